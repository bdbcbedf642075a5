// heavy_rows.cu — everything about heavy rows: finding them (compaction of the row flags
// into ascending ids), computing them on tensor cores, and moving them to and from the
// fixed-size cuBLAS GEMMs of the dense_capacity option.
//
// twell_heavy_rows_matmul computes
//
//   C[i, c] = sum_r A[arow(i), r] * B[c, r]        for i < count[0], c < OUTC, r < RED
//
// with A bf16 [*, RED] and B bf16 [OUTC, RED] row-major (B = w_up [N, K] for the up
// projection, B = w_down [K, N] for the down projection: both are the torch.nn.Linear
// layout, so no transposed copy is needed). Epilogues:
//   EPI_STORE (gate == nullptr):  out[orow(i), c] = bf16(C)
//   EPI_GATE  (gate != nullptr):  out[orow(i), c] = bf16(gate'[grow(i), c] * C)
//             where gate' = relu(gate) if relu_g (raw pre-activation) else gate
// Row maps: arow(i) = a_by_id ? ids[i] : i, and likewise grow, orow. With relu_a the A
// elements pass through relu on load (non-gated heavy rows read the raw pre-activation).
// relu keeps NaN, as dense math does.
//
// The row count lives on the device (count[0]), so the grid is sized for the worst case
// on the host and every block reads the count and loops over the work that exists: no
// host synchronisation.
//
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate). Each lane loads 16 contiguous bytes of A
// and of B per 32-wide k-slice; the same permutation of k is used for A and B, so the
// dot products are exact reorderings of the plain ones.
// Limits: RED % 8 == 0, OUTC % 8 == 0, 16-byte aligned rows.

// Compile-time parameters TWELL_HR_SPLIT and TWELL_HR_STAGES; constant TWELL_HR_FLAG_ROWS.
// Uses tensor_core.cuh (the tile and its accumulators, cp.async); stages its own ring.

// ---------------------------------------------------------------------------------------
// twell_heavy_rows_matmul — a tiled GEMM over the listed rows: a cluster computes 64 rows x
// 64 output columns, staging 32-wide k-slices of A (gathered rows) and B in shared memory
// through a cp.async ring of HR_STAGES slices, so each B element read from L2 serves 64
// rows (bench/ladder/heavy_rows_simple.cu keeps the untiled kernel: 16 rows a block).
// 4 warps in a 2 x 2 layout, each 32 rows x 32 columns (2 x 4 mma tiles). The k order
// inside a slice is the same permutation for A and B (16 contiguous bytes per lane).
// The reduction is split across the HR_SPLIT CTAs of a thread-block cluster (its
// __cluster_dims__: CuPy's plain launch starts clusters): CTA r takes the r-th share of
// the k-blocks of the cluster's tile, writes its fp32 fragments to its shared memory, and
// after a cluster barrier each CTA sums its share of the tile's elements over the CTAs'
// fragments in rank order (DSMEM reads) and applies the epilogue. So few rows (decode,
// rare heavy rows) keep HR_SPLIT times as many SMs busy with k-loops that much shorter,
// with no global workspace and no second launch; every element is still summed in one
// fixed order (its k-blocks in order within a CTA, then the CTAs in rank order):
// deterministic, independent of M and of the grid (for one HR_SPLIT: the launcher
// chooses it from the weight's shape alone).

// TWELL_HR_SPLIT (a parameter): the CTAs of a cluster, the split of the reduction;
// TWELL_HR_STAGES (a parameter): the depth of the cp.async ring (HR_STAGES - 1 k-slices
// in flight); TWELL_HR_FLAG_ROWS (a constant): the most rows whose flags the matmul
// compacts itself (a block-wide scan in shared memory, a multiple of 128). All defined by
// the launcher (heavy_rows.py).
#define HR_SPLIT TWELL_HR_SPLIT
#define HR_STAGES TWELL_HR_STAGES
#define HR_FLAG_ROWS TWELL_HR_FLAG_ROWS
static_assert(HR_SPLIT == 1 || HR_SPLIT == 2 || HR_SPLIT == 4 || HR_SPLIT == 8,
              "each CTA finishes 32 / HR_SPLIT values of every thread's fragment");
