// backward.cu — the backward pass of the FFN block (gated or not), on the state the
// forward kept (twell/kernels/backward.py: Activations).
//
// Gradients of L = <dy, y> + l1s * sum |h| (l1s = l1_coeff / (M*N) or / M; the coefficient
// comes as a host number or as a device scalar, read by the kernels: no host sync):
//   gated:     a = x wgᵀ, g = relu(a), u = x wuᵀ, h = g u, y = h wdᵀ
//              dh = dy wd + l1s sign(h),  da = dh u [a > 0],  du = dh g
//              dx = da wg + du wu,  dWg = daᵀ x,  dWu = duᵀ x,  dWd = dyᵀ h
//   non-gated: a = x wuᵀ, h = relu(a); da = dh [a > 0]; dx = da wu; dWu = daᵀ x; dWd = dyᵀ h
//
// ------------------------------------------------------------------ the pipeline
//  1 light      twell_bw_light (twell_bw_light_saved when the forward kept the up
//               products): one warp per token (light_rows.cu's pattern). For each
//               active unit n of the token's TwELL entries (g = the stored bf16 gate
//               value): u = x[t]·w_up[n] (the forward's, kept in Activations.up, or
//               recomputed with the same sum), dh = dy[t]·w_down_t[n] + l1 term, da, du.
//               The pair values (da, du, h) go to `vals` and the unit to `units` at the
//               pair's index, the row's pair count to row_nnz. Then twell_bw_light_dx:
//               dx[t] = sum da·w_gate[n] + du·w_up[n] in fp32, in entry order, a warp per
//               (256-column slice, token), slice-major, so the slices of w_gate and w_up
//               being read stay in L2 (the three weight matrices together do not).
//               twell_bw_light also
//               decides the backward's routing: a row is heavy (left to step 4) when the
//               forward said so, a weight holds Inf/NaN (every row: the host's flag, or
//               twell_bw_any_nonfinite's on the device), a tile overflows, the row has
//               more than row_cap entries, an entry is invalid or non-finite, or its x or
//               dy row holds Inf/NaN (dense math then spreads NaN to every unit: only
//               the dense path reproduces it). Duplicate columns in a tile are not
//               checked (twell's producers never write them).
//  2 unit lists twell_bw_unit_count -> twell_bw_unit_chunks -> twell_bw_unit_starts ->
//               twell_bw_unit_scatter: the transposed view ("unit lists", below), by a
//               counting sort whose ranks come from popcounts of per-chunk bit masks
//               (integer atomicOr in shared memory: order-free), no float atomics.
//  3 weights    twell_bw_weight_grads (+ twell_bw_weight_grads_finish): per unit, over its
//               list in ascending token order, in fp32: dWg[n] += da x[t],
//               dWu[n] += du x[t], dWd_t[n] += h dy[t]. Lists longer than `seg` entries are
//               cut into segments computed by different blocks; segment 0 writes the
//               output row, the others a workspace row, and the finish kernel adds them
//               in segment order. Units nobody uses get zero rows. A block takes one K
//               slice of its item, blocks numbered slice-major, and a token range per
//               launch where needed, so the x and dy rows being read stay in L2.
//  4 heavy      per chunk of heavy rows (ids[c0 : c0 + cap_rows] of the backward's row
//               list), tensor cores (mma.sync m16n8k16, ldmatrix, cp.async ring):
//               twell_bw_heavy_units  a, u, dy·wd for 64 rows x 64 units, then da, du, h
//                                     (bf16) into chunk buffers (dense math, NaN kept);
//               twell_bw_heavy_dx     dx rows = [da du] [wg; wu] (split over the reduction
//                                     when few rows; twell_bw_heavy_dx_reduce adds splits
//                                     in order);
//               twell_bw_heavy_weights dW += (chunk's da, du, h)ᵀ (x, x, dy): fp32
//                                     read-add-write of the tile, after the light part.
//               With dense_capacity, the first C heavy rows go through cuBLAS instead
//               (backward.py: _capacity_rows), before the chunks (which take the rest):
//               gathered x, dy rows (zeros past the count); a, u, dy·wd by GEMMs in bf16;
//               twell_bw_capacity_units  da, du, h in place (twell_bw_heavy_units' math);
//               dx = da wg + du wu by two fp32 GEMMs, twell_bw_capacity_dx rounds once
//               and scatters; dW += (da, du, h)ᵀ (x, x, dy) by fp32 GEMMs (beta = 1).
//  5 transpose  twell_bw_transpose_f32: dWd_t [N, K] -> dWd [K, N] (fp32, or rounded to bf16).
// Row counts of step 4 live on the device (count[0]); grids are sized for the worst case
// and blocks loop over the work that exists. Nothing synchronises with the host.
//
// ------------------------------------------------------------------ layouts
// Row-major; bf16 as uint16 bits. x, dy, dx [M, K]; packed [M, N/TILE*SLOTS];
// w_gate, w_up, w_down_t [N, K]; heavy flags uint8 [M]; weight grads fp32 [N, K].
// row_cap R: the most entries a light row may have (the launcher proves the bounds).
//
// PAIRS. The active (token, unit) pairs of the light rows. Pair index p = t*R + r, where r
// is the entry's rank in its row in TwELL order (tiles ascending, slots ascending):
// r = tile_off[t, j] + slot - 1, tile_off [M, tiles] int32 = the exclusive prefix over
// the row's tiles of their counts (written by step 1). Per-pair values: vals fp32
// [NV, M*R] (structure of arrays): gated (da, du, h), non-gated (da, h); units int32
// [M*R], the pair's unit; row_nnz int32 [M], a light row's pair count. The forward's up
// products (Activations.up, fp32 [M, R]) are indexed the same way.
//
// UNIT LISTS (the transposed view, reused by the prefill kernels): for unit n,
//   entries unit_start[n] .. unit_start[n+1]-1 (int32 [N+1]) of
//   tokens int32 [M*R]  the token t, ascending within a unit
//   pairs  int32 [M*R]  the pair index p (where the pair's values live)
// built from per-chunk counts counts int32 [C, N] (C = ceil(M / CHUNK_ROWS); after
// step 2b, the exclusive prefix over chunks) and seg_start int32 [N+1] (exclusive prefix
// of the extra segments of each unit, max(0, ceil(count / seg) - 1)).
//
// ------------------------------------------------------------------ determinism
// Every float sum has one owner and a fixed order: step 1 in entry order, step 3 in token
// order (+ segments in order), step 4 per mma fragment in k order (+ splits in order),
// light before heavy (capacity rows, then chunks); cuBLAS is deterministic for a given
// library path and shape. The only atomics are integer ORs into shared bit masks.
//
// Limits: K = TWELL_KDIM, a multiple of 8, <= 4096; N % TILE == 0, N <= 65536; M * R <
// 2^31 (the launcher lowers R if needed); 16-byte aligned rows.
//
// Compile-time parameters: TWELL_KDIM, TWELL_TILE, TWELL_SLOTS, TWELL_GATED; constants
// shared with backward.py: TWELL_LIST_CAPACITY, TWELL_BW_CHUNK_ROWS, TWELL_BW_UNIT_WARPS,
// TWELL_BW_GRAD_BATCH, TWELL_BW_LIGHT_MIN_BLOCKS.

#define NCH ((TWELL_KDIM + 255) / 256)
#define WPL ((TWELL_SLOTS + 31) / 32)
#define NV (TWELL_GATED ? 3 : 2)
#define KCH (TWELL_KDIM / 8)
// Threads of a weight-gradient block: 16-byte chunks of a row, one per thread (256 at most).
#define GRAD_THREADS (KCH >= 256 ? 256 : ((KCH + 31) / 32) * 32)
#define CPT ((KCH + GRAD_THREADS - 1) / GRAD_THREADS)
#define CW (TWELL_BW_CHUNK_ROWS / 32)
#define FULL 0xffffffffu
// Entries whose weight rows the light kernel loads at once (K <= 2048: two), and units
// whose two weight pieces a warp of the dx kernel loads at once.
#define LIGHT_UNITS (NCH <= 8 ? 2 : 1)
#define DX_UNITS 8

