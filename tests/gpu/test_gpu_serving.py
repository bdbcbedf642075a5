"""Serving on the GPU: CUDA-graph capture from torch, the prepared-weight cache of the
functional ops, non-finite weights, and the switch to dense math at high density.

Skipped without a GPU; run on the GPU machine. Outputs are poisoned as in test_gpu.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from twell import workloads
from twell.reference.forward import ffn_dense
from twell.testing.asserts import relative_error

torch = pytest.importorskip("torch")

from torch_helpers import as_f64, tensors  # noqa: E402

import twell  # noqa: E402
from twell.kernels.density import crossover  # noqa: E402
from twell.torch import SparseMLP  # noqa: E402


def heavy_problem(m: int, k: int = 512, n: int = 1024) -> workloads.Problem:
    p = workloads.heavy(m, k, n, p=0.02, frac=0.05, seed=m)
    x = p.x.astype(np.float32)
    if m > 3:
        x[1, 5], x[2, 7] = np.nan, np.inf
    return dataclasses.replace(p, x=x.astype(p.x.dtype))


@pytest.mark.parametrize("path", ["fused", "epilogue", "pack", "sliced"])
@pytest.mark.parametrize("m", [1, 8, 64, 300])
def test_torch_graph_capture_in_default_mode(m: int, path: str) -> None:
    """torch.cuda.graph in its default (global) capture mode; replays give eager's bits."""
    p = heavy_problem(m)
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd, path=path, density_switch=False)
    eager = block(x)
    static_x = x.clone()
    graph, static_y = capture(block, static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y.view(torch.int16), eager.view(torch.int16))
    static_x.copy_(x.flip(0))  # new inputs in the captured buffer
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y.view(torch.int16), block(x.flip(0)).view(torch.int16))
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    finite = np.isfinite(oracle).all(axis=1)
    assert relative_error(as_f64(eager)[finite], oracle[finite]) < 1e-2


def capture(fn, *args):  # noqa: ANN001, ANN201 - a torch graph of fn(*args) and its output
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def shuffled_inputs(p: workloads.Problem, count: int, dtype: torch.dtype) -> list:
    """``count`` inputs of p's rows in new orders (new values and addresses per call)."""
    rng = np.random.default_rng(7)
    return [torch.from_numpy(p.x[rng.permutation(len(p.x))].astype(np.float32)).cuda().to(dtype)
            for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 8, 64, 300, 2048, 4097])
def test_call_graphs_read_x_in_place_and_give_eager_bits(m: int, dtype: torch.dtype) -> None:
    """A SparseFFN call on torch tensors launches the block's own graph, re-pointed at
    the call's x and at a fresh y, or for a small batch with copies (twell._graphs): the
    eager call's bits for inputs at new addresses, and no call's output changed by a
    later call. Above COPY_TOKENS tokens (or once torch's graph trees have run) the graph
    is captured the second time the shape comes."""
    from twell import _graphs

    p = heavy_problem(m)  # heavy rows, NaN and Inf in x
    _, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd, density_switch=False)
    xs = shuffled_inputs(p, 3, dtype)
    outs = [block(xs[0])]
    # the first call captures a small batch's graph, unless torch's graph trees have freed
    # their cuBLAS workspaces in this process (_graphs._cublas_epoch): the shape must then
    # come back within one epoch first
    first = 0 if m > _graphs.COPY_TOKENS or _graphs._cublas_epoch[0] else 1
    assert block._graphed.captures == first
    outs += [block(x) for x in xs[1:] + xs]
    torch.cuda.synchronize()
    for x, y in zip(xs + xs, outs, strict=True):
        assert torch.equal(y.view(torch.uint8), block._graphed.run(x).view(torch.uint8))
    graphs = list(block._graphed._graphs.values())
    assert len(graphs) == 1 and block._graphed.captures == 1
    if m <= _graphs.SMALL_TOKENS:
        assert not graphs[0].execs  # small batches replay with copies
        return
    assert graphs[0].execs, "the graph fell back to copies"
    assert any(e.bases[0] == xs[2].data_ptr() for e in graphs[0].execs)
    # nothing of the capture is kept but the graph (its scratch lives in torch's pool)
    assert graphs[0].keep == [] and graphs[0].static_x is None


