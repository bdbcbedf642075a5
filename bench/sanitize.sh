#!/usr/bin/env bash
# compute-sanitizer (memcheck) over a representative subset of the GPU tests, plus the
# Hypothesis GPU tests run plainly. Usage (device machine, repo root):
#   bash bench/sanitize.sh            # logs under $OUT (or /tmp/twell_out)
set -u
OUT=${OUT:-/tmp/twell_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/twell_cupy_cache
timeout "${HYP_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  -k hypothesis 2>&1 | tee "$OUT/hypothesis.log" | tail -25
SUBSET='(ffn_matches_dense_float64 and (129 or 300 or 257 or 70 or 2000)) or dense_rows_kernels or graph or version_1 or gate_gemm_epilogue or (other_paths and epilogue and 300) or fixed_size'
timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "$SUBSET" 2>&1 \
  | tee "$OUT/memcheck.log" | grep -v "Warning" | tail -25
echo "memcheck exit: ${PIPESTATUS[0]}"
# The sliced route and the backward's slice kernels (light pairs, dx, weight gradients by
# K slices and token ranges), and its heavy-row queue (twell_bw_heavy_chunks).
timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "sliced_route or more_tiles" \
  2>&1 | tee "$OUT/memcheck_sliced.log" | grep -v "Warning" | tail -5
echo "memcheck (sliced route) exit: ${PIPESTATUS[0]}"
BACKWARD='(slices_give and 1024) or (saved_up and heavy) or (matches_reference and uniform and 37) or heavy_chunks_give or more_heavy_rows_than'
timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu_backward.py -k "$BACKWARD" \
  2>&1 | tee "$OUT/memcheck_backward.log" | grep -v "Warning" | tail -5
echo "memcheck (backward) exit: ${PIPESTATUS[0]}"
