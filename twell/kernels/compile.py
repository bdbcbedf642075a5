"""The one place where twell's CUDA sources are compiled.

Each kernel source is a ``.cu`` file next to its launcher module (``X.cu`` is launched
by ``X.py`` alone; the backward's steps, ``backward_*.cu``, by ``backward.py``), read as a
string through :mod:`importlib.resources`. A launcher declares its source once, as a
:class:`Source`: the compile-time parameters it chooses per call (tile width, slots,
model width, ...), the constants it shares with the kernel (block sizes the host needs
for its grid), the shared headers it uses, and example configurations for the compile
test. The text that gets compiled is always

    #define TWELL_<NAME> <value>   (constants and parameters, sorted)
    common.cuh                     (shared device code: types, bf16 helpers, routing rule)
    the source's headers           (tensor_core.cuh: the tensor-core tile engine)
    <the source>

built by :func:`full_source`, for both back ends:

- :meth:`Source.kernel` compiles with CuPy's ``RawModule`` (NVRTC) for the current
  device and caches the result per (device id, source, parameters) behind a lock. CuPy
  keeps its own on-disk cache keyed on the whole text (``CUPY_CACHE_DIR``), so a change
  to ``common.cuh`` or another header recompiles and a warm start does not.
- :func:`planning` records the modules a sequence of calls would compile, without
  compiling or launching, and :func:`compile_modules` then builds them on a thread per
  CPU core (twell.warmup: a model's kernels ready before its first call).
- :func:`compile_cubin` compiles with ``cuda.bindings.nvrtc`` on any machine, GPU or
  not (the CPU test proves that every source builds for sm_90a without spilling).

Kernels launch through CuPy (``kernel(grid, block, args)``), except where a twell kernel
follows another (or cuBLAS's gate GEMM) in a forward pass: :func:`launch_after` lets its
CTAs be scheduled while the first one's last CTAs still run (programmatic dependent
launch; the kernels that allow it are their sources' ``dependent`` ones).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.resources
import os
import re
import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twell import _driver
from twell._optional import optional_dependency

#: Architecture the kernels are built for (wgmma/setmaxnreg need the ``a`` variant).
ARCH = "sm_90a"

#: NVRTC options shared by both back ends. CuPy adds ``-ftz=true`` on its own; the CPU
#: path adds it too so both builds see the same code.
OPTIONS = ("--std=c++17", f"--gpu-architecture={ARCH}", "-ftz=true")

#: The shared device code put in front of every source.
COMMON_HEADER = "common.cuh"

#: Whether :func:`launch_after` launches with a programmatic dependency on the previous
#: kernel (``TWELL_PDL=0`` in the environment, or False here: plain launches, for
#: comparisons or a driver that misbehaves).
PROGRAMMATIC = os.environ.get("TWELL_PDL", "1") != "0"
#: The ``struct`` code of each numpy scalar type a kernel argument may have (a CuPy array
#: is its pointer, "Q"); a kernel's parameters are laid out with C's alignment, as
#: ``struct``'s native mode lays them out.
_CODES = {"int32": "i", "uint32": "I", "int64": "q", "uint64": "Q", "float32": "f"}
#: ``CU_LAUNCH_PARAM_BUFFER_POINTER``, ``CU_LAUNCH_PARAM_BUFFER_SIZE``, ``CU_LAUNCH_PARAM_END``.
_BUFFER_POINTER, _BUFFER_SIZE, _PARAMS_END = 1, 2, 0
_formats: dict[tuple[type, ...], str] = {}

_lock = threading.Lock()
_module_locks: dict[tuple[int, str, tuple[tuple[str, int], ...]], threading.Lock] = {}
_modules: dict[tuple[int, str, tuple[tuple[str, int], ...]], Any] = {}
_kernels: dict[tuple[int, str, tuple[tuple[str, int], ...], str], Any] = {}
#: Source.kernel's cache: (device, id(source), function, *parameter items) -> (source,
#: kernel). Keyed on the Source object, not its name, so that a variant with other
#: constants (``dataclasses.replace(SOURCE, constants=...)``, as benchmarks build) gets its
#: own kernels; the entry holds the source, so its id is not reused while cached.
_launches: dict[tuple, tuple[Source, Any]] = {}

#: Every declared source, by file name (filled by the launcher modules' imports), and
#: the ``dependent`` kernels of them all (the ones :func:`launch_after` overlaps).
SOURCES: dict[str, Source] = {}
DEPENDENT: set[str] = set()


@dataclass(frozen=True)
class Source:
    """A kernel source and its declared compile-time interface.

    Args:
        name: the file name (``"pack.cu"``).
        parameters: names of the parameters a launch chooses (``TWELL_<NAME>`` in the
            source); every compile must give exactly these.
        constants: fixed values shared by the launcher and the kernel, defined once here.
        examples: configurations of ``parameters`` the CPU compile test builds.
        directory: where the file lives (default: this package; benchmarks' ladder
            sources live under ``bench/``).
        dependent: the kernels :func:`launch_after` may launch: each calls
            ``twell_grid_wait()`` before any global memory access, in every CTA (the CPU
            test checks that in their PTX, for every example configuration).
        headers: shared device headers of this package (``"tensor_core.cuh"``) the
            source uses, put after ``common.cuh`` in this order.
    """

    name: str
    parameters: tuple[str, ...] = ()
    constants: Mapping[str, int] = field(default_factory=dict)
    examples: tuple[Mapping[str, int], ...] = ({},)
    directory: Path | None = None
    dependent: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()

    def text(self) -> str:
        """The source file's text."""
        return _read(self.name, self.directory)

    def defines(self, params: Mapping[str, int]) -> dict[str, int]:
        """Constants plus ``params``, checked against the declared parameter names."""
        if set(params) != set(self.parameters):
            raise ValueError(
                f"{self.name}: expected parameters {sorted(self.parameters)}, got {sorted(params)}"
            )
        return {**self.constants, **{k: int(v) for k, v in params.items()}}

    def kernel(self, function: str, **params: int) -> Any:
        """One compiled ``cupy.RawKernel`` (an ``extern "C"`` name of this source) for
        the current device, with the given parameter values; cached.

        A launch asks for its kernel every time, so the hit costs one CUDA device query
        and one dict lookup keyed on the call as written (a launcher passes its
        parameters in a fixed order); the first call of a key checks and compiles.
        """
        modules = getattr(_plan, "modules", None)
        if modules is not None:
            modules[(self.name, tuple(sorted(self.defines(params).items())))] = self
            return _Planned(function)
        key = (_device_id(), id(self), function, *params.items())
        found = _launches.get(key)
        if found is None:
            found = _launches[key] = (self, _kernel(self, function, self.defines(params)))
        return found[1]