def test_call_graph_of_a_misaligned_x_gets_a_graph_of_its_own() -> None:
    """An x at an address of lower alignment than the captured one is not fed to the
    captured kernels: it gets its own graph (its alignment is part of the key)."""
    p = heavy_problem(300)  # above SMALL_TOKENS: the graphs are re-pointed
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd, density_switch=False)
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    shifted = flat[1:].view(x.shape)  # 2-byte aligned
    shifted.copy_(x)
    for _ in range(2):
        for arg in (x, shifted):
            got = block(arg)
            assert torch.equal(got.view(torch.int16), block._graphed.run(x).view(torch.int16))
    assert len(block._graphed._graphs) == 2


def test_graph_of_a_model_with_sparse_mlps() -> None:
    p = heavy_problem(64)
    x, wg, wu, wd = tensors(p)
    linear = [torch.nn.Linear(*s, bias=False).cuda().bfloat16() for s in
              ((512, 1024), (512, 1024), (1024, 512))]  # fmt: skip
    with torch.no_grad():
        for layer, w in zip(linear, (wg, wu, wd), strict=True):
            layer.weight.copy_(w)
    model = torch.nn.Sequential(SparseMLP(*linear), torch.nn.LayerNorm(512).cuda().bfloat16(),
                                SparseMLP(*linear))  # fmt: skip
    with torch.no_grad():
        for _ in range(3):  # the density switch settles
            model(x)
        torch.cuda.synchronize()
        eager = model(x)
        graph, out = capture(model, x)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


def test_functional_ffn_caches_prepared_weights_and_sees_in_place_changes() -> None:
    from twell import ops

    p = workloads.uniform(200, 256, 512, p=0.005, seed=3)  # sparse: no switch to dense
    x, wg, wu, wd = tensors(p)
    ops._prepared_cache.clear()
    y1 = twell.ffn(x, wg, wu, wd)
    assert len(ops._prepared_cache) == 1
    y2 = twell.ffn(x, wg, wu, wd)
    assert len(ops._prepared_cache) == 1 and torch.equal(y1, y2)
    wd.mul_(2)  # in place: the version counter moves
    y3 = twell.ffn(x, wg, wu, wd)
    assert len(ops._prepared_cache) == 2
    assert relative_error(as_f64(y3), 2 * as_f64(y1)) < 1e-2


@pytest.mark.parametrize("which", ["w_up", "w_down"])
def test_non_finite_weight_of_an_idle_unit_poisons_like_dense_math(which: str) -> None:
    p = workloads.uniform(100, 256, 512, p=0.005, seed=4)
    arrays = dict(zip(("x", "w_gate", "w_up", "w_down"), p.arrays(), strict=True))
    pre = arrays["x"].astype(np.float64) @ arrays["w_gate"].astype(np.float64).T
    idle = int(np.nonzero((pre <= 0).all(axis=0))[0][0])  # a unit no token activates
    w = arrays[which].astype(np.float32)
    if which == "w_up":
        w[idle, 3] = np.nan
    else:
        w[3, idle] = np.nan
    arrays[which] = w.astype(p.x.dtype)
    oracle = ffn_dense(*arrays.values())
    x, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
                     for a in arrays.values())  # fmt: skip
    for y in (twell.ffn(x, wg, wu, wd), twell.SparseFFN(wg, wu, wd)(x)):
        np.testing.assert_array_equal(np.isnan(as_f64(y)), np.isnan(oracle))


def _decision(block: twell.SparseFFN, x: torch.Tensor) -> int:
    """The decision the block's call takes on ``x`` on the device, read back."""
    from twell._interop import cupy_view

    return int(block._prepared.takes_dense(cupy_view(x.contiguous())))


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16).clone()


def test_density_switch_stays_sparse_with_dense_sequence_starts() -> None:
    # paperlike: every 512th token (a BOS-like sink) fires hundreds of units, the mean is
    # about 5 of 1024 (threshold 9.7 at 4096 tokens). A sample aligned with the sequence
    # starts read 26. The call decides on its own rows: sparse, the bits of the block
    # with the switch off.
    p = workloads.paperlike(4096, 512, 1024, seed=0, seq_len=512)
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd)
    assert _decision(block, x) == 0
    off = twell.SparseFFN(wg, wu, wd, density_switch=False)
    assert torch.equal(_bits(block(x)), _bits(off(x)))


def test_density_switch_goes_dense_and_stays_correct() -> None:
    p = workloads.uniform(512, 512, 1024, p=0.3, seed=5)  # far above 1% of N active
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd)
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    first = block(x)
    torch.cuda.synchronize()
    second = block(x)
    density = block._prepared.density
    assert density.estimate is not None and density.estimate > density.threshold(512)
    assert density.dense
    third = block(x)
    assert torch.equal(second, third)
    for y in (first, second):
        assert relative_error(as_f64(y), oracle) < 1e-2
    sparse_only = twell.SparseFFN(wg, wu, wd, density_switch=False)
    sparse_only(x)
    torch.cuda.synchronize()
    sparse_only(x)
    assert not sparse_only._prepared.density.dense


