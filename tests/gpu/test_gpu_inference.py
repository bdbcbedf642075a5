"""The user's path on the GPU: ``torch.compile`` (``fullgraph=True``, every mode) over
SparseMLP and SparseFFN, transformers' ``generate`` with the dynamic and the static
(compiled) cache, compiled and eager training steps of a Llama model, and eager training
calls that never wait for the GPU.

Skipped without a GPU; run on the GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from twell import workloads
from twell.testing.asserts import relative_error

torch = pytest.importorskip("torch")

from torch_helpers import LlamaMLP, as_f64  # noqa: E402

import twell  # noqa: E402
from twell import inference  # noqa: E402
from twell.reference.forward import ffn_dense  # noqa: E402
from twell.timing import host_us_queued  # noqa: E402
from twell.torch import SparseMLP, l1_penalty, sparsify  # noqa: E402

# Through torch's ops, whose buffers come from torch's allocator.
pytestmark = pytest.mark.unpoisoned

MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs"]


def _mlp(p: workloads.Problem, **kwargs) -> tuple[SparseMLP, LlamaMLP]:  # noqa: ANN003
    dense = LlamaMLP(p.K, p.N).cuda().bfloat16()
    with torch.no_grad():
        for layer, w in ((dense.gate_proj, p.w_gate), (dense.up_proj, p.w_up),
                         (dense.down_proj, p.w_down)):  # fmt: skip
            layer.weight.copy_(torch.from_numpy(w.astype(np.float32)))
    twin = LlamaMLP(p.K, p.N).cuda().bfloat16()
    twin.load_state_dict(dense.state_dict())
    return SparseMLP.from_module(twin, **kwargs), dense


def _x(p: workloads.Problem) -> torch.Tensor:
    return torch.from_numpy(p.x.astype(np.float32)).cuda().bfloat16()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_compiled_sparse_mlp_gives_the_eager_bits(mode: str, m: int) -> None:
    """fullgraph in every mode; the compiled calls' bits are the eager call's (the same
    kernels run); inside reduce-overhead's CUDA-graph trees twell captures no graph of
    its own (plain launches, which the trees capture)."""
    p = workloads.uniform(m, 2048, 5632, p=0.005, seed=m)
    sparse, _ = _mlp(p)
    x = _x(p)
    with torch.no_grad():
        eager = sparse(x).clone()
        assert relative_error(as_f64(eager), ffn_dense(*p.arrays())) < 1e-2
        block = sparse.prepared()
        captures = block.graphed.captures
        torch._dynamo.reset()
        compiled = torch.compile(sparse, mode=None if mode == "default" else mode,
                                 fullgraph=True, dynamic=False)  # fmt: skip
        for _ in range(4):
            got = compiled(x).clone()
            assert torch.equal(got, eager)
        if mode == "reduce-overhead":
            assert block.graphed.captures == captures


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_sparse_ffn_in_a_larger_function(mode: str) -> None:
    p = workloads.uniform(64, 1024, 2048, p=0.01, seed=5)
    w = [torch.from_numpy(a.astype(np.float32)).cuda().bfloat16() for a in p.arrays()[1:]]
    block = twell.SparseFFN(*w)
    x = _x(p)

    def f(x: torch.Tensor) -> torch.Tensor:
        return block(torch.relu(x) * 2.0) + 1.0

    with torch.no_grad():
        eager = f(x)
        torch._dynamo.reset()
        compiled = torch.compile(f, mode=None if mode == "default" else mode, fullgraph=True)
        for _ in range(3):
            assert relative_error(as_f64(compiled(x).clone()), as_f64(eager)) < 1e-2


def _llama(layers: int = 2, l0: float = 12.0):  # noqa: ANN202
    from twell.testing import llama

    model = llama.relu_llama(hidden=512, ffn=1024, layers=layers, heads=8, kv_heads=4,
                             vocab=1000, max_positions=512, device="cuda")  # fmt: skip
    llama.calibrate(model, l0=l0, sequences=16, length=128)
    return model


def _twins():  # noqa: ANN202
    """A fresh dynamo cache, the small Llama sparsified, and its dense twin."""
    import copy

    torch._dynamo.reset()
    model = _llama()
    dense = copy.deepcopy(model)
    sparsify(model)
    return model, dense


@pytest.mark.parametrize("batch", [1, 4])
def test_generate_with_the_static_cache_compiled_runs_and_stays_greedy(batch: int) -> None:
    """transformers compiles the decode step for a static cache (reduce-overhead, on
    CUDA): it must run, repeat its own tokens, and choose at every step a token that the
    eager twell model ranks first up to rounding, as the dynamic cache's tokens are
    (inductor's fused kernels around the MLPs round differently from eager ones, so an
    exact greedy tie may break the other way; the dense twin, compiled, is held to the
    same bound)."""
    pytest.importorskip("transformers")

    from twell.testing import llama

    model, dense = _twins()
    ids = llama.random_tokens(model, batch, 16, seed=3)
    kwargs = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    with torch.no_grad():
        dynamic = model.generate(ids, **kwargs)
        eager = model.generate(ids, cache_implementation="static", disable_compile=True,
                               **kwargs)  # fmt: skip
        compiled = model.generate(ids, cache_implementation="static", **kwargs)
        again = model.generate(ids, cache_implementation="static", **kwargs)
        dense_compiled = dense.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(again, compiled)
    # Static or dynamic cache: the attention rounds differently, so a near tie between
    # two tokens of this random model may break either way.
    assert llama.greedy_gap(model, dynamic, 16) < 2e-2
    assert llama.greedy_gap(model, eager, 16) < 2e-2
    assert llama.greedy_gap(model, compiled, 16) < 2e-2
    assert llama.greedy_gap(dense, dense_compiled, 16) < 2e-2


_GENERATE_RECORDINGS = """
import copy, json, torch
from twell import _graphs
from twell.testing import llama
from twell.torch import sparsify
model = llama.relu_llama(hidden=512, ffn=1024, layers=2, heads=8, kv_heads=4, vocab=1000,
                         max_positions=512, device="cuda")
