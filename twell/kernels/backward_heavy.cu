// backward_heavy.cu — step 4 of the FFN block's backward pass (launched by backward.py):
// the heavy rows (the forward's dense rows, and the rows step 1 sent to the dense path),
// by dense math on tensor cores, and the kernels between the cuBLAS GEMMs of the rows the
// dense_capacity option sends there.
//
// twell_bw_heavy_chunks: the rows ids[c0 : c0 + cap_rows] of the backward's heavy-row
// list, chunk after chunk, in one launch of work items (64 x 64 tiles, the engine of
// tensor_core.cuh), for dense math's backward (NaN and Inf kept):
//   4a  a, u, dy·wd for 64 rows x 64 units, then da, du, h (bf16) into chunk buffers
//   4b  dx rows = [da du] [wg; wu] (non-gated: da wu), split over the reduction when the
//       chunk has few row blocks; 4b' adds the splits in order
//   4c  dW += (chunk's da, du, h)ᵀ (x, x, dy): fp32 read-add-write of the tile, after the
//       light part (step 3) and the capacity rows.
// With dense_capacity, the first C heavy rows go through cuBLAS instead (backward.py:
// _capacity_rows), before the chunks (which take the rest): gathered x, dy rows (zeros
// past the count); a, u, dy·wd by GEMMs in bf16; twell_bw_capacity_units: da, du, h in
// place (4a's math); dx = da wg + du wu by two fp32 GEMMs, twell_bw_capacity_dx rounds
// once and scatters; dW += (da, du, h)ᵀ (x, x, dy) by fp32 GEMMs (beta = 1).
//
// Row counts live on the device (count[0]); grids are sized for the worst case and blocks
// loop over the work that exists. Every output element has one owner and a fixed order
// (per mma fragment in k order, splits in order, chunks in order): deterministic.
//
// Layouts: row-major; bf16 as uint16 bits. x, dy, dx [M, K]; w_gate, w_up, w_down_t
// [N, K]; ids int32 (ascending), count int32 [1]; chunk buffers dadu [cap_rows, ld]
// ((da | du) gated, ld = 2N; da non-gated, ld = N) and hbuf [cap_rows, N]; ws fp32, the
// split dx's partial sums; weight gradients fp32 [N, K] (dw0, dw1, dw2 as step 3's).
//
// Limits: K = TWELL_KDIM, a multiple of 8; N a multiple of 32; 16-byte aligned rows.
//
// Compile-time parameters: TWELL_KDIM, TWELL_GATED. Uses tensor_core.cuh.

#define NV (TWELL_GATED ? 3 : 2)

// One (row, unit) of a heavy row, dense math's backward: from a = the gate product (the
// up product, non-gated), u = the up product (gated only) and dhb = dy·w_down_t[n],
// h = relu(a)·u (relu(a)), dh = dhb + l1s·sign(h), da = dh·u·[a > 0] (dh·[a > 0]),
// du = dh·relu(a) (0). relu keeps NaN, as dense math does.
__device__ __forceinline__ void heavy_unit_grads(float a, float u, float dhb, float l1s,
                                                 float& da, float& du, float& h) {
  const float gv = a > 0.f ? a : (a != a ? a : 0.f);
  const float mask = a > 0.f ? 1.f : 0.f;
#if TWELL_GATED
  h = gv * u;
  const float dh = dhb + l1s * twell_sign(h);
  da = dh * u * mask;
  du = dh * gv;
#else
  (void)u;
  h = gv;
  const float dh = dhb + l1s * twell_sign(h);
  da = dh * mask;
  du = 0.f;
#endif
}

// =======================================================================================
// The chunks: tensor-core tiles, one launch of work items in stage order.
// =======================================================================================

