// sparse_ffn_v1.cu — ladder step 1 of twell/kernels/light_rows.cu: the sparse up/down
// projection of the light rows, one warp per token, reading TwELL tile by tile (no entry
// list, x and y in registers). Kept runnable as the simple baseline (bench/ladder/run.py).
//
// Gated (TWELL_GATED=1):  y[m] = sum over stored (n, g) of row m:  g * (x[m]·w_up[n]) * w_down_t[n]
// Non-gated (TWELL_GATED=0): y[m] = sum over stored (n, h) of row m: h * w_down_t[n]
// The hidden activation is never materialised: each active unit's up row and down row are
// gathered (16-byte loads, L2-resident weights), the up dot product is reduced across the
// warp by an xor butterfly (every lane ends with the same bits), and the down row is
// accumulated in fp32 registers. bf16 out, round to nearest even.
//
// Layouts (row-major, bf16 as uint16 bits): x [M, K]; packed [M, N/TILE*SLOTS] uint32;
// heavy [M] uint8 (rows with heavy[m] != 0 are skipped: the dense path writes them);
// w_up [N, K]; w_down_t [N, K] (w_down transposed, prepared once); y [M, K].
// Lane l owns the 8 columns [c*256 + 8l, c*256 + 8l + 8) of chunk c (NCH chunks).
// Limits: K = TWELL_KDIM, a multiple of 8 and at most 4096; 16-byte aligned rows.
// Entries with a column >= N or counts above SLOTS-1 are ignored (memory safety only:
// validated input never has them). Deterministic: fixed summation order, no atomics.
//
// Compile-time parameters: TWELL_KDIM, TWELL_TILE, TWELL_SLOTS, TWELL_GATED.

#define NCH ((TWELL_KDIM + 255) / 256)
#define FULL_CHUNKS (TWELL_KDIM % 256 == 0)
#define WPL ((TWELL_SLOTS + 31) / 32)  // packed words per lane per tile
#define SPARSE_WARPS 4
#define GROUP 8                         // chunks loaded together (bounds registers)
#define X_IN_SMEM (NCH > GROUP)
#define SPARSE_MIN_BLOCKS (NCH > GROUP ? 1 : 2)  // 2: <= 255 registers, no spills at K=2048

__device__ __forceinline__ bool chunk_valid(int c, int lane) {
  return FULL_CHUNKS || (c * 256 + lane * 8 < TWELL_KDIM);
}

extern "C" __global__ void __launch_bounds__(SPARSE_WARPS * 32, SPARSE_MIN_BLOCKS)
twell_sparse_rows(const uint16_t* __restrict__ x,         // [M, K] (gated only)
                  const uint32_t* __restrict__ packed,    // [M, N/TILE*SLOTS]
                  const uint8_t* __restrict__ heavy,      // [M]
                  const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                  const uint16_t* __restrict__ w_down_t,  // [N, K]
                  uint16_t* __restrict__ y,               // [M, K] out
                  int M, int N) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long row = (long long)blockIdx.x * SPARSE_WARPS + warp;
  if (row >= M || heavy[row]) return;
  const int tiles = N / TWELL_TILE;
  const uint32_t* words = packed + row * (long long)tiles * TWELL_SLOTS;

#if TWELL_GATED
#if X_IN_SMEM
  __shared__ uint4 xs[SPARSE_WARPS][NCH * 32];
#pragma unroll
  for (int c = 0; c < NCH; ++c)
    xs[warp][c * 32 + lane] = chunk_valid(c, lane)
        ? __ldcs(reinterpret_cast<const uint4*>(x + row * TWELL_KDIM) + c * 32 + lane)
        : make_uint4(0, 0, 0, 0);
  __syncwarp();
#else
  uint4 xr[NCH];
#pragma unroll
  for (int c = 0; c < NCH; ++c)
    xr[c] = chunk_valid(c, lane)
        ? __ldcs(reinterpret_cast<const uint4*>(x + row * TWELL_KDIM) + c * 32 + lane)
        : make_uint4(0, 0, 0, 0);
#endif
#endif

  float acc[NCH][8];
