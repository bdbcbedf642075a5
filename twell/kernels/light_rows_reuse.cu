// light_rows_reuse.cu — light rows of the FFN block with the down projection's weight rows
// read once per block of tokens (the "reuse" route).
//
//   gated:     h[t, e] = g * (x[t]·w_up[n])       (entry e of row t: unit n, bf16 gate g)
//   non-gated: h[t, e] = g
//   y[t, :]  = sum over the entries of row t, in order, of h[t, e] * w_down_t[n, :]
//
// Input: the pair layout of light_rows_sliced.cu's twell_sliced_lists (a row's TwELL
// entries, column | bf16 << 16, in TwELL order, and their count; 0 for heavy rows).
//
// Kernels:
//  twell_reuse_up    (gated; non-gated only for the training forward's row sums) a warp
//                    per token, as light_rows.cu's gather but for the up rows alone: x[t]
//                    in registers (lane l: columns [8l, 8l+8) of every 256-column slice),
//                    each entry's w_up row from L2 in 16-byte loads, UP_UNITS entries' rows
//                    in flight, the dot product summed per lane over slices in order and
//                    then by an xor butterfly. The same operations as light_rows.cu, so h
//                    has the gather's bits. Writes h[t, e]; for the training forward also
//                    the up products up[t, e] and the row's sum of |h| in entry order.
//  twell_reuse_down  a CTA per (64 output columns, RD_TOKENS tokens). A producer thread
//                    streams w_down_t[256 units, 64 columns] chunks (32 KB, TMA, 128-byte
//                    swizzle) through an RD_STAGES-deep ring: every chunk is read ONCE per
//                    block of tokens and serves all of them (a per-token gather reads a
//                    unit's row once for every token that uses it). The consumers are
//                    groups of 8 lanes; a group owns TPG tokens, lane l of it the columns
//                    [8l, 8l+8) of each, fp32 sums in registers. Per chunk, a group walks
//                    each of its tokens' entries that fall in the chunk: the prefix of what
//                    is left of the row (entries are in tile order and a chunk is whole
//                    tiles), held 8 at a time in the group's lanes with the next 8 loaded
//                    ahead, and adds h * w with one 16-byte shared load per lane (the 8
//                    lanes read one 128-byte row: no bank conflicts). Full/empty mbarriers,
//                    no __syncthreads: a warp runs up to RD_STAGES chunks ahead of the
//                    slowest.
//
// Determinism and bits: every sum has one owner and a fixed order. For each row and column
// the down sums are fmaf(h, w, acc) over the entries in order from 0, rounded once to
// bf16: with twell_reuse_up's h, the same operations as light_rows.cu's from_twell, so
// the route gives the "epilogue" and "pack" routes' bits.
//
// Layouts (row-major; bf16 as uint16 bits): x, y [M, K]; heavy uint8 [M]; w_up,
// w_down_t [N, K]; entries uint32 and h float [M, row_cap]; up float [M, up_cap];
// row_nnz int32 [M].
// Limits: K = TWELL_KDIM, a multiple of 8, <= 4096; 16-byte aligned rows; M * row_cap <
// 2^31 (the launcher bounds row_cap); the entries of a row lie inside their TwELL tiles
// (twell's producers write them so; an entry outside contributes nothing, and the
// entries after it in its row may be skipped: never an access outside the buffers).
//
// Compile-time parameters: TWELL_KDIM, TWELL_GATED, TWELL_TPG (tokens per group: 1, 2, 4
// or 8), TWELL_WARPS (consumer warps of the down kernel), TWELL_STAGES (its ring depth);
// constant shared with the launcher (light_rows_reuse.py): TWELL_UP_UNITS.

#define NCH ((TWELL_KDIM + 255) / 256)  // 256-column slices of a row
#define FULL 0xffffffffu

