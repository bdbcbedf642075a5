"""The FFN block on the GPU: the kernels composed into one forward pass.

A :class:`PreparedBlock` holds the weights in the layouts the kernels want (bf16, and
``w_down`` transposed so a unit's down column is contiguous), built once. Its forward
pass has two stages (docs/design.md draws them):

1. **Light rows** — a *route* from :data:`ROUTES` (the ``path`` option): it computes the
   gate, decides which rows are heavy (the routing rule), and writes the light rows of
   ``y``. Every route has the signature ``route(block, x, y, save) -> LightRows``
   (``save``: where the training forward wants the light rows' sums of ``|h|`` and up
   products, a :class:`SaveTargets`, or None):

   - ``"fused"``: cuBLAS gate GEMM into a dense bf16 pre-activation, then one kernel
     scans it and gathers (light_rows.from_pre);
   - ``"epilogue"``: the gate GEMM packs TwELL in its epilogue (gate_gemm.cu), then the
     gather reads TwELL; no dense pre-activation exists, so heavy rows recompute theirs;
   - ``"pack"``: cuBLAS, the packing kernel (pack.cu), then the gather reads TwELL;
   - ``"sliced"``: the gate as in ``"pack"``, then the gather by 256-column slices of the
     weights (light_rows_sliced.cu), so that the slice being read stays in L2; ``"fused"``
     takes it for large batches of weights far larger than L2
     (``light_rows_sliced.pays``).

2. **Heavy rows** — the heavy rows' ids are compacted on the device (by a kernel of their
   own, or, for inference batches of at most ``heavy_rows.FLAG_ROWS`` tokens without
   ``dense_capacity``, inside the tensor-core kernels that do their dense math: one
   launch less). Inference calls of more tokens with ``dense_capacity="auto"`` do their
   dense math by count (:func:`heavy_rows_counted`: the gate GEMM's count build, whose
   cost follows the number of heavy rows); the others through :func:`heavy_rows_stage`
   (heavy_rows.cu's tiles, the first ``ceil(dense_capacity * M)`` rows optionally
   through fixed-size cuBLAS GEMMs).

Inference calls of the ``"fused"`` path with at most ``decode_units.MAX_ROWS`` tokens
(decode) take neither stage: decode_units.py computes the whole block in two launches,
dividing the work among the SMs by hidden unit (each active unit's weight rows read once
for all tokens), with no heavy rows; it feeds the density switch from its bit masks.

Two cases take plain dense math for the whole batch instead (:func:`dense_block`: three
cuBLAS GEMMs and one elementwise kernel, the dense block's own rounding points):

- a weight holds NaN or Inf (checked once, when the block is prepared): dense math then
  spreads it to outputs no sparse path would touch (``0 * NaN``), and twell keeps that;
- the activations are too dense for the sparse path to pay (twell.kernels.density), as
  the statistics of earlier calls say. An inference call of more than
  ``heavy_rows.FLAG_ROWS`` tokens with ``dense_capacity="auto"`` decides instead on the
  device from its own rows (:meth:`PreparedBlock.decide`, between its route's gate and
  gather), and a dense decision sends every row through the count build.

Nothing synchronises with the host, so a forward pass can be captured in a CUDA graph;
no sum depends on the order blocks finish in, so the same inputs give the same output
bits for the same decisions (and those calls that decide on their own rows, whatever
ran before).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twell import tuning
from twell._arrays import bfloat16
from twell.kernels import (
    decode_units,
    gate_gemm,
    heavy_rows,
    light_rows,
    light_rows_decode,
    light_rows_sliced,
)
from twell.kernels.activations import Activations, row_capacity
from twell.kernels.buffers import alloc, check_out, empty_bf16, keep_for_graph
from twell.kernels.convert import as_bf16, from_bf16, transpose
from twell.kernels.cublas import gemm_nt
from twell.kernels.density import (  # noqa: F401 - the policy's names, importable here too
    CROSSOVER,
    HEAVY_DENSE,
    DensitySwitch,
    crossover,
    plain_reductions,
    sample_rows,
)
from twell.kernels.pack import pack
from twell.options import Options, check_width


@dataclass
class LightRows:
    """What a route hands to the heavy-row stage.

    Attributes:
        heavy: uint8 ``[M]``, 1 for the rows the route left to the dense path.
        pre: the dense bf16 gate pre-activation ``[M, N]`` when the route wrote one, or
            None: then the heavy rows' pre-activations are recomputed from ``x``.
        packed: the TwELL words of ``relu(pre)`` when the route packed them, else None.
        scratch: other buffers the route's kernels use (kept alive with a captured call).
        dense: the call's own density decision (int32 ``[1]`` on the device,
            light_rows.decide) when the route took one: set, every row is heavy.
    """

    heavy: Any
    pre: Any | None = None
    packed: Any | None = None
    scratch: list[Any] = field(default_factory=list)
    dense: Any | None = None


class PreparedBlock:
    """A gated (or non-gated) ReLU FFN block prepared for the GPU kernels.

    Args:
        w_gate: ``[N, K]`` or None (non-gated block ``relu(x @ w_up.T) @ w_down.T``).
        w_up: ``[N, K]``; w_down: ``[K, N]`` (``torch.nn.Linear`` layout), CuPy arrays,
            already validated (``twell.ops`` does that).
        options: how the block runs (:class:`twell.options.Options`).
        check_weights: check once that the weights are finite (three reductions read on
            the host: a synchronisation). False (a training step, which must not
            synchronise): ``weights_finite`` is None, unknown; the backward then checks
            on the device, and the forward's ``save=True`` path does not use it.
    """

    def __init__(
        self,
        w_gate: Any | None,
        w_up: Any,
        w_down: Any,
        options: Options,
        *,
        check_weights: bool = True,
    ) -> None:
        self.options = options
        tuning.check_device(_device_name(w_up.device.id))  # thresholds of another GPU model?
        self.w_gate = None if w_gate is None else as_bf16(w_gate)
        self.w_up = as_bf16(w_up)
        self.w_down = as_bf16(w_down)
        self.n, self.k = self.w_up.shape
        check_width(self.k)
        self.max_row_nnz = options.row_limit(self.n)
        self.w_down_t = transpose(self.w_down)
        self.weights_finite: bool | None = (
            _all_finite(self.w_gate, self.w_up, self.w_down) if check_weights else None
        )
        self.density = DensitySwitch(self.n, self.max_row_nnz, options.density_switch)
        if options.auto_capacity:  # those calls decide on the device, from their own rows
            self.density.per_call_above = heavy_rows.FLAG_ROWS
        self._graph_scratch: list[list[Any]] = []  # buffers of captured calls

    def _keep(self, buffers: list[Any]) -> None:
        """Keep a captured call's buffers alive as long as this block (a graph of its own,
        twell._graphs, takes them over): those of CuPy's pool only, since the memory torch
        hands out in a capture stays with the capturing graph's pool (a user's repeated
        torch captures would otherwise grow this list for the block's lifetime; a CuPy
        stream capture's buffers are all CuPy's and still stay). A captured call's input
        is the capturer's to keep alive, as torch asks of any captured input."""
        kept = keep_for_graph(buffers)
        if kept:
            self._graph_scratch.append(kept)

    @property
    def gated(self) -> bool:
        """Whether the block has a gate projection."""
        return self.w_gate is not None

    @property
    def w_first(self) -> Any:
        """The weight whose relu'd product is the hidden activation's pattern."""
        return self.w_up if self.w_gate is None else self.w_gate

    def decide(
        self, m: int, *, pre: Any | None = None, packed: Any | None = None, heavy: Any = None
    ) -> Any:
        """This call's density decision on the device, from its own rows
        (light_rows.decide, against the switch's threshold at ``m`` tokens): int32
        ``[1]``."""
        return light_rows.decide(
            m, self.n, pre=pre, packed=packed, heavy=heavy, tile=self.options.tile,
            slots=self.options.slots, row_limit=self.max_row_nnz,
            threshold=self.density.threshold(m), kdim=self.k, gated=self.gated,
        )  # fmt: skip

    def counts_heavy_rows(self, m: int) -> bool:
        """Whether an inference call of ``m`` tokens does its heavy rows by count
        (:func:`heavy_rows_counted`): ``dense_capacity="auto"`` above
        ``heavy_rows.FLAG_ROWS`` tokens."""
        return self.options.auto_capacity and m > heavy_rows.FLAG_ROWS

    def takes_dense(self, x: Any) -> bool:
        """Whether an inference call on ``x`` (CuPy ``[M, K]``) runs dense math: by the
        call's own decision where it takes one on the device (computed here from its gate
        and read back: a synchronisation, for reports and tests), else as the statistics
        in force say (the decision of the last call, :attr:`DensitySwitch.dense`, for a
        call that ran)."""
        m = x.shape[0]
        if not self.weights_finite:
            return True
        if self.counts_heavy_rows(m) and self.density.decides_per_call(m):
            pre = gemm_nt(as_bf16(x), self.w_first)
            return bool(int(self.decide(m, pre=pre)[0]))
        return bool(self.density.dense)

    def _by_unit(self, m: int) -> bool:
        """Whether an inference call of ``m`` tokens takes decode_units.py's kernels (the
        ``"fused"`` path at most ``decode_units.MAX_ROWS`` tokens)."""
        return self.options.path == "fused" and decode_units.fits(m, self.n)

    def __call__(self, x: Any) -> Any:
        """The block's output for ``x [M, K]`` (``x``'s dtype)."""
        return self.forward(x)

    def route(self, m: int, save: bool = False) -> str:
        """The light-row route (a key of :data:`ROUTES`) of a sparse call of ``m`` tokens
        (decode and the density switch's dense calls take neither): the ``path`` option,
        where ``"fused"`` stands for the route measured fastest at the shape (the sliced
        gather for large weights, ``light_rows_sliced.pays``), and a training call
        (``save``) takes ``"epilogue"`` where the path keeps no training outputs."""
        path = self.options.path
        if save and path in ("fused", "sliced"):
            return "epilogue"
        if path == "fused" and light_rows_sliced.pays(m, self.k, self.n, self.gated):
            return "sliced"
        return path

    def forward(self, x: Any, *, save: bool = False, out: Any = None) -> Any:
        """The block's output for ``x [M, K]`` (``x``'s dtype); no host synchronisation.
        ``out``: a C-contiguous bf16 ``[M, K]`` array to write it into (bf16 ``x``; every
        element written), which is then the output.

        With ``save``, returns ``(y, Activations)``: what a backward pass needs (the packed
        gate and the heavy rows), taken from a route that packs TwELL (``"epilogue"`` when
        the block's own route does not).

        May be captured in a CUDA graph (torch must be imported: the gate GEMM then runs
        through it). The buffers a captured call takes from CuPy's pool stay alive as long
        as this object; those torch hands out stay with the capturing graph's pool.
        """
        xb = as_bf16(x)
        m, k = xb.shape
        if k != self.k:
            raise ValueError(f"x: expected K={self.k}, got {k}")
        if out is not None:
            if np.dtype(x.dtype) != bfloat16:
                raise ValueError(f"out: y is written in place only for bf16 x, got x {x.dtype}")
            check_out("out", out, (m, k))
        y = empty_bf16((m, k)) if out is None else out
        in_capture = capturing()
        by_unit = not save and self.weights_finite and self._by_unit(m)
        auto = not save and self.options.auto_capacity
        # Heavy rows by count (heavy_rows_counted), and the density decision taken on the
        # device from the call's own rows: no statistics of earlier calls involved.
        counted = auto and self.counts_heavy_rows(m)
        per_call = counted and self.density.decides_per_call(m)
        if m and not save and (not self.weights_finite or self.density.go_dense(m, in_capture)):
            scratch = dense_block(self, xb, y)
            if in_capture:
                self._keep([xb, y, *scratch])
            return from_bf16(y, x.dtype)
        if by_unit:
            # Decode: the whole block by unit, every row (no heavy rows).
            scratch = decode_units.forward(
                xb, self.w_first, self.w_up if self.gated else None, self.w_down_t, y,
                units_per_token=self.density.estimate,
            )  # fmt: skip
            if in_capture:
                self._keep([xb, y, *scratch])
            else:
                self.density.observe_masks(scratch[1])
            return from_bf16(y, x.dtype)
        path = self.route(m, save)
        # The training forward's L1 term, per row: light rows by the route, heavy rows by
        # the heavy-row stage (every row written).
        row_l1 = alloc((m,), np.float32) if save else None
        up = None
        if save and self.gated:  # the backward reads the up products instead of recomputing
            r = row_capacity(self.max_row_nnz, self.n, self.options.tile, self.options.slots, m)
            up = alloc((m, r), np.float32)
        targets = SaveTargets(row_l1, up) if save else None
        capacity = self.options.capacity_rows(m)  # "auto": 0 (small batches: the tiles)
        if in_capture and path == "fused" and not save and not counted and not capacity and (
            BESIDE and light_rows_decode.DECODE_ROWS_BELOW < m <= heavy_rows.FLAG_ROWS
        ):  # fmt: skip
            light, scratch = fused_beside(self, xb, y)
            self._keep([xb, y, light.pre, light.heavy, *scratch])
            return from_bf16(y, x.dtype)
        light = (
            ROUTES[path](self, xb, y, targets, per_call) if m else LightRows(alloc((0,), np.uint8))
        )
        if not save and m <= heavy_rows.FLAG_ROWS and not capacity:
            # Small batches: the heavy-row kernels compact the row flags themselves.
            ids = count = None
        else:  # launched to start as the route's last kernel ends
            ids, count = heavy_rows.compact_rows(light.heavy, overlap=True)
        # The heavy-row kernels start while the kernel before them ends where no heavy row
        # is expected (they then find none and end at once).
        overlap = not self.density.expects_heavy(m)
        if not m:
            scratch = []
        elif counted:
            scratch = heavy_rows_counted(self, xb, light, ids, count, y)
        else:
            scratch = heavy_rows_stage(
                self, xb, light, ids, count, y, row_l1, capacity, overlap=overlap
            )
        if m and not in_capture and not per_call:
            self.density.observe(light.packed, light.pre, self.options.slots, light.heavy)
        if in_capture:
            self._keep(
                [xb, y, light.pre, light.packed, light.dense, *light.scratch, row_l1, up, *scratch]
            )
        result = from_bf16(y, x.dtype)
        if not save:
            return result
        return result, Activations(light.packed, light.heavy, ids, count, row_l1, up)


