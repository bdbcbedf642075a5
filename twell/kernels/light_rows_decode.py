"""Launcher of ``light_rows_decode.cu``: the fused route's light rows for few tokens.

:func:`from_pre` has the contract of :func:`twell.kernels.light_rows.from_pre` (which
calls it up to :data:`DECODE_ROWS_BELOW` tokens): from the bf16 gate pre-activation it
writes ``heavy[m]`` for every row and the light rows of ``y``; heavy rows of ``y`` are
left as they are. One launch on CuPy's current stream, no allocation, no host
synchronisation: it can be captured in a CUDA graph.

The kernel splits every weight row over the CTAs of a thread-block cluster (its
``__cluster_dims__``, so CuPy's plain launch starts clusters); the number of clusters is
the driver's ``cuOccupancyMaxActiveClusters``, asked once per device and compiled variant
(:func:`twell.kernels.compile.max_active_clusters`), at most M.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twell import tuning
from twell.kernels.buffers import u16
from twell.kernels.compile import Source, declare, launch_after, max_active_clusters
from twell.options import LIST_CAPACITY

#: Up to this many tokens (M <= DECODE_ROWS_BELOW), ``light_rows.from_pre`` runs this
#: kernel; above, light_rows.cu's (H100, K=2048, N=5632, gated, 64 tokens: 22.8 µs against
#: 31.6; at 256 tokens 75.2 against 39.4). The two sum in different orders, so a row's
#: output bits depend on which side of this bound M lies (and, here, on M and the
#: device's cluster count); within one kernel they are identical run to run.
DECODE_ROWS_BELOW: int = tuning.value("light_rows_decode.DECODE_ROWS_BELOW")
#: Threads per CTA, CTAs per cluster, and the dynamic shared memory of a CTA (the sm_90
#: opt-in maximum: one CTA per SM; the kernel sizes its staging ring to fit and
#: static_asserts that its layout does).
THREADS = 256
CLUSTER = 8
SMEM_BYTES = 232448
#: Most (token, unit) pairs of one batch of tokens (the kernel's shared pair list).
PAIR_CAPACITY = 4096

SOURCE = declare(
    Source(
        "light_rows_decode.cu",
        parameters=("KDIM", "TILE", "SLOTS", "GATED"),
        dependent=("twell_light_rows_decode",),
        constants={
            "THREADS": THREADS, "CLUSTER": CLUSTER, "SMEM_BYTES": SMEM_BYTES,
            "LIST_CAPACITY": LIST_CAPACITY, "PAIR_CAPACITY": PAIR_CAPACITY,
        },
        examples=tuple(
            {"KDIM": k, "TILE": 256, "SLOTS": 32, "GATED": g}
            for k in (8, 264, 2048, 4096) for g in (0, 1)
        ) + tuple(
            {"KDIM": k, "TILE": t, "SLOTS": s, "GATED": g}
            for k, t, s in [(2048, 128, 16), (2048, 64, 8), (1032, 32, 2), (4096, 256, 128),
                            (2048, 256, 256)]
            for g in (0, 1)
        ),
    )
)  # fmt: skip

_NULL = np.uint64(0)
_FUNCTION = "twell_light_rows_decode"


def from_pre(
    x: Any | None, pre: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int,
) -> None:  # fmt: skip
    """Light rows of ``y`` straight from the bf16 pre-activation ``pre [M, N]``; writes
    ``heavy[m]`` (1: the row is left to the dense path) for every row. Gated if ``w_up``
    is given."""
    _launch(x, pre, heavy, w_up, w_down_t, y, tile=tile, slots=slots,
            max_row_nnz=max_row_nnz)  # fmt: skip


def _launch(
    x: Any | None, pre: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int, slots: int, max_row_nnz: int, clusters: int | None = None,
) -> None:  # fmt: skip
    """:func:`from_pre`, with the number of clusters given (``None``: as many as fit at
    once; other counts serve timing probes). Any number gives a correct result."""
    m, k = y.shape
    if m == 0:
        return
    gated = w_up is not None
    kernel = SOURCE.kernel(_FUNCTION, KDIM=k, TILE=tile, SLOTS=slots, GATED=int(gated))
    if kernel.max_dynamic_shared_size_bytes < SMEM_BYTES:
        kernel.max_dynamic_shared_size_bytes = SMEM_BYTES
    count = max(1, min(m, _clusters(kernel) if clusters is None else int(clusters)))
    launch_after(  # may start while the gate GEMM's last CTAs run
        kernel, (count * CLUSTER,), (THREADS,),
        (
            u16(x) if gated else _NULL, u16(pre), heavy, u16(w_up) if gated else _NULL,
            u16(w_down_t), u16(y), np.int32(m), np.int32(w_down_t.shape[0]),
            np.int32(max_row_nnz),
        ),
        SMEM_BYTES,
    )  # fmt: skip


def _clusters(kernel: Any) -> int:
    """Clusters of the kernel that fit on the current device at once (more would run in
    a second wave): :func:`twell.kernels.compile.max_active_clusters`."""
    return max_active_clusters(kernel, CLUSTER, THREADS, SMEM_BYTES)
