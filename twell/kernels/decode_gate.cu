// decode_gate.cu — the gate and up stage of the by-unit decode route (decode_units.cu)
// with x resident in shared memory: one CTA per SM, each loading its slice of x once and
// streaming the w_first rows of a contiguous range of units past it.
//
// It writes what twell_units_gate_up writes, for twell_units_down to read:
//   h[t, n] = r(g[t,n]) * (x[t]·w_up[n])   (gated)   or  r(g[t,n])   (non-gated),
//   only where unit n is kept for token t;
//   masks: bit i of byte o of row t set when unit 8 o + i is kept for token t (the
//   little-endian bytes of decode_units.cu's uint16 [M, N / 16] masks);
//   g[t,n] = bf16(x[t]·w_first[n]); kept: relu keeps the bf16 bits, or they are non-finite.
//
// Why (K = 2048, N = 5632, M = 64, H100): twell_units_gate_up reads x from L2 once per CTA
// (352 CTAs x 256 KB) and waits on one 32-wide k-chunk of loads at a time, so above 24
// tokens the route gave its gate to cuBLAS and a third launch did the up products. Here
// x is read from L2 once per SM, the weight rows stream with two batches of loads in
// flight per warp, and the up products follow in the same launch.
//
// Geometry: a thread-block cluster of KSPLIT CTAs (__cluster_dims__) owns a contiguous
// range of 8-unit octets (cluster c of G: octets [c O / G, (c + 1) O / G), O = N / 8), cut
// into tiles of 16 units (the last may hold 8); CTA r of the cluster owns the k-slice
// [r KS, (r + 1) KS), KS = K / KSPLIT, and holds x[:, slice] for all TOKENS tokens in
// shared memory (rows padded so that a warp's 16-byte reads are conflict-free).
//  1. gate: the 8 warps split each tile's slice into contiguous runs of 32-wide k-chunks;
//     a warp's loads of the next step (CB chunks of its two rows) are issued before it
//     computes the current one (mma.sync m16n8k16, units as rows, tokens as columns, the
//     operands' k permuted alike as in decode_units.cu); at a tile's end the warps'
//     fragments are summed in warp order into the CTA's partial gate of the tile;
//  2. exchange (cluster barrier): every CTA sums the KSPLIT partials in rank order (DSMEM),
//     so all CTAs of a cluster hold the same bf16 gate; kept bits per (unit, token);
//  3. masks (rank 0) and non-gated h; an L2 prefetch of the kept units' w_down_t rows
//     (units split among the ranks; gated: after the up products' loads are issued);
//  4. gated: the kept pairs listed (unit-major, tokens ascending); each CTA computes its
//     slice of every pair's up dot product (a warp per pair, UPB pairs' loads in flight,
//     x from shared memory), then after a cluster barrier rank r sums the slices of the
//     pairs p with p % KSPLIT == r in rank order and writes h; a last cluster barrier
//     keeps every CTA's shared memory alive until its peers have read it.
//
// Determinism: every sum runs in an order fixed by K, N, M, the grid and the data: the
// same bits run to run (the launcher fixes the grid by the device's SM count).
//
// Layouts (row-major, bf16 as uint16 bits): x [M, K]; w_first, w_up, w_down_t [N, K];
// h float [M, N]; masks uint8 [M, N / 8]; rows 16-byte aligned.
// Limits: K = TWELL_KDIM with (K / TWELL_KSPLIT) % 256 == 0; N % 32 == 0 (whole octets,
// 16-unit mask words); 1 <= M <= 8 TWELL_NT <= 64; a cluster's tiles at most `maxt` <= 8
// (the launcher's bound, decode_units.resident_geometry, which also sizes the dynamic
// shared memory: decode_units.resident_shared_bytes).
//
// Compile-time parameters: TWELL_KDIM, TWELL_GATED, TWELL_NT (tiles of 8 tokens: 1, 2, 4
// or 8), TWELL_KSPLIT (CTAs of a cluster: 1, 2 or 4); constant TWELL_RESIDENT_THREADS (256).