def capturing() -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


@functools.cache
def _device_name(device: int) -> str:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["name"].decode()


def _all_finite(*weights: Any) -> bool:
    import cupy

    with plain_reductions():
        return all(w is None or bool(cupy.isfinite(w).all()) for w in weights)


def dense_block(block: PreparedBlock, x: Any, y: Any) -> list[Any]:
    """The whole block in dense math: ``y = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``
    (or ``relu(x @ w_up.T) @ w_down.T``), cuBLAS GEMMs with bf16 intermediates."""
    g = gemm_nt(x, block.w_first)
    if not capturing():
        block.density.observe(None, g, block.options.slots)
    u = gemm_nt(x, block.w_up) if block.gated else None
    heavy_rows.relu_mul(g, u, g)
    gemm_nt(g, block.w_down, y)
    return [g, u]


# ---------------------------------------------------------------------- routes
@dataclass
class SaveTargets:
    """Where a training forward's route writes what the backward reads besides TwELL.

    Attributes:
        row_l1: float32 ``[M]``, the light rows' sums of ``|h|``.
        up: float32 ``[M, R]`` (gated; else None), the light rows' up products by pair
            (``Activations.up``).
    """

    row_l1: Any
    up: Any | None


#: ``route(block, x, y, save, decide)``; ``save`` (:class:`SaveTargets` or None) says
#: where the training forward wants its extra outputs (a route that packs TwELL takes it);
#: ``decide``: the route takes the density decision from the call's own rows, on the
#: device, between its gate and its gather (:meth:`PreparedBlock.decide`).
Route = Callable[[PreparedBlock, Any, Any, SaveTargets | None, bool], LightRows]


