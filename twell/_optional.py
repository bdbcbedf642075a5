"""Optional dependencies: imported where they are needed, with the pip extra that brings
each one named when it is missing.

twell itself needs NumPy, SciPy and ml_dtypes. The rest comes with an extra of
pyproject.toml: CuPy for the GPU kernels (``cuda13`` or ``cuda12``), torch for
:mod:`twell.torch`, matplotlib for the benchmark plots, Hypothesis for
:mod:`twell.testing.strategies` and its profiles. Every import of one of them goes
through :func:`optional_dependency`::

    with optional_dependency("cupy", "twell's GPU kernels"):
        import cupy
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

#: The pip extra that installs each optional top-level package.
EXTRAS = {
    "cupy": "cuda13",
    "torch": "torch",
    "matplotlib": "plots",
    "hypothesis": "strategies",
}


class MissingDependencyError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra brings it."""


def install_hint(package: str) -> str:
    """The command that installs ``package`` (a top-level name of :data:`EXTRAS`)."""
    if package == "cupy":
        return "pip install 'twell[cuda13]' (or 'twell[cuda12]' for CUDA 12)"
    return f"pip install 'twell[{EXTRAS[package]}]'"


@contextlib.contextmanager
def optional_dependency(package: str, needed_by: str) -> Iterator[None]:
    """Around the imports of an optional package: if the package is not installed, raise
    :class:`MissingDependencyError` (a :class:`ModuleNotFoundError`) naming the pip extra
    that brings it.

    Args:
        package: the top-level package, a key of :data:`EXTRAS` (``"cupy"``, ``"torch"``,
            ``"matplotlib"``, ``"hypothesis"``).
        needed_by: what needs it, for the message (``"twell's GPU kernels"``).

    Any other import failure (a broken installation, a module missing inside an
    installed package) passes through as it is.
    """
    try:
        yield
    except ModuleNotFoundError as error:
        if isinstance(error, MissingDependencyError):
            raise
        if (error.name or "").split(".")[0] != package or _installed(package):
            raise
        raise MissingDependencyError(
            f"{needed_by} needs {package}, which is not installed: {install_hint(package)}",
            name=package,
        ) from error


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules without a spec: there, so installed
        return True
