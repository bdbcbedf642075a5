"""The block-reuse light-row stage (reuse.cu) against today's light-row kernel, on a GPU.

    PYTHONPATH=. python bench/reuse/check_reuse.py            # from the repository root
    OUT=/some/dir PYTHONPATH=. python bench/reuse/check_reuse.py   # also writes reuse.json

Workloads (twell.workloads, K=2048, N=5632): uniform, heavy, paperlike at M=16384 and
uniform at M=65536. For each: the gate pre-activation by torch (bf16 F.linear on CUDA),
handed to CuPy by DLPack; today's fused light-row kernel and this stage (both up paths:
"columns" = block reuse on tensor cores, "gather" = per-token gather baseline) on the
same pre-activation, with max_row_nnz = 3% of N as today's default.

Checks (per case): identical heavy flags; light rows within rel. error 1e-2 of today's
output and of float64 math on a sample of rows; the same bits on a rerun (outputs and
every scratch buffer poisoned with 0xFF first, so an unwritten element shows up as NaN);
heavy rows of y left untouched. Timing: CUDA events, median of 20 calls after 5 warm-ups,
each call queued behind a short spin kernel so host launch gaps are not measured; every
kernel alone, and the stage together. Runs in well under 4 minutes; a failing case is
reported and the next one runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import cupy as cp  # noqa: E402
import reuse  # noqa: E402
import torch  # noqa: E402

from twell import workloads  # noqa: E402

K, N = 2048, 5632
TILE, SLOTS = 256, 32
MAX_ROW_NNZ = max(16, min(1024, N * 3 // 100))  # today's default_max_row_nnz(N)
WARMUP, REPS = 5, 20
SAMPLE_ROWS = 64
#: (workload, M, time the tiling variants too)
CASES = [("uniform", 16384, True), ("heavy", 16384, False), ("paperlike", 16384, False),
         ("uniform", 65536, False)]  # fmt: skip


# ---------------------------------------------------------------------------- helpers
def todays_kernel() -> tuple[str, Any]:
    """today's fused light-row launcher: (name, fn(x, pre, heavy, w_up, w_down_t, y))."""
    try:
        from twell.kernels.ffn_gpu import fused_rows

        name = "twell.kernels.ffn_gpu.fused_rows"
    except ImportError:
        from twell.kernels.light_rows import from_pre as fused_rows

        name = "twell.kernels.light_rows.from_pre"

    def run(x, pre, heavy, w_up, w_down_t, y):
        fused_rows(
            x, pre, heavy, w_up, w_down_t, y, tile=TILE, slots=SLOTS, max_row_nnz=MAX_ROW_NNZ
        )

    return name, run


def poisoned(shape: tuple[int, ...], dtype: Any) -> Any:
    a = cp.empty(shape, dtype=dtype)
    a.view(cp.uint8).fill(0xFF)
    return a


_SPIN = None


def spin(cycles: int = 400_000) -> None:
    """A busy kernel (~0.2 ms) so that the launches timed after it queue up on the GPU."""
    global _SPIN
    if _SPIN is None:
        _SPIN = cp.RawKernel(
            r"""extern "C" __global__ void spin(long long cycles) {
                  long long t0 = clock64(); while (clock64() - t0 < cycles) { } }""",
            "spin",
        )
    _SPIN((1,), (32,), (np.int64(cycles),))


def gpu_ms(fn: Any) -> float:
    for _ in range(WARMUP):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(REPS):
        spin()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def to_torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()


def bits(a: Any) -> Any:
    return a.view(cp.uint16)


