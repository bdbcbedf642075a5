"""Bad input (docs/ops.md): every public entry raises TypeError/ValueError naming the argument."""

from __future__ import annotations

import re

import numpy as np
import pytest

import twell
from twell import Hybrid, TwELL

M, K, N, TILE, SLOTS = 4, 8, 64, 32, 4


def arrays(n: int = N, k: int = K, m: int = M) -> dict:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((m, k)).astype(np.float32),
        "w_gate": rng.standard_normal((n, k)).astype(np.float32),
        "w_up": rng.standard_normal((n, k)).astype(np.float32),
        "w_down": rng.standard_normal((k, n)).astype(np.float32),
    }


def hidden(m: int = M) -> Hybrid:
    a = arrays(m=m)
    return twell.gate(a["x"], a["w_gate"], tile=TILE, slots=SLOTS)


# Each op as a function of a dict of its arguments (so a case can replace one of them).
OPS = {
    "gate": lambda a: twell.gate(a["x"], a["w_gate"], tile=a["tile"], slots=a["slots"]),
    "down": lambda a: twell.down(a["h"], a["w_down"]),
    "gated_down": lambda a: twell.gated_down(a["x"], a["h"], a["w_up"], a["w_down"]),
    "ffn": lambda a: twell.ffn(
        a["x"], a["w_gate"], a["w_up"], a["w_down"], tile=a["tile"], slots=a["slots"]
    ),
    "ffn_nongated": lambda a: twell.ffn(
        a["x"], None, a["w_up"], a["w_down"], tile=a["tile"], slots=a["slots"]
    ),
}
ARGUMENTS = {
    "gate": ("x", "w_gate"),
    "down": ("w_down",),
    "gated_down": ("x", "w_up", "w_down"),
    "ffn": ("x", "w_gate", "w_up", "w_down"),
    "ffn_nongated": ("x", "w_up", "w_down"),
}


def call(op: str, **replace):
    a = {**arrays(), "h": hidden(), "tile": TILE, "slots": SLOTS, **replace}
    return OPS[op](a)


def op_argument_pairs(names=None):
    return [
        (op, name) for op, args in ARGUMENTS.items() for name in args if not names or name in names
    ]


# ------------------------------------------------------------------ valid calls work
@pytest.mark.parametrize("op", OPS)
def test_the_baseline_calls_are_valid(op):
    call(op)


# ------------------------------------------------------------------ array types
@pytest.mark.parametrize(("op", "name"), op_argument_pairs())
def test_a_list_is_rejected(op, name):
    value = arrays()[name].tolist()
    with pytest.raises(TypeError, match=rf"^{name}: expected a numpy.ndarray.*got list"):
        call(op, **{name: value})


@pytest.mark.parametrize(("op", "name"), op_argument_pairs())
def test_a_scalar_is_rejected(op, name):
    with pytest.raises(TypeError, match=rf"^{name}: .*got float"):
        call(op, **{name: 1.0})


@pytest.mark.parametrize(("op", "name"), op_argument_pairs())
def test_mixed_numpy_and_torch_are_rejected(op, name):
    torch = pytest.importorskip("torch")
    value = torch.from_numpy(arrays()[name])
    # down's only array is w_down: then it is the NumPy Hybrid h that does not match.
    match = (
        "^h: expected a Hybrid holding GPU"
        if op == "down"
        else f"mixed array types: .*{name} is torch"
    )
    with pytest.raises(TypeError, match=match):
        call(op, **{name: value})


@pytest.mark.parametrize("op", ["gate", "ffn", "ffn_nongated", "gated_down"])
def test_torch_cpu_tensors_are_rejected(op):
    torch = pytest.importorskip("torch")
    tensors = {name: torch.from_numpy(a) for name, a in arrays().items()}
    if op == "gated_down":
        match = r"^(x|g): "  # the NumPy Hybrid or the CPU tensors, named either way
    else:
        match = r"^x: torch tensors must live on a CUDA device.*NumPy"
    with pytest.raises(TypeError, match=match):
        call(op, **tensors)


def test_down_with_torch_cpu_weights_is_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^(h|w_down): "):
        call("down", w_down=torch.from_numpy(arrays()["w_down"]))


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
@pytest.mark.parametrize(("op", "name"), op_argument_pairs())
def test_non_float_dtypes_are_rejected(op, name, dtype):
    value = arrays()[name].astype(dtype)
    with pytest.raises(
        TypeError, match=rf"^{name}: expected a floating dtype.*got {np.dtype(dtype)}"
    ):
        call(op, **{name: value})