# The "fused" path keeps cuBLAS + scan at every batch size, though the epilogue route
# writes and scans no dense pre-activation: with the scan testing two bf16 per
# instruction it is ahead or level (H100, K=2048, N=5632, M=16384: 1.09-1.13 ms against
# 1.13-1.24 for the epilogue route; the same order on an H200).


def _route_fused(
    block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None, decide: bool = False
) -> LightRows:
    if save is not None:
        raise ValueError(
            "the fused route writes no TwELL, row_l1 or up products (use epilogue or pack)"
        )
    pre = gemm_nt(x, block.w_first)
    dense = block.decide(x.shape[0], pre=pre) if decide else None
    return LightRows(_light_from_pre(block, x, pre, y, dense), pre=pre, dense=dense)


def _light_from_pre(block: PreparedBlock, x: Any, pre: Any, y: Any, dense: Any = None) -> Any:
    """The light rows of ``y`` from the gate's pre-activation (light_rows.from_pre with the
    block's weights and options); returns the row flags it wrote."""
    heavy = alloc((x.shape[0],), np.uint8)
    gated = block.gated
    light_rows.from_pre(
        x if gated else None, pre, heavy, block.w_up if gated else None, block.w_down_t, y,
        tile=block.options.tile, slots=block.options.slots, max_row_nnz=block.max_row_nnz,
        dense=dense,
    )  # fmt: skip
    return heavy


