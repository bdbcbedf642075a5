"""The one place where twell's CUDA sources are compiled.

Kernel sources live next to this file as ``.cu`` files and are read as strings through
:mod:`importlib.resources`. Compile-time parameters (tile width, slots, model width, ...)
are injected in one place, :func:`prelude`, as ``#define`` lines in front of the source, so
every kernel sees the same names (``TWELL_<NAME>``).

Two back ends share that source text:

- :func:`module` compiles with CuPy's ``RawModule`` (NVRTC) for the current device and
  caches the result per (device id, source name, parameters) behind a lock. CuPy keeps
  its own on-disk cache of the cubins too (``CUPY_CACHE_DIR``), so a warm start does not
  recompile.
- :func:`compile_cubin` compiles with ``cuda.bindings.nvrtc`` on any machine, GPU or
  not (CI uses it to prove that every source builds for sm_90a without spilling).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Every kernel source of the package (file names under ``twell/kernels``).
SOURCES = (
    "pack.cu",
    "sparse_ffn.cu",
    "sparse_rows.cu",
    "dense_rows.cu",
    "convert.cu",
    "gate_gemm.cu",
)

#: Architecture the kernels are built for (wgmma/setmaxnreg need the ``a`` variant).
ARCH = "sm_90a"

#: NVRTC options shared by both back ends. CuPy adds ``-ftz=true`` on its own; the CPU
#: path adds it too so both builds see the same code.
OPTIONS = ("--std=c++17", f"--gpu-architecture={ARCH}", "-ftz=true")

_lock = threading.Lock()
_modules: dict[tuple[int, str, tuple[tuple[str, int], ...]], Any] = {}
_kernels: dict[tuple[int, str, tuple[tuple[str, int], ...], str], Any] = {}


@functools.cache
def source(name: str) -> str:
    """The text of kernel source ``name`` (a file in ``twell/kernels``)."""
    if name not in SOURCES:
        raise ValueError(f"name: expected one of {SOURCES}, got {name!r}")
    return importlib.resources.files("twell.kernels").joinpath(name).read_text()


def prelude(params: Mapping[str, int]) -> str:
    """``#define TWELL_<NAME> <value>`` lines for the compile-time parameters."""
    lines = []
    for key, value in sorted(params.items()):
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ValueError(f"params: bad parameter name {key!r}")
        lines.append(f"#define TWELL_{key} {int(value)}")
    return "\n".join(lines) + "\n"


def full_source(name: str, params: Mapping[str, int]) -> str:
    """Source ``name`` with its parameter prelude, exactly as both back ends compile it."""
    return prelude(params) + source(name)


def _require_cupy() -> Any:
    try:
        import cupy
    except ImportError as error:
        raise RuntimeError(
            "twell's GPU kernels need CuPy: pip install 'twell[cuda13]' (or 'twell[cuda12]')"
        ) from error
    return cupy


@dataclass(frozen=True)
class DeviceInfo:
    """What the launchers need to know about a device."""

    id: int
    multiprocessors: int
    compute_capability: tuple[int, int]


def unavailable_reason() -> str | None:
    """Why the GPU kernels cannot run here (no CuPy, no device, not Hopper), or None.

    Never raises: the command line and the GPU tests use it to decide, and to say why.
    """
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        major, minor = (int(c) for c in cupy.cuda.Device().compute_capability)
    except Exception as error:  # noqa: BLE001 - no driver, no device, ...
        return f"no usable CUDA device: {error}"
    if (major, minor) != (9, 0):
        return f"twell's kernels need a Hopper GPU (compute capability 9.0), not {major}.{minor}"
    return None


def device_info() -> DeviceInfo:
    """The current CuPy device, checked to be a Hopper GPU (compute capability 9.0)."""
    cupy = _require_cupy()
    try:
        device_id = int(cupy.cuda.runtime.getDevice())
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise RuntimeError(f"twell's GPU kernels need a CUDA GPU; CUDA says: {error}") from error
    return _device_info(device_id)


