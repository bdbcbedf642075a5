"""PyTorch integration: a drop-in sparse MLP for Llama-style models.

A Llama-style MLP computes ``down_proj(act(gate_proj(x)) * up_proj(x))``; with ``act``
ReLU that is twell's gated block. :class:`SparseMLP` wraps the three ``nn.Linear``
modules (sharing their parameters, no copy: the state dict keeps the names
``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight`` and their layouts) and
:func:`sparsify` swaps every such MLP of a model in place::

    model = transformers.LlamaForCausalLM(config_with_relu).cuda().bfloat16()
    twell.torch.sparsify(model)          # returns how many MLPs were replaced
    with torch.inference_mode():
        logits = model(input_ids).logits

What runs where:

- No gradient needed (``torch.no_grad()``/``inference_mode()``): the op ``twell::ffn``
  (:mod:`twell.inference`): on CUDA the GPU kernels, through a block prepared on first
  use and rebuilt whenever a weight changes (tracked by the tensors' version counters);
  on CPU the float64 NumPy reference.
- Gradients needed (training), ``train_kernels=True`` (the default): the custom ops
  ``twell::ffn_train_forward`` / ``twell::ffn_train_backward`` (:mod:`twell.autograd`):
  the GPU kernels for CUDA tensors, the float64 NumPy reference for CPU tensors. Eager
  CUDA calls run the same implementations without the dispatcher, and replay op graphs
  for batches up to :data:`OP_GRAPH_TOKENS` tokens (``op_graphs``). The backward keeps
  only the compressed activations (TwELL words, heavy-row ids, and the gated block's up
  products of the active units, 4 bytes each). ``train_kernels=False``: dense torch
  math.

Every path is one opaque op to ``torch.compile`` (``fullgraph=True`` in every mode,
CUDA graphs included, as transformers' static-cache ``generate`` uses them): dynamo never
traces twell's launch code.

Training with the L1 penalty: every forward that records gradients leaves the layer's
L1 term in ``mlp.l1`` (a differentiable float32 scalar) and its L0 in ``mlp.l0`` (mean
active units per token, no gradient)::

    y = model(x)
    loss = task_loss(y) + coeff * twell.torch.l1_penalty(model)   # sum of the layers' l1
    loss.backward()

Once the backward pass has reached the layer (the gradient of its output or of its L1
term is computed), ``mlp.l1`` is replaced by its detached value: the attribute would
otherwise keep the whole step's autograd graph alive until the next forward, and with it
the parameters' gradient accumulators, which torch reuses from step to step together
with the CUDA stream they were made on; a later CUDA-graph capture then fails
(``cudaErrorStreamCaptureImplicit``) when those were made on the legacy default stream.
So a term meant for a second, separate backward pass must be taken (``l1_penalty``)
before the first. Under ``torch.compile`` no hook is registered (the term stays
attached until the next forward).

Mixed precision: under ``torch.autocast`` the block's input is cast to the autocast
dtype; fp32 (master) weights go to the op as they are, the kernels round them to bf16
and their gradients come back in fp32.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from typing import Any

from twell._optional import optional_dependency

with optional_dependency("torch", "twell.torch"):
    import torch
    from torch import nn

from twell import inference  # noqa: E402 - after torch
from twell._validation import check_floating  # noqa: E402
from twell.autograd import REDUCTIONS, _ffn_train  # noqa: E402
from twell.capacity import AutoCapacity, TrainSwitch  # noqa: E402
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE, Options  # noqa: E402

__all__ = ["SparseMLP", "is_relu_mlp", "l0_per_layer", "l1_penalty", "sparsify"]

#: Largest batch (tokens) whose eager training calls replay op graphs by default
#: (``SparseMLP(op_graphs=None)``): up to it the host's ~40 launches per op set the
#: time; above, the GPU work hides them and the graphs' copies would only cost.
OP_GRAPH_TOKENS = 16384


def _is_relu(act: Any) -> bool:
    return isinstance(act, nn.ReLU) or act in (torch.relu, torch.nn.functional.relu)


#: The linear layers of a Llama-style MLP.
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_relu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style MLP (``gate_proj``, ``up_proj``, ``down_proj``
    linear layers without bias) whose activation ``act_fn`` is ReLU."""
    layers = [getattr(module, name, None) for name in _PROJECTIONS]
    if not all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers):
        return False
    return _is_relu(getattr(module, "act_fn", None))


