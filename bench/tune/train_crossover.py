"""Probe of where a training call's sparse kernels stop paying (``density.TRAIN_CROSSOVER``,
read by twell.capacity.TrainSwitch): at K=2048, N=5632 and each batch size of the table,
a ``SparseMLP``'s forward + backward (the L1 term's gradient included, default options,
bf16 weights) on twell's training ops and on its dense torch math (``train_kernels=False``,
what the switch runs), at densities around the crossover in force; the crossover is the
density at which the two GPU times meet.

The tokens are ``uniform`` at density p: ``x ~ N(1, 1)`` and the gate's rows shifted so
that a share p of the pre-activations is positive. Each time is of back-to-back steps
behind a busy wait (GPU time, the host's launches hidden), so that a host-bound batch
does not set a density threshold. The training ops' output is checked against the dense
math's first.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import nn

from bench.tune.common import Context, K, N, ProbeError, crossing
from twell import autograd
from twell.torch import SparseMLP

#: The batch sizes of the table.
SIZES = (4096, 16384)
#: Densities measured, as multiples of the crossover in force at the size.
AROUND = (0.6, 1.2)
AROUND_FULL = (0.6, 0.9, 1.2, 1.8)
#: Steps a time is the mean of, and the rounds whose median is taken.
STEPS, ROUNDS = 5, 3
#: Largest relative difference of the output between the training ops and dense math.
TOLERANCE = 2e-2


def _layers(p: float) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    """bf16 gate/up/down layers whose gate fires for a share ``p`` of ``x ~ N(1, 1)``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    std = 0.02 * math.sqrt(2 * K)  # of a pre-activation, about
    shift = -statistics.NormalDist().inv_cdf(p) * std / K
    layers = []
    for rows, cols, offset in ((N, K, shift), (N, K, 0.0), (K, N, 0.0)):
        layer = nn.Linear(cols, rows, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            w = torch.randn(rows, cols, device="cuda", generator=g) * 0.02 - offset
            layer.weight.copy_(w)
        layers.append(layer)
    return layers[0], layers[1], layers[2]


def _gpu_ms(module: SparseMLP, x: Any, dy: Any) -> float:
    coeff = torch.tensor(1e-4, device="cuda")
    weights = list(module.parameters())

    def step() -> None:
        y = module(x)
        torch.autograd.backward([y, module.l1], [dy, coeff])
        x.grad = None
        for w in weights:
            w.grad = None

    for _ in range(8):  # op graphs captured, the capacity settled
        step()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # the host queues the steps behind it
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / STEPS)
    return statistics.median(times)


def _time(m: int, p: float, ctx: Context) -> tuple[float, float]:
    """(training ops, dense math) GPU ms of a step of ``m`` tokens at density ``p``."""
    gate, up, down = _layers(p)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(m, K, device="cuda", generator=g) + 1).to(torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16)
    sparse = SparseMLP(gate, up, down, density_switch=False)
    dense = SparseMLP(gate, up, down, train_kernels=False)
    y_sparse, y_dense = sparse(x).detach().float(), dense(x).detach().float()
    err = float((y_sparse - y_dense).norm() / y_dense.norm().clamp_min(1e-30))
    if not err <= TOLERANCE:
        raise ProbeError(f"training ops, M={m}, p={p:.4g}: relative error {err:.3g}")
    t_sparse, t_dense = _gpu_ms(sparse, x, dy), _gpu_ms(dense, x, dy)
    autograd.release_op_graphs()
    ctx.log(f"  M={m:<6} p={p:<8.4g} training ops {t_sparse:8.3f} ms   dense {t_dense:8.3f} ms")
    return t_sparse, t_dense


def measure(ctx: Context) -> dict[str, tuple[Any, dict]]:
    from twell.kernels.density import interpolate

    table = ctx.values["density.TRAIN_CROSSOVER"]
    around = AROUND if ctx.quick else AROUND_FULL
    points, rows, guessed = [], [], []
    for m in SIZES:
        guess = interpolate(table, m)
        ps = sorted({min(0.5, guess * a) for a in around})
        timed = [_time(m, p, ctx) for p in ps]
        # the dense math's time hardly moves with p: its mean is the reference
        t_dense = statistics.fmean(d for _, d in timed)
        p, extrapolated = crossing(ps, [s for s, _ in timed], t_dense)
        points.append([m, round(p, 4)])
        if extrapolated:
            guessed.append(m)
        rows.append({"M": m, "p": [round(q, 5) for q in ps],
                     "training_ops_ms": [round(s, 3) for s, _ in timed],
                     "dense_ms": [round(d, 3) for _, d in timed]})  # fmt: skip
    data = {
        "how": "K=2048, N=5632, SparseMLP forward + backward (L1 term included), default "
        "options, bf16 weights, uniform at density p, against the same layer with "
        "train_kernels=False; GPU time of back-to-back steps behind a busy wait",
        "extrapolated_at_M": guessed,
        "measured": rows,
    }
    return {"density.TRAIN_CROSSOVER": (points, data)}
