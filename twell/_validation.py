"""The validation layer: every check of the public ops and of the reference, in one place.

``twell.ops`` (NumPy, CuPy and torch) and ``twell.reference`` (NumPy) call
:func:`check_inputs` before they compute anything, so a bad argument raises the same
``TypeError``/``ValueError`` with the same message whichever entry point it reached. The
message starts with the name of the argument the caller passed, then says what was
expected and what was given (docs/ops.md, "Errors and bad input").

What the layer guarantees to the code behind it:

- every array comes from one library, has a floating dtype and a consistent shape; ``x``
  is flattened to ``[M, K]`` (M may be 0 where the caller allows it);
- a :class:`~twell.formats.Hybrid` argument has been validated once before its first
  read (:func:`~twell.formats.ensure_valid`: objects twell built are trusted, objects
  wrapped around user buffers are checked on first use);
- :func:`dense_where_needed` hands back a Hybrid whose rows are read densely wherever
  the sparse path would skip a non-finite value that dense math propagates (a NaN or Inf
  in a weight, or in a token of ``x``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from twell._arrays import FLOAT_DTYPES, dtype_message, library_of, non_finite
from twell.formats import Hybrid, TwELL, check_layout, ensure_valid
from twell.options import check_width

__all__ = [
    "ABSENT",
    "Inputs",
    "array_library",
    "check_accumulation",
    "check_activation",
    "check_dtype",
    "check_floating",
    "check_gpu_arrays",
    "check_inputs",
    "check_like_output",
    "check_number",
    "check_reduction",
    "dense_where_needed",
    "device_id",
    "ensure_valid",
]

#: The torch dtypes the ops take (by name).
TORCH_FLOATS = ("bfloat16", "float16", "float32", "float64")

#: Default of an argument an op does not take (``None`` is a value a user can pass).
ABSENT: Any = object()


@dataclass
class Inputs:
    """Validated inputs of one call: the library, flat 2-D arrays, the output's batch shape.

    ``k`` and ``n`` are the model and FFN widths the arguments agree on (None where no
    argument fixes them).
    """

    library: str
    arrays: dict[str, Any]
    batch_shape: tuple[int, ...]
    k: int | None = None
    n: int | None = None

    @property
    def rows(self) -> int:
        """M, the number of tokens (rows of the flattened ``x``)."""
        return math.prod(self.batch_shape)


# ---------------------------------------------------------------------- single arrays
def _pinned(name: str, claims: list[tuple[str, int]]) -> int | None:
    """The size of a dimension as the arguments other than ``name`` give it (None: only
    ``name`` does)."""
    others = [value for who, value in claims if who != name]
    return others[0] if others else None


def _wrong_shape(name: str, array: Any, layout: str, shape: tuple, k_claims: list,
                 n_claims: list) -> tuple[str, str]:  # fmt: skip
    """What a weight's shape error shows: the expected ``shape`` as text, with a letter
    where only ``name`` itself gives the size, and a hint when ``array`` transposed would
    fit the sizes the other arguments give (else "")."""
    k_free, n_free = _pinned(name, k_claims) is None, _pinned(name, n_claims) is None
    free = (n_free, k_free) if layout == "NK" else (k_free, n_free)
    ordered = tuple(None if f else d for d, f in zip(shape, free, strict=True))
    letters = ("N", "K") if layout == "NK" else ("K", "N")
    shown = (
        "("
        + ", ".join(str(d) if d is not None else c for d, c in zip(ordered, letters, strict=True))
        + ")"
    )
    fits = all(
        d is None or d == int(got) for d, got in zip(ordered, array.shape[::-1], strict=True)
    )
    order = "[N, K]" if layout == "NK" else "[K, N]"
    hint = f"; transposed? {name} is {order}, the layout of torch.nn.Linear's weight"
    return shown, hint if fits else ""


def array_library(named: dict[str, Any]) -> str:
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


def check_floating(**tensors: Any) -> None:
    """``TypeError`` naming the first torch tensor whose dtype is not one of
    :data:`TORCH_FLOATS` (floating and at least 2 bytes: complex and float8 are not);
    None entries are skipped. Plain attribute reads: ``torch.compile`` traces it inside
    ``SparseMLP.forward``. (The torch ops' CPU reference would otherwise compute in
    float64 and cast the result back to an integer dtype.)"""
    for name, t in tensors.items():
        if t is not None and not (t.is_floating_point() and t.element_size() >= 2):
            dtype = str(t.dtype).removeprefix("torch.")
            raise TypeError(f"{name}: expected a floating dtype {TORCH_FLOATS}, got {dtype}")


def check_dtype(name: str, array: Any, library: str) -> None:
    """A floating dtype (and, for torch, a CUDA device)."""
    if library == "torch":
        check_floating(**{name: array})
        if array.device.type != "cuda":
            raise TypeError(
                f"{name}: torch tensors must live on a CUDA device (got {array.device}); "
                "pass NumPy arrays to run the CPU reference"
            )
        return
    if np.dtype(array.dtype) not in FLOAT_DTYPES:
        raise TypeError(dtype_message(name, array.dtype))


def _numpy_only(named: dict[str, Any], library: str, reference: str) -> None:
    if library == "numpy":
        return
    name = next(name for name, array in named.items() if array is not None)
    raise TypeError(
        f"{name}: twell.reference.{reference} takes NumPy arrays, got a {library} array "
        f"(the public ops, such as twell.{reference}, run GPU arrays)"
    )


def _present(name: str, array: Any) -> None:
    if array is None:
        raise TypeError(f"{name}: expected an array, got None")


# ---------------------------------------------------------------------- whole calls
def _agreed(claims: list[tuple[str, int]]) -> int | None:
    """The value most arguments claim (ties: the earliest claimant's)."""
    if not claims:
        return None
    votes: dict[int, int] = {}
    for _, value in claims:
        votes[value] = votes.get(value, 0) + 1
    best = max(votes.values())
    return next(value for _, value in claims if votes[value] == best)


def _sources(claims: list[tuple[str, int]], value: int | None) -> str:
    return ", ".join(name for name, claimed in claims if claimed == value)


def check_inputs(
    *,
    x: Any = ABSENT,
    hidden: Any = None,
    hidden_name: str | None = None,
    weights: dict[str, tuple[Any, str]],
    tile: int | None = None,
    slots: int | None = None,
    optional: tuple[str, ...] = ("w_gate",),
    empty_ok: bool = False,
    reference: str | None = None,
) -> Inputs:
    """Check every argument of an op; return them flattened to 2-D.

    Args:
        x: the ``[..., K]`` input; left out (:data:`ABSENT`) by ops without one.
        hidden: a :class:`Hybrid` argument (its N and M constrain the rest).
        hidden_name: the name of that argument in the op; set by the ops that take one
            (so that ``None`` passed for it is rejected too).
        weights: name → (array or None, layout) with layout ``"NK"`` or ``"KN"``.
        tile, slots: the TwELL geometry to check, when the op produces a TwELL.
        optional: weights that may be None (the gate of a non-gated block).
        empty_ok: accept M = 0 (the op returns an empty result); else it raises.
        reference: the name of a ``twell.reference`` op: NumPy arrays only.

    When arguments disagree on K, N or M, the one that disagrees with the others is
    named (with two arguments, the later one: ``x`` and a Hybrid fix M and N first).
    """
    if x is not ABSENT:
        _present("x", x)
    for name, (array, _) in weights.items():
        if name not in optional:
            _present(name, array)
    named = {**({"x": x} if x is not ABSENT else {}), **{n: a for n, (a, _) in weights.items()}}
    library = array_library(named)
    if reference is not None:
        _numpy_only(named, library, reference)
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
            check_dtype(name, array, library)

    # Shapes: ranks first, then the dimensions the arguments share.
    k_claims: list[tuple[str, int]] = []
    n_claims: list[tuple[str, int]] = []
    batch_shape: tuple[int, ...] = ()
    if x is not ABSENT:
        if x.ndim < 1:
            raise ValueError(f"x: expected shape [..., K], got {tuple(x.shape)}")
        batch_shape = tuple(int(d) for d in x.shape[:-1])
        if int(x.shape[-1]) < 1:
            raise ValueError(f"x: expected K >= 1 features, got shape {tuple(x.shape)}")
        k_claims.append(("x", int(x.shape[-1])))
    if hidden is not None:
        n_claims.append((hidden_name or "h", int(hidden.shape[1])))
        if x is ABSENT:
            batch_shape = (int(hidden.shape[0]),)
    present = {name: (a, layout) for name, (a, layout) in weights.items() if a is not None}
    for name, (array, layout) in present.items():
        if array.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {tuple(array.shape)}")
        first, second = int(array.shape[0]), int(array.shape[1])
        n_claims.append((name, first if layout == "NK" else second))
        k_claims.append((name, second if layout == "NK" else first))
    k, n = _agreed(k_claims), _agreed(n_claims)
    if x is not ABSENT and k_claims[0][1] != k:
        raise ValueError(
            f"x: expected shape [..., {k}] (K = {k}, as in {_sources(k_claims, k)}), "
            f"got {tuple(x.shape)}"
        )
    if hidden is not None and n_claims[0][1] != n:
        raise ValueError(
            f"{hidden_name}: expected shape ({hidden.shape[0]}, {n}) (N = {n}, as in "
            f"{_sources(n_claims, n)}), got {hidden.shape}"
        )
    for name, (array, layout) in present.items():
        shape = (n, k) if layout == "NK" else (k, n)
        for axis, (want, got) in enumerate(zip(shape, array.shape, strict=True)):
            if want != got:
                is_n = (axis == 0) == (layout == "NK")
                dim, claims = ("N", n_claims) if is_n else ("K", k_claims)
                shown, hint = _wrong_shape(name, array, layout, shape, k_claims, n_claims)
                raise ValueError(
                    f"{name}: expected shape {shown} (axis {axis} = {dim} = {want}, as in "
                    f"{_sources(claims, want)}), got {tuple(array.shape)}{hint}"
                )
    rows = math.prod(batch_shape)
    if k is not None and k < 1:
        name = k_claims[0][0]
        raise ValueError(f"{name}: expected K >= 1 features, got shape {tuple(named[name].shape)}")
    if n is not None and n < 1 and present:
        name = next(iter(present))
        raise ValueError(
            f"{name}: expected N >= 1 hidden units, got shape {tuple(named[name].shape)}"
        )
    if x is not ABSENT and rows < 1 and not empty_ok:
        raise ValueError(f"x: expected at least one token, got shape {tuple(x.shape)}")
    if hidden is not None and x is not ABSENT and hidden.shape[0] != rows:
        raise ValueError(
            f"{hidden_name}: expected {rows} rows (one per token of x), got {hidden.shape[0]}"
        )
    if tile is not None:
        # (N comes from a weight, or from h: its errors name that argument)
        check_layout((1, n), tile, slots, name=n_claims[0][0] if n_claims else "h")

    flat = {name: array for name, (array, _) in present.items()}
    if x is not ABSENT:
        flat = {"x": x.reshape(rows, k), **flat}
    if library != "numpy":
        check_gpu_arrays(flat, hidden)
        if k is not None:
            check_width(k, "x" if x is not ABSENT else next(iter(flat)))
    if hidden is not None:
        ensure_valid(hidden, hidden_name)  # the one content check of a format argument
    return Inputs(library, flat, batch_shape, k, n)


def check_gpu_arrays(arrays: dict[str, Any], hidden: Hybrid | None) -> None:
    """Kernels ignore strides and run on one device: check contiguity and devices."""
    devices = {}
    for name, array in arrays.items():
        contiguous = (
            array.is_contiguous() if hasattr(array, "is_contiguous") else array.flags.c_contiguous
        )
        if not contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array (call .contiguous())")
        devices[name] = device_id(array)
    if hidden is not None:
        devices["h"] = hidden.packed.device.id
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on GPU {dev}" for name, dev in devices.items())
        raise ValueError(f"arrays on different devices: {listed}")


def device_id(array: Any) -> int:
    """The CUDA device ordinal of a CuPy array or a torch tensor."""
    device = array.device
    return int(device.index if hasattr(device, "index") else device.id)


# ---------------------------------------------------------------------- other arguments
def check_like_output(name: str, array: Any, inputs: Inputs, reference: str) -> np.ndarray:
    """An array shaped like the op's output ``[..., K]`` (``dy``), flattened to ``[M, K]``."""
    _present(name, array)
    library = array_library({name: array})
    _numpy_only({name: array}, library, reference)
    check_dtype(name, array, library)
    expected = (*inputs.batch_shape, inputs.k)
    if tuple(array.shape) != expected:
        raise ValueError(
            f"{name}: expected shape {expected} (the output's: x's leading dimensions and "
            f"K = {inputs.k}), got {tuple(array.shape)}"
        )
    return array.reshape(inputs.rows, inputs.k)


def check_activation(name: str, h: Any, reference: str) -> TwELL | Hybrid | np.ndarray:
    """A NumPy activation ``[..., N]``: a float array, or a NumPy-backed TwELL/Hybrid
    (validated once, as an op argument is)."""
    if isinstance(h, (TwELL, Hybrid)):
        if h.xp is not np:
            raise TypeError(
                f"{name}: twell.reference.{reference} takes NumPy-backed formats, got one "
                "holding CuPy arrays (copy it with twell.formats.to_host)"
            )
        ensure_valid(h, name)
        return h
    _present(name, h)
    library = array_library({name: h})
    _numpy_only({name: h}, library, reference)
    check_dtype(name, h, library)
    if h.ndim < 1:
        raise ValueError(f"{name}: expected shape [..., N], got {tuple(h.shape)}")
    return h


def check_accumulation(dtype: Any) -> np.dtype:
    """The reference's ``dtype`` keyword: float32 or float64."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved not in (np.dtype(np.float32), np.dtype(np.float64)):
        given = repr(dtype) if resolved is None else resolved
        raise TypeError(f"dtype: expected float32 or float64 for the accumulations, got {given}")
    return resolved


def check_number(name: str, value: Any) -> float:
    """A finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return float(value)


def check_reduction(reduction: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices``."""
    if not isinstance(reduction, str) or reduction not in choices:
        raise ValueError(f"reduction: expected one of {choices}, got {reduction!r}")
    return reduction


# ---------------------------------------------------------------------- non-finite values
def dense_where_needed(hidden: Hybrid, *, x: Any = None, weights: tuple[Any, ...] = ()) -> Hybrid:
    """``hidden``, with the rows that only dense math gets right moved to its dense part.

    The sparse paths never read the weights of an inactive unit, nor multiply the
    inactive units of a token. Dense math does, and a NaN or Inf there makes
    ``0 · Inf = NaN``. So: a non-finite value in any of ``weights`` sends every row
    to the dense path; a non-finite value in a token of ``x`` (``[M, K]``) sends that
    token's row. NumPy or CuPy arrays (torch tensors as CuPy views); on the GPU this
    costs one reduction per array and one host synchronisation.
    """
    rows = hidden.shape[0]
    if rows == 0:
        return hidden
    xp = hidden.xp
    needed = non_finite(x).any(axis=1) if x is not None else xp.zeros(rows, dtype=bool)
    flags = [non_finite(w).any() for w in weights if w is not None]
    if flags:
        needed = needed | xp.stack(flags).any()
    needed &= hidden.light_mask()
    if not bool(needed.any()):
        return hidden
    return hidden._with_dense_rows(needed)
