"""twell.warmup on CUDA: the planned modules are every module the model's calls then
need, planning leaves nothing behind, and the report says what happened."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from twell import warmup  # noqa: E402
from twell.kernels import compile as kc  # noqa: E402
from twell.torch import SparseMLP  # noqa: E402

pytestmark = pytest.mark.unpoisoned

TOKENS = (1, 64, 1500)
TRAINING = (700,)


def _mlp(k: int, n: int, seed: int) -> SparseMLP:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b, bias=False) for a, b in ((k, n), (k, n), (n, k))]
    for layer in layers:
        torch.nn.init.normal_(layer.weight, std=k**-0.5)
    return SparseMLP(*layers).cuda().bfloat16()


def _calls(mlp: SparseMLP, k: int) -> list[torch.Tensor]:
    outputs = []
    with torch.no_grad():
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outputs.append(mlp(x))
    mlp.train()
    for m in TRAINING:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = mlp(x)
        (y.float().square().sum() + mlp.l1).backward()
        outputs += [y.detach(), x.grad, mlp.gate_proj.weight.grad]
    mlp.eval()
    return outputs


def test_warmup_plans_every_module_the_calls_need_and_leaves_no_state() -> None:
    k, n = 384, 1792
    model = torch.nn.Sequential(_mlp(k, n, 0))
    torch.manual_seed(1)
    report = warmup.warmup(model, tokens=TOKENS, training=True, training_tokens=TRAINING)
    assert not report.failed, str(report)
    assert report.layers == 1 and report.planned > 0
    compiled = set(kc._modules)
    torch.manual_seed(2)
    first = _calls(model[0], k)
    assert set(kc._modules) == compiled, "a call compiled a module the plan missed"
    # Planning left nothing a later call sees: a second model with the same weights
    # gives the same bits on the same inputs.
    twin = torch.nn.Sequential(_mlp(k, n, 0))
    torch.manual_seed(2)
    second = _calls(twin[0], k)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
