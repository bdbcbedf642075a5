"""Where a training step of bench/train_small.py's model spends its time, dense and twell.

Trains the twell variant for ``--steps`` steps with a strong L1 coefficient (so that the
MLPs become sparse quickly), then profiles ``--profile-steps`` steps of each variant with
``torch.profiler`` and prints the kernels by GPU time, the host time per step, and the
training forward/backward ops' share. Writes ``--out`` (JSON).

    PYTHONPATH=. python bench/profile_train.py --out $OUT/profile_train.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
import train_small  # noqa: E402

import twell.torch as twell_torch  # noqa: E402


def step_fn(model: Any, optimizer: Any, data: torch.Tensor, gen: Any, config: Any,
            coeff: float, sparse: bool, runner: Any = None) -> dict[str, float]:  # fmt: skip
    batch = train_small.random_batch(data, config.batch, config.seq, gen).cuda(non_blocking=True)
    if runner is not None:
        runner(batch, coeff)
    else:
        with train_small.autocast(torch.device("cuda")):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        if sparse and coeff > 0:
            loss = loss + coeff * twell_torch.l1_penalty(model)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    if runner is None:
        optimizer.zero_grad(set_to_none=True)
    return {}


def run(variant: str, config: Any, data: torch.Tensor, args: argparse.Namespace) -> dict:
    """One variant: ``dense``, ``twell``, or ``twell_op_graphs`` (SparseMLP's training
    ops replaying their own CUDA graphs in eager steps)."""
    sparse = variant.startswith("twell")
    if variant == "twell_op_graphs":
        config = dataclasses.replace(config, op_graphs=True)
    model = train_small.build_model(config, torch.device("cuda"), sparse=sparse)
    optimizer = train_small.make_optimizer(model, config)
    gen = torch.Generator().manual_seed(config.seed)
    rec: dict[str, Any] = {"variant": variant}
    t0 = time.perf_counter()
    for _ in range(args.steps if sparse else 10):
        step_fn(model, optimizer, data, gen, config, args.l1 if sparse else 0.0, sparse)
    torch.cuda.synchronize()
    rec["train_s"] = time.perf_counter() - t0
    if sparse:
        rec["l0"] = [round(v, 1) for v in twell_torch.l0_per_layer(model)]
    times = []
    for _ in range(args.timed_steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step_fn(model, optimizer, data, gen, config, args.l1, sparse)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    rec["step_ms"] = round(statistics.median(times) * 1e3, 2)
    if args.graphs:
        sample = train_small.random_batch(data, config.batch, config.seq, gen).cuda()
        runner = train_small.GraphedStep(model, sparse, sample)
        times = []
        for _ in range(args.timed_steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step_fn(model, optimizer, data, gen, config, args.l1, sparse, runner)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rec["graphed_step_ms"] = round(statistics.median(times) * 1e3, 2)
        print(f"== {variant}: graphed step {rec['graphed_step_ms']} ms")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            step_fn(model, optimizer, data, gen, config, args.l1, sparse)
        torch.cuda.synchronize()
    events = prof.key_averages()
    n = args.profile_steps
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: -e.self_device_time_total,
    )
    gpu_total = sum(e.self_device_time_total for e in kernels) / n / 1e3
    rec["gpu_ms_per_step"] = round(gpu_total, 2)
    rec["kernels"] = [
        {"name": e.key[:90], "ms_per_step": round(e.self_device_time_total / n / 1e3, 3),
         "calls_per_step": e.count // n}
        for e in kernels[: args.top]
    ]  # fmt: skip
    cpu = sorted(
        (e for e in events if e.key.startswith(("twell::", "aten::", "autograd"))),
        key=lambda e: -e.cpu_time_total,
    )
    rec["cpu_ops"] = [
        {"name": e.key[:90], "cpu_ms_per_step": round(e.cpu_time_total / n / 1e3, 3),
         "calls_per_step": e.count // n}
        for e in cpu[:20]
    ]  # fmt: skip
    if variant == "twell_op_graphs":
        from twell import autograd

        graphs = autograd._FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS
        rec["op_graphs"] = {"captures": [g.captures for g in graphs],
                            "replays": [g.replays for g in graphs]}  # fmt: skip
        print(f"== {variant}: op graphs {rec['op_graphs']}")
    print(f"== {variant}: step {rec['step_ms']} ms, GPU busy {rec['gpu_ms_per_step']} ms/step"
          f"{'  L0 ' + str(rec['l0']) if sparse else ''}")  # fmt: skip
    for k in rec["kernels"]:
        print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4} {k['name']}")
    for k in rec["cpu_ops"][:12]:
        print(f"  cpu {k['cpu_ms_per_step']:8.3f} ms  x{k['calls_per_step']:<4} {k['name']}")
    return rec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300, help="twell training steps first")
    p.add_argument("--l1", type=float, default=1e-4)
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--variants", nargs="+", default=["dense", "twell"])
    p.add_argument("--graphs", action="store_true", help="also time graph-replayed steps")
    p.add_argument("--out", default="profile_train.json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    config = dataclasses.replace(train_small.Config(), l1_warmup=0.0)
    train_data, _, _ = train_small.stdlib_corpus()
    out = {"device": torch.cuda.get_device_name(), "runs": []}
    for variant in args.variants:
        out["runs"].append(run(variant, config, train_data, args))
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
