"""One launch of gate_gemm.cu's packing kernel at the benchmark's main shape, for a profiler:

    ncu --clock-control none -k regex:twell_gate_gemm -c 1 --section WarpStateStats \
        --section SourceCounters python3 bench/profile_gate_gemm.py
"""

import cupy as cp

from bench.dev_gate_gemm import sparse_problem
from twell.kernels.gate_gemm import gate_pack

x, w = sparse_problem(16384, 5632, 2048, seed=0)
packed, heavy = gate_pack(x, w, 256, 32)
cp.cuda.runtime.deviceSynchronize()
print("heavy rows", int(heavy.sum()))