// Step 4 in one launch over every chunk of heavy rows (ids[c0 .. c0 + rows - 1] per chunk
// of cap_rows), stage after stage: 4a (da, du, h), 4b (dx, split or not), 4b' (the split's
// reduction), 4c (weight gradients), then the next chunk. Blocks take work items from a
// ticket counter in that order, and an item starts only once every item of the stages
// before it is done (a done counter). Tickets go out in order, so an item only ever waits
// for items that running blocks hold: no deadlock, whatever number of blocks is resident.
// With no heavy rows past the capacity GEMMs, every block takes one ticket and returns.
// Each output element is written by one item in chunk order: the bits do not depend on
// the grid. Data written earlier in the launch is read past L1 (cp.async.cg, __ldcg).
struct HeavyArgs {
  const uint16_t* x;
  const uint16_t* dy;
  const int* ids;
  const uint16_t* w_gate;  // null non-gated
  const uint16_t* w_up;
  const uint16_t* w_down_t;
  int N;
  float l1s;
  uint16_t* dadu;  // [cap_rows, ld]: (da | du) gated (ld = 2N), da non-gated (ld = N)
  int ld;
  uint16_t* hbuf;  // [cap_rows, N]
  uint16_t* dx;
  float* ws;  // the split dx's partial sums
  int target, ws_units;
  float *dw0, *dw1, *dw2;
};

// Rows of the chunk starting at heavy row c0.
__device__ __forceinline__ int chunk_rows(const int* __restrict__ count, int c0, int cap_rows) {
  return max(0, min(count[0] - c0, cap_rows));
}

// How many ways 4b splits its reduction (a function of the chunk's rows).
__device__ __forceinline__ int dx_split(int rows, int col_blocks, int kblocks, int target,
                                        int ws_units) {
  const int rb = (rows + TC_TILE - 1) / TC_TILE;
  if (rb == 0) return 1;
  int ks = target / (rb * col_blocks);
  ks = min(ks, kblocks / 4);
  ks = min(ks, ws_units / rb);
  return max(ks, 1);
}

// Element pairs of the split's reduction per work item (16 per thread).
#define HEAVY_REDUCE_ITEM 2048

// Work items of stage `stage` (0 .. 3) of a chunk of `rows` rows.
__device__ __forceinline__ int heavy_stage_items(const HeavyArgs& a, int stage, int rows) {
  const int K = TWELL_KDIM;
  const int row_blocks = (rows + TC_TILE - 1) / TC_TILE, col_blocks = (K + TC_TILE - 1) / TC_TILE;
  const int unit_blocks = (a.N + TC_TILE - 1) / TC_TILE;
  if (rows == 0) return 0;
  if (stage == 0) return row_blocks * unit_blocks;
  const int ks = dx_split(rows, col_blocks, a.ld / TC_SLICE, a.target, a.ws_units);
  if (stage == 1) return row_blocks * col_blocks * ks;
  if (stage == 2) return ks == 1 ? 0 : (rows * (K / 2) + HEAVY_REDUCE_ITEM - 1) / HEAVY_REDUCE_ITEM;
  return NV * unit_blocks * col_blocks;
}

