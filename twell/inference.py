"""The FFN block's inference on torch tensors as one opaque PyTorch op: ``twell::ffn``.

``twell::ffn(x, w_gate?, w_up, w_down, tile, slots, path, max_row_nnz, dense_capacity,
density_switch) -> y`` computes ``(relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T`` (``w_gate``
None: ``relu(x @ w_up.T) @ w_down.T``) for ``x [..., K]``, in ``x``'s dtype. The options
are :class:`twell.options.Options`' fields flattened to numbers and strings (``max_row_nnz`` -1:
the default; ``dense_capacity`` -1.0: ``"auto"``).

Why an op: ``torch.compile`` must never trace into twell's launch code. That code builds
kernel arguments from NumPy scalars and ``data_ptr()`` values; dynamo turns NumPy values
into tensors of its own and reads pointers at trace time, so a compiled frame would
launch kernels with the addresses of the tensors it was traced with. Those addresses
are stale at the next call, and the kernel that reads them faults asynchronously (an
"illegal memory access" that kills the process) before the Python error dynamo raises
is even seen. As a custom op with a fake implementation the call is one node of the
graph: ``fullgraph=True`` works in every mode, and the launch code only ever runs on
real tensors. :class:`twell.SparseFFN` and :class:`twell.torch.SparseMLP` call the op
when they are being compiled and its implementation directly otherwise (an eager call
pays no dispatcher).

Where it runs:

- **CUDA**: the prepared block of the weights (:func:`block_for`), with twell's own CUDA
  graphs (twell._graphs) for eager calls and for compiled code that runs eagerly, and
  with plain launches inside torch's CUDA-graph trees (``mode="reduce-overhead"``,
  transformers' static-cache ``generate``: torch captures the launches itself, and a
  graph of twell's own captured during the trees' warm-up would take memory from their
  pool). Every launch is on torch's current stream, and inside a capture nothing
  synchronises with the host or allocates outside torch's allocator.
- **CPU**: the float64 NumPy reference (``twell.reference.ffn``), cast back to ``x``'s
  dtype.

Prepared blocks are kept per (weights, options) in a registry keyed on the weights'
storage and version counter (:func:`block_for`): a weight changed in place is seen, the
block reads the weights where they lie without keeping them alive, and a block is
dropped once one of its weights' storage is freed.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Any

import numpy as np
import torch

from twell._interop import unview
from twell._validation import check_floating
from twell.options import Options

__all__ = ["block_for", "ffn", "forget", "op_arguments"]


# ---------------------------------------------------------------------- options
def op_arguments(options: Options) -> tuple[int, int, str, int, float, bool]:
    """``options`` as the op's trailing arguments."""
    return (
        options.tile,
        options.slots,
        options.path,
        -1 if options.max_row_nnz is None else options.max_row_nnz,
        -1.0 if options.auto_capacity else float(options.dense_capacity),
        options.density_switch,
    )


@functools.lru_cache(maxsize=256)
def _options(tile: int, slots: int, path: str, max_row_nnz: int, dense_capacity: float,
             density_switch: bool) -> Options:  # fmt: skip
    return Options(
        tile, slots, path, None if max_row_nnz < 0 else max_row_nnz,
        "auto" if dense_capacity < 0 else dense_capacity, bool(density_switch),
    )  # fmt: skip


