// backward_grads.cu — step 3 of the FFN block's backward pass (launched by backward.py):
// the weight gradients of the light pairs.
//
// twell_bw_weight_grads (twell_bw_weight_grads_sliced) + twell_bw_weight_grads_finish:
// per unit n, over its list in ascending token order, in fp32:
//   dWg[n] += da x[t],  dWu[n] += du x[t],  dWd_t[n] += h dy[t]     (gated)
//   dWu[n] += da x[t],  dWd_t[n] += h dy[t]                         (non-gated)
// then, with `fold` > 0 (backward.py: few capacity rows), the first min(count, fold) heavy
// rows of the dense path in row order: their da, du, h (bf16 [fold, N], as
// twell_bw_capacity_units leaves them) against their gathered x and dy rows, added to
// segment 0's sums (so the fp32 weight gradients are not read and written again by a
// GEMM with beta = 1: 3 N·K·8 bytes, where a few rows' products cost next to nothing).
// With `final_ok` (bf16 gradients asked for, no weight GEMM after this step) and no heavy
// rows left for the chunks (left[0] == 0, read on the device), a unit's sums are its
// final gradients: dWg and dWu (dWu non-gated) are rounded here into the bf16 outputs o0,
// o1 (the fp32 rows are not written), and twell_bw_round_grads then finds nothing to do;
// else the fp32 rows are written, the heavy-row chunks add to them, and it rounds them.
// Either way each value is rounded once from the same fp32 sum: the same bits (but for
// the sign of a zero: a final row with nothing to add in the last range is its value +
// 0.0, which turns a -0 into +0).
// Lists longer than `seg` entries are cut into segments computed by different blocks;
// segment 0 writes the output row, the others a workspace row, and the finish kernel
// adds them in segment order. Units nobody uses get zero rows. A block takes one K slice
// of its item, blocks numbered slice-major, and a token range per launch where needed,
// so the x and dy rows being read stay in L2.
//
// Layouts: x, dy [M, K] bf16; the unit lists (tokens, pairs, unit_start, seg_start) of
// backward_lists.cu; vals fp32 [NV, cap], the pair values of backward_light.cu; weight
// gradients fp32 [N, K] (dw0, dw1, dw2: (dWg, dWu, dWd_t) gated, (dWu, dWd_t) non-gated);
// ws fp32 [extra_cap·NV, K], the extra segments' rows; the folded rows: f0, f1, f2 bf16
// [fold, N] in the order of the outputs ((da, du, h) gated, (da, h) non-gated, f2 null),
// fx, fdy bf16 [fold, K], fcount int32 [1] (rows past it are padding).
//
// Limits: K = TWELL_KDIM, a multiple of 8, <= 4096; 16-byte aligned rows.
//
// Compile-time parameters: TWELL_KDIM, TWELL_GATED; constant shared with backward.py:
// TWELL_BW_GRAD_BATCH (pairs a block stages in shared memory at a time).

#define NV (TWELL_GATED ? 3 : 2)
#define KCH (TWELL_KDIM / 8)
// Threads of a weight-gradient block: 16-byte chunks of a row, one per thread (256 at most).
#define GRAD_THREADS (KCH >= 256 ? 256 : ((KCH + 31) / 32) * 32)
#define CPT ((KCH + GRAD_THREADS - 1) / GRAD_THREADS)

// Largest n in [0, N) with start[n] <= e (start non-decreasing, start[0] = 0 <= e).
__device__ __forceinline__ int find_unit(const int* __restrict__ start, int N, int e) {
  int lo = 0, hi = N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (start[mid] <= e) lo = mid; else hi = mid;
  }
  return lo;
}

// First index i in [lo, hi) with tokens[i] >= t (tokens ascending), hi if none.
__device__ __forceinline__ int first_token_at_least(const int* __restrict__ tokens, int lo,
                                                    int hi, int t) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (tokens[mid] < t) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// A batch of the item's pairs: their tokens and values.
struct GradShared {
  int tok[TWELL_BW_GRAD_BATCH];
  float v[NV][TWELL_BW_GRAD_BATCH];
};

#define GRAD_UNROLL 4

// Eight fp32 values rounded to bf16 (nearest even, __float2bfloat16_rn each, as the
// conversion kernels round), packed in element order.
__device__ __forceinline__ uint16_t twell_bf16_bits(float f) {
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&b);
}
__device__ __forceinline__ uint4 twell_round8(float4 lo, float4 hi) {
  return make_uint4((uint32_t)twell_bf16_bits(lo.x) | ((uint32_t)twell_bf16_bits(lo.y) << 16),
                    (uint32_t)twell_bf16_bits(lo.z) | ((uint32_t)twell_bf16_bits(lo.w) << 16),
                    (uint32_t)twell_bf16_bits(hi.x) | ((uint32_t)twell_bf16_bits(hi.y) << 16),
                    (uint32_t)twell_bf16_bits(hi.z) | ((uint32_t)twell_bf16_bits(hi.w) << 16));
}

