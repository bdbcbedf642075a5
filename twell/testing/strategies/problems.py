"""Strategies for whole FFN problems (also with NaN/Inf planted) and for arguments gone
wrong."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from scipy.special import ndtri

from twell._arrays import round_bf16
from twell.options import DEFAULT_TILE
from twell.testing.strategies._draw import (
    IntArg,
    InvalidArgument,
    draw_value,
    int_strategy,
    seeds,
    st,
)
from twell.testing.strategies.matrices import TILES


# --------------------------------------------------------------------------- FFN problems
class FFNProblem(NamedTuple):
    """One FFN block's inputs, float32 and bf16-representable (``torch.nn.Linear`` layout).

    ``x`` ``[M, K]``; ``w_gate`` ``[N, K]`` or ``None`` (non-gated); ``w_up`` ``[N, K]``;
    ``w_down`` ``[K, N]``. It unpacks as the ops' first four arguments:
    ``twell.ffn(*problem, tile=problem.tile)`` runs with any problem, and
    ``twell.ffn(*problem)`` with one drawn at the default tile (``ffn_problems()``).
    """

    x: np.ndarray
    w_gate: np.ndarray | None
    w_up: np.ndarray
    w_down: np.ndarray

    @property
    def tile(self) -> int:
        """The widest tile of docs/format.md that divides N (at most the ops' default,
        256): a ``tile`` the ops take for this problem, with any ``slots`` up to it."""
        n = self.w_up.shape[0]
        fits = [t for t in TILES if t <= DEFAULT_TILE and n % t == 0]
        if not fits:
            raise ValueError(f"N={n} is not a multiple of any tile of docs/format.md {TILES}")
        return max(fits)


def _check_fixed(name: str, value: Any, choices: tuple = (), *, low: int | None = None) -> None:
    """``InvalidArgument`` for a fixed (not drawn) argument out of its range, raised at
    the first draw, before anything is built."""
    if value is None or isinstance(value, st.SearchStrategy):
        return
    if (choices and value not in choices) or (low is not None and int(value) < low):
        want = f"one of {choices}" if choices else f"at least {low}"
        raise InvalidArgument(f"{name}: expected {want}, got {value!r}")


#: Firing probabilities of the gate units (docs/benchmark.md's ``uniform`` at small N).
_FIRING = (0.02, 0.05, 0.1, 0.3)


@st.composite
def ffn_problems(
    draw: st.DrawFn,
    gated: bool | st.SearchStrategy[bool] | None = None,
    *,
    rows: IntArg = None,
    k: IntArg = None,
    tiles: IntArg = None,
    tile: int = DEFAULT_TILE,
    allow_heavy: bool = True,
) -> FFNProblem:
    """Inputs of a gated or non-gated FFN block, sparse like docs/benchmark.md's ``uniform``.

    ``x[:, 0] = 1`` and column 0 of the gating weight (``w_gate``, or ``w_up`` when
    non-gated) is ``-z`` with ``z = Φ⁻¹(1 - p)``, so a fraction ``p`` (drawn from
    0.02..0.3) of the units fire per token. With ``allow_heavy`` some tokens have
    ``x[:, 1:]`` scaled by 3: they fire many units and overflow small ``slots``.

    Args:
        gated: ``True``/``False``, a strategy, or ``None`` to draw.
        rows: M (default: 1 about a fifth of the time, else 2..16).
        k: K (default 2..16). ``tiles``: N / tile (default 1..3).
        tile: N is a multiple of this; the default is the ops' (256), so that
            ``twell.ffn(*problem)`` runs as it is. A smaller tile gives smaller N (pass
            it to the ops too: ``tile=problem.tile``).
        allow_heavy: allow heavy tokens.

    Raises:
        hypothesis.errors.InvalidArgument: a ``tile`` not of docs/format.md, a fixed
            ``k`` below 2 (column 0 is the gate's bias) or ``rows``/``tiles`` below 0/1.
    """
    _check_fixed("tile", tile, TILES)
    _check_fixed("k", k, low=2)
    _check_fixed("rows", rows, low=0)
    _check_fixed("tiles", tiles, low=1)
    if gated is None:
        gated = draw(st.booleans())
    elif isinstance(gated, st.SearchStrategy):
        gated = draw(gated)
    m = draw_value(draw, rows)
    if m is None:  # decode (M = 1) about a fifth of the time
        m = 1 if draw(st.integers(0, 4)) == 0 else draw(st.integers(2, 16))
    k_ = draw(int_strategy(k, 2, 16))
    n = draw(int_strategy(tiles, 1, 3)) * tile
    p = draw(st.sampled_from(_FIRING))
    heavy_share = draw(st.sampled_from([0.0, 0.0, 0.25])) if allow_heavy else 0.0
    rng = np.random.default_rng(draw(seeds()))

    x = rng.standard_normal((m, k_))
    x[:, 0] = 1.0
    x[rng.random(m) < heavy_share, 1:] *= 3.0
    gating = rng.standard_normal((n, k_)) / np.sqrt(k_ - 1)
    gating[:, 0] = -ndtri(1.0 - p)
    w_up = rng.standard_normal((n, k_)) / np.sqrt(k_)
    w_down = rng.standard_normal((k_, n)) / np.sqrt(n)

    def bf16(a: np.ndarray) -> np.ndarray:
        return round_bf16(a.astype(np.float32))

    if gated:
        return FFNProblem(bf16(x), bf16(gating), bf16(w_up), bf16(w_down))
    return FFNProblem(bf16(x), None, bf16(gating), bf16(w_down))


@st.composite
def nonfinite_ffn_problems(
    draw: st.DrawFn,
    gated: bool | st.SearchStrategy[bool] | None = None,
    *,
    places: tuple[str, ...] = ("w_gate", "w_up", "w_down"),
    max_values: int = 3,
    **kwargs: Any,
) -> FFNProblem:
    """An :func:`ffn_problems` block with 1..``max_values`` NaN/±Inf values planted.

    Each value goes into one of ``places`` (``"x"`` may be added; ``"w_gate"`` falls back
    to ``w_up`` for a non-gated block). Weight values go, when there is one, to a unit
    that no token activates: that is where a sparse path that skips inactive units
    differs from dense math, which computes ``0 · Inf = NaN`` there.

    Args:
        gated: as :func:`ffn_problems`. ``**kwargs``: passed on to it.
        places: where values may go: any of ``"x"``, ``"w_gate"``, ``"w_up"``,
            ``"w_down"`` (an ``x`` of no rows passes its values to ``w_up``).
        max_values: most values planted.
    """
    problem = draw(ffn_problems(gated, **kwargs))
    arrays = {name: None if a is None else a.copy() for name, a in problem._asdict().items()}
    gating = arrays["w_gate"] if arrays["w_gate"] is not None else arrays["w_up"]
    with np.errstate(all="ignore"):
        pre = problem.x.astype(np.float64) @ gating.T.astype(np.float64)
    inactive = np.nonzero((pre <= 0).all(axis=0))[0]
    n, k = gating.shape
    for _ in range(draw(st.integers(1, max_values))):
        place = draw(st.sampled_from(places))
        if place == "w_gate" and arrays["w_gate"] is None:
            place = "w_up"
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        if place == "x" and not problem.x.shape[0]:
            place = "w_up"  # (an x without rows holds no value: a weight takes it)
        if place == "x":
            row = draw(st.integers(0, problem.x.shape[0] - 1))
            arrays["x"][row, draw(st.integers(0, k - 1))] = value
            continue
        pool = inactive if inactive.size and draw(st.integers(0, 3)) else np.arange(n)
        unit = int(pool[draw(st.integers(0, len(pool) - 1))])
        column = draw(st.integers(0, k - 1))
        if place == "w_down":
            arrays["w_down"][column, unit] = value
        else:
            arrays[place][unit, column] = value
    return FFNProblem(**arrays)


#: What :func:`malformed` does to an argument.
MALFORMATIONS = (
    "same",  # unchanged (so that the valid path is exercised too)
    "transposed",  # a.T (for an N-D array: axes reversed)
    "flattened",  # a.ravel()
    "batched",  # a[None]: an extra leading axis
    "unsqueezed",  # a[..., None]: an extra trailing axis
    "shorter",  # one axis one shorter (possibly down to 0)
    "longer",  # one axis one longer (the new entries are zero)
    "float16",  # another floating dtype (valid: twell takes it)
    "integer",  # int32 values
    "boolean",  # bool values
    "complex",  # complex64 values
    "list",  # a Python list
    "scalar",  # a Python float
    "none",  # None
)


@st.composite
def malformed(
    draw: st.DrawFn, array: np.ndarray, kinds: tuple[str, ...] = MALFORMATIONS
) -> tuple[Any, str]:
    """``(value, kind)``: ``array`` gone wrong in one of ``kinds`` (:data:`MALFORMATIONS`).

    Some results are still valid arguments (``"same"``, ``"float16"``, a ``"batched"`` x,
    a transposed square matrix, ``None`` for an optional ``w_gate``): a property test
    decides validity with its own rule and checks that the op raises ``TypeError`` or
    ``ValueError`` exactly when the argument is invalid, and otherwise returns what dense
    math returns for the argument as it is.
    """
    kind = draw(st.sampled_from(kinds))
    if kind == "same":
        return array, kind
    if kind == "transposed":
        return np.ascontiguousarray(array.T), kind
    if kind == "flattened":
        return array.ravel(), kind
    if kind == "batched":
        return array[None], kind
    if kind == "unsqueezed":
        return array[..., None], kind
    if kind in ("shorter", "longer"):
        if array.ndim == 0:
            return array, "same"
        axis = draw(st.integers(0, array.ndim - 1))
        if kind == "shorter":
            return np.take(array, np.arange(max(0, array.shape[axis] - 1)), axis=axis), kind
        pad = [(0, 1 if a == axis else 0) for a in range(array.ndim)]
        return np.pad(array, pad), kind
    if kind == "float16":
        with np.errstate(over="ignore"):
            return array.astype(np.float16), kind
    if kind == "integer":
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(array).astype(np.int32), kind
    if kind == "boolean":
        return array != 0, kind
    if kind == "complex":
        return array.astype(np.complex64), kind
    if kind == "list":
        return array.tolist(), kind
    if kind == "scalar":
        return 1.0, kind
    return None, kind