llama.calibrate(model, l0=12.0, sequences=16, length=128)
dense = copy.deepcopy(model)
sparsify(model)
ids = llama.random_tokens(model, 1, 128, seed=5)
kwargs = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False,
          "cache_implementation": "static"}
found = {}
with torch.no_grad():
    for name, m in (("twell", model), ("dense", dense)):
        outputs = [m.generate(ids, **kwargs) for _ in range(4)]
        epoch = _graphs._cublas_epoch[0]
        outputs += [m.generate(ids, **kwargs) for _ in range(4)]
        found[name] = [_graphs._cublas_epoch[0] - epoch,
                       all(torch.equal(o, outputs[0]) for o in outputs)]
print(json.dumps(found))
"""


def test_repeated_static_cache_generate_records_no_more_than_dense() -> None:
    """transformers builds a new static cache at every generate call, allocating each
    layer's tensors during the prefill, and torch's graph trees record again (freeing the
    cuBLAS workspaces) when they land elsewhere. A capture of twell's during the prefill
    that left its buffers in torch's default pool moved them, and captures and recordings
    followed each other. In a fresh process (a user's: the tests before this one leave
    allocations that make even the dense twin record at most calls), repeated calls of
    the twell model record no more often than its dense twin's once both are warm, and
    repeat their tokens."""
    pytest.importorskip("transformers")
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _GENERATE_RECORDINGS], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["twell"][1] and found["dense"][1], found  # the tokens repeat
    assert found["twell"][0] <= found["dense"][0], found


def test_compiled_llama_forward_and_training_step() -> None:
    """torch.compile(model) (default mode): the forward's logits as eager twell's (up to
    the rounding of inductor's fused kernels around the MLPs); a training step with
    labels= and the L1 term runs compiled, with the eager step's loss, and its gradients
    differ from the eager step's no more than the dense twin's compiled gradients differ
    from its eager ones (bf16 rounding through a random model)."""
    pytest.importorskip("transformers")

    from twell.testing import llama

    model, dense = _twins()
    ids = llama.random_tokens(model, 2, 64, seed=4)
    with torch.no_grad():
        eager_logits = model(ids).logits.float()
        got = torch.compile(model)(ids).logits.float()
    assert float((got - eager_logits).norm() / eager_logits.norm()) < 1e-2
    differences = {}
    for name, m in (("twell", model), ("dense", dense)):
        m.train()
        runs = []
        for run in (m, torch.compile(m)):
            out = run(input_ids=ids, labels=ids)
            loss = out.loss + (1e-4 * l1_penalty(m) if name == "twell" else 0.0)
            loss.backward()
            runs.append((float(loss.detach()), [q.grad.float().clone() for q in m.parameters()]))
            m.zero_grad(set_to_none=True)
        (a, ga), (b, gb) = runs
        assert abs(a - b) < 1e-2 * abs(a)
        differences[name] = [float((x - y).norm() / y.norm().clamp_min(1e-20))
                             for x, y in zip(ga, gb, strict=True)]  # fmt: skip
    for ours, theirs in zip(differences["twell"], differences["dense"], strict=True):
        assert ours < 3 * theirs + 2e-2, (ours, theirs)


@pytest.mark.parametrize("workload", ["uniform", "heavy"])
def test_eager_training_replays_give_the_plain_bits(workload: str) -> None:
    """SparseMLP's default eager training (op graphs from the second call, the autograd
    Function without the dispatcher) gives the bits of plain launches and of the custom
    ops that compiled code calls."""
    p = (workloads.uniform(512, 1024, 2048, p=0.01, seed=1) if workload == "uniform"
         else workloads.heavy(512, 1024, 2048, p=0.01, frac=0.02, seed=1))  # fmt: skip
    dy = torch.randn(512, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for name, graphs in (("plain", False), ("graphs", True)):
        sparse, _ = _mlp(p, op_graphs=graphs, dense_capacity=0.0)
        for _ in range(3):  # eager, capture + replay, replay
            for q in sparse.parameters():
                q.grad = None
            x = _x(p).requires_grad_()
            y = sparse(x)
            y.backward(dy.bfloat16())
        results[name] = [y.detach().clone(), x.grad.clone(),
                         *(q.grad.clone() for q in sparse.parameters())]  # fmt: skip
    sparse, _ = _mlp(p, dense_capacity=0.0)
    weights = [q for q in sparse.parameters()]
    x = _x(p).requires_grad_()
    y = torch.ops.twell.ffn_train_forward(x, *weights, 256, 32, -1, 0.0, "mean", False)[0]
    y.backward(dy.bfloat16())
    results["ops"] = [y.detach(), x.grad, *(q.grad for q in weights)]
    for name in ("graphs", "ops"):
        for a, b in zip(results[name], results["plain"], strict=True):
            assert torch.equal(a, b), name


def test_eager_training_never_waits_for_the_gpu() -> None:
    """A default SparseMLP training step (auto dense capacity, op graphs) queued behind a
    long GPU sleep returns without waiting (host_us_queued raises if it waits)."""
    p = workloads.heavy(2048, 2048, 5632, p=0.005, frac=0.01, seed=2)
    sparse, _ = _mlp(p)
    x = _x(p).requires_grad_()
    dy = torch.randn_like(x)

    def step() -> None:
        for q in sparse.parameters():
            q.grad = None
        sparse(x).backward(dy)

    assert host_us_queued(step, calls=4) < 50_000


def test_inference_registry_follows_weight_updates_and_frees_blocks() -> None:
    p = workloads.uniform(8, 512, 1024, p=0.02, seed=6)
    sparse, dense = _mlp(p)
    x = _x(p)
    with torch.no_grad():
        first = sparse(x).clone()
        block = sparse.prepared()
        sparse.up_proj.weight.mul_(2.0)  # in place: the version counter moves
        second = sparse(x)
        assert sparse.prepared() is not block
        assert relative_error(as_f64(second), as_f64(2.0 * first)) < 1e-2
    key = tuple(inference._identity(q) for q in sparse.parameters())
    assert key in inference._blocks
    del sparse, block
    import gc

    gc.collect()
    q = workloads.uniform(8, 512, 1024, p=0.02, seed=7)
    other, _ = _mlp(q)
    with torch.no_grad():
        other(_x(q))  # a build sweeps the blocks of freed weights
    assert key not in inference._blocks


def test_the_memo_of_the_last_call_gives_the_full_paths_bits() -> None:
    """A SparseMLP's repeated eager call goes to its remembered block (no checks, no
    registry lookup) with the bits of the full path, and leaves it where a weight moved
    (``.data`` replaced), changed in place, or the module went through ``train()``."""
    p = workloads.uniform(4, 512, 1024, p=0.005, seed=8)
    sparse, _ = _mlp(p)
    sparse.eval()
    x = _x(p).reshape(1, 4, 512)
    with torch.no_grad():
        first = sparse(x).clone()
        assert sparse._recent.remembered() is sparse.prepared()
        for _ in range(3):
            assert torch.equal(sparse(x), first)
        sparse.up_proj.weight.data = 2.0 * sparse.up_proj.weight.data
        assert relative_error(as_f64(sparse(x)), as_f64(2.0 * first)) < 1e-2
        sparse.up_proj.weight.mul_(0.5)  # back to the first values (exact in bf16)
        assert relative_error(as_f64(sparse(x)), as_f64(first)) < 1e-2
        sparse.train().eval()
        assert sparse._recent.remembered() is None
        assert relative_error(as_f64(sparse(x)), as_f64(first)) < 1e-2
        half = sparse(x[:, :2])  # another shape: the full path
        assert relative_error(as_f64(half), as_f64(first[:, :2])) < 1e-2


def test_two_forwards_before_one_backward_keep_their_activations() -> None:
    """Gradient accumulation through one autograd graph (two forwards of a layer, then one
    backward): with op graphs the second forward's replay first copies out what the
    first forward lent to its backward, so both backward calls read their own
    activations; the gradients are the plain launches' bits."""
    p = workloads.uniform(512, 1024, 2048, p=0.01, seed=8)
    q = workloads.uniform(512, 1024, 2048, p=0.01, seed=9)
    gen = torch.Generator("cuda").manual_seed(1)
    dys = [torch.randn(512, 1024, device="cuda", generator=gen).bfloat16() for _ in range(2)]
    results = {}
    for graphs in (False, True):
        sparse, _ = _mlp(p, op_graphs=graphs, dense_capacity=0.0)
        for _ in range(3):  # eager, capture + replay, replay
            for w in sparse.parameters():
                w.grad = None
            xs = [_x(p).requires_grad_(), _x(q).requires_grad_()]
            ys = [sparse(x) for x in xs]
            torch.autograd.backward(ys, dys)
        results[graphs] = [*(x.grad for x in xs), *(w.grad for w in sparse.parameters())]
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
