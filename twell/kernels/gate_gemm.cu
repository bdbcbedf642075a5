// gate_gemm.cu — the gate GEMM with relu and TwELL packing in its epilogue (Hopper:
// TMA loads, wgmma on tensor cores, warp specialisation).
//
//   pre[m, n] = bf16(sum_k x[m, k] * w[n, k])          (fp32 accumulation)
//   packed    = TwELL of relu(pre) (docs/format.md), heavy[m] = 1 for a row with a tile over
//               SLOTS-1 nonzeros or a non-finite pre-activation (never cleared: the
//               caller zeroes heavy first, every CTA touching the row may set it)
//
// The dense pre-activation never reaches global memory (TWELL_OUTPUT 0, what twell runs).
// Five other builds of the same source serve checks and measurements, never the ops:
// TWELL_OUTPUT 1 writes the bf16 pre-activation [M, N] instead of packing (tests compare
// the packed words with pack.cu applied to it), TWELL_OUTPUT 2 stores nothing (the main
// loop's time, docs/history.md, Gate GEMM); 3 and 4 time parts of the epilogue: 3 fills the
// bf16 tile and hands it over, but the packer warps do nothing with it; 4 only hands it
// over (the barriers, no tile stores); 5 packs as 0 and records, per CTA, clock64 cycles
// of its parts into `pre` (uint64 [grid, 8]: the consumers' time to their end, their
// waits for a free tile, their epilogue (both with their share of the last tile's
// packing; these three as warp 4, the first consumer warp, saw them), the packers' work,
// their waits for a full tile, the last tile's packing, the tiles, the packers' time to
// their end).
//
// TWELL_OUTPUT 6, the *count* build, is dense math for a number of rows known only on
// the device (the heavy rows of a call, pipeline.heavy_rows_counted): the rows are
// min(M, *rows) (`rows` may be given to the other builds too), and the reduction is split
// over S parts, S a function of that row count (twell_count_splits: enough work units to
// fill SPLIT_UNITS SMs); each part stores its fp32 sums in `part` ([S, rows rounded up to
// BM, N]) for twell_gate_gemm_reduce to add in a fixed order. With S = 1 the bf16 tile goes
// out as in TWELL_OUTPUT 1 (both builds: row m to `out_ids[m]` when given, else m), as
// bf16(relu(g) * u) when a gate is given (g: row gate_ids[m], or m, of `gate`). The gate
// rows of a tile land in the bf16 tile itself, by bulk copies (one per row, by id) that
// the packer warps issue as soon as they have stored the tile before: they arrive while
// the consumers' main loop runs, and the consumers multiply in their epilogue, so no load
// latency follows the main loop. With `direct` set and the count covering all M rows,
// the producer reads x through `map_all` (the matrix the caller gathered x from by
// ascending ids, which the count then makes the identity): the gather is skipped
// (twell_gather_counted with skip_all).
//
// Structure: a persistent grid (one CTA per SM) walks 128 x 256 output tiles in groups of
// row tiles, each group column by column (unit_of: the CTAs running at once share a block
// of x's rows and of w's, which stay in L2). Warpgroup 0: one thread issues TMA loads of
// x [128 x 64] and w [256 x 64] (128-byte swizzle) into a STAGES-deep ring guarded by
// mbarriers; its other three warps are the packers. Warpgroups 1 and 2 are
// the consumers: each owns 64 rows of the tile and runs wgmma.m64n256k16 over the ring
// (fp32 accumulators in registers, 128 per thread), releasing a stage once the wgmma
// reading it has retired.
// Epilogue: the consumers round their accumulators to bf16 into a padded tile in shared
// memory and go on with the next tile at once; meanwhile the packer warps turn the tile
// into TwELL words (a warp per row, lane = 8 consecutive columns, segmented prefix sum per
// TwELL tile, as pack.cu: entries in ascending column order, unused words 0, so the bits
// are deterministic) and set the heavy flags. Two named barriers pass the tile back and
// forth, so packing overlaps the tensor-core work of the next tile; the CTA's last tile,
// which no main loop follows, the consumer warps pack with the packers.
//
// Limits: K % 8 == 0 (TMA row pitch), N % TWELL_TILE == 0, TWELL_TILE divides 256,
// TWELL_SLOTS <= TWELL_TILE; x and w 16-byte aligned. Rows and columns past M, N and K
// come in as zeros (TMA out-of-bounds fill) and are never stored.
//
// Compile-time parameters: TWELL_TILE, TWELL_SLOTS, TWELL_OUTPUT, TWELL_STAGES and
// TWELL_SMEM_BYTES (the launcher's sum for that ring, checked here); constants from the
// launcher: TWELL_BLOCK_M/N/K, TWELL_CONSUMERS.

