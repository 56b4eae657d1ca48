"""Rotary position embeddings (RoPE): the cos/sin table as a model computes it in a dtype, against float64.

A model rotates the pair (x_j, x_{j + d/2}) of q and k at position p by the angle p * inv_freq_j, with
inv_freq_j = theta^(-2j/d), j = 0 .. d/2 - 1 (transformers' ``LlamaRotaryEmbedding``, 5.x: ``inv_freq`` in fp32,
``position_ids.float() @ inv_freq`` in fp32 with autocast off, cos and sin in fp32, then cast to the activations'
dtype). The failures the issue cites put one of these steps in a narrow dtype:

- **positions held in bf16** (huggingface/candle PR 3520: ``inv_freq`` and the positions cast to bf16 before the
  product): integers are exact only up to 2^8 = 256 (bf16 keeps 8 significant bits), so position 257 rounds to 256
  and from there on neighbouring positions share a table row; 15,962 becomes 15,936;
- **positions held in fp16**: exact up to 2^11 = 2048, and from 65,520 (half an ulp above fp16's max 65504) they
  round to inf, so cos and sin are NaN.

With the positions exact (fp32 up to 2^24) and only the table or the rotation in bf16/fp16, neighbouring positions
stay distinct: the highest frequency (inv_freq_0 = 1) turns by one radian per position, which no 16-bit rounding of
a unit vector hides. What remains is an angle error: the rounding of the product p * inv_freq_j (half an ulp of the
angle) and of cos and sin (at most about one ulp of 1 in the table's dtype).

Pure functions over tensors; no verdicts (``attncheck.findings.rope`` judges).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.dtypes import dtype_from_name, dtype_label
from attncheck.numerics.rope_types import model_frequencies, reference_frequencies, why_not_judged
from attncheck.results.rope import RopeAudit, RopeTableCheck, RopeWhatIf

# Positions are audited in chunks so that a 1M-token context never holds more than this many table rows at once.
CHUNK_ROWS = 1 << 16


def inverse_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """The exact inverse frequencies theta^(-2j/d), j = 0 .. d/2 - 1, in float64: the reference."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return torch.tensor(float(theta), dtype=torch.float64) ** -exponents  # (d/2,)


def model_inverse_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """The inverse frequencies as transformers' default RoPE computes them: 1 / theta^(2j/d) in fp32."""
    return 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (d/2,)