# ---------------------------------------------------------------------- registry
def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter (it cannot change
        return -1  # in place outside inference mode)


def _identity(t: torch.Tensor | None) -> tuple | None:
    """What a weight is: its storage (alive while the registry holds a weak reference to
    it, so the id is not reused), where in it, its layout."""
    if t is None:
        return None
    return (t.untyped_storage()._cdata, t.data_ptr(), tuple(t.shape), t.dtype, t.device.index)


class _Block:
    """A registry entry: a prepared block of borrowed weights, the graphs of its calls,
    and what the weights were when it was built."""

    def __init__(self, weights: tuple[torch.Tensor | None, ...], options: Options) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        from twell._blocks import check_weights, prepare_gpu

        w_gate, w_up, w_down = weights
        arrays = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
        check_weights(arrays, options)  # as SparseFFN checks them: dtypes, shapes, device
        self.prepared, self.graphed = prepare_gpu("torch", arrays, options, borrow=True)
        self.versions = tuple(None if t is None else _version(t) for t in weights)
        self._refs = [StorageWeakRef(t.untyped_storage()) for t in weights if t is not None]

    def alive(self) -> bool:
        return not any(ref.expired() for ref in self._refs)

    def __call__(self, x: torch.Tensor, graphs: bool = True) -> torch.Tensor:
        """The block on a contiguous 2-D CUDA tensor with at least one row."""
        return self.graphed(x) if graphs else self.graphed.run(x)


#: weights' identities -> {options: _Block}
_blocks: dict[tuple, dict[Options, _Block]] = {}
#: Registry entries dropped so far (:func:`forget`, :func:`_sweep`): a :class:`Recent`
#: filled before a drop is stale.
_dropped = [0]


class Recent:
    """One caller's last validated eager CUDA call: what it checked (``x``'s shape, dtype
    and device; the weight tensors themselves, their addresses, version counters, shapes
    and dtypes; the options) and the block it found. A next call with all of these
    unchanged, and the block still alive in the registry's sense (its weights' storage
    not freed), goes to the block directly: the checks and the registry's lookup cost a
    replayed small call about a third of its host time, and a decode loop makes the same
    call per layer and token. Anything different takes the full path, which remembers
    anew. The memo is one tuple, written and read whole, so threads sharing a module
    (``nn.DataParallel``'s replicas share it) see one call's memo or another's, never a
    mix. The weights and the block are held by weak references, as the registry holds
    weights: a replaced weight or a block the registry dropped is not kept alive. A copy
    (``copy.deepcopy`` of a model, pickling) starts empty."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._memo: tuple | None = None

    def __reduce__(self) -> tuple:
        return (Recent, ())

    def __deepcopy__(self, memo: dict) -> Recent:
        return Recent()

    def remembered(self) -> _Block | None:
        """The block of the last call (None: nothing remembered, or gone)."""
        memo = self._memo
        return None if memo is None else memo[2]()

    def remember(self, x: torch.Tensor, weights: tuple[torch.Tensor | None, ...],
                 options: Options, block: _Block) -> None:  # fmt: skip
        key = (x.shape, x.dtype, x.get_device(), options, _dropped[0], x.is_cuda)
        state = tuple(
            None if t is None else (weakref.ref(t), t.data_ptr(), _version(t), t.shape, t.dtype)
            for t in weights
        )
        self._memo = (key, state, weakref.ref(block))

    def block_for(self, x: torch.Tensor, weights: tuple[torch.Tensor | None, ...],
                  options: Options) -> _Block | None:  # fmt: skip
        """The remembered block if this call is the remembered one's like, else None."""
        memo = self._memo
        if memo is None:
            return None
        key, state, block_ref = memo
        if (
            type(x) is not torch.Tensor  # a subclass takes the full path
            or x.shape != key[0]
            or x.dtype != key[1]
            or options is not key[3]
            or _dropped[0] != key[4]
            or len(weights) != len(state)
            or x.is_cuda != key[5]  # (the device's index alone: any kind of device)
            or x.get_device() != key[2]
            or not x.is_contiguous()
        ):
            return None
        for t, mine in zip(weights, state, strict=True):  # (lengths checked above)
            if mine is None or t is None:
                if mine is not t:
                    return None
            elif (
                mine[0]() is not t  # (a dead reference: another tensor)
                or t.data_ptr() != mine[1]
                or _version(t) != mine[2]
                or t.shape != mine[3]
                or t.dtype != mine[4]
            ):
                return None
        block = block_ref()
        return block if block is not None and block.alive() else None


def block_for(
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    options: Options,
    *,
    isolated: bool = False,
) -> _Block:
    """The prepared block of these CUDA weights and options (built on first use, rebuilt
    after a weight changed in place; a dropped weight's blocks go at the next build).
    ``isolated``: build it on a thread of its own (:func:`_build_isolated`)."""
    weights = (w_gate, w_up, w_down)
    key = tuple(_identity(t) for t in weights)
    by_options = _blocks.get(key)
    block = None if by_options is None else by_options.get(options)
    if block is not None and block.versions == tuple(
        None if t is None else _version(t) for t in weights
    ):
        return block
    _sweep()
    block = _build_isolated(weights, options) if isolated else _Block(weights, options)
    _blocks.setdefault(key, {})[options] = block
    return block


def _build_isolated(weights: tuple[torch.Tensor | None, ...], options: Options) -> _Block:
    """A block built on a short-lived thread, on a stream of its own: inside torch's
    CUDA-graph trees every allocation of the calling thread goes to the trees' memory
    pool (which must hold only what the trees track), and a capture in progress on the
    calling thread must not see the block's one-time work (the weights' finiteness check
    reads the host). The thread's work is finished when this returns."""
    device = weights[1].device
    result: dict[str, Any] = {}

    def build() -> None:
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    result["block"] = _Block(weights, options)
                stream.synchronize()
        except BaseException as error:  # noqa: BLE001 - raised on the calling thread
            result["error"] = error

    thread = threading.Thread(target=build, name="twell-prepare")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["block"]


def forget(w_gate: torch.Tensor | None, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """Drop the prepared blocks of these weights (for writes a version counter does not
    see: ``.data`` assignments, some fused optimizers)."""
    if not _blocks:  # (a training loop's every forward calls this: no key to build)
        return
    if _blocks.pop(tuple(_identity(t) for t in (w_gate, w_up, w_down)), None) is not None:
        _dropped[0] += 1


def _sweep() -> None:
    # list(): a copy taken at once, as another thread may be adding a block meanwhile
    for key, found in list(_blocks.items()):
        if not all(b.alive() for b in list(found.values())):
            if _blocks.pop(key, None) is not None:
                _dropped[0] += 1


def _in_graph_tree(device: torch.device) -> bool:
    """Whether the call runs inside torch's CUDA-graph trees (``reduce-overhead``): their
    warm-up and recording run on the trees' own stream. Unsure (a torch whose trees look
    otherwise): yes, so the call takes plain launches, right in either case."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        manager = trees.get_manager(device.index, create_if_none_exists=False)
        if manager is None:
            return False
        return torch.cuda.current_stream(device).cuda_stream == manager.stream.cuda_stream
    except Exception:  # noqa: BLE001 - internals of another version: take the safe path
        return True


# ---------------------------------------------------------------------- the op
def _check(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor,
           w_down: torch.Tensor, tile: int) -> None:  # fmt: skip
    """Dtypes (``TypeError``) and shapes (``ValueError``), naming the argument; the rest is
    checked where the block is prepared."""
    check_floating(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    if x.dim() < 1:
        raise ValueError(f"x: expected a tensor [..., K], got shape {tuple(x.shape)}")
    if w_up.dim() != 2:
        raise ValueError(f"w_up: expected a 2-D tensor [N, K], got shape {tuple(w_up.shape)}")
    n, k = w_up.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., {k}] (w_up's K), got {tuple(x.shape)}")
    if w_gate is not None and tuple(w_gate.shape) != (n, k):
        raise ValueError(f"w_gate: expected shape ({n}, {k}), got {tuple(w_gate.shape)}")
    if tuple(w_down.shape) != (k, n):
        raise ValueError(f"w_down: expected shape ({k}, {n}), got {tuple(w_down.shape)}")
    if n % tile:
        raise ValueError(f"w_up: N={n} is not a multiple of tile={tile}")


@torch.library.custom_op("twell::ffn", mutates_args=())
def ffn_op(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tile: int,
    slots: int,
    path: str,
    max_row_nnz: int,
    dense_capacity: float,
    density_switch: bool,
) -> torch.Tensor:
    """The block's output for ``x [..., K]`` (module docstring)."""
    options = _options(tile, slots, path, max_row_nnz, dense_capacity, density_switch)
    return _run(x, w_gate, w_up, w_down, options, graphs=None)


@ffn_op.register_fake
def _ffn_fake(x, w_gate, w_up, w_down, tile, slots, path, max_row_nnz, dense_capacity,
              density_switch):  # fmt: skip
    _check(x, w_gate, w_up, w_down, tile)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _run(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor,
         w_down: torch.Tensor, options: Options, graphs: bool | None,
         recent: Recent | None = None) -> torch.Tensor:  # fmt: skip
    """The op's implementation (``graphs`` None: decide from where the call runs);
    ``recent``: remembers the call's block where ``x`` and the weights were used in place."""
    _check(x, w_gate, w_up, w_down, options.tile)
    if x.device.type == "cpu":
        return _reference(x, w_gate, w_up, w_down, options)
    if x.device.type != "cuda":
        raise TypeError(f"x: expected a CPU or CUDA tensor, got one on {x.device}")
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} like x, got {t.device}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    weights = [t if t is None or t.is_contiguous() else t.contiguous()
               for t in (w_gate, w_up, w_down)]  # fmt: skip
    if graphs is None:  # the op, from compiled code: plain launches inside graph trees
        graphs = not _in_graph_tree(x.device)
    block = block_for(*weights, options, isolated=not graphs)
    originals = (w_gate, w_up, w_down)
    if (
        recent is not None
        and graphs
        and x2.data_ptr() == x.data_ptr()
        and all(a is b for a, b in zip(weights, originals, strict=True))
    ):
        recent.remember(x, originals, options, block)
    y = block(x2, graphs)
    return unview(y.view(x.shape))  # not a view of a buffer made inside the op


def _reference(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor,
               w_down: torch.Tensor, options: Options) -> torch.Tensor:  # fmt: skip
    from twell import reference

    def f64(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.detach().to(torch.float64).numpy()

    k = x.shape[-1]
    y = reference.ffn(f64(x.reshape(-1, k)), f64(w_gate), f64(w_up), f64(w_down),
                      tile=options.tile, slots=options.slots)  # fmt: skip
    return torch.from_numpy(np.ascontiguousarray(y)).to(x.dtype).reshape(x.shape)


def ffn(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    options: Options,
    arguments: tuple | None = None,
    recent: Recent | None = None,
) -> torch.Tensor:
    """The block's inference output for ``x [..., K]``: through ``twell::ffn`` while
    ``torch.compile`` traces, else its implementation directly (``arguments``:
    ``op_arguments(options)``, when the caller keeps them; ``recent``: the caller's
    memo of its last call, :class:`Recent`)."""
    if torch.compiler.is_compiling():
        args = op_arguments(options) if arguments is None else arguments
        return ffn_op(x, w_gate, w_up, w_down, *args)
    if recent is not None:
        block = recent.block_for(x, (w_gate, w_up, w_down), options)
        if block is not None:
            y = block(x.view(-1, x.shape[-1]), True)
            return unview(y.view(x.shape))
    return _run(x, w_gate, w_up, w_down, options, graphs=True, recent=recent)
