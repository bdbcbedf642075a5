"""A prepared GPU block and the call graphs of its torch calls: what :class:`twell.SparseFFN`
holds for GPU weights and what twell.inference's registry keeps per torch weights."""

from __future__ import annotations

from typing import Any

from twell._graphs import GraphedBlock, _capturing
from twell._interop import on_gpu
from twell._validation import check_inputs
from twell.options import Options

__all__ = ["check_weights", "prepare_gpu"]


def check_weights(weights: dict[str, Any], options: Options) -> None:
    """The checks :class:`SparseFFN` makes of its weights (``{"w_gate": ..., "w_up": ...,
    "w_down": ...}`` in ``torch.nn.Linear`` layouts; ``w_gate`` may be None)."""
    check_inputs(
        weights={"w_gate": (weights["w_gate"], "NK"), "w_up": (weights["w_up"], "NK"),
                 "w_down": (weights["w_down"], "KN")},
        tile=options.tile, slots=options.slots,
    )  # fmt: skip


def prepare_gpu(
    library: str, weights: dict[str, Any], options: Options, *, borrow: bool = False
) -> tuple[Any, GraphedBlock]:
    """The :class:`~twell.kernels.pipeline.PreparedBlock` of validated GPU weights
    (``{"w_gate": ..., "w_up": ..., "w_down": ...}``, CuPy or torch) and the
    :class:`~twell._graphs.GraphedBlock` that replays its torch calls.

    ``borrow`` (torch weights): the prepared block reads the weights without keeping
    them alive (twell.inference's registry, which drops a block when its weights'
    storage dies). Inside a CUDA-graph capture the weights are not checked on the host
    (that would synchronise): the block then runs dense math, which is right for any
    weights."""
    capturing = library == "torch" and _capturing()
    from twell.kernels import PreparedBlock

    with on_gpu(library, weights, borrow=borrow) as (g, _):
        prepared = PreparedBlock(
            g.get("w_gate"), g["w_up"], g["w_down"], options, check_weights=not capturing
        )
    # The graph cache refers to the prepared block, not to its owner: no reference cycle,
    # so a dropped SparseFFN frees its graphs at once rather than in a later garbage
    # collection that may fall inside someone else's graph capture.
    graphed = GraphedBlock(
        lambda x: _eager_torch(prepared, x), prepared.density, prepared._graph_scratch
    )
    return prepared, graphed


def _eager_torch(prepared: Any, x: Any) -> Any:
    """One call of a prepared block on a validated 2-D torch tensor."""
    with on_gpu("torch", {"x": x}) as (d, to_caller):
        return to_caller(prepared(d["x"]))