// ---------------------------------------------------------------- PTX helpers
__device__ __forceinline__ void bw_cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void bw_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bw_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bw_ldmatrix(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void bw_ldmatrix_trans(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// ---------------------------------------------------------------- small helpers
__device__ __forceinline__ bool non_finite8(uint4 v) {
  return twell_non_finite(v.x & 0xffffu) || twell_non_finite(v.x >> 16) ||
         twell_non_finite(v.y & 0xffffu) || twell_non_finite(v.y >> 16) ||
         twell_non_finite(v.z & 0xffffu) || twell_non_finite(v.z >> 16) ||
         twell_non_finite(v.w & 0xffffu) || twell_non_finite(v.w >> 16);
}

// sign(h) as NumPy has it: -1, 0, +1, NaN for NaN.
__device__ __forceinline__ float sign_of(float h) {
  return h > 0.f ? 1.f : (h < 0.f ? -1.f : (h == 0.f ? 0.f : h));
}

// One (row, unit) of a heavy row, dense math's backward: from a = the gate product (the
// up product, non-gated), u = the up product (gated only) and dhb = dy·w_down_t[n],
// h = relu(a)·u (relu(a)), dh = dhb + l1s·sign(h), da = dh·u·[a > 0] (dh·[a > 0]),
// du = dh·relu(a) (0). relu keeps NaN, as dense math does.
__device__ __forceinline__ void heavy_unit_grads(float a, float u, float dhb, float l1s,
                                                 float& da, float& du, float& h) {
  const float gv = a > 0.f ? a : (a != a ? a : 0.f);
  const float mask = a > 0.f ? 1.f : 0.f;
#if TWELL_GATED
  h = gv * u;
  const float dh = dhb + l1s * sign_of(h);
  da = dh * u * mask;
  du = dh * gv;
#else
  (void)u;
  h = gv;
  const float dh = dhb + l1s * sign_of(h);
  da = dh * mask;
  du = 0.f;
#endif
}

// Largest n in [0, N) with start[n] <= e (start non-decreasing, start[0] = 0 <= e).
__device__ __forceinline__ int find_unit(const int* __restrict__ start, int N, int e) {
  int lo = 0, hi = N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (start[mid] <= e) lo = mid; else hi = mid;
  }
  return lo;
}

// First index i in [lo, hi) with tokens[i] >= t (tokens ascending), hi if none.
__device__ __forceinline__ int first_token_at_least(const int* __restrict__ tokens, int lo,
                                                    int hi, int t) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (tokens[mid] < t) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// =======================================================================================
// 1. Light rows: one warp per token.
// =======================================================================================
template <bool WITH_X>
struct LightShared {
  uint32_t list[TWELL_LIST_CAPACITY];
  uint4 dy[NCH * 32];
  uint4 x[NCH * 32];  // for the up products the forward did not keep
};
template <>
struct LightShared<false> {
  uint32_t list[TWELL_LIST_CAPACITY];
  uint4 dy[NCH * 32];
};

// Copies a K-wide bf16 row to shared memory (dst may be null: check only); returns,
// for the whole warp, whether any value is Inf or NaN.
__device__ __forceinline__ bool load_row(uint4* dst, const uint16_t* __restrict__ src,
                                         int lane) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  bool bad = false;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const uint4 v = twell_slice_lane_valid(c, lane, TWELL_KDIM) ? __ldcs(s + c * 32 + lane)
                                                                : make_uint4(0, 0, 0, 0);
    bad |= non_finite8(v);
    if (dst != nullptr) dst[c * 32 + lane] = v;
  }
  return __any_sync(FULL, bad);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(FULL, v, d);
  return v;
}

// RECOMPUTE: the up products from x and w_up (gated, without the forward's); else read
// from up_saved (gated) or not needed (non-gated).
template <bool RECOMPUTE>
__device__ __forceinline__ void
light_pairs(const uint16_t* __restrict__ x,         // [M, K]
               const uint16_t* __restrict__ dy,        // [M, K]
               const uint32_t* __restrict__ packed,    // [M, N/TILE*SLOTS]
               const uint8_t* __restrict__ heavy_in,   // [M] the forward's heavy rows
               int all_heavy,                          // 1: every row is heavy
               const int* __restrict__ all_heavy_dev,  // [1] the same, on the device (or null)
               const uint16_t* __restrict__ w_gate,    // [N, K] (gated only)
               const uint16_t* __restrict__ w_up,      // [N, K]
               const uint16_t* __restrict__ w_down_t,  // [N, K]
               const float* __restrict__ up_saved,     // [M, row_cap] the forward's, or null
               uint8_t* __restrict__ heavy_out,        // [M] out: the backward's heavy rows
               int* __restrict__ tile_off,             // [M, tiles] out
               float* __restrict__ vals,               // [NV, cap] out
               int* __restrict__ units,                // [cap] out: each pair's unit
               int* __restrict__ row_nnz,              // [M] out: a light row's pairs
               long long cap, int M, int N, int row_cap,
               const float* __restrict__ l1_dev,  // [1] L1 coefficient on the device, or null
               float l1_host) {                   // l1_dev ? the L1 scale : coefficient * scale
  constexpr bool recompute = TWELL_GATED && RECOMPUTE;
  __shared__ LightShared<recompute> sm;
  const float l1s = l1_dev != nullptr ? l1_dev[0] * l1_host : l1_host;
  const int lane = threadIdx.x;
  const long long row = blockIdx.x;
  if (row >= M) return;
  const int tiles = N / TWELL_TILE;
  const uint32_t* words = packed + row * (long long)tiles * TWELL_SLOTS;
  bool is_heavy = all_heavy || (all_heavy_dev != nullptr && all_heavy_dev[0]) || heavy_in[row];

  // Count words: overflow, the row's total, the tiles' offsets.
  if (!is_heavy) {
    bool bad = false;
    int nnz = 0;
    for (int j0 = 0; j0 < tiles; j0 += 32) {
      const int j = j0 + lane;
      const uint32_t word = j < tiles ? __ldg(words + j * TWELL_SLOTS) : 0u;
      const int c = (int)min(word, (uint32_t)TWELL_SLOTS);  // unsigned: never negative
      bad |= twell_tile_overflows(c, TWELL_SLOTS);
      int incl = c;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(FULL, incl, d);
        if (lane >= d) incl += t;
      }
      if (j < tiles) tile_off[row * tiles + j] = nnz + incl - c;
      nnz += __shfl_sync(FULL, incl, 31);
    }
    is_heavy = __any_sync(FULL, bad) || nnz > row_cap;
  }
  // x and dy rows (to shared memory): Inf or NaN sends the row to the dense path.
  if (!is_heavy) {
#if TWELL_GATED
    bool bad;
    if constexpr (recompute) bad = load_row(sm.x, x + row * TWELL_KDIM, lane);
    else bad = load_row(nullptr, x + row * TWELL_KDIM, lane);  // checked, not kept
#else
    bool bad = load_row(nullptr, x + row * TWELL_KDIM, lane);
#endif
    bad |= load_row(sm.dy, dy + row * TWELL_KDIM, lane);
    is_heavy = bad;
  }
  // The entry list, checked (columns inside their tile, positive finite values).
  int total = 0;
  if (!is_heavy) {
    bool bad = false;
    for (int j0 = 0; j0 < tiles; j0 += 32) {
      const int mine = j0 + lane < tiles ? (int)__ldg(words + (j0 + lane) * TWELL_SLOTS) : 0;
      const int batch = min(32, tiles - j0);
      for (int b = 0; b < batch; ++b) {
        const int count = __shfl_sync(FULL, mine, b);
        const uint32_t* tw = words + (j0 + b) * TWELL_SLOTS;
        const uint32_t lo = (uint32_t)(j0 + b) * TWELL_TILE;
#pragma unroll
        for (int q = 0; q < WPL; ++q) {
          const int idx = q * 32 + lane;
          if (idx >= 1 && idx <= count) {
            const uint32_t w = __ldg(tw + idx);
            const uint32_t col = w & 0xffffu, bits = w >> 16;
            bad |= col < lo || col >= lo + TWELL_TILE || !twell_relu_keeps(bits) ||
                   twell_non_finite(bits);
            sm.list[total + idx - 1] = w;
          }
        }
        total += count;
      }
    }
    is_heavy = __any_sync(FULL, bad);
  }
  if (lane == 0) {
    heavy_out[row] = is_heavy ? 1 : 0;
    row_nnz[row] = is_heavy ? 0 : total;
  }
  if (is_heavy) return;
  __syncwarp();

  const long long p0 = row * (long long)row_cap;
  // The pair values, LIGHT_UNITS entries' rows in flight at a time (nothing waits on an
  // earlier entry's result: no dx here).
  for (int e0 = 0; e0 < total; e0 += LIGHT_UNITS) {
    uint4 b[LIGHT_UNITS][NCH];
#if TWELL_GATED
    uint4 a[LIGHT_UNITS][NCH];
#endif
#pragma unroll
    for (int q = 0; q < LIGHT_UNITS; ++q) {
      const int e = min(e0 + q, total - 1);  // past the end: a repeat, never stored
      const long long n = sm.list[e] & 0xffffu;
      const uint4* down = reinterpret_cast<const uint4*>(w_down_t + n * TWELL_KDIM);
#pragma unroll
      for (int c = 0; c < NCH; ++c)
        b[q][c] = twell_slice_lane_valid(c, lane, TWELL_KDIM) ? __ldg(down + c * 32 + lane)
                                                              : make_uint4(0, 0, 0, 0);
#if TWELL_GATED
      if constexpr (recompute) {
        const uint4* up = reinterpret_cast<const uint4*>(w_up + n * TWELL_KDIM);
#pragma unroll
        for (int c = 0; c < NCH; ++c)
          a[q][c] = twell_slice_lane_valid(c, lane, TWELL_KDIM) ? __ldg(up + c * 32 + lane)
                                                                : make_uint4(0, 0, 0, 0);
      }
#endif
    }
#pragma unroll
    for (int q = 0; q < LIGHT_UNITS; ++q) {
      const int e = e0 + q;
      if (e >= total) break;
      const uint32_t entry = sm.list[e];
      const float g = twell_hi_bf16(entry);
      float pd = 0.f;
#pragma unroll
      for (int c = 0; c < NCH; ++c) pd = twell_dot8(sm.dy[c * 32 + lane], b[q][c], pd);
      const float dhb = warp_sum(pd);
#if TWELL_GATED
      float u;
      if constexpr (recompute) {  // the forward's sum: the same chunks, lanes and butterfly
        float pu = 0.f;
#pragma unroll
        for (int c = 0; c < NCH; ++c) pu = twell_dot8(sm.x[c * 32 + lane], a[q][c], pu);
        u = warp_sum(pu);
      } else {
        u = up_saved[p0 + e];
      }
      const float h = g * u;
      const float dh = dhb + l1s * sign_of(h);
      const float da = dh * u, du = dh * g;
#else
      const float h = g;  // relu(a) > 0 here: sign(h) = 1
      const float da = dhb + l1s * sign_of(h);
#endif
      if (lane == 0) {
        vals[p0 + e] = da;
#if TWELL_GATED
        vals[cap + p0 + e] = du;
        vals[2 * cap + p0 + e] = h;
#else
        vals[cap + p0 + e] = h;
#endif
        units[p0 + e] = (int)(entry & 0xffffu);
      }
    }
  }
}