def declare(source: Source) -> Source:
    """Register a launcher's source (once per name) and return it."""
    known = SOURCES.get(source.name)
    if known is not None and known != source:
        raise ValueError(f"{source.name} is declared twice with different interfaces")
    SOURCES[source.name] = source
    DEPENDENT.update(source.dependent)
    return source


@functools.cache
def _read(name: str, directory: Path | None) -> str:
    if directory is not None:
        return (directory / name).read_text()
    return importlib.resources.files("twell.kernels").joinpath(name).read_text()


def common_header() -> str:
    """The text of ``common.cuh``."""
    return _read(COMMON_HEADER, None)


def prelude(params: Mapping[str, int]) -> str:
    """``#define TWELL_<NAME> <value>`` lines for the compile-time values."""
    lines = []
    for key, value in sorted(params.items()):
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ValueError(f"params: bad parameter name {key!r}")
        lines.append(f"#define TWELL_{key} {int(value)}")
    return "\n".join(lines) + "\n"


def full_source(source: Source, params: Mapping[str, int]) -> str:
    """The text both back ends compile for ``params``: prelude, ``common.cuh``, the
    source's headers, the source."""
    return _text(source, source.defines(params))


def _text(source: Source, defines: Mapping[str, int]) -> str:
    headers = "".join(_read(name, None) for name in source.headers)
    return prelude(defines) + common_header() + headers + source.text()


