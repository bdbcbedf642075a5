// common.cuh — device code shared by every twell kernel source.
//
// twell/kernels/compile.py puts this header in front of each source (after the
// `#define TWELL_<NAME>` parameter lines), for the GPU build (CuPy/NVRTC) and the
// CPU-side NVRTC build alike, so both compile the same text.
//
// It holds:
// - the fixed-width integer types (NVRTC has no <stdint.h>);
// - bf16 helpers: unpacking the halves of a 32-bit word, rounding pairs of floats,
//   8-wide dot products and axpy on 16-byte vectors, NumPy's sign;
// - the one routing rule of docs/format.md: which bf16 values are kept by ReLU, which
//   are non-finite, when a tile overflows and when a row has too many active units.
//   The rule is written with plain integer operations (TWELL_HOST_DEVICE), so a host
//   compiler can build it too: tests/test_routing_rule.py compiles this header with the
//   machine's C++ compiler and checks it against twell.formats, bit pattern by bit
//   pattern;
// - thread-block cluster helpers (rank, barrier, DSMEM loads) for the cluster kernels;
// - mbarriers and TMA tensor loads (inline PTX, sm_90) for the kernels that stream
//   tiles through shared-memory rings (gate_gemm.cu, light_rows_decode.cu);
// - the two sides of a programmatic dependent launch (compile.launch_after).

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TWELL_DEVICE __device__ __forceinline__
#define TWELL_HOST_DEVICE __host__ __device__ __forceinline__
#else  // a host compiler (the routing-rule test)
#define TWELL_HOST_DEVICE inline
#endif

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

// ---------------------------------------------------------------- the routing rule
// relu(h) != 0 for a bf16 bit pattern: a positive nonzero value, or NaN of either sign
// (relu propagates NaN, as dense math does). Subnormals count (the GPU flushes them to
// zero only in arithmetic).
TWELL_HOST_DEVICE bool twell_relu_keeps(uint32_t bits16) {
  const uint32_t mag = bits16 & 0x7fffu;
  return mag > 0x7f80u || (mag != 0u && !(bits16 & 0x8000u));
}

// The same test on a bf16 held in the top 16 bits of a word whose low 16 bits are zero
// (the form gate_gemm.cu's packer works on: two compares, no masking).
TWELL_HOST_DEVICE bool twell_relu_keeps_top(uint32_t top) {
  return (int)top > 0 || top > 0xff800000u;
}

// A bf16 bit pattern is non-finite (Inf or NaN): exponent bits all ones.
TWELL_HOST_DEVICE bool twell_non_finite(uint32_t bits16) {
  return (bits16 & 0x7f80u) == 0x7f80u;
}

// The same on a bf16 held in the top 16 bits of a word with zero low bits.
TWELL_HOST_DEVICE bool twell_non_finite_top(uint32_t top) { return (top << 1) >= 0xff000000u; }

// A row-tile with `count` nonzeros overflows a TwELL tile of `slots` words (one of them
// is the count word): its row must be read from the dense backup.
TWELL_HOST_DEVICE bool twell_tile_overflows(int count, int slots) { return count > slots - 1; }

// A row with `nnz` active units is sent to the dense path when it exceeds the limit
// (a gathered unit costs two weight rows from L2; past the limit, the row's dense math
// on tensor cores is cheaper). Any limit gives the same result.
TWELL_HOST_DEVICE bool twell_row_over_limit(int nnz, int max_row_nnz) {
  return nnz > max_row_nnz;
}

