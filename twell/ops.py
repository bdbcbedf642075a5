"""The public ops: validate, dispatch, restore the caller's array type.

NumPy arrays run the reference (``twell.reference``) on the CPU and return float64
NumPy arrays. CuPy arrays and PyTorch CUDA tensors run the GPU kernels
(``twell.kernels``) zero-copy through DLPack, on the caller's current stream, and return
the caller's type. Every check happens here, before anything is launched; the reference
and the kernels receive clean 2-D inputs.
"""

from __future__ import annotations

import collections
import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from twell import reference
from twell._arrays import FLOAT_DTYPES, library_of
from twell._interop import on_gpu
from twell.formats import Hybrid, check_layout
from twell.options import DEFAULT_SLOTS, DEFAULT_TILE, Options, check_width

_TORCH_FLOATS = ("bfloat16", "float16", "float32", "float64")


@dataclass
class _Inputs:
    """Validated inputs of one call: the library, flat 2-D arrays, the output shape."""

    library: str
    arrays: dict[str, Any]
    batch_shape: tuple[int, ...]


def _library(named: dict[str, Any]) -> str:
    """The one array library of all non-None arguments (TypeError if mixed)."""
    libraries = {}
    for name, array in named.items():
        if array is not None:
            try:
                libraries[name] = library_of(array)
            except TypeError as error:
                raise TypeError(f"{name}: {error}") from None
    if len(set(libraries.values())) > 1:
        listed = ", ".join(f"{name} is {lib}" for name, lib in libraries.items())
        raise TypeError(f"mixed array types: {listed}; pass arrays of one library")
    return next(iter(libraries.values()))


def _check_dtype(name: str, array: Any, library: str) -> None:
    if library == "torch":
        dtype = str(array.dtype).removeprefix("torch.")
        if dtype not in _TORCH_FLOATS:
            raise TypeError(f"{name}: expected a floating dtype {_TORCH_FLOATS}, got {dtype}")
        if array.device.type != "cuda":
            raise TypeError(
                f"{name}: torch tensors must live on a CUDA device (got {array.device}); "
                "pass NumPy arrays to run the CPU reference"
            )
        return
    if np.dtype(array.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating dtype (bfloat16, float16, float32, float64), "
            f"got {array.dtype}"
        )


def _check_matrix(name: str, array: Any, rows: int | None, columns: int | None) -> None:
    if array.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D matrix, got shape {tuple(array.shape)}")
    for axis, (want, got) in enumerate(zip((rows, columns), array.shape, strict=True)):
        if want is not None and want != got:
            raise ValueError(
                f"{name}: expected shape {(rows, columns)} (axis {axis} = {want}), "
                f"got {tuple(array.shape)}"
            )


