"""Hugging Face transformers as a client, on the CPU (twell's reference path): a tiny
``LlamaForCausalLM`` with ReLU MLPs through ``sparsify`` — generate with the dynamic and
the static cache (compiled, ``fullgraph=True``), a training step with ``labels=`` and the
L1 term, and a ``save_pretrained``/``from_pretrained`` round trip. The GPU twins of these
tests are in test_gpu_transformers.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from twell.testing import llama  # noqa: E402
from twell.torch import SparseMLP, l0_per_layer, l1_penalty, sparsify  # noqa: E402


def tiny_llama(seed: int = 0, dtype=torch.float32):  # noqa: ANN001, ANN201
    return llama.relu_llama(hidden=64, ffn=256, layers=2, heads=4, kv_heads=2, vocab=97,
                            max_positions=64, seed=seed, dtype=dtype)  # fmt: skip


def _prompt(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(1))


def test_sparsify_replaces_every_mlp_and_keeps_the_logits() -> None:
    model = tiny_llama()
    ids = _prompt()
    with torch.no_grad():
        dense = model(ids).logits
    assert sparsify(model) == 2
    assert all(isinstance(layer.mlp, SparseMLP) for layer in model.model.layers)
    with torch.no_grad():
        sparse = model(ids).logits
    # The reference rounds gate values to bf16 (as TwELL stores them).
    assert float((sparse - dense).norm() / dense.norm()) < 1e-2


def _generate(model, ids, **kwargs):  # noqa: ANN001, ANN202
    return model.generate(ids, max_new_tokens=5, do_sample=False, **kwargs)


def test_generate_with_the_dynamic_and_the_static_cache() -> None:
    model = tiny_llama()
    sparsify(model)
    ids = _prompt()
    dynamic = _generate(model, ids)
    static = _generate(model, ids, cache_implementation="static")
    assert dynamic.shape == (2, 11)
    assert torch.equal(dynamic, static)


def test_generate_with_a_compiled_static_cache_gives_the_eager_tokens() -> None:
    """The static cache compiles the decode step (transformers does it for CUDA; here
    forced on the CPU, with a backend that needs no C++ compiler): fullgraph, so any
    graph break in twell's path fails the test."""
    model = tiny_llama()
    sparsify(model)
    ids = _prompt()
    eager = _generate(model, ids, cache_implementation="static")
    config = transformers.CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = _generate(model, ids, cache_implementation="static", compile_config=config)
    assert torch.equal(compiled, eager)


def test_a_training_step_with_labels_and_the_l1_term() -> None:
    """Loss, L1 term and every parameter's gradient as the dense twin's (whose MLPs
    record the same per-token L1 term, see the fixture), then an AdamW step."""
    model, dense = tiny_llama(), tiny_llama()
    sparsify(model, reduction="per_token")
    model.train()
    dense.train()
    ids = _prompt(2, 12)
    out, ref = model(ids, labels=ids), dense(ids, labels=ids)
    loss, ref_loss = float(out.loss.detach()), float(ref.loss.detach())
    assert abs(loss - ref_loss) < 1e-2 * ref_loss
    dense_l1 = sum(layer.mlp.l1_term for layer in dense.model.layers)
    l1, l1_dense = float(l1_penalty(model).detach()), float(dense_l1.detach())
    assert abs(l1 - l1_dense) < 2e-2 * l1_dense
    (out.loss + 1e-3 * l1_penalty(model)).backward()
    (ref.loss + 1e-3 * dense_l1).backward()
    assert len(l0_per_layer(model)) == 2
    for (name, p), q in zip(model.named_parameters(), dense.parameters(), strict=True):
        assert p.grad is not None, name
        error = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert error < 3e-2, (name, error)
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_training_step_with_gradient_checkpointing() -> None:
    """transformers' gradient checkpointing runs each decoder layer's forward again inside
    the backward pass: the sparsified model's loss and gradients are those of the same
    model without it."""
    runs = []
    for checkpointing in (True, False):
        model = tiny_llama()
        sparsify(model, reduction="per_token")
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids = _prompt(2, 12)
        out = model(ids, labels=ids)
        (out.loss + 1e-3 * l1_penalty(model)).backward()
        runs.append([out.loss.detach(), *(p.grad for p in model.parameters())])
    for a, b in zip(*runs, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.fixture(autouse=True)
def _dense_l1_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a dense LlamaMLP record its per-token L1 term (sum over units, mean over
    tokens) in ``mlp.l1_term`` at each forward, as SparseMLP does in ``mlp.l1``."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    def forward(self, x):  # noqa: ANN001, ANN202
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        self.l1_term = h.abs().sum() / max(1, h.numel() // h.shape[-1])
        return self.down_proj(h)

    monkeypatch.setattr(LlamaMLP, "forward", forward)


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path) -> None:  # noqa: ANN001
    model = tiny_llama()
    sparsify(model)
    ids = _prompt()
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert {k for k in loaded.state_dict()} == {k for k in model.state_dict()}
    assert sparsify(loaded) == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, before, rtol=0, atol=0)