def _from_twell(
    block: PreparedBlock, x: Any, y: Any, light: LightRows, save: SaveTargets | None
) -> LightRows:
    light_rows.from_twell(
        x if block.gated else None, light.packed, light.heavy,
        block.w_up if block.gated else None, block.w_down_t, y, tile=block.options.tile,
        slots=block.options.slots, max_row_nnz=block.max_row_nnz,
        row_l1=None if save is None else save.row_l1, up=None if save is None else save.up,
    )  # fmt: skip
    return light


def _decided(block: PreparedBlock, packed: Any, heavy: Any, decide: bool) -> Any | None:
    """The call's own decision from its TwELL words (every row flagged heavy when dense),
    or None when the route takes none."""
    return block.decide(packed.shape[0], packed=packed, heavy=heavy) if decide else None


def _route_epilogue(
    block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None, decide: bool = False
) -> LightRows:
    packed, heavy = gate_gemm.gate_pack(x, block.w_first, block.options.tile, block.options.slots)
    dense = _decided(block, packed, heavy, decide)
    return _from_twell(block, x, y, LightRows(heavy, packed=packed, dense=dense), save)


def _route_pack(
    block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None, decide: bool = False
) -> LightRows:
    pre = gemm_nt(x, block.w_first)
    packed, heavy = pack(pre, block.options.tile, block.options.slots)
    dense = _decided(block, packed, heavy, decide)
    return _from_twell(block, x, y, LightRows(heavy, pre=pre, packed=packed, dense=dense), save)


