"""``python -m twell tune``: measure the thresholds of twell/tuning/ on this GPU and write
its file.

The probes run in an order where each one sees the thresholds the ones before it
measured (the crossover is measured on the routes the decode probes chose); a value a
probe measures is set in its module at once (``decode_units.MAX_ROWS = ...``). The
thresholds of the probes not run keep the values in force (the file this process
loaded, twell.tuning), with the model they were measured on. A probe whose timed
variant gives a wrong result stops the run, and nothing is written.
"""

from __future__ import annotations

import copy
import importlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.tune import (
    crossover,
    decode_gates,
    decode_units,
    flag_rows,
    light_rows,
    row_limit,
    sliced,
    train_crossover,
)
from bench.tune.common import Context, ProbeError
from twell import tuning
from twell.kernels import density
from twell.timing import gpu_name, versions

#: The probes, in the order they run.
PROBES: dict[str, Callable[[Context], dict[str, tuple[Any, dict]]]] = {
    "decode_gates": decode_gates.measure,
    "decode_scan": decode_units.measure_scan,
    "decode_rows": decode_units.measure_rows,
    "light_rows": light_rows.measure,
    "flag_rows": flag_rows.measure,
    "sliced": sliced.measure,
    "row_limit": row_limit.measure,
    "crossover": crossover.measure,
    "heavy_dense": crossover.measure_heavy,
    "train_crossover": train_crossover.measure,
}


def select(only: Sequence[str] | None, quick: bool) -> list[str]:
    """The probes to run, in :data:`PROBES`' order: those named in ``only`` (probes, or
    thresholds: their probes), else :data:`twell.tuning.QUICK` or all of them."""
    if only:
        wanted = {tuning.SPECS[name].probe if name in tuning.SPECS else name for name in only}
    else:
        wanted = set(tuning.QUICK if quick else PROBES)
    unknown = wanted - set(PROBES)
    if unknown:
        raise ValueError(f"unknown probes {sorted(unknown)}; known: {list(PROBES)}")
    return [name for name in PROBES if name in wanted]


def apply(name: str, value: Any) -> Any:
    """Set threshold ``name`` in the module that reads it, for the probes after this one;
    returns the value as the module holds it. ``options.ROW_LIMIT_PERCENT`` is not set
    anywhere: the probes build their blocks with the limit of ``Context.values``."""
    module, attribute = name.split(".")
    kind = tuning.SPECS[name].kind
    held = tuple(tuple(p) for p in value) if kind == "points" else (
        tuple(value) if kind == "interval" else int(value))  # fmt: skip
    if name == "heavy_rows.FLAG_ROWS":
        held = flag_rows.applied(held)
    if module != "options":
        setattr(importlib.import_module(f"twell.kernels.{module}"), attribute, held)
    density.crossover.cache_clear()
    density.train_crossover.cache_clear()
    return held


def default_out(model: str) -> Path:
    """The package's file of a known model, else ``tuning-<model>.json`` here."""
    return tuning.path_of(model) if model in tuning.MODELS else Path(f"tuning-{model}.json")


def tune(
    out: str | None = None, only: Sequence[str] | None = None, quick: bool = False,
    log: Callable[[str], None] = print,
) -> int:  # fmt: skip
    """Run the probes, write the file; 0 on success, 1 when a probe's check failed."""
    gpu = gpu_name()
    model = tuning.model_of(gpu)
    base = tuning.active()
    names = select(only, quick)
    log(f"twell tune on {gpu} ({model}): probes {', '.join(names)}; values in force from "
        f"{base.path}")  # fmt: skip
    ctx = Context(quick, {name: base.value(name) for name in tuning.SPECS}, log)
    measured: dict[str, tuple[Any, dict]] = {}
    began = time.perf_counter()
    for probe in names:
        started = time.perf_counter()
        log(f"== {probe}: {', '.join(tuning.probes()[probe])}")
        try:
            found = PROBES[probe](ctx)
        except ProbeError as error:
            log(f"twell tune: {error}. Nothing written.")
            return 1
        for name, (value, data) in found.items():
            value = json.loads(json.dumps(value))  # tuples as lists, as in the file
            data = json.loads(json.dumps(data, default=float))  # (a device scalar: a float)
            measured[name] = (value, data)
            ctx.values[name] = apply(name, value)
            log(f"   {name} = {value}")
        log(f"   ({time.perf_counter() - started:.0f} s)")
    entries = copy.deepcopy(dict(base.entries))
    for name, (value, data) in measured.items():
        spec = tuning.SPECS[name]
        entries[name] = {"value": value, "meaning": spec.meaning,
                         "probe": f"python -m twell tune --only {spec.probe}",
                         "measured_on": model, "data": data}  # fmt: skip
    result = {"schema": tuning.SCHEMA, "model": model, "gpu": gpu, "versions": versions(),
              "thresholds": {name: entries[name] for name in tuning.SPECS}}  # fmt: skip
    problems = tuning.validate(result, "the measured thresholds")
    if problems:
        log("twell tune: " + "; ".join(problems) + ". Nothing written.")
        return 1
    path = Path(out) if out else default_out(model)
    path.write_text(tuning.dumps(result))
    log(f"\n{'threshold':<38} {'before':>24}  {'now':>24}")
    for name, (value, _) in measured.items():
        before = json.loads(json.dumps(base.value(name)))
        log(f"{name:<38} {_short(before):>24}  {_short(value):>24}")
    log(f"\nwrote {path} ({time.perf_counter() - began:.0f} s of probes)")
    if model not in tuning.MODELS:
        log(f"use it with {tuning.ENVIRONMENT}={path.resolve()}")
    return 0


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else f"{len(value)} points"