// ---------------------------------------------------------------------- up
// A warp per token: its entries' up products, UP_UNITS entries' w_up rows in flight. Lane
// j of each batch of 32 entries writes entry j's h (and up product, for ranks < up_cap);
// lane 0 the row's sum of |h| over its entries in order.
extern "C" __global__ void __launch_bounds__(256)
twell_reuse_up(const uint16_t* __restrict__ x,         // [M, K] (gated)
               const uint16_t* __restrict__ w_up,      // [N, K] (gated)
               const uint32_t* __restrict__ entries,   // [M, row_cap]
               const int* __restrict__ row_nnz,        // [M]
               const uint8_t* __restrict__ heavy,      // [M]
               float* __restrict__ h,                  // [M, row_cap] out (gated) or null
               float* __restrict__ up,                 // [M, up_cap] out or null
               float* __restrict__ row_l1,             // [M] out (light rows) or null
               int M, int N, int row_cap, int up_cap) {
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= M) return;
  const int total = row_nnz[row];
  if (total == 0) {  // a heavy row (its L1 term is the heavy-row stage's), or no entries
    if (row_l1 != nullptr && lane == 0 && !heavy[row]) row_l1[row] = 0.f;
    return;
  }
  const uint32_t* ent = entries + row * (long long)row_cap;
#if TWELL_GATED
  uint4 xv[NCH];
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * TWELL_KDIM);
#pragma unroll
  for (int c = 0; c < NCH; ++c)
    xv[c] = twell_slice_lane_valid(c, lane, TWELL_KDIM) ? __ldcs(xr + c * 32 + lane)
                                                         : make_uint4(0, 0, 0, 0);
#endif
  float l1 = 0.f;
  for (int e0 = 0; e0 < total; e0 += 32) {
    const int mine = min(32, total - e0);
    const uint32_t word_l = lane < mine ? ent[e0 + lane] : 0u;
#if TWELL_GATED
    float u_l = 0.f;  // lane j keeps entry e0 + j's up product
    for (int j0 = 0; j0 < mine; j0 += TWELL_UP_UNITS) {
      uint4 wv[TWELL_UP_UNITS][NCH];
#pragma unroll
      for (int q = 0; q < TWELL_UP_UNITS; ++q) {
        long long n = __shfl_sync(FULL, word_l, min(j0 + q, mine - 1)) & 0xffffu;
        if (n >= N) n = 0;  // invalid input: read a valid row (its h is zeroed below)
        const uint4* wr = reinterpret_cast<const uint4*>(w_up + n * TWELL_KDIM);
#pragma unroll
        for (int c = 0; c < NCH; ++c)
          wv[q][c] = twell_slice_lane_valid(c, lane, TWELL_KDIM) ? __ldg(wr + c * 32 + lane)
                                                                 : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int q = 0; q < TWELL_UP_UNITS; ++q) {
        if (j0 + q >= mine) break;
        float part = 0.f;
#pragma unroll
        for (int c = 0; c < NCH; ++c) part = twell_dot8(xv[c], wv[q][c], part);
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1) part += __shfl_xor_sync(FULL, part, d);
        if (lane == j0 + q) u_l = part;
      }
    }
    float value = twell_hi_bf16(word_l);
    if ((word_l & 0xffffu) >= (uint32_t)N) value = 0.f;
    const float h_l = value * u_l;
#else
    const float u_l = 0.f;
    float h_l = twell_hi_bf16(word_l);
    if ((word_l & 0xffffu) >= (uint32_t)N) h_l = 0.f;
#endif
    if (lane < mine) {
      if (h != nullptr) h[row * row_cap + e0 + lane] = h_l;
      if (up != nullptr && e0 + lane < up_cap) up[row * up_cap + e0 + lane] = u_l;
    }
    if (row_l1 != nullptr) {  // in entry order, as light_rows.cu adds them
      for (int j = 0; j < mine; ++j) l1 += fabsf(__shfl_sync(FULL, h_l, j));
    }
  }
  if (row_l1 != nullptr && lane == 0) row_l1[row] = l1;
}

