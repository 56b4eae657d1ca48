"""Synthetic sweep: d_k x scale x seq x std -> measurements next to their theory.

For every grid point the unscaled logits s = q . k_j come from ``synthetic``;
the logits the softmax sees are x = scale * s, kept in float64 as "the scores as
given". Then, as ``attncheck run`` does: the float64 reference softmax of x, and
for every method x dtype the softmax of x cast to the dtype, its NaN rows, its
exp-overflow rows and its error against the reference. The theory beside each
measurement is in ``theory``.

No printing, no paths, no typer or rich here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from attncheck.devices import resolve_device
from attncheck.draws import OUTPUT_ROWS, head_layout
from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.softmax import MethodParams, reference_softmax, run_method
from attncheck.numerics.precision import cast, dtype_from_name, exp_overflow_threshold, limits_of
from attncheck.numerics.rowmath import entropy, jacobian_frobenius
from attncheck.numerics.sweep.synthetic import entry_moments, make_qk, scores_of
from attncheck.numerics.sweep.theory import (
    naive_overflow_log_probability,
    probability_from_log,
    var_qk_stderr,
    var_qk_theory,
)
from attncheck.params import COLLAPSE_THRESHOLD, Scale
from attncheck.registry import PATHS
from attncheck.results.sweep import SweepCell, SweepOutput, SweepPoint, SweepResult

if TYPE_CHECKING:  # the caller's config, read as given: numerics imports no config
    from attncheck.config.sweep import SweepConfig

__all__ = ["RowStats", "measure_outputs", "row_stats", "run_sweep"]


# --------------------------------------------------------------------------- results


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


def _measure_cells(
    x: torch.Tensor, ref: torch.Tensor, point_theory: dict[str, float], config: SweepConfig
) -> list[SweepCell]:
    """Every method x dtype on logits x (R, S) float64 with reference ``ref``; ``point_theory``:
    the natural log of the predicted naive overflow rate per dtype."""
    cells = []
    rows = x.shape[0]
    ref_ok = torch.isfinite(ref).all(dim=-1)  # (R,)
    for name in config.dtypes:
        xc = cast(x, dtype_from_name(name))  # (R, S) the logits in the cell's dtype
        ref_algo = reference_softmax(xc)  # (R, S) float64
        algo_ok = torch.isfinite(ref_algo).all(dim=-1)
        for method in config.methods:
            out = run_method(method, xc, block=config.block)
            p = out.probs.to(torch.float64)  # (R, S)
            finite = torch.isfinite(p).all(dim=-1)  # (R,)
            exp_over = theory = theory_log10 = None
            if method == "naive" and name in point_theory:
                log_p = point_theory[name]
                theory = probability_from_log(log_p)
                theory_log10 = log_p / math.log(10.0)
            if method == "naive":  # the event the Gaussian tail predicts, without the row-sum overflows
                exp_over = float(out.events["exp_overflow"].double().mean())
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
                    exp_overflow_rate_theory=theory,
                    max_abs_err=_max_over(err, finite & ref_ok),
                    max_abs_err_algo=_max_over(err_algo, finite & algo_ok),
                    exp_overflow_rate_theory_log10=theory_log10,
                )
            )
    return cells


def measure_outputs(
    q, k, v, scale: float, dtypes, paths, block: int, device, methods: dict[str, str] | None = None
) -> list[SweepOutput]:
    """The output O = P@V of each attention path x dtype for heads q (H, Q, d), k, v (H, S, d)
    in float64, against float64 softmax(scale q.k) @ v. The eager path runs torch.softmax
    unless ``methods`` names another softmax for it."""
    if not paths:
        return []
    inp = prepare_inputs(q, k, v=v, scale=Scale(repr(scale)))
    (blk,) = list(score_blocks(inp, inp.rows, device, start_audit(inp, statistics=False)))  # every head in one block
    ref = torch.softmax(blk.given, dim=-1)  # (R, S) float64
    out_ref = blk.reference_out(ref)  # (R, d) float64
    params = MethodParams(block=block)
    results = []
    for name in dtypes:
        dt = dtype_from_name(name)
        for p in paths:
            cell = PATHS.get(p).function()(blk, dt, [(methods or {}).get(p, "torch")], params).cells[0][1]
            o = cell.out.to(torch.float64)  # (R, d)
            finite = torch.isfinite(o).all(dim=-1)
            d = (o - out_ref)[finite]
            results.append(
                SweepOutput(
                    path=p,
                    dtype=name,
                    rows=o.shape[0],
                    nan_rate=float((~finite).double().mean()),
                    max_abs_err=float(d.abs().max()) if d.numel() else None,
                    rmse=float(d.pow(2).mean().sqrt()) if d.numel() else None,
                    rel_l1=float(d.abs().sum() / out_ref[finite].abs().sum()) if d.numel() else None,
                )
            )
    return results


def _point_seed(seed: int, dk: int, seq: int) -> int:
    """A seed per (d_k, seq): adding a value to the grid leaves the other points' draws unchanged."""
    return (seed * 1_000_003 + dk) * 1_000_003 % (1 << 62) + seq


def run_sweep(config: SweepConfig, progress: Callable[[int, int], None] | None = None) -> SweepResult:
    """Measure every grid point; points come ordered seq, std, d_k, scale.
    ``progress(done, total)`` is called after each point."""
    device = resolve_device(config.device)
    points = []
    for seq in config.seqs:
        for std in config.stds:
            m2, m4 = entry_moments(config.dist, std)
            for dk in config.dks:
                heads, queries = head_layout(config.rows, seq)
                q, k, v = make_qk(
                    heads,
                    queries,
                    seq,
                    dk,
                    dist=config.dist,
                    std=std,
                    seed=_point_seed(config.seed, dk, seq),
                    with_v=True,
                )
                q, k, v = q.to(device), k.to(device), v.to(device)  # (H, Q, d), (H, S, d), (H, S, d) float64
                s = scores_of(q, k, config.rows)  # (R, S) float64: the logits before the scale
                oh = -(-min(OUTPUT_ROWS, config.rows) // queries)  # heads whose output is measured
                var_qk = float(s.var())
                theory = var_qk_theory(dk, m2, m2)
                stderr = var_qk_stderr(dk, config.rows, seq, m2, m4)
                for scale in config.scales:
                    c = scale.value(dk)
                    x = s * c  # (R, S) the logits as given
                    ref = reference_softmax(x)  # (R, S) float64
                    stats = row_stats(ref)
                    overflow_theory = {  # natural logs of the predictions
                        name: naive_overflow_log_probability(
                            exp_overflow_threshold(dtype_from_name(name)), c, dk, seq, m2, m2
                        )
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
                            outputs=measure_outputs(
                                q[:oh], k[:oh], v[:oh], c, config.dtypes, config.paths, config.block, device
                            ),
                        )
                    )
                    if progress is not None:
                        progress(len(points), config.points)
    return SweepResult(
        config=config,
        device=str(device),
        points=points,
        limits={d: limits_of(dtype_from_name(d)) for d in config.dtypes},
    )
