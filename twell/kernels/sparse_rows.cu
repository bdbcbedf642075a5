// sparse_rows.cu — light rows of the FFN block, one warp per token, entry list in shared
// memory, optionally several units' rows in flight at once (version 2 of sparse_ffn.cu).
//
//   gated:     y[m] = sum over active (n, g):  g * (x[m]·w_up[n]) * w_down_t[n]
//   non-gated: y[m] = sum over active (n, h):  h * w_down_t[n]
//
// Two kernels share the second phase (the gather):
// - twell_twell_rows reads the active units from a TwELL buffer (gated_down, down).
// - twell_fused_rows reads them straight from the dense bf16 gate pre-activation (ffn):
//   relu, and the heavy decision of pack.cu (a tile over SLOTS-1 nonzeros, a non-finite
//   value, or more than max_row_nnz (<= LIST_CAP) active units in the row: beyond that the
//   gather costs more than the row's dense math on tensor cores), without writing TwELL. Heavy
//   rows get heavy[m] = 1 and are left to dense_rows.cu; light rows get heavy[m] = 0.
// Phase 1 writes the row's entries (column | bf16 << 16, ascending columns) to a
// per-warp list in shared memory. Phase 2 walks the list UNITS entries at a time: all
// their up and down rows are loaded (16-byte loads) before any arithmetic, the up dot
// products are reduced by xor butterflies (every lane gets the same bits), and the
// down rows are accumulated in fp32 registers in list order: deterministic, and the same
// bits whatever UNITS is. x is kept in shared memory (read once per UNITS units).
//
// Layouts (row-major, bf16 as uint16 bits): x [M, K]; pre [M, N]; packed
// [M, N/TILE*SLOTS]; heavy [M] uint8; w_up [N, K]; w_down_t [N, K]; y [M, K].
// Limits: K = TWELL_KDIM, a multiple of 8, at most 4096; N % TILE == 0; 16-byte aligned
// rows. Entries whose column is >= N (invalid input) contribute nothing.
//
// Compile-time parameters: TWELL_KDIM, TWELL_TILE, TWELL_SLOTS, TWELL_GATED.

#include <cuda_bf16.h>
// NVRTC has no <stdint.h>; these match its definitions (redeclaring is allowed).
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;

#define NCH ((TWELL_KDIM + 255) / 256)
#define FULL_CHUNKS (TWELL_KDIM % 256 == 0)
#define EPL (TWELL_TILE / 32)
#define WPL ((TWELL_SLOTS + 31) / 32)
// One warp per block: a block retires as soon as its token is done, so tokens with many
// active units do not hold finished warps' registers (load balance on skewed workloads).
#define ROW_WARPS 1
#define LIST_CAP 1024
#ifdef TWELL_UNITS  // optional override: units whose rows are in flight together
#define UNITS TWELL_UNITS
#else  // measured on an H100 (docs/kernel_notes.md): more units in flight cost occupancy
#define UNITS 1
#endif
#ifndef TWELL_MIN_BLOCKS  // register cap = 65536 / (32 * blocks), at most 255
#define TWELL_MIN_BLOCKS 8
#endif

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float s) {
  s = fmaf(lo_bf16(a.x), lo_bf16(b.x), s);
  s = fmaf(hi_bf16(a.x), hi_bf16(b.x), s);
  s = fmaf(lo_bf16(a.y), lo_bf16(b.y), s);
  s = fmaf(hi_bf16(a.y), hi_bf16(b.y), s);
  s = fmaf(lo_bf16(a.z), lo_bf16(b.z), s);
  s = fmaf(hi_bf16(a.z), hi_bf16(b.z), s);
  s = fmaf(lo_bf16(a.w), lo_bf16(b.w), s);
  s = fmaf(hi_bf16(a.w), hi_bf16(b.w), s);
  return s;
}

