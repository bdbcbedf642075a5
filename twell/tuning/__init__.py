"""Measured thresholds, one JSON file per GPU model.

The kernels switch between routes at thresholds measured on a GPU (where the sparse path
stops paying, which decode kernel takes how many tokens, ...). Those numbers are data:
``h100.json``, ``h200.json`` beside this file, one entry per threshold, each with its
value, a one-line meaning, the command (probe) that measures it, the model it was
measured on (``measured_on``), and the measurements behind it where recorded (``data``).
:data:`SPECS` lists every threshold the code reads, with its type, its range and its
probe; every file holds all of them (tests/test_tuning.py checks that).

Which file a process uses is decided once, when the kernels are first imported:

1. ``TWELL_TUNING`` in the environment: the path of a JSON file, or a model name
   (``h200``) for one of the files here;
2. else the first visible GPU's name, read through NVML (no CUDA context is created):
   an H100 (any form factor) takes ``h100.json``, an H200 ``h200.json``; a GPU of
   another model takes the closest known file (:data:`CLOSEST`, else the H100's) and
   warns once, naming the command that tunes it (:data:`TUNE_COMMAND`);
3. no GPU visible (a CPU-only machine: the NumPy reference, the CPU tests): the H100's,
   silently.

The kernel modules copy their values into module constants at import
(``decode_units.MAX_ROWS = tuning.value("decode_units.MAX_ROWS")``), so a call reads a
module global, as before, and nothing here runs per call. One process uses one file: a
block prepared on a GPU of another model than the one the file is for warns once
(:func:`check_device`).

``python -m twell tune`` (bench/tune/, from a source checkout) measures them again on the
current GPU and writes such a file.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The environment variable that names the file to use (a path, or a model of MODELS).
ENVIRONMENT = "TWELL_TUNING"
#: The models with a file here, and the one used without a GPU or for an unknown model.
MODELS = ("h100", "h200")
DEFAULT_MODEL = "h100"
#: Models without a file of their own, by a pattern of their lower-case device name, and
#: the known model closest to them (memory bandwidth first: most thresholds are bytes).
CLOSEST = ((r"gh200.*(144|hbm3e)", "h200"), (r"gh200|h800|h100", "h100"))
#: The command that measures the thresholds on the current GPU (from a checkout's root).
TUNE_COMMAND = "PYTHONPATH=. python -m twell tune"
#: The version of the file layout this module reads.
SCHEMA = 1
_HERE = Path(__file__).resolve().parent


class TuningWarning(UserWarning):
    """The thresholds in use were measured on another GPU model than this one."""


@dataclass(frozen=True)
class Spec:
    """What a threshold is: its type, its range, the probe that measures it.

    Attributes:
        kind: ``"int"``; ``"interval"`` (two ints, ``low <= high``); or ``"points"``
            (``(M, fraction)`` pairs, M ascending, each fraction in ``(0, high]``).
        low, high: the range of the value (of each int; of M for ``"points"``, whose
            fractions lie in ``(0, 1]``).
        probe: the probe of bench/tune/ that measures it (``--only`` takes this name).
        meaning: one line on what the value decides.
        multiple: the value must be a multiple of this (ints).
    """

    kind: str
    low: int
    high: int
    probe: str
    meaning: str
    multiple: int = 1


#: Every threshold the code reads, by ``module.CONSTANT`` (the module that reads it).
SPECS: dict[str, Spec] = {
    "density.CROSSOVER": Spec(
        "points", 1, 1 << 20, "crossover",
        "(M, mean active units per row as a fraction of N) at which the default sparse "
        "route and dense math take the same time at K=2048, N=5632; linear in log2(M) "
        "between points, constant past the ends",
    ),
    "density.TRAIN_CROSSOVER": Spec(
        "points", 1, 1 << 20, "train_crossover",
        "(M, mean active units per token as a fraction of N) at which a SparseMLP's "
        "forward + backward on the training ops and on dense torch math take the same GPU "
        "time at K=2048, N=5632; linear in log2(M) between points, constant past the ends",
    ),
    "density.HEAVY_DENSE": Spec(
        "interval", 0, 1 << 20, "heavy_dense",
        "batch sizes [low, high) at which one heavy row makes dense math pay for the batch",
    ),
    "options.ROW_LIMIT_PERCENT": Spec(
        "int", 1, 100, "row_limit",
        "default max_row_nnz, in percent of N: a token with more active units takes the "
        "dense path (at least 16, at most options.LIST_CAPACITY)",
    ),
    "decode_units.MAX_ROWS": Spec(
        "int", 0, 256, "decode_rows",
        "most tokens of an inference call of the fused path that take the by-unit decode "
        "route (decode_units_*.cu) instead of the per-token kernels",
    ),
    "decode_units.MMA_GATE_TOKENS": Spec(
        "int", 0, 64, "decode_gates",
        "most tokens whose by-unit gate runs on mma.sync in the gate/up kernel",
    ),
    "decode_units.WGMMA_TOKENS": Spec(
        "int", 0, 64, "decode_gates",
        "most tokens whose by-unit gate runs on the TMA/wgmma kernel (above MMA_GATE_TOKENS; "
        "more: a cuBLAS gate GEMM)",
    ),
    "decode_units.SCAN_TOKENS": Spec(
        "int", 0, 256, "decode_scan",
        "most tokens whose by-unit down projection runs by a scan (one CTA per token and "
        "32 columns) rather than by lists of token groups",
    ),
    "decode_units.SCAN_WIDE_UNITS": Spec(
        "int", 0, 65536, "decode_scan",
        "mean kept units per token above which a scan CTA takes 128 threads at any token "
        "count (else 128 up to 8 tokens, 64 above)",
    ),
    "light_rows_decode.DECODE_ROWS_BELOW": Spec(
        "int", 0, 4096, "light_rows",
        "most tokens whose light rows from a pre-activation run in the cluster kernel "
        "(light_rows_decode.cu) instead of light_rows.cu's",
    ),
    "light_rows_sliced.WEIGHT_BYTES": Spec(
        "int", 0, 1 << 40, "sliced",
        "bytes of gathered weights (w_up and w_down, gated) from which the fused path "
        "reads its light rows by 256-column slices",
    ),
    "light_rows_sliced.MIN_ROWS": Spec(
        "int", 1, 1 << 31, "sliced",
        "fewest tokens of a call that reads its light rows by slices (with WEIGHT_BYTES)",
    ),
    "heavy_rows.FLAG_ROWS": Spec(
        "int", 128, 1024, "flag_rows",
        "most tokens of an inference call whose heavy-row kernels compact the row flags "
        "themselves (one launch less; also their shared-memory capacity)",
        multiple=128,
    ),
}  # fmt: skip


#: The probes ``python -m twell tune --quick`` runs: the thresholds that matter most (the
#: crossover, and which kernels take decode and small batches).
QUICK = ("decode_gates", "decode_rows", "crossover")


def probes() -> dict[str, list[str]]:
    """The probes of bench/tune/ and the thresholds each one measures."""
    out: dict[str, list[str]] = {}
    for name, spec in SPECS.items():
        out.setdefault(spec.probe, []).append(name)
    return out


@dataclass(frozen=True)
class Tuning:
    """The thresholds of one file.

    Attributes:
        model: the model the file is for (``h100``), or the file's stem.
        gpu: the device name the file was written for.
        path: where it was read from.
        entries: the ``thresholds`` object of the file, by name.
    """

    model: str
    gpu: str
    path: str
    entries: Mapping[str, Mapping[str, Any]]

    def value(self, name: str) -> Any:
        """The value of threshold ``name`` (a key of :data:`SPECS`): an int, a pair of
        ints (``"interval"``) or a tuple of ``(M, fraction)`` pairs (``"points"``)."""
        value = self.entries[name]["value"]
        kind = SPECS[name].kind
        if kind == "points":
            return tuple((int(m), float(f)) for m, f in value)
        if kind == "interval":
            return (int(value[0]), int(value[1]))
        return int(value)

    def stale(self) -> list[str]:
        """The thresholds of this file measured on another model than the file's."""
        return [k for k, e in self.entries.items() if e.get("measured_on") != self.model]


