// reuse.cu — the light rows of the sparse FFN block with BLOCK REUSE of the weight rows:
// every row of w_up and w_down_t is read once per block of tokens (not once per active
// (token, unit) pair, as the per-token gather of light_rows.cu does), and serves all the
// tokens of the block that use it.
//
//   gated:     y[t, :] = sum over active n:  g[t, n] * (x[t] . w_up[n]) * w_down_t[n, :]
//   non-gated: y[t, :] = sum over active n:  g[t, n] * w_down_t[n, :]
//
// g = relu(pre) rounded to bf16 (pre = x @ w_gate.T, or TwELL values); "active" = g != 0.
// Only light rows are computed here; heavy rows (a TwELL tile over SLOTS-1 nonzeros, a
// non-finite pre-activation, or more than max_row_nnz active units: the same rule as
// light_rows.cu's scan) get heavy[t] = 1 and are left untouched for the dense path.
//
// ------------------------------------------------------------------ the pipeline
//  1 scan      twell_reuse_scan_pre | twell_reuse_scan_twell
//              one lane per token: routing rule, the token's entries (raw list), per-chunk
//              counts, and the UNIT MASKS (for each group of 32 tokens and each unit, a
//              32-bit word: which of the 32 tokens use the unit) — a 32x32 bit transpose
//              across the warp, no atomics (the TwELL reader ORs bits in shared memory:
//              order-free).
//  2 pointers  twell_reuse_unit_ptr (column view) and twell_reuse_row_ptr (row view):
//              block-wide prefix sums of popcounts / counts, one CTA per token block.
//  3 scatter   twell_reuse_scatter: each entry computes its place in both views
//              (rank inside a unit = popcount of the mask bits of earlier tokens).
//  4 up        twell_reuse_up (+ twell_reuse_up_finish when K is split across CTAs), or
//              the per-token gather baseline twell_reuse_up_gather: h = g * (x . w_up[n]).
//  5 down      twell_reuse_down: y from the row view, w_down_t staged once per block.
// Steps 1-3 build the data structure below; it is a function of the active set only,
// reusable (the transposed view is what dW_up = du^T x and dW_down = dy^T h need).
//
// ------------------------------------------------------------------ layouts
// Row-major, bf16 as uint16 bits. x [M, K]; pre [M, N]; packed [M, N/TILE*SLOTS] (TwELL);
// w_up [N, K]; w_down_t [N, K] (w_down transposed: a unit's down column is a row);
// y [M, K]; heavy [M] uint8. R = max_row_nnz (capacity per light token).
//
// ReuseView — the active (token, unit) pairs of the light tokens, in two orders:
//   scan outputs (intermediate):
//     raw       uint32 [M, R]   token t's entries, unit | bf16(g) << 16, in scan order
//                               (ascending units from pre; TwELL's order within a tile)
//     row_nnz   int32  [M]      entries of t (0 for heavy rows)
//     chunk_cnt uint16 [NRC, M] entries of t in row chunk c (units [c*RCH, (c+1)*RCH))
//     mask      uint32 [W, N]   W = ceil(M/32); bit l of mask[w, n]: token 32w+l uses n
//                               (heavy tokens' bits may be set: AND with light[w])
//     light     uint32 [W]      bit l: token 32w+l exists and is light
//   ROW VIEW (down; token blocks of DB tokens, chunk-major blocked CSR):
//     row_ptr   int32 [nbd, NRC*DB + 1]  entries of token i of block b in row chunk c are
//               row_*[row_ptr[b, c*DB+i] : row_ptr[b, c*DB+i+1]] (ascending units); so a
//               chunk's entries for a run of tokens are contiguous. Block b's entries
//               live in [b*DB*R, b*DB*R + count_b): fixed worst-case capacity, no gaps
//               inside a block, no cross-block prefix sum.
//     row_unit  uint16 [nbd*DB*R]  the unit n
//     row_h     fp32   [nbd*DB*R]  g after the scatter; h = g*u after the up step
//   COLUMN VIEW (up, backward; token blocks of UB tokens, blocked CSC = the transposed
//   view): pairs of block b sorted by unit, then token:
//     unit_ptr  int32 [nbu, N+1]    pairs of unit n in block b: [unit_ptr[b,n], unit_ptr[b,n+1])
//     col_off   int32 [W, N]        first pair of (32-token group w, unit n) (scatter helper)
//     col_word  uint32 [nbu*UB*R]   token offset in block | bf16(g) << 16 (TwELL's word)
//     col_unit  uint16 [nbu*UB*R]   the unit n (explicit, so a pair range can cross units)
//     col_dst   int32  [nbu*UB*R]   the pair's index in the row view (where h goes)
//   up_sum    fp32 [KSPLIT, nbu*UB*R]  per-pair running sums of the up dot products
//
// ------------------------------------------------------------------ tiling
// scan: a warp = 32 tokens (lane = token), 32 units per step; the 32 x 32 bf16 tile of
//   the pre-activation goes global -> shared by cp.async in coalesced 64-byte row pieces
//   (SCAN_STAGES = 8 steps in flight: at M = 16K only ~4 warps per SM), each lane reads
//   its row (80-byte pitch: conflict-free) and tests both halves of a word at once.
// up (twell_reuse_up): CTA = UB tokens x a K range (KSPLIT ranges); it stages x[block,
//   UKS-slice] in shared memory (cp.async, UP_STAGES buffers, 64-byte segments XOR-
//   swizzled by row parity), and each warp walks unit groups of 16 units: the group's
//   w_up[16 units, slice] goes global -> registers as the A operand of mma.m16n8k16
//   (read ONCE per token block: this is the reuse), the group's pairs (contiguous in the
//   column view) 8 at a time are the B operand (x rows gathered from shared memory, one
//   16-byte load per lane), and the wanted dot product of each pair is picked out of the
//   16x8 accumulator (its unit's row, its own column) and added to the pair's running sum.
//   Tensor cores do 16x the useful work, but they are ~16x faster than FMA per issue
//   slot and need no bf16 unpacking; the bound is the x gather from shared memory. The
//   warp's group pointers sit in shared memory and the next group's A operand and first
//   64 pairs are loaded while the current group computes (latency hidden).
// down (twell_reuse_down): CTA = DB tokens x DKS output columns; it stages w_down_t[RCH
//   units, DKS columns] per row chunk (cp.async, double-buffered: read ONCE per token
//   block), each warp owns DB/16 tokens whose fp32 accumulators live in registers (lane =
//   DKS/32 consecutive columns), copies its tokens' entries of the chunk (contiguous in
//   the row view) to a shared list and adds h * w for each, token by token, in ascending
//   unit order. Output columns are independent: no reduction across CTAs.
// up_gather (baseline): one warp per token, as light_rows.cu (4 KB of w_up per pair from L2).
//
// ------------------------------------------------------------------ limits
// K = TWELL_KDIM, a multiple of 8, <= 4096; N % TILE == 0, N <= 65536, N % 16 == 0;
// RCH % TILE == 0; 16-byte aligned rows; UB % 32 == 0; DB = 16 * (tokens per warp <= 32);
// indices of the views are int32 (the launcher checks nb*B*R < 2^31); counts per (token,
// row chunk) <= DLIST (checked by the launcher). Entries of a TwELL whose column lies
// outside its tile are skipped (invalid input contributes nothing).
//
// ------------------------------------------------------------------ determinism
// No atomics whose order reaches an output (only shared-memory atomicOr of mask bits).
// Every pair is owned by one fixed lane in every slice; sums run over K slices in
// ascending order; down adds entries in ascending unit order with fmaf, exactly as
// light_rows.cu does, so up_gather + down reproduce light_rows.cu's bits.
//
// ------------------------------------------------------------------ floor (M=16384, K=2048,
// N=5632, uniform p=0.005: P = 461K pairs, 28.1 per token; UB = DB = 512, UKS = DKS = 64)
//   scan   HBM: pre 184.5 MB read + mask 11.5 MB + raw 1.8 MB written = 198 MB -> 0.066 ms
//          at 3.0 TB/s (the same read today's fused kernel pays).
//   ptr+scatter  L2: mask 11.5 MB read twice, col_off 11.5 MB written + read, views
//          ~10 MB -> ~0.01 ms (+ launch gaps).
//   up     L2->SM: w_up once per token block (M/UB) * N*K*2 = 738 MB, x 67 MB (HBM),
//          running sums P*8 B*(K/UKS) = 118 MB -> 0.12 ms at 7.6 TB/s;
//          shared: gathered x P*K*2 = 1.9 GB (x1.5 expected bank conflicts of 2-row phases)
//          -> 0.06-0.10 ms at 29.6 TB/s; tensor: 16 mma.m16n8k16 per pair = 30 GFLOP
//          issued for 1.9 useful -> ~0.05 ms at ~600 TFLOP/s. Floor ~0.12 ms (L2).
//          (the gather baseline: 4 KB per pair = 1.9 GB from L2 -> 0.25-0.29 ms)
//   down   L2->SM: w_down_t (M/DB) * N*K*2 = 738 MB + row view P*8 B*(K/DKS) = 118 MB
//          -> 0.11 ms; shared: P*K*2 = 1.9 GB conflict-free -> 0.064 ms; FMA pipe:
//          P*K = 944M fmaf + 944M bf16 unpacks -> 0.064 ms (INT pipe); issue: ~8.5 warp
//          instructions per (pair, 64 columns) + ~10 per (token, chunk) = ~165M -> 0.18 ms
//          at 4 IPC per SM: the down half is ISSUE-bound. HBM: y 67 MB.
//   Stage floor ~0.31 ms (scan 0.066 + up 0.12 + down 0.11 + small); expected 0.36-0.50.
//   A bigger token block halves the L2 terms (UB = 1024: up 0.07 ms), at the price of
//   shared memory (x tile) or registers (down accumulators: DB * DKS <= 32K).
//
// Compile-time parameters: TWELL_KDIM, TWELL_TILE, TWELL_SLOTS, TWELL_GATED; tunables
// (defaults below): TWELL_UP_BLOCK, TWELL_UP_KS, TWELL_DOWN_BLOCK, TWELL_DOWN_KS,
// TWELL_ROW_CHUNK. TWELL_EMU builds for the CPU emulator (bench/reuse/emu).

