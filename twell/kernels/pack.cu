// pack.cu — relu + TwELL packing of a dense bf16 gate pre-activation, and heavy-row flags
// (the "pack" route; gate_gemm.cu does the same inside the GEMM's epilogue).
//
// Layouts (row-major): pre [M, N] bf16; packed [M, (N/TILE)*SLOTS] uint32 (docs/format.md:
// word 0 = true count, words 1..c = column | bf16 << 16, ascending columns, unused words
// written as 0 so the output bits are deterministic); heavy [M] uint8.
// Tiling: one warp per row, looping over the row's tiles; lane l owns columns
// [l*EPL, (l+1)*EPL) of the tile (EPL = TILE/32 elements, one vector load).
// A row is heavy if a tile overflows or any pre-activation is non-finite (the routing
// rule of common.cuh; relu decided on bits, NaN counts as a nonzero).
// Limits: N % TILE == 0, N <= 65536, TILE in {32..256}, SLOTS in {2..TILE}.
//
// Compile-time parameters: TWELL_TILE, TWELL_SLOTS; constants TWELL_PACK_WARPS and
// TWELL_PACK_SIMD (pack.py): the bit tests two bf16 per instruction (twell_tile_bits, the
// same mask as twell_relu_keeps), and a tile without entries stored as zeros straight
// away (no prefix sum, no staging); 0: one value at a time. The same words either way.

#define EPL (TWELL_TILE / 32)
#define PACK_WARPS TWELL_PACK_WARPS

extern "C" __global__ void __launch_bounds__(PACK_WARPS * 32)
twell_pack_rows(const uint16_t* __restrict__ pre,   // [M, N] bf16 bits, gate pre-activation
                uint32_t* __restrict__ packed,      // [M, N/TILE*SLOTS] out
                uint8_t* __restrict__ heavy,        // [M] out: 1 = route to the dense part
                int M, int N) {
  __shared__ uint32_t stage[PACK_WARPS][TWELL_SLOTS];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long row = (long long)blockIdx.x * PACK_WARPS + warp;
  if (row >= M) return;
  const int tiles = N / TWELL_TILE;
  const uint16_t* src = pre + row * (long long)N;
  uint32_t* dst = packed + row * (long long)tiles * TWELL_SLOTS;
  bool is_heavy = false;

  uint32_t next[(EPL + 1) / 2];
  twell_load_lane<EPL>(src + lane * EPL, next);
  for (int j = 0; j < tiles; ++j) {
#if TWELL_PACK_SIMD
    uint32_t raw[(EPL + 1) / 2];
#pragma unroll
    for (int w = 0; w < (EPL + 1) / 2; ++w) raw[w] = next[w];
    if (j + 1 < tiles) twell_load_lane<EPL>(src + (j + 1) * TWELL_TILE + lane * EPL, next);
    uint32_t mask;
    bool bad;
    twell_tile_bits<EPL, true>(raw, mask, bad);
    is_heavy |= __any_sync(0xffffffffu, bad);
    if (__ballot_sync(0xffffffffu, mask != 0u) == 0u) {  // no entry: count 0, zeros
      for (int w = lane; w < TWELL_SLOTS; w += 32) __stcs(dst + j * TWELL_SLOTS + w, 0u);
      continue;
    }
    const int mine = __popc(mask);
    const int incl = twell_warp_prefix(mine, lane);
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    is_heavy |= twell_tile_overflows(total, TWELL_SLOTS);
    for (int w = lane; w < TWELL_SLOTS; w += 32) stage[warp][w] = 0u;
    __syncwarp();
    if (!twell_tile_overflows(total, TWELL_SLOTS) && mask != 0u) {
      uint16_t v[EPL];
      twell_unpack_lane<EPL>(raw, v);
      int slot = 1 + incl - mine;
      const uint32_t col0 = (uint32_t)(j * TWELL_TILE + lane * EPL);
#pragma unroll
      for (int e = 0; e < EPL; ++e)
        if (mask & (1u << e)) stage[warp][slot++] = (col0 + e) | ((uint32_t)v[e] << 16);
    }
#else
    uint16_t v[EPL];
    twell_unpack_lane<EPL>(next, v);
    if (j + 1 < tiles) twell_load_lane<EPL>(src + (j + 1) * TWELL_TILE + lane * EPL, next);

    const TwellTileScan scan = twell_scan_tile<EPL>(v, lane);
    const uint32_t mask = scan.mask;
    const int mine = scan.mine, incl = scan.incl, total = scan.total;
    is_heavy |= twell_tile_overflows(total, TWELL_SLOTS) || scan.bad;

    // Stage the tile's words in shared memory, then store them coalesced.
    for (int w = lane; w < TWELL_SLOTS; w += 32) stage[warp][w] = 0u;
    __syncwarp();
    if (!twell_tile_overflows(total, TWELL_SLOTS)) {
      int slot = 1 + incl - mine;
      const uint32_t col0 = (uint32_t)(j * TWELL_TILE + lane * EPL);
#pragma unroll
      for (int e = 0; e < EPL; ++e)
        if (mask & (1u << e)) stage[warp][slot++] = (col0 + e) | ((uint32_t)v[e] << 16);
    }
#endif
    if (lane == 0) stage[warp][0] = (uint32_t)total;
    __syncwarp();
    for (int w = lane; w < TWELL_SLOTS; w += 32) __stcs(dst + j * TWELL_SLOTS + w, stage[warp][w]);
    __syncwarp();
  }
  if (lane == 0) heavy[row] = is_heavy ? 1 : 0;
}