#define TWELL_BW_LIGHT_ARGS                                                                \
  const uint16_t *__restrict__ x, const uint16_t *__restrict__ dy,                         \
      const uint32_t *__restrict__ packed, const uint8_t *__restrict__ heavy_in,           \
      int all_heavy, const int *__restrict__ all_heavy_dev,                                \
      const uint16_t *__restrict__ w_gate, const uint16_t *__restrict__ w_up,              \
      const uint16_t *__restrict__ w_down_t, const float *__restrict__ up_saved,           \
      uint8_t *__restrict__ heavy_out, int *__restrict__ tile_off,                         \
      float *__restrict__ vals, int *__restrict__ units, int *__restrict__ row_nnz,        \
      long long cap, int M, int N, int row_cap, const float *__restrict__ l1_dev,          \
      float l1_host
#define TWELL_BW_LIGHT_PASS                                                                \
  x, dy, packed, heavy_in, all_heavy, all_heavy_dev, w_gate, w_up, w_down_t, up_saved,     \
      heavy_out, tile_off, vals, units, row_nnz, cap, M, N, row_cap, l1_dev, l1_host

// The up products recomputed (gated) or not needed (non-gated): up_saved unused.
extern "C" __global__ void __launch_bounds__(32, TWELL_BW_LIGHT_MIN_BLOCKS)
twell_bw_light(TWELL_BW_LIGHT_ARGS) {
  light_pairs<true>(TWELL_BW_LIGHT_PASS);
}

#if TWELL_GATED
// The forward's up products read from up_saved [M, row_cap].
extern "C" __global__ void __launch_bounds__(32, TWELL_BW_LIGHT_MIN_BLOCKS)
twell_bw_light_saved(TWELL_BW_LIGHT_ARGS) {
  light_pairs<false>(TWELL_BW_LIGHT_PASS);
}
#endif

// dx of the light rows by 256-column slices: a warp per (slice c, token t), numbered
// slice-major (the warps running at once read the same slice of w_gate and w_up, which
// stays in L2 where the whole matrices do not). In the pair order of twell_bw_light:
// dx[t, slice] = sum over pairs (da w_gate[n, slice] + du w_up[n, slice]) (gated),
// sum (da w_up[n, slice]) (non-gated), fp32, rounded once. Heavy rows are left alone.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_light_dx(const uint8_t* __restrict__ heavy, const int* __restrict__ row_nnz,
                  const int* __restrict__ units, const float* __restrict__ vals,
                  long long cap, int M, int row_cap,
                  const uint16_t* __restrict__ w_gate,  // [N, K] (gated only)
                  const uint16_t* __restrict__ w_up,    // [N, K]
                  uint16_t* __restrict__ dx) {          // [M, K] out (light rows)
  const int lane = threadIdx.x & 31;
  const long long item = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= (long long)NCH * M) return;
  const int c = (int)(item / M);
  const long long t = item - (long long)c * M;
  if (heavy[t]) return;
  const int total = row_nnz[t];
  const long long p0 = t * (long long)row_cap;
  const bool ok = twell_slice_lane_valid(c, lane, TWELL_KDIM);
  const int col = c * 256 + lane * 8;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  for (int e0 = 0; e0 < total; e0 += 32) {
    const int mine = min(32, total - e0);
    const int n_l = lane < mine ? units[p0 + e0 + lane] : 0;
    const float da_l = lane < mine ? vals[p0 + e0 + lane] : 0.f;
#if TWELL_GATED
    const float du_l = lane < mine ? vals[cap + p0 + e0 + lane] : 0.f;
#endif
#if TWELL_GATED  // the old kernel's order per entry: da·w_gate, then du·w_up
    twell_slice_gather<true, DX_UNITS>(n_l, da_l, du_l, mine, ok, col, TWELL_KDIM, w_gate, w_up,
                                       acc);
#else
    twell_slice_gather<false, DX_UNITS>(n_l, da_l, 0.f, mine, ok, col, TWELL_KDIM, w_up, w_up,
                                        acc);
#endif
  }
  if (ok) twell_store_bf16x8(dx + t * TWELL_KDIM + col, acc);
}

// flag[0] = 1 if any of the n8 * 8 bf16 of w is Inf or NaN (flag zeroed before; every
// writer stores the same 1: no atomics needed). Weights the host never checked.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_any_nonfinite(const uint16_t* __restrict__ w, long long n8, int* __restrict__ flag) {
  bool bad = false;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8;
       i += (long long)gridDim.x * blockDim.x)
    bad |= non_finite8(__ldg(reinterpret_cast<const uint4*>(w) + i));
  if (bad) flag[0] = 1;
}

// =======================================================================================
// 2. Unit lists: a block per (chunk of CHUNK_ROWS tokens, TwELL tile).
// =======================================================================================
struct UnitShared {
  uint32_t mask[TWELL_TILE][CW];  // bit r of mask[u][r/32]: row r of the chunk uses unit u
  int start[TWELL_TILE][CW];      // scatter: list position of the first entry of each word
};

