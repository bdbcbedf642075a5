"""What a CUDA-graph IF node around the heavy-row stage saves at M=2048 (K=2048, N=5632,
`uniform`: no heavy rows), with twell's own kernels in graphs built through the driver
API (stream capture, a conditional node added to the capture, its body captured with
`cuStreamBeginCaptureToGraph`).

The condition comes from a one-CTA kernel that ORs the heavy flags and calls
`cudaGraphSetConditional` (a device-runtime function: the kernel is compiled with
`-rdc=true`, which makes CuPy link `libcudadevrt.a`). Graphs, replayed back to back (µs
per replay, CUDA events over 200 replays, the three interleaved five times):
  plain    from_pre -> compact_rows -> two heavy-row matmuls     (what the fused route runs)
  if_node  from_pre -> set_if(any flag) -> IF { compact_rows -> two heavy-row matmuls }
  alone    from_pre only (the floor)
Then both graphs with and without one row flagged heavy after from_pre (its light output
poisoned with NaN, so only the heavy-row stage writes it): the IF graph's y must equal
the plain graph's bit for bit both times (y poisoned with NaN before each replay), and
the body must have run only in the first (the row count it writes set to -1 before).

torch 2.11 has no conditional capture of its own (`CUDAGraph.begin_capture_to_if_node`
came later), hence the driver calls here.

    PYTHONPATH=. python bench/dev_conditional.py [--M 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import cupy as cp
import numpy as np

from bench.dev_reuse_floor import uniform_block
from twell import _driver
from twell.benchmark import gpu_name, versions
from twell.kernels import heavy_rows, light_rows
from twell.kernels.buffers import empty_bf16
from twell.kernels.cublas import gemm_nt

SET_IF = r"""
#include <cuda_device_runtime_api.h>
extern "C" __global__ void __launch_bounds__(1024)
set_if(unsigned long long handle, const unsigned char* flags, int m) {
  int any = 0;
  for (int i = threadIdx.x; i < m; i += blockDim.x) any |= flags[i];
  any = __syncthreads_or(any);
  if (threadIdx.x == 0) cudaGraphSetConditional(handle, any ? 1u : 0u);
}
"""

_P = ctypes.c_void_p


def _call(name: str, *args) -> None:
    """A driver call twell._driver does not declare (pointers passed as ``_P``: without
    declared argument types ctypes would pass a Python int as a C int)."""
    status = getattr(_driver.library(), name)(*args)
    if status:
        raise _driver.DriverError(name, status)


class NodeParams(ctypes.Structure):
    """``CUgraphNodeParams`` (256 bytes) with the conditional member of its union."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("handle", ctypes.c_uint64),
        ("cond_type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("graphs_out", ctypes.POINTER(_P)),
        ("ctx", _P),
        ("rest", ctypes.c_byte * (232 - 32)),
        ("reserved2", ctypes.c_longlong),
    ]


assert ctypes.sizeof(NodeParams) == 256
THREAD_LOCAL, IF, COND_NODE, ASSIGN_DEFAULT, SET_DEPS = 1, 0, 13, 1, 1


