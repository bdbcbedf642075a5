"""Where a DDP step's time goes, dense against twell: the small model of train_small.py
under DistributedDataParallel, eager steps timed with and without the gradient all-reduce
(``no_sync``) in the same process, every timed step started behind a barrier (so the
slowest rank's time per step is known too: without the all-reduce the ranks do not wait
for each other), then torch.profiler over a few steps (rank 0's kernels, NCCL included,
GPU time per step).

    torchrun --standalone --nproc_per_node 2 bench/profile_distributed.py [--op-graphs]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_distributed  # noqa: E402
import train_small  # noqa: E402

import twell.torch as twell_torch  # noqa: E402


def profile(variant: str, config: Any, data: torch.Tensor, device: Any, rank: int,
            args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    sparse = variant == "twell"
    model = train_small.build_model(config, device, sparse=sparse)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = train_distributed.optimizer_for(ddp, config, fused=True)
    gen = train_distributed.batch_generator(config, rank)

    def step(sync: bool = True) -> None:
        batch = train_small.random_batch(data, config.batch, config.seq, gen)
        batch = batch.to(device, non_blocking=True)
        with contextlib.nullcontext() if sync else ddp.no_sync():
            with train_small.autocast(device):
                logits = ddp(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            if sparse:
                loss = loss + config.l1_coeff * twell_torch.l1_penalty(model)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(sync: bool) -> tuple[float, float, list[float]]:
        """Median step time on this rank; the median over steps of the slowest rank's
        time (every step starts behind a barrier, so the ranks start together); each
        rank's median."""
        times = []
        for _ in range(args.timed_steps):
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            step(sync)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, times)
        slowest = [max(ts) for ts in zip(*every, strict=True)]
        return (round(statistics.median(times) * 1e3, 2),
                round(statistics.median(slowest) * 1e3, 2),
                [round(statistics.median(ts) * 1e3, 2) for ts in every])  # fmt: skip

    for _ in range(args.steps):
        step()
    rec: dict[str, Any] = {"variant": variant, "op_graphs": config.op_graphs}
    rec["step_ms_no_sync"], rec["step_ms_no_sync_slowest_rank"], rec["ranks_no_sync"] = timed(False)
    rec["step_ms_ddp"], rec["step_ms_ddp_slowest_rank"], rec["ranks_ddp"] = timed(True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            step()
        torch.cuda.synchronize()
    n = args.profile_steps
    kernels = sorted(
        (e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: -e.self_device_time_total,
    )
    rec["gpu_ms_per_step"] = round(sum(e.self_device_time_total for e in kernels) / n / 1e3, 2)
    rec["nccl_ms_per_step"] = round(
        sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / n / 1e3, 2
    )
    rec["kernels"] = [
        {"name": e.key[:80], "ms_per_step": round(e.self_device_time_total / n / 1e3, 3),
         "calls_per_step": e.count // n}
        for e in kernels[:14]
    ]  # fmt: skip
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="warm-up steps per variant")
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--op-graphs", action="store_true", help="SparseMLP(op_graphs=True)")
    p.add_argument("--reverse-devices", action="store_true", help="rank r on the last-but-r GPU")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.reverse_devices:  # rank r on GPU (world - 1 - r): does a slow rank follow its GPU?
        local = int(os.environ["LOCAL_WORLD_SIZE"]) - 1 - local
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl", device_id=device)
    try:
        data, _, _ = train_small.stdlib_corpus()
        config = dataclasses.replace(train_small.Config(), op_graphs=args.op_graphs, l1_warmup=0.0)
        records = [profile(v, config, data, device, rank, args) for v in ("dense", "twell")]
        if rank == 0:
            for rec in records:
                print(
                    f"== {rec['variant']}: step {rec['step_ms_ddp']} ms with DDP, "
                    f"{rec['step_ms_no_sync']} without the all-reduce (slowest rank per "
                    f"step {rec['step_ms_no_sync_slowest_rank']}; ranks {rec['ranks_no_sync']}"
                    f" / DDP {rec['ranks_ddp']}); GPU busy "
                    f"{rec['gpu_ms_per_step']} ms/step, NCCL {rec['nccl_ms_per_step']}"
                )
                for k in rec["kernels"]:
                    print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4} {k['name']}")
            if args.out:
                Path(args.out).write_text(json.dumps(records, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
