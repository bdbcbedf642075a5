"""Seconds from a bare process to every kernel of the common paths having run once.

Run it twice with the same ``CUPY_CACHE_DIR``: the first run (empty cache) is the cold
JIT figure of BENCH.md, the second the warm start.
"""

import time

start = time.perf_counter()

import cupy as cp  # noqa: E402

import twell  # noqa: E402
from twell import workloads  # noqa: E402
from twell.benchmark import to_device  # noqa: E402

for m in (64, 2048):  # the decode kernels below M=1024, the row kernels above
    p = workloads.heavy(m, 512, 1024, seed=1)
    x, w_gate, w_up, w_down = (to_device(a) for a in p.arrays())
    for slots in (32, 64, 128):
        twell.ffn(x, w_gate, w_up, w_down, slots=slots)
        twell.ffn(x, None, w_up, w_down, slots=slots)
    h = twell.gate(x, w_gate)
    twell.gated_down(x, h, w_up, w_down)
    twell.down(h, w_down)
cp.cuda.Device().synchronize()
print(f"{time.perf_counter() - start:.2f}")
