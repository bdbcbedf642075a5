"""Launchers of reuse.cu: the light rows of the FFN block with block reuse of weight rows.

The stage, on CuPy arrays (bf16 as ml_dtypes ``bfloat16`` or raw ``uint16`` bits):

    view = allocate_view(M, N, K, gated=True, max_row_nnz=168, alloc=alloc)
    scan_pre(view, pre)          # or scan_twell(view, packed, heavy_in)
    pointers(view)               # prefix sums: row view (and column view) pointers
    scatter(view)                # both views
    up(view, x, w_up)            # h = g * (x . w_up[n]) via the column view (tensor cores)
    # or up_gather(view, x, w_up)  (baseline: per-token gather of w_up rows)
    down(view, w_down_t, y)      # light rows of y via the row view
    # heavy: view.heavy (uint8 [M]); those rows of y are not written

or all at once with :func:`light_rows` (the same call shape as today's
``fused_rows(x, pre, heavy, w_up, w_down_t, y, tile=, slots=, max_row_nnz=)``).

Every scratch buffer comes from the ``alloc(shape, dtype)`` argument (default
``cupy.empty``). Sizes depend only on (M, N, K, max_row_nnz, config): nothing is read
back to the host, so the stage can be captured in a CUDA graph. Capacities are worst
cases (each light token has at most ``max_row_nnz`` entries; a token with more is heavy),
and every limit is checked here before the first launch: nothing is dropped silently.

``backend`` selects how kernels are compiled and launched: :class:`CupyBackend` (default,
NVRTC for the current GPU) or the CPU emulator of ``emu/emu_backend.py`` (tests without
a GPU; arrays are NumPy there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

SOURCE_PATH = Path(__file__).with_name("reuse.cu")

#: Constants of reuse.cu the host needs (kept in step with the source).
SCAN_WARPS = 4
SCAN_STAGES = 8
SCAN_PITCH = 80
PTR_THREADS = 1024
UP_WARPS = 16
DN_WARPS = 16
DLIST = 256
GATHER_WARPS = 4
FINISH_THREADS = 256
MAX_DYNAMIC_SMEM = 232448  # bytes per block on sm_90
MAX_K = 4096

Alloc = Callable[[tuple[int, ...], Any], Any]


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Config:
    """Tiling of the stage (compile-time constants of reuse.cu).

    Attributes:
        up_block: tokens per block of the column view and the up kernel (UB).
        up_ks: K columns of x staged per step of the up kernel (multiple of 32).
        down_block: tokens per block of the row view and the down kernel (DB = 16 warps x
            at most 32 tokens).
        down_ks: output columns per down CTA (32, 64 or 128).
        row_chunk: units per row chunk (staged per step of the down kernel; a multiple
            of the TwELL tile).
    """

    up_block: int = 512
    up_ks: int = 64
    down_block: int = 512
    down_ks: int = 64
    row_chunk: int = 512

    def defines(self, k: int, tile: int, slots: int, gated: bool) -> dict[str, int]:
        return {
            "KDIM": int(k), "TILE": int(tile), "SLOTS": int(slots), "GATED": int(bool(gated)),
            "UP_BLOCK": self.up_block, "UP_KS": self.up_ks, "DOWN_BLOCK": self.down_block,
            "DOWN_KS": self.down_ks, "ROW_CHUNK": self.row_chunk,
        }  # fmt: skip


def _tunables(params: Mapping[str, int]) -> Config:
    base = Config()
    return Config(
        up_block=int(params.get("UP_BLOCK", base.up_block)),
        up_ks=int(params.get("UP_KS", base.up_ks)),
        down_block=int(params.get("DOWN_BLOCK", base.down_block)),
        down_ks=int(params.get("DOWN_KS", base.down_ks)),
        row_chunk=int(params.get("ROW_CHUNK", base.row_chunk)),
    )


def up_stages(config: Config) -> int:
    tile = config.up_block * config.up_ks * 2
    return 2 if 2 * tile <= 160 * 1024 else 1


def dynamic_smem_bytes(kernel: str, params: Mapping[str, int]) -> int:
    """Dynamic shared memory kernel ``kernel`` needs with ``params`` (0 for none)."""
    c = _tunables(params)
    if kernel == "twell_reuse_scan_pre":
        return SCAN_WARPS * SCAN_STAGES * 32 * SCAN_PITCH
    if kernel == "twell_reuse_scan_twell":
        return SCAN_WARPS * int(params["TILE"]) * 4
    if kernel == "twell_reuse_up":  # x tiles, then each warp's group pointers
        groups_per_warp = -(-int(params.get("N", 65536)) // (16 * UP_WARPS))
        return up_stages(c) * c.up_block * c.up_ks * 2 + UP_WARPS * 2 * (groups_per_warp + 1) * 4
    if kernel == "twell_reuse_down":
        return 2 * c.row_chunk * c.down_ks * 2 + DN_WARPS * (
            DLIST * 8 + (c.down_block // DN_WARPS + 1) * 4
        )
    return 0


def full_source(params: Mapping[str, int]) -> str:
    """``#define TWELL_<NAME> <value>`` lines, then reuse.cu: what both builds compile."""
    lines = [f"#define TWELL_{k} {int(v)}" for k, v in sorted(params.items())]
    return "\n".join(lines) + "\n" + SOURCE_PATH.read_text()