// relu on the two bf16 of a word, on bits: negative values (but NaN) become +0, the rest
// (+0 too) pass unchanged; both halves at once (a half is NaN when its magnitude plus
// 0x7f carries into its sign bit).
TWELL_HOST_DEVICE uint32_t twell_relu_bf16x2(uint32_t w) {
  const uint32_t nan = ((w & 0x7fff7fffu) + 0x007f007fu) & 0x80008000u;
  const uint32_t kill = w & 0x80008000u & ~nan;  // negative, not NaN: the halves to zero
  return w & ~((kill >> 15) * 0xffffu);
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#include <cuda_bf16.h>

// ---------------------------------------------------------------- bf16 helpers
// The bf16 in the low / high half of a 32-bit word, as a float.
TWELL_DEVICE float twell_lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
TWELL_DEVICE float twell_hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
TWELL_DEVICE float twell_bf16_to_float(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

// Two floats rounded to bf16 (nearest even) in one word; `lo` in the low half.
TWELL_DEVICE uint32_t twell_pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// s + a·b over 8 bf16 pairs, fp32, in element order.
TWELL_DEVICE float twell_dot8(uint4 a, uint4 b, float s) {
  s = fmaf(twell_lo_bf16(a.x), twell_lo_bf16(b.x), s);
  s = fmaf(twell_hi_bf16(a.x), twell_hi_bf16(b.x), s);
  s = fmaf(twell_lo_bf16(a.y), twell_lo_bf16(b.y), s);
  s = fmaf(twell_hi_bf16(a.y), twell_hi_bf16(b.y), s);
  s = fmaf(twell_lo_bf16(a.z), twell_lo_bf16(b.z), s);
  s = fmaf(twell_hi_bf16(a.z), twell_hi_bf16(b.z), s);
  s = fmaf(twell_lo_bf16(a.w), twell_lo_bf16(b.w), s);
  s = fmaf(twell_hi_bf16(a.w), twell_hi_bf16(b.w), s);
  return s;
}

// sign(h) as NumPy has it: -1, 0, +1, NaN for NaN (the L1 penalty's gradient).
TWELL_DEVICE float twell_sign(float h) {
  return h > 0.f ? 1.f : (h < 0.f ? -1.f : (h == 0.f ? 0.f : h));
}

// acc[i] += h·b[i] over 8 bf16, fp32.
TWELL_DEVICE void twell_axpy8(float h, uint4 b, float* acc) {
  acc[0] = fmaf(h, twell_lo_bf16(b.x), acc[0]);
  acc[1] = fmaf(h, twell_hi_bf16(b.x), acc[1]);
  acc[2] = fmaf(h, twell_lo_bf16(b.y), acc[2]);
  acc[3] = fmaf(h, twell_hi_bf16(b.y), acc[3]);
  acc[4] = fmaf(h, twell_lo_bf16(b.z), acc[4]);
  acc[5] = fmaf(h, twell_hi_bf16(b.z), acc[5]);
  acc[6] = fmaf(h, twell_lo_bf16(b.w), acc[6]);
  acc[7] = fmaf(h, twell_hi_bf16(b.w), acc[7]);
}

// Whether lane `lane`'s 8 columns of 256-column slice `s` lie inside a row of K columns
// (K a multiple of 8; always true when K is a multiple of 256).
TWELL_DEVICE bool twell_slice_lane_valid(int s, int lane, int K) {
  return K % 256 == 0 || s * 256 + lane * 8 < K;
}

// One warp's share of a sliced gather: lane j of the warp holds entry j's unit n_l and
// coefficients a_l, b_l (j < mine <= 32); every lane adds, for each entry in order,
// a·A[n, col..col+8) and then (TWO) b·B[n, col..col+8) to its 8 fp32 sums (rows of K
// bf16; ok: the lane's columns exist). UNITS entries' pieces are loaded at once.
template <bool TWO, int UNITS>
TWELL_DEVICE void twell_slice_gather(int n_l, float a_l, float b_l, int mine, bool ok,
                                     long long col, int k, const uint16_t* __restrict__ A,
                                     const uint16_t* __restrict__ B, float* acc) {
  for (int j0 = 0; j0 < mine; j0 += UNITS) {
    uint4 av[UNITS], bv[UNITS];
#pragma unroll
    for (int q = 0; q < UNITS; ++q) {
      const long long n = __shfl_sync(0xffffffffu, n_l, min(j0 + q, mine - 1));
      const bool live = ok && j0 + q < mine;
      av[q] = live ? __ldg(reinterpret_cast<const uint4*>(A + n * k + col)) : make_uint4(0, 0, 0, 0);
      if (TWO)
        bv[q] = live ? __ldg(reinterpret_cast<const uint4*>(B + n * k + col))
                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int q = 0; q < UNITS; ++q) {
      const float a = __shfl_sync(0xffffffffu, a_l, min(j0 + q, mine - 1));
      const float b = TWO ? __shfl_sync(0xffffffffu, b_l, min(j0 + q, mine - 1)) : 0.f;
      if (j0 + q < mine) {
        twell_axpy8(a, av[q], acc);
        if (TWO) twell_axpy8(b, bv[q], acc);
      }
    }
    __syncwarp();  // (without it NVRTC 13 spilled in a one-matrix build)
  }
}

// 8 fp32 sums rounded once to bf16 and stored (16 bytes, streaming).
TWELL_DEVICE void twell_store_bf16x8(uint16_t* dst, const float* acc) {
  uint4 v;
  v.x = twell_pack_bf16x2(acc[0], acc[1]);
  v.y = twell_pack_bf16x2(acc[2], acc[3]);
  v.z = twell_pack_bf16x2(acc[4], acc[5]);
  v.w = twell_pack_bf16x2(acc[6], acc[7]);
  __stcs(reinterpret_cast<uint4*>(dst), v);
}

// bf16(relu(g) * u) on both halves of bf16x2 words: twell_relu_bf16x2, then one
// product rounded to nearest even (the exact product of two bf16 rounded once, as fp32
// math rounded to bf16 gives, subnormals kept).
TWELL_DEVICE uint32_t twell_relu_mul_bf16x2(uint32_t g, uint32_t u) {
  uint32_t h;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(h) : "r"(twell_relu_bf16x2(g)), "r"(u));
  return h;
}

TWELL_DEVICE uint4 twell_relu_bf16x8(uint4 v) {
  return make_uint4(twell_relu_bf16x2(v.x), twell_relu_bf16x2(v.y), twell_relu_bf16x2(v.z),
                    twell_relu_bf16x2(v.w));
}

// relu of one bf16 bit pattern as a float: its value where twell_relu_keeps, else 0 (NaN
// kept, as dense math does).
TWELL_DEVICE float twell_relu_value(uint32_t bits16) {
  return twell_relu_keeps(bits16) ? __uint_as_float(bits16 << 16) : 0.f;
}
// d += A (16 x 16, row) * B (16 x 8, col), bf16 in, fp32 accumulate (mma.sync; the
// fragments as the PTX manual lays them out).
TWELL_DEVICE void twell_mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                 uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// ---------------------------------------------------------------- reading a TwELL tile
// A warp reads a tile of T bf16 columns, lane l owning the E = T/32 columns [l*E, l*E+E):
// twell_load_lane fetches them as raw 32-bit words in one streaming vector load (several
// can be in flight before twell_unpack_lane splits them), twell_scan_tile applies the
// routing rule's bit tests and counts the tile's nonzeros across the warp.
template <int E>
TWELL_DEVICE void twell_load_lane(const uint16_t* p, uint32_t (&raw)[(E + 1) / 2]) {
  if constexpr (E == 8) {
    const uint4 q = __ldcs(reinterpret_cast<const uint4*>(p));
    raw[0] = q.x; raw[1] = q.y; raw[2] = q.z; raw[3] = q.w;
  } else if constexpr (E == 4) {
    const uint2 q = __ldcs(reinterpret_cast<const uint2*>(p));
    raw[0] = q.x; raw[1] = q.y;
  } else if constexpr (E == 2) {
    raw[0] = __ldcs(reinterpret_cast<const unsigned int*>(p));
  } else {
    raw[0] = __ldcs(reinterpret_cast<const unsigned short*>(p));
  }
}

template <int E>
TWELL_DEVICE void twell_unpack_lane(const uint32_t (&raw)[(E + 1) / 2], uint16_t (&v)[E]) {
  if constexpr (E == 1) {
    v[0] = (uint16_t)raw[0];
  } else {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      v[2 * i] = raw[i] & 0xffff;
      v[2 * i + 1] = raw[i] >> 16;
    }
  }
}