def settled(block: twell.SparseFFN, x: torch.Tensor) -> torch.Tensor:
    """Two calls with the first one's statistics landed in between (the switch reads them
    at the second)."""
    block(x)
    torch.cuda.synchronize()
    return block(x)


def test_density_switch_decides_by_batch_size() -> None:
    # a density halfway between the crossovers in force at 256 tokens and at 2048 (H200:
    # 0.83% and 1.12%; H100: 0.32% and 0.86%): past the first, below the second
    low, high = crossover(256), crossover(2048)
    assert low < high
    p = workloads.uniform(2048, 256, 5632, p=(low + high) / 2, seed=3)
    x, wg, wu, wd = tensors(p)
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    block = twell.SparseFFN(wg, wu, wd)
    density = block._prepared.density
    y = settled(block, x[:256])
    assert density.threshold(256) < density.estimate < density.threshold(2048)
    assert density.dense
    assert relative_error(as_f64(y), oracle[:256]) < 1e-2
    y = block(x)
    assert not density.dense
    assert relative_error(as_f64(y), oracle) < 1e-2
    again = settled(block, x[:256])
    assert density.dense  # dense again
    assert torch.equal(block(x[:256]), again)


def test_a_heavy_row_sends_mid_sized_batches_dense() -> None:
    # token 0 of 512 fires ~19% of the units (outside the switch's row sample, so the mean
    # stays below the crossover): the heavy-row stage would cost more than the sparse
    # path saves at this batch size
    p = workloads.uniform(512, 256, 4096, p=0.003, seed=4)
    x = p.x.astype(np.float32)
    x[0, 1:] *= 3
    p = dataclasses.replace(p, x=x.astype(p.x.dtype))
    x, wg, wu, wd = tensors(p)
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    block = twell.SparseFFN(wg, wu, wd)
    density = block._prepared.density
    y = settled(block, x)
    assert density.estimate < density.threshold(512)
    assert density.heavy_share == pytest.approx(1 / 512)
    assert density.dense
    assert relative_error(as_f64(y), oracle) < 1e-2
    assert not density.go_dense(4096, False)  # large batches keep the sparse path
    assert not density.go_dense(32, False)
    sparse_only = twell.SparseFFN(wg, wu, wd, density_switch=False)
    assert not sparse_only._prepared.density.go_dense(512, False)
    assert relative_error(as_f64(settled(sparse_only, x)), oracle) < 1e-2


def test_heavy_rows_by_count_give_bits_that_ignore_earlier_calls() -> None:
    """1% heavy tokens at 4096 tokens: "auto" computes the heavy rows by count on tensor
    cores (pipeline.heavy_rows_counted). A fresh block's first call, the call after
    batches of other densities and heavy shares, and a warm block all give the same
    bits; the fixed-size cuBLAS GEMMs (a fixed capacity) round otherwise; all match dense
    math."""
    p = workloads.heavy(4096, 256, 2048, p=0.005, frac=0.01, seed=6)
    x, wg, wu, wd = tensors(p)
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    block = twell.SparseFFN(wg, wu, wd, dense_capacity="auto")
    first = _bits(block(x))
    assert relative_error(as_f64(block(x)), oracle) < 1e-2
    for other in (
        workloads.heavy(4096, 256, 2048, p=0.005, frac=0.3, seed=9),
        workloads.uniform(4096, 256, 2048, p=0.2, seed=9),
        workloads.uniform(512, 256, 2048, p=0.2, seed=9),
    ):
        for _ in range(3):
            block(tensors(other)[0])
        torch.cuda.synchronize()
    assert torch.equal(_bits(block(x)), first)
    fixed = twell.SparseFFN(wg, wu, wd, dense_capacity=1 / 16)
    y_fixed = settled(fixed, x)
    assert not torch.equal(_bits(y_fixed), first)  # cuBLAS's rounding of the heavy rows
    assert relative_error(as_f64(y_fixed), oracle) < 1e-2