def _check_value(name: str, spec: Spec, value: Any) -> str | None:
    """Why ``value`` is not a valid value of ``spec`` (None: it is)."""

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and spec.low <= v <= spec.high

    if spec.kind == "int":
        if not integer(value) or value % spec.multiple:
            step = f", a multiple of {spec.multiple}" if spec.multiple > 1 else ""
            return f"{name}: expected an int in [{spec.low}, {spec.high}]{step}, got {value!r}"
    elif spec.kind == "interval":
        if not (isinstance(value, list) and len(value) == 2 and all(map(integer, value))
                and value[0] <= value[1]):  # fmt: skip
            return f"{name}: expected [low, high], ints in [{spec.low}, {spec.high}], got {value!r}"
    elif spec.kind == "points":
        pairs = isinstance(value, list) and len(value) >= 1 and all(
            isinstance(p, list) and len(p) == 2 and integer(p[0])
            and isinstance(p[1], (int, float)) and not isinstance(p[1], bool)
            and math.isfinite(p[1]) and 0 < p[1] <= 1
            for p in value
        )  # fmt: skip
        if not pairs or any(a[0] >= b[0] for a, b in zip(value, value[1:], strict=False)):
            return (f"{name}: expected [[M, fraction], ...], M ascending in [{spec.low}, "
                    f"{spec.high}], fractions in (0, 1], got {value!r}")  # fmt: skip
    return None