static_assert(HR_STAGES >= 2 && HR_STAGES <= 5, "static shared memory: 48 KB");
static_assert(HR_FLAG_ROWS % 128 == 0 && HR_FLAG_ROWS <= 1024, "flags: 128 threads, 4 KB");

__device__ __forceinline__ void epilogue(float v0, float v1, int i, int col, int OUTC,
                                         const int* __restrict__ ids,
                                         const uint16_t* __restrict__ gate, int g_by_id,
                                         int relu_g, uint16_t* __restrict__ out, int o_by_id) {
  if (gate != nullptr) {
    const long long gr = g_by_id ? ids[i] : i;
    float g0 = twell_bf16_to_float(gate[gr * OUTC + col]);
    float g1 = twell_bf16_to_float(gate[gr * OUTC + col + 1]);
    if (relu_g) {
      g0 = g0 <= 0.f ? 0.f : g0;  // NaN stays NaN
      g1 = g1 <= 0.f ? 0.f : g1;
    }
    v0 *= g0;
    v1 *= g1;
  }
  const long long orow = o_by_id ? ids[i] : i;
  *reinterpret_cast<__nv_bfloat162*>(out + orow * OUTC + col) = __floats2bfloat162_rn(v0, v1);
}

extern "C" __global__ void __cluster_dims__(HR_SPLIT, 1, 1) __launch_bounds__(128, 1)
twell_heavy_rows_matmul(const uint16_t* __restrict__ A, int a_by_id, int relu_a,
                       const uint16_t* __restrict__ B, int OUTC, int RED,
                       const int* __restrict__ ids_in, const int* __restrict__ count_ptr,
                       const uint8_t* __restrict__ flags, int flag_rows,
                       const uint16_t* __restrict__ gate, int g_by_id, int relu_g,
                       uint16_t* __restrict__ out, int o_by_id) {
  twell_grid_wait();  // in a forward pass, launched after the kernel that flags the rows
  twell_grid_release();
  // The ring of k-slices and, after the k-loop, this CTA's fp32 fragments ([value]
  // [thread]) share the same bytes: a 5-deep ring (40 KB) fits beside the row ids.
  union Smem {
    struct {
      uint4 a[HR_STAGES][TC_TILE][4];
      uint4 b[HR_STAGES][TC_TILE][4];
    } ring;
    float part[32][128];
  };
  __shared__ Smem smem;
  auto& As = smem.ring.a;
  auto& Bs = smem.ring.b;
  auto& part = smem.part;
  __shared__ int s_ids[HR_FLAG_ROWS];
  __shared__ int s_warp[4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp >> 1, wn = warp & 1;
  // The rows: ids[:count] from the caller, or (flags != null, flag_rows <= HR_FLAG_ROWS)
  // compacted here from the row flags, ascending (the same list compact_rows makes): no
  // separate launch for small batches.
  const int* ids = ids_in;
  int count;
  if (flags != nullptr) {
    constexpr int PER = HR_FLAG_ROWS / 128;
    int mine = 0;
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      const int r = tid * PER + q;
      mine += (r < flag_rows && flags[r]) ? 1 : 0;
    }
    int incl = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int at = incl - mine;
    for (int w = 0; w < warp; ++w) at += s_warp[w];
#pragma unroll
    for (int q = 0; q < PER; ++q) {
      const int r = tid * PER + q;
      if (r < flag_rows && flags[r]) s_ids[at++] = r;
    }
    count = s_warp[0] + s_warp[1] + s_warp[2] + s_warp[3];
    __syncthreads();
    ids = s_ids;
  } else {
    count = count_ptr[0];
  }
  const int row_blocks = (count + TC_TILE - 1) / TC_TILE;
  const int col_blocks = (OUTC + TC_TILE - 1) / TC_TILE;
  const int kblocks = (RED + 31) / 32;
  const uint32_t rank = HR_SPLIT == 1 ? 0u : twell_cluster_rank();
  const int kper = (kblocks + HR_SPLIT - 1) / HR_SPLIT;
  const int kb0 = min(kblocks, (int)rank * kper), kb1 = min(kblocks, kb0 + kper);
  const int nkb = kb1 - kb0;
  const long long items = (long long)row_blocks * col_blocks;

  // Every CTA of a cluster takes the same items (the same trip count: the barriers match).
  for (long long item = twell_cluster_index(); item < items; item += twell_cluster_count()) {
    const int rb = (int)(item / col_blocks), cb = (int)(item % col_blocks);
    // This thread's two A rows and two B rows to stage (chunk c = tid + 128 q).
    const uint16_t* arow[2];
    const uint16_t* brow[2];
    bool aok[2], bok[2];
    int kc[2], rr[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int c = tid + 128 * q;
      rr[q] = c >> 2;
      kc[q] = c & 3;
      // Rows past the count are zero-filled, not read (a clamped row read 64 times over
      // made one heavy row slower than 64).
      aok[q] = rb * TC_TILE + rr[q] < count;
      const int i = min(rb * TC_TILE + rr[q], count - 1);
      const long long ar = a_by_id ? ids[i] : i;
      arow[q] = A + ar * RED + kc[q] * 8;
      const int col = cb * TC_TILE + rr[q];
      bok[q] = col < OUTC;
      brow[q] = B + (long long)(bok[q] ? col : 0) * RED + kc[q] * 8;
    }
    auto stage_in = [&](int j) {  // j-th k-block of this CTA's share
      const int s = j % HR_STAGES, r = (kb0 + j) * 32;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const bool kok = r + kc[q] * 8 < RED;
        twell_cp_async16(&As[s][rr[q]][kc[q]], (kok && aok[q]) ? arow[q] + r : arow[q],
                         kok && aok[q]);
        twell_cp_async16(&Bs[s][rr[q]][kc[q]], (kok && bok[q]) ? brow[q] + r : brow[q],
                         kok && bok[q]);
      }
    };

    float acc[2][4][4];
    twell_acc_zero(acc);

    // (The previous item's ring reads ended at the barrier after its k-loop, and its
    // reads of `part`, which the ring overwrites, at its closing cluster barrier.)
#pragma unroll
    for (int j = 0; j < HR_STAGES - 1; ++j) {
      if (j < nkb) stage_in(j);
      twell_cp_async_commit();
    }
    for (int kb = 0; kb < nkb; ++kb) {
      twell_cp_async_wait<HR_STAGES - 2>();
      __syncthreads();
      if (kb + HR_STAGES - 1 < nkb) stage_in(kb + HR_STAGES - 1);
      twell_cp_async_commit();
      const int s = kb % HR_STAGES;
      uint4 a[2][2], b[4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        a[mt][0] = As[s][wm * 32 + mt * 16 + g][t];
        a[mt][1] = As[s][wm * 32 + mt * 16 + g + 8][t];
        if (relu_a) {
          a[mt][0] = twell_relu_bf16x8(a[mt][0]);
          a[mt][1] = twell_relu_bf16x8(a[mt][1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) b[nt] = Bs[s][wn * 32 + nt * 8 + g][t];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          twell_mma_bf16(acc[mt][nt], a[mt][0].x, a[mt][1].x, a[mt][0].y, a[mt][1].y, b[nt].x, b[nt].y);
          twell_mma_bf16(acc[mt][nt], a[mt][0].z, a[mt][1].z, a[mt][0].w, a[mt][1].w, b[nt].z, b[nt].w);
        }
    }
    twell_cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring, which `part` overwrites

    // The fragments to shared memory; after the barrier, every CTA's are readable.
    if constexpr (HR_SPLIT > 1) {
#pragma unroll
      for (int v = 0; v < 32; ++v) part[v][tid] = twell_acc_value(acc, v);
      twell_cluster_sync();
    }
    // This CTA finishes the values v = V rank .. V rank + V - 1 (V = 32 / HR_SPLIT) of
    // every thread's fragment, v = (mt * 4 + nt) * 4 + e: the same (row, column) in every
    // CTA, summed over the CTAs in rank order (a single CTA keeps its registers).
    constexpr int V = 32 / HR_SPLIT;
#pragma unroll
    for (int p = 0; p < V / 2; ++p) {
      const int v = V * (int)rank + 2 * p;
      const int mt = v >> 4, nt = (v >> 2) & 3, half = (v >> 1) & 1;
      const int col = cb * TC_TILE + wn * 32 + nt * 8 + 2 * t;
      const int i = rb * TC_TILE + wm * 32 + mt * 16 + g + 8 * half;
      float v0 = 0.f, v1 = 0.f;
      if constexpr (HR_SPLIT == 1) {
        v0 = twell_acc_value(acc, v);
        v1 = twell_acc_value(acc, v + 1);
      } else {
#pragma unroll
        for (int q = 0; q < HR_SPLIT; ++q) {  // rank order: fixed
          v0 += __uint_as_float(twell_ld_remote_u32(twell_smem_addr(&part[v][tid]), (uint32_t)q));
          v1 += __uint_as_float(twell_ld_remote_u32(twell_smem_addr(&part[v + 1][tid]), (uint32_t)q));
        }
      }
      if (col < OUTC && i < count)
        epilogue(v0, v1, i, col, OUTC, ids, gate, g_by_id, relu_g, out, o_by_id);
    }
    // Every CTA is done reading `part` before the ring overwrites it.
    if constexpr (HR_SPLIT > 1) twell_cluster_sync();
  }
}

// ---------------------------------------------------------------------------------------
// Heavy row ids in ascending order, by a block-wide prefix sum (no atomics, so the
// order never depends on scheduling). One block of 1024 threads; thread t scans the
// contiguous chunk [t*chunk, (t+1)*chunk). Writes ids[0..R) and count[0] = R.
extern "C" __global__ void __launch_bounds__(1024)
twell_compact_rows(const uint8_t* __restrict__ heavy, int M, int* __restrict__ ids,
                   int* __restrict__ count) {
  twell_grid_wait();  // launched after the kernel that flags the rows
  twell_grid_release();
  __shared__ int sums[1024];
  const int t = threadIdx.x;
  const int chunk = (M + 1023) / 1024;
  const int begin = min(M, t * chunk), end = min(M, begin + chunk);
  int mine = 0;
  for (int i = begin; i < end; ++i) mine += heavy[i] ? 1 : 0;
  sums[t] = mine;
  __syncthreads();
  for (int d = 1; d < 1024; d <<= 1) {  // Hillis-Steele inclusive scan
    const int add = t >= d ? sums[t - d] : 0;
    __syncthreads();
    sums[t] += add;
    __syncthreads();
  }
  int out = sums[t] - mine;
  for (int i = begin; i < end; ++i)
    if (heavy[i]) ids[out++] = i;
  if (t == 1023) count[0] = sums[1023];
}

// heavy[ids[i]] = 1 for i < R (marks the dense rows of a Hybrid given by a caller).
extern "C" __global__ void twell_mark_rows(const int* __restrict__ ids, int R,
                                           uint8_t* __restrict__ heavy) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < R) heavy[ids[i]] = 1;
}

