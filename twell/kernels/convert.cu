// convert.cu — layout and dtype helpers: a bf16 transpose (w_down [K, N] -> [N, K], done
// once by a prepared block) and conversions between bf16 and float16/32/64.
// Grid-stride loops; sizes as 64-bit integers.

#include <cuda_fp16.h>

// out[c, r] = in[r, c] for in [rows, cols] (2-byte elements), 32x32 tiles via shared memory.
extern "C" __global__ void twell_transpose_u16(const uint16_t* __restrict__ in,
                                               uint16_t* __restrict__ out, int rows, int cols) {
  __shared__ uint16_t tile[32][33];
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int r = r0 + dy, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[dy][threadIdx.x] = in[(long long)r * cols + c];
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int c = c0 + dy, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[(long long)c * rows + r] = tile[threadIdx.x][dy];
  }
}

#define CONVERT(NAME, IN_T, OUT_T, EXPR)                                                    \
  extern "C" __global__ void NAME(const IN_T* __restrict__ in, OUT_T* __restrict__ out,     \
                                  long long n) {                                            \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;             \
         i += (long long)gridDim.x * blockDim.x) {                                          \
      const IN_T v = in[i];                                                                 \
      out[i] = EXPR;                                                                        \
    }                                                                                       \
  }

__device__ __forceinline__ uint16_t f2bf(float f) {
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&b);
}

CONVERT(twell_f32_to_bf16, float, uint16_t, f2bf(v))
CONVERT(twell_f64_to_bf16, double, uint16_t, f2bf((float)v))
CONVERT(twell_f16_to_bf16, __half, uint16_t, f2bf(__half2float(v)))
CONVERT(twell_bf16_to_f32, uint16_t, float, twell_bf16_to_float(v))
CONVERT(twell_bf16_to_f64, uint16_t, double, (double)twell_bf16_to_float(v))
CONVERT(twell_bf16_to_f16, uint16_t, __half, __float2half_rn(twell_bf16_to_float(v)))
