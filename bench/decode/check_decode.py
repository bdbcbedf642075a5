"""Check and time twell's decode kernel (``twell.kernels.light_rows_decode``, what
``light_rows.from_pre`` runs up to ``DECODE_ROWS_BELOW`` tokens) against light_rows.cu's
wide kernel (what it ran before: ``twell_light_rows_from_pre_wide``), on the GPU.

    python bench/decode/check_decode.py            # from the repo root; ~1-2 minutes
    OUT=/some/dir python bench/decode/check_decode.py   # also writes $OUT/decode.json
    python bench/decode/check_decode.py --quick    # fewer cases, no sweep

Per case (workload x M x gated/non-gated, plus boundary rows and other shapes):

1. builds the problem (twell.workloads; weights depend only on the seed, x on M), the
   pre-activation ``pre = bf16(x_f32 @ w_gate_f32.T)`` (CuPy float32 GEMM, rounded to
   nearest even), the routing-rule heavy flags and a float32 reference of the light rows;
2. runs the wide kernel once and the decode kernel twice, on outputs poisoned with 0xFF;
3. checks: heavy flags identical (decode = wide = rule); light rows' relative error
   against the wide kernel and the reference <= 1e-2; identical bits on both runs and
   after CUDA-graph replay; heavy rows of y untouched; light rows fully written; light
   rows without active units exactly zero;
4. times both kernels (main shape only): CUDA events around one launch, median of 50
   after 10 warm-ups, with a 100 µs spin kernel queued first so host launch overhead is
   not measured ("eager"); per launch inside a CUDA graph of 24 launches ("graph"); and
   per launch in a graph where a 96 MB memset precedes every launch, minus the
   memset-only graph ("cold": weights come from DRAM, as in a real decoder). Weight
   copies are rotated (6 sets) so consecutive launches do not share L2-resident rows.

A failing case prints its error and the run goes on. At the end: a table, a sweep of
cluster counts at M = 64, 1, 256 (decode kernel), and the JSON record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

K_MAIN, N_MAIN = 2048, 5632
MS = (1, 2, 8, 37, 64, 128, 256)
WORKLOADS = ("uniform", "heavy", "paperlike")
TOL = 1e-2
SETS = 6  # weight copies rotated in timings
POISON16 = 0xFFFF
BUDGET_S = 170.0  # cases and sweep stop starting after this


class Env:
    """What the run needs: CuPy, the two kernels, helpers. Built once."""

    def __init__(self) -> None:
        import cupy as cp
        import numpy as np

        from twell.kernels import light_rows, light_rows_decode
        from twell.kernels.compile import device_info

        self.cp, self.np = cp, np
        self.light_rows, self.decode = light_rows, light_rows_decode
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
        self.device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self.sms = device_info().multiprocessors
        self.spin = cp.RawKernel(
            r"""extern "C" __global__ void spin(unsigned long long ns) {
              unsigned long long t0, t;
              asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
              do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
            }""",
            "spin",
        )
        self.flush_buf = cp.empty((96 << 20,), dtype=cp.uint8)

    # ---- bf16 helpers on the GPU (uint16 bits <-> float32)
    def f32(self, bits: Any) -> Any:
        cp = self.cp
        return (bits.astype(cp.uint32) << 16).view(cp.float32)

    def bf16_bits(self, f: Any) -> Any:
        cp = self.cp
        f = cp.ascontiguousarray(f, dtype=cp.float32)
        b = f.view(cp.uint32)
        r = ((b + cp.uint32(0x7FFF) + ((b >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)
        return cp.where(cp.isnan(f), cp.uint16(0x7FC0), r)

    def upload(self, a: Any) -> Any:
        """A bf16 (ml_dtypes) NumPy array as a contiguous uint16 CuPy array."""
        return self.cp.asarray(self.np.ascontiguousarray(a).view(self.np.uint16))

    # ---- the two kernels
    def run_new(self, x, pre, heavy, wu, wdt, y, *, tile=256, slots=32, max_row_nnz=168,
                clusters=None):  # fmt: skip
        self.decode._launch(x, pre, heavy, wu, wdt, y, tile=tile, slots=slots,
                            max_row_nnz=max_row_nnz, clusters=clusters)  # fmt: skip

    def run_base(self, x, pre, heavy, wu, wdt, y, *, tile=256, slots=32, max_row_nnz=168):
        lr = self.light_rows
        lr._launch("twell_light_rows_from_pre_wide", y.shape[0], 32 * lr.WIDE_WARPS, x, pre,
                   heavy, wu, wdt, y, tile, slots, max_row_nnz)  # fmt: skip

    def max_active_clusters(self) -> int:
        """The decode launcher's cluster count on this device (cached there)."""
        kernel = self.decode.SOURCE.kernel("twell_light_rows_decode", KDIM=K_MAIN, TILE=256,
                                           SLOTS=32, GATED=1)  # fmt: skip
        return self.decode._clusters(kernel)


