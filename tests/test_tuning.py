"""The measured thresholds as data (twell.tuning): the files' schema, which file a process
takes, the kernel modules reading their values from it, and the ``tune`` command's
command line (the probes themselves need a GPU: bench/tune/)."""

from __future__ import annotations

import ast
import copy
import importlib
import json
import warnings
from pathlib import Path

import pytest

from twell import tuning
from twell.__main__ import main

FILES = sorted(Path(tuning.__file__).parent.glob("*.json"))
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """``tuning.active`` resolved again inside the test (and after it, from the real
    environment); no GPU unless the test says so."""
    monkeypatch.delenv(tuning.ENVIRONMENT, raising=False)
    monkeypatch.setattr(tuning, "_nvml_device_name", lambda: None)
    tuning.active.cache_clear()
    tuning.check_device.cache_clear()
    yield monkeypatch
    tuning.active.cache_clear()
    tuning.check_device.cache_clear()


def test_a_file_per_known_model() -> None:
    assert [f.stem for f in FILES] == sorted(tuning.MODELS)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_every_file_holds_every_threshold_in_range(path: Path) -> None:
    data = json.loads(path.read_text())
    assert tuning.validate(data, path.name) == []
    assert data["model"] == path.stem and tuning.model_of(data["gpu"]) == path.stem
    for name, entry in data["thresholds"].items():
        assert entry["measured_on"] in tuning.MODELS, name
        assert entry["probe"] == f"python -m twell tune --only {tuning.SPECS[name].probe}"
    assert path.read_text() == tuning.dumps(data)  # the layout the tune command writes


def test_loaded_values_have_the_types_the_code_reads() -> None:
    t = tuning.load(tuning.path_of("h100"))
    crossover = t.value("density.CROSSOVER")
    assert isinstance(crossover, tuple) and all(isinstance(p, tuple) for p in crossover)
    assert crossover[0] == (1, 0.2)
    assert t.value("density.HEAVY_DENSE") == (48, 4096)
    assert t.value("decode_units.MAX_ROWS") == 192
    assert t.stale() == ["density.TRAIN_CROSSOVER"]  # measured on an H200: waits for an H100
    h200 = tuning.load(tuning.path_of("h200"))
    assert set(h200.stale()) <= set(tuning.SPECS)  # what still waits for a run on an H200


