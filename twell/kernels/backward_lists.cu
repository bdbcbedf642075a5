// backward_lists.cu — step 2 of the FFN block's backward pass (launched by backward.py):
// the unit lists, the transposed (units x tokens) view of the light pairs, for the
// weight gradients (and the prefill kernels).
//
// twell_bw_unit_count -> twell_bw_unit_chunks -> twell_bw_unit_starts ->
// twell_bw_unit_scatter: a counting sort whose ranks come from popcounts of per-chunk bit
// masks (integer atomicOr in shared memory: order-free), no float atomics. The count and
// scatter kernels take a block per (chunk of CHUNK_ROWS tokens, TwELL tile), its mask one
// bit per (unit of the tile, row of the chunk).
//
// Layouts: packed [M, N/TILE*SLOTS] (the light rows' TwELL words, checked by step 1);
// heavy uint8 [M] (the backward's heavy rows, skipped); tile_off [M, tiles] and the pair
// index p = t·R + r of backward_light.cu. UNIT LISTS: for unit n, entries
// unit_start[n] .. unit_start[n+1]-1 (int32 [N+1]) of
//   tokens int32 [M·R]  the token t, ascending within a unit
//   pairs  int32 [M·R]  the pair index p (where the pair's values live)
// built from per-chunk counts counts int32 [C, N] (C = ceil(M / CHUNK_ROWS); after
// twell_bw_unit_chunks, the exclusive prefix over chunks) and seg_start int32 [N+1]
// (exclusive prefix of the extra segments of each unit, max(0, ceil(count / seg) - 1)).
//
// Limits: N % TILE == 0, N <= 65536; M·R < 2^31.
//
// Compile-time parameters: TWELL_TILE, TWELL_SLOTS; constants shared with backward.py:
// TWELL_BW_CHUNK_ROWS (tokens per block, a multiple of 32), TWELL_BW_UNIT_WARPS (warps
// per block).

#define WPL ((TWELL_SLOTS + 31) / 32)
#define CW (TWELL_BW_CHUNK_ROWS / 32)

// A block's bit masks (and, to scatter, their first list positions) of its chunk and tile.
struct UnitShared {
  uint32_t mask[TWELL_TILE][CW];  // bit r of mask[u][r/32]: row r of the chunk uses unit u
  int start[TWELL_TILE][CW];      // scatter: list position of the first entry of each word
};

// Sets the mask bits of the light rows of chunk c, tile j (TwELL words trusted: step 1
// checked every light row).
__device__ __forceinline__ void build_masks(UnitShared& sm, const uint32_t* __restrict__ packed,
                                            const uint8_t* __restrict__ heavy, int M,
                                            int tiles, int c, int j) {
  uint32_t* flat = &sm.mask[0][0];
  for (int i = threadIdx.x; i < TWELL_TILE * CW; i += blockDim.x) flat[i] = 0u;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < TWELL_BW_CHUNK_ROWS; r += TWELL_BW_UNIT_WARPS) {
    const long long t = (long long)c * TWELL_BW_CHUNK_ROWS + r;
    if (t >= M) break;
    if (heavy[t]) continue;
    const uint32_t* tw = packed + (t * tiles + j) * TWELL_SLOTS;
    const int count = (int)__ldg(tw);
#pragma unroll
    for (int q = 0; q < WPL; ++q) {
      const int idx = q * 32 + lane;
      if (idx >= 1 && idx <= count) {
        const int local = (int)(__ldg(tw + idx) & 0xffffu) - j * TWELL_TILE;
        atomicOr(&sm.mask[local][r >> 5], 1u << (r & 31));
      }
    }
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(TWELL_BW_UNIT_WARPS * 32)
twell_bw_unit_count(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ heavy,
                    int M, int N, int* __restrict__ counts) {  // counts [C, N] out
  __shared__ UnitShared sm;
  const int c = blockIdx.x, j = blockIdx.y;
  build_masks(sm, packed, heavy, M, N / TWELL_TILE, c, j);
  for (int u = threadIdx.x; u < TWELL_TILE; u += blockDim.x) {
    int s = 0;
#pragma unroll
    for (int w = 0; w < CW; ++w) s += __popc(sm.mask[u][w]);
    counts[(long long)c * N + j * TWELL_TILE + u] = s;
  }
}

// counts [C, N] -> exclusive prefix over chunks (in place); totals[n] = entries of unit n.
extern "C" __global__ void twell_bw_unit_chunks(int* __restrict__ counts, int C, int N,
                                                int* __restrict__ totals) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  int run = 0;
  for (int c0 = 0; c0 < C; c0 += 8) {
    int v[8];
#pragma unroll
    for (int b = 0; b < 8; ++b) v[b] = c0 + b < C ? counts[(long long)(c0 + b) * N + n] : 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      if (c0 + b < C) counts[(long long)(c0 + b) * N + n] = run;
      run += v[b];
    }
  }
  totals[n] = run;
}