// Constants shared with the launcher (gate_gemm.py passes them in the prelude).
#define BM TWELL_BLOCK_M
#define BN TWELL_BLOCK_N
#define BK TWELL_BLOCK_K
#define STAGES TWELL_STAGES
#define CONSUMERS TWELL_CONSUMERS
static_assert(BN == 256 && BK == 64 && BM == 64 * CONSUMERS,
              "wgmma.m64n256k16 per consumer warpgroup, 128-byte swizzled k-steps of 64");
#define THREADS (128 * (CONSUMERS + 1))
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define PACKER_WARPS 3          // warps 1-3 of warpgroup 0
#define ROWS_IN_FLIGHT 4
#define ALL_WARPS (PACKER_WARPS + 4 * CONSUMERS)  // who packs a CTA's last tile
#define EPI_PITCH (BN * 2 + 16)  // bytes per row of the bf16 tile (padding: no bank conflicts)
#define EPI_BYTES (TWELL_OUTPUT == 2 ? 0 : BM * EPI_PITCH)  // the main loop alone needs no tile
#define PACKS (TWELL_OUTPUT == 0 || TWELL_OUTPUT == 5)
#define PROFILE (TWELL_OUTPUT == 5)
#define COUNTED (TWELL_OUTPUT == 6)
#define STORE_ROWS (COUNTED ? TWELL_STORE_ROWS : 1)  // rows a packer warp stores per step
#define BARRIER_OFFSET (STAGES * STAGE_BYTES + EPI_BYTES)
// Dynamic shared memory the launcher asks for: the ring's full and empty mbarriers, the
// gate tile's, and 1024 bytes of slack for alignment.
static_assert(TWELL_SMEM_BYTES == BARRIER_OFFSET + (2 * STAGES + 1) * 8 + 1024,
              "gate_gemm.py's SMEM_BYTES");
#define LANES_PER_TILE (TWELL_TILE / 8)

// d[0..127] += A (64 x 16, K-major, smem) * B (256 x 16, K-major, smem)^T, fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a,
                                                 uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

// Named barriers between the consumers (they fill the bf16 tile) and the packer warps
// (they drain it). Barrier 0 is __syncthreads'.
#define BAR_TILE_FULL 1
#define BAR_TILE_FREE 2
#define BAR_COUNT (CONSUMERS * 128 + PACKER_WARPS * 32)
__device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(BAR_COUNT) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(BAR_COUNT) : "memory");
}
// The packer warps among themselves (the count build's gate: all have read the tile
// before one issues the copies that overwrite it).
#define BAR_PACKERS 3
__device__ __forceinline__ void bar_sync_packers() {
  asm volatile("bar.sync %0, %1;" ::"n"(BAR_PACKERS), "n"(PACKER_WARPS * 32) : "memory");
}

