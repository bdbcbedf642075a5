"""Llama models whose ReLU MLPs are as sparse as a trained sparse model's, for tests and
benchmarks (needs torch and transformers).

A randomly initialised ``LlamaForCausalLM`` with ReLU MLPs keeps about half of its units
active. Trained sparse models (the paper's 1.5B model: ~29 of 5632 units per token) get
there through the gate's thresholds; a Llama MLP has no bias, so :func:`calibrate` makes
one: residual dimension ``d`` is held at a constant (the embedding's column ``d`` is 1,
and row ``d`` of every ``o_proj`` and ``down_proj`` is 0, so no layer writes to it).
RMSNorm keeps its sign, so every MLP input has ``x[:, d] > 0`` and ``w_gate[:, d]``
acts as a per-unit threshold. Layer by layer, on calibration tokens, each unit's
threshold is set so that it fires on its target share of tokens: 30% of the units
never fire (as in trained models), the others' shares are log-normal across units,
scaled to the requested mean L0. Held-out tokens then land near the target (the spread
per layer is what :func:`l0_per_layer` reports).

Example::

    model = relu_llama(hidden=2048, ffn=5632, layers=8, device="cuda")
    calibrate(model, l0=29)
    twell.torch.sparsify(model)
"""

from __future__ import annotations

import math
from typing import Any

#: The residual dimension held constant by :func:`calibrate`.
CONSTANT_DIM = 0


