// backward_transpose.cu — step 5 of the FFN block's backward pass (launched by
// backward.py): dWd, accumulated as dWd_t [N, K] fp32, into the torch.nn.Linear layout
// [K, N] of w_down, fp32 or rounded once to bf16.
//
// twell_bw_transpose_f32: out [C, R] = in [R, C]ᵀ through 32 x 32 tiles in shared memory
// (padded to 33 columns: no bank conflicts), blocks of 32 x 8 threads.
// No compile-time parameters.

extern "C" __global__ void __launch_bounds__(256)
twell_bw_transpose_f32(const float* __restrict__ in, void* __restrict__ out, int R, int C,
                       int out_bf16) {
  __shared__ float tile[32][33];
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int r = r0 + i, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[i][threadIdx.x] = in[(long long)r * C + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int c = c0 + i, r = r0 + threadIdx.x;
    if (r < R && c < C) {
      const float v = tile[threadIdx.x][i];
      if (out_bf16)
        reinterpret_cast<__nv_bfloat16*>(out)[(long long)c * R + r] = __float2bfloat16_rn(v);
      else
        reinterpret_cast<float*>(out)[(long long)c * R + r] = v;
    }
  }
}