// One row of the bf16 tile (this lane's 8 columns [8l, 8l + 8) in q) -> its TwELL words
// for the CTA's 256 columns (256/TILE TwELL tiles) and its heavy flag; a whole warp.
// Prefix sums by ballots of the count bits (no chain of shuffles).
__device__ __forceinline__ void pack_row(uint4 q, uint32_t* __restrict__ dst, int tiles_here,
                                         int col0, int lane, uint8_t* __restrict__ heavy_flag) {
  const uint32_t raw[4] = {q.x, q.y, q.z, q.w};
  uint32_t mask = 0, bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // both halves as the top bits of a 32-bit word
    const uint32_t hi = raw[i] & 0xffff0000u, lo = raw[i] << 16;
    const uint32_t nz_lo = twell_relu_keeps_top(lo), nz_hi = twell_relu_keeps_top(hi);
    mask |= (nz_lo | (nz_hi << 1)) << (2 * i);
    bad |= twell_non_finite_top(lo) | twell_non_finite_top(hi);
  }
  const uint32_t mine = __popc(mask);  // 0..8: four bits
  const uint32_t seg_mask =
      LANES_PER_TILE == 32 ? 0xffffffffu
                           : ((1u << LANES_PER_TILE) - 1u) << (lane & ~(LANES_PER_TILE - 1));
  const uint32_t below = seg_mask & ((1u << lane) - 1u);
  const uint32_t b0 = __ballot_sync(0xffffffffu, mine & 1u);
  const uint32_t b1 = __ballot_sync(0xffffffffu, mine & 2u);
  const uint32_t b2 = __ballot_sync(0xffffffffu, mine & 4u);
  const uint32_t b3 = __ballot_sync(0xffffffffu, mine & 8u);
  const int excl = __popc(b0 & below) + 2 * __popc(b1 & below) + 4 * __popc(b2 & below) +
                   8 * __popc(b3 & below);
  const int total = __popc(b0 & seg_mask) + 2 * __popc(b1 & seg_mask) +
                    4 * __popc(b2 & seg_mask) + 8 * __popc(b3 & seg_mask);
  const bool over = twell_tile_overflows(total, TWELL_SLOTS);
  if (__ballot_sync(0xffffffffu, over || bad) && lane == 0) *heavy_flag = 1;
  const int seg = lane / LANES_PER_TILE, seg_lane = lane % LANES_PER_TILE;
  if (seg >= tiles_here) return;  // columns past N (zeros from TMA): nothing to store
  uint32_t* out = dst + seg * TWELL_SLOTS;
  // Words: 0 = count; 1..total = entries (their owners write them); the rest 0.
#pragma unroll
  for (int w0 = 0; w0 < TWELL_SLOTS; w0 += LANES_PER_TILE) {
    const int w = w0 + seg_lane;
    if (w == 0) out[0] = (uint32_t)total;
    else if (w < TWELL_SLOTS && (over || w > total)) out[w] = 0u;
  }
  if (!over) {  // entries: only this lane's set bits (most lanes have none)
    int slot = 1 + excl;
    const uint32_t col = (uint32_t)(col0 + lane * 8);
    for (uint32_t left = mask; left; left &= left - 1u) {
      const int e = __ffs(left) - 1;
      const uint32_t word = e < 4 ? (e < 2 ? raw[0] : raw[1]) : (e < 6 ? raw[2] : raw[3]);
      const uint32_t bits = (e & 1) ? (word & 0xffff0000u) : (word << 16);
      out[slot++] = (col + e) | bits;
    }
  }
}

// Whether `tile` is the CTA's last (the persistent grid's stride is gridDim.x): the
// packers and the consumers decide it alike.
__device__ __forceinline__ bool final_tile(int tile, int tiles) {
  return tile + (int)gridDim.x >= tiles;
}

// Rows g, g + warps, g + 2 warps, ... of the bf16 tile -> their TwELL words and heavy
// flags; warp g of `warps` (ROWS_IN_FLIGHT rows' tile loads in flight per step).
__device__ __forceinline__ void pack_rows(uint32_t tile_addr, int g, int warps, int m0, int n0,
                                          int cols, int M, int N, int lane,
                                          uint32_t* __restrict__ packed,
                                          uint8_t* __restrict__ heavy) {
  const long long row_words = (long long)(N / TWELL_TILE) * TWELL_SLOTS;
  const long long first = (long long)(n0 / TWELL_TILE) * TWELL_SLOTS;
  const uint32_t addr = tile_addr + lane * 16;
  for (int r0 = g; r0 < BM; r0 += ROWS_IN_FLIGHT * warps) {
    uint4 q[ROWS_IN_FLIGHT];
#pragma unroll
    for (int i = 0; i < ROWS_IN_FLIGHT; ++i)
      q[i] = twell_lds128(addr + min(r0 + i * warps, BM - 1) * EPI_PITCH);
#pragma unroll
    for (int i = 0; i < ROWS_IN_FLIGHT; ++i) {
      const int r = r0 + i * warps;
      const long long m = (long long)m0 + r;
      if (r < BM && m < M)
        pack_row(q[i], packed + m * row_words + first, cols / TWELL_TILE, n0, lane, heavy + m);
    }
  }
}