def _require_cupy() -> Any:
    with optional_dependency("cupy", "twell's GPU kernels"):
        import cupy
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


def launch_after(
    kernel: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple,
    shared_mem: int = 0,
    *,
    overlap: bool = True,
) -> None:
    """Launch ``kernel`` (a compiled ``cupy.RawKernel``) on CuPy's current stream as
    ``kernel(grid, block, args, shared_mem=shared_mem)`` would, but allowed to start
    before the previous kernel in the stream has finished: its CTAs take SMs as the
    previous kernel's CTAs leave them (or earlier, where that kernel calls
    ``twell_grid_release()``), and wait in ``twell_grid_wait()`` (common.cuh) until it
    has finished and its writes are visible. Captured into a CUDA graph, the dependency
    becomes a programmatic edge. The wait covers the previous kernel only (and, through
    its own wait, what it waited for): the launchers use this where that kernel is
    twell's or its cuBLAS GEMM. ``overlap=False``: a plain launch (for launchers that
    decide per call).

    Raises:
        ValueError: ``kernel`` is not one of a source's ``dependent`` kernels (those that
            wait first), or a grid or block size is out of range.
        TypeError: an argument is neither a CuPy array nor a numpy scalar of ``_CODES``.
    """
    if isinstance(kernel, _Planned):
        return
    name = getattr(kernel, "name", None)
    if overlap and name not in DEPENDENT:
        raise ValueError(f"launch_after: {name} is not a dependent kernel of any Source")
    for what, dims in (("grid", grid), ("block", block)):
        if not 1 <= len(dims) <= 3 or not all(0 < d < 2**31 for d in dims):
            raise ValueError(f"launch_after: {what} {dims} must be 1 to 3 sizes in [1, 2**31)")
    if not overlap or not PROGRAMMATIC or not _has_launch_ex():
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    cupy = _require_cupy()
    key = tuple(map(type, args))
    layout = _formats.get(key)
    if layout is None:
        codes = []
        for arg in args:
            code = "Q" if isinstance(arg, cupy.ndarray) else _CODES.get(type(arg).__name__)
            if code is None or not (code == "Q" or hasattr(arg, "dtype")):
                raise TypeError(f"launch_after: unsupported kernel argument {type(arg).__name__}")
            codes.append(code)
        layout = _formats[key] = "@" + "".join(codes)
    packed = struct.pack(layout, *(a.data.ptr if isinstance(a, cupy.ndarray) else a for a in args))
    buffer = ctypes.create_string_buffer(packed, len(packed))
    size = ctypes.c_size_t(len(packed))
    extra = (ctypes.c_void_p * 5)(
        _BUFFER_POINTER, ctypes.addressof(buffer), _BUFFER_SIZE, ctypes.addressof(size), _PARAMS_END
    )
    attribute = _driver.LaunchAttribute(id=_driver.ATTRIBUTE_PROGRAMMATIC)
    attribute.value[0] = 1
    config = _driver.LaunchConfig(
        grid=(ctypes.c_uint * 3)(*grid, *(1,) * (3 - len(grid))),
        block=(ctypes.c_uint * 3)(*block, *(1,) * (3 - len(block))),
        shared_mem_bytes=shared_mem,
        stream=cupy.cuda.get_current_stream().ptr,
        attrs=ctypes.addressof(attribute),
        num_attrs=1,
    )
    _driver.call(
        "cuLaunchKernelEx", ctypes.byref(config), ctypes.c_void_p(kernel.kernel.ptr), None, extra
    )


@functools.cache
def _has_launch_ex() -> bool:
    """Whether the driver has ``cuLaunchKernelEx`` (else launches are plain: the kernels'
    wait then returns at once, and stream order alone orders them)."""
    try:
        _driver.function("cuLaunchKernelEx")
    except RuntimeError:
        return False
    return True


def _device_id() -> int:
    """CuPy's current device (no check: :func:`device_info` checks on a cache miss)."""
    cupy = _require_cupy()
    try:
        return cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError:
        return device_info().id  # raises the descriptive error


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


