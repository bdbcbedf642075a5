"""The FFN block's training step on the GPU: twell's ``forward(save=True)`` + ``ffn_backward``
against dense torch autograd of the same block (bf16, same inputs).

    PYTHONPATH=. python bench/bench_backward.py                  # M=16384 K=2048 N=5632
    PYTHONPATH=. python bench/bench_backward.py --nongated --workloads uniform
    PYTHONPATH=. python bench/bench_backward.py --dense-capacity 0   # heavy rows: twell's kernels

For each workload (``uniform``, ``heavy``, ``paperlike`` at the benchmark shape):

- correctness against ``twell.reference.ffn_backward`` (float64) on a sample of rows: the
  full run's ``dx`` rows, and all four gradients of a run on the sampled rows alone;
  bit-identical reruns;
- timing (:mod:`twell.timing`): ``per_call`` (events around each call) and
  ``back_to_back`` (20 calls between two events), for twell's forward(save=True) +
  backward, forward alone, backward alone, and torch's forward + backward; the
  backward's time per kernel (events around each launch; ``capacity_rows`` around the
  whole cuBLAS part of the heavy rows, its two kernels included);
- extra peak memory of one step: torch's ``max_memory_allocated`` delta for torch, and
  for twell both CuPy's pool (``total_bytes`` grown from an empty pool: the device memory
  the step took; ``used_bytes`` after it: the outputs) and the same step with twell's
  buffers taken from torch's allocator (``max_memory_allocated`` delta).

Weight gradients: twell returns fp32, torch bf16 (the parameters' dtype). The L1 term is
off in the timed steps (``--l1`` sets it for the correctness check). Writes
``bench/results/<gpu>/backward.json`` (``--out``) after every case; each case's exception
is caught and recorded.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any

import ml_dtypes
import numpy as np

from twell.timing import back_to_back_ms, gpu_name, per_call_ms, record_path, versions, write_json

BF16 = np.dtype(ml_dtypes.bfloat16)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    num = np.linalg.norm(got[finite] - ref[finite])
    return float(num / max(np.linalg.norm(ref[finite]), 1e-30))


def to_f64(a: Any) -> np.ndarray:
    import cupy as cp

    if np.dtype(a.dtype) == BF16:
        return a.view(cp.uint16).get().view(BF16).astype(np.float64)
    return cp.asnumpy(a).astype(np.float64)


def timings(fn: Any, sets: int, reps: int) -> dict[str, float]:
    return {
        "per_call_ms": per_call_ms(fn, sets, reps=reps),
        "back_to_back_ms": back_to_back_ms(fn, sets),
    }


def torch_tensor(a: np.ndarray, *, grad: bool = False) -> Any:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()
    return t.requires_grad_(grad)


def stage_times(backward_mod: Any, fn: Any) -> dict[str, float]:
    """Time per kernel name of one call of ``fn`` (events around each launch), and of the
    heavy rows' cuBLAS part (``capacity_rows``: GEMMs and kernels, those also listed)."""
    import torch

    original = backward_mod._launch
    original_capacity = backward_mod._capacity_rows
    marks: list[tuple[str, Any, Any]] = []

    def timed(function: str, *args: Any) -> Any:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = (original_capacity if function == "capacity_rows" else original)(*args)
        stop.record()
        marks.append((function, start, stop))
        return out

    backward_mod._launch = lambda function, *args: timed(function, function, *args)
    backward_mod._capacity_rows = lambda *args: timed("capacity_rows", *args)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        backward_mod._launch = original
        backward_mod._capacity_rows = original_capacity
    out: dict[str, float] = {}
    for name, start, stop in marks:
        out[name] = out.get(name, 0.0) + start.elapsed_time(stop)
    return {k: round(v, 4) for k, v in out.items()}