// The rows a launch computes: min(M, *rows), or M without a device count.
__device__ __forceinline__ int rows_in(const int* __restrict__ rows, int M) {
  return rows == nullptr ? M : min(M, max(rows[0], 0));
}

// The parts of the reduction of the count build for `m_rows` rows (1 in the other builds):
// the most parts, at most max_splits, that keep the work units (row tiles x column tiles
// x parts) within SPLIT_UNITS, with no empty part. A function of the row count and the
// shape alone (not of the GPU), so the bits are too; gate_gemm.py's count_splits mirrors it.
__device__ __forceinline__ int twell_count_splits(int m_rows, int tiles_n, int kblocks,
                                                  int max_splits) {
  const int units = ((m_rows + BM - 1) / BM) * tiles_n;
  if (!COUNTED || units == 0) return 1;
  const int s = max(1, min(max_splits, min(kblocks, TWELL_SPLIT_UNITS / units)));
  const int per = (kblocks + s - 1) / s;
  return (kblocks + per - 1) / per;
}

// Work unit `t` of a launch: its output tile (m0, n0), its part of the reduction and the
// k blocks [kb0, kb1) that part sums. Units run part-major; within a part, in groups of
// `group` row tiles (the last group may be smaller), each group column by column, rows
// fastest: the tiles in flight at once cover a block of rows and columns, so fewer of
// x's and w's tiles compete for L2 with the streamed output (group 1: row by row).
struct Unit {
  int m0, n0, part, kb0, kb1;
};
__device__ __forceinline__ Unit unit_of(int t, int tiles_mn, int tiles_n, int per, int kblocks,
                                        int group) {
  Unit u;
  u.part = t / tiles_mn;
  const int r = t - u.part * tiles_mn;
  const int tiles_m = tiles_mn / tiles_n;
  const int g = r / (group * tiles_n), first = g * group;
  const int rows = min(group, tiles_m - first);
  const int q = r - first * tiles_n;
  u.m0 = (first + q % rows) * BM;
  u.n0 = (q / rows) * BN;
  u.kb0 = u.part * per;
  u.kb1 = min(kblocks, u.kb0 + per);
  return u;
}

