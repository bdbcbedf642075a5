"""A reuse.py backend that runs the kernels on the CPU (cuda_emu.h), on NumPy arrays.

Each set of compile-time parameters is built once with the host C++ compiler into a
shared library under ``$TWELL_EMU_DIR`` (default ``/tmp/twell_emu``). Slow (every CUDA
thread is a fiber), so for small problems only; faithful enough to check indexing,
synchronisation, fragment layouts and capacities.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "cuda_emu.h", HERE / "emu_main.cpp", HERE.parent / "reuse.cu")


class EmuBackend:
    def __init__(self, sms: int = 132, poison: bool = True, build_dir: str | None = None) -> None:
        self.sms = sms
        self.poison = poison
        self.build_dir = Path(build_dir or os.environ.get("TWELL_EMU_DIR", "/tmp/twell_emu"))
        self._libs: dict[tuple, Any] = {}
        self.launches: list[str] = []

    def multiprocessors(self) -> int:
        return self.sms

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        a = np.empty(shape, dtype=dtype)
        if self.poison:
            a.view(np.uint8)[...] = 0xFF
        return a

    def _lib(self, defines: Mapping[str, int]) -> Any:
        key = tuple(sorted(defines.items()))
        lib = self._libs.get(key)
        if lib is not None:
            return lib
        digest = hashlib.sha1(repr(key).encode())
        for path in SOURCES:
            digest.update(path.read_bytes())
        self.build_dir.mkdir(parents=True, exist_ok=True)
        so = self.build_dir / f"reuse_{digest.hexdigest()[:16]}.so"
        if not so.exists():
            flags = [f"-DTWELL_{k}={int(v)}" for k, v in key]
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            cmd = ["g++", "-O1", "-g", "-std=c++20", "-fPIC", "-shared", "-Wno-unknown-pragmas",
                   f"-I{HERE}", f"-I{HERE.parent}", *flags, str(HERE / "emu_main.cpp"), "-o",
                   str(tmp)]  # fmt: skip
            subprocess.run(cmd, check=True)
            tmp.rename(so)
        lib = ctypes.CDLL(str(so))
        lib.twell_emu_launch.restype = ctypes.c_int
        self._libs[key] = lib
        return lib

    @staticmethod
    def _arg(a: Any) -> Any:
        if a is None:
            return ctypes.c_void_p(0)
        if isinstance(a, np.ndarray):
            return ctypes.c_void_p(a.ctypes.data)
        if isinstance(a, np.generic):
            kinds = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
                     np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
                     np.dtype(np.float32): ctypes.c_float}  # fmt: skip
            return kinds[a.dtype](a.item())
        raise TypeError(f"kernel argument of type {type(a).__name__}")

    def launch(self, function: str, defines: Mapping[str, int], grid: tuple[int, ...],
               block: tuple[int, ...], args: tuple, smem: int = 0) -> None:  # fmt: skip
        lib = self._lib(defines)
        g = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
        b = tuple(int(v) for v in block) + (1,) * (3 - len(block))
        values = [self._arg(a) for a in args]
        argv = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        error = ctypes.create_string_buffer(512)
        rc = lib.twell_emu_launch(function.encode(), *[ctypes.c_uint(v) for v in g],
                                  *[ctypes.c_uint(v) for v in b], ctypes.c_uint(int(smem)),
                                  argv, error, 512)  # fmt: skip
        self.launches.append(function)
        if rc:
            raise RuntimeError(f"{function}: emulator error: {error.value.decode()}")