def model_table(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    compute: torch.dtype,
    table: torch.dtype,
    rotation: torch.dtype | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions x inv_freq as a model computes them, each (P, d/2).

    ``compute`` holds the positions, the inverse frequencies, their product and cos/sin (transformers: fp32; the
    candle bug: bf16); ``table`` is the dtype the attention receives (the activations' dtype). ``rotation``, where
    given, is the dtype the rotation runs in: rotating the unit probe (1, 0) in it yields cos and sin rounded to it,
    which is what tells two positions apart after the rotation. ``scale``: the factor cos and sin are multiplied by
    in ``compute`` before the cast (transformers' ``attention_scaling``: yarn's attention factor, else 1).
    """
    pos = positions.to(compute)  # (P,)
    inv = inv_freq.to(compute)  # (F,)
    angles = pos[:, None] * inv[None, :]  # (P, F) rounded to compute
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(table), sin.to(table)
    if rotation is not None:
        cos, sin = cos.to(rotation), sin.to(rotation)
    return cos, sin


def angle_error(cos: torch.Tensor, sin: torch.Tensor, reference_angles: torch.Tensor) -> torch.Tensor:
    """The angle of each (cos, sin) minus the exact angle, wrapped into [-pi, pi), in float64 (NaN where non-finite)."""
    got = torch.atan2(sin.to(torch.float64), cos.to(torch.float64))
    return torch.remainder(got - reference_angles + math.pi, 2 * math.pi) - math.pi


def same_as_previous(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(P - 1,) bool: row p equal to row p - 1 in every entry, or either of them not finite (no position told)."""
    equal = ((cos[1:] == cos[:-1]) & (sin[1:] == sin[:-1])).all(dim=-1)
    finite = torch.isfinite(cos).all(dim=-1) & torch.isfinite(sin).all(dim=-1)
    return equal | ~finite[1:] | ~finite[:-1]


def significant_bits(dtype: torch.dtype) -> int:
    """Significant bits of a floating dtype (the implicit one included): bf16 8, fp16 11, fp32 24, fp64 53."""
    return 1 - int(round(math.log2(torch.finfo(dtype).eps)))


def first_inexact_position(dtype: torch.dtype) -> int:
    """The first integer the dtype rounds to another: 2^bits + 1 (bf16 257, fp16 2049, fp32 16,777,217)."""
    return (1 << significant_bits(dtype)) + 1


def first_infinite_position(dtype: torch.dtype) -> int:
    """The first integer that rounds to inf: max + half an ulp of max (fp16 65,520; bf16 and fp32 beyond 2^127)."""
    fi = torch.finfo(dtype)
    half_ulp = 2.0 ** (math.floor(math.log2(fi.max)) - significant_bits(dtype))
    return int(fi.max + half_ulp)


def predicted_first_indistinct(compute: torch.dtype) -> int:
    """Closed form: the first position whose table row repeats its predecessor's, when positions are held in
    ``compute``. Positions below 2^bits are exact and the highest frequency turns one radian per position, so no
    earlier row repeats; 2^bits + 1 rounds (to even) onto 2^bits."""
    return first_inexact_position(compute)


def audit_table(
    theta: float,
    head_dim: int,
    compute: torch.dtype,
    table: torch.dtype,
    context: int,
    rotation: torch.dtype | None = None,
    start: int = 0,
) -> RopeAudit:
    """Audit positions start .. context - 1 of the default RoPE table (transformers' fp32 inverse frequencies) in
    chunks of ``CHUNK_ROWS`` (each chunk carries its predecessor's last row, so adjacency crosses chunks)."""
    inv32 = model_inverse_frequencies(theta, head_dim)
    exact = inverse_frequencies(theta, head_dim)
    first_same = first_nan = None
    same_count, nan_rows, worst, worst_at, sq, count = 0, 0, -1.0, (start, 0), 0.0, 0
    prev: tuple[torch.Tensor, torch.Tensor] | None = None
    for lo in range(start, context, CHUNK_ROWS):
        positions = torch.arange(lo, min(lo + CHUNK_ROWS, context), dtype=torch.int64)
        cos, sin = model_table(positions, inv32, compute, table, rotation)
        err = angle_error(cos, sin, positions.to(torch.float64)[:, None] * exact[None, :]).abs()  # (P, F)
        finite = torch.isfinite(err)
        bad_rows = (~finite).any(dim=-1)
        if first_nan is None and bool(bad_rows.any()):
            first_nan = int(positions[bad_rows.nonzero()[0, 0]])
        nan_rows += int(bad_rows.sum())
        safe = torch.where(finite, err, torch.zeros((), dtype=err.dtype))
        flat = int(safe.argmax())
        if float(safe.view(-1)[flat]) > worst:
            worst = float(safe.view(-1)[flat])
            worst_at = (int(positions[flat // safe.shape[1]]), flat % safe.shape[1])
        sq += float((safe**2).sum())
        count += int(finite.sum())
        rows_cos = cos if prev is None else torch.cat([prev[0], cos])
        rows_sin = sin if prev is None else torch.cat([prev[1], sin])
        row_positions = positions if prev is None else torch.cat([positions[:1] - 1, positions])
        same = same_as_previous(rows_cos, rows_sin)  # (rows - 1,)
        same_count += int(same.sum())
        if first_same is None and bool(same.any()):
            first_same = int(row_positions[1:][same.nonzero()[0, 0]])
        prev = (cos[-1:], sin[-1:])
    return RopeAudit(
        theta=float(theta),
        head_dim=head_dim,
        compute=dtype_label(compute),
        table=dtype_label(table),
        rotation=None if rotation is None else dtype_label(rotation),
        context=context,
        predicted_first_indistinct=predicted_first_indistinct(compute),
        first_indistinct=first_same,
        indistinct_positions=same_count,
        first_nonfinite=first_nan,
        nonfinite_positions=nan_rows,
        # a row whose cos or sin is not finite has no angle: the error over the context is undefined, not the
        # error of its finite entries (theta 1e-300 leaves only frequency 0 finite, 4e-8 rad off)
        max_angle_error=max(worst, 0.0) if first_nan is None else None,
        max_error_position=worst_at[0] if first_nan is None else None,
        max_error_frequency=worst_at[1] if first_nan is None else None,
        rms_angle_error=math.sqrt(sq / count) if count and first_nan is None else None,
    )


def _frequency_columns(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The d/2 frequencies of a table: transformers' layout repeats them in both halves (cat(freqs, freqs)), the
    interleaved one (GPT-J) in pairs; None for neither."""
    half = cos.shape[-1] // 2

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN equal to NaN: a table NaN in both copies repeats
        return bool(((a == b) | (a.isnan() & b.isnan())).all())

    if same(cos[:, :half], cos[:, half:]) and same(sin[:, :half], sin[:, half:]):
        return cos[:, :half], sin[:, :half], "halves"
    if same(cos[:, 0::2], cos[:, 1::2]) and same(sin[:, 0::2], sin[:, 1::2]):
        return cos[:, 0::2], sin[:, 0::2], "interleaved"
    return None


# A theta fit extends over positions 0 .. FIT_FIRST, then FIT_GROWTH times as far at each stage, on at most
# FIT_ROWS table rows per stage (evenly spaced), until the table stops being consistent with one theta.
FIT_FIRST = 4
FIT_GROWTH = 4
FIT_ROWS = 1024
MAX_LN_THETA = 700.0  # |ln theta| beyond this has no float64 theta (e^709 is near its max): no fit
FIT_STEPS = 3  # Gauss-Newton steps per stage: the residuals are nearly linear in ln theta


def consistency_bound(dtype: torch.dtype, last_position: int) -> float:
    """Radians: the most a correctly computed table of ``dtype`` may be off its exact angles through
    ``last_position``: cos and sin each rounded to the dtype (at most sqrt(2) x half an ulp of [0.5, 1), below one
    eps) plus fp32's rounding of the product p x inv_freq (half an ulp of the angle, below p x 2^-24) and of inv_freq
    (a few ulps: p x inv_freq x 2^-22), together below p x 2^-21."""
    return float(torch.finfo(dtype).eps) + last_position * 2.0**-21


@dataclass(frozen=True)
class ThetaFit:
    theta: float
    residual: float  # radians: the largest |angle - p x theta^(-2j/d)| over the rows the fit used
    last_position: int  # the fit used the table's positions 0 .. last_position


def _fit_residuals(u: float, p: torch.Tensor, x: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(angle residuals wrapped into [-pi, pi) (R, F), their derivatives in ln theta) for ln theta = u."""
    pred = p[:, None] * torch.exp(-u * x)[None, :]  # (R, F)
    r = torch.remainder(got - pred + math.pi, 2 * math.pi) - math.pi
    return r, x[None, :] * pred


def fitted_theta(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> ThetaFit | None:
    """theta fitted to the table by least squares of its angles in float64 (Gauss-Newton on ln theta), needs
    position 1 in the table.

    One entry (the angle of frequency 1 at position 1, theta^(-2/d)) raised to d/2 gives a first estimate whose error
    is the entry's rounding times d/2 (a bf16 table of theta 500,000, d 64: 495,730, which then puts 0.48 rad
    between a correct table and its reference). The fit then takes every frequency of the positions 0 .. 4, 16, 64,
    ... (each stage's angles unwrapped around the previous stage's prediction, which is off by far less than pi),
    and stops before the first stage whose angles are not within ``consistency_bound`` of one theta: a correct table
    is fitted over all of its positions, a wrong one (positions rounded, inverse frequencies cast) over its leading
    consistent part only, so the fit does not absorb its error. The fewest significant digits (1, 2, 3: 10,000,
    500,000, 1e6) that fit the same positions as well within the bound are taken: such a theta is a config's."""
    at = (positions == 1).nonzero()
    freqs = cos.shape[-1]
    if len(at) == 0 or freqs < 2:
        return None
    finite = torch.isfinite(cos).all(-1) & torch.isfinite(sin).all(-1) & (positions >= 0)
    first = math.atan2(float(sin[int(at[0, 0]), 1]), float(cos[int(at[0, 0]), 1]))
    if not (first > 0 and bool(finite[int(at[0, 0])])):
        return None
    dim = 2 * freqs
    x = torch.arange(freqs, dtype=torch.float64) * 2 / dim  # exponents 2j/d
    p_all, order = positions[finite].sort()
    rows_all = finite.nonzero()[:, 0][order]  # the table's finite rows by position

    def stage(limit: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions <= limit, at most FIT_ROWS of them evenly spaced, and their angles (R,), (R, F)."""
        n = int((p_all <= limit).sum())
        pick = torch.linspace(0, n - 1, min(n, FIT_ROWS)).round().long()
        rows = rows_all[pick]
        return p_all[pick].to(torch.float64), torch.atan2(sin[rows].to(torch.float64), cos[rows].to(torch.float64))

    u, last = -(dim / 2) * math.log(first), 1  # ln theta from position 1 alone
    if not abs(u) < MAX_LN_THETA:
        return None  # no float theta: the angle at position 1 is not any theta's
    p, got = stage(last)
    limit, top = FIT_FIRST, int(p_all[-1])
    while last < top:
        p_try, got_try = stage(limit)
        trial = u
        for _ in range(FIT_STEPS):
            r, slope = _fit_residuals(trial, p_try, x, got_try)
            trial -= float((r * slope).sum() / (slope * slope).sum())
        worst = float(_fit_residuals(trial, p_try, x, got_try)[0].abs().max())
        if not abs(trial) < MAX_LN_THETA or (limit > FIT_FIRST and not worst <= consistency_bound(cos.dtype, limit)):
            break  # the table is not one theta's from here on: keep the fit of the part before
        u, last, limit, p, got = trial, int(p_try[-1]), limit * FIT_GROWTH, p_try, got_try

    def residual(v: float) -> float:
        return float(_fit_residuals(v, p, x, got)[0].abs().max())

    theta, worst = math.exp(u), residual(u)
    for digits in (1, 2, 3):
        round_theta = float(f"{theta:.{digits}g}")
        if residual(math.log(round_theta)) <= max(worst, consistency_bound(cos.dtype, last)):
            theta = round_theta
            break
    return ThetaFit(
        theta=theta, residual=_largest_residual(theta, p_all, rows_all, last, cos, sin, x), last_position=last
    )


def _largest_residual(theta: float, p_all, rows_all, last: int, cos, sin, x) -> float:
    """The largest |angle residual| against theta over every row the fit covers (not the stages' evenly spaced
    subset), in chunks of CHUNK_ROWS rows."""
    n, worst = int((p_all <= last).sum()), 0.0
    for lo in range(0, n, CHUNK_ROWS):
        rows = rows_all[lo : min(lo + CHUNK_ROWS, n)]
        got = torch.atan2(sin[rows].to(torch.float64), cos[rows].to(torch.float64))
        r, _ = _fit_residuals(math.log(theta), p_all[lo : lo + len(rows)].to(torch.float64), x, got)
        worst = max(worst, float(r.abs().max()))
    return worst


def _judge_angles(
    c: torch.Tensor, s: torch.Tensor, pos: torch.Tensor, ref: torch.Tensor, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|angle error| with inf where not finite (T, F), positions past ``tolerance`` (T,), rows repeating their
    adjacent predecessor's (T - 1,))."""
    err = angle_error(c, s, ref).abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))  # a NaN entry: no angle at all
    affected = err.max(dim=-1).values > tolerance
    same = same_as_previous(c, s) & (pos[1:] == pos[:-1] + 1)
    return err, affected, same


def magnitude_error(cos: torch.Tensor, sin: torch.Tensor, scale: float) -> float | None:
    """The largest |sqrt(cos^2 + sin^2) / scale - 1| over finite entries: how far the table's rows lie from the
    circle of radius ``scale`` (1, or yarn's attention factor); None where no entry is finite."""
    off = (torch.hypot(cos.to(torch.float64), sin.to(torch.float64)) / scale - 1).abs()
    finite = torch.isfinite(off)
    return float(off[finite].max()) if bool(finite.any()) else None


def what_if_tables(
    pos: torch.Tensor,
    ref: torch.Tensor,
    model_inv: torch.Tensor,
    scale: float,
    table: torch.dtype,
    dtypes,
    tolerance: float,
) -> tuple[RopeWhatIf, ...]:
    """The table recomputed in each of ``dtypes`` (names) at the same positions from the model's inverse frequencies
    ``model_inv``, against the float64 angles ``ref`` (T, d/2)."""
    out = []
    for name in dtypes:
        c, s = model_table(pos, model_inv, dtype_from_name(name), table, scale=scale)
        err, affected, same = _judge_angles(c, s, pos, ref, tolerance)
        worst = float(err.max())
        out.append(
            RopeWhatIf(
                dtype=name,
                first_indistinct=int(pos[1:][same].min()) if bool(same.any()) else None,
                first_affected=int(pos[affected].min()) if bool(affected.any()) else None,
                affected_positions=int(affected.sum()),
                max_angle_error=worst if math.isfinite(worst) else None,
            )
        )
    return tuple(out)


def _layout_note(layout: str, pos: torch.Tensor, row: torch.Tensor) -> str | None:
    nonfinite = ~torch.isfinite(row)
    notes = (
        None if layout == "halves" else "interleaved layout",
        f"cos/sin not finite from position {int(pos[nonfinite].min()):,}" if bool(nonfinite.any()) else None,
    )
    return "; ".join(n for n in notes if n) or None


def check_table(
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    theta: float | None,
    tolerance: float,
    rope_type: str = "default",
    what_if=(),
    parameters: dict | None = None,
) -> dict:
    """A recorded table (..., T, d) against float64 cos and sin of its positions x its type's inverse frequencies
    (``rope_types.reference_frequencies``; times yarn's attention factor): the first sequence only (the others
    share its recipe). Returns the fields of ``results.rope.RopeTableCheck`` that depend on the numbers (the caller
    adds the calls). A type not modelled, or one whose parameters were not recorded, is not judged and says why."""
    lead = cos.reshape(-1, *cos.shape[-2:])
    c2, s2 = lead[0], sin.reshape(-1, *sin.shape[-2:])[0]  # (T, d)
    given = positions is not None
    pos = positions.reshape(-1, positions.shape[-1])[0] if given else torch.arange(c2.shape[0])
    parameters = dict(parameters or {})
    out: dict = {"positions_from": "recorded" if given else "assumed", "theta": theta, "theta_from": ""}
    why = why_not_judged(rope_type, parameters, c2.shape[-1] // 2)
    if why is not None:
        return {**out, "judged": False, "note": why}
    cols = _frequency_columns(c2, s2)
    if cols is None:
        return {**out, "judged": False, "note": "cos and sin do not repeat their frequencies (halves or pairs)"}
    c, s, layout = cols
    out["theta_from"] = "config" if theta is not None else ""
    if theta is None and rope_type == "default":  # another type's angle at position 1 is not theta's alone
        fit = fitted_theta(c, s, pos)
        if fit is not None:
            theta = fit.theta
            out.update(theta=theta, theta_from="fitted", theta_fit_error=fit.residual, theta_fit_last=fit.last_position)
    if theta is None:
        note = "theta unknown: no config recorded, and no theta fits the table (none fits its angle at position 1)"
        if not bool((pos == 1).any()):
            note = "theta unknown: no config recorded and no position 1 to fit it from"
        return {**out, "judged": False, "note": note}
    dim = 2 * c.shape[-1]
    longest = int(positions.max()) + 1 if given else int(pos.max()) + 1  # longrope picks its factors by it
    inv, scale = reference_frequencies(rope_type, theta, dim, parameters, longest)
    ref = pos.to(torch.float64)[:, None] * inv[None, :]  # (T, d/2)
    err, affected, same = _judge_angles(c, s, pos, ref, tolerance)
    nonfinite = ~(torch.isfinite(c).all(dim=-1) & torch.isfinite(s).all(dim=-1))  # (T,): rows with no angle
    flat = int(err.argmax())
    worst = float(err.view(-1)[flat])
    model_inv = model_frequencies(rope_type, theta, dim, parameters, longest)
    fp32_cos, fp32_sin = model_table(pos, model_inv, torch.float32, c.dtype, scale=scale)
    out.update(
        judged=True,
        note=_layout_note(layout, pos, err.max(dim=-1).values),
        first_position=int(pos.min()),
        last_position=int(pos.max()),
        tolerance=tolerance,
        first_affected=int(pos[affected].min()) if bool(affected.any()) else None,
        affected_positions=int(affected.sum()),
        first_indistinct=int(pos[1:][same].min()) if bool(same.any()) else None,
        indistinct_positions=int(same.sum()),
        max_angle_error=worst if math.isfinite(worst) else None,  # None: undefined where cos/sin are not finite
        first_nonfinite=int(pos[nonfinite].min()) if bool(nonfinite.any()) else None,
        nonfinite_positions=int(nonfinite.sum()),
        max_error_position=int(pos[flat // err.shape[1]]),
        max_error_frequency=flat % err.shape[1],
        fp32_recipe_error=float(angle_error(fp32_cos, fp32_sin, ref).abs().max()),
        attention_factor=scale,
        max_magnitude_error=magnitude_error(c, s, scale),
        what_if=what_if_tables(pos, ref, model_inv, scale, c.dtype, what_if, tolerance),
    )
    return out


def table_checks(tables: list[dict], tolerance: float, what_if=(), rank: int | None = None) -> list[RopeTableCheck]:
    """Each recorded table ({'index', 'cos', 'sin', 'positions', 'theta', 'rope_type', 'parameters', 'calls',
    'modules'}, as ``loaders.rope`` reads them) checked by ``check_table``, with its calls' rotated q and k where the
    table carries their check (``qk``: ``numerics.rope_qk.RotatedQK.result``'s ``RopeQKCheck``); ``rank``: the
    process of a torchrun capture that recorded them (None: a single process)."""
    out = []
    for table in tables:
        cos = table["cos"]
        found = check_table(
            cos,
            table["sin"],
            table["positions"],
            table["theta"],
            tolerance,
            table["rope_type"],
            what_if,
            table.get("parameters"),
        )
        if table.get("qk") is not None:
            found["qk"] = table["qk"]
        out.append(
            RopeTableCheck(
                index=table["index"],
                shape=tuple(cos.shape),
                dtype=dtype_label(cos.dtype),
                calls=tuple(table["calls"]),
                modules=tuple(table["modules"]),
                rope_type=table["rope_type"],
                parameters=dict(table.get("parameters") or {}),
                rank=rank,
                **found,
            )
        )
    return out