__device__ __forceinline__ void axpy8(float h, uint4 b, float* acc) {
  acc[0] = fmaf(h, lo_bf16(b.x), acc[0]);
  acc[1] = fmaf(h, hi_bf16(b.x), acc[1]);
  acc[2] = fmaf(h, lo_bf16(b.y), acc[2]);
  acc[3] = fmaf(h, hi_bf16(b.y), acc[3]);
  acc[4] = fmaf(h, lo_bf16(b.z), acc[4]);
  acc[5] = fmaf(h, hi_bf16(b.z), acc[5]);
  acc[6] = fmaf(h, lo_bf16(b.w), acc[6]);
  acc[7] = fmaf(h, hi_bf16(b.w), acc[7]);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // .x = a (low half)
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ bool chunk_valid(int c, int lane) {
  return FULL_CHUNKS || (c * 256 + lane * 8 < TWELL_KDIM);
}

// relu(h) != 0 for a bf16 bit pattern: positive nonzero, or NaN of either sign.
__device__ __forceinline__ bool relu_nonzero(uint32_t b) {
  const uint32_t mag = b & 0x7fffu;
  return mag > 0x7f80u || (mag != 0u && !(b & 0x8000u));
}

#define SCAN_BATCH 8  // tiles whose loads are in flight together in phase 1

// One lane's EPL bf16 of a tile, as raw 32-bit words (EPL == 1: one 16-bit value).
__device__ __forceinline__ void load_tile(const uint16_t* p, uint32_t* raw) {
#if EPL == 8
  const uint4 q = __ldcs(reinterpret_cast<const uint4*>(p));
  raw[0] = q.x; raw[1] = q.y; raw[2] = q.z; raw[3] = q.w;
#elif EPL == 4
  const uint2 q = __ldcs(reinterpret_cast<const uint2*>(p));
  raw[0] = q.x; raw[1] = q.y;
#elif EPL == 2
  raw[0] = __ldcs(reinterpret_cast<const unsigned int*>(p));
#else
  raw[0] = __ldcs(reinterpret_cast<const unsigned short*>(p));
#endif
}

__device__ __forceinline__ void unpack_tile(const uint32_t* raw, uint16_t (&v)[EPL]) {
#if EPL == 1
  v[0] = (uint16_t)raw[0];
#else
#pragma unroll
  for (int i = 0; i < EPL / 2; ++i) {
    v[2 * i] = raw[i] & 0xffff;
    v[2 * i + 1] = raw[i] >> 16;
  }
#endif
}

struct Shared {
  uint32_t list[ROW_WARPS][LIST_CAP];
#if TWELL_GATED
  uint4 x[ROW_WARPS][NCH * 32];
#endif
};

// Phase 2 for U list entries starting at list[e]: gather, multiply, accumulate.
template <int U>
__device__ __forceinline__ void gather_units(const uint32_t* list, int e, int lane, int N,
                                             const uint4* xs, const uint16_t* __restrict__ w_up,
                                             const uint16_t* __restrict__ w_down_t,
                                             float (&acc)[NCH][8]) {
  float value[U];
  const uint4* down[U];
#if TWELL_GATED
  const uint4* up[U];
#endif
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t entry = list[e + u];
    int n = entry & 0xffffu;
    value[u] = hi_bf16(entry);
    if (n >= N) {  // invalid input: contribute nothing, read a valid row
      n = 0;
      value[u] = 0.f;
    }
    down[u] = reinterpret_cast<const uint4*>(w_down_t + (long long)n * TWELL_KDIM);
#if TWELL_GATED
    up[u] = reinterpret_cast<const uint4*>(w_up + (long long)n * TWELL_KDIM);
#endif
  }
  uint4 b[U][NCH];
#if TWELL_GATED
  uint4 a[U][NCH];
#endif
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = chunk_valid(c, lane);
#if TWELL_GATED
      a[u][c] = ok ? __ldg(up[u] + c * 32 + lane) : make_uint4(0, 0, 0, 0);
#endif
      b[u][c] = ok ? __ldg(down[u] + c * 32 + lane) : make_uint4(0, 0, 0, 0);
    }
  }
  float h[U];
