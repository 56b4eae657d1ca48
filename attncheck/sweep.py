"""Synthetic sweep: d_k x scale x seq x std -> measurements next to their theory.

For every grid point the unscaled logits s = q . k_j come from ``synthetic``;
the logits the softmax sees are x = scale * s, kept in float64 as "the scores as
given". Then, as ``attncheck run`` does: the float64 reference softmax of x, and
for every method x dtype the softmax of x cast to the dtype, its NaN rows, its
exp-overflow rows and its error against the reference.

Theory (entries of q and k i.i.d., mean 0, E[x^2] = v, E[x^4] = m4):

- Var(q . k) = d_k v^2 (d_k independent products of variance v^2);
- Var(scale * q . k) = scale^2 d_k v^2: 1 for 1/sqrt(d_k), 1/d_k for 1/d_k,
  1/d_k^3 for 1/d_k^2 (with v = 1);
- the chance that a row of naive softmax hits an exp overflow, see
  ``naive_overflow_probability``.

No printing, no paths, no typer or rich here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.diagnose import entropy, jacobian_frobenius, resolve_device
from attncheck.precision import dtype_from_name, exp_overflow_threshold
from attncheck.softmax import reference_softmax, run_method
from attncheck.sweep_config import (
    DIST_NAMES,
    SCALE_NAMES,
    Scale,
    SweepConfig,
    head_layout,
    parse_scale,
    parse_scales,
)
from attncheck.synthetic import entry_moments, make_scores

__all__ = [
    "DIST_NAMES",
    "SCALE_NAMES",
    "Scale",
    "SweepCell",
    "SweepConfig",
    "SweepPoint",
    "SweepResult",
    "RowStats",
    "naive_overflow_probability",
    "parse_scale",
    "parse_scales",
    "row_stats",
    "run_sweep",
    "uniform_limits",
    "var_qk_stderr",
    "var_qk_theory",
]

COLLAPSE_THRESHOLD = 0.99  # a row with max probability >= this counts as collapsed (as in `attncheck run`)
_CHI_NODES = 1200  # quadrature nodes over |q| for the overflow prediction
_CHI_HALF_WIDTH = 12.0  # chi_d has std < 0.71: +-12 around sqrt(d) holds all its mass


# --------------------------------------------------------------------------- results


@dataclass
class SweepCell:
    """One method x dtype at one grid point; rates are shares of rows."""

    method: str
    dtype: str
    rows: int
    nan_rate: float
    overflow_rate: float  # rows where an exp or the row sum hit inf from finite logits (as `run` counts them)
    exp_overflow_rate: float | None  # naive only: rows where exp of a finite logit is inf in the dtype
    exp_overflow_rate_theory: float | None  # naive only: its Gaussian-tail prediction
    max_abs_err: float | None  # max |p - p_float64(x)| over rows without NaN/inf; None if there are none
    max_abs_err_algo: float | None  # against float64 softmax of x after the cast to the dtype


@dataclass
class SweepPoint:
    dk: int
    scale: str  # as given: 'none', 'sqrt', 'dk', 'dk2' or the number as typed
    scale_value: float
    std: float
    seq: int
    rows: int
    dist: str
    var_qk: float  # sample variance of the unscaled logits q . k
    var_qk_theory: float
    var_qk_stderr: float  # standard error of var_qk under this layout (rows of a head share keys)
    var_scaled: float  # sample variance of scale * q . k
    var_scaled_theory: float
    max_prob_mean: float | None
    entropy_mean: float | None  # nats
    entropy_norm_mean: float | None  # entropy / log(seq): 1 is uniform, 0 one-hot
    jacobian_norm_mean: float | None  # ||diag(p) - p p^T||_F: 0 when collapsed, gradient dies
    collapsed_rate: float | None  # rows with max probability >= COLLAPSE_THRESHOLD
    jacobian_norm_collapsed_mean: float | None  # |J| over the collapsed rows only; None if there are none
    cells: list[SweepCell]


@dataclass
class SweepResult:
    config: SweepConfig
    device: str
    points: list[SweepPoint]


@dataclass
class RowStats:
    """Shape of softmax rows (from the float64 reference)."""

    rows: int
    max_prob_mean: float | None
    entropy_mean: float | None
    entropy_norm_mean: float | None
    jacobian_norm_mean: float | None
    collapsed_rate: float | None
    jacobian_norm_collapsed_mean: float | None  # over rows with max probability >= COLLAPSE_THRESHOLD


# --------------------------------------------------------------------------- theory


def var_qk_theory(dk: int, var_q: float, var_k: float) -> float:
    """Var(q . k) = d_k var_q var_k for independent zero-mean entries."""
    return dk * var_q * var_k


def var_qk_stderr(dk: int, rows: int, seq: int, m2: float, m4: float) -> float:
    """Standard error of the sample variance of all rows x seq logits q . k.

    With s = q . k and E[x^2] = m2, E[x^4] = m4 per entry:
    Var(s^2) = d m4^2 + (2 d^2 - 3 d) m2^4. Two logits sharing their q (same row)
    or their k (same head and key) are uncorrelated, but their squares are not:
    Cov(s^2, s'^2) = d m2^2 (m4 - m2^2). Rows are laid out by ``head_layout``.
    """
    heads, queries = head_layout(rows, seq)
    last = rows - (heads - 1) * queries  # queries of the (possibly cut) last head
    n = rows * seq
    var_s2 = dk * m4 * m4 + (2 * dk * dk - 3 * dk) * m2**4
    cov = dk * m2 * m2 * (m4 - m2 * m2)
    same_q = rows * seq * (seq - 1)
    same_k = seq * ((heads - 1) * queries * (queries - 1) + last * (last - 1))
    return math.sqrt((n * var_s2 + (same_q + same_k) * cov) / (n * n))


def uniform_limits(seq: int) -> tuple[float, float]:
    """(max probability, ||diag(p) - p p^T||_F) of the uniform softmax over ``seq`` keys:
    1/S and sqrt(S (1/S)^2 - 2 S (1/S)^3 + (1/S)^2) = sqrt(1/S - 1/S^2). A one-hot row gives (1, 0)."""
    return 1.0 / seq, math.sqrt(1.0 / seq - 1.0 / seq**2)


def _gauss_tail(z: float) -> float:
    """P(N(0, 1) > z)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def naive_overflow_probability(threshold: float, scale: float, dk: int, seq: int, var_q: float, var_k: float) -> float:
    """Chance that a row of ``seq`` logits x_j = scale * q . k_j has some x_j > ``threshold``.

    A Gaussian-tail prediction. Given q, x_j ~ N(0, scale^2 var_k |q|^2), independent
    over j (exact for normal keys; for the outlier mixture a Gaussian
    approximation with the same variance), and w = |q| / sqrt(var_q) follows a chi
    distribution with d_k degrees of freedom, so

        P = E_w[ 1 - (1 - Q(threshold / (scale sqrt(var_q var_k) w)))^seq ],

    Q the standard normal tail (via math.erfc), the mean over w taken by
    quadrature. It predicts single-exp overflow; naive softmax can also overflow
    through its row sum alone, which this does not count, and the cast of x to
    the dtype moves the threshold by under half an ulp.
    """
    if scale == 0:
        return 0.0
    sigma1 = scale * math.sqrt(var_q * var_k)  # std of x_j for |q| = sqrt(var_q)
    centre = math.sqrt(dk)
    lo = max(0.0, centre - _CHI_HALF_WIDTH)
    step = (centre + _CHI_HALF_WIDTH - lo) / _CHI_NODES
    total = weight_sum = 0.0
    logs = []
    for i in range(_CHI_NODES):
        w = lo + (i + 0.5) * step
        logs.append((w, (dk - 1) * math.log(w) - 0.5 * w * w))  # chi_d log-density up to a constant
    top = max(lw for _, lw in logs)
    for w, lw in logs:
        weight = math.exp(lw - top)
        if weight == 0.0:
            continue
        tail = _gauss_tail(threshold / (sigma1 * w))
        row = 1.0 if tail >= 1.0 else -math.expm1(seq * math.log1p(-tail))
        total += weight * row
        weight_sum += weight
    return total / weight_sum


# --------------------------------------------------------------------------- measurement


def row_stats(p: torch.Tensor) -> RowStats:
    """Mean max probability, entropy, normalised entropy and Jacobian norm of softmax rows (..., S).

    Rows with NaN/inf (undefined softmax) are left out.
    """
    p = p.reshape(-1, p.shape[-1])  # (R, S)
    ok = torch.isfinite(p).all(dim=-1)
    if not bool(ok.all()):
        p = p[ok]
    n = p.shape[0]
    if n == 0:
        return RowStats(0, None, None, None, None, None, None)
    h = entropy(p)  # (R,)
    pmax = p.amax(dim=-1)  # (R,)
    keys = p.shape[-1]
    jac = jacobian_frobenius(p)  # (R,)
    collapsed = pmax >= COLLAPSE_THRESHOLD  # (R,)
    return RowStats(
        rows=n,
        max_prob_mean=float(pmax.mean()),
        entropy_mean=float(h.mean()),
        entropy_norm_mean=float(h.mean()) / math.log(keys) if keys >= 2 else None,
        jacobian_norm_mean=float(jac.mean()),
        collapsed_rate=float(collapsed.double().mean()),
        jacobian_norm_collapsed_mean=float(jac[collapsed].mean()) if bool(collapsed.any()) else None,
    )


def _max_over(err: torch.Tensor, rows: torch.Tensor) -> float | None:
    if not bool(rows.any()):
        return None
    return float(err[rows].max())


def _measure_cells(x: torch.Tensor, ref: torch.Tensor, point_theory: dict[str, float | None], config: SweepConfig) -> list[SweepCell]:
    """Every method x dtype on logits x (R, S) float64 with reference ``ref``."""
    cells = []
    rows = x.shape[0]
    ref_ok = torch.isfinite(ref).all(dim=-1)  # (R,)
    for name in config.dtypes:
        xc = x.to(dtype_from_name(name))  # (R, S) the logits in the cell's dtype
        ref_algo = reference_softmax(xc)  # (R, S) float64
        algo_ok = torch.isfinite(ref_algo).all(dim=-1)
        for method in config.methods:
            out = run_method(method, xc, block=config.block)
            p = out.probs.to(torch.float64)  # (R, S)
            finite = torch.isfinite(p).all(dim=-1)  # (R,)
            exp_over = None
            if method == "naive":  # the event the Gaussian tail predicts, without the row-sum overflows
                exp_over = float((torch.isinf(torch.exp(xc)) & torch.isfinite(xc)).any(dim=-1).double().mean())
            err = (p - ref).abs().amax(dim=-1)  # (R,)
            err_algo = (p - ref_algo).abs().amax(dim=-1)
            cells.append(
                SweepCell(
                    method=method,
                    dtype=name,
                    rows=rows,
                    nan_rate=float(torch.isnan(p).any(dim=-1).double().mean()),
                    overflow_rate=float(out.overflow_rows.double().mean()),
                    exp_overflow_rate=exp_over,
                    exp_overflow_rate_theory=point_theory.get(name) if method == "naive" else None,
                    max_abs_err=_max_over(err, finite & ref_ok),
                    max_abs_err_algo=_max_over(err_algo, finite & algo_ok),
                )
            )
    return cells


def _point_seed(seed: int, dk: int, seq: int) -> int:
    """A seed per (d_k, seq): adding a value to the grid leaves the other points' draws unchanged."""
    return (seed * 1_000_003 + dk) * 1_000_003 % (1 << 62) + seq


def run_sweep(config: SweepConfig) -> SweepResult:
    """Measure every grid point; points come ordered seq, std, d_k, scale."""
    device = resolve_device(config.device)
    points = []
    for seq in config.seqs:
        for std in config.stds:
            m2, m4 = entry_moments(config.dist, std)
            for dk in config.dks:
                s = make_scores(config.rows, seq, dk, dist=config.dist, std=std, seed=_point_seed(config.seed, dk, seq), device=device)  # (R, S) float64
                var_qk = float(s.var())
                theory = var_qk_theory(dk, m2, m2)
                stderr = var_qk_stderr(dk, config.rows, seq, m2, m4)
                for scale in config.scales:
                    c = scale.value(dk)
                    x = s * c  # (R, S) the logits as given
                    ref = reference_softmax(x)  # (R, S) float64
                    stats = row_stats(ref)
                    overflow_theory = {
                        name: naive_overflow_probability(exp_overflow_threshold(dtype_from_name(name)), c, dk, seq, m2, m2)
                        for name in config.dtypes
                        if "naive" in config.methods
                    }
                    points.append(
                        SweepPoint(
                            dk=dk,
                            scale=scale.name,
                            scale_value=c,
                            std=std,
                            seq=seq,
                            rows=config.rows,
                            dist=config.dist,
                            var_qk=var_qk,
                            var_qk_theory=theory,
                            var_qk_stderr=stderr,
                            var_scaled=float(x.var()),
                            var_scaled_theory=c * c * theory,
                            max_prob_mean=stats.max_prob_mean,
                            entropy_mean=stats.entropy_mean,
                            entropy_norm_mean=stats.entropy_norm_mean,
                            jacobian_norm_mean=stats.jacobian_norm_mean,
                            collapsed_rate=stats.collapsed_rate,
                            jacobian_norm_collapsed_mean=stats.jacobian_norm_collapsed_mean,
                            cells=_measure_cells(x, ref, overflow_theory, config),
                        )
                    )
    return SweepResult(config=config, device=str(device), points=points)
