"""End-to-end: a 2B Llama-architecture decoder forward, dense MLPs against twell MLPs.

Configuration (docs/benchmark.md): 38 layers, hidden 2048, FFN 5632, 32 heads, vocab
49152, ReLU MLPs, random weights; forward of 64 sequences × 2048 tokens (the base model's
last hidden state: the 49152-wide logits of 131072 tokens would not fit and are not MLP
work).

Making the random model's MLPs sparse the way a trained ReLU model's are. A Llama MLP has
no bias, so the gate threshold rides on a constant input dimension:

- dimension 0 of every token embedding is 1, and row 0 of every ``o_proj`` and
  ``down_proj`` is zero, so dimension 0 of the residual stream stays exactly 1;
- RMSNorm divides a token's whole vector by one positive number, which changes no sign;
- unit n fires for token t iff ``B[t, n] > −w_gate[n, 0]``, where
  ``B[t, n] = pre[t, n] / x[t, 0]`` (the RMS scale cancels); layer by layer (each layer's
  input depends on the layers before), a calibration batch sets
  ``w_gate[n, 0] = −(mean_t B[t, n] + z_n · std_t B[t, n])`` with ``z_n`` the per-unit
  thresholds of the ``paperlike`` workload (30% dead units, log-normal rates).

Thresholds are calibrated on tokens spread over 8 sequences; the realized L0 of every
layer and the share of tokens routed dense are measured on 8 held-out sequences.

    PYTHONPATH=. python bench/bench_decoder.py            # needs torch, transformers, cupy
    PYTHONPATH=. python bench/bench_decoder.py --layers 4 --batch 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np


def build_model(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
        max_position_embeddings=args.seq, hidden_act="relu",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    base = model.model
    with torch.no_grad():
        base.embed_tokens.weight[:, 0] = 1.0
        for layer in base.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
            layer.mlp.gate_proj.weight[:, 0] = 0.0
    return model


def calibrate(model: Any, ids: Any, args: argparse.Namespace) -> None:
    """Set every layer's threshold column, first layer first."""
    import torch

    from twell import workloads

    base = model.model
    for index, layer in enumerate(base.layers):
        captured: list[Any] = []
        handle = layer.mlp.register_forward_pre_hook(lambda _m, a, into=captured: into.append(a[0]))
        try:
            with torch.inference_mode():
                base(ids)
        finally:
            handle.remove()
        x = captured[0].reshape(-1, args.hidden)
        x = x[:: max(1, x.shape[0] // args.calibration_tokens)].float()  # spread over the batch
        w = layer.mlp.gate_proj.weight.float()
        # B[t, n] = pre[t, n] / x[t, 0] (x[t, 0] = γ₀ / rms_t > 0 cancels the RMS scale).
        # With w[n, 0] set, pre[t, n] = x[t, 0] · (w[n, 0] + B[t, n]): unit n fires iff
        # B[t, n] > −w[n, 0]. B is not centred (tokens share directions after attention).
        scores = (x[:, 1:] @ w[:, 1:].T) / x[:, :1]
        z = workloads.paperlike(1, args.hidden, args.ffn, seed=index).params["unit_threshold"]
        z = torch.from_numpy(z).to(scores.device)
        mean, spread = scores.mean(dim=0), z * scores.std(dim=0)
        target = workloads.PAPER_L0_PER_UNIT * args.ffn
        low, high = 0.0, 4.0  # bisect the scale α of the thresholds to the paper's L0
        for _ in range(30):
            alpha = 0.5 * (low + high)
            l0 = float((scores > mean + alpha * spread).sum()) / scores.shape[0]
            low, high = (alpha, high) if l0 > target else (low, alpha)
        threshold = -(mean + high * spread)
        with torch.no_grad():
            layer.mlp.gate_proj.weight[:, 0] = threshold.to(torch.bfloat16)


def measure_l0(model: Any, ids: Any) -> tuple[list[float], list[float]]:
    """Per layer: mean active units per token, and the share of tokens routed dense
    (more than 3% of N active, or a 256-unit tile over 31: twell's defaults)."""
    import torch

    l0, dense_share = [], []

    def hook(mlp: Any, inputs: tuple) -> None:
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        active = mlp.gate_proj(x) > 0
        per_token = active.sum(dim=1)
        overflow = (active.reshape(x.shape[0], -1, 256).sum(dim=2) > 31).any(dim=1)
        heavy = (per_token > 0.03 * active.shape[1]) | overflow
        l0.append(float(per_token.float().mean()))
        dense_share.append(float(heavy.float().mean()))

    hooks = [layer.mlp.register_forward_pre_hook(hook) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model.model(ids)
    finally:
        for h in hooks:
            h.remove()
    return l0, dense_share


def time_forward(model: Any, ids: Any, warmup: int, reps: int) -> tuple[float, Any]:
    """Median milliseconds of the base model's forward (:func:`twell.timing.per_call_ms`
    on a GPU, the wall clock on the CPU) and its last hidden state."""
    import time

    import torch

    from twell.timing import per_call_ms

    def forward(_: int = 0) -> Any:
        return model.model(ids).last_hidden_state

    with torch.inference_mode():
        if ids.is_cuda:
            return per_call_ms(forward, reps=reps, warmup=warmup), forward()
        times = []
        for _ in range(warmup + reps):
            begin = time.perf_counter()
            out = forward()
            times.append(1e3 * (time.perf_counter() - begin))
        return statistics.median(times[warmup:]), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=38)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--calibration-sequences", type=int, default=8)
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=4096,
        help="tokens sampled across the calibration sequences",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument(
        "--dense-capacity",
        type=lambda v: v if v == "auto" else float(v),
        default="auto",
        help="SparseMLP dense_capacity: auto (the default: sized per call from the measured "
        "share of heavy rows) or a fraction of tokens whose heavy rows use cuBLAS",
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="JSON record file (default: bench/results/<gpu>/decoder.json; a rerun replaces "
        "the record of the same configuration)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    import torch

    import twell.torch
    from twell.testing.asserts import relative_error

    model = build_model(args)
    ids = torch.randint(0, 49152, (args.batch, args.seq), device=args.device)
    calibrate(model, ids[: args.calibration_sequences], args)
    held_out = ids[args.calibration_sequences : 2 * args.calibration_sequences]
    l0, dense_share = measure_l0(model, held_out)
    t_dense, y_dense = time_forward(model, ids, args.warmup, args.reps)
    y_dense = y_dense[:2].float().cpu().numpy()
    replaced = twell.torch.sparsify(model, dense_capacity=args.dense_capacity)
    t_twell, y_twell = time_forward(model, ids, args.warmup, args.reps)
    rel_err = relative_error(y_twell[:2].float().cpu().numpy(), y_dense)
    record = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "op": "decoder_forward",
        "workload": "llama2b-relu-calibrated",
        "layers": args.layers, "M": args.batch * args.seq, "K": args.hidden, "N": args.ffn,
        "tile": 256, "slots": 32, "mlps_replaced": replaced, "dense_capacity": args.dense_capacity,
        "t_ms": t_twell, "t_dense_ms": t_dense, "speedup": t_dense / t_twell,
        "rel_err": rel_err, "l0": float(np.mean(l0)), "l0_per_layer": l0,
        "dense_rows_share_per_layer": dense_share,
        "torch": torch.__version__,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in record.items() if not k.endswith("_per_layer")}))
    print(f"L0 per layer: {' '.join(f'{v:.0f}' for v in l0)}")
    print(f"dense-routed tokens per layer (%): {' '.join(f'{100 * v:.1f}' for v in dense_share)}")
    if args.device == "cuda" or args.out is not None:
        from twell.timing import merge_records, record_path

        path = merge_records(args.out or record_path("decoder", record["gpu"]), [record])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