@pytest.mark.parametrize(("op", "name"), op_argument_pairs())
def test_floats_of_the_other_byte_order_are_rejected_with_the_conversion(op, name):
    value = arrays()[name].astype(">f4")
    with pytest.raises(TypeError, match=rf"^{name}: expected native byte order, got >f4 .*float32"):
        call(op, **{name: value})


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix)
@pytest.mark.parametrize(("op", "name"), op_argument_pairs())
@pytest.mark.parametrize("kind", ["masked", "matrix"])
def test_numpy_subclasses_whose_meaning_the_ops_would_drop_are_rejected(op, name, kind):
    plain = arrays()[name]
    value = np.ma.masked_array(plain, mask=plain > 0) if kind == "masked" else np.asmatrix(plain)
    with pytest.raises(TypeError, match=rf"^{name}: expected a plain numpy.ndarray"):
        call(op, **{name: value})


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix)
def test_formats_refuse_masked_and_matrix_input():
    h = np.maximum(arrays()["w_gate"], 0)
    for value in (np.ma.masked_array(h, mask=h > 1), np.asmatrix(h)):
        with pytest.raises(TypeError, match=r"^h: expected a plain numpy.ndarray"):
            Hybrid.from_dense(value, tile=TILE, slots=SLOTS)


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize(
    ("op", "name", "expected"),
    [("down", "w_down", r"\(K, 64\)"), ("gate", "w_gate", r"\(N, 8\)"),
     ("ffn", "w_down", r"\(8, 64\)"), ("ffn", "w_gate", r"\(64, 8\)")],
)  # fmt: skip
def test_a_transposed_weight_is_named_as_one(op, name, expected):
    value = np.ascontiguousarray(arrays()[name].T)
    with pytest.raises(
        ValueError, match=rf"^{name}: expected shape {expected} .*; transposed\? {name} is \["
    ):
        call(op, **{name: value})


def test_a_wrong_size_that_no_transpose_fixes_gets_no_hint():
    with pytest.raises(ValueError, match=r"got \(8, 96\)$"):
        call("ffn", w_down=np.ones((K, 96), np.float32))


@pytest.mark.parametrize("op", ["gate", "gated_down", "ffn", "ffn_nongated"])
@pytest.mark.parametrize("x", [np.float32(1.0), np.zeros((4, 0)), np.zeros((0, 0))])
def test_x_without_features_is_rejected(op, x):
    with pytest.raises(ValueError, match=r"^x: expected"):
        call(op, x=np.asarray(x, np.float32))


@pytest.mark.parametrize("op", ["gate", "gated_down", "ffn", "ffn_nongated", "down"])
@pytest.mark.parametrize("batch", [(0,), (2, 0), (0, 3)])
def test_an_empty_batch_gives_an_empty_result(op, batch):
    """M = 0 (an empty batch in serving) returns an empty result of the right shape."""
    x = np.zeros((*batch, K), np.float32)
    h = twell.gate(x, arrays()["w_gate"], tile=TILE, slots=SLOTS)
    assert isinstance(h, Hybrid) and h.shape == (0, N) and h.nnz == 0
    out = call(op, x=x, h=h)
    if op == "gate":
        assert out.shape == (0, N) and out.to_dense().shape == (0, N)
    elif op == "down":
        assert out.shape == (0, K) and out.dtype == np.float64
    else:
        assert out.shape == (*batch, K) and out.dtype == np.float64
    if op == "ffn":  # the prepared block too
        a = arrays()
        y = twell.SparseFFN(a["w_gate"], a["w_up"], a["w_down"], tile=TILE, slots=SLOTS)(x)
        assert y.shape == (*batch, K)


@pytest.mark.parametrize(("op", "name"), op_argument_pairs({"w_gate", "w_up", "w_down"}))
@pytest.mark.parametrize("shape", [(N * K,), (1, N, K)])
def test_weights_must_be_matrices(op, name, shape):
    value = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=rf"^{name}: expected a 2-D matrix"):
        call(op, **{name: value})


# down has no x: K is whatever w_down says, so only its N can mismatch.
@pytest.mark.parametrize(
    ("op", "name"), [p for p in op_argument_pairs({"w_gate", "w_up", "w_down"}) if p[0] != "down"]
)
def test_mismatched_k_is_rejected(op, name):
    value = arrays(k=K + 1)[name]
    with pytest.raises(
        ValueError, match=rf"^{name}: expected shape .*got {re.escape(str(value.shape))}"
    ):
        call(op, **{name: value})


@pytest.mark.parametrize(
    ("op", "name"),
    [("ffn", "w_up"), ("ffn", "w_down"), ("ffn_nongated", "w_down"), ("down", "w_down"),
     ("gated_down", "w_up"), ("gated_down", "w_down")],
)  # fmt: skip
def test_mismatched_n_is_rejected(op, name):
    value = arrays(n=N + TILE)[name]
    with pytest.raises(
        ValueError, match=rf"^{name}: expected shape .*got {re.escape(str(value.shape))}"
    ):
        call(op, **{name: value})


