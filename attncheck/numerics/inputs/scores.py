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
from typing import TYPE_CHECKING, Iterator

import torch

from attncheck.errors import AttncheckError

# prepare_inputs, start_audit are re-exported (noqa): the pipelines and tests import them from here
from attncheck.numerics.inputs.audit import (
    SPREAD_SAMPLE,
    SpreadSample,
    _finite_abs_max,
    start_audit,  # noqa: F401
)
from attncheck.numerics.inputs.index_mask import IndexMask
from attncheck.numerics.inputs.prepare import (
    AttentionInputs,
    mask_planes,
    prepare_inputs,  # noqa: F401
    sentinel_in,
)
from attncheck.numerics.paths.base import PathSpec
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, cast, dtype_label
from attncheck.numerics.reduce import ExactSum, row_counts
from attncheck.numerics.rowmath import row_sum
from attncheck.registry import PATHS
from attncheck.results import AttentionAudit, DtypeAudit

if TYPE_CHECKING:
    from attncheck.loaders import TensorSource
    from attncheck.numerics.backends import ChunkFacts


LEAK_TOLERANCE = 1e-6


class QKBlock:
    """A block of score rows computed from Q and K: the float64 reference input and, per dtype,
    the scores the model would produce, with the rows each pipeline stage broke. ``segment``: the part of the
    query axis the block lies in, where the blocks were cut (``score_blocks``); None otherwise."""

    segment: int | None = None

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
        _, _, self.v, self._v64 = _kv_of(inp, bh, device)  # (n, Tk, dv) as given and in float64, or None
        self._k32: dict = {}  # dtype -> k in it, in fp32 (the fused paths' scores)
        self._v_in: dict = {}  # dtype -> v in it, in float64 (reference_out)
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
    def _slice4(t: torch.Tensor | IndexMask | None, bh: slice, qs: slice, device: torch.device) -> torch.Tensor | None:
        """Rows ``qs`` of the (batch x head) planes ``bh``: (n, tq, Tk). A broadcast view (a mask
        kept at its own size) gives the block's slice alone; reshaping it would expand it whole.
        Causal and padding alone (``IndexMask``) make the block's part from the row and key indices."""
        if t is None:
            return None
        if isinstance(t, IndexMask):
            return t.rows(bh, qs).to(device)
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
            path = PATHS.get(path)
        if inp.logits32 is not None and path.logits:  # flex's own fp32 logits after its score_mod
            flat = self._slice4(inp.logits32, *self.rows, self.given.device).reshape(-1, self.given.shape[-1])
            none = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
            return flat, [("qk_overflow", none), ("mask_sentinel", none)]
        kd = self._k32.get(dt)
        if kd is None:  # k in dt, in fp32: once per block, not once per path
            kd = self._k32[dt] = cast(self.k, dt).float()
        qd = cast(self.q, dt).float()
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
        if dtype is None or dtype == self.v.dtype:  # V itself (a cast to its own dtype leaves it as it is)
            v64 = self._v64
        else:
            v64 = self._v_in.get(dtype)
            if v64 is None:  # each dtype's V cast once per block, not once per path
                v64 = self._v_in[dtype] = cast(self.v, dtype).to(torch.float64)
        return torch.matmul(ref.reshape(n, -1, tk), v64).reshape(-1, self.v.shape[-1])

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


def _cut_ranges(inp: AttentionInputs, rows_per_block: int, cuts: list[int]) -> Iterator[tuple[slice, slice, int]]:
    """(heads, queries, segment) of consecutive blocks of score rows in (batch, head, query) order, one head at a
    time, none across a cut of the query axis: segment s holds the queries cuts[s] to cuts[s + 1]."""
    for i in range(inp.q.shape[0] * inp.q.shape[1]):
        for s, (a, z) in enumerate(zip(cuts[:-1], cuts[1:])):
            for q0 in range(a, z, rows_per_block):
                yield slice(i, i + 1), slice(q0, min(q0 + rows_per_block, z)), s


def score_blocks(
    inp: AttentionInputs,
    rows_per_block: int,
    device: torch.device,
    audit: AttentionAudit,
    cuts: list[int] | None = None,
) -> Iterator[QKBlock]:
    """Consecutive blocks of score rows in (batch, head, query) order. With ``cuts`` (0 = cuts[0] <= ... <=
    cuts[-1] = Tq), no block lies across a cut, and each block knows its ``segment``: the s of its queries'
    cuts[s] to cuts[s + 1] (a bounded diagnosis's exact rows and its groups, ``cells.groups``)."""
    spread = SpreadSample(audit)
    if cuts is None:
        for bh, qs in _row_ranges(inp, rows_per_block):
            yield QKBlock(inp, bh, qs, device, audit, spread)
    else:
        for bh, qs, segment in _cut_ranges(inp, rows_per_block, cuts):
            block = QKBlock(inp, bh, qs, device, audit, spread)
            block.segment = segment
            yield block
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
    k, k64, _, _ = _kv_of(inp, bh, device)  # (n, Tk, d)
    raw = torch.matmul(q.to(torch.float64), k64.transpose(-1, -2))  # (n, tq, Tk)
    return q, k, raw


def _kv_of(inp: AttentionInputs, bh: slice, device: torch.device | str = "cpu"):
    """(k, k in float64, v, v in float64) of the kv heads the query heads ``bh`` read, each (n, Tk, ...); v None
    without one. The last heads' are kept in ``inp.cache``: the blocks of rows of one head (a long call's) take and
    cast them once, not once per block (a float64 k of 65,536 keys is 64 MiB per head)."""
    key = (bh.start, bh.stop, str(device))
    hit = inp.cache.get("kv64")
    if hit is not None and hit[0] == key:
        return hit[1]
    index = _kv_heads(inp, bh)
    k = inp.k.reshape(-1, *inp.k.shape[2:])[index].to(device)
    v = None if inp.v is None else inp.v.reshape(-1, *inp.v.shape[2:])[index].to(device)
    found = (k, k.to(torch.float64), v, None if v is None else v.to(torch.float64))
    inp.cache["kv64"] = (key, found)
    return found


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
