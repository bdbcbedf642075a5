// decode_units_gate.cu — the by-unit decode route's first launch (decode_units.cuh: the
// route's sums, layouts and limits): for UT tiles of 16 hidden units per CTA, the gate of
// every token, h[t, n] of the kept (token, unit) pairs and the kept-unit masks that the
// down kernels read.
//
// twell_units_gate_up — one CTA per UT tiles of 16 units (grid N / (16 UT), 8 warps; all
// M <= 8 NT tokens, so x is read once per CTA: UT > 1 for larger M; with TWELL_PRE the
// gate comes from a bf16 pre-activation [M, N] a cuBLAS GEMM wrote, its CTA's columns
// staged in shared memory, and step 1 is skipped):
//  1. the gate of its units for all M tokens on tensor cores (mma.sync m16n8k16, the
//     units as rows, the tokens as columns): the WPT = 8 / UT warps of a unit tile take
//     its 32-wide k-chunks in turn (kw, kw + WPT, ...), each lane loading 16 contiguous
//     bytes of two weight rows and of x (the same permutation of k for both operands, so
//     the dot products are exact reorderings of the plain ones; warps of different tiles
//     load the same x pieces, the later ones from L1); a tile's warp fragments are summed
//     in warp order in shared memory and rounded to bf16;
//  2. gated: the kept (token, unit) pairs listed, then their up dot products cut into
//     (pair, 256-wide slice of K) items spread over all warps, several items' loads in
//     flight per warp (fp32; per item a lane's 8 products, then an xor butterfly; a
//     pair's slices summed in K order): h[t, n] = r(g) * (x[t]·w_up[n]);
//     non-gated: h[t, n] = r(g);
//  3. masks[t, b] (uint16): bit i set when unit 16b + i is kept for token t; h[t, n] is
//     written only where the bit is set; the kept units' w_down_t rows are prefetched
//     into L2 for the down kernel.
//
// twell_units_gate_wgmma (built where TWELL_STAGES > 0; the launcher's default from 17
// to 64 tokens): the same CTAs and steps 2 and 3, step 1 on wgmma through a TMA ring of
// TWELL_STAGES stages (see the kernel).
//
// Floor (uniform p = 0.005, K = 2048, N = 5632, gated): the gate reads w_first once
// (23 MB: 6.9 µs at 3.35 TB/s; a plain kernel reading them from an H100's DRAM took
// 10.2-10.4 µs); an active unit adds 8 KB (M = 8: ~220 units, 1.8 MB).
//
// Layouts: x [M, K]; w_first, w_up, w_down_t [N, K]; pre bf16 [M, N] (TWELL_PRE: read by
// the gate/up kernel, written by the wgmma kernel); out: h float [M, N] (kept pairs only),
// masks uint16 [M, N / 16].
// Limits: 1 <= M <= 8 * TWELL_NT; N a multiple of 16 UT; static shared memory within
// 48 KB (with TWELL_PRE: UT * NT <= 64); the wgmma kernel: M <= 64, its ring in dynamic
// shared memory (decode_units.wgmma_shared_bytes).
//
// Compile-time parameters: TWELL_KDIM, TWELL_GATED, TWELL_NT (8-token column tiles: 1, 2,
// 4 or 8, and 16 or 32 with TWELL_PRE), TWELL_UT (unit tiles per CTA: 1, 2 or 4),
// TWELL_PRE (the gate read from a pre-activation instead of computed; for the wgmma
// kernel, written to one), TWELL_STAGES (the wgmma kernel's ring; 0: no wgmma kernel in
// the module); constants shared with the launcher (decode_units.py): TWELL_UNITS (16),
// TWELL_GATE_THREADS (256).

