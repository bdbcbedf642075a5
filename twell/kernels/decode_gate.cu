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
// each warp holds its share of x in registers for the whole launch, the weight rows
// stream through shared memory STAGES tiles ahead, and the up products follow in the
// same launch.
//
// Geometry: a thread-block cluster of KSPLIT CTAs (__cluster_dims__) owns a contiguous
// range of 8-unit octets (cluster c of G: octets [c O / G, (c + 1) O / G), O = N / 8), cut
// into tiles of 16 units (the last may hold 8); CTA r of the cluster owns the k-slice
// [r KS, (r + 1) KS), KS = K / KSPLIT, and warp w of it the CPW 32-wide k-chunks
// [w CPW, (w + 1) CPW) of that slice.
//  1. gate, on tensor cores (mma.sync m16n8k16; the tokens as rows, in MT tiles of 16,
//     the units as columns, two n8 tiles per unit tile): a warp loads the A fragments of
//     its chunks for every token once (a lane's 16 contiguous bytes of two token rows
//     give two mma steps: logical k 2tig, 2tig+1, 2tig+8, 2tig+9 <-> columns k0 .. k0+3,
//     then k0+4 .. k0+7, the same permutation for both operands, so the products are exact
//     reorderings of the plain ones) and keeps them in registers; each lane copies its
//     own 16-byte pieces of the tile's weight rows into shared memory (cp.async, STAGES
//     tiles in flight, so no barrier guards the ring) and reads them back as the B
//     fragments; at a tile's end the warps' fragments are summed in warp order into the
//     CTA's partial gate of the tile;
//  2. exchange (cluster barrier): every CTA sums the KSPLIT partials in rank order (DSMEM),
//     so all CTAs of a cluster hold the same bf16 gate; kept bits per (unit, token);
//  3. masks (rank 0) and non-gated h; an L2 prefetch of the kept units' w_down_t rows
//     (units split among the ranks; gated: after the up products' loads are issued);
//  4. gated: the kept pairs listed (unit-major, tokens ascending); each CTA computes its
//     slice of every pair's up dot product (a warp per pair, x and w_up from global
//     memory, UPB pairs' loads in flight), then after a cluster barrier rank r sums the
//     slices of the pairs p with p % KSPLIT == r in rank order and writes h; a last
//     cluster barrier keeps every CTA's shared memory alive until its peers have read it.
//
// Determinism: every sum runs in an order fixed by K, N, M, the grid and the data: the
// same bits run to run (the launcher fixes the grid by the device's SM count).
//
// Layouts (row-major, bf16 as uint16 bits): x [M, K]; w_first, w_up, w_down_t [N, K];
// h float [M, N]; masks uint8 [M, N / 8]; rows 16-byte aligned.
// Limits: K = TWELL_KDIM with (K / TWELL_KSPLIT) % 256 == 0 and a warp's A fragments at
// most 128 registers (K MT <= 4096 KSPLIT); N % 32 == 0 (whole octets, 16-unit mask
// words); 1 <= M <= 8 TWELL_NT <= 64; a cluster's tiles at most `maxt` <= 8 (the
// launcher's bound, decode_units.resident_geometry, which also sizes the dynamic shared
// memory: decode_units.resident_shared_bytes).
//
// Compile-time parameters: TWELL_KDIM, TWELL_GATED, TWELL_NT (tiles of 8 tokens: 1, 2, 4
// or 8), TWELL_KSPLIT (CTAs of a cluster: 1, 2 or 4), TWELL_STAGES (tiles of weight rows
// in flight: 2 to 4); constant TWELL_RESIDENT_THREADS (256).

