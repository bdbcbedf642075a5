"""PyTorch integration: a drop-in sparse MLP for Llama-style models.

A Llama-style MLP computes ``down_proj(act(gate_proj(x)) * up_proj(x))``; with ``act``
ReLU that is twell's gated block. :class:`SparseMLP` wraps the three ``nn.Linear``
modules (sharing their parameters, no copy) and :func:`sparsify` swaps every such MLP of
a model in place::

    model = transformers.LlamaForCausalLM(config_with_relu).cuda().bfloat16()
    twell.torch.sparsify(model)          # returns how many MLPs were replaced
    with torch.inference_mode():
        logits = model(input_ids).logits

What runs where:

- CUDA tensors with autograd not recording (``torch.no_grad()``/``inference_mode()``):
  twell's GPU kernels, through a :class:`twell.SparseFFN` prepared on first use and
  rebuilt whenever a weight changes (tracked by the tensors' version counters).
- Anything else — CPU tensors, or a forward whose gradients are needed — runs the same
  block in dense torch math. twell's training kernels are not built yet; the dense path
  keeps results and gradients right meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from twell.ops import SparseFFN
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE, Options

__all__ = ["SparseMLP", "is_relu_mlp", "sparsify"]


def _is_relu(act: Any) -> bool:
    return isinstance(act, nn.ReLU) or act in (torch.relu, torch.nn.functional.relu)


def is_relu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style MLP (``gate_proj``, ``up_proj``, ``down_proj``
    linear layers without bias) whose activation ``act_fn`` is ReLU."""
    layers = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers):
        return False
    return _is_relu(getattr(module, "act_fn", None))


class SparseMLP(nn.Module):
    """``down_proj(relu(gate_proj(x)) * up_proj(x))`` on twell's kernels.

    Args:
        gate_proj, up_proj: ``nn.Linear(K, N, bias=False)``.
        down_proj: ``nn.Linear(N, K, bias=False)``.
        tile, slots: TwELL geometry of the hidden activation (``N % tile == 0``).
        dense_capacity: see :class:`twell.SparseFFN` (fraction of tokens whose heavy rows
            go through fixed-size cuBLAS GEMMs).

    Raises:
        TypeError: a layer is not an ``nn.Linear``.
        ValueError: a layer has a bias, the shapes do not chain, or ``dense_capacity`` is
            not in [0, 1].
    """

    def __init__(
        self,
        gate_proj: nn.Linear,
        up_proj: nn.Linear,
        down_proj: nn.Linear,
        *,
        tile: int = DEFAULT_TILE,
        slots: int = DEFAULT_SLOTS,
        dense_capacity: float = 0.0,
    ) -> None:
        super().__init__()
        for name, layer in (
            ("gate_proj", gate_proj),
            ("up_proj", up_proj),
            ("down_proj", down_proj),
        ):
            if not isinstance(layer, nn.Linear):
                raise TypeError(f"{name}: expected an nn.Linear, got {type(layer).__name__}")
            if layer.bias is not None:
                raise ValueError(f"{name}: twell's block has no bias; got a Linear with bias")
        n, k = gate_proj.weight.shape
        if tuple(up_proj.weight.shape) != (n, k) or tuple(down_proj.weight.shape) != (k, n):
            raise ValueError(
                f"expected gate_proj/up_proj [N, K] and down_proj [K, N]; got "
                f"{tuple(gate_proj.weight.shape)}, {tuple(up_proj.weight.shape)}, "
                f"{tuple(down_proj.weight.shape)}"
            )
        self.options = Options(tile, slots, dense_capacity=dense_capacity)
        if n % self.options.tile:
            raise ValueError(f"gate_proj: N={n} is not a multiple of tile={tile}")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self._block: SparseFFN | None = None
        self._block_key: tuple | None = None

    @classmethod
    def from_module(cls, mlp: nn.Module, **kwargs: Any) -> SparseMLP:
        """Wrap a Llama-style MLP (see :func:`is_relu_mlp`), sharing its parameters.

        Raises:
            ValueError: ``mlp`` is not a bias-free gate/up/down MLP with ReLU activation.
        """
        if not is_relu_mlp(mlp):
            act = getattr(mlp, "act_fn", None)
            raise ValueError(
                "mlp: expected gate_proj/up_proj/down_proj nn.Linear layers without bias and "
                f"act_fn ReLU (set hidden_act='relu'); got {type(mlp).__name__} with "
                f"act_fn {type(act).__name__}"
            )
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, **kwargs)

    def extra_repr(self) -> str:
        n, k = self.gate_proj.weight.shape
        return f"K={k}, N={n}, tile={self.options.tile}, slots={self.options.slots}"

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def prepared(self) -> SparseFFN:
        """The :class:`twell.SparseFFN` of the current weights (rebuilt after a change)."""
        weights = self._weights()
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
        if self._block is None or key != self._block_key:
            o = self.options
            self._block = SparseFFN(
                *(w.detach() for w in weights), tile=o.tile, slots=o.slots, path=o.path,
                max_row_nnz=o.max_row_nnz, dense_capacity=o.dense_capacity,
                density_switch=o.density_switch,
            )  # fmt: skip
            self._block_key = key
        return self._block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x [..., K]``."""
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(w.requires_grad for w in self._weights())
        )
        if x.is_cuda and not needs_grad:
            return self.prepared()(x.contiguous())
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


def sparsify(
    model: nn.Module,
    *,
    tile: int = DEFAULT_TILE,
    slots: int = DEFAULT_SLOTS,
    dense_capacity: float = 0.0,
) -> int:
    """Replace every Llama-style ReLU MLP inside ``model`` by a :class:`SparseMLP`.

    Parameters are shared, not copied. MLPs with another activation are left alone.
    ``tile``, ``slots`` and ``dense_capacity`` go to every :class:`SparseMLP`.

    Returns:
        The number of MLPs replaced.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if not isinstance(child, SparseMLP) and is_relu_mlp(child)
    ]
    for parent, name, child in targets:
        replacement = SparseMLP.from_module(
            child, tile=tile, slots=slots, dense_capacity=dense_capacity
        )
        setattr(parent, name, replacement)
    return len(targets)
