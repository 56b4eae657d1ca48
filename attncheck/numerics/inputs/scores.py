"""Q, K and a mask -> attention scores, computed per dtype the way models compute them.

Per dtype: Q and K are cast to the dtype, Q@K^T runs as torch's matmul in the dtype
(float32 accumulation inside, the result rounded to the dtype, so it can overflow fp16
before any softmax; the same op hand-written attention runs, so the same bits on the
same device), the scale is applied to q first or to the scores after, and the mask is
added in the dtype. The
reference is the same pipeline in float64, with boolean-masked keys at -inf (or at
the numeric --mask-value, so a leaking sentinel shows as leaked mass).

Shapes: q (..., Hq, Tq, d), k (..., Hk, Tk, d); Hq must be a multiple of Hk
(grouped-query attention); the leading axes must match. Rows of the score tensor
are (batch..., head, query) in row-major order; keys are the last axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from attncheck import params
from attncheck.errors import AttncheckError, param
from attncheck.format import size_text
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, cast, check_scores_dtype, dtype_label
from attncheck.numerics.reduce import row_counts
from attncheck.results import AttentionAudit, DtypeAudit

if TYPE_CHECKING:
    from attncheck.loaders import TensorSource
    from attncheck.numerics.backends import ChunkFacts
    from attncheck.numerics.paths.base import CallFacts, PathSpec


def scale_value(scale: str | params.Scale, d: int) -> float:
    """'auto'/'sqrt' -> 1/sqrt(d), 'none' -> 1, 'dk' -> 1/d, 'dk2' -> 1/d^2, a number -> itself."""
    return (scale if isinstance(scale, params.Scale) else params.scale(scale)).value(d)


def sentinel_in(dtype: torch.dtype, mask_value: str) -> float:
    """The value a masked key gets in ``dtype``: -inf, finfo(dtype).min, or a number as the dtype rounds it."""
    if mask_value == "-inf":
        return float("-inf")
    if mask_value == "min":
        return torch.finfo(dtype).min
    return cast(torch.tensor(float(mask_value), dtype=torch.float64), dtype).item()


@dataclass(frozen=True)
class AttentionInputs:
    """Validated Q, K and mask, normalised to q (B, Hq, Tq, d), k (B, Hk, Tk, d)."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    scale_name: str
    scale_order: str  # "q" or "scores"
    mask_float: torch.Tensor | None  # float64 additive mask, broadcastable to (B, Hq, Tq, Tk)
    masked: torch.Tensor | None  # bool, True = masked (bool mask file, causal, padding)
    mask_value: str  # "-inf", "min" or a number, for boolean-masked keys
    lead: tuple[int, ...]  # the leading (batch) axes of the inputs before normalisation
    float_mask_looks_boolean: bool = False
    v: torch.Tensor | None = None  # (B, Hk, Tk, dv): with it, the output O = P@V of every cell
    cache: dict = field(
        default_factory=dict, compare=False, repr=False
    )  # what paths derive once per input (FP8 quantisation)
    float_mask_value: float | None = (
        None  # the sentinel of a float mask as the mask holds it (its most common value <= -1e4)
    )
    mask_summed_neginf: int = 0  # -inf values of a float mask that also holds sentinels beyond half its dtype's range
    mask_deep_sentinel: float | None = None  # such a sentinel, e.g. -65504
    # Facts that let a block skip checks that cannot fire: q and k hold no NaN or inf; the float mask
    # holds no NaN or +inf; the largest |q| and |k| (float64), whose product times d bounds every |q.k|.
    qk_finite: bool = False
    mask_sane: bool = True
    # What a boolean-masked key becomes on the eager path when it differs from ``mask_value``: an SDPA
    # call's boolean mask is -inf in its kernels, but ported to eager attention as transformers writes
    # it, finfo(dtype).min is added ('min'); the float64 reference is -inf either way.
    eager_mask_value: str | None = None
    q_amax: float = math.inf
    k_amax: float = math.inf
    # A FlexAttention call with a score_mod: its logits after the mod (B, Hq, Tq, Tk), as flex computes
    # them in fp32 (what its paths' softmax runs on) and in float64 (the reference, in place of S from q, k).
    logits32: torch.Tensor | None = None
    logits64: torch.Tensor | None = None
    flex_block: int | None = None  # the fused flex kernel's key block (its BlockMask's KV_BLOCK_SIZE); None: one block
    # A captured call's facts a kernel path reads (the mask it was given, the GPU's capability, a softcap); None: a file
    call: "CallFacts | None" = None

    def qk_bound(self, dtype: torch.dtype, factor: float = 1.0) -> float:
        """An upper bound on |Q@K^T| times ``factor`` however the scores are computed from q and k
        rounded to ``dtype`` (each rounding at most 2^-7 relative below fp8, fp32 accumulation over
        d terms): d max|q| max|k| (1 + 2^-7)^2 (1 + d 2^-23), times 1.01; inf when q or k is not
        finite or does not fit the dtype."""
        limit = torch.finfo(dtype).max
        if not self.qk_finite or self.q_amax > limit or self.k_amax > limit:
            return math.inf
        d = self.q.shape[-1]
        return d * self.q_amax * self.k_amax * (1 + 2**-7) ** 2 * (1 + d * 2**-23) * 1.01 * factor

    def cannot_overflow(self, dtype: torch.dtype, held: torch.dtype, factor: float = 1.0) -> bool:
        """No score of Q@K^T (times ``factor``) from q and k in ``dtype`` can round to inf in ``held``."""
        return self.qk_bound(dtype, factor) < torch.finfo(held).max

    @property
    def eager_value(self) -> str:
        return self.eager_mask_value or self.mask_value

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def d(self) -> int:
        return self.q.shape[-1]

    @property
    def score_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.q.shape[1], self.q.shape[2], self.k.shape[2])

    @property
    def rows(self) -> int:
        return self.q.shape[0] * self.q.shape[1] * self.q.shape[2]

    def facts(self, dtype: str, mask: str | None = None) -> "CallFacts":
        """What a kernel path's support depends on, read from these inputs: their shapes, and how the mask
        was given (``mask``; else the call's where recorded, else 'explicit' for any mask, 'none' without)."""
        from attncheck.numerics.paths.base import CallFacts

        if mask is None:
            given = self.masked is not None or self.mask_float is not None
            mask = self.call.mask if self.call is not None else ("explicit" if given else "none")
        _, hq, tq, d = self.q.shape
        dv = d if self.v is None else self.v.shape[-1]
        return CallFacts(
            dtype=dtype, head_dim=d, head_dim_v=dv, tq=tq, tk=self.k.shape[2], mask=mask, gqa=self.k.shape[1] < hq
        )