def test_hidden_rows_must_match_the_tokens():
    with pytest.raises(ValueError, match=r"^g: expected 4 rows \(one per token of x\), got 3"):
        call("gated_down", h=hidden(m=3))


@pytest.mark.parametrize("op", ["down", "gated_down"])
@pytest.mark.parametrize("value", ["ell", "dense", "none"])
def test_the_hidden_argument_must_be_a_hybrid(op, value):
    h = hidden()
    value = {"ell": h.ell, "dense": h.to_dense(), "none": None}[value]
    name = "h" if op == "down" else "g"
    with pytest.raises(TypeError, match=rf"^{name}: expected a twell.Hybrid"):
        call(op, h=value)


# ------------------------------------------------------------------ tile / slots / N
@pytest.mark.parametrize("op", ["gate", "ffn", "ffn_nongated"])
@pytest.mark.parametrize("tile", [0, 16, 48, 100, 512, -32])
def test_tile_must_be_a_power_of_two_in_range(op, tile):
    with pytest.raises(
        ValueError, match=rf"^tile: expected a power of two in \[32, 256\], got {tile}"
    ):
        call(op, tile=tile)


@pytest.mark.parametrize("op", ["gate", "ffn"])
@pytest.mark.parametrize("value", ["32", 32.0, True, None])
def test_tile_and_slots_must_be_integers(op, value):
    for name in ("tile", "slots"):
        with pytest.raises(TypeError, match=rf"^{name}: expected an int"):
            call(op, **{name: value})


@pytest.mark.parametrize("op", ["gate", "ffn", "ffn_nongated"])
@pytest.mark.parametrize("slots", [0, 1, 3, 6, 64, 256])
def test_slots_must_be_a_power_of_two_up_to_tile(op, slots):
    with pytest.raises(
        ValueError, match=rf"^slots: expected a power of two in \[2, tile=32\], got {slots}"
    ):
        call(op, slots=slots)


@pytest.mark.parametrize(
    ("op", "name"), [("gate", "w_gate"), ("ffn", "w_gate"), ("ffn_nongated", "w_up")]
)
def test_n_must_be_a_multiple_of_tile(op, name):
    with pytest.raises(ValueError, match=rf"^{name}: N=96 is not a multiple of tile=64"):
        call(op, **arrays(n=96), tile=64)


@pytest.mark.parametrize(
    ("op", "name"), [("gate", "w_gate"), ("ffn", "w_gate"), ("ffn_nongated", "w_up")]
)
def test_n_must_fit_16_bit_columns(op, name):
    n = 65536 + 256
    big = {
        "x": np.ones((1, 1), np.float32),
        "w_gate": np.ones((n, 1), np.float32),
        "w_up": np.ones((n, 1), np.float32),
        "w_down": np.ones((1, n), np.float32),
    }
    with pytest.raises(ValueError, match=rf"^{name}: N={n} exceeds 65536"):
        call(op, **big, tile=256, slots=32)


# ------------------------------------------------------------------ TwELL(...)
def test_twell_constructor_errors():
    good = np.zeros((2, 8), np.uint32)
    cases = [
        (
            TypeError,
            r"^packed: expected a numpy or cupy array, got list",
            ([[0] * 8] * 2, (2, 64), 32, 4),
        ),
        (
            TypeError,
            r"^packed: expected dtype uint32, got int32",
            (good.astype(np.int32), (2, 64), 32, 4),
        ),
        (
            TypeError,
            r"^packed: expected dtype uint32, got float32",
            (good.astype(np.float32), (2, 64), 32, 4),
        ),
        (ValueError, r"^packed: expected shape \(2, 8\)", (good[:, :7], (2, 64), 32, 4)),
        (ValueError, r"^packed: expected shape \(2, 8\)", (good.reshape(-1), (2, 64), 32, 4)),
        (ValueError, r"^packed: expected shape \(3, 8\)", (good, (3, 64), 32, 4)),
        (ValueError, r"^shape: N=48 is not a multiple of tile=32", (good, (2, 48), 32, 4)),
        (ValueError, r"^shape: N=65568 exceeds 65536", (good, (2, 65568), 32, 4)),
        (ValueError, r"^shape: expected \(M, N\)", (good, (2, 64, 1), 32, 4)),
        (ValueError, r"^shape: dimensions must be >= 0", (good, (-2, 64), 32, 4)),
        (ValueError, r"^tile: expected a power of two", (good, (2, 64), 24, 4)),
        (ValueError, r"^tile: expected a power of two", (good, (2, 1024), 512, 4)),
        (ValueError, r"^slots: expected a power of two", (good, (2, 64), 32, 5)),
        (ValueError, r"^slots: expected a power of two", (good, (2, 64), 32, 1)),
        (ValueError, r"^slots: expected a power of two", (good, (2, 64), 32, 64)),
        (TypeError, r"^tile: expected an int", (good, (2, 64), 32.0, 4)),
        (TypeError, r"^slots: expected an int", (good, (2, 64), 32, "4")),
    ]
    for error, message, args in cases:
        with pytest.raises(error, match=message):
            TwELL(*args)


