// dense_rows.cu — dense math for the heavy rows of a Hybrid, on tensor cores.
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
// host synchronisation. Work item = 16 rows x 32 output columns; the block's 4 warps
// split the reduction (interleaved 32-wide slices) and their partial sums are added in a
// fixed order through shared memory: deterministic.
//
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate). Each lane loads 16 contiguous bytes of A
// and of B per 32-wide k-slice; the same permutation of k is used for A and B, so the
// dot products are exact reorderings of the plain ones.
// Limits: RED % 8 == 0, OUTC % 8 == 0, 16-byte aligned rows.

#include <cuda_bf16.h>
// NVRTC has no <stdint.h>; these match its definitions (redeclaring is allowed).
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;

#define DR_WARPS 4
#define DR_NT 4  // n8 tiles per work item (32 output columns)

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// relu on two bf16 in one word; NaN (either sign) kept, negatives and -0 to +0.
__device__ __forceinline__ uint32_t relu2(uint32_t w) {
  uint32_t out = 0;
#pragma unroll
  for (int s = 0; s < 32; s += 16) {
    const uint32_t h = (w >> s) & 0xffffu;
    const bool keep = ((h & 0x7fffu) > 0x7f80u) || !(h & 0x8000u);
    out |= (keep ? h : 0u) << s;
  }
  return out;
}

__device__ __forceinline__ uint4 relu8(uint4 v) {
  return make_uint4(relu2(v.x), relu2(v.y), relu2(v.z), relu2(v.w));
}

__device__ __forceinline__ float bf16_to_float(uint16_t b) {
  return __uint_as_float((uint32_t)b << 16);
}

extern "C" __global__ void __launch_bounds__(DR_WARPS * 32)
twell_dense_rows(const uint16_t* __restrict__ A, int a_by_id, int relu_a,
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
        alo = relu8(alo);
        ahi = relu8(ahi);
      }
#pragma unroll
      for (int nt = 0; nt < DR_NT; ++nt) {
        mma_bf16(acc[nt], alo.x, ahi.x, alo.y, ahi.y, bq[nt].x, bq[nt].y);
        mma_bf16(acc[nt], alo.z, ahi.z, alo.w, ahi.w, bq[nt].z, bq[nt].w);
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
              float g0 = bf16_to_float(gate[gr * OUTC + col]);
              float g1 = bf16_to_float(gate[gr * OUTC + col + 1]);
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