def _as_4d(name: str, t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    if t.dim() < 2:
        raise AttncheckError(f"{name} has shape {tuple(t.shape)}; it needs at least (tokens, head_dim)")
    if t.dim() == 2:
        return t.reshape(1, 1, *t.shape), ()
    lead = tuple(t.shape[:-3])
    return t.reshape(-1, *t.shape[-3:]), lead


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: str | params.Scale = "auto",
    scale_order: str = "scores",
    causal: bool = False,
    pad_left: list[int] | None = None,
    pad_right: list[int] | None = None,
    mask_value: str = "-inf",
    mask_convention: str = "attend",
    v: torch.Tensor | None = None,
    max_bytes: int | None = None,
    masked: torch.Tensor | None = None,
    eager_mask_value: str | None = None,
    logits: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AttentionInputs:
    """Validate shapes and build the mask planes; every mismatch is an AttncheckError naming both shapes.
    ``masked``: a boolean plane (True = masked, broadcast to the scores) beside ``mask``, whose keys
    become ``mask_value`` like a boolean mask's (a model's own mask rebuilt for another dtype);
    ``eager_mask_value``: what they become on the eager path instead (``AttentionInputs.eager_mask_value``).
    What the diagnosis holds whole (float64 copies of q, k and v, the mask planes over every
    score) is estimated first and refused when it exceeds ``max_bytes``."""
    for name, t in (("q", q), ("k", k)) + ((("v", v),) if v is not None else ()):
        check_scores_dtype(name, t.dtype)
    if q.shape[-1] != k.shape[-1]:
        raise AttncheckError(
            f"q and k have different head dims: q {tuple(q.shape)} has d = {q.shape[-1]}, k {tuple(k.shape)} has d = "
            f"{k.shape[-1]}"
        )
    if q.dim() != k.dim():
        raise AttncheckError(f"q {tuple(q.shape)} and k {tuple(k.shape)} have different numbers of axes")
    q4, lead = _as_4d("q", q)
    k4, _ = _as_4d("k", k)
    if q.dim() >= 3 and tuple(q.shape[:-3]) != tuple(k.shape[:-3]):
        raise AttncheckError(f"q {tuple(q.shape)} and k {tuple(k.shape)} have different batch axes")
    v4 = None
    if v is not None:
        if v.dim() != k.dim() or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
            raise AttncheckError(
                f"v {tuple(v.shape)} does not match k {tuple(k.shape)}: v needs k's batch and head axes and its "
                f"{k.shape[-2]} tokens (the last axis, the value dimension, may differ)"
            )
        v4, _ = _as_4d("v", v)
    hq, hk = q4.shape[1], k4.shape[1]
    if hq % hk:
        raise AttncheckError(
            f"k has {hk} heads, which does not divide q's {hq} heads (q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    order = params.choice(scale_order, params.SCALE_ORDERS, "scale_order")
    params.choice(mask_convention, params.MASK_CONVENTIONS, "mask_convention")
    scale = scale if isinstance(scale, params.Scale) else params.scale(scale)
    mask_value = params.mask_value(mask_value)
    b, tq, tk = q4.shape[0], q4.shape[2], k4.shape[2]
    full = (b, hq, tq, tk)
    # Masks stay at their own size (a (T, T) mask over 256 heads is one (T, T) plane): broadcast
    # views of it stand for the planes over every score, and each block of rows takes its slice.
    mask4 = None if mask is None else _compact_mask(mask, full, lead)
    masked4 = None if masked is None else _compact_mask(masked, full, lead)
    need = 8 * (q.numel() + k.numel() + (v.numel() if v is not None else 0))
    if logits is not None:
        for name, t, want in (("scores_mod", logits[0], torch.float32), ("scores_mod64", logits[1], torch.float64)):
            if tuple(t.shape) != (*lead, q4.shape[1], q4.shape[2], k4.shape[2]) or t.dtype != want:
                raise AttncheckError(
                    f"{name} has shape {tuple(t.shape)} and dtype {str(t.dtype).removeprefix('torch.')}; for q "
                    f"{tuple(q.shape)} and k {tuple(k.shape)} it must be "
                    f"{(*lead, q4.shape[1], q4.shape[2], k4.shape[2])} {str(want).removeprefix('torch.')}"
                )
        need += 12 * logits[0].numel()
    need += sum(m.numel() * (8 if m.is_floating_point() else 1) for m in (mask4, masked4) if m is not None)
    need += (tq * tk if causal else 0) + (b * tk if pad_left or pad_right else 0)
    if max_bytes is not None and need > max_bytes:
        raise AttncheckError(
            f"q, k{', v' if v is not None else ''} and the mask (batch {b}, heads {hq}, queries {tq}, keys {tk}) "
            f"need {size_text(need)} in float64, over {param('max_memory')} {size_text(max_bytes)}"
        )
    planes_masked = None
    mask_float = None
    float_mask_value = None
    looks_boolean = False
    summed, deep = 0, None
    if mask is not None:
        if mask.dtype == torch.bool:
            planes_masked = ~mask4 if mask_convention == "attend" else mask4
        elif mask.is_floating_point():
            mask_float = mask4.to(torch.float64)
            vals, counts = torch.unique(
                mask.to(torch.float64), return_counts=True
            )  # of the mask as given, before broadcasting
            looks_boolean = vals.numel() <= 2 and bool(((vals == 0) | (vals == 1)).all()) and bool((vals == 1).any())
            sentinel = vals <= MASK_SENTINEL_LIMIT
            if bool(sentinel.any()):
                float_mask_value = float(vals[sentinel][torch.argmax(counts[sentinel])])
            summed, deep = _summed_planes(mask)
        else:
            raise AttncheckError(
                f"mask has dtype {str(mask.dtype).removeprefix('torch.')}; use a boolean mask (True = attend; "
                f"{param('mask_convention')} ignore for True = masked) or an additive float mask"
            )
    extra = masked4  # the planes combine at the shape they broadcast to, not over every score
    if causal:
        # PyTorch's is_causal: ones(L, S).tril(0), aligned at the top left.
        plane = ~torch.ones(1, 1, tq, tk, dtype=torch.bool).tril(diagonal=0)
        extra = plane if extra is None else (extra | plane)
    for side, pads in (("left", pad_left), ("right", pad_right)):
        if not pads:
            continue
        if len(pads) != b:
            raise AttncheckError(f"gives {len(pads)} lengths for a batch of {b}", param=f"pad_{side}")
        for n in pads:
            if n < 0 or n > tk:
                raise AttncheckError(f"length {n} is outside 0..{tk} keys", param=f"pad_{side}")
        n_pad = torch.tensor(pads).view(b, 1, 1, 1)
        key = torch.arange(tk).view(1, 1, 1, tk)
        plane = (key < n_pad) if side == "left" else (key >= tk - n_pad)
        extra = plane if extra is None else (extra | plane)
    if extra is not None:
        planes_masked = extra if planes_masked is None else (planes_masked | extra)
    if planes_masked is not None:
        planes_masked = torch.broadcast_to(planes_masked, full)  # a view: no plane over every score is held
    mask_sane = mask_float is None or not bool((torch.isnan(mask_float) | torch.isposinf(mask_float)).any())
    if mask_float is not None:
        mask_float = torch.broadcast_to(mask_float, full)
    qk_finite = bool(torch.isfinite(q4).all()) and bool(torch.isfinite(k4).all())
    return AttentionInputs(
        qk_finite=qk_finite,
        mask_sane=mask_sane,
        q_amax=float(q4.abs().amax()) if qk_finite and q4.numel() else math.inf,
        k_amax=float(k4.abs().amax()) if qk_finite and k4.numel() else math.inf,
        q=q4,
        k=k4,
        scale=scale.value(q4.shape[-1]),
        scale_name=scale.name,
        scale_order=order,
        mask_float=mask_float,
        masked=planes_masked,
        mask_value=mask_value,
        eager_mask_value=None if eager_mask_value is None else params.mask_value(eager_mask_value),
        lead=lead,
        float_mask_looks_boolean=looks_boolean,
        v=v4,
        float_mask_value=float_mask_value,
        mask_summed_neginf=summed,
        mask_deep_sentinel=deep,
        logits32=None if logits is None else logits[0].reshape(-1, q4.shape[1], q4.shape[2], k4.shape[2]),
        logits64=None if logits is None else logits[1].reshape(-1, q4.shape[1], q4.shape[2], k4.shape[2]),
    )


def _summed_planes(mask: torch.Tensor) -> tuple[int, float | None]:
    """(-inf values of a float mask, one of its finite sentinels) when the mask holds both -inf and
    finite values beyond half its dtype's range: the mark of two finfo.min planes added together
    (a single plane never overflows). (0, None) otherwise. Counted over the mask as given."""
    half = torch.finfo(mask.dtype).max / 2
    deep = torch.isfinite(mask) & (mask < -half)
    if not bool(deep.any()):
        return 0, None
    neginf = int(torch.isneginf(mask).sum())
    return (neginf, float(mask[deep].max())) if neginf else (0, None)


def mask_planes(mask_float: torch.Tensor | None, masked: torch.Tensor | None, dt: torch.dtype, value: str):
    """The mask as the model holds it in ``dt``: (the float mask cast to dt, the boolean mask's
    plane of ``value`` (``sentinel_in``) in dt, their sum: the additive mask), each None when absent."""
    mf = None if mask_float is None else cast(mask_float, dt)
    plane = None
    if masked is not None:
        plane = torch.zeros(masked.shape, dtype=dt, device=masked.device).masked_fill(masked, sentinel_in(dt, value))
    mask_dt = plane if mf is None else (mf if plane is None else mf + plane)
    return mf, plane, mask_dt


def _compact_mask(mask: torch.Tensor, full: tuple[int, ...], lead: tuple[int, ...]) -> torch.Tensor:
    """The mask with 4 axes, each its own size or 1: it broadcasts to the scores' shape ``full``
    (checked) and is not expanded to it."""
    b, h, tq, tk = full
    m = mask
    if m.dim() > 4 or (m.dim() == 4 and lead and len(lead) > 1):
        m = m.reshape(-1, *m.shape[-3:]) if m.dim() > 4 else m
    try:
        fits = torch.broadcast_shapes(tuple(m.shape), full) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise AttncheckError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape (batch {b}, heads {h}, "
            f"queries {tq}, keys {tk})"
        )
    return m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() < 4 else m


SPREAD_SAMPLE = 1 << 17


class SpreadSample:
    """The first SPREAD_SAMPLE unmasked float64 scores (row-major order, so the same values
    whatever the chunking) and their robust spread, kept in ``audit.scores_std``."""

    def __init__(self, audit: AttentionAudit) -> None:
        self.audit = audit
        self._values: list[torch.Tensor] = []
        self._taken = 0

    @property
    def full(self) -> bool:
        return self._taken >= SPREAD_SAMPLE

    def add(self, values: torch.Tensor) -> None:
        take = min(values.numel(), SPREAD_SAMPLE - self._taken)
        if take <= 0:
            return
        self._values.append(values.reshape(-1)[:take].to("cpu", torch.float64))
        self._taken += take
        if self.full:
            self.finish()

    def finish(self) -> None:
        """Set ``audit.scores_std`` from what was taken (once full, or after the last block)."""
        if self._values:
            self.audit.scores_std = robust_std(torch.cat(self._values))
            self._values = [torch.cat(self._values)] if not self.full else []


def robust_std(values: torch.Tensor, sample: int | None = None) -> float:
    """1.4826 x median absolute deviation: the std of a normal sample, blind to a few outliers.
    ``sample``: at most this many values, taken at an even stride (a whole q of a long sequence
    costs a sort of millions for a number the audit prints to 3 digits)."""
    flat = values.reshape(-1)
    if sample is not None and flat.numel() > sample:
        flat = flat[:: -(-flat.numel() // sample)]
    v = flat[torch.isfinite(flat)].to(torch.float64)
    if v.numel() == 0:
        return 0.0
    med = v.median()
    return float(1.4826 * (v - med).abs().median())


LEAK_TOLERANCE = 1e-6


class QKBlock:
    """A block of score rows computed from Q and K: the float64 reference input and, per dtype,
    the scores the model would produce, with the rows each pipeline stage broke."""

    def __init__(
        self,
        inp: AttentionInputs,
        bh: slice,
        qs: slice,
        device: torch.device,
        audit: AttentionAudit,
        spread: SpreadSample,
    ) -> None:
        self.inp, self.audit = inp, audit
        self.rows = (bh, qs)  # the query heads and queries of this block
        self.q, self.k, raw = _qk_float64(inp, bh, qs, device)  # (n, tq, d), (n, Tk, d), (n, tq, Tk)
        self.v = (
            None if inp.v is None else inp.v.reshape(-1, *inp.v.shape[2:])[_kv_heads(inp, bh)].to(device)
        )  # (n, Tk, dv)
        self.masked = self._slice4(inp.masked, bh, qs, device)  # (n, tq, Tk) bool or None
        self.mask_float = self._slice4(inp.mask_float, bh, qs, device)
        if inp.qk_finite:  # q.k of finite q and k is finite in float64: no check per score
            self.raw_finite = None
            audit.raw_max_abs = (
                max(audit.raw_max_abs, float(raw.amax()), -float(raw.amin())) if raw.numel() else audit.raw_max_abs
            )
        else:
            self.raw_finite = torch.isfinite(raw).reshape(-1, raw.shape[-1])
            audit.raw_max_abs = max(audit.raw_max_abs, _finite_abs_max(raw))
        s = raw.mul_(inp.scale)  # (n, tq, Tk): raw is not needed again
        if not spread.full:  # from the first rows on, only as many as the sample still needs
            flat_s, flat_m = (
                s.reshape(-1, s.shape[-1]),
                None if self.masked is None else self.masked.reshape(-1, s.shape[-1]),
            )
            step = -(-SPREAD_SAMPLE // max(1, s.shape[-1]))
            for start in range(0, flat_s.shape[0], step):
                part = flat_s[start : start + step]
                keep = torch.isfinite(part) if flat_m is None else torch.isfinite(part) & ~flat_m[start : start + step]
                spread.add(part[keep])
                if spread.full:
                    break
        # The reference adds the same planes in float64; a boolean-masked key is -inf
        # for -inf and min sentinels, and the number itself otherwise (so leaks show).
        ref_sentinel = float("-inf") if inp.mask_value in ("-inf", "min") else float(inp.mask_value)
        if self.mask_float is not None:
            s = s.add_(self.mask_float)
        if self.masked is not None:
            if ref_sentinel == float("-inf") and inp.qk_finite and inp.mask_sane:
                s = s.masked_fill_(self.masked, ref_sentinel)  # x + -inf is -inf for every x but NaN and +inf
            else:
                s = s + torch.zeros_like(s).masked_fill(self.masked, ref_sentinel)
        if inp.logits64 is not None:  # a flex score_mod: the logits after it, in float64 (-inf where masked)
            s = self._slice4(inp.logits64, bh, qs, device)
        self.given = s.reshape(-1, s.shape[-1])  # (r, Tk) float64
        self.flat_masked = None if self.masked is None else self.masked.reshape(-1, self.masked.shape[-1])
        # The keys the mask masks, read from the mask: boolean-masked keys, and float-mask
        # values of -inf or <= -1e4 (a score plus -1e4 can sit above -1e4, but is masked).
        self.key_masked = self.flat_masked
        if self.mask_float is not None:
            by_float = (self.mask_float <= MASK_SENTINEL_LIMIT).reshape(-1, self.given.shape[-1])
            self.key_masked = by_float if self.key_masked is None else self.key_masked | by_float
        self.key_counts = None if self.key_masked is None else row_counts(self.key_masked)  # (r,) masked keys per row
        self.all_masked = None if self.key_masked is None else self.key_counts == self.given.shape[-1]

    @staticmethod
    def _slice4(t: torch.Tensor | None, bh: slice, qs: slice, device: torch.device) -> torch.Tensor | None:
        """Rows ``qs`` of the (batch x head) planes ``bh``: (n, tq, Tk). A broadcast view (a mask
        kept at its own size) gives the block's slice alone; reshaping it would expand it whole."""
        if t is None:
            return None
        b, h = t.shape[:2]
        if t.is_contiguous():
            return t.reshape(b * h, *t.shape[2:])[bh, qs].to(device)
        index = torch.arange(b * h)[bh]
        return t[index // h, index % h, qs].to(device)

    def in_dtype(self, dt: torch.dtype):
        """(scores (r, Tk) in dt, causes before 'fully_masked', causes after it)."""
        inp = self.inp
        a = self.audit.dtypes.setdefault(dtype_label(dt), DtypeAudit(dtype_label(dt)))
        qd, kd = cast(self.q, dt), cast(self.k, dt)
        if inp.scale_order == "q":
            qd = qd * inp.scale  # rounded to dt
        s = torch.matmul(qd, kd.transpose(-1, -2))  # torch's matmul in the dtype, as hand-written code runs it
        if inp.scale_order == "scores":
            s = s * inp.scale
        flat = s.reshape(-1, s.shape[-1])
        over = torch.isinf(flat) if self.raw_finite is None else torch.isinf(flat) & self.raw_finite
        qk_rows = over.any(dim=-1)
        a.qk_overflow_values += int(over.sum())
        a.qk_overflow_rows += int(qk_rows.sum())
        a.qk_max_abs = max(a.qk_max_abs, _finite_abs_max(flat))
        before_mask_bad = ~torch.isfinite(flat)
        sentinel = sentinel_in(dt, inp.eager_value)
        in_dt = None if inp.float_mask_value is None else sentinel_in(dt, repr(inp.float_mask_value))
        # What a masked key holds in dt: the boolean planes' sentinel, else the float mask's.
        values = [sentinel] if self.masked is not None else []
        if in_dt is not None and in_dt not in values:
            values.append(in_dt)
        a.mask_values = values
        a.sentinel_value = values[0] if values else sentinel
        a.sentinel_not_representable = (
            self.masked is not None and inp.eager_value not in ("-inf",) and math.isinf(sentinel)
        )
        mf, plane, mask_dt = self._mask_planes(dt, inp.eager_value)
        if mf is not None:
            a.mask_not_representable += int((torch.isinf(mf) & torch.isfinite(self.mask_float)).sum())
        if mf is not None and plane is not None:
            a.summed_planes_overflow += int((torch.isinf(mask_dt) & torch.isfinite(mf) & torch.isfinite(plane)).sum())
        if mask_dt is not None:
            added = s + mask_dt
            a.overflow_on_add += int((torch.isinf(added) & torch.isfinite(s) & torch.isfinite(mask_dt)).sum())
            s = added
        flat = s.reshape(-1, s.shape[-1])
        broken = torch.isneginf(flat).all(dim=-1) | torch.isnan(flat).any(dim=-1)
        # The mask is to blame where every value it meant to add is finite (a finite
        # sentinel, finite float-mask values) and the dtype still made the row all -inf or NaN.
        mask_rows = broken & ~before_mask_bad.any(dim=-1) & self._intended_finite_rows(sentinel, inp.eager_value)
        a.mask_sentinel_rows += int(mask_rows.sum())
        return flat, [("qk_overflow", qk_rows), ("mask_sentinel", mask_rows)], []

    def _mask_planes(self, dt: torch.dtype, value: str | None = None):
        return mask_planes(self.mask_float, self.masked, dt, value or self.inp.mask_value)

    def fp32_scores(self, dt: torch.dtype, path: "PathSpec"):
        """The scores a fused kernel computes from Q and K in ``dt``, in float32, and the causes
        before 'fully_masked': (scores (r, Tk) float32, causes).

        A path whose ``scores`` is 'fp32-split' (PyTorch's math backend): fp16/bf16 q and k upcast
        to fp32, each scaled by sqrt(scale), then q @ k^T. 'fp32' (the fused kernels): q and k in
        dt, S = q @ k^T accumulated in fp32, times the scale in fp32; a path that reads flex's
        ``logits``: its logits after the score_mod where the call recorded them. Either way the
        mask, as the model holds it in dt, is added in fp32.
        """
        inp = self.inp
        if isinstance(path, str):  # a path named: its spec
            from attncheck.registry import PATHS

            path = PATHS.get(path)
        if inp.logits32 is not None and path.logits:  # flex's own fp32 logits after its score_mod
            flat = self._slice4(inp.logits32, *self.rows, self.given.device).reshape(-1, self.given.shape[-1])
            none = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
            return flat, [("qk_overflow", none), ("mask_sentinel", none)]
        qd, kd = cast(self.q, dt).float(), cast(self.k, dt).float()
        if path.scores == "fp32-split":
            root = math.sqrt(inp.scale)
            s = torch.matmul(qd * root, kd.transpose(-1, -2) * root)  # (n, tq, Tk)
        else:
            s = torch.matmul(qd, kd.transpose(-1, -2)) * inp.scale  # the scale rounded to fp32, as the kernel holds it
        flat = s.reshape(-1, s.shape[-1])
        factor = max(
            inp.scale, 1.0
        )  # sdpa-math scales before the product, flash after: either is within max(scale, 1) x |q.k|
        if inp.cannot_overflow(dt, torch.float32, factor) and inp.mask_float is None and inp.mask_value == "-inf":
            # Every score is finite and the mask only sets keys to -inf: nothing to count, nothing to add.
            none = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
            if self.masked is not None:
                s.masked_fill_(self.masked, float("-inf"))
            return flat, [("qk_overflow", none), ("mask_sentinel", none)]
        over = torch.isinf(flat) if self.raw_finite is None else torch.isinf(flat) & self.raw_finite
        qk_rows = over.any(dim=-1)
        before_bad = ~torch.isfinite(flat)
        _, _, mask_dt = self._mask_planes(dt)
        if mask_dt is not None:
            s = s + mask_dt.float()
        flat = s.reshape(-1, s.shape[-1])
        broken = torch.isneginf(flat).all(dim=-1) | torch.isnan(flat).any(dim=-1)
        mask_rows = broken & ~before_bad.any(dim=-1) & self._intended_finite_rows(sentinel_in(dt, inp.mask_value))
        return flat, [("qk_overflow", qk_rows), ("mask_sentinel", mask_rows)]

    def reference_out(self, ref: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float64 output P64 @ V64 (r, dv) of the float64 probabilities ``ref`` (r, Tk);
        with ``dtype``, of V as that dtype holds it (the yardstick of a path's own rounding)."""
        n, tk = self.v.shape[0], self.v.shape[1]
        v = self.v if dtype is None else cast(self.v, dtype)
        return torch.matmul(ref.reshape(n, -1, tk), v.to(torch.float64)).reshape(-1, self.v.shape[-1])

    def _intended_finite_rows(self, sentinel: float, value: str | None = None) -> torch.Tensor:
        """(r,) rows whose mask values, as meant (float64), are all finite."""
        ok = torch.ones(self.given.shape[0], dtype=torch.bool, device=self.given.device)
        if self.mask_float is not None:
            ok &= torch.isfinite(self.mask_float).reshape(-1, self.given.shape[-1]).all(dim=-1)
        if self.flat_masked is not None and (value or self.inp.mask_value) == "-inf":
            ok &= ~self.flat_masked.any(dim=-1)
        return ok

    def mark_masked(self, c: "ChunkFacts") -> None:
        """Set the chunk's masked keys per row and its fully masked rows from the mask."""
        if self.key_masked is not None:
            c.masked = self.key_counts.to(c.masked.dtype)
            c.masked_rows = self.all_masked

    def extremes(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(r,) float64: the largest finite score of each row and the smallest one on a key the
        mask leaves open, in the dtype scores ``xc``; where the dtype pipeline overflowed to
        +inf, the float64 score instead."""
        x64 = xc.to(torch.float64)
        fin = torch.isfinite(x64)
        top = torch.where(fin, x64, float("-inf")).amax(dim=-1)
        over = torch.isposinf(x64) & torch.isfinite(self.given)
        if bool(over.any()):
            top = torch.maximum(top, torch.where(over, self.given, float("-inf")).amax(dim=-1))
        keep = fin & (x64 > MASK_SENTINEL_LIMIT) if self.key_masked is None else fin & ~self.key_masked
        return top, torch.where(keep, x64, float("inf")).amin(dim=-1)

    def audit_reference(self, ref: torch.Tensor, ref_ok: torch.Tensor) -> None:
        """Mass the float64 reference puts on masked keys (a leaking sentinel), and the score spread."""
        if self.key_masked is not None:
            masked = self.key_masked
            self.audit.masked_keys += int(self.key_counts.sum())
            if self.mask_float is None and self.inp.mask_value in ("-inf", "min"):
                return  # the reference holds -inf at every masked key: exp gives exactly 0 there, no leak
            leak = (ref * masked).sum(dim=-1)[ref_ok & ~masked.all(dim=-1)]
            if leak.numel():
                self.audit.leak_max = max(self.audit.leak_max, float(leak.max()))
                self.audit.leak_rows += int((leak > LEAK_TOLERANCE).sum())


def _finite_abs_max(t: torch.Tensor) -> float:
    fin = torch.isfinite(t)
    if not bool(fin.any()):
        return 0.0
    return float(torch.where(fin, t.abs(), 0).max())


def start_audit(inp: AttentionInputs, statistics: bool = True) -> AttentionAudit:
    """The audit blocks fill in; without ``statistics``, the spreads and maxima of q and k
    are left at 0 (for callers that only need the paths' numbers)."""
    if not statistics:
        return AttentionAudit(
            d=inp.d,
            heads=inp.heads,
            kv_heads=inp.k.shape[1],
            scale=inp.scale,
            scale_name=inp.scale_name,
            scale_order=inp.scale_order,
            mask_value=inp.mask_value,
            q_std=0.0,
            k_std=0.0,
            q_max_abs=0.0,
            k_max_abs=0.0,
            float_mask_looks_boolean=inp.float_mask_looks_boolean,
        )
    q64, k64 = inp.q.to(torch.float64), inp.k.to(torch.float64)
    return AttentionAudit(
        d=inp.d,
        heads=inp.heads,
        kv_heads=inp.k.shape[1],
        scale=inp.scale,
        scale_name=inp.scale_name,
        scale_order=inp.scale_order,
        mask_value=inp.mask_value
        if inp.masked is not None or inp.float_mask_value is None
        else repr(inp.float_mask_value),
        float_mask_value=inp.float_mask_value,
        q_std=robust_std(q64, SPREAD_SAMPLE),
        k_std=robust_std(k64, SPREAD_SAMPLE),
        q_max_abs=_finite_abs_max(q64),
        k_max_abs=_finite_abs_max(k64),
        float_mask_looks_boolean=inp.float_mask_looks_boolean,
        mask_summed_neginf=inp.mask_summed_neginf,
        mask_deep_sentinel=inp.mask_deep_sentinel,
    )


def _row_ranges(inp: AttentionInputs, rows_per_block: int) -> Iterator[tuple[slice, slice]]:
    """(heads, queries) of consecutive blocks of score rows in (batch, head, query) order."""
    bh_total = inp.q.shape[0] * inp.q.shape[1]
    tq = inp.q.shape[2]
    if rows_per_block >= tq:
        per = rows_per_block // tq
        for start in range(0, bh_total, per):
            yield slice(start, min(start + per, bh_total)), slice(0, tq)
    else:
        for i in range(bh_total):
            for q0 in range(0, tq, rows_per_block):
                yield slice(i, i + 1), slice(q0, min(q0 + rows_per_block, tq))


def score_blocks(
    inp: AttentionInputs, rows_per_block: int, device: torch.device, audit: AttentionAudit
) -> Iterator[QKBlock]:
    """Consecutive blocks of score rows in (batch, head, query) order."""
    spread = SpreadSample(audit)
    for bh, qs in _row_ranges(inp, rows_per_block):
        yield QKBlock(inp, bh, qs, device, audit, spread)
    spread.finish()


class GivenBlock:
    """A block of scores a model produced, diagnosed as they are, beside the Q/K pipeline of
    the same rows, which runs for the audit only (Q@K^T overflow, the mask per dtype, leaks):
    so scores given with --q/--k get the same pipeline table and findings as Q/K alone."""

    all_masked = None  # the census reads the given scores' own values

    def __init__(self, given: torch.Tensor, qk: QKBlock) -> None:
        self.given, self.qk = given, qk  # (r, Tk) as given, the same rows from Q and K

    def mark_masked(self, c: "ChunkFacts") -> None:
        """Masked keys and rows are read from the given scores' own values (the census default)."""

    def audit_reference(self, ref: torch.Tensor, ref_ok: torch.Tensor) -> None:
        self.qk.audit_reference(ref, ref_ok)

    def audit_dtype(self, dt: torch.dtype) -> None:
        self.qk.in_dtype(dt)


def given_blocks(
    scores: "TensorSource", inp: AttentionInputs, rows_per_block: int, device: torch.device, audit: AttentionAudit
) -> Iterator[GivenBlock]:
    """The given scores in blocks of the rows ``score_blocks`` computes, each with its QKBlock."""
    spread = SpreadSample(audit)
    rows = _Rows(scores.row_blocks(rows_per_block))
    for bh, qs in _row_ranges(inp, rows_per_block):
        qk = QKBlock(inp, bh, qs, device, audit, spread)
        yield GivenBlock(rows.take(qk.given.shape[0]), qk)
    spread.finish()


def _qk_float64(
    inp: AttentionInputs, bh: slice, qs: slice, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (n, tq, d) and k (n, Tk, d) of the heads ``bh`` and queries ``qs`` (k repeated for
    GQA), and their float64 q.k^T (n, tq, Tk)."""
    b, hq = inp.q.shape[:2]
    q = inp.q.reshape(b * hq, *inp.q.shape[2:])[bh, qs].to(device)  # (n, tq, d)
    k = inp.k.reshape(-1, *inp.k.shape[2:])[_kv_heads(inp, bh)].to(device)  # (n, Tk, d)
    raw = torch.matmul(q.to(torch.float64), k.to(torch.float64).transpose(-1, -2))  # (n, tq, Tk)
    return q, k, raw


def _kv_heads(inp: AttentionInputs, bh: slice) -> torch.Tensor:
    """Index of the k/v head each of the query heads ``bh`` reads (grouped-query attention)."""
    hq, hk = inp.q.shape[1], inp.k.shape[1]
    heads = torch.arange(bh.start, bh.stop)
    return (heads // hq) * hk + (heads % hq) // (hq // hk)


class _Rows:
    """Row blocks of any size re-cut into blocks of the sizes asked for, in order."""

    def __init__(self, blocks: Iterator[torch.Tensor]) -> None:
        self._blocks = iter(blocks)
        self._have: list[torch.Tensor] = []
        self._count = 0

    def take(self, n: int) -> torch.Tensor:
        while self._count < n:
            block = next(self._blocks, None)
            if block is None:
                break
            self._have.append(block)
            self._count += block.shape[0]
        rows = torch.cat(self._have) if len(self._have) != 1 else self._have[0]
        out, rest = rows[:n], rows[n:]
        self._have, self._count = ([rest] if rest.shape[0] else []), rest.shape[0]
        return out


def fit_scale(scores: "TensorSource", inp: AttentionInputs, rows_per_block: int) -> float | None:
    """Least-squares s ~ alpha * (q.k) over keys that are finite and not masked-looking,
    reading the scores in row blocks (sums are exact, so the blocks do not matter)."""
    from attncheck.numerics.reduce import ExactSum
    from attncheck.numerics.rowmath import row_sum

    if math.prod(scores.shape) != math.prod(inp.score_shape) or scores.shape[-1] != inp.k.shape[2]:
        raise AttncheckError(
            f"scores of shape {tuple(scores.shape)} do not match q.k^T of shape {tuple(inp.score_shape)}"
        )
    rows = _Rows(scores.row_blocks(rows_per_block))
    num, den = ExactSum(), ExactSum()
    for bh, qs in _row_ranges(inp, rows_per_block):
        _, _, raw = _qk_float64(inp, bh, qs)
        raw = raw.reshape(-1, raw.shape[-1])  # (r, Tk)
        s = rows.take(raw.shape[0]).to(torch.float64)  # (r, Tk)
        use = torch.isfinite(s) & torch.isfinite(raw) & (s > MASK_SENTINEL_LIMIT)
        raw = torch.where(use, raw, 0.0)
        num.add(row_sum(torch.where(use, s, 0.0) * raw))
        den.add(row_sum(raw * raw))
    total = den.total()
    return None if total == 0 else num.total() / total


def max_abs_qk(inp: AttentionInputs, rows_per_block: int) -> float:
    """max |q.k| in float64 over finite products, unscaled (``AttentionAudit.raw_max_abs``), in row blocks: the
    one number of the Q/K pipeline a call whose scores were recorded needs when the pipeline itself is not run."""
    top = 0.0
    for bh, qs in _row_ranges(inp, rows_per_block):
        _, _, raw = _qk_float64(inp, bh, qs)  # (n, tq, Tk)
        top = max(top, float(raw.abs().amax()) if inp.qk_finite else _finite_abs_max(raw))
    return top