namespace resident {

constexpr int K = TWELL_KDIM;
constexpr bool GATED = TWELL_GATED != 0;
constexpr int NT = TWELL_NT;
constexpr int TOKENS = 8 * NT;
constexpr int KSPLIT = TWELL_KSPLIT;
constexpr int KS = K / KSPLIT;                      // this CTA's slice of K
constexpr int THREADS = TWELL_RESIDENT_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int CPW = KS / 32 / WARPS;                // 32-wide chunks per warp and tile
constexpr int CB = CPW % 4 == 0 ? 4 : CPW % 2 == 0 ? 2 : 1;  // chunks per step
constexpr int SPT = CPW / CB;                       // steps per tile
constexpr int XS = KS + (KS % 64 == 0 ? 32 : 0);    // x row stride (bf16): 64 mod 128 bytes
constexpr int TW = TOKENS >= 32 ? TOKENS / 32 : 1;  // 32-bit words of a unit's token bits
constexpr int LP = KS / 256;                        // a lane's 16-byte pieces of a slice row
constexpr int UPB = LP >= 16 ? 1 : 16 / LP;         // pairs a warp loads at once
constexpr int LANES_PER_WORD = TOKENS >= 32 ? 8 : TOKENS / 4;  // lanes holding a word's bits

static_assert(NT == 1 || NT == 2 || NT == 4 || NT == 8, "TWELL_NT: 1, 2, 4 or 8");
static_assert(KSPLIT == 1 || KSPLIT == 2 || KSPLIT == 4, "TWELL_KSPLIT: 1, 2 or 4");
static_assert(KS * KSPLIT == K && KS % 256 == 0, "K / TWELL_KSPLIT a multiple of 256");
static_assert(THREADS == 256, "eight warps");

__device__ __forceinline__ uint4 ldg16(const uint16_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
// relu as dense math has it: NaN passes, -Inf and negatives give +0.
__device__ __forceinline__ float relu_nan(float v) { return (v > 0.f || v != v) ? v : 0.f; }

// The float4 at shared-window address `local` in CTA `rank`'s shared memory (DSMEM).
__device__ __forceinline__ float4 ld_remote_f4(uint32_t local, uint32_t rank) {
  uint32_t remote;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
__device__ __forceinline__ float ld_remote_f32(uint32_t local, uint32_t rank) {
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ void cluster_sync() {
  if constexpr (KSPLIT > 1) {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
  } else {
    __syncthreads();
  }
}

}  // namespace resident

#if TWELL_KSPLIT > 1
#define TWELL_RESIDENT_CLUSTER __cluster_dims__(TWELL_KSPLIT, 1, 1)
#else
#define TWELL_RESIDENT_CLUSTER
#endif

extern "C" __global__ void TWELL_RESIDENT_CLUSTER
__launch_bounds__(TWELL_RESIDENT_THREADS, 1)
twell_units_gate_resident(const uint16_t* __restrict__ x,         // [M, K]
                          const uint16_t* __restrict__ w_first,   // [N, K]
                          const uint16_t* __restrict__ w_up,      // [N, K] (gated only)
                          const uint16_t* __restrict__ w_down_t,  // [N, K] (L2 prefetch)
                          float* __restrict__ h,                  // [M, N] out (kept pairs)
                          uint8_t* __restrict__ masks,            // [M, N / 8] out
                          int M, int N, int maxt) {
  using namespace resident;
  (void)w_up;
  extern __shared__ __align__(16) unsigned char smem[];
  const int cells = maxt * 16 * TOKENS;  // (unit, token) cells of the cluster, at most
  uint16_t* s_x = reinterpret_cast<uint16_t*>(smem);                    // [TOKENS][XS]
  float* s_part = reinterpret_cast<float*>(smem + TOKENS * XS * 2);    // [WARPS][NT][32][4]
  float* s_gate = s_part + WARPS * NT * 32 * 4;  // [cells]: this CTA's partial gate
  uint16_t* s_g = reinterpret_cast<uint16_t*>(s_gate + cells);  // [cells]: the gate, bf16
  uint32_t* s_tok = reinterpret_cast<uint32_t*>(s_g + cells);   // [maxt * 16][TW]
  uint16_t* s_pairs = reinterpret_cast<uint16_t*>(s_part);  // after the gate: u << 8 | t
  float* s_up = s_gate;  // after the exchange: this CTA's slice of each pair's up product
  __shared__ int s_npairs;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const uint32_t rank = KSPLIT == 1 ? 0u : twell_cluster_rank();
  const int cluster = KSPLIT == 1 ? (int)blockIdx.x : (int)twell_cluster_index();
  const int clusters = KSPLIT == 1 ? (int)gridDim.x : (int)twell_cluster_count();
  const int octets = N / 8;
  const int o0 = (int)((long long)cluster * octets / clusters);
  const int o1 = (int)((long long)(cluster + 1) * octets / clusters);
  const int n0 = o0 * 8, nunits = (o1 - o0) * 8;
  const int ntiles = (nunits + 15) / 16;
  const int kbeg = (int)rank * KS;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  // ---- 1. gate. Step s: tile s / SPT, this warp's chunks [warp CPW + (s % SPT) CB, + CB).
  auto load_step = [&](uint4 (&a)[CB], uint4 (&b)[CB], int s) {
    const int tile = s / SPT, q = s % SPT;
    const int r0 = tile * 16 + grp;
    const bool v0 = r0 < nunits, v1 = r0 + 8 < nunits;
    const uint16_t* ra = w_first + (long long)(n0 + (v0 ? r0 : 0)) * K + kbeg + tig * 8;
    const uint16_t* rb = w_first + (long long)(n0 + (v1 ? r0 + 8 : 0)) * K + kbeg + tig * 8;
#pragma unroll
    for (int i = 0; i < CB; ++i) {
      const int k = (warp * CPW + q * CB + i) * 32;
      a[i] = v0 ? ldg16(ra + k) : zero;
      b[i] = v1 ? ldg16(rb + k) : zero;
    }
  };
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
  const uint32_t x_base = twell_smem_addr(s_x) + (uint32_t)(grp * XS + tig * 8) * 2u;
  auto mma_step = [&](const uint4 (&a)[CB], const uint4 (&b)[CB], int s) {
    const int q = s % SPT;
#pragma unroll
    for (int i = 0; i < CB; ++i) {
      const uint32_t kl = (uint32_t)(warp * CPW + q * CB + i) * 64u;  // bytes
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 xx = twell_lds128(x_base + (uint32_t)(nt * 8 * XS) * 2u + kl);
        // logical k 2tig, 2tig+1, 2tig+8, 2tig+9 <-> columns k0 .. k0+3, then k0+4 .. k0+7
        twell_mma_bf16(acc[nt], a[i].x, b[i].x, a[i].y, b[i].y, xx.x, xx.y);
        twell_mma_bf16(acc[nt], a[i].z, b[i].z, a[i].w, b[i].w, xx.z, xx.w);
      }
    }
  };
  // a tile's last step: the warps' fragments summed in warp order into s_gate
  auto finish_tile = [&](int s) {
    if (s % SPT != SPT - 1) return;  // uniform over the CTA
    const int tile = s / SPT;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      *reinterpret_cast<float4*>(s_part + ((warp * NT + nt) * 32 + lane) * 4) =
          make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
    }
    __syncthreads();
    for (int i = tid; i < 16 * TOKENS; i += THREADS) {
      const int u = i / TOKENS, t = i % TOKENS;
      const int nt = t >> 3, tt = t & 7;
      const int src = (u & 7) * 4 + (tt >> 1), j = (u >> 3) * 2 + (tt & 1);
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += s_part[((w * NT + nt) * 32 + src) * 4 + j];
      s_gate[tile * 16 * TOKENS + i] = v;
    }
    __syncthreads();
  };

  const int steps = ntiles * SPT;
  uint4 a0[CB], b0[CB], a1[CB], b1[CB];
  if (steps > 0) load_step(a0, b0, 0);
  if (steps > 1) load_step(a1, b1, 1);
  {  // x[:, slice] into shared memory (rows of absent tokens zero) while those loads fly
    constexpr int PIECES = KS / 8;
    for (int i = tid; i < TOKENS * PIECES; i += THREADS) {
      const int t = i / PIECES, p = i % PIECES;
      uint16_t* dst = s_x + t * XS + p * 8;
      if (t < M) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(twell_smem_addr(dst)),
                     "l"(x + (long long)t * K + kbeg + p * 8)
                     : "memory");
      } else {
        *reinterpret_cast<uint4*>(dst) = zero;
      }
    }
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
    __syncthreads();
  }
  for (int s = 0; s < steps; s += 2) {
    mma_step(a0, b0, s);
    if (s + 2 < steps) load_step(a0, b0, s + 2);
    finish_tile(s);
    if (s + 1 < steps) {
      mma_step(a1, b1, s + 1);
      if (s + 3 < steps) load_step(a1, b1, s + 3);
      finish_tile(s + 1);
    }
  }

  // ---- 2. exchange: the gate of every cell, the ranks' partials summed in rank order;
  // a thread takes 4 consecutive tokens of a unit, every load of a round in flight.
  cluster_sync();
  const int used = ntiles * 16 * TOKENS;  // a multiple of 128
  {
    constexpr int R = 4;  // rounds of float4s in flight per thread
    const uint32_t gate_base = twell_smem_addr(s_gate);
    for (int g0 = 0; g0 < used; g0 += THREADS * 4 * R) {
      float4 v[R];
#pragma unroll
      for (int r = 0; r < R; ++r) v[r] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int q = 0; q < KSPLIT; ++q) {
        float4 p[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int i = g0 + (r * THREADS + tid) * 4;
          p[r] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (i < used) {
            p[r] = KSPLIT == 1 || q == (int)rank
                       ? *reinterpret_cast<const float4*>(s_gate + i)
                       : ld_remote_f4(gate_base + (uint32_t)i * 4u, (uint32_t)q);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          v[r].x += p[r].x;
          v[r].y += p[r].y;
          v[r].z += p[r].z;
          v[r].w += p[r].w;
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int i = g0 + (r * THREADS + tid) * 4;  // warp-uniform: used % 128 == 0
        if (i >= used) continue;
        const int u = i / TOKENS, t = i % TOKENS;
        const float f[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
        uint32_t bits4 = 0;
        uint16_t gb[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          gb[e] = (uint16_t)(twell_pack_bf16x2(f[e], 0.f) & 0xffffu);
          const bool kept = t + e < M && u < nunits &&
                            (twell_relu_keeps(gb[e]) || twell_non_finite(gb[e]));
          bits4 |= (uint32_t)kept << e;
          if (!GATED && kept && u % KSPLIT == (int)rank)
            h[(long long)(t + e) * N + n0 + u] = relu_nan(twell_bf16_to_float(gb[e]));
        }
        *reinterpret_cast<uint2*>(s_g + i) =
            make_uint2(gb[0] | (uint32_t)gb[1] << 16, gb[2] | (uint32_t)gb[3] << 16);
        // the lanes holding one 32-bit word of the unit's token bits OR them together
        uint32_t word = bits4 << (t & 31);
#pragma unroll
        for (int d = 1; d < LANES_PER_WORD; d <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, d);
        if ((t & 31) == 0) s_tok[u * TW + (t >> 5)] = word;
      }
    }
  }
  cluster_sync();  // the peers are done with s_gate (s_up reuses it); s_tok, s_g complete

  // ---- 3. masks (rank 0); the kept units' w_down_t rows into L2 (units split by rank)
  if (rank == 0) {
    const int noct = o1 - o0;
    for (int i = tid; i < M * noct; i += THREADS) {
      const int t = i / noct, o = i % noct;
      uint32_t m = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) m |= ((s_tok[(o * 8 + e) * TW + (t >> 5)] >> (t & 31)) & 1u) << e;
      masks[(long long)t * octets + o0 + o] = (uint8_t)m;
    }
  }
  auto prefetch_down = [&]() {
    for (int u = (int)rank + KSPLIT * tid; u < nunits; u += KSPLIT * THREADS) {
      uint32_t any = 0;
#pragma unroll
      for (int w = 0; w < TW; ++w) any |= s_tok[u * TW + w];
      if (any) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     ::"l"(w_down_t + (long long)(n0 + u) * K), "r"((uint32_t)K * 2u) : "memory");
      }
    }
  };
  if constexpr (!GATED) {
    prefetch_down();
    return;  // no cluster barrier follows: no DSMEM read after this
  }

  // ---- 4. gated: the kept pairs, unit-major and tokens ascending (warp 0)
  if (warp == 0) {
    int base = 0;
    for (int u0 = 0; u0 < ntiles * 16; u0 += 32) {
      const int u = u0 + lane;
      int c = 0;
      if (u < nunits) {
#pragma unroll
        for (int w = 0; w < TW; ++w) c += __popc(s_tok[u * TW + w]);
      }
      int incl = c;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += o;
      }
      int pos = base + incl - c;
      if (u < nunits) {
        for (int w = 0; w < TW; ++w)
          for (uint32_t rest = s_tok[u * TW + w]; rest; rest &= rest - 1)
            s_pairs[pos++] = (uint16_t)((u << 8) | (w * 32 + __ffs(rest) - 1));
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s_npairs = base;
  }
  __syncthreads();
  const int npairs = s_npairs;
  // this CTA's slice of each pair's up product: a warp per pair, UPB pairs' loads at once;
  // lane l sums its pieces l*8 + 256 j (j ascending), then an xor butterfly
  for (int p0 = warp * UPB; p0 < npairs; p0 += WARPS * UPB) {
    uint4 wv[UPB][LP];
#pragma unroll
    for (int i = 0; i < UPB; ++i) {
      const int p = p0 + i;
      const int u = p < npairs ? (int)(s_pairs[p] >> 8) : 0;
      const uint16_t* row = w_up + (long long)(n0 + u) * K + kbeg + lane * 8;
#pragma unroll
      for (int j = 0; j < LP; ++j) wv[i][j] = p < npairs ? ldg16(row + j * 256) : zero;
    }
#pragma unroll
    for (int i = 0; i < UPB; ++i) {
      const int p = p0 + i;
      if (p >= npairs) break;  // warp-uniform
      const int t = (int)(s_pairs[p] & 255u);
      const uint32_t xrow = twell_smem_addr(s_x) + (uint32_t)(t * XS + lane * 8) * 2u;
      float v = 0.f;
#pragma unroll
      for (int j = 0; j < LP; ++j) v = twell_dot8(twell_lds128(xrow + (uint32_t)j * 512u), wv[i][j], v);
#pragma unroll
      for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
      if (lane == 0) s_up[p] = v;
    }
  }
  prefetch_down();  // after the up products' loads, which the launch waits on
  cluster_sync();
  const uint32_t up_base = twell_smem_addr(s_up);
  for (int p = (int)rank + KSPLIT * tid; p < npairs; p += KSPLIT * THREADS) {
    float v = 0.f;
#pragma unroll
    for (int q = 0; q < KSPLIT; ++q)
      v += KSPLIT == 1 || q == (int)rank ? s_up[p] : ld_remote_f32(up_base + (uint32_t)p * 4u, (uint32_t)q);
    const uint32_t pr = s_pairs[p];
    const int u = (int)(pr >> 8), t = (int)(pr & 255u);
    h[(long long)t * N + n0 + u] = relu_nan(twell_bf16_to_float(s_g[u * TOKENS + t])) * v;
  }
  if constexpr (KSPLIT > 1) cluster_sync();  // peers may still read this CTA's s_up
}