def relu_llama(
    *,
    hidden: int = 2048,
    ffn: int = 5632,
    layers: int = 8,
    heads: int = 16,
    kv_heads: int = 8,
    vocab: int = 32000,
    max_positions: int = 131072,
    seed: int = 0,
    dtype: Any = None,
    device: Any = "cpu",
) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` with ReLU MLPs (bf16 by default), in
    eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_act="relu",
        max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype or torch.bfloat16).eval()


def _mlps(model: Any) -> list[Any]:
    return [layer.mlp for layer in model.model.layers]


def random_tokens(model: Any, batch: int, length: int, seed: int) -> Any:
    """Token ids drawn uniformly from the vocabulary (ids 0-2 left out), on the model's
    device."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, length), generator=generator)
    return ids.to(next(model.parameters()).device)


def _mlp_inputs(model: Any, layer: int, ids: Any, chunk: int) -> Any:
    """The inputs of MLP ``layer`` (float32 ``[tokens, K]``) for ``ids``."""
    import torch

    captured: list[Any] = []
    mlp = _mlps(model)[layer]

    def hook(module: Any, args: tuple) -> None:
        captured.append(args[0].reshape(-1, args[0].shape[-1]).float())

    handle = mlp.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], chunk):
                model.model(input_ids=ids[start : start + chunk], use_cache=False)
    finally:
        handle.remove()
    return torch.cat(captured)


def target_shares(n: int, l0: float, *, dead: float = 0.3, sigma: float = 1.0,
                  seed: int = 0) -> Any:  # fmt: skip
    """Per-unit firing shares (float64 ``[n]``): ``dead`` of the units 0, the others
    log-normal (``sigma``) with mean ``l0 / n`` over all units, at most 0.5."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shares = np.exp(sigma * rng.standard_normal(n))
    shares[rng.permutation(n)[: int(round(dead * n))]] = 0.0
    for _ in range(20):  # scale to the mean, then clip; a few rounds settle it
        shares *= l0 / max(shares.sum(), 1e-12)
        shares = np.minimum(shares, 0.5)
    return shares


def calibrate(
    model: Any,
    l0: float = 29.0,
    *,
    sequences: int = 32,
    length: int = 512,
    dead: float = 0.3,
    sigma: float = 1.0,
    seed: int = 0,
    chunk: int = 8,
    ids: Any = None,
) -> None:
    """Set the gate thresholds of every MLP of a :func:`relu_llama` model (in place, in
    layer order) so that each unit fires on its share of ``sequences × length``
    calibration tokens (:func:`target_shares`, mean ``l0`` units per token), or of the
    token ids ``ids [sequences, length]`` when given (long sequences differ from each
    other: a threshold set on one moves another's L0 by a large factor, so a benchmark
    of a few long sequences calibrates on its own). Call it on a dense model, before
    :func:`twell.torch.sparsify` (or copy its state dict into the sparse model after)."""
    import torch

    d = CONSTANT_DIM
    with torch.no_grad():
        model.model.embed_tokens.weight[:, d] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[d, :] = 0.0
            layer.mlp.down_proj.weight[d, :] = 0.0
    if ids is None:
        ids = random_tokens(model, sequences, length, seed)
    for index, mlp in enumerate(_mlps(model)):
        x = _mlp_inputs(model, index, ids, chunk)  # [T, K], x[:, d] > 0
        w = mlp.gate_proj.weight
        n = w.shape[0]
        shares = torch.as_tensor(
            target_shares(n, l0, dead=dead, sigma=sigma, seed=seed + 1 + index),
            device=x.device,
        )
        with torch.no_grad():
            wf = w.float()
            rest = x @ wf.T - x[:, d : d + 1] * wf[:, d]  # [T, N], without the threshold
            # Unit n fires on token t when rest + x_d * b_n > 0, i.e. b_n > -rest / x_d.
            ratio = (-rest / x[:, d : d + 1]).T.contiguous()  # [N, T]
            del rest
            ratio, _ = torch.sort(ratio, dim=1)
            t = ratio.shape[1]
            rank = torch.clamp((shares * t).floor().long(), 0, t - 1)
            b = ratio.gather(1, rank[:, None])[:, 0]
            # A dead unit: below every calibration token's ratio, with a wide margin.
            spread = (ratio[:, -1] - ratio[:, 0]).clamp_min(1e-3)
            b = torch.where(shares > 0, b, ratio[:, 0] - 4 * spread)
            w[:, d] = b.to(w.dtype)
            del ratio


def activity(model: Any, ids: Any, limit: int, chunk: int = 8) -> tuple[list[float], list[float]]:
    """Of each MLP on ``ids``, in one forward pass: the mean active units per token and
    the share of tokens with more than ``limit`` of them (the rows twell sends to dense
    math). Dense math on the MLP inputs: works before and after ``sparsify``."""
    import torch

    mlps = _mlps(model)
    active = [0] * len(mlps)
    heavy = [0] * len(mlps)
    tokens = [0] * len(mlps)

    def hook(index: int) -> Any:
        w = mlps[index].gate_proj.weight

        def count(module: Any, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])
            per_token = ((x.to(w.dtype) @ w.T) > 0).sum(dim=1)
            active[index] += int(per_token.sum())
            heavy[index] += int((per_token > limit).sum())
            tokens[index] += x.shape[0]

        return count

    handles = [mlp.register_forward_pre_hook(hook(i)) for i, mlp in enumerate(mlps)]
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], chunk):
                model.model(input_ids=ids[start : start + chunk], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return (
        [a / max(1, t) for a, t in zip(active, tokens, strict=True)],
        [h / max(1, t) for h, t in zip(heavy, tokens, strict=True)],
    )


def l0_per_layer(model: Any, ids: Any, chunk: int = 8) -> list[float]:
    """Mean active units per token of each MLP on ``ids`` (:func:`activity`)."""
    return activity(model, ids, 0, chunk)[0]


def heavy_share(model: Any, ids: Any, limit: int, chunk: int = 8) -> list[float]:
    """Share of tokens of each MLP with more than ``limit`` active units (:func:`activity`)."""
    return activity(model, ids, limit, chunk)[1]


def greedy_gap(model: Any, sequences: Any, prompt: int) -> float:
    """How far from greedy under ``model`` (run eagerly, no cache) ``sequences`` are: the
    largest gap, over the positions after ``prompt``, between the logits' maximum and the
    logit of the token chosen, relative to the logits' largest magnitude (0: every token
    is the model's argmax or ties with it). Compiled and eager models round differently,
    so their greedy tokens can part at a near tie; a small gap says they did only there."""
    import torch

    with torch.no_grad():
        logits = model(sequences).logits[:, prompt - 1 : -1].float()
    chosen = logits.gather(2, sequences[:, prompt:, None])[..., 0]
    gap = logits.max(dim=2).values - chosen
    return float(gap.max() / logits.abs().max())


def mlp_share_cap(share: float, mlp_speedup: float) -> float:
    """The whole-model speedup when a fraction ``share`` of the dense model's time is
    MLP work and that work gets ``mlp_speedup`` faster (Amdahl)."""
    return 1.0 / ((1.0 - share) + share / mlp_speedup) if mlp_speedup > 0 else math.nan
