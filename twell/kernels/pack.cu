// pack.cu — relu + TwELL packing of a dense bf16 gate pre-activation, and heavy-row flags
// (the "pack" route; gate_gemm.cu does the same inside the GEMM's epilogue).
//
// Layouts (row-major): pre [M, N] bf16; packed [M, (N/TILE)*SLOTS] uint32 (docs/format.md:
// word 0 = true count, words 1..c = column | bf16 << 16, ascending columns, unused words
// written as 0 so the output bits are deterministic); heavy [M] uint8.
// Tiling: one warp per row, looping over the row's tiles; lane l owns columns
// [l*EPL, (l+1)*EPL) of the tile (EPL = TILE/32 elements, one vector load).
// A row is heavy if a tile overflows or any pre-activation is non-finite (the routing
// rule of common.cuh; relu decided on bits, NaN counts as a nonzero).
// Limits: N % TILE == 0, N <= 65536, TILE in {32..256}, SLOTS in {2..TILE}.
//
// Compile-time parameters: TWELL_TILE, TWELL_SLOTS; constant TWELL_PACK_WARPS (pack.py).

#define EPL (TWELL_TILE / 32)
#define PACK_WARPS TWELL_PACK_WARPS

__device__ __forceinline__ void load_lane(const uint16_t* p, uint16_t (&v)[EPL]) {
#if EPL == 8
  uint4 q = __ldcs(reinterpret_cast<const uint4*>(p));
  uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) { v[2 * i] = w[i] & 0xffff; v[2 * i + 1] = w[i] >> 16; }
#elif EPL == 4
  uint2 q = __ldcs(reinterpret_cast<const uint2*>(p));
  v[0] = q.x & 0xffff; v[1] = q.x >> 16; v[2] = q.y & 0xffff; v[3] = q.y >> 16;
#elif EPL == 2
  uint32_t q = __ldcs(reinterpret_cast<const unsigned int*>(p));
  v[0] = q & 0xffff; v[1] = q >> 16;
#else
  v[0] = __ldcs(reinterpret_cast<const unsigned short*>(p));
#endif
}

extern "C" __global__ void __launch_bounds__(PACK_WARPS * 32)
twell_pack_rows(const uint16_t* __restrict__ pre,   // [M, N] bf16 bits, gate pre-activation
                uint32_t* __restrict__ packed,      // [M, N/TILE*SLOTS] out
                uint8_t* __restrict__ heavy,        // [M] out: 1 = route to the dense part
                int M, int N) {
  __shared__ uint32_t stage[PACK_WARPS][TWELL_SLOTS];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long row = (long long)blockIdx.x * PACK_WARPS + warp;
  if (row >= M) return;
  const int tiles = N / TWELL_TILE;
  const uint16_t* src = pre + row * (long long)N;
  uint32_t* dst = packed + row * (long long)tiles * TWELL_SLOTS;
  bool is_heavy = false;

  uint16_t next[EPL];
  load_lane(src + lane * EPL, next);
  for (int j = 0; j < tiles; ++j) {
    uint16_t v[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) v[e] = next[e];
    if (j + 1 < tiles) load_lane(src + (j + 1) * TWELL_TILE + lane * EPL, next);

    uint32_t mask = 0;
    bool bad = false;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      mask |= (twell_relu_keeps(v[e]) ? 1u : 0u) << e;
      bad |= twell_non_finite(v[e]);
    }
    const int mine = __popc(mask);
    int incl = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += t;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    is_heavy |= twell_tile_overflows(total, TWELL_SLOTS) || __any_sync(0xffffffffu, bad);

    // Stage the tile's words in shared memory, then store them coalesced.
    for (int w = lane; w < TWELL_SLOTS; w += 32) stage[warp][w] = 0u;
    __syncwarp();
    if (!twell_tile_overflows(total, TWELL_SLOTS)) {
      int slot = 1 + incl - mine;
      const uint32_t col0 = (uint32_t)(j * TWELL_TILE + lane * EPL);
#pragma unroll
      for (int e = 0; e < EPL; ++e)
        if (mask & (1u << e)) stage[warp][slot++] = (col0 + e) | ((uint32_t)v[e] << 16);
    }
    if (lane == 0) stage[warp][0] = (uint32_t)total;
    __syncwarp();
    for (int w = lane; w < TWELL_SLOTS; w += 32) __stcs(dst + j * TWELL_SLOTS + w, stage[warp][w]);
    __syncwarp();
  }
  if (lane == 0) heavy[row] = is_heavy ? 1 : 0;
}