// 4a. da, du, h of 64 heavy rows x 64 units (dense math, NaN and Inf kept), bf16, into
//     dadu and hbuf.
__device__ __forceinline__ void heavy_units_item(const HeavyArgs& a, int c0, int rows, int item,
                                                 TwellTcRing& sm) {
  const int K = TWELL_KDIM, N = a.N;
  const int col_blocks = (N + TC_TILE - 1) / TC_TILE, slices = (K + TC_SLICE - 1) / TC_SLICE;
  const int rb = item / col_blocks, cb = item % col_blocks;
  const int r0 = rb * TC_TILE, n0 = cb * TC_TILE;
  const uint16_t* __restrict__ x = a.x;
  const uint16_t* __restrict__ dy = a.dy;
  const int* __restrict__ ids = a.ids;
  auto x_row = [&](int i) -> const uint16_t* {
    return i < rows ? x + (long long)ids[c0 + i] * K : nullptr;
  };
  auto dy_row = [&](int i) -> const uint16_t* {
    return i < rows ? dy + (long long)ids[c0 + i] * K : nullptr;
  };
  float acc_a[2][4][4], acc_d[2][4][4];
  twell_acc_zero(acc_a);
  twell_acc_zero(acc_d);
  const TwellStageK sx = twell_stage_k(x_row, r0, K, x);
  {
    const uint16_t* w_first = TWELL_GATED ? a.w_gate : a.w_up;
    auto w_row = [&](int n) -> const uint16_t* {
      return n < N ? w_first + (long long)n * K : nullptr;
    };
    twell_tc_mainloop<false, false>(acc_a, sx, twell_stage_k(w_row, n0, K, w_first), 0, slices,
                                    sm);
  }
#if TWELL_GATED
  float acc_u[2][4][4];
  twell_acc_zero(acc_u);
  {
    auto w_row = [&](int n) -> const uint16_t* {
      return n < N ? a.w_up + (long long)n * K : nullptr;
    };
    twell_tc_mainloop<false, false>(acc_u, sx, twell_stage_k(w_row, n0, K, a.w_up), 0, slices,
                                    sm);
  }
#endif
  {
    auto w_row = [&](int n) -> const uint16_t* {
      return n < N ? a.w_down_t + (long long)n * K : nullptr;
    };
    twell_tc_mainloop<false, false>(acc_d, twell_stage_k(dy_row, r0, K, dy),
                                    twell_stage_k(w_row, n0, K, a.w_down_t), 0, slices, sm);
  }
  twell_acc_pairs(r0, n0, rows, N, [&](int i, int n, int mt, int nt, int half) {
    float da[2], du[2], hv[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#if TWELL_GATED
      const float u = acc_u[mt][nt][2 * half + e];
#else
      const float u = 0.f;
#endif
      heavy_unit_grads(acc_a[mt][nt][2 * half + e], u, acc_d[mt][nt][2 * half + e], a.l1s, da[e],
                       du[e], hv[e]);
    }
    uint16_t* row = a.dadu + (long long)i * a.ld;
    *reinterpret_cast<uint32_t*>(row + n) = twell_pack_bf16x2(da[0], da[1]);
#if TWELL_GATED
    *reinterpret_cast<uint32_t*>(row + N + n) = twell_pack_bf16x2(du[0], du[1]);
#endif
    *reinterpret_cast<uint32_t*>(a.hbuf + (long long)i * N + n) = twell_pack_bf16x2(hv[0], hv[1]);
  });
}

// 4b. dx[ids[c0 + i]] = sum_r dadu[i, r] W[r] with W = [w_gate; w_up] (gated) or w_up:
//     A K-major (dadu rows), B R-major (weight rows r, columns k); split over the
//     reduction into ws when the chunk has few row blocks.
__device__ __forceinline__ void heavy_dx_item(const HeavyArgs& a, int c0, int rows, int item,
                                              TwellTcRing& sm) {
  const int K = TWELL_KDIM, N = a.N;
  const int red = a.ld;  // 2N gated, N non-gated
  const int row_blocks = (rows + TC_TILE - 1) / TC_TILE, col_blocks = (K + TC_TILE - 1) / TC_TILE;
  const int kblocks = red / TC_SLICE;
  const int ks = dx_split(rows, col_blocks, kblocks, a.target, a.ws_units);
  const int kper = (kblocks + ks - 1) / ks;
  const int kss = item % ks, rest = item / ks;
  const int rb = rest / col_blocks, cb = rest % col_blocks;
  const int r0 = rb * TC_TILE, k0 = cb * TC_TILE;
  const int s0 = kss * kper, s1 = min(kblocks, s0 + kper);
  const uint16_t* dadu = a.dadu;
  auto a_row = [&](int i) -> const uint16_t* {
    return i < rows ? dadu + (long long)i * a.ld : nullptr;
  };
  auto w_row = [&](int r) -> const uint16_t* {
#if TWELL_GATED
    return r < N ? a.w_gate + (long long)r * K : a.w_up + (long long)(r - N) * K;
#else
    return a.w_up + (long long)r * K;
#endif
  };
  float acc[2][4][4];
  twell_acc_zero(acc);
  twell_tc_mainloop<false, true>(acc, twell_stage_k(a_row, r0, red, dadu),
                                 twell_stage_r(w_row, k0, K, a.w_up), s0, max(0, s1 - s0), sm);
  twell_acc_pairs(r0, k0, rows, K, [&](int i, int col, int mt, int nt, int half) {
    const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
    if (ks == 1) {
      *reinterpret_cast<uint32_t*>(a.dx + (long long)a.ids[c0 + i] * K + col) =
          twell_pack_bf16x2(v0, v1);
    } else {
      float* w = a.ws + ((long long)kss * row_blocks * TC_TILE + i) * K + col;
      w[0] = v0;
      w[1] = v1;
    }
  });
}

