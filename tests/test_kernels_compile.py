"""Every kernel source compiles for sm_90a with NVRTC, on a CPU-only machine, no spills.

The configurations come from each source's declaration (``twell.kernels.compile.Source``:
its parameters and examples), so a new source or parameter is tested by declaring it.
Needs ``cuda.bindings`` (NVRTC), ``libnvrtc`` and the CUDA headers (the ``test`` extra
installs them as pip wheels); skipped with the reason when they are missing.
"""

from __future__ import annotations

import importlib.resources
import re

import pytest

import twell.kernels  # noqa: F401 - imports every launcher, which declares its source
from twell.kernels import compile as kc

CONFIGS = [(source, params) for source in kc.SOURCES.values() for params in source.examples]


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
    ("source", "params"),
    CONFIGS,
    ids=[f"{s.name}-{'-'.join(map(str, p.values()))}" for s, p in CONFIGS],
)
def test_source_compiles_without_spills(source: kc.Source, params: dict[str, int]) -> None:
    result = kc.compile_cubin(source, params)
    assert result.cubin[:4] == b"\x7fELF"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.log)
    assert spills, f"no ptxas report in the log:\n{result.log}"
    assert all(int(s) == 0 and int(lo) == 0 for s, lo in spills), result.log
    stacks = re.findall(r"(\d+) bytes stack frame", result.log)
    assert all(int(s) == 0 for s in stacks), result.log


def test_every_source_is_declared() -> None:
    files = {p.name for p in importlib.resources.files("twell.kernels").iterdir()}
    assert {f for f in files if f.endswith(".cu")} == set(kc.SOURCES)


def _headers() -> dict[str, str]:
    """The shared device headers (common.cuh, tensor_core.cuh, ...) by name."""
    files = importlib.resources.files("twell.kernels").iterdir()
    return {p.name: p.read_text() for p in files if p.name.endswith(".cuh")}


def test_every_source_uses_the_shared_headers_not_copies_of_them() -> None:
    """Types and helpers live in the shared headers; a source redefining them would drift."""
    headers = _headers()
    assert {"common.cuh", "tensor_core.cuh"} <= set(headers)
    declared = r"TWELL_\w+ \w+ (twell_\w+)\("
    shared = [name for text in headers.values() for name in re.findall(declared, text)]
    assert {"twell_relu_keeps", "twell_cp_async16", "twell_acc_zero"} <= set(shared)
    assert len(shared) == len(set(shared)), "a helper defined in two headers"
    for source in kc.SOURCES.values():
        text = source.text()
        assert "typedef" not in text, source.name
        assert set(source.headers) <= set(headers) - {"common.cuh"}, source.name
        for name in shared:
            # a definition: the name, a parameter list (no lambda in it), a body
            definition = rf"\b{name}\s*\((?:[^;{{}}()\[]|\[\w*\]|\([^()]*\))*\)\s*{{"
            assert not re.search(definition, text), (source.name, name)


def test_a_source_gets_its_headers_after_the_common_one() -> None:
    source = kc.SOURCES["heavy_rows.cu"]
    text = kc.full_source(source, source.examples[0])
    common, engine = kc.common_header(), _headers()["tensor_core.cuh"]
    assert text.index(common) < text.index(engine) < text.index(source.text())
    assert engine not in kc.full_source(kc.SOURCES["pack.cu"], {"TILE": 256, "SLOTS": 32})


def test_backward_kernels_launch_from_their_step_source() -> None:
    """backward.py launches each kernel by name through the source that defines it (CPU:
    the map against the sources' text), and keeps the forward's contract importable."""
    from twell.kernels import activations, backward

    defined = {
        name: source
        for source in kc.SOURCES.values() if source.name.startswith("backward")
        for name in re.findall(r'extern "C" __global__\s+void\s+(?:__\w+__\([^)]*\)\s*)*(\w+)\(',
                               source.text())
    }  # fmt: skip
    assert {k: s.name for k, s in backward._SOURCE_OF.items()} == {
        k: s.name for k, s in defined.items()
    }
    assert backward.Activations is activations.Activations
    assert backward.row_capacity is activations.row_capacity


def test_parameters_are_declared_not_guessed() -> None:
    source = kc.SOURCES["pack.cu"]
    with pytest.raises(ValueError, match="expected parameters"):
        source.defines({"TILE": 256})
    with pytest.raises(ValueError, match="expected parameters"):
        kc.SOURCES["heavy_rows.cu"].defines({"TILE": 256, "SLOTS": 32})
    text = kc.full_source(source, {"TILE": 256, "SLOTS": 32})
    defines = (
        "#define TWELL_PACK_SIMD 1\n#define TWELL_PACK_WARPS 8\n#define TWELL_SLOTS 32\n"
        "#define TWELL_TILE 256\n"
    )
    assert text.startswith(defines)
    assert kc.common_header() in text


