#!/bin/bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/auto $OUT/zero
timeout 150 python3 -m twell bench --workloads heavy paperlike uniform --M 16384 65536 --out $OUT/auto > $OUT/bench_auto.log 2>&1; echo bench auto rc=$?
timeout 70 python3 -m twell bench --workloads heavy paperlike --M 16384 --dense-capacity 0 --out $OUT/zero > $OUT/bench_zero.log 2>&1; echo bench zero rc=$?
timeout 340 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_serving.py tests/test_torch_training.py tests/test_gpu_decode.py tests/test_gpu_decode_units.py tests/test_gpu_robustness.py tests/test_cli.py > $OUT/testsB.log 2>&1; echo tests rc=$?; tail -5 $OUT/testsB.log
