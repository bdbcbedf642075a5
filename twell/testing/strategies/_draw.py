"""Drawing helpers the strategy modules share (not part of the public API)."""

from __future__ import annotations

from twell._optional import optional_dependency

with optional_dependency("hypothesis", "twell.testing.strategies"):
    from hypothesis import strategies as st
    from hypothesis.errors import InvalidArgument

IntArg = int | st.SearchStrategy[int] | None

__all__ = [
    "IntArg",
    "InvalidArgument",
    "draw_value",
    "int_strategy",
    "powers_of_two",
    "seeds",
    "st",
]


def int_strategy(value: IntArg, low: int, high: int) -> st.SearchStrategy[int]:
    """``value`` as a strategy: an int is fixed, ``None`` means ``[low, high]``."""
    if value is None:
        return st.integers(low, high)
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(int(value))


def draw_value(draw: st.DrawFn, value: IntArg) -> int | None:
    """Draw ``value`` if it is a strategy; pass ints and ``None`` through."""
    if isinstance(value, st.SearchStrategy):
        return draw(value)
    return None if value is None else int(value)


def seeds() -> st.SearchStrategy[int]:
    """Seeds of the NumPy generators that fill in columns and values."""
    return st.integers(0, 2**32 - 1)


def powers_of_two(low: int, high: int) -> list[int]:
    """The powers of two in ``[low, high]``."""
    return [1 << i for i in range(16) if low <= 1 << i <= high]
