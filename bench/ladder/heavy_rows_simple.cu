// heavy_rows_simple.cu — ladder step: the first heavy-row kernel (version 1 of
// twell/kernels/heavy_rows.cu's twell_heavy_rows_matmul), kept runnable as a baseline.
//
// Same contract as twell_heavy_rows_matmul (see heavy_rows.cu), without shared memory:
// work item = 16 rows x 32 output columns; the block's 4 warps split the reduction
// (interleaved 32-wide slices) and add their partial sums in a fixed order through shared
// memory: deterministic. Each B element read from L2 serves 16 rows only, which is why
// the tiled kernel (64 rows per B tile, cp.async ring) replaced it (docs/history.md).

#define DR_WARPS 4
#define DR_NT 4  // n8 tiles per work item (32 output columns)

extern "C" __global__ void __launch_bounds__(DR_WARPS * 32)
twell_heavy_rows_simple(const uint16_t* __restrict__ A, int a_by_id, int relu_a,
                 const uint16_t* __restrict__ B, int OUTC, int RED,
                 const int* __restrict__ ids, const int* __restrict__ count_ptr,
                 const uint16_t* __restrict__ gate, int g_by_id, int relu_g,
                 uint16_t* __restrict__ out, int o_by_id) {
  __shared__ float partial[DR_WARPS][DR_NT][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int count = count_ptr[0];
  const int row_blocks = (count + 15) / 16;
  const int col_blocks = (OUTC + 8 * DR_NT - 1) / (8 * DR_NT);
  const long long items = (long long)row_blocks * col_blocks;
  const int kblocks = (RED + 31) / 32;

  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const int rb = (int)(item / col_blocks), cb = (int)(item % col_blocks);
    const int i0 = min(rb * 16 + g, count - 1), i1 = min(rb * 16 + g + 8, count - 1);
    const long long ar0 = a_by_id ? ids[i0] : i0, ar1 = a_by_id ? ids[i1] : i1;
    const uint16_t* a0p = A + ar0 * RED + t * 8;
    const uint16_t* a1p = A + ar1 * RED + t * 8;
    const uint16_t* bp[DR_NT];
    bool bvalid[DR_NT];
#pragma unroll
    for (int nt = 0; nt < DR_NT; ++nt) {
      const int col = cb * 32 + nt * 8 + g;
      bvalid[nt] = cb * 32 + nt * 8 < OUTC;
      bp[nt] = B + (long long)(bvalid[nt] ? col : 0) * RED + t * 8;
    }
    float acc[DR_NT][4];
#pragma unroll
    for (int nt = 0; nt < DR_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;

#pragma unroll 2
    for (int kb = warp; kb < kblocks; kb += DR_WARPS) {
      const int r = kb * 32;
      const bool kvalid = r + t * 8 < RED;
      uint4 alo = make_uint4(0, 0, 0, 0), ahi = alo, bq[DR_NT];
      if (kvalid) {
        alo = __ldg(reinterpret_cast<const uint4*>(a0p + r));
        ahi = __ldg(reinterpret_cast<const uint4*>(a1p + r));
      }
#pragma unroll
      for (int nt = 0; nt < DR_NT; ++nt)
        bq[nt] = (kvalid && bvalid[nt]) ? __ldg(reinterpret_cast<const uint4*>(bp[nt] + r))
                                        : make_uint4(0, 0, 0, 0);
      if (relu_a) {
        alo = twell_relu_bf16x8(alo);
        ahi = twell_relu_bf16x8(ahi);
      }
#pragma unroll
      for (int nt = 0; nt < DR_NT; ++nt) {
        twell_mma_bf16(acc[nt], alo.x, ahi.x, alo.y, ahi.y, bq[nt].x, bq[nt].y);
        twell_mma_bf16(acc[nt], alo.z, ahi.z, alo.w, ahi.w, bq[nt].z, bq[nt].w);
      }
    }

#pragma unroll
    for (int nt = 0; nt < DR_NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][nt][e][lane] = acc[nt][e];
    __syncthreads();
    {
      const int nt = warp;  // warp w finishes n8 tile w (DR_NT == DR_WARPS)
      float c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        c[e] = ((partial[0][nt][e][lane] + partial[1][nt][e][lane]) + partial[2][nt][e][lane]) +
               partial[3][nt][e][lane];
      const int col = cb * 32 + nt * 8 + 2 * t;
      if (col < OUTC) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = rb * 16 + g + 8 * half;
          if (i < count) {
            float v0 = c[2 * half], v1 = c[2 * half + 1];
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
            __nv_bfloat162 o = __floats2bfloat162_rn(v0, v1);
            const long long orow = o_by_id ? ids[i] : i;
            *reinterpret_cast<__nv_bfloat162*>(out + orow * OUTC + col) = o;
          }
        }
      }
    }
    __syncthreads();
  }
}