# ---------------------------------------------------------------------------- backends
class CupyBackend:
    """Compiles reuse.cu with CuPy's RawModule (NVRTC, sm_90a) for the current device;
    modules cached per (device, parameters), safe across threads."""

    options = ("--std=c++17", "--gpu-architecture=sm_90a")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[tuple, Any] = {}

    @staticmethod
    def _cupy() -> Any:
        import cupy

        return cupy

    def multiprocessors(self) -> int:
        cp = self._cupy()
        device = cp.cuda.Device().id
        found = self._kernels.get(("sms", device))
        if found is None:
            found = self._kernels[("sms", device)] = int(
                cp.cuda.runtime.deviceGetAttribute(
                    cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device
                )
            )
        return found

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._cupy().empty(shape, dtype=dtype)

    def _kernel(self, function: str, defines: Mapping[str, int]) -> Any:
        cp = self._cupy()
        key = (cp.cuda.Device().id, tuple(sorted(defines.items())), function)
        found = self._kernels.get(key)
        if found is None:
            with self._lock:
                module_key = key[:2]
                module = self._kernels.get(module_key)
                if module is None:
                    module = cp.RawModule(code=full_source(defines), options=self.options)
                    module.compile()
                    self._kernels[module_key] = module
                found = self._kernels[key] = [module.get_function(function), 0]
        return found

    def launch(self, function: str, defines: Mapping[str, int], grid: tuple[int, ...],
               block: tuple[int, ...], args: tuple, smem: int = 0) -> None:  # fmt: skip
        entry = self._kernel(function, defines)
        kernel = entry[0]
        if smem > 48 * 1024 and entry[1] < smem:
            kernel.max_dynamic_shared_size_bytes = smem
            entry[1] = smem
        null = np.uint64(0)
        kernel(grid, block, tuple(null if a is None else a for a in args), shared_mem=smem)


_default_backend: CupyBackend | None = None


def default_backend() -> CupyBackend:
    global _default_backend
    if _default_backend is None:
        _default_backend = CupyBackend()
    return _default_backend


