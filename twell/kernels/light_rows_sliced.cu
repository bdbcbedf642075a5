// light_rows_sliced.cu — light rows of the FFN block by K slices (the "sliced" route):
// the gathered up and down projections of light_rows.cu, reorganised so that the warps
// running at once read one 256-column slice of the weights. Where w_up and w_down_t
// together are far larger than L2 (K = 4096, N = 14336: 117 MB each), a per-token gather
// reads most rows from HBM; a slice of either (N x 512 bytes) stays in L2, so the same
// bytes come at L2 rate.
//
//   gated:     y[t] = sum over entries (n, g) of row t:  g * (x[t]·w_up[n]) * w_down_t[n]
//   non-gated: y[t] = sum over entries (n, h):  h * w_down_t[n]
//
// Kernels (after the gate packed TwELL: gate_gemm.cu or pack.cu; rows the packer flagged
// heavy are left to heavy_rows.cu):
//  twell_sliced_lists  a warp per token: the row's TwELL entries, in TwELL order (tiles
//                      ascending, slots ascending), to entries[t, e] (the TwELL word:
//                      column | bf16 value << 16) and their count to row_nnz[t]. A row with
//                      more than row_cap entries (the routing rule's max_row_nnz, or the
//                      list's room) gets heavy[t] = 1; a heavy row gets row_nnz[t] = 0.
//  twell_sliced_up     (gated) launched once per slice s, in slice order; a warp per token:
//                      u[t, e] = (launch 0) or += (later launches) x[t, slice]·w_up[n,
//                      slice], fp32: each lane's 8 products in column order, then an xor
//                      butterfly; the last launch (final = 1) leaves h = g * u instead of
//                      u. One launch per slice (not one slice-major launch) because the
//                      sums of a pair's slices must be added in order.
//  twell_sliced_down   a warp per (slice, token), numbered slice-major: y[t, slice] =
//                      sum over entries in order of h * w_down_t[n, slice] (h = g for the
//                      non-gated block), fp32, rounded once to bf16; heavy rows left alone.
//
// Determinism: every sum has one owner and a fixed order (slices in order, entries in
// order): identical bits run to run. The order differs from light_rows.cu's (whole-row
// dot products), so the two routes give a row different bits.
//
// Layouts (row-major; bf16 as uint16 bits): x, y [M, K]; packed [M, N/TILE*SLOTS];
// heavy uint8 [M]; w_up, w_down_t [N, K]; entries uint32 and u float [M, row_cap];
// row_nnz int32 [M]. Limits: K = TWELL_KDIM, a multiple of 8, <= 4096; N % TILE == 0;
// 16-byte aligned rows; M * row_cap < 2^31 (the launcher bounds row_cap).
//
// Compile-time parameters: TWELL_KDIM, TWELL_TILE, TWELL_SLOTS, TWELL_GATED; constant
// shared with the launcher (light_rows_sliced.py): TWELL_SLICE_UNITS.

#define NCH ((TWELL_KDIM + 255) / 256)  // 256-column slices of a row
#define WPL ((TWELL_SLOTS + 31) / 32)
#define FULL 0xffffffffu

extern "C" __global__ void __launch_bounds__(256)
twell_sliced_lists(const uint32_t* __restrict__ packed,  // [M, N/TILE*SLOTS]
                   uint8_t* __restrict__ heavy,           // [M] in/out
                   uint32_t* __restrict__ entries,        // [M, row_cap] out
                   int* __restrict__ row_nnz,             // [M] out
                   int M, int N, int row_cap) {
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= M) return;
  if (heavy[row]) {
    if (lane == 0) row_nnz[row] = 0;
    return;
  }
  const int tiles = N / TWELL_TILE;
  const uint32_t* words = packed + row * (long long)tiles * TWELL_SLOTS;
  uint32_t* out = entries + row * (long long)row_cap;
  int total = 0;
  for (int j0 = 0; j0 < tiles; j0 += 32) {
    const int j = j0 + lane;
    const int count =
        j < tiles ? (int)min(__ldg(words + j * TWELL_SLOTS), (uint32_t)(TWELL_SLOTS - 1)) : 0;
    int incl = count;  // inclusive prefix over this batch of tiles
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int t = __shfl_up_sync(FULL, incl, d);
      if (lane >= d) incl += t;
    }
    const int batch_total = __shfl_sync(FULL, incl, 31);
    if (total + batch_total <= row_cap) {
      const int batch = min(32, tiles - j0);
      for (int b = 0; b < batch; ++b) {  // a tile's entries, lanes over its slots
        const int c = __shfl_sync(FULL, count, b);
        const int first = total + __shfl_sync(FULL, incl, b) - c;
        const uint32_t* tw = words + (j0 + b) * TWELL_SLOTS;
#pragma unroll
        for (int q = 0; q < WPL; ++q) {
          const int idx = q * 32 + lane;
          if (idx >= 1 && idx <= c) out[first + idx - 1] = __ldg(tw + idx);
        }
      }
    }
    total += batch_total;
  }
  if (lane == 0) {
    const bool over = total > row_cap;
    if (over) heavy[row] = 1;
    row_nnz[row] = over ? 0 : total;
  }
}

