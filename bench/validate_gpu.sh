#!/usr/bin/env bash
# Validation of a tree on a Hopper GPU, in two runs of under ten minutes each:
#   bash bench/validate_gpu.sh tests   GPU facts, cold/warm JIT, GPU tests, demo and check
#   bash bench/validate_gpu.sh bench   the FFN benchmark (JSON, with the gate GEMM alone), 2B decoder
# Logs and JSON go under $OUT (or /tmp/twell_out); each step has its own time limit.
set -u
OUT=${OUT:-/tmp/twell_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
case "${1:-}" in
tests)
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" \
    | tee -a "$OUT/gpu.txt"
  export CUPY_CACHE_DIR
  CUPY_CACHE_DIR=$(mktemp -d)
  for start in cold warm; do
    echo "$start start, all kernels of the common paths: $(timeout 120 python3 bench/jit_time.py)" \
      | tee -a "$OUT/gpu.txt"
  done
  timeout 540 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/gpu \
    tests/test_torch.py tests/test_training_*.py tests/test_kernels_compile.py tests/test_cli.py > "$OUT/tests.log" 2>&1
  echo "pytest exit: $?" | tee -a "$OUT/tests.log"
  tail -12 "$OUT/tests.log"
  { timeout 90 python3 -m twell demo; timeout 90 python3 -m twell check; } > "$OUT/cli.log" 2>&1
  echo "cli exit: $?" | tee -a "$OUT/cli.log"
  tail -30 "$OUT/cli.log"
  ;;
bench)
  timeout 300 python3 -m twell bench --workloads uniform heavy paperlike --M 16384 65536 \
    --paths fused epilogue --out "$OUT/ffn.json" > "$OUT/bench.log" 2>&1
  timeout 120 python3 -m twell bench --workloads uniform --M 1 64 4096 16384 --nongated \
    --out "$OUT/ffn.json" >> "$OUT/bench.log" 2>&1
  timeout 90 python3 -m twell bench --workloads density=0.001 density=0.02 --M 16384 \
    --out "$OUT/ffn.json" >> "$OUT/bench.log" 2>&1
  grep -v '^{' "$OUT/bench.log" | tail -40
  timeout 200 python3 bench/bench_decoder.py --out "$OUT/decoder.json" > "$OUT/decoder.log" 2>&1
  echo "decoder exit: $?" | tee -a "$OUT/decoder.log"
  tail -5 "$OUT/decoder.log"
  ;;
*)
  echo "usage: bash bench/validate_gpu.sh tests|bench" >&2
  exit 2
  ;;
esac
