"""twell.warmup without a GPU: layers on the CPU need no kernels, bad batch sizes are
refused, the command says why it cannot run."""

from __future__ import annotations

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


def test_a_model_on_the_cpu_plans_nothing() -> None:
    report = warmup.warmup(_model())
    assert (report.layers, report.planned, report.failed) == (0, 0, [])
    assert "0 layer shape(s)" in str(report)


def test_batch_sizes_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="tokens"):
        warmup.warmup(_model(), tokens=(0,))


@pytest.mark.skipif(unavailable_reason() is None, reason="a GPU is usable here")
def test_the_command_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warmup"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


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


def test_a_plan_asks_for_no_register_count_and_caches_no_guess() -> None:
    from twell.kernels import compile as kc
    from twell.kernels import light_rows

    cached = light_rows._registers_allow.cache_info().currsize
    with kc.planning() as modules:
        assert light_rows._wide_warps_per_sm("any_function", 2048, 256, 32, True) > 0
    assert len(modules) == 1
    assert light_rows._registers_allow.cache_info().currsize == cached
