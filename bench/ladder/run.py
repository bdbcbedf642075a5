"""The ladder of kernel versions, kept runnable: each earlier version beside the one
twell runs now, checked against it and timed on the same inputs (one GPU call).

bench/ladder/README.md lists the steps, one line each, with their measured figures.

    PYTHONPATH=. python bench/ladder/run.py
"""

from __future__ import annotations

import math
from pathlib import Path

import cupy as cp
import numpy as np

from twell.benchmark import make_problem, time_ms, to_device
from twell.kernels import heavy_rows, light_rows
from twell.kernels.buffers import empty_bf16, u16
from twell.kernels.compile import Source
from twell.kernels.cublas import gemm_nt
from twell.kernels.pack import pack
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options
from twell.testing.asserts import relative_error

HERE = Path(__file__).resolve().parent
SPARSE_V1 = Source("sparse_ffn_v1.cu", ("KDIM", "TILE", "SLOTS", "GATED"), directory=HERE)
HEAVY_V1 = Source("heavy_rows_simple.cu", directory=HERE)


def light_rows_v1(x, packed, heavy, w_up, w_down_t, y) -> None:
    m, k = y.shape
    SPARSE_V1.kernel("twell_sparse_rows", KDIM=k, TILE=256, SLOTS=32, GATED=1)(
        (math.ceil(m / 4),), (128,),
        (u16(x), packed, heavy, u16(w_up), u16(w_down_t), u16(y), np.int32(m),
         np.int32(w_down_t.shape[0])),
    )  # fmt: skip


def heavy_rows_v1(a, b, out, ids, count, max_rows) -> None:
    outc, red = b.shape
    items = math.ceil(max_rows / 16) * math.ceil(outc / 32)
    HEAVY_V1.kernel("twell_heavy_rows_simple")(
        (max(1, min(items, 132 * 8)),), (128,),
        (u16(a), np.int32(1), np.int32(0), u16(b), np.int32(outc), np.int32(red), ids, count,
         np.uint64(0), np.int32(0), np.int32(0), u16(out), np.int32(1)),
    )  # fmt: skip


def main() -> None:
    p = make_problem("heavy", 16384, 2048, 5632)
    x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    block = PreparedBlock(wg, wu, wd, Options())
    pre = gemm_nt(x, wg)
    packed, heavy = pack(pre, 256, 32)
    light = cp.asnumpy(heavy) == 0
    y1, y2 = empty_bf16((16384, 2048)), empty_bf16((16384, 2048))
    args = (x, packed, heavy, block.w_up, block.w_down_t)
    light_rows_v1(*args, y1)
    light_rows.from_twell(*args, y2, tile=256, slots=32)
    err = relative_error(y1[cp.asarray(light)], y2[cp.asarray(light)].astype(cp.float32))
    t1 = time_ms(lambda i: light_rows_v1(*args, y1), 1)
    t2 = time_ms(lambda i: light_rows.from_twell(*args, y2, tile=256, slots=32), 1)
    print(f"light rows v1 {t1:.3f} ms, v2 {t2:.3f} ms, rel. difference {err:.1e}")
    ids, count = heavy_rows.compact_rows(heavy)
    r = int(count.get()[0])
    o1, o2 = empty_bf16((16384, 5632)), empty_bf16((16384, 5632))
    heavy_rows_v1(x, wu, o1, ids, count, r)
    heavy_rows.matmul(x, wu, o2, ids, count, r, a_by_id=True, out_by_id=True)
    rows = ids[:r]
    err = relative_error(o1[rows], o2[rows].astype(cp.float32))
    t1 = time_ms(lambda i: heavy_rows_v1(x, wu, o1, ids, count, r), 1)
    t2 = time_ms(lambda i: heavy_rows.matmul(x, wu, o2, ids, count, r, a_by_id=True,
                                             out_by_id=True), 1)  # fmt: skip
    print(f"heavy rows ({r} rows, up projection) v1 {t1:.3f} ms, v2 {t2:.3f} ms, "
          f"rel. difference {err:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
