"""Which step of a twell call invalidates a torch.cuda.graph capture (default mode)?

Runs the steps of SparseFFN's forward one by one inside a capture and checks the capture
after each; prints the first step that breaks it.  PYTHONPATH=. python bench/debug_capture.py
"""

import cupy
import numpy as np
import torch

import twell
from twell import ops, workloads
from twell._interop import on_gpu
from twell.kernels import heavy_rows, light_rows
from twell.kernels.buffers import alloc, empty_bf16
from twell.kernels.convert import as_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.pipeline import capturing


def check(tag: str) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    try:
        status = cupy.cuda.runtime.streamIsCapturing(stream)
    except Exception as error:  # noqa: BLE001
        raise RuntimeError(f"BROKEN after {tag}: {error}") from None
    print(f"{tag}: capture status {status}", flush=True)


def main() -> None:
    p = workloads.uniform(64, 512, 1024, p=0.02, seed=1)
    x, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in p.arrays())
    block = twell.SparseFFN(wg, wu, wd, density_switch=False)
    prepared = block._prepared
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            block(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            check("start")
            inputs = ops._validate(x=x, weights={})
            check("validate")
            with on_gpu(inputs.library, inputs.arrays) as (d, to_caller):
                check("on_gpu enter")
                xb = as_bf16(d["x"])
                check("as_bf16")
                y = empty_bf16((64, 512))
                check("alloc y (torch allocator)")
                capturing()
                check("capturing()")
                print(
                    "torch stream",
                    torch.cuda.current_stream().cuda_stream,
                    "cupy stream",
                    cupy.cuda.get_current_stream().ptr,
                    flush=True,
                )
                pre = empty_bf16((64, 1024))
                check("alloc pre")
                xt = torch.from_dlpack(xb)
                check("from_dlpack x")
                wt = torch.from_dlpack(prepared.w_first)
                check("from_dlpack w")
                ot = torch.from_dlpack(pre)
                check("from_dlpack out")
                torch.mm(xt, wt.t(), out=ot)
                check("torch.mm")
                pre = gemm_nt(xb, prepared.w_first)
                check("gemm_nt")
                heavy = alloc((64,), np.uint8)
                light_rows.from_pre(
                    xb,
                    pre,
                    heavy,
                    prepared.w_up,
                    prepared.w_down_t,
                    y,
                    tile=256,
                    slots=32,
                    max_row_nnz=prepared.max_row_nnz,
                )
                check("light_rows.from_pre")
                ids, count = heavy_rows.compact_rows(heavy)
                check("compact_rows")
                out = to_caller(y)
                check("to_caller")
            check("on_gpu exit")
            y2 = block(x)
            check("whole SparseFFN call")
        print("capture ended fine", out.shape, y2.shape)
    except Exception as error:  # noqa: BLE001
        print("FAILED:", type(error).__name__, str(error)[:300])


if __name__ == "__main__":
    main()