def test_calibrated_llama_is_as_sparse_as_asked() -> None:
    """twell.testing.llama.calibrate: held-out tokens land near the target L0 in every
    layer, and the calibrated model stays a model (sparsify keeps its logits)."""
    model = llama.relu_llama(hidden=128, ffn=512, layers=3, heads=4, kv_heads=2, vocab=200,
                             max_positions=256, dtype=torch.float32)  # fmt: skip
    held_out = llama.random_tokens(model, 4, 64, seed=99)
    assert min(llama.l0_per_layer(model, held_out)) > 100  # random init: about half
    llama.calibrate(model, l0=8, sequences=16, length=64)
    per_layer = llama.l0_per_layer(model, held_out)
    assert all(5 < v < 12 for v in per_layer), per_layer
    with torch.no_grad():
        dense = model(held_out).logits
        sparsify(model)
        sparse = model(held_out).logits
    assert float((sparse - dense).norm() / dense.norm()) < 1e-2


def _bench_models():  # noqa: ANN202 - bench/models.py as a module
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "models.py"
    spec = importlib.util.spec_from_file_location("bench_models", path)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    return models


def test_bench_models_step_decoder_gives_the_greedy_tokens() -> None:
    """bench/models.py's compiled step loop (a static cache, one fullgraph-compiled step
    per token, tokens chosen on the device) gives generate's greedy tokens, twice."""
    models = _bench_models()
    model = tiny_llama()
    sparsify(model)
    ids = _prompt()
    expected = _generate(model, ids, cache_implementation="static")
    decoder = models.StepDecoder(model, ids, 5, backend="aot_eager", mode=None)
    assert torch.equal(decoder.generate(), expected)
    assert torch.equal(decoder.generate(), expected)
    dense = tiny_llama(seed=1)
    other = models.StepDecoder(dense, ids, 5, backend="aot_eager", mode=None)
    times = models.time_decoders({"twell": decoder, "dense": other}, warmup=1, rounds=2)
    assert set(times) == {"twell", "dense"} and min(times.values()) > 0
    # each timed round ran after its own decoder's prefill: both loops end on their tokens
    assert torch.equal(torch.cat([ids, decoder.out], dim=1), expected)
    assert torch.equal(torch.cat([ids, other.out], dim=1),
                       _generate(dense, ids, cache_implementation="static"))  # fmt: skip


def test_bench_models_train_mlp_share_keeps_the_mlp_weights_in_adamw() -> None:
    """bench/models.py's train_mlp_share: the step without MLP work still updates the MLP
    weights (zero gradients: weight decay moves them), alternates with the whole step,
    and leaves the model and the optimizer as they were."""
    models = _bench_models()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    ids = _prompt()
    ran = []

    def step(i: int) -> None:
        ran.append(model.model.layers[0].mlp.forward is torch.zeros_like)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    up = model.model.layers[0].mlp.up_proj.weight
    q = model.model.layers[0].self_attn.q_proj.weight
    share = models.train_mlp_share(model, step, optimizer)["mlp_share"]
    assert 0.0 <= share < 1.0
    assert True in ran and False in ran  # both steps ran, in alternating rounds
    # a warm-up step of each, then rounds of five steps: dense first, then the other first
    assert ran[:17] == [False, True] + [False] * 5 + [True] * 10
    # AdamW updated the MLP weights in every step, the steps without MLP work included
    assert int(optimizer.state[up]["step"]) == int(optimizer.state[q]["step"]) == len(ran)
    assert not optimizer._optimizer_step_pre_hooks
    assert all(layer.mlp.forward is not torch.zeros_like for layer in model.model.layers)
    assert all(p.grad is None for p in model.parameters())


