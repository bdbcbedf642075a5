"""The GPU tests: what every module in this folder shares.

- Without a usable GPU (:func:`twell.kernels.compile.unavailable_reason`: no CuPy, no
  device, no NVRTC) each module is reported as skipped, with the reason, without being
  imported (the modules import CuPy at the top).
- Every test here carries the ``gpu`` marker (``pytest -m "not gpu"`` leaves them out).
- Every buffer twell's launchers take from CuPy's pool is poisoned (0xFF bytes: NaN in
  bf16 and fp32, -1 in integers) before the kernels run, so an element a kernel forgot to
  write fails the comparison (:func:`twell.testing.gpu.poisoned_buffers`). A module
  marked ``unpoisoned`` runs on plain buffers.
- A module that uses torch (a global ``torch``) is skipped when torch has no CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twell.kernels.compile import unavailable_reason

REASON = unavailable_reason()


class _WithoutGPU(pytest.Module):
    """A test module that is not imported: its collection is skipped with the reason."""

    def collect(self) -> Any:  # noqa: ANN401
        pytest.skip(f"no GPU: {REASON}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "unpoisoned: a GPU test module whose buffers are not poisoned"
    )


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
    cls = pytest.Module if REASON is None else _WithoutGPU
    module = cls.from_parent(parent, path=module_path)
    module.add_marker(pytest.mark.gpu)
    return module


@pytest.fixture(autouse=True)
def gpu_test(request: pytest.FixtureRequest) -> Iterator[None]:
    torch = getattr(request.module, "torch", None)
    if torch is not None and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if request.node.get_closest_marker("unpoisoned") is not None:
        yield
        return
    from twell.testing.gpu import poisoned_buffers

    with poisoned_buffers():
        yield
