"""Run check_reuse.py's case logic on the CPU: NumPy stands in for CuPy, the emulator for
the GPU, a NumPy model for today's kernel; timings are stubbed. Catches glue mistakes in
the GPU script before GPU time is spent.

    .venv/bin/python bench/reuse/emu/dryrun_check.py
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[2]))

BF16 = np.dtype(ml_dtypes.bfloat16)

# ---- a NumPy-backed stand-in for the parts of CuPy the script uses
fake = types.ModuleType("cupy")
for name in (
    "empty",
    "array_equal",
    "nonzero",
    "linspace",
    "maximum",
    "isfinite",
    "float64",
    "float32",
    "uint16",
    "uint32",
    "uint8",
    "int64",
    "int32",
    "linalg",
    "asarray",
):
    setattr(fake, name, getattr(np, name))


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass


class _Device:
    id = 0

    def use(self):
        pass

    def synchronize(self):
        pass

    attributes = {"MultiProcessorCount": 132}


fake.cuda = types.SimpleNamespace(
    Event=_Event,
    Device=_Device,
    get_elapsed_time=lambda a, b: 0.0,
    runtime=types.SimpleNamespace(
        getDeviceProperties=lambda i: {"name": b"emulator"}, runtimeGetVersion=lambda: 0
    ),
)
fake.__version__ = "numpy-standin"
fake.RawKernel = lambda *a, **k: lambda *a, **k: None
fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)


def _from_dlpack(t):
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16)
    return t.numpy()


fake.from_dlpack = _from_dlpack
sys.modules["cupy"] = fake
torch.Tensor.cuda = lambda self, *a, **k: self
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.empty_cache = lambda *a, **k: None

import check_reuse  # noqa: E402
import reuse  # noqa: E402
from emu_backend import EmuBackend  # noqa: E402

reuse._default_backend = EmuBackend()
check_reuse.K, check_reuse.N = 264, 512
check_reuse.MAX_ROW_NNZ = 24
check_reuse.gpu_ms = lambda fn: (fn(), 1.0)[1]
check_reuse.SAMPLE_ROWS = 16


def today(x, pre, heavy, w_up, w_down_t, y):
    """NumPy model of today's kernel: routing rule, float64 math, bf16 out."""
    sys.path.insert(0, str(HERE))
    from test_emu import reference, routing

    h = routing(pre, check_reuse.TILE, check_reuse.SLOTS, check_reuse.MAX_ROW_NNZ)
    heavy[...] = h
    ref = reference(x, pre, w_up, w_down_t, h, True)
    y[~h] = ref[~h].astype(np.float32).astype(BF16)


check_reuse.todays_kernel = lambda: ("numpy model", today)

# torch F.linear on bf16 CPU tensors works; dense() in timing runs too (CPU, small).
# First main() itself (table, JSON) on one small case, then the cases one by one.
import os  # noqa: E402
import tempfile  # noqa: E402

check_reuse.CASES = [("heavy", 300, False)]
with tempfile.TemporaryDirectory() as out:
    os.environ["OUT"] = out
    check_reuse.main()
    assert (Path(out) / "reuse.json").exists()
records = []
for workload, M, variants in [
    ("uniform", 700, True),
    ("heavy", 300, False),
    ("paperlike", 2100, False),
]:
    record = {"workload": workload, "M": M}
    try:
        check_reuse.run_case(workload, M, record, variants)
    except Exception:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        record["error"] = "exception"
    record["pass"] = check_reuse.passed(record)
    print(json.dumps(record), flush=True)
    records.append(record)
print("dry run:", "ALL PASS" if all(r["pass"] for r in records) else "FAILURES")