def test_heavy_rows_in_the_sample_leave_the_decision_to_the_light_rows() -> None:
    """Three heavy tokens (~19% of the units each) at rows of the decision's 64-row
    sample: counted in the mean they would lift it from ~10 units past the crossover of
    4096 tokens; the light rows' mean decides instead, and the batch keeps the sparse
    path with the heavy rows by count: the switch-off block's bits."""
    from twell.kernels.density import sample_rows

    p = workloads.uniform(4096, 256, 2048, p=0.005, seed=6)
    x = p.x.astype(np.float32)
    rows = list(range(4096))[sample_rows(4096, 64)][:3]
    x[rows, 1:] *= 3
    p = dataclasses.replace(p, x=x.astype(p.x.dtype))
    x, wg, wu, wd = tensors(p)
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    block = twell.SparseFFN(wg, wu, wd)
    assert _decision(block, x) == 0
    y = block(x)
    assert relative_error(as_f64(y), oracle) < 1e-2
    off = twell.SparseFFN(wg, wu, wd, density_switch=False)
    assert torch.equal(_bits(off(x)), _bits(y))


@pytest.mark.parametrize("path", ["fused", "epilogue", "pack", "sliced"])
def test_a_dense_batch_goes_dense_at_its_first_call(path: str) -> None:
    """x negated (about 99% of the gate's pre-activations positive: far past the
    crossover) at 4096 tokens: the call decides dense on the device from its own rows, at
    its first call and every call after, with every route (from the pre-activation or
    from TwELL words): each row by count on tensor cores, the same bits whatever came
    before; the sparse batch in the same block keeps the sparse path."""
    p = workloads.uniform(4096, 256, 2048, p=0.005, seed=10)
    xs, wg, wu, wd = tensors(p)
    xd = torch.neg(xs)
    block = twell.SparseFFN(wg, wu, wd, path=path)
    assert _decision(block, xd) == 1 and _decision(block, xs) == 0
    first = _bits(block(xd))
    for _ in range(3):
        block(xs)
    torch.cuda.synchronize()
    assert torch.equal(_bits(block(xd)), first)
    oracle = ffn_dense(-p.x.astype(np.float64), p.w_gate, p.w_up, p.w_down)
    assert relative_error(as_f64(block(xd)), oracle) < 1e-2
    off = twell.SparseFFN(wg, wu, wd, path=path, density_switch=False)
    assert torch.equal(_bits(off(xs)), _bits(block(xs)))


def test_a_batch_mostly_of_heavy_rows_keeps_its_light_rows_sparse() -> None:
    """30% heavy tokens at 4096 tokens: the light rows' mean is under the crossover, so
    the call stays sparse and the heavy rows take the tensor-core GEMMs by count, whose
    cost follows their number (no whole-batch dense math needed); correct."""
    p = workloads.heavy(4096, 256, 2048, p=0.005, frac=0.3, seed=7)
    x, wg, wu, wd = tensors(p)
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    block = twell.SparseFFN(wg, wu, wd)
    assert _decision(block, x) == 0
    assert relative_error(as_f64(block(x)), oracle) < 1e-2


def test_heavy_rows_keep_a_mid_sized_batch_dense_across_measurements() -> None:
    """The dense path measures the share of heavy rows over every row, as the sparse
    routes do (a row sample would miss the rare heavy rows and send the batch back)."""
    import cupy as cp

    from twell.kernels.pipeline import PreparedBlock
    from twell.options import Options

    p = workloads.heavy(1024, 256, 2048, p=0.005, frac=0.005, seed=7)  # 5 heavy tokens
    block = PreparedBlock(*(cp.asarray(a.astype(np.float32)).astype(cp.float32)
                            for a in (p.w_gate, p.w_up, p.w_down)), Options())  # fmt: skip
    x = cp.asarray(p.x.astype(np.float32))
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    decisions = []
    for _ in range(4 * block.density.EVERY):
        y = block(x)
        cp.cuda.get_current_stream().synchronize()
        decisions.append(block.density.dense)
    assert block.density.heavy_share == pytest.approx(5 / 1024)
    assert decisions[0] is False and all(decisions[1:])
    assert relative_error(cp.asnumpy(y).astype(np.float64), oracle) < 1e-2


@pytest.mark.parametrize("m", [64, 300])
def test_refresh_calls_measure_while_the_calls_replay_graphs(m: int) -> None:
    """The same shape turns dense (x negated: about 99% of the gate's pre-activations
    positive): the call graphs' refresh calls measure it, so within one refresh period
    the switch sends the calls dense, and they stay right. (Before every refresh call
    measured, one in the switch's EVERY did: 512 calls could pass.)"""
    p = workloads.uniform(m, 256, 1024, p=0.004, seed=8)  # ~4 of 1024: sparse
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd)
    density = block._prepared.density
    settled(block, x)
    assert not density.dense
    flipped = torch.neg(x)
    for i in range(density.refresh_every + 16):
        y = block(flipped)
        if i % 16 == 0:
            torch.cuda.synchronize()  # let a measurement land
    assert density.dense
    oracle = ffn_dense(-p.x.astype(np.float64), p.w_gate, p.w_up, p.w_down)
    assert relative_error(as_f64(y), oracle) < 1e-2


