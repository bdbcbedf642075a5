"""reuse.py + reuse.cu on the CPU emulator, against NumPy: structure, routing, outputs,
determinism, the TwELL input path, the non-gated block, small and default tilings.

    .venv/bin/python bench/reuse/emu/test_emu.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import reuse  # noqa: E402
from emu_backend import EmuBackend  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(BF16)


def routing(pre: np.ndarray, tile: int, slots: int, max_row_nnz: int) -> np.ndarray:
    """heavy flags by the rule: tile over slots-1, non-finite, more than max_row_nnz."""
    bits = pre.view(np.uint16)
    mag = bits & 0x7FFF
    keep = (mag > 0x7F80) | ((mag != 0) & ((bits & 0x8000) == 0))
    bad = (bits & 0x7F80) == 0x7F80
    m, n = pre.shape
    tiles = keep.reshape(m, n // tile, tile).sum(axis=2)
    return bad.any(axis=1) | (tiles > slots - 1).any(axis=1) | (keep.sum(axis=1) > max_row_nnz)


def pack_twell(pre: np.ndarray, tile: int, slots: int, shuffle: np.random.Generator | None):
    """TwELL words of relu(pre) (entries ascending, or shuffled inside each tile)."""
    m, n = pre.shape
    bits = pre.view(np.uint16).astype(np.uint32)
    mag = bits & 0x7FFF
    keep = (mag > 0x7F80) | ((mag != 0) & ((bits & 0x8000) == 0))
    out = np.zeros((m, n // tile * slots), np.uint32)
    for r in range(m):
        for j in range(n // tile):
            cols = np.nonzero(keep[r, j * tile : (j + 1) * tile])[0] + j * tile
            out[r, j * slots] = len(cols)
            if len(cols) <= slots - 1:
                if shuffle is not None:
                    cols = shuffle.permutation(cols)
                out[r, j * slots + 1 : j * slots + 1 + len(cols)] = cols | (bits[r, cols] << 16)
    return out


def reference(x, pre, w_up, w_down_t, heavy, gated):
    """float64 y of the light rows (g = relu(pre) as bf16, everything else exact)."""
    g = np.maximum(pre.astype(np.float64), 0.0)
    g[heavy] = 0.0
    if gated:
        u = x.astype(np.float64) @ w_up.astype(np.float64).T
        h = g * u
    else:
        h = g
    return h @ w_down_t.astype(np.float64)


def make_problem(rng, M, N, K, p, heavy_rows=()):
    z = {0.005: 2.5758, 0.02: 2.0537, 0.05: 1.6449}[p]
    x = bf16(rng.standard_normal((M, K)))
    w_up = bf16(rng.standard_normal((N, K)) / np.sqrt(K))
    w_down_t = bf16(rng.standard_normal((N, K)) / np.sqrt(N))
    pre = rng.standard_normal((M, N)).astype(np.float32) - z
    for kind, row in heavy_rows:
        if kind == "overflow":
            pre[row, :64] = np.abs(pre[row, :64]) + 0.5
        elif kind == "nan":
            pre[row, 5] = np.nan
        elif kind == "inf":
            pre[row, 7] = -np.inf
        elif kind == "many":  # spread over tiles: over max_row_nnz, no tile overflow
            pre[row, ::12] = 1.0
    return x, bf16(pre), w_up, w_down_t


def column_view_numpy(pre, heavy, M, N, UB, R):
    """(unit_ptr, pairs as (unit, token in block, g bits)) built plainly."""
    bits = pre.view(np.uint16)
    mag = bits & 0x7FFF
    keep = ((mag != 0) & ((bits & 0x8000) == 0)) & ~heavy[:, None]
    nbu = -(-M // UB)
    ptr = np.zeros((nbu, N + 1), np.int64)
    pairs = []
    for b in range(nbu):
        rows = slice(b * UB, min(M, (b + 1) * UB))
        k = keep[rows]
        counts = k.sum(axis=0)
        ptr[b, 1:] = np.cumsum(counts)
        ptr[b] += b * UB * R
        units, toks = np.nonzero(k.T)  # sorted by unit then token
        pairs.append((toks, units, bits[rows][toks, units]))
    return ptr, pairs


def run_case(name, *, M, N, K, p, gated=True, tile=256, slots=32, max_row_nnz=40,
             config=None, up_path="columns", ksplit=None, heavy_rows=(), twell=False, seed=0):  # fmt: skip
    rng = np.random.default_rng(seed)
    x, pre, w_up, w_down_t = make_problem(rng, M, N, K, p, heavy_rows)
    backend = EmuBackend()
    config = config or reuse.Config()
    t0 = time.time()
    heavy_ref = routing(pre, tile, slots, max_row_nnz)
    ys = []
    views = []
    for rep in range(2):
        y = backend.empty((M, K), np.uint16).view(BF16)
        heavy = backend.empty((M,), np.uint8)
        if not twell:
            view = reuse.light_rows(
                x if gated else None, pre, heavy, w_up if gated else None, w_down_t, y,
                tile=tile, slots=slots, max_row_nnz=max_row_nnz, up_path=up_path, ksplit=ksplit,
                config=config, backend=backend,
            )  # fmt: skip
        else:
            packed = pack_twell(
                pre, tile, slots, np.random.default_rng(seed + 1)
            )  # same order both runs
            bits = pre.view(np.uint16)
            heavy_in = (((bits & 0x7F80) == 0x7F80).any(axis=1)).astype(np.uint8)  # producer flags
            view = reuse.allocate_view(
                M, N, K, gated=gated, max_row_nnz=max_row_nnz, tile=tile, slots=slots,
                columns=gated and up_path == "columns", ksplit=ksplit, config=config,
                heavy=heavy, backend=backend,
            )  # fmt: skip
            reuse.build(view, packed=packed, heavy_in=heavy_in)
            if gated:
                (reuse.up if up_path == "columns" else reuse.up_gather)(view, x, w_up)
            reuse.down(view, w_down_t, y)
        ys.append(y)
        views.append(view)
    view = views[0]
    heavy = view.heavy.astype(bool)
    problems = []
    if not np.array_equal(heavy, heavy_ref):
        problems.append(f"heavy flags differ in {np.sum(heavy != heavy_ref)} rows")
    light = ~heavy_ref
    ref = reference(x, pre, w_up, w_down_t, heavy_ref, gated)
    got = ys[0].astype(np.float64)
    err = np.linalg.norm(got[light] - ref[light]) / max(np.linalg.norm(ref[light]), 1e-30)
    if not err <= 1e-2:
        problems.append(f"rel error {err:.3g}")
    if not np.isfinite(got[light]).all():
        problems.append("non-finite light outputs (unwritten?)")
    if (ys[0].view(np.uint16)[heavy_ref] != 0xFFFF).any():
        problems.append("a heavy row of y was written")
    if not np.array_equal(ys[0].view(np.uint16), ys[1].view(np.uint16)):
        problems.append("second run differs (bits)")
    # Structure of the column view against a plain construction.
    if view.columns and not twell:
        ptr_ref, pairs = column_view_numpy(pre, heavy_ref, M, N, config.up_block, max_row_nnz)
        ptr = view.unit_ptr.reshape(-1, N + 1)
        if not np.array_equal(ptr, ptr_ref):
            problems.append("unit_ptr differs")
        else:
            for b, (toks, units, gbits) in enumerate(pairs):
                lo = ptr_ref[b, 0]
                sl = slice(lo, lo + len(toks))
                w = view.col_word[sl]
                if not (np.array_equal(w & 0xFFFF, toks) and np.array_equal(view.col_unit[sl], units)
                        and np.array_equal(w >> 16, gbits)):  # fmt: skip
                    problems.append(f"column view block {b} differs")
                    break
                dst = view.col_dst[sl]
                if not np.array_equal(view.row_unit[dst], units):
                    problems.append(f"col_dst of block {b} points at other units")
                    break
    status = "PASS" if not problems else "FAIL " + "; ".join(problems)
    pairs_total = int((~heavy_ref[:, None] & (pre.astype(np.float32) > 0)).sum())
    print(f"{status:6s} {name}: M={M} N={N} K={K} pairs={pairs_total} heavy={int(heavy_ref.sum())} "
          f"rel_err={err:.2e} ({time.time() - t0:.1f}s)", flush=True)  # fmt: skip
    return not problems, ys[0], view


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    small = reuse.Config(up_block=64, up_ks=64, down_block=64, down_ks=64, row_chunk=256)
    hv = [("overflow", 3), ("nan", 10), ("inf", 17), ("many", 40)]
    ok = True
    cases = [
        (
            "small tiling, gated, columns",
            dict(M=200, N=512, K=264, p=0.05, config=small, heavy_rows=hv),
        ),
        (
            "small tiling, gated, gather",
            dict(M=200, N=512, K=264, p=0.05, config=small, heavy_rows=hv, up_path="gather"),
        ),
        ("small tiling, ksplit 3", dict(M=130, N=512, K=264, p=0.05, config=small, ksplit=3)),
        (
            "small tiling, non-gated",
            dict(M=200, N=512, K=264, p=0.05, config=small, gated=False, heavy_rows=hv),
        ),
        (
            "small tiling, TwELL input (shuffled)",
            dict(M=200, N=512, K=264, p=0.05, config=small, heavy_rows=hv, twell=True),
        ),
        (
            "DLIST rounds (dense-ish)",
            dict(
                M=96,
                N=512,
                K=64,
                p=0.05,
                config=reuse.Config(
                    up_block=32, up_ks=32, down_block=512, down_ks=32, row_chunk=512
                ),
                max_row_nnz=200,
            ),
        ),
        (
            "tile 128 slots 16, UKS 32, DKS 128",
            dict(
                M=150,
                N=384,
                K=136,
                p=0.02,
                tile=128,
                slots=16,
                config=reuse.Config(
                    up_block=96, up_ks=32, down_block=128, down_ks=128, row_chunk=128
                ),
                heavy_rows=[("overflow", 2)],
            ),
        ),
        ("max_row_nnz 0", dict(M=70, N=256, K=64, p=0.05, config=small, max_row_nnz=0)),
    ]
    if not args.quick:
        cases += [
            ("default tiling, gated, columns", dict(M=1100, N=768, K=264, p=0.02, heavy_rows=hv)),
            (
                "default tiling, gated, gather",
                dict(M=600, N=512, K=264, p=0.02, heavy_rows=hv, up_path="gather"),
            ),
            ("default tiling, non-gated", dict(M=600, N=512, K=128, p=0.02, gated=False)),
            (
                "up_ks 128 (one x stage, no A prefetch)",
                dict(M=520, N=512, K=264, p=0.02, config=reuse.Config(up_ks=128)),
            ),
            (
                "up_block 1024, up_ks 32 (no swizzle)",
                dict(
                    M=1030,
                    N=256,
                    K=264,
                    p=0.02,
                    config=reuse.Config(up_block=1024, up_ks=32),
                    heavy_rows=hv,
                ),
            ),
        ]
    for name, kw in cases:
        try:
            passed, _, _ = run_case(name, **kw)
        except Exception as error:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            print(f"FAIL   {name}: {type(error).__name__}: {error}", flush=True)
            passed = False
        ok &= passed
    # The gather path must give the same y bits as the columns path up to the up step's
    # summation order; and the TwELL path (ascending entries) the same bits as pre.
    print("all passed" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
