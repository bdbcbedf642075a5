"""Whole models, the way the paper reports them: a transformers ``LlamaForCausalLM`` with
ReLU MLPs at the paper's shape, its MLPs calibrated to the paper's sparsity, through
``twell.torch.sparsify``, against its dense twin in the same process.

    PYTHONPATH=. python bench/models.py                       # 8 layers, every benchmark
    PYTHONPATH=. python bench/models.py --layers 38           # the full 2B-class model
    PYTHONPATH=. python bench/models.py --benchmarks decode --batches 1 8

The model: hidden 2048, FFN 5632, 16 heads (8 KV heads), vocabulary 32000, bf16;
``twell.testing.llama.calibrate`` sets its gate thresholds for a mean L0 of ``--l0``
(default 29 of 5632, the paper's 1.5B model) on random tokens, and again before each
benchmark: a prefill on its own sequences, a training step and decode on random
sequences of their length (``--calibration-tokens`` in all). The MLP inputs move with
the sequence length and, for long sequences, from one sequence to another: thresholds
set on 512-token sequences leave a 16k-token prefill at an L0 of 1.4, and thresholds set
on other 16k-token sequences at 90. Records have the L0 and heavy-row share of their
own tokens (``l0_run``, ``heavy_share_run``; decode: of the prompts); the report has,
per model, the per-layer L0 on held-out 512-token sequences after the first
calibration. The dense twin is a copy of the calibrated model before
``sparsify``.

Benchmarks (``--benchmarks``), each twell against dense:

- ``prefill``: a forward pass over ``--prefill-tokens`` tokens (one sequence, no cache,
  logits of the last token), eager, and at ``--compiled-tokens`` compiled two ways:
  ``torch.compile(model)`` and each decoder layer compiled on its own
  (``compiled_layers``: whole-model compilation of transformers' Llama hands SDPA an
  explicit causal mask, off its flash kernel, and runs slower than eager at 16k tokens
  for both models); energy per token from NVML (``nvidia-ml-py``) where the driver
  reports it; the MLPs' share of the dense model's time (the MLPs replaced by zeros)
  and the whole-model cap it sets (Amdahl, with the MLP speedup measured in the run).
- ``decode`` (``--decode-modes``), at ``--batches``, ``--prompt`` tokens in,
  ``--new-tokens`` out, greedy: ``compiled_steps``, the decode loop of serving code on a
  static cache (:class:`StepDecoder`: one ``fullgraph`` step per token in torch's CUDA
  graphs, tokens chosen on the device; the time of the steps after the prompt, and the
  MLPs' share of the dense step, its MLPs replaced by zeros, with the speedup the model
  would have if they cost nothing, ``cap_free_mlps``); ``static_cache``, ``generate``
  with transformers' static cache (which compiles the decode step,
  ``mode="reduce-overhead"``), and whether the compiled twell model's tokens equal the
  eager twell model's; ``eager``, ``generate`` with the dynamic cache. ``generate`` adds
  1–2 ms of Python per token on either side, so its calls are timed interleaved, twell's
  and dense's in turn (``twell.timing.wall_ms_interleaved``), as are the decode loops,
  the prefill's calls, the training steps (rounds of a few back to back) and the MLP
  shares and speedups behind ``cap`` (each against its own dense rounds), so that a
  clock, power or host drift over the run weighs on both models alike; both models,
  their AdamW states and twell's op graphs are then resident at once (``train_ddp``
  still times one after the other).
- ``train_step``: ``model(ids, labels=ids)``, twell's L1 term added, backward, AdamW,
  ``zero_grad``: eager at ``--train-tokens`` tokens per step (sequences of 1024), and
  compiled at ``--compiled-train-tokens``, timed after ``--train-warmup`` steps (op
  graphs captured, capacities settled); the first step's loss against dense's
  (``loss_rel_diff``), the peak memory ratio, the mean L0 of the layers in the last
  timed step (``l0_timed``), and for eager steps the MLPs' share of the dense step (its
  MLPs replaced by zeros, AdamW still updating their weights), the MLPs' own forward +
  backward speedup on the model's activations and the cap they set. AdamW runs at
  ``--lr`` (default 0: every step does all of its work, and the weights, hence the
  calibrated sparsity, stay put; on random tokens a nonzero rate makes the units dense
  within a few steps, and twell then runs every row through its dense path).
- ``train_ddp`` (run by ``torchrun``, one process a GPU, and alone: ``torchrun
  --standalone --nproc_per_node 2 bench/models.py``): the eager training step under
  ``DistributedDataParallel`` at ``--ddp-tokens`` tokens a GPU, twell's against dense's,
  and each one's scaling efficiency against its step alone on one GPU.

Records (one per line of the README's table) go to ``bench/results/<gpu>/models.json``
(``--out``) with the fields of docs/benchmark.md: ``benchmark``, ``model``, ``mode``,
``tokens``, ``batch``, ``t_twell_ms``, ``t_dense_ms``, ``speedup`` and, where they
apply, ``energy_ratio``, ``tokens_match``, ``loss_rel_diff``, ``peak_mem_ratio`` (a
training step's extra peak memory, twell's counting what its op graphs keep between
steps: ``graph_gb_twell``, and ``op_graphs_kept``: graphs and GB of each set), ``l0``.
``--plot FILE`` draws the speedups (needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from twell.timing import (
    gpu_name,
    record_path,
    round_order,
    versions,
    wall_ms,
    wall_ms_interleaved,
    write_json,
)


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


class Energy:
    """NVML's energy counter of the current GPU (mJ), or None where unavailable."""

    def __init__(self) -> None:
        self.handle = None
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            index = torch.cuda.current_device()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
        except Exception:  # noqa: BLE001 - no NVML, or no energy counter
            self.handle = None

    def joules_per_call(
        self, fns: dict[str, Callable[[int], Any]], calls: int, rounds: int = 4
    ) -> dict[str, float] | None:
        """Energy of one call of each of ``fns`` in J (None without a counter): rounds of
        ``calls`` back-to-back calls, the functions' rounds interleaved in an order that
        turns each round, so that a drift in clocks or heat over the run weighs on each
        alike; ``calls`` long enough (a second or more) that the counter's update
        interval does not show."""
        if self.handle is None:
            return None
        names = list(fns)
        total = dict.fromkeys(names, 0.0)
        for name in names:
            fns[name](0)
        for r in range(rounds):
            for name in round_order(names, r):
                _sync()
                before = self._read(self.handle)
                for i in range(calls):
                    fns[name](i)
                _sync()
                total[name] += (self._read(self.handle) - before) / 1e3
        return {name: joules / (rounds * calls) for name, joules in total.items()}