def f64(a: Any) -> Any:
    """A bf16 (or float) CuPy array as float64 (bf16 through its bits: no reliance on
    CuPy arithmetic support for the bfloat16 dtype)."""
    if np.dtype(a.dtype).itemsize == 2 and np.dtype(a.dtype).kind not in "iu":
        a = (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return a.astype(cp.float64)


def rel(a: Any, b: Any) -> float:
    a, b = f64(a), f64(b)
    return float(cp.linalg.norm(a - b) / max(float(cp.linalg.norm(b)), 1e-30))


# ---------------------------------------------------------------------------- one case
def run_case(workload: str, M: int, record: dict, variants: bool) -> None:
    t0 = time.time()
    problem = workloads.make(workload, M, K, N, seed=0)
    xt, wgt, wut, wdt = (
        to_torch(a) for a in (problem.x, problem.w_gate, problem.w_up, problem.w_down)
    )
    del problem
    pre_t = torch.nn.functional.linear(xt, wgt)  # cuBLAS gate GEMM, bf16 out
    wdt_t = wdt.t().contiguous()  # w_down_t [N, K]
    torch.cuda.synchronize()
    x, pre, w_up, w_down_t = (cp.from_dlpack(t) for t in (xt, pre_t, wut, wdt_t))
    w_down = cp.from_dlpack(wdt)
    record["setup_s"] = round(time.time() - t0, 1)
    today_name, today = todays_kernel()
    record["today"] = today_name

    # ---- today's kernel
    y_today = poisoned((M, K), cp.uint16).view(x.dtype)
    heavy_today = poisoned((M,), cp.uint8)
    today(x, pre, heavy_today, w_up, w_down_t, y_today)
    light = heavy_today == 0
    record["heavy_rows"] = int(M - int(light.sum()))
    active = (bits(pre) & 0x8000) == 0
    active &= bits(pre) != 0
    record["l0"] = round(float(active.sum()) / M, 2)
    record["pairs_light"] = int(active[light].sum())

    # ---- this stage, both up paths, correctness (everything poisoned)
    outs = {}
    for path in ("columns", "gather"):
        runs = []
        for _ in range(2):
            y = poisoned((M, K), cp.uint16).view(x.dtype)
            heavy = poisoned((M,), cp.uint8)
            view = reuse.light_rows(x, pre, heavy, w_up, w_down_t, y, tile=TILE, slots=SLOTS,
                                    max_row_nnz=MAX_ROW_NNZ, up_path=path, alloc=poisoned)  # fmt: skip
            cp.cuda.Device().synchronize()
            runs.append((y, heavy, view))
        (y, heavy, view), (y2, heavy2, view2) = runs
        res: dict[str, Any] = {"ksplit": view.ksplit}
        res["heavy_equal_today"] = bool(cp.array_equal(heavy, heavy_today))
        both = light & (heavy == 0)
        res["rel_err_vs_today"] = rel(y[both], y_today[both])
        res["bits_equal_today_frac"] = float((bits(y)[both] == bits(y_today)[both]).mean())
        res["rerun_bits_equal"] = bool(cp.array_equal(bits(y), bits(y2)) and cp.array_equal(heavy, heavy2)
                                       and cp.array_equal(view.row_h.view(cp.uint32),
                                                          view2.row_h.view(cp.uint32)))  # fmt: skip
        res["light_rows_finite"] = bool(cp.isfinite(f64(y[both])).all())
        res["heavy_rows_untouched"] = bool((bits(y)[heavy != 0] == 0xFFFF).all())
        outs[path] = (y, heavy)
        record[path] = res

    # float64 on a sample of light rows (same bf16 inputs; g = relu(pre) in bf16)
    rows = cp.nonzero(light)[0]
    rows = rows[cp.linspace(0, rows.size - 1, min(SAMPLE_ROWS, int(rows.size))).astype(cp.int64)]
    xs = f64(x[rows])
    g = cp.maximum(f64(pre[rows]), 0.0)
    h = g * (xs @ f64(w_up).T)
    y_ref = h @ f64(w_down).T
    record["rel_err_f64_today"] = rel(y_today[rows], y_ref)
    for path in ("columns", "gather"):
        record[path]["rel_err_f64"] = rel(outs[path][0][rows], y_ref)

    # ---- the TwELL input path (twell's pack kernel, if present): same y bits as from pre
    try:
        try:
            from twell.kernels.pack import pack
        except ImportError:
            from twell.kernels.ffn_gpu import pack
        packed, heavy_in = pack(pre, TILE, SLOTS)
        y = poisoned((M, K), cp.uint16).view(x.dtype)
        view = reuse.allocate_view(M, N, K, gated=True, max_row_nnz=MAX_ROW_NNZ, alloc=poisoned)
        reuse.build(view, packed=packed, heavy_in=heavy_in)
        reuse.up(view, x, w_up)
        reuse.down(view, w_down_t, y)
        record["twell_input_same_bits"] = bool(
            cp.array_equal(view.heavy, outs["columns"][1])
            and cp.array_equal(bits(y), bits(outs["columns"][0]))
        )
    except Exception as error:  # noqa: BLE001
        record["twell_input_same_bits"] = f"error: {type(error).__name__}: {error}"

    # ---- timing
    times: dict[str, float] = {}
    y_t = cp.empty((M, K), cp.uint16).view(x.dtype)
    heavy_t = cp.empty((M,), cp.uint8)
    times["today_fused_rows"] = gpu_ms(lambda: today(x, pre, heavy_t, w_up, w_down_t, y_t))
    times["cublas_gate_gemm"] = gpu_ms(lambda: torch.nn.functional.linear(xt, wgt))

    def dense() -> None:
        a = torch.nn.functional.linear(xt, wgt)
        b = torch.nn.functional.linear(xt, wut)
        torch.nn.functional.linear(torch.relu(a) * b, wdt)

    times["dense_block_torch"] = gpu_ms(dense)
    view = reuse.allocate_view(M, N, K, gated=True, max_row_nnz=MAX_ROW_NNZ, heavy=heavy_t)
    y = cp.empty((M, K), cp.uint16).view(x.dtype)
    reuse.build(view, pre=pre)
    times["scan_pre"] = gpu_ms(lambda: reuse.scan_pre(view, pre))
    times["row_ptr"] = gpu_ms(lambda: reuse.row_pointers(view))
    times["unit_ptr"] = gpu_ms(lambda: reuse.unit_pointers(view))
    times["scatter"] = gpu_ms(lambda: reuse.scatter(view))
    times["up_columns_main"] = gpu_ms(lambda: reuse.up_main(view, x, w_up))
    if view.ksplit > 1:
        times["up_finish"] = gpu_ms(lambda: reuse.up_finish(view))
    times["up_gather"] = gpu_ms(lambda: reuse.up_gather(view, x, w_up))
    reuse.build(view, pre=pre)
    reuse.up(view, x, w_up)
    times["down"] = gpu_ms(lambda: reuse.down(view, w_down_t, y))

    def stage(up_fn: Any) -> None:
        reuse.build(view, pre=pre)
        up_fn(view, x, w_up)
        reuse.down(view, w_down_t, y)

    times["stage_columns"] = gpu_ms(lambda: stage(reuse.up))
    times["stage_gather"] = gpu_ms(lambda: stage(reuse.up_gather))
    record["times_ms"] = {k: round(v, 4) for k, v in times.items()}
    record["ksplit"] = view.ksplit
    # Effective rates, for the floors in reuse.cu's header.
    nbu, nbd = view.up_blocks, view.down_blocks
    record["rates"] = {
        "scan_pre_read_TBps": round(M * N * 2 / times["scan_pre"] / 1e9, 2),
        "up_w_up_L2_TBps": round(nbu * N * K * 2 / times["up_columns_main"] / 1e9, 2),
        "down_w_down_L2_TBps": round(nbd * N * K * 2 / times["down"] / 1e9, 2),
        "gather_rows_L2_TBps": round(record["pairs_light"] * K * 2 / times["up_gather"] / 1e9, 2),
    }

    # ---- tiling variants (timing of up / down / whole stage only)
    if variants:
        record["variants"] = {}
        for label, cfg in [
            ("up_block1024_ks32", reuse.Config(up_block=1024, up_ks=32)),
            ("up_ks128", reuse.Config(up_ks=128)),
            (
                "down_ks128_block256_chunk256",
                reuse.Config(down_ks=128, down_block=256, row_chunk=256),
            ),
            ("down_ks32", reuse.Config(down_ks=32)),
            ("row_chunk256", reuse.Config(row_chunk=256)),
        ]:
            try:
                v = reuse.allocate_view(M, N, K, gated=True, max_row_nnz=MAX_ROW_NNZ, config=cfg)
                yv = cp.empty((M, K), cp.uint16).view(x.dtype)
                reuse.build(v, pre=pre)
                reuse.up(v, x, w_up)
                reuse.down(v, w_down_t, yv)
                ok = bool(cp.array_equal(v.heavy, outs["columns"][1])) and rel(
                    yv[light], outs["columns"][0][light]) < 1e-2  # fmt: skip
                vt = {"ok": ok, "ksplit": v.ksplit,
                      "up_main": gpu_ms(lambda v=v: reuse.up_main(v, x, w_up)),
                      "down": gpu_ms(lambda v=v, yv=yv: reuse.down(v, w_down_t, yv)),
                      "stage": gpu_ms(lambda v=v, yv=yv: (reuse.build(v, pre=pre), reuse.up(v, x, w_up),
                                                           reuse.down(v, w_down_t, yv)))}  # fmt: skip
                record["variants"][label] = {
                    k: (round(t, 4) if isinstance(t, float) else t) for k, t in vt.items()
                }
            except Exception as error:  # noqa: BLE001
                record["variants"][label] = f"error: {type(error).__name__}: {error}"
    record["total_s"] = round(time.time() - t0, 1)


def passed(record: dict) -> bool:
    checks = []
    for path in ("columns", "gather"):
        r = record.get(path, {})
        checks += [r.get("heavy_equal_today"), r.get("rerun_bits_equal"), r.get("light_rows_finite"),
                   r.get("heavy_rows_untouched"), r.get("rel_err_vs_today", 1) <= 1e-2,
                   r.get("rel_err_f64", 1) <= 1e-2]  # fmt: skip
    return all(checks) and "error" not in record


def main() -> int:
    t_start = time.time()
    cp.cuda.Device().use()
    info = {
        "gpu": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        "cupy": cp.__version__, "torch": torch.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "python": platform.python_version(), "max_row_nnz": MAX_ROW_NNZ, "config": vars(reuse.Config()),
    }  # fmt: skip
    print(json.dumps(info), flush=True)
    records = []
    for workload, M, variants in CASES:
        record: dict[str, Any] = {"workload": workload, "M": M, "K": K, "N": N, **info}
        if time.time() - t_start > 190:  # keep the whole run under 4 minutes
            record.update(error="skipped: time budget")
            records.append({**record, "pass": False})
            print(f"skipping {workload} {M}: time budget", flush=True)
            continue
        try:
            run_case(workload, M, record, variants)
        except Exception as error:  # noqa: BLE001
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc()[-3000:]
            print(record["traceback"], flush=True)
        record["pass"] = passed(record)
        records.append(record)
        print(json.dumps(record), flush=True)
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    # ---- table
    print()
    cols = ["today_fused_rows", "scan_pre", "row_ptr", "unit_ptr", "scatter", "up_columns_main",
            "up_finish", "up_gather", "down", "stage_columns", "stage_gather", "cublas_gate_gemm",
            "dense_block_torch"]  # fmt: skip
    print(f"{'case':20s} {'pass':5s} " + " ".join(f"{c[:12]:>12s}" for c in cols))
    for r in records:
        t = r.get("times_ms", {})
        print(f"{r['workload'] + ' ' + str(r['M']):20s} {str(r['pass']):5s} "
              + " ".join(f"{t[c]:12.4f}" if c in t else f"{'-':>12s}" for c in cols))  # fmt: skip
    print()
    for r in records:
        if "error" in r:
            print(f"{r['workload']} {r['M']}: ERROR {r['error']}")
            continue
        t = r["times_ms"]
        block_today = t["cublas_gate_gemm"] + t["today_fused_rows"]
        block_new = t["cublas_gate_gemm"] + t["stage_columns"]
        print(f"{r['workload']} {r['M']}: L0 {r['l0']}, heavy rows {r['heavy_rows']}, ksplit {r['ksplit']}; "
              f"rel err vs today: columns {r['columns']['rel_err_vs_today']:.2e}, gather "
              f"{r['gather']['rel_err_vs_today']:.2e} (gather bits equal today: "
              f"{r['gather']['bits_equal_today_frac']:.4f}); vs f64: columns "
              f"{r['columns']['rel_err_f64']:.2e}, today {r['rel_err_f64_today']:.2e}; "
              f"TwELL input same bits: {r.get('twell_input_same_bits')}; "
              f"gate GEMM + light rows: today {block_today:.3f} ms, reuse {block_new:.3f} ms "
              f"(dense {t['dense_block_torch']:.3f} ms: {t['dense_block_torch'] / block_today:.2f}x -> "
              f"{t['dense_block_torch'] / block_new:.2f}x, heavy rows not included); rates {r['rates']}")  # fmt: skip
        if "variants" in r:
            print(f"  variants: {json.dumps(r['variants'])}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "reuse.json").write_text(json.dumps(records, indent=1))
        print(f"wrote {Path(out) / 'reuse.json'}")
    print(
        f"total {time.time() - t_start:.0f} s; {'ALL PASS' if all(r['pass'] for r in records) else 'FAILURES'}"
    )
    return 0 if all(r["pass"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
