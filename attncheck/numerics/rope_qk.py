"""The rotated q and k against float64: what a recorded rotary table did to the vectors it turned.

A capture records each call's q and k after the rotation: x_rec = R_rec x + r, with R_rec the recorded table's
rotation ([[c, -s], [s, c]] on each pair of entries, c and s as recorded), x the unrotated vector (not recorded) and
r the rounding of the rotated vector to its dtype. Unrotating with the recorded table in float64 gives
u = R_rec^-1 x_rec = x + R_rec^-1 r, and turning u by the exact angles (positions x float64 inverse frequencies)
gives x_ref = R_ex u. Then

    x_rec - x_ref = (R_rec - R_ex) x + (I - R_ex R_rec^-1) r:

the table's error as this very vector meets it (each pair of entries weighted by its share of the vector), plus a
second-order term. On a pair, R_ex R_rec^-1 is a turn by the pair's angle error scaled by 1 / |recorded row|, so the
error depends on the vector only through the lengths of its pairs: a vector the model did not rotate, or paired
otherwise, still reads the table's error and nothing else. The dtype's rounding r cancels to within
|R_rec - R_ex| |r|, so a healthy bf16 model's own rounding of q and k (an ulp of bf16) is not counted as RoPE error:
a table computed right (fp32 angles, cos and sin cast to bf16) shows its cast alone, about 2^-9 of the vector. What
this cannot see is a rotation that did not apply the table it was passed (a kernel computing other angles): that
needs the unrotated q and k, which are not recorded.

Layouts: transformers' ``rotate_half`` pairs entry j with j + r/2 (cos and sin repeat their frequencies in both
halves); the interleaved layout (GPT-J's ``rotate_every_two``) pairs 2j with 2j + 1. A table narrower than the head
(partial rotary, r < d: GPT-NeoX, Phi) turns the first r entries and the rest pass through.

The scores: RoPE makes q_i.k_j depend on the angle between positions i and j only, so an error common to both (every
angle shifted alike) leaves them unchanged while positions rounded apart do not. The error of q_i.k_j relative to
|q_i| |k_j| is computed on a sample of pairs, beside the bound e_q + e_k + e_q e_k that holds for every pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.dtypes import dtype_label
from attncheck.numerics.rope import _frequency_columns, fitted_theta, inverse_frequencies
from attncheck.results.rope import RopeQKCheck, RopeVectorCheck

SCORE_SAMPLE = 64  # positions of a call whose q and k pair up for the scores' error (64 x 64 pairs per head)
CHUNK = 1 << 21  # float64 entries of one (batch, heads, positions, head dim) slice unrotated and rotated at once
CALLS_NAMED = 3  # calls named per reason a call (or its k) is not judged; the rest counted


def relative_tolerance(angle: float) -> float:
    """The relative error of a vector turned by ``angle`` radians: |R(a) x - x| / |x| = 2 sin(a / 2)."""
    return 2 * math.sin(angle / 2)


def implied_angle(relative: float) -> float:
    """The angle whose turn alone gives a relative error (``relative_tolerance`` inverted; pi from 2 on)."""
    return 2 * math.asin(min(relative / 2, 1.0)) if math.isfinite(relative) else math.pi


@dataclass
class _Recipe:
    """A recorded table's pairs of entries: its frequency columns as recorded and exact, per sequence."""

    layout: str  # 'halves' (rotate_half) or 'interleaved' (rotate_every_two)
    rotary: int  # r: the entries of the head it turns
    pos: torch.Tensor  # (Bt, T) int64
    c: torch.Tensor  # (Bt, T, r/2) float64: cos as recorded
    s: torch.Tensor
    ce: torch.Tensor  # (Bt, T, r/2) float64: cos of the exact angles
    se: torch.Tensor
    bad: torch.Tensor  # (Bt, T) bool: a row not finite or zero, no rotation at all
    gap: torch.Tensor  # (Bt, T, r/2): |x_rec - x_ref|^2 of a pair over its |x_rec|^2 (the same for every pair)
    gain: torch.Tensor  # (Bt, T, r/2): |x_ref|^2 of a pair over its |x_rec|^2