# ---------------------------------------------------------------------------- the view
@dataclass
class ReuseView:
    """The active (token, unit) pairs of the light tokens in a row view and a column view
    (layouts: the header of reuse.cu), plus the scratch of the stage. Built by
    :func:`allocate_view` (buffers only), then :func:`scan_pre`/:func:`scan_twell`,
    :func:`pointers`, :func:`scatter`."""

    M: int
    N: int
    K: int
    tile: int
    slots: int
    gated: bool
    max_row_nnz: int
    columns: bool
    ksplit: int
    config: Config
    backend: Any
    heavy: Any  # uint8 [M]: 1 = heavy row (left to the dense path)
    row_nnz: Any
    raw: Any
    chunk_cnt: Any
    mask: Any
    light: Any
    row_ptr: Any
    row_unit: Any
    row_h: Any
    unit_ptr: Any = None
    col_off: Any = None
    col_word: Any = None
    col_unit: Any = None
    col_dst: Any = None
    up_sum: Any = None
    defines: dict[str, int] = field(default_factory=dict)

    @property
    def groups(self) -> int:  # 32-token groups (rows of the unit masks)
        return -(-self.M // 32)

    @property
    def up_blocks(self) -> int:
        return -(-self.M // self.config.up_block)

    @property
    def down_blocks(self) -> int:
        return -(-self.M // self.config.down_block)

    @property
    def row_chunks(self) -> int:
        return -(-self.N // self.config.row_chunk)

    @property
    def pair_capacity(self) -> int:  # per K split, column view
        return self.up_blocks * self.config.up_block * self.max_row_nnz

    def launch(self, function: str, grid: tuple[int, ...], block: int, args: tuple,
               smem: int = 0) -> None:  # fmt: skip
        self.backend.launch(function, self.defines, grid, (block,), args, smem)


def _check_config(config: Config, tile: int, slots: int, max_row_nnz: int) -> None:
    c = config
    if c.up_block % 32 or not 32 <= c.up_block <= 65536:
        raise ValueError(
            f"config.up_block: expected a multiple of 32 in [32, 65536], got {c.up_block}"
        )
    if c.up_ks not in (32, 64, 128, 256):
        raise ValueError(f"config.up_ks: expected 32, 64, 128 or 256, got {c.up_ks}")
    if c.down_block % DN_WARPS or not 1 <= c.down_block // DN_WARPS <= 32:
        raise ValueError(
            f"config.down_block: expected {DN_WARPS} x (1..32) tokens, got {c.down_block}"
        )
    if c.down_ks not in (32, 64, 128):
        raise ValueError(f"config.down_ks: expected 32, 64 or 128, got {c.down_ks}")
    if c.row_chunk % tile or c.row_chunk % 32 or c.row_chunk > 65536:
        raise ValueError(
            f"config.row_chunk: expected a multiple of tile={tile} (and of 32), got {c.row_chunk}"
        )
    # One token's entries of one row chunk must fit a warp's list in the down kernel.
    per_chunk = min(max_row_nnz, (c.row_chunk // tile) * (slots - 1))
    if per_chunk > DLIST:
        raise ValueError(
            f"max_row_nnz={max_row_nnz}: a token may hold {per_chunk} entries in a row chunk "
            f"of {c.row_chunk} units, more than the down kernel's list ({DLIST}); use a "
            f"smaller config.row_chunk or max_row_nnz"
        )
    params = c.defines(8, tile, slots, True)
    for kernel in ("twell_reuse_up", "twell_reuse_down"):
        need = dynamic_smem_bytes(kernel, params)
        if need > MAX_DYNAMIC_SMEM:
            raise ValueError(f"config: {kernel} would need {need} bytes of shared memory")


def allocate_view(
    M: int, N: int, K: int, *, gated: bool, max_row_nnz: int, tile: int = 256,
    slots: int = 32, columns: bool | None = None, ksplit: int | None = None,
    config: Config | None = None, heavy: Any = None, alloc: Alloc | None = None,
    backend: Any = None,
) -> ReuseView:  # fmt: skip
    """Every buffer of the stage for M tokens, sized for the worst case; checks every
    limit (``ValueError``) before anything is launched.

    Args:
        columns: build the column view (default: ``gated``; the up step needs it).
        ksplit: K ranges of the up kernel (default: enough CTAs to fill the GPU).
        heavy: uint8 ``[M]`` to hold the routing flags (default: allocated).
    """
    config = config or Config()
    backend = backend or default_backend()
    alloc = alloc or backend.empty
    columns = gated if columns is None else bool(columns)
    for name, value in (("M", M), ("N", N), ("K", K), ("max_row_nnz", max_row_nnz)):
        if int(value) != value or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    if M == 0:
        raise ValueError("M: the stage needs at least one token")
    if tile not in (32, 64, 128, 256) or slots < 2 or slots > tile or slots & (slots - 1):
        raise ValueError(f"tile/slots: expected a power-of-two tile in [32, 256] and slots in "
                         f"[2, tile], got tile={tile}, slots={slots}")  # fmt: skip
    if N % tile or N > 65536 or N == 0:
        raise ValueError(f"N={N}: expected a positive multiple of tile={tile}, at most 65536")
    if K % 8 or K == 0 or K > MAX_K:
        raise ValueError(f"K={K}: expected a positive multiple of 8, at most {MAX_K}")
    if max_row_nnz > 65535:
        raise ValueError(f"max_row_nnz: expected at most 65535, got {max_row_nnz}")
    _check_config(config, tile, slots, max_row_nnz)
    R = max(int(max_row_nnz), 1)  # capacity per token (R = 0 routes every active row)
    nbu, nbd = -(-M // config.up_block), -(-M // config.down_block)
    if max(nbu * config.up_block, nbd * config.down_block, M) * R >= 2**31:
        raise ValueError(
            f"M={M}, max_row_nnz={max_row_nnz}: the views would need more than 2^31 entries "
            "(int32 indices); split the batch"
        )
    if (M + 31) // 32 * N >= 2**31:
        raise ValueError(f"M={M}, N={N}: the unit masks would need more than 2^31 words")
    slices = -(-K // config.up_ks)
    if ksplit is None:  # one wave of up CTAs (one per SM: 128 KB of x tiles each)
        ksplit = max(1, min(slices, backend.multiprocessors() // nbu))
    if not 1 <= ksplit:
        raise ValueError(f"ksplit: expected a positive int, got {ksplit}")
    ksplit = min(int(ksplit), slices)
    per = -(-slices // ksplit)
    ksplit = -(-slices // per)  # every K range holds at least one slice
    W = (M + 31) // 32
    nrc = -(-N // config.row_chunk)
    if heavy is None:
        heavy = alloc((M,), np.uint8)
    view = ReuseView(
        M=M, N=N, K=K, tile=tile, slots=slots, gated=bool(gated), max_row_nnz=int(max_row_nnz),
        columns=columns, ksplit=ksplit, config=config, backend=backend, heavy=heavy,
        row_nnz=alloc((M,), np.int32), raw=alloc((M * R,), np.uint32),
        chunk_cnt=alloc((nrc * M,), np.uint16), mask=alloc((W * N,), np.uint32),
        light=alloc((W,), np.uint32), row_ptr=alloc((nbd * (nrc * config.down_block + 1),), np.int32),
        row_unit=alloc((nbd * config.down_block * R,), np.uint16),
        row_h=alloc((nbd * config.down_block * R,), np.float32),
        defines=config.defines(K, tile, slots, gated),
    )  # fmt: skip
    if columns:
        cap = nbu * config.up_block * R
        view.unit_ptr = alloc((nbu * (N + 1),), np.int32)
        view.col_off = alloc((W * N,), np.int32)
        view.col_word = alloc((cap,), np.uint32)
        view.col_unit = alloc((cap,), np.uint16)
        view.col_dst = alloc((cap,), np.int32)
        view.up_sum = alloc((ksplit * cap,), np.float32)
    return view


# ---------------------------------------------------------------------------- checks
def _u16(array: Any) -> Any:
    return array.view(np.uint16)


def _check_matrix(name: str, array: Any, shape: tuple[int, int], itemsize: int = 2) -> None:
    if tuple(array.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(array.shape)}")
    if np.dtype(array.dtype).itemsize != itemsize:
        raise TypeError(f"{name}: expected a {itemsize}-byte dtype, got {array.dtype}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def _ints(view: ReuseView) -> tuple:
    return np.int32(view.M), np.int32(view.N), np.int32(view.max_row_nnz)


# ---------------------------------------------------------------------------- steps
def scan_pre(view: ReuseView, pre: Any) -> None:
    """Routing rule, entries and unit masks from the dense bf16 pre-activation [M, N]."""
    _check_matrix("pre", pre, (view.M, view.N))
    grid = (-(-view.groups // SCAN_WARPS),)
    view.launch(
        "twell_reuse_scan_pre", grid, SCAN_WARPS * 32,
        (_u16(pre), *_ints(view), view.heavy, view.row_nnz, view.raw, view.chunk_cnt,
         view.mask, view.light),
        dynamic_smem_bytes("twell_reuse_scan_pre", view.defines),
    )  # fmt: skip


def scan_twell(view: ReuseView, packed: Any, heavy_in: Any | None = None) -> None:
    """The same from a TwELL buffer ``packed`` uint32 [M, N/tile*slots]. ``heavy_in``
    (uint8 [M], the producer's flags) is copied into ``view.heavy`` first (or, when it is
    ``view.heavy`` itself, used in place); None: no row is flagged on entry."""
    _check_matrix("packed", packed, (view.M, view.N // view.tile * view.slots), 4)
    if heavy_in is None:
        view.heavy.fill(0)
    elif heavy_in is not view.heavy:
        if tuple(heavy_in.shape) != (view.M,) or np.dtype(heavy_in.dtype).itemsize != 1:
            raise ValueError(f"heavy_in: expected uint8 [{view.M}]")
        view.heavy[...] = heavy_in
    grid = (-(-view.groups // SCAN_WARPS),)
    view.launch(
        "twell_reuse_scan_twell", grid, SCAN_WARPS * 32,
        (packed, *_ints(view), view.heavy, view.row_nnz, view.raw, view.chunk_cnt, view.mask,
         view.light),
        dynamic_smem_bytes("twell_reuse_scan_twell", view.defines),
    )  # fmt: skip


def row_pointers(view: ReuseView) -> None:
    """Prefix sums of the row view (one CTA per down block)."""
    view.launch(
        "twell_reuse_row_ptr", (view.down_blocks,), PTR_THREADS,
        (view.chunk_cnt, view.heavy, *_ints(view), view.row_ptr),
    )  # fmt: skip


def unit_pointers(view: ReuseView) -> None:
    """Prefix sums of the column view (one CTA per up block)."""
    view.launch(
        "twell_reuse_unit_ptr", (view.up_blocks,), PTR_THREADS,
        (view.mask, view.light, *_ints(view), view.unit_ptr, view.col_off),
    )  # fmt: skip


def pointers(view: ReuseView) -> None:
    """Prefix sums: row view pointers (and the column view's when built)."""
    row_pointers(view)
    if view.columns:
        unit_pointers(view)


def scatter(view: ReuseView) -> None:
    """Every entry to its place in the row view (row_h = g) and the column view."""
    grid = (-(-view.groups // SCAN_WARPS),)
    view.launch(
        "twell_reuse_scatter", grid, SCAN_WARPS * 32,
        (view.raw, view.row_nnz, view.mask, view.light, view.col_off, view.row_ptr,
         *_ints(view), view.col_word, view.col_unit, view.col_dst, view.row_unit, view.row_h),
    )  # fmt: skip


def build(view: ReuseView, pre: Any = None, packed: Any = None, heavy_in: Any = None) -> None:
    """scan (from ``pre`` or ``packed``), pointers, scatter."""
    if (pre is None) == (packed is None):
        raise ValueError("give exactly one of pre (dense bf16) and packed (TwELL)")
    if pre is not None:
        scan_pre(view, pre)
    else:
        scan_twell(view, packed, heavy_in)
    pointers(view)
    scatter(view)


def up(view: ReuseView, x: Any, w_up: Any) -> None:
    """row_h = g * (x . w_up[n]) for every pair, through the column view: tensor cores on
    16-unit x 8-pair tiles, K split in ``view.ksplit`` ranges (then summed in order)."""
    if not view.columns:
        raise ValueError("up: the view was allocated without the column view (columns=False)")
    _check_matrix("x", x, (view.M, view.K))
    _check_matrix("w_up", w_up, (view.N, view.K))
    up_main(view, x, w_up)
    if view.ksplit > 1:
        up_finish(view)


def up_main(view: ReuseView, x: Any, w_up: Any) -> None:
    """The tensor-core kernel of :func:`up` alone (without the K-range reduction)."""
    slices = -(-view.K // view.config.up_ks)
    k_range = -(-slices // view.ksplit) * view.config.up_ks
    view.launch(
        "twell_reuse_up", (view.up_blocks, view.ksplit), UP_WARPS * 32,
        (_u16(x), _u16(w_up), view.unit_ptr, view.col_word, view.col_unit, view.col_dst,
         *_ints(view), np.int32(k_range), view.up_sum, view.row_h),
        dynamic_smem_bytes("twell_reuse_up", {**view.defines, "N": view.N}),
    )  # fmt: skip


def up_finish(view: ReuseView) -> None:
    """h = g * (sum of the K ranges' partial sums) (only when ``view.ksplit > 1``)."""
    # Enough CTAs per block for the expected pairs (~1% of the capacity), grid-stride past.
    expected = view.config.up_block * min(max(view.max_row_nnz, 1), 64)
    ys = max(1, min(64, -(-expected // (FINISH_THREADS * 4))))
    view.launch(
        "twell_reuse_up_finish", (view.up_blocks, ys), FINISH_THREADS,
        (view.up_sum, np.int32(view.ksplit), view.unit_ptr, view.col_word, view.col_dst,
         *_ints(view), view.row_h),
    )  # fmt: skip


def up_gather(view: ReuseView, x: Any, w_up: Any) -> None:
    """Baseline (a): the same h by a per-token gather of w_up rows (light_rows.cu's
    arithmetic: same bits as today's kernel)."""
    _check_matrix("x", x, (view.M, view.K))
    _check_matrix("w_up", w_up, (view.N, view.K))
    view.launch(
        "twell_reuse_up_gather", (-(-view.M // GATHER_WARPS),), GATHER_WARPS * 32,
        (_u16(x), _u16(w_up), view.row_ptr, view.row_unit, np.int32(view.M), np.int32(view.N),
         view.row_h),
    )  # fmt: skip


def down(view: ReuseView, w_down_t: Any, y: Any) -> None:
    """Light rows of y [M, K] (bf16) = sum over the row view of h * w_down_t[n]."""
    _check_matrix("w_down_t", w_down_t, (view.N, view.K))
    _check_matrix("y", y, (view.M, view.K))
    view.launch(
        "twell_reuse_down", (view.down_blocks, -(-view.K // view.config.down_ks)), DN_WARPS * 32,
        (_u16(w_down_t), view.row_ptr, view.row_unit, view.row_h, view.heavy,
         np.int32(view.M), np.int32(view.N), _u16(y)),
        dynamic_smem_bytes("twell_reuse_down", view.defines),
    )  # fmt: skip


def light_rows(
    x: Any | None, pre: Any, heavy: Any, w_up: Any | None, w_down_t: Any, y: Any, *,
    tile: int = 256, slots: int = 32, max_row_nnz: int, up_path: str = "columns",
    ksplit: int | None = None, config: Config | None = None, alloc: Alloc | None = None,
    backend: Any = None,
) -> ReuseView:  # fmt: skip
    """The whole stage, in today's ``fused_rows`` call shape: light rows of ``y`` from the
    bf16 pre-activation, ``heavy[m]`` written for every row. Gated if ``w_up`` is given
    (``up_path``: ``"columns"`` = block reuse, ``"gather"`` = baseline). Returns the view
    (its buffers; the caller may keep them alive, e.g. for a backward pass)."""
    if up_path not in ("columns", "gather"):
        raise ValueError(f"up_path: expected 'columns' or 'gather', got {up_path!r}")
    M, N = pre.shape
    K = y.shape[1]
    gated = w_up is not None
    if gated and x is None:
        raise ValueError("x: the gated block needs x")
    view = allocate_view(
        M, N, K, gated=gated, max_row_nnz=max_row_nnz, tile=tile, slots=slots,
        columns=gated and up_path == "columns", ksplit=ksplit, config=config, heavy=heavy,
        alloc=alloc, backend=backend,
    )  # fmt: skip
    # Validate every operand before the first launch.
    _check_matrix("pre", pre, (M, N))
    _check_matrix("w_down_t", w_down_t, (N, K))
    _check_matrix("y", y, (M, K))
    if tuple(heavy.shape) != (M,) or np.dtype(heavy.dtype).itemsize != 1:
        raise ValueError(f"heavy: expected uint8 [{M}]")
    if gated:
        _check_matrix("x", x, (M, K))
        _check_matrix("w_up", w_up, (N, K))
    build(view, pre=pre)
    if gated:
        (up if up_path == "columns" else up_gather)(view, x, w_up)
    down(view, w_down_t, y)
    return view


def with_config(view: ReuseView, **changes: Any) -> Config:
    """A copy of ``view.config`` with ``changes`` (convenience for sweeps)."""
    return replace(view.config, **changes)