def test_every_threshold_the_code_reads_is_a_spec_and_every_spec_is_read() -> None:
    """The kernel modules hold the active file's values; ``tuning.value`` is only asked
    for names of SPECS (a scan of the package's source)."""
    read = set()
    for path in (ROOT / "twell").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "value" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "tuning" and node.args
                    and isinstance(node.args[0], ast.Constant)):  # fmt: skip
                read.add(node.args[0].value)
    assert read <= set(tuning.SPECS)
    active = tuning.active()
    for name in tuning.SPECS:
        module, attribute = name.split(".")
        if module == "options":
            continue
        held = getattr(importlib.import_module(f"twell.kernels.{module}"), attribute)
        assert held == active.value(name), name
    from twell.options import LIST_CAPACITY, default_max_row_nnz

    percent = active.value("options.ROW_LIMIT_PERCENT")
    for n in (256, 2048, 5632, 14336, 65536):
        assert default_max_row_nnz(n) == max(16, min(LIST_CAPACITY, n * percent // 100))


def test_the_probes_of_the_specs_are_the_tune_command_s() -> None:
    """bench/tune/run.py (read, not imported: it needs CuPy) runs a probe of every name."""
    tree = ast.parse((ROOT / "bench" / "tune" / "run.py").read_text())
    probes = next(
        [key.value for key in node.value.keys]
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "PROBES"
    )
    assert set(probes) == set(tuning.probes())
    assert set(tuning.QUICK) <= set(probes)


@pytest.mark.parametrize(
    ("name", "model", "closest"),
    [
        ("NVIDIA H100 80GB HBM3", "h100", "h100"),
        ("NVIDIA H100 PCIe", "h100", "h100"),
        ("NVIDIA H100 NVL", "h100", "h100"),
        ("NVIDIA H200", "h200", "h200"),
        ("NVIDIA H200 NVL", "h200", "h200"),
        ("NVIDIA H800", "nvidia_h800", "h100"),
        ("NVIDIA GH200 480GB", "nvidia_gh200_480gb", "h100"),
        ("NVIDIA GH200 144G HBM3e", "nvidia_gh200_144g_hbm3e", "h200"),
        ("NVIDIA B200", "nvidia_b200", "h100"),
        ("NVIDIA H1000", "nvidia_h1000", "h100"),
    ],
)
def test_device_names_map_to_models(name: str, model: str, closest: str) -> None:
    assert tuning.model_of(name) == model
    assert tuning.closest_model(name) == closest


def test_without_a_gpu_the_h100_file_silently(fresh: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.active().model == "h100"


def test_a_known_gpu_takes_its_own_file(fresh: pytest.MonkeyPatch) -> None:
    fresh.setattr(tuning, "_nvml_device_name", lambda: "NVIDIA H200")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.active().model == "h200"
        tuning.check_device("NVIDIA H200")  # the same model: no warning
    with pytest.warns(tuning.TuningWarning, match="TWELL_TUNING=h100"):
        tuning.check_device("NVIDIA H100 80GB HBM3")


def test_an_unknown_gpu_warns_once_naming_the_tune_command(fresh: pytest.MonkeyPatch) -> None:
    fresh.setattr(tuning, "_nvml_device_name", lambda: "NVIDIA B200")
    with pytest.warns(tuning.TuningWarning, match="python -m twell tune"):
        assert tuning.active().model == "h100"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.value("decode_units.MAX_ROWS") == 192  # cached: no second warning
        tuning.check_device("NVIDIA B200")


def test_the_environment_names_a_model_or_a_file(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fresh.setenv(tuning.ENVIRONMENT, "h200")
    assert tuning.active().model == "h200"
    data = json.loads(tuning.path_of("h100").read_text())
    data["model"], data["gpu"] = "mine", "NVIDIA Something"
    data["thresholds"]["decode_units.MAX_ROWS"]["value"] = 128
    custom = tmp_path / "mine.json"
    custom.write_text(tuning.dumps(data))
    fresh.setenv(tuning.ENVIRONMENT, str(custom))
    tuning.active.cache_clear()
    assert tuning.value("decode_units.MAX_ROWS") == 128
    assert tuning.active().path == str(custom)
    data["thresholds"].pop("heavy_rows.FLAG_ROWS")
    custom.write_text(json.dumps(data))
    tuning.active.cache_clear()
    with pytest.raises(ValueError, match="heavy_rows.FLAG_ROWS is missing"):
        tuning.active()


def _broken(**changes: object) -> list[str]:
    data = json.loads(tuning.path_of("h100").read_text())
    for name, value in changes.items():
        data["thresholds"][name.replace("__", ".")]["value"] = value
    return tuning.validate(data)


def test_validation_names_what_is_wrong() -> None:
    assert _broken() == []
    assert "MAX_ROWS" in _broken(decode_units__MAX_ROWS=257)[0]
    assert "MAX_ROWS" in _broken(decode_units__MAX_ROWS=True)[0]
    assert "multiple of 128" in _broken(heavy_rows__FLAG_ROWS=1000)[0]
    assert "HEAVY_DENSE" in _broken(density__HEAVY_DENSE=[4096, 48])[0]
    assert "CROSSOVER" in _broken(density__CROSSOVER=[[4, 0.1], [1, 0.2]])[0]
    assert "CROSSOVER" in _broken(density__CROSSOVER=[[1, 1.5]])[0]
    assert "CROSSOVER" in _broken(density__CROSSOVER=[])[0]
    data = json.loads(tuning.path_of("h100").read_text())
    extra = copy.deepcopy(data)
    extra["thresholds"]["pipeline.SOMETHING"] = {"value": 1}
    assert "not a threshold" in tuning.validate(extra)[0]
    del data["thresholds"]["density.CROSSOVER"]["probe"]
    assert "no 'probe'" in tuning.validate(data)[0]
    assert tuning.validate([]) and tuning.validate({"thresholds": {}})


def test_the_tune_command_lists_its_probes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--list"]) == 0
    out = capsys.readouterr().out
    for probe, names in tuning.probes().items():
        assert probe in out and all(name in out for name in names)


def test_the_tune_command_without_a_gpu_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import twell.__main__ as cli

    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    assert main(["tune", "--quick", "--out", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "Hopper GPU" in err and "Traceback" not in err


def test_the_tune_command_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--only", "crossover", "no_such_probe"])
    assert exit_.value.code == 2
    assert "no_such_probe" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--help"])
    assert exit_.value.code == 0


def test_no_visible_device_means_no_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert tuning._nvml_device_name() is None
