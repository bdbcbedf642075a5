"""bench/train_small.py's model under data parallelism: DDP and FSDP2, dense and twell.

Launch with torchrun, one process per GPU::

    torchrun --nproc_per_node 2 bench/train_distributed.py --out bench/results/dist.json
    torchrun --nproc_per_node 2 bench/train_distributed.py --smoke --out /tmp/dist.json  # CPU, gloo

For each variant (``dense``: the model as is; ``twell``: ``sparsify``'d MLPs trained with
the L1 penalty and its warm-up, as in train_small.py) the script runs:

1. **one GPU**: every rank trains its own copy of the model alone for
   ``--baseline-steps`` steps, with no communication, at the per-GPU batch (all ranks at
   once, so each measures one GPU of the same machine);
2. for each strategy, from the same initial weights, ``--steps`` steps at the same
   per-GPU batch (each rank draws its own batches):

   - ``ddp``: ``DistributedDataParallel`` (gradients all-reduced in buckets);
   - ``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` on every transformer block
     and on the whole model (parameters, gradients and optimizer state sharded).

Both use bf16 autocast with fp32 parameters (as train_small.py). The report (rank 0
writes ``--out``, JSON) has, per run and rank: the training loss every ``--log-every``
steps, the step times (median after ``--warmup-steps``), tokens/s and peak memory; per
strategy the all-reduced mean loss and the scaling efficiency:
``tokens/s of the whole job / (world size * mean one-GPU tokens/s)``.

``NCCL_NVLS_ENABLE=0`` is set for the job (NVLink SHARP multicast off; see the machines'
notes).
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL starts: no NVLink multicast (NVLS)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import train_small  # noqa: E402  (also puts the repository on sys.path)

STRATEGIES = ("ddp", "fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = train_small.Config()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("train_distributed.json"), help="JSON report")
    p.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(STRATEGIES),
        help="ddp: DistributedDataParallel; fsdp: FSDP2 fully_shard",
    )
    p.add_argument("--variants", nargs="+", choices=("dense", "twell"), default=["dense", "twell"])
    p.add_argument(
        "--smoke", action="store_true", help="tiny CPU run over gloo (2 layers, hidden 64, FFN 256)"
    )
    for field in dataclasses.fields(train_small.Config):
        default = getattr(defaults, field.name)
        p.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=type(default),
            default=None,
            help=f"default {300 if field.name == 'steps' else default}",
        )
    p.add_argument(
        "--baseline-steps",
        type=int,
        default=None,
        help="steps of the one-GPU runs (default: 100, smoke: 5)",
    )
    p.add_argument("--log-every", type=int, default=None, help="default 10 (smoke: 2)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps left out of the timing (default 10, smoke: 1)",
    )
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> train_small.Config:
    config = train_small.Config.smoke() if args.smoke else train_small.Config(steps=300)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(train_small.Config)
        if getattr(args, f.name) is not None
    }
    return dataclasses.replace(config, **overrides)


# ---------------------------------------------------------------------- one run
def optimizer_for(model: Any, config: train_small.Config, *, fused: bool) -> Any:
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=fused or None)


def run(
    strategy: str,
    variant: str,
    config: train_small.Config,
    steps: int,
    data: Any,
    device: Any,
    args: argparse.Namespace,
    rank: int,
) -> dict[str, Any]:
    """Train ``steps`` steps; ``strategy`` is ``"single"``, ``"ddp"`` or ``"fsdp"``.
    Returns this rank's record."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    import twell.torch as twell_torch

    sparse = variant == "twell"
    model = train_small.build_model(config, device, sparse=sparse)  # same weights on all ranks
    inner = model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        inner = model.module
    elif strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # Fused AdamW on plain CUDA tensors; FSDP2's sharded DTensors take the foreach path.
    optimizer = optimizer_for(model, config, fused=device.type == "cuda" and strategy != "fsdp")
    train_data, _ = data
    generator = torch.Generator().manual_seed(config.seed + 1000 * (rank + 1))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, log = [], []
    config_steps = dataclasses.replace(config, steps=steps)  # schedules span this run
    for step in range(steps):
        batch = train_small.random_batch(train_data, config.batch, config.seq, generator)
        batch = batch.to(device, non_blocking=True)
        lr = train_small.lr_at(config_steps, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        coeff = train_small.l1_coeff_at(config_steps, step) if sparse else 0.0
        train_small.synchronize(device)
        t0 = time.perf_counter()
        with train_small.autocast(device):
            logits = model(batch[:, :-1])
        task = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss = task
        if coeff > 0:
            loss = task + coeff * twell_torch.l1_penalty(inner)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_small.synchronize(device)
        times.append(time.perf_counter() - t0)
        if step % args.log_every == 0 or step == steps - 1:
            entry: dict[str, Any] = {"step": step, "loss": float(task.detach()), "lr": lr}
            if strategy != "single":
                mean = task.detach().clone()
                torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
                entry["mean_loss"] = float(mean)
            if sparse:
                entry.update(l1_coeff=coeff, l0=twell_torch.l0_per_layer(inner))
            log.append(entry)
            if not args.quiet and rank == 0:
                print(f"[{strategy}/{variant}] step {step:4d} loss {entry['loss']:.4f}", flush=True)
    timed = times[args.warmup_steps :] or times
    step_time = statistics.median(timed)
    return {
        "rank": rank,
        "train_log": log,
        "step_time_s": {
            "median": step_time,
            "mean": statistics.fmean(timed),
            "min": min(timed),
            "max": max(timed),
            "first": times[0],
        },
        "tokens_per_s": config.batch * config.seq / step_time,
        "peak_memory_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    }


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    config = config_from(args)
    if args.baseline_steps is None:
        args.baseline_steps = 5 if args.smoke else 100
    if args.log_every is None:
        args.log_every = 2 if args.smoke else 10
    if args.warmup_steps is None:
        args.warmup_steps = 1 if args.smoke else 10

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc_per_node 2 " + sys.argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and not args.smoke
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        timeout=datetime.timedelta(minutes=30),
        **({"device_id": device} if use_cuda else {}),
    )
    try:
        train_data, val_data, corpus = train_small.stdlib_corpus()
        data = (train_data, val_data)
        report: dict[str, Any] = {
            "recipe": {
                "config": dataclasses.asdict(config),
                "seed": config.seed,
                "steps": config.steps,
                "baseline_steps": args.baseline_steps,
                "world_size": world,
                "strategies": args.strategies,
                "variants": args.variants,
                "corpus": corpus,
            },
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "torch": torch.__version__,
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "runs": [],
        }
        for variant in args.variants:
            single = run("single", variant, config, args.baseline_steps, data, device, args, rank)
            singles = gather(single, world)
            dist.barrier()
            one_gpu = statistics.fmean(r["tokens_per_s"] for r in singles)
            report["runs"].append(
                {
                    "strategy": "single",
                    "variant": variant,
                    "ranks": singles,
                    "tokens_per_s_per_gpu": one_gpu,
                }
            )
            for strategy in args.strategies:
                record = run(strategy, variant, config, config.steps, data, device, args, rank)
                ranks = gather(record, world)
                # The job's pace is its slowest rank's.
                step_time = max(r["step_time_s"]["median"] for r in ranks)
                total = world * config.batch * config.seq / step_time
                report["runs"].append(
                    {
                        "strategy": strategy,
                        "variant": variant,
                        "ranks": ranks,
                        "step_time_s": step_time,
                        "tokens_per_s": total,
                        "scaling_efficiency": total / (world * one_gpu),
                        "final_mean_loss": ranks[0]["train_log"][-1].get("mean_loss"),
                    }
                )
                if use_cuda:
                    torch.cuda.empty_cache()
                dist.barrier()
        if rank == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
            if not args.quiet:
                for entry in report["runs"]:
                    if entry["strategy"] == "single":
                        print(
                            f"[single/{entry['variant']}] "
                            f"{entry['tokens_per_s_per_gpu']:.0f} tok/s per GPU"
                        )
                    else:
                        print(
                            f"[{entry['strategy']}/{entry['variant']}] "
                            f"step {entry['step_time_s'] * 1e3:.1f} ms, "
                            f"{entry['tokens_per_s']:.0f} tok/s, scaling efficiency "
                            f"{entry['scaling_efficiency']:.2f}, loss {entry['final_mean_loss']}"
                        )
                print(f"report: {args.out}")
            return report
        return None
    finally:
        dist.destroy_process_group()


def gather(record: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every rank's record, in rank order (on every rank)."""
    import torch.distributed as dist

    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    return records


if __name__ == "__main__":
    main()