def _route_sliced(
    block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None, decide: bool = False
) -> LightRows:
    if save is not None:
        raise ValueError("the sliced route writes no row_l1 or up products (use epilogue)")
    pre = gemm_nt(x, block.w_first)
    packed, heavy = pack(pre, block.options.tile, block.options.slots)
    dense = _decided(block, packed, heavy, decide)
    scratch = light_rows_sliced.from_twell(
        x if block.gated else None, packed, heavy, block.w_up if block.gated else None,
        block.w_down_t, y, tile=block.options.tile, slots=block.options.slots,
        max_row_nnz=block.max_row_nnz,
    )  # fmt: skip
    return LightRows(heavy, pre=pre, packed=packed, scratch=scratch, dense=dense)


#: The light-row stage of each ``path``.
ROUTES: dict[str, Route] = {
    "fused": _route_fused,
    "epilogue": _route_epilogue,
    "pack": _route_pack,
    "sliced": _route_sliced,
}


#: Whether captured calls of the fused route with at most ``heavy_rows.FLAG_ROWS``
#: tokens take their heavy rows beside the light rows (:func:`fused_beside`).
BESIDE = True
#: CTAs per SM of :func:`fused_beside`'s heavy-row kernels (``heavy_rows.matmul``'s
#: ``per_sm``; their grid-stride loops take the rest). They usually find no heavy row,
#: and their CTAs wait for SMs that the light-row kernel holds, so they end after it: a
#: quarter of the default grid ends sooner. H200, K=2048, N=5632, the user's CUDA graph,
#: 4 against 1 (µs): uniform 128 / 256 / 512 / 1024 tokens 25.7 / 34.4 / 48.8 / 81.7
#: against 24.4 / 33.4 / 46.4 / 79.2; with heavy rows or a NaN row level or better;
#: the same bits (a grid-stride loop computes each tile alike). Not fewer: where heavy
#: rows come (a call the statistics expected none of, or ``density_switch=False``) the
#: kernels stream the weights, and ``per_sm=0.25`` took 1.8-3x as long as 1 (one heavy
#: row at 256 tokens: 225 against 90 us), for 0.2-0.8 us less where none comes.
BESIDE_PER_SM = 1.0
#: (device, stream) -> the second stream of :func:`fused_beside` for captures on that
#: stream (a stream belongs to one capture at a time: two threads capturing on two
#: streams get two).
_beside_streams: dict[tuple[int, int], Any] = {}


