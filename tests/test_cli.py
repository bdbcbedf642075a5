"""python -m twell: demo, check and bench on this machine (the reference path)."""

from __future__ import annotations

import pytest

import twell.__main__ as cli


def test_demo_reports_and_passes_on_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--tokens", "64", "--cpu"]) == 0
    out = capsys.readouterr().out
    for text in ("L0 (active units per token)", "heavy rows", "TwELL packed", "overflow", "PASS"):
        assert text in out


def test_check_prints_a_verdict_for_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--cpu", "--tokens", "5", "--width", "64", "--ffn", "512"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 10 and "FAIL" not in out and "all checks passed" in out


def test_bench_hands_its_options_to_the_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    import twell.benchmark

    seen = []
    monkeypatch.setattr(cli, "gpu_available", lambda: True)
    monkeypatch.setattr(twell.benchmark, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--workloads", "uniform", "--M", "64"]) == 0
    assert seen == [["--workloads", "uniform", "--M", "64"]]


def test_bench_sweep_hands_the_rest_to_the_sweeps(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")  # twell.sweeps times torch's dense block
    import twell.sweeps

    seen = []
    monkeypatch.setattr(cli, "gpu_available", lambda: True)
    monkeypatch.setattr(twell.sweeps, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--sweep", "--M", "1", "64"]) == 0
    assert seen == [["--M", "1", "64"]]


def test_bench_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert cli.main(["bench"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err


def test_other_commands_reject_unknown_options() -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--bogus"])


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--tokens", "0"],
        ["demo", "--tokens", "-3"],
        ["demo", "--tokens", "many"],
        ["check", "--tokens", "0"],
        ["check", "--width", "0"],
        ["check", "--ffn", "100"],
    ],
)
def test_bad_sizes_are_usage_errors_not_tracebacks(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --" in err and "expected" in err and "Traceback" not in err


def test_bench_help_needs_no_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m twell bench") and "--workloads" in out


@pytest.mark.parametrize("densities", [True, False], ids=["with-density", "batch-only"])
def test_sweep_plot_draws_a_panel_per_kind_of_record(tmp_path, densities) -> None:
    """The sweep's PNG has the density panel only where the sweep ran densities (an empty
    panel with an empty legend is what a `--densities`-less run drew before)."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch")  # twell.sweeps times torch's dense block
    from matplotlib.image import imread

    from twell import sweeps

    base = {"gpu": "GPU", "api": "SparseFFN", "K": 2048, "N": 5632}
    records = [{**base, "workload": "uniform", "M": m, "timing": t, "speedup": 1.5}
               for m in (1, 64) for t in ("per_call", "graph")]  # fmt: skip
    if densities:
        records += [{**base, "workload": f"density={p}", "M": 16384, "p": p,
                     "timing": "per_call", "speedup": 1.2} for p in (0.001, 0.1)]  # fmt: skip
    path = tmp_path / "sweep.png"
    sweeps.plot(records, str(path))
    height, width = imread(path).shape[:2]
    assert width > 1.5 * height if densities else width < 1.5 * height
