"""The public ops: validate, dispatch, restore the caller's array type.

NumPy arrays run the reference (``twell.reference``) on the CPU and return float64
NumPy arrays. CuPy arrays and PyTorch CUDA tensors run the GPU kernels
(``twell.kernels``) zero-copy through DLPack, on the caller's current stream, and return
the caller's type. Every check happens here, before anything is launched; the reference
and the kernels receive clean 2-D inputs.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import numpy as np

from twell import reference
from twell._arrays import bfloat16
from twell._blocks import prepare_gpu
from twell._interop import on_gpu
from twell._validation import (
    TORCH_FLOATS,
    Inputs,
    array_library,
    check_dtype,
    check_gpu_arrays,
    check_inputs,
    dense_where_needed,
    device_id,
)
from twell.formats import Hybrid, TwELL
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE, Options

# The validation layer lives in twell._validation, shared with twell.reference; these are
# its names in this module.
_Inputs = Inputs
_library = array_library
_check_dtype = check_dtype
_check_gpu_arrays = check_gpu_arrays
_device_id = device_id


def _validate(**kwargs: Any) -> Inputs:
    """Check every argument of an op (:func:`twell._validation.check_inputs`)."""
    return check_inputs(**kwargs)


# ---------------------------------------------------------------------- GPU plumbing
def _kernels():  # noqa: ANN202 - the twell.kernels module
    from twell import kernels

    return kernels


def _restore(result: Any, inputs: _Inputs, to_caller: Any = None) -> Any:
    """Give ``result`` the caller's array type (``to_caller``) and batch shape."""
    if to_caller is not None:
        result = to_caller(result)
    if inputs.batch_shape != (result.shape[0],):
        result = result.reshape(*inputs.batch_shape, result.shape[-1])
    return result


#: Blocks prepared by the functional :func:`ffn` for torch weights, most recent last.
_prepared_cache: collections.OrderedDict[tuple, tuple[list[Any], SparseFFN]] = (
    collections.OrderedDict()
)
_PREPARED_CACHE_SIZE = 8


def _cached_block(tensors: list[Any], tile: int, slots: int) -> tuple[tuple | None, Any]:
    """``(key, block)``: the functional :func:`ffn`'s cached :class:`SparseFFN` of these
    torch weights, or None (key None: not all torch tensors, nothing to key on). The key
    is (pointer, shape, dtype, version counter) of each weight, and a hit must hold the
    same tensor objects (so an in-place change, or a new tensor at a recycled address,
    is seen)."""
    if not all(t is None or hasattr(t, "_version") for t in tensors) or tensors[1] is None:
        return None, None
    key = (tile, slots, *[None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype,
                                                  t._version) for t in tensors])  # fmt: skip
    found = _prepared_cache.get(key)
    if found is not None and all(
        (r is None and t is None) or (r is not None and r() is t)
        for r, t in zip(found[0], tensors, strict=True)
    ):
        _prepared_cache.move_to_end(key)
        return key, found[1]
    return key, None


def _block_for(weights: dict[str, Any], tile: int, slots: int) -> SparseFFN:
    """The :class:`SparseFFN` of the functional :func:`ffn`: cached for torch weights
    (:func:`_cached_block`); built anew for CuPy weights, whose in-place changes leave no
    trace to key on."""
    tensors = [weights.get(name) for name in ("w_gate", "w_up", "w_down")]
    key, block = _cached_block(tensors, tile, slots)
    if key is None:
        return SparseFFN(*tensors, tile=tile, slots=slots)
    if block is not None:
        return block
    block = SparseFFN(*tensors, tile=tile, slots=slots)
    _prepared_cache[key] = ([None if t is None else weakref.ref(t) for t in tensors], block)
    while len(_prepared_cache) > _PREPARED_CACHE_SIZE:
        _prepared_cache.popitem(last=False)
    return block


# ---------------------------------------------------------------------- M = 0
def _empty_result(inputs: Inputs, *, bf16: bool = False) -> Any:
    """The GPU result of an op on no token: ``[*batch_shape, K]`` zeros of the caller's
    type, in ``x``'s dtype (bfloat16 for ``down``), on the arguments' device."""
    first = inputs.arrays.get("x")
    if first is None:
        first = next(iter(inputs.arrays.values()))
    shape = (*inputs.batch_shape, inputs.k)
    if inputs.library == "torch":
        import torch

        dtype = torch.bfloat16 if bf16 else first.dtype
        return torch.zeros(shape, dtype=dtype, device=first.device)
    import cupy

    dtype = bfloat16 if bf16 else np.dtype(first.dtype)
    with cupy.cuda.Device(_device_id(first)):
        if dtype == bfloat16:
            return cupy.zeros(shape, dtype=np.uint16).view(bfloat16)
        return cupy.zeros(shape, dtype=dtype)


