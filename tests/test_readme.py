"""What the README promises, checked on the CPU: its code blocks marked
``<!-- readme-test: run -->`` run as written (those of docs/testing.md too), its results
tables are what ``python -m twell results`` makes of the committed records, and the demo says why
it runs on the CPU."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- readme-test: run -->"
BLOCK = re.compile(re.escape(MARK) + r"\s*```python\n(.*?)```", re.DOTALL)


def marked_blocks(path: Path) -> list[str]:
    """The Python code blocks of ``path`` that follow a :data:`MARK` line."""
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def run_block(code: str, where: str) -> dict[str, Any]:
    """Execute ``code`` as a module would be, then call every ``test_*`` it defines."""
    namespace: dict[str, Any] = {"__name__": f"readme_block_{where}"}
    exec(compile(code, where, "exec"), namespace)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()
    return namespace


def blocks() -> list[Any]:
    found = []
    for path in (ROOT / "README.md", ROOT / "docs" / "testing.md"):
        for i, code in enumerate(marked_blocks(path)):
            found.append(pytest.param(code, f"{path.name}:{i}", id=f"{path.name}-{i}"))
    return found


def test_the_readme_marks_its_api_screen_and_fuzzing_example() -> None:
    codes = marked_blocks(ROOT / "README.md")
    assert len(codes) >= 2
    assert any("twell.gate(" in code for code in codes)
    assert any("strategies" in code for code in codes)


@pytest.mark.parametrize(("code", "where"), blocks())
def test_a_marked_block_runs_as_written(
    code: str, where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if "hypothesis" in code:
        pytest.importorskip("hypothesis")
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    run_block(code, where)


# ---------------------------------------------------------------------- results tables
def tables() -> ModuleType:
    """twell.results, the tables' generator (``python -m twell results``)."""
    import twell.results

    return twell.results


def test_the_generator_makes_a_table_for_every_gpu_with_records() -> None:
    t = tables()
    text = t.render()
    for gpu in t.gpus():
        assert f"`bench/results/{gpu}/`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert all(line.count(" | ") == len(t.COLUMNS) - 1 for line in rows), rows
    h200 = t.gpu_table(t.ROOT / "h200")
    assert h200 is not None
    for benchmark in ("model prefill", "model train step", "model decode", "SparseMLP fwd+bwd"):
        assert f"| {benchmark} |" in h200


def test_the_readme_tables_are_the_generator_output() -> None:
    t = tables()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert t.replace_block(readme, t.render()) == readme, (
        "README.md's results tables differ from the records: run "
        "`python -m twell results --write README.md`"
    )


def test_the_generator_reads_a_folder_of_its_own(tmp_path: Path) -> None:
    t = tables()
    folder = tmp_path / "h999"
    folder.mkdir()
    record = {"gpu": "GPU X", "benchmark": "prefill", "mode": "eager", "tokens": 64,
              "batch": 1, "t_twell_ms": 2.0, "t_dense_ms": 3.0, "speedup": 1.5}  # fmt: skip
    (folder / "models.json").write_text('{"records": [' + repr(record).replace("'", '"') + "]}")
    (tmp_path / "empty").mkdir()
    text = t.render(tmp_path)
    assert "**GPU X**" in text
    assert "| model prefill | eager, 64 tokens | 2.00 | 3.00 | 1.50× |" in text
    assert "empty" not in text
    assert t.main(["--root", str(tmp_path), "--gpu", "nothing"]) == 2