// The gate rows of unit `u` (row gate_ids[m], or m, of `gate`, its columns of the tile)
// into the bf16 tile at `tile_addr`, completing on `bar`; one warp.
__device__ __forceinline__ void load_gate_tile(uint32_t tile_addr, uint32_t bar,
                                               const uint16_t* __restrict__ gate,
                                               const int* __restrict__ gate_ids, const Unit& u,
                                               int m_rows, int N, int lane) {
  const int rows = min(BM, m_rows - u.m0);
  const uint32_t bytes = (uint32_t)min(BN, N - u.n0) * 2;
  if (lane == 0) twell_mbar_expect_tx(bar, bytes * (uint32_t)rows);
  for (int r = lane; r < rows; r += 32) {
    const long long m = u.m0 + r;
    const long long g = gate_ids == nullptr ? m : gate_ids[m];
    twell_bulk_load(tile_addr + r * EPI_PITCH, gate + g * N + u.n0, bytes, bar);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
twell_gate_gemm(const __grid_constant__ TwellTmaDesc map_x,  // x [M, K], box 64 x 128
                const __grid_constant__ TwellTmaDesc map_w,  // w [N, K], box 64 x 256
                const __grid_constant__ TwellTmaDesc map_all,  // x's source (6, direct)
                uint32_t* __restrict__ packed,          // [M, N/TILE*SLOTS] (OUTPUT 0, 5)
                uint8_t* __restrict__ heavy,            // [M], zeroed by the caller (0, 5)
                uint16_t* __restrict__ pre,             // [M, N] bf16 (1, 6); uint64 [grid, 8] (5)
                float* __restrict__ part,               // [S, M rounded up to BM, N] (6)
                const int* __restrict__ rows,           // device row count, or null: M
                const int* __restrict__ out_ids,        // bf16 row m -> out_ids[m] (1, 6), or null
                const uint16_t* __restrict__ gate,      // [*, N] bf16 (6, one part), or null
                const int* __restrict__ gate_ids,       // row m's gate: gate_ids[m], or null: m
                int M, int N, int K, int max_splits, int direct, int group) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = twell_smem_addr(smem_raw);
  uint8_t* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);  // 1024-aligned (swizzle)
  const uint32_t sbase = twell_smem_addr(smem);
  uint8_t* tile_smem = smem + STAGES * STAGE_BYTES;  // the bf16 tile, EPI_PITCH-byte rows
  const uint32_t full_bar = sbase + BARRIER_OFFSET;  // STAGES barriers, 8 bytes each
  const uint32_t empty_bar = full_bar + STAGES * 8;
  const uint32_t gate_bar = empty_bar + STAGES * 8;  // the gate tile's (count build)

  const int tiles_n = (N + BN - 1) / BN;
  const int kblocks = (K + BK - 1) / BK;
  const int m_rows = rows_in(rows, M);
  const int tiles_m = (m_rows + BM - 1) / BM;
  const int splits = twell_count_splits(m_rows, tiles_n, kblocks, max_splits);
  const int per = (kblocks + splits - 1) / splits;
  const int tiles_mn = tiles_m * tiles_n;
  const int tiles = tiles_mn * splits;  // work units
  // The count build's gate, unsplit, comes through the bf16 tile (see the header).
  const bool gate_tile = COUNTED && gate != nullptr && splits == 1;
  const int wg = threadIdx.x / 128;
  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const long long t_start = PROFILE ? clock64() : 0;
  uint64_t* prof = PROFILE ? reinterpret_cast<uint64_t*>(pre) + blockIdx.x * 8 : nullptr;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      twell_mbar_init(full_bar + 8 * s, 1);
      twell_mbar_init(empty_bar + 8 * s, CONSUMERS);
    }
    twell_mbar_init(gate_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    if (tid == 0) {  // the producer: TMA loads into the ring
      const TwellTmaDesc* src = COUNTED && direct && m_rows == M ? &map_all : &map_x;
      int it = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const Unit u = unit_of(tile, tiles_mn, tiles_n, per, kblocks, group);
        for (int kb = u.kb0; kb < u.kb1; ++kb, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) twell_mbar_wait(empty_bar + 8 * s, ((it / STAGES) - 1) & 1);
          const uint32_t a = sbase + s * STAGE_BYTES;
          twell_mbar_expect_tx(full_bar + 8 * s, STAGE_BYTES);
          twell_tma_load_2d(a, src, kb * BK, u.m0, full_bar + 8 * s);
          twell_tma_load_2d(a + A_BYTES, &map_w, kb * BK, u.n0, full_bar + 8 * s);
        }
      }
    }
    // The parts of a split reduction store from the consumers' registers: no bf16 tile.
    if (tid < 32 || TWELL_OUTPUT == 2 || splits > 1) return;
    // Packer warps: drain each finished bf16 tile while the consumers compute the next.
    const int pw = tid / 32 - 1;
    long long wait_full = 0, busy = 0, last = 0;
    if (!gate_tile) {
      bar_arrive(BAR_TILE_FREE);  // the tile buffer starts free
    } else if (pw == 0 && (int)blockIdx.x < tiles) {  // the first tile's gate rows
      load_gate_tile(twell_smem_addr(tile_smem), gate_bar, gate, gate_ids,
                     unit_of(blockIdx.x, tiles_mn, tiles_n, per, kblocks, group), m_rows, N, lane);
    }
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const Unit u = unit_of(tile, tiles_mn, tiles_n, per, kblocks, group);
      const int m0 = u.m0, n0 = u.n0;
      const int cols = min(BN, N - n0);
      const long long t0 = PROFILE ? clock64() : 0;
      bar_sync(BAR_TILE_FULL);
      const long long t1 = PROFILE ? clock64() : 0;
      if (PACKS) {
        // The packers are busy for the whole main loop; scanning the four rows of a step
        // before any of their stores, so that they interleave, was slower (H100, M=16384:
        // 0.608 against 0.581 ms; docs/history.md, Gate GEMM). The CTA's last tile, which
        // no main loop hides, the consumer warps pack with them (half the tail, ~2% at
        // M=16384).
        pack_rows(twell_smem_addr(tile_smem), pw,
                  final_tile(tile, tiles) ? ALL_WARPS : PACKER_WARPS, m0, n0, cols, M, N, lane,
                  packed, heavy);
      } else if (TWELL_OUTPUT == 1 || COUNTED) {
        // The bf16 tile (with a gate, the consumers multiplied it in) to its rows of `pre`,
        // STORE_ROWS rows per step, their ids loaded before the stores.
        for (int r0 = pw; r0 < BM; r0 += PACKER_WARPS * STORE_ROWS) {
          long long o[STORE_ROWS];
#pragma unroll
          for (int i = 0; i < STORE_ROWS; ++i) {
            const int m = min(m0 + r0 + i * PACKER_WARPS, m_rows - 1);
            o[i] = out_ids == nullptr ? m : out_ids[m];
          }
#pragma unroll
          for (int i = 0; i < STORE_ROWS; ++i) {
            const int r = r0 + i * PACKER_WARPS;
            if (r < BM && m0 + r < m_rows && lane * 8 < cols)
              *reinterpret_cast<uint4*>(pre + o[i] * N + n0 + lane * 8) =
                  *reinterpret_cast<const uint4*>(tile_smem + r * EPI_PITCH + lane * 16);
          }
        }
        if (gate_tile && !final_tile(tile, tiles)) {  // the next tile's gate rows, once
          twell_fence_proxy_async();                 // every packer has read this one
          bar_sync_packers();
          if (pw == 0)
            load_gate_tile(twell_smem_addr(tile_smem), gate_bar, gate, gate_ids,
                           unit_of(tile + gridDim.x, tiles_mn, tiles_n, per, kblocks, group),
                           m_rows, N, lane);
        }
      }
      if (PROFILE) {
        const long long t2 = clock64();
        wait_full += t1 - t0;
        busy += t2 - t1;
        last = t2 - t1;
      }
      if (!gate_tile && !final_tile(tile, tiles)) bar_arrive(BAR_TILE_FREE);  // the next sync's
    }
    if (PROFILE && pw == 0 && lane == 0) {
      prof[3] = busy;
      prof[4] = wait_full;
      prof[5] = last;
      prof[7] = clock64() - t_start;
    }
    return;
  }

  const int c = wg - 1;  // consumer: rows [64c, 64c + 64) of the tile
  const int warp = tid / 32;
  int it = 0, local = 0;  // k steps and tiles so far
  long long wait_free = 0, epilogue = 0, count = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++local) {
    const Unit u = unit_of(tile, tiles_mn, tiles_n, per, kblocks, group);
    const int m0 = u.m0, n0 = u.n0;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    twell_wgmma_fence_regs(d);
    for (int kb = u.kb0; kb < u.kb1; ++kb, ++it) {
      const int s = it % STAGES;
      twell_mbar_wait(full_bar + 8 * s, (it / STAGES) & 1);
      const uint32_t a = sbase + s * STAGE_BYTES + c * (64 * 128);
      const uint32_t b = sbase + s * STAGE_BYTES + A_BYTES;
      twell_wgmma_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; ++k)
        wgmma_m64n256k16(d, twell_wgmma_desc(a + 32 * k), twell_wgmma_desc(b + 32 * k));
      twell_wgmma_commit();
      twell_wgmma_wait<1>();  // the previous stage's wgmma has retired: hand its stage back
      if (kb > u.kb0 && tid == 0) twell_mbar_arrive(empty_bar + 8 * ((it - 1) % STAGES));
    }
    twell_wgmma_wait<0>();
    twell_wgmma_fence_regs(d);
    if (tid == 0) twell_mbar_arrive(empty_bar + 8 * ((it - 1) % STAGES));
    if (TWELL_OUTPUT == 2 || TWELL_OUTPUT == 4) {
      // The timing builds store nothing, but the accumulators must stay live: without a
      // use, ptxas drops the wgmma instructions (18 registers) and the "main loop" times
      // the TMA loads alone. M is never negative, so the branch never runs (heavy may be
      // null here).
      if (M < 0) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 128; ++i) sum += d[i];
        heavy[threadIdx.x] = (uint8_t)__float_as_uint(sum);
      }
      if (TWELL_OUTPUT == 2) continue;  // the main loop alone
    }

    // This thread holds rows r and r + 8 of the tile, columns 8j + 2(lane % 4) + {0, 1}
    // (the wgmma accumulator layout).
    if (COUNTED && splits > 1) {  // a part's fp32 sums, straight from the registers
      const int r = m0 + c * 64 + warp * 16 + lane / 4;
      float* p = part + ((long long)u.part * tiles_m * BM + r) * N + n0 + (lane % 4) * 2;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (n0 + 8 * j + (lane % 4) * 2 < N) {
          if (r < m_rows) *reinterpret_cast<float2*>(p + 8 * j) = make_float2(d[4 * j], d[4 * j + 1]);
          if (r + 8 < m_rows)
            *reinterpret_cast<float2*>(p + 8 * N + 8 * j) = make_float2(d[4 * j + 2], d[4 * j + 3]);
        }
      }
      continue;
    }
    // Round to bf16 into the shared tile, then hand it over.
    const long long t0 = PROFILE ? clock64() : 0;
    if (gate_tile) twell_mbar_wait(gate_bar, local & 1);  // the tile holds its gate rows
    else bar_sync(BAR_TILE_FREE);
    const long long t1 = PROFILE ? clock64() : 0;
    const int r = c * 64 + warp * 16 + lane / 4;
    uint8_t* p0 = tile_smem + r * EPI_PITCH + (lane % 4) * 4;
    uint8_t* p1 = p0 + 8 * EPI_PITCH;
