"""Models and helpers shared by the torch tests (CPU ones here, GPU ones in tests/gpu/).

Imported by name (``from torch_helpers import ...``): pytest puts ``tests/`` on
``sys.path`` for its conftest. Import torch first (``pytest.importorskip("torch")``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from twell import reference, workloads
from twell.torch import SparseMLP, l1_penalty


class LlamaMLP(nn.Module):
    """The shape of transformers' LlamaMLP (ReLU unless ``act`` says otherwise), without
    depending on transformers."""

    def __init__(self, k: int, n: int, act: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(k, n, bias=False)
        self.up_proj = nn.Linear(k, n, bias=False)
        self.down_proj = nn.Linear(n, k, bias=False)
        self.act_fn = nn.ReLU() if act is None else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Decoder(nn.Module):
    """Residual stack of norm + MLP: enough model around the MLPs for compile tests."""

    def __init__(self, k: int, n: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(k) for _ in range(layers))
        self.mlps = nn.ModuleList(LlamaMLP(k, n) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(norm(x))
        return x


def mlp_from_problem(problem: workloads.Problem, dtype: torch.dtype = torch.float64) -> LlamaMLP:
    """A :class:`LlamaMLP` (on the CPU, in ``dtype``) holding ``problem``'s weights."""
    mlp = LlamaMLP(problem.K, problem.N).to(dtype)
    with torch.no_grad():
        for layer, weight in ((mlp.gate_proj, problem.w_gate), (mlp.up_proj, problem.w_up),
                              (mlp.down_proj, problem.w_down)):  # fmt: skip
            layer.weight.copy_(torch.from_numpy(weight.astype(np.float64)))
    return mlp


def cuda_mlp(problem: workloads.Problem, dtype: torch.dtype, reduction: str) -> SparseMLP:
    """A :class:`SparseMLP` on CUDA in ``dtype`` holding ``problem``'s weights."""
    mlp = mlp_from_problem(problem, torch.float32).cuda().to(dtype)
    # the training kernels under test: never the dense switch's torch math
    return SparseMLP.from_module(mlp, reduction=reduction, density_switch=False)


def grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``x``'s gradient, then the gradients of ``module``'s parameters."""
    return [x.grad] + [p.grad for p in module.parameters()]


def op_args(dtype: torch.dtype, gated: bool, m: int = 40, k: int = 48, n: int = 256) -> tuple:
    """``(x, w_gate, w_up, w_down)`` for the training ops (CPU, requiring gradients;
    ``w_gate`` None when not ``gated``), drawn from a seed of the shape."""
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, dtype=dtype, generator=g, requires_grad=True)
    w_gate = torch.randn(n, k, dtype=dtype, generator=g) / k**0.5 if gated else None
    w_up = torch.randn(n, k, dtype=dtype, generator=g) / k**0.5
    w_down = torch.randn(k, n, dtype=dtype, generator=g) / n**0.5
    weights = [None if w is None else w.requires_grad_() for w in (w_gate, w_up, w_down)]
    return (x, *weights)


def reference_grads(problem: workloads.Problem, x: np.ndarray, dy: np.ndarray, coeff: float,
                    reduction: str) -> tuple:  # fmt: skip
    """The float64 reference gradients of ``problem``'s block at ``x``."""
    _, wg, wu, wd = problem.arrays()
    return reference.ffn_backward(x, wg, wu, wd, dy, coeff, reduction=reduction)


def train_step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, coeff: float) -> None:
    """Forward and backward of ``<dy, model(x)> + coeff * l1_penalty(model)``."""
    y = model(x)
    loss = (y.float() * dy).sum()
    if coeff:
        loss = loss + coeff * l1_penalty(model)
    loss.backward()


def tensors(problem: workloads.Problem) -> list[torch.Tensor | None]:
    """``problem.arrays()`` as CUDA bf16 tensors (None stays None)."""
    return [None if a is None else torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
            for a in problem.arrays()]  # fmt: skip


def as_f64(t: torch.Tensor) -> np.ndarray:
    """``t`` as a float64 NumPy array on the host."""
    return t.float().cpu().numpy().astype(np.float64)