def bench_case(workload: str, gated: bool, args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp
    import torch.nn.functional as nnf

    from twell import reference, workloads
    from twell.benchmark import to_device
    from twell.capacity import train_capacity
    from twell.kernels import backward, buffers
    from twell.kernels.pipeline import PreparedBlock
    from twell.options import Options

    m, k, n = args.M, args.K, args.N
    rec: dict[str, Any] = {"workload": workload, "gated": gated, "M": m, "K": k, "N": n,
                           "dense_capacity": args.dense_capacity}  # fmt: skip
    t0 = time.time()
    p = workloads.make(workload, m, k, n, seed=0)
    w_gate, w_up, w_down = (p.w_gate, p.w_up, p.w_down) if gated else (None, p.w_gate, p.w_down)
    rng = np.random.default_rng(1)
    xs_np = [p.x, np.roll(p.x, m // 2, axis=0)]
    dys_np = [rng.standard_normal((m, k)).astype(BF16) for _ in xs_np]
    rec["setup_s"] = round(time.time() - t0, 2)

    options = Options(dense_capacity=0.0 if args.dense_capacity == "auto" else args.dense_capacity)
    block = PreparedBlock(to_device(w_gate), to_device(w_up), to_device(w_down), options)
    xs = [to_device(a) for a in xs_np]
    dys = [to_device(a) for a in dys_np]
    if args.dense_capacity == "auto":
        # as SparseMLP's default in a training loop: the capacity the last step's heavy
        # rows ask for (here: a first forward's)
        count = int(block.forward(xs[0], save=True)[1].count[0])
        options = Options(dense_capacity=train_capacity(count, m))
        block = PreparedBlock(to_device(w_gate), to_device(w_up), to_device(w_down), options)
        rec["auto_capacity"] = options.dense_capacity

    def twell_step(i: int, l1: float = 0.0) -> Any:
        y, saved = block.forward(xs[i], save=True)
        return y, backward.ffn_backward(block, xs[i], dys[i], saved, l1_coeff=l1)

    # ---- statistics of the saved activations
    y, saved = block.forward(xs[0], save=True)
    heavy = cp.asnumpy(saved.heavy).astype(bool)
    counts = cp.asnumpy(saved.packed[:, :: options.slots]).astype(np.int64)
    pairs = int(counts[~heavy].sum())
    rows_per_pair = 3 if gated else 2
    rec["stats"] = {
        "heavy_rows": int(heavy.sum()),
        "light_l0": round(pairs / max(1, int((~heavy).sum())), 2),
        "light_pairs": pairs,
        "row_cap": backward.row_capacity(block.max_row_nnz, n, options.tile, options.slots, m),
        "capacity_rows": options.capacity_rows(m),
        "gather_bytes_light_rows": pairs * rows_per_pair * k * 2,
        "gather_bytes_weight_grads": pairs * 2 * k * 2,
        "dense_backward_flop": (12 if gated else 8) * m * k * n,
    }

    # ---- correctness on a row sample
    sample = np.arange(0, m, max(1, m // args.sample))
    l1_ref = args.l1 * len(sample) / m  # the same per-element L1 scale as the full run
    full = backward.ffn_backward(block, xs[0], dys[0], saved, l1_coeff=args.l1,
                                 reduction="per_token")  # fmt: skip
    again = backward.ffn_backward(block, xs[0], dys[0], saved, l1_coeff=args.l1,
                                  reduction="per_token")  # fmt: skip
    rec["deterministic"] = all(
        a is None or bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)))
        for a, b in zip(full, again, strict=True)
    )
    xs_s, dys_s = xs_np[0][sample], dys_np[0][sample]
    ref = reference.ffn_backward(xs_s, w_gate, w_up, w_down, dys_s, l1_ref, reduction="per_token")
    dx_rows = to_f64(full[0])[sample]
    errors = {"dx_rows_of_full_run": rel_err(dx_rows, ref[0])}
    del full, again
    x_g, dy_g = to_device(xs_s), to_device(dys_s)
    _, saved_s = block.forward(x_g, save=True)
    small = backward.ffn_backward(block, x_g, dy_g, saved_s, l1_coeff=l1_ref,
                                  reduction="per_token")  # fmt: skip
    for name, g, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), small, ref, strict=True):
        if r is not None:
            errors[f"{name}_of_sample_run"] = rel_err(to_f64(g), r)
    rec["rel_err"] = {kk: float(f"{v:.3e}") for kk, v in errors.items()}
    rec["sample_rows"] = len(sample)
    del small, saved_s

    # ---- timing: twell
    rec["twell"] = {"forward_save_plus_backward": timings(twell_step, 2, args.reps)}
    rec["twell"]["forward_save"] = timings(lambda i: block.forward(xs[i], save=True), 2, args.reps)
    saved_sets = [block.forward(xs[i], save=True)[1] for i in range(2)]
    rec["twell"]["backward"] = timings(
        lambda i: backward.ffn_backward(block, xs[i], dys[i], saved_sets[i]), 2, args.reps
    )
    rec["twell"]["backward_stages_ms"] = stage_times(
        backward, lambda: backward.ffn_backward(block, xs[0], dys[0], saved_sets[0])
    )
    saved_sets.clear()

    # ---- timing: torch autograd, same block
    w_t = [None if w is None else torch_tensor(w, grad=True) for w in (w_gate, w_up, w_down)]
    xs_t = [torch_tensor(a, grad=True) for a in xs_np]
    dys_t = [torch_tensor(a) for a in dys_np]

    def torch_forward(i: int) -> Any:
        x = xs_t[i]
        if gated:
            h = nnf.relu(nnf.linear(x, w_t[0])) * nnf.linear(x, w_t[1])
        else:
            h = nnf.relu(nnf.linear(x, w_t[1]))
        return nnf.linear(h, w_t[2])

    def torch_step(i: int) -> Any:
        for t in (*w_t, xs_t[i]):
            if t is not None:
                t.grad = None
        torch_forward(i).backward(dys_t[i])
        return xs_t[i].grad

    rec["torch"] = {
        "forward_plus_backward": timings(torch_step, 2, args.reps),
        "forward": timings(torch_forward, 2, args.reps),
    }

    # ---- twell as torch users meet it: the autograd ops on the same torch tensors
    from twell.autograd import ffn_train

    def ops_step(i: int) -> Any:
        for t in (*w_t, xs_t[i]):
            if t is not None:
                t.grad = None
        y, _, _ = ffn_train(xs_t[i], w_t[0], w_t[1], w_t[2], options)
        y.backward(dys_t[i])
        return xs_t[i].grad

    rec["twell_ops"] = {"forward_plus_backward": timings(ops_step, 2, args.reps)}
    rec["twell_ops"]["memory"] = _peak_delta(ops_step)
    rec["twell_ops"]["memory_vs_torch"] = round(
        rec["twell_ops"]["memory"] / max(1, _peak_delta(torch_step)), 3
    )
    tw = rec["twell"]["forward_save_plus_backward"]
    th = rec["torch"]["forward_plus_backward"]
    rec["speedup"] = {kk: round(th[kk] / tw[kk], 3) for kk in tw}
    to = rec["twell_ops"]["forward_plus_backward"]
    rec["speedup_ops"] = {kk: round(th[kk] / to[kk], 3) for kk in to}
    ref0 = reference.ffn_backward(xs_s, w_gate, w_up, w_down, dys_s)  # no L1: torch has none
    rec["torch_rel_err_dx_rows"] = _torch_dx_error(torch_step, ref0[0], sample)

    # ---- extra peak memory of one step
    rec["memory"] = _memory(torch_step, twell_step, buffers)
    return rec


