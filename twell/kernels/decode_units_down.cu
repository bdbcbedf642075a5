// decode_units_down.cu — the by-unit decode route's down projection by lists of token
// groups (decode_units.cuh: the route's sums, layouts and limits): every row of
// y[t] = sum over the units n kept for t of h[t, n] * w_down_t[n], from the kept-unit
// masks and h of the gate/up kernel (decode_units_gate.cu).
//
// twell_units_down — one CTA per DC columns of y and 8 NT tokens (grid ceil(K / DC) x
// ceil(M / (8 NT)), 8 warps; the launcher takes NT for at most 8 tokens, so a CTA's
// serial steps stay short): the masks of its tokens into shared memory (as uint32: 32
// units per word); each token's kept units listed in ascending order (passes of LIST
// units when a token keeps more). The work of a pass is cut into work units of (token,
// CHP = 8 * JW consecutive list entries, 8 columns), so a token with many units spreads
// over many lanes: JW lanes take a work unit, lane j summing entries j, j + JW, ... of it
// (at most 8, every load in flight at once; h[t, n] * w_down_t[n, cols], fp32), then an
// xor butterfly over the JW lanes into shared memory; one thread per (token, 8 columns)
// adds the work units in order into its accumulator. Every row of y is written.
//
// Layouts: masks uint32 [M, N / 32] (16-byte aligned base), h float [M, N] (read at the
// kept pairs only), w_down_t [N, K]; out: y [M, K].
// Limits: N % 32 == 0, N <= 65536 (16-bit unit ids in the lists); the dynamic shared
// memory holds the partials, accumulators and lists, then min(M, 8 NT) * (N / 32) * 4
// bytes of masks (decode_units.down_shared_bytes; the launcher keeps it within an SM's
// and takes NT <= 8).
//
// Compile-time parameters: TWELL_KDIM, TWELL_NT (8-token tiles per CTA: a power of two up
// to 32), TWELL_DC (columns of y per CTA, a multiple of 8); constants shared with the
// launcher (decode_units.py): TWELL_DOWN_THREADS (256), TWELL_DOWN_LANES (4), TWELL_LIST
// (512).

namespace units {

constexpr int NT = TWELL_NT;
constexpr int TOKENS = 8 * NT;                    // most tokens of a CTA
constexpr int DTHREADS = TWELL_DOWN_THREADS;
constexpr int DCOLS = TWELL_DC;                   // columns of y per down CTA
constexpr int DCHUNKS = DCOLS / 8;                // 8-column pieces of a slice
constexpr int LIST = TWELL_LIST;                  // list entries per token per pass
constexpr int JW = TWELL_DOWN_LANES;              // lanes of a down work unit
constexpr int PB = 8;                             // pairs per lane of a work unit
constexpr int CHP = JW * PB;                      // pairs per work unit
constexpr int WU_MAX = TOKENS * (LIST / CHP) * DCHUNKS;  // work units of a pass, at most

static_assert(NT == 1 || NT == 2 || NT == 4 || NT == 8 || NT == 16 || NT == 32,
              "TWELL_NT: 1, 2, 4, 8, 16 or 32 tiles of 8 tokens");
static_assert(DCOLS % 8 == 0 && DTHREADS % 32 == 0 && 32 % JW == 0, "down kernel geometry");
static_assert(LIST % CHP == 0, "down kernel geometry");

}  // namespace units