#pragma unroll
    for (int j = 0; j < 32 && TWELL_OUTPUT != 4; ++j) {
      uint32_t* q0 = reinterpret_cast<uint32_t*>(p0 + j * 16);
      uint32_t* q1 = reinterpret_cast<uint32_t*>(p1 + j * 16);
      const uint32_t v0 = twell_pack_bf16x2(d[4 * j], d[4 * j + 1]);
      const uint32_t v1 = twell_pack_bf16x2(d[4 * j + 2], d[4 * j + 3]);
      *q0 = gate_tile ? twell_relu_mul_bf16x2(*q0, v0) : v0;
      *q1 = gate_tile ? twell_relu_mul_bf16x2(*q1, v1) : v1;
    }
    if (PACKS && final_tile(tile, tiles)) {  // help pack the CTA's last tile
      bar_sync(BAR_TILE_FULL);
      pack_rows(twell_smem_addr(tile_smem), PACKER_WARPS + warp + 4 * c, ALL_WARPS, m0, n0,
                min(BN, N - n0), M, N, lane, packed, heavy);
    } else {
      bar_arrive(BAR_TILE_FULL);
    }
    if (PROFILE) {
      wait_free += t1 - t0;
      epilogue += clock64() - t0;
      ++count;
    }
  }
  if (PROFILE && threadIdx.x == 128) {
    prof[0] = clock64() - t_start;
    prof[1] = wait_free;
    prof[2] = epilogue;
    prof[6] = count;
  }
}

