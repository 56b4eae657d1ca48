"""Sums kept in 16 bits: the softmax denominator and the output P@V accumulated in fp16 or bf16, the way CPU
inference engines keep them, against float64.

What the engines do (read at these commits):

- sonos/tract, PR 2586 (merged 2026-08): ``softmax_inner_slice_f16`` summed the exponentials into an **f16**
  running total, one addition per key, every partial sum rounded to f16; with 4,096 equal logits the total sticks
  at 2,048 (fp16's spacing is 2 there) and a 4,096-key row of its regression test summed to 1.29 after the
  division. PR 2587 fixes the same in ``linalg/src/generic/reduce.rs`` (``HSoftMaxL2``, ``HSum8``). Order
  ``seq`` is that running total.
- ggml-org/llama.cpp, ``ggml/src/ggml-cpu/ops.cpp`` at 1f08e2d662715ead7987c365eced4f273d90e431,
  ``ggml_compute_forward_flash_attn_ext_f16_one_chunk``: with an f16 V cache the output accumulator ``VKQ16`` is
  **f16**, updated once per key by ``ggml_vec_mad_f16(DV, VKQ16, v, vs)`` (each element converted to fp32,
  ``y + v*vs`` in fp32, stored back as f16) with ``vs = expf(s - M)`` <= 1, and rescaled by
  ``ggml_vec_scale_f16`` when a new running max M appears; the row sum ``S = S*ms + vs`` stays **fp32**. So
  P@V there is an f16 ``seq`` sum of unnormalised weights times V, divided by S only at the end: it holds
  sum_j exp(s_j - m) v_j, which exceeds fp16's range when many keys carry weight near 1 and |V| is large.
- ikawrakow/ik_llama.cpp, PR 1196 (merged 2026-01-28): the CUDA flash attention's f16 V x softmax accumulation
  overflowed to NaN at a 64k-token context (MiniMax-M2); the fix adds an offset Delta = ln 4 to the running max
  (mainline llama.cpp: ln 8), dividing that accumulator by e^Delta.

What is computed here (one rule for every order, so that orders compare on the same terms):

- The terms enter in fp32: the denominator's ``e_j = exp(fp32(s_j - m))`` with m the row's max; P@V's
  ``fp32(e_j * v_jd)`` with V in its dtype. The row max is the final one (a two-pass softmax). The online
  kernels' rescale by exp(M_old - M) is order ``online`` (below): there a partial sum is taken against the
  running max M_t <= m, so it is e^(m - M_t) times the two-pass one at the same key, never smaller: an online
  accumulator can pass the range where the two-pass sum stays finite (and, once inf, a rescale keeps it inf).
- ``seq``: one running total in the dtype, one addition per key, each partial sum the exact sum of the total and
  the term rounded once to the dtype (round to nearest even; tract's f16 total and llama.cpp's VKQ16).
- ``pairwise``: a balanced tree over the keys (the row padded with zeros to a power of two), every node the exact
  sum of its two children rounded once to the dtype: a generalisation (no engine cited here sums so), the
  order a tree reduction takes; its error grows as log2(n) u instead of n u.
- ``block:B``: the keys in consecutive blocks of B; a block's terms summed exactly and rounded once to fp32 (a
  SIMD or tensor-core tile summing in fp32 registers), each block sum added to a running total held in the dtype
  with one rounding: a generalisation of the engines above (fp32 inside a block, the dtype between blocks).

- ``online`` (fp16 only): llama.cpp's CPU flash attention replayed key by key,
  ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` in ``ggml/src/ggml-cpu/ops.cpp`` at
  1f08e2d662715ead7987c365eced4f273d90e431 with an f16 V. Per key (a masked key, -inf, is skipped): ``s`` the
  score in fp32; if ``s > M``: ``M = s``, ``ms = expf(Mold - M)`` (0 at the first key), ``VKQ16 *= ms`` by
  ``ggml_vec_scale_f16`` (each element f16 -> fp32, times ms in fp32, back to f16), ``vs = 1``; else ``vs =
  expf(s - M)``; then ``ggml_vec_mad_f16``: ``VKQ16 = f16(fp32(VKQ16 + v*vs))`` (one fused multiply-add in fp32,
  as the AVX2/NEON builds' ``GGML_F16_VEC_FMA`` does, then the f16 store); and ``S = fp32(S*ms + vs)`` in fp32,
  one rounding: the multiply-add contracted to an FMA, as GCC does by default where the target has one (without
  it S*ms rounds first; the two differ only at keys that raise the max). At the end ``O = fp32(VKQ16) *
  fp32(1/S)``. V is cast to f16 whatever its dtype (the f16 cache); the score is the float64 reference rounded once
  to fp32 (the kernel's own q.k dot product is not judged here: the sums are); ``expf`` is the correctly rounded
  fp32 exp.
  The denominator is ``S`` (fp32: it never leaves the range); P@V is ``VKQ16``. The loop runs over keys, as the
  kernel's sequential dependence requires (each key's rescale and rounding act on the sum so far), vectorised
  over every row and head dim.

A partial sum past the dtype's range is inf (the sum of signed terms may then meet an opposite inf: NaN). The
first key at which each row's accumulator leaves the finite range is kept (the block's last key; for a tree, the
last key of the first node that did). Rows are vectorised: the loop runs over keys (``seq``), blocks (``block``)
or the log2(n) levels of the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.inputs.scores import QKBlock, _kv_heads, _qk_float64, _row_ranges
from attncheck.params import SumSpec
from attncheck.results.lowsum import LowSumStats, SumOverflow

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Accumulated:
    """A low-precision sum over axis 1 of terms (r, n, *rest): the total and where it first left the range."""

    total: torch.Tensor  # (r, *rest) in the dtype
    over: torch.Tensor  # (r, *rest) int64: the key at which the accumulator became inf/NaN, -1 if it never did
    partial: torch.Tensor  # (r, *rest) float64: the last finite partial sum before it (pairwise: the node's sum)


def _add(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """a + b rounded once to ``dt``: the sum in float64 is exact for fp16 and fp32 operands in the ranges that
    matter (and where it is not, the smaller operand lies below half an ulp of the dtype: the rounding is the
    same), then one round to nearest even."""
    return (a.to(torch.float64) + b.to(torch.float64)).to(dt)


def _mark(over: torch.Tensor, partial: torch.Tensor, new: torch.Tensor, old: torch.Tensor, key) -> None:
    """Record ``key`` where ``new`` left the finite range for the first time (``old`` was the partial before)."""
    bad = ~torch.isfinite(new)
    if bool(bad.any()):
        hit = bad & (over < 0)
        over[hit] = key if isinstance(key, int) else key[hit]
        partial[hit] = old.to(torch.float64)[hit]


def accumulate(terms: torch.Tensor, spec: SumSpec) -> Accumulated:
    """The sum over axis 1 of ``terms`` (r, n, *rest) (fp32 or float64 values) kept as ``spec`` says."""
    if spec.dtype not in DTYPES:
        raise AttncheckError(f"no 16-bit dtype {spec.dtype!r}", param="accumulate")
    dt = DTYPES[spec.dtype]
    r, n, rest = terms.shape[0], terms.shape[1], tuple(terms.shape[2:])
    over = torch.full((r, *rest), -1, dtype=torch.int64, device=terms.device)
    partial = torch.zeros((r, *rest), dtype=torch.float64, device=terms.device)
    acc = torch.zeros((r, *rest), dtype=dt, device=terms.device)
    if spec.order == "seq":
        for j in range(n):  # the running total: one rounding per key, vectorised over rows
            new = _add(acc, terms[:, j], dt)
            _mark(over, partial, new, acc, j)
            acc = new
        return Accumulated(acc, over, partial)
    if spec.order == "block":
        b = spec.block
        for start in range(0, n, b):  # each block's exact sum rounded once to fp32, added to the total in the dtype
            part = terms[:, start : start + b].to(torch.float64).sum(dim=1).to(torch.float32)
            new = _add(acc, part, dt)
            _mark(over, partial, new, acc, min(start + b, n) - 1)
            acc = new
        return Accumulated(acc, over, partial)
    if spec.order != "pairwise":
        raise AttncheckError(f"no order {spec.order!r}", param="accumulate")
    width = 1 << max(n - 1, 0).bit_length()
    s = terms
    if width != n:
        s = torch.cat([terms, terms.new_zeros((r, width - n, *rest))], dim=1)
    span = 1
    if n == 1:
        s = s.to(dt)
    while s.shape[1] > 1:  # log2(width) levels; every node rounds to the dtype
        left, right = s[:, 0::2], s[:, 1::2]
        new = _add(left, right, dt)
        span *= 2
        bad = ~torch.isfinite(new)
        if bool(bad.any()):
            # the first node (in key order) of this level that left the range, for rows not marked at a lower level
            idx = torch.arange(new.shape[1], device=new.device).view(1, -1, *([1] * len(rest)))
            ends = torch.clamp((idx + 1) * span - 1, max=n - 1).expand_as(new)
            big = torch.full_like(ends, n)
            first_end, pos = torch.where(bad, ends, big).min(dim=1)
            sums = left.to(torch.float64) + right.to(torch.float64)
            node_sum = sums.gather(1, pos.unsqueeze(1)).squeeze(1)
            hit = (first_end < n) & (over < 0)
            over[hit] = first_end[hit]
            partial[hit] = node_sum[hit]
        s = new
    return Accumulated(s[:, 0], over, partial)


@dataclass
class Online:
    """llama.cpp's CPU flash attention with an f16 V, replayed (order ``online`` in the module docstring)."""

    acc: torch.Tensor  # (r, dv) float16: VKQ16 after the last key
    S: torch.Tensor  # (r,) float32: the row sum
    out: torch.Tensor  # (r, dv) float32: fp32(VKQ16) * fp32(1/S), 0 where S is 0
    over: torch.Tensor  # (r, dv) int64: the key at which VKQ16 first became inf or NaN, -1 if it never did
    partial: torch.Tensor  # (r, dv) float64: VKQ16 before that key