// dense[i, :] = relu(pre[ids[i], :]) for i < R (the dense part of a Hybrid; NaN kept).
extern "C" __global__ void twell_gather_relu_rows(const uint16_t* __restrict__ pre,
                                                  const int* __restrict__ ids, int R, int N,
                                                  uint16_t* __restrict__ dense) {
  const long long total = (long long)R * N;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const long long i = k / N, n = k - i * N;
    const uint32_t b = pre[(long long)ids[i] * N + n];
    dense[k] = twell_relu_keeps(b) ? (uint16_t)b : (uint16_t)0;
  }
}

// ---- heavy rows through fixed-size cuBLAS GEMMs (the dense_capacity option) -----------
// dst[i] = src[ids[i]] for i < min(count, C), zeros for count <= i < C;
// rest[0] = max(count - C, 0) (the rows left to twell_heavy_rows_matmul). Rows are `width` bf16
// wide (width % 8 == 0), moved 16 bytes at a time.
extern "C" __global__ void twell_gather_rows(const uint16_t* __restrict__ src, int width,
                                             const int* __restrict__ ids,
                                             const int* __restrict__ count, int C,
                                             uint16_t* __restrict__ dst, int* __restrict__ rest) {
  const int n = count[0];
  if (blockIdx.x == 0 && threadIdx.x == 0) rest[0] = max(n - C, 0);
  const int per_row = width / 8;
  const long long total = (long long)C * per_row;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(k / per_row), c = (int)(k % per_row);
    const uint4 v = i < n ? reinterpret_cast<const uint4*>(src + (long long)ids[i] * width)[c]
                          : make_uint4(0, 0, 0, 0);
    reinterpret_cast<uint4*>(dst + (long long)i * width)[c] = v;
  }
}

