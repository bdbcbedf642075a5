"""twell.warmup without a GPU: layers on the CPU need no kernels, bad batch sizes are
refused, the command says why it cannot run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from twell import warmup  # noqa: E402
from twell.__main__ import main  # noqa: E402
from twell.kernels.compile import unavailable_reason  # noqa: E402
from twell.torch import SparseMLP  # noqa: E402


def _model() -> torch.nn.Module:
    shapes = ((64, 256), (64, 256), (256, 64))
    return torch.nn.Sequential(SparseMLP(*(torch.nn.Linear(a, b, bias=False) for a, b in shapes)))


def test_layers_of_a_model_are_its_distinct_sparse_shapes() -> None:
    model = torch.nn.Sequential(_model(), _model())
    (layer,) = warmup.layers_of(model)
    assert (layer.k, layer.n, layer.tile, layer.slots, layer.dense_capacity) == (
        64, 256, 256, 32, "auto",
    )  # fmt: skip


def test_a_model_on_the_cpu_plans_nothing_and_says_so() -> None:
    report = warmup.warmup(_model())
    assert (report.layers, report.skipped, report.planned, report.failed) == (0, 1, 0, [])
    assert "1 not on a CUDA device: skipped" in str(report)


@pytest.mark.parametrize(
    ("tokens", "error"),
    [((0,), ValueError), ((1.5,), TypeError), (("a",), TypeError), (1, TypeError),
     ((True,), TypeError)],
)  # fmt: skip
def test_bad_batch_sizes_are_refused_naming_the_argument(tokens: object, error: type) -> None:
    with pytest.raises(error, match="tokens"):
        warmup.warmup(_model(), tokens=tokens)
    with pytest.raises(error, match="training_tokens"):
        warmup.warmup(_model(), training_tokens=tokens)


def test_training_kernels_are_planned_when_the_weights_require_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As SparseMLP runs its training kernels: under autograd, in eval mode too."""
    seen = []
    monkeypatch.setattr(
        warmup, "_calls", lambda layer, tokens, training: seen.append(training) or []
    )
    model = _model().eval()
    layer = warmup.layers_of(model)[0]
    cuda_layer = dataclasses.replace(layer, device=torch.device("cuda", 0))
    monkeypatch.setattr(warmup, "layers_of", lambda m: [cuda_layer])
    monkeypatch.setattr(warmup, "_plan", lambda calls, report, workers: {})
    monkeypatch.setattr(warmup, "_run", lambda calls, report: None)
    monkeypatch.setattr(warmup.kc, "compile_modules", lambda modules, workers: [])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    warmup.warmup(model)
    model.requires_grad_(False)
    warmup.warmup(model)
    warmup.warmup(model, training=True)
    assert seen == [warmup.TRAINING_TOKENS, (), warmup.TRAINING_TOKENS]


@pytest.mark.skipif(unavailable_reason() is None, reason="a GPU is usable here")
def test_the_command_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warmup"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_the_command_reads_k_and_n_from_a_transformers_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    seen = []
    monkeypatch.setattr(
        warmup, "warmup", lambda layers, **kw: seen.extend(layers) or warmup.Report()
    )
    monkeypatch.setattr("twell.kernels.compile.unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    llama = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=512, intermediate_size=1536).save_pretrained(llama)
    assert main(["warmup", "--model", str(llama)]) == 0
    assert (seen[0].k, seen[0].n) == (512, 1536)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config().save_pretrained(gpt2)
    odd = tmp_path / "odd"
    transformers.LlamaConfig(hidden_size=512, intermediate_size=1000).save_pretrained(odd)
    for argv, said in (
        (["--model", str(gpt2)], "no Llama-style config"),
        (["--model", str(tmp_path / "missing")], "no Llama-style config"),
        (["--model", str(odd)], "N=1000"),
        (["--model", str(llama), "--hidden", "1024"], "leave out --hidden"),
    ):
        assert main(["warmup", *argv]) == 2
        assert said in capsys.readouterr().err


def test_planning_records_modules_launches_nothing_and_stays_on_its_thread() -> None:
    import threading

    from twell.kernels import compile as kc
    from twell.kernels import light_rows

    source = light_rows.SOURCE
    params = dict(source.examples[0])
    seen_elsewhere = []
    with kc.planning() as modules:
        kernel = source.kernel("any_function", **params)
        kernel((1,), (32,), ())  # a launch that launches nothing
        kc.launch_after(kernel, (1,), (32,), ())
        assert kernel.kernel.ptr == 0 and kc.planned()
        other = threading.Thread(target=lambda: seen_elsewhere.append(kc.planned()))
        other.start()
        other.join()
        with pytest.raises(RuntimeError, match="already active"):
            with kc.planning():
                pass
    assert seen_elsewhere == [False]
    assert not kc.planned()
    assert modules == {(source.name, tuple(sorted(source.defines(params).items()))): source}


def test_a_planned_training_step_runs_on_the_planning_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training forward and backward are planned on the planning thread itself: a
    backward run by autograd's device thread would be outside the plan and launch its
    kernels for real."""
    import contextlib
    import threading

    from twell import autograd
    from twell.kernels import compile as kc

    seen = []

    def record(name: str, outputs: int):  # noqa: ANN202
        def run(*args: object) -> tuple:
            seen.append((name, kc.planned(), threading.get_ident()))
            return (None,) * outputs

        return run

    monkeypatch.setattr(autograd, "_forward_cuda", record("forward", 7))
    monkeypatch.setattr(autograd, "_backward_cuda", record("backward", 4))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    layer = warmup.layers_of(_model())[0]
    with kc.planning():
        warmup._training(layer, 8, 0.05)
    me = threading.get_ident()
    assert seen == [("forward", True, me), ("backward", True, me)]


def test_calls_are_labelled_apart_and_follow_train_kernels() -> None:
    layer = warmup.layers_of(_model())[0]
    calls = warmup._calls(layer, (1, 64), (512,))
    labels = [what for what, _, _ in calls]
    assert len(set(labels)) == len(labels) == 4  # 2 inference, 2 training capacities
    assert {device for _, device, _ in calls} == {layer.device}
    dense = dataclasses.replace(layer, train_kernels=False)
    assert [what for what, _, _ in warmup._calls(dense, (1, 64), (512,))] == labels[:2]