// One block of 1024 threads: unit_start = exclusive prefix of totals (unit_start[N] = all
// entries); seg_start = exclusive prefix of the extra segments max(0, ceil(t/seg) - 1).
extern "C" __global__ void __launch_bounds__(1024)
twell_bw_unit_starts(const int* __restrict__ totals, int N, int seg,
                     int* __restrict__ unit_start, int* __restrict__ seg_start) {
  __shared__ int s_units[1024], s_segs[1024];
  const int t = threadIdx.x;
  const int chunk = (N + 1023) / 1024;
  const int begin = min(N, t * chunk), end = min(N, begin + chunk);
  int units = 0, segs = 0;
  for (int n = begin; n < end; ++n) {
    const int v = totals[n];
    units += v;
    segs += v > 0 ? (v - 1) / seg : 0;
  }
  s_units[t] = units;
  s_segs[t] = segs;
  __syncthreads();
  for (int d = 1; d < 1024; d <<= 1) {  // Hillis-Steele inclusive scans
    const int au = t >= d ? s_units[t - d] : 0, as = t >= d ? s_segs[t - d] : 0;
    __syncthreads();
    s_units[t] += au;
    s_segs[t] += as;
    __syncthreads();
  }
  int ru = s_units[t] - units, rs = s_segs[t] - segs;
  for (int n = begin; n < end; ++n) {
    const int v = totals[n];
    unit_start[n] = ru;
    seg_start[n] = rs;
    ru += v;
    rs += v > 0 ? (v - 1) / seg : 0;
  }
  if (t == 1023) {
    unit_start[N] = s_units[1023];
    seg_start[N] = s_segs[1023];
  }
}

// Writes every light entry of chunk c, tile j at its place: unit_start[n] + counts[c, n]
// (the chunk's offset) + the number of earlier rows of the chunk using n.
extern "C" __global__ void __launch_bounds__(TWELL_BW_UNIT_WARPS * 32)
twell_bw_unit_scatter(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ heavy,
                      const int* __restrict__ tile_off, int M, int N, int row_cap,
                      const int* __restrict__ counts, const int* __restrict__ unit_start,
                      int* __restrict__ tokens, int* __restrict__ pairs) {
  __shared__ UnitShared sm;
  const int c = blockIdx.x, j = blockIdx.y;
  const int tiles = N / TWELL_TILE;
  build_masks(sm, packed, heavy, M, tiles, c, j);
  for (int u = threadIdx.x; u < TWELL_TILE; u += blockDim.x) {
    const int n = j * TWELL_TILE + u;
    int run = unit_start[n] + counts[(long long)c * N + n];
#pragma unroll
    for (int w = 0; w < CW; ++w) {
      sm.start[u][w] = run;
      run += __popc(sm.mask[u][w]);
    }
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < TWELL_BW_CHUNK_ROWS; r += TWELL_BW_UNIT_WARPS) {
    const long long t = (long long)c * TWELL_BW_CHUNK_ROWS + r;
    if (t >= M) break;
    if (heavy[t]) continue;
    const uint32_t* tw = packed + (t * tiles + j) * TWELL_SLOTS;
    const int count = (int)__ldg(tw);
    const int base = (int)(t * row_cap) + tile_off[t * tiles + j] - 1;
#pragma unroll
    for (int q = 0; q < WPL; ++q) {
      const int idx = q * 32 + lane;
      if (idx >= 1 && idx <= count) {
        const int local = (int)(__ldg(tw + idx) & 0xffffu) - j * TWELL_TILE;
        const int pos = sm.start[local][r >> 5] +
                        __popc(sm.mask[local][r >> 5] & ((1u << (r & 31)) - 1u));
        tokens[pos] = (int)t;
        pairs[pos] = base + idx;
      }
    }
  }
}