def validate(data: Any, where: str = "tuning") -> list[str]:
    """The problems of a tuning file's parsed JSON (empty: valid): every threshold of
    :data:`SPECS` present with a value in range, a meaning, a probe and ``measured_on``;
    no threshold the code does not read."""
    if not isinstance(data, dict) or not isinstance(data.get("thresholds"), dict):
        return [f"{where}: expected an object with a 'thresholds' object"]
    problems = []
    if data.get("schema") != SCHEMA:
        problems.append(f"{where}: expected schema {SCHEMA}, got {data.get('schema')!r}")
    if not isinstance(data.get("gpu"), str) or not isinstance(data.get("model"), str):
        problems.append(f"{where}: expected 'gpu' and 'model' strings")
    entries = data["thresholds"]
    for name in sorted(set(entries) - set(SPECS)):
        problems.append(f"{where}: {name} is not a threshold twell reads")
    for name, spec in SPECS.items():
        entry = entries.get(name)
        if not isinstance(entry, dict) or "value" not in entry:
            problems.append(f"{where}: {name} is missing")
            continue
        for field in ("meaning", "probe", "measured_on"):
            if not isinstance(entry.get(field), str) or not entry[field]:
                problems.append(f"{where}: {name} has no {field!r}")
        problem = _check_value(name, spec, entry["value"])
        if problem:
            problems.append(f"{where}: {problem}")
    return problems


def load(path: str | os.PathLike) -> Tuning:
    """Read and check a tuning file.

    Raises:
        ValueError: the file does not hold every threshold with a valid value (the
            message names each problem and the file).
    """
    with open(path) as f:
        data = json.load(f)
    problems = validate(data, str(path))
    if problems:
        raise ValueError("invalid tuning file:\n  " + "\n  ".join(problems))
    return Tuning(data["model"], data["gpu"], str(path), data["thresholds"])


def model_of(device_name: str) -> str:
    """The model of a device name: ``h100`` and ``h200`` for those GPUs in any form factor
    ("NVIDIA H100 80GB HBM3", "NVIDIA H200 NVL"), else the name in lower case with every
    run of other characters as one ``_`` ("NVIDIA GH200 480GB" → ``nvidia_gh200_480gb``)."""
    low = device_name.lower()
    for known in MODELS:
        if re.search(rf"(?<![a-z0-9]){known}(?![0-9])", low):
            return known
    return re.sub(r"[^a-z0-9]+", "_", low).strip("_") or "unknown"