// h = bf16(relu(g) * u) elementwise over n bf16 (n % 2 == 0), or relu(g) when u is null;
// relu keeps NaN.
extern "C" __global__ void twell_relu_mul(const uint16_t* __restrict__ g,
                                          const uint16_t* __restrict__ u,
                                          uint16_t* __restrict__ h, long long n) {
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; 2 * k < n;
       k += (long long)gridDim.x * blockDim.x) {
    const uint32_t gw = reinterpret_cast<const uint32_t*>(g)[k];
    const uint32_t uw = u == nullptr ? 0x3f803f80u : reinterpret_cast<const uint32_t*>(u)[k];
    float r[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t gb = (gw >> (16 * s)) & 0xffffu;
      r[s] = twell_relu_value(gb) * __uint_as_float(((uw >> (16 * s)) & 0xffffu) << 16);
    }
    __nv_bfloat162 v = __floats2bfloat162_rn(r[0], r[1]);
    reinterpret_cast<uint32_t*>(h)[k] = *reinterpret_cast<uint32_t*>(&v);
  }
}

// dst[ids[i]] = src[i] for i < min(count, C); rows `width` bf16 wide (width % 8 == 0).
extern "C" __global__ void twell_scatter_rows(const uint16_t* __restrict__ src, int width,
                                              const int* __restrict__ ids,
                                              const int* __restrict__ count, int C,
                                              uint16_t* __restrict__ dst) {
  const int n = min(count[0], C);
  const int per_row = width / 8;
  const long long total = (long long)n * per_row;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(k / per_row), c = (int)(k % per_row);
    reinterpret_cast<uint4*>(dst + (long long)ids[i] * width)[c] =
        reinterpret_cast<const uint4*>(src + (long long)i * width)[c];
  }
}

