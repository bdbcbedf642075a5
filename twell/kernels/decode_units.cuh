// decode_units.cuh — what the by-unit decode route's sources share: decode_units_gate.cu
// (the gate and up products), decode_units_down.cu (the down projection by lists of token
// groups) and decode_units_scan.cu (the down projection by a scan), all launched by
// decode_units.py. compile.py puts it after common.cuh in front of each of them
// (Source.headers).
//
// The route: the whole FFN block for a few tokens (decode, M <= 256), with the work divided
// among the GPU's SMs by hidden unit rather than by token: every weight row of an active
// unit is read once for all the tokens that use it.
//
//   gated:     y[t] = sum over n with g[t,n] kept of  r(g[t,n]) * (x[t]·w_up[n]) * w_down_t[n]
//   non-gated: y[t] = sum over n with g[t,n] kept of  r(g[t,n]) * w_down_t[n]
//   g[t,n] = bf16(x[t]·w_first[n])    (w_first: w_gate, or w_up when non-gated)
//   r(v) = v for v > 0 and for NaN, 0 otherwise (relu as dense math has it)
//
// "Kept" is relu's rule on the bf16 bits (twell_relu_keeps) or a non-finite value: a unit
// whose g is NaN or ±Inf always enters the sum, so a row with a non-finite pre-activation
// gets the NaN/Inf pattern dense math gives it (relu(-Inf) * u = 0 for a finite u). There
// are no heavy rows here: a unit list has no capacity, so a token with many active units
// costs more weight rows, never a different path, and every row of y is written.
//
// Two launches (no host synchronisation, no atomics, no global scratch beyond the two
// outputs of the first): a gate/up kernel (decode_units_gate.cu) writes h[t, n] for the
// kept pairs and the kept-unit bit masks; a down kernel (decode_units_down.cu or
// decode_units_scan.cu) reads them and writes y.
//
// Determinism: every value is summed in an order fixed by M, K, N and the data (never by
// timing or by the grid): identical bits run to run, and on any sm_90 device (the
// tensor-core sums follow the hardware's order). With TWELL_PRE the gate's bits are the
// cuBLAS GEMM's, which depend on the kernel cuBLAS picks (library version, CuPy or
// torch as the caller).
//
// Layouts (row-major, bf16 as uint16 bits): x [M, K]; w_first, w_up, w_down_t [N, K];
// y [M, K]; h float [M, N]; masks uint16 [M, N / 16] (bit i of masks[t, b]: unit 16 b + i
// kept for token t; the down kernels read them as uint32 [M, N / 32]); the bf16 rows
// 16-byte aligned, the masks' base too (the down kernel copies them in 16-byte pieces).
// Limits: K = TWELL_KDIM, a multiple of 8 in [8, 4096]; N % 32 == 0, N <= 65536 (the
// down kernels' lists hold 16-bit unit ids).

namespace units {

constexpr int K = TWELL_KDIM;
static_assert(K % 8 == 0 && K >= 8 && K <= 4096, "TWELL_KDIM: a multiple of 8 in [8, 4096]");

__device__ __forceinline__ uint4 ldg16(const uint16_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

}  // namespace units
