"""Programmatic dependent launch (twell.kernels.compile.launch_after), without a GPU.

A kernel launched with ``launch_after`` may start while the kernel before it still runs;
it is correct only if every CTA waits (``griddepcontrol.wait``) before its first global
memory access. The kernels that may be launched so are their sources' ``dependent``
kernels (``launch_after`` refuses any other). These tests read each one's PTX (NVRTC for
``compute_90a``) in every example configuration and check that the wait comes first, check
the check on PTX lines of every kind, and pin the driver structures the launch fills.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

import pytest

from twell import _driver
from twell.kernels import compile as kc

# the launchers' imports declare their sources (kc.SOURCES)
from twell.kernels import decode_units, heavy_rows, light_rows, light_rows_decode  # noqa: F401

pytest.importorskip("cuda.bindings")

#: Every declared source with dependent kernels, and each of its example configurations.
CONFIGS = [
    (source, params)
    for source in kc.SOURCES.values()
    if source.dependent
    for params in source.examples
]
#: A PTX instruction that reads or writes memory: its opcode and its qualifiers.
MEMORY = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(ld|ldu|st|atom|red|cp|tex|tld4|suld|sust|sured|prefetch|prefetchu"
    r"|multimem|mbarrier|cvt|tensormap)((?:\.[\w:]+)*)\s"
)
#: State spaces a load, store or atomic may name that are not global memory.
OTHER_SPACES = re.compile(r"\.(shared|param|local|const)\b")


def _functions(ptx: str) -> dict[str, str]:
    """Each ``.entry``'s body, by name."""
    parts = re.split(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _global_access(line: str) -> bool:
    """Whether a PTX line may read or write global memory: a copy with a global side, or a
    load, store or atomic in the global space or a generic one. Prefetches are hints (the
    kernels prefetch weights, which no kernel writes); address conversions and mbarriers
    touch no global memory."""
    found = MEMORY.match(line)
    if found is None:
        return False
    opcode, qualifiers = found.groups()
    if opcode in ("cvt", "mbarrier", "prefetch", "prefetchu"):
        return False
    if opcode in ("cp", "multimem", "tensormap"):
        return ".global" in qualifiers and ".prefetch" not in qualifiers
    return OTHER_SPACES.search(qualifiers) is None


def test_every_dependent_kernel_is_checked():
    names = {n for s, _ in CONFIGS for n in s.dependent}
    assert names == {
        "twell_units_gate_up", "twell_units_down", "twell_units_down_scan64",
        "twell_units_down_scan128", "twell_heavy_rows_matmul", "twell_compact_rows",
        "twell_light_rows_from_pre", "twell_light_rows_from_pre_cols",
        "twell_light_rows_from_pre_cols_deep",
        "twell_light_rows_decode",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("source", "params"), CONFIGS, ids=[f"{s.name}-{i}" for i, (s, _) in enumerate(CONFIGS)]
)
def test_dependent_kernels_wait_before_touching_global_memory(source, params):
    """In each dependent kernel's PTX the wait comes unpredicated, before the first branch
    (so every CTA runs it on every path) and before the first global memory access."""
    functions = _functions(kc.compile_ptx(source, params))
    for name in source.dependent:
        assert name in functions, f"{name}: not built by {params}"
        lines = functions[name].splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        assert not lines[wait].lstrip().startswith("@"), f"{name}: a predicated wait"
        branch = next((i for i, line in enumerate(lines) if re.search(r"\bbra\b", line)),
                      len(lines))  # fmt: skip
        first = next((i for i, line in enumerate(lines) if _global_access(line)), len(lines))
        assert wait < branch, f"{name}: a branch at PTX line {branch} before the wait"
        assert wait < first, f"{name}: a global access at PTX line {first}: {lines[first]}"


@pytest.mark.parametrize(
    "line",
    ["\tst.u32 \t[%rd1], %r1;", "\tatom.add.u32 \t%r1, [%rd2], 1;",
     "\tred.relaxed.gpu.global.add.u32 \t[%rd1], 1;", "\tldu.global.u32 \t%r1, [%rd1];",
     "\tcp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%rd1], [%r2], 16;",
     "\t@%p1 ld.global.nc.v4.u32 \t{%r1, %r2, %r3, %r4}, [%rd1];",
     "\tst.relaxed.gpu.global.u32 \t[%rd1], %r1;", "\tld.u8 \t%rs1, [%rd3];",
     "\tcp.async.cg.shared.global [%r1], [%rd1], 16;",
     "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], "
     "[%rd1, {%r2, %r3}], [%r4];"],
)  # fmt: skip
def test_the_ptx_check_sees_global_accesses(line):
    assert _global_access(line)


@pytest.mark.parametrize(
    "line",
    ["\tld.param.u64 \t%rd1, [p0];", "\tst.shared.u32 \t[%r1], %r2;",
     "\tcp.async.bulk.prefetch.L2.global [%rd1], %r1;", "\tcvta.to.global.u64 \t%rd2, %rd1;",
     "\tld.shared.v4.u32 \t{%r1, %r2, %r3, %r4}, [%r5];", "\tmov.u32 \t%r1, %tid.x;"],
)  # fmt: skip
def test_the_ptx_check_lets_other_instructions_pass(line):
    assert not _global_access(line)


def test_launch_after_refuses_a_kernel_that_does_not_wait_first():
    class Kernel:  # the name is checked before anything touches a GPU
        name = "twell_light_rows_from_twell"

    with pytest.raises(ValueError, match="not a dependent kernel"):
        kc.launch_after(Kernel(), (1,), (32,), ())
    Kernel.name = "twell_compact_rows"
    for grid, block in [((0,), (32,)), ((1, 1, 1, 1), (32,)), ((1,), (2**31,)), ((), (32,))]:
        with pytest.raises(ValueError, match="must be 1 to 3 sizes"):
            kc.launch_after(Kernel(), grid, block, ())


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
