"""Seconds from a bare process to every kernel of the common paths having run once.

Run it twice with the same ``CUPY_CACHE_DIR``: the first run (empty cache) is the cold
JIT figure of docs/benchmark.md, the second the warm start. Prints the total and its parts:
imports, building the test problems (NumPy), CUDA context and cuBLAS handle, and the
first use of every kernel (compiling or loading from CuPy's cache, and running it).
"""

import time

start = time.perf_counter()

import cupy as cp  # noqa: E402

import twell  # noqa: E402
from twell import workloads  # noqa: E402
from twell.benchmark import to_device  # noqa: E402

imported = time.perf_counter()
problems = [workloads.heavy(m, 512, 1024, seed=1) for m in (64, 2048)]
built = time.perf_counter()
cp.zeros(1).sum()
cp.cuda.device.get_cublas_handle()
cp.cuda.Device().synchronize()
context = time.perf_counter()

for p in problems:  # M=64: the decode kernels (M <= 1024); M=2048: the row kernels
    x, w_gate, w_up, w_down = (to_device(a) for a in p.arrays())
    for slots in (32, 64, 128):
        twell.ffn(x, w_gate, w_up, w_down, slots=slots)
        twell.ffn(x, None, w_up, w_down, slots=slots)
    h = twell.gate(x, w_gate)
    twell.gated_down(x, h, w_up, w_down)
    twell.down(h, w_down)
cp.cuda.Device().synchronize()
done = time.perf_counter()
print(
    f"{done - start:.2f} s in all (imports {imported - start:.2f}, test problems "
    f"{built - imported:.2f}, CUDA context and cuBLAS {context - built:.2f}, first use of "
    f"every kernel {done - context:.2f})"
)