// 4b'. The split's partial sums added in split order, rounded once into dx.
__device__ __forceinline__ void heavy_dx_reduce_item(const HeavyArgs& a, int c0, int rows,
                                                     int item) {
  const int K = TWELL_KDIM;
  const int col_blocks = (K + TC_TILE - 1) / TC_TILE;
  const int ks = dx_split(rows, col_blocks, a.ld / TC_SLICE, a.target, a.ws_units);
  const long long rows_cap = (long long)((rows + TC_TILE - 1) / TC_TILE) * TC_TILE;
  const long long total = (long long)rows * (K / 2);
  const long long q1 = min(total, (long long)(item + 1) * HEAVY_REDUCE_ITEM);
  for (long long q = (long long)item * HEAVY_REDUCE_ITEM + threadIdx.x; q < q1; q += blockDim.x) {
    const int i = (int)(q / (K / 2)), col = 2 * (int)(q % (K / 2));
    float v0 = 0.f, v1 = 0.f;
    for (int s = 0; s < ks; ++s) {
      const float2 w = __ldcg(reinterpret_cast<const float2*>(a.ws + (s * rows_cap + i) * K + col));
      v0 += w.x;
      v1 += w.y;
    }
    *reinterpret_cast<uint32_t*>(a.dx + (long long)a.ids[c0 + i] * K + col) =
        twell_pack_bf16x2(v0, v1);
  }
}

// 4c. dW[which] [N, K] += Aᵀ B over the chunk's rows: which v < NV-1: A = dadu column
//     block v (da, du), B = x rows; v = NV-1: A = hbuf, B = dy rows. Both R-major.
//     Each output element is owned by one thread: read, add the chunk's sum, write.
__device__ __forceinline__ void heavy_weights_item(const HeavyArgs& a, int c0, int rows,
                                                   int item, TwellTcRing& sm) {
  const int K = TWELL_KDIM, N = a.N;
  const int unit_blocks = (N + TC_TILE - 1) / TC_TILE, col_blocks = (K + TC_TILE - 1) / TC_TILE;
  const int per = unit_blocks * col_blocks;
  const int slices = (rows + TC_SLICE - 1) / TC_SLICE;
  const int which = item / per, rest = item % per;
  const int m0 = (rest / col_blocks) * TC_TILE, k0 = (rest % col_blocks) * TC_TILE;
  const bool last = which == NV - 1;
  const uint16_t* abase = last ? a.hbuf : a.dadu + (long long)which * N;
  const int apitch = last ? N : a.ld;
  const uint16_t* bsrc = last ? a.dy : a.x;
  const int* __restrict__ ids = a.ids;
  auto a_row = [&](int r) -> const uint16_t* {
    return r < rows ? abase + (long long)r * apitch : nullptr;
  };
  auto b_row = [&](int r) -> const uint16_t* {
    return r < rows ? bsrc + (long long)ids[c0 + r] * K : nullptr;
  };
  float acc[2][4][4];
  twell_acc_zero(acc);
  twell_tc_mainloop<true, true>(acc, twell_stage_r(a_row, m0, N, abase),
                                twell_stage_r(b_row, k0, K, bsrc), 0, slices, sm);
  float* out = which == 0 ? a.dw0 : (which == 1 ? a.dw1 : a.dw2);
  // twell_acc_pairs' loop written out: through the helper NVRTC computes these addresses
  // another way (the same loads, adds and stores) for K not a multiple of 64.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int k = k0 + wn * 32 + nt * 8 + 2 * t;
      if (k >= K) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int n = m0 + wm * 32 + mt * 16 + g + 8 * half;
        if (n >= N) continue;
        float2* o = reinterpret_cast<float2*>(out + (long long)n * K + k);
        float2 v = __ldcg(o);
        v.x += acc[mt][nt][2 * half];
        v.y += acc[mt][nt][2 * half + 1];
        *o = v;
      }
    }
}

