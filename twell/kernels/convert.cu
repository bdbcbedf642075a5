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

// The same for rows and cols multiples of 8 and 16-byte aligned arrays: 64x64 tiles, 256
// threads, 16-byte loads and stores (eight threads move one 128-byte row segment). The
// tile's 16-byte chunks are swizzled (chunk q of row r sits at q ^ (r / 8)) so that the
// column reads of the second half hit 16 different banks per warp.
extern "C" __global__ void __launch_bounds__(256)
    twell_transpose_u16x8(const uint4* __restrict__ in, uint4* __restrict__ out, int rows,
                          int cols) {
  __shared__ __align__(16) uint16_t tile[64 * 64];
  const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
  const int lane8 = threadIdx.x & 7, line = threadIdx.x >> 3;  // 32 lines of 8 threads
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = line + 32 * i, gr = r0 + r, gc = c0 + lane8 * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (gr < rows && gc < cols) v = in[((long long)gr * cols + gc) >> 3];
    *reinterpret_cast<uint4*>(&tile[r * 64 + ((lane8 ^ (r >> 3)) << 3)]) = v;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = line + 32 * i, gc = c0 + c, gr = r0 + lane8 * 8;
    if (gc >= cols || gr >= rows) continue;
    const int at = (((c >> 3) ^ lane8) << 3) + (c & 7);  // rows lane8*8 .. +7 share r >> 3
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = lane8 * 8 + 2 * k;
      w[k] = (uint32_t)tile[r * 64 + at] | ((uint32_t)tile[(r + 1) * 64 + at] << 16);
    }
    out[((long long)gc * rows + gr) >> 3] = make_uint4(w[0], w[1], w[2], w[3]);
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

// twell_f32_to_bf16 eight values a thread: two 16-byte loads, one 16-byte store (the
// scalar kernel moves 4 bytes in and 2 out per thread). n8 = n / 8; in and out 16-byte
// aligned. The same f2bf per element: the same bits.
extern "C" __global__ void twell_f32_to_bf16_x8(const float4* __restrict__ in,
                                                uint4* __restrict__ out, long long n8) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8;
       i += (long long)gridDim.x * blockDim.x) {
    const float4 a = __ldg(in + 2 * i), b = __ldg(in + 2 * i + 1);
    out[i] = make_uint4((uint32_t)f2bf(a.x) | ((uint32_t)f2bf(a.y) << 16),
                        (uint32_t)f2bf(a.z) | ((uint32_t)f2bf(a.w) << 16),
                        (uint32_t)f2bf(b.x) | ((uint32_t)f2bf(b.y) << 16),
                        (uint32_t)f2bf(b.z) | ((uint32_t)f2bf(b.w) << 16));
  }
}
CONVERT(twell_f64_to_bf16, double, uint16_t, f2bf((float)v))
CONVERT(twell_f16_to_bf16, __half, uint16_t, f2bf(__half2float(v)))
CONVERT(twell_bf16_to_f32, uint16_t, float, twell_bf16_to_float(v))
CONVERT(twell_bf16_to_f64, uint16_t, double, (double)twell_bf16_to_float(v))
CONVERT(twell_bf16_to_f16, uint16_t, __half, __float2half_rn(twell_bf16_to_float(v)))