#ifdef TWELL_EMU
#include "cuda_emu.h"
#else
#include <cuda_bf16.h>
// NVRTC has no <stdint.h>; these match its definitions (redeclaring is allowed).
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#endif

#ifndef TWELL_UP_BLOCK
#define TWELL_UP_BLOCK 512
#endif
#ifndef TWELL_UP_KS
#define TWELL_UP_KS 64
#endif
#ifndef TWELL_DOWN_BLOCK
#define TWELL_DOWN_BLOCK 512
#endif
#ifndef TWELL_DOWN_KS
#define TWELL_DOWN_KS 64
#endif
#ifndef TWELL_ROW_CHUNK
#define TWELL_ROW_CHUNK 512
#endif

#define KDIM TWELL_KDIM
#define FULL 0xffffffffu

// ---------------------------------------------------------------- small helpers
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
#ifdef TWELL_EMU
  return emu::pack_bf16x2(lo, hi);
#else
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half), nearest even
  return *reinterpret_cast<uint32_t*>(&v);
#endif
}

// The routing rule on a bf16 held in the top 16 bits of a word whose low bits are zero:
// relu keeps it (positive nonzero, or NaN of either sign); it is Inf or NaN.
__device__ __forceinline__ uint32_t keeps_top(uint32_t top) {
  return ((int)top > 0 || top > 0xff800000u) ? 1u : 0u;
}
__device__ __forceinline__ bool non_finite_top(uint32_t top) { return (top << 1) >= 0xff000000u; }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

#ifdef TWELL_EMU
#define DYNAMIC_SMEM(name) uint8_t* name = emu::S.dyn_smem
#else
#define DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#endif

// 16-byte global -> shared copy that bypasses registers; `fill` false writes zeros
// (rows or columns past the matrix). src must be a valid address either way.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool fill) {
#ifdef TWELL_EMU
  emu::cp_async(dst, src, 16, fill ? 16 : 0);
#else
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(fill ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef TWELL_EMU
  emu::cp_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef TWELL_EMU
  emu::cp_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// d += A (16 x 16, row) * B (16 x 8, col), bf16 in, fp32 accumulate; PTX fragments.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#ifdef TWELL_EMU
  emu::mma_bf16(d, a0, a1, a2, a3, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Exclusive prefix sum of v over the block in thread order (all threads call it); total
// gets the block's sum. scratch: 33 ints of shared memory. Integer adds: deterministic.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += o;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int s = lane < warps ? scratch[lane] : 0;
    int si = s;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(FULL, si, d);
      if (lane >= d) si += o;
    }
    if (lane < warps) scratch[lane] = si - s;
    if (lane == 31) scratch[32] = si;
  }
  __syncthreads();
  const int result = scratch[warp] + incl - v;
  total = scratch[32];
  __syncthreads();
  return result;
}

#define RCH TWELL_ROW_CHUNK
#define UB TWELL_UP_BLOCK
#define DB TWELL_DOWN_BLOCK

// ================================================================ 1. scan
#define SCAN_WARPS 4
#define SCAN_STAGES 8  // steps in flight: few warps per SM at M = 16K, HBM wants ~25 KB per SM
#define SCAN_PITCH 80  // bytes per token row of a 32-unit step (64 + 16: conflict-free)
#define SCAN_STAGE_BYTES (32 * SCAN_PITCH)
#define SCAN_SMEM_BYTES (SCAN_WARPS * SCAN_STAGES * SCAN_STAGE_BYTES)

