#!/usr/bin/env bash
# Old tree against this one, in one GPU call: bits and timings, alternating runs.
#   git archive <rev> | tar -x -C .old   (a folder git ignores; carried to the device)
#   bash bench/compare_trees.sh .old      # JSON and a table under $OUT
set -u
OLD=${1:-.old}
OUT=${OUT:-/tmp/twell_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for round in $(seq 1 "${ROUNDS:-2}"); do
  PYTHONPATH="$OLD" python3 bench/compare_trees.py --label old --out "$OUT/old_$round.json" > /dev/null
  PYTHONPATH=. python3 bench/compare_trees.py --label new --out "$OUT/new_$round.json" > /dev/null
done
python3 - "$OUT" <<'PY'
import json, sys, statistics
out = sys.argv[1]
import glob
runs = {lab: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{lab}_*.json"))]
        for lab in ("old", "new")}
key = lambda r: (r["workload"], r["M"], r["path"], r.get("gated"))
old = {key(r): r for r in runs["old"][0]}
times = {lab: {} for lab in runs}
for lab, rs in runs.items():
    for run in rs:
        for r in run:
            if "t_ms" in r:
                times[lab].setdefault(key(r), []).append(r["t_ms"])
same = all(old[key(r)]["bits"] == r["bits"] for run in runs["new"] for r in run)
print(f"bits identical old vs new (every case, both rounds): {same}")
print(f"{'workload':<10}{'M':>7} {'path':<9}{'gated':<6}{'old ms':>9}{'new ms':>9}{'new/old':>8}  bits")
for k, r in old.items():
    if "t_ms" not in r:
        continue
    o, n = min(times["old"][k]), min(times["new"][k])
    eq = all(run_r["bits"] == r["bits"] for run in runs["new"] for run_r in run if key(run_r) == k)
    print(f"{k[0]:<10}{k[1]:>7} {k[2]:<9}{str(k[3]):<6}{o:>9.3f}{n:>9.3f}{n / o:>8.3f}  {'=' if eq else 'DIFF'}")
PY