def fused_beside(block: PreparedBlock, x: Any, y: Any) -> tuple[LightRows, list[Any]]:
    """The fused route and the heavy-row stage of a call of at most
    ``heavy_rows.FLAG_ROWS`` tokens (no capacity), as two branches after the gate GEMM:
    the light rows (the by-columns kernel) on CuPy's current stream; on a second stream,
    the row flags alone (``light_rows.flags``: the rule the light rows apply, so the two
    branches split the rows between them) and then the heavy-row kernels, which read
    those flags. The current stream waits for the second at the end. Where no row is
    heavy, the heavy-row kernels end while the light rows still run, instead of after
    them (their launch latency, a few µs, left the call's critical path). The same
    kernels and flags as the sequential stages: the same bits. Used in CUDA-graph
    captures (twell's call graphs, the caller's), where the fork and join are graph
    edges; plain launches keep the stages in one stream (the events would cost host
    time). Returns the light rows (their flags) and the scratch buffers."""
    import cupy

    pre = gemm_nt(x, block.w_first)
    flags = alloc((x.shape[0],), np.uint8)
    main = cupy.cuda.get_current_stream()
    key = (x.device.id, main.ptr)
    side = _beside_streams.get(key)
    if side is None:
        side = _beside_streams[key] = cupy.cuda.Stream(non_blocking=True)
    fork = cupy.cuda.Event(disable_timing=True)
    fork.record(main)
    heavy = _light_from_pre(block, x, pre, y)
    side.wait_event(fork)
    with side:
        light_rows.flags(pre, flags, kdim=block.k, gated=block.gated, tile=block.options.tile,
                         slots=block.options.slots, max_row_nnz=block.max_row_nnz)  # fmt: skip
        scratch = heavy_rows_stage(block, x, LightRows(flags, pre=pre), None, None, y,
                                   capacity=0, per_sm=BESIDE_PER_SM)  # fmt: skip
        join = cupy.cuda.Event(disable_timing=True)
        join.record(side)
    main.wait_event(join)
    return LightRows(heavy, pre=pre), [flags, *scratch]