// 32 x 32 bit transpose across a warp: lane l holds row l (bit u = A[l][u]); returns
// column `lane` (bit l = A[l][lane]). Five butterfly steps swapping blocks.
__device__ __forceinline__ uint32_t transpose32(uint32_t x, int lane) {
  const uint32_t masks[5] = {0x0000ffffu, 0x00ff00ffu, 0x0f0f0f0fu, 0x33333333u, 0x55555555u};
#pragma unroll
  for (int s = 0; s < 5; ++s) {
    const int j = 16 >> s;
    const uint32_t m = masks[s];
    const uint32_t o = __shfl_xor_sync(FULL, x, j);
    x = (lane & j) ? ((x & ~m) | ((o & ~m) >> j)) : ((x & m) | ((o & m) << j));
  }
  return x;
}

// Per-token state of the scan (one lane = one token).
struct ScanState {
  int total;         // active units seen (all of them, also past the capacity)
  int tile_count;    // in the current TwELL tile
  int chunk_count;   // in the current row chunk
  bool bad;          // a non-finite value
  bool over;         // a TwELL tile over SLOTS-1
};

__device__ __forceinline__ void append_entry(uint32_t* __restrict__ raw_row, ScanState& st,
                                             int R, uint32_t word) {
  if (st.total < R) raw_row[st.total] = word;
  st.total++;
}

// After the 32 units [n0, n0 + 32): close TwELL tiles and row chunks that end there.
__device__ __forceinline__ void close_units(ScanState& st, int n_end, int N, long long t,
                                            int M, uint16_t* __restrict__ chunk_cnt) {
  if (n_end % TWELL_TILE == 0) {
    st.over |= st.tile_count > TWELL_SLOTS - 1;
    st.tile_count = 0;
  }
  if (n_end % RCH == 0 || n_end == N) {
    if (t < M) chunk_cnt[(long long)((n_end - 1) / RCH) * M + t] = (uint16_t)imin(st.chunk_count, 65535);
    st.chunk_count = 0;
  }
}

// The end of a token's scan: routing decision and the light-token word of its group.
__device__ __forceinline__ void finish_scan(const ScanState& st, long long t, int M, int R,
                                            long long group, int lane, bool was_heavy,
                                            uint8_t* __restrict__ heavy, int* __restrict__ row_nnz,
                                            uint32_t* __restrict__ light) {
  const bool valid = t < M;
  const bool is_heavy = was_heavy || st.bad || st.over || st.total > R;
  if (valid) {
    heavy[t] = is_heavy ? 1 : 0;
    row_nnz[t] = is_heavy ? 0 : st.total;
  }
  const uint32_t lw = __ballot_sync(FULL, valid && !is_heavy);
  if (lane == 0) light[group] = lw;
}

// From the dense bf16 pre-activation. Grid: ceil(M / (32 * SCAN_WARPS)), SCAN_WARPS*32
// threads, SCAN_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(SCAN_WARPS * 32)
twell_reuse_scan_pre(const uint16_t* __restrict__ pre,  // [M, N]
                     int M, int N, int max_row_nnz,
                     uint8_t* __restrict__ heavy,        // [M] out
                     int* __restrict__ row_nnz,          // [M] out
                     uint32_t* __restrict__ raw,         // [M, R] out
                     uint16_t* __restrict__ chunk_cnt,   // [NRC, M] out
                     uint32_t* __restrict__ mask,        // [W, N] out
                     uint32_t* __restrict__ light) {     // [W] out
  DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long group = (long long)blockIdx.x * SCAN_WARPS + warp;
  if (group * 32 >= M) return;  // the whole warp: uniform
  const long long t = group * 32 + lane;
  const int R = max_row_nnz;
  uint8_t* stages = smem + warp * SCAN_STAGES * SCAN_STAGE_BYTES;
  // Copy roles: lane l moves 16 bytes of token row 8q + (l & 7), piece l >> 3.
  const int piece = lane >> 3;
  const int steps = N / 32;

  auto issue = [&](int step) {
    if (step < steps) {
      uint8_t* st = stages + (step % SCAN_STAGES) * SCAN_STAGE_BYTES;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int row = 8 * q + (lane & 7);
        const long long tok = group * 32 + row;
        const bool ok = tok < M;
        const uint16_t* src = pre + (ok ? tok : 0) * (long long)N + step * 32 + piece * 8;
        cp_async16(st + row * SCAN_PITCH + piece * 16, src, ok);
      }
    }
    cp_async_commit();
  };

  ScanState st = {0, 0, 0, false, false};
  uint32_t* raw_row = raw + (t < M ? t : 0) * (long long)R;
#pragma unroll
  for (int s = 0; s < SCAN_STAGES - 1; ++s) issue(s);
  for (int s = 0; s < steps; ++s) {
    issue(s + SCAN_STAGES - 1);
    cp_async_wait<SCAN_STAGES - 1>();
    __syncwarp();
    const uint8_t* row = stages + (s % SCAN_STAGES) * SCAN_STAGE_BYTES + lane * SCAN_PITCH;
    uint32_t w[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * q);
      w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
    }
    __syncwarp();  // the stage may be refilled from the next iteration on
    // Both bf16 of a word at once: bit 15 / 31 of `keep` = positive nonzero (relu keeps
    // it; a NaN makes the row heavy anyway, so -NaN need not count), of (sum + 0x80) =
    // exponent all ones. bits: bit i = unit n0 + 2i, bit 16 + i = unit n0 + 2i + 1.
    uint32_t bits = 0, badv = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t wv = w[i];
      const uint32_t keep = ((wv & 0x7fff7fffu) + 0x7fff7fffu) & ~wv & 0x80008000u;
      badv |= (wv & 0x7f807f80u) + 0x00800080u;
      bits |= ((keep >> 15) & 0x00010001u) << i;
    }
    st.bad |= (badv & 0x80008000u) != 0u;
    const int n0 = s * 32;
    if (bits) {  // rare: this token's entries, ascending
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if ((bits >> i) & 1u) append_entry(raw_row, st, R, (uint32_t)(n0 + 2 * i) | (w[i] << 16));
        if ((bits >> (16 + i)) & 1u)
          append_entry(raw_row, st, R, (uint32_t)(n0 + 2 * i + 1) | (w[i] & 0xffff0000u));
      }
    }
    const int c = __popc(bits);
    st.tile_count += c;
    st.chunk_count += c;
    // Unit masks: transposed, lane u holds the word of bit position u (unit n0 + 2u for
    // u < 16, n0 + 2(u - 16) + 1 above); bit l = token l of the group.
    const uint32_t word = transpose32(bits, lane);
    mask[group * N + n0 + (lane < 16 ? 2 * lane : 2 * lane - 31)] = word;
    close_units(st, n0 + 32, N, t, M, chunk_cnt);
  }
  cp_async_wait<0>();
  finish_scan(st, t, M, R, group, lane, false, heavy, row_nnz, light);
}