// Sets the mask bits of the light rows of chunk c, tile j (TwELL words trusted: step 1
// checked every light row).
__device__ __forceinline__ void build_masks(UnitShared& sm, const uint32_t* __restrict__ packed,
                                            const uint8_t* __restrict__ heavy, int M,
                                            int tiles, int c, int j) {
  uint32_t* flat = &sm.mask[0][0];
  for (int i = threadIdx.x; i < TWELL_TILE * CW; i += blockDim.x) flat[i] = 0u;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < TWELL_BW_CHUNK_ROWS; r += TWELL_BW_UNIT_WARPS) {
    const long long t = (long long)c * TWELL_BW_CHUNK_ROWS + r;
    if (t >= M) break;
    if (heavy[t]) continue;
    const uint32_t* tw = packed + (t * tiles + j) * TWELL_SLOTS;
    const int count = (int)__ldg(tw);
#pragma unroll
    for (int q = 0; q < WPL; ++q) {
      const int idx = q * 32 + lane;
      if (idx >= 1 && idx <= count) {
        const int local = (int)(__ldg(tw + idx) & 0xffffu) - j * TWELL_TILE;
        atomicOr(&sm.mask[local][r >> 5], 1u << (r & 31));
      }
    }
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(TWELL_BW_UNIT_WARPS * 32)
twell_bw_unit_count(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ heavy,
                    int M, int N, int* __restrict__ counts) {  // counts [C, N] out
  __shared__ UnitShared sm;
  const int c = blockIdx.x, j = blockIdx.y;
  build_masks(sm, packed, heavy, M, N / TWELL_TILE, c, j);
  for (int u = threadIdx.x; u < TWELL_TILE; u += blockDim.x) {
    int s = 0;
#pragma unroll
    for (int w = 0; w < CW; ++w) s += __popc(sm.mask[u][w]);
    counts[(long long)c * N + j * TWELL_TILE + u] = s;
  }
}

// counts [C, N] -> exclusive prefix over chunks (in place); totals[n] = entries of unit n.
extern "C" __global__ void twell_bw_unit_chunks(int* __restrict__ counts, int C, int N,
                                                int* __restrict__ totals) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  int run = 0;
  for (int c0 = 0; c0 < C; c0 += 8) {
    int v[8];
#pragma unroll
    for (int b = 0; b < 8; ++b) v[b] = c0 + b < C ? counts[(long long)(c0 + b) * N + n] : 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      if (c0 + b < C) counts[(long long)(c0 + b) * N + n] = run;
      run += v[b];
    }
  }
  totals[n] = run;
}

// One block of 1024 threads: unit_start = exclusive prefix of totals (unit_start[N] = all
// entries); seg_start = exclusive prefix of the extra segments max(0, ceil(t/seg) - 1).
extern "C" __global__ void __launch_bounds__(1024)
twell_bw_unit_starts(const int* __restrict__ totals, int N, int seg,
                     int* __restrict__ unit_start, int* __restrict__ seg_start) {
  __shared__ int s_units[1024], s_segs[1024];
  const int t = threadIdx.x;
  const int chunk = (N + 1023) / 1024;
  const int begin = min(N, t * chunk), end = min(N, begin + chunk);
  int units = 0, segs = 0;
  for (int n = begin; n < end; ++n) {
    const int v = totals[n];
    units += v;
    segs += v > 0 ? (v - 1) / seg : 0;
  }
  s_units[t] = units;
  s_segs[t] = segs;
  __syncthreads();
  for (int d = 1; d < 1024; d <<= 1) {  // Hillis-Steele inclusive scans
    const int au = t >= d ? s_units[t - d] : 0, as = t >= d ? s_segs[t - d] : 0;
    __syncthreads();
    s_units[t] += au;
    s_segs[t] += as;
    __syncthreads();
  }
  int ru = s_units[t] - units, rs = s_segs[t] - segs;
  for (int n = begin; n < end; ++n) {
    const int v = totals[n];
    unit_start[n] = ru;
    seg_start[n] = rs;
    ru += v;
    rs += v > 0 ? (v - 1) / seg : 0;
  }
  if (t == 1023) {
    unit_start[N] = s_units[1023];
    seg_start[N] = s_segs[1023];
  }
}

// Writes every light entry of chunk c, tile j at its place: unit_start[n] + counts[c, n]
// (the chunk's offset) + the number of earlier rows of the chunk using n.
extern "C" __global__ void __launch_bounds__(TWELL_BW_UNIT_WARPS * 32)
twell_bw_unit_scatter(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ heavy,
                      const int* __restrict__ tile_off, int M, int N, int row_cap,
                      const int* __restrict__ counts, const int* __restrict__ unit_start,
                      int* __restrict__ tokens, int* __restrict__ pairs) {
  __shared__ UnitShared sm;
  const int c = blockIdx.x, j = blockIdx.y;
  const int tiles = N / TWELL_TILE;
  build_masks(sm, packed, heavy, M, tiles, c, j);
  for (int u = threadIdx.x; u < TWELL_TILE; u += blockDim.x) {
    const int n = j * TWELL_TILE + u;
    int run = unit_start[n] + counts[(long long)c * N + n];
#pragma unroll
    for (int w = 0; w < CW; ++w) {
      sm.start[u][w] = run;
      run += __popc(sm.mask[u][w]);
    }
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < TWELL_BW_CHUNK_ROWS; r += TWELL_BW_UNIT_WARPS) {
    const long long t = (long long)c * TWELL_BW_CHUNK_ROWS + r;
    if (t >= M) break;
    if (heavy[t]) continue;
    const uint32_t* tw = packed + (t * tiles + j) * TWELL_SLOTS;
    const int count = (int)__ldg(tw);
    const int base = (int)(t * row_cap) + tile_off[t * tiles + j] - 1;
#pragma unroll
    for (int q = 0; q < WPL; ++q) {
      const int idx = q * 32 + lane;
      if (idx >= 1 && idx <= count) {
        const int local = (int)(__ldg(tw + idx) & 0xffffu) - j * TWELL_TILE;
        const int pos = sm.start[local][r >> 5] +
                        __popc(sm.mask[local][r >> 5] & ((1u << (r & 31)) - 1u));
        tokens[pos] = (int)t;
        pairs[pos] = base + idx;
      }
    }
  }
}

// =======================================================================================
// 3. Weight gradients of the light pairs: a block per unit segment.
// =======================================================================================
struct GradShared {
  int tok[TWELL_BW_GRAD_BATCH];
  float v[NV][TWELL_BW_GRAD_BATCH];
};

#define GRAD_UNROLL 4

// out[v] rows (fp32, K wide): v < NV-1 sum vals[v]·x[t], v = NV-1 sum vals[v]·dy[t].
// Items: unit n (segment 0, writes dw[v] row n) for item < N; extra segment e = item - N
// (writes ws row e*NV + v) after that. A block computes one item's columns of one K slice
// (`slices` equal slices of KCH / slices 16-byte chunks, one per thread; slices == 1: the
// whole row, GRAD_THREADS threads). Blocks are numbered slice-major, so the blocks running
// at once read the same slice of x and dy: a slice of both for all tokens can stay in L2
// where the whole rows cannot. Each value is summed in token order by one thread whatever
// the slicing: the bits do not depend on it. Where even a slice of all tokens is too large,
// the launcher runs the kernel once per token range [t0, t1), in order: the first launch
// writes the rows, the later ones (accumulate = 1) add their range's sums to them (a
// fixed order: the bits depend on the ranges, not on timing).
// C: 16-byte chunks per thread (CPT for the whole row; 1 for a slice, which has one per
// thread).
#define TWELL_GRAD_ARGS                                                                    \
  const uint16_t *__restrict__ x, const uint16_t *__restrict__ dy,                         \
      const int *__restrict__ tokens, const int *__restrict__ pairs,                       \
      const float *__restrict__ vals, long long cap, const int *__restrict__ unit_start,   \
      const int *__restrict__ seg_start, int N, int seg, int extra_cap, int slices, int t0, \
      int t1, int accumulate, float *__restrict__ dw0, float *__restrict__ dw1,            \
      float *__restrict__ dw2, float *__restrict__ ws
#define TWELL_GRAD_PASS                                                                    \
  x, dy, tokens, pairs, vals, cap, unit_start, seg_start, N, seg, extra_cap, slices, t0, t1, \
      accumulate, dw0, dw1, dw2, ws