#pragma unroll
  for (int c = 0; c < NCH; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[c][e] = 0.f;

  uint32_t next[WPL];
#pragma unroll
  for (int q = 0; q < WPL; ++q) {
    const int idx = q * 32 + lane;
    next[q] = idx < TWELL_SLOTS ? __ldcs(words + idx) : 0u;
  }
  for (int j = 0; j < tiles; ++j) {
    uint32_t cur[WPL];
#pragma unroll
    for (int q = 0; q < WPL; ++q) cur[q] = next[q];
    if (j + 1 < tiles) {
#pragma unroll
      for (int q = 0; q < WPL; ++q) {
        const int idx = q * 32 + lane;
        next[q] = idx < TWELL_SLOTS ? __ldcs(words + (j + 1) * TWELL_SLOTS + idx) : 0u;
      }
    }
    const int count = min((int)__shfl_sync(0xffffffffu, cur[0], 0), TWELL_SLOTS - 1);
    for (int e = 1; e <= count; ++e) {
      uint32_t entry = 0;
#pragma unroll
      for (int q = 0; q < WPL; ++q) {
        const uint32_t t = __shfl_sync(0xffffffffu, cur[q], e & 31);
        if (q == (e >> 5)) entry = t;
      }
      const int n = entry & 0xffffu;
      if (n >= N) continue;  // warp-uniform
      const float value = twell_hi_bf16(entry);
      const uint4* down = reinterpret_cast<const uint4*>(w_down_t + (long long)n * TWELL_KDIM);
#if TWELL_GATED
      const uint4* up = reinterpret_cast<const uint4*>(w_up + (long long)n * TWELL_KDIM);
#if !X_IN_SMEM
      uint4 a[NCH], b[NCH];
#pragma unroll
      for (int c = 0; c < NCH; ++c) {
        if (chunk_valid(c, lane)) {
          a[c] = __ldg(up + c * 32 + lane);
          b[c] = __ldg(down + c * 32 + lane);
        } else {
          a[c] = make_uint4(0, 0, 0, 0);
          b[c] = a[c];
        }
      }
      float part = 0.f;
#pragma unroll
      for (int c = 0; c < NCH; ++c) part += twell_dot8(xr[c], a[c], 0.f);
#else
      float part = 0.f;
#pragma unroll
      for (int c0 = 0; c0 < NCH; c0 += GROUP) {
        uint4 a[GROUP];
#pragma unroll
        for (int c = 0; c < GROUP; ++c)
          a[c] = (c0 + c < NCH && chunk_valid(c0 + c, lane)) ? __ldg(up + (c0 + c) * 32 + lane)
                                                              : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int c = 0; c < GROUP; ++c)
          if (c0 + c < NCH) part += twell_dot8(xs[warp][(c0 + c) * 32 + lane], a[c], 0.f);
      }
#endif
#pragma unroll
      for (int d = 16; d >= 1; d >>= 1) part += __shfl_xor_sync(0xffffffffu, part, d);
      const float h = value * part;
#else
      const float h = value;
#endif
#if TWELL_GATED && !X_IN_SMEM
#pragma unroll
      for (int c = 0; c < NCH; ++c) twell_axpy8(h, b[c], acc[c]);
#else
#pragma unroll
      for (int c0 = 0; c0 < NCH; c0 += GROUP) {
        uint4 b[GROUP];
#pragma unroll
        for (int c = 0; c < GROUP; ++c)
          b[c] = (c0 + c < NCH && chunk_valid(c0 + c, lane)) ? __ldg(down + (c0 + c) * 32 + lane)
                                                              : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int c = 0; c < GROUP; ++c)
          if (c0 + c < NCH) twell_axpy8(h, b[c], acc[c0 + c]);
      }
#endif
    }
  }

  uint4* out = reinterpret_cast<uint4*>(y + row * TWELL_KDIM);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    if (chunk_valid(c, lane)) {
      uint4 v;
      v.x = twell_pack_bf16x2(acc[c][0], acc[c][1]);
      v.y = twell_pack_bf16x2(acc[c][2], acc[c][3]);
      v.z = twell_pack_bf16x2(acc[c][4], acc[c][5]);
      v.w = twell_pack_bf16x2(acc[c][6], acc[c][7]);
      __stcs(out + c * 32 + lane, v);
    }
  }
}