// ---------------------------------------------------------------------- down
#define RD_COLS 64                      // output columns per CTA: one 128-byte TMA box row
#define RD_CHUNK 256                    // units per ring stage: the TMA box's rows
#define RD_STAGE_BYTES (RD_CHUNK * 128)
#define RD_WARPS TWELL_WARPS            // consumer warps
#define RD_STAGES TWELL_STAGES
#define TPG TWELL_TPG
#define RD_TOKENS (RD_WARPS * 4 * TPG)  // tokens per CTA
#define RD_THREADS (RD_WARPS * 32 + 32) // + the producer warp
#define RD_BAR_OFFSET (RD_STAGES * RD_STAGE_BYTES)
#define RD_SMEM_BYTES (RD_BAR_OFFSET + 2 * RD_STAGES * 8 + 1024)  // light_rows_reuse.py's
static_assert(TPG == 1 || TPG == 2 || TPG == 4 || TPG == 8, "TWELL_TPG: 1, 2, 4 or 8");
#define RD_PAIRS (TPG < 8 || !TWELL_GATED)

extern "C" __global__ void __launch_bounds__(RD_THREADS, 1)
twell_reuse_down(const __grid_constant__ TwellTmaDesc map_w,  // w_down_t [N, K], box 64 x 256
                 const uint32_t* __restrict__ entries,        // [M, row_cap]
                 const float* __restrict__ h,                 // [M, row_cap] (gated) or null
                 const int* __restrict__ row_nnz,             // [M]
                 const uint8_t* __restrict__ heavy,           // [M]
                 uint16_t* __restrict__ y,                    // [M, K] out (light rows)
                 int M, int N, int row_cap) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = twell_smem_addr(smem_raw);
  uint8_t* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);  // 1024-aligned (swizzle)
  const uint32_t sbase = twell_smem_addr(smem);
  const uint32_t full_bar = sbase + RD_BAR_OFFSET;
  const uint32_t empty_bar = full_bar + 8 * RD_STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col0 = blockIdx.x * RD_COLS;
  const int chunks = (N + RD_CHUNK - 1) / RD_CHUNK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < RD_STAGES; ++s) {
      twell_mbar_init(full_bar + 8 * s, 1);
      twell_mbar_init(empty_bar + 8 * s, RD_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == RD_WARPS) {  // the producer: one thread, TMA loads into the ring
    if (lane == 0) {
      for (int c = 0; c < chunks; ++c) {
        const int s = c % RD_STAGES;
        if (c >= RD_STAGES) twell_mbar_wait(empty_bar + 8 * s, ((c / RD_STAGES) - 1) & 1);
        twell_mbar_expect_tx(full_bar + 8 * s, RD_STAGE_BYTES);
        twell_tma_load_2d(sbase + s * RD_STAGE_BYTES, &map_w, col0, c * RD_CHUNK,
                          full_bar + 8 * s);
      }
    }
    return;
  }

  const int sub = lane & 7;             // this lane's columns: col0 + 8 sub .. + 8
  const int first_lane = lane & 24;     // the group's lanes: first_lane .. + 8
  const unsigned gmask = 0xffu << first_lane;
  const long long tok0 = (long long)blockIdx.y * RD_TOKENS + (threadIdx.x >> 3) * TPG;

  // Per token, two windows of its entries in the group's lanes: A, lane sub holding entry
  // base + sub (its unit and h), and B, entry base + 8 + sub, loaded a window ahead so its
  // load has long completed when A runs out and B becomes A (a load whose result the next
  // chunk's test reads would stall every chunk). st packs off (entries of A used, 0..8),
  // base and the row's count (both <= 1024).
  uint32_t aw[TPG], bw[TPG], st[TPG];
#if TWELL_GATED
  float ah[TPG], bh[TPG];
#endif
  float acc[TPG][8];
#pragma unroll
  for (int i = 0; i < TPG; ++i) {
    const long long t = tok0 + i;
    const int cnt = (t < M && !heavy[t]) ? row_nnz[t] : 0;
    st[i] = (uint32_t)cnt << 16;
    aw[i] = bw[i] = 0u;
#if TWELL_GATED
    ah[i] = bh[i] = 0.f;
#endif
    if (sub < cnt) {
      aw[i] = entries[t * row_cap + sub];
#if TWELL_GATED
      ah[i] = h[t * row_cap + sub];
#endif
    }
    if (sub + 8 < cnt) {
      bw[i] = entries[t * row_cap + sub + 8];
#if TWELL_GATED
      bh[i] = h[t * row_cap + sub + 8];
#endif
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  }

  for (int c = 0; c < chunks; ++c) {
    const int s = c % RD_STAGES;
    twell_mbar_wait(full_bar + 8 * s, (c / RD_STAGES) & 1);
    const uint8_t* stage = smem + s * RD_STAGE_BYTES;
    const uint32_t unit0 = (uint32_t)c * RD_CHUNK;
    // The last chunk takes whatever is left (entries past N contribute nothing).
    const uint32_t unit_end = c + 1 == chunks ? 0xffffffffu : unit0 + RD_CHUNK;
#pragma unroll
    for (int i = 0; i < TPG; ++i) {
      for (;;) {
        const int off = st[i] & 15u, base = (st[i] >> 4) & 2047u, cnt = st[i] >> 16;
        const bool in = sub >= off && base + sub < cnt && (aw[i] & 0xffffu) < unit_end;
        const uint32_t ball = (__ballot_sync(gmask, in) >> first_lane) & 0xffu;
        const int end = off + __ffs(~(ball >> off)) - 1;  // A's in-chunk run from off
        int q = off;
        // Two entries' loads in flight, added in order (not at 8 tokens per group of the
        // gated build: its registers would spill).
        for (; RD_PAIRS && q + 1 < end; q += 2) {
          const uint32_t w0 = __shfl_sync(gmask, aw[i], q, 8);
          const uint32_t w1 = __shfl_sync(gmask, aw[i], q + 1, 8);
#if TWELL_GATED
          const float h0 = __shfl_sync(gmask, ah[i], q, 8);
          const float h1 = __shfl_sync(gmask, ah[i], q + 1, 8);
#else
          const float h0 = twell_hi_bf16(w0), h1 = twell_hi_bf16(w1);
#endif
          const uint32_t r0 = (w0 & 0xffffu) - unit0, r1 = (w1 & 0xffffu) - unit0;
          const uint4 v0 = r0 < RD_CHUNK ? *reinterpret_cast<const uint4*>(
                                               stage + r0 * 128 + ((sub ^ (r0 & 7)) << 4))
                                         : make_uint4(0, 0, 0, 0);
          const uint4 v1 = r1 < RD_CHUNK ? *reinterpret_cast<const uint4*>(
                                               stage + r1 * 128 + ((sub ^ (r1 & 7)) << 4))
                                         : make_uint4(0, 0, 0, 0);
          twell_axpy8(h0, v0, acc[i]);
          twell_axpy8(h1, v1, acc[i]);
        }
        for (; q < end; ++q) {
          const uint32_t w0 = __shfl_sync(gmask, aw[i], q, 8);
#if TWELL_GATED
          const float h0 = __shfl_sync(gmask, ah[i], q, 8);
#else
          const float h0 = twell_hi_bf16(w0);
#endif
          const uint32_t r0 = (w0 & 0xffffu) - unit0;
          const uint4 v0 = r0 < RD_CHUNK ? *reinterpret_cast<const uint4*>(
                                               stage + r0 * 128 + ((sub ^ (r0 & 7)) << 4))
                                         : make_uint4(0, 0, 0, 0);
          twell_axpy8(h0, v0, acc[i]);
        }
        if (end < 8 || base + 8 >= cnt) {  // the rest of the row lies past this chunk
          st[i] = ((uint32_t)cnt << 16) | ((uint32_t)base << 4) | (uint32_t)end;
          break;
        }
        // A used up: B becomes A, the window after it is loaded into B.
        aw[i] = bw[i];
#if TWELL_GATED
        ah[i] = bh[i];
#endif
        const int next = base + 16 + sub;
        if (next < cnt) {
          const long long e = (tok0 + i) * row_cap + next;
          bw[i] = entries[e];
#if TWELL_GATED
          bh[i] = h[e];
#endif
        }
        st[i] = ((uint32_t)cnt << 16) | ((uint32_t)(base + 8) << 4);
      }
    }
    __syncwarp();
    if (lane == 0) twell_mbar_arrive(empty_bar + 8 * s);
  }

  const int col = col0 + sub * 8;
  if (col < TWELL_KDIM) {
#pragma unroll
    for (int i = 0; i < TPG; ++i) {
      const long long t = tok0 + i;
      if (t < M && !heavy[t]) twell_store_bf16x8(y + t * TWELL_KDIM + col, acc[i]);
    }
  }
}
