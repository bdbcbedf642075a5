"""Train a small Llama-architecture byte-level model, dense and with twell's sparse MLPs.

The model is written in plain torch (no transformers): token embedding, ``layers`` blocks
of RMSNorm → causal self-attention with rotary positions
(``F.scaled_dot_product_attention``) → RMSNorm → Llama MLP with ReLU (``gate_proj``,
``up_proj``, ``down_proj``, ``act_fn``), a final RMSNorm and an untied LM head over 256
byte values. Data: the Python standard library's own source files
(``os.path.dirname(os.__file__)/*.py``, sorted; every 20th file, 5%, is held out),
read as bytes.

Two runs from the same seed (the same initial weights and batches):

- ``dense``: the model as it is (dense torch math, no penalty);
- ``twell``: :func:`twell.torch.sparsify` swaps every MLP for a ``SparseMLP`` (the same
  parameters; forward and backward through twell's training ops), and the loss adds the
  layers' L1 terms, ``coeff(t) * sum(mlp.l1)``, with ``coeff`` ramping linearly from 0 to
  ``--l1-coeff`` over the first ``--l1-warmup`` fraction of the steps (as in the paper).

CUDA runs use bf16 autocast with fp32 master weights (AdamW). The report (``--out``,
JSON, by default ``bench/results/<gpu>/train_small.json``) has the recipe (config, seed,
steps), and per run the training loss every ``--log-every`` steps, the held-out loss
every ``--eval-every`` steps and at the end, the L0 of every layer over the steps (twell:
from the training forward; both: measured on a held-out batch at each evaluation), the
step time (median after ``--warmup-steps``), tokens/s and peak GPU memory. With
matplotlib installed it also writes PNG plots beside the JSON. ``--save PATH`` stores the
trained sparse model (recipe + state dict; the MLPs keep the names
``gate_proj``/``up_proj``/``down_proj``).

    python bench/train_small.py --steps 1200 --l1-coeff 1e-4 --graphs  # the record, ~2 min/run
    python bench/train_small.py --variants twell --steps 500 --out /tmp/t.json  # one run
    python bench/train_small.py --smoke --out /tmp/smoke.json  # CPU, seconds

Step times are the synchronised wall clock of each training step (a run's steps, not one
call repeated: twell.timing's timers do not apply).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from torch import nn  # noqa: E402

import twell.torch as twell_torch  # noqa: E402
from twell.timing import record_path  # noqa: E402


# ---------------------------------------------------------------------- configuration
@dataclasses.dataclass
class Config:
    """Model and training recipe (everything a run depends on, with ``seed``)."""

    layers: int = 6
    hidden: int = 1024
    ffn: int = 2816
    heads: int = 16
    vocab: int = 256
    seq: int = 1024
    batch: int = 16
    steps: int = 2500
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    lr_warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    l1_coeff: float = 1e-4
    l1_warmup: float = 0.25
    reduction: str = "per_token"
    tile: int = 256
    slots: int = 32
    # SparseMLP(op_graphs=...): each training op replays a graph; None: twell's default
    # (on for calls of at most twell.torch.OP_GRAPH_TOKENS tokens)
    op_graphs: bool | None = None
    seed: int = 0

    @classmethod
    def smoke(cls) -> Config:
        return cls(
            layers=2, hidden=64, ffn=256, heads=2, seq=64, batch=4, steps=20, lr_warmup=5, lr=3e-3
        )


# ---------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)  # [seq, head_dim/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dimension; ``x [B, H, S, D]``."""
    s = x.shape[-2]
    cos, sin = cos[:s].to(x.dtype), sin[:s].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        shape = (b, s, self.heads, d // self.heads)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    """The Llama MLP with ReLU: what :func:`twell.torch.sparsify` recognises."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_fn = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden)
        self.self_attn = Attention(config.hidden, config.heads)
        self.post_attention_layernorm = RMSNorm(config.hidden)
        self.mlp = MLP(config.hidden, config.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class ByteLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        cos, sin = rotary_tables(config.seq, config.hidden // config.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def build_model(config: Config, device: torch.device, *, sparse: bool) -> nn.Module:
    """The model with ``config.seed``'s weights (the same for dense and sparse)."""
    torch.manual_seed(config.seed)
    model = ByteLM(config).to(device)
    if sparse:
        replaced = twell_torch.sparsify(
            model, tile=config.tile, slots=config.slots, reduction=config.reduction,
            op_graphs=config.op_graphs,
        )  # fmt: skip
        assert replaced == config.layers, replaced
    return model


# ---------------------------------------------------------------------- data
def stdlib_corpus(holdout_every: int = 20) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Bytes of the standard library's ``*.py`` files: ``(train, validation, info)``.

    Files sorted by name; file ``i`` is held out when ``i % holdout_every ==
    holdout_every - 1`` (5%). Files are joined with a NUL byte.
    """
    root = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    train, val = [], []
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read() + b"\0"
        (val if i % holdout_every == holdout_every - 1 else train).append(data)
    info = {"root": root, "files": len(files), "train_files": len(train), "val_files": len(val)}
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    train_t, val_t = as_tensor(train).long(), as_tensor(val).long()
    info.update(train_bytes=int(train_t.numel()), val_bytes=int(val_t.numel()))
    return train_t, val_t, info


def random_batch(
    data: torch.Tensor, batch: int, seq: int, generator: torch.Generator
) -> torch.Tensor:
    """``[batch, seq + 1]`` windows at random offsets (inputs and shifted targets)."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def eval_batches(data: torch.Tensor, batch: int, seq: int, limit: int) -> list[torch.Tensor]:
    """Fixed, non-overlapping held-out windows (the same for every evaluation)."""
    windows = (data.numel() - 1) // seq
    step = max(1, windows // (batch * limit))
    starts = list(range(0, windows * seq, step * seq))[: batch * limit]
    rows = [data[s : s + seq + 1] for s in starts if s + seq + 1 <= data.numel()]
    return [torch.stack(rows[i : i + batch]) for i in range(0, len(rows) - batch + 1, batch)]


# ---------------------------------------------------------------------- training
def lr_at(config: Config, step: int) -> float:
    if step < config.lr_warmup:
        return config.lr * (step + 1) / config.lr_warmup
    progress = (step - config.lr_warmup) / max(1, config.steps - config.lr_warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def l1_coeff_at(config: Config, step: int) -> float:
    """The L1 coefficient's warm-up: linear from 0 to ``l1_coeff`` over the first
    ``l1_warmup`` fraction of the steps, then constant."""
    ramp = config.l1_warmup * config.steps
    if ramp <= 0:
        return config.l1_coeff
    return config.l1_coeff * min(1.0, step / ramp)


def make_optimizer(
    model: nn.Module, config: Config, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only; fused on CUDA unless ``fused`` says otherwise
    (FSDP2's sharded parameters take the foreach path)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    if fused is None:
        fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=fused or None)


def autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


class GraphedStep:
    """Forward, loss and backward of one training step captured in one CUDA graph (torch's
    whole-network capture) and replayed per step: no host cost per kernel. The batch and
    the L1 coefficient are copied into static tensors before each replay; the gradients
    the replay writes are the parameters' ``.grad`` tensors made at capture (so the loop
    must not set them to None afterwards); the optimizer step stays eager and updates the
    parameters in place, which the graph reads. bf16 autocast runs without its weight
    cache (cached casts would not outlive the capture)."""

    def __init__(self, model: nn.Module, sparse: bool, sample: torch.Tensor) -> None:
        self.model, self.sparse = model, sparse
        self.batch = sample.clone()
        self.coeff = torch.zeros((), device=sample.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: kernels compiled, cuBLAS and caches set up
                model.zero_grad(set_to_none=True)
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self._body()
        # The layers' L0 tensors of the captured forward: each replay rewrites them (the
        # modules' own attributes change whenever the model runs eagerly, e.g. to evaluate).
        self.l0 = [m.l0 for m in sparse_mlps(model)]

    def _body(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            logits = self.model(self.batch[:, :-1])
        task = F.cross_entropy(logits.float().flatten(0, 1), self.batch[:, 1:].flatten())
        penalty = twell_torch.l1_penalty(self.model) if self.sparse else None
        (task if penalty is None else task + self.coeff * penalty).backward()
        return task, penalty

    def __call__(self, batch: torch.Tensor, coeff: float) -> tuple[torch.Tensor, Any]:
        """Replays the step on ``batch`` (the sample's shape): ``(task loss, penalty)``."""
        self.batch.copy_(batch)
        self.coeff.fill_(coeff)
        self.graph.replay()
        return self.outputs


def sparse_mlps(model: nn.Module) -> list[twell_torch.SparseMLP]:
    return [m for m in model.modules() if isinstance(m, twell_torch.SparseMLP)]


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Held-out loss (mean over batches) and per-layer L0 (mean active units per token).

    L0 is measured on each MLP's input with a dense gate GEMM on the side (a forward
    pre-hook): a ``SparseMLP`` without gradients runs twell's inference kernels, which
    never call ``gate_proj``.
    """
    mlps = [m for m in model.modules() if isinstance(m, (MLP, twell_torch.SparseMLP))]
    counts: list[list[float]] = [[] for _ in mlps]

    def hook(index: int) -> Any:
        def count(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0]
            pre = F.linear(x, module.gate_proj.weight.to(x.dtype))
            counts[index].append(float((pre > 0).sum()) / (pre.numel() // pre.shape[-1]))

        return count

    handles = [mlp.register_forward_pre_hook(hook(i)) for i, mlp in enumerate(mlps)]
    model.eval()
    losses = []
    try:
        for batch in batches:
            batch = batch.to(device)
            with autocast(device):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            losses.append(float(loss))
    finally:
        for handle in handles:
            handle.remove()
        model.train()
    return {"loss": statistics.fmean(losses), "l0": [statistics.fmean(c) for c in counts]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    config: Config,
    variant: str,
    device: torch.device,
    data: tuple[torch.Tensor, torch.Tensor],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], nn.Module]:
    """One run (``variant`` ``"dense"`` or ``"twell"``): its report and the model."""
    sparse = variant == "twell"
    model = build_model(config, device, sparse=sparse)
    if args.compile:
        model.compile(fullgraph=False)
    optimizer = make_optimizer(model, config)
    train_data, val_data = data
    runner = None
    if args.graphs and device.type == "cuda":
        sample = random_batch(train_data, config.batch, config.seq, torch.Generator())
        runner = GraphedStep(model, sparse, sample.to(device))
    generator = torch.Generator().manual_seed(config.seed)
    held_out = eval_batches(val_data, config.batch, config.seq, args.eval_batches)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    times: list[float] = []
    started = time.perf_counter()
    steps_done = 0
    for step in range(config.steps):
        batch = random_batch(train_data, config.batch, config.seq, generator).to(
            device, non_blocking=True
        )
        lr = lr_at(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        coeff = l1_coeff_at(config, step) if sparse else 0.0
        synchronize(device)
        t0 = time.perf_counter()
        if runner is not None:  # one graph replay: forward, loss, backward
            task, penalty = runner(batch, coeff)
        else:
            with autocast(device):
                logits = model(batch[:, :-1])
            task = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            loss = task
            penalty = twell_torch.l1_penalty(model) if sparse else None
            if coeff > 0 and penalty is not None:
                loss = task + coeff * penalty
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        if runner is None:  # a replay overwrites the captured .grad tensors
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        steps_done = step + 1
        if step % args.log_every == 0 or step == config.steps - 1:
            entry = {
                "step": step,
                "loss": float(task.detach()),
                "lr": lr,
                "grad_norm": float(grad_norm),
                "step_time_s": times[-1],
            }
            if sparse:
                entry.update(
                    l1_coeff=coeff,
                    l1=float(penalty.detach()),
                    l0=[float(t) for t in runner.l0]
                    if runner is not None
                    else twell_torch.l0_per_layer(model),
                )
            log.append(entry)
            if not args.quiet:
                extra = (
                    f" l1 {entry['l1']:.4g} L0 {[round(v, 1) for v in entry['l0']]}"
                    if sparse
                    else ""
                )
                print(f"[{variant}] step {step:5d} loss {entry['loss']:.4f}{extra}", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            evals.append({"step": step, **evaluate(model, held_out, device)})
        if args.max_minutes and time.perf_counter() - started > 60 * args.max_minutes:
            print(f"[{variant}] stopping after {steps_done} steps (--max-minutes)", flush=True)
            break
    final = evaluate(model, held_out, device)
    evals.append({"step": steps_done, **final})
    timed = times[args.warmup_steps :] or times
    step_time = statistics.median(timed)
    tokens = config.batch * config.seq
    report = {
        "variant": variant,
        "steps_done": steps_done,
        "train_log": log,
        "eval": evals,
        "held_out_loss": final["loss"],
        "held_out_l0": final["l0"],
        "step_time_s": {
            "median": step_time,
            "mean": statistics.fmean(timed),
            "min": min(timed),
            "max": max(timed),
            "first": times[0],
        },
        "tokens_per_s": tokens / step_time,
        "wall_s": time.perf_counter() - started,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
    }
    return report, model


# ---------------------------------------------------------------------- report
def plot(report: dict[str, Any], out: Path) -> list[str]:
    """PNG plots beside ``out`` when matplotlib is importable; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in report["runs"]:
        ax.plot(
            [e["step"] for e in run["train_log"]],
            [e["loss"] for e in run["train_log"]],
            label=f"{run['variant']} train",
        )
        ax.plot(
            [e["step"] for e in run["eval"]],
            [e["loss"] for e in run["eval"]],
            "o--",
            label=f"{run['variant']} held-out",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.legend()
    path = out.with_name(out.stem + "_loss.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(str(path))
    sparse = [r for r in report["runs"] if r["variant"] == "twell"]
    if sparse and sparse[0]["train_log"]:
        run = sparse[0]
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [e["step"] for e in run["train_log"]]
        for layer in range(len(run["train_log"][0]["l0"])):
            ax.plot(steps, [e["l0"][layer] for e in run["train_log"]], label=f"layer {layer}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("L0 (active units per token)")
        ax.legend(fontsize="small")
        path = out.with_name(out.stem + "_l0.png")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    return written


def add_config_flags(p: argparse.ArgumentParser, defaults: Config) -> None:
    """One ``--field`` per :class:`Config` field (``--flag/--no-flag`` for booleans),
    default None (the config keeps its value); ``defaults`` only fills the help text."""
    for field in dataclasses.fields(Config):
        default = getattr(defaults, field.name)
        boolean = "bool" in str(field.type)  # (bool | None: None keeps twell's default)
        p.add_argument(
            f"--{field.name.replace('_', '-')}",
            **({"action": argparse.BooleanOptionalAction} if boolean else {"type": type(default)}),
            default=None,
            help=f"default {default}",
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Config()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", type=Path, default=None,
        help="JSON report, PNG plots beside it (default: bench/results/<gpu>/train_small.json)",
    )  # fmt: skip
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU-sized run: 2 layers, hidden 64, FFN 256, 20 steps",
    )
    p.add_argument("--variants", nargs="+", choices=("dense", "twell"), default=["dense", "twell"])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_config_flags(p, defaults)
    p.add_argument("--log-every", type=int, default=None, help="default 25 (smoke: 5)")
    p.add_argument(
        "--eval-every", type=int, default=None, help="default 250 (smoke: 10); 0: end only"
    )
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the timing")
    p.add_argument(
        "--max-minutes", type=float, default=None,
        help="stop a run after this many minutes (default 4, smoke: never; both runs then fit "
        "in 10 minutes; 0: never); the report says how many steps were done",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--graphs", action="store_true",
        help="CUDA only: forward, loss and backward as one CUDA-graph replay per step "
        "(the optimizer step stays eager)",
    )  # fmt: skip
    p.add_argument(
        "--save", type=Path, default=None, help="save the sparse model (recipe + state dict)"
    )
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    config = Config.smoke() if args.smoke else Config()
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(Config)
        if getattr(args, f.name) is not None
    }
    return dataclasses.replace(config, **overrides)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = config_from(args)
    if config.hidden % config.heads or (config.hidden // config.heads) % 2:
        raise SystemExit("--hidden must be a multiple of --heads with an even head size")
    if args.log_every is None:
        args.log_every = 5 if args.smoke else 25
    if args.eval_every is None:
        args.eval_every = 10 if args.smoke else 250
    if args.max_minutes is None:
        args.max_minutes = 0.0 if args.smoke else 4.0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke and args.device is None:
        device = torch.device("cpu")
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: extra threads only spin (and contend)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    train_data, val_data, corpus = stdlib_corpus()
    recipe = {
        "config": dataclasses.asdict(config),
        "seed": config.seed,
        "steps": config.steps,
        "variants": args.variants,
        "corpus": corpus,
        "compile": args.compile,
        "graphs": args.graphs,
    }
    report: dict[str, Any] = {
        "recipe": recipe,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "runs": [],
    }
    for variant in args.variants:
        run, model = train(config, variant, device, (train_data, val_data), args)
        report["runs"].append(run)
        if variant == "twell" and args.save is not None:
            args.save.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"recipe": recipe, "state_dict": model.state_dict()}, args.save)
            report["saved"] = str(args.save)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out is None:
        args.out = record_path("train_small", report["device"] if device.type == "cuda" else "cpu")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report["plots"] = plot(report, args.out)
    args.out.write_text(json.dumps(report, indent=1))
    if not args.quiet:
        for run in report["runs"]:
            print(
                f"[{run['variant']}] held-out loss {run['held_out_loss']:.4f}  "
                f"step {run['step_time_s']['median'] * 1e3:.1f} ms  "
                f"{run['tokens_per_s']:.0f} tok/s  L0 {[round(v, 1) for v in run['held_out_l0']]}"
            )
        print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