// From a TwELL buffer: heavy (in/out) holds the producer's flags (overflow, non-finite)
// on entry. Grid as twell_reuse_scan_pre; SCAN_WARPS * TILE * 4 bytes of dynamic shared
// memory (a bitmap per warp).
extern "C" __global__ void __launch_bounds__(SCAN_WARPS * 32)
twell_reuse_scan_twell(const uint32_t* __restrict__ packed,  // [M, N/TILE*SLOTS]
                       int M, int N, int max_row_nnz,
                       uint8_t* __restrict__ heavy,           // [M] in/out
                       int* __restrict__ row_nnz,             // [M] out
                       uint32_t* __restrict__ raw,            // [M, R] out
                       uint16_t* __restrict__ chunk_cnt,      // [NRC, M] out
                       uint32_t* __restrict__ mask,           // [W, N] out
                       uint32_t* __restrict__ light) {        // [W] out
  DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long group = (long long)blockIdx.x * SCAN_WARPS + warp;
  if (group * 32 >= M) return;
  const long long t = group * 32 + lane;
  const bool valid = t < M;
  const int R = max_row_nnz;
  const int tiles = N / TWELL_TILE;
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(smem) + warp * TWELL_TILE;
  const bool was_heavy = valid && heavy[t] != 0;
  const uint32_t* words = packed + (valid ? t : 0) * (long long)tiles * TWELL_SLOTS;
  uint32_t* raw_row = raw + (valid ? t : 0) * (long long)R;
  ScanState st = {0, 0, 0, false, false};
  for (int j = 0; j < tiles; ++j) {
    for (int u = lane; u < TWELL_TILE; u += 32) bitmap[u] = 0u;
    __syncwarp();
    const uint32_t* tw = words + j * TWELL_SLOTS;
    const int c = (valid && !was_heavy) ? (int)tw[0] : 0;
    st.over |= c > TWELL_SLOTS - 1;
    const int stored = c > TWELL_SLOTS - 1 ? 0 : c;
    const uint32_t lo_col = (uint32_t)(j * TWELL_TILE);
#pragma unroll 1
    for (int e = 1; e <= stored; ++e) {
      const uint32_t word = tw[e];
      const uint32_t col = word & 0xffffu;
      if (col - lo_col >= (uint32_t)TWELL_TILE) continue;  // outside its tile: skipped
      st.bad |= non_finite_top(word & 0xffff0000u);
      append_entry(raw_row, st, R, word);
      st.tile_count++;
      st.chunk_count++;
      atomicOr(&bitmap[col - lo_col], 1u << lane);  // OR: the order does not matter
    }
    __syncwarp();
    for (int u = lane; u < TWELL_TILE; u += 32) mask[group * N + lo_col + u] = bitmap[u];
    __syncwarp();
    // Row chunks end on tile boundaries (RCH % TILE == 0).
    const int n_end = (j + 1) * TWELL_TILE;
    st.tile_count = 0;  // the overflow test above used the stored count c
    if (n_end % RCH == 0 || n_end == N) {
      if (valid) chunk_cnt[(long long)((n_end - 1) / RCH) * M + t] = (uint16_t)imin(st.chunk_count, 65535);
      st.chunk_count = 0;
    }
  }
  finish_scan(st, t, M, R, group, lane, was_heavy, heavy, row_nnz, light);
}

// ================================================================ 2. pointers
#define PTR_THREADS 1024

// Column view of token block b (UB tokens): unit_ptr[b, 0..N] and col_off[w, n] for the
// block's 32-token groups. Grid: nbu = ceil(M / UB) CTAs of PTR_THREADS.
extern "C" __global__ void __launch_bounds__(PTR_THREADS)
twell_reuse_unit_ptr(const uint32_t* __restrict__ mask,  // [W, N]
                     const uint32_t* __restrict__ light, // [W]
                     int M, int N, int max_row_nnz,
                     int* __restrict__ unit_ptr,         // [nbu, N+1] out
                     int* __restrict__ col_off) {        // [W, N] out
  __shared__ int scratch[33];
  __shared__ uint32_t light_s[UB / 32];
  const int b = blockIdx.x;
  const int W = (M + 31) / 32;
  const int g0 = b * (UB / 32);
  const int ng = imin(UB / 32, W - g0);
  for (int q = threadIdx.x; q < UB / 32; q += blockDim.x) light_s[q] = q < ng ? light[g0 + q] : 0u;
  __syncthreads();
  const int base = b * UB * max_row_nnz;
  int carry = 0;
  for (int n0 = 0; n0 < N; n0 += blockDim.x) {
    const int n = n0 + threadIdx.x;
    int cnt = 0;
    if (n < N)
      for (int q = 0; q < ng; ++q) cnt += __popc(mask[(long long)(g0 + q) * N + n] & light_s[q]);
    int total;
    const int excl = block_exclusive_scan(cnt, scratch, total);
    if (n < N) {
      int run = base + carry + excl;
      unit_ptr[(long long)b * (N + 1) + n] = run;
      for (int q = 0; q < ng; ++q) {
        const long long at = (long long)(g0 + q) * N + n;
        col_off[at] = run;
        run += __popc(mask[at] & light_s[q]);
      }
    }
    carry += total;
  }
  if (threadIdx.x == 0) unit_ptr[(long long)b * (N + 1) + N] = base + carry;
}

// Row view of token block b (DB tokens): row_ptr[b, c*DB + i] over row chunks c and the
// block's tokens i, plus the end. Grid: nbd = ceil(M / DB) CTAs of PTR_THREADS.
extern "C" __global__ void __launch_bounds__(PTR_THREADS)
twell_reuse_row_ptr(const uint16_t* __restrict__ chunk_cnt,  // [NRC, M]
                    const uint8_t* __restrict__ heavy,       // [M]
                    int M, int N, int max_row_nnz,
                    int* __restrict__ row_ptr) {             // [nbd, NRC*DB + 1] out
  __shared__ int scratch[33];
  const int b = blockIdx.x;
  const int nrc = (N + RCH - 1) / RCH;
  const int items = nrc * DB;
  int* out = row_ptr + (long long)b * (items + 1);
  const int base = b * DB * max_row_nnz;
  int carry = 0;
  for (int q0 = 0; q0 < items; q0 += blockDim.x) {
    const int q = q0 + threadIdx.x;
    const int c = q / DB, i = q % DB;
    const long long t = (long long)b * DB + i;
    const int cnt = (q < items && t < M && !heavy[t]) ? (int)chunk_cnt[(long long)c * M + t] : 0;
    int total;
    const int excl = block_exclusive_scan(cnt, scratch, total);
    if (q < items) out[q] = base + carry + excl;
    carry += total;
  }
  if (threadIdx.x == 0) out[items] = base + carry;
}