template <int C>
__device__ __forceinline__ void weight_grads(TWELL_GRAD_ARGS) {
  __shared__ GradShared sm;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int extras = min(seg_start[N], extra_cap);
  const int items = N + extras, per = N + extra_cap;
  const int cs = KCH / slices;  // chunks of a slice
  for (int b = blockIdx.x; b < slices * per; b += gridDim.x) {
    const int s = b / per, item = b - s * per;
    if (item >= items) continue;  // block-uniform
    int begin, end;
    long long row;  // where the item's rows go: dw[v] row n, or ws row e*NV + v
    if (item < N) {
      begin = unit_start[item];
      end = min(unit_start[item + 1], begin + seg);
      row = (long long)item * TWELL_KDIM;
    } else {
      const int e = item - N;
      const int n = find_unit(seg_start, N, e);
      begin = unit_start[n] + (e - seg_start[n] + 1) * seg;
      end = min(unit_start[n + 1], begin + seg);
      row = (long long)e * NV * TWELL_KDIM;
    }
    begin = first_token_at_least(tokens, begin, end, t0);  // the range's part of the list
    end = first_token_at_least(tokens, begin, end, t1);
    if (accumulate && begin == end) continue;  // nothing to add (block-uniform)
    float* const out0 = item < N ? dw0 + row : ws + row;
    float* const out1 = item < N ? dw1 + row : ws + row + TWELL_KDIM;
    float* const out2 = item < N ? dw2 + row : ws + row + 2 * TWELL_KDIM;
    float acc[NV][C][8];
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int cc = 0; cc < C; ++cc)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[v][cc][i] = 0.f;

    for (int b0 = begin; b0 < end; b0 += TWELL_BW_GRAD_BATCH) {
      const int nb = min(TWELL_BW_GRAD_BATCH, end - b0);
      __syncthreads();  // the previous batch is consumed
      for (int i = tid; i < nb; i += threads) {
        const long long p = pairs[b0 + i];
        sm.tok[i] = tokens[b0 + i];
#pragma unroll
        for (int v = 0; v < NV; ++v) sm.v[v][i] = vals[v * cap + p];
      }
      __syncthreads();
      for (int i = 0; i < nb; i += GRAD_UNROLL) {
        uint4 xv[GRAD_UNROLL][C], dv[GRAD_UNROLL][C];
#pragma unroll
        for (int q = 0; q < GRAD_UNROLL; ++q) {
          const bool live = i + q < nb;
          const long long t = live ? sm.tok[i + q] : 0;
          const uint4* xr = reinterpret_cast<const uint4*>(x + t * TWELL_KDIM);
          const uint4* dr = reinterpret_cast<const uint4*>(dy + t * TWELL_KDIM);
#pragma unroll
          for (int cc = 0; cc < C; ++cc) {
            const int kl = tid + cc * threads, k = s * cs + kl;
            const bool ok = live && kl < cs && k < KCH;
            xv[q][cc] = ok ? __ldg(xr + k) : make_uint4(0, 0, 0, 0);
            dv[q][cc] = ok ? __ldg(dr + k) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int q = 0; q < GRAD_UNROLL; ++q) {
          if (i + q < nb) {
#pragma unroll
            for (int cc = 0; cc < C; ++cc) {
#pragma unroll
              for (int v = 0; v < NV - 1; ++v) twell_axpy8(sm.v[v][i + q], xv[q][cc], acc[v][cc]);
              twell_axpy8(sm.v[NV - 1][i + q], dv[q][cc], acc[NV - 1][cc]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int cc = 0; cc < C; ++cc) {
      const int kl = tid + cc * threads, k = s * cs + kl;
      if (kl < cs && k < KCH) {
#pragma unroll
        for (int v = 0; v < NV; ++v) {  // the output pointer chosen by value
          float4* o = reinterpret_cast<float4*>((v == 0 ? out0 : (v == 1 ? out1 : out2)) + k * 8);
          float4 lo = make_float4(acc[v][cc][0], acc[v][cc][1], acc[v][cc][2], acc[v][cc][3]);
          float4 hi = make_float4(acc[v][cc][4], acc[v][cc][5], acc[v][cc][6], acc[v][cc][7]);
          if (accumulate) {  // the earlier ranges' sums + this range's
            const float4 a = o[0], b = o[1];
            lo = make_float4(a.x + lo.x, a.y + lo.y, a.z + lo.z, a.w + lo.w);
            hi = make_float4(b.x + hi.x, b.y + hi.y, b.z + hi.z, b.w + hi.w);
          }
          o[0] = lo;
          o[1] = hi;
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(GRAD_THREADS)
twell_bw_weight_grads(TWELL_GRAD_ARGS) {  // whole rows: slices == 1, GRAD_THREADS threads
  weight_grads<CPT>(TWELL_GRAD_PASS);
}

extern "C" __global__ void __launch_bounds__(256)
twell_bw_weight_grads_sliced(TWELL_GRAD_ARGS) {  // slices > 1: one chunk per thread
  weight_grads<1>(TWELL_GRAD_PASS);
}

// Adds the extra segments of each unit to its rows, in segment order (segment 0 is
// already there). A block per extra segment; the first segment of a unit does the work.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_weight_grads_finish(const int* __restrict__ seg_start, int N, int extra_cap,
                             const float* __restrict__ ws, float* __restrict__ dw0,
                             float* __restrict__ dw1, float* __restrict__ dw2) {
  const int extras = min(seg_start[N], extra_cap);
  for (int e = blockIdx.x; e < extras; e += gridDim.x) {
    const int n = find_unit(seg_start, N, e);
    if (seg_start[n] != e) continue;
    const int nseg = min(seg_start[n + 1], extras) - e;
    // One flat loop over (v, k); the output pointer chosen by value. (Two NVRTC versions
    // spilled a few bytes here with a loop over v: 13.0 when unrolled, 13.x when not.)
    const long long row = (long long)n * TWELL_KDIM;
    for (int i = threadIdx.x; i < NV * (TWELL_KDIM / 4); i += blockDim.x) {
      const int v = i / (TWELL_KDIM / 4), k = i - v * (TWELL_KDIM / 4);
      float4* o = reinterpret_cast<float4*>((v == 0 ? dw0 : (v == 1 ? dw1 : dw2)) + row) + k;
      const float4* src =
          reinterpret_cast<const float4*>(ws + ((long long)e * NV + v) * TWELL_KDIM) + k;
      float4 acc = *o;
      for (int s = 0; s < nseg; ++s) {
        const float4 b = src[(long long)s * NV * (TWELL_KDIM / 4)];
        acc.x += b.x;
        acc.y += b.y;
        acc.z += b.z;
        acc.w += b.w;
      }
      *o = acc;
    }
  }
}

// =======================================================================================
// 4. Heavy rows: tensor-core tiles of 64 x 64 outputs, 4 warps (2 x 2, 32 x 32 each),
//    reduction slices of 32 through a 3-stage cp.async ring. Operands are staged either
//    "K-major" (tile rows x reduction: [64][40] bf16, reduction contiguous in memory) or
//    "R-major" (reduction rows x tile columns: [32][72] bf16, tile columns contiguous in
//    memory; fragments through ldmatrix.trans). Pitches of 80 and 144 bytes keep the
//    eight rows of every ldmatrix on distinct banks.
// =======================================================================================
#define HT 64
#define HS 32
#define HSTAGES 3
#define KPITCH 40
#define RPITCH 72
#define HBUF 2560  // bf16 per operand and stage (>= 64*40 and 32*72)

struct __align__(16) HeavyShared {
  uint16_t a[HSTAGES][HBUF];
  uint16_t b[HSTAGES][HBUF];
};

// K-major operand: the 64 tile rows are fixed for a tile (row pointer or null = zeros).
struct StageK {
  const uint16_t* p[2];
  const uint16_t* fallback;
  int rr[2], kc[2];
  int red;
  __device__ __forceinline__ void stage(int s, uint16_t* buf) const {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int k = s * HS + kc[q] * 8;
      const bool ok = p[q] != nullptr && k < red;
      bw_cp_async16(buf + rr[q] * KPITCH + kc[q] * 8, ok ? p[q] + k : fallback, ok);
    }
  }
};

template <class Fn>
__device__ __forceinline__ StageK make_stage_k(Fn row_ptr, int row0, int red,
                                               const uint16_t* fallback) {
  StageK st;
  st.fallback = fallback;
  st.red = red;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int c = threadIdx.x + 128 * q;
    st.rr[q] = c >> 2;
    st.kc[q] = c & 3;
    st.p[q] = row_ptr(row0 + st.rr[q]);
  }
  return st;
}

// R-major operand: the reduction row's pointer comes from `row_ptr(r)` (null = zeros),
// columns col0 .. col0+63 of it (those >= width are zeros).
template <class Fn>
struct StageR {
  Fn row_ptr;
  const uint16_t* fallback;
  int col0, width;
  __device__ __forceinline__ void stage(int s, uint16_t* buf) const {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int c = threadIdx.x + 128 * q;
      const int rr = c >> 3, mc = c & 7;
      const uint16_t* p = row_ptr(s * HS + rr);
      const int col = col0 + mc * 8;
      const bool ok = p != nullptr && col < width;
      bw_cp_async16(buf + rr * RPITCH + mc * 8, ok ? p + col : fallback, ok);
    }
  }
};

template <class Fn>
__device__ __forceinline__ StageR<Fn> make_stage_r(Fn row_ptr, int col0, int width,
                                                   const uint16_t* fallback) {
  StageR<Fn> st{row_ptr, fallback, col0, width};
  return st;
}

// Fragments of warp (wm, wn) for the k16 step ks of a staged slice.
template <bool RMAJOR>
__device__ __forceinline__ void frag_a(const uint16_t* buf, int ks, int mt, int wm, int lane,
                                       uint32_t (&r)[4]) {
  if (RMAJOR) {
    const int k = ks * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int m = wm * 32 + mt * 16 + ((lane >> 3) & 1) * 8;
    bw_ldmatrix_trans(r, buf + k * RPITCH + m);
  } else {
    const int m = wm * 32 + mt * 16 + (lane & 15);
    const int k = ks * 16 + (lane >> 4) * 8;
    bw_ldmatrix(r, buf + m * KPITCH + k);
  }
}
template <bool RMAJOR>
__device__ __forceinline__ void frag_b(const uint16_t* buf, int ks, int np, int wn, int lane,
                                       uint32_t (&r)[4]) {
  if (RMAJOR) {
    const int k = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
    const int n = wn * 32 + np * 16 + (lane >> 4) * 8;
    bw_ldmatrix_trans(r, buf + k * RPITCH + n);
  } else {
    const int n = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int k = ks * 16 + ((lane >> 3) & 1) * 8;
    bw_ldmatrix(r, buf + n * KPITCH + k);
  }
}

__device__ __forceinline__ void zero_acc(float (&acc)[2][4][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// acc += A·Bᵀ over slices s0 .. s0+ns-1 (each 32 deep), A = tile rows, B = tile columns.
template <bool A_R, bool B_R, class LA, class LB>
__device__ __forceinline__ void mainloop(float (&acc)[2][4][4], const LA& la, const LB& lb,
                                         int s0, int ns, HeavyShared& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  __syncthreads();  // every earlier read of the ring is done
  if (ns > 0) {
    la.stage(s0, sm.a[0]);
    lb.stage(s0, sm.b[0]);
  }
  bw_cp_commit();
  if (ns > 1) {
    la.stage(s0 + 1, sm.a[1]);
    lb.stage(s0 + 1, sm.b[1]);
  }
  bw_cp_commit();
#pragma unroll 1
  for (int s = 0; s < ns; ++s) {
    bw_cp_wait<1>();
    __syncthreads();
    if (s + 2 < ns) {
      la.stage(s0 + s + 2, sm.a[(s + 2) % HSTAGES]);
      lb.stage(s0 + s + 2, sm.b[(s + 2) % HSTAGES]);
    }
    bw_cp_commit();
    const uint16_t* A = sm.a[s % HSTAGES];
    const uint16_t* B = sm.b[s % HSTAGES];
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      uint32_t af[2][4], bf[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) frag_a<A_R>(A, ks, mt, wm, lane, af[mt]);
#pragma unroll
      for (int np = 0; np < 2; ++np) frag_b<B_R>(B, ks, np, wn, lane, bf[np]);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          twell_mma_bf16(acc[mt][nt], af[mt][0], af[mt][1], af[mt][2], af[mt][3],
                         bf[nt >> 1][(nt & 1) * 2], bf[nt >> 1][(nt & 1) * 2 + 1]);
    }
  }
  bw_cp_wait<0>();
}

// Step 4 in one launch over every chunk of heavy rows (ids[c0 .. c0 + rows - 1] per chunk
// of cap_rows), stage after stage: 4a (da, du, h), 4b (dx, split or not), 4b' (the split's
// reduction), 4c (weight gradients), then the next chunk. Blocks take work items from a
// ticket counter in that order, and an item starts only once every item of the stages
// before it is done (a done counter). Tickets go out in order, so an item only ever waits
// for items that running blocks hold: no deadlock, whatever number of blocks is resident.
// With no heavy rows past the capacity GEMMs, every block takes one ticket and returns.
// Each output element is written by one item in chunk order: the bits do not depend on
// the grid. Data written earlier in the launch is read past L1 (cp.async.cg, __ldcg).
struct HeavyArgs {
  const uint16_t* x;
  const uint16_t* dy;
  const int* ids;
  const uint16_t* w_gate;  // null non-gated
  const uint16_t* w_up;
  const uint16_t* w_down_t;
  int N;
  float l1s;
  uint16_t* dadu;  // [cap_rows, ld]: (da | du) gated (ld = 2N), da non-gated (ld = N)
  int ld;
  uint16_t* hbuf;  // [cap_rows, N]
  uint16_t* dx;
  float* ws;  // the split dx's partial sums
  int target, ws_units;
  float *dw0, *dw1, *dw2;
};

// Rows of the chunk starting at heavy row c0.
__device__ __forceinline__ int chunk_rows(const int* __restrict__ count, int c0, int cap_rows) {
  return max(0, min(count[0] - c0, cap_rows));
}

// How many ways 4b splits its reduction (a function of the chunk's rows).
__device__ __forceinline__ int dx_split(int rows, int col_blocks, int kblocks, int target,
                                        int ws_units) {
  const int rb = (rows + HT - 1) / HT;
  if (rb == 0) return 1;
  int ks = target / (rb * col_blocks);
  ks = min(ks, kblocks / 4);
  ks = min(ks, ws_units / rb);
  return max(ks, 1);
}

// Element pairs of the split's reduction per work item (16 per thread).
#define HEAVY_REDUCE_ITEM 2048

// Work items of stage `stage` (0 .. 3) of a chunk of `rows` rows.
__device__ __forceinline__ int heavy_stage_items(const HeavyArgs& a, int stage, int rows) {
  const int K = TWELL_KDIM;
  const int row_blocks = (rows + HT - 1) / HT, col_blocks = (K + HT - 1) / HT;
  const int unit_blocks = (a.N + HT - 1) / HT;
  if (rows == 0) return 0;
  if (stage == 0) return row_blocks * unit_blocks;
  const int ks = dx_split(rows, col_blocks, a.ld / HS, a.target, a.ws_units);
  if (stage == 1) return row_blocks * col_blocks * ks;
  if (stage == 2) return ks == 1 ? 0 : (rows * (K / 2) + HEAVY_REDUCE_ITEM - 1) / HEAVY_REDUCE_ITEM;
  return NV * unit_blocks * col_blocks;
}

// 4a. da, du, h of 64 heavy rows x 64 units (dense math, NaN and Inf kept), bf16, into
//     dadu and hbuf.
__device__ __forceinline__ void heavy_units_item(const HeavyArgs& a, int c0, int rows, int item,
                                                 HeavyShared& sm) {
  const int K = TWELL_KDIM, N = a.N;
  const int col_blocks = (N + HT - 1) / HT, slices = (K + HS - 1) / HS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
  const int rb = item / col_blocks, cb = item % col_blocks;
  const int r0 = rb * HT, n0 = cb * HT;
  const uint16_t* __restrict__ x = a.x;
  const uint16_t* __restrict__ dy = a.dy;
  const int* __restrict__ ids = a.ids;
  auto x_row = [&](int i) -> const uint16_t* {
    return i < rows ? x + (long long)ids[c0 + i] * K : nullptr;
  };
  auto dy_row = [&](int i) -> const uint16_t* {
    return i < rows ? dy + (long long)ids[c0 + i] * K : nullptr;
  };
  float acc_a[2][4][4], acc_d[2][4][4];
  zero_acc(acc_a);
  zero_acc(acc_d);
  const StageK sx = make_stage_k(x_row, r0, K, x);
  {
    const uint16_t* w_first = TWELL_GATED ? a.w_gate : a.w_up;
    auto w_row = [&](int n) -> const uint16_t* {
      return n < N ? w_first + (long long)n * K : nullptr;
    };
    mainloop<false, false>(acc_a, sx, make_stage_k(w_row, n0, K, w_first), 0, slices, sm);
  }
#if TWELL_GATED
  float acc_u[2][4][4];
  zero_acc(acc_u);
  {
    auto w_row = [&](int n) -> const uint16_t* {
      return n < N ? a.w_up + (long long)n * K : nullptr;
    };
    mainloop<false, false>(acc_u, sx, make_stage_k(w_row, n0, K, a.w_up), 0, slices, sm);
  }
#endif
  {
    auto w_row = [&](int n) -> const uint16_t* {
      return n < N ? a.w_down_t + (long long)n * K : nullptr;
    };
    mainloop<false, false>(acc_d, make_stage_k(dy_row, r0, K, dy),
                           make_stage_k(w_row, n0, K, a.w_down_t), 0, slices, sm);
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int n = n0 + wn * 32 + nt * 8 + 2 * t;
      if (n >= N) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + wm * 32 + mt * 16 + g + 8 * half;
        if (i >= rows) continue;
        float da[2], du[2], hv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#if TWELL_GATED
          const float u = acc_u[mt][nt][2 * half + e];
#else
          const float u = 0.f;
#endif
          heavy_unit_grads(acc_a[mt][nt][2 * half + e], u, acc_d[mt][nt][2 * half + e], a.l1s,
                           da[e], du[e], hv[e]);
        }
        uint16_t* row = a.dadu + (long long)i * a.ld;
        *reinterpret_cast<uint32_t*>(row + n) = twell_pack_bf16x2(da[0], da[1]);
#if TWELL_GATED
        *reinterpret_cast<uint32_t*>(row + N + n) = twell_pack_bf16x2(du[0], du[1]);
#endif
        *reinterpret_cast<uint32_t*>(a.hbuf + (long long)i * N + n) =
            twell_pack_bf16x2(hv[0], hv[1]);
      }
    }
}

// 4b. dx[ids[c0 + i]] = sum_r dadu[i, r] W[r] with W = [w_gate; w_up] (gated) or w_up:
//     A K-major (dadu rows), B R-major (weight rows r, columns k); split over the
//     reduction into ws when the chunk has few row blocks.
__device__ __forceinline__ void heavy_dx_item(const HeavyArgs& a, int c0, int rows, int item,
                                              HeavyShared& sm) {
  const int K = TWELL_KDIM, N = a.N;
  const int red = a.ld;  // 2N gated, N non-gated
  const int row_blocks = (rows + HT - 1) / HT, col_blocks = (K + HT - 1) / HT;
  const int kblocks = red / HS;
  const int ks = dx_split(rows, col_blocks, kblocks, a.target, a.ws_units);
  const int kper = (kblocks + ks - 1) / ks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
  const int kss = item % ks, rest = item / ks;
  const int rb = rest / col_blocks, cb = rest % col_blocks;
  const int r0 = rb * HT, k0 = cb * HT;
  const int s0 = kss * kper, s1 = min(kblocks, s0 + kper);
  const uint16_t* dadu = a.dadu;
  auto a_row = [&](int i) -> const uint16_t* {
    return i < rows ? dadu + (long long)i * a.ld : nullptr;
  };
  auto w_row = [&](int r) -> const uint16_t* {
#if TWELL_GATED
    return r < N ? a.w_gate + (long long)r * K : a.w_up + (long long)(r - N) * K;
#else
    return a.w_up + (long long)r * K;
#endif
  };
  float acc[2][4][4];
  zero_acc(acc);
  mainloop<false, true>(acc, make_stage_k(a_row, r0, red, dadu),
                        make_stage_r(w_row, k0, K, a.w_up), s0, max(0, s1 - s0), sm);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = k0 + wn * 32 + nt * 8 + 2 * t;
      if (col >= K) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + wm * 32 + mt * 16 + g + 8 * half;
        if (i >= rows) continue;
        const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        if (ks == 1) {
          *reinterpret_cast<uint32_t*>(a.dx + (long long)a.ids[c0 + i] * K + col) =
              twell_pack_bf16x2(v0, v1);
        } else {
          float* w = a.ws + ((long long)kss * row_blocks * HT + i) * K + col;
          w[0] = v0;
          w[1] = v1;
        }
      }
    }
}

// 4b'. The split's partial sums added in split order, rounded once into dx.
__device__ __forceinline__ void heavy_dx_reduce_item(const HeavyArgs& a, int c0, int rows,
                                                     int item) {
  const int K = TWELL_KDIM;
  const int col_blocks = (K + HT - 1) / HT;
  const int ks = dx_split(rows, col_blocks, a.ld / HS, a.target, a.ws_units);
  const long long rows_cap = (long long)((rows + HT - 1) / HT) * HT;
  const long long total = (long long)rows * (K / 2);
  const long long q1 = min(total, (long long)(item + 1) * HEAVY_REDUCE_ITEM);
  for (long long q = (long long)item * HEAVY_REDUCE_ITEM + threadIdx.x; q < q1; q += blockDim.x) {
    const int i = (int)(q / (K / 2)), col = 2 * (int)(q % (K / 2));
    float v0 = 0.f, v1 = 0.f;
    for (int s = 0; s < ks; ++s) {
      const float2 w = __ldcg(reinterpret_cast<const float2*>(a.ws + (s * rows_cap + i) * K + col));
      v0 += w.x;
      v1 += w.y;
    }
    *reinterpret_cast<uint32_t*>(a.dx + (long long)a.ids[c0 + i] * K + col) =
        twell_pack_bf16x2(v0, v1);
  }
}

// 4c. dW[which] [N, K] += Aᵀ B over the chunk's rows: which v < NV-1: A = dadu column
//     block v (da, du), B = x rows; v = NV-1: A = hbuf, B = dy rows. Both R-major.
//     Each output element is owned by one thread: read, add the chunk's sum, write.
__device__ __forceinline__ void heavy_weights_item(const HeavyArgs& a, int c0, int rows,
                                                   int item, HeavyShared& sm) {
  const int K = TWELL_KDIM, N = a.N;
  const int unit_blocks = (N + HT - 1) / HT, col_blocks = (K + HT - 1) / HT;
  const int per = unit_blocks * col_blocks;
  const int slices = (rows + HS - 1) / HS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
  const int which = item / per, rest = item % per;
  const int m0 = (rest / col_blocks) * HT, k0 = (rest % col_blocks) * HT;
  const bool last = which == NV - 1;
  const uint16_t* abase = last ? a.hbuf : a.dadu + (long long)which * N;
  const int apitch = last ? N : a.ld;
  const uint16_t* bsrc = last ? a.dy : a.x;
  const int* __restrict__ ids = a.ids;
  auto a_row = [&](int r) -> const uint16_t* {
    return r < rows ? abase + (long long)r * apitch : nullptr;
  };
  auto b_row = [&](int r) -> const uint16_t* {
    return r < rows ? bsrc + (long long)ids[c0 + r] * K : nullptr;
  };
  float acc[2][4][4];
  zero_acc(acc);
  mainloop<true, true>(acc, make_stage_r(a_row, m0, N, abase), make_stage_r(b_row, k0, K, bsrc),
                       0, slices, sm);
  float* out = which == 0 ? a.dw0 : (which == 1 ? a.dw1 : a.dw2);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int k = k0 + wn * 32 + nt * 8 + 2 * t;
      if (k >= K) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int n = m0 + wm * 32 + mt * 16 + g + 8 * half;
        if (n >= N) continue;
        float2* o = reinterpret_cast<float2*>(out + (long long)n * K + k);
        float2 v = __ldcg(o);
        v.x += acc[mt][nt][2 * half];
        v.y += acc[mt][nt][2 * half + 1];
        *o = v;
      }
    }
}

// The launch: sync = {ticket counter, done counter}, zero on entry. `rows_max`: the most
// heavy rows the list can hold here (count is at most this).
extern "C" __global__ void __launch_bounds__(128, 3)
twell_bw_heavy_chunks(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy,
                      const int* __restrict__ ids, const int* __restrict__ count, int rows_max,
                      int cap_rows, const uint16_t* __restrict__ w_gate,  // null non-gated
                      const uint16_t* __restrict__ w_up, const uint16_t* __restrict__ w_down_t,
                      int N, const float* __restrict__ l1_dev, float l1_host,  // as light
                      uint16_t* __restrict__ dadu, int ld, uint16_t* __restrict__ hbuf,
                      uint16_t* __restrict__ dx, float* __restrict__ ws, int target,
                      int ws_units, float* __restrict__ dw0, float* __restrict__ dw1,
                      float* __restrict__ dw2, int* __restrict__ sync) {
  __shared__ HeavyShared sm;
  __shared__ int s_ticket;
  HeavyArgs a;
  a.x = x;
  a.dy = dy;
  a.ids = ids;
  a.w_gate = w_gate;
  a.w_up = w_up;
  a.w_down_t = w_down_t;
  a.N = N;
  a.l1s = l1_dev != nullptr ? l1_dev[0] * l1_host : l1_host;
  a.dadu = dadu;
  a.ld = ld;
  a.hbuf = hbuf;
  a.dx = dx;
  a.ws = ws;
  a.target = target;
  a.ws_units = ws_units;
  a.dw0 = dw0;
  a.dw1 = dw1;
  a.dw2 = dw2;
  const int heavy = min(count[0], rows_max);
  volatile int* done = sync + 1;
  for (;;) {
    if (threadIdx.x == 0) s_ticket = atomicAdd(sync, 1);
    __syncthreads();
    int ticket = s_ticket;
    __syncthreads();
    // Find the ticket's chunk, stage and item; `before`: items of all earlier stages.
    int before = 0, c0 = 0, stage = 0, rows = 0;
    bool found = false;
    for (c0 = 0; c0 < heavy && !found; c0 += cap_rows) {
      rows = chunk_rows(count, c0, cap_rows);
      for (stage = 0; stage < 4; ++stage) {
        const int items = heavy_stage_items(a, stage, rows);
        if (ticket < items) {
          found = true;
          break;
        }
        ticket -= items;
        before += items;
      }
      if (found) break;
    }
    if (!found) return;
    if (threadIdx.x == 0) {
      while (*done < before) {
      }
      __threadfence();
    }
    __syncthreads();
    if (stage == 0) heavy_units_item(a, c0, rows, ticket, sm);
    else if (stage == 1) heavy_dx_item(a, c0, rows, ticket, sm);
    else if (stage == 2) heavy_dx_reduce_item(a, c0, rows, ticket);
    else heavy_weights_item(a, c0, rows, ticket, sm);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(sync + 1, 1);
    }
  }
}

