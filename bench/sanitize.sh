#!/usr/bin/env bash
# compute-sanitizer (memcheck) over a representative subset of the GPU tests, plus the
# Hypothesis GPU tests run plainly. Usage (device machine, repo root):
#   bash bench/sanitize.sh            # every subset below; logs under $OUT (or /tmp/twell_out)
#   bash bench/sanitize.sh decode     # the decode kernels' subset only (exits with its status)
#   bash bench/sanitize.sh counted    # the per-call decisions' subset only (likewise)
#   bash bench/sanitize.sh light      # the light rows from a pre-activation only (likewise)
set -u
case "${1:-all}" in all | decode | counted | light) ;; *) echo "usage: $0 [decode|counted|light]" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/twell_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/twell_cupy_cache

# memcheck NAME TEST_FILE EXPRESSION [LINES]: the tests of TEST_FILE that match the -k
# EXPRESSION under memcheck; log in $OUT/memcheck_NAME.log, its last LINES (5) shown,
# the exit status echoed and returned (9: an error found).
memcheck() {
  timeout "${SAN_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider "$2" -k "$3" \
    2>&1 | tee "$OUT/memcheck_$1.log" | grep -v "Warning" | tail -"${4:-5}"
  local status=${PIPESTATUS[0]}
  echo "memcheck ($1) exit: $status"
  return "$status"
}

if [ "${1:-all}" = all ] || [ "${1:-all}" = decode ]; then
  # The by-unit decode kernels: both gates (mma.sync, the default up to 16 tokens, and
  # the wgmma gate's TMA ring, at K = 264 and 2048), both down kernels, heavy rows,
  # NaN/Inf, K past the last 64-wide box, a ring holding a previous call's rows past M.
  DECODE='(units_match_dense and (1-gated-264 or 9-nongated-264 or 64-gated-264 or 33-gated-2048))
    or (every_geometry and 64-) or (wgmma_gate_matches and (25-gated-264 or 64-nongated-2048))
    or ring_held or (down_by_scan and 64-264)'
  memcheck decode tests/gpu/test_gpu_decode_units.py "$(echo $DECODE)"
  status=$?
  [ "${1:-}" = decode ] && exit "$status"
fi
# The count build (split and unsplit counts, rows to ids, the gate in its epilogue), the
# per-call decision from pre-activations and TwELL words, heavy rows by count at every
# share and NaN rows.
if [ "${1:-all}" = all ] || [ "${1:-all}" = counted ]; then
  memcheck counted tests/gpu/test_gpu_counted.py \
    '(computes_the_counted_rows_only and (512-264 or 768-40)) or scatters or decides or heavy_shares'
  status=$?
  [ "${1:-}" = counted ] && exit "$status"
fi
# The light rows from a pre-activation: the by-columns kernel at 1, 3 and 8 warps a token
# (heavy rows of every kind, K past a 256-column slice), rows at the list capacity, and
# the call's decision in both kernels.
memcheck light tests/gpu/test_gpu_decode.py \
  '(cols_kernel_gives and (264-gated-1 or 2048-nongated-3 or 4096-gated-8)) or list_capacity or decision_flags'
status=$?
[ "${1:-}" = light ] && exit "$status"
timeout "${HYP_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py \
  -k hypothesis 2>&1 | tee "$OUT/hypothesis.log" | tail -25
memcheck ffn tests/gpu/test_gpu.py \
  '(ffn_matches_dense_float64 and (129 or 300 or 257 or 70 or 2000)) or graph or gate_gemm_epilogue or (other_paths and epilogue and 300) or fixed_size' 25
# The sliced route and the backward's slice kernels (light pairs, dx, weight gradients by
# K slices and token ranges), and its heavy-row queue (twell_bw_heavy_chunks).
memcheck sliced tests/gpu/test_gpu.py "sliced_route or more_tiles"
memcheck backward tests/gpu/test_gpu_backward.py \
  '(slices_give and 1024) or (saved_up and heavy) or (matches_reference and uniform and 37) or heavy_chunks_give or more_heavy_rows_than'