# ---------------------------------------------------------------------- heavy rows
def heavy_rows_stage(
    block: PreparedBlock,
    x: Any,
    light: LightRows,
    ids: Any,
    count: Any,
    y: Any,
    row_l1: Any | None = None,
    capacity: int | None = None,
    *,
    overlap: bool = False,
    per_sm: float = 4.0,
) -> list[Any]:
    """Dense math for the heavy rows ``ids[:count]``: writes their rows of ``y`` (and of
    ``row_l1``, float32 ``[M]``, their sums of ``|h|``, when given); the first
    ``capacity`` of them (default: the options' fixed capacity) through cuBLAS GEMMs.
    ``overlap``: the tensor-core kernels launch to start while the kernel before ends
    (``heavy_rows.matmul``: faster only when they find no row); ``per_sm``: their
    CTAs per SM (``heavy_rows.matmul``).
    ``ids`` and ``count`` None (at most ``heavy_rows.FLAG_ROWS`` rows, no capacity, no
    ``row_l1``): the heavy-row kernels read ``light.heavy`` and compact it themselves.

    Their pre-activations are the same rows of ``light.pre``, or, when the route wrote
    none, are recomputed here into the rows of a fresh ``[M, N]`` buffer (only the heavy
    rows of it are ever written or read). Returns the scratch buffers it used.
    """
    m = x.shape[0]
    pre = light.pre
    scratch: list[Any] = [light.heavy, ids, count]
    if capacity is None:
        capacity = block.options.capacity_rows(m)
    if capacity:
        ids, count = _capacity_gemms(block, x, pre, ids, count, capacity, y, scratch, row_l1)
        if capacity == m:
            return scratch
    max_rows = m - capacity
    flags = light.heavy if ids is None else None
    if flags is not None and (capacity or row_l1 is not None or m > heavy_rows.FLAG_ROWS):
        raise ValueError("heavy_rows_stage: ids=None only without a capacity and row_l1")
    if pre is None:
        pre = empty_bf16((m, block.n))
        scratch += [pre, heavy_rows.matmul(x, block.w_first, pre, ids, count, max_rows,
                                           a_by_id=True, out_by_id=True, flags=flags,
                                           overlap=overlap, per_sm=per_sm)]  # fmt: skip
    if block.gated:
        # h = relu(pre) * (x @ w_up.T) for heavy rows, written over their own `pre` rows.
        scratch.append(
            heavy_rows.matmul(x, block.w_up, pre, ids, count, max_rows, a_by_id=True,
                              out_by_id=True, gate=pre, gate_by_id=True, relu_gate=True,
                              flags=flags, overlap=overlap, per_sm=per_sm)
        )  # fmt: skip
        scratch.append(
            heavy_rows.matmul(pre, block.w_down, y, ids, count, max_rows, a_by_id=True,
                              out_by_id=True, flags=flags, overlap=overlap, per_sm=per_sm)
        )  # fmt: skip
        if row_l1 is not None:
            heavy_rows.row_abs_sum(pre, ids, count, max_rows, row_l1, by_id=True, relu=False)
    else:
        scratch.append(
            heavy_rows.matmul(pre, block.w_down, y, ids, count, max_rows, a_by_id=True,
                              out_by_id=True, relu_a=True, flags=flags, overlap=overlap,
                              per_sm=per_sm)
        )  # fmt: skip
        if row_l1 is not None:
            heavy_rows.row_abs_sum(pre, ids, count, max_rows, row_l1, by_id=True, relu=True)
    return scratch