// The launch: sync = {ticket counter, done counter}, zero on entry. `rows_max`: the most
// heavy rows the list can hold here (count is at most this).
extern "C" __global__ void __launch_bounds__(128, 3)
twell_bw_heavy_chunks(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy,
                      const int* __restrict__ ids, const int* __restrict__ count, int rows_max,
                      int cap_rows, const uint16_t* __restrict__ w_gate,  // null non-gated
                      const uint16_t* __restrict__ w_up, const uint16_t* __restrict__ w_down_t,
                      int N, const float* __restrict__ l1_dev, float l1_host,  // as light
                      uint16_t* __restrict__ dadu, int ld, uint16_t* __restrict__ hbuf,
                      uint16_t* __restrict__ dx, float* __restrict__ ws, int target,
                      int ws_units, float* __restrict__ dw0, float* __restrict__ dw1,
                      float* __restrict__ dw2, int* __restrict__ sync) {
  __shared__ TwellTcRing sm;
  __shared__ int s_ticket;
  HeavyArgs a;
  a.x = x;
  a.dy = dy;
  a.ids = ids;
  a.w_gate = w_gate;
  a.w_up = w_up;
  a.w_down_t = w_down_t;
  a.N = N;
  a.l1s = l1_dev != nullptr ? l1_dev[0] * l1_host : l1_host;
  a.dadu = dadu;
  a.ld = ld;
  a.hbuf = hbuf;
  a.dx = dx;
  a.ws = ws;
  a.target = target;
  a.ws_units = ws_units;
  a.dw0 = dw0;
  a.dw1 = dw1;
  a.dw2 = dw2;
  const int heavy = min(count[0], rows_max);
  volatile int* done = sync + 1;
  for (;;) {
    if (threadIdx.x == 0) s_ticket = atomicAdd(sync, 1);
    __syncthreads();
    int ticket = s_ticket;
    __syncthreads();
    // Find the ticket's chunk, stage and item; `before`: items of all earlier stages.
    int before = 0, c0 = 0, stage = 0, rows = 0;
    bool found = false;
    for (c0 = 0; c0 < heavy && !found; c0 += cap_rows) {
      rows = chunk_rows(count, c0, cap_rows);
      for (stage = 0; stage < 4; ++stage) {
        const int items = heavy_stage_items(a, stage, rows);
        if (ticket < items) {
          found = true;
          break;
        }
        ticket -= items;
        before += items;
      }
      if (found) break;
    }
    if (!found) return;
    if (threadIdx.x == 0) {
      while (*done < before) {
      }
      __threadfence();
    }
    __syncthreads();
    if (stage == 0) heavy_units_item(a, c0, rows, ticket, sm);
    else if (stage == 1) heavy_dx_item(a, c0, rows, ticket, sm);
    else if (stage == 2) heavy_dx_reduce_item(a, c0, rows, ticket);
    else heavy_weights_item(a, c0, rows, ticket, sm);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(sync + 1, 1);
    }
  }
}


// =======================================================================================
// Capacity rows (dense_capacity): the first C heavy rows, gathered into fixed-size
// buffers whose a, u, dy·wd come from cuBLAS (bf16); these kernels sit between the GEMMs.
// Rows i >= min(count, C) are padding.
// =======================================================================================

