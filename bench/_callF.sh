set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
timeout 250 torchrun --standalone --nproc_per_node 2 bench/train_distributed.py --variants twell dense --strategies fsdp --steps 120 --baseline-steps 120 --no-reference --quiet --profile-steps 3 --out $OUT/f.json > $OUT/f.log 2>&1
echo "exit $?"; tail -2 $OUT/f.log; gzip $OUT/*trace.json; ls $OUT