// out[v] rows (fp32, K wide): v < NV-1 sum vals[v]·x[t], v = NV-1 sum vals[v]·dy[t].
// Items: unit n (segment 0, writes dw[v] row n) for item < N; extra segment e = item - N
// (writes ws row e*NV + v) after that. A block computes one item's columns of one K slice
// (`slices` equal slices of KCH / slices 16-byte chunks, one per thread; slices == 1: the
// whole row, GRAD_THREADS threads). Blocks are numbered slice-major, so the blocks running
// at once read the same slice of x and dy: a slice of both for all tokens can stay in L2
// where the whole rows cannot. Each value is summed in token order by one thread whatever
// the slicing: the bits do not depend on it. Where even a slice of all tokens is too large,
// the launcher runs the kernel once per token range [t0, t1), in order: the first launch
// writes the rows, the later ones (accumulate = 1) add their range's sums to them (a
// fixed order: the bits depend on the ranges, not on timing); the launcher passes `fold`
// to the last launch only, and the folded rows go after the pairs of segment 0. With
// `prior`, the capacity rows' cuBLAS GEMMs wrote the units' rows first (beta = 0), and
// every launch adds to them.
// C: 16-byte chunks per thread (CPT for the whole row; 1 for a slice, which has one per
// thread).
#define TWELL_GRAD_ARGS                                                                    \
  const uint16_t *__restrict__ x, const uint16_t *__restrict__ dy,                         \
      const int *__restrict__ tokens, const int *__restrict__ pairs,                       \
      const float *__restrict__ vals, long long cap, const int *__restrict__ unit_start,   \
      const int *__restrict__ seg_start, int N, int seg, int extra_cap, int slices, int t0, \
      int t1, int accumulate, float *__restrict__ dw0, float *__restrict__ dw1,            \
      float *__restrict__ dw2, float *__restrict__ ws, const uint16_t *__restrict__ f0,    \
      const uint16_t *__restrict__ f1, const uint16_t *__restrict__ f2,                    \
      const uint16_t *__restrict__ fx, const uint16_t *__restrict__ fdy,                   \
      const int *__restrict__ fcount, int fold, uint16_t *__restrict__ o0,                \
      uint16_t *__restrict__ o1, const int *__restrict__ left, int final_ok, int prior
#define TWELL_GRAD_PASS                                                                    \
  x, dy, tokens, pairs, vals, cap, unit_start, seg_start, N, seg, extra_cap, slices, t0, t1, \
      accumulate, dw0, dw1, dw2, ws, f0, f1, f2, fx, fdy, fcount, fold, o0, o1, left, final_ok, \
      prior
