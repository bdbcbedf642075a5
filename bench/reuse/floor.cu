// floor.cu — the consumer loop of a block-reuse down projection alone, as a floor probe
// (bench/dev_reuse_floor.py): what "per-chunk lists, whole warps in step" costs when the
// weight chunks are already in shared memory and the lists are given, i.e. with staging,
// list building and the up half left out.
//
// A CTA owns 128 tokens x 256 output columns: 16 warps, each with 8 token slots; lane l
// holds columns [8l, 8l + 8) of its warp's 8 tokens (64 fp32 sums). The CTA walks CHUNKS
// chunks of ROWS weight rows (the units its tokens use, compacted: 256 columns of bf16,
// 512 bytes a row, two stages of ROWS * 512 bytes filled once at the start). Per (warp,
// chunk) a list: a head word (8 slot counts, 4 bits each), the entries sorted by slot
// (uint32 row in the chunk, fp32 h). Every lane of a warp works on the same entry, so the
// warp never diverges: per entry one broadcast of (row, h), one 16-byte shared load per
// lane (a 512-byte row: conflict-free), 8 bf16 unpacks and 8 FMAs.
//
// TWELL_SWITCH 0: static loops over the 8 slots, the slot's count from the head word;
//              1: entries in list order, the slot taken from bits 8..10 of the entry and
//                 dispatched by a switch (the branch is warp-uniform).
// TWELL_SYNC   1: a __syncthreads() per chunk (what a ring hand-over costs at least).
//
// Layouts: w [2][ROWS][256] bf16 (uint16); heads [block][chunk][warp] uint32 (CTA i
// takes token block i / slices: the column slices of a block share its lists); offs the
// same, int32 (start of the list in ent/hv); ent uint32 / hv float; out [cta][128][256]
// bf16. A list holds at most 32 entries (the generator caps it).

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
                 const int* __restrict__ offs, const uint32_t* __restrict__ ent,
                 const float* __restrict__ hv, uint16_t* __restrict__ out, int chunks,
                 int slices) {
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

  for (int c = 0; c < chunks; ++c) {
    const long long lid = (blk * chunks + c) * 16 + warp;
    const uint32_t head = heads[lid];
    const int off = offs[lid];
    const int total = (int)((head & 15) + ((head >> 4) & 15) + ((head >> 8) & 15) +
                                        ((head >> 12) & 15) + ((head >> 16) & 15) +
                                        ((head >> 20) & 15) + ((head >> 24) & 15) +
                                        ((head >> 28) & 15));
    const uint32_t my_e = lane < total ? ent[off + lane] : 0u;
    const float my_h = lane < total ? hv[off + lane] : 0.f;
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