@functools.cache  # one driver query per (device, kernel, geometry): a host call, no sync
def _active_clusters(device: int, function: int, cluster: int, threads: int, shared: int) -> int:
    sms = _device_info(device).multiprocessors
    try:
        query = _driver.function("cuOccupancyMaxActiveClusters")
    except RuntimeError:
        return max(1, sms // cluster)
    config = _driver.LaunchConfig()
    config.grid[:] = (cluster * max(1, sms // cluster), 1, 1)
    config.block[:] = (threads, 1, 1)
    config.shared_mem_bytes = shared
    count = ctypes.c_int(0)
    status = query(ctypes.byref(count), ctypes.c_void_p(function), ctypes.byref(config))
    return int(count.value) if status == 0 and count.value > 0 else max(1, sms // cluster)


def max_active_clusters(kernel: Any, cluster: int, threads: int, shared: int) -> int:
    """Clusters of ``cluster`` CTAs of the compiled ``kernel`` (a ``cupy.RawKernel`` built
    with ``__cluster_dims__``) that the current device runs at once with ``threads``
    threads and ``shared`` bytes of dynamic shared memory per CTA: the driver's
    ``cuOccupancyMaxActiveClusters`` (the GPCs' SM counts decide it, not only the SM
    total), or SMs // cluster where the driver cannot say. Asked once per geometry."""
    return _active_clusters(device_info().id, kernel.kernel.ptr, cluster, threads, shared)


def _kernel(source: Source, function: str, defines: Mapping[str, int]) -> Any:
    """The compiled kernel ``function`` of ``source`` with ``defines`` (constants and
    parameters), for the current device; cached, safe to call from several threads.

    Raises:
        RuntimeError: CuPy is missing, there is no Hopper GPU, or NVRTC failed (the
            message carries the compiler log).
    """
    frozen = tuple(sorted(defines.items()))
    device = device_info().id
    key = (device, source.name, frozen, function)
    found = _kernels.get(key)
    if found is not None:
        return found
    compiled = _module(source, frozen, device)
    with _lock:
        found = _kernels[key] = compiled.get_function(function)
    return found


def _module(source: Source, frozen: tuple[tuple[str, int], ...], device: int) -> Any:
    """The compiled ``cupy.RawModule`` of ``source`` with the ``frozen`` defines on
    ``device`` (the current one). Each module compiles under a lock of its own, so that
    threads compile different modules at once (NVRTC releases the GIL) and one module
    once."""
    key = (device, source.name, frozen)
    found = _modules.get(key)
    if found is not None:
        return found
    cupy = _require_cupy()
    with _lock:
        lock = _module_locks.setdefault(key, threading.Lock())
    with lock:
        found = _modules.get(key)
        if found is None:
            try:
                found = cupy.RawModule(code=_text(source, dict(frozen)), options=OPTIONS[:2])
                found.compile()
            except cupy.cuda.compiler.CompileException as error:
                raise RuntimeError(
                    f"compiling twell kernel {source.name} {dict(frozen)} failed:\n{error}"
                ) from error
            _modules[key] = found
    return found


# ------------------------------------------------------------------ planning
class _Planned:
    """What :meth:`Source.kernel` returns inside :func:`planning`: it records the module
    the kernel lives in and launches nothing (``__call__`` and :func:`launch_after` skip
    it; its attributes are those the launchers read or set)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.max_dynamic_shared_size_bytes = 0
        self.kernel = _NoFunction()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _NoFunction:
    ptr = 0


_plan = threading.local()
#: Threads that plan or compile at once by default: one per CPU core, at most 32.
WORKERS = min(32, os.cpu_count() or 1)


def planned() -> bool:
    """Whether this thread is inside :func:`planning` (the call graphs then capture
    nothing: a graph of skipped launches would replay nothing)."""
    return getattr(_plan, "modules", None) is not None


@contextlib.contextmanager
def planning() -> Iterator[dict[tuple, Source]]:
    """Inside, on this thread, :meth:`Source.kernel` compiles nothing and launches
    nothing: it records the module each kernel would come from, into the dict this
    yields (``(source name, defines) -> Source``; :func:`compile_modules` builds them).

    The calls made inside run their host logic and their torch/cuBLAS work for real, on
    buffers the skipped kernels never write: their outputs are garbage, and nothing they
    build may outlive the plan (twell.warmup plans on weights of its own and drops their
    prepared blocks).
    """
    if planned():
        raise RuntimeError("planning() is already active on this thread")
    modules: dict[tuple, Source] = {}
    _plan.modules = modules
    try:
        yield modules
    finally:
        _plan.modules = None


def compile_modules(
    modules: Mapping[tuple, Source], workers: int | None = None
) -> list[tuple[tuple, BaseException]]:
    """Compile (or load from CuPy's disk cache) the modules of a :func:`planning` record
    for the current device, ``workers`` threads at a time (default :data:`WORKERS`).
    Returns the ``(key, error)`` of the modules that failed (a failed module raises again
    when a call needs it)."""
    import concurrent.futures

    cupy = _require_cupy()
    device = device_info().id
    todo = [(key, source) for key, source in modules.items() if (device, *key) not in _modules]

    def build(item: tuple[tuple, Source]) -> None:
        (_, frozen), source = item
        with cupy.cuda.Device(device):
            _module(source, frozen, device)

    failed: list[tuple[tuple, BaseException]] = []
    workers = workers or WORKERS
    with concurrent.futures.ThreadPoolExecutor(max(1, workers), "twell-compile") as pool:
        futures = {pool.submit(build, item): item[0] for item in todo}
        for future in concurrent.futures.as_completed(futures):
            error = future.exception()
            if error is not None:
                failed.append((futures[future], error))
    return failed


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
    source: Source, params: Mapping[str, int] | None = None, *, verbose_ptxas: bool = True
) -> CompileResult:
    """Compile ``source`` for sm_90a with ``cuda.bindings.nvrtc`` (no GPU needed).

    Raises:
        RuntimeError: ``cuda.bindings`` or the headers are missing, or compilation failed.
    """
    extra = ["--ptxas-options=-v"] if verbose_ptxas else []
    cubin, log = _nvrtc(source, params, list(OPTIONS) + extra, "CUBIN")
    return CompileResult(cubin, log)


def compile_ptx(source: Source, params: Mapping[str, int] | None = None) -> str:
    """The PTX of ``source`` for ``compute_90a`` (NVRTC on any machine; tests read the
    order of its instructions)."""
    options = [o.replace(ARCH, ARCH.replace("sm_", "compute_")) for o in OPTIONS]
    return _nvrtc(source, params, options, "PTX")[0].decode().rstrip("\x00")


def _nvrtc(
    source: Source, params: Mapping[str, int] | None, options: list[str], output: str
) -> tuple[bytes, str]:
    """NVRTC's ``output`` ("CUBIN" or "PTX") for ``source`` with ``params``, and its log."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as error:
        raise RuntimeError("cuda.bindings is not installed (pip install cuda-bindings)") from error
    name = source.name
    code = full_source(source, params or {}).encode()
    flags = [o.encode() for o in options]
    flags += [f"--include-path={d}".encode() for d in include_dirs()]

    def check(result: Any, what: str) -> Any:
        status, *rest = result
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what} failed: {status}")
        return rest[0] if len(rest) == 1 else rest

    program = check(nvrtc.nvrtcCreateProgram(code, name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        status = nvrtc.nvrtcCompileProgram(program, len(flags), flags)[0]
        size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        buffer = b" " * size
        check(nvrtc.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        log = buffer.decode(errors="replace").rstrip("\x00 \n")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"compiling {name} {dict(params or {})} failed:\n{log}")
        size = check(getattr(nvrtc, f"nvrtcGet{output}Size")(program), f"nvrtcGet{output}Size")
        data = b" " * size
        check(getattr(nvrtc, f"nvrtcGet{output}")(program, data), f"nvrtcGet{output}")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return data, log
