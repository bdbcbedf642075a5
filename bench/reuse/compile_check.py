"""Compile reuse.cu for sm_90a with NVRTC on this (GPU-less) machine and check ptxas.

    .venv/bin/python bench/reuse/compile_check.py            # the required configurations
    .venv/bin/python bench/reuse/compile_check.py --all      # plus the tunable variants

Every kernel of every configuration must have 0 bytes of spill stores/loads and a 0-byte
stack frame; prints registers and shared memory per kernel (and exits 1 on a failure).
Needs ``cuda.bindings`` and the CUDA headers (see docs/nvrtc_on_cpu.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import reuse  # noqa: E402

#: The configurations the brief asks for: KDIM x GATED at TILE=256, SLOTS=32.
REQUIRED = [
    {"KDIM": k, "TILE": 256, "SLOTS": 32, "GATED": g} for k in (2048, 4096, 264) for g in (0, 1)
]
#: Tunable variants the check script may time.
VARIANTS = [
    {"KDIM": 2048, "TILE": 256, "SLOTS": 32, "GATED": 1, "UP_BLOCK": 1024},
    {"KDIM": 2048, "TILE": 256, "SLOTS": 32, "GATED": 1, "UP_KS": 128},
    {"KDIM": 2048, "TILE": 256, "SLOTS": 32, "GATED": 1, "UP_KS": 32, "UP_BLOCK": 1024},
    {
        "KDIM": 2048,
        "TILE": 256,
        "SLOTS": 32,
        "GATED": 1,
        "DOWN_KS": 128,
        "DOWN_BLOCK": 256,
        "ROW_CHUNK": 256,
    },
    {"KDIM": 2048, "TILE": 256, "SLOTS": 32, "GATED": 1, "DOWN_KS": 32},
    {"KDIM": 2048, "TILE": 256, "SLOTS": 32, "GATED": 1, "ROW_CHUNK": 256},
    {"KDIM": 2048, "TILE": 128, "SLOTS": 64, "GATED": 1},
    {"KDIM": 4096, "TILE": 256, "SLOTS": 128, "GATED": 1},
    {"KDIM": 8, "TILE": 32, "SLOTS": 2, "GATED": 1},
]


def include_dirs() -> list[str]:
    try:
        from twell.kernels.compile import include_dirs as twell_dirs

        return twell_dirs()
    except Exception:  # noqa: BLE001 - the tree is being restructured: fall back
        import cuda.pathfinder as pf

        return [pf.find_nvidia_header_directory("cudart")]


def compile_source(code: str, name: str = "reuse.cu") -> tuple[bytes, str]:
    """(cubin, log) of ``code`` built for sm_90a with ptxas -v."""
    from cuda.bindings import nvrtc

    options = [b"--std=c++17", b"--gpu-architecture=sm_90a", b"-ftz=true", b"--ptxas-options=-v"]
    options += [f"--include-path={d}".encode() for d in include_dirs()]
    status, program = nvrtc.nvrtcCreateProgram(code.encode(), name.encode(), 0, [], [])
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        text = log.decode(errors="replace").rstrip("\x00 \n")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed:\n{text}")
        _, size = nvrtc.nvrtcGetCUBINSize(program)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(program, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin, text


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Per kernel: registers, stack, spill stores/loads, static shared memory (bytes)."""
    report: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line) or re.search(
            r"Compiling entry function '(\w+)'", line
        )
        if m:
            current = m.group(1)
            report.setdefault(current, {})
            continue
        if current is None:
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            report[current].update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            report[current]["regs"] = int(m[1])
            s = re.search(r"(\d+) bytes smem", line)
            report[current]["smem"] = int(s[1]) if s else 0
    return {k: v for k, v in report.items() if k.startswith("twell_")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--all", action="store_true", help="also the tunable variants")
    args = parser.parse_args()
    configs = REQUIRED + (VARIANTS if args.all else [])
    failed = 0
    for params in configs:
        code = reuse.full_source(params)
        try:
            cubin, log = compile_source(code)
        except RuntimeError as error:
            print(f"FAIL {params}: {error}")
            failed += 1
            continue
        report = ptxas_report(log)
        print(f"{params}  cubin {len(cubin)} B")
        for kernel, r in sorted(report.items()):
            ok = r.get("stack", 1) == 0 and r.get("spill_st", 1) == 0 and r.get("spill_ld", 1) == 0
            dyn = reuse.dynamic_smem_bytes(kernel, params)
            print(
                f"  {'ok ' if ok else 'BAD'} {kernel:26s} regs {r.get('regs', '?'):>3}  "
                f"stack {r.get('stack', '?')}  spill {r.get('spill_st', '?')}/{r.get('spill_ld', '?')}  "
                f"smem static {r.get('smem', 0)} + dynamic {dyn}"
            )
            failed += not ok
    print("all clean" if not failed else f"{failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