namespace resident {

constexpr int K = TWELL_KDIM;
constexpr bool GATED = TWELL_GATED != 0;
constexpr int NT = TWELL_NT;
constexpr int TOKENS = 8 * NT;                      // the gate's token columns per unit
constexpr int MT = (NT + 1) / 2;                    // m16 tiles of tokens
constexpr int KSPLIT = TWELL_KSPLIT;
constexpr int KS = K / KSPLIT;                      // this CTA's slice of K
constexpr int STAGES = TWELL_STAGES;
constexpr int THREADS = TWELL_RESIDENT_THREADS;
constexpr int WARPS = THREADS / 32;
constexpr int CPW = KS / 32 / WARPS;                // 32-wide chunks per warp
constexpr int TW = TOKENS >= 32 ? TOKENS / 32 : 1;  // 32-bit words of a unit's token bits
constexpr int LP = KS / 256;                        // a lane's 16-byte pieces of a slice row
constexpr int UPB = LP >= 16 ? 1 : 16 / LP;         // pairs a warp loads at once
constexpr int LANES_PER_WORD = TOKENS >= 32 ? 8 : TOKENS / 4;  // lanes holding a word's bits

static_assert(NT == 1 || NT == 2 || NT == 4 || NT == 8, "TWELL_NT: 1, 2, 4 or 8");
static_assert(KSPLIT == 1 || KSPLIT == 2 || KSPLIT == 4, "TWELL_KSPLIT: 1, 2 or 4");
static_assert(STAGES >= 2 && STAGES <= 4, "TWELL_STAGES: 2 to 4");
static_assert(KS * KSPLIT == K && KS % 256 == 0, "K / TWELL_KSPLIT a multiple of 256");
static_assert(8 * CPW * MT <= 128, "a warp's A fragments in at most 128 registers");
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
  uint4* s_w = reinterpret_cast<uint4*>(smem);  // [STAGES][WARPS][CPW][2][32]: weight pieces
  float* s_part = reinterpret_cast<float*>(s_w + STAGES * WARPS * CPW * 64);  // [WARPS][MT][2][32][4]
  float* s_gate = s_part + WARPS * MT * 2 * 32 * 4;  // [cells]: this CTA's partial gate
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
  const int kw = (int)rank * KS + warp * CPW * 32 + tig * 8;  // this lane's first column
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  // ---- 1. gate. Tile s's pieces of this lane (rows 16 s + grp and + 8, its chunks) into
  // stage s % STAGES; a commit group per tile, empty past the last, so that waiting for
  // all but the STAGES - 1 newest groups always means "tile s has landed".
  const uint32_t w_base = twell_smem_addr(s_w) + (uint32_t)(warp * CPW * 64 + lane) * 16u;
  auto copy_tile = [&](int s) {
    if (s < ntiles) {
      const uint32_t dst = w_base + (uint32_t)((s % STAGES) * WARPS * CPW * 64) * 16u;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = s * 16 + hh * 8 + grp;
        const bool ok = r < nunits;
        const uint16_t* src = w_first + (long long)(n0 + (ok ? r : 0)) * K + kw;
#pragma unroll
        for (int i = 0; i < CPW; ++i) {
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                           dst + (uint32_t)((i * 2 + hh) * 32) * 16u),
                       "l"(src + i * 32), "r"(ok ? 16 : 0)
                       : "memory");
        }
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) copy_tile(s);

  // this warp's A fragments, every token (absent tokens zero): per chunk and m16 tile,
  // {row grp, row grp + 8} x {k-step 1, k-step 2} as the mma's a0..a3
  uint32_t xa[CPW][MT][8];
  {
    uint4 lo[CPW][MT], hi[CPW][MT];
#pragma unroll
    for (int i = 0; i < CPW; ++i)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int t0 = mt * 16 + grp, t8 = t0 + 8;
        lo[i][mt] = t0 < M ? ldg16(x + (long long)t0 * K + kw + i * 32) : zero;
        hi[i][mt] = t8 < M ? ldg16(x + (long long)t8 * K + kw + i * 32) : zero;
      }