@functools.cache
def _device_info(device_id: int) -> DeviceInfo:
    cupy = _require_cupy()
    try:
        device = cupy.cuda.Device(device_id)
        major, minor = (int(c) for c in device.compute_capability)
        sms = int(
            cupy.cuda.runtime.deviceGetAttribute(
                cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id
            )
        )
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise RuntimeError(f"twell's GPU kernels need a CUDA GPU; CUDA says: {error}") from error
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"twell's kernels are built for Hopper ({ARCH}, compute capability 9.0); "
            f"device {device_id} has compute capability {major}.{minor}"
        )
    return DeviceInfo(device_id, sms, (major, minor))


def module(name: str, params: Mapping[str, int] | None = None) -> Any:
    """The compiled ``cupy.RawModule`` of source ``name`` for the current device.

    Cached per (device id, source name, parameters); safe to call from several threads.

    Raises:
        RuntimeError: CuPy is missing, there is no Hopper GPU, or NVRTC failed (the
            message carries the compiler log).
    """
    cupy = _require_cupy()
    info = device_info()
    frozen = tuple(sorted((str(k), int(v)) for k, v in (params or {}).items()))
    key = (info.id, name, frozen)
    with _lock:
        found = _modules.get(key)
        if found is not None:
            return found
        code = full_source(name, dict(frozen))
        try:
            compiled = cupy.RawModule(code=code, options=OPTIONS[:2])
            compiled.compile()
        except cupy.cuda.compiler.CompileException as error:
            raise RuntimeError(
                f"compiling twell kernel {name} {dict(frozen)} failed:\n{error}"
            ) from error
        _modules[key] = compiled
        return compiled


def kernel(name: str, function: str, params: Mapping[str, int] | None = None) -> Any:
    """One ``cupy.RawKernel`` (``function``, an ``extern "C"`` name) of source ``name``,
    for the current device; cached like :func:`module`."""
    frozen = tuple(sorted((str(k), int(v)) for k, v in (params or {}).items()))
    key = (device_info().id, name, frozen, function)
    found = _kernels.get(key)
    if found is None:
        found = module(name, dict(frozen)).get_function(function)
        with _lock:
            _kernels[key] = found
    return found


# ------------------------------------------------------------------ CPU-side NVRTC
def include_dirs() -> list[str]:
    """Header directories for NVRTC without a GPU: CUDA runtime headers, CuPy's CCCL.

    Raises:
        RuntimeError: the CUDA headers (``cuda_bf16.h``) cannot be found.
    """
    dirs: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            dirs.append(found)
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root:
            dirs.append(os.path.join(root, "include"))
    dirs.append("/usr/local/cuda/include")
    try:
        import cupy

        cccl = os.path.join(os.path.dirname(cupy.__file__), "_core", "include", "cupy", "_cccl")
        dirs.append(os.path.join(cccl, "libcudacxx", "include"))
    except ImportError:
        pass
    dirs = [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]
    if not any(os.path.exists(os.path.join(d, "cuda_bf16.h")) for d in dirs):
        raise RuntimeError(
            "CUDA headers (cuda_bf16.h) not found: pip install nvidia-cuda-runtime, "
            "or set CUDA_PATH"
        )
    return dirs


@dataclass(frozen=True)
class CompileResult:
    """A cubin built on the CPU, with NVRTC's log (it holds the ptxas report)."""

    cubin: bytes
    log: str


def compile_cubin(
    name: str, params: Mapping[str, int] | None = None, *, verbose_ptxas: bool = True
) -> CompileResult:
    """Compile source ``name`` for sm_90a with ``cuda.bindings.nvrtc`` (no GPU needed).

    Raises:
        RuntimeError: ``cuda.bindings`` or the headers are missing, or compilation failed.
    """
    try:
        from cuda.bindings import nvrtc
    except ImportError as error:
        raise RuntimeError("cuda.bindings is not installed (pip install cuda-bindings)") from error
    code = full_source(name, params or {}).encode()
    options = [o.encode() for o in OPTIONS]
    options += [f"--include-path={d}".encode() for d in include_dirs()]
    if verbose_ptxas:
        options.append(b"--ptxas-options=-v")

    def check(result: Any, what: str) -> Any:
        status, *rest = result
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what} failed: {status}")
        return rest[0] if len(rest) == 1 else rest

    program = check(nvrtc.nvrtcCreateProgram(code, name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        status = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
        size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        buffer = b" " * size
        check(nvrtc.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        log = buffer.decode(errors="replace").rstrip("\x00 \n")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"compiling {name} {dict(params or {})} failed:\n{log}")
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return CompileResult(cubin, log)