// ================================================================ 3. scatter
// Every entry of every light token to its place in the row view (row_unit, row_h = g) and,
// when col_word is not null, in the column view. One lane per token; grid as the scan.
extern "C" __global__ void __launch_bounds__(SCAN_WARPS * 32)
twell_reuse_scatter(const uint32_t* __restrict__ raw,      // [M, R]
                    const int* __restrict__ row_nnz,       // [M]
                    const uint32_t* __restrict__ mask,     // [W, N]
                    const uint32_t* __restrict__ light,    // [W]
                    const int* __restrict__ col_off,       // [W, N]
                    const int* __restrict__ row_ptr,       // [nbd, NRC*DB + 1]
                    int M, int N, int max_row_nnz,
                    uint32_t* __restrict__ col_word,       // column view out (or null)
                    uint16_t* __restrict__ col_unit,
                    int* __restrict__ col_dst,
                    uint16_t* __restrict__ row_unit,       // row view out
                    float* __restrict__ row_h) {
  const int lane = threadIdx.x & 31;
  const long long group = (long long)blockIdx.x * SCAN_WARPS + (threadIdx.x >> 5);
  const long long t = group * 32 + lane;
  if (t >= M) return;  // no collectives below
  const int R = max_row_nnz;
  const int nnz = row_nnz[t];
  if (nnz == 0) return;
  const uint32_t lw = light[group];
  const uint32_t below = (1u << lane) - 1u;
  const int nrc = (N + RCH - 1) / RCH;
  const int* rp = row_ptr + (t / DB) * (long long)(nrc * DB + 1) + (int)(t % DB);
  const uint32_t tok_in_block = (uint32_t)(t % UB);
  const uint32_t* entries = raw + t * R;
  int chunk = -1, at = 0;
  for (int e = 0; e < nnz; ++e) {
    const uint32_t word = entries[e];
    const int n = (int)(word & 0xffffu);
    const int c = n / RCH;  // nondecreasing along the entries
    if (c != chunk) {
      chunk = c;
      at = rp[c * DB];
    }
    const int rpos = at++;
    row_unit[rpos] = (uint16_t)n;
    row_h[rpos] = bf16_hi(word);
    if (col_word != nullptr) {
      const long long m = group * N + n;
      const int cpos = col_off[m] + __popc(mask[m] & lw & below);
      col_word[cpos] = tok_in_block | (word & 0xffff0000u);
      col_unit[cpos] = (uint16_t)n;
      col_dst[cpos] = rpos;
    }
  }
}

// ================================================================ 4. up
#define UKS TWELL_UP_KS
#define USEG (UKS / 32)
#define UP_WARPS 16
#define UP_THREADS (UP_WARPS * 32)
#define UP_TILE_BYTES (UB * UKS * 2)
#define UP_STAGES ((2 * UP_TILE_BYTES <= 160 * 1024) ? 2 : 1)
#define UP_SMEM_BYTES (UP_STAGES * UP_TILE_BYTES)
// The next unit group's A operand is loaded while the current one computes, when the
// registers allow it (2 x 4 x USEG of them).
#define UP_PREFETCH_A (USEG <= 2)

// Byte offset of 16-byte piece p of 32-k segment s of token row r in the x tile. Segments
// are XOR-swizzled by row parity, so the two rows a quarter-warp reads (4 lanes each)
// fall in different 64-byte halves of the banks whenever their parities differ.
__device__ __forceinline__ int x_tile_offset(int r, int s, int p) {
  const int sw = USEG >= 2 ? (s ^ (r & 1)) : s;
  return r * (UKS * 2) + sw * 64 + p * 16;
}

__device__ __forceinline__ void stage_x(uint8_t* tile, const uint16_t* __restrict__ x, int M,
                                        long long row0, int k0) {
  constexpr int pieces_per_row = UKS / 8;
  for (int id = threadIdx.x; id < UB * pieces_per_row; id += UP_THREADS) {
    const int r = id / pieces_per_row, c16 = id % pieces_per_row;
    const int s = c16 >> 2, p = c16 & 3;
    const long long tok = row0 + r;
    const int k = k0 + c16 * 8;
    const bool ok = tok < M && k < KDIM;
    cp_async16(tile + x_tile_offset(r, s, p), x + (ok ? tok * KDIM + k : 0), ok);
  }
}

// The A operand (w_up rows n0 + g and n0 + g + 8, this lane's 8 k of each 32-k segment).
__device__ __forceinline__ void load_a(const uint16_t* __restrict__ w_up, int n0, int k0,
                                       int lane, uint4 (&lo)[USEG], uint4 (&hi)[USEG]) {
  const int g = lane >> 2, t4 = lane & 3;
  const uint16_t* r0 = w_up + (long long)(n0 + g) * KDIM;
  const uint16_t* r1 = r0 + 8LL * KDIM;
#pragma unroll
  for (int s = 0; s < USEG; ++s) {
    const int k = k0 + s * 32 + t4 * 8;
    const bool ok = k < KDIM;
    lo[s] = ok ? __ldg(reinterpret_cast<const uint4*>(r0 + k)) : make_uint4(0, 0, 0, 0);
    hi[s] = ok ? __ldg(reinterpret_cast<const uint4*>(r1 + k)) : make_uint4(0, 0, 0, 0);
  }
}

// Up to 64 pairs [c0, pe) of a unit group as one warp holds them: lane l has pairs c0 + l
// and c0 + 32 + l (token word, unit row = unit - n0, running sum; zeros past pe). `first`:
// the first slice of the K range, whose running sums start at 0.
struct PairChunk {
  uint32_t w0, w1;
  int u0, u1;
  float s0, s1;
  __device__ __forceinline__ void load(int c0, int pe, int n0, bool first,
                                       int lane, const uint32_t* __restrict__ col_word,
                                       const uint16_t* __restrict__ col_unit,
                                       const float* __restrict__ sums) {
    const int p0 = c0 + lane, p1 = p0 + 32;
    const bool v0 = p0 < pe, v1 = p1 < pe;
    w0 = v0 ? col_word[p0] : 0u;
    w1 = v1 ? col_word[p1] : 0u;
    u0 = v0 ? (int)col_unit[p0] - n0 : 0;
    u1 = v1 ? (int)col_unit[p1] - n0 : 0;
    s0 = (v0 && !first) ? sums[p0] : 0.f;
    s1 = (v1 && !first) ? sums[p1] : 0.f;
  }
};

