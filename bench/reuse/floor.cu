// floor.cu — the consumer loop of a block-reuse down projection alone, as a floor probe
// (bench/dev_reuse_floor.py): what "per-chunk lists, whole warps in step" costs when the
// weight chunks are already in shared memory and the lists are given, i.e. with staging,
// list building and the up half left out.
//
// A CTA owns 128 tokens x 256 output columns: 16 warps, each with 8 token slots; lane l
// holds columns [8l, 8l + 8) of its warp's 8 tokens (64 fp32 sums). The CTA walks `chunks`
// chunks of ROWS weight rows (the units its tokens use, compacted: 256 columns of bf16,
// 512 bytes a row, two stages of ROWS * 512 bytes filled once at the start). Per (warp,
// chunk) a list: a head word (8 slot counts, 4 bits each), the entries sorted by slot
// (uint32 row in the chunk, fp32 h). Every lane of a warp works on the same entry, so the
// warp never diverges: per entry one broadcast of (row, h), one 16-byte shared load per
// lane (a 512-byte row: conflict-free), 8 bf16 unpacks and 8 FMAs.
//
// TWELL_SWITCH 0: static loops over the 8 slots, the slot's count from the head word;
//              1: entries in list order, the slot taken from bits 8..10 of the entry and
//                 dispatched by a switch (the branch is warp-uniform);
//              2: as 1, with the next entry's weights loaded while one is added.
// TWELL_SYNC   1: a __syncthreads() per chunk (what a ring hand-over costs at least).
// TWELL_PREFETCH 1: the next chunk's list loaded before this chunk's entries are added (0:
//              after, so every chunk starts with a round trip to L2 for its list).
//
// Layouts: w [2][ROWS][256] bf16 (uint16); heads [block][chunk][warp] uint32 (CTA i
// takes token block i / slices: the column slices of a block share its lists); ent
// uint32 / hv float [block][chunk][warp][32]; out [cta][128][256] bf16. A list holds at
// most 32 entries (the generator caps it).

#define FULL 0xffffffffu

// acc[slot] += h * v (8 bf16), the slot picked by a switch: the sums stay in registers
// (a dynamic index would put them in local memory); the branch is warp-uniform here.
__device__ __forceinline__ void add_to_slot(uint32_t slot, float h, uint4 v, float (&acc)[8][8]) {
  switch (slot) {
#define FLOOR_CASE(S) \
  case S:             \
    twell_axpy8(h, v, acc[S]); \
    break;
    FLOOR_CASE(0) FLOOR_CASE(1) FLOOR_CASE(2) FLOOR_CASE(3)
    FLOOR_CASE(4) FLOOR_CASE(5) FLOOR_CASE(6) FLOOR_CASE(7)
#undef FLOOR_CASE
  }
}

extern "C" __global__ void __launch_bounds__(512, 1)
twell_floor_down(const uint4* __restrict__ w, const uint32_t* __restrict__ heads,
                 const uint32_t* __restrict__ ent, const float* __restrict__ hv,
                 uint16_t* __restrict__ out, int chunks, int slices) {
  extern __shared__ uint4 stage[];  // [2][ROWS][32]
  for (int i = threadIdx.x; i < 2 * TWELL_ROWS * 32; i += blockDim.x) stage[i] = w[i];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long cta = blockIdx.x, blk = cta / slices;  // the token block's lists
  float acc[8][8];
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[s][j] = 0.f;

  // A list: heads[lid], its entries at ent/hv[lid * 32 + lane] (zero past its end: row 0,
  // slot 0, h 0).
  auto lid_of = [&](int c) { return (blk * chunks + c) * 16 + warp; };
  uint32_t head = 0u, my_e = 0u;
  float my_h = 0.f;
  if (chunks > 0) {
    head = heads[lid_of(0)];
    my_e = ent[lid_of(0) * 32 + lane];
    my_h = hv[lid_of(0) * 32 + lane];
  }
  for (int c = 0; c < chunks; ++c) {
#if TWELL_PREFETCH
    // The next chunk's list loaded now, used after this chunk's entries.
    uint32_t head_n = 0u, e_n = 0u;
    float h_n = 0.f;
    if (c + 1 < chunks) {
      head_n = heads[lid_of(c + 1)];
      e_n = ent[lid_of(c + 1) * 32 + lane];
      h_n = hv[lid_of(c + 1) * 32 + lane];
    }
#endif
    const int total = (int)((head & 15) + ((head >> 4) & 15) + ((head >> 8) & 15) +
                            ((head >> 12) & 15) + ((head >> 16) & 15) +
                            ((head >> 20) & 15) + ((head >> 24) & 15) + ((head >> 28) & 15));
    const uint4* st = stage + (c & 1) * TWELL_ROWS * 32 + lane;
#if TWELL_SWITCH == 2
    // The flat list with the next entry's (row, h) and weights loaded while this one is
    // added (lanes past the list hold row 0: a valid read, never added).
    uint32_t e = __shfl_sync(FULL, my_e, 0);
    float h = __shfl_sync(FULL, my_h, 0);
    uint4 v = st[(e & 255u) * 32];
    for (int j = 0; j < total; ++j) {
      const uint32_t e1 = __shfl_sync(FULL, my_e, (j + 1) & 31);
      const float h1 = __shfl_sync(FULL, my_h, (j + 1) & 31);
      const uint4 v1 = st[(e1 & 255u) * 32];
      add_to_slot((e >> 8) & 7u, h, v, acc);
      e = e1;
      h = h1;
      v = v1;
    }
#elif TWELL_SWITCH
    for (int j = 0; j < total; ++j) {
      const uint32_t e = __shfl_sync(FULL, my_e, j);
      const float h = __shfl_sync(FULL, my_h, j);
      const uint4 v = st[(e & 255u) * 32];
      add_to_slot((e >> 8) & 7u, h, v, acc);
    }
#else
    int j = 0;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int n = (head >> (4 * s)) & 15;
      for (int q = 0; q < n; ++q, ++j) {
        const uint32_t e = __shfl_sync(FULL, my_e, j);
        const float h = __shfl_sync(FULL, my_h, j);
        const uint4 v = st[(e & 255u) * 32];
        twell_axpy8(h, v, acc[s]);
      }
    }
#endif
#if TWELL_SYNC
    __syncthreads();
#endif
#if TWELL_PREFETCH
    head = head_n;
    my_e = e_n;
    my_h = h_n;
#else
    if (c + 1 < chunks) {
      head = heads[lid_of(c + 1)];
      my_e = ent[lid_of(c + 1) * 32 + lane];
      my_h = hv[lid_of(c + 1) * 32 + lane];
    }
#endif
  }
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    uint4 o;
    o.x = twell_pack_bf16x2(acc[s][0], acc[s][1]);
    o.y = twell_pack_bf16x2(acc[s][2], acc[s][3]);
    o.z = twell_pack_bf16x2(acc[s][4], acc[s][5]);
    o.w = twell_pack_bf16x2(acc[s][6], acc[s][7]);
    reinterpret_cast<uint4*>(out + (cta * 128 + warp * 8 + s) * 256)[lane] = o;
  }
}
