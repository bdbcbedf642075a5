"""Programmatic dependent launch (compile.launch_after) on, off, and off for some kernels
only: µs per block call replayed from a CUDA graph, weights rotated over sets that exceed
L2 (read from DRAM), the settings alternated in one process, dense cuBLAS math beside
them. Checks first that every setting gives the same output bits and that they match
float64 dense math.

    PYTHONPATH=. python bench/dev_pdl.py [--M 1 8 64 2048] [--rounds 2] [--out pdl.json]

A workload ``W+nan`` is ``W`` with a NaN in token 0's x (a token that keeps every unit).
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np
import torch  # noqa: F401 - the cuBLAS gate GEMM is captured through torch

from twell.benchmark import fused_blocks, gpu_name, graph_ms_cupy, make_problem, to_device
from twell.kernels import compile as kc
from twell.kernels import decode_units, heavy_rows, light_rows, light_rows_decode, pipeline
from twell.kernels.buffers import empty_bf16
from twell.reference.forward import ffn_dense
from twell.testing.asserts import relative_error

SETS = 4  # 4 x 69 MB of weights: far past the 50 MB of L2
K, N = 2048, 5632
#: Settings: kernels (name prefixes) launched plainly; None: every launch plain.
SETTINGS = {
    "on": (),
    "off": None,
    "plain_heavy": ("twell_heavy_rows_matmul", "twell_compact_rows"),
    "plain_down": ("twell_units_down",),
    "plain_after_gemm": ("twell_light_rows_from_pre", "twell_light_rows_decode",
                         "twell_units_gate_up"),
    "plain_gate": ("twell_units_gate_up",),
}  # fmt: skip
_LAUNCH = kc.launch_after
_PLAIN: tuple[str, ...] = ()


def _launch(kernel, grid, block, args, shared_mem=0, *, overlap=True):  # noqa: ANN001, ANN202
    plain = bool(_PLAIN) and getattr(kernel, "name", "").startswith(_PLAIN)
    return _LAUNCH(kernel, grid, block, args, shared_mem, overlap=overlap and not plain)


for _module in (decode_units, heavy_rows, light_rows, light_rows_decode):
    _module.launch_after = _launch


def setting(name: str) -> None:
    global _PLAIN
    plain = SETTINGS[name]
    kc.PROGRAMMATIC = plain is not None
    _PLAIN = plain or ()


def run(workload: str, m: int, rounds: int, settings: list[str]) -> list[dict]:
    nan = workload.endswith("+nan")  # token 0's x[0] is NaN: it keeps every unit
    problems = [make_problem(workload.removesuffix("+nan"), m, K, N, seed=s) for s in range(SETS)]
    x_host = problems[0].x.copy()
    if nan:
        x_host[0, 0] = np.nan
    x = to_device(x_host)
    blocks = fused_blocks(problems)
    p0 = problems[0]
    ref = ffn_dense(x_host, p0.w_gate, p0.w_up, p0.w_down)

    def dense(b):  # noqa: ANN001, ANN202
        y = empty_bf16((m, K))
        return [y, *pipeline.dense_block(b, x, y)]

    bits = {}
    for name in settings:
        setting(name)
        bits[name] = blocks[0](x).view(cp.uint16).copy()
    out = [{"workload": workload, "M": m, "variant": "bits_equal",
            "equal": all(bool(cp.array_equal(bits["off"], b)) for b in bits.values()),
            "rel_err": relative_error(blocks[0](x), ref)}]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in (*settings, "dense")}
    for _ in range(rounds):
        for name in times:
            setting("off" if name == "dense" else name)
            fn = dense if name == "dense" else (lambda b: b(x))
            us = graph_ms_cupy(lambda fn=fn: [fn(b) for b in blocks], reps=30) * 1e3 / SETS
            times[name].append(us)
    setting("on")
    for name, values in times.items():
        out.append({"workload": workload, "M": m, "variant": name, "rotated_us": values})
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", nargs="*", type=int,
                    default=[1, 8, 16, 32, 64, 512, 2048, 4096])  # fmt: skip
    ap.add_argument("--also", nargs="*", default=["paperlike:64", "paperlike:2048",
                                                  "heavy:2048", "heavy:512"],
                    metavar="WORKLOAD:M")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.settings = list(dict.fromkeys(["on", "off", *args.settings]))
    plan = [("uniform", m) for m in args.M]
    plan += [(w, int(m)) for w, m in (a.rsplit(":", 1) for a in args.also)]
    records = []
    for workload, m in plan:
        records += run(workload, m, args.rounds, args.settings)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