extern "C" __global__ void __launch_bounds__(TWELL_DOWN_THREADS, 2)
twell_units_down(const uint32_t* __restrict__ masks,     // [M_all, N / 32] (the uint16 pairs)
                 const float* __restrict__ h,            // [M_all, N] (kept pairs)
                 const uint16_t* __restrict__ w_down_t,  // [N, K]
                 uint16_t* __restrict__ y,               // [M_all, K] out (every row)
                 int M_all, int N) {
  using namespace units;
  twell_grid_wait();  // launched after the gate/up kernel (compile.launch_after)
  twell_grid_release();
  // this CTA's tokens: TOKENS of them from t0 (grid.y = ceil(M_all / TOKENS))
  const int t0 = blockIdx.y * TOKENS;
  const int M = min(M_all - t0, TOKENS);
  masks += (long long)t0 * (N / 32);  // 16-byte aligned: t0 * N / 8 bytes, N % 32 == 0
  h += (long long)t0 * N;
  y += (long long)t0 * K;
  extern __shared__ __align__(16) unsigned char smem[];
  float* s_part = reinterpret_cast<float*>(smem);                  // [WU_MAX][8]
  float* s_acc = s_part + WU_MAX * 8;                               // [TOKENS][DCHUNKS][8]
  uint16_t* s_list = reinterpret_cast<uint16_t*>(s_acc + TOKENS * DCHUNKS * 8);  // [TOKENS][LIST]
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_list + TOKENS * LIST);       // [M][words]
  __shared__ int s_cnt[TOKENS];
  __shared__ int s_wuoff[TOKENS + 1];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int words = N / 32;
  const int total = M * words;
  // every 16-byte piece of the masks in flight at once (cp.async), the tail word by word
  const int pieces = total / 4;
  for (int i = tid; i < pieces; i += DTHREADS) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(s_mask + 4 * i);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(masks + 4 * i)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  for (int i = 4 * pieces + tid; i < total; i += DTHREADS) s_mask[i] = __ldg(masks + i);
  for (int i = tid; i < TOKENS * DCHUNKS * 8; i += DTHREADS) s_acc[i] = 0.f;
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  for (int t = warp; t < M; t += DTHREADS / 32) {
    int c = 0;
    for (int w = lane; w < words; w += 32) c += __popc(s_mask[t * words + w]);
    c = (int)__reduce_add_sync(0xffffffffu, (unsigned)c);
    if (lane == 0) s_cnt[t] = c;
  }
  __syncthreads();
  int most = 0;
  for (int t = 0; t < M; ++t) most = max(most, s_cnt[t]);

  for (int p0 = 0; p0 < most; p0 += LIST) {
    // token tt's kept units with list positions [p0, p0 + LIST), ascending
    for (int tt = warp; tt < M; tt += DTHREADS / 32) {
      int run = 0;
      for (int w0 = 0; w0 < words && run < p0 + LIST; w0 += 32) {
        const int w = w0 + lane;
        const uint32_t m = w < words ? s_mask[tt * words + w] : 0u;
        const int mine = __popc(m);
        int incl = mine;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int o = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += o;
        }
        int pos = run + incl - mine;
        if (pos + mine > p0 && pos < p0 + LIST) {
          for (uint32_t r = m; r; r &= r - 1, ++pos)
            if (pos >= p0 && pos < p0 + LIST)
              s_list[tt * LIST + pos - p0] = (uint16_t)(w * 32 + __ffs(r) - 1);
        }
        run += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    if (tid == 0) {  // work units: token-major, then chunk of CHP pairs, then 8 columns
      int off = 0;
      for (int t = 0; t < M; ++t) {
        s_wuoff[t] = off;
        const int here = min(max(s_cnt[t] - p0, 0), LIST);
        off += (here + CHP - 1) / CHP * DCHUNKS;
      }
      s_wuoff[M] = off;
    }
    __syncthreads();

    const int W = s_wuoff[M];
    for (int w0 = 0; w0 < W; w0 += DTHREADS / JW) {
      const int wu = w0 + tid / JW, jl = tid % JW;
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
      if (wu < W) {
        int t = 0;
        while (s_wuoff[t + 1] <= wu) ++t;
        const int r = wu - s_wuoff[t], j = r / DCHUNKS;
        const int col = blockIdx.x * DCOLS + (r % DCHUNKS) * 8;
        const int here = min(s_cnt[t] - p0, LIST);
        if (col < K) {
          const uint16_t* list = s_list + t * LIST;
          const float* ht = h + (long long)t * N;
          uint4 wv[PB];
          float hv[PB];
#pragma unroll
          for (int i = 0; i < PB; ++i) {  // one batch: every load in flight at once
            const int p = j * CHP + jl + i * JW;
            if (p < here) {
              const int n = list[p];
              hv[i] = ht[n];
              wv[i] = ldg16(w_down_t + (long long)n * K + col);
            } else {
              hv[i] = 0.f;
              wv[i] = make_uint4(0u, 0u, 0u, 0u);
            }
          }
#pragma unroll
          for (int i = 0; i < PB; ++i) twell_axpy8(hv[i], wv[i], v);
        }
      }
#pragma unroll
      for (int d = 1; d < JW; d <<= 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], d);
      }
      if (wu < W && jl == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) s_part[wu * 8 + i] = v[i];
      }
    }
    __syncthreads();
    // this pass's chunks into the accumulators, in chunk order
    for (int q = tid; q < M * DCHUNKS; q += DTHREADS) {
      const int t = q / DCHUNKS, c = q % DCHUNKS;
      const int chunks = (s_wuoff[t + 1] - s_wuoff[t]) / DCHUNKS;
      float* acc = s_acc + q * 8;
      for (int j = 0; j < chunks; ++j) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += s_part[(s_wuoff[t] + j * DCHUNKS + c) * 8 + i];
      }
    }
    __syncthreads();  // lists, work units and partials are rebuilt by the next pass
  }
  for (int q = tid; q < M * DCHUNKS; q += DTHREADS) {
    const int t = q / DCHUNKS;
    const int col = blockIdx.x * DCOLS + (q % DCHUNKS) * 8;
    if (col < K) {
      const float* a = s_acc + q * 8;
      uint4 o;
      o.x = twell_pack_bf16x2(a[0], a[1]);
      o.y = twell_pack_bf16x2(a[2], a[3]);
      o.z = twell_pack_bf16x2(a[4], a[5]);
      o.w = twell_pack_bf16x2(a[6], a[7]);
      *reinterpret_cast<uint4*>(y + (long long)t * K + col) = o;
    }
  }
}
