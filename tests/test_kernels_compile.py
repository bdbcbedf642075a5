"""Every kernel source compiles for sm_90a with NVRTC, on a CPU-only machine, no spills.

Needs ``cuda.bindings`` (NVRTC), ``libnvrtc`` and the CUDA headers (the ``test`` extra
installs them as pip wheels); skipped with the reason when they are missing.
"""

from __future__ import annotations

import re

import pytest

from twell.kernels import compile as kc

# Representative compile-time parameters of each source (what the launchers pass).
CONFIGS = [
    ("pack.cu", {"TILE": tile, "SLOTS": slots})
    for tile, slots in [(256, 32), (256, 64), (256, 128), (128, 16), (64, 8), (32, 2)]
] + [
    ("sparse_ffn.cu", {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": gated})
    for k, tile, slots in [
        (2048, 256, 32),
        (2048, 256, 64),
        (2048, 256, 128),
        (4096, 256, 32),
        (8, 32, 2),
        (136, 64, 16),
        (1032, 128, 4),
    ]
    for gated in (0, 1)
]
CONFIGS += [
    ("sparse_rows.cu", {"KDIM": k, "TILE": tile, "SLOTS": slots, "GATED": gated})
    for k, tile, slots in [
        (2048, 256, 32), (2048, 256, 64), (2048, 256, 128), (4096, 256, 32),
        (4096, 256, 128), (8, 32, 2), (136, 64, 16), (1032, 128, 4),
    ]
    for gated in (0, 1)
] + [("dense_rows.cu", {}), ("convert.cu", {})] + [
    ("gate_gemm.cu", {"TILE": tile, "SLOTS": slots})
    for tile, slots in [(256, 32), (256, 64), (256, 128), (128, 16), (64, 8), (32, 2)]
]  # fmt: skip


def _nvrtc_ready() -> str | None:
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as error:  # ImportError, or libnvrtc not found
        return f"NVRTC unavailable: {type(error).__name__}: {str(error)[:200]}"
    try:
        kc.include_dirs()
    except RuntimeError as error:
        return str(error)
    return None


_REASON = _nvrtc_ready()


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.parametrize(
    ("name", "params"), CONFIGS, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CONFIGS]
)
def test_source_compiles_without_spills(name: str, params: dict[str, int]) -> None:
    result = kc.compile_cubin(name, params)
    assert result.cubin[:4] == b"\x7fELF"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.log)
    assert spills, f"no ptxas report in the log:\n{result.log}"
    assert all(int(s) == 0 and int(lo) == 0 for s, lo in spills), result.log
    stacks = re.findall(r"(\d+) bytes stack frame", result.log)
    assert all(int(s) == 0 for s in stacks), result.log


def test_every_source_is_listed() -> None:
    import importlib.resources

    files = {p.name for p in importlib.resources.files("twell.kernels").iterdir()}
    assert {f for f in files if f.endswith(".cu")} == set(kc.SOURCES)
    assert {name for name, _ in CONFIGS} == set(kc.SOURCES)


def test_prelude_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="bad parameter name"):
        kc.prelude({"tile; evil": 1})
    assert kc.prelude({"TILE": 256, "SLOTS": 32}) == (
        "#define TWELL_SLOTS 32\n#define TWELL_TILE 256\n"
    )


def test_unknown_source_raises() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        kc.source("nope.cu")


def test_gate_gemm_launcher_matches_its_source() -> None:
    """The launcher's tile and shared-memory figures are the ones gate_gemm.cu uses."""
    from twell.kernels import gate_gemm

    defines = dict(re.findall(r"^#define (\w+) (\d+)\b", kc.source("gate_gemm.cu"), re.M))
    assert (int(defines["BM"]), int(defines["BN"]), int(defines["BK"])) == (
        gate_gemm.BLOCK_M, gate_gemm.BLOCK_N, gate_gemm.BLOCK_K,
    )  # fmt: skip
    stages, consumers = int(defines["STAGES"]), int(defines["CONSUMERS"])
    assert (stages, consumers) == (gate_gemm._STAGES, gate_gemm._CONSUMERS)
    ring = stages * (gate_gemm.BLOCK_M + gate_gemm.BLOCK_N) * gate_gemm.BLOCK_K * 2
    tile = gate_gemm.BLOCK_M * (2 * gate_gemm.BLOCK_N + 16)
    assert gate_gemm.SMEM_BYTES == ring + tile + 2 * stages * 8 + 1024 <= 232448