// =======================================================================================
// 4'. Capacity rows (dense_capacity): the first C heavy rows, gathered into fixed-size
//     buffers whose a, u, dy·wd come from cuBLAS (bf16); these kernels sit between the
//     GEMMs. Rows i >= min(count, C) are padding.
// =======================================================================================

// da, du, h from a, u, dy·wd elementwise, in place (a -> da, u -> du, d -> h; bf16 [C, N]),
// with the formulas of twell_bw_heavy_units (heavy_unit_grads) on inputs cuBLAS has
// already rounded to bf16 (the chunk kernels keep them in fp32); padding rows get zeros (so
// they add nothing to the weight GEMMs, whatever the L1 coefficient holds). u is unused
// (null) for the non-gated block. N % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_capacity_units(uint16_t* __restrict__ a, uint16_t* __restrict__ u,
                        uint16_t* __restrict__ d, const int* __restrict__ count, int C, int N,
                        const float* __restrict__ l1_dev, float l1_host) {
  const float l1s = l1_dev != nullptr ? l1_dev[0] * l1_host : l1_host;
  const int rows = min(count[0], C);
  const int per_row = N / 8;
  const long long total = (long long)C * per_row;
  for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < total;
       q += (long long)gridDim.x * blockDim.x) {
    uint4* pa = reinterpret_cast<uint4*>(a) + q;
    uint4* pd = reinterpret_cast<uint4*>(d) + q;
#if TWELL_GATED
    uint4* pu = reinterpret_cast<uint4*>(u) + q;
#endif
    if (q / per_row >= rows) {
      *pa = make_uint4(0, 0, 0, 0);
      *pd = make_uint4(0, 0, 0, 0);
#if TWELL_GATED
      *pu = make_uint4(0, 0, 0, 0);
#endif
      continue;
    }
    const uint4 av = *pa, dv = *pd;
    const uint32_t a_w[4] = {av.x, av.y, av.z, av.w};
    const uint32_t d_w[4] = {dv.x, dv.y, dv.z, dv.w};
    uint32_t da_out[4], h_out[4];
#if TWELL_GATED
    const uint4 uv = *pu;
    const uint32_t u_w[4] = {uv.x, uv.y, uv.z, uv.w};
    uint32_t du_out[4];
#endif
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float da[2], du[2], hv[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#if TWELL_GATED
        const float x_u = twell_bf16_to_float((u_w[w] >> (16 * e)) & 0xffffu);
#else
        const float x_u = 0.f;
#endif
        heavy_unit_grads(twell_bf16_to_float((a_w[w] >> (16 * e)) & 0xffffu), x_u,
                         twell_bf16_to_float((d_w[w] >> (16 * e)) & 0xffffu), l1s, da[e],
                         du[e], hv[e]);
      }
      da_out[w] = twell_pack_bf16x2(da[0], da[1]);
      h_out[w] = twell_pack_bf16x2(hv[0], hv[1]);
#if TWELL_GATED
      du_out[w] = twell_pack_bf16x2(du[0], du[1]);
#endif
    }
    *pa = make_uint4(da_out[0], da_out[1], da_out[2], da_out[3]);
    *pd = make_uint4(h_out[0], h_out[1], h_out[2], h_out[3]);
