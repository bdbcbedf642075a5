"""The training ops on CUDA (twell.autograd): outputs shaped as their fake implementations
promise, the non-gated op against the float64 reference, and op graphs (``graphs=True``)
that replay the eager bits into fresh tensors.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_helpers import op_args  # noqa: E402

from twell import reference, workloads  # noqa: E402
from twell.autograd import ffn_train_backward, ffn_train_forward  # noqa: E402
from twell.testing.asserts import relative_error  # noqa: E402

# Through torch's ops, whose buffers come from torch's allocator.
pytestmark = pytest.mark.unpoisoned


@pytest.mark.parametrize("m", [40, 0])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_gpu_ops_match_their_fake_implementations(gated: bool, m: int) -> None:
    """On CUDA too, the ops' outputs have the shapes, dtypes and strides their fake
    implementations promise (``up``: [M, R] gated, [M, 0] not; M = 0 included). Only
    these checks: some outputs have unspecified elements (``ids`` past the count, ``up``
    past a row's entries), which opcheck's eager-against-compiled comparison would read."""
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    x, w_gate, w_up, w_down = (
        None if t is None else t.detach().cuda().bfloat16().requires_grad_()
        for t in op_args(torch.float32, gated, m=m, k=64, n=256)
    )
    settings = (64, 16, -1, 0.0, "mean")
    torch.library.opcheck(ffn_train_forward, (x, w_gate, w_up, w_down, *settings), test_utils=utils)
    with torch.no_grad():
        out = ffn_train_forward(x, w_gate, w_up, w_down, *settings)
    assert out[6].shape == (m, 16 if gated else 0) and out[6].dtype == torch.float32
    detached = [None if t is None else t.detach() for t in (x, w_gate, w_up, w_down)]
    dy = torch.randn_like(detached[0])
    torch.library.opcheck(
        ffn_train_backward, (dy, torch.tensor(0.5, device="cuda"), *detached, *out[2:], *settings),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@pytest.mark.parametrize("task", [True, False], ids=["task", "l1-only"])
def test_gpu_nongated_op_matches_the_reference(task: bool) -> None:
    problem = workloads.heavy(1024, 256, 1024, seed=4).as_nongated()
    _, _, wu64, wd64 = problem.arrays()
    x, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16().requires_grad_()
                 for a in (problem.x, wu64, wd64))  # fmt: skip
    y, l1, *_ = ffn_train_forward(x, None, wu, wd, 256, 32, -1, 0.0, "mean")
    dy = torch.randn_like(y) if task else torch.zeros_like(y)
    loss = 1.0 * l1 + ((y * dy).float().sum() if task else 0.0)
    loss.backward()
    want = reference.ffn_backward(problem.x, None, wu64, wd64, dy.double().cpu().numpy(), 1.0)
    for got, ref in zip((x.grad, wu.grad, wd.grad), (want[0], want[2], want[3]), strict=True):
        if not np.any(ref):
            assert got is None or not torch.any(got)
            continue
        assert relative_error(got.double().cpu().numpy(), ref) < 2e-2


def assert_same_training_outputs(want: tuple, got: tuple, slots: int) -> None:
    """The forward op's outputs equal where they are specified: ``y``, ``l1``, ``heavy``,
    ``count``, the heavy ids ``ids[:count]``, the TwELL words of light rows up to each
    tile's count, and the up products of light rows up to their entry count (a tile's
    unused slots, the ids past the count and the rest of ``up`` are unspecified)."""
    y, l1, packed, heavy, ids, count, up = want
    for a, b in zip((y, l1, heavy, count), (got[0], got[1], got[3], got[5]), strict=True):
        assert torch.equal(a, b)
    n = int(count[0])
    assert torch.equal(ids[:n], got[4][:n])
    m = packed.shape[0]
    words, other = packed.view(m, -1, slots), got[2].view(m, -1, slots)
    light = heavy == 0
    assert torch.equal(words[light, :, 0], other[light, :, 0])
    slot = torch.arange(slots, device=packed.device)
    valid = slot[None, None, :] <= words[:, :, :1].clamp(max=slots - 1)
    valid &= light[:, None, None]
    assert torch.equal(words[valid], other[valid])
    entries = words[:, :, 0].clamp(max=slots - 1).sum(dim=1)
    rank = torch.arange(up.shape[1], device=up.device)
    kept = light[:, None] & (rank[None, :] < entries[:, None])
    assert bool(kept.any()) and torch.equal(up[kept], got[6][kept])


@pytest.mark.parametrize("workload", ["uniform", "heavy"])
def test_gpu_op_graphs_replay_the_eager_bits_into_fresh_tensors(workload: str) -> None:
    """graphs=True: the first call runs eagerly, the second captures, later ones replay;
    every call returns the eager op's bits, and a replay does not change what an earlier
    call returned (``y`` and the backward's results are handed over in the graph's own
    tensors, written again only once nothing holds them; the kept ``y`` holds a slot). The weights
    are read where they lie (changed in place, as an optimizer does); every other input
    is a new tensor each step, which the graph copies in."""
    from twell import autograd

    p = workloads.make(workload, 333, 256, 1024, seed=3)
    x0, wg, wu, wd = (torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
                      for a in p.arrays())  # fmt: skip
    settings = (256, 32, -1, 0.0, "per_token")
    fw, bw = autograd._OP_FORWARD_GRAPHS, autograd._BACKWARD_GRAPHS
    before = (fw.captures, fw.replays, bw.captures, bw.replays)
    kept = []
    for step in range(4):
        with torch.no_grad():
            wu.mul_(1.0 - 0.0625 * step)
        x = x0 * (1.0 + 0.125 * step)  # new tensors every step
        dy = torch.randn_like(x)
        dl1 = torch.full((), 0.5 + step, device="cuda")
        want = ffn_train_forward(x, wg, wu, wd, *settings)
        got = ffn_train_forward(x.clone(), wg, wu, wd, *settings, True)
        saved = [t.clone() for t in got[2:]]
        want_g = ffn_train_backward(dy, dl1, x, wg, wu, wd, *want[2:], *settings)
        got_g = ffn_train_backward(dy.clone(), dl1.clone(), x.clone(), wg, wu, wd, *saved,
                                   *settings, True)  # fmt: skip
        assert_same_training_outputs(want, got, slots=32)
        for a, b in zip(want_g, got_g, strict=True):
            assert torch.equal(a, b)
        kept.append([t.clone() for t in got + got_g])
        kept[-1].append(got[0])  # the returned y itself, to check after later replays
        # The backward's results are handed over in the graph's own tensors (bf16): held
        # into the next step they would have it capture a second graph.
        del got_g, a, b
    for values in kept:
        assert torch.equal(values[-1], values[0])
    assert not torch.equal(kept[0][0], kept[-1][0])
    after = (fw.captures, fw.replays, bw.captures, bw.replays)
    # (an earlier test's graph serves this one if its weights landed at the same places)
    # The forward's y, kept above, holds its graph: a second slot, then eager calls.
    assert after[0] - before[0] <= 2 and after[1] - before[1] == 2
    assert (after[2] - before[2], after[3] - before[3]) in ((1, 3), (0, 4))