def _validate(
    *,
    x: Any = None,
    hidden: Hybrid | None = None,
    hidden_name: str | None = None,
    weights: dict[str, tuple[Any, str]],
    tile: int | None = None,
    slots: int | None = None,
) -> _Inputs:
    """Check every argument of an op; return them flattened to 2-D.

    Args:
        x: the ``[..., K]`` input, or None for ops without one.
        hidden: a :class:`Hybrid` argument (its N and M constrain the rest).
        hidden_name: the name of that argument in the public op; set by the ops that
            take one (so that ``None`` passed for it is rejected too).
        weights: name → (array or None, layout) with layout ``"NK"`` or ``"KN"``.
        tile, slots: the TwELL geometry to check, when the op produces a TwELL.
    """
    named = {"x": x, **{name: array for name, (array, _) in weights.items()}}
    library = _library(named)
    if hidden_name is not None:
        if not isinstance(hidden, Hybrid):
            raise TypeError(f"{hidden_name}: expected a twell.Hybrid, got {type(hidden).__name__}")
        on_gpu = library in ("cupy", "torch")
        if (hidden.xp is np) == on_gpu:
            where = "GPU (CuPy)" if on_gpu else "NumPy"
            raise TypeError(
                f"{hidden_name}: expected a Hybrid holding {where} arrays like the others"
            )
    for name, array in named.items():
        if array is not None:
            _check_dtype(name, array, library)

    k = n = None
    batch_shape: tuple[int, ...] = ()
    flat: dict[str, Any] = {}
    if x is not None:
        if x.ndim < 1:
            raise ValueError(f"x: expected shape [..., K], got {tuple(x.shape)}")
        k = int(x.shape[-1])
        batch_shape = tuple(int(d) for d in x.shape[:-1])
        rows = math.prod(batch_shape)
        if rows < 1 or k < 1:
            raise ValueError(f"x: expected at least one token and K >= 1, got {tuple(x.shape)}")
        flat["x"] = x.reshape(rows, k)
    if hidden is not None:
        n = hidden.shape[1]
        if x is not None and hidden.shape[0] != flat["x"].shape[0]:
            raise ValueError(
                f"{hidden_name}: expected {flat['x'].shape[0]} rows (one per token of x), "
                f"got {hidden.shape[0]}"
            )
    n_name = "h"
    for name, (array, layout) in weights.items():
        if array is None:
            continue
        if n is None:
            n_name = name
        if layout == "NK":
            _check_matrix(name, array, n, k)
            n, k = int(array.shape[0]), int(array.shape[1])
        else:
            _check_matrix(name, array, k, n)
            k, n = int(array.shape[0]), int(array.shape[1])
        flat[name] = array
    if tile is not None:
        try:
            check_layout((1, n), tile, slots)
        except ValueError as error:
            # check_layout names its own ``shape``; here N comes from a weight.
            raise ValueError(str(error).replace("shape: ", f"{n_name}: ", 1)) from None
    if library != "numpy":
        _check_gpu_arrays(flat, hidden)
        if k is not None:
            check_width(k, "x" if x is not None else next(iter(flat)))
    return _Inputs(library, flat, batch_shape)


def _check_gpu_arrays(arrays: dict[str, Any], hidden: Hybrid | None) -> None:
    """Kernels ignore strides and run on one device: check contiguity and devices."""
    devices = {}
    for name, array in arrays.items():
        contiguous = (
            array.is_contiguous() if hasattr(array, "is_contiguous") else array.flags.c_contiguous
        )
        if not contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array (call .contiguous())")
        devices[name] = _device_id(array)
    if hidden is not None:
        devices["h"] = hidden.packed.device.id
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on GPU {dev}" for name, dev in devices.items())
        raise ValueError(f"arrays on different devices: {listed}")


def _device_id(array: Any) -> int:
    device = array.device
    return int(device.index if hasattr(device, "index") else device.id)


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
_prepared_cache: collections.OrderedDict[tuple, tuple[list[Any], Any]] = (
    collections.OrderedDict()
)
_PREPARED_CACHE_SIZE = 8


def _prepared_for(weights: dict[str, Any], views: dict[str, Any], options: Options) -> Any:
    """A prepared block for the functional ops: cached for torch weights, keyed on
    (pointer, shape, dtype, version counter) of each and checked to be the same tensor
    objects (so an in-place change or a new tensor at a recycled address is seen);
    built anew for CuPy weights, whose in-place changes leave no trace to key on."""
    tensors = [weights.get(name) for name in ("w_gate", "w_up", "w_down")]
    prepared = _kernels().PreparedBlock
    if not any(hasattr(t, "_version") for t in tensors):
        return prepared(views.get("w_gate"), views["w_up"], views["w_down"], options)
    key = (options, *[None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype, t._version)
                      for t in tensors])  # fmt: skip
    found = _prepared_cache.get(key)
    if found is not None and all(
        (r is None and t is None) or (r is not None and r() is t)
        for r, t in zip(found[0], tensors, strict=True)
    ):
        _prepared_cache.move_to_end(key)
        return found[1]
    block = prepared(views.get("w_gate"), views["w_up"], views["w_down"], options)
    _prepared_cache[key] = ([None if t is None else weakref.ref(t) for t in tensors], block)
    while len(_prepared_cache) > _PREPARED_CACHE_SIZE:
        _prepared_cache.popitem(last=False)
    return block


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
    inputs = _validate(x=x, weights={"w_gate": (w_gate, "NK")}, tile=tile, slots=slots)
    a = inputs.arrays
    if inputs.library == "numpy":
        return reference.gate(a["x"], a["w_gate"], tile=tile, slots=slots)
    with on_gpu(inputs.library, inputs.arrays) as (g, _):
        return _kernels().gate(g["x"], g["w_gate"], Options(tile, slots))


