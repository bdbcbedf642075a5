// decode_units_scan.cu — the by-unit decode route's down projection for a few tokens, by a
// scan (decode_units.cuh: the route's sums, layouts and limits): every row of
// y[t] = sum over the units n kept for t of h[t, n] * w_down_t[n], from the kept-unit
// masks and h of the gate/up kernel (decode_units_gate.cu).
//
// twell_units_down_scan64 and twell_units_down_scan128 — for up to SCAN_TOKENS tokens
// (the launcher's bound): one CTA of T = 64 or 128 threads per (32 columns of y, token)
// (grid ceil(K / 32) x M). Thread i counts the kept units of its run of the token's mask
// words ([i B, (i + 1) B), B = ceil(N / 32 / T)); a prefix sum over the CTA (a warp scan,
// then the warps' totals) gives each thread the list position of its first one, and the
// threads write the token's kept units into a shared list, which is then in ascending
// unit order whatever T (passes of SLIST entries where a token keeps more). The list is
// summed in 32 virtual slots: slot v takes positions v, v + 32, v + 64, ... in order
// (h[t, n] * w_down_t[n, cols], fp32), and the 32 slots are added by a fixed binary tree
// (v with v ^ 1, then ^ 2, ^ 4, ^ 8, ^ 16). Thread 4s + q holds columns
// [8q, 8q + 8) of the T/4 slots s, s + T/4, ... below 32 (so 1 or 2 of them); the tree's
// first three levels are xor shuffles over lane bits 2-4, the last two go through shared
// memory or stay in the thread. So the bits do not depend on T, which the launcher picks
// freely: more threads spread a token with many units over more slots, fewer keep a large
// grid (many tokens) in fewer waves.
// Against the lists kernel (decode_units_down.cu): no mask staging, no per-token list
// building by a warp, no work-unit offsets or partial sums between barriers (four barriers
// for a token that fits one pass), and its grid grows with M where that kernel groups
// tokens by eight.
//
// Layouts: masks uint32 [M, N / 32], h float [M, N] (read at the kept pairs only),
// w_down_t [N, K]; out: y [M, K].
// Limits: N % 32 == 0, N <= 65536 (16-bit unit ids in the list); static shared memory only.
// Compile-time parameter: TWELL_KDIM.