namespace units {

constexpr bool GATED = TWELL_GATED != 0;
constexpr int NT = TWELL_NT;
constexpr int TOKENS = 8 * NT;                    // most tokens of a launch
constexpr bool PRE = TWELL_PRE != 0;              // the gate given (cuBLAS), not computed
constexpr int UT = TWELL_UT;                      // m16 unit tiles per CTA
constexpr int U = TWELL_UNITS * UT;               // units per CTA
constexpr int WARPS = TWELL_GATE_THREADS / 32;    // warps of a CTA
constexpr int WPT = WARPS / UT;                   // warps per unit tile (they split K)
constexpr int CHUNKS = (K + 31) / 32;             // 32-wide k-chunks of a row
constexpr int TW = TOKENS >= 32 ? TOKENS / 32 : 1;  // 32-bit words of a token mask
constexpr int BATCH = NT == 1 ? 4 : NT == 2 ? 2 : 1;  // chunks a warp loads before its mmas
constexpr int SLICES = (K + 255) / 256;           // 256-wide slices of a row (a lane: 8)
constexpr int UP_PAIRS = 32;                      // kept pairs per round of up products
// work items a warp loads at once: six from 33 tokens (NT >= 8), so that a CTA's typical
// pairs at M = 64 (about 5 pairs x 8 slices) take one round (H100: 26.9-27.3 against
// 28.3-28.6 us per block with the weights in L2, level from DRAM; docs/history.md,
// Decode); below, four already cover a CTA's typical pairs
constexpr int UP_LOADS = NT >= 8 ? 6 : 4;

static_assert(TWELL_UNITS == 16, "a unit tile is one m16 tile of mma");
static_assert(UT == 1 || UT == 2 || UT == 4, "TWELL_UT: 1, 2 or 4 unit tiles per CTA");
static_assert(NT == 1 || NT == 2 || NT == 4 || NT == 8 || (PRE && (NT == 16 || NT == 32)),
              "TWELL_NT: 1, 2, 4 or 8 tiles of 8 tokens (16 or 32 with TWELL_PRE)");
static_assert(U * TOKENS % TWELL_GATE_THREADS == 0 || U * TOKENS < TWELL_GATE_THREADS,
              "(unit, token) pairs in whole passes of the CTA");

// relu as dense math has it: NaN passes, -Inf and negatives give +0.
__device__ __forceinline__ float relu_nan(float v) { return (v > 0.f || v != v) ? v : 0.f; }

}  // namespace units