// Inclusive prefix sum of `v` over the lanes of a full warp.
TWELL_DEVICE int twell_warp_prefix(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += t;
  }
  return v;
}

// One warp's tile: `mask` bit i set when relu keeps this lane's value i, `mine` its
// popcount, `incl` the inclusive prefix of `mine` over the lanes, `total` the tile's
// count, `bad` whether any lane holds a non-finite value (warp-wide).
struct TwellTileScan {
  uint32_t mask;
  int mine, incl, total;
  bool bad;
};

template <int E>
TWELL_DEVICE TwellTileScan twell_scan_tile(const uint16_t (&v)[E], int lane) {
  TwellTileScan r;
  r.mask = 0;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    r.mask |= (twell_relu_keeps(v[i]) ? 1u : 0u) << i;
    bad |= twell_non_finite(v[i]);
  }
  r.mine = __popc(r.mask);
  r.incl = twell_warp_prefix(r.mine, lane);
  r.total = __shfl_sync(0xffffffffu, r.incl, 31);
  r.bad = __any_sync(0xffffffffu, bad);
  return r;
}

// The bit tests of twell_scan_tile on a lane's raw words (twell_load_lane), two bf16 per
// instruction (SIMD halfword compares): `mask` bit i set when relu keeps value i, `bad`
// when one is not finite. KEEP_NAN: the mask is twell_relu_keeps exactly (NaN of either
// sign kept); without, a negative NaN is not kept ("> 0 as int16" alone), which a caller
// that sends every row holding a non-finite value to the dense path may accept.
template <int E, bool KEEP_NAN>
TWELL_DEVICE void twell_tile_bits(const uint32_t (&raw)[(E + 1) / 2], uint32_t& mask,
                                  bool& bad) {
  if constexpr (E == 1) {
    const uint32_t h = raw[0] & 0xffffu;
    mask = (KEEP_NAN ? twell_relu_keeps(h) : (h != 0u && !(h & 0x8000u))) ? 1u : 0u;
    bad = twell_non_finite(h);
  } else {
    mask = 0u;
    uint32_t inf = 0u;
#pragma unroll
    for (int w = 0; w < E / 2; ++w) {
      uint32_t keep = __vcmpgts2(raw[w], 0u);  // 0xffff per positive halfword
      if constexpr (KEEP_NAN) keep |= __vcmpgtu2(raw[w] & 0x7fff7fffu, 0x7f807f80u);  // NaN
      inf |= __vcmpeq2(raw[w] & 0x7f807f80u, 0x7f807f80u);
      mask |= ((keep & 1u) | ((keep >> 15) & 2u)) << (2 * w);
    }
    bad = inf != 0u;
  }
}

