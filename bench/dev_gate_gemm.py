"""Development check of gate_gemm.cu on the GPU: GEMM bits against cuBLAS, the packing
epilogue against pack.cu applied to the same kernel's dense output, and timings.

    python bench/dev_gate_gemm.py small|full|block|clocks [--out DIR]

``small``: correctness on odd shapes, every tile/slots geometry, and a problem whose
pre-activations are special values (zeros of both signs, bf16 subnormals, values at the
rounding edges 2^-134 and 0x7f7f8000, Inf, NaN). ``full``: M=16384 timings of the kernel's
builds (a 4-stage ring for the main loop alone) and the cycles of the epilogue's parts
(OUTPUT_PROFILE). ``block``: the FFN block on the "epilogue" and "fused" routes
(``twell.benchmark.bench_config``), per call and in CUDA graphs. ``clocks``: the SM
clock and power nvidia-smi reads while each build runs back to back for a second (does
the packing epilogue cost time through the clock?).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import cupy as cp
import numpy as np

from twell.kernels import gate_gemm
from twell.kernels.buffers import empty_bf16
from twell.kernels.convert import as_bf16, from_bf16
from twell.kernels.cublas import gemm_nt
from twell.kernels.pack import pack


def rand_bf16(shape, seed, scale=1.0):
    rng = cp.random.default_rng(seed)
    return as_bf16(rng.standard_normal(shape, dtype=cp.float32) * scale)


def sparse_problem(m, n, k, seed):
    """x, w with pre-activations ~ N(-2.6, 1): ~0.5% positive, every 50th row dense."""
    x = from_bf16(rand_bf16((m, k), seed), np.float32)
    w = from_bf16(rand_bf16((n, k), seed + 1, 1.0 / np.sqrt(k)), np.float32)
    x[:, 0] = 1.0
    x[::50, 0] = 0.0
    w[:, 0] = -2.6
    return as_bf16(x), as_bf16(w)


def special_problem(m, n, k, seed, non_finite=True):
    """x, w whose products hit relu's and rounding's edges exactly. Columns 0 and 1 of x
    are zero but in rows 8i, 8i+1, 8i+2 (1, 0.5, 0.75 times e_0: pre = that times
    w[:, 0]) and 8i+3 (e_0 + e_1: pre = w[:, 0] + w[:, 1] in fp32; the bf16 maximum plus
    ~1e36 is finite in fp32 and rounds to Inf in bf16). Every 16th column of w[:, 0]
    cycles through zeros of both signs, bf16 subnormals, the largest bf16 and ordinary
    values (the other columns -1); with ``non_finite``,
    w[:16, 0] also holds Inf and NaN (which 0 * NaN spreads to every row: all rows heavy).
    The other rows are sparse_problem's (its bias moved to column 2)."""
    x, w = sparse_problem(m, n, k, seed)
    x = from_bf16(x, np.float32)
    w = from_bf16(w, np.float32)
    x[:, 2], w[:, 2] = x[:, 0], w[:, 0]
    x[:, :2] = 0.0
    rows = cp.arange(m)
    for r, (a, b) in enumerate([(1.0, 0.0), (0.5, 0.0), (0.75, 0.0), (1.0, 1.0)]):
        sel = rows[rows % 8 == r]
        x[sel] = 0.0
        x[sel, 0] = a
        x[sel, 1] = b
    # bf16 bit patterns (0x0001 = 2^-133, the smallest subnormal; 0x7F7F the largest)
    col0 = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x0080,
            0x0003, 0x7F00, 0x0001, 0x7F7F, 0x4000, 0xC000]  # fmt: skip
    col1 = [0x0000, 0x7BC0, 0xFBC0, 0x0001, 0x8001, 0x3F80]
    # every 16th column special (a tile keeps up to ~10 of its 16: entries, and overflow
    # at small SLOTS); the others -1 (never kept) and 0
    t = np.arange(n) // 16
    w0 = np.where(np.arange(n) % 16 == 0, np.array(col0, np.uint16)[t % 16], 0xBF80)
    w1 = np.where(np.arange(n) % 16 == 0, np.array(col1, np.uint16)[(t // 16) % 6], 0)
    w0, w1 = w0.astype(np.uint16), w1.astype(np.uint16)
    if non_finite:
        specials = [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0000, 0x3F80, 0x7F80, 0x0001,
                    0xFFC1, 0x8000, 0x7F7F, 0xFF80, 0x0002, 0x7FC0, 0x3F80, 0xBF80]  # fmt: skip
        w0[: min(n, 16)] = specials[: min(n, 16)]
    w = as_bf16(w)
    w.view(cp.uint16)[:, 0] = cp.asarray(w0)
    w.view(cp.uint16)[:, 1] = cp.asarray(w1)
    return as_bf16(x), w


def check(m, n, k, tile=256, slots=32, seed=0, special=None):
    """``special``: None (sparse_problem), "finite" or "non_finite" (special_problem)."""
    if special is None:
        x, w = sparse_problem(m, n, k, seed)
    else:
        x, w = special_problem(m, n, k, seed, non_finite=special == "non_finite")
    ref = gemm_nt(x, w)
    pre = empty_bf16((m, n))
    pre.view(cp.uint16).fill(0xFFFF)
    gate_gemm.launch(x, w, tile=tile, slots=slots, output=gate_gemm.OUTPUT_DENSE, pre=pre)
    a = from_bf16(pre, np.float32)
    b = from_bf16(ref, np.float32)
    rel = float(cp.linalg.norm(a - b) / max(float(cp.linalg.norm(b)), 1e-30))
    same = float((pre.view(cp.uint16) == ref.view(cp.uint16)).mean())
    # the packing epilogue vs pack.cu on this kernel's own dense output
    p_ref, h_ref = pack(pre, tile, slots)
    packed = cp.full((m, n // tile * slots), 0xDEADBEEF, dtype=cp.uint32)
    heavy = cp.zeros((m,), dtype=cp.uint8)
    gate_gemm.launch(x, w, tile=tile, slots=slots, packed=packed, heavy=heavy)
    cp.cuda.runtime.deviceSynchronize()
    pack_equal = bool((packed == p_ref).all()) and bool((heavy == h_ref).all())
    return {"m": m, "n": n, "k": k, "tile": tile, "slots": slots, "special": special,
            "rel_vs_cublas": rel, "bits_equal_frac": same, "nan": bool(cp.isnan(a).any()),
            "pack_equal": pack_equal, "heavy_rows": int(h_ref.sum()),
            "nonzero_words": int((p_ref != 0).sum())}  # fmt: skip


def time_ms(fn, reps=20, warm=5):
    for _ in range(warm):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def profile(x, w, packed, heavy):
    """OUTPUT_PROFILE's clock64 cycles per CTA (means over the CTAs; the kernel's own
    time in ms beside them): where the packer epilogue's time goes."""
    buf = cp.zeros((gate_gemm.ctas(x.shape[0], w.shape[0]) * 8,), dtype=cp.uint64)
    gate_gemm.launch(x, w, tile=256, slots=32, output=gate_gemm.OUTPUT_PROFILE, packed=packed,
                     heavy=heavy, pre=buf.view(cp.uint16))  # fmt: skip
    cp.cuda.runtime.deviceSynchronize()
    rows = buf.reshape(-1, 8).get().astype(np.float64)
    names = ["consumers_to_end", "consumer_wait_free", "consumer_epilogue",
             "packer_busy", "packer_wait_full", "packer_last_tile", "tiles",
             "packers_to_end"]  # fmt: skip
    out = {name: float(rows[:, i].mean()) for i, name in enumerate(names)}
    out["kernel"] = float(np.maximum(rows[:, 0], rows[:, 7]).mean())
    out["kernel_max"] = float(np.maximum(rows[:, 0], rows[:, 7]).max())
    out["packer_busy_per_tile"] = out["packer_busy"] / max(out["tiles"], 1)
    out["clock_hz"] = (
        cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1e3
    )
    return out


def clocks():
    """Median SM clock (MHz) and power (W) of the current device over 1.2 s of
    back-to-back launches of each build at M=16384 (nvidia-smi sampling every 20 ms, the
    first 10 samples dropped), beside the launch's time."""
    m, n, k = 16384, 5632, 2048
    x = rand_bf16((m, k), 5)
    w = rand_bf16((n, k), 6, 1.0 / np.sqrt(k))
    pre = empty_bf16((m, n))
    packed = cp.empty((m, n // 256 * 32), dtype=cp.uint32)
    heavy = cp.zeros((m,), dtype=cp.uint8)
    builds = {
        "cublas": lambda: gemm_nt(x, w, pre),
        "main_loop": lambda: gate_gemm.launch(x, w, tile=256, slots=32,
                                              output=gate_gemm.OUTPUT_NONE),
        "main_loop_s4": lambda: gate_gemm.launch(x, w, tile=256, slots=32,
                                                 output=gate_gemm.OUTPUT_NONE, stages=4),
        "tile_only": lambda: gate_gemm.launch(x, w, tile=256, slots=32,
                                              output=gate_gemm.OUTPUT_TILE_ONLY),
        "pack": lambda: gate_gemm.launch(x, w, tile=256, slots=32, packed=packed, heavy=heavy),
    }  # fmt: skip
    bus = cp.cuda.Device().pci_bus_id  # this device's samples only
    out = {}
    for name, fn in builds.items():
        ms = time_ms(fn)
        sampler = subprocess.Popen(
            ["nvidia-smi", "-i", bus, "--query-gpu=clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        t_end = time.time() + 1.2
        while time.time() < t_end:
            for _ in range(50):
                fn()
            cp.cuda.runtime.deviceSynchronize()
        sampler.terminate()
        lines = sampler.communicate()[0].strip().splitlines()[10:]  # skip the ramp
        samples = np.array(
            [[float(v) for v in line.split(",")] for line in lines
             if line and "N/A" not in line] or [[np.nan, np.nan]]
        )  # fmt: skip
        out[name] = {"ms": ms, "sm_mhz": float(np.median(samples[:, 0])),
                     "watts": float(np.median(samples[:, 1])), "samples": len(lines)}  # fmt: skip
        print(name, json.dumps(out[name]), flush=True)
    return [{"clocks": out}]


def block_timings():
    """The FFN block (``twell.benchmark.bench_config``) on the "epilogue" route (this
    kernel) and on "fused" (cuBLAS and the scan of the dense pre-activation), per call and
    in CUDA graphs (a bench_config call graphs its first path only)."""
    from twell.benchmark import bench_config

    cases = [("uniform", 2048), ("uniform", 4096), ("uniform", 8192), ("uniform", 16384),
             ("heavy", 16384), ("paperlike", 16384)]  # fmt: skip
    out = []
    for workload, m in cases:
        for paths in (("epilogue", "fused"), ("fused",)):
            try:
                for r in bench_config(workload, m, 2048, 5632, paths=paths, graphs=True):
                    r["graph_path"] = paths[0]
                    keys = ("workload", "M", "path", "graph_path", "t_ms", "t_dense_ms",
                            "speedup", "t_graph_ms", "t_dense_graph_ms", "rel_err",
                            "heavy_rows")  # fmt: skip
                    print(json.dumps({k: r.get(k) for k in keys}), flush=True)
                    out.append(r)
            except Exception as error:  # noqa: BLE001
                out.append({"workload": workload, "M": m, "paths": paths, "error": repr(error)})
                print(out[-1], flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["small", "full", "block", "clocks"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    t0 = time.time()
    if args.phase == "small":
        configs = [(300, 512, 128), (128, 256, 64), (1, 256, 8), (257, 768, 264),
                   (1000, 5632, 2048), (64, 384, 72, 128, 64), (130, 512, 40, 32, 32),
                   (300, 512, 64, 256, 32, 1, "finite"), (300, 512, 64, 256, 32, 1, "non_finite"),
                   (300, 512, 64, 256, 2, 1, "finite"), (300, 768, 64, 128, 16, 1, "finite"),
                   (260, 512, 64, 32, 2, 1, "non_finite"), (300, 512, 64, 64, 8, 2, "finite"),
                   (2000, 5632, 2048, 256, 64, 3, "finite")]  # fmt: skip
    elif args.phase == "full":
        configs = [(16384, 5632, 2048), (16384 + 37, 5632, 2048, 128, 64)]
    else:
        configs = []
    for cfg in configs:
        try:
            r = check(*cfg)
        except Exception as error:  # noqa: BLE001
            r = {"cfg": cfg, "error": repr(error)}
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.phase == "full":
        m, n, k = 16384, 5632, 2048
        x = rand_bf16((m, k), 5)
        ws = [rand_bf16((n, k), 6 + i, 1.0 / np.sqrt(k)) for i in range(2)]
        pre = empty_bf16((m, n))
        packed = cp.empty((m, n // 256 * 32), dtype=cp.uint32)
        heavy = cp.zeros((m,), dtype=cp.uint8)
        flops = 2.0 * m * n * k
        state = {"i": 0}

        def rot():
            state["i"] ^= 1
            return state["i"]

        def ours(**kw):
            return lambda: gate_gemm.launch(x, ws[rot()], tile=256, slots=32, **kw)

        candidates = {
            "cublas": lambda: gemm_nt(x, ws[rot()], pre),
            "wgmma_dense": ours(output=gate_gemm.OUTPUT_DENSE, pre=pre),
            "wgmma_main_loop": ours(output=gate_gemm.OUTPUT_NONE),
            "wgmma_handover_only": ours(output=gate_gemm.OUTPUT_HANDOVER_ONLY),
            "wgmma_tile_only": ours(output=gate_gemm.OUTPUT_TILE_ONLY),
            "wgmma_pack": ours(packed=packed, heavy=heavy),
            "wgmma_main_loop_s4": ours(output=gate_gemm.OUTPUT_NONE, stages=4),
            "cublas_plus_pack": lambda: pack(gemm_nt(x, ws[rot()], pre), 256, 32),
        }
        rounds = {key: [] for key in candidates}
        for _ in range(5):  # interleaved rounds; the best median of each (clocks drift)
            for key, fn in candidates.items():
                rounds[key].append(time_ms(fn))
        timings = {key: min(v) for key, v in rounds.items()}
        timings = {key: {"ms": v, "tflops": flops / v / 1e9} for key, v in timings.items()}
        print(json.dumps(timings), flush=True)
        results.append({"timings": timings})
        results.append({"profile": profile(x, ws[0], packed, heavy)})
        print(json.dumps(results[-1]), flush=True)
    if args.phase == "block":
        results += block_timings()
    if args.phase == "clocks":
        results += clocks()
    print(f"elapsed {time.time() - t0:.1f} s")
    if args.out:
        with open(f"{args.out}/gate_gemm_{args.phase}.json", "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if "error" in r or r.get("pack_equal") is False]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
