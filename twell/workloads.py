"""The synthetic problems of docs/benchmark.md ("Workloads"), shared by bench, demo and tests.

Real sparse checkpoints cannot be downloaded here, so sparsity comes from the gate
pre-activations themselves, produced by the real GEMM. Every workload uses the same
construction: column 0 of ``x`` is 1 and column 0 of ``w_gate`` is minus a per-unit
threshold ``z_n``, so that the gate pre-activation of token m, unit n is

    g[m, n] = s_m * xi[m, n] - z_n,        xi ~ N(0, 1),

where ``s_m`` is a per-token scale (1 unless the workload says otherwise). Unit n fires
for token m when ``s_m * xi > z_n``.

All arrays are ``ml_dtypes.bfloat16`` NumPy arrays in the ``torch.nn.Linear`` layout:
``x`` ``[M, K]``, ``w_gate`` ``[N, K]``, ``w_up`` ``[N, K]``, ``w_down`` ``[K, N]``.

Reproducibility: a problem is a pure function of its arguments. The random streams are
separate, so the weights depend only on ``(seed, K, N)`` and the workload's unit
parameters (never on M: a decode problem and a prefill problem of the same seed share
one "model"), and ``x`` for M tokens is the first M rows of ``x`` for more tokens.

Example:
    >>> from twell import workloads
    >>> problem = workloads.make("uniform", 64, 256, 512, seed=1)
    >>> problem
    Problem('uniform', M=64, K=256, N=512, dtype=bfloat16, design_l0=2.56)
    >>> problem.x.shape, problem.w_gate.shape, problem.w_down.shape
    ((64, 256), (512, 256), (256, 512))
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ml_dtypes
import numpy as np


# SciPy is imported on first use (it costs a noticeable part of a second at import time).
def _ndtr(x: Any) -> Any:
    """The standard normal CDF Φ (scipy.special.ndtr)."""
    from scipy.special import ndtr as phi

    return phi(x)


def _ndtri(p: Any) -> Any:
    """The inverse standard normal CDF Φ⁻¹ (scipy.special.ndtri)."""
    from scipy.special import ndtri as phi_inverse

    return phi_inverse(p)


__all__ = [
    "Problem",
    "WORKLOADS",
    "DENSITIES",
    "PAPER_L0_PER_UNIT",
    "uniform",
    "heavy",
    "paperlike",
    "density",
    "make",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: The paper's 1.5B model keeps ~29 of 5632 units active per token.
PAPER_L0_PER_UNIT = 29.0 / 5632.0

#: The densities of the speedup-versus-sparsity sweep (docs/benchmark.md).
DENSITIES = (0.001, 0.005, 0.02, 0.05, 0.10)

# Independent random streams: each array comes from its own stream, so that changing one
# argument (M, p, frac, ...) does not reshuffle arrays that do not depend on it.
_STREAM_X = 0
_STREAM_W_GATE = 1
_STREAM_W_UP = 2
_STREAM_W_DOWN = 3
_STREAM_HEAVY_ROWS = 4
_STREAM_UNITS = 5
_STREAM_TOKEN_SCALES = 6

# Gauss-Hermite nodes (probabilists') for averaging over the log-normal token scale.
_QUADRATURE_NODES = 48


@dataclass(frozen=True, eq=False, repr=False)
class Problem:
    """One synthetic FFN problem: inputs and weights of a gated ReLU block.

    Attributes:
        name: the workload that made it (``"uniform"``, ``"heavy"``, ...).
        x: ``[M, K]`` activations.
        w_gate: ``[N, K]`` gate weights (``None`` for a non-gated problem).
        w_up: ``[N, K]`` up weights.
        w_down: ``[K, N]`` down weights.
        params: the workload's design parameters (``seed``, ``design_l0``, and per
            workload e.g. ``p``, ``heavy_rows``, ``sink_rows``, ``unit_threshold``).
    """

    name: str
    x: np.ndarray
    w_gate: np.ndarray | None
    w_up: np.ndarray
    w_down: np.ndarray
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def M(self) -> int:
        """Number of tokens."""
        return int(self.x.shape[0])

    @property
    def K(self) -> int:
        """Model width."""
        return int(self.x.shape[1])

    @property
    def N(self) -> int:
        """FFN width (hidden units)."""
        return int(self.w_up.shape[0])

    @property
    def gated(self) -> bool:
        """Whether the problem has a gate projection."""
        return self.w_gate is not None

    @property
    def nbytes(self) -> int:
        """Total bytes of the four arrays."""
        arrays = (self.x, self.w_gate, self.w_up, self.w_down)
        return sum(a.nbytes for a in arrays if a is not None)

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """``(x, w_gate, w_up, w_down)``, the argument order of ``twell.ffn``."""
        return self.x, self.w_gate, self.w_up, self.w_down

    def astype(self, dtype: Any) -> Problem:
        """A copy with every array cast to ``dtype`` (e.g. ``np.float32``)."""

        def cast(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a.astype(dtype)

        return replace(
            self,
            x=cast(self.x),
            w_gate=cast(self.w_gate),
            w_up=cast(self.w_up),
            w_down=cast(self.w_down),
            params=dict(self.params),
        )

    def as_nongated(self) -> Problem:
        """The non-gated variant ``relu(x @ w_up.T) @ w_down.T`` with the same sparsity.

        The gate weights (which carry the thresholds) become the up weights, so the
        hidden activation has the nonzero pattern of the gated problem's gate.
        """
        if self.w_gate is None:
            return self
        return replace(
            self,
            name=f"{self.name}-nongated",
            w_gate=None,
            w_up=self.w_gate,
            params=dict(self.params),
        )

    def gate_preactivation(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """``x @ w.T`` in float32 for the sparsifying projection (``w_gate``, else ``w_up``).

        Args:
            rows: optional subset of tokens (a slice or an index array).

        Returns:
            ``[M', N]`` float32 pre-activations.
        """
        w = self.w_gate if self.w_gate is not None else self.w_up
        x = self.x if rows is None else self.x[rows]
        return x.astype(np.float32) @ w.astype(np.float32).T

    def l0(self, rows: slice | np.ndarray | None = None) -> float:
        """Measured mean number of active units per token (float32 gate, ReLU > 0).

        Args:
            rows: optional subset of tokens to measure on (large M: subsample).
        """
        g = self.gate_preactivation(rows)
        return float(np.count_nonzero(g > 0)) / max(g.shape[0], 1)

    def __repr__(self) -> str:
        design = self.params.get("design_l0")
        extra = "" if design is None else f", design_l0={design:.3g}"
        return (
            f"Problem({self.name!r}, M={self.M}, K={self.K}, N={self.N}, "
            f"dtype={self.x.dtype}{extra})"
        )


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_shape(M: Any, K: Any, N: Any) -> tuple[int, int, int]:
    # K >= 2: column 0 carries the threshold, the rest the random projection.
    return _check_int("M", M, 1), _check_int("K", K, 2), _check_int("N", N, 1)


def _check_real(name: str, value: Any, low: float, high: float, *, closed: bool) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    value_f = float(value) if ok else math.nan
    inside = low <= value_f <= high if closed else low < value_f < high
    if not (ok and inside):
        interval = f"[{low}, {high}]" if closed else f"({low}, {high})"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return value_f


def _check_positive(name: str, value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (ok and math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- building


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _normal(seed: int, stream: int, shape: tuple[int, int], std: float) -> np.ndarray:
    """float32 N(0, std^2) without float64 temporaries."""
    a = _rng(seed, stream).standard_normal(shape, dtype=np.float32)
    a *= np.float32(std)
    return a


def _tokens(seed: int, M: int, K: int) -> np.ndarray:
    """float32 ``[M, K]``: column 0 is 1, the rest N(0, 1) (rows are prefix-stable in M)."""
    x = _rng(seed, _STREAM_X).standard_normal((M, K), dtype=np.float32)
    x[:, 0] = 1.0
    return x


def _gate_weights(seed: int, K: int, N: int, threshold: np.ndarray) -> np.ndarray:
    """float32 ``[N, K]``: column 0 is ``-threshold``, the rest N(0, 1/(K-1))."""
    w = _normal(seed, _STREAM_W_GATE, (N, K), 1.0 / math.sqrt(K - 1))
    w[:, 0] = -threshold
    return w


def _problem(
    name: str,
    x: np.ndarray,
    w_gate: np.ndarray,
    seed: int,
    params: dict[str, Any],
) -> Problem:
    M, K = x.shape
    N = w_gate.shape[0]
    w_up = _normal(seed, _STREAM_W_UP, (N, K), 1.0 / math.sqrt(K))
    w_down = _normal(seed, _STREAM_W_DOWN, (K, N), 1.0 / math.sqrt(N))
    return Problem(
        name=name,
        x=x.astype(BFLOAT16),
        w_gate=w_gate.astype(BFLOAT16),
        w_up=w_up.astype(BFLOAT16),
        w_down=w_down.astype(BFLOAT16),
        params={"seed": seed, **params},
    )


# ---------------------------------------------------------------------------- workloads


def uniform(M: int, K: int, N: int, p: float = 0.005, *, seed: int = 0) -> Problem:
    """Every unit fires independently with probability ``p`` for every token.

    ``x[:, 1:] ~ N(0, 1)``, ``x[:, 0] = 1``; ``w_gate[:, 1:] ~ N(0, 1/(K-1))``,
    ``w_gate[:, 0] = -z`` with ``z = Φ⁻¹(1 - p)``; ``w_up ~ N(0, 1/K)``,
    ``w_down ~ N(0, 1/N)``. Design L0 is ``p·N`` (p=0.005, N=5632: 28.2).

    Args:
        M, K, N: tokens, model width (>= 2), FFN width.
        p: firing probability, in (0, 1).
        seed: non-negative integer seed.

    Returns:
        A :class:`Problem`; ``params`` holds ``p``, ``z``, ``design_l0``.
    """
    M, K, N = _check_shape(M, K, N)
    p = _check_real("p", p, 0.0, 1.0, closed=False)
    seed = _check_int("seed", seed, 0)
    z = float(-_ndtri(p))
    x = _tokens(seed, M, K)
    w_gate = _gate_weights(seed, K, N, np.full(N, z, dtype=np.float32))
    return _problem("uniform", x, w_gate, seed, {"p": p, "z": z, "design_l0": p * N})


def heavy(
    M: int,
    K: int,
    N: int,
    p: float = 0.005,
    *,
    frac: float = 0.01,
    scale: float = 3.0,
    seed: int = 0,
) -> Problem:
    """:func:`uniform`, then a random ``frac`` of tokens get ``x[:, 1:] *= scale``.

    Those heavy tokens fire each unit with probability ``Φ(-z/scale)`` (p=0.005,
    scale=3: 0.195, ~50 per 256-unit tile and up to ~75): at tile 256 / 32 slots their
    rows overflow, which is what exercises the dense backup. The number of heavy tokens
    is ``round(frac·M)``, at least 1 when ``frac > 0`` (so small M still has one).

    Args:
        M, K, N: tokens, model width (>= 2), FFN width.
        p: firing probability of an ordinary token, in (0, 1).
        frac: fraction of heavy tokens, in [0, 1].
        scale: factor applied to the heavy tokens' ``x[:, 1:]`` (> 0).
        seed: non-negative integer seed.

    Returns:
        A :class:`Problem`; ``params`` holds ``p``, ``z``, ``frac``, ``scale``,
        ``heavy_rows`` (sorted int64 token ids) and ``design_l0``.
    """
    M, K, N = _check_shape(M, K, N)
    p = _check_real("p", p, 0.0, 1.0, closed=False)
    frac = _check_real("frac", frac, 0.0, 1.0, closed=True)
    scale = _check_positive("scale", scale)
    seed = _check_int("seed", seed, 0)
    z = float(-_ndtri(p))
    n_heavy = 0 if frac == 0.0 else max(1, round(frac * M))
    rows = np.sort(_rng(seed, _STREAM_HEAVY_ROWS).choice(M, size=n_heavy, replace=False))
    x = _tokens(seed, M, K)
    x[rows, 1:] *= np.float32(scale)
    w_gate = _gate_weights(seed, K, N, np.full(N, z, dtype=np.float32))
    heavy_rate = float(_ndtr(-z / scale))
    design_l0 = N * ((M - n_heavy) * p + n_heavy * heavy_rate) / M
    params = {
        "p": p,
        "z": z,
        "frac": frac,
        "scale": scale,
        "heavy_rows": rows.astype(np.int64),
        "design_l0": design_l0,
    }
    return _problem("heavy", x, w_gate, seed, params)


def _expected_l0(
    threshold: np.ndarray,
    scales: np.ndarray,
    weights: np.ndarray,
) -> float:
    """Σ_n E_s[Φ(-z_n / s)] with the token scale s given as quadrature ``(scales, weights)``."""
    return float(_ndtr(-threshold[:, None] / scales[None, :]).sum(axis=0) @ weights)


def _calibrate_log_rate_mean(
    log_rate_noise: np.ndarray,
    *,
    n_dead: int,
    dead_z: float,
    scales: np.ndarray,
    weights: np.ndarray,
    target_l0: float,
    max_rate: float,
) -> float:
    """The mean μ of the units' log firing rates that puts the expected L0 at ``target_l0``.

    Alive unit n fires (at token scale 1) with rate ``min(exp(μ + noise_n), max_rate)``,
    i.e. threshold ``z_n = -Φ⁻¹(rate)``; the expected L0 is monotone in μ, so a bracketed
    root search (Brent) finds μ deterministically.
    """
    dead = n_dead * float(_ndtr(-dead_z / scales) @ weights)

    def excess(mu: float) -> float:
        rate = np.minimum(np.exp(mu + log_rate_noise), max_rate)
        return dead + _expected_l0(-_ndtri(rate), scales, weights) - target_l0

    low = math.log(1e-300) - float(log_rate_noise.min())
    high = math.log(max_rate) - float(log_rate_noise.min())
    lowest, highest = excess(low) + target_l0, excess(high) + target_l0
    if not lowest < target_l0 < highest:
        raise ValueError(
            f"target_l0 must lie in ({lowest:.4g}, {highest:.4g}) for these unit "
            f"parameters, got {target_l0!r}"
        )
    from scipy.optimize import brentq

    return float(brentq(excess, low, high, xtol=1e-12, rtol=1e-12, maxiter=500))


def paperlike(
    M: int,
    K: int,
    N: int,
    *,
    seed: int = 0,
    seq_len: int = 2048,
    target_l0: float | None = None,
    dead_frac: float = 0.3,
    dead_z: float = 6.0,
    rate_sigma: float = 1.0,
    token_sigma: float = 0.25,
    sink_scale: float = 4.0,
    max_rate: float = 0.5,
) -> Problem:
    """Activations shaped like a trained sparse model's: dead, cold and hot units, sinks.

    - ``dead_frac`` (30%) of units practically never fire: threshold ``z = dead_z``
      (6), a rate of 2e-5 for ordinary tokens (7% for the ×4 sinks).
    - The other units' firing rates (at token scale 1) are log-normal across units:
      ``rate_n = min(exp(μ + rate_sigma·ε_n), max_rate)``, threshold
      ``z_n = -Φ⁻¹(rate_n)``.
    - Each token m has a log-normal scale ``s_m = exp(token_sigma·η_m)`` applied to
      ``x[m, 1:]``, so its pre-activations are ``s_m·ξ - z_n``.
    - The first token of every ``seq_len``-token sequence (m % seq_len == 0) is a
      BOS-like sink: its ``x[m, 1:]`` is scaled by another ``sink_scale`` (×4). Sinks fire
      hundreds of units, dead ones included, and overflow TwELL tiles.

    μ is calibrated deterministically, from the drawn ε_n, so that the expected mean L0
    over tokens (sinks included at their share ``1/seq_len``; token scale integrated by
    Gauss-Hermite quadrature) equals ``target_l0``, by default ``29/5632·N`` (the paper's
    1.5B model: 29 at N=5632). The weights do not depend on M.

    Realized (seed 0, K=2048, N=5632, seq_len 2048, float32 gate): mean L0 28.1 at
    M=4096 and 29.35 at M=16384 (seeds 1-3 at M=4096: 29.8, 29.2, 30.1). Per-token L0
    is very uneven by design (the token scale moves every unit's rate together): median
    11, 90th percentile 80, 99th 221; sinks 600-1800. Overflowing rows at tile 256 /
    32 slots: 0.049% at both M (exactly the sinks: 2 rows, 8 rows).

    >>> problem = paperlike(2048, 256, 5632, seed=0)
    >>> round(problem.params["design_l0"], 6)
    29.0
    >>> round(problem.l0(), 1)
    28.3

    Args:
        M, K, N: tokens, model width (>= 2), FFN width.
        seed: non-negative integer seed.
        seq_len: tokens per sequence; token ``m`` is a sink when ``m % seq_len == 0``.
        target_l0: expected mean active units per token; default ``29/5632·N``.
        dead_frac: fraction of units that never fire, in [0, 1).
        dead_z: threshold of the dead units (> 0).
        rate_sigma: spread of the log firing rates across alive units (>= 0).
        token_sigma: spread of the log token scale (>= 0).
        sink_scale: extra scale of the sink tokens (> 0).
        max_rate: cap on an alive unit's firing rate, in (0, 0.5].

    Returns:
        A :class:`Problem`; ``params`` holds the arguments, the calibrated
        ``log_rate_mean`` μ, ``unit_threshold`` (float32 ``[N]``), ``dead_units``,
        ``sink_rows`` and ``design_l0`` (= target).
    """
    M, K, N = _check_shape(M, K, N)
    seed = _check_int("seed", seed, 0)
    seq_len = _check_int("seq_len", seq_len, 1)
    dead_frac = _check_real("dead_frac", dead_frac, 0.0, 1.0, closed=True)
    if dead_frac >= 1.0:
        raise ValueError(f"dead_frac must be a number in [0, 1), got {dead_frac!r}")
    dead_z = _check_positive("dead_z", dead_z)
    rate_sigma = _check_real("rate_sigma", rate_sigma, 0.0, 10.0, closed=True)
    token_sigma = _check_real("token_sigma", token_sigma, 0.0, 10.0, closed=True)
    sink_scale = _check_positive("sink_scale", sink_scale)
    max_rate = _check_real("max_rate", max_rate, 0.0, 0.5, closed=True)
    if max_rate == 0.0:
        raise ValueError("max_rate must be a number in (0, 0.5], got 0.0")
    if target_l0 is None:
        target_l0 = PAPER_L0_PER_UNIT * N
    target_l0 = _check_positive("target_l0", target_l0)

    units = _rng(seed, _STREAM_UNITS)
    n_dead = round(dead_frac * N)
    if N - n_dead == 0:
        raise ValueError(f"dead_frac={dead_frac!r} leaves no alive unit at N={N}")
    order = units.permutation(N)
    dead_units = np.sort(order[:n_dead])
    alive_units = order[n_dead:]
    log_rate_noise = rate_sigma * units.standard_normal(N - n_dead)

    # Token-scale distribution: ordinary tokens with weight 1 - 1/seq_len, sinks 1/seq_len.
    nodes, node_weights = np.polynomial.hermite_e.hermegauss(_QUADRATURE_NODES)
    node_weights = node_weights / math.sqrt(2.0 * math.pi)
    sink_share = 1.0 / seq_len
    base = np.exp(token_sigma * nodes)
    scales = np.concatenate([base, sink_scale * base])
    weights = np.concatenate([(1.0 - sink_share) * node_weights, sink_share * node_weights])

    mu = _calibrate_log_rate_mean(
        log_rate_noise,
        n_dead=n_dead,
        dead_z=dead_z,
        scales=scales,
        weights=weights,
        target_l0=target_l0,
        max_rate=max_rate,
    )
    threshold = np.empty(N, dtype=np.float64)
    threshold[dead_units] = dead_z
    threshold[alive_units] = -_ndtri(np.minimum(np.exp(mu + log_rate_noise), max_rate))

    x = _tokens(seed, M, K)
    token_scale = np.exp(
        np.float32(token_sigma)
        * _rng(seed, _STREAM_TOKEN_SCALES).standard_normal(M, dtype=np.float32)
    )
    sink_rows = np.arange(0, M, seq_len, dtype=np.int64)
    token_scale[sink_rows] *= np.float32(sink_scale)
    x[:, 1:] *= token_scale[:, None]

    w_gate = _gate_weights(seed, K, N, threshold.astype(np.float32))
    params = {
        "seq_len": seq_len,
        "target_l0": target_l0,
        "dead_frac": dead_frac,
        "dead_z": dead_z,
        "rate_sigma": rate_sigma,
        "token_sigma": token_sigma,
        "sink_scale": sink_scale,
        "max_rate": max_rate,
        "log_rate_mean": mu,
        "unit_threshold": threshold.astype(np.float32),
        "dead_units": dead_units.astype(np.int64),
        "sink_rows": sink_rows,
        "design_l0": target_l0,
    }
    return _problem("paperlike", x, w_gate, seed, params)


def density(p: float, M: int, K: int, N: int, *, seed: int = 0) -> Problem:
    """:func:`uniform` at firing probability ``p`` (the sparsity sweep, see ``DENSITIES``).

    Same weights (apart from the threshold column) and same ``x`` for every ``p`` of a
    seed, so the sweep varies only the sparsity.
    """
    problem = uniform(M, K, N, p, seed=seed)
    return replace(problem, name="density")


#: Workload name → function ``f(M, K, N, **kw)`` (``density`` needs ``p=``).
WORKLOADS: dict[str, Callable[..., Problem]] = {
    "uniform": uniform,
    "heavy": heavy,
    "paperlike": paperlike,
    "density": density,
}


def make(name: str, M: int, K: int, N: int, seed: int = 0, **kw: Any) -> Problem:
    """Build workload ``name`` at shape ``(M, K, N)``.

    Args:
        name: a key of :data:`WORKLOADS`.
        M, K, N: tokens, model width, FFN width.
        seed: non-negative integer seed.
        **kw: the workload's own parameters (``p``, ``frac``, ``scale``, ``seq_len``, ...).

    Example:
        >>> make("density", 8, 64, 256, p=0.05).params["p"]
        0.05
    """
    try:
        function = WORKLOADS[name]
    except (KeyError, TypeError):
        raise ValueError(f"name must be one of {sorted(WORKLOADS)}, got {name!r}") from None
    if name == "density" and "p" not in kw:
        raise ValueError("density needs p=, e.g. make('density', M, K, N, p=0.02)")
    return function(M=M, K=K, N=N, seed=seed, **kw)