def _empty_hybrid(inputs: Inputs, tile: int, slots: int) -> Hybrid:
    """``gate`` on no token, on the GPU: an empty CuPy-backed Hybrid ``[0, N]``."""
    import cupy

    n = inputs.n
    with cupy.cuda.Device(_device_id(inputs.arrays["x"])):
        packed = cupy.zeros((0, n // tile * slots), dtype=np.uint32)
        dense = cupy.zeros((0, n), dtype=np.uint16).view(bfloat16)
        rows = cupy.zeros(0, dtype=np.int32)
    return Hybrid._trusted(TwELL._trusted(packed, (0, n), tile, slots), rows, dense)


def _trust(h: Hybrid) -> Hybrid:
    """Mark a Hybrid the kernels produced as valid by construction (never re-checked)."""
    h._validated = True
    return h


# ---------------------------------------------------------------------- public ops
def gate(x: Any, w_gate: Any, *, tile: int = DEFAULT_TILE, slots: int = DEFAULT_SLOTS) -> Hybrid:
    """``relu(x @ w_gate.T)`` packed as a :class:`Hybrid` (TwELL + dense heavy rows).

    Args:
        x: ``[..., K]`` tokens (leading dimensions are flattened into M rows).
        w_gate: ``[N, K]`` gate weights (``torch.nn.Linear`` layout).
        tile: TwELL tile width; ``slots``: words per row-tile (docs/format.md).

    Returns:
        A Hybrid of shape ``[M, N]`` holding NumPy arrays for NumPy input, CuPy arrays
        for CuPy or torch input (the GPU path synchronises once to size ``dense_rows``).
    """
    inputs = _validate(
        x=x, weights={"w_gate": (w_gate, "NK")}, tile=tile, slots=slots, optional=(),
        empty_ok=True,
    )  # fmt: skip
    a = inputs.arrays
    if inputs.library == "numpy":
        return reference.gate(a["x"], a["w_gate"], tile=tile, slots=slots)
    if inputs.rows == 0:
        return _empty_hybrid(inputs, tile, slots)
    with on_gpu(inputs.library, inputs.arrays) as (g, _):
        return _trust(_kernels().gate(g["x"], g["w_gate"], Options(tile, slots)))


def down(h: Hybrid, w_down: Any) -> Any:
    """``h @ w_down.T`` for a Hybrid ``h`` ``[M, N]`` and ``w_down`` ``[K, N]``."""
    inputs = _validate(
        hidden=h, hidden_name="h", weights={"w_down": (w_down, "KN")}, optional=(), empty_ok=True
    )
    if inputs.library == "numpy":
        return reference.down(h, inputs.arrays["w_down"])
    if inputs.rows == 0:
        return _empty_result(inputs, bf16=True)
    with on_gpu(inputs.library, inputs.arrays) as (g, to_caller):
        h = dense_where_needed(h, weights=(g["w_down"],))  # non-finite w_down: dense math
        return _restore(_kernels().down(h, g["w_down"]), inputs, to_caller)


def gated_down(x: Any, g: Hybrid, w_up: Any, w_down: Any) -> Any:
    """``(g * (x @ w_up.T)) @ w_down.T``, forming ``x · w_up`` only where ``g != 0``."""
    inputs = _validate(
        x=x, hidden=g, hidden_name="g", weights={"w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        optional=(), empty_ok=True,
    )  # fmt: skip
    a = inputs.arrays
    if inputs.library == "numpy":
        return _restore(reference.gated_down(a["x"], g, a["w_up"], a["w_down"]), inputs)
    if inputs.rows == 0:
        return _empty_result(inputs)
    with on_gpu(inputs.library, inputs.arrays) as (d, to_caller):
        # A non-finite weight (every row) or token of x (its row): dense math.
        g = dense_where_needed(g, x=d["x"], weights=(d["w_up"], d["w_down"]))
        y = _kernels().gated_down(d["x"], g, d["w_up"], d["w_down"])
        return _restore(y, inputs, to_caller)


def ffn(
    x: Any,
    w_gate: Any | None,
    w_up: Any,
    w_down: Any,
    *,
    tile: int = DEFAULT_TILE,
    slots: int = DEFAULT_SLOTS,
) -> Any:
    """The whole FFN block: ``(relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    With ``w_gate=None`` the non-gated block ``relu(x @ w_up.T) @ w_down.T``.

    Args:
        x: ``[..., K]`` tokens.
        w_gate, w_up: ``[N, K]``; w_down: ``[K, N]`` (``torch.nn.Linear`` layout).
        tile, slots: TwELL geometry used for the hidden activation.

    Returns:
        ``[..., K]``: float64 NumPy for NumPy input; the caller's GPU type and dtype else.
    """
    # Weights seen before (torch, unchanged): they were checked when their block was
    # prepared, and the block checks x against them, so only x is checked (host time).
    _, block = _cached_block([w_gate, w_up, w_down], tile, slots)
    if block is not None and hasattr(x, "_version"):
        return block(x)
    inputs = _validate(
        x=x,
        weights={"w_gate": (w_gate, "NK"), "w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        tile=tile,
        slots=slots,
        empty_ok=True,
    )
    a = inputs.arrays
    if inputs.library == "numpy":
        y = reference.ffn(a["x"], a.get("w_gate"), a["w_up"], a["w_down"], tile=tile, slots=slots)
        return _restore(y, inputs)
    if inputs.rows == 0:
        return _empty_result(inputs)
    return _restore(_block_for(inputs.arrays, tile, slots)(a["x"]), inputs)


class SparseFFN:
    """An FFN block whose weights are prepared once for repeated calls.

    The GPU kernels want ``w_down`` transposed (``[N, K]``: one unit's down column
    contiguous) and the weights in bf16; this object builds those layouts once, where
    :func:`ffn` rebuilds them on every call. NumPy weights run the reference.

    The prepared layouts are a snapshot: after changing the weights in place, build a new
    ``SparseFFN`` (``twell.torch.SparseMLP`` does so by itself).

    Args:
        w_gate: ``[N, K]``, or ``None`` for the non-gated block.
        w_up: ``[N, K]``; w_down: ``[K, N]`` (``torch.nn.Linear`` layout); NumPy, CuPy or
            torch CUDA arrays, all of one library.
        tile, slots: TwELL geometry of the hidden activation.
        path: the GPU pipeline: ``"fused"`` (default; cuBLAS gate GEMM, then one kernel
            scans the pre-activation and gathers), ``"epilogue"`` (the gate GEMM packs
            TwELL in its epilogue, then the gather reads it), ``"pack"`` (cuBLAS, a
            packing kernel, the gather) or ``"sliced"`` (as ``"pack"``, the gather by
            column slices of the weights that stay in L2; ``"fused"`` takes it for weights
            of 96 MiB and more at M >= 4096; a training call takes ``"epilogue"``, the
            route that writes TwELL). Same results up to rounding order; docs/design.md
            compares them.
        max_row_nnz: tokens with more active units take the dense path (default 3% of N);
            any value gives the same result.
        dense_capacity: ``"auto"`` (default): sized per call for the share of heavy rows
            the density switch last measured (none before the first statistics or with
            ``density_switch=False``; a CUDA graph keeps the one in force when it was
            captured); or a fixed
            fraction of M of heavy rows done by fixed-size cuBLAS GEMMs (the rest by
            twell's heavy-row kernel). The GEMMs round like dense bf16 math, so heavy
            rows' bits depend on the capacity in force (give a number to fix them).
        density_switch: run whole batches in dense math when earlier calls were too dense,
            or held heavy rows at mid-sized batches, for the sparse path to pay (decided
            by batch size without a host synchronisation; docs/design.md; False: always
            sparse, e.g. for bit-for-bit comparisons of one path).

    Example:
        >>> block = twell.SparseFFN(w_gate, w_up, w_down)   # doctest: +SKIP
        >>> y = block(x)                                      # doctest: +SKIP
    """

    def __init__(
        self,
        w_gate: Any | None,
        w_up: Any,
        w_down: Any,
        *,
        tile: int = DEFAULT_TILE,
        slots: int = DEFAULT_SLOTS,
        path: str = "fused",
        max_row_nnz: int | None = None,
        dense_capacity: float | str = "auto",
        density_switch: bool = True,
    ) -> None:
        self.options = Options(tile, slots, path, max_row_nnz, dense_capacity, density_switch)
        self._weights = {"w_gate": (w_gate, "NK"), "w_up": (w_up, "NK"), "w_down": (w_down, "KN")}
        inputs = _validate(weights=self._weights, tile=tile, slots=slots)
        self.library = inputs.library
        self.shape = (int(w_up.shape[0]), int(w_up.shape[1]))  # (N, K)
        self._prepared = None
        if self.library != "numpy":
            self._device = _device_id(inputs.arrays["w_up"])
            self._prepared, self._graphed = prepare_gpu(inputs.library, inputs.arrays,
                                                        self.options)  # fmt: skip
        # The torch call a model makes most (contiguous [..., K], on the weights' GPU, a
        # float dtype): recognised by a few attribute reads instead of the full check.
        self._fast_torch: tuple[type, frozenset, Any] | None = None
        if self.library == "torch":
            import torch

            floats = frozenset(getattr(torch, name) for name in TORCH_FLOATS)
            self._fast_torch = (torch.Tensor, floats, torch.compiler.is_compiling)

    @property
    def gated(self) -> bool:
        """Whether the block has a gate projection."""
        return self._weights["w_gate"][0] is not None

    def _compiled(self, x: Any) -> Any:
        """The call as ``torch.compile`` sees it: the op ``twell::ffn`` (twell.inference),
        whose implementation prepares the weights once more, in its own registry."""
        from twell import inference

        w = self._weights
        return inference.ffn(x, w["w_gate"][0], w["w_up"][0], w["w_down"][0], self.options)

    def __repr__(self) -> str:
        n, k = self.shape
        kind = "gated" if self.gated else "non-gated"
        o = self.options
        return f"<SparseFFN {kind} K={k} N={n} tile={o.tile} slots={o.slots} ({self.library})>"

    def __call__(self, x: Any) -> Any:
        """The block's output for ``x`` ``[..., K]``, in the caller's array type.

        On the GPU only ``x`` is checked (the weights were checked when prepared); the
        call neither synchronises nor allocates outside the caller's allocator, so it can
        be captured by ``torch.cuda.graph`` (torch tensors) or a CuPy stream capture.
        """
        k = self.shape[1]
        fast = self._fast_torch
        if fast is not None and fast[2]():  # torch.compile is tracing: one opaque op
            return self._compiled(x)
        if (
            fast is not None
            and isinstance(x, fast[0])
            and x.dtype in fast[1]
            and x.is_cuda
            and x.get_device() == self._device  # (x.device builds a torch.device)
            and (dims := x.dim()) >= 2
            and x.shape[-1] == k
            and x.numel() > 0
            and x.is_contiguous()
        ):
            if dims == 2:
                return self._graphed(x)
            return self._graphed(x.view(-1, k)).view(x.shape)
        if hasattr(x, "shape") and (len(x.shape) < 1 or x.shape[-1] != k):
            raise ValueError(f"x: expected shape [..., {k}] (the block's K), got {tuple(x.shape)}")
        o = self.options
        if self._prepared is None:
            inputs = _validate(
                x=x, weights=self._weights, tile=o.tile, slots=o.slots, empty_ok=True
            )
            a = inputs.arrays
            y = reference.ffn(
                a["x"], a.get("w_gate"), a["w_up"], a["w_down"], tile=o.tile, slots=o.slots
            )
            return _restore(y, inputs)
        inputs = _validate(x=x, weights={}, empty_ok=True)
        if inputs.library != self.library or _device_id(x) != self._device:
            raise TypeError(
                f"x: expected a {self.library} array on GPU {self._device} like the block's "
                f"weights, got a {inputs.library} array"
                + (f" on GPU {_device_id(x)}" if inputs.library != "numpy" else "")
            )
        if inputs.rows == 0:
            return _empty_result(inputs)
        if inputs.library == "torch":  # a graph replay per call (twell._graphs)
            return _restore(self._graphed(inputs.arrays["x"]), inputs)
        with on_gpu(inputs.library, inputs.arrays) as (d, to_caller):
            return _restore(self._prepared(d["x"]), inputs, to_caller)
