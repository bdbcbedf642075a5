"""Which training setups capture in one CUDA graph (forward + loss + backward) with twell's
SparseMLP: prints PASS/FAIL per variant (debugging aid). The "eager" variants run eager
steps first (on torch's legacy default stream, or on a side stream): a capture fails if
anything keeps those steps' autograd graph alive, since torch then reuses the parameters'
gradient accumulators made on the legacy stream (SparseMLP's ``l1`` attribute did that
until it detached itself once the backward has passed the layer).

    PYTHONPATH=. python bench/debug_train_capture.py
"""

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
import train_small  # noqa: E402

import twell.torch as twell_torch  # noqa: E402


def attempt(name: str, model: torch.nn.Module, batch: torch.Tensor, autocast: bool,
            penalty: bool, grad: bool = True) -> None:  # fmt: skip
    def body() -> None:
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast, cache_enabled=False):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        if penalty:
            loss = loss + 1e-4 * twell_torch.l1_penalty(model)
        if grad:
            loss.backward()

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                body()
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        graph.replay()
        torch.cuda.synchronize()
        print(f"PASS {name}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        tb = traceback.format_exc().splitlines()
        print("   " + "\n   ".join([line for line in tb if "File" in line][-14:]), flush=True)


VARIANTS = [(a, p, g, False) for a in (False, True) for p in (False, True) for g in (False, True)]
VARIANTS.append((False, True, True, True))  # bf16 parameters, no autocast


def after_eager(on_side_stream: bool, cleared: bool = False) -> None:
    """train_small's default model: eager L1 training steps (default stream or a side
    stream), then the whole-step capture."""
    config = train_small.Config(l1_warmup=0.0)
    model = train_small.build_model(config, torch.device("cuda"), sparse=True)
    optimizer = train_small.make_optimizer(model, config)
    data = torch.randint(0, 256, (config.batch, config.seq + 1), device="cuda")
    stream = torch.cuda.Stream() if on_side_stream else torch.cuda.current_stream()

    def step() -> torch.Tensor:  # its locals (and their autograd graph) die on return
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        (loss + 1e-3 * twell_torch.l1_penalty(model)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    with torch.cuda.stream(stream):
        for _ in range(5):
            step()
    torch.cuda.synchronize()
    if cleared:  # what SparseMLP keeps is released too (before it detached its l1 itself)
        for mlp in train_small.sparse_mlps(model):
            mlp.l1 = mlp.l0 = None
    try:
        train_small.GraphedStep(model, True, data)
        print(f"PASS full model after eager steps (side stream: {on_side_stream}, "
              f"graphs released: {cleared})", flush=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001
        print(f"FAIL full model after eager steps (side stream: {on_side_stream}, graphs "
              f"released: {cleared}): {str(e).splitlines()[0]}", flush=True)  # fmt: skip


def main() -> None:
    if len(sys.argv) == 1:  # each variant in its own process (a failed capture may linger)
        import subprocess

        for i in [*range(len(VARIANTS)), "eager", "eager-side", "eager-cleared"]:
            subprocess.run([sys.executable, __file__, str(i)], check=False, timeout=120)
        return
    if sys.argv[1].startswith("eager"):
        after_eager(sys.argv[1] == "eager-side", sys.argv[1] == "eager-cleared")
        return
    autocast, penalty, grad, bf16 = VARIANTS[int(sys.argv[1])]
    config = train_small.Config(layers=2, hidden=256, ffn=1024, heads=4, seq=128, batch=4)
    data = torch.randint(0, 256, (4, 129), device="cuda")
    model = train_small.build_model(config, torch.device("cuda"), sparse=True)
    if bf16:
        model = model.bfloat16()
    name = f"autocast={autocast} penalty={penalty} backward={grad} bf16_params={bf16}"
    attempt(name, model, data, autocast, penalty, grad)


if __name__ == "__main__":
    main()