class SparseMLP(nn.Module):
    """``down_proj(relu(gate_proj(x)) * up_proj(x))`` on twell's kernels.

    Args:
        gate_proj, up_proj: ``nn.Linear(K, N, bias=False)``.
        down_proj: ``nn.Linear(N, K, bias=False)``.
        tile, slots: TwELL geometry of the hidden activation (``N % tile == 0``).
        dense_capacity: ``"auto"`` (default) or a fraction of tokens whose heavy rows go
            through fixed-size cuBLAS GEMMs (see :class:`twell.SparseFFN`). ``"auto"``:
            each training call on CUDA takes the capacity that an earlier call's
            heavy-row count asks for (:class:`twell.capacity.AutoCapacity`, read without
            a host synchronisation; 0 while no heavy rows were seen), so a layer whose
            tokens are still dense early in sparsity training runs its heavy rows at
            cuBLAS speed; inside a CUDA-graph capture of the caller's own it means 0, and
            under ``torch.compile`` the ops choose it the same way from the layer's
            :func:`twell.capacity.for_weights`. Inference takes :class:`twell.SparseFFN`'s
            ``"auto"`` (from the density switch's heavy-row share). The bits then depend
            on the choices (reruns from the same start repeat them).
        train_kernels: run forwards that record gradients through twell's training ops
            (GPU kernels on CUDA, the NumPy reference on CPU); False: dense torch math.
        reduction: the L1 term's reduction, ``"mean"`` (mean of ``|h|`` over the M·N
            entries) or ``"per_token"`` (sum over units, mean over tokens).
        op_graphs: whether training calls on CUDA replay a CUDA graph of the ops'
            launches (from the second call with the same batch shape and weights on),
            eagerly and in code ``torch.compile`` compiled without CUDA graphs of its
            own: a replay costs the host about one launch instead of ~40; ``x`` and
            ``dy`` are copied into the graph's buffers; ``y`` (bf16 ``x``), and ``dx``
            and the weight gradients (bf16 ``x`` and weights) come back in the graph's
            own tensors, written again only once nothing holds them (other dtypes get
            copies). None (default): on for batches of at most :data:`OP_GRAPH_TOKENS`
            tokens, where the host's launches would otherwise set the step's time.
            Memory: each layer's graphs keep their buffers, the activations the
            forward lends the backward, the tensors they hand outputs over in and
            their scratch per batch shape, until
            :func:`twell.autograd.release_op_graphs` (deleting the model does not free
            them; :func:`twell.autograd.op_graph_memory` counts them).
            Replays of one op must not run on two streams at once
            (:class:`twell._graphs.OpGraphs`). No effect inside a CUDA graph capture of
            the caller's own (``reduce-overhead`` included).
        density_switch: switch to dense math where the layer is too dense for the
            sparse kernels to pay. Inference: :class:`twell.SparseFFN`'s switch (the
            batch from the statistics of the calls before, a row by its own count).
            Training calls on CUDA (eager): :class:`twell.capacity.TrainSwitch`, which
            runs the layer's dense torch math (as ``train_kernels=False``) while its
            earlier calls' mean active units per token were above about 1.5% of N,
            where the training ops cost the GPU more than dense math. False: always the
            training ops.

    Attributes:
        l1: after a forward that records gradients, the L1 term of its hidden
            activation (differentiable float32 scalar) until the backward pass reaches
            the layer's output or this term, then its detached value (outside
            ``torch.compile``, see the module docstring); None after a forward without
            gradients.
        l0: likewise, the mean number of active units per token (float32 scalar tensor,
            no gradient); None after a forward without gradients.

    Raises:
        TypeError: a layer is not an ``nn.Linear``.
        ValueError: a layer has a bias, the shapes do not chain, ``dense_capacity`` is
            not in [0, 1], or ``reduction`` is unknown.
    """

    _recent: inference.Recent | None = None  # (a module pickled without one: none)

    def __init__(
        self,
        gate_proj: nn.Linear,
        up_proj: nn.Linear,
        down_proj: nn.Linear,
        *,
        tile: int = DEFAULT_TILE,
        slots: int = DEFAULT_SLOTS,
        dense_capacity: float | str = "auto",
        train_kernels: bool = True,
        reduction: str = "mean",
        op_graphs: bool | None = None,
        density_switch: bool = True,
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
        if not isinstance(density_switch, bool):
            raise TypeError(f"density_switch: expected a bool, got {type(density_switch).__name__}")
        self.options = Options(
            tile, slots, dense_capacity=dense_capacity, density_switch=density_switch
        )
        self._auto = AutoCapacity() if self.options.auto_capacity else None
        self._switch = TrainSwitch() if density_switch else None
        self._auto_options: dict[tuple[Options, float], Options] = {}
        if n % self.options.tile:
            fits = [t for t in (256, 128, 64, 32) if n % t == 0 and t >= self.options.slots]
            hint = (
                f"tile={fits[0]} fits (SparseMLP(..., tile=...) or sparsify(model, tile=...))"
                if fits
                else f"no tile of at least slots={self.options.slots} divides it (tiles are "
                "32-256; the kernels need N to be a multiple of 32)"
            )  # fmt: skip
            raise ValueError(f"gate_proj: N={n} is not a multiple of tile={tile}; {hint}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if op_graphs is not None and not isinstance(op_graphs, bool):
            raise TypeError(f"op_graphs: expected a bool or None, got {type(op_graphs).__name__}")
        self.train_kernels = bool(train_kernels)
        self.reduction = reduction
        self.op_graphs = op_graphs
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.l1: torch.Tensor | None = None
        self.l0: torch.Tensor | None = None
        # The inference op's trailing arguments (constants for torch.compile).
        self._arguments = inference.op_arguments(self.options)
        self._recent = inference.Recent()  # the last eager inference call's block

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
        return (
            f"K={k}, N={n}, tile={self.options.tile}, slots={self.options.slots}, "
            f"dense_capacity={'auto' if self._auto else self.options.dense_capacity!r}, "
            f"train_kernels={self.train_kernels}, reduction={self.reduction!r}, "
            f"density_switch={self._switch is not None}"
        )

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def prepared(self) -> Any:
        """The prepared inference block of the current CUDA weights (twell.inference's
        registry: rebuilt after a weight changed in place).

        A change is seen through the weights' version counters; the block is also
        dropped by every training forward and every ``train()``/``eval()`` switch:
        optimizers that write parameters without moving their version counter (writes
        through ``.data``) would otherwise leave a stale block behind.
        """
        return inference.block_for(*self._weights(), self.options)

    def _forget(self) -> None:
        if self._recent is not None:
            self._recent.clear()
        w = self._weights()
        if w[1].is_cuda:
            inference.forget(*w)

    def train(self, mode: bool = True) -> SparseMLP:
        """``nn.Module.train``; also drops the prepared inference block (see
        :meth:`prepared`)."""
        self._forget()
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x [..., K]``; sets :attr:`l1` and :attr:`l0`."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        weights = self._weights()
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(w.requires_grad for w in weights)
        )
        if not needs_grad:
            if self.l1 is not None or self.l0 is not None:  # (nn.Module's setattr is slow)
                self.l1 = self.l0 = None
            return inference.ffn(x, *weights, self.options, self._arguments, self._recent)
        compiling = torch.compiler.is_compiling()
        if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
            # The op sees the autocast dtype for x; fp32 master weights go in as they are
            # (the kernels round them to bf16; their gradients come back in fp32). A
            # non-floating x is refused, not cast.
            check_floating(x=x)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if not compiling:
            self._forget()  # the weights are about to change: no stale inference block
        # A forward run again inside a backward pass (activation checkpointing recomputes
        # it there) must take the path and capacity the first run took, which saved
        # tensors of that shape: it reads and records nothing.
        again = not compiling and torch._C._current_graph_task_id() != -1
        switch = self._switch if x.is_cuda and not compiling and self.train_kernels else None
        dense = switch is not None and (switch.current() if again else switch.choose())
        if dense and self._auto is not None and not again:
            self._auto.reset()  # its counts are of a denser past: none when back on the ops
        if self.train_kernels and not dense:
            auto = self._auto if x.is_cuda and not compiling else None
            fraction = None if auto is None else auto.current() if again else auto.choose()
            options = self.options if auto is None else self._options_at(fraction)
            y, l1, l0, count, stats = _ffn_train(
                x, *weights, options, self.reduction, self._graphs(x)
            )
            if switch is None and auto is not None and not again:
                auto.record(count, x.numel() // x.shape[-1])
        else:
            check_floating(x=x)  # as the ops do: a TypeError before any math
            y, l1, l0 = self._dense(x)
            stats = None
        if switch is not None and not again:
            # One host copy carries the L0 and the heavy-row count (the switch hands the
            # count to "auto"): every call's values then land in one queue, in call order.
            m, n = x.numel() // x.shape[-1], weights[1].shape[0]
            if stats is not None:
                switch.record(stats, m, n, auto)
            else:  # dense math: an L0 alone
                switch.record(l0, m, n)
        if compiling:
            self.l1, self.l0 = l1, l0
        else:  # (plain attributes: nn.Module's __setattr__ costs microseconds a call)
            self.__dict__["l1"], self.__dict__["l0"] = l1, l0
        if y.requires_grad and not compiling:
            hook = _detach_l1_hook(self, l1)
            y.register_hook(hook)  # the task loss's backward reaches the layer
            if l1.requires_grad:
                l1.register_hook(hook)  # or a backward of the L1 term alone does
        return y

    def _graphs(self, x: torch.Tensor) -> bool:
        """Whether this training call replays op graphs (``op_graphs``; None: on CUDA for
        batches of at most :data:`OP_GRAPH_TOKENS` tokens, where the host's launches
        would otherwise set the time)."""
        if self.op_graphs is not None:
            return self.op_graphs
        return x.is_cuda and x.numel() // x.shape[-1] <= OP_GRAPH_TOKENS

    def _options_at(self, fraction: float) -> Options:
        """``self.options`` with dense capacity ``fraction`` (cached per value)."""
        o = self.options
        found = self._auto_options.get((o, fraction))
        if found is None:
            found = dataclasses.replace(o, dense_capacity=fraction)
            self._auto_options[(o, fraction)] = found
        return found

    def _dense(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense torch math: ``(y, l1, l0)`` as the training op defines them."""
        pre = self.gate_proj(x)
        h = torch.relu(pre) * self.up_proj(x)
        m = max(1, h.numel() // h.shape[-1])
        total = h.abs().sum(dtype=torch.float32)
        l1 = total / (m * h.shape[-1]) if self.reduction == "mean" else total / m
        l0 = (pre.detach() > 0).sum(dtype=torch.float32) / m
        return self.down_proj(h), l1, l0


def _detach_l1_hook(mlp: SparseMLP, l1: torch.Tensor) -> Any:
    """A gradient hook for the layer's output that swaps ``mlp.l1`` (while it still is
    ``l1``) for its detached value. Weak references only: the hook lives in the autograd
    graph, which must not keep the module or ``l1`` alive."""
    mlp_ref, l1_ref = weakref.ref(mlp), weakref.ref(l1)

    def hook(grad: torch.Tensor) -> None:
        module, term = mlp_ref(), l1_ref()
        if module is not None and term is not None and module.l1 is term:
            module.__dict__["l1"] = term.detach()

    return hook


def _sparse_mlps(model: nn.Module, caller: str) -> list[SparseMLP]:
    """The :class:`SparseMLP` layers of ``model``; ``ValueError`` when it holds none (a
    penalty of 0.0 would quietly drop the regulariser from a training loss)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: expected a torch.nn.Module, got {type(model).__name__}")
    mlps = [m for m in model.modules() if isinstance(m, SparseMLP)]
    if not mlps:
        raise ValueError(
            f"{caller}: the model holds no SparseMLP (not sparsified, or "
            "twell.torch.sparsify(model) replaced none: a transformers model needs "
            "hidden_act='relu' in its config)"
        )
    return mlps


#: ``l1_penalty`` warned about a missing L1 term (once per process).
_warned_no_l1 = [False]


def l1_penalty(model: nn.Module) -> torch.Tensor | float:
    """The sum of the L1 terms (:attr:`SparseMLP.l1`) that the last forward of ``model``
    left in its :class:`SparseMLP` layers.

    0.0 when none did: under ``torch.no_grad()`` (an evaluation, whose forward clears
    them) silently; with gradients on (a training step that asks before its forward,
    or after an inference forward) with a ``UserWarning``, once per process.

    Raises:
        ValueError: ``model`` holds no :class:`SparseMLP`.
    """
    terms = [m.l1 for m in _sparse_mlps(model, "l1_penalty") if m.l1 is not None]
    if not terms:
        if (
            torch.is_grad_enabled()
            and not _warned_no_l1[0]
            and not torch.compiler.is_compiling()  # (dynamo cannot trace a warning)
        ):
            _warned_no_l1[0] = True
            warnings.warn(
                "twell: l1_penalty found no L1 term in the model's SparseMLPs: a forward "
                "sets them when it needs gradients (an input or a weight that requires "
                "them, outside torch.no_grad(), which reentrant activation checkpointing "
                "uses) and an inference forward clears them; take the penalty after the "
                "training forward (shown once per process)",
                stacklevel=2,
            )
        return 0.0
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def l0_per_layer(model: nn.Module) -> list[float]:
    """The L0 (mean active units per token) of each :class:`SparseMLP` of ``model`` at
    its last forward with gradients, in module order (reads them on the host); layers
    with no such forward since their last inference one are left out.

    Raises:
        ValueError: ``model`` holds no :class:`SparseMLP`.
    """
    return [float(m.l0) for m in _sparse_mlps(model, "l0_per_layer") if m.l0 is not None]


#: The keyword arguments of :class:`SparseMLP` (what :func:`sparsify` passes on).
_SPARSE_MLP_OPTIONS = frozenset(
    name
    for name, parameter in inspect.signature(SparseMLP).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
)


def sparsify(model: nn.Module, **options: Any) -> int:
    """Replace every Llama-style ReLU MLP inside ``model`` by a :class:`SparseMLP`.

    Parameters are shared, not copied, and the state dict keeps its keys. MLPs with
    another activation or with biases are left alone; a model with none to replace and
    none replaced before gets a :class:`UserWarning` saying why (a transformers model
    needs ``hidden_act="relu"`` in its config).

    Args:
        model: the model, changed in place.
        **options: :class:`SparseMLP`'s keyword arguments, given to every layer:
            ``tile`` (default 256), ``slots`` (32), ``dense_capacity`` (``"auto"``),
            ``train_kernels`` (True), ``reduction`` (``"mean"``), ``op_graphs`` (None),
            ``density_switch`` (True).

    Returns:
        The number of MLPs replaced.

    Raises:
        TypeError: an option :class:`SparseMLP` does not take (even when no MLP is
            replaced).
        ValueError: an option value :class:`SparseMLP` refuses, or an MLP the options
            do not fit (``N`` not a multiple of ``tile``), named by the path in
            ``model`` of the layer being built; nothing is replaced then.
    """
    unknown = sorted(set(options) - _SPARSE_MLP_OPTIONS)
    if unknown:
        raise TypeError(
            f"sparsify: unexpected option(s) {', '.join(unknown)}; SparseMLP takes "
            f"{', '.join(sorted(_SPARSE_MLP_OPTIONS))}"
        )
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if not isinstance(child, SparseMLP) and is_relu_mlp(child)
    ]
    names = {id(m): name for name, m in model.named_modules()}
    replacements = []
    for _, _, child in targets:  # every layer built before any is replaced
        try:
            replacements.append(SparseMLP.from_module(child, **options))
        except ValueError as error:
            raise ValueError(f"sparsify: building {names[id(child)]}: {error}") from error
    for (parent, name, _), sparse in zip(targets, replacements, strict=True):
        setattr(parent, name, sparse)
    if not targets and not any(isinstance(m, SparseMLP) for m in model.modules()):
        shaped = [
            name
            for name, m in model.named_modules()
            if name and all(isinstance(getattr(m, p, None), nn.Linear) for p in _PROJECTIONS)
        ]
        if is_relu_mlp(model):
            why = "model is itself a ReLU MLP (SparseMLP.from_module(model) converts it)"
        elif shaped:
            why = (
                f"{len(shaped)} MLP(s) with gate_proj/up_proj/down_proj (first: {shaped[0]!r}) "
                "have an activation other than ReLU, or biased layers"
            )
        else:
            why = "no module has gate_proj/up_proj/down_proj linear layers"
        warnings.warn(
            f"sparsify: nothing replaced: {why}. twell needs ReLU MLPs without biases "
            "(for a transformers model: hidden_act='relu' in its config)",
            UserWarning,
            stacklevel=2,
        )
    return len(targets)