def test_prelude_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="bad parameter name"):
        kc.prelude({"tile; evil": 1})


def test_gate_gemm_shared_memory_matches_its_source() -> None:
    """The launcher's figure is the kernel's (the kernel static_asserts the same sum)."""
    from twell.kernels import gate_gemm

    ring = gate_gemm.STAGES * (gate_gemm.BLOCK_M + gate_gemm.BLOCK_N) * gate_gemm.BLOCK_K * 2
    tile = gate_gemm.BLOCK_M * (2 * gate_gemm.BLOCK_N + 16)
    assert gate_gemm.SMEM_BYTES == ring + tile + (2 * gate_gemm.STAGES + 1) * 8 + 1024 <= 232448
    assert "static_assert(TWELL_SMEM_BYTES ==" in kc.SOURCES["gate_gemm.cu"].text()


def test_fused_path_routes_by_shape() -> None:
    """The light-row route of a call (CPU: PreparedBlock.route's rule, no GPU): "fused"
    stands for cuBLAS + the scan at every M, the sliced gather for weights of 96 MiB and
    more; training calls take the epilogue route where the path keeps no training
    outputs; other paths are kept."""
    from types import SimpleNamespace

    from twell.kernels.pipeline import PreparedBlock
    from twell.options import Options

    def route(m: int, k: int = 2048, n: int = 5632, gated: bool = True, path: str = "fused",
              save: bool = False) -> str:  # fmt: skip
        block = SimpleNamespace(options=Options(path=path), k=k, n=n, gated=gated)
        return PreparedBlock.route(block, m, save)  # type: ignore[arg-type]

    assert [route(m) for m in (1, 4095, 4096, 65536)] == ["fused"] * 4
    assert route(4096, gated=False) == "fused"
    assert route(4095, k=4096, n=14336) == "fused" and route(4096, k=4096, n=14336) == "sliced"
    assert route(8, save=True) == "epilogue" and route(8, path="sliced", save=True) == "epilogue"
    assert route(8192, path="pack") == "pack" and route(8192, path="pack", save=True) == "pack"


def test_cols_warps_by_tokens_and_width() -> None:
    """The by-columns light-row kernel's warps per token (CPU: the launcher's rule): eight
    up to COLS_WIDE_ROWS tokens, four above, at most one per 256-column slice."""
    from twell.kernels import light_rows

    rows = light_rows.COLS_WIDE_ROWS
    assert [light_rows.cols_warps(m, 2048) for m in (1, rows, rows + 1, 16384)] == [8, 8, 4, 4]
    widths = (8, 256, 264, 1032, 4096)
    assert [light_rows.cols_warps(1, k) for k in widths] == [1, 1, 2, 5, 8]
    assert light_rows.cols_warps(rows + 1, 264) == 2