// da, du, h from a, u, dy·wd elementwise, in place (a -> da, u -> du, d -> h; bf16 [C, N]),
// with the formulas of the chunks' 4a (heavy_unit_grads) on inputs cuBLAS has already
// rounded to bf16 (the chunks keep them in fp32); padding rows get zeros (so
// they add nothing to the weight GEMMs, whatever the L1 coefficient holds). u is unused
// (null) for the non-gated block. N % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_capacity_units(uint16_t* __restrict__ a, uint16_t* __restrict__ u,
                        uint16_t* __restrict__ d, const int* __restrict__ count, int C, int N,
                        const float* __restrict__ l1_dev, float l1_host) {
  const float l1s = l1_dev != nullptr ? l1_dev[0] * l1_host : l1_host;
  const int rows = min(count[0], C);
  const int per_row = N / 8;
  const long long total = (long long)C * per_row;
  for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < total;
       q += (long long)gridDim.x * blockDim.x) {
    uint4* pa = reinterpret_cast<uint4*>(a) + q;
    uint4* pd = reinterpret_cast<uint4*>(d) + q;
#if TWELL_GATED
    uint4* pu = reinterpret_cast<uint4*>(u) + q;
#endif
    if (q / per_row >= rows) {
      *pa = make_uint4(0, 0, 0, 0);
      *pd = make_uint4(0, 0, 0, 0);
#if TWELL_GATED
      *pu = make_uint4(0, 0, 0, 0);
#endif
      continue;
    }
    const uint4 av = *pa, dv = *pd;
    const uint32_t a_w[4] = {av.x, av.y, av.z, av.w};
    const uint32_t d_w[4] = {dv.x, dv.y, dv.z, dv.w};
    uint32_t da_out[4], h_out[4];
#if TWELL_GATED
    const uint4 uv = *pu;
    const uint32_t u_w[4] = {uv.x, uv.y, uv.z, uv.w};
    uint32_t du_out[4];
#endif
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float da[2], du[2], hv[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#if TWELL_GATED
        const float x_u = twell_bf16_to_float((u_w[w] >> (16 * e)) & 0xffffu);
#else
        const float x_u = 0.f;
#endif
        heavy_unit_grads(twell_bf16_to_float((a_w[w] >> (16 * e)) & 0xffffu), x_u,
                         twell_bf16_to_float((d_w[w] >> (16 * e)) & 0xffffu), l1s, da[e],
                         du[e], hv[e]);
      }
      da_out[w] = twell_pack_bf16x2(da[0], da[1]);
      h_out[w] = twell_pack_bf16x2(hv[0], hv[1]);
#if TWELL_GATED
      du_out[w] = twell_pack_bf16x2(du[0], du[1]);
#endif
    }
    *pa = make_uint4(da_out[0], da_out[1], da_out[2], da_out[3]);
    *pd = make_uint4(h_out[0], h_out[1], h_out[2], h_out[3]);
#if TWELL_GATED
    *pu = make_uint4(du_out[0], du_out[1], du_out[2], du_out[3]);
#endif
  }
}

// dx[ids[i]] = bf16(dxc[i]) for i < min(count, C): the capacity rows' fp32 dx (both
// products summed by cuBLAS) rounded once and scattered. K % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_capacity_dx(const float* __restrict__ dxc, const int* __restrict__ ids,
                     const int* __restrict__ count, int C, uint16_t* __restrict__ dx) {
  const int K = TWELL_KDIM;
  const int rows = min(count[0], C);
  const int per_row = K / 4;
  const long long total = (long long)rows * per_row;
  for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < total;
       q += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(q / per_row), c = (int)(q % per_row);
    const float4 v = reinterpret_cast<const float4*>(dxc)[q];
    reinterpret_cast<uint2*>(dx + (long long)ids[i] * K)[c] =
        make_uint2(twell_pack_bf16x2(v.x, v.y), twell_pack_bf16x2(v.z, v.w));
  }
}