#if TWELL_GATED
  float part[U];
#pragma unroll
  for (int u = 0; u < U; ++u) part[u] = 0.f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const uint4 xv = xs[c * 32 + lane];
#pragma unroll
    for (int u = 0; u < U; ++u) part[u] = dot8(xv, a[u][c], part[u]);
  }
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1)
#pragma unroll
    for (int u = 0; u < U; ++u) part[u] += __shfl_xor_sync(0xffffffffu, part[u], d);
#pragma unroll
  for (int u = 0; u < U; ++u) h[u] = value[u] * part[u];
#else
#pragma unroll
  for (int u = 0; u < U; ++u) h[u] = value[u];
#endif
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int c = 0; c < NCH; ++c) axpy8(h[u], b[u][c], acc[c]);
}

__device__ __forceinline__ void gather_list(const uint32_t* list, int count, int lane, int N,
                                            const uint4* xs, const uint16_t* __restrict__ w_up,
                                            const uint16_t* __restrict__ w_down_t,
                                            float (&acc)[NCH][8]) {
  int e = 0;
  for (; e + UNITS <= count; e += UNITS)
    gather_units<UNITS>(list, e, lane, N, xs, w_up, w_down_t, acc);
  for (; e < count; ++e) gather_units<1>(list, e, lane, N, xs, w_up, w_down_t, acc);
}

__device__ __forceinline__ void store_row(uint16_t* __restrict__ y, long long row, int lane,
                                          const float (&acc)[NCH][8]) {
  uint4* out = reinterpret_cast<uint4*>(y + row * TWELL_KDIM);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    if (chunk_valid(c, lane)) {
      uint4 v;
      v.x = pack_bf16x2(acc[c][0], acc[c][1]);
      v.y = pack_bf16x2(acc[c][2], acc[c][3]);
      v.z = pack_bf16x2(acc[c][4], acc[c][5]);
      v.w = pack_bf16x2(acc[c][6], acc[c][7]);
      __stcs(out + c * 32 + lane, v);
    }
  }
}

__device__ __forceinline__ const uint4* load_x(Shared& sm, const uint16_t* __restrict__ x,
                                               long long row, int warp, int lane) {
#if TWELL_GATED
  const uint4* src = reinterpret_cast<const uint4*>(x + row * TWELL_KDIM);
#pragma unroll
  for (int c = 0; c < NCH; ++c)
    sm.x[warp][c * 32 + lane] = chunk_valid(c, lane) ? __ldcs(src + c * 32 + lane)
                                                     : make_uint4(0, 0, 0, 0);
  return sm.x[warp];
#else
  return nullptr;
#endif
}

#define ZERO_ACC(acc)                                   \
  float acc[NCH][8];                                    \
  _Pragma("unroll") for (int c = 0; c < NCH; ++c)       \
      _Pragma("unroll") for (int i = 0; i < 8; ++i) acc[c][i] = 0.f;

// Phase 1 of the fused kernels (one warp): scan the pre-activation row ``src`` (SCAN_BATCH
// tiles' loads in flight), append its entries to ``list`` in ascending columns, and
// return whether the row is heavy; ``total`` gets the number of entries.
__device__ __forceinline__ bool scan_row(const uint16_t* __restrict__ src, int tiles,
                                         int lane, uint32_t* list, int max_row_nnz,
                                         int& total_out) {
  int total = 0;
  bool is_heavy = false;
  for (int j0 = 0; j0 < tiles && !is_heavy; j0 += SCAN_BATCH) {
    uint32_t raw[SCAN_BATCH][EPL / 2 > 0 ? EPL / 2 : 1];
#pragma unroll
    for (int b = 0; b < SCAN_BATCH; ++b) {
      if (j0 + b < tiles) load_tile(src + (j0 + b) * TWELL_TILE + lane * EPL, raw[b]);
    }
#pragma unroll
    for (int b = 0; b < SCAN_BATCH; ++b) {
      if (j0 + b >= tiles || is_heavy) break;
      uint16_t v[EPL];
      unpack_tile(raw[b], v);
      uint32_t mask = 0;
      bool bad = false;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        mask |= (relu_nonzero(v[i]) ? 1u : 0u) << i;
        bad |= (v[i] & 0x7f80u) == 0x7f80u;
      }
      const int mine = __popc(mask);
      int incl = mine;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += t;
      }
      const int count = __shfl_sync(0xffffffffu, incl, 31);
      is_heavy = __any_sync(0xffffffffu, bad) || count > TWELL_SLOTS - 1 ||
                 total + count > max_row_nnz;
      if (!is_heavy) {
        int slot = total + incl - mine;
        const uint32_t col0 = (uint32_t)((j0 + b) * TWELL_TILE + lane * EPL);
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if (mask & (1u << i)) list[slot++] = (col0 + i) | ((uint32_t)v[i] << 16);
        total += count;
      }
    }
  }
  total_out = total;
  return is_heavy;
}