def test_weight_gradient_slices_bound_the_slice_and_fit_the_width() -> None:
    """The backward's weight-gradient K slices (CPU: the launcher's rule, no compile)."""
    from twell.kernels import backward

    assert backward.grad_slices(16, 2048) == 1  # x and dy fit whole
    assert backward.grad_slices(4096, 2048) == 2  # 32 MB: 16 MB slices
    assert backward.grad_slices(16384, 2048) == 8  # 128 MB: 16 MB slices
    assert backward.grad_slices(10**6, 2048) == 8  # the narrowest: 256 columns, one warp
    assert backward.grad_slices(10**6, 264) == 1  # 33 chunks: no whole warps to slice
    assert backward.grad_slices(10**6, 4096) == 16
    # token ranges where a slice of all tokens is too large: equal, within the bound
    assert backward.grad_rows(16384, 2048, 8) == 16384
    assert backward.grad_rows(65536, 2048, 8) == 21846  # three launches
    most = backward.GRAD_SLICE_BYTES * 8 // (4 * 2048)  # tokens whose slices fit
    for m in (24577, 131109, 10**6):
        rows = backward.grad_rows(m, 2048, 8)
        assert rows <= most and -(-m // rows) == -(-m // most)  # the fewest launches


def test_sliced_light_rows_pay_for_large_weights_and_batches() -> None:
    from twell.kernels import light_rows_sliced as sliced

    assert sliced.pays(16384, 4096, 14336) and sliced.pays(4096, 4096, 14336)
    assert not sliced.pays(4095, 4096, 14336)  # a smaller batch
    assert not sliced.pays(16384, 2048, 5632)  # 46 MB of weights: L2 holds most of them


def test_decode_units_route_limits() -> None:
    """The by-unit decode route's bounds (pure Python: no GPU needed)."""
    from twell.kernels import decode_units

    assert decode_units.fits(1, 32) and decode_units.fits(decode_units.MAX_ROWS, 16384)
    assert not decode_units.fits(0, 1024)
    assert not decode_units.fits(decode_units.MAX_ROWS + 1, 1024)
    assert decode_units.fits(decode_units.MAX_TOKENS, 8192, most=decode_units.MAX_TOKENS)
    # the down kernel holds the masks of at most DOWN_TOKENS tokens: any N the ids allow
    assert decode_units.fits(64, 65536, most=64)
    # one wave of two CTAs per SM (132 SMs): the narrowest slices that fit
    widths = [decode_units.down_columns(m, 2048, 5632, 132) for m in (1, 32, 48, 64, 128, 144)]
    assert widths == [32, 32, 64, 64, 128, 64]
    # the widest model: slices whose shared memory still lets two CTAs share an SM
    widest = decode_units.down_columns(128, 2048, 65536, 132)
    assert widest == 64
    assert decode_units.down_shared_bytes(128, 65536, widest) <= decode_units.SHARED_PER_SM // 2
    # the scan kernel's CTA: 128 threads for a few tokens or tokens keeping many units
    wide = decode_units.SCAN_WIDE_UNITS
    assert [decode_units.scan_threads_for(m) for m in (1, 8, 9, 64)] == [128, 128, 64, 64]
    assert decode_units.scan_threads_for(64, wide + 1) == 128
    assert decode_units.scan_threads_for(64, wide) == 64
    assert [decode_units.unit_tiles(m, 5632) for m in (1, 16, 17, 64)] == [1, 1, 2, 2]
    assert decode_units.unit_tiles(64, 96) == 2 and decode_units.unit_tiles(32, 64) == 2
    assert not decode_units.fits(1, 48)  # 32-unit mask words
    assert decode_units.fits(1, 65536) and not decode_units.fits(1, 65536 + 32)  # 16-bit ids
    assert [decode_units.token_tiles(m) for m in (1, 8, 9, 16, 17, 33, 64)] == [1, 1, 2, 2, 4, 8, 8]
    # the gate by token count: mma.sync up to 16, wgmma up to 64 (its tile's rows), cuBLAS
    gates = [decode_units.gate_for(m, 5632) for m in (1, 16, 17, 64, 65, 192)]
    assert gates == ["mma", "mma", "wgmma", "wgmma", "cublas", "cublas"]
    assert decode_units.WGMMA_TOKENS == 64


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_wgmma_gate_default_geometry_takes_two_ctas_per_sm() -> None:
    """The wgmma gate's default CTA (32 units, an 8-stage ring) at 64 tokens: its dynamic
    and static shared memory and its registers leave room for two CTAs per SM (the grid of
    176 CTAs for N = 5632 then runs in one wave on 132 SMs)."""
    from twell.kernels import decode_units

    ut, stages = decode_units.WGMMA_UNIT_TILES, decode_units.WGMMA_STAGES
    params = {"KDIM": 2048, "GATED": 1, "NT": 8, "UT": ut, "PRE": 0, "STAGES": stages}
    log = kc.compile_cubin(decode_units.GATE, params).log
    entry = log[log.index("Function properties for twell_units_gate_wgmma") :]
    found = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", entry)
    registers, static = int(found.group(1)), int(found.group(2))
    dynamic = decode_units.wgmma_shared_bytes(16 * ut, stages)
    assert 2 * (dynamic + static + 1024) <= 233472  # 228 KB an SM, 1 KB reserved a CTA
    assert 2 * registers * decode_units.GATE_THREADS <= 65536


def test_launch_cache_tells_a_variant_from_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Source.kernel caches per Source object (CPU: the compile stubbed): a variant built
    with other constants gets its own kernel under the same name, the same source hits."""
    import dataclasses

    built = []
    monkeypatch.setattr(kc, "_device_id", lambda: 0)
    monkeypatch.setattr(kc, "_kernel", lambda s, f, d: built.append(d) or object())
    monkeypatch.setattr(kc, "_launches", {})
    source = kc.SOURCES["pack.cu"]
    variant = dataclasses.replace(source, constants={**source.constants, "PACK_SIMD": 0})
    a = source.kernel("twell_pack_rows", TILE=256, SLOTS=32)
    assert source.kernel("twell_pack_rows", TILE=256, SLOTS=32) is a
    b = variant.kernel("twell_pack_rows", TILE=256, SLOTS=32)
    assert b is not a and [d["PACK_SIMD"] for d in built] == [1, 0]