def test_bench_models_decode_steps_alternates_three_decode_loops(monkeypatch) -> None:  # noqa: ANN001
    """bench/models.py's decode_steps: twell's, dense's and a copy of dense without MLP
    work decode in alternating rounds; the record has both models' times, the speedup,
    the MLPs' share of the dense step and the cap it sets; the models are left as they
    were."""
    import argparse

    models = _bench_models()

    class Eager(models.StepDecoder):  # no inductor on the CPU runners
        def __init__(self, model, ids, new_tokens) -> None:  # noqa: ANN001
            super().__init__(model, ids, new_tokens, backend="aot_eager", mode=None)

    monkeypatch.setattr(models, "StepDecoder", Eager)
    model, dense = tiny_llama(), tiny_llama()
    sparsify(model)
    ids = _prompt()
    rec = models.decode_steps(argparse.Namespace(new_tokens=4, prompt=6), model, dense, ids)
    assert rec["steps"] == 3
    assert rec["speedup"] == pytest.approx(rec["t_dense_ms"] / rec["t_twell_ms"])
    assert rec["cap_free_mlps"] == pytest.approx(1.0 / (1.0 - rec["mlp_share"]))
    assert rec["tokens_per_s_twell"] > 0 and rec["greedy_gap"] >= 0
    assert all(layer.mlp.forward is not torch.zeros_like for layer in dense.model.layers)


def test_bench_models_mlp_inputs_in_one_pass() -> None:
    """bench/models.py's mlp_inputs: every MLP's input (or the first ``count``) from one
    forward, in layer order, its hooks removed after."""
    models = _bench_models()
    model = tiny_llama()
    ids = _prompt()
    every = models.mlp_inputs(model, ids)
    assert [x.shape for x in every] == [(2, 6, 64)] * 2
    assert not torch.equal(every[0], every[1])
    first = models.mlp_inputs(model, ids, count=1)
    assert len(first) == 1 and torch.equal(first[0], every[0])
    assert not any(layer.mlp._forward_pre_hooks for layer in model.model.layers)


def test_bench_models_runs_train_ddp_only_under_torchrun(monkeypatch, capsys) -> None:  # noqa: ANN001
    """bench/models.py's train_ddp needs a torchrun job, which runs it alone: asked for
    outside one (or beside another benchmark inside one) the command line is refused
    before any model is built."""
    import sys

    models = _bench_models()
    monkeypatch.setattr(models, "build", lambda args: pytest.fail("built a model"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", ["models.py", "--benchmarks", "train_ddp"])
    with pytest.raises(SystemExit) as refused:
        models.main()
    assert refused.value.code == 2
    assert "train_ddp runs under torchrun, and alone" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["models.py", "--benchmarks", "train_ddp", "prefill"])
    with pytest.raises(SystemExit) as refused:
        models.main()
    assert refused.value.code == 2


def test_bench_models_energy_alternates_rounds_and_gives_joules_per_call(monkeypatch) -> None:  # noqa: ANN001
    """bench/models.py's Energy.joules_per_call: every function warmed once, then rounds
    of ``calls`` calls whose order turns each round; each round's counter difference (mJ)
    goes to the function it timed, and the sum over rounds is divided by the calls."""
    models = _bench_models()
    monkeypatch.setattr(models, "_sync", lambda: None)
    counter = [0]
    seen = []

    def runner(name: str, mj: int):  # noqa: ANN202
        def call(i: int) -> None:
            seen.append((name, i))
            counter[0] += mj

        return call

    energy = models.Energy.__new__(models.Energy)
    energy.handle, energy._read = object(), lambda handle: counter[0]
    joules = energy.joules_per_call({"a": runner("a", 1000), "b": runner("b", 3000)},
                                    calls=2, rounds=2)  # fmt: skip
    assert seen == [("a", 0), ("b", 0), ("a", 0), ("a", 1), ("b", 0), ("b", 1),
                    ("b", 0), ("b", 1), ("a", 0), ("a", 1)]  # fmt: skip
    assert joules == {"a": 1.0, "b": 3.0}
    energy.handle = None
    assert energy.joules_per_call({"a": runner("a", 1)}, calls=1) is None