extern "C" __global__ void __launch_bounds__(ROW_WARPS * 32, TWELL_MIN_BLOCKS)
twell_fused_rows(const uint16_t* __restrict__ x,         // [M, K] (gated only)
                 const uint16_t* __restrict__ pre,       // [M, N] gate pre-activation
                 uint8_t* __restrict__ heavy,            // [M] out
                 const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                 const uint16_t* __restrict__ w_down_t,  // [N, K]
                 uint16_t* __restrict__ y,               // [M, K] out (light rows)
                 int M, int N, int max_row_nnz) {
  __shared__ Shared sm;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row = (long long)blockIdx.x * ROW_WARPS + warp;
  if (row >= M) return;
  const int tiles = N / TWELL_TILE;
  const uint16_t* src = pre + row * (long long)N;
  uint32_t* list = sm.list[warp];

  // Phase 1: scan the row, build the entry list, decide heavy.
  int total = 0;
  const bool is_heavy = scan_row(src, tiles, lane, list, min(max_row_nnz, LIST_CAP), total);
  if (lane == 0) heavy[row] = is_heavy ? 1 : 0;
  if (is_heavy) return;
  __syncwarp();

  // Phase 2: gather.
  const uint4* xs = load_x(sm, x, row, warp, lane);
  __syncwarp();
  ZERO_ACC(acc)
  gather_list(list, total, lane, N, xs, w_up, w_down_t, acc);
  store_row(y, row, lane, acc);
}


// Small M (decode): one block of WIDE_WARPS warps per token. Warp 0 scans the row; the
// warps share the entry list (entry e goes to warp e % WIDE_WARPS) and their fp32 partial
// rows are added in warp order through shared memory: deterministic.
#define WIDE_WARPS 8

struct WideShared {
  uint32_t list[LIST_CAP];
  float partial[NCH * 256];
#if TWELL_GATED
  uint4 x[NCH * 32];
#endif
  int total;
  int heavy;
};