def test_twell_constructor_rejects_torch_tensors():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^packed: expected a numpy or cupy array, got Tensor"):
        TwELL(torch.zeros((2, 8), dtype=torch.int32), (2, 64), 32, 4)


@pytest.mark.parametrize("make", [TwELL.from_dense, Hybrid.from_dense])
def test_from_dense_errors(make):
    h = np.zeros((2, 64), np.float32)
    with pytest.raises(TypeError, match=r"^h: expected a numpy or cupy array, got list"):
        make(h.tolist(), 32, 4)
    with pytest.raises(TypeError, match=r"^h: expected a floating dtype"):
        make(h.astype(np.int32), 32, 4)
    with pytest.raises(ValueError, match=r"^h: expected a 2-D matrix"):
        make(h.reshape(2, 8, 8), 32, 4)
    with pytest.raises(ValueError, match=r"^h: N=64 is not a multiple of tile=128"):
        make(h, 128, 4)
    with pytest.raises(ValueError, match=r"^slots: "):
        make(h, 32, 3)


# ------------------------------------------------------------------ Hybrid(...)
ELL = TwELL(np.zeros((3, 8), np.uint32), (3, 64), 32, 4)
ROWS = np.array([1], np.int32)
DENSE = np.zeros((1, 64), np.float32)


@pytest.mark.parametrize(
    ("error", "message", "ell", "dense_rows", "dense"),
    [
        (TypeError, r"^ell: expected a TwELL, got ndarray", ELL.packed, ROWS, DENSE),
        (TypeError, r"^ell: expected a TwELL, got Hybrid", Hybrid(ELL, ROWS, DENSE), ROWS, DENSE),
        (TypeError, r"^dense_rows: expected a numpy or cupy array, got list", ELL, [1], DENSE),
        (TypeError, r"^dense: expected a numpy or cupy array, got list", ELL, ROWS, [[0.0] * 64]),
        (
            TypeError,
            r"^dense_rows: expected a 1-D int32 array, got int64",
            ELL,
            ROWS.astype(np.int64),
            DENSE,
        ),
        (TypeError, r"^dense_rows: .* got float32", ELL, ROWS.astype(np.float32), DENSE),
        (TypeError, r"^dense_rows: .* with shape \(1, 1\)", ELL, ROWS.reshape(1, 1), DENSE),
        (TypeError, r"^dense: expected a floating dtype.*got int64", ELL, ROWS, DENSE.astype(int)),
        (ValueError, r"^dense: expected shape \(1, 64\), got \(2, 64\)", ELL, ROWS, DENSE[[0, 0]]),
        (ValueError, r"^dense: expected shape \(1, 64\), got \(1, 32\)", ELL, ROWS, DENSE[:, :32]),
    ],
)
def test_hybrid_constructor_errors(error, message, ell, dense_rows, dense):
    with pytest.raises(error, match=message):
        Hybrid(ell, dense_rows, dense)


def test_hybrid_constructor_rejects_torch_parts():
    torch = pytest.importorskip("torch")
    ell = TwELL(np.zeros((3, 8), np.uint32), (3, 64), 32, 4)
    with pytest.raises(TypeError, match=r"^dense_rows: "):
        Hybrid(ell, torch.tensor([1], dtype=torch.int32), np.zeros((1, 64), np.float32))
    with pytest.raises(TypeError, match=r"^dense: "):
        Hybrid(ell, np.array([1], np.int32), torch.zeros((1, 64)))


def test_sparse_ffn_path_must_be_known():
    a = arrays()
    known = r"path: expected one of \('fused', 'epilogue', 'pack', 'sliced'\)"
    with pytest.raises(ValueError, match=known):
        twell.SparseFFN(a["w_gate"], a["w_up"], a["w_down"], tile=TILE, slots=SLOTS, path="x")
    for path in ("fused", "epilogue", "pack", "sliced"):  # NumPy weights: all the reference
        block = twell.SparseFFN(a["w_gate"], a["w_up"], a["w_down"], tile=TILE, slots=SLOTS,
                                path=path)  # fmt: skip
        assert block.options.path == path
        np.testing.assert_allclose(block(a["x"]), call("ffn"))


@pytest.mark.parametrize("capacity", [-0.1, 1.5])
def test_sparse_ffn_dense_capacity_must_be_a_fraction(capacity):
    a = arrays()
    with pytest.raises(ValueError, match="dense_capacity: expected a fraction in"):
        twell.SparseFFN(a["w_gate"], a["w_up"], a["w_down"], dense_capacity=capacity)