def _default_pool(device: int) -> list:
    """torch's default memory pool on ``device``: each segment's address and its blocks'
    sizes and states."""
    return [
        (s["address"], [(b["size"], b["state"]) for b in s["blocks"]])
        for s in torch.cuda.memory_snapshot()
        if s["device"] == device and tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)
    ]


@pytest.mark.parametrize("m", [8, 300])
def test_a_capture_leaves_torchs_default_pool_as_it_found_it(m: int) -> None:
    """The call that captures a block's graph allocates nothing in torch's default pool
    beyond its output: the copy of x, the warm-up calls' buffers and the scratch come from
    the graphs' own pool. (transformers allocates a static cache layer by layer during
    the prefill; blocks a capture left in the default pool moved it, and torch's graph
    trees recorded anew for the moved cache.)"""
    from twell import _graphs

    p = heavy_problem(m)
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd, density_switch=False)
    # built, and torch's cuBLAS set up, by a call that captures nothing (a large batch
    # is captured only the second time it comes)
    block(torch.randn(_graphs.COPY_TOKENS + 1, x.shape[1], device="cuda", dtype=x.dtype))
    for _ in range(2):  # the first call captures, or the second one after graph trees ran
        torch.cuda.synchronize()
        before, captures = _default_pool(x.device.index), block._graphed.captures
        y = block(x)
        del y
        torch.cuda.synchronize()
        if block._graphed.captures > captures:
            assert _default_pool(x.device.index) == before
            return
    pytest.fail("no call captured a graph")


@pytest.mark.parametrize("m", [8, 300, 2048])
def test_user_captures_leave_no_buffers_on_the_block(m: int) -> None:
    """A user's captures keep their buffers in their graphs' pools, not on the block
    (repeated captures would grow it): the block holds nothing after five captures, and
    each graph still replays eager's bits (its static input kept by the user, as torch
    asks of any captured input)."""
    p = heavy_problem(m)
    x, wg, wu, wd = tensors(p)
    block = twell.SparseFFN(wg, wu, wd, density_switch=False)
    eager = block(x)
    inputs = [x.clone() for _ in range(5)]
    graphs = [capture(block, static_x) for static_x in inputs]
    assert block._prepared._graph_scratch == []
    for graph, out in graphs:
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("case", ["none", "one", "share", "all", "nan"])
@pytest.mark.parametrize("m", [65, 256, 1024])
def test_heavy_rows_beside_the_light_rows_give_the_sequential_bits(
    m: int, case: str, monkeypatch
) -> None:  # noqa: ANN001
    """Captured in a CUDA graph, a fused-route call of at most heavy_rows.FLAG_ROWS
    tokens runs its row flags and heavy rows on a second stream beside the light rows
    (pipeline.fused_beside); plain launches run the stages one after the other. The same
    bits, with no heavy row, one, a share, every row heavy, and NaN rows, at the paper's
    shape; the outputs poisoned first; and the reference's values."""
    from twell import inference
    from twell.kernels import pipeline
    from twell.options import Options

    frac = {"none": 0.0, "one": 1 / m, "share": 0.3, "all": 1.0, "nan": 0.0}[case]
    p = workloads.heavy(m, 2048, 5632, frac=frac, seed=m)
    if case == "nan":
        x = p.x.astype(np.float32)
        x[[1, m - 1], 7] = np.nan
        p = dataclasses.replace(p, x=x.astype(p.x.dtype))
    x, wg, wu, wd = tensors(p)
    options = Options(density_switch=False)
    taken = []
    beside = pipeline.fused_beside
    monkeypatch.setattr(pipeline, "fused_beside", lambda *a: taken.append(1) or beside(*a))
    plain = inference._run(x, wg, wu, wd, options, graphs=False)
    assert not taken
    static_x = x.clone()
    graph, static_y = capture(lambda t: inference._run(t, wg, wu, wd, options, graphs=False),
                              static_x)  # fmt: skip
    assert taken  # the capture took the two streams
    static_y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y.view(torch.int16), plain.view(torch.int16))
    oracle = ffn_dense(p.x, p.w_gate, p.w_up, p.w_down)
    finite = np.isfinite(oracle).all(axis=1)
    assert finite.sum() >= m - 2
    assert relative_error(as_f64(plain)[finite], oracle[finite]) < 1e-2
