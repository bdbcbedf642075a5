"""The packing kernel (`pack.cu`, the "pack" and "sliced" routes) with its bit tests one
value at a time (PACK_SIMD 0) and two bf16 per instruction with empty tiles stored
straight away (PACK_SIMD 1): µs per launch (CUDA events, the median of 30, eager CuPy
launches, the pre-activation of a real gate GEMM on `density=P`), and both variants'
words and heavy flags compared on the same input, which also holds rows of zeros, -0,
+Inf, -Inf, +NaN and -NaN.

    PYTHONPATH=. python bench/dev_pack.py [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import cupy as cp

from bench.dev_gate_gemm import time_ms
from twell.benchmark import gpu_name, make_problem, to_device, versions
from twell.kernels import pack
from twell.kernels.cublas import gemm_nt

BASE = pack.SOURCE
#: (M, K, N, density): the model shapes of docs/benchmark.md.
CASES = ((4096, 2048, 5632, 0.005), (16384, 2048, 5632, 0.005), (16384, 4096, 14336, 0.003))


def use(simd: int) -> None:
    pack.SOURCE = dataclasses.replace(BASE, constants={**BASE.constants, "PACK_SIMD": simd})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = []
    for m, k, n, p in CASES:
        prob = make_problem(f"density={p}", m, k, n)
        pre = gemm_nt(to_device(prob.x), to_device(prob.w_gate))
        bits = pre.view(cp.uint16)
        for row, value in enumerate((0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFC1)):
            bits[row] = 0x8000  # -0 everywhere, then one special value
            bits[row, 3 * 256 + 5] = value
        bits[6, 7] = 0xFFC1  # a -NaN in an otherwise ordinary row
        results = {}
        for simd in (0, 1, 0, 1):
            use(simd)
            packed, heavy = pack.pack(pre, 256, 32)
            t = time_ms(lambda pre=pre: pack.pack(pre, 256, 32), reps=30) * 1e3
            results.setdefault(simd, []).append(t)
            if simd not in results.get("words", {}):
                results.setdefault("words", {})[simd] = (packed.copy(), heavy.copy())
        (w0, h0), (w1, h1) = results["words"][0], results["words"][1]
        r = {"M": m, "K": k, "N": n, "p": p, "scalar_us": results[0], "simd_us": results[1],
             "words_equal": bool(cp.array_equal(w0, w1)),
             "heavy_equal": bool(cp.array_equal(h0, h1)),
             "heavy_rows": int(h1.sum()), "special_rows_heavy": h1[:7].get().tolist(),
             "gpu": gpu_name(), **versions()}  # fmt: skip
        print(json.dumps(r), flush=True)
        records.append(r)
    use(pack.PACK_SIMD)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