// ---------------------------------------------------------------- dependent launches
// A kernel launched by compile.launch_after may be running before the kernel ahead of it
// in the stream has finished: twell_grid_wait() returns once that kernel has finished and
// its writes are visible, so such a kernel calls it before it touches global memory, in
// every CTA (a CTA that left without waiting could let the kernel after it start early).
// For a kernel launched as usual it returns at once. twell_grid_release() lets the
// kernel after this one be scheduled before this one's CTAs end (once every CTA of this
// kernel has started or called it); without it that happens as they end.
TWELL_DEVICE void twell_grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
TWELL_DEVICE void twell_grid_release() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---------------------------------------------------------------- mbarriers and TMA
// A TMA tensor map (CUtensorMap, made on the host by cuTensorMapEncodeTiled and passed by
// value as a __grid_constant__ kernel parameter; <cuda.h> does not build under NVRTC).
struct __align__(64) TwellTmaDesc { unsigned long long v[16]; };

// The shared-window address of a pointer into shared memory.
TWELL_DEVICE uint32_t twell_smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
TWELL_DEVICE void twell_mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also announces `bytes` of asynchronous copies completing on `bar`.
TWELL_DEVICE void twell_mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
TWELL_DEVICE void twell_mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Spins until the phase of parity `parity` of `bar` has completed.
TWELL_DEVICE void twell_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// The 2-D box of `map` at element coordinates (c0 innermost, c1) into shared memory at
// `dst`, completion counted on `bar` (complete_tx bytes).
TWELL_DEVICE void twell_tma_load_2d(uint32_t dst, const TwellTmaDesc* map, int c0, int c1,
                                    uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
// `bytes` (a multiple of 16) from global `src` into shared memory at `dst` (both 16-byte
// aligned), completion counted on `bar` (complete_tx bytes).
TWELL_DEVICE void twell_bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Orders this thread's shared-memory accesses before later asynchronous-proxy ones (TMA
// and bulk copies) that a barrier makes wait for them.
TWELL_DEVICE void twell_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
TWELL_DEVICE uint4 twell_lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// ---------------------------------------------------------------- wgmma (sm_90a)
// Shared-memory matrix descriptor: a K-major tile with rows of 128 bytes, 128-byte
// swizzle, 8-row groups 1024 bytes apart (the layout TMA writes with SWIZZLE_128B); a
// k16 step further along the rows is 32 bytes more on the address.
TWELL_DEVICE uint64_t twell_wgmma_desc(uint32_t addr) {
  uint64_t desc = (uint64_t)((addr & 0x3FFFFu) >> 4);
  desc |= (uint64_t)1 << 16;            // leading byte offset 16 B (unused for this layout)
  desc |= (uint64_t)(1024 >> 4) << 32;  // stride byte offset: 8 rows x 128 B
  desc |= (uint64_t)1 << 62;            // 128-byte swizzle
  return desc;
}
TWELL_DEVICE void twell_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
TWELL_DEVICE void twell_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
TWELL_DEVICE void twell_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma fence/wait.
template <int N>
TWELL_DEVICE void twell_wgmma_fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---------------------------------------------------------------- thread-block clusters
// (inline PTX, sm_90) The CTA's rank in its cluster, the cluster's index in the grid, and
// the number of clusters.
TWELL_DEVICE uint32_t twell_cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
TWELL_DEVICE uint32_t twell_cluster_index() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
TWELL_DEVICE uint32_t twell_cluster_count() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
// All threads of all CTAs of the cluster; release/acquire at cluster scope (shared
// memory written before it is visible to DSMEM reads after it). A CTA barrier too.
TWELL_DEVICE void twell_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The 32-bit word of CTA `rank`'s shared memory at the shared-window address `local` has
// in ours (DSMEM).
TWELL_DEVICE uint32_t twell_ld_remote_u32(uint32_t local, uint32_t rank) {
  uint32_t remote, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
  return v;
}

#endif
