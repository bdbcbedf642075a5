// backward_light.cu — step 1 of the FFN block's backward pass (launched by backward.py):
// the light rows' pair values and their dx, and which rows the backward sends to the dense
// path.
//
// twell_bw_light (twell_bw_light_saved when the forward kept the up products): one warp
// per token (light_rows.cu's pattern). For each active unit n of the token's TwELL
// entries (g = the stored bf16 gate value):
//   gated:     u = x[t]·w_up[n] (the forward's, Activations.up, or recomputed with the
//              same sum), dh = dy[t]·w_down_t[n] + l1s·sign(h), h = g·u, da = dh·u,
//              du = dh·g
//   non-gated: h = g, da = dy[t]·w_down_t[n] + l1s (sign(h) = 1)
// (l1s: the L1 coefficient times 1/(M·N) or 1/M, from the host or read on the device).
// The pair's values go to `vals` and its unit to `units` at the pair's index, the row's
// pair count to row_nnz. The kernel also routes the backward's rows: a row is heavy (left
// to step 4) when the forward said so, a weight holds Inf/NaN (every row: the host's
// flag, or twell_bw_any_nonfinite's on the device), a tile overflows, the row has more
// than row_cap entries, an entry is invalid or non-finite, or its x or dy row holds
// Inf/NaN (dense math then spreads NaN to every unit: only the dense path reproduces
// it). Duplicate columns in a tile are not checked (twell's producers never write them).
//
// twell_bw_light_dx: dx[t] = sum da·w_gate[n] + du·w_up[n] (non-gated: da·w_up[n]) in
// fp32, in entry order, rounded once; a warp per (256-column slice, token), slice-major,
// so the slices of w_gate and w_up being read stay in L2 (the three weight matrices
// together do not).
//
// Layouts: row-major; bf16 as uint16 bits. x, dy, dx [M, K]; packed [M, N/TILE*SLOTS];
// w_gate, w_up, w_down_t [N, K]; heavy flags uint8 [M].
// PAIRS: the active (token, unit) pairs of the light rows. Pair index p = t·R + r
// (R = row_cap, the most entries a light row may have), r the entry's rank in its row in
// TwELL order (tiles ascending, slots ascending): r = tile_off[t, j] + slot - 1, with
// tile_off [M, tiles] int32 the exclusive prefix over the row's tiles of their counts
// (written here). Per-pair values: vals fp32 [NV, M·R] (structure of arrays): gated
// (da, du, h), non-gated (da, h); units int32 [M·R], the pair's unit; row_nnz int32 [M],
// a light row's pair count. The forward's up products (Activations.up, fp32 [M, R]) are
// indexed the same way.
//
// Limits: K = TWELL_KDIM, a multiple of 8, <= 4096; N % TILE == 0, N <= 65536;
// M·R < 2^31 (the launcher lowers R if needed); 16-byte aligned rows.
//
// Compile-time parameters: TWELL_KDIM, TWELL_TILE, TWELL_SLOTS, TWELL_GATED; constants
// shared with backward.py: TWELL_LIST_CAPACITY (the light kernel's entry list),
// TWELL_BW_LIGHT_MIN_BLOCKS (blocks per SM its register budget is sized for).

#define NCH ((TWELL_KDIM + 255) / 256)
#define WPL ((TWELL_SLOTS + 31) / 32)
#define FULL 0xffffffffu
// Entries whose weight rows the light kernel loads at once (K <= 2048: two), and units
// whose two weight pieces a warp of the dx kernel loads at once.
#define LIGHT_UNITS (NCH <= 8 ? 2 : 1)
#define DX_UNITS 8

// Whether any of the 8 bf16 of v is Inf or NaN.
__device__ __forceinline__ bool non_finite8(uint4 v) {
  return twell_non_finite(v.x & 0xffffu) || twell_non_finite(v.x >> 16) ||
         twell_non_finite(v.y & 0xffffu) || twell_non_finite(v.y >> 16) ||
         twell_non_finite(v.z & 0xffffu) || twell_non_finite(v.z >> 16) ||
         twell_non_finite(v.w & 0xffffu) || twell_non_finite(v.w >> 16);
}

// The warp's shared memory: the row's entry list and its dy row (and x row, to recompute
// the up products).
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
      const float dh = dhb + l1s * twell_sign(h);
      const float da = dh * u, du = dh * g;
#else
      const float h = g;  // relu(a) > 0 here: sign(h) = 1
      const float da = dhb + l1s * twell_sign(h);
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
#if TWELL_GATED  // per entry: da·w_gate, then du·w_up
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
