"""Floor probe of the block-reuse down projection with per-chunk lists and whole warps in
step (`bench/reuse/floor.cu`), against the per-token gathers twell runs, on the real
entries of `uniform` p=0.005 at M=16384 (K=2048, N=5632).

The probe gets for free what a real kernel of that design would have to do besides:
each CTA copies two chunks of weights into shared memory once and reuses them for every
chunk (no ring of loads), and the lists are built in Python, untimed. The kernel is
timed whole and with no chunk at all (the copy and the output stores alone); the
difference is the consumer loop (8 token slots x 256 columns a warp, 16 warps a CTA,
128 tokens x 256 columns a CTA, chunks of 128 of the block's units, compacted), a lower
bound of that design's down half.
Beside it, the gathers' kernels on the same entries: `light_rows.from_twell` (up and
down per token, the "epilogue" route's stage) and the sliced route's lists, up and down
kernels (`twell_sliced_down` is a per-token down gather by itself). µs per launch (CUDA
events, median of 20 eager launches, weights warm in L2). The probe's output is checked
against a float64 sum of the same lists for the first and the last block of tokens (every
column slice), and for NaN (the output is poisoned before the launch) everywhere.

    PYTHONPATH=. python bench/dev_reuse_floor.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import cupy as cp
import numpy as np

from bench.dev_gate_gemm import time_ms
from twell.benchmark import gpu_name, make_problem, to_device, versions
from twell.kernels import gate_gemm, light_rows, light_rows_sliced
from twell.kernels.buffers import empty_bf16, u16
from twell.kernels.compile import Source
from twell.kernels.pipeline import PreparedBlock
from twell.options import Options

ROWS = 128  # units of a chunk (compacted), 512 bytes each at 256 columns
TOKENS = 128  # tokens of a CTA: 16 warps x 8 slots
SLICE = 256  # columns of a CTA
SOURCE = Source("floor.cu", parameters=("SWITCH", "SYNC", "PREFETCH"), constants={"ROWS": ROWS},
                directory=Path(__file__).parent / "reuse")  # fmt: skip


def build_lists(entries: np.ndarray, row_nnz: np.ndarray, h: np.ndarray):
    """Per (token block, chunk, warp): a head word of 8 slot counts and the entries
    sorted by slot (row in the chunk | slot << 8, and h), from the pair layout."""
    m = row_nnz.shape[0]
    blocks = math.ceil(m / TOKENS)
    per_block = []
    chunks = 0
    for b in range(blocks):
        t0, t1 = b * TOKENS, min(m, (b + 1) * TOKENS)
        toks, units, hs = [], [], []
        for t in range(t0, t1):
            c = int(row_nnz[t])
            toks.append(np.full(c, t - t0))
            units.append(entries[t, :c] & 0xFFFF)
            hs.append(h[t, :c])
        toks, units, hs = np.concatenate(toks), np.concatenate(units), np.concatenate(hs)
        distinct, idx = np.unique(units, return_inverse=True)
        chunk, row = idx // ROWS, idx % ROWS
        per_block.append((toks, chunk, row, hs))
        chunks = max(chunks, int(chunk.max()) + 1 if chunk.size else 0)
    heads = np.zeros((blocks, chunks, 16), np.uint32)
    ent = np.zeros((blocks, chunks, 16, 32), np.uint32)  # zero past a list's end
    hv = np.zeros((blocks, chunks, 16, 32), np.float32)
    capped = 0
    for b, (toks, chunk, row, hs) in enumerate(per_block):
        warp, slot = toks // 8, toks % 8
        # Sort by (chunk, warp, slot), stable: a token's entries keep their order.
        order = np.lexsort((slot, warp, chunk))
        toks, chunk, row, hs, warp, slot = (a[order] for a in (toks, chunk, row, hs, warp, slot))
        key = chunk * 16 + warp
        starts = np.searchsorted(key, np.arange(chunks * 16))
        ends = np.searchsorted(key, np.arange(chunks * 16), side="right")
        for k, (s0, s1) in enumerate(zip(starts, ends, strict=True)):
            c, w = divmod(k, 16)
            counts = np.bincount(slot[s0:s1], minlength=8)
            if counts.max(initial=0) > 15 or s1 - s0 > 32:
                capped += 1
                keep = np.concatenate([np.flatnonzero(slot[s0:s1] == s)[:15] for s in range(8)])
                keep = np.sort(keep)[:32]
            else:
                keep = np.arange(s1 - s0)
            sl = slot[s0:s1][keep]
            counts = np.bincount(sl, minlength=8)
            heads[b, c, w] = sum(int(counts[s]) << (4 * s) for s in range(8))
            ent[b, c, w, : keep.size] = row[s0:s1][keep] | (sl << 8)
            hv[b, c, w, : keep.size] = hs[s0:s1][keep]
    return heads, ent, hv, chunks, capped


def reference(w: np.ndarray, heads, ent, hv, chunks: int, block: int) -> np.ndarray:
    """float64 [TOKENS, SLICE] of one CTA: the lists of ``block`` over the staged rows."""
    out = np.zeros((TOKENS, SLICE))
    for c in range(chunks):
        for wp in range(16):
            head = int(heads[block, c, wp])
            total = sum((head >> (4 * s)) & 15 for s in range(8))
            for e, h in zip(ent[block, c, wp, :total], hv[block, c, wp, :total], strict=True):
                slot, row = (int(e) >> 8) & 7, int(e) & 255
                out[wp * 8 + slot] += float(h) * w[c & 1, row]
    return out


def uniform_block(m: int, k: int = 2048, n: int = 5632):
    """``x``, ``w_gate`` (CuPy) and a prepared block of `uniform` p=0.005."""
    p = make_problem("uniform", m, k, n)
    x, wg, wu, wd = (to_device(a) for a in (p.x, p.w_gate, p.w_up, p.w_down))
    return x, wg, PreparedBlock(wg, wu, wd, Options())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, default=16384)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    m, k, n = args.M, 2048, 5632
    x, wg, block = uniform_block(m, k, n)
    limit = block.max_row_nnz
    packed, heavy = gate_gemm.gate_pack(x, wg, 256, 32)
    y = empty_bf16((m, k))
    rec: dict = {"M": m, "K": k, "N": n, "gpu": gpu_name(), **versions()}

    def gather() -> None:
        light_rows.from_twell(x, packed, heavy, block.w_up, block.w_down_t, y, tile=256,
                              slots=32, max_row_nnz=limit)  # fmt: skip

    rec["from_twell_us"] = time_ms(gather) * 1e3
    params = {"KDIM": k, "TILE": 256, "SLOTS": 32, "GATED": 1}
    entries, row_nnz = light_rows_sliced.lists(packed, heavy, n, limit, params)
    rec["sliced_lists_us"] = (
        time_ms(lambda: light_rows_sliced.lists(packed, heavy, n, limit, params)) * 1e3
    )
    cap = entries.shape[1]
    rows = math.ceil(m / 8)
    h = cp.empty((m, cap), cp.float32)
    up = light_rows_sliced.SOURCE.kernel("twell_sliced_up", **params)
    down = light_rows_sliced.SOURCE.kernel("twell_sliced_down", **params)
    i32 = np.int32

    def ups() -> None:
        for s in range(k // 256):
            up((rows,), (256,), (u16(x), u16(block.w_up), entries, row_nnz, h, i32(m),
                                 i32(cap), i32(s), i32(s == k // 256 - 1)))  # fmt: skip

    def downs() -> None:
        down(
            (math.ceil(k // 256 * m / 8),),
            (256,),
            (heavy, entries, row_nnz, h, u16(block.w_down_t), u16(y), i32(m), i32(cap)),
        )

    rec["sliced_up_us"] = time_ms(ups) * 1e3
    rec["sliced_down_us"] = time_ms(downs) * 1e3
    print(json.dumps(rec), flush=True)

    heads, ent, hv, chunks, capped = build_lists(
        cp.asnumpy(entries), cp.asnumpy(row_nnz), cp.asnumpy(h)
    )
    listed = sum(int(((heads >> (4 * q)) & 15).sum()) for q in range(8))
    rec.update(chunks=chunks, lists_capped=capped, entries=listed,
               light_rows=int((cp.asnumpy(row_nnz) > 0).sum()))  # fmt: skip
    rng = np.random.default_rng(1)
    w_bits = rng.standard_normal((2, ROWS, SLICE)).astype(np.float32).view(np.uint32) >> 16
    w_bits = w_bits.astype(np.uint16)
    w_f = (w_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    d_w, d_heads = cp.asarray(w_bits), cp.asarray(heads)
    d_ent, d_hv = cp.asarray(ent), cp.asarray(hv)
    blocks, slices = heads.shape[0], k // SLICE
    out = cp.empty((blocks * slices, TOKENS, SLICE), cp.uint16)
    probes = {}
    last = blocks - 1
    refs = {b: reference(w_f, heads, ent, hv, chunks, b) for b in (0, last)}
    for sw, sync, pf in itertools.product((0, 1, 2), (0, 1), (0, 1)):
        name = f"switch{sw}_sync{sync}_prefetch{pf}"
        kern = SOURCE.kernel("twell_floor_down", SWITCH=sw, SYNC=sync, PREFETCH=pf)
        smem = 2 * ROWS * SLICE * 2
        kern.max_dynamic_shared_size_bytes = smem

        def run(kern=kern, smem=smem, chunks=chunks) -> None:
            kern(
                (blocks * slices,),
                (512,),
                (d_w, d_heads, d_ent, d_hv, out, i32(chunks), i32(slices)),
                shared_mem=smem,
            )

        out.fill(0xFFFF)  # NaN: an unwritten element shows
        run()
        host = (cp.asnumpy(out).astype(np.uint32) << 16).view(np.float32)
        err = 0.0
        for b, ref in refs.items():  # the first and the last token block, every slice
            got = host[b * slices : (b + 1) * slices]
            err = max(err, float(np.abs(got - ref[None]).max() / np.abs(ref).max()))
        ok = bool(err < 1e-2 and np.isfinite(host).all())
        # The same launch with no chunk: the staging copy and the output stores alone.
        fixed = time_ms(lambda run=run: run(chunks=0)) * 1e3
        us = time_ms(run) * 1e3
        probes[name] = {
            "us": us, "no_chunks_us": fixed, "loop_us": us - fixed, "max_rel_err": err,
            "all_written": bool(np.isfinite(host).all()), "ok": ok,
            "registers": int(kern.num_regs), "local_bytes": int(kern.local_size_bytes),
        }  # fmt: skip
        print(json.dumps({name: probes[name]}), flush=True)
    rec["probe"] = probes
    print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1))
    if not all(v["ok"] for v in probes.values()):
        raise SystemExit("probe output differs from the float64 sum")


if __name__ == "__main__":
    main()
