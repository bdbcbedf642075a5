"""Launcher of ``decode_units_gate.cu``, ``decode_units_down.cu`` and
``decode_units_scan.cu`` (their shared device code: ``decode_units.cuh``): the whole FFN
block for at most :data:`MAX_ROWS` tokens, with the work divided among the SMs by hidden
unit (each active unit's weight rows read once for all the tokens that use it) instead
of by token.

:func:`forward` writes every row of ``y`` in two launches on CuPy's current stream: the
gate of 16 to 64 units per CTA on tensor cores with the up dot products of the kept
pairs (mma.sync up to :data:`MMA_GATE_TOKENS` tokens; a TMA ring and wgmma up to
:data:`WGMMA_TOKENS`; above, read from a cuBLAS GEMM before them), then the down
projection: up to :data:`SCAN_TOKENS` tokens by one CTA per (token, 32 columns) listing
the token's kept units by a prefix sum, above by slices of columns and groups of at most
:data:`DOWN_TOKENS` tokens. No heavy rows (a unit list has no capacity: rows with many
active units, or a non-finite pre-activation, are summed over all their kept units), no
allocation but the scratch outputs, no host synchronisation: it can be captured in a
CUDA graph (above :data:`WGMMA_TOKENS` tokens torch must be imported: the gate GEMM then
runs through it, and its bits may differ from CuPy's eager GEMM; see
``cublas.gemm_nt``). ``PreparedBlock.forward`` takes it for inference calls of the
``"fused"`` path when :func:`fits` says so, with the density switch's estimate of units
per token as a hint for the scan's CTA size.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from twell import tuning
from twell.kernels.buffers import alloc, u16
from twell.kernels.compile import Source, declare, device_info, launch_after
from twell.kernels.cublas import gemm_nt
from twell.kernels.gate_gemm import tensor_map
from twell.options import MAX_COLUMNS

#: Most tokens ``PreparedBlock.forward`` sends here; above, the per-token kernels (on an
#: H100 the route is ahead up to 192 tokens: 49.5 against 53.0 µs at K=2048, N=5632; on
#: an H200 up to 64, where the per-token route's by-columns light rows take over: 29.8
#: against 31.1 µs at 96 tokens, 33.7 against 45.3 at 192). The
#: routes sum in different orders, so a row's output bits depend on which side of this
#: bound M lies.
MAX_ROWS: int = tuning.value("decode_units.MAX_ROWS")
#: Most tokens the kernels take (the tensor-core gate: 64).
MAX_TOKENS = 256
#: Units of an m16 tile of the gate kernel and its threads; the down kernel's
#: threads, columns of y per CTA, lanes per work unit (each lane sums up to 8 pairs of
#: one token, all loads in flight at once) and list entries per token and pass.
UNITS = 16
GATE_THREADS = 256
DOWN_THREADS = 256
DOWN_LANES = 4
LIST = 512
#: Most tokens whose down projection runs by a scan (``twell_units_down_scan``: one CTA
#: per token and 32 columns of y, the token's units listed by a prefix sum) rather than by
#: lists of eight-token groups (``twell_units_down``); a scan CTA has 64 or 128 threads
#: (:func:`scan_threads_for`; the output bits do not depend on it). On an H100 the scan
#: is ahead up to 64 tokens (29.2 against 30.1 µs) and behind at 96.
SCAN_TOKENS: int = tuning.value("decode_units.SCAN_TOKENS")
#: Mean kept units per token above which a scan CTA takes 128 threads at any token count
#: (:func:`scan_threads_for`).
SCAN_WIDE_UNITS: int = tuning.value("decode_units.SCAN_WIDE_UNITS")
#: Unit tiles per gate CTA by token count: (most tokens, tiles). The gate CTA reads all
#: of x, so more tokens want more units per CTA (fewer CTAs reading x).
UNIT_TILES = ((16, 1), (64, 2))
#: Most tokens per down CTA (a second grid dimension covers the rest).
DOWN_TOKENS = 8
#: Columns of y per down CTA, narrowest first (see :func:`down_columns`): wider slices
#: pay a CTA's list building once for more work.
DOWN_COLUMNS = (32, 64, 128)
#: Shared memory of an SM that CTAs can use (sm_90), and what a down CTA takes beyond
#: its dynamic shared memory (static arrays, the driver's reserve), with room to spare.
SHARED_PER_SM = 227 * 1024
STATIC_RESERVE = 4 * 1024
#: Most tokens whose gate the gate/up kernel computes itself by default (mma.sync, every
#: CTA reading all of x; :func:`gate_for`); the wgmma kernel above. From 17 tokens an
#: mma.sync CTA covers 32 tokens (H100, 17 tokens: 20.2 µs against 17.8 for wgmma).
MMA_GATE_TOKENS: int = tuning.value("decode_units.MMA_GATE_TOKENS")

#: The gate's computation (``forward``'s ``gate``): ``"mma"`` in the gate/up kernel
#: (mma.sync, every CTA reading all of x; at most 64 tokens), ``"cublas"`` (a GEMM into
#: an [M, N] pre-activation the gate/up kernel reads), ``"wgmma"`` (twell_units_gate_wgmma:
#: a TMA ring and wgmma, then the up products in the same kernel; at most 64 tokens) and
#: ``"wgmma_pre"`` (that kernel writing the pre-activation instead; measurements).
GATES = ("mma", "cublas", "wgmma", "wgmma_pre")
#: Most tokens whose gate the wgmma kernel computes by default (:func:`gate_for`; at most
#: 64, its tile's rows), above them cuBLAS's GEMM (H100: 28.2 against 28.5 µs at 64
#: tokens); then the kernel's 16-unit tiles per CTA and the depth of its TMA ring (64 or
#: 16 units per CTA, or six stages, were slower).
WGMMA_TOKENS: int = tuning.value("decode_units.WGMMA_TOKENS")
WGMMA_UNIT_TILES = 2
WGMMA_STAGES = 8

#: Example configurations of the route's parameters (the compile tests build each source
#: with the values of those it declares).
_EXAMPLES = tuple(
    {"KDIM": k, "GATED": g, "NT": nt, "UT": ut, "DC": dc, "PRE": pre, "STAGES": 0}
    for k in (8, 264, 2048, 4096) for g in (0, 1)
    for nt, ut, dc, pre in ((1, 1, 16, 0), (2, 1, 32, 0), (4, 2, 64, 0), (8, 4, 16, 0),
                            (8, 1, 64, 1), (2, 1, 32, 1), (32, 1, 64, 1))
) + tuple(
    {"KDIM": 2048, "GATED": g, "NT": nt, "UT": ut, "DC": 16, "PRE": 0, "STAGES": 0}
    for g in (0, 1) for nt, ut in ((4, 1), (8, 1), (8, 2), (4, 4), (1, 4))
) + tuple(
    {"KDIM": 2048, "GATED": g, "NT": 16, "UT": 1, "DC": 128, "PRE": 1, "STAGES": 0}
    for g in (0, 1)
) + tuple(
    {"KDIM": 4096, "GATED": 1, "NT": nt, "UT": ut, "DC": 64, "PRE": 1, "STAGES": 0}
    for nt, ut in ((32, 2), (16, 4))
) + tuple(  # the wgmma gate (STAGES > 0), fused and writing pre
    {"KDIM": k, "GATED": g, "NT": nt, "UT": ut, "DC": 16, "PRE": pre, "STAGES": st}
    for k, g, nt, ut, pre, st in ((2048, 1, 8, 2, 0, 8), (2048, 1, 4, 2, 0, 8),
                                  (2048, 1, 8, 4, 0, 6), (2048, 0, 4, 1, 0, 4),
                                  (264, 1, 1, 1, 0, 2), (4096, 1, 8, 2, 1, 8),
                                  (8, 1, 4, 2, 0, 3))
)  # fmt: skip


def _examples(parameters: tuple[str, ...]) -> tuple[dict[str, int], ...]:
    """:data:`_EXAMPLES` restricted to ``parameters``, each configuration once."""
    found = {tuple((p, e[p]) for p in parameters): None for e in _EXAMPLES}
    return tuple(dict(items) for items in found)


def _declare(name: str, parameters: tuple[str, ...], **fields: Any) -> Source:
    """Declare a source of the route: its parameters, their examples, the shared header."""
    return declare(Source(name, parameters=parameters, examples=_examples(parameters),
                          headers=("decode_units.cuh",), **fields))  # fmt: skip


# The route's sources, by job; a launch gives each the call's values of the parameters
# it declares.
#: The gate and the up products of the kept pairs (``twell_units_gate_up``, and
#: ``twell_units_gate_wgmma`` where ``STAGES`` > 0).
GATE = _declare(
    "decode_units_gate.cu", ("KDIM", "GATED", "NT", "UT", "PRE", "STAGES"),
    dependent=("twell_units_gate_up",),
    constants={"UNITS": UNITS, "GATE_THREADS": GATE_THREADS},
)  # fmt: skip
#: The down projection by lists of token groups (``twell_units_down``).
DOWN = _declare(
    "decode_units_down.cu", ("KDIM", "NT", "DC"), dependent=("twell_units_down",),
    constants={"DOWN_THREADS": DOWN_THREADS, "DOWN_LANES": DOWN_LANES, "LIST": LIST},
)  # fmt: skip
#: The down projection by a scan (``twell_units_down_scan64`` and ``..._scan128``).
SCAN = _declare(
    "decode_units_scan.cu", ("KDIM",),
    dependent=("twell_units_down_scan64", "twell_units_down_scan128"),
)  # fmt: skip

_NULL = np.uint64(0)


def fits(m: int, n: int, *, most: int | None = None) -> bool:
    """Whether a call of ``m`` tokens on ``n`` units takes this route (``most``: the
    token bound, :data:`MAX_ROWS` unless given; the kernels take up to
    :data:`MAX_TOKENS`): N a multiple of 32 and at most 65536 (the lists hold 16-bit
    unit ids; the down kernel's masks of :data:`DOWN_TOKENS` tokens then take at most
    64 KB of shared memory)."""
    return (
        1 <= m <= min(MAX_TOKENS, MAX_ROWS if most is None else most)
        and n % 32 == 0
        and n <= MAX_COLUMNS
    )


def token_tiles(m: int) -> int:
    """The kernels' ``NT`` for ``m`` tokens: 8-token tiles, a power of two (1 to 32)."""
    return 1 << max(0, math.ceil(math.log2(max(1, -(-m // 8)))))


def unit_tiles(m: int, n: int) -> int:
    """The gate kernel's ``UT`` for ``m`` tokens and ``n`` units (:data:`UNIT_TILES`,
    fewer where ``n`` is not a multiple of the CTA's units)."""
    ut = next((t for most, t in UNIT_TILES if m <= most), 1)
    while n % (UNITS * ut):
        ut //= 2
    return ut


def gate_for(m: int, n: int) -> str:
    """The gate ``forward`` uses by default for ``m`` tokens (``n`` units): ``"mma"`` up
    to :data:`MMA_GATE_TOKENS` tokens, ``"wgmma"`` up to :data:`WGMMA_TOKENS`, else
    ``"cublas"``."""
    return "mma" if m <= MMA_GATE_TOKENS else "wgmma" if m <= WGMMA_TOKENS else "cublas"


def scan_threads_for(m: int, units_per_token: float | None = None) -> int:
    """Threads of a scan CTA (64 or 128; the bits are the same) for ``m`` tokens that keep
    ``units_per_token`` units on average (the density switch's estimate; None: unknown).
    128 threads spread a token's units over 32 slots, 64 over 16 and make a grid of half
    the warps: 64 are ahead for tokens of few units past 8 tokens (H100, ``uniform``,
    28 units a token, M=64: 29.0 against 33.1 µs), 128 for tokens of many
    (``paperlike``, 47 on average, M=64: 35.8 against 39.4)."""
    heavy = units_per_token is not None and units_per_token > SCAN_WIDE_UNITS
    return 128 if m <= 8 or heavy else 64


def down_shared_bytes(m: int, n: int, columns: int, *, down_tokens: int = DOWN_TOKENS) -> int:
    """Dynamic shared memory of the down kernel (its layout in decode_units_down.cu) for a call
    of ``m`` tokens with at most ``down_tokens`` and ``columns`` of y per CTA."""
    tokens = 8 * token_tiles(min(m, down_tokens))
    rows = min(m, tokens)
    chunks = columns // 8
    work_units = tokens * (LIST // (8 * DOWN_LANES)) * chunks
    return 4 * (work_units * 8 + tokens * chunks * 8) + 2 * tokens * LIST + rows * (n // 32) * 4


@functools.cache  # a few ints in, one out: computed once per shape, not per call
def down_columns(
    m: int, k: int, n: int, multiprocessors: int, *, down_tokens: int = DOWN_TOKENS
) -> int:
    """The down kernel's columns of y per CTA for ``m`` tokens (width ``k``, ``n`` units):
    the narrowest of :data:`DOWN_COLUMNS` whose grid (column slices x groups of
    ``down_tokens`` tokens) fits one wave of two CTAs per SM, else 64. On an H100 a
    second wave cost more than wider slices (M=128: 44.4 µs with 64 columns, 39.8 with
    128; M=64: 35.9 with 32, 31.5 with 64)."""
    groups = -(-m // (8 * token_tiles(min(m, down_tokens))))
    for columns in DOWN_COLUMNS:
        shared = down_shared_bytes(m, n, columns, down_tokens=down_tokens)
        two = shared <= SHARED_PER_SM // 2 - STATIC_RESERVE
        if two and -(-k // columns) * groups <= 2 * multiprocessors:
            return columns
    return 64


def wgmma_shared_bytes(units: int, stages: int = WGMMA_STAGES) -> int:
    """Dynamic shared memory of ``twell_units_gate_wgmma``: its TMA ring (a stage: room for
    64 rows of x, its box holding M of them, and a ``units`` x 64 box of ``w_first``, 64
    columns each), its mbarriers, and slack to align the ring to 1024 bytes."""
    return stages * (64 + units) * 128 + 16 * stages + 1024


def forward(
    x: Any, w_first: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    ut: int | None = None, down_tokens: int = DOWN_TOKENS, columns: int | None = None,
    gate: str | None = None, down: str | None = None, scan_threads: int | None = None,
    units_per_token: float | None = None, stages: int = WGMMA_STAGES,
) -> list[Any]:  # fmt: skip
    """``y [M, K]`` (bf16, every row) of the block for ``x [M, K]``; gated if ``w_up`` is
    given (``w_first`` is then ``w_gate``, else ``w_up``). ``w_down_t`` is ``[N, K]``.
    ``gate`` is one of :data:`GATES` (default :func:`gate_for`). ``ut``, ``down_tokens``,
    ``columns``, ``down`` (``"scan"`` or ``"lists"``), ``scan_threads`` (64 or 128, the
    scan only) and ``stages`` (the wgmma gate's TMA ring) override the geometry
    (benchmarks; defaults :func:`unit_tiles`, :data:`DOWN_TOKENS`, :func:`down_columns`,
    :data:`SCAN_TOKENS`, :func:`scan_threads_for` of ``units_per_token``, a hint that does
    not change the bits, :data:`WGMMA_STAGES`); the list kernel's tokens per CTA are
    ``down_tokens`` rounded up to 8, 16, 32 or 64 (the scan kernel takes one token and 32
    columns per CTA and ignores ``down_tokens`` and ``columns``). Returns the scratch
    buffers it used (keep them alive while a captured graph runs)."""
    m, k = x.shape
    n = w_first.shape[0]
    if not fits(m, n, most=MAX_TOKENS):
        raise ValueError(f"decode_units: M={m}, N={n} outside the route's limits")
    gated = w_up is not None
    gate = gate_for(m, n) if gate is None else gate
    if gate not in GATES:
        raise ValueError(f"decode_units: gate must be one of {GATES}, got {gate!r}")
    if gate != "cublas" and token_tiles(m) > 8:
        raise ValueError(f"decode_units: the {gate} gate takes at most 64 tokens, got {m}")
    wgmma = gate.startswith("wgmma")
    if ut is None:
        ut = unit_tiles(m, n) if gate == "mma" else WGMMA_UNIT_TILES if wgmma else 1
    if gate == "cublas" and ut * token_tiles(m) > 64:
        raise ValueError(f"decode_units: ut={ut} with {m} tokens exceeds the gate's shared memory")
    if ut not in (1, 2, 4) or n % (UNITS * ut) or down_tokens < 1:
        raise ValueError(f"decode_units: ut={ut}, down_tokens={down_tokens} do not fit N={n}")
    if wgmma and (stages < 2 or wgmma_shared_bytes(UNITS * ut, stages) > SHARED_PER_SM - 24 * 1024):
        raise ValueError(f"decode_units: a wgmma ring of {stages} stages does not fit")
    if down not in (None, "lists", "scan"):
        raise ValueError(f"decode_units: down must be 'scan' or 'lists', got {down!r}")
    down = down or ("scan" if m <= SCAN_TOKENS else "lists")
    if scan_threads not in (None, 64, 128) or (scan_threads and down != "scan"):
        raise ValueError(
            f"decode_units: scan_threads={scan_threads} with down={down!r}: 64 or 128, for "
            "the scan kernel only"
        )
    if down == "lists":
        if columns is None:
            columns = down_columns(m, k, n, device_info().multiprocessors, down_tokens=down_tokens)
        nt = token_tiles(min(m, down_tokens))
        shared = down_shared_bytes(m, n, columns, down_tokens=down_tokens)
        if columns < 8 or columns % 8 or nt > 8 or shared > SHARED_PER_SM - STATIC_RESERVE:
            raise ValueError(
                f"decode_units: down_tokens={down_tokens}, columns={columns}: the down kernel "
                f"takes at most 64 tokens and {SHARED_PER_SM - STATIC_RESERVE} bytes of shared "
                f"memory per CTA ({shared} asked), columns a multiple of 8"
            )
    h = alloc((m, n), np.float32)
    masks = alloc((m, n // UNITS), np.uint16)
    through_pre = gate in ("cublas", "wgmma_pre")  # the gate/up kernel reads a pre-activation
    pre = gemm_nt(x, w_first) if gate == "cublas" else None  # cuBLAS: x read once
    if gate == "wgmma_pre":
        pre = alloc((m, n), np.uint16)
    module = {"KDIM": k, "GATED": int(gated), "NT": token_tiles(m), "UT": ut,
              "PRE": int(through_pre), "STAGES": stages if wgmma else 0}  # fmt: skip
    if wgmma:  # the first kernel of the call: launched as usual
        fn = GATE.kernel("twell_units_gate_wgmma", **module)
        smem = wgmma_shared_bytes(UNITS * ut, stages)
        if fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
        fn(
            (n // (UNITS * ut),), (GATE_THREADS,),
            (tensor_map(x, m), tensor_map(w_first, UNITS * ut), u16(x),
             u16(w_up) if gated else _NULL, u16(w_down_t), _NULL if pre is None else u16(pre),
             h, masks, np.int32(m), np.int32(n)),
            shared_mem=smem,
        )  # fmt: skip
    if gate != "wgmma":
        gate_args = (
            u16(x), u16(w_first), u16(w_up) if gated else _NULL, u16(w_down_t),
            _NULL if pre is None else u16(pre), h, masks, np.int32(m), np.int32(n),
        )  # fmt: skip
        # after a gate GEMM it may start as the GEMM's last CTAs end; the first kernel of
        # the call (no pre-activation) is launched as usual
        kernel = GATE.kernel("twell_units_gate_up", **module)
        launch_after(kernel, (n // (UNITS * ut),), (GATE_THREADS,), gate_args, overlap=through_pre)
    down_args = (masks.view(np.uint32), h, u16(w_down_t), u16(y), np.int32(m), np.int32(n))
    if down == "scan":
        threads = scan_threads or scan_threads_for(m, units_per_token)
        scan = SCAN.kernel(f"twell_units_down_scan{threads}", KDIM=k)
        launch_after(scan, (-(-k // 32), m), (threads,), down_args)
        return [h, masks] if pre is None else [h, masks, pre]
    kernel = DOWN.kernel("twell_units_down", KDIM=k, NT=nt, DC=columns)
    if kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared
    launch_after(kernel, (-(-k // columns), -(-m // (8 * nt))), (DOWN_THREADS,), down_args, shared)
    return [h, masks] if pre is None else [h, masks, pre]