def test_the_generator_says_where_to_run_it(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Outside a checkout's root (no bench/results/ there): exit 2 saying so, no
    traceback."""
    assert tables().main(["--root", str(tmp_path / "bench" / "results")]) == 2
    assert "run from a twell checkout's root" in capsys.readouterr().err


def test_the_models_table_orders_several_models_and_names_their_layers(tmp_path: Path) -> None:
    import json

    t = tables()
    folder = tmp_path / "h999"
    folder.mkdir()

    def record(model: str, benchmark: str, tokens: int, **extra: object) -> dict:
        return {"gpu": "GPU X", "model": model, "benchmark": benchmark, "mode": "eager",
                "tokens": tokens, "batch": 1, "t_twell_ms": 2.0, "t_dense_ms": 3.0,
                "speedup": 1.5, **extra}  # fmt: skip

    big, small = "llama-relu-38L-2048x5632", "llama-relu-8L-2048x5632"
    records = [record(small, "decode", 64), record(big, "prefill", 16384),
               record(small, "prefill", 2048, l0_run=29.4, heavy_share_run=0.031),
               {"gpu": "GPU X", "speedup": 1.0}]  # fmt: skip
    report = {"models": {small: {"l0_mean": 37.4}, big: {"l0_mean": 46.7}}, "records": records}
    (folder / "models.json").write_text(json.dumps(report))
    rows = [line for line in t.gpu_table(folder).splitlines() if line.startswith("| model")]
    assert rows[0].startswith("| model prefill | 8 layers, eager, 2048 tokens |")
    assert "L0 29, 3.1% of rows heavy" in rows[0]
    assert rows[1].startswith("| model decode | 8 layers,")
    assert rows[2].startswith("| model prefill | 38 layers, eager, 16384 tokens |")
    assert "Model rows: `llama-relu-8L-2048x5632`, `llama-relu-38L-2048x5632`." in (
        t.gpu_table(folder)
    )


def test_serving_rows_show_the_other_workloads_back_to_back(tmp_path: Path) -> None:
    """``serving.json``'s heavy and paperlike records: one row each (workload, M), back to
    back, per call in the notes, in the table's workload order, and whether dense math
    was decided."""
    import json

    t = tables()
    folder = tmp_path / "h999"
    folder.mkdir()

    def record(workload: str, m: int, timing: str, speedup: float, **extra: object) -> dict:
        return {"gpu": "GPU X", "api": "SparseFFN", "workload": workload, "M": m, "K": 2048,
                "N": 5632, "timing": timing, "t_ms": 1.0, "t_dense_ms": speedup,
                "speedup": speedup, **extra}  # fmt: skip

    records = [record("paperlike", 16384, "back_to_back", 1.7),
               record("heavy=0.02x4", 16384, "per_call", 1.6),
               record("heavy=0.02x4", 16384, "back_to_back", 1.5, dense_path=True),
               record("heavy", 65536, "back_to_back", 1.8),
               record("heavy", 16384, "back_to_back", 1.4)]  # fmt: skip
    (folder / "serving.json").write_text(json.dumps(records))
    rows = [line for line in t.gpu_table(folder).splitlines() if "SparseFFN" in line]
    assert [r.split(" | ")[1] for r in rows] == [
        "heavy 1% ×3, M=16384, back to back", "heavy 1% ×3, M=65536, back to back",
        "heavy 2% ×4, M=16384, back to back", "paperlike, M=16384, back to back",
    ]  # fmt: skip
    assert rows[2].endswith("| 1.50× | per call 1.60×; dense math decided |")


def test_density_records_at_other_batch_sizes_get_rows_of_their_own(tmp_path: Path) -> None:
    """The density sweep is one row at its batch size (per call in the notes, in order
    of p); a density at another M is a row of its own (per call and graph in the notes)."""
    import json

    t = tables()
    folder = tmp_path / "h999"
    folder.mkdir()

    def record(p: str, m: int, timing: str, speedup: float, **extra: object) -> dict:
        return {"gpu": "GPU X", "api": "SparseFFN", "workload": f"density={p}", "M": m,
                "K": 2048, "N": 5632, "timing": timing, "t_ms": 1.0, "t_dense_ms": speedup,
                "speedup": speedup, **extra}  # fmt: skip

    records = [record("0.1", 16384, "back_to_back", 1.01, dense_path=True),
               record("0.001", 16384, "back_to_back", 2.4),
               record("0.1", 16384, "per_call", 1.09), record("0.001", 16384, "per_call", 2.3),
               record("0.1", 2048, "back_to_back", 0.94), record("0.1", 2048, "graph", 0.89),
               record("0.1", 2048, "per_call", 0.93)]  # fmt: skip
    (folder / "serving.json").write_text(json.dumps(records))
    rows = [line for line in t.gpu_table(folder).splitlines() if "SparseFFN" in line]
    assert [r.split(" | ")[1] for r in rows] == [
        "density p = 0.1, M=2048, back to back",
        "density p = 0.001 / 0.1, M=16384, back to back",
    ]  # fmt: skip
    assert rows[0].endswith("| 0.94× | per call 0.93×; CUDA graph 0.89× |")
    assert rows[1].endswith(
        "| 2.40 / 1.01× | per call 2.30 / 1.09×; dense math decided at p ≥ 0.1 |"
    )


def test_decode_rows_go_by_batch_then_mode_and_name_the_step_loop(tmp_path: Path) -> None:
    import json

    t = tables()
    folder = tmp_path / "h999"
    folder.mkdir()

    def record(mode: str, batch: int, **extra: object) -> dict:
        return {"gpu": "GPU X", "model": "m", "benchmark": "decode", "mode": mode,
                "tokens": 64, "batch": batch, "t_twell_ms": 2.0, "t_dense_ms": 3.0,
                "speedup": 1.5, **extra}  # fmt: skip

    steps = {"steps": 63, "ms_per_step_twell": 0.6, "ms_per_step_dense": 0.8,
             "mlp_share": 0.4, "cap_free_mlps": 1.667}  # fmt: skip
    records = [record("eager", 1), record("static_cache", 8), record("compiled_steps", 8, **steps),
               record("compiled_steps", 1, **steps)]  # fmt: skip
    (folder / "models.json").write_text(json.dumps({"records": records}))
    rows = [line for line in t.gpu_table(folder).splitlines() if line.startswith("| model")]
    assert rows[0].startswith("| model decode | compiled step loop, static cache, batch 1, 63 ")
    assert "0.600 ms a step (dense 0.800); MLPs 40% of the dense step, at most 1.67×" in rows[0]
    assert rows[1].startswith("| model decode | generate, dynamic cache, eager, batch 1, 64 new")
    assert rows[2].startswith("| model decode | compiled step loop, static cache, batch 8")
    assert rows[3].startswith("| model decode | generate, static cache, compiled, batch 8")


def test_data_parallel_rows_set_twell_against_dense_with_each_ones_scaling(
    tmp_path: Path,
) -> None:
    import json

    t = tables()
    folder = tmp_path / "h999"
    folder.mkdir()
    ddp = {"gpu": "GPU X", "model": "m", "benchmark": "train_step", "mode": "ddp_eager",
           "tokens": 16384, "batch": 16, "world_size": 2, "t_twell_ms": 100.0,
           "t_dense_ms": 120.0, "speedup": 1.2, "scaling_twell": 0.97,
           "scaling_dense": 0.95}  # fmt: skip
    (folder / "models.json").write_text(json.dumps({"records": [ddp]}))

    def run(strategy: str, variant: str, step_s: float, scaling: float | None = None) -> dict:
        found = {"strategy": strategy, "variant": variant, "steps_done": 300,
                 "step_time_s": step_s, "ranks": [{"step_time_s": {"median": step_s}}]}  # fmt: skip
        return found if scaling is None else {**found, "scaling_efficiency": scaling}

    runs = [run("single", "dense", 0.036), run("ddp", "dense", 0.040, 0.9),
            run("single", "twell", 0.043), run("ddp", "twell", 0.048, 0.89),
            run("fsdp", "twell", 0.081, 0.64)]  # fmt: skip
    (folder / "train_distributed.json").write_text(
        json.dumps({"recipe": {"world_size": 2}, "runs": runs})
    )
    lines = t.gpu_table(folder).splitlines()
    model = next(line for line in lines if line.startswith("| model train step"))
    assert "| eager DDP on 2 GPUs, 16384 tokens (16 × 1024) a GPU | 100 | 120 | 1.20× |" in model
    assert "scaling efficiency twell 0.97, dense 0.95" in model
    small = [line for line in lines if line.startswith("| small model")]
    assert small[0].startswith("| small model, DDP on 2 GPUs | 300 steps | 48.0 | 40.0 | 0.83× |")
    assert "twell: scaling efficiency 0.89, one GPU 43.0 ms" in small[0]
    assert "dense: scaling efficiency 0.90, one GPU 36.0 ms" in small[0]
    assert small[1].startswith(
        "| small model, FSDP2 on 2 GPUs | 300 steps, twell only | 81.0 | — |"
    )


def test_a_model_benchmark_run_replaces_its_own_records_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/models.py's records file: a run keeps other models' records and build
    reports and the file's other keys, stamps old records with their versions, replaces
    a record of the same configuration in place, and refuses another GPU's file."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_models", ROOT / "bench" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    monkeypatch.setattr(models, "gpu_name", lambda: "GPU X")
    monkeypatch.setattr(models, "versions", lambda: {"torch": "new"})
    path = tmp_path / "models.json"
    assert models.load_report(path, "a")["records"] == []
    one = {"model": "b", "benchmark": "prefill", "tokens": 1}
    two = {"model": "a", "benchmark": "prefill", "tokens": 1}
    old = {"gpu": "GPU X", "torch": "old", "model": "b", "calibration": {"l0_mean": 30.0},
           "commands": ["python bench/models.py"], "records": [one, two]}  # fmt: skip
    path.write_text(json.dumps(old))
    report = models.load_report(path, "a")
    assert report["models"] == {"b": {"l0_mean": 30.0}}  # a's build report comes anew
    assert report["commands"] == old["commands"] and report["torch"] == "new"
    assert [r["torch"] for r in report["records"]] == ["old", "old"]
    new = dict(two, t_twell_ms=1.0)
    records = models.replace_record(report["records"], new)
    assert records[1] is new and len(records) == 2  # in place
    other = dict(two, tokens=2)
    assert models.replace_record(records, other)[-1] is other
    path.write_text(json.dumps(dict(old, gpu="GPU Y")))
    with pytest.raises(ValueError, match="GPU Y"):
        models.load_report(path, "a")


# ---------------------------------------------------------------------- the demo
def test_the_demo_says_why_it_runs_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import twell.__main__ as cli
    import twell.kernels.compile

    reason = "CuPy is not installed"
    monkeypatch.setattr(twell.kernels.compile, "unavailable_reason", lambda: reason)
    assert cli.main(["demo", "--tokens", "64"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "NumPy reference, CPU" in out
    assert "do not run here: CuPy is not installed" in out and "twell[cuda13]" in out


# ---------------------------------------------------------------------- no diary
@pytest.mark.parametrize(
    "path",
    [ROOT / "README.md", ROOT / "bench" / "README.md"]
    + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "history.md"),
    ids=lambda p: p.name,
)
def test_the_docs_describe_the_code_not_the_work_history(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # work rounds ("se" "ssion", spelt so that a grep of the tree for it stays empty), the
    # old diary's name, dates
    for pattern in (r"(?i)\bses{2}ions?\b", r"perf-log", r"\b20\d\d-\d\d-\d\d\b"):
        found = re.search(pattern, text)
        assert found is None, f"{path.name}: {found.group(0)!r}"
