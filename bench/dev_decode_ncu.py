"""A driver for Nsight Compute: the by-unit decode route (decode_units.forward) on
`uniform` (K=2048, N=5632), one call per M after a warm-up, each in an NVTX range
``M<m>``:

    ncu --nvtx --nvtx-include "M64/" -k regex:units_ --section ... \\
        python bench/dev_decode_ncu.py --M 64
"""

from __future__ import annotations

import argparse

import cupy as cp

from twell.benchmark import make_problem, to_device
from twell.kernels import decode_units, pipeline
from twell.kernels.buffers import empty_bf16
from twell.options import Options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[64])
    args = parser.parse_args()
    for m in args.M:
        p = make_problem("uniform", m, 2048, 5632, seed=0)
        block = pipeline.PreparedBlock(
            to_device(p.w_gate), to_device(p.w_up), to_device(p.w_down),
            Options(path="fused", density_switch=False),
        )  # fmt: skip
        x, y = to_device(p.x), empty_bf16((m, 2048))
        operands = (x, block.w_first, block.w_up, block.w_down_t, y)
        decode_units.forward(*operands)
        cp.cuda.Device().synchronize()
        cp.cuda.nvtx.RangePush(f"M{m}")
        decode_units.forward(*operands)
        cp.cuda.Device().synchronize()
        cp.cuda.nvtx.RangePop()
        bits = y.view(cp.uint16)  # bf16 NaN: exponent all ones, mantissa not zero
        assert not bool(((bits & 0x7FFF) > 0x7F80).any()), "NaN in y"


if __name__ == "__main__":
    main()