// u[pair] = x[token] . w_up[unit] for the pairs of the column view, h = g * u to the row
// view. Grid: (nbu, ksplit); CTA (b, r) covers K columns [r*k_range, (r+1)*k_range).
// up_sum [ksplit, nbu*UB*R]: running sums (with ksplit > 1 the partial sums for
// twell_reuse_up_finish). UP_THREADS threads, UP_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(UP_THREADS, 1)
twell_reuse_up(const uint16_t* __restrict__ x,          // [M, K]
               const uint16_t* __restrict__ w_up,       // [N, K]
               const int* __restrict__ unit_ptr,        // [nbu, N+1]
               const uint32_t* __restrict__ col_word,
               const uint16_t* __restrict__ col_unit,
               const int* __restrict__ col_dst,
               int M, int N, int max_row_nnz, int k_range,
               float* __restrict__ up_sum,              // [ksplit, nbu*UB*R]
               float* __restrict__ row_h) {             // row view: g in, h out (ksplit 1)
  DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.x, r = blockIdx.y, splits = gridDim.y;
  const int k_begin = r * k_range;
  const int k_end = imin(KDIM, k_begin + k_range);
  const int slices = k_end > k_begin ? (k_end - k_begin + UKS - 1) / UKS : 0;
  const long long cap = (long long)gridDim.x * UB * max_row_nnz;
  float* __restrict__ sums = up_sum + r * cap;
  const int* uptr = unit_ptr + (long long)b * (N + 1);
  const long long row0 = (long long)b * UB;
  const int groups = N / 16;
  const int g = lane >> 2, t4 = lane & 3;
  const int octet = lane >> 3, c8 = lane & 7;  // pair c8 of mma group q is owned by lane 8*(q&3) + c8

  // This warp's groups' pair ranges, once: [2j] = first pair, [2j + 1] = end of group
  // warp + 16 j (one more slot, so the prefetch of "the next group" may read it).
  const int gpw = (groups + UP_WARPS - 1) / UP_WARPS;
  int* gptr = reinterpret_cast<int*>(smem + UP_SMEM_BYTES) + warp * 2 * (gpw + 1);
  for (int j = lane; j <= gpw; j += 32) {
    const int gi = warp + j * UP_WARPS;
    gptr[2 * j] = gi < groups ? uptr[gi * 16] : 0;
    gptr[2 * j + 1] = gi < groups ? uptr[gi * 16 + 16] : 0;
  }
  __syncwarp();
  if (slices > 0) stage_x(smem, x, M, row0, k_begin);
  cp_async_commit();
  for (int sl = 0; sl < slices; ++sl) {
    const int k0 = k_begin + sl * UKS;
    if (UP_STAGES == 2) {
      if (sl + 1 < slices) stage_x(smem + ((sl + 1) & 1) * UP_TILE_BYTES, x, M, row0, k0 + UKS);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint8_t* xs = smem + (UP_STAGES == 2 ? (sl & 1) : 0) * UP_TILE_BYTES;
    const bool first = sl == 0, last = sl == slices - 1;
    const bool final_h = last && splits == 1;

    uint4 a_lo[USEG], a_hi[USEG];
    if (UP_PREFETCH_A && warp < groups) load_a(w_up, warp * 16, k0, lane, a_lo, a_hi);
    // The first 64 pairs of the warp's first group (later: prefetched one group ahead).
    PairChunk cur, nxt;
    if (warp < groups) cur.load(gptr[0], gptr[1], warp * 16, first, lane, col_word, col_unit, sums);
    for (int gi = warp, j = 0; gi < groups; gi += UP_WARPS, ++j) {
      uint4 n_lo[USEG], n_hi[USEG];  // the next group's A operand, in flight meanwhile
      if (!UP_PREFETCH_A) load_a(w_up, gi * 16, k0, lane, a_lo, a_hi);
      else if (gi + UP_WARPS < groups) load_a(w_up, (gi + UP_WARPS) * 16, k0, lane, n_lo, n_hi);
      const int n0 = gi * 16;
      const int pb = gptr[2 * j], pe = gptr[2 * j + 1];
      if (gi + UP_WARPS < groups)
        nxt.load(gptr[2 * j + 2], gptr[2 * j + 3], n0 + 16 * UP_WARPS, first, lane, col_word,
                 col_unit, sums);
      for (int c0 = pb; c0 < pe; c0 += 64) {
        // This lane holds pairs c0 + lane (half 0) and c0 + 32 + lane (half 1).
        if (c0 != pb) cur.load(c0, pe, n0, first, lane, col_word, col_unit, sums);
        const int p0 = c0 + lane, p1 = p0 + 32;
        const bool v0 = p0 < pe, v1 = p1 < pe;
        float s0 = cur.s0, s1 = cur.s1;
        const int nq = imin(8, (pe - c0 + 7) >> 3);
        for (int q = 0; q < nq; ++q) {
          const bool h1 = q >= 4;
          // B operand: column g = pair 8q + g of the chunk; its token's x row.
          const uint32_t tw = __shfl_sync(FULL, h1 ? cur.w1 : cur.w0, ((q & 3) << 3) | g);
          const int tok = (int)(tw & 0xffffu);
          float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int s = 0; s < USEG; ++s) {
            const uint4 bq = *reinterpret_cast<const uint4*>(xs + x_tile_offset(tok, s, t4));
            mma_bf16(d, a_lo[s].x, a_hi[s].x, a_lo[s].y, a_hi[s].y, bq.x, bq.y);
            mma_bf16(d, a_lo[s].z, a_hi[s].z, a_lo[s].w, a_hi[s].w, bq.z, bq.w);
          }
          // D[row][col]: row = unit - n0, col = pair. The owner of pair c8 (unit row ur)
          // takes D[ur][c8] from lane 4*(ur & 7) + c8/2, register (ur >= 8)*2 + (c8 & 1).
          const int ur = h1 ? cur.u1 : cur.u0;
          const int src = ((ur & 7) << 2) | (c8 >> 1);
          const float e0 = __shfl_sync(FULL, d[0], src), e1 = __shfl_sync(FULL, d[1], src);
          const float e2 = __shfl_sync(FULL, d[2], src), e3 = __shfl_sync(FULL, d[3], src);
          const float val = ur >= 8 ? ((c8 & 1) ? e3 : e2) : ((c8 & 1) ? e1 : e0);
          if (octet == (q & 3)) {
            if (h1) s1 += val;
            else s0 += val;
          }
        }
        if (final_h) {
          if (v0) row_h[col_dst[p0]] = bf16_hi(cur.w0) * s0;
          if (v1) row_h[col_dst[p1]] = bf16_hi(cur.w1) * s1;
        } else {
          if (v0) sums[p0] = s0;
          if (v1) sums[p1] = s1;
        }
      }
      cur = nxt;
      if (UP_PREFETCH_A && gi + UP_WARPS < groups) {
#pragma unroll
        for (int s = 0; s < USEG; ++s) a_lo[s] = n_lo[s], a_hi[s] = n_hi[s];
      }
    }
    __syncthreads();  // every warp is done with this x tile
    if (UP_STAGES == 1 && sl + 1 < slices) {
      stage_x(smem, x, M, row0, k0 + UKS);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
}

// h = g * (sum of the K ranges' partial sums, in range order) for every pair of block b.
// Grid: (nbu, any), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
twell_reuse_up_finish(const float* __restrict__ up_sum,    // [ksplit, nbu*UB*R]
                      int ksplit,
                      const int* __restrict__ unit_ptr,    // [nbu, N+1]
                      const uint32_t* __restrict__ col_word,
                      const int* __restrict__ col_dst,
                      int M, int N, int max_row_nnz,
                      float* __restrict__ row_h) {
  const int b = blockIdx.x;
  const long long cap = (long long)gridDim.x * UB * max_row_nnz;
  const int pb = unit_ptr[(long long)b * (N + 1)], pe = unit_ptr[(long long)b * (N + 1) + N];
  for (int p = pb + blockIdx.y * blockDim.x + threadIdx.x; p < pe; p += gridDim.y * blockDim.x) {
    float s = 0.f;
    for (int r = 0; r < ksplit; ++r) s += up_sum[r * cap + p];
    row_h[col_dst[p]] = bf16_hi(col_word[p]) * s;
  }
}

// Baseline (a): h = g * (x[t] . w_up[n]) by a per-token gather of w_up rows from L2, with
// the arithmetic of light_rows.cu (lane = 8 k of each 256-k chunk, dot8 chain, xor
// butterfly), so its h has the same bits. One warp per token, GATHER_WARPS per CTA.
#define GATHER_WARPS 4
#define NCH ((KDIM + 255) / 256)
extern "C" __global__ void __launch_bounds__(GATHER_WARPS * 32)
twell_reuse_up_gather(const uint16_t* __restrict__ x,      // [M, K]
                      const uint16_t* __restrict__ w_up,   // [N, K]
                      const int* __restrict__ row_ptr,     // [nbd, NRC*DB + 1]
                      const uint16_t* __restrict__ row_unit,
                      int M, int N,
                      float* __restrict__ row_h) {         // g in, h out
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * GATHER_WARPS + (threadIdx.x >> 5);
  if (t >= M) return;  // whole warp
  const int nrc = (N + RCH - 1) / RCH;
  const int* rp = row_ptr + (t / DB) * (long long)(nrc * DB + 1) + (int)(t % DB);
  uint4 xv[NCH];
  const uint4* xr = reinterpret_cast<const uint4*>(x + t * KDIM);
#pragma unroll
  for (int c = 0; c < NCH; ++c)
    xv[c] = (c * 256 + lane * 8 < KDIM) ? __ldg(xr + c * 32 + lane) : make_uint4(0, 0, 0, 0);
  for (int c0 = 0; c0 < nrc; c0 += 32) {
    const int c = c0 + lane;
    const int st = c < nrc ? rp[c * DB] : 0, en = c < nrc ? rp[c * DB + 1] : 0;
    const int batch = imin(32, nrc - c0);
    for (int q = 0; q < batch; ++q) {
      const int b0 = __shfl_sync(FULL, st, q), e0 = __shfl_sync(FULL, en, q);
      for (int e = b0; e < e0; ++e) {
        const uint4* wr = reinterpret_cast<const uint4*>(w_up + (long long)row_unit[e] * KDIM);
        uint4 a[NCH];
#pragma unroll
        for (int k = 0; k < NCH; ++k)
          a[k] = (k * 256 + lane * 8 < KDIM) ? __ldg(wr + k * 32 + lane) : make_uint4(0, 0, 0, 0);
        float part = 0.f;
#pragma unroll
        for (int k = 0; k < NCH; ++k) {
          const uint4 xa = xv[k], wa = a[k];
          part = fmaf(bf16_lo(xa.x), bf16_lo(wa.x), part);
          part = fmaf(bf16_hi(xa.x), bf16_hi(wa.x), part);
          part = fmaf(bf16_lo(xa.y), bf16_lo(wa.y), part);
          part = fmaf(bf16_hi(xa.y), bf16_hi(wa.y), part);
          part = fmaf(bf16_lo(xa.z), bf16_lo(wa.z), part);
          part = fmaf(bf16_hi(xa.z), bf16_hi(wa.z), part);
          part = fmaf(bf16_lo(xa.w), bf16_lo(wa.w), part);
          part = fmaf(bf16_hi(xa.w), bf16_hi(wa.w), part);
        }
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1) part += __shfl_xor_sync(FULL, part, d);
        if (lane == 0) row_h[e] = row_h[e] * part;
      }
    }
  }
}

// ================================================================ 5. down
#define DKS TWELL_DOWN_KS
#define DN_WARPS 16
#define DN_THREADS (DN_WARPS * 32)
#define DTW (DB / DN_WARPS)          // tokens per warp
#define DCPL (DKS / 32)              // output columns per lane
#define DLIST 256                    // entries of a warp's shared list
#define DN_STAGE_BYTES (RCH * DKS * 2)
#define DN_SMEM_BYTES (2 * DN_STAGE_BYTES + DN_WARPS * (DLIST * 8 + (DTW + 1) * 4))

__device__ __forceinline__ void stage_w(uint8_t* st, const uint16_t* __restrict__ w_down_t,
                                        int N, int chunk, int k0) {
  constexpr int pieces_per_row = DKS / 8;
  const int u0 = chunk * RCH;
  const int pieces = imin(RCH, N - u0) * pieces_per_row;
  const uint16_t* src = w_down_t + (long long)u0 * KDIM + k0;
#pragma unroll 1
  for (int id = threadIdx.x; id < pieces; id += DN_THREADS) {
    const int u = id / pieces_per_row, c16 = id % pieces_per_row;
    const bool ok = k0 + c16 * 8 < KDIM;
    cp_async16(st + id * 16, ok ? src + u * KDIM + c16 * 8 : w_down_t, ok);
  }
}

// acc += ha * w[row a] (+ hb * w[row b] when two), this lane's DCPL columns; the loads
// of both rows are issued before the first add.
__device__ __forceinline__ void add_entry(float (&acc)[DCPL], const uint8_t* ws, uint32_t a,
                                          float ha, uint32_t b, float hb, bool two = true) {
#if DCPL == 1
  const uint32_t wa = *reinterpret_cast<const uint16_t*>(ws + a);
  const uint32_t wb = two ? *reinterpret_cast<const uint16_t*>(ws + b) : 0u;
  acc[0] = fmaf(ha, bf16_lo(wa), acc[0]);
  if (two) acc[0] = fmaf(hb, bf16_lo(wb), acc[0]);
#elif DCPL == 2
  const uint32_t wa = *reinterpret_cast<const uint32_t*>(ws + a);
  const uint32_t wb = two ? *reinterpret_cast<const uint32_t*>(ws + b) : 0u;
  acc[0] = fmaf(ha, bf16_lo(wa), acc[0]);
  acc[1] = fmaf(ha, bf16_hi(wa), acc[1]);
  if (two) {
    acc[0] = fmaf(hb, bf16_lo(wb), acc[0]);
    acc[1] = fmaf(hb, bf16_hi(wb), acc[1]);
  }
#else
  const uint2 wa = *reinterpret_cast<const uint2*>(ws + a);
  const uint2 wb = two ? *reinterpret_cast<const uint2*>(ws + b) : make_uint2(0, 0);
  acc[0] = fmaf(ha, bf16_lo(wa.x), acc[0]);
  acc[1] = fmaf(ha, bf16_hi(wa.x), acc[1]);
  acc[2] = fmaf(ha, bf16_lo(wa.y), acc[2]);
  acc[3] = fmaf(ha, bf16_hi(wa.y), acc[3]);
  if (two) {
    acc[0] = fmaf(hb, bf16_lo(wb.x), acc[0]);
    acc[1] = fmaf(hb, bf16_hi(wb.x), acc[1]);
    acc[2] = fmaf(hb, bf16_lo(wb.y), acc[2]);
    acc[3] = fmaf(hb, bf16_hi(wb.y), acc[3]);
  }
#endif
}

// One round of a warp's chunk: the entries of its tokens [i0, i1) (as many tokens as fit
// DLIST; one token's entries of a chunk always fit), copied to the warp's list as
// {byte offset of the unit's row in the stage, h}. start: lane i holds token i's first
// entry; end: the warp's end. Returns lo (the round's first entry) and i1.
__device__ __forceinline__ void fill_list(uint2* list, int start, int end, int i0, int unit0,
                                          const uint16_t* __restrict__ row_unit,
                                          const float* __restrict__ row_h, int lane, int& lo,
                                          int& i1) {
  lo = __shfl_sync(FULL, start, i0);
  const unsigned ok = __ballot_sync(FULL, lane > i0 && lane < DTW && start - lo <= DLIST);
  i1 = (end - lo <= DLIST) ? DTW : (31 - __clz((int)ok));
  const int hi = i1 == DTW ? end : __shfl_sync(FULL, start, i1 & 31);
  for (int e = lo + lane; e < hi; e += 32) {
    const uint32_t off = (uint32_t)((int)row_unit[e] - unit0) * (DKS * 2);
    list[e - lo] = make_uint2(off, __float_as_uint(row_h[e]));
  }
}

// y[t, k0 : k0 + DKS] for the light tokens of block b. Grid: (nbd, ceil(K / DKS)),
// DN_THREADS threads, DN_SMEM_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(DN_THREADS, 1)
twell_reuse_down(const uint16_t* __restrict__ w_down_t,  // [N, K]
                 const int* __restrict__ row_ptr,        // [nbd, NRC*DB + 1]
                 const uint16_t* __restrict__ row_unit,
                 const float* __restrict__ row_h,
                 const uint8_t* __restrict__ heavy,      // [M]
                 int M, int N,
                 uint16_t* __restrict__ y) {             // [M, K] out (light rows)
  DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.x, k0 = blockIdx.y * DKS;
  const int nrc = (N + RCH - 1) / RCH;
  const int* rp = row_ptr + (long long)b * (nrc * DB + 1);
  uint2* list = reinterpret_cast<uint2*>(smem + 2 * DN_STAGE_BYTES) + warp * DLIST;
  int* slot = reinterpret_cast<int*>(smem + 2 * DN_STAGE_BYTES + DN_WARPS * DLIST * 8) +
              warp * (DTW + 1);  // first entry of each of the warp's tokens, and the end
  float acc[DTW][DCPL];
#pragma unroll
  for (int i = 0; i < DTW; ++i)
#pragma unroll
    for (int j = 0; j < DCPL; ++j) acc[i][j] = 0.f;

  stage_w(smem, w_down_t, N, 0, k0);
  cp_async_commit();
  for (int c = 0; c < nrc; ++c) {
    if (c + 1 < nrc) stage_w(smem + ((c + 1) & 1) * DN_STAGE_BYTES, w_down_t, N, c + 1, k0);
    cp_async_commit();
    // This warp's tokens' entries of chunk c: [start(0), end) with start(i) in lane i.
    const int* cp = rp + c * DB + warp * DTW;
    const int start = lane < DTW ? cp[lane] : 0;
    const int end = cp[DTW];
    if (lane < DTW) slot[lane] = start;
    if (lane == 0) slot[DTW] = end;
    const int unit0 = c * RCH;
    int i0 = 0, lo, i1;
    fill_list(list, start, end, i0, unit0, row_unit, row_h, lane, lo, i1);  // overlaps the wait
    cp_async_wait<1>();
    __syncthreads();
    const uint8_t* ws = smem + (c & 1) * DN_STAGE_BYTES + lane * (DCPL * 2);
    for (;;) {
      __syncwarp();
#pragma unroll
      for (int i = 0; i < DTW; ++i) {
        if (i >= i0 && i < i1) {
          const int es = slot[i] - lo, ee = slot[i + 1] - lo;
          // Two entries per iteration (their loads overlap); the adds stay in list order.
          int e = es;
#pragma unroll 1
          for (; e + 1 < ee; e += 2) {
            const uint2 ea = list[e], eb = list[e + 1];
            add_entry(acc[i], ws, ea.x, __uint_as_float(ea.y), eb.x, __uint_as_float(eb.y));
          }
          if (e < ee) {
            const uint2 ea = list[e];
            add_entry(acc[i], ws, ea.x, __uint_as_float(ea.y), ea.x, 0.f, false);
          }
        }
      }
      __syncwarp();  // the list is refilled by the next round
      i0 = i1;
      if (i0 >= DTW) break;
      fill_list(list, start, end, i0, unit0, row_unit, row_h, lane, lo, i1);
    }
    __syncthreads();  // the stage is refilled two chunks on
  }
  cp_async_wait<0>();
  // Light tokens only: heavy rows belong to the dense path, rows past M do not exist.
  const int col = k0 + lane * DCPL;
#pragma unroll
  for (int i = 0; i < DTW; ++i) {
    const long long t = (long long)b * DB + warp * DTW + i;
    if (t < M && col < KDIM && !heavy[t]) {
      uint16_t* out = y + t * KDIM + col;
#if DCPL == 1
      *out = (uint16_t)(pack_bf16x2(acc[i][0], 0.f) & 0xffffu);
#elif DCPL == 2
      *reinterpret_cast<uint32_t*>(out) = pack_bf16x2(acc[i][0], acc[i][1]);
#else
      *reinterpret_cast<uint2*>(out) =
          make_uint2(pack_bf16x2(acc[i][0], acc[i][1]), pack_bf16x2(acc[i][2], acc[i][3]));
#endif
    }
  }
}
