"""A model's kernels compiled before its first call.

A fresh process compiles each kernel source the first time a call needs it (NVRTC:
0.3–3 s per source and configuration), one after another as the calls come, so the
first ``generate`` or training step of a model waits for all of them in a row.
:func:`warmup` compiles them all at once instead, in three steps:

1. **plan**: it runs the calls the model's layer shapes will see — inference at each
   batch size of ``tokens``, through the sparse path and through the dense one the
   density switch may choose, and with ``training`` a forward and backward at each
   training size, with and without a dense capacity — inside
   :func:`twell.kernels.compile.planning`, on stand-in layers with weights of their own,
   each call on a thread of its own: twell's kernels are recorded, not compiled or
   launched (the CuPy kernels of twell's host code compile as they run, in parallel; a
   training step calls the ops' implementations on that thread, not through autograd,
   whose backward would run on a thread outside the plan);
2. **compile**: it builds the recorded modules on a thread per CPU core (NVRTC releases
   the GIL), into CuPy's disk cache (``CUPY_CACHE_DIR``) as well, so that a later
   process only loads them;
3. **run**: it makes the same calls for real, once: a kernel the plan missed (none on
   the paths above) compiles here, and each kernel is loaded.

Nothing the stand-ins build outlives the call. The kernels depend on the layer's shape
and options (K, N, tile, slots), not on the weights' values, so a model whose layers
are on the GPU can be warmed up before its checkpoint is loaded.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from twell import inference
from twell.kernels import compile as kc
from twell.torch import SparseMLP

#: Batch sizes (tokens) planned for inference: one on each side of every threshold the
#: routes are chosen by (decode: up to a few tokens, the by-unit route up to about 1024,
#: then the row routes; twell.tuning holds the thresholds).
INFERENCE_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
#: Batch sizes planned for training (forward and backward).
TRAINING_TOKENS = (1024, 16384)
#: The dense capacity planned beside 0 when a layer's is ``"auto"``.
AUTO_CAPACITY = 0.05


@dataclasses.dataclass(frozen=True)
class Layer:
    """What decides a layer's kernels: its shape, dtype, device and options."""

    k: int
    n: int
    dtype: torch.dtype
    device: torch.device
    tile: int
    slots: int
    dense_capacity: float | str
    reduction: str
    train_kernels: bool = True


