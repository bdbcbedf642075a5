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

2. **Heavy rows** — :func:`heavy_rows_stage`: the heavy rows' ids are compacted on the
   device (by a kernel of their own, or, for inference batches of at most
   ``heavy_rows.FLAG_ROWS`` tokens without ``dense_capacity``, inside the tensor-core
   kernels that do their dense math: one launch less) and their dense math runs on
   tensor cores (heavy_rows.cu), the first ``ceil(dense_capacity * M)`` of them
   optionally through fixed-size cuBLAS GEMMs.

Inference calls of the ``"fused"`` path with at most ``decode_units.MAX_ROWS`` tokens
(decode) take neither stage: decode_units.py computes the whole block in two launches,
dividing the work among the SMs by hidden unit (each active unit's weight rows read once
for all tokens), with no heavy rows; it feeds the density switch from its bit masks.

Two cases take plain dense math for the whole batch instead (:func:`dense_block`: three
cuBLAS GEMMs and one elementwise kernel, the dense block's own rounding points):

- a weight holds NaN or Inf (checked once, when the block is prepared): dense math then
  spreads it to outputs no sparse path would touch (``0 * NaN``), and twell keeps that;
- the activations are too dense for the sparse path to pay (:class:`DensitySwitch`).

Nothing synchronises with the host, so a forward pass can be captured in a CUDA graph;
no step uses atomics, so the same inputs give the same output bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twell.kernels import decode_units, gate_gemm, heavy_rows, light_rows, light_rows_sliced
from twell.kernels.backward import Activations, row_capacity
from twell.kernels.buffers import alloc, empty_bf16, keep_for_graph
from twell.kernels.convert import as_bf16, from_bf16, transpose
from twell.kernels.cublas import gemm_nt
from twell.kernels.pack import pack
from twell.options import Options, auto_capacity, check_width


@dataclass
class LightRows:
    """What a route hands to the heavy-row stage.

    Attributes:
        heavy: uint8 ``[M]``, 1 for the rows the route left to the dense path.
        pre: the dense bf16 gate pre-activation ``[M, N]`` when the route wrote one, or
            None: then the heavy rows' pre-activations are recomputed from ``x``.
        packed: the TwELL words of ``relu(pre)`` when the route packed them, else None.
        scratch: other buffers the route's kernels use (kept alive with a captured call).
    """

    heavy: Any
    pre: Any | None = None
    packed: Any | None = None
    scratch: list[Any] = field(default_factory=list)


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

    def forward(self, x: Any, *, save: bool = False) -> Any:
        """The block's output for ``x [M, K]`` (``x``'s dtype); no host synchronisation.

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
        y = empty_bf16((m, k))
        in_capture = capturing()
        by_unit = not save and self.weights_finite and self._by_unit(m)
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
        light = ROUTES[path](self, xb, y, targets) if m else LightRows(alloc((0,), np.uint8))
        auto = not save and self.options.auto_capacity
        capacity = self.options.capacity_rows(m, self.density.capacity(m) if auto else None)
        if not save and m <= heavy_rows.FLAG_ROWS and not capacity:
            # Small batches: the heavy-row kernels compact the row flags themselves.
            ids = count = None
        else:  # launched to start as the route's last kernel ends
            ids, count = heavy_rows.compact_rows(light.heavy, overlap=True)
        # The heavy-row kernels start while the kernel before them ends where no heavy row
        # is expected (they then find none and end at once).
        overlap = not self.density.expects_heavy(m)
        scratch = (
            heavy_rows_stage(self, xb, light, ids, count, y, row_l1, capacity, overlap=overlap)
            if m
            else []
        )
        if m and not in_capture:
            self.density.observe(light.packed, light.pre, self.options.slots, light.heavy)
        if in_capture:
            self._keep([xb, y, light.pre, light.packed, *light.scratch, row_l1, up, *scratch])
        out = from_bf16(y, x.dtype)
        if not save:
            return out
        return out, Activations(light.packed, light.heavy, ids, count, row_l1, up)


def capturing() -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


def _all_finite(*weights: Any) -> bool:
    import cupy

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


#: Where the sparse path stops paying, by batch size: ``(M, mean active units per row as
#: a fraction of N)`` at which the default route and :func:`dense_block` take the same
#: time, measured on an H100 at K=2048, N=5632 (``bench/dev_crossover.py``, CUDA graphs,
#: weights from DRAM; docs/perf-log.md). Linear in log2(M) between the points, constant
#: past the ends. Decode batches gain up to high densities (the by-unit route reads each
#: active unit once for all tokens); near 256 tokens the dense GEMMs are at their most
#: efficient per token and the sparse routes at their least; prefill batches gain up to
#: about 1%. Points up to 192 tokens from the eighth session; from 256 on, the fifteenth
#: session's (``--mid``, record ``..._2026-11-26_crossover_mid.json``: the fused route
#: with the SIMD scan; before, 256 0.22%, 512 0.45%, 1024 0.6%, 2048 0.7%, 4096 0.95%,
#: 8192 1%).
CROSSOVER = (
    (1, 0.2), (4, 0.1), (16, 0.05), (32, 0.02), (64, 0.012), (128, 0.0065), (192, 0.0045),
    (256, 0.0032), (384, 0.0056), (512, 0.0066), (768, 0.0083), (1024, 0.0072),
    (1536, 0.0078), (2048, 0.0086), (3072, 0.009), (4096, 0.0099), (8192, 0.0113),
)  # fmt: skip
#: Batch sizes ``[low, high)`` at which a single heavy row makes the dense path pay: the
#: heavy-row stage costs 40-91 µs at K=2048, N=5632 whatever the number of heavy rows
#: (a full read of w_up and w_down for a few rows), which is most of the sparse path's
#: gain below about 4096 tokens; in the by-unit route a token with hundreds of units
#: holds up its token group from 48 tokens on (docs/perf-log.md).
HEAVY_DENSE = (48, 4096)


@functools.lru_cache(maxsize=1024)
def crossover(m: int) -> float:
    """:data:`CROSSOVER` at ``m`` tokens (a fraction of N); cached (every replayed call
    asks: whoever changes :data:`CROSSOVER` calls ``crossover.cache_clear()``)."""
    points = CROSSOVER
    if m <= points[0][0]:
        return points[0][1]
    for (m0, f0), (m1, f1) in zip(points, points[1:], strict=False):
        if m <= m1:
            t = (math.log2(m) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
            return float(f0 + t * (f1 - f0))
    return points[-1][1]


class DensitySwitch:
    """Decides, without a host synchronisation, when a batch is too dense for the sparse
    path, from the statistics of the calls before.

    Every :attr:`EVERY`-th eager call (and the one after :meth:`measure_next`: the call
    graphs' refresh calls, twell._graphs.REFRESH) measures on the device the mean number
    of active units per row (from a strided sample of :attr:`SAMPLE_ROWS` rows: their TwELL count
    words when the route packed them, else their positive pre-activations; the dense path
    samples its own gate GEMM the same way; the by-unit route counts every row from its
    masks) and the share of heavy rows, and copies both to pinned host memory behind an
    event. A heavy row is one the route left to the dense path (more than ``max_row_nnz``
    units, a tile past its slots, or a non-finite value: the route's flags, every row); the
    by-unit route and the dense path, which have no flags, count rows above
    ``max_row_nnz`` active units (every row). A batch of fewer than
    :attr:`SHARE_ROWS` rows leaves the share as it was (one decode token would set it to
    0 or 1). A later call reads them only
    once the event has completed, so the host never waits; the decision follows the data
    with a lag of a few calls. An ``m``-token call runs :func:`dense_block` when the mean
    is above :meth:`threshold` (``m``) or when it expects a heavy row and ``m`` lies in
    :data:`HEAVY_DENSE` (docs/design.md). Inside a CUDA-graph capture nothing is measured
    or read: the statistics in force decide.

    Both paths are correct; they round differently, so the same input gives the same
    bits as long as the decision stays the same (``dense`` tells which one ran last).
    """

    #: Rows sampled for an estimate (strided over the batch).
    SAMPLE_ROWS = 64
    #: Eager calls between two estimates: an estimate costs a few small launches and
    #: reductions (on an H100's host, about 0.1–0.3 ms per call when done every call).
    EVERY = 8
    #: Fewest rows whose share of heavy rows is taken.
    SHARE_ROWS = 16

    def __init__(self, n: int, row_limit: int, enabled: bool = True) -> None:
        self.n = n
        self.row_limit = row_limit
        self.enabled = enabled
        self.estimate: float | None = None  # mean active units per row
        self.heavy_share = 0.0  # share of heavy rows
        self.dense = False
        self._pending: tuple[Any, Any] | None = None
        self._calls = 0
        self._due = False

    def threshold(self, m: int) -> float:
        """Mean active units per row above which an ``m``-token call runs dense math
        (:func:`crossover` of N, at least 8)."""
        return max(8.0, self.n * crossover(m))

    def go_dense(self, m: int, capturing: bool) -> bool:
        """Whether an ``m``-token call runs the dense path (reads a finished estimate,
        never waits; inside a capture, reads nothing)."""
        if not capturing and self._pending is not None and self._pending[1].done:
            estimate, share = (float(v) for v in self._pending[0])
            self.estimate = estimate
            if not math.isnan(share):  # NaN: too few rows to tell
                self.heavy_share = share
            self._pending = None
        low, high = HEAVY_DENSE
        self.dense = (
            self.enabled
            and self.estimate is not None
            and (self.estimate > self.threshold(m) or (low <= m < high and self.expects_heavy(m)))
        )
        return self.dense

    def expects_heavy(self, m: int) -> bool:
        """Whether an ``m``-token call is expected to hold a heavy row (by the last
        measured share; none measured: no)."""
        return self.heavy_share * m >= 0.5

    def measure_next(self) -> None:
        """Make the next eager call measure, whatever :attr:`EVERY` says (the call graphs'
        refresh calls, twell._graphs.REFRESH: otherwise only one of every EVERY of them
        would); with an estimate still in flight, the first call after it lands."""
        self._due = self.enabled

    def _measures(self) -> bool:
        """Whether this eager call measures (counts the call)."""
        self._calls += 1
        if not self.enabled or self._pending is not None:
            return False
        if not self._due and self._calls % self.EVERY != 1:
            return False
        self._due = False
        return True

    def capacity(self, m: int) -> float:
        """``dense_capacity="auto"`` for an ``m``-token call: the capacity
        (:func:`twell.options.auto_capacity`) for the heavy rows the statistics in force
        expect, ``heavy_share * m`` (0 before the first statistics or with the switch off)."""
        if not self.enabled or self.estimate is None:
            return 0.0
        return auto_capacity(math.floor(self.heavy_share * m + 0.5), m)

    def observe_masks(self, masks: Any) -> None:
        """:meth:`observe` from decode_units.py's kept-unit bit masks (uint16 ``[M, N/16]``,
        every row: a few tokens, so all of them are counted). A row that keeps every unit
        (a non-finite x: its gate is NaN everywhere) is left out of the mean, as long as
        one row is not, and counts as heavy."""
        import cupy

        if not self._measures():
            return
        counts = _popcount8(masks.device.id)[masks.view(cupy.uint8)].sum(axis=1, dtype=cupy.float32)
        usual = counts < 16 * masks.shape[1]
        taken = cupy.maximum(usual.sum(dtype=cupy.float32), 1.0)
        per_row = cupy.where(usual.any(), (counts * usual).sum() / taken, counts.mean())
        heavy = None
        if masks.shape[0] >= self.SHARE_ROWS:
            heavy = (counts > self.row_limit).mean(dtype=cupy.float32)
        self._publish(per_row, heavy)

    def observe(self, packed: Any | None, pre: Any, slots: int, heavy: Any | None = None) -> None:
        """Start the estimate of this call (a few small kernels and an async copy): the
        mean from a row sample; the share of heavy rows from ``heavy``, the route's uint8
        row flags, or without them (the dense path) from every row of ``pre``."""
        import cupy

        if not self._measures():
            return
        m = pre.shape[0] if packed is None else packed.shape[0]
        rows = sample_rows(m, self.SAMPLE_ROWS)
        if packed is not None:
            words = packed[rows, ::slots][: self.SAMPLE_ROWS]
            counts = words.sum(axis=1, dtype=cupy.float32)
        else:
            sample = pre[rows][: self.SAMPLE_ROWS].view(cupy.int16)
            counts = (sample > 0).sum(axis=1, dtype=cupy.float32)
        if m < self.SHARE_ROWS:
            share = None
        elif heavy is not None:
            share = (heavy != 0).mean(dtype=cupy.float32)
        else:
            # Every row where the share decides the path (a sample misses the rare heavy
            # rows); above, the sample (the share then only sizes "auto", and counting
            # every row would take a temporary of M x N bytes).
            rows_in = pre if m < HEAVY_DENSE[1] else pre[rows][: self.SAMPLE_ROWS]
            units = (rows_in.view(cupy.int16) > 0).sum(axis=1, dtype=cupy.int32)
            share = (units > self.row_limit).mean(dtype=cupy.float32)
        self._publish(counts.mean(), share)

    def _publish(self, per_row: Any, heavy: Any | None) -> None:
        """Copy the device statistics to pinned memory behind an event (read by go_dense);
        ``heavy`` None (a batch under :attr:`SHARE_ROWS` rows) publishes NaN: the share in
        force stays."""
        import cupy

        if heavy is None:
            heavy = cupy.full((), np.nan, dtype=cupy.float32)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(8), np.float32, 2)
        cupy.stack([per_row.reshape(()), heavy.reshape(())]).get(out=host, blocking=False)
        event = cupy.cuda.Event(disable_timing=True)
        event.record()
        self._pending = (host, event)


@functools.cache
def _popcount8(device: int) -> Any:
    """Set bits of every byte value, on ``device`` (uint8 ``[256]``)."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray([bin(b).count("1") for b in range(256)], dtype=cupy.uint8)


def sample_rows(m: int, rows: int) -> slice:
    """About ``rows`` of ``m`` rows, strided, for the density estimate: an odd stride
    (so a sample of ``rows`` rows falls once on every residue modulo any power of two up
    to ``rows``; fewer rows where ``m // rows`` is even and small),
    starting half a stride in. A batch of packed sequences whose first tokens fire far
    more units than the rest (a real model's BOS sinks; the ``paperlike`` workload's) is
    then sampled at its true share: a stride of ``m / rows`` from row 0 took every
    sequence's first token whenever the sequence length divided it, and sent such
    batches to the dense path (``paperlike``, M=16384: an estimate of 86 active units per
    row for a mean of 29)."""
    step = max(1, m // rows) | 1
    return slice(step // 2, None, step)


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


#: ``route(block, x, y, save)``; ``save`` (:class:`SaveTargets` or None) says where the
#: training forward wants its extra outputs (a route that packs TwELL takes it).
Route = Callable[[PreparedBlock, Any, Any, SaveTargets | None], LightRows]


# The "fused" path of a gated block took the "epilogue" route from 4096 tokens until the
# fifteenth session: the epilogue packs TwELL inside the gate GEMM, so the 2 * M * N bytes
# of dense pre-activation are neither written nor scanned, and was level with or ahead of
# cuBLAS + scan there (docs/perf-log.md, eleventh session). Since the scan tests two bf16
# per instruction (light_rows.SCAN_SIMD), cuBLAS + scan is ahead or level everywhere:
# H100, K=2048, N=5632, graph / back to back / per call, ms, fused against epilogue:
# uniform 4096 0.302 / 0.303 / 0.346 against 0.327 / 0.327 / 0.370, 8192 0.556 / 0.556 /
# 0.615 against 0.583 / 0.584 / 0.649, 16384 1.089-1.129 / 1.113-1.156 / 1.183-1.201
# against 1.127 / 1.160 / 1.240; heavy 16384 1.122-1.130 / 1.133-1.136 against 1.166 /
# 1.195; paperlike 16384 1.113-1.115 / 1.123-1.127 against 1.177 / 1.203 (H200: the same
# order). Records bench/results/*_2026-11-26_paths_*.json.


def _route_fused(block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None) -> LightRows:
    if save is not None:
        raise ValueError(
            "the fused route writes no TwELL, row_l1 or up products (use epilogue or pack)"
        )
    pre = gemm_nt(x, block.w_first)
    heavy = alloc((x.shape[0],), np.uint8)
    light_rows.from_pre(
        x if block.gated else None, pre, heavy, block.w_up if block.gated else None,
        block.w_down_t, y, tile=block.options.tile, slots=block.options.slots,
        max_row_nnz=block.max_row_nnz,
    )  # fmt: skip
    return LightRows(heavy, pre=pre)


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


def _route_epilogue(block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None) -> LightRows:
    packed, heavy = gate_gemm.gate_pack(x, block.w_first, block.options.tile, block.options.slots)
    return _from_twell(block, x, y, LightRows(heavy, packed=packed), save)


def _route_pack(block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None) -> LightRows:
    pre = gemm_nt(x, block.w_first)
    packed, heavy = pack(pre, block.options.tile, block.options.slots)
    return _from_twell(block, x, y, LightRows(heavy, pre=pre, packed=packed), save)


def _route_sliced(block: PreparedBlock, x: Any, y: Any, save: SaveTargets | None) -> LightRows:
    if save is not None:
        raise ValueError("the sliced route writes no row_l1 or up products (use epilogue)")
    pre = gemm_nt(x, block.w_first)
    packed, heavy = pack(pre, block.options.tile, block.options.slots)
    scratch = light_rows_sliced.from_twell(
        x if block.gated else None, packed, heavy, block.w_up if block.gated else None,
        block.w_down_t, y, tile=block.options.tile, slots=block.options.slots,
        max_row_nnz=block.max_row_nnz,
    )  # fmt: skip
    return LightRows(heavy, pre=pre, packed=packed, scratch=scratch)


#: The light-row stage of each ``path``.
ROUTES: dict[str, Route] = {
    "fused": _route_fused,
    "epilogue": _route_epilogue,
    "pack": _route_pack,
    "sliced": _route_sliced,
}


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
) -> list[Any]:
    """Dense math for the heavy rows ``ids[:count]``: writes their rows of ``y`` (and of
    ``row_l1``, float32 ``[M]``, their sums of ``|h|``, when given); the first
    ``capacity`` of them (default: the options' fixed capacity) through cuBLAS GEMMs.
    ``overlap``: the tensor-core kernels launch to start while the kernel before ends
    (``heavy_rows.matmul``: faster only when they find no row).
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
                                           overlap=overlap)]  # fmt: skip
    if block.gated:
        # h = relu(pre) * (x @ w_up.T) for heavy rows, written over their own `pre` rows.
        scratch.append(
            heavy_rows.matmul(x, block.w_up, pre, ids, count, max_rows, a_by_id=True,
                              out_by_id=True, gate=pre, gate_by_id=True, relu_gate=True,
                              flags=flags, overlap=overlap)
        )  # fmt: skip
        scratch.append(
            heavy_rows.matmul(pre, block.w_down, y, ids, count, max_rows, a_by_id=True,
                              out_by_id=True, flags=flags, overlap=overlap)
        )  # fmt: skip
        if row_l1 is not None:
            heavy_rows.row_abs_sum(pre, ids, count, max_rows, row_l1, by_id=True, relu=False)
    else:
        scratch.append(
            heavy_rows.matmul(pre, block.w_down, y, ids, count, max_rows, a_by_id=True,
                              out_by_id=True, relu_a=True, flags=flags, overlap=overlap)
        )  # fmt: skip
        if row_l1 is not None:
            heavy_rows.row_abs_sum(pre, ids, count, max_rows, row_l1, by_id=True, relu=True)
    return scratch


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
