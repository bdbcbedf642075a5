// pack.cu — relu + TwELL packing of a dense bf16 gate pre-activation, heavy-row flags,
// and the deterministic compaction of heavy row ids.
//
// Layouts (row-major): pre [M, N] bf16; packed [M, (N/TILE)*SLOTS] uint32 (SPEC.md §2:
// word 0 = true count, words 1..c = column | bf16 << 16, ascending columns, unused words
// written as 0 so the output bits are deterministic); heavy [M] uint8.
// Tiling: one warp per row, looping over the row's tiles; lane l owns columns
// [l*EPL, (l+1)*EPL) of the tile (EPL = TILE/32 elements, one vector load).
// A row is heavy if a tile holds more than SLOTS-1 nonzeros or any pre-activation is
// non-finite. relu is decided on bits: positive nonzero (denormals included), and NaN of
// either sign counts as a nonzero (relu propagates NaN, as dense math does).
// Limits: N % TILE == 0, N <= 65536, TILE in {32..256}, SLOTS in {2..TILE}.
//
// Compile-time parameters: TWELL_TILE, TWELL_SLOTS.

#include <cuda_bf16.h>
// NVRTC has no <stdint.h>; these match its definitions (redeclaring is allowed).
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;

#define EPL (TWELL_TILE / 32)
#define PACK_WARPS 8

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

// relu(h) != 0 for a bf16 bit pattern: positive nonzero, or NaN of either sign.
__device__ __forceinline__ bool relu_nonzero(uint32_t b) {
  const uint32_t mag = b & 0x7fffu;
  return mag > 0x7f80u || (mag != 0u && !(b & 0x8000u));
}

__device__ __forceinline__ bool non_finite(uint32_t b) { return (b & 0x7f80u) == 0x7f80u; }

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
      mask |= (relu_nonzero(v[e]) ? 1u : 0u) << e;
      bad |= non_finite(v[e]);
    }
    const int mine = __popc(mask);
    int incl = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += t;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    is_heavy |= (total > TWELL_SLOTS - 1) || __any_sync(0xffffffffu, bad);

    // Stage the tile's words in shared memory, then store them coalesced.
    for (int w = lane; w < TWELL_SLOTS; w += 32) stage[warp][w] = 0u;
    __syncwarp();
    if (total <= TWELL_SLOTS - 1) {
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

// Heavy row ids in ascending order, by a block-wide prefix sum (no atomics, so the
// order never depends on scheduling). One block of 1024 threads; thread t scans the
// contiguous chunk [t*chunk, (t+1)*chunk). Writes ids[0..R) and count[0] = R.
extern "C" __global__ void __launch_bounds__(1024)
twell_compact_rows(const uint8_t* __restrict__ heavy, int M, int* __restrict__ ids,
                   int* __restrict__ count) {
  __shared__ int sums[1024];
  const int t = threadIdx.x;
  const int chunk = (M + 1023) / 1024;
  const int begin = min(M, t * chunk), end = min(M, begin + chunk);
  int mine = 0;
  for (int i = begin; i < end; ++i) mine += heavy[i] ? 1 : 0;
  sums[t] = mine;
  __syncthreads();
  for (int d = 1; d < 1024; d <<= 1) {  // Hillis-Steele inclusive scan
    const int add = t >= d ? sums[t - d] : 0;
    __syncthreads();
    sums[t] += add;
    __syncthreads();
  }
  int out = sums[t] - mine;
  for (int i = begin; i < end; ++i)
    if (heavy[i]) ids[out++] = i;
  if (t == 1023) count[0] = sums[1023];
}

// heavy[ids[i]] = 1 for i < R (marks the dense rows of a Hybrid given by a caller).
extern "C" __global__ void twell_mark_rows(const int* __restrict__ ids, int R,
                                           uint8_t* __restrict__ heavy) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < R) heavy[ids[i]] = 1;
}

// dense[i, :] = relu(pre[ids[i], :]) for i < R (the dense part of a Hybrid; NaN kept).
extern "C" __global__ void twell_gather_relu_rows(const uint16_t* __restrict__ pre,
                                                  const int* __restrict__ ids, int R, int N,
                                                  uint16_t* __restrict__ dense) {
  const long long total = (long long)R * N;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const long long i = k / N, n = k - i * N;
    const uint32_t b = pre[(long long)ids[i] * N + n];
    dense[k] = relu_nonzero(b) ? (uint16_t)b : (uint16_t)0;
  }
}

// ---- heavy rows through fixed-size GEMMs (SparseFFN's dense_capacity) ----------------
// dst[i] = src[ids[i]] for i < min(count, C), zeros for count <= i < C;
// rest[0] = max(count - C, 0) (the rows left to dense_rows.cu). Rows are `width` bf16
// wide (width % 8 == 0), moved 16 bytes at a time.
extern "C" __global__ void twell_gather_rows(const uint16_t* __restrict__ src, int width,
                                             const int* __restrict__ ids,
                                             const int* __restrict__ count, int C,
                                             uint16_t* __restrict__ dst, int* __restrict__ rest) {
  const int n = count[0];
  if (blockIdx.x == 0 && threadIdx.x == 0) rest[0] = max(n - C, 0);
  const int per_row = width / 8;
  const long long total = (long long)C * per_row;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(k / per_row), c = (int)(k % per_row);
    const uint4 v = i < n ? reinterpret_cast<const uint4*>(src + (long long)ids[i] * width)[c]
                          : make_uint4(0, 0, 0, 0);
    reinterpret_cast<uint4*>(dst + (long long)i * width)[c] = v;
  }
}

// h = bf16(relu(g) * u) elementwise over n bf16 (n % 2 == 0), or relu(g) when u is null;
// relu keeps NaN.
extern "C" __global__ void twell_relu_mul(const uint16_t* __restrict__ g,
                                          const uint16_t* __restrict__ u,
                                          uint16_t* __restrict__ h, long long n) {
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; 2 * k < n;
       k += (long long)gridDim.x * blockDim.x) {
    const uint32_t gw = reinterpret_cast<const uint32_t*>(g)[k];
    const uint32_t uw = u == nullptr ? 0x3f803f80u : reinterpret_cast<const uint32_t*>(u)[k];
    float r[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t gb = (gw >> (16 * s)) & 0xffffu;
      const float gv = __uint_as_float(gb << 16);
      const float relu_g = ((gb & 0x7fffu) > 0x7f80u || !(gb & 0x8000u)) ? gv : 0.f;
      r[s] = relu_g * __uint_as_float(((uw >> (16 * s)) & 0xffffu) << 16);
    }
    __nv_bfloat162 v = __floats2bfloat162_rn(r[0], r[1]);
    reinterpret_cast<uint32_t*>(h)[k] = *reinterpret_cast<uint32_t*>(&v);
  }
}

// dst[ids[i]] = src[i] for i < min(count, C); rows `width` bf16 wide (width % 8 == 0).
extern "C" __global__ void twell_scatter_rows(const uint16_t* __restrict__ src, int width,
                                              const int* __restrict__ ids,
                                              const int* __restrict__ count, int C,
                                              uint16_t* __restrict__ dst) {
  const int n = min(count[0], C);
  const int per_row = width / 8;
  const long long total = (long long)n * per_row;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(k / per_row), c = (int)(k % per_row);
    reinterpret_cast<uint4*>(dst + (long long)ids[i] * width)[c] =
        reinterpret_cast<const uint4*>(src + (long long)i * width)[c];
  }
}