// Steps 2 and 3 of a gate/up CTA once the gate of its U units is known: in s_g as bf16
// bits (STAGED: a pre-activation or the wgmma gate's accumulators were staged there) or
// as the warps' mma fragments in s_red (the mma gate); all TWELL_GATE_THREADS threads of
// the CTA, whose units start at n0. s_red's room holds the pair list after.
template <bool STAGED>
__device__ __forceinline__ void units_keep_and_up(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ w_up,
    const uint16_t* __restrict__ w_down_t, float* __restrict__ h, uint16_t* __restrict__ masks,
    int M, int N, int n0, float (*s_red)[units::NT][32][4], uint16_t (*s_g)[units::TOKENS],
    uint32_t (*s_tok)[units::TW]) {
  using namespace units;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  (void)w_up;
  // one thread per (unit u, token t): the sums of u's tile's warps in warp order, rounded to
  // bf16 (TWELL_PRE: the staged pre-activation); 32 consecutive (u, t) per warp and pass,
  // so a ballot gives whole words of s_tok
  for (int i = tid; i < U * TOKENS; i += TWELL_GATE_THREADS) {  // warp-uniform trip count
    const int u = i / TOKENS, t = i % TOKENS;
    const int nt = t >> 3, tt = t & 7, uu = u & 15;
    const int src = (uu & 7) * 4 + (tt >> 1), j = (uu >> 3) * 2 + (tt & 1);
    uint32_t bits;
    if constexpr (STAGED) {
      bits = s_g[u][t];
    } else {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < WPT; ++w) s += s_red[w * UT + u / 16][nt][src][j];
      bits = twell_pack_bf16x2(s, 0.f) & 0xffffu;
    }
    const float g = twell_bf16_to_float((uint16_t)bits);
    const bool kept = t < M && (twell_relu_keeps(bits) || twell_non_finite(bits));
    s_g[u][t] = (uint16_t)bits;
    const uint32_t ballot = __ballot_sync(0xffffffffu, kept);
    if constexpr (TOKENS >= 32) {
      if (lane == 0) s_tok[u][t >> 5] = ballot;
    } else if (t == 0) {
      s_tok[u][0] = (ballot >> (lane - lane % TOKENS)) & (0xffffffffu >> (32 - (TOKENS < 32 ? TOKENS : 32)));
    }
    if (!GATED && kept) h[(long long)t * N + n0 + u] = relu_nan(g);
  }
  __syncthreads();

  // ---- 3. masks: bit i of masks[t, b] for unit 16 b + i, every token; the kept units'
  // w_up rows (for step 2's later rounds) and w_down_t rows (for the down kernel) start
  // moving into L2
  for (int t = tid; t < M; t += TWELL_GATE_THREADS) {
#pragma unroll
    for (int b = 0; b < UT; ++b) {
      uint32_t m = 0;
#pragma unroll
      for (int u = 0; u < 16; ++u) m |= ((s_tok[b * 16 + u][t >> 5] >> (t & 31)) & 1u) << u;
      masks[(long long)t * (N / 16) + blockIdx.x * UT + b] = (uint16_t)m;
    }
  }
  if (tid >= TWELL_GATE_THREADS - U) {
    const int u = tid - (TWELL_GATE_THREADS - U);
    uint32_t any = 0;
#pragma unroll
    for (int w = 0; w < TW; ++w) any |= s_tok[u][w];
    if (any) {
      if constexpr (GATED) {  // the up products' rows, ahead of their loads in step 2
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w_up + (long long)(n0 + u) * K),
                     "r"((uint32_t)K * 2u) : "memory");
      }
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w_down_t + (long long)(n0 + u) * K),
                   "r"((uint32_t)K * 2u) : "memory");
    }
  }

  // ---- 2. gated: up dot products of the kept pairs. Warp 0 lists the pairs (unit-major,
  // tokens ascending; in s_red, dead by now). They are taken UP_PAIRS at a time, cut into
  // work items of (pair, 256-wide slice of K): one 16-byte load of x and of w_up per lane,
  // UP_LOADS items per warp with every load in flight, so a round costs one trip to
  // memory whatever the pairs' spread over units and tokens; a pair's slices are summed
  // in K order by one thread.
  if constexpr (GATED) {
    uint16_t* s_pairs = reinterpret_cast<uint16_t*>(&s_red[0][0][0][0]);  // u << 8 | t
    __shared__ int s_npairs;
    __shared__ float s_dot[UP_PAIRS][SLICES];
    if (warp == 0) {
      int base = 0;
      for (int u0 = 0; u0 < U; u0 += 32) {
        const int u = u0 + lane;
        int c = 0;
        if (u < U) {
#pragma unroll
          for (int w = 0; w < TW; ++w) c += __popc(s_tok[u][w]);
        }
        int incl = c;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int o = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += o;
        }
        int pos = base + incl - c;
        if (u < U) {
          for (int w = 0; w < TW; ++w) {
            for (uint32_t rest = s_tok[u][w]; rest; rest &= rest - 1)
              s_pairs[pos++] = (uint16_t)((u << 8) | (w * 32 + __ffs(rest) - 1));
          }
        }
        base += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) s_npairs = base;
    }
    __syncthreads();
    const int npairs = s_npairs;
    const uint4 none = make_uint4(0u, 0u, 0u, 0u);
    for (int p0 = 0; p0 < npairs; p0 += UP_PAIRS) {
      const int here = min(UP_PAIRS, npairs - p0), items = here * SLICES;
      for (int i0 = warp; i0 < items; i0 += WARPS * UP_LOADS) {
        uint4 xa[UP_LOADS], wa[UP_LOADS];
#pragma unroll
        for (int j = 0; j < UP_LOADS; ++j) {
          const int it = i0 + j * WARPS, k = (it % SLICES) * 256 + lane * 8;
          xa[j] = none;
          wa[j] = none;
          if (it < items && k < K) {
            const uint32_t pr = s_pairs[p0 + it / SLICES];
            xa[j] = ldg16(x + (long long)(pr & 255u) * K + k);
            wa[j] = ldg16(w_up + (long long)(n0 + (int)(pr >> 8)) * K + k);
          }
        }
#pragma unroll
        for (int j = 0; j < UP_LOADS; ++j) {
          float v = twell_dot8(xa[j], wa[j], 0.f);
#pragma unroll
          for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
          const int it = i0 + j * WARPS;
          if (lane == 0 && it < items) s_dot[it / SLICES][it % SLICES] = v;
        }
      }
      __syncthreads();
      for (int p = tid; p < here; p += TWELL_GATE_THREADS) {
        float v = 0.f;
#pragma unroll
        for (int sl = 0; sl < SLICES; ++sl) v += s_dot[p][sl];
        const uint32_t pr = s_pairs[p0 + p];
        const int u = (int)(pr >> 8), t = (int)(pr & 255u);
        h[(long long)t * N + n0 + u] = relu_nan(twell_bf16_to_float(s_g[u][t])) * v;
      }
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------- gate and up
// Launch bound: two CTAs per SM from four 8-token tiles (the tensor-core gate's registers),
// three below and for the cuBLAS gate from eight tiles: its six up loads then take 80
// registers (without this bound ~118: two CTAs per SM, a second wave of its 352-CTA grid;
// with four loads it took 63, four CTAs per SM).
#define TWELL_GATE_MIN_CTAS (TWELL_NT >= 4 && !(TWELL_PRE && TWELL_NT >= 8) ? 2 : 3)
extern "C" __global__ void __launch_bounds__(TWELL_GATE_THREADS, TWELL_GATE_MIN_CTAS)
twell_units_gate_up(const uint16_t* __restrict__ x,         // [M, K]
                    const uint16_t* __restrict__ w_first,   // [N, K]
                    const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                    const uint16_t* __restrict__ w_down_t,  // [N, K] (prefetched into L2)
                    const uint16_t* __restrict__ pre,       // [M, N] gate (TWELL_PRE only)
                    float* __restrict__ h,                  // [M, N] out (kept pairs)
                    uint16_t* __restrict__ masks,           // [M, N / 16] out
                    int M, int N) {
  using namespace units;
  twell_grid_wait();  // with TWELL_PRE, launched after the gate GEMM (compile.launch_after)
  twell_grid_release();  // the down kernel's CTAs may take SMs as they free up
  // the warps' gate fragments (TWELL_PRE: room for the pair list of step 2 only)
  __shared__ float s_red[PRE ? (UT + 1) / 2 : WARPS][NT][32][4];
  (void)pre;
  __shared__ uint16_t s_g[U][TOKENS];  // the gate, bf16 bits
  __shared__ uint32_t s_tok[U][TW];  // bit t % 32 of word t / 32: unit kept for token t
  static_assert(sizeof(s_red) + sizeof(s_g) + sizeof(s_tok) + 4 * UP_PAIRS * SLICES + 16 <=
                    48 * 1024,
                "static shared memory (TWELL_PRE: UT * NT <= 64)");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int n0 = blockIdx.x * U;
  const int ut = warp % UT, kw = warp / UT;  // this warp's unit tile and share of K
  const uint16_t* ra = w_first + (long long)(n0 + ut * 16 + grp) * K;  // rows grp, grp + 8
  const uint16_t* rb = ra + 8LL * K;
  const uint16_t* xr[NT];
  bool xv[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int t = nt * 8 + grp;
    xv[nt] = t < M;
    xr[nt] = x + (long long)(xv[nt] ? t : 0) * K;
  }

  // ---- 1. gate: UT tiles of 16 units x TOKENS tokens; the WPT warps of a tile take its
  // 32-wide chunks of K in turn (kw, kw + WPT, ...). TWELL_PRE: read from pre instead.
  if constexpr (!PRE) {
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int c0 = kw; c0 < CHUNKS; c0 += WPT * BATCH) {
      uint4 a[BATCH], b[BATCH], xx[BATCH][NT];
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int k0 = (c0 + i * WPT) * 32 + tig * 8;
        const bool ok = k0 < K;  // K % 8 == 0: a lane's 8 columns are all in or all out
        a[i] = ok ? ldg16(ra + k0) : zero;
        b[i] = ok ? ldg16(rb + k0) : zero;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) xx[i][nt] = ok && xv[nt] ? ldg16(xr[nt] + k0) : zero;
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          // logical k 2tig, 2tig+1, 2tig+8, 2tig+9 <-> columns k0 .. k0+3, then k0+4 .. k0+7
          twell_mma_bf16(acc[nt], a[i].x, b[i].x, a[i].y, b[i].y, xx[i][nt].x, xx[i][nt].y);
          twell_mma_bf16(acc[nt], a[i].z, b[i].z, a[i].w, b[i].w, xx[i][nt].z, xx[i][nt].w);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) s_red[warp][nt][lane][j] = acc[nt][j];
    __syncthreads();
  }

  if constexpr (PRE) {
    // the CTA's U columns of pre for every token into s_g, every 16-byte load in flight
    constexpr int PIECES = U / 8;  // 16-byte pieces of a token's columns
    constexpr int STEPS = (TOKENS * PIECES + TWELL_GATE_THREADS - 1) / TWELL_GATE_THREADS;
    uint4 v[STEPS];
#pragma unroll
    for (int j = 0; j < STEPS; ++j) {
      const int i = tid + j * TWELL_GATE_THREADS, t = i / PIECES;
      v[j] = make_uint4(0u, 0u, 0u, 0u);
      if (t < M) v[j] = ldg16(pre + (long long)t * N + n0 + (i % PIECES) * 8);
    }
#pragma unroll
    for (int j = 0; j < STEPS; ++j) {
      const int i = tid + j * TWELL_GATE_THREADS, t = i / PIECES, p = i % PIECES;
      if (t < TOKENS) {
        const uint32_t w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int e = 0; e < 8; ++e) s_g[p * 8 + e][t] = (uint16_t)(w[e / 2] >> (16 * (e % 2)));
      }
    }
    __syncthreads();
  }

  static_assert(U * TOKENS * 2 <= sizeof(s_red), "the pair list fits in s_red");
  units_keep_and_up<PRE>(x, w_up, w_down_t, h, masks, M, N, n0, s_red, s_g, s_tok);
}