class Problems:
    """Weights per (workload, K, N) on the GPU (uint16 bits + float32 copies for the
    reference + rotated copies for timing); x per M."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.cache: dict[tuple, dict] = {}

    def get(self, workload: str, m: int, k: int = K_MAIN, n: int = N_MAIN,
            p: float = 0.005) -> tuple[dict, Any]:  # fmt: skip
        from twell import workloads

        key = (workload, k, n, p)
        if key not in self.cache:
            for old in list(self.cache):  # keep one weight set on the GPU at a time
                if old[1:] == (K_MAIN, N_MAIN, 0.005) and key[1:] == old[1:]:
                    del self.cache[old]
            self.env.cp.get_default_memory_pool().free_all_blocks()
            big = _make(workloads, workload, max(m, 256) if k == K_MAIN else m, k, n, p)
            env = self.env
            w = {"wg": env.upload(big.w_gate), "wu": env.upload(big.w_up)}
            w["wdt"] = env.upload(big.w_down.T)
            w["wg_f32"] = env.f32(w["wg"])
            w["wu_f32"] = env.f32(w["wu"])
            w["wdt_f32"] = env.f32(w["wdt"])
            w["x_big"] = big.x
            w["big"] = big
            sets = k == K_MAIN and n == N_MAIN  # the timed shape: rotated copies
            for name in ("wu", "wdt"):
                copies = [w[name].copy() for _ in range(SETS - 1)]
                w[f"{name}_sets"] = [w[name], *copies] if sets else None
            self.cache[key] = w
        w = self.cache[key]
        if workload == "heavy" and k == K_MAIN:
            x = _make(workloads, "heavy", m, k, n, p).x  # heavy rows are chosen among M
        elif w["x_big"].shape[0] >= m:
            x = w["x_big"][:m]  # x rows are prefix-stable in M (twell.workloads)
        else:
            x = _make(workloads, workload, m, k, n, p).x
        return w, self.env.upload(x)


def _make(workloads: Any, workload: str, m: int, k: int, n: int, p: float) -> Any:
    if workload == "uniform":
        return workloads.uniform(m, k, n, p=p, seed=7)
    if workload == "heavy":
        return workloads.heavy(m, k, n, p=p, seed=7)
    if workload == "paperlike":
        return workloads.paperlike(m, k, n, seed=7)
    raise ValueError(workload)


def routing_rule(env: Env, pre: Any, tile: int, slots: int, max_row_nnz: int) -> tuple[Any, Any]:
    """(heavy flags, kept mask) of the routing rule, vectorised."""
    cp = env.cp
    mag = pre & cp.uint16(0x7FFF)
    keeps = (mag > 0x7F80) | ((mag != 0) & ((pre & cp.uint16(0x8000)) == 0))
    bad = (pre & cp.uint16(0x7F80)) == cp.uint16(0x7F80)
    m, n = pre.shape
    counts = keeps.reshape(m, n // tile, tile).sum(axis=2)
    heavy = bad.any(axis=1) | (counts > slots - 1).any(axis=1) | (keeps.sum(axis=1) > max_row_nnz)
    return heavy.astype(cp.uint8), keeps


def edge_rows(env: Env, pre: Any, max_row_nnz: int) -> dict[int, str]:
    """Overwrite the first rows of ``pre`` (uint16, M >= 12) with boundary cases."""
    cp = env.cp
    neg, pos = 0xBF80, 0x3F00
    what = {}
    pre[0, :] = neg
    what[0] = "no active unit (light, y = 0)"
    pre[1, 100] = 0x7FC0
    what[1] = "NaN (heavy)"
    pre[2, 200] = 0x7F80
    what[2] = "+Inf (heavy)"
    pre[3, 300] = 0xFF80
    what[3] = "-Inf (heavy: non-finite)"
    pre[4, :] = neg
    pre[4, 0:31] = pos
    what[4] = "31 = slots-1 in one tile (light)"
    pre[5, :] = neg
    pre[5, 0:32] = pos
    what[5] = "32 in one tile (heavy: overflow)"
    pre[6, :] = neg
    cols = cp.array([j * 256 + i for j in range(21) for i in range(8)], dtype=cp.int64)
    pre[6, cols[:max_row_nnz]] = pos
    what[6] = f"{min(max_row_nnz, 168)} active (light if = max_row_nnz)"
    pre[7, :] = neg
    pre[7, cols] = pos
    pre[7, 21 * 256] = pos
    what[7] = "169 active (heavy: over max_row_nnz)"
    pre[8, 0::2] = 0x8000
    pre[8, 1::2] = 0x0000
    what[8] = "+-0 only (light, y = 0)"
    pre[9, :] = neg
    pre[9, 5:10] = 0x0001
    what[9] = "positive subnormals (light)"
    pre[10, 50] = 0xFFC1
    what[10] = "negative NaN (heavy)"
    pre[11, :] = neg
    pre[11, 5 * 256 : 5 * 256 + 31] = pos
    pre[11, 6 * 256 : 6 * 256 + 31] = pos
    what[11] = "two tiles at 31 (light)"
    return what


def rel_err(env: Env, a: Any, b: Any) -> float:
    cp = env.cp
    a64, b64 = a.astype(cp.float64), b.astype(cp.float64)
    num = float(cp.linalg.norm(a64 - b64))
    den = float(cp.linalg.norm(b64))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ---------------------------------------------------------------------- timing
def time_eager(env: Env, launch: Any, iters: int = 50, warm: int = 10) -> float:
    cp = env.cp
    for i in range(warm):
        launch(i)
    starts = [cp.cuda.Event() for _ in range(iters)]
    ends = [cp.cuda.Event() for _ in range(iters)]
    for i in range(iters):
        env.spin((1,), (1,), (env.np.uint64(100_000),))
        starts[i].record()
        launch(warm + i)
        ends[i].record()
    ends[-1].synchronize()
    times = sorted(cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends, strict=True))
    return times[len(times) // 2]


def time_graph(env: Env, launch: Any | None, *, flush: bool = False, r: int = 24,
               reps: int = 10) -> float:  # fmt: skip
    """µs per launch inside a CUDA graph of ``r`` launches (each after a memset if
    ``flush``; ``launch=None``: memsets only)."""
    cp = env.cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for i in range(r):
            if flush:
                env.flush_buf.data.memset_async(i & 0xFF, env.flush_buf.nbytes, stream)
            if launch is not None:
                launch(i)
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        e0 = [cp.cuda.Event() for _ in range(reps)]
        e1 = [cp.cuda.Event() for _ in range(reps)]
        for i in range(reps):
            e0[i].record(stream)
            graph.launch(stream)
            e1[i].record(stream)
        stream.synchronize()
    times = sorted(cp.cuda.get_elapsed_time(a, b) * 1e3 / r for a, b in zip(e0, e1, strict=True))
    return times[len(times) // 2]


# ---------------------------------------------------------------------- one case
def run_case(env: Env, probs: Problems, case: dict, *, timing: bool, flush_us: list) -> dict:
    cp = env.cp
    res: dict[str, Any] = dict(case)
    t_case = time.time()
    k, n = case.get("K", K_MAIN), case.get("N", N_MAIN)
    tile, slots, mrn = case.get("tile", 256), case.get("slots", 32), case.get("max_row_nnz", 168)
    gated = case["gated"]
    w, x = probs.get(case["workload"], case["M"], k, n, case.get("p", 0.005))
    timing = timing and w["wu_sets"] is not None
    m = case["M"]
    pre = env.bf16_bits(env.f32(x) @ w["wg_f32"].T)
    if case.get("edge"):
        res["edge_rows"] = edge_rows(env, pre, mrn)
    heavy_ref, keeps = routing_rule(env, pre, tile, slots, mrn)
    light = heavy_ref == 0
    g = cp.where(keeps & light[:, None], env.f32(pre), cp.float32(0))
    h = g * (env.f32(x) @ w["wu_f32"].T) if gated else g
    y_ref = h @ w["wdt_f32"]
    res["heavy_rows"] = int(heavy_ref.sum())
    nnz = keeps.sum(axis=1)
    res["l0_light"] = round(float(nnz[light].mean()) if bool(light.any()) else 0.0, 2)
    res["units_light"] = int((keeps & light[:, None]).any(axis=0).sum())
    xa = x if gated else None
    wu = w["wu"] if gated else None
    kw = {"tile": tile, "slots": slots, "max_row_nnz": mrn}

    def fresh() -> tuple[Any, Any]:
        yy = cp.empty((m, k), dtype=cp.uint16)
        yy.fill(POISON16)
        hh = cp.empty((m,), dtype=cp.uint8)
        hh.fill(0xFF)
        return yy, hh

    # today's kernel
    y_b, h_b = fresh()
    env.run_base(xa, pre, h_b, wu, w["wdt"], y_b, **kw)
    base_ok = True
    # the new kernel, twice
    y1, h1 = fresh()
    env.run_new(xa, pre, h1, wu, w["wdt"], y1, **kw)
    y2, h2 = fresh()
    env.run_new(xa, pre, h2, wu, w["wdt"], y2, **kw)
    cp.cuda.get_current_stream().synchronize()

    checks: dict[str, bool] = {}
    checks["heavy_eq_rule"] = bool((h1 == heavy_ref).all())
    if base_ok:
        checks["heavy_eq_today"] = bool((h1 == h_b).all())
        res["err_vs_today"] = rel_err(env, env.f32(y1[light]), env.f32(y_b[light]))
        res["today_err_vs_ref"] = rel_err(env, env.f32(y_b[light]), y_ref[light])
        checks["err_vs_today"] = res["err_vs_today"] <= TOL
    res["err_vs_ref"] = rel_err(env, env.f32(y1[light]), y_ref[light])
    checks["err_vs_ref"] = res["err_vs_ref"] <= TOL
    checks["bits_two_runs"] = bool((y1 == y2).all()) and bool((h1 == h2).all())
    heavy_mask = ~light
    checks["heavy_rows_untouched"] = bool((y1[heavy_mask] == POISON16).all())
    checks["light_rows_written"] = bool((y1[light] != POISON16).all())
    empty = light & (nnz == 0)
    checks["empty_rows_zero"] = bool((env.f32(y1[empty]) == 0).all())
    res["empty_light_rows"] = int(empty.sum())

    if timing:
        sets = list(range(SETS))

        def new_launch(i: int, **extra: Any) -> None:
            s = sets[i % SETS]
            env.run_new(xa, pre, h2, w["wu_sets"][s] if gated else None, w["wdt_sets"][s], y2,
                        **kw, **extra)  # fmt: skip

        def base_launch(i: int) -> None:
            s = sets[i % SETS]
            env.run_base(xa, pre, h_b, w["wu_sets"][s] if gated else None, w["wdt_sets"][s], y_b,
                         **kw)  # fmt: skip

        t: dict[str, float] = {}
        if not flush_us:
            flush_us.append(time_graph(env, None, flush=True))
        t["new_eager"] = time_eager(env, new_launch)
        t["new_graph"] = time_graph(env, new_launch)
        y2.fill(POISON16)
        cp.cuda.get_current_stream().synchronize()  # the graph runs on another stream
        t["new_cold"] = time_graph(env, new_launch, flush=True) - flush_us[0]
        cp.cuda.get_current_stream().synchronize()
        checks["bits_graph_replay"] = bool((y2 == y1).all())
        if base_ok:
            t["today_eager"] = time_eager(env, base_launch)
            t["today_graph"] = time_graph(env, base_launch)
            t["today_cold"] = time_graph(env, base_launch, flush=True) - flush_us[0]
        res["us"] = {key: round(v, 2) for key, v in t.items()}
        weight_bytes = res["units_light"] * k * 2 * (2 if gated else 1)
        if t["new_cold"] > 0:
            res["new_cold_weight_TBps"] = round(weight_bytes / (t["new_cold"] * 1e-6) / 1e12, 2)
    res["checks"] = checks
    res["ok"] = all(checks.values())
    res["seconds"] = round(time.time() - t_case, 2)
    return res


def case_name(c: dict) -> str:
    extra = ""
    if c.get("edge"):
        extra = " edge"
    if "K" in c:
        extra += f" K={c['K']} N={c['N']}"
    if c.get("tile", 256) != 256:
        extra += f" tile={c['tile']} slots={c['slots']}"
    return f"{c['workload']:9s} M={c['M']:3d} {'gated' if c['gated'] else 'nongated'}{extra}"


def all_cases(quick: bool) -> list[dict]:
    first = [  # the main cases first
        {"workload": "uniform", "M": 1, "gated": True},
        {"workload": "uniform", "M": 64, "gated": True},
        {"workload": "uniform", "M": 64, "gated": False},
        {"workload": "uniform", "M": 37, "gated": True, "edge": True, "timing": False},
    ]
    rest: list[dict] = [{"workload": "uniform", "M": 37, "gated": False, "edge": True,
                         "timing": False}]  # fmt: skip
    ms = (1, 8, 64, 256) if quick else MS
    for workload in WORKLOADS:
        for m in ms:
            for gated in (True, False):
                c = {"workload": workload, "M": m, "gated": gated}
                if not any(_same(c, s) for s in first):
                    rest.append(c)
    rest += [
        {"workload": "uniform", "M": 37, "gated": True, "tile": 128, "slots": 16, "timing": False},
        {"workload": "uniform", "M": 37, "gated": True, "K": 264, "N": 1024, "p": 0.02,
         "timing": False},
        {"workload": "uniform", "M": 37, "gated": False, "K": 264, "N": 1024, "p": 0.02,
         "timing": False},
        {"workload": "uniform", "M": 16, "gated": True, "K": 4096, "N": 2048, "p": 0.01,
         "timing": False},
        {"workload": "uniform", "M": 16, "gated": False, "K": 4096, "N": 2048, "p": 0.01,
         "timing": False},
        {"workload": "uniform", "M": 5, "gated": True, "K": 8, "N": 256, "p": 0.05,
         "timing": False},
        {"workload": "uniform", "M": 5, "gated": False, "K": 8, "N": 256, "p": 0.05,
         "timing": False},
    ]  # fmt: skip
    return first + rest


def _same(a: dict, b: dict) -> bool:
    keys = ("workload", "M", "gated", "edge")
    return all(a.get(k) == b.get(k) for k in keys)


def sweep(env: Env, probs: Problems, deadline: float, flush_us: list) -> list[dict]:
    """Cluster counts of the decode kernel at M = 64, 1, 256 (uniform, gated): graph and
    cold µs per launch (the launcher's own choice is the driver's max active clusters)."""
    cp = env.cp
    out = []
    cap = max(1, env.sms // env.decode.CLUSTER)
    counts = sorted({4, 8, 12, 14, 15, cap, env.max_active_clusters()})
    for m in (64, 1, 256):
        w, x = probs.get("uniform", m)
        pre = env.bf16_bits(env.f32(x) @ w["wg_f32"].T)
        y_b = cp.empty((m, K_MAIN), dtype=cp.uint16)
        h_b = cp.empty((m,), dtype=cp.uint8)
        env.run_base(x, pre, h_b, w["wu"], w["wdt"], y_b)
        for clusters in counts:
            if time.time() > deadline:
                return out
            if m == 1 and clusters != counts[0]:
                continue
            row: dict[str, Any] = {"M": m, "clusters": clusters}
            try:
                y = cp.empty((m, K_MAIN), dtype=cp.uint16)
                y.fill(POISON16)
                h = cp.empty((m,), dtype=cp.uint8)
                env.run_new(x, pre, h, w["wu"], w["wdt"], y, clusters=clusters)
                cp.cuda.get_current_stream().synchronize()
                light = h_b == 0
                row["err_vs_today"] = rel_err(env, env.f32(y[light]), env.f32(y_b[light]))
                row["heavy_eq_today"] = bool((h == h_b).all())

                def launch(i: int, args: tuple = (x, pre, h, w, y, clusters)) -> None:
                    x_, pre_, h_, w_, y_, clusters_ = args
                    s = i % SETS
                    env.run_new(x_, pre_, h_, w_["wu_sets"][s], w_["wdt_sets"][s], y_,
                                clusters=clusters_)  # fmt: skip

                row["graph_us"] = round(time_graph(env, launch), 2)
                row["cold_us"] = round(time_graph(env, launch, flush=True) - flush_us[0], 2)
            except Exception as error:  # noqa: BLE001
                row["error"] = repr(error)[:300]
            out.append(row)
            print("  sweep", json.dumps(row), flush=True)
    return out


def _table(record: dict) -> None:
    print("\nµs per launch: eager (events) / graph (24 per graph) / cold (memset before each)")
    head = (f"{'case':40s} {'hv':>3s} {'L0':>5s} {'units':>5s} {'new eager':>9s} "
            f"{'graph':>7s} {'cold':>7s} | {'today eager':>11s} {'graph':>7s} {'cold':>7s} | "
            f"{'err/today':>9s} ok")  # fmt: skip
    print(head)
    for r in record["cases"]:
        us = r.get("us", {})

        def f(key: str, us: dict = us) -> str:
            v = us.get(key)
            return f"{v:.1f}" if isinstance(v, (int, float)) else "-"

        err = r.get("err_vs_today")
        print(
            f"{case_name(r):40s} {r.get('heavy_rows', '-')!s:>3s} {r.get('l0_light', '-')!s:>5s} "
            f"{r.get('units_light', '-')!s:>5s} {f('new_eager'):>9s} {f('new_graph'):>7s} "
            f"{f('new_cold'):>7s} | {f('today_eager'):>11s} {f('today_graph'):>7s} "
            f"{f('today_cold'):>7s} | {(f'{err:.1e}' if isinstance(err, float) else '-'):>9s} "
            f"{'ok' if r.get('ok') else 'FAIL'}"
        )  # fmt: skip
    for row in record.get("sweep", []):
        print("sweep", row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases, no sweep")
    parser.add_argument("--json", default=None, help="output path (default: $OUT/decode.json)")
    args = parser.parse_args()
    t_start = time.time()
    deadline = t_start + BUDGET_S
    record: dict[str, Any] = {"cases": []}

    def save() -> None:
        path = args.json or (os.environ.get("OUT") and str(Path(os.environ["OUT"], "decode.json")))
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(record, indent=1, default=str))

    env = Env()
    record.update({"device": env.device, "sms": env.sms, "cupy": env.cp.__version__,
                   "max_active_clusters": env.max_active_clusters(),
                   "decode_rows_below": env.decode.DECODE_ROWS_BELOW})  # fmt: skip
    print(f"device {env.device}, {env.sms} SMs, CuPy {env.cp.__version__}; clusters of "
          f"{env.decode.CLUSTER}: {record['max_active_clusters']} at once", flush=True)  # fmt: skip
    probs = Problems(env)
    flush_us: list[float] = []
    ok = True
    cases = all_cases(args.quick)
    for index, case in enumerate(cases):
        if time.time() > deadline - 10:
            print("budget exhausted: remaining cases skipped", flush=True)
            record["skipped"] = len(cases) - index
            break
        timing = case.get("timing", True) and time.time() < deadline - 40
        name = case_name(case)
        try:
            res = run_case(env, probs, case, timing=timing, flush_us=flush_us)
        except Exception:  # noqa: BLE001
            res = {**case, "ok": False, "error": traceback.format_exc(limit=3)[-1500:]}
            print(f"FAIL {name}: {res['error']}", flush=True)
            record["cases"].append(res)
            ok = False
            save()
            continue
        record["cases"].append(res)
        ok &= res["ok"]
        bad = [k for k, v in res["checks"].items() if not v]
        us = res.get("us", {})
        print(
            f"{'ok  ' if res['ok'] else 'FAIL'} {name}: heavy {res['heavy_rows']}, L0 "
            f"{res['l0_light']}, units {res['units_light']}, err/today "
            f"{res.get('err_vs_today', float('nan')):.2e}, err/ref {res['err_vs_ref']:.2e}"
            + (f"; µs new {us.get('new_eager')}/{us.get('new_graph')}/{us.get('new_cold')} "
               f"today {us.get('today_eager')}/{us.get('today_graph')}/{us.get('today_cold')}"
               if us else "")
            + (f"; failed: {bad}" if bad else ""),
            flush=True,
        )  # fmt: skip
        save()
    record["flush_graph_us"] = flush_us[0] if flush_us else None
    if not args.quick and flush_us:
        try:
            record["sweep"] = sweep(env, probs, deadline - 5, flush_us)
        except Exception:  # noqa: BLE001
            record["sweep_error"] = traceback.format_exc(limit=3)
            print(record["sweep_error"], flush=True)
    record["ok"] = ok
    record["elapsed_s"] = round(time.time() - t_start, 1)
    save()
    _table(record)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
