"""Q, K, V and a mask -> validated attention inputs: shapes normalised to (B, H, T, d), the scale
resolved, the mask kept compact (each axis its own size or 1) with its form recorded (boolean,
additive, summed sentinel planes), and the value a masked key gets in each dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attncheck import params
from attncheck.errors import AttncheckError, param
from attncheck.format import size_text
from attncheck.numerics.inputs.index_mask import IndexMask
from attncheck.numerics.paths.base import CallFacts
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, cast, check_scores_dtype


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
    # bool, True = masked: a plane (a boolean mask file, a model's plane; causal and padding joined to it), or causal
    # and padding alone as their rule (IndexMask: each block of rows makes its part, no tq x tk plane is held)
    masked: torch.Tensor | IndexMask | None
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
    q4, k4, v4, lead, hq = _shapes(q, k, v)
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
    _check_size(q, k, v, q4, k4, lead, full, mask4, masked4, logits, causal, pad_left, pad_right, max_bytes)
    planes_masked, mask_float, float_mask_value, looks_boolean, summed, deep = _mask_planes(
        mask, mask4, mask_convention
    )
    rule = _index_rule(causal, pad_left, pad_right, full)
    if masked4 is not None:
        planes_masked = masked4 if planes_masked is None else (planes_masked | masked4)
    if planes_masked is None:
        planes_masked = rule  # causal and padding alone: made per block of rows, never held as a plane
    else:  # a plane is held: the rules join it at the shape they broadcast to
        planes_masked = planes_masked if rule is None else (planes_masked | rule.plane())
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


def _shapes(q, k, v):
    """q, k (and v) checked against each other and seen as (b, h, t, d): (q4, k4, v4, lead, q heads); every
    mismatch is an AttncheckError naming both shapes."""
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
    return q4, k4, v4, lead, hq


def _check_size(q, k, v, q4, k4, lead, full, mask4, masked4, logits, causal, pad_left, pad_right, max_bytes):
    """The logits' shapes checked; what the diagnosis holds whole (float64 q, k, v, the logits, the
    mask planes) estimated and refused over ``max_bytes``."""
    b, hq, tq, tk = full
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
    need += _joined_plane(full, mask4, masked4, causal, bool(pad_left or pad_right))
    if max_bytes is not None and need > max_bytes:
        raise AttncheckError(
            f"q, k{', v' if v is not None else ''} and the mask (batch {b}, heads {hq}, queries {tq}, keys {tk}) "
            f"need {size_text(need)} in float64, over {param('max_memory')} {size_text(max_bytes)}"
        )


def _joined_plane(full, mask4, masked4, causal: bool, padded: bool) -> int:
    """Bytes of the boolean plane that joins a boolean mask, ``masked``, causal and padding when a boolean plane is
    held: the shape they all broadcast to. Causal and padding alone are a rule (``IndexMask``), made per block of
    rows: 0."""
    b, _, tq, tk = full
    planes = [tuple(m.shape) for m in (mask4, masked4) if m is not None and m.dtype == torch.bool]
    if not planes or not (causal or padded or len(planes) > 1):
        return 0
    rules = ([(1, 1, tq, tk)] if causal else []) + ([(b, 1, 1, tk)] if padded else [])
    return math.prod(torch.broadcast_shapes(*planes, *rules))


def _mask_planes(mask, mask4, mask_convention):
    """The given mask read: (its boolean plane, True = masked; its float64 additive plane; the float
    mask's sentinel; whether it looks boolean; its summed -inf count and deep sentinel)."""
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
    return planes_masked, mask_float, float_mask_value, looks_boolean, summed, deep


def _index_rule(causal, pad_left, pad_right, full) -> IndexMask | None:
    """The keys causal, left and right padding mask, as rules (``IndexMask``: PyTorch's is_causal, ones(L, S).tril(0)
    aligned at the top left; per batch the first and last keys); None when there are none. The pads are checked."""
    b, hq, tq, tk = full
    pads = {}
    for side, given in (("left", pad_left), ("right", pad_right)):
        if not given:
            continue
        if len(given) != b:
            raise AttncheckError(f"gives {len(given)} lengths for a batch of {b}", param=f"pad_{side}")
        for n in given:
            if n < 0 or n > tk:
                raise AttncheckError(f"length {n} is outside 0..{tk} keys", param=f"pad_{side}")
        pads[side] = torch.tensor(given, dtype=torch.int64)
    if not causal and not pads:
        return None
    return IndexMask(full, causal, pads.get("left"), pads.get("right"))


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