#pragma unroll
    for (int i = 0; i < CPW; ++i)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 a = lo[i][mt], b = hi[i][mt];
        xa[i][mt][0] = a.x; xa[i][mt][1] = b.x; xa[i][mt][2] = a.y; xa[i][mt][3] = b.y;
        xa[i][mt][4] = a.z; xa[i][mt][5] = b.z; xa[i][mt][6] = a.w; xa[i][mt][7] = b.w;
      }
  }

  for (int s = 0; s < ntiles; ++s) {  // uniform over the CTA (and the cluster)
    copy_tile(s + STAGES - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][hh][j] = 0.f;
    const uint32_t src = w_base + (uint32_t)((s % STAGES) * WARPS * CPW * 64) * 16u;
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint4 b = twell_lds128(src + (uint32_t)((i * 2 + hh) * 32) * 16u);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t* a = xa[i][mt];
          twell_mma_bf16(acc[mt][hh], a[0], a[1], a[2], a[3], b.x, b.y);
          twell_mma_bf16(acc[mt][hh], a[4], a[5], a[6], a[7], b.z, b.w);
        }
      }
    }
    // the tile's fragments, summed over the warps in warp order into s_gate
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        *reinterpret_cast<float4*>(s_part + (((warp * MT + mt) * 2 + hh) * 32 + lane) * 4) =
            make_float4(acc[mt][hh][0], acc[mt][hh][1], acc[mt][hh][2], acc[mt][hh][3]);
    __syncthreads();
    // a thread per (m16 tile, n8 tile, lane) slot: its 4 floats over the warps in order
    // (float4 reads, no bank conflicts), then the D fragment's cells: rows (tokens) grp and
    // grp + 8, columns (units) 2 tig and 2 tig + 1
    for (int q = tid; q < MT * 2 * 32; q += THREADS) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float4 p = *reinterpret_cast<const float4*>(s_part + (w * MT * 2 * 32 + q) * 4);
        v.x += p.x;
        v.y += p.y;
        v.z += p.z;
        v.w += p.w;
      }
      const int mt = q >> 6, hh = (q >> 5) & 1, ln = q & 31;
      const int u = hh * 8 + (ln & 3) * 2, t = mt * 16 + (ln >> 2);
      float* g = s_gate + s * 16 * TOKENS + u * TOKENS + t;
      if (t < TOKENS) {
        g[0] = v.x;
        g[TOKENS] = v.y;
      }
      if (t + 8 < TOKENS) {
        g[8] = v.z;
        g[TOKENS + 8] = v.w;
      }
    }
    __syncthreads();
  }
  asm volatile("cp.async.wait_all;" ::: "memory");  // the empty groups past the last tile

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
  // lane l sums its pieces l*8 + 256 j of the slice (j ascending), then an xor butterfly
  for (int p0 = warp * UPB; p0 < npairs; p0 += WARPS * UPB) {
    uint4 wv[UPB][LP], xv[UPB][LP];
#pragma unroll
    for (int i = 0; i < UPB; ++i) {
      const int p = p0 + i;
      const uint32_t pr = p < npairs ? s_pairs[p] : 0u;
      const int col = (int)rank * KS + lane * 8;
      const uint16_t* wrow = w_up + (long long)(n0 + (int)(pr >> 8)) * K + col;
      const uint16_t* xrow = x + (long long)(pr & 255u) * K + col;
#pragma unroll
      for (int j = 0; j < LP; ++j) {
        wv[i][j] = p < npairs ? ldg16(wrow + j * 256) : zero;
        xv[i][j] = p < npairs ? ldg16(xrow + j * 256) : zero;
      }
    }
#pragma unroll
    for (int i = 0; i < UPB; ++i) {
      const int p = p0 + i;
      if (p >= npairs) break;  // warp-uniform
      float v = 0.f;
#pragma unroll
      for (int j = 0; j < LP; ++j) v = twell_dot8(xv[i][j], wv[i][j], v);
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