extern "C" __global__ void __launch_bounds__(256)
twell_sliced_up(const uint16_t* __restrict__ x,         // [M, K]
                const uint16_t* __restrict__ w_up,      // [N, K]
                const uint32_t* __restrict__ entries,   // [M, row_cap]
                const int* __restrict__ row_nnz,        // [M]
                float* __restrict__ u,                  // [M, row_cap] in/out
                int M, int row_cap, int s, int final_slice) {
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= M) return;
  const int total = row_nnz[row];
  if (total == 0) return;
  const bool ok = twell_slice_lane_valid(s, lane, TWELL_KDIM);
  const int col = s * 256 + lane * 8;
  const uint4 xv = ok ? __ldg(reinterpret_cast<const uint4*>(x + row * TWELL_KDIM + col))
                      : make_uint4(0, 0, 0, 0);
  const uint32_t* ent = entries + row * (long long)row_cap;
  float* ur = u + row * (long long)row_cap;
  for (int e0 = 0; e0 < total; e0 += 32) {
    const int mine = min(32, total - e0);
    const uint32_t word_l = lane < mine ? ent[e0 + lane] : 0u;
    float prev_l = 0.f;
    if (s > 0 && lane < mine) prev_l = ur[e0 + lane];
    float part_l = 0.f;  // lane j keeps the sum of entry e0 + j
    for (int j0 = 0; j0 < mine; j0 += TWELL_SLICE_UNITS) {
      uint4 wv[TWELL_SLICE_UNITS];
#pragma unroll
      for (int q = 0; q < TWELL_SLICE_UNITS; ++q) {
        const uint32_t w = __shfl_sync(FULL, word_l, min(j0 + q, mine - 1));
        const long long n = w & 0xffffu;
        wv[q] = ok && j0 + q < mine
                    ? __ldg(reinterpret_cast<const uint4*>(w_up + n * TWELL_KDIM + col))
                    : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int q = 0; q < TWELL_SLICE_UNITS; ++q) {
        float p = twell_dot8(xv, wv[q], 0.f);
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1) p += __shfl_xor_sync(FULL, p, d);
        if (lane == j0 + q) part_l = p;
      }
    }
    if (lane < mine) {
      const float sum = s > 0 ? prev_l + part_l : part_l;
      ur[e0 + lane] = final_slice ? twell_hi_bf16(word_l) * sum : sum;
    }
  }
}

extern "C" __global__ void __launch_bounds__(256)
twell_sliced_down(const uint8_t* __restrict__ heavy,     // [M]
                  const uint32_t* __restrict__ entries,  // [M, row_cap]
                  const int* __restrict__ row_nnz,       // [M]
                  const float* __restrict__ h,           // [M, row_cap] (gated) or null
                  const uint16_t* __restrict__ w_down_t,  // [N, K]
                  uint16_t* __restrict__ y,              // [M, K] out (light rows)
                  int M, int row_cap) {
  const int lane = threadIdx.x & 31;
  const long long item = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= (long long)NCH * M) return;
  const int s = (int)(item / M);
  const long long t = item - (long long)s * M;
  if (heavy[t]) return;
  const int total = row_nnz[t];
  const bool ok = twell_slice_lane_valid(s, lane, TWELL_KDIM);
  const int col = s * 256 + lane * 8;
  const uint32_t* ent = entries + t * (long long)row_cap;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  for (int e0 = 0; e0 < total; e0 += 32) {
    const int mine = min(32, total - e0);
    const uint32_t word_l = lane < mine ? ent[e0 + lane] : 0u;
#if TWELL_GATED
    const float h_l = lane < mine ? h[t * row_cap + e0 + lane] : 0.f;
#else
    const float h_l = twell_hi_bf16(word_l);
#endif
    twell_slice_gather<false, TWELL_SLICE_UNITS>((int)(word_l & 0xffffu), h_l, 0.f, mine, ok,
                                                 col, TWELL_KDIM, w_down_t, w_down_t, acc);
  }
  if (ok) twell_store_bf16x8(y + t * TWELL_KDIM + col, acc);
}