#if TWELL_GATED
    *pu = make_uint4(du_out[0], du_out[1], du_out[2], du_out[3]);
#endif
  }
}

// dx[ids[i]] = bf16(dxc[i]) for i < min(count, C): the capacity rows' fp32 dx (both
// products summed by cuBLAS) rounded once and scattered. K % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_capacity_dx(const float* __restrict__ dxc, const int* __restrict__ ids,
                     const int* __restrict__ count, int C, uint16_t* __restrict__ dx) {
  const int K = TWELL_KDIM;
  const int rows = min(count[0], C);
  const int per_row = K / 4;
  const long long total = (long long)rows * per_row;
  for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < total;
       q += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(q / per_row), c = (int)(q % per_row);
    const float4 v = reinterpret_cast<const float4*>(dxc)[q];
    reinterpret_cast<uint2*>(dx + (long long)ids[i] * K)[c] =
        make_uint2(twell_pack_bf16x2(v.x, v.y), twell_pack_bf16x2(v.z, v.w));
  }
}

// =======================================================================================
// 5. transpose of the fp32 accumulator: out [C, R] = in [R, C]ᵀ, written as fp32 or rounded
// to bf16 (out_bf16) (32 x 32 tiles, blocks of 32 x 8).
// =======================================================================================
extern "C" __global__ void __launch_bounds__(256)
twell_bw_transpose_f32(const float* __restrict__ in, void* __restrict__ out, int R, int C,
                       int out_bf16) {
  __shared__ float tile[32][33];
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int r = r0 + i, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[i][threadIdx.x] = in[(long long)r * C + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int c = c0 + i, r = r0 + threadIdx.x;
    if (r < R && c < C) {
      const float v = tile[threadIdx.x][i];
      if (out_bf16)
        reinterpret_cast<__nv_bfloat16*>(out)[(long long)c * R + r] = __float2bfloat16_rn(v);
      else
        reinterpret_cast<float*>(out)[(long long)c * R + r] = v;
    }
  }
}