template <int C>
__device__ __forceinline__ void weight_grads(TWELL_GRAD_ARGS) {
  __shared__ GradShared sm;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int extras = min(seg_start[N], extra_cap);
  const int items = N + extras, per = N + extra_cap;
  const int cs = KCH / slices;  // chunks of a slice
  for (int b = blockIdx.x; b < slices * per; b += gridDim.x) {
    const int s = b / per, item = b - s * per;
    if (item >= items) continue;  // block-uniform
    int begin, end;
    long long row;  // where the item's rows go: dw[v] row n, or ws row e*NV + v
    if (item < N) {
      begin = unit_start[item];
      end = min(unit_start[item + 1], begin + seg);
      row = (long long)item * TWELL_KDIM;
    } else {
      const int e = item - N;
      const int n = find_unit(seg_start, N, e);
      begin = unit_start[n] + (e - seg_start[n] + 1) * seg;
      end = min(unit_start[n + 1], begin + seg);
      row = (long long)e * NV * TWELL_KDIM;
    }
    begin = first_token_at_least(tokens, begin, end, t0);  // the range's part of the list
    end = first_token_at_least(tokens, begin, end, t1);
    // the folded rows this block adds (segment 0 only; block-uniform)
    const int frows = item < N && fold > 0 ? min(fcount[0], fold) : 0;
    // segment 0 of a unit without extra segments, the last range, no heavy rows left over
    const bool final = final_ok && item < N && left[0] == 0 &&
                       seg_start[item + 1] == seg_start[item];  // block-uniform
    // add to what the row holds: an earlier range's sums, or (`prior`, a unit's row) the
    // capacity rows' cuBLAS GEMMs' (the extra segments' workspace rows have no prior);
    // nothing to add leaves the row as it is (a final row is still rounded into its output)
    const bool add = accumulate || (prior && item < N);
    if (add && begin == end && frows == 0 && !final) continue;
    float* const out0 = item < N ? dw0 + row : ws + row;
    float* const out1 = item < N ? dw1 + row : ws + row + TWELL_KDIM;
    float* const out2 = item < N ? dw2 + row : ws + row + 2 * TWELL_KDIM;
    float acc[NV][C][8];
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int cc = 0; cc < C; ++cc)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[v][cc][i] = 0.f;

    for (int b0 = begin; b0 < end; b0 += TWELL_BW_GRAD_BATCH) {
      const int nb = min(TWELL_BW_GRAD_BATCH, end - b0);
      __syncthreads();  // the previous batch is consumed
      for (int i = tid; i < nb; i += threads) {
        const long long p = pairs[b0 + i];
        sm.tok[i] = tokens[b0 + i];
#pragma unroll
        for (int v = 0; v < NV; ++v) sm.v[v][i] = vals[v * cap + p];
      }
      __syncthreads();
      for (int i = 0; i < nb; i += GRAD_UNROLL) {
        uint4 xv[GRAD_UNROLL][C], dv[GRAD_UNROLL][C];
#pragma unroll
        for (int q = 0; q < GRAD_UNROLL; ++q) {
          const bool live = i + q < nb;
          const long long t = live ? sm.tok[i + q] : 0;
          const uint4* xr = reinterpret_cast<const uint4*>(x + t * TWELL_KDIM);
          const uint4* dr = reinterpret_cast<const uint4*>(dy + t * TWELL_KDIM);
#pragma unroll
          for (int cc = 0; cc < C; ++cc) {
            const int kl = tid + cc * threads, k = s * cs + kl;
            const bool ok = live && kl < cs && k < KCH;
            xv[q][cc] = ok ? __ldg(xr + k) : make_uint4(0, 0, 0, 0);
            dv[q][cc] = ok ? __ldg(dr + k) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int q = 0; q < GRAD_UNROLL; ++q) {
          if (i + q < nb) {
#pragma unroll
            for (int cc = 0; cc < C; ++cc) {
#pragma unroll
              for (int v = 0; v < NV - 1; ++v) twell_axpy8(sm.v[v][i + q], xv[q][cc], acc[v][cc]);
              twell_axpy8(sm.v[NV - 1][i + q], dv[q][cc], acc[NV - 1][cc]);
            }
          }
        }
      }
    }
    // The folded rows, in row order, a batch of their values at this unit at a time in
    // shared memory. Gated, a row whose da, du and h are all zero here adds nothing and is
    // skipped (a heavy row keeps a fifth of the units or so): only finite x and dy rows
    // have such units, as an Inf or NaN in x makes u (and so h) Inf or NaN at every unit,
    // and one in dy makes du so. Non-gated, a = -Inf leaves da = h = 0 while dense math
    // still adds 0·Inf = NaN, so every row is added.
    for (int r0 = 0; r0 < frows; r0 += TWELL_BW_GRAD_BATCH) {
      const int nb = min(TWELL_BW_GRAD_BATCH, frows - r0);
      __syncthreads();  // the previous batch is consumed
      for (int i = tid; i < nb; i += threads) {
        const long long cell = (long long)(r0 + i) * N + item;
        sm.v[0][i] = twell_bf16_to_float(f0[cell]);
        sm.v[1][i] = twell_bf16_to_float(f1[cell]);
#if TWELL_GATED
        sm.v[2][i] = twell_bf16_to_float(f2[cell]);
        sm.tok[i] = sm.v[0][i] != 0.f || sm.v[1][i] != 0.f || sm.v[2][i] != 0.f;
#else
        sm.tok[i] = 1;
#endif
      }
      __syncthreads();
      for (int i = 0; i < nb; ++i) {
        if (!sm.tok[i]) continue;  // block-uniform
        const long long r = r0 + i;
        const uint4* xr = reinterpret_cast<const uint4*>(fx + r * TWELL_KDIM);
        const uint4* dr = reinterpret_cast<const uint4*>(fdy + r * TWELL_KDIM);
#pragma unroll
        for (int cc = 0; cc < C; ++cc) {
          const int kl = tid + cc * threads, k = s * cs + kl;
          if (kl < cs && k < KCH) {
            const uint4 xv = __ldg(xr + k), dv = __ldg(dr + k);
#pragma unroll
            for (int v = 0; v < NV - 1; ++v) twell_axpy8(sm.v[v][i], xv, acc[v][cc]);
            twell_axpy8(sm.v[NV - 1][i], dv, acc[NV - 1][cc]);
          }
        }
      }
    }
#pragma unroll
    for (int cc = 0; cc < C; ++cc) {
      const int kl = tid + cc * threads, k = s * cs + kl;
      if (kl < cs && k < KCH) {
#pragma unroll
        for (int v = 0; v < NV; ++v) {  // the output pointer chosen by value
          float4* o = reinterpret_cast<float4*>((v == 0 ? out0 : (v == 1 ? out1 : out2)) + k * 8);
          float4 lo = make_float4(acc[v][cc][0], acc[v][cc][1], acc[v][cc][2], acc[v][cc][3]);
          float4 hi = make_float4(acc[v][cc][4], acc[v][cc][5], acc[v][cc][6], acc[v][cc][7]);
          if (add) {  // what the row holds + this range's sums
            const float4 a = o[0], b = o[1];
            lo = make_float4(a.x + lo.x, a.y + lo.y, a.z + lo.z, a.w + lo.w);
            hi = make_float4(b.x + hi.x, b.y + hi.y, b.z + hi.z, b.w + hi.w);
          }
          if (final && v < NV - 1) {  // rounded once, as twell_bw_round_grads would
            uint16_t* to = (v == 0 ? o0 : o1) + row + k * 8;
            *reinterpret_cast<uint4*>(to) = twell_round8(lo, hi);
          } else {
            o[0] = lo;
            o[1] = hi;
          }
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(GRAD_THREADS)
twell_bw_weight_grads(TWELL_GRAD_ARGS) {  // whole rows: slices == 1, GRAD_THREADS threads
  weight_grads<CPT>(TWELL_GRAD_PASS);
}

extern "C" __global__ void __launch_bounds__(256)
twell_bw_weight_grads_sliced(TWELL_GRAD_ARGS) {  // slices > 1: one chunk per thread
  weight_grads<1>(TWELL_GRAD_PASS);
}

// Adds the extra segments of each unit to its rows, in segment order (segment 0 is
// already there). A block per extra segment; the first segment of a unit does the work.
// With final_ok and no heavy rows left over (as twell_bw_weight_grads decides), dWg and
// dWu are rounded into the bf16 outputs o0, o1 instead of written back in fp32.
extern "C" __global__ void __launch_bounds__(256)
twell_bw_weight_grads_finish(const int* __restrict__ seg_start, int N, int extra_cap,
                             const float* __restrict__ ws, float* __restrict__ dw0,
                             float* __restrict__ dw1, float* __restrict__ dw2,
                             uint16_t* __restrict__ o0, uint16_t* __restrict__ o1,
                             const int* __restrict__ left, int final_ok) {
  const bool final = final_ok && left[0] == 0;
  const int extras = min(seg_start[N], extra_cap);
  for (int e = blockIdx.x; e < extras; e += gridDim.x) {
    const int n = find_unit(seg_start, N, e);
    if (seg_start[n] != e) continue;
    const int nseg = min(seg_start[n + 1], extras) - e;
    // One flat loop over (v, k); the output pointer chosen by value. (Two NVRTC versions
    // spilled a few bytes here with a loop over v: 13.0 when unrolled, 13.x when not.)
    const long long row = (long long)n * TWELL_KDIM;
    for (int i = threadIdx.x; i < NV * (TWELL_KDIM / 4); i += blockDim.x) {
      const int v = i / (TWELL_KDIM / 4), k = i - v * (TWELL_KDIM / 4);
      float4* o = reinterpret_cast<float4*>((v == 0 ? dw0 : (v == 1 ? dw1 : dw2)) + row) + k;
      const float4* src =
          reinterpret_cast<const float4*>(ws + ((long long)e * NV + v) * TWELL_KDIM) + k;
      float4 acc = *o;
      for (int s = 0; s < nseg; ++s) {
        const float4 b = src[(long long)s * NV * (TWELL_KDIM / 4)];
        acc.x += b.x;
        acc.y += b.y;
        acc.z += b.z;
        acc.w += b.w;
      }
      if (final && v < NV - 1) {
        uint16_t* to = (v == 0 ? o0 : o1) + row + 4 * k;
        *reinterpret_cast<uint2*>(to) =
            make_uint2((uint32_t)twell_bf16_bits(acc.x) | ((uint32_t)twell_bf16_bits(acc.y) << 16),
                       (uint32_t)twell_bf16_bits(acc.z) | ((uint32_t)twell_bf16_bits(acc.w) << 16));
      } else {
        *o = acc;
      }
    }
  }
}

// dW (fp32 [n8 * 8]) rounded to bf16 into out, eight values a thread, unless
// twell_bw_weight_grads and its finish kernel already wrote the final bf16 values
// (final_ok and no heavy rows left for the chunks: left[0] == 0).
extern "C" __global__ void __launch_bounds__(256)
twell_bw_round_grads(const float4* __restrict__ in, uint4* __restrict__ out, long long n8,
                     const int* __restrict__ left, int final_ok) {
  if (final_ok && left[0] == 0) return;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8;
       i += (long long)gridDim.x * blockDim.x)
    out[i] = twell_round8(__ldg(in + 2 * i), __ldg(in + 2 * i + 1));
}