def build(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """(twell model, dense twin, calibration report)."""
    import torch

    from twell.options import default_max_row_nnz
    from twell.testing import llama
    from twell.torch import sparsify

    model = llama.relu_llama(hidden=args.hidden, ffn=args.ffn, layers=args.layers,
                             heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                             device="cuda")  # fmt: skip
    start = time.perf_counter()
    llama.calibrate(model, l0=args.l0, sequences=args.calibration_sequences, length=512)
    held_out = llama.random_tokens(model, 8, 512, seed=1234)
    calibration_s = time.perf_counter() - start
    l0, heavy = llama.activity(model, held_out, default_max_row_nnz(args.ffn))
    info = {
        "calibration_s": calibration_s,
        "l0_per_layer": l0,
        "heavy_share_per_layer": heavy,
    }
    info["l0_mean"] = statistics.fmean(info["l0_per_layer"])
    dense = copy.deepcopy(model)
    replaced = sparsify(model)
    assert replaced == args.layers, replaced
    torch.cuda.empty_cache()
    return model, dense, info


def calibrated(args: argparse.Namespace, model: Any, dense: Any, ids: list[Any] | None,
               length: int) -> None:  # fmt: skip
    """Calibrate the dense twin for the next benchmark and copy its weights into the
    twell model: on the benchmark's own token ids when given (a few long sequences: the
    MLP inputs of one long random sequence differ from another's, so thresholds set on
    others leave it anywhere from an L0 near 1 to hundreds), else on random sequences of
    ``length`` tokens, ``args.calibration_tokens`` in all."""
    import torch

    from twell.testing import llama

    if ids is None:
        sequences = max(1, args.calibration_tokens // length)
        llama.calibrate(dense, l0=args.l0, sequences=sequences, length=length)
    else:
        llama.calibrate(dense, l0=args.l0, ids=torch.cat(ids))
    with torch.no_grad():
        model.load_state_dict(dense.state_dict())
    torch.cuda.empty_cache()


def run_sparsity(dense: Any, ids: Any) -> dict[str, Any]:
    """The sparsity a benchmark's own tokens give (the calibration's held-out tokens are
    512-token sequences; activations move with the length): the mean L0 over the layers
    and the mean share of tokens over the row limit (dense math on the dense twin)."""
    from twell.options import default_max_row_nnz
    from twell.testing import llama

    n = dense.config.intermediate_size
    l0, heavy = llama.activity(dense, ids, default_max_row_nnz(n))
    return {"l0_run": statistics.fmean(l0), "heavy_share_run": statistics.fmean(heavy)}


def tokens(model: Any, batch: int, length: int, sets: int = 2) -> list[Any]:
    from twell.testing import llama

    return [llama.random_tokens(model, batch, length, seed=100 + i) for i in range(sets)]


# ---------------------------------------------------------------------- prefill
def prefill(args: argparse.Namespace, model: Any, dense: Any, emit: Callable) -> None:
    import torch

    energy = Energy()
    for mode in PREFILL_MODES:
        lengths = args.prefill_tokens if mode == "eager" else args.compiled_tokens
        runners = {"twell": model, "dense": dense}
        if mode == "compiled":
            runners = {k: torch.compile(m) for k, m in runners.items()}
        prefill_mode(args, model, dense, runners, mode, lengths, energy, emit)


#: Prefill modes: eager; ``torch.compile(model)``; each decoder layer compiled on its own
#: (regional compilation: :func:`compiled_layers`), at ``--compiled-tokens``.
PREFILL_MODES = ("eager", "compiled", "compiled_layers")


@contextlib.contextmanager
def compiled_layers(models: Any, on: bool) -> Iterator[None]:
    """Each decoder layer of ``models`` compiled on its own (``nn.Module.compile``) while
    ``on``; restored after. Whole-model compilation of transformers' Llama builds the
    causal mask as a tensor (as transformers' source reads: under torch before 2.14 its
    check whether the mask may be left to SDPA's ``is_causal`` reads as "exporting"),
    and SDPA with an explicit ``[T, T]`` mask leaves the flash kernel: a 16k-token
    prefill then runs slower compiled than eager, for both models. Compiling the layers
    alone keeps the mask out, as eager does."""
    layers = [layer for m in models for layer in m.model.layers] if on else []
    for layer in layers:
        layer.compile()
    try:
        yield
    finally:
        for layer in layers:
            layer._compiled_call_impl = None


def prefill_mode(args: argparse.Namespace, model: Any, dense: Any, runners: dict, mode: str,
                 lengths: list[int], energy: Energy, emit: Callable) -> None:  # fmt: skip
    """The prefill records of one mode (see :func:`prefill`)."""
    import torch

    for t in lengths:
        ids = tokens(model, 1, t)
        calibrated(args, model, dense, ids, t)
        rec: dict[str, Any] = {"benchmark": "prefill", "mode": mode, "tokens": t, "batch": 1}
        rec.update(run_sparsity(dense, ids[0]))
        fns = {}
        for name, m in runners.items():

            def fn(i: int, m: Any = m, ids: list = ids) -> Any:
                with torch.no_grad():
                    return m(input_ids=ids[i % 2], use_cache=False, logits_to_keep=1).logits

            fns[name] = fn
        # (the layers compiled after the calibration, whose passes they would trace)
        with compiled_layers(list(runners.values()), mode == "compiled_layers"):
            outs = {name: fn(0).float() for name, fn in fns.items()}
            # twell's and dense's rounds interleaved: a clock or host drift weighs on both
            calls = max(1, min(10, 65536 // t))
            times = wall_ms_interleaved(fns, warmup=2, rounds=5, calls=calls)
        for name, ms in times.items():
            rec[f"t_{name}_ms"] = ms
        rec["speedup"] = rec["t_dense_ms"] / rec["t_twell_ms"]
        rec["logits_rel_err"] = float((outs["twell"] - outs["dense"]).norm() / outs["dense"].norm())
        if mode == "eager" and t == args.energy_tokens:
            # rounds of about two seconds each
            e = energy.joules_per_call(fns, calls=max(10, math.ceil(2000 / rec["t_twell_ms"])))
            if e is not None and e["dense"]:
                rec["energy_mj_per_token_twell"] = e["twell"] * 1e3 / t
                rec["energy_mj_per_token_dense"] = e["dense"] * 1e3 / t
                rec["energy_ratio"] = e["twell"] / e["dense"]
            rec.update(mlp_share(dense, model, ids[0]))
        emit(rec)


def mlp_inputs(dense: Any, ids: Any, count: int | None = None) -> list[Any]:
    """The inputs of the first ``count`` MLPs of ``dense`` (all: None) in one forward
    pass on ``ids``, in layer order."""
    import torch

    inputs: list[Any] = []
    layers = dense.model.layers[:count]
    handles = [layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
               for layer in layers]  # fmt: skip
    try:
        with torch.no_grad():
            dense(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


@contextlib.contextmanager
def without_mlps(dense: Any) -> Iterator[None]:
    """Every MLP of ``dense`` returns zeros inside the block (no MLP work, forward or
    backward): what the rest of the model costs."""
    import torch

    layers = dense.model.layers
    saved = [layer.mlp.forward for layer in layers]
    for layer in layers:
        layer.mlp.forward = torch.zeros_like
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            layer.mlp.forward = forward


def mlp_share(dense: Any, model: Any, ids: Any) -> dict[str, Any]:
    """The MLPs' share of the dense model's prefill (the model timed with its MLPs'
    forward replaced by zeros, in rounds alternating with the whole model), the MLP
    speedup of layer 0 on its real input (twell's and dense's layer alternating), and the
    whole-model cap they set."""
    import torch

    from twell.testing.llama import mlp_share_cap

    layers = dense.model.layers

    def fn(i: int) -> Any:
        with torch.no_grad():
            return dense(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    def rest(i: int) -> Any:
        with without_mlps(dense):
            return fn(i)

    parts = wall_ms_interleaved({"dense": fn, "rest": rest}, warmup=1, rounds=4, calls=3)
    x = mlp_inputs(dense, ids, count=1)[0]
    runs = {}
    for name, mlp in (("dense", layers[0].mlp), ("twell", model.model.layers[0].mlp)):

        def run(i: int, mlp: Any = mlp) -> Any:
            with torch.no_grad():
                return mlp(x)

        runs[name] = run
    times = wall_ms_interleaved(runs, warmup=2, rounds=4, calls=10)
    share = max(0.0, 1.0 - parts["rest"] / parts["dense"])
    speedup = times["dense"] / times["twell"]
    return {"mlp_share": share, "mlp_speedup": speedup, "cap": mlp_share_cap(share, speedup)}


# ---------------------------------------------------------------------- decode
def _decode_step(model: Any, token: Any, position: Any, cache: Any) -> Any:
    """One greedy decode step on a static cache: the next token of each sequence."""
    logits = model(input_ids=token, past_key_values=cache, cache_position=position,
                   use_cache=True).logits  # fmt: skip
    return logits[:, -1].argmax(-1, keepdim=True)


class StepDecoder:
    """Greedy decode the way serving loops run a static cache (gpt-fast's pattern): the
    prompt's prefill eagerly, then one compiled forward per token (``fullgraph``; torch's
    CUDA graphs in ``mode="reduce-overhead"``), each token chosen on the device and fed to
    the next step, the host waiting only at the end. ``generate`` adds its own Python per
    token (logits processors, stopping criteria, a host read of ``unfinished_sequences``),
    which on a small model outweighs the step's GPU time on both sides."""

    def __init__(self, model: Any, ids: Any, new_tokens: int, backend: str = "inductor",
                 mode: str | None = "reduce-overhead") -> None:  # fmt: skip
        import torch
        from transformers import StaticCache

        self.model, self.ids, self.new_tokens = model, ids, new_tokens
        batch, prompt = ids.shape
        self.cache = StaticCache(config=model.config, max_cache_len=prompt + new_tokens)
        self.positions = torch.arange(prompt + new_tokens, device=ids.device)
        self.out = torch.empty(batch, new_tokens, dtype=ids.dtype, device=ids.device)
        options = {"mode": mode} if mode else {}
        self.step = torch.compile(_decode_step, backend=backend, fullgraph=True, **options)

    def prefill(self) -> Any:
        """The cache emptied and filled with the prompt; the first new token."""
        import torch

        self.cache.reset()
        prompt = self.ids.shape[1]
        with torch.no_grad():
            token = _decode_step(self.model, self.ids, self.positions[:prompt], self.cache)
        self.out[:, :1].copy_(token)
        return self.out[:, :1].clone()

    def steps(self, token: Any) -> Any:
        """The other ``new_tokens - 1`` tokens after ``token`` (no host synchronisation)."""
        import torch

        prompt = self.ids.shape[1]
        with torch.no_grad():
            for i in range(1, self.new_tokens):
                torch.compiler.cudagraph_mark_step_begin()
                position = self.positions[prompt + i - 1 : prompt + i]
                token = self.step(self.model, token, position, self.cache)
                self.out[:, i : i + 1].copy_(token)
                token = self.out[:, i : i + 1].clone()  # not the graph's own output buffer
        return self.out

    def generate(self) -> Any:
        """Prompt and new tokens, ``[batch, prompt + new_tokens]``."""
        import torch

        return torch.cat([self.ids, self.steps(self.prefill())], dim=1)


def time_decoders(decoders: dict[str, StepDecoder], warmup: int = 2,
                  rounds: int = 6) -> dict[str, float]:  # fmt: skip
    """Median over ``rounds`` of each decoder's steps' wall time (prefill excluded, ms),
    the decoders' rounds alternating (``wall_ms_interleaved``)."""
    for decoder in decoders.values():
        for _ in range(warmup):  # compiles, then records the CUDA graph
            decoder.generate()
    first: dict[str, Any] = {}

    def prefill(name: str, r: int) -> None:
        first[name] = decoders[name].prefill()

    runs = {name: (lambda i, name=name: decoders[name].steps(first[name])) for name in decoders}
    return wall_ms_interleaved(runs, warmup=0, rounds=rounds, before=prefill)


def decode(args: argparse.Namespace, model: Any, dense: Any, emit: Callable) -> None:
    import torch

    from twell.testing.llama import greedy_gap

    calibrated(args, model, dense, None, args.prompt + args.new_tokens)
    for batch in args.batches:
        ids = tokens(model, batch, args.prompt, sets=1)[0]
        sparsity = run_sparsity(dense, ids)  # of the prompt
        for mode in args.decode_modes:
            rec: dict[str, Any] = {"benchmark": "decode", "mode": mode, "tokens": args.new_tokens,
                                   "batch": batch, "prompt": args.prompt, **sparsity}  # fmt: skip
            if mode == "compiled_steps":
                rec.update(decode_steps(args, model, dense, ids))
                emit(rec)
                continue
            runs: dict[str, Callable[[int], Any]] = {}
            for name, m in (("twell", model), ("dense", dense)):
                suffix = "" if name == "twell" else "_dense"
                kwargs: dict[str, Any] = {"max_new_tokens": args.new_tokens, "do_sample": False,
                                          "min_new_tokens": args.new_tokens}  # fmt: skip
                if mode == "static_cache":
                    kwargs["cache_implementation"] = "static"

                def run(i: int, m: Any = m, kwargs: dict = kwargs, ids: Any = ids) -> Any:
                    with torch.no_grad():
                        return m.generate(ids, **kwargs)

                out = run(0)  # compiles (static cache)
                if mode == "static_cache":
                    eager_kwargs = dict(kwargs, disable_compile=True)
                    with torch.no_grad():
                        reference = m.generate(ids, **eager_kwargs)
                    # greedy tokens of the compiled model against the eager one's, and how
                    # far from eager-greedy its choices are (twell.testing.llama.greedy_gap)
                    rec["tokens_match" + suffix] = bool(torch.equal(out, reference))
                    rec["greedy_gap" + suffix] = greedy_gap(m, out, args.prompt)
                runs[name] = run
            # host-bound: the two models' calls interleaved (wall_ms_interleaved)
            for name, ms in wall_ms_interleaved(runs, warmup=1, rounds=7).items():
                rec[f"t_{name}_ms"] = ms
                rec[f"tokens_per_s_{name}"] = batch * args.new_tokens / (ms / 1e3)
            rec["speedup"] = rec["t_dense_ms"] / rec["t_twell_ms"]
            emit(rec)


def decode_steps(args: argparse.Namespace, model: Any, dense: Any, ids: Any) -> dict[str, Any]:
    """The ``compiled_steps`` figures of one batch: twell's, dense's and dense's with
    every MLP's work taken out (a copy whose MLPs return zeros: ``mlp_share`` and the
    speedup the model would have if they cost nothing, ``cap_free_mlps``), their decode
    loops timed in alternating rounds, and how far each model's greedy choices are from
    eager greedy decoding."""
    import torch

    from twell.testing.llama import greedy_gap

    rest = copy.deepcopy(dense)
    for layer in rest.model.layers:
        layer.mlp.forward = torch.zeros_like
    models = {"twell": model, "dense": dense, "rest": rest}
    # A fresh cache of compiled steps per batch (one code object serves every model and
    # batch; the recompile limit would otherwise be reached). It also resets torch's
    # graph trees, which frees their cuBLAS workspaces: twell then captures its own
    # graphs anew (twell._graphs._cublas_epoch).
    torch._dynamo.reset()
    decoders = {name: StepDecoder(m, ids, args.new_tokens) for name, m in models.items()}
    times = time_decoders(decoders)
    steps = args.new_tokens - 1
    batch = ids.shape[0]
    rec: dict[str, Any] = {"steps": steps}
    for name in ("twell", "dense"):
        ms = rec[f"t_{name}_ms"] = times[name]
        rec[f"ms_per_step_{name}"] = ms / steps
        rec[f"tokens_per_s_{name}"] = batch * steps / (ms / 1e3)
        suffix = "" if name == "twell" else "_dense"
        rec["greedy_gap" + suffix] = greedy_gap(models[name], decoders[name].generate(),
                                                args.prompt)  # fmt: skip
    rec["speedup"] = times["dense"] / times["twell"]
    rec["mlp_share"] = 1.0 - times["rest"] / times["dense"]
    rec["cap_free_mlps"] = times["dense"] / times["rest"]
    del decoders, rest
    torch._dynamo.reset()
    return rec


# ---------------------------------------------------------------------- training
def train_step(args: argparse.Namespace, model: Any, dense: Any, emit: Callable) -> None:
    import torch

    from twell import autograd
    from twell.testing.llama import mlp_share_cap
    from twell.torch import SparseMLP, l1_penalty

    plans = [("eager", t) for t in args.train_tokens]
    plans += [("compiled", t) for t in args.compiled_train_tokens]
    for mode, t in plans:
        autograd.release_op_graphs()  # each plan's memory figure counts its own graphs only
        seq = min(1024, t)
        batch = t // seq
        rec: dict[str, Any] = {"benchmark": "train_step", "mode": mode, "tokens": t,
                               "batch": batch, "lr": args.lr}  # fmt: skip
        calibrated(args, model, dense, None, seq)
        rec.update(run_sparsity(dense, tokens(dense, batch, seq, sets=1)[0]))
        losses, steps, models, optimizers = {}, {}, {}, {}
        for name, base in (("twell", model), ("dense", dense)):
            m = copy.deepcopy(base).train()
            run_model = torch.compile(m) if mode == "compiled" else m
            optimizer = torch.optim.AdamW(m.parameters(), lr=args.lr, fused=True)
            ids = tokens(m, batch, seq)

            def step(i: int, m: Any = m, run_model: Any = run_model, opt: Any = optimizer,
                     ids: list = ids, name: str = name) -> Any:  # fmt: skip
                out = run_model(input_ids=ids[i % 2], labels=ids[i % 2])
                loss = out.loss
                if name == "twell":
                    loss = loss + args.l1 * l1_penalty(m)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return out.loss

            losses[name] = float(step(0).detach())
            for i in range(args.train_warmup):  # op graphs captured, capacities settled
                step(i + 1)
            steps[name], models[name], optimizers[name] = step, m, optimizer
        torch.cuda.synchronize()
        # the forward's graphs of eager calls and of compiled ones, the backward's
        graphs = (autograd._FORWARD_GRAPHS, autograd._OP_FORWARD_GRAPHS,
                  autograd._BACKWARD_GRAPHS)  # fmt: skip
        before = [(g.captures, g.replays) for g in graphs]
        # twell's and dense's rounds of 5 steps interleaved: a clock or host drift over
        # the run weighs on both alike
        for name, ms in wall_ms_interleaved(steps, warmup=0, rounds=5, calls=5).items():
            rec[f"t_{name}_ms"] = ms
        # op graphs captured / replayed over the timed steps (dense's steps take none)
        rec["op_graphs"] = [(g.captures - c, g.replays - r)
                            for g, (c, r) in zip(graphs, before, strict=True)]  # fmt: skip
        mlps = [x for x in models["twell"].modules() if isinstance(x, SparseMLP)]
        # the sparsity the last timed step ran at (a nonzero lr on random tokens makes
        # the calibrated units dense within a few steps)
        l0 = [float(x.l0) for x in mlps if x.l0 is not None]
        rec["l0_timed"] = statistics.fmean(l0) if l0 else None
        rec["capacity_per_layer"] = [layer_capacity(x, mode == "compiled") for x in mlps]
        for name, step in steps.items():  # peak memory of a step beyond what is held
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_memory = torch.cuda.memory_allocated()
            for i in range(2):
                step(i)
            torch.cuda.synchronize()
            rec[f"peak_extra_gb_{name}"] = (torch.cuda.max_memory_allocated() - base_memory) / 2**30
        # what the op graphs keep between steps counts too
        rec["graph_gb_twell"] = autograd.op_graph_memory() / 2**30
        # graphs kept and their GB in each set (a key keeps a second graph while the
        # outputs it handed over are still held at its next call)
        rec["op_graphs_kept"] = [(len(g), g.memory() / 2**30) for g in graphs]
        rec["peak_extra_gb_twell"] += rec["graph_gb_twell"]
        if mode == "eager":
            rec.update(train_mlp_share(models["dense"], steps["dense"], optimizers["dense"]))
        del models, steps, step, mlps, m, run_model, optimizer, optimizers
        autograd.release_op_graphs()  # keyed on the copies' weights: gone with them
        rec["speedup"] = rec["t_dense_ms"] / rec["t_twell_ms"]
        rec["loss_rel_diff"] = abs(losses["twell"] - losses["dense"]) / abs(losses["dense"])
        rec["peak_mem_ratio"] = rec["peak_extra_gb_twell"] / max(rec["peak_extra_gb_dense"], 1e-9)
        if "mlp_share" in rec:
            rec["mlp_speedup"] = mlp_speedup(model, dense, t, seq)
            autograd.release_op_graphs()  # the layer copies' graphs: not the next plan's
            rec["cap"] = mlp_share_cap(rec["mlp_share"], rec["mlp_speedup"])
        emit(rec)


def layer_capacity(mlp: Any, compiled: bool) -> float | None:
    """The dense capacity a layer's training calls take now: its own ``"auto"`` choice
    in eager calls, the one the ops keep per layer for compiled ones
    (``twell.capacity.for_weights``); None for a fixed capacity."""
    from twell import capacity

    if mlp._auto is None:
        return None
    return capacity.for_weights(mlp.up_proj.weight).fraction if compiled else mlp._auto.fraction


def train_mlp_share(dense: Any, step: Callable[[int], Any], optimizer: Any) -> dict[str, Any]:
    """The MLPs' share of the dense model's training step: the step timed with every MLP
    replaced by zeros (no MLP forward or backward), in rounds alternating with the whole
    step. AdamW still updates the MLP weights there (from zero gradients held aside, so
    no kernel fills them): the update costs twell's step as much as dense's, so the share
    is what the MLP kernels could shrink."""
    import torch

    params = [p for layer in dense.model.layers for p in layer.mlp.parameters()]
    zeros = [torch.zeros_like(p) for p in params]

    def fill(opt: Any, args: Any, kwargs: Any) -> None:
        for p, z in zip(params, zeros, strict=True):
            if p.grad is None:
                p.grad = z

    def rest(i: int) -> Any:
        handle = optimizer.register_step_pre_hook(fill)
        try:
            with without_mlps(dense):
                return step(i)
        finally:
            handle.remove()

    parts = wall_ms_interleaved({"dense": step, "rest": rest}, warmup=1, rounds=4, calls=5)
    return {"mlp_share": max(0.0, 1.0 - parts["rest"] / parts["dense"])}


def mlp_speedup(model: Any, dense: Any, t: int, seq: int) -> float:
    """Dense over twell time of every layer's MLP forward + backward (back to back) on
    that layer's own input in the dense model at ``t`` tokens (the gradients of a random
    upstream gradient)."""
    import torch

    inputs = mlp_inputs(dense, tokens(dense, t // seq, seq, sets=1)[0])
    runs = {}
    for name, net in (("dense", dense), ("twell", model)):
        mlps = [copy.deepcopy(layer.mlp).train() for layer in net.model.layers]
        xs = [x.clone().requires_grad_() for x in inputs]
        dy = torch.randn_like(inputs[0])

        def run(i: int, mlps: list = mlps, xs: list = xs, dy: Any = dy) -> None:
            for mlp, x in zip(mlps, xs, strict=True):
                mlp(x).backward(dy)
                x.grad = None  # (an activation: no gradient kept across steps)
                for p in mlp.parameters():
                    p.grad = None

        runs[name] = run
    total = wall_ms_interleaved(runs, warmup=5, rounds=4, calls=5)
    return total["dense"] / total["twell"]


def train_ddp(args: argparse.Namespace, model: Any, dense: Any, emit: Callable) -> None:
    """The eager training step under ``DistributedDataParallel`` on every GPU of a
    ``torchrun`` job, at ``--ddp-tokens`` tokens per GPU: twell's DDP step against dense's,
    and each one's scaling (its step alone on one GPU over its DDP step, the same batch
    per GPU: the job's tokens/s over the world size times one GPU's). The one-GPU steps
    run on every rank at once, each alone, so they meet the same host and memory traffic
    as the DDP steps; each time is the slowest rank's. Every rank draws its own tokens."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from twell import autograd
    from twell.testing import llama
    from twell.torch import SparseMLP, l1_penalty

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("train_ddp: launch with torchrun --nproc_per_node N (one process a GPU)")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.cuda.current_device()

    def slowest(ms: float) -> float:
        t = torch.tensor([ms], dtype=torch.float64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for t in args.ddp_tokens:
        seq = min(1024, t)
        batch = t // seq
        rec: dict[str, Any] = {"benchmark": "train_step", "mode": "ddp_eager", "tokens": t,
                               "batch": batch, "world_size": world, "lr": args.lr}  # fmt: skip
        calibrated(args, model, dense, None, seq)
        rec.update(run_sparsity(dense, tokens(dense, batch, seq, sets=1)[0]))
        times: dict[tuple[str, str], float] = {}
        for name, base in (("twell", model), ("dense", dense)):
            for strategy in ("single", "ddp"):
                m = copy.deepcopy(base).train()
                run_model = m
                if strategy == "ddp":
                    run_model = DistributedDataParallel(m, device_ids=[device])
                optimizer = torch.optim.AdamW(m.parameters(), lr=args.lr, fused=True)
                ids = [llama.random_tokens(m, batch, seq, seed=100 + world * i + rank)
                       for i in range(2)]  # fmt: skip

                def step(i: int, m: Any = m, run_model: Any = run_model, opt: Any = optimizer,
                         ids: list = ids, name: str = name) -> None:  # fmt: skip
                    loss = run_model(input_ids=ids[i % 2], labels=ids[i % 2]).loss
                    if name == "twell":
                        loss = loss + args.l1 * l1_penalty(m)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                for i in range(args.train_warmup):  # op graphs captured, capacities settled
                    step(i)
                dist.barrier()
                times[(name, strategy)] = slowest(wall_ms(step, 5, warmup=0, rounds=3))
                if name == "twell" and strategy == "ddp":
                    l0 = [float(x.l0) for x in m.modules() if isinstance(x, SparseMLP)
                          and x.l0 is not None]  # fmt: skip
                    rec["l0_timed"] = statistics.fmean(l0) if l0 else None
                del m, run_model, optimizer
                autograd.release_op_graphs()
        rec["t_twell_ms"], rec["t_dense_ms"] = times[("twell", "ddp")], times[("dense", "ddp")]
        rec["t_single_twell_ms"] = times[("twell", "single")]
        rec["t_single_dense_ms"] = times[("dense", "single")]
        rec["speedup"] = rec["t_dense_ms"] / rec["t_twell_ms"]
        rec["scaling_twell"] = rec["t_single_twell_ms"] / rec["t_twell_ms"]
        rec["scaling_dense"] = rec["t_single_dense_ms"] / rec["t_dense_ms"]
        emit(rec)


DECODE_MODES = ("compiled_steps", "static_cache", "eager")
BENCHMARKS = {
    "prefill": prefill, "train_step": train_step, "decode": decode, "train_ddp": train_ddp,
}  # fmt: skip
#: Benchmarks that only a torchrun job runs (one process a GPU), and that it alone runs.
DISTRIBUTED = ("train_ddp",)


def plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if "speedup" in r]
    layers = [str(r.get("model", "")).split("-")[2:3] for r in done]
    labels = [f"{r['benchmark']}\n{r['mode']}\n{r['tokens']}×{r['batch']}\n{''.join(n)}"
              for r, n in zip(done, layers, strict=True)]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(done)), 4))
    ax.bar(range(len(done)), [r["speedup"] for r in done])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(done)), labels, fontsize=7)
    ax.set_ylabel("speedup over dense")
    ax.set_title(f"Llama ReLU models on {records[0].get('gpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _record_key(rec: dict[str, Any]) -> tuple:
    return tuple(rec.get(k) for k in ("model", "benchmark", "mode", "tokens", "batch"))


def load_report(path: Any, name: str) -> dict[str, Any]:
    """The records file at ``path`` (a new one if absent), for a run of model ``name``:
    each record the run emits replaces the one of the same model and configuration
    (benchmark, mode, tokens, batch) in place (:func:`replace_record`); the others stay,
    each with the versions it was measured with, and so do the models' build reports
    (``models``) and the file's other keys. A file of another GPU is a ``ValueError``
    (pass ``--out``)."""
    import json
    from pathlib import Path

    fresh = {"gpu": gpu_name(), **versions(), "models": {}, "records": []}
    path = Path(path)
    if not path.exists():
        return fresh
    old = json.loads(path.read_text())
    if not isinstance(old, dict) or old.get("gpu") != fresh["gpu"]:
        found = old.get("gpu") if isinstance(old, dict) else type(old).__name__
        raise ValueError(f"{path}: records of {found}, not of {fresh['gpu']}; pass --out")
    report = {**old, **{k: v for k, v in fresh.items() if k not in ("models", "records")}}
    report["models"] = dict(old.get("models") or {})
    if "calibration" in old and old.get("model"):  # a file of one model
        report["models"].setdefault(old["model"], old["calibration"])
    for key in ("calibration", "model", "errors"):
        report.pop(key, None)
    stamp = {k: old[k] for k in ("cupy", "cuda", "torch") if k in old}
    report["records"] = [{**stamp, **r} for r in old.get("records") or []]
    report["models"].pop(name, None)
    return report


def replace_record(records: list[dict[str, Any]], rec: dict[str, Any]) -> list[dict[str, Any]]:
    """``records`` with ``rec`` in the place of the one of its configuration (appended
    when there is none)."""
    key = _record_key(rec)
    places = [i for i, r in enumerate(records) if _record_key(r) == key]
    if not places:
        return [*records, rec]
    kept = [r for i, r in enumerate(records) if i not in places[1:]]
    kept[places[0]] = rec
    return kept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--l0", type=float, default=29.0)
    p.add_argument("--calibration-sequences", type=int, default=32)
    p.add_argument("--calibration-tokens", type=int, default=65536)
    p.add_argument(
        "--benchmarks",
        nargs="+",
        default=None,
        choices=list(BENCHMARKS),
        help="default: every one but train_ddp; under torchrun: train_ddp",
    )
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 4096, 16384, 65536])
    p.add_argument("--compiled-tokens", type=int, nargs="*", default=[16384])
    p.add_argument("--energy-tokens", type=int, default=16384)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-modes", nargs="+", default=list(DECODE_MODES), choices=DECODE_MODES)
    p.add_argument("--train-tokens", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--compiled-train-tokens", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--l1", type=float, default=1e-4)
    p.add_argument("--lr", type=float, default=0.0)
    p.add_argument("--train-warmup", type=int, default=10)
    p.add_argument("--ddp-tokens", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()

    import torch

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.benchmarks is None:
        args.benchmarks = list(DISTRIBUTED) if distributed else [
            b for b in BENCHMARKS if b not in DISTRIBUTED
        ]  # fmt: skip
    if distributed != all(b in DISTRIBUTED for b in args.benchmarks):
        p.error(f"{', '.join(DISTRIBUTED)} runs under torchrun, and alone; the others without")
    lead = True
    if distributed:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (NVLS)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        lead = dist.get_rank() == 0
    out = args.out or record_path("models")
    name = f"llama-relu-{args.layers}L-{args.hidden}x{args.ffn}"
    report = load_report(out, name)
    model, dense, info = build(args)
    if lead:
        report["models"][name] = info
        print(f"== {name}: L0 per layer {[round(v, 1) for v in info['l0_per_layer']]}", flush=True)
    failures = 0

    def emit(rec: dict[str, Any]) -> None:
        if not lead:  # every rank measures; the first writes
            return
        rec = {"gpu": report["gpu"], "model": name, **versions(), **rec}
        report["records"] = replace_record(report["records"], rec)
        write_json(out, report)
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                 if k not in ("gpu", "model")}  # fmt: skip
        print(shown, flush=True)

    for bench in args.benchmarks:
        try:
            BENCHMARKS[bench](args, model, dense, emit)
        except Exception as error:  # noqa: BLE001 - recorded, counted, the rest runs
            traceback.print_exc()
            failures += 1
            report.setdefault("errors", []).append(f"{bench}: {type(error).__name__}: {error}")
            if lead:
                write_json(out, report)
        torch.cuda.empty_cache()
    if args.plot and lead:
        plot(report["records"], args.plot)
    if distributed:
        torch.distributed.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