// The training forward's L1 value of its heavy rows (light rows: light_rows.cu):
// out[ids[i]] = sum of |h| over the bf16 row h = src[by_id ? ids[i] : i], for
// i < min(count, max_rows); relu applied first when `relu` (the non-gated block's heavy
// rows keep their pre-activation); NaN kept, so a NaN row sums to NaN as dense math does.
// N % 8 == 0, rows 16-byte aligned. One warp per row in a fixed order (lane-strided, then a
// shuffle tree): deterministic.
extern "C" __global__ void twell_row_abs_sum(const uint16_t* __restrict__ src, int N,
                                             const int* __restrict__ ids,
                                             const int* __restrict__ count, int max_rows,
                                             int by_id, int relu, float* __restrict__ out) {
  const int n = min(count[0], max_rows);
  const int lane = threadIdx.x & 31;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n;
       i += (gridDim.x * blockDim.x) >> 5) {
    const int row = ids[i];
    const uint4* h = reinterpret_cast<const uint4*>(src + (long long)(by_id ? row : i) * N);
    float s = 0.f;
    for (int c = lane; c < N / 8; c += 32) {
      const uint4 v = h[c];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const uint32_t b = (w[q / 2] >> (16 * (q % 2))) & 0xffffu;
        s += (relu && !twell_relu_keeps(b)) ? 0.f : fabsf(__uint_as_float(b << 16));
      }
    }
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0) out[row] = s;
  }
}
