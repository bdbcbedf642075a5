"""The FFN block as PyTorch custom ops with autograd: twell's training path.

Two operators in the ``twell`` namespace, made with ``torch.library.custom_op`` (fake
implementations for ``torch.compile``, autograd through ``register_autograd``):

``twell::ffn_train_forward(x, w_gate?, w_up, w_down, tile, slots, max_row_nnz,
dense_capacity, reduction, graphs=False) -> (y, l1, packed, heavy, ids, count, up)``

- ``x [M, K]``, ``w_gate``/``w_up`` ``[N, K]``, ``w_down [K, N]`` (``nn.Linear``
  layouts; ``w_gate=None`` is the non-gated block). ``y [M, K]`` in ``x``'s dtype.
- ``l1``: float32 scalar, the L1 term ``l1_loss(h, reduction)`` of the hidden activation
  ``h`` (``"mean"``: mean of ``|h|`` over the M·N entries; ``"per_token"``: sum over
  units, mean over tokens). It is differentiable: its gradient flows into ``x`` and the
  weights, so ``loss = task_loss + coeff * l1`` trains the penalty.
- What the backward reads, compressed (never a dense ``[M, N]`` tensor): ``packed``, the
  TwELL words of ``relu(x @ w_gate.T)`` (``relu(x @ w_up.T)`` non-gated) as int32
  ``[M, N/tile*slots]`` (a view of the uint32 words of docs/format.md), ``heavy`` uint8
  ``[M]`` (1: the row took the dense path), ``ids`` int32 ``[M]`` (the heavy rows' ids,
  ascending, in ``ids[:count]``; the rest unspecified) and ``count`` int32 ``[1]``;
  ``up`` float32 ``[M, R]``: on CUDA, the gated block's up products ``x[t]·w_up[n]`` of
  the light rows' active units by rank in the row (``Activations.up``: the backward
  reads them instead of recomputing them; elements past a row's entries and heavy rows'
  are unspecified); ``R`` is the backward's row capacity (:func:`_up_width`), 0 for the
  non-gated block; zeros on CPU (the reference backward does not read it).

``twell::ffn_train_backward(dy?, dl1?, x, w_gate?, w_up, w_down, packed, heavy, ids,
count, up, tile, slots, max_row_nnz, dense_capacity, reduction, graphs=False) -> (dx,
dw_gate, dw_up, dw_down)``: the gradients of ``<dy, y> + dl1 · l1``. ``dx`` has ``x``'s
dtype, each weight gradient its weight's dtype; ``dw_gate`` is an empty tensor for the
non-gated block. A missing ``dy`` or ``dl1`` (None) counts as zero.

The arguments after the tensors (``tile`` … ``graphs``) are the ops' settings; inside
Python they travel as one :class:`TrainSettings` (:meth:`TrainSettings.op_args` spells
them out for an op call).

``graphs=True`` (CUDA): the op replays a CUDA graph of its launches from the second
call with the same shapes and weights on (:class:`twell._graphs.OpGraphs`: the weights
read in place, the other tensors copied into the graph's buffers; ``y``, ``dx`` and the
bf16 gradients handed over in tensors of the graph's that it writes again only once
nothing holds them, the other outputs copied; the same numbers as without).

Where they run:

- **CUDA tensors**: twell's GPU kernels. The forward prepares the weights
  (:class:`twell.kernels.pipeline.PreparedBlock`: bf16 copies and the transposed
  ``w_down``) on every call, since an optimizer step changes them, and runs
  ``PreparedBlock.forward(x, save=True)``; the backward prepares them again from the
  saved weights and runs ``twell.kernels.backward.ffn_backward``. Everything runs on
  torch's current stream with torch's allocator, without host synchronisation (so
  forward and backward can be captured in a CUDA graph), with one exception: a
  defined ``dl1`` is read on the host (``float(dl1)``) unless the backward kernels take
  the coefficient on the device (:func:`_l1_coefficient`). The value of ``l1`` is the
  sum of the forward kernels' per-row sums of ``|h|`` (``Activations.row_l1``: the light
  rows' ``h`` in fp32 from the gather, the heavy rows' from their bf16 dense rows). So a
  non-finite weight shows in ``l1`` only where it meets an active unit or a heavy row
  (as in ``y``); dense math would spread a NaN in ``w_up`` to ``l1`` through
  ``0 * NaN``. The gradients do follow dense math there: the backward checks the
  weights on the device and then runs every row densely.
- **CPU tensors**: the float64 NumPy reference (``twell.reference.ffn``,
  ``twell.reference.ffn_backward``), results cast back to the inputs' dtypes; this is
  what CI checks against torch autograd of the dense block.

:func:`ffn_train` is the differentiable entry point that :class:`twell.torch.SparseMLP`
calls; it also returns the L0 statistic (mean active units per token, from the TwELL
count words; not differentiable).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from twell._graphs import OpGraphs
from twell._interop import unview as _unview
from twell._validation import check_floating
from twell.capacity import AUTO, for_weights
from twell.options import Options, check_geometry

__all__ = [
    "REDUCTIONS", "TrainSettings", "ffn_train", "ffn_train_backward", "ffn_train_forward",
    "l0_from_packed", "op_graph_memory", "release_op_graphs",
]  # fmt: skip

#: The L1 reductions (docs/ops.md): mean over M·N entries, or sum over units / M.
REDUCTIONS = ("mean", "per_token")


@dataclasses.dataclass(frozen=True, slots=True)
class TrainSettings:
    """The training ops' settings: their arguments after the tensors, as one value.

    The custom ops take them flat (``torch.library`` schemas want typed scalars), in the
    order of the fields; everywhere else they travel as this object, spelled out only for
    an op call (:meth:`op_args`) and for the CUDA implementations, whose flat arguments
    key the op graphs (:meth:`launch_args`). Nothing is checked here: the ops check
    their arguments (``ValueError`` naming the one at fault).

    Attributes:
        tile, slots: TwELL geometry of the hidden activation.
        max_row_nnz: light rows' entry limit (-1: the default for N,
            :func:`twell.options.default_max_row_nnz`).
        dense_capacity: fraction of tokens whose heavy rows go through fixed-size cuBLAS
            GEMMs, or :data:`twell.capacity.AUTO` for ``"auto"`` (eager calls of
            :class:`twell.torch.SparseMLP` resolve ``"auto"`` to a fraction before the
            op; from compiled code the CUDA implementations resolve it).
        reduction: the L1 term's reduction (:data:`REDUCTIONS`).
        graphs: on CUDA, replay a CUDA graph of the op's launches (module docstring).
    """

    tile: int
    slots: int
    max_row_nnz: int
    dense_capacity: float
    reduction: str
    graphs: bool = False

    @classmethod
    def of(cls, options: Options, reduction: str, graphs: bool = False) -> TrainSettings:
        """The settings of a call with ``options`` (``"auto"``: :data:`AUTO`); made once
        per distinct value (every training call asks)."""
        key = (options, reduction, bool(graphs))
        found = _SETTINGS.get(key)
        if found is None:
            capacity = AUTO if options.auto_capacity else options.fixed_capacity
            found = cls(
                options.tile, options.slots,
                -1 if options.max_row_nnz is None else options.max_row_nnz,
                capacity, reduction, bool(graphs),
            )  # fmt: skip
            if len(_SETTINGS) >= 256:
                _SETTINGS.clear()
            _SETTINGS[key] = found
        return found

    def resolved(self, w_up: torch.Tensor, choose: bool) -> tuple[TrainSettings, Any]:
        """These settings with :data:`AUTO` replaced by the layer's capacity
        (:func:`twell.capacity.for_weights`), and the layer's AutoCapacity (None for a
        fixed capacity). ``choose``: the forward's choice (:meth:`AutoCapacity.choose`,
        which the forward then records its count for), else the one in force (the
        backward's)."""
        if self.dense_capacity != AUTO:
            return self, None
        auto = for_weights(w_up)
        fraction = auto.choose() if choose else auto.fraction
        return dataclasses.replace(self, dense_capacity=fraction), auto

    @classmethod
    def from_op(cls, args: Sequence[Any]) -> TrainSettings:
        """The settings from an op's arguments after its tensors (``graphs`` optional)."""
        fields = len(dataclasses.fields(cls)) - 1
        return cls(*args[:fields], bool(args[fields]) if len(args) > fields else False)

    def op_args(self) -> tuple[int, int, int, float, str, bool]:
        """The ops' arguments after their tensors, in the ops' order."""
        return (*self.launch_args(), self.graphs)

    def launch_args(self) -> tuple[int, int, int, float, str]:
        """The CUDA implementations' arguments after their tensors (:func:`_forward_cuda`,
        :func:`_backward_cuda`): the settings without ``graphs``. The op graphs key on
        them, and find ``dense_capacity`` (the setting ``"auto"`` moves) by position."""
        return (self.tile, self.slots, self.max_row_nnz, self.dense_capacity, self.reduction)

    def options(self) -> Options:
        """The :class:`~twell.options.Options` the kernels run with (no density switch:
        a training step runs sparse)."""
        capacity = "auto" if self.dense_capacity == AUTO else self.dense_capacity
        return Options(
            self.tile, self.slots, max_row_nnz=None if self.max_row_nnz < 0 else self.max_row_nnz,
            dense_capacity=capacity, density_switch=False,
        )  # fmt: skip


#: :meth:`TrainSettings.of`'s values by (options, reduction, graphs).
_SETTINGS: dict[tuple[Options, str, bool], TrainSettings] = {}


# ---------------------------------------------------------------------- checks
def _check_args(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    settings: TrainSettings,
) -> None:
    """Dtypes (``TypeError``), shapes, geometry and reduction (``ValueError``), naming
    the argument."""
    check_floating(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    tile, reduction = settings.tile, settings.reduction
    check_geometry(tile, settings.slots)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    if w_up.dim() != 2:
        raise ValueError(f"w_up: expected a 2-D tensor [N, K], got shape {tuple(w_up.shape)}")
    n, k = w_up.shape
    if x.shape[1] != k:
        raise ValueError(f"x: expected K={k} columns (as in w_up), got shape {tuple(x.shape)}")
    if w_gate is not None and tuple(w_gate.shape) != (n, k):
        raise ValueError(f"w_gate: expected shape ({n}, {k}), got {tuple(w_gate.shape)}")
    if tuple(w_down.shape) != (k, n):
        raise ValueError(f"w_down: expected shape ({k}, {n}), got {tuple(w_down.shape)}")
    if n % tile:
        raise ValueError(f"w_up: N={n} is not a multiple of tile={tile}")


def _up_width(m: int, n: int, gated: bool, options: Options) -> int:
    """Columns of the forward's ``up`` output: the backward's row capacity (gated), 0."""
    from twell.kernels.activations import row_capacity

    if not gated:
        return 0
    return row_capacity(options.row_limit(n), n, options.tile, options.slots, m)


def _l1_scale(reduction: str, m: int, n: int) -> float:
    return 1.0 / max(1, m * n) if reduction == "mean" else 1.0 / max(1, m)


# ---------------------------------------------------------------------- forward op
@torch.library.custom_op("twell::ffn_train_forward", mutates_args=())
def ffn_train_forward(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile: int,
    slots: int,
    max_row_nnz: int,
    dense_capacity: float,
    reduction: str,
    graphs: bool = False,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """``(y, l1, packed, heavy, ids, count, up)`` of the block (module docstring)."""
    settings = TrainSettings(tile, slots, max_row_nnz, dense_capacity, reduction, graphs)
    _check_args(x, w_gate, w_up, w_down, settings)
    if x.device.type == "cuda":
        settings, auto = settings.resolved(w_up, choose=True)
        args = (x, w_gate, w_up, w_down, *settings.launch_args())
        if graphs:
            outputs = _OP_FORWARD_GRAPHS(_forward_cuda, args, pinned=_FORWARD_WEIGHTS)
        else:
            outputs = _forward_cuda(*args)
        if auto is not None:
            auto.record(outputs[5], x.shape[0])
        return outputs
    if x.device.type != "cpu":
        raise TypeError(f"x: expected a CPU or CUDA tensor, got one on {x.device}")
    return _forward_cpu(x, w_gate, w_up, w_down, settings)


@ffn_train_forward.register_fake
def _forward_fake(x, w_gate, w_up, w_down, *rest):
    settings = TrainSettings.from_op(rest)
    _check_args(x, w_gate, w_up, w_down, settings)
    m = x.shape[0]
    n = w_up.shape[0]
    tile, slots = settings.tile, settings.slots
    r = _up_width(m, n, w_gate is not None, settings.options())
    return (
        x.new_empty(x.shape),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((m, n // tile * slots), dtype=torch.int32),
        x.new_empty((m,), dtype=torch.uint8),
        x.new_empty((m,), dtype=torch.int32),
        x.new_empty((1,), dtype=torch.int32),
        x.new_empty((m, r), dtype=torch.float32),
    )


# ---------------------------------------------------------------------- backward op
@torch.library.custom_op("twell::ffn_train_backward", mutates_args=())
def ffn_train_backward(
    dy: torch.Tensor | None,
    dl1: torch.Tensor | None,
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    packed: torch.Tensor,
    heavy: torch.Tensor,
    ids: torch.Tensor,
    count: torch.Tensor,
    up: torch.Tensor,
    tile: int,
    slots: int,
    max_row_nnz: int,
    dense_capacity: float,
    reduction: str,
    graphs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw_gate, dw_up, dw_down)`` of ``<dy, y> + dl1 · l1`` (module docstring)."""
    settings = TrainSettings(tile, slots, max_row_nnz, dense_capacity, reduction, graphs)
    _check_args(x, w_gate, w_up, w_down, settings)
    if dy is not None and tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"dy: expected the output's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if dl1 is not None and dl1.numel() != 1:
        raise ValueError(f"dl1: expected a scalar, got shape {tuple(dl1.shape)}")
    if x.shape[0] == 0 or (dy is None and dl1 is None):
        return _zero_grads(x, w_gate, w_up, w_down)
    if x.device.type == "cuda":
        settings = settings.resolved(w_up, choose=False)[0]
        args = (dy, dl1, x, w_gate, w_up, w_down, packed, heavy, ids, count, up,
                *settings.launch_args())  # fmt: skip
        if graphs:
            return _BACKWARD_GRAPHS(_backward_cuda, args, pinned=_BACKWARD_WEIGHTS)
        return _backward_cuda(*args)
    return _backward_cpu(dy, dl1, x, w_gate, w_up, w_down, reduction)


@ffn_train_backward.register_fake
def _backward_fake(dy, dl1, x, w_gate, w_up, w_down, packed, heavy, ids, count, up, *_settings):
    return (
        torch.empty_like(x),
        w_up.new_empty((0,)) if w_gate is None else torch.empty_like(w_gate),
        torch.empty_like(w_up),
        torch.empty_like(w_down),
    )


def _zero_grads(x, w_gate, w_up, w_down):
    return (
        torch.zeros_like(x),
        w_up.new_empty((0,)) if w_gate is None else torch.zeros_like(w_gate),
        torch.zeros_like(w_up),
        torch.zeros_like(w_down),
    )


# ---------------------------------------------------------------------- autograd
def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, w_gate, w_up, w_down, *rest = inputs
    _, _, packed, heavy, ids, count, up = output
    ctx.save_for_backward(x, w_gate, w_up, w_down, packed, heavy, ids, count, up)
    ctx.mark_non_differentiable(up)
    ctx.settings = TrainSettings.from_op(rest)
    ctx.gated = w_gate is not None
    # Unused outputs give None (not zeros): no L1 work, no host read of a zero dl1.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dy, dl1, *_unused):
    x, w_gate, w_up, w_down, packed, heavy, ids, count, up = ctx.saved_tensors
    if dy is None and dl1 is None:
        return (None,) * 10
    if not ctx.gated:
        w_gate = None
    dx, dw_gate, dw_up, dw_down = ffn_train_backward(
        None if dy is None else dy.contiguous(), dl1, x, w_gate, w_up, w_down, packed, heavy,
        ids, count, up, *ctx.settings.op_args(),
    )  # fmt: skip
    needs = ctx.needs_input_grad
    return (
        dx if needs[0] else None,
        dw_gate if ctx.gated and needs[1] else None,
        dw_up if needs[2] else None,
        dw_down if needs[3] and dy is not None else None,  # the L1 term needs no w_down
        None, None, None, None, None, None,
    )  # fmt: skip


ffn_train_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------- entry point
def l0_from_packed(packed: torch.Tensor, slots: int) -> torch.Tensor:
    """Mean number of active units per token (float32 scalar) from the TwELL count words
    (word 0 of every row-tile holds the true count, overflowed tiles included)."""
    m = packed.shape[0]
    counts = packed.reshape(m, packed.shape[1] // slots, slots)[:, :, 0]
    return counts.sum(dtype=torch.float32) / max(1, m)


def ffn_train(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    options: Options,
    reduction: str = "mean",
    graphs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block on ``x [..., K]`` through the training ops: ``(y, l1, l0)``.

    ``y [..., K]`` (``x``'s dtype) and ``l1`` (float32 scalar) are differentiable; ``l0``
    (float32 scalar, mean active units per token) is not. ``graphs``: on CUDA, each op
    replays a CUDA graph of its launches from the second call with the same shapes and
    weights on (:class:`twell._graphs.OpGraphs`: its memory and stream rules apply).

    Raises:
        ValueError: ``options.dense_capacity`` is ``"auto"`` (it follows a layer's
            earlier calls, which :class:`twell.torch.SparseMLP` keeps; pass a fraction).
    """
    if options.auto_capacity:
        raise ValueError(
            "ffn_train: dense_capacity='auto' follows a layer's earlier calls, which "
            "twell.torch.SparseMLP keeps; pass a fraction here"
        )
    return _ffn_train(x, w_gate, w_up, w_down, options, reduction, graphs)[:3]


def _ffn_train(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    options: Options,
    reduction: str,
    graphs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`ffn_train`'s outputs, the forward's heavy-row count (int32 ``[1]``) and,
    for eager CUDA calls, ``stats``: float32 ``[2]`` (L0, heavy-row count; one host copy
    serves both training policies), else None. With op graphs ``stats`` lies in the
    graphs' memory: read it on the current stream before the next forward op-graph
    replay on the device.

    Eager calls on CUDA run the implementations through :class:`_EagerTraining` (no
    dispatcher: an op call through it costs hundreds of microseconds of host time);
    CPU tensors and code that ``torch.compile`` traces take the custom ops."""
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (a reshape costs µs even as a no-op)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    settings = TrainSettings.of(options, reduction, graphs)
    stats = None
    if x2.is_cuda and not torch.compiler.is_compiling():
        y, l1, l0, count, stats = _EagerTraining.apply(x2, w_gate, w_up, w_down, settings)
    else:
        y, l1, packed, _, _, count, _ = ffn_train_forward(
            x2, w_gate, w_up, w_down, *settings.op_args()
        )
        l0 = l0_from_packed(packed.detach(), options.slots)
    return (y if y.shape == x.shape else y.reshape(x.shape)), l1, l0, count, stats


def _forward_with_l0(x, w_gate, w_up, w_down, tile, slots, *rest, out=None):  # noqa: ANN001, ANN202
    """:func:`_forward_cuda`'s outputs and the L0 (computed on the device, in the same op
    graph when one is replayed); ``out``: as :func:`_forward_cuda`'s, one entry longer."""
    outputs = _forward_cuda(x, w_gate, w_up, w_down, tile, slots, *rest,
                            out=None if out is None else out[:7])  # fmt: skip
    return (*outputs, l0_from_packed(outputs[2], slots))


def _forward_with_stats(x, w_gate, w_up, w_down, tile, slots, *rest, out=None):  # noqa: ANN001, ANN202
    """:func:`_forward_with_l0`'s outputs and ``stats``, float32 ``[2]``: (L0, heavy-row
    count), which a caller copies to the host once for both training policies
    (:class:`twell.capacity.TrainSwitch`); an op graph computes it at no host cost."""
    outputs = _forward_with_l0(x, w_gate, w_up, w_down, tile, slots, *rest,
                               out=None if out is None else out[:8])  # fmt: skip
    stats = torch.cat((outputs[7].reshape(1), outputs[5].to(torch.float32)))
    return (*outputs, stats)


#: Forward outputs lent to the backward by the op graphs (packed, heavy, ids, count, up;
#: and stats, read by the caller), and the input buffer it reads (x); the first five's
#: positions in the backward's arguments.
_LENT = ((0,), (2, 3, 4, 5, 6, 8))
_BACKWARD_LENT = frozenset({2, 6, 7, 8, 9, 10})


class _EagerTraining(torch.autograd.Function):
    """The training ops' autograd for eager CUDA calls, calling their implementations
    directly (the same numbers as the ops: the same functions run). With op graphs, the
    forward's TwELL words, heavy rows and up products (and its copy of ``x``) are lent to
    the backward in the graph's own memory (:class:`twell._graphs.Lease`), which then
    replays a graph that reads them in place: a step copies ``x`` and ``dy`` in and
    ``l1``, ``l0`` out, nothing else (``y`` and the gradients are handed over:
    :class:`twell._graphs.OpGraphs`)."""

    @staticmethod
    def forward(ctx: Any, x, w_gate, w_up, w_down, settings: TrainSettings):  # noqa: ANN001, ANN205
        _check_args(x, w_gate, w_up, w_down, settings)
        args = (x, w_gate, w_up, w_down, *settings.launch_args())
        if settings.graphs:
            outputs, lease = _FORWARD_GRAPHS(_forward_with_stats, args, _FORWARD_WEIGHTS, _LENT)
            ctx.save_for_backward(w_gate, w_up, w_down)
            ctx.lease = lease
        else:
            outputs = _forward_with_stats(*args)
            ctx.save_for_backward(w_gate, w_up, w_down, x, *outputs[2:7])
            ctx.lease = None
        y, l1, _, _, _, count, _, l0, stats = outputs
        ctx.mark_non_differentiable(l0, count, stats)
        ctx.settings = settings
        ctx.set_materialize_grads(False)
        return y, l1, l0, count, stats

    @staticmethod
    def backward(ctx: Any, dy, dl1, *_unused):  # noqa: ANN001, ANN205
        w_gate, w_up, w_down, *rest = ctx.saved_tensors
        lease = ctx.lease
        if lease is None and not rest:
            raise RuntimeError(
                "twell: a second backward through a training call made with op graphs: its "
                "saved activations were lent by the graphs and the first backward gave them "
                "back; build the module with op_graphs=False to backpropagate through a "
                "call more than once (retain_graph=True)"
            )
        x, packed, heavy, ids, count, up = (rest if lease is None else lease.tensors)[:6]
        if dy is None and dl1 is None:
            return None, None, None, None, None
        settings = ctx.settings
        if dy is not None:
            dy = dy.contiguous()
        if x.shape[0] == 0:
            grads = _zero_grads(x, w_gate, w_up, w_down)
        else:
            args = (dy, dl1, x, w_gate, w_up, w_down, packed, heavy, ids, count, up,
                    *settings.launch_args())  # fmt: skip
            if settings.graphs:
                pinned = _BACKWARD_WEIGHTS
                if lease is not None and lease.static:  # read in the forward graph's memory
                    pinned = pinned | _BACKWARD_LENT
                grads = _BACKWARD_GRAPHS(_backward_cuda, args, pinned)
            else:
                grads = _backward_cuda(*args)
        if lease is not None:
            lease.release()
            ctx.lease = None
        dx, dw_gate, dw_up, dw_down = grads
        needs = ctx.needs_input_grad
        return (
            dx if needs[0] else None,
            dw_gate if w_gate is not None and needs[1] else None,
            dw_up if needs[2] else None,
            dw_down if needs[3] and dy is not None else None,  # the L1 term needs no w_down
            None,
        )


# ---------------------------------------------------------------------- CPU: reference
def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float64).numpy()


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A C-contiguous tensor of ``dtype`` from a NumPy result (fake impls promise that)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _forward_cpu(x, w_gate, w_up, w_down, settings):
    from twell import reference

    options = settings.options()
    tile, slots, reduction = options.tile, options.slots, settings.reduction
    xf, wg, wu, wd = (_numpy(t) for t in (x, w_gate, w_up, w_down))
    m, n = x.shape[0], w_up.shape[0]
    g = reference.gate(xf, wu if wg is None else wg, tile=tile, slots=slots)
    if wg is None:
        y = reference.down(g, wd)
    else:
        y = reference.gated_down(xf, g, wu, wd)
    with np.errstate(all="ignore"):  # dense math on non-finite values is the contract
        pre = xf @ (wu if wg is None else wg).T
        h = reference.forward.relu(pre)
        if wg is not None:
            h = h * (xf @ wu.T)
        l1 = float(np.abs(h).sum()) * _l1_scale(reduction, m, n)
    rows = g.dense_rows.astype(np.int32)
    heavy = np.zeros(m, dtype=np.uint8)
    heavy[rows] = 1
    ids = np.zeros(m, dtype=np.int32)
    ids[: rows.size] = rows
    return (
        _tensor(y, x.dtype),
        torch.tensor(l1, dtype=torch.float32),
        torch.from_numpy(np.ascontiguousarray(g.ell.packed).view(np.int32).copy()),
        torch.from_numpy(heavy),
        torch.from_numpy(ids),
        torch.tensor([rows.size], dtype=torch.int32),
        torch.zeros((m, _up_width(m, n, wg is not None, options)), dtype=torch.float32),
    )


def _backward_cpu(dy, dl1, x, w_gate, w_up, w_down, reduction):
    from twell import reference

    xf, wg, wu, wd = (_numpy(t) for t in (x, w_gate, w_up, w_down))
    dyf = np.zeros(xf.shape) if dy is None else _numpy(dy)
    coeff = 0.0 if dl1 is None else float(dl1)
    dx, dwg, dwu, dwd = reference.ffn_backward(xf, wg, wu, wd, dyf, coeff, reduction=reduction)
    return (
        _tensor(dx, x.dtype),
        w_up.new_empty((0,)) if w_gate is None else _tensor(dwg, w_gate.dtype),
        _tensor(dwu, w_up.dtype),
        _tensor(dwd, w_down.dtype),
    )


# ---------------------------------------------------------------------- CUDA: kernels
def _y_out(outputs: int) -> Callable[[tuple], tuple | None]:
    """The forward's ``hand_over`` (:class:`OpGraphs`) for an implementation of
    ``outputs`` outputs: ``y`` (bf16 ``x``; the kernels take bf16 copies of other weights),
    written into a given tensor."""

    def specs(args: tuple) -> tuple | None:
        x = args[0]
        if x.dtype != torch.bfloat16:
            return None
        return ((tuple(x.shape), x.dtype), *[None] * (outputs - 1))

    return specs


def _grads_out(args: tuple) -> tuple | None:
    """Shapes and dtypes of the backward's results that :func:`_backward_cuda` can write
    into given tensors (``out``), from its arguments: ``(dx, dw_gate, dw_up, dw_down)``,
    None for the non-gated block's ``dw_gate``; None where it cannot (not all bf16)."""
    x, w_gate, w_up, w_down = args[2], args[3], args[4], args[5]
    if any(t is not None and t.dtype != torch.bfloat16 for t in (x, w_gate, w_up, w_down)):
        return None
    return tuple(
        None if t is None else (tuple(t.shape), t.dtype) for t in (x, w_gate, w_up, w_down)
    )


#: The ops' CUDA graphs when called with ``graphs=True`` (one memory pool each); ``replace``
#: is ``dense_capacity``'s position in the implementations' arguments. They hand ``y``,
#: ``dx`` and the weight gradients over (``hand_over``): written into tensors outside the
#: pool, which the caller gets (``.grad`` too) without a copy.
_FORWARD_GRAPHS = OpGraphs(replace=frozenset({7}), hand_over=_y_out(9))
_BACKWARD_GRAPHS = OpGraphs(replace=frozenset({14}), hand_over=_grads_out)
#: The forward op's own graphs (called through the dispatcher with ``graphs=True``: the
#: outputs of :func:`_forward_cuda`, where the eager path's graphs hold
#: :func:`_forward_with_l0`'s).
_OP_FORWARD_GRAPHS = OpGraphs(replace=frozenset({7}), hand_over=_y_out(7))
#: The weights' positions in the ops' arguments: read in place by the graphs.
_FORWARD_WEIGHTS = frozenset({1, 2, 3})
_BACKWARD_WEIGHTS = frozenset({3, 4, 5})


def op_graph_memory() -> int:
    """Bytes of GPU memory the training ops' graphs hold (``op_graphs``): their input
    buffers, the activations the forward lends the backward, the tensors they hand
    ``y``, ``dx`` and the gradients over in (held by the caller or not) and the pools'
    outputs and shared scratch (:meth:`twell._graphs.OpGraphs.memory`)."""
    return sum(g.memory() for g in (_FORWARD_GRAPHS, _OP_FORWARD_GRAPHS, _BACKWARD_GRAPHS))


def release_op_graphs() -> None:
    """Drop every training op graph and give torch's cache the memory only they held
    (after training, or when a model's weights go away: a layer's graphs are keyed on its
    weights' addresses). Later eager calls capture again from their second call."""
    import gc

    for graphs in (_FORWARD_GRAPHS, _OP_FORWARD_GRAPHS, _BACKWARD_GRAPHS):
        graphs.clear()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _training_block(w_gate: Any, w_up: Any, w_down: Any, options: Options) -> Any:
    """A :class:`PreparedBlock` for one training step: the same layouts, built with no
    host synchronisation (capturable): its weights are not checked on the host
    (``check_weights=False``); the backward checks them on the device."""
    from twell.kernels.pipeline import PreparedBlock

    return PreparedBlock(w_gate, w_up, w_down, options, check_weights=False)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _check_cuda(**tensors: torch.Tensor | None) -> None:
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise TypeError(f"{name}: expected a CUDA tensor like x, got one on {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} like x, got {t.device}")


def _forward_cuda(x, w_gate, w_up, w_down, *launch, out=None):
    """The forward on CUDA; ``launch``: :meth:`TrainSettings.launch_args`. ``out``: a
    tensor to write ``y`` into first (bf16 ``x``; the rest None), which is then ``y``."""
    from twell._interop import on_gpu

    _check_cuda(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    settings = TrainSettings(*launch)
    tile, slots, reduction = settings.tile, settings.slots, settings.reduction
    m, n = x.shape[0], w_up.shape[0]
    options = settings.options()
    if m == 0:
        return (
            torch.empty_like(x) if out is None else out[0],
            torch.zeros((), dtype=torch.float32, device=x.device),
            torch.zeros((0, n // tile * slots), dtype=torch.int32, device=x.device),
            torch.zeros((0,), dtype=torch.uint8, device=x.device),
            torch.zeros((0,), dtype=torch.int32, device=x.device),
            torch.zeros((1,), dtype=torch.int32, device=x.device),
            torch.zeros(
                (0, _up_width(0, n, w_gate is not None, options)),
                dtype=torch.float32,
                device=x.device,
            ),  # fmt: skip
        )
    arrays = {"x": x.contiguous(), "w_gate": _contiguous(w_gate), "w_up": w_up.contiguous(),
              "w_down": w_down.contiguous()}  # fmt: skip
    if out is not None:
        arrays["y"] = out[0]
    with on_gpu("torch", arrays) as (v, to_caller):
        block = _training_block(v["w_gate"], v["w_up"], v["w_down"], options)
        y, saved = block.forward(v["x"], save=True, out=v.get("y"))
        outputs = [
            to_caller(a)
            for a in (y, saved.packed.view(np.int32), saved.heavy, saved.ids[:m], saved.count)
        ]
        del block, y  # (a captured block keeps its buffers: not a view of out's tensor)
        row_l1 = to_caller(saved.row_l1)
        if saved.up is not None:
            outputs.append(to_caller(saved.up))
    y, packed, heavy, ids, count, *up = (_unview(t) for t in outputs)
    if out is not None:  # written in place: the caller's tensor is y
        y = out[0]
    if not up:  # the non-gated block keeps none
        up = [torch.zeros((m, 0), dtype=torch.float32, device=x.device)]
    l1 = row_l1.sum() * _l1_scale(reduction, m, n)
    return y, l1, packed, heavy, ids, count, up[0]


def _l1_coefficient(dl1: torch.Tensor | None, backward_module: Any) -> Any:
    """What ``ffn_backward`` gets as ``l1_coeff``: 0.0 without an L1 gradient; a CuPy
    float32 ``[1]`` device array when the backward kernels take one
    (``backward_module.DEVICE_L1_COEFF`` true: no host synchronisation); else
    ``float(dl1)``, one host read, which a CUDA-graph capture cannot contain."""
    if dl1 is None:
        return 0.0
    if getattr(backward_module, "DEVICE_L1_COEFF", False):
        from twell._interop import cupy_view

        return cupy_view(dl1.detach().reshape(1).to(torch.float32).contiguous())
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "twell: the L1 term's gradient cannot be captured in a CUDA graph yet: the "
            "backward kernels take its coefficient as a host number (reading it would "
            "synchronise). Capture a step without the L1 term, or run it eagerly."
        )
    return float(dl1)


def _backward_cuda(dy, dl1, x, w_gate, w_up, w_down, packed, heavy, ids, count, up, *launch,
                   out=None):  # fmt: skip
    """The backward on CUDA; ``launch``: :meth:`TrainSettings.launch_args`. ``out``: the
    tensors to write ``(dx, dw_gate, dw_up, dw_down)`` into (:func:`_grads_out`; bf16 x
    and weights), which are then the results."""
    from twell._interop import on_gpu
    from twell.kernels import backward as kernels_backward
    from twell.kernels.activations import Activations

    settings = TrainSettings(*launch)
    _check_cuda(dy=dy, dl1=dl1, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, packed=packed,
                up=up)  # fmt: skip
    if dy is None:
        dy = torch.zeros_like(x)
    coeff = _l1_coefficient(dl1, kernels_backward)
    options = settings.options()
    arrays = {
        "x": x.contiguous(), "dy": dy.to(x.dtype).contiguous(), "w_gate": _contiguous(w_gate),
        "w_up": w_up.contiguous(), "w_down": w_down.contiguous(), "packed": packed.contiguous(),
        "heavy": heavy.contiguous(), "ids": ids.contiguous(), "count": count.contiguous(),
    }  # fmt: skip
    if w_gate is not None:  # the non-gated block keeps no up products
        arrays["up"] = up.contiguous()
    if out is not None:
        arrays.update({f"out{i}": t for i, t in enumerate(out) if t is not None})
    with on_gpu("torch", arrays) as (v, to_caller):
        block = _training_block(v["w_gate"], v["w_up"], v["w_down"], options)
        saved = Activations(v["packed"].view(np.uint32), v["heavy"], v["ids"], v["count"],
                            up=v.get("up"))  # fmt: skip
        # bf16 weights get bf16 gradients straight from the kernels (half the memory of
        # fp32 ones and no second copy); others get fp32, cast below.
        bf16 = all(w is None or w.dtype == torch.bfloat16 for w in (w_gate, w_up, w_down))
        into = None if out is None else tuple(v.get(f"out{i}") for i in range(4))
        grads = kernels_backward.ffn_backward(
            block, v["x"], v["dy"], saved, l1_coeff=coeff, reduction=settings.reduction,
            grad_dtype=v["w_up"].dtype if bf16 else np.float32, out=into,
        )  # fmt: skip
        if out is not None:  # written in place: the caller's tensors are the results
            return (out[0], w_up.new_empty((0,)) if out[1] is None else out[1], *out[2:])
        dx, dwg, dwu, dwd = (None if g is None else _unview(to_caller(g)) for g in grads)
    return (
        dx.to(x.dtype).contiguous(),
        w_up.new_empty((0,)) if w_gate is None else dwg.to(w_gate.dtype).contiguous(),
        dwu.to(w_up.dtype).contiguous(),
        dwd.to(w_down.dtype).contiguous(),
    )