// ---- around the count build (pipeline.heavy_rows_counted) ------------------------------
// The count build's output for its min(M, *rows) rows, rows i of out[out_ids[i]] (or
// out[i]), N bf16 wide:
//   v = the sum of the parts (fp32, part 0 first) where the launch split its reduction
//       (part: [S, M rounded up to BM, N]), else the bf16 the launch stored (`single`,
//       [M, N]); neither given: v = 1;
//   out = bf16(relu(g) * bf16(v)) with g = gate[gate_ids[i]] (or gate[i]) when `gate` is
//       given (relu keeps NaN: twell_relu_mul's h), else bf16(v).
// S is the launch's own (twell_count_splits of the same rows, N, K and max_splits); a
// launch of one part wrote its output itself (given the same gate), and this kernel does
// nothing. N % 2 == 0.
extern "C" __global__ void __launch_bounds__(256)
twell_gate_gemm_reduce(const float* __restrict__ part, const uint16_t* __restrict__ single,
                       const int* __restrict__ rows, int M, int N, int K, int max_splits,
                       const uint16_t* __restrict__ gate, const int* __restrict__ gate_ids,
                       const int* __restrict__ out_ids, uint16_t* __restrict__ out) {
  const int m_rows = rows_in(rows, M);
  const int has_source = part != nullptr || single != nullptr;
  const int splits =
      has_source ? twell_count_splits(m_rows, (N + BN - 1) / BN, (K + BK - 1) / BK, max_splits)
                 : 1;
  if (has_source && splits == 1) return;
  const long long stride = (long long)((m_rows + BM - 1) / BM) * BM * N;  // one part
  const int pairs = N / 2;
  const long long total = (long long)m_rows * pairs;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(k / pairs);
    const int col = 2 * (int)(k - (long long)i * pairs);
    float v0 = 1.f, v1 = 1.f;
    if (has_source && splits > 1) {
      const float* p = part + (long long)i * N + col;
      v0 = 0.f;
      v1 = 0.f;
      for (int s = 0; s < splits; ++s) {
        const float2 q = *reinterpret_cast<const float2*>(p + s * stride);
        v0 += q.x;
        v1 += q.y;
      }
    } else if (has_source) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(single + (long long)i * N + col);
      v0 = __uint_as_float(w << 16);
      v1 = __uint_as_float(w & 0xffff0000u);
    }
    if (gate != nullptr) {
      const long long g_row = gate_ids == nullptr ? i : gate_ids[i];
      const uint32_t gw = *reinterpret_cast<const uint32_t*>(gate + g_row * N + col);
      const uint32_t g0 = gw & 0xffffu, g1 = gw >> 16;
      // bf16(v) first: the up product rounds to bf16 as the capacity GEMMs' does
      v0 = twell_relu_value(g0) * __bfloat162float(__float2bfloat16_rn(v0));
      v1 = twell_relu_value(g1) * __bfloat162float(__float2bfloat16_rn(v1));
    }
    const long long o = out_ids == nullptr ? i : out_ids[i];
    *reinterpret_cast<uint32_t*>(out + o * N + col) = twell_pack_bf16x2(v0, v1);
  }
}

// dst[i] = src[ids[i]] for i < min(*rows, M) (rows `width` bf16 wide, width % 8 == 0);
// the rows of dst past the count are left as they are (the count build never stores them).
// With skip_all, a count of all M rows copies nothing (the count build reads src itself).
extern "C" __global__ void __launch_bounds__(256)
twell_gather_counted(const uint16_t* __restrict__ src, int width, const int* __restrict__ ids,
                     const int* __restrict__ rows, int M, uint16_t* __restrict__ dst,
                     int skip_all) {
  const int per_row = width / 8;
  const int m_rows = rows_in(rows, M);
  if (skip_all && m_rows == M) return;
  const long long total = (long long)m_rows * per_row;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(k / per_row), c = (int)(k % per_row);
    reinterpret_cast<uint4*>(dst + (long long)i * width)[c] =
        reinterpret_cast<const uint4*>(src + (long long)ids[i] * width)[c];
  }
}
