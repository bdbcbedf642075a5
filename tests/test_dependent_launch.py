"""Programmatic dependent launch (twell.kernels.compile.launch_after), without a GPU.

A kernel launched with ``launch_after`` may start while the kernel before it still runs;
it is correct only if every CTA waits (``griddepcontrol.wait``) before its first global
memory access. These tests read each such kernel's PTX (NVRTC for ``compute_90a``) and
check that order, check that no launcher calls ``launch_after`` for a kernel missing from
the list checked here, and pin the layout of the driver structures the launch fills.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from twell import _driver
from twell.kernels import compile as kc
from twell.kernels import decode_units, heavy_rows, light_rows, light_rows_decode

pytest.importorskip("cuda.bindings")

KERNELS = Path(kc.__file__).parent
#: Every kernel some launcher starts with launch_after: (source, parameters, kernels).
LAUNCHED_AFTER = [
    (decode_units.SOURCE, {"KDIM": 2048, "GATED": 1, "NT": 8, "UT": 1, "DC": 16, "PRE": 1},
     ("twell_units_gate_up", "twell_units_down_scan64", "twell_units_down_scan128")),
    (decode_units.SOURCE, {"KDIM": 2048, "GATED": 1, "NT": 8, "UT": 1, "DC": 64, "PRE": 0},
     ("twell_units_down",)),
    (heavy_rows.SOURCE, {"HR_SPLIT": 4, "HR_STAGES": 5},
     ("twell_heavy_rows_matmul", "twell_compact_rows")),
    (light_rows.SOURCE, {"KDIM": 2048, "TILE": 256, "SLOTS": 32, "GATED": 1},
     ("twell_light_rows_from_pre", "twell_light_rows_from_pre_wide",
      "twell_light_rows_from_pre_wide2")),
    (light_rows_decode.SOURCE, light_rows_decode.SOURCE.examples[0],
     ("twell_light_rows_decode",)),
]  # fmt: skip
#: PTX instructions that touch global memory (shared-memory and parameter accesses,
#: and prefetches of weights no kernel writes, may come first).
GLOBAL = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|atom\.global|red\.global"
    r"|cp\.async\.(?!bulk\.prefetch)|ld\.(?!shared|param|local|const))"
)


def _functions(ptx: str) -> dict[str, str]:
    """Each ``.entry``'s body, by name."""
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize(
    ("source", "params", "names"), LAUNCHED_AFTER, ids=[s.name for s, _, _ in LAUNCHED_AFTER]
)
def test_kernels_launched_after_wait_before_touching_global_memory(source, params, names):
    functions = _functions(kc.compile_ptx(source, params))
    for name in names:
        lines = functions[name].splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        first = next((i for i, line in enumerate(lines) if GLOBAL.match(line)), len(lines))
        assert wait < first, f"{name}: a global access at PTX line {first}: {lines[first]}"


def test_every_launch_after_call_site_is_checked():
    """The launchers that call launch_after are those whose kernels LAUNCHED_AFTER holds:
    a new one must add its kernels there, so that the test above covers them."""
    callers = {p.name for p in KERNELS.glob("*.py") if "launch_after(" in p.read_text()}
    assert callers == {"compile.py", "decode_units.py", "heavy_rows.py", "light_rows.py",
                       "light_rows_decode.py"}  # fmt: skip


def test_launch_structures_match_cuda_h():
    assert ctypes.sizeof(_driver.LaunchAttribute) == 72
    assert _driver.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_driver.LaunchConfig) == 56
    assert _driver.LaunchConfig.stream.offset == 32
    assert _driver.LaunchConfig.attrs.offset == 40
    assert _driver.LaunchConfig.num_attrs.offset == 48


@pytest.mark.parametrize(("value", "expected"), [("0", "False"), ("1", "True"), (None, "True")])
def test_programmatic_launches_follow_the_environment(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "TWELL_PDL"}
    if value is not None:
        env["TWELL_PDL"] = value
    code = "from twell.kernels import compile; print(compile.PROGRAMMATIC)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == expected