extern "C" __global__ void __launch_bounds__(WIDE_WARPS * 32)
twell_fused_rows_wide(const uint16_t* __restrict__ x,         // [M, K] (gated only)
                      const uint16_t* __restrict__ pre,       // [M, N] gate pre-activation
                      uint8_t* __restrict__ heavy,            // [M] out
                      const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                      const uint16_t* __restrict__ w_down_t,  // [N, K]
                      uint16_t* __restrict__ y,               // [M, K] out (light rows)
                      int M, int N, int max_row_nnz) {
  __shared__ WideShared sm;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row = blockIdx.x;
  if (row >= M) return;
  if (warp == 0) {
    int total = 0;
    const bool is_heavy = scan_row(pre + row * (long long)N, N / TWELL_TILE, lane, sm.list,
                                   min(max_row_nnz, LIST_CAP), total);
    if (lane == 0) {
      sm.total = total;
      sm.heavy = is_heavy ? 1 : 0;
      heavy[row] = is_heavy ? 1 : 0;
    }
  }
#if TWELL_GATED
  const uint4* src = reinterpret_cast<const uint4*>(x + row * TWELL_KDIM);
  for (int i = threadIdx.x; i < NCH * 32; i += WIDE_WARPS * 32)
    sm.x[i] = chunk_valid(i / 32, i % 32) ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
  const uint4* xs = sm.x;
#else
  const uint4* xs = nullptr;
#endif
  __syncthreads();
  if (sm.heavy) return;
  const int total = sm.total;
  ZERO_ACC(acc)
  for (int e = warp; e < total; e += WIDE_WARPS)
    gather_units<1>(sm.list, e, lane, N, xs, w_up, w_down_t, acc);
  // Fixed-order reduction: partial = acc_0; partial += acc_1; ...; y = partial + acc_last.
  for (int w = 0; w < WIDE_WARPS - 1; ++w) {
    if (warp == w) {
#pragma unroll
      for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float& slot = sm.partial[c * 256 + lane * 8 + i];
          slot = (w == 0) ? acc[c][i] : slot + acc[c][i];
        }
    }
    __syncthreads();
  }
  if (warp == WIDE_WARPS - 1) {
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[c][i] = sm.partial[c * 256 + lane * 8 + i] + acc[c][i];
    store_row(y, row, lane, acc);
  }
}

extern "C" __global__ void __launch_bounds__(ROW_WARPS * 32, TWELL_MIN_BLOCKS)
twell_twell_rows(const uint16_t* __restrict__ x,         // [M, K] (gated only)
                 const uint32_t* __restrict__ packed,    // [M, N/TILE*SLOTS]
                 uint8_t* __restrict__ heavy,            // [M] rows to skip (in/out)
                 const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                 const uint16_t* __restrict__ w_down_t,  // [N, K]
                 uint16_t* __restrict__ y,               // [M, K] out (light rows)
                 int M, int N, int max_row_nnz) {
  __shared__ Shared sm;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row = (long long)blockIdx.x * ROW_WARPS + warp;
  if (row >= M || heavy[row]) return;
  const int tiles = N / TWELL_TILE;
  const uint32_t* words = packed + row * (long long)tiles * TWELL_SLOTS;
  if (max_row_nnz < tiles * (TWELL_SLOTS - 1)) {
    // Rows with more active units than max_row_nnz go to the dense path (heavy = 1).
    int nnz = 0;
    for (int j = lane; j < tiles; j += 32) nnz += (int)__ldg(words + j * TWELL_SLOTS);
    nnz = __reduce_add_sync(0xffffffffu, nnz);
    if (nnz > max_row_nnz) {
      if (lane == 0) heavy[row] = 1;
      return;
    }
  }
  uint32_t* list = sm.list[warp];
  const uint4* xs = load_x(sm, x, row, warp, lane);
  ZERO_ACC(acc)

  // Phase 1: the count words of 32 tiles at a time (one per lane), then the entries.
  int total = 0;
  for (int j0 = 0; j0 < tiles; j0 += 32) {
    const int mine = j0 + lane < tiles
        ? min((int)__ldcs(words + (j0 + lane) * TWELL_SLOTS), TWELL_SLOTS - 1) : 0;
    const int batch = min(32, tiles - j0);
    for (int b = 0; b < batch; ++b) {
      const int count = __shfl_sync(0xffffffffu, mine, b);
      if (total + count > LIST_CAP) {  // list full: gather what it holds first
        __syncwarp();
        gather_list(list, total, lane, N, xs, w_up, w_down_t, acc);
        __syncwarp();
        total = 0;
      }
      const uint32_t* tile_words = words + (j0 + b) * TWELL_SLOTS;
#pragma unroll
      for (int q = 0; q < WPL; ++q) {
        const int idx = q * 32 + lane;
        if (idx >= 1 && idx <= count) list[total + idx - 1] = __ldcs(tile_words + idx);
      }
      total += count;
    }
  }
  __syncwarp();
  gather_list(list, total, lane, N, xs, w_up, w_down_t, acc);
  store_row(y, row, lane, acc);
}