// ---------------------------------------------------------------------- wgmma gate
#if TWELL_STAGES > 0
namespace units {
constexpr int WG_STAGES = TWELL_STAGES;
constexpr int WG_A = 64 * 128;           // a stage's x tile: 64 tokens x 64 k, bf16
constexpr int WG_B = U * 128;            // its w_first box: U units x 64 k
constexpr int WG_STAGE = WG_A + WG_B;    // 1024-byte multiples: every box swizzle-aligned
constexpr int WG_KB = (K + 63) / 64;     // 64-wide k-blocks (TMA fills past K with zeros)
static_assert(TOKENS <= 64 && (U == 16 || U == 32 || U == 64), "wgmma gate geometry");
static_assert(TWELL_GATE_THREADS == 256, "one consumer warpgroup, a producer warp, three more");

// d += A (64 x 16, K-major, smem) * B (N x 16, K-major, smem)^T, fp32 accumulators in the
// wgmma layout (N / 2 a thread); for the unit counts of a wgmma gate CTA.
template <int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b);
template <>
__device__ __forceinline__ void wgmma_m64k16<16>(float (&d)[8], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_m64k16<32>(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_m64k16<64>(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

}  // namespace units

// twell_units_gate_wgmma — the gate/up kernel with its gate on wgmma: one CTA per U units
// (grid N / U), every token (at most 64: the wgmma's 64 rows). Warp 4's lane 0 streams
// boxes of x [R x 64] and w_first [U x 64] through a TWELL_STAGES-deep TMA ring (128-byte
// swizzle, mbarriers); warpgroup 0 (warps 0-3) runs wgmma.m64nUk16 over it, fp32
// accumulators in registers, and rounds them to bf16 into s_g; then steps 2 and 3 as
// twell_units_gate_up's, by all eight warps. With TWELL_PRE it writes the gate to
// pre [M, N] instead and stops (a measurement build: twell_units_gate_up reads it).
// x's box is its M rows: TMA fills rows past a tensor's end with zeros, and slowly (an
// H100 streamed the gate at M = 1 slower than at M = 64 with 64-row boxes); the wgmma
// tile's rows past M hold whatever the ring held (their outputs are never read).
// x and w_first come as TMA maps (gate_gemm.tensor_map, boxes of M and U rows).
extern "C" __global__ void __launch_bounds__(TWELL_GATE_THREADS, 1)
twell_units_gate_wgmma(const __grid_constant__ TwellTmaDesc map_x,  // x [M, K], box M x 64
                    const __grid_constant__ TwellTmaDesc map_w,  // w_first [N, K], box U x 64
                    const uint16_t* __restrict__ x,         // [M, K] (the up products)
                    const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                    const uint16_t* __restrict__ w_down_t,  // [N, K] (prefetched into L2)
                    uint16_t* __restrict__ pre,             // [M, N] gate out (TWELL_PRE)
                    float* __restrict__ h,                  // [M, N] out (kept pairs)
                    uint16_t* __restrict__ masks,           // [M, N / 16] out
                    int M, int N) {
  using namespace units;
  twell_grid_wait();  // launched as usual: returns at once
  twell_grid_release();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = twell_smem_addr(smem_raw);
  const uint32_t ring = (raw + 1023u) & ~1023u;  // 1024-aligned (the swizzle's atoms)
  const uint32_t full_bar = ring + WG_STAGES * WG_STAGE, empty_bar = full_bar + 8 * WG_STAGES;
  __shared__ float s_red[(UT + 1) / 2][NT][32][4];  // room for the pair list
  __shared__ uint16_t s_g[U][TOKENS];
  __shared__ uint32_t s_tok[U][TW];
  static_assert(U * TOKENS * 2 <= sizeof(s_red), "the pair list fits in s_red");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n0 = blockIdx.x * U;
  (void)pre;

  if (tid == 0) {
    for (int st = 0; st < WG_STAGES; ++st) {
      twell_mbar_init(full_bar + 8 * st, 1);
      twell_mbar_init(empty_bar + 8 * st, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 4) {
    if (lane == 0) {  // the producer
      const uint32_t bytes = (uint32_t)(M * 128 + WG_B);
      for (int kb = 0; kb < WG_KB; ++kb) {
        const int st = kb % WG_STAGES;
        if (kb >= WG_STAGES) twell_mbar_wait(empty_bar + 8 * st, ((kb / WG_STAGES) - 1) & 1);
        const uint32_t a = ring + st * WG_STAGE;
        twell_mbar_expect_tx(full_bar + 8 * st, bytes);
        twell_tma_load_2d(a, &map_x, kb * 64, 0, full_bar + 8 * st);
        twell_tma_load_2d(a + WG_A, &map_w, kb * 64, n0, full_bar + 8 * st);
      }
    }
  } else if (warp < 4) {  // the consumer warpgroup
    float d[U / 2];
#pragma unroll
    for (int i = 0; i < U / 2; ++i) d[i] = 0.f;
    twell_wgmma_fence_regs(d);
    for (int kb = 0; kb < WG_KB; ++kb) {
      const int st = kb % WG_STAGES;
      twell_mbar_wait(full_bar + 8 * st, (kb / WG_STAGES) & 1);
      const uint32_t a = ring + st * WG_STAGE, b = a + WG_A;
      twell_wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_m64k16<U>(d, twell_wgmma_desc(a + 32 * k), twell_wgmma_desc(b + 32 * k));
      twell_wgmma_commit();
      twell_wgmma_wait<1>();  // the previous stage's wgmma has retired: hand its stage back
      if (kb > 0 && tid == 0) twell_mbar_arrive(empty_bar + 8 * ((kb - 1) % WG_STAGES));
    }
    twell_wgmma_wait<0>();
    twell_wgmma_fence_regs(d);
    // this thread holds tokens r and r + 8 (r = 16 warp + lane / 4), units
    // 8j + 2 (lane % 4) + {0, 1}: the wgmma accumulator layout
    const int r = 16 * warp + lane / 4;
#pragma unroll
    for (int j = 0; j < U / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int u = 8 * j + 2 * (lane % 4) + e;
        if (r < TOKENS) s_g[u][r] = (uint16_t)(twell_pack_bf16x2(d[4 * j + e], 0.f) & 0xffffu);
        if (r + 8 < TOKENS)
          s_g[u][r + 8] = (uint16_t)(twell_pack_bf16x2(d[4 * j + 2 + e], 0.f) & 0xffffu);
      }
    }
  }
  __syncthreads();
  if constexpr (PRE) {  // the measurement build: the gate out, row by row
    for (int i = tid; i < M * U; i += TWELL_GATE_THREADS)
      pre[(long long)(i / U) * N + n0 + i % U] = s_g[i % U][i / U];
    return;
  }
  units_keep_and_up<true>(x, w_up, w_down_t, h, masks, M, N, n0, s_red, s_g, s_tok);
}
#endif
