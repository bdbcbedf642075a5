"""A missing optional dependency raises an ImportError that names the pip extra bringing it.

The packages are made missing by putting ``None`` in ``sys.modules`` (what Python does for
a module that cannot be imported), and the modules that import them are imported afresh.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from twell._optional import EXTRAS, MissingDependencyError, install_hint, optional_dependency


def block(monkeypatch: pytest.MonkeyPatch, package: str, *reimported: str) -> None:
    """Make ``package`` missing and forget ``reimported`` modules (and their submodules),
    so that importing them again runs their imports. Everything is restored afterwards."""
    monkeypatch.setitem(sys.modules, package, None)
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in reimported):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    ("package", "extra"),
    [("cupy", "cuda13"), ("torch", "torch"), ("matplotlib", "plots"), ("hypothesis", "strategies")],
)
def test_a_missing_package_names_its_extra(monkeypatch, package, extra):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(MissingDependencyError, match=rf"pip install 'twell\[{extra}\]'") as info:
        with optional_dependency(package, "this feature"):
            importlib.import_module(package)
    assert isinstance(info.value, ModuleNotFoundError)
    assert info.value.name == package
    assert str(info.value).startswith(f"this feature needs {package}")
    assert EXTRAS[package] == extra and f"[{extra}]" in install_hint(package)


def test_a_missing_submodule_of_a_missing_package_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(MissingDependencyError, match="twell\\[strategies\\]"):
        with optional_dependency("hypothesis", "this feature"):
            import hypothesis.strategies  # noqa: F401


def test_other_import_failures_pass_through_unchanged():
    # a module missing inside an installed package: a broken or partial installation
    with pytest.raises(ModuleNotFoundError) as info:
        with optional_dependency("hypothesis", "this feature"):
            import hypothesis.no_such_module  # noqa: F401
    assert not isinstance(info.value, MissingDependencyError)
    # another package than the one named
    with pytest.raises(ModuleNotFoundError) as info:
        with optional_dependency("torch", "this feature"):
            import no_such_package_of_twell  # noqa: F401
    assert not isinstance(info.value, MissingDependencyError)


def test_gpu_paths_without_cupy_name_the_cuda_extra(monkeypatch):
    from twell import _interop
    from twell.kernels import compile as kernel_compile

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(MissingDependencyError, match=r"twell\[cuda13\]"):
        kernel_compile._require_cupy()
    with pytest.raises(MissingDependencyError, match=r"twell's GPU ops needs cupy.*cuda13"):
        with _interop.on_gpu("cupy", {"x": object()}):
            pass


def test_strategies_without_hypothesis_name_the_strategies_extra(monkeypatch):
    block(monkeypatch, "hypothesis", "twell.testing.strategies", "twell.testing.profiles")
    for module in ("twell.testing.strategies", "twell.testing.profiles"):
        with pytest.raises(MissingDependencyError, match=r"pip install 'twell\[strategies\]'"):
            importlib.import_module(module)


def test_the_sweeps_without_torch_name_the_torch_extra(monkeypatch):
    block(monkeypatch, "torch", "twell.sweeps")
    with pytest.raises(MissingDependencyError, match=r"pip install 'twell\[torch\]'"):
        importlib.import_module("twell.sweeps")


def test_the_plot_without_matplotlib_names_the_plots_extra(monkeypatch, tmp_path):
    pytest.importorskip("torch")  # twell.sweeps times torch's dense block
    from twell import sweeps

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'twell\[plots\]'"):
        sweeps.plot([], str(tmp_path / "sweep.png"))


def test_twell_torch_without_torch_names_the_torch_extra(monkeypatch):
    block(monkeypatch, "torch", "twell.torch")
    with pytest.raises(MissingDependencyError, match=r"pip install 'twell\[torch\]'"):
        importlib.import_module("twell.torch")
