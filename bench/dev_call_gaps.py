"""Where a single SparseFFN call's GPU time goes: kernel spans and the idle gaps between
them (torch profiler, three calls, the second one reported), per call (synchronised
before each) and back to back. A call of a repeated shape launches the block's own
graph (twell._graphs); the profiler's own host overhead delays the first kernel.

    PYTHONPATH=. python bench/dev_call_gaps.py [--M 16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

import twell
from twell.sweeps import torch_problem


def kernels(prof) -> list[dict]:  # noqa: ANN001
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "twell_call":
            out.append({"name": e.name[:60], "start": e.time_range.start,
                        "end": e.time_range.end})  # fmt: skip
    return sorted(out, key=lambda k: k["start"])


def spans(ks: list[dict]) -> dict:
    gaps = [(ks[i + 1]["start"] - ks[i]["end"], ks[i]["name"], ks[i + 1]["name"])
            for i in range(len(ks) - 1)]  # fmt: skip
    busy = sum(k["end"] - k["start"] for k in ks)
    return {"kernels": len(ks), "span_us": ks[-1]["end"] - ks[0]["start"], "busy_us": busy,
            "gaps_over_3us": [(round(g, 1), a, b) for g, a, b in gaps if g > 3],
            "longest": sorted(((round(k["end"] - k["start"], 1), k["name"]) for k in ks),
                              reverse=True)[:8],
            # every kernel in order: name, µs it ran, µs idle before it
            "sequence": [(k["name"][:40], round(k["end"] - k["start"], 1),
                          round(k["start"] - ks[i - 1]["end"], 1) if i else 0.0)
                         for i, k in enumerate(ks)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, nargs="+", default=[16384])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for m in args.M:
        _, x, ws, _ = torch_problem("uniform", m, 2048, 5632)
        block = twell.SparseFFN(*ws[0])
        for _ in range(5):
            block(x)
        torch.cuda.synchronize()
        for mode in ("per_call", "back_to_back"):
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    if mode == "per_call":
                        torch.cuda.synchronize()
                    with torch.profiler.record_function("twell_call"):
                        block(x)
                torch.cuda.synchronize()
            ks = kernels(prof)
            per = len(ks) // 3
            if per == 0 or len(ks) % 3:  # calls launched different kernels: no fair split
                print(json.dumps({"M": m, "mode": mode, "kernels": len(ks),
                                  "note": "not three equal calls"}), flush=True)  # fmt: skip
                continue
            calls = sorted(e.time_range.start for e in prof.events()
                           if e.name == "twell_call"
                           and e.device_type == torch.autograd.DeviceType.CPU)  # fmt: skip
            r = {"M": m, "mode": mode, "kernels_per_call": per, **spans(ks[per:2 * per]),
                 "call_to_first_kernel_us": ks[per]["start"] - calls[1],
                 "call_to_last_kernel_end_us": ks[2 * per - 1]["end"] - calls[1]}  # fmt: skip
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.out:
        with open(f"{args.out}/call_gaps.json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