namespace units {
constexpr int SLIST = 512;  // list entries per pass (a multiple of 32)

template <int T>
__device__ __forceinline__ void down_scan(const uint32_t* __restrict__ masks,
                                          const float* __restrict__ h,
                                          const uint16_t* __restrict__ w_down_t,
                                          uint16_t* __restrict__ y, int N) {
  constexpr int SLOTS = T / 4;      // slot threads per column group
  constexpr int V = 32 / SLOTS;     // virtual slots per thread
  // entries whose loads a thread has in flight (eight at 128 threads spilled at 64 registers)
  constexpr int SE = T == 128 ? 7 : 4;
  static_assert(T == 64 || T == 128, "64 or 128 threads");
  constexpr int WARPS_ = T / 32;
  static_assert(SE % V == 0 && SE * SLOTS % 32 == 0, "a round's entries map to fixed slots");
  __shared__ uint16_t s_list[SLIST];
  __shared__ int s_warp[WARPS_];
  __shared__ float s_part[WARPS_][V][4][8];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t = blockIdx.y, col0 = blockIdx.x * 32;
  const int q = tid & 3, slot = tid >> 2;
  const int words = N / 32;
  const uint32_t* mrow = masks + (long long)t * words;
  const float* ht = h + (long long)t * N;
  const int col = col0 + 8 * q;
  const uint16_t* wcol = w_down_t + col;

  // this thread's kept units (its words: a contiguous run, so that the list, thread after
  // thread, is in ascending unit order whatever T), then their first list position: a
  // CTA prefix sum
  const int per = (words + T - 1) / T;
  const int wb = min(words, tid * per), we = min(words, wb + per);
  int mine = 0;
#pragma unroll 1
  for (int w0 = wb; w0 < we; w0 += 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mine += w0 + i < we ? __popc(__ldg(mrow + w0 + i)) : 0;
  }
  const int incl = twell_warp_prefix(mine, lane);
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int first = incl - mine, total = 0;
#pragma unroll
  for (int w = 0; w < WARPS_; ++w) {
    const int c = s_warp[w];
    if (w < warp) first += c;
    total += c;
  }

  float acc[V][8];
#pragma unroll
  for (int j = 0; j < V; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  for (int p0 = 0; p0 < total; p0 += SLIST) {
    if (first < p0 + SLIST && first + mine > p0) {  // this thread's entries in [p0, p0 + SLIST)
      int at = first;
#pragma unroll 1
      for (int w0 = wb; w0 < we; w0 += 4) {
        uint32_t mw[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) mw[i] = w0 + i < we ? __ldg(mrow + w0 + i) : 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int bits = __popc(mw[i]);
          if (at + bits > p0 && at < p0 + SLIST) {
            int a = at;
            for (uint32_t r = mw[i]; r; r &= r - 1, ++a)
              if (a >= p0 && a < p0 + SLIST)
                s_list[a - p0] = (uint16_t)((w0 + i) * 32 + __ffs(r) - 1);
          }
          at += bits;
        }
      }
    }
    __syncthreads();
    const int here = min(total - p0, SLIST);
    // entry e of a round is position e0 + e * SLOTS: virtual slot slot + (e % V) * SLOTS
    for (int e0 = slot; e0 < here; e0 += SE * SLOTS) {
      uint4 wv[SE];
      float hv[SE];
#pragma unroll
      for (int e = 0; e < SE; ++e) {  // every load of SE entries in flight at once
        const int p = e0 + e * SLOTS;
        hv[e] = 0.f;
        wv[e] = make_uint4(0u, 0u, 0u, 0u);
        if (p < here) {
          const int n = s_list[p];
          hv[e] = ht[n];
          if (col < K) wv[e] = ldg16(wcol + (long long)n * K);
        }
      }
#pragma unroll
      for (int e = 0; e < SE; ++e) twell_axpy8(hv[e], wv[e], acc[e % V]);
    }
    __syncthreads();  // the list is rebuilt by the next pass
  }
  // tree levels 1-3 (virtual slot bits 0-2 = lane bits 2-4)
#pragma unroll
  for (int d = 4; d < 32; d <<= 1) {
#pragma unroll
    for (int j = 0; j < V; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[j][i] += __shfl_xor_sync(0xffffffffu, acc[j][i], d);
  }
  if (lane < 4) {
#pragma unroll
    for (int j = 0; j < V; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) s_part[warp][j][lane][i] = acc[j][i];
  }
  __syncthreads();
  // levels 4-5: virtual slot bits 3-4 = g in 0..3, held by warp g % WARPS_, slot set g / WARPS_
  if (tid < 4 && col < K) {
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      float r[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        auto part = [&](int g) { return s_part[g % WARPS_][g / WARPS_][tid][i + c]; };
        r[c] = (part(0) + part(1)) + (part(2) + part(3));
      }
      o[i / 2] = twell_pack_bf16x2(r[0], r[1]);
    }
    *reinterpret_cast<uint4*>(y + (long long)t * K + col) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}
}  // namespace units

// at most 64 registers: a wave holds 32 warps per SM
#define TWELL_DOWN_SCAN(T)                                                                 \
  extern "C" __global__ void __launch_bounds__(T, 1024 / (T)) twell_units_down_scan##T(       \
      const uint32_t* __restrict__ masks, const float* __restrict__ h,                    \
      const uint16_t* __restrict__ w_down_t, uint16_t* __restrict__ y, int M, int N) {    \
    (void)M;                                                                               \
    twell_grid_wait();                                                                     \
    twell_grid_release();                                                                  \
    units::down_scan<T>(masks, h, w_down_t, y, N);                                         \
  }
TWELL_DOWN_SCAN(64)
TWELL_DOWN_SCAN(128)
#undef TWELL_DOWN_SCAN