@dataclass
class _Role:
    """What the calls' q (or k) came to: the largest error per table position, over calls, batch and heads."""

    err: torch.Tensor  # (Bt, T) float64; -inf where no vector was judged
    calls: int = 0
    vectors: int = 0
    nonfinite: int = 0
    best: float = -math.inf
    best_call: int | None = None
    dtypes: dict | None = None  # label -> unit roundoff, of each dtype the vectors came in


def _pairs(x: torch.Tensor, layout: str, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two entries of each pair of the first r, (..., r/2) each."""
    if layout == "halves":
        return x[..., : r // 2], x[..., r // 2 : r]
    return x[..., 0:r:2], x[..., 1:r:2]


def _joined(a: torch.Tensor, b: torch.Tensor, rest: torch.Tensor, layout: str) -> torch.Tensor:
    turned = torch.cat((a, b), dim=-1) if layout == "halves" else torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((turned, rest), dim=-1)


class RotatedQK:
    """The rotated-q/k check of the calls under one recorded table: ``add`` each call's q and k (batch, heads,
    positions, head dim), then ``result``. ``why_not`` says why the table's calls cannot be judged at all."""

    def __init__(self, cos, sin, positions, theta: float | None, rope_type: str = "default") -> None:
        self.why_not: str | None = None
        self.recipe: _Recipe | None = None
        self.skipped: dict[str, list[int]] = {}
        self.calls = 0
        self.score = (-math.inf, None, None)  # (relative error, (query position, key position), call)
        self.pairs = 0
        self.bound: float | None = None
        if rope_type != "default":
            self.why_not = f"rope_type {rope_type}: its frequencies are not theta^(-2j/d)"
            return
        c = cos.reshape(-1, *cos.shape[-2:]).to(torch.float64)  # (Bt, T, r)
        s = sin.reshape(-1, *sin.shape[-2:]).to(torch.float64)
        bt, t, r = c.shape
        pos = positions.reshape(bt, t) if positions is not None else torch.arange(t).expand(bt, t)
        cols = _frequency_columns(c.reshape(bt * t, r), s.reshape(bt * t, r))
        if cols is None:
            self.why_not = "cos and sin do not repeat their frequencies (halves or pairs)"
            return
        cf, sf, layout = (cols[0].reshape(bt, t, r // 2), cols[1].reshape(bt, t, r // 2), cols[2])
        if theta is None:
            # the table's own fit, as its check makes it: on the entries in the table's dtype, whose rounding bounds
            # how far the fit may run (in float64 it would stop at the first positions and fit them alone)
            fit = fitted_theta(cf[0].to(cos.dtype), sf[0].to(cos.dtype), pos[0])
            theta = None if fit is None else fit.theta
        if theta is None:
            self.why_not = "theta unknown: no config recorded and no position 1 to fit it from"
            return
        angles = pos.to(torch.float64)[..., None] * inverse_frequencies(theta, r)  # (Bt, T, r/2)
        finite = torch.isfinite(cf).all(-1) & torch.isfinite(sf).all(-1)
        m = cf * cf + sf * sf  # the recorded row's squared length: 1 but for its rounding
        bad = ~finite | (m == 0).any(-1)
        ce, se = angles.cos(), angles.sin()
        # R_ex R_rec^-1 = [[al, -be], [be, al]] on each pair (a turn by the angle error, scaled by 1 / |row|):
        # x_rec - x_ref = [[1 - al, be], [-be, 1 - al]] x_rec, whose length is sqrt((1 - al)^2 + be^2) |x_rec|
        al, be = (cf * ce + sf * se) / m, (cf * se - sf * ce) / m
        gap, gain = (1 - al) ** 2 + be**2, al**2 + be**2
        self.recipe = _Recipe(layout, r, pos, cf, sf, ce, se, bad, gap, gain)
        self.roles = {role: _Role(torch.full((bt, t), -math.inf, dtype=torch.float64)) for role in ("q", "k")}

    def skip(self, reason: str, call: int) -> None:
        self.skipped.setdefault(reason, []).append(call)

    def _misfit(self, x, name: str) -> str | None:
        """Why ``x`` cannot be the rotated q or k of this table's positions."""
        rec = self.recipe
        bt, t = rec.pos.shape
        if x is None:
            return f"no {name} recorded"
        if x.dim() != 4 or not x.is_floating_point():
            return f"{name} is not a floating (batch, heads, positions, head dim) tensor"
        if x.shape[-2] != t:
            cache = " (keys of a KV cache)" if name == "k" and x.shape[-2] > t else ""
            return f"{name} holds {x.shape[-2]:,} positions and the table {t:,}{cache}"
        if x.shape[-1] < rec.rotary:
            return f"{name}'s head dim {x.shape[-1]} is narrower than the table's {rec.rotary}"
        if bt not in (1, x.shape[0]):
            return f"{name} has batch {x.shape[0]} and the table {bt}"
        return None

    def add(self, call: int, q, k) -> None:
        """A call's q and k as recorded (after the rotation): judged, or skipped with the reason."""
        if self.recipe is None:
            return
        problem = self._misfit(q, "q")
        if problem is not None:
            self.skip(problem, call)
            return
        self.calls += 1
        eq, tq = self._judge("q", call, q)
        problem = self._misfit(k, "k")
        if problem is None and k.shape[0] != q.shape[0]:
            problem = f"k has batch {k.shape[0]} and q {q.shape[0]}"
        if problem is None and q.shape[1] % k.shape[1]:
            problem = f"q's {q.shape[1]} heads are no multiple of k's {k.shape[1]}"
        if problem is not None:
            self.skip("k not judged: " + problem, call)
            return
        ek, tk = self._judge("k", call, k)
        self._scores(call, q, k, (tq, tk))
        if math.isfinite(eq) and math.isfinite(ek):
            self.bound = max(self.bound or 0.0, eq + ek + eq * ek)
        elif eq > -math.inf and ek > -math.inf:
            self.bound = math.inf

    def _reference(self, x: torch.Tensor, sel) -> torch.Tensor:
        """x (B, H, t, d) float64 at the table's positions ``sel`` (a slice or indices of T), unrotated with the
        recorded table and turned by the exact angles."""
        rec = self.recipe
        c, s, ce, se = (v[:, sel][:, None] for v in (rec.c, rec.s, rec.ce, rec.se))  # (Bt, 1, t, r/2)
        a, b = _pairs(x, rec.layout, rec.rotary)
        m = c * c + s * s
        u, v = (a * c + b * s) / m, (b * c - a * s) / m
        return _joined(u * ce - v * se, v * ce + u * se, x[..., rec.rotary :], rec.layout)

    def _judge(self, role: str, call: int, x: torch.Tensor) -> tuple[float, int]:
        """Each vector's relative error, max over heads (and over a batch the table broadcasts over) into the role's
        per-position maximum; returns this call's largest error and its position index."""
        rec, acc = self.recipe, self.roles[role]
        b, h, t, d = x.shape
        err = torch.full((b, t), -math.inf, dtype=torch.float64)
        step = max(1, CHUNK // max(1, b * h * d))
        for lo in range(0, t, step):
            hi = min(t, lo + step)
            xs = x[:, :, lo:hi].detach().to("cpu", torch.float64)
            a, pair = _pairs(xs, rec.layout, rec.rotary)
            energy = a * a + pair * pair  # (B, H, t, r/2): each pair's |x_rec|^2, all its error depends on
            gap = (energy * rec.gap[:, None, lo:hi]).sum(dim=-1)
            ref = (energy * rec.gain[:, None, lo:hi]).sum(dim=-1) + (xs[..., rec.rotary :] ** 2).sum(dim=-1)
            e = torch.where(gap == 0, torch.zeros((), dtype=gap.dtype), (gap / ref).sqrt())  # (B, H, t)
            finite = torch.isfinite(xs).all(dim=-1)
            bad = rec.bad[:, None, lo:hi].expand_as(e)
            left_out = ~finite & ~bad  # NaN or inf in the model's own q: the diagnosis reports it, not RoPE
            e = torch.where(bad, math.inf, torch.where(left_out, -math.inf, e))
            acc.nonfinite += int(left_out.sum())
            acc.vectors += int((~left_out).sum())
            err[:, lo:hi] = e.amax(dim=1)
        per_table = err if rec.pos.shape[0] == b else err.amax(dim=0, keepdim=True)
        acc.err = torch.maximum(acc.err, per_table)
        acc.calls += 1
        acc.dtypes = {**(acc.dtypes or {}), dtype_label(x.dtype): torch.finfo(x.dtype).eps / 2}
        flat = int(err.argmax())
        worst = float(err.view(-1)[flat])
        if worst > acc.best:
            acc.best, acc.best_call = worst, call
        return worst, flat % t

    def _scores(self, call: int, q: torch.Tensor, k: torch.Tensor, worst: tuple[int, int]) -> None:
        """q_i.k_j as recorded against the same pair rotated exactly, over SCORE_SAMPLE positions spread evenly (and
        the worst q and k positions), keys at or before their query (the pairs a causal model sees too), every head
        and batch row; relative to |q_ref_i| |k_ref_j|."""
        rec = self.recipe
        t = q.shape[-2]
        idx = torch.linspace(0, t - 1, min(t, SCORE_SAMPLE)).round().to(torch.int64)
        idx = torch.unique(torch.cat((idx, torch.tensor(worst, dtype=torch.int64))))
        qs = q[:, :, idx].detach().to("cpu", torch.float64)
        ks = k[:, :, idx].detach().to("cpu", torch.float64)
        qr, kr = self._reference(qs, idx), self._reference(ks, idx)
        group = q.shape[1] // k.shape[1]  # grouped-query attention: query head h reads k head h // group
        ks, kr = ks.repeat_interleave(group, dim=1), kr.repeat_interleave(group, dim=1)
        delta = (qs @ ks.mT - qr @ kr.mT).abs()  # (B, H, S, S)
        scale = qr.norm(dim=-1)[..., :, None] * kr.norm(dim=-1)[..., None, :]
        rel = delta / scale
        rows = rec.pos[:, idx]  # (Bt, S): the sampled positions of each sequence
        seen = (rows[:, None, :] <= rows[:, :, None])[:, None]  # keys at or before the query: what every model sees
        valid = torch.isfinite(rel) & (scale > 0) & seen
        rel = torch.where(valid, rel, -math.inf)
        self.pairs += int(valid.sum())
        if not bool(valid.any()):
            return
        flat = int(rel.argmax())
        value = float(rel.view(-1)[flat])
        if value > self.score[0]:
            bi, rest = divmod(flat, rel[0].numel())
            i, j = divmod(rest % (len(idx) * len(idx)), len(idx))
            row = rec.pos[bi if rec.pos.shape[0] > 1 else 0]
            self.score = (value, (int(row[idx[i]]), int(row[idx[j]])), call)

    def _vector(self, role: str, tolerance_relative: float) -> RopeVectorCheck | None:
        acc = self.roles[role]
        if acc.calls == 0:
            return None
        pos, err = self.recipe.pos, acc.err
        affected = err > tolerance_relative
        judged = err > -math.inf
        flat = int(err.argmax())
        worst = float(err.view(-1)[flat]) if bool(judged.any()) else None
        return RopeVectorCheck(
            role=role,
            dtype=",".join(acc.dtypes),
            calls=acc.calls,
            vectors=acc.vectors,
            nonfinite=acc.nonfinite,
            first_affected=int(pos[affected].min()) if bool(affected.any()) else None,
            affected_positions=int(torch.unique(pos[affected]).numel()),
            max_relative_error=worst,
            max_error_position=None if worst is None else int(pos.reshape(-1)[flat]),
            max_error_call=None if worst is None else acc.best_call,
            max_angle=None if worst is None else implied_angle(worst),
            rounding=max(acc.dtypes.values()),
        )

    def _note(self) -> str | None:
        parts = []
        for reason, calls in self.skipped.items():
            named = ", ".join(f"#{c}" for c in calls[:CALLS_NAMED])
            more = f" and {len(calls) - CALLS_NAMED} more" if len(calls) > CALLS_NAMED else ""
            parts.append(f"{reason} (call{'s' if len(calls) > 1 else ''} {named}{more})")
        return "; ".join(parts) or None

    def result(self, tolerance: float) -> RopeQKCheck | None:
        """The check at an angle ``tolerance`` (radians); None where no call was given or the table is not judged."""
        if self.recipe is None or (self.calls == 0 and not self.skipped):
            return None
        rel = relative_tolerance(tolerance)
        value, where, call = self.score
        return RopeQKCheck(
            calls=self.calls,
            tolerance_relative=rel,
            q=self._vector("q", rel),
            k=self._vector("k", rel),
            score_error=value if where is not None else None,
            score_positions=where,
            score_call=call,
            score_pairs=self.pairs,
            score_bound=self.bound,
            note=self._note(),
        )