def capture(stream: cp.cuda.Stream, side: cp.cuda.Stream, before, body, set_if=None):
    """A graph of ``before()``, then (``set_if`` given) an IF node whose condition
    ``set_if(handle)`` sets and whose body is ``body()``, else ``body()`` plainly."""
    _call("cuStreamBeginCapture_v2", _P(stream.ptr), THREAD_LOCAL)
    with stream:
        before()
        if set_if is None:
            body()
        else:
            status, ident, graph = ctypes.c_int(), ctypes.c_uint64(), _P()
            deps, edges, count = ctypes.POINTER(_P)(), _P(), ctypes.c_size_t()
            info = (ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                    ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count))  # fmt: skip
            _call("cuStreamGetCaptureInfo_v3", _P(stream.ptr), *info)
            ctx = _P()
            _call("cuCtxGetCurrent", ctypes.byref(ctx))
            handle = ctypes.c_uint64()
            _call("cuGraphConditionalHandleCreate", ctypes.byref(handle), graph, ctx, 0,
                  ASSIGN_DEFAULT)  # fmt: skip
            set_if(handle.value)
            _call("cuStreamGetCaptureInfo_v3", _P(stream.ptr), *info)
            bodies = (_P * 1)()
            params = NodeParams(type=COND_NODE, handle=handle.value, cond_type=IF, size=1,
                                ctx=ctx)  # fmt: skip
            node = _P()
            _call("cuGraphAddNode_v2", ctypes.byref(node), graph, deps, None, count,
                  ctypes.byref(params))  # fmt: skip
            ctypes.memmove(bodies, params.graphs_out, ctypes.sizeof(bodies))
            _call("cuStreamUpdateCaptureDependencies_v2", _P(stream.ptr), ctypes.byref(node),
                  None, 1, SET_DEPS)  # fmt: skip
            _call("cuStreamBeginCaptureToGraph", _P(side.ptr), _P(bodies[0]), None, None, 0,
                  THREAD_LOCAL)  # fmt: skip
            with side:
                body()
            inner = _P()
            _call("cuStreamEndCapture", _P(side.ptr), ctypes.byref(inner))
    graph = _P()
    _call("cuStreamEndCapture", _P(stream.ptr), ctypes.byref(graph))
    exe = _P()
    _call("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, 0)
    return exe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    m, k, n = args.M, 2048, 5632
    x, wg, block = uniform_block(m, k, n)
    pre = gemm_nt(x, wg)
    heavy = cp.zeros((m,), cp.uint8)
    y = empty_bf16((m, k))
    pre_h = empty_bf16((m, n))
    limit = block.max_row_nnz
    ids, count = cp.empty((m,), cp.int32), cp.empty((1,), cp.int32)
    compact = heavy_rows._kernel("twell_compact_rows")
    setter = cp.RawModule(code=SET_IF, options=("-rdc=true",)).get_function("set_if")
    flag = [False]

    def light() -> None:
        light_rows.from_pre(x, pre, heavy, block.w_up, block.w_down_t, y, tile=256, slots=32,
                            max_row_nnz=limit)  # fmt: skip
        if flag[0]:  # row 5 to the heavy-row stage, its light output poisoned
            heavy[5] = 1
            pre_h[5] = pre[5]
            y.view(cp.uint16)[5] = 0x7FC0

    def heavy_stage() -> None:
        compact((1,), (1024,), (heavy, np.int32(m), ids, count))
        heavy_rows.matmul(x, block.w_up, pre_h, ids, count, m, a_by_id=True, out_by_id=True,
                          gate=pre_h, gate_by_id=True, relu_gate=True)  # fmt: skip
        heavy_rows.matmul(pre_h, block.w_down, y, ids, count, m, a_by_id=True, out_by_id=True)

    def set_if(handle: int) -> None:
        setter((1,), (1024,), (np.uint64(handle), heavy, np.int32(m)))

    stream = cp.cuda.Stream(non_blocking=True)
    side = cp.cuda.Stream(non_blocking=True)
    with stream:  # warm-up: every kernel compiled and loaded before a capture
        for flag[0] in (True, False):
            light()
            heavy_stage()
    stream.synchronize()

    def build(kind: str):
        if kind == "plain":
            return capture(stream, side, light, heavy_stage)
        if kind == "if_node":
            return capture(stream, side, light, heavy_stage, set_if)
        return capture(stream, side, light, lambda: None)

    rec: dict = {"M": m, "gpu": gpu_name(), **versions()}
    graphs = {}
    for kind in ("plain", "if_node", "alone"):
        try:
            graphs[kind] = build(kind)
        except Exception as error:  # noqa: BLE001 - recorded: the capture is what is probed
            rec[f"{kind}_error"] = repr(error)
            print(json.dumps({kind: repr(error)}), flush=True)
    times: dict[str, list[float]] = {kind: [] for kind in graphs}
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(5):
        for kind, exe in graphs.items():
            for _ in range(10):
                _call("cuGraphLaunch", exe, _P(stream.ptr))
            start.record(stream)
            for _ in range(200):
                _call("cuGraphLaunch", exe, _P(stream.ptr))
            stop.record(stream)
            stop.synchronize()
            times[kind].append(cp.cuda.get_elapsed_time(start, stop) / 200 * 1e3)
    rec["us_per_replay"] = {kind: sorted(v) for kind, v in times.items()}
    print(json.dumps(rec), flush=True)

    checks: dict = {}
    try:
        u16 = y.view(cp.uint16)
        results = {}
        for flagged in (True, False):
            flag[0] = flagged
            for kind in ("plain", "if_node"):
                exe = build(kind)
                u16.fill(0x7FC0)
                count.fill(-1)  # compact_rows, inside the body, overwrites it when it runs
                stream.synchronize()
                _call("cuGraphLaunch", exe, _P(stream.ptr))
                stream.synchronize()
                results[(flagged, kind)] = u16.copy()
                results[(flagged, kind, "count")] = int(count[0])
        want = results[(True, "plain")]
        checks = {
            "flagged_equal_plain": bool(cp.array_equal(results[(True, "if_node")], want)),
            "flagged_row_written": bool((want[5] != 0x7FC0).all()),
            "unflagged_equal_plain": bool(
                cp.array_equal(results[(False, "if_node")], results[(False, "plain")])
            ),
            "body_ran_when_flagged": results[(True, "if_node", "count")] == 1,
            "body_skipped_when_not": results[(False, "if_node", "count")] == -1,
        }
    except Exception as error:  # noqa: BLE001
        checks["error"] = repr(error)
    rec["checks"] = checks
    rec["check_ok"] = bool(checks) and all(v is True for v in checks.values())
    print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1))
    if not rec["check_ok"]:
        raise SystemExit("the IF graph's output differs from the plain graph's")


if __name__ == "__main__":
    main()