@dataclasses.dataclass
class Report:
    """What :func:`warmup` did: layer shapes (and those skipped, not on a CUDA device),
    modules planned and compiled, seconds per step, the calls or modules that failed
    (``(what, error)``), and the calls whose plan stopped early (running on garbage, its
    host code raised: the rest of its kernels compiled in the run step)."""

    layers: int = 0
    skipped: int = 0
    planned: int = 0
    compiled: int = 0
    plan_s: float = 0.0
    compile_s: float = 0.0
    run_s: float = 0.0
    failed: list[tuple[str, BaseException]] = dataclasses.field(default_factory=list)
    unplanned: list[tuple[str, BaseException]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        skipped = f" ({self.skipped} not on a CUDA device: skipped)" if self.skipped else ""
        text = (
            f"{self.layers} layer shape(s){skipped}: {self.planned} kernel module(s) planned, "
            f"{self.compiled} compiled here; plan {self.plan_s:.2f} s, compile "
            f"{self.compile_s:.2f} s, first calls {self.run_s:.2f} s"
        )
        for label, errors in (("failed", self.failed), ("plan stopped", self.unplanned)):
            for what, error in errors:
                text += f"\n  {label}: {what}: {type(error).__name__}: {error}"
        return text


def layers_of(model: nn.Module) -> list[Layer]:
    """The distinct :class:`Layer` s of the :class:`twell.torch.SparseMLP` s in ``model``."""
    found: dict[Layer, None] = {}
    for module in model.modules():
        if isinstance(module, SparseMLP):
            w = module.gate_proj.weight
            o = module.options
            capacity = "auto" if o.auto_capacity else o.dense_capacity
            found[Layer(w.shape[1], w.shape[0], w.dtype, w.device, o.tile, o.slots,
                        capacity, module.reduction, module.train_kernels)] = None  # fmt: skip
    return list(found)


def warmup(
    model: nn.Module | Iterable[Layer],
    *,
    tokens: Sequence[int] = INFERENCE_TOKENS,
    training: bool | None = None,
    training_tokens: Sequence[int] = TRAINING_TOKENS,
    workers: int | None = None,
) -> Report:
    """Compile the kernels that ``model``'s sparse layers (or the given :class:`Layer` s)
    need, in parallel, before their first call (module docstring).

    Args:
        model: a model with :class:`twell.torch.SparseMLP` layers (after
            :func:`twell.torch.sparsify`), or layer descriptions.
        tokens: inference batch sizes (tokens per call) to plan for.
        training: plan the training forward and backward too (None: when a sparse
            layer's weights require gradients, which is when ``SparseMLP`` runs its
            training kernels for a forward under autograd, train or eval mode alike;
            layer descriptions: no).
        training_tokens: training batch sizes (tokens per step and layer).
        workers: compile threads (default: one per CPU core).

    Returns:
        A :class:`Report`. Layers that are not on a CUDA device (CPU, ``meta``) need or
        get no kernels: they are counted as skipped. The layers' weights may hold
        anything: move the model to the GPU, warm up, then load its checkpoint.

    Raises:
        TypeError: ``tokens`` or ``training_tokens`` is not a sequence of integers.
        ValueError: a batch size below 1.
    """
    tokens, training_tokens = _sizes("tokens", tokens), _sizes("training_tokens", training_tokens)
    if isinstance(model, nn.Module):
        layers = layers_of(model)
        if training is None:
            training = any(
                p.requires_grad for m in model.modules()
                if isinstance(m, SparseMLP) and m.train_kernels for p in m.parameters()
            )  # fmt: skip
    else:
        layers = list(model)
    on_gpu = [layer for layer in layers if layer.device.type == "cuda"]
    report = Report(layers=len(on_gpu), skipped=len(layers) - len(on_gpu))
    layers = on_gpu
    if not layers:
        return report
    calls = [
        call
        for layer in layers
        for call in _calls(layer, tokens, training_tokens if training else ())
    ]
    start = time.perf_counter()
    by_device = _plan(calls, report, workers)
    report.planned = sum(len(modules) for modules in by_device.values())
    planned = time.perf_counter()
    before = len(kc._modules)
    for device, modules in by_device.items():
        _compile(device, modules, workers, report)
    report.compiled = len(kc._modules) - before
    compiled = time.perf_counter()
    _run(calls, report)
    for layer in layers:
        torch.cuda.synchronize(layer.device)
    report.plan_s, report.compile_s = planned - start, compiled - planned
    report.run_s = time.perf_counter() - compiled
    return report


def _sizes(name: str, sizes: Sequence[int]) -> tuple[int, ...]:
    """Batch sizes checked: a sequence of integers >= 1."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"{name}: expected a sequence of batch sizes, got {sizes!r}")
    for m in sizes:
        if isinstance(m, bool) or not isinstance(m, numbers.Integral):
            raise TypeError(f"{name}: expected integer batch sizes, got {m!r}")
    if any(m < 1 for m in sizes):
        raise ValueError(f"{name}: expected batch sizes >= 1, got {list(sizes)}")
    return tuple(int(m) for m in sizes)


def _plan(calls: list[tuple[str, Any, Any]], report: Report, workers: int | None) -> dict:
    """The modules the calls need, by device, each call planned on a thread of its own
    (the CuPy kernels their host code uses compile as it runs: in parallel, then)."""
    import concurrent.futures

    def plan(call: Any) -> dict:
        with kc.planning() as modules:
            call()
        return modules

    by_device: dict[Any, dict] = {}
    workers = workers or kc.WORKERS
    with concurrent.futures.ThreadPoolExecutor(max(1, workers), "twell-plan") as pool:
        futures = {pool.submit(plan, call): (what, device) for what, device, call in calls}
        for future in concurrent.futures.as_completed(futures):
            what, device = futures[future]
            error = future.exception()
            if error is None:
                by_device.setdefault(device, {}).update(future.result())
            else:  # the call's later kernels compile when it runs
                report.unplanned.append((what, error))
    return by_device


def _compile(device: torch.device, modules: dict, workers: int | None, report: Report) -> None:
    """The planned modules of one device, built on that device."""
    import cupy

    try:
        with cupy.cuda.Device(device.index if device.index is not None else 0):
            failed = kc.compile_modules(modules, workers)
    except Exception as error:  # noqa: BLE001 - e.g. not a Hopper GPU: the run says more
        failed = [(("every module", ()), error)]
    for key, error in failed:
        report.failed.append((f"compile on {device}: {key[0]} {dict(key[1])}", error))


def _run(calls: list[tuple[str, Any, Any]], report: Report) -> None:
    for what, _, call in calls:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - reported
            report.failed.append((what, error))


def _calls(layer: Layer, tokens: Sequence[int], training_tokens: Sequence[int]) -> list:
    """``(what, device, call)``: each call builds its stand-in layer, runs it, and drops
    what it built."""
    where = f"K={layer.k} N={layer.n} on {layer.device}"
    calls: list[tuple[str, Any, Any]] = [
        (f"inference {where} M={m}", layer.device, lambda m=m: _inference(layer, m)) for m in tokens
    ]
    if not layer.train_kernels:  # its training forwards run dense torch math
        return calls
    capacities = (0.0, AUTO_CAPACITY) if layer.dense_capacity == "auto" else (None,)
    calls += [
        (f"training {where} M={m} capacity={layer.dense_capacity if c is None else c}",
         layer.device, lambda m=m, c=c: _training(layer, m, c))
        for m in training_tokens
        for c in capacities
    ]  # fmt: skip
    return calls


def _stand_in(layer: Layer, dense_capacity: float | str | None = None) -> SparseMLP:
    def linear(rows: int, cols: int) -> nn.Linear:
        lin = nn.Linear(cols, rows, bias=False, device=layer.device, dtype=layer.dtype)
        nn.init.normal_(lin.weight, std=cols**-0.5)
        return lin

    capacity = layer.dense_capacity if dense_capacity is None else dense_capacity
    return SparseMLP(
        linear(layer.n, layer.k), linear(layer.n, layer.k), linear(layer.k, layer.n),
        tile=layer.tile, slots=layer.slots, dense_capacity=capacity,
        reduction=layer.reduction, op_graphs=False,
    )  # fmt: skip


def _inference(layer: Layer, m: int) -> None:
    """One call through the sparse path, one through the dense path."""
    mlp = _stand_in(layer)
    x = torch.randn(m, layer.k, device=layer.device, dtype=layer.dtype)
    try:
        with torch.no_grad(), torch.cuda.device(layer.device):
            mlp(x)
            density = mlp.prepared().prepared.density
            if density.enabled:
                density.estimate = float(layer.n)  # the switch's dense path
                mlp(x)
    finally:
        inference.forget(*mlp._weights())


def _training(layer: Layer, m: int, capacity: float | None) -> None:
    """One training forward and backward with the L1 term, through the training ops'
    CUDA implementations called on this thread: autograd would run the backward on its
    own device thread, outside the plan, and launch its kernels for real on buffers the
    planned forward never wrote."""
    from twell.autograd import TrainSettings, _backward_cuda, _forward_cuda

    mlp = _stand_in(layer, capacity)  # a fixed capacity (_calls plans "auto" as two)
    settings = TrainSettings.of(mlp.options, layer.reduction).launch_args()
    weights = mlp._weights()
    with torch.no_grad(), torch.cuda.device(layer.device):
        x = torch.randn(m, layer.k, device=layer.device, dtype=layer.dtype)
        dy = torch.randn(m, layer.k, device=layer.device, dtype=layer.dtype)
        dl1 = torch.ones((), device=layer.device, dtype=torch.float32)
        _, _, *saved = _forward_cuda(x, *weights, *settings)
        _backward_cuda(dy, dl1, x, *weights, *saved, *settings)