def heavy_rows_counted(
    block: PreparedBlock, x: Any, light: LightRows, ids: Any, count: Any, y: Any
) -> list[Any]:
    """Dense math for the heavy rows ``ids[:count]`` whose cost follows their count:
    their x rows gathered, then the count build of the tensor-core GEMM
    (gate_gemm.matmul_counted) for the up product (and the gate, when the route wrote no
    pre-activation), ``h = relu(g) * bf16(u)``, and the down product written to their
    rows of ``y``. Every kernel reads the count on the device; with no heavy row each
    returns at once. A row's bits depend on the count only through the parts its
    reductions split into (gate_gemm.count_splits): on this call's rows, never on
    earlier calls. Returns the scratch buffers."""
    m, n, k = x.shape[0], block.n, block.k
    x_c = empty_bf16((m, k))
    # (ids ascending: a count of all rows reads x itself, with no copy)
    gate_gemm.gather_counted(x, ids, count, x_c, skip_all=True)
    scratch: list[Any] = [light.heavy, ids, count, x_c]
    if light.pre is None:  # the gate (or the non-gated block's up product) of these rows
        g = empty_bf16((m, n))
        part = gate_gemm.matmul_counted(x_c, block.w_first, count, g, a_all=x)
        gate_gemm.reduce_counted(part, g, count, m, k, g)
        g_ids = None
        scratch += [g, part]
    else:
        g, g_ids = light.pre, ids
    h = empty_bf16((m, n))
    if block.gated:
        part = gate_gemm.matmul_counted(x_c, block.w_up, count, h, gate=g, gate_ids=g_ids, a_all=x)
        gate_gemm.reduce_counted(part, h, count, m, k, h, gate=g, gate_ids=g_ids)
        scratch.append(part)
    else:
        gate_gemm.reduce_counted(None, None, count, m, k, h, gate=g, gate_ids=g_ids)
    part = gate_gemm.matmul_counted(h, block.w_down, count, y, out_ids=ids)
    gate_gemm.reduce_counted(part, y, count, m, n, y, out_ids=ids)
    return [*scratch, h, part]


def _capacity_gemms(
    block: PreparedBlock,
    x: Any,
    pre: Any | None,
    ids: Any,
    count: Any,
    capacity: int,
    y: Any,
    scratch: list[Any],
    row_l1: Any | None,
) -> tuple[Any, Any]:
    """The first ``capacity`` heavy rows through cuBLAS GEMMs of ``capacity`` rows: gather
    x and the pre-activation rows (zeros past the device count; ``pre=None``: recomputed
    from the gathered x), ``h = relu(g) * (x @ w_up.T)`` (or ``relu(g)``), ``h @ w_down.T``,
    scatter. Returns the ids and device count of the heavy rows left over."""
    rest = alloc((1,), np.int32)
    x_c = empty_bf16((capacity, block.k))
    heavy_rows.gather_rows(x, ids, count, x_c, rest)
    if pre is None:
        g_c = gemm_nt(x_c, block.w_first)
    else:
        g_c = empty_bf16((capacity, block.n))
        heavy_rows.gather_rows(pre, ids, count, g_c, rest)
    u_c = gemm_nt(x_c, block.w_up) if block.gated else None
    heavy_rows.relu_mul(g_c, u_c, g_c)
    if row_l1 is not None:
        heavy_rows.row_abs_sum(g_c, ids, count, capacity, row_l1, by_id=False, relu=False)
    y_c = gemm_nt(g_c, block.w_down)
    heavy_rows.scatter_rows(y_c, ids, count, y)
    scratch += [x_c, g_c, u_c, y_c, rest]
    return ids[capacity:], rest
