"""Graphs re-pointed at each call's tensors (twell._graphs, twell._graph_nodes), on the
GPU: whether the TMA map of gate_gemm.cu holds its address as a plain word, what each
batch size's captured SparseFFN graph holds and how it is launched (re-pointed, with
copies, or not at all), that its launches give the eager call's bits for inputs at new
addresses, and what a call costs against eager launches and dense torch (host µs behind
a GPU sleep, per call with a synchronisation, back to back).

    PYTHONPATH=. python bench/dev_repoint.py [--out FILE] [--skip-timing] [--skip-checks]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

import twell
from twell import _graphs, workloads
from twell._arrays import bfloat16
from twell.kernels import gate_gemm


def map_probe() -> dict:
    import cupy

    a = cupy.zeros((4096, 2048), dtype=cupy.uint16)
    raw = gate_gemm.tensor_map(a.view(bfloat16), 128).tobytes()
    words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, 128, 8)]
    address = a.data.ptr
    return {
        "address": hex(address),
        "raw_word": [i for i, w in enumerate(words) if w == address],
        "shifted_word": [i for i, w in enumerate(words) if w == address >> 4],
        "words": [hex(w) for w in words],
    }


def tensors(p: workloads.Problem, dtype: torch.dtype = torch.bfloat16) -> list:
    return [torch.from_numpy(a.astype(np.float32)).cuda().to(dtype) for a in p.arrays()]


def inputs(p: workloads.Problem, count: int, dtype: torch.dtype) -> list:
    """``count`` inputs of p's shape with p's pattern of rows shuffled (new addresses,
    new values)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        rows = rng.permutation(p.x.shape[0])
        out.append(torch.from_numpy(p.x[rows].astype(np.float32)).cuda().to(dtype))
    return out


def check(name: str, p: workloads.Problem, dtype: torch.dtype = torch.bfloat16,
          calls: int = 4) -> dict:  # fmt: skip
    _, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd)
    xs = inputs(p, 3, dtype)
    for _ in range(calls):  # settle the density switch, capture
        block(xs[0])
    same = True
    for x in xs + xs[::-1]:
        got = block(x)
        want = block._graphed.run(x)
        torch.cuda.synchronize()
        same &= torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    graphed = block._graphed
    rec: dict = {"case": name, "M": p.x.shape[0], "dtype": str(dtype), "bits_equal": bool(same),
                 "captures": graphed.captures, "graphs": []}  # fmt: skip
    for key, g in graphed._graphs.items():
        r = g.execs[0] if g.execs else None
        rec["graphs"].append({
            "decision": repr(key[-1]),
            "mode": "repointed" if r is not None else "copies",
            "patched": None if r is None else r.patched,
            "opaque": None if r is None else r.opaque,
        })  # fmt: skip
    print(json.dumps(rec), flush=True)
    return rec


def host_us(fn, calls: int = 8) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def per_call_ms(fn, calls: int = 30) -> float:  # noqa: ANN001
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times[5:])) * 1e3


def back_to_back_ms(fn, calls: int = 40) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls


def timing(m: int) -> dict:
    p = workloads.uniform(m, 2048, 5632, seed=0)
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd)
    for _ in range(4):
        block(x)
    # a new x every call (two tensors in turn): the graph is re-pointed at every call
    xs, turn = [x, x.clone()], [0]

    def alternating(b: twell.SparseFFN) -> torch.Tensor:
        turn[0] ^= 1
        return b(xs[turn[0]])

    variants = {
        "graphed": lambda: block(x),
        "graphed_alternating": lambda: alternating(block),
        "eager": lambda: block._graphed.run(x),
        "dense": lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd),
    }
    if _graphs.SMALL_TOKENS < m <= _graphs.COPY_TOKENS:  # the same graph with copies
        copies = twell.SparseFFN(wg, wu, wd)
        real = _graphs._try_repoint
        _graphs._try_repoint = lambda *a, **k: (None, None)
        try:
            for _ in range(4):
                copies(x)
        finally:
            _graphs._try_repoint = real
        variants["copies_alternating"] = lambda: alternating(copies)
    rec: dict = {"M": m}
    for name, fn in variants.items():
        rec[name] = {
            "host_us": round(host_us(fn, 8 if m > 4096 else 30), 1),
            "per_call_ms": round(per_call_ms(fn), 4),
            "back_to_back_ms": round(back_to_back_ms(fn), 4),
        }
    rec["graphs"] = [bool(g.execs) for g in block._graphed._graphs.values()]
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    record: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "copy_tokens": _graphs.COPY_TOKENS}  # fmt: skip
    record["tensor_map"] = map_probe()
    print(json.dumps(record["tensor_map"]), flush=True)
    k, n = 2048, 5632
    checks = []
    for m in () if args.skip_checks else (1, 8, 64, 300, 2048, 4096, 8192, 16384):
        checks.append(check("uniform", workloads.uniform(m, k, n, seed=m)))
    if not args.skip_checks:
        checks.append(check("heavy", workloads.heavy(8192, k, n, seed=2)))
        checks.append(check("heavy", workloads.heavy(2048, k, n, seed=2)))
        checks.append(check("density", workloads.uniform(2048, k, n, p=0.1, seed=3), calls=12))
        checks.append(check("uniform", workloads.uniform(64, k, n, seed=4), torch.float32))
        checks.append(check("uniform", workloads.uniform(8192, k, n, seed=4), torch.float32))
    record["checks"] = checks
    if not args.skip_timing:
        record["timing"] = [timing(m) for m in (8, 64, 2048, 4096, 8192, 16384)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if not all(c["bits_equal"] for c in checks):
        raise SystemExit("a graph launch differed from the eager call's bits")


if __name__ == "__main__":
    main()