def _expf(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp, correctly rounded (float64 exp, then one rounding to fp32: glibc's expf gives the same)."""
    return torch.exp(x.to(torch.float64)).to(torch.float32)


def online_f16(scores: torch.Tensor, v: torch.Tensor) -> Online:
    """Score rows ``scores`` (r, n) and V (r, n, dv) through llama.cpp's f16-V flash attention loop (module
    docstring, order ``online``), key by key and vectorised over rows and head dims: each key's update reads
    the accumulator the previous key rounded, so the keys cannot be taken apart."""
    s32 = scores.to(torch.float32)
    r, n = s32.shape
    vh = v.to(torch.float16)  # the f16 V cache the kernel reads
    acc = torch.zeros((r, vh.shape[-1]), dtype=torch.float16, device=s32.device)
    big = torch.zeros(r, dtype=torch.float32, device=s32.device)  # S
    top = torch.full((r,), float("-inf"), dtype=torch.float32, device=s32.device)  # M
    over = torch.full(acc.shape, -1, dtype=torch.int64, device=s32.device)
    partial = torch.zeros(acc.shape, dtype=torch.float64, device=s32.device)
    one = torch.ones(r, dtype=torch.float64, device=s32.device)
    for j in range(n):
        sj = s32[:, j]
        live = (sj != float("-inf")).unsqueeze(1)  # the kernel skips a masked key (continue)
        new = sj > top
        ms = one
        if bool(new.any()):  # a new running max: ggml_vec_scale_f16 (f16 -> fp32, times ms in fp32, f16)
            ms = torch.where(new, _expf(top - sj), torch.ones_like(sj)).to(torch.float64)
            acc = torch.where(new.unsqueeze(1), (acc.to(torch.float64) * ms.unsqueeze(1)).to(torch.float32).half(), acc)
            top = torch.where(new, sj, top)
        vs = _expf(sj - top).to(torch.float64)  # 1 exactly where sj is the new max
        mad = (acc.to(torch.float64) + vh[:, j].to(torch.float64) * vs.unsqueeze(1)).to(torch.float32).half()
        mad = torch.where(live, mad, acc)
        _mark(over, partial, mad, acc, j)
        acc = mad
        big = torch.where(live.squeeze(1), (big.to(torch.float64) * ms + vs).to(torch.float32), big)
    inv = torch.where(big == 0, torch.zeros_like(big), (1.0 / big.to(torch.float64)).to(torch.float32))
    out = (acc.to(torch.float32) * inv.unsqueeze(1)).to(torch.float32)
    return Online(acc, big, out, over, partial)


@dataclass
class RowSums:
    """Per row: the low-precision denominator and output against float64, and their accumulators' overflow."""

    denom: torch.Tensor  # (r,) float64: the denominator as kept
    denom64: torch.Tensor  # (r,) float64 reference
    denom_over: torch.Tensor  # (r,) int64 key, -1 none
    denom_partial: torch.Tensor  # (r,) float64
    valid: torch.Tensor  # (r,) bool: rows with a finite max (a softmax is defined)
    out_err: torch.Tensor | None = None  # (r,) float64: max_d |O - O64| / max_d |O64| (inf where O is not finite)
    out_over: torch.Tensor | None = None  # (r,) int64 first key over all dims, -1 none
    out_dim: torch.Tensor | None = None  # (r,) int64 the dim that went first
    out_partial: torch.Tensor | None = None  # (r,) float64
    out_value: torch.Tensor | None = None  # (r,) float64: what that dim's accumulator became (inf, -inf, nan)
    out_peak: torch.Tensor | None = None  # (r,) float64 max_d |sum_j e_j v_jd| in float64

    @property
    def denom_err(self) -> torch.Tensor:
        """(r,) relative error of the denominator; inf where its accumulator overflowed."""
        err = (self.denom - self.denom64).abs() / self.denom64
        return torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)


def row_sums(scores: torch.Tensor, spec: SumSpec, v: torch.Tensor | None = None) -> RowSums:
    """The softmax denominator (and with ``v`` (r, n, dv) the output) of score rows ``scores`` (r, n), with the
    sums kept as ``spec`` says, beside float64. Rows whose max is not finite (all masked, NaN, +inf) have no
    softmax: ``valid`` is False there and their numbers are not meaningful."""
    s = scores.to(torch.float64)
    m = s.amax(dim=-1, keepdim=True)
    valid = torch.isfinite(m.squeeze(-1))
    z = torch.where(valid.unsqueeze(-1), s - m, torch.full_like(s, float("-inf")))
    e64 = torch.exp(z)
    denom64 = e64.sum(dim=-1)
    if spec.order == "online":  # llama.cpp's loop: the fp32 row sum S and the f16 VKQ16 in one pass
        vd = (v if v is not None else s.new_zeros((*s.shape, 0))).to(torch.float16)
        online = online_f16(s, vd)
        never = torch.full_like(online.S, -1, dtype=torch.int64)  # S sums terms <= 1 in fp32: it stays finite
        out = RowSums(online.S.to(torch.float64), denom64, never, torch.zeros_like(denom64), valid)
        acc = Accumulated(online.acc, online.over, online.partial)
        o = online.out.to(torch.float64)
    else:
        e32 = torch.exp(z.to(torch.float32))  # the engines' expf of the shifted score
        d = accumulate(e32.unsqueeze(-1), spec)
        out = RowSums(d.total.squeeze(-1).to(torch.float64), denom64, d.over.squeeze(-1), d.partial.squeeze(-1), valid)
        if v is None:
            return out
        vd = v.to(DTYPES[spec.dtype]) if v.dtype not in (torch.float16, torch.bfloat16) else v
        acc = accumulate(e32.unsqueeze(-1) * vd.to(torch.float32), spec)  # terms (r, n, dv) fp32(e_j * v_jd)
        o = acc.total.to(torch.float64) / out.denom.unsqueeze(-1)
    if v is None:
        return out
    num64 = torch.einsum("rn,rnd->rd", e64, vd.to(torch.float64))
    o64 = num64 / denom64.unsqueeze(-1)
    scale = o64.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    err = (o - o64).abs().amax(dim=-1) / scale
    err = torch.where(torch.isfinite(o).all(dim=-1) & ~torch.isnan(err), err, torch.full_like(err, float("inf")))
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(acc.over >= 0, acc.over, torch.full_like(acc.over, big))
    first, dim = keyed.min(dim=-1)
    out.out_err = err
    out.out_over = torch.where(first == big, torch.full_like(first, -1), first)
    out.out_dim = dim
    out.out_partial = acc.partial.gather(1, dim.unsqueeze(1)).squeeze(1)
    out.out_value = acc.total.to(torch.float64).gather(1, dim.unsqueeze(1)).squeeze(1)
    out.out_peak = num64.abs().amax(dim=-1)
    return out


def add_rows(stats: LowSumStats, sums: RowSums, row0: int) -> None:
    """Fold the rows of one block (its first row is ``row0`` of the whole tensor) into ``stats``."""
    valid = sums.valid
    n_valid = int(valid.sum())
    if n_valid == 0:
        return
    err = sums.denom_err[valid]
    finite = err[torch.isfinite(err)]
    before = stats.rows - stats.denom_overflow_rows
    if finite.numel():
        stats.denom_err_max = max(stats.denom_err_max, float(finite.max()))
        total = stats.denom_err_mean * before + float(finite.sum())
        stats.denom_err_mean = total / (before + finite.numel())
    stats.rows += n_valid
    over = (sums.denom_over >= 0) & valid
    stats.denom_overflow_rows += int(over.sum())
    if stats.denom_first is None and bool(over.any()):
        i = int(torch.nonzero(over)[0])
        stats.denom_first = SumOverflow(
            row0 + i, int(sums.denom_over[i]), float(sums.denom_partial[i]), float(sums.denom[i])
        )
    if sums.out_err is None:
        return
    oerr = sums.out_err[valid]
    ofin = oerr[torch.isfinite(oerr)]
    stats.out_rows += n_valid
    stats.out_nonfinite_rows += n_valid - ofin.numel()
    if ofin.numel():
        stats.out_err_max = max(stats.out_err_max or 0.0, float(ofin.max()))
    stats.out_peak = max(stats.out_peak, float(sums.out_peak[valid].max()))
    oover = (sums.out_over >= 0) & valid
    stats.out_overflow_rows += int(oover.sum())
    if stats.out_first is None and bool(oover.any()):
        i = int(torch.nonzero(oover)[0])
        stats.out_first = SumOverflow(
            row0 + i,
            int(sums.out_over[i]),
            float(sums.out_partial[i]),
            float(sums.out_value[i]),
            int(sums.out_dim[i]),
        )


def stats(blocks, specs: tuple[SumSpec, ...]) -> list[LowSumStats]:
    """Every spec over every row of ``blocks`` (an iterable of (scores (r, n), v (r, n, dv) or None), in row
    order), folded into one ``LowSumStats`` per spec."""
    out = [LowSumStats(spec.label, dtype_max=float(torch.finfo(DTYPES[spec.dtype]).max)) for spec in specs]
    row0 = 0
    for scores, v in blocks:
        for spec, st in zip(specs, out):
            st.keys = scores.shape[-1]
            add_rows(st, row_sums(scores, spec, v), row0)
        row0 += scores.shape[0]
    return out


def rows_per_block(keys: int, dv: int, chunk_elements: int) -> int:
    """Rows a block may hold: a pairwise tree of P@V holds (r, 2n, dv) float64 terms beside the scores."""
    return max(1, chunk_elements // max(1, keys * (2 + 2 * dv)))


def qk_blocks(inp, rows: int):
    """(float64 scores (r, Tk), V (r, Tk, dv) or None) of Q/K inputs (numerics.inputs.prepare.AttentionInputs) in
    row blocks: q.k^T times the scale plus the float mask, boolean-masked keys -inf (or the mask value given), a
    flex call's logits after its score_mod: the float64 reference the diagnosis computes (inputs.scores.QKBlock)."""
    sentinel = float("-inf") if inp.mask_value in ("-inf", "min") else float(inp.mask_value)
    for bh, qs in _row_ranges(inp, rows):
        _, _, s = _qk_float64(inp, bh, qs)
        s = s.mul_(inp.scale)
        mask_float = QKBlock._slice4(inp.mask_float, bh, qs, s.device)
        masked = QKBlock._slice4(inp.masked, bh, qs, s.device)
        if mask_float is not None:
            s = s.add_(mask_float)
        if masked is not None:
            s = s + torch.zeros_like(s).masked_fill(masked, sentinel)
        if inp.logits64 is not None:
            s = QKBlock._slice4(inp.logits64, bh, qs, s.device)
        v = None
        if inp.v is not None:
            vh = inp.v.reshape(-1, *inp.v.shape[2:])[_kv_heads(inp, bh)]  # (n, Tk, dv)
            v = vh.unsqueeze(1).expand(-1, s.shape[1], -1, -1).reshape(-1, *vh.shape[1:])
        yield s.reshape(-1, s.shape[-1]), v