def down(h: Hybrid, w_down: Any) -> Any:
    """``h @ w_down.T`` for a Hybrid ``h`` ``[M, N]`` and ``w_down`` ``[K, N]``."""
    inputs = _validate(hidden=h, hidden_name="h", weights={"w_down": (w_down, "KN")})
    inputs.batch_shape = (h.shape[0],)
    if inputs.library == "numpy":
        return reference.down(h, inputs.arrays["w_down"])
    with on_gpu(inputs.library, inputs.arrays) as (g, to_caller):
        return _restore(_kernels().down(h, g["w_down"]), inputs, to_caller)


def gated_down(x: Any, g: Hybrid, w_up: Any, w_down: Any) -> Any:
    """``(g * (x @ w_up.T)) @ w_down.T``, forming ``x · w_up`` only where ``g != 0``."""
    inputs = _validate(
        x=x, hidden=g, hidden_name="g", weights={"w_up": (w_up, "NK"), "w_down": (w_down, "KN")}
    )
    a = inputs.arrays
    if inputs.library == "numpy":
        return _restore(reference.gated_down(a["x"], g, a["w_up"], a["w_down"]), inputs)
    with on_gpu(inputs.library, inputs.arrays) as (d, to_caller):
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
    inputs = _validate(
        x=x,
        weights={"w_gate": (w_gate, "NK"), "w_up": (w_up, "NK"), "w_down": (w_down, "KN")},
        tile=tile,
        slots=slots,
    )
    a = inputs.arrays
    if inputs.library == "numpy":
        y = reference.ffn(a["x"], a.get("w_gate"), a["w_up"], a["w_down"], tile=tile, slots=slots)
        return _restore(y, inputs)
    with on_gpu(inputs.library, inputs.arrays) as (d, to_caller):
        block = _prepared_for(inputs.arrays, d, Options(tile, slots))
        return _restore(block(d["x"]), inputs, to_caller)


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
            TwELL in its epilogue, then the gather reads it) or ``"pack"`` (cuBLAS, a
            packing kernel, the gather). Same results; docs/design.md compares them.
        max_row_nnz: tokens with more active units take the dense path (default 3% of N);
            any value gives the same result.
        dense_capacity: fraction of M of heavy rows done by fixed-size cuBLAS GEMMs (the
            rest by twell's heavy-row kernel); pays on models with many heavy tokens.
        density_switch: run whole batches in dense math when earlier calls were too dense
            for the sparse path to pay (decided without a host synchronisation; False:
            always sparse, e.g. for bit-for-bit comparisons of one path).

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
        dense_capacity: float = 0.0,
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
            with on_gpu(inputs.library, inputs.arrays) as (g, _):
                self._prepared = _kernels().PreparedBlock(
                    g.get("w_gate"), g["w_up"], g["w_down"], self.options
                )

    @property
    def gated(self) -> bool:
        """Whether the block has a gate projection."""
        return self._weights["w_gate"][0] is not None

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
        if hasattr(x, "shape") and (len(x.shape) < 1 or x.shape[-1] != k):
            raise ValueError(f"x: expected shape [..., {k}] (the block's K), got {tuple(x.shape)}")
        o = self.options
        if self._prepared is None:
            inputs = _validate(x=x, weights=self._weights, tile=o.tile, slots=o.slots)
            a = inputs.arrays
            y = reference.ffn(
                a["x"], a.get("w_gate"), a["w_up"], a["w_down"], tile=o.tile, slots=o.slots
            )
            return _restore(y, inputs)
        inputs = _validate(x=x, weights={})
        if inputs.library != self.library or _device_id(x) != self._device:
            raise TypeError(
                f"x: expected a {self.library} array on GPU {self._device} like the block's "
                f"weights, got a {inputs.library} array"
                + (f" on GPU {_device_id(x)}" if inputs.library != "numpy" else "")
            )
        with on_gpu(inputs.library, inputs.arrays) as (d, to_caller):
            return _restore(self._prepared(d["x"]), inputs, to_caller)
