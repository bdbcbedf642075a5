#!/usr/bin/env bash
# One device call: GPU facts, compile + correctness tests, then the quick benchmark.
# Usage (device machine, repo root): bash bench/gpu_session.sh [bench args...]
# Logs and JSON go under $OUT (or /tmp/twell_out).
set -u
OUT=${OUT:-/tmp/twell_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/twell_cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider --durations=8 \
    tests/test_kernels_compile.py tests/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -60
fi
timeout "${BENCH_TIMEOUT:-250}" python3 bench/bench_ffn.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
if [ -n "${BENCH2:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH2_TIMEOUT:-200}" python3 bench/bench_ffn.py --out "$OUT" $BENCH2 2>&1 | tee "$OUT/bench2.log" | grep -v '^{'
fi