def closest_model(device_name: str) -> str:
    """The known model whose file a device uses: its own, else :data:`CLOSEST`'s, else
    :data:`DEFAULT_MODEL`."""
    model = model_of(device_name)
    if model in MODELS:
        return model
    low = device_name.lower()
    return next((known for pattern, known in CLOSEST if re.search(pattern, low)), DEFAULT_MODEL)


def path_of(model: str) -> Path:
    """The file of a known model (``h100`` → ``.../twell/tuning/h100.json``)."""
    return _HERE / f"{model}.json"


def _nvml_device_name() -> str | None:
    """The name of the first GPU CUDA sees (``CUDA_VISIBLE_DEVICES``: its first entry, an
    index or a UUID), read through NVML: no CUDA context, safe before a fork. None where
    NVML or a GPU is missing."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = None if visible is None else visible.split(",")[0].strip()
    if first is not None and (first == "" or first.startswith("-")):
        return None  # no device visible
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):  # no driver, or one without NVML's v2 entry points
        return None
    try:
        handle = ctypes.c_void_p()
        if first is not None and first.startswith("GPU-"):
            status = nvml.nvmlDeviceGetHandleByUUID(first.encode(), ctypes.byref(handle))
        else:
            index = int(first) if first is not None and first.isdigit() else 0
            status = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle))
        if status != 0:
            return None
        name = ctypes.create_string_buffer(96)
        if nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0:
            return None
        return name.value.decode(errors="replace")
    except AttributeError:
        return None
    finally:
        nvml.nvmlShutdown()


def _warn(message: str) -> None:
    warnings.warn(message, TuningWarning, stacklevel=3)


@functools.cache
def active() -> Tuning:
    """The thresholds this process uses (chosen once; see the module's docstring)."""
    chosen = os.environ.get(ENVIRONMENT, "").strip()
    if chosen:
        return load(path_of(chosen) if chosen in MODELS else chosen)
    name = _nvml_device_name()
    if name is None:
        return load(path_of(DEFAULT_MODEL))
    model = closest_model(name)
    if model_of(name) != model:
        _warn(
            f"twell has no thresholds measured on a {name}: using the {model.upper()}'s. "
            f"Run `{TUNE_COMMAND}` from a twell checkout to measure them (a few minutes), "
            f"then point {ENVIRONMENT} at the file it writes."
        )
    return load(path_of(model))


def value(name: str) -> Any:
    """The value of threshold ``name`` (a key of :data:`SPECS`) in the :func:`active` file."""
    return active().value(name)


@functools.cache
def check_device(device_name: str) -> None:
    """Warn once per device model if the active thresholds are those of another model
    (a process on several GPU models, or a device order NVML and CUDA disagree on)."""
    tuning = active()
    if os.environ.get(ENVIRONMENT, "").strip() or tuning.model not in MODELS:
        return  # chosen by the user
    model = closest_model(device_name)
    if model != tuning.model:
        _warn(
            f"twell uses the {tuning.model.upper()}'s thresholds (chosen for the first visible "
            f"GPU) on a {device_name}; set {ENVIRONMENT}={model} to use its own."
        )


def dumps(data: Any) -> str:
    """A tuning file's JSON text: an object per line of nesting, lists of numbers (and
    lists of pairs) on one line."""

    def flat(v: Any) -> bool:
        return not isinstance(v, (dict, list)) or (
            isinstance(v, list) and all(not isinstance(x, (dict, list)) or (
                isinstance(x, list) and all(not isinstance(y, (dict, list)) for y in x))
                for x in v)
        )  # fmt: skip

    def out(v: Any, indent: int) -> str:
        pad, close = " " * (indent + 2), "\n" + " " * indent
        if isinstance(v, dict) and v:
            items = [f"{pad}{json.dumps(k)}: {out(x, indent + 2)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + close + "}"
        if isinstance(v, list) and not flat(v):
            return "[\n" + ",\n".join(pad + out(x, indent + 2) for x in v) + close + "]"
        return json.dumps(v, ensure_ascii=False)

    return out(data, 0) + "\n"