def _capacity(text: str) -> float | str:
    return text if text == "auto" else float(text)


def _torch_dx_error(torch_step: Any, ref_dx: np.ndarray, sample: np.ndarray) -> float:
    """torch's dx on the sampled rows against the L1-free float64 reference."""
    import torch

    dx = torch_step(0)[torch.as_tensor(sample, device="cuda")].float().cpu().numpy()
    return float(f"{rel_err(dx.astype(np.float64), ref_dx):.3e}")


def _peak_delta(step: Any) -> int:
    """Peak bytes torch's allocator held above its level before one ``step(0)`` (whose
    result is kept until the peak is read, as a training step keeps its gradients)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    keep = step(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del keep
    return int(peak)


def _memory(torch_step: Any, twell_step: Any, buffers: Any) -> dict[str, Any]:
    import cupy as cp
    import torch

    out: dict[str, Any] = {"torch_peak_delta_bytes": _peak_delta(torch_step)}

    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    used0, total0 = pool.used_bytes(), pool.total_bytes()
    keep = twell_step(0)
    cp.cuda.Device().synchronize()
    out["twell_cupy_pool_total_growth_bytes"] = pool.total_bytes() - total0
    out["twell_cupy_pool_used_after_bytes"] = pool.used_bytes() - used0
    del keep
    pool.free_all_blocks()

    def torch_alloc(shape: tuple[int, ...], dtype: Any) -> Any:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        t = torch.empty(max(1, size), dtype=torch.uint8, device="cuda")
        return cp.from_dlpack(t)[:size].view(dtype).reshape(shape)

    with buffers.allocating_with(torch_alloc):
        out["twell_torch_allocator_peak_delta_bytes"] = _peak_delta(twell_step)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, default=16384)
    parser.add_argument("--K", type=int, default=2048)
    parser.add_argument("--N", type=int, default=5632)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "heavy", "paperlike"])
    parser.add_argument("--nongated", action="store_true", help="also the non-gated block")
    parser.add_argument("--sample", type=int, default=256, help="rows of the correctness check")
    parser.add_argument("--l1", type=float, default=1e-2, help="L1 coefficient of the check")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dense-capacity", type=_capacity, default="auto",
                        help="Options.dense_capacity: the first ceil(f*M) heavy rows of the "
                        "forward and the backward through cuBLAS GEMMs; 'auto' (default, "
                        "as SparseMLP): the capacity a first forward's heavy rows ask for "
                        "(twell.capacity.train_capacity)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=220.0, help="seconds; later cases skip")
    parser.add_argument(
        "--out", default=None, help="JSON record (default: bench/results/<gpu>/backward.json)"
    )
    args = parser.parse_args(argv)

    started = time.time()
    result: dict[str, Any] = {"device": gpu_name(), "versions": versions(), "args": vars(args),
                              "records": []}  # fmt: skip
    path = args.out or record_path("backward", result["device"])
    for gated in [True, False] if args.nongated else [True]:
        for workload in args.workloads:
            if time.time() - started > args.budget:
                result["records"].append({"workload": workload, "gated": gated,
                                          "skipped": "time budget"})  # fmt: skip
                continue
            case_start = time.time()
            try:
                rec = bench_case(workload, gated, args)
            except Exception:  # noqa: BLE001 - recorded, the next case runs
                rec = {"workload": workload, "gated": gated, "error": traceback.format_exc()}
            rec["case_s"] = round(time.time() - case_start, 1)
            result["records"].append(rec)
            write_json(path, result)
            print(_summary(rec), flush=True)
            _free()
    print(f"wrote {path} in {time.time() - started:.0f} s")
    return 0


def _free() -> None:
    import cupy as cp
    import torch

    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def _summary(rec: dict[str, Any]) -> str:
    head = f"{rec['workload']:<10} {'gated' if rec['gated'] else 'nongated':<8}"
    if rec.get("dense_capacity"):
        head += f" cap {rec['dense_capacity']}"
    if "auto_capacity" in rec:
        head += f" ({rec['auto_capacity']:.4g})"
    if "error" in rec:
        return f"{head} ERROR {rec['error'].strip().splitlines()[-1]}"
    if "skipped" in rec:
        return f"{head} skipped"
    tw, th = rec["twell"]["forward_save_plus_backward"], rec["torch"]["forward_plus_backward"]
    return (
        f"{head} twell {tw['per_call_ms']:.3f}/{tw['back_to_back_ms']:.3f} ms  torch "
        f"{th['per_call_ms']:.3f}/{th['back_to_back_ms']:.3f} ms  speedup {rec['speedup']}  "
        f"bwd {rec['twell']['backward']['per_call_ms']:.3f} ms  err {rec['rel_err']}  "
        f"det {rec['deterministic']}  heavy {rec['stats']['heavy_rows']}  "
        f"L0 {rec['stats']['light_l0']}  mem {rec['memory']}  ops: "
        f"{rec['twell_ops']['forward_plus_backward']} speedup {rec['speedup_ops']} "
        f"mem {rec['twell_ops']['memory']} ({rec['twell_ops']['memory_vs_torch']}x torch)"
    )


if __name__ == "__main__":
    sys.exit(main())
