"""Run one checkout of twell on fixed inputs: output bits (hashes) and timings, as JSON.

Used to compare two trees in one GPU call (bench/compare_trees.sh runs an older checkout
and this one alternately): a restructure must keep every output bit and the speed.
Only the public API is used, so any version of twell since the first can be measured.

    PYTHONPATH=<tree> python bench/compare_trees.py --label new --out results.json
"""

from __future__ import annotations

import argparse
import hashlib
import json

import cupy as cp
import numpy as np

import twell

# From twell.benchmark, not twell.timing: the older tree being compared has only that.
from twell.benchmark import make_problem, time_ms, to_device


def digest(array: object) -> str:
    return hashlib.sha256(cp.asnumpy(array.view(cp.uint8)).tobytes()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--M", type=int, default=16384)
    args = parser.parse_args()
    records = []
    for workload, m in [("uniform", args.M), ("heavy", args.M), ("paperlike", args.M),
                        ("heavy", 1000), ("uniform", 64)]:  # fmt: skip
        p = make_problem(workload, m, 2048, 5632)
        x = p.x.astype(np.float32)
        if m <= 1000:  # NaN and Inf rows
            x[3, 5], x[7, 9] = np.nan, np.inf
        x = to_device(x.astype(p.x.dtype))
        sets = [[to_device(w) for w in (p.w_gate, p.w_up, p.w_down)]]
        sets += [[w.copy() for w in sets[0]] for _ in range(2)]
        for path in ("fused", "epilogue", "pack"):
            for gated in (True, False):
                blocks = [twell.SparseFFN(*(ws if gated else [None, ws[0], ws[2]]), path=path)
                          for ws in sets]  # fmt: skip
                y = blocks[0](x)
                t = time_ms(lambda i, blocks=blocks, x=x: blocks[i](x), len(blocks))
                records.append({"label": args.label, "workload": workload, "M": m, "path": path,
                                "gated": gated, "bits": digest(y), "t_ms": t})  # fmt: skip
        h = twell.gate(x, sets[0][0])
        records.append(
            {
                "label": args.label,
                "workload": workload,
                "M": m,
                "path": "gate",
                "bits": digest(h.packed) + digest(h.dense) + digest(h.dense_rows),
            }
        )
        print(json.dumps(records[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
