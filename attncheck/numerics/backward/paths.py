"""The backward of each attention path, with the rounding points of the implementation it names.

All take a ``HeadBlock``: query heads (n, Tq, d) with the k and v each reads (GQA expanded), the
output gradient dO (n, Tq, dv), the mask, and for a captured call the scores its softmax saw or the
output its kernel gave. Each returns dQ (n, Tq, d), dK and dV (n, Tk, .) per query head, in the
cell's dtype, and what ``diagnose`` needs to name a cause (the rows each stage broke) and the
loss-scale headroom (the largest magnitude each intermediate reached, in the dtype that holds it).

- ``eager``: autograd of hand-written attention in the dtype, op for op as torch runs it
  (``tests/numerics/backward`` holds every bit equal to ``torch.autograd`` of the same forward):
  dP = dO @ V^T and dV = P^T @ dO as torch's matmul in the dtype; dS = torch's softmax backward
  ``P * (dP - rowsum(P * dP))`` (``_softmax_backward_data``, in the softmax's own dtype when it
  was given ``dtype=``, then cast back); a mask added to the scores passes dS through, a mask
  applied with ``masked_fill`` zeroes it at the filled keys; dS times the scale (or q pre-scaled);
  dQ = dS @ K and dK = dS^T @ Q in the dtype. A query row whose every key is -inf has a NaN
  softmax: added, its NaN dS reaches dQ (that row) and dK, dV (every key of the head); filled,
  only dV (P^T dO with a NaN P).
- ``sdpa-math``: autograd of PyTorch 2.13's math SDPA (``_scaled_dot_product_attention_math``):
  fp16/bf16 upcast to fp32, q and k^T each times sqrt(scale), ``_safe_softmax`` (rows whose
  every score is -inf are 0, so their dS is 0), every product in fp32, the gradients cast to the
  dtype once (bit for bit against torch's autograd under ``sdpa_kernel(SDPBackend.MATH)``).
- ``flash``: the FlashAttention-2 backward as PyTorch's CPU flash kernel computes it
  (``cpu_flash_attention_backward``, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp):
  D = rowsum(dO * O) in fp32; per query block (32 queries below 192, 64 below 768, else 256) and
  key block (512): S = scale * q @ k^T + mask in fp32, P = exp(S - lse) from the forward's
  log-sum-exp (a fully masked row has lse 0, so P = 0), dP = dO @ V^T in fp32, dS = P (dP - D)
  in fp32; P and dS rounded to the dtype for the products dV += P^T dO, dQ += scale dS K,
  dK += scale dS^T Q, whose sums the CPU kernel keeps in the dtype, rounded after each block
  (on CUDA, FlashAttention accumulates them in fp32 and rounds once). With ``is_causal`` a
  query's future keys are filled (S with -inf, P with 0) rather than added to, and key blocks
  that start past the query block are skipped, so a NaN in a future key spreads as far as the
  kernel lets it (within a computed block, 0 x NaN in dS K is still NaN). Its exp is torch's (a few fp32 ulp from the
  kernel's vectorised one), so the gradients agree with the kernel's within a rounding bound,
  not bit for bit.
- ``reference``: float64 autograd of the intended attention: the scores as given, masked keys at
  -inf, and a row with no key left contributes nothing (its probabilities and gradient are 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attncheck.numerics.inputs.scores import mask_planes, sentinel_in
from attncheck.numerics.methods.online import online_softmax
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, cast, dtype_label

FLASH_KV_BLOCK = 512  # cpu_flash_attention_backward's kv_split_size


def flash_q_block(tq: int) -> int:
    """The CPU flash backward's query block: 256 from 768 queries, 64 from 192, else 32."""
    return 256 if tq >= 768 else 64 if tq >= 192 else 32


@dataclass
class HeadBlock:
    """Query heads of one call (n of them) with everything their backward reads."""

    q: torch.Tensor  # (n, Tq, d) as given
    k: torch.Tensor  # (n, Tk, d): the kv head each query head reads
    v: torch.Tensor  # (n, Tk, dv)
    dout: torch.Tensor  # (n, Tq, dv)
    masked: torch.Tensor | None  # (n, Tq, Tk) bool, True = masked (boolean mask, causal, padding)
    mask_float: torch.Tensor | None  # (n, Tq, Tk) float64, added
    scale: float
    scale_order: str  # 'scores' (S = (Q K^T) s) or 'q' (S = (q s) K^T)
    mask_value: str  # what a boolean-masked key holds on the eager path: '-inf', 'min' or a number
    sdpa_mask_value: str  # ... in SDPA's kernels ('-inf' for a boolean mask)
    scores: torch.Tensor | None = None  # (n, Tq, Tk): the scores a captured softmax saw, as recorded
    out: torch.Tensor | None = None  # (n, Tq, dv): the output the model's kernel gave
    causal: bool = (
        False  # SDPA's is_causal (also in ``masked``): the flash kernel fills and skips the keys past a query
    )


@dataclass
class PathGrads:
    """One path's gradients for a head block, and what broke where."""

    dq: torch.Tensor  # (n, Tq, d) in the cell's dtype
    dk: torch.Tensor  # (n, Tk, d) per query head (summed over a GQA group by the caller)
    dv: torch.Tensor  # (n, Tk, dv)
    forward_causes: list[tuple[str, torch.Tensor]]  # (cause, (n, Tq) bool) rows whose probabilities are not finite
    dp_bad: torch.Tensor  # (n, Tq) rows of dP holding NaN or inf
    ds_bad: torch.Tensor  # (n, Tq) rows of dS holding NaN or inf
    ds_nan: torch.Tensor  # (n, Tq) rows whose dS holds NaN (inf - inf in dP - D) rather than only inf
    held: list[tuple[str, str]] = field(
        default_factory=list
    )  # (intermediate, the dtype the path holds it in): dO, dP, dS, dQ, dK, dV
    group_sum_dtype: torch.dtype | None = None  # the dtype a GQA group's dK, dV are summed in (None: the cell's)
    # With ``terms``: the magnitudes the bound on the recorded gradients reads (``diagnose._compare_real``)
    terms: Terms | None = None


@dataclass
class Terms:
    """Magnitudes of a path's intermediates, fp32, finite parts only (NaN and inf read as 0): what the
    rounding bound of the recorded gradients is built from."""

    p: torch.Tensor  # (n, Tq, Tk) |P|
    dsd: torch.Tensor  # (n, Tq, Tk) |dP - D|: dS = P (dP - D)
    s: torch.Tensor  # (n, Tq, Tk) |S| where P > 0, else 0
    lse: torch.Tensor  # (n, Tq) |log-sum-exp| of each row's scores (0 for a row with no key)
    held: torch.dtype = torch.float32  # the lowest precision S, dP, P and dS are held in (the eager path's dtype)


def finite_abs(t: torch.Tensor) -> torch.Tensor:
    """|t| in fp32 with NaN and inf as 0: the magnitudes a rounding bound sums."""
    return torch.nan_to_num(t.float().abs(), nan=0.0, posinf=0.0)


def _terms(
    p: torch.Tensor,
    dp: torch.Tensor,
    dsum: torch.Tensor,
    s: torch.Tensor,
    lse: torch.Tensor | None = None,
    held: torch.dtype = torch.float32,
) -> Terms:
    pf = finite_abs(p)
    s32 = s.float()
    if lse is None:
        lse = torch.logsumexp(s32, dim=-1)
    lse = torch.where(torch.isneginf(lse), 0.0, lse)
    s_abs = torch.where(pf > 0, finite_abs(s32), 0.0)
    return Terms(pf, finite_abs(dp.float() - dsum.float()), s_abs, finite_abs(lse), held)


def _rows_bad(t: torch.Tensor) -> torch.Tensor:
    """Rows (the last axis) holding NaN or inf: a float64 row sum is finite exactly when every entry
    is (no sum of float32 values can overflow float64), in one pass and without a mask per entry."""
    return ~torch.isfinite(t.sum(dim=-1, dtype=torch.float64))


def peak(t: torch.Tensor) -> float:
    """The largest finite |x| (0 for none)."""
    top = float(t.abs().amax()) if t.numel() else 0.0
    if math.isfinite(top):
        return top
    a = t.abs()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


def _forward_causes(s: torch.Tensor, p: torch.Tensor, computed: bool) -> list[tuple[str, torch.Tensor]]:
    """Rows whose probabilities p are not finite, by what broke them in the forward, in pipeline
    order: NaN in the scores, +inf in them (Q@K^T overflowing the dtype where the scores were
    computed here, else given), every key -inf (fully masked), else the softmax itself."""
    bad = _rows_bad(p)
    none = torch.zeros_like(bad)
    if not bool(bad.any()):
        return [
            ("input_nan", none),
            ("qk_overflow" if computed else "inf_input", none),
            ("fully_masked", none),
            ("forward_nan", none),
        ]
    rows = s[bad]  # (m, Tk): only the broken rows are looked at
    nan, posinf, masked = none.clone(), none.clone(), none.clone()
    nan[bad] = torch.isnan(rows).any(dim=-1)
    posinf[bad] = torch.isposinf(rows).any(dim=-1)
    masked[bad] = torch.isneginf(rows).all(dim=-1)
    posinf &= ~nan
    masked &= ~nan & ~posinf
    rest = bad & ~nan & ~posinf & ~masked
    return [
        ("input_nan", nan),
        ("qk_overflow" if computed else "inf_input", posinf),
        ("fully_masked", masked),
        ("forward_nan", rest),
    ]


def _nan_rows(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Of the rows ``bad`` says hold NaN or inf, those holding NaN."""
    out = torch.zeros_like(bad)
    if bool(bad.any()):
        out[bad] = torch.isnan(t[bad]).any(dim=-1)
    return out


def _matmul(a: torch.Tensor, b: torch.Tensor, exact: bool) -> torch.Tensor:
    """torch's matmul in the operands' dtype, or (``exact`` False) the same product in fp32 rounded
    to that dtype once: the same rounding point, with fp32 sums in another order (a few fp32 ulp),
    and far faster where a CPU has no fp16/bf16 arithmetic."""
    if exact or a.dtype in (torch.float32, torch.float64):
        return torch.matmul(a, b)
    return torch.matmul(a.float(), b.float()).to(a.dtype)


def filled_keys(hb: HeadBlock) -> torch.Tensor | None:
    """The keys a ``masked_fill`` set: the boolean mask's, or with recorded scores, the keys they
    hold at -inf or a mask sentinel."""
    if hb.scores is not None:
        return hb.scores <= MASK_SENTINEL_LIMIT
    return hb.masked


def eager(
    hb: HeadBlock,
    dt: torch.dtype,
    mask_op: str = "add",
    softmax_dtype: torch.dtype | None = None,
    scores_dtype: torch.dtype | None = None,
    exact: bool = True,
    terms: bool = False,
) -> PathGrads:
    """Autograd of hand-written attention with its matmuls in ``dt`` (see the module docstring).
    ``scores_dtype``: the dtype the scores reach the softmax in where it differs (under autocast a
    float32 mask added to the bf16 Q@K^T promotes them): the softmax's gradient is cast to it, then
    back to ``dt`` for the Q@K^T product, as autograd casts a gradient to its input's dtype.
    ``exact`` False: the products through fp32 (``_matmul``), for a yardstick rather than the bits."""
    mm = lambda a, b: _matmul(a, b, exact)  # noqa: E731
    qd, kd, vd, do = cast(hb.q, dt), cast(hb.k, dt), cast(hb.v, dt), cast(hb.dout, dt)
    s_dt = scores_dtype or dt
    if hb.scale_order == "q":
        qd = qd * hb.scale
    computed = hb.scores is None
    if computed:
        s = mm(qd, kd.transpose(-1, -2))  # (n, Tq, Tk) in dt
        if hb.scale_order == "scores":
            s = s * hb.scale
        if mask_op == "fill" and hb.masked is not None:
            mf, _, _ = mask_planes(hb.mask_float, None, dt, hb.mask_value)
            s = s.masked_fill(hb.masked, sentinel_in(dt, hb.mask_value))
            s = s if mf is None else s + mf
        else:
            _, _, mask_dt = mask_planes(hb.mask_float, hb.masked, dt, hb.mask_value)
            s = s if mask_dt is None else s + mask_dt
        s = s.to(s_dt)
    else:
        s = cast(hb.scores, s_dt)
    sd = softmax_dtype if softmax_dtype is not None and softmax_dtype != s_dt else None
    ps = torch.softmax(s, dim=-1, dtype=sd) if sd is not None else torch.softmax(s, dim=-1)  # (n, Tq, Tk)
    p = ps.to(dt)
    dp = mm(do, vd.transpose(-1, -2))  # (n, Tq, Tk) in dt
    dv = mm(p.transpose(-1, -2), do)  # (n, Tk, dv)
    dps = dp.to(ps.dtype)
    ds_held = torch._softmax_backward_data(dps, ps, -1, ps.dtype)
    ds = ds_held.to(s_dt)
    if mask_op == "fill":
        filled = filled_keys(hb)
        if filled is not None:
            ds = ds.masked_fill(filled, 0)
    ds = ds.to(dt)
    dqk = ds * hb.scale if hb.scale_order == "scores" else ds
    dq = mm(dqk, kd)  # (n, Tq, d)
    dk = mm(qd.transpose(-1, -2), dqk).transpose(-1, -2)  # (n, Tk, d): autograd's q^T @ dS for the operand k^T
    if hb.scale_order == "q":
        dq = dq * hb.scale
    name = _label(dt)
    held = [
        ("dO", name),
        ("dP", name),
        ("dS", _label(ds_held.dtype)),
        ("dS", _label(s_dt)),
        ("dS", name),
        ("dQ", name),
        ("dK", name),
        ("dV", name),
    ]
    ds_bad = _rows_bad(ds_held) | _rows_bad(ds)
    return PathGrads(
        dq,
        dk,
        dv,
        _forward_causes(s, p, computed),
        _rows_bad(dp),
        ds_bad,
        _nan_rows(ds_held, ds_bad),
        held,
        terms=_terms(ps, dps, (ps * dps).sum(dim=-1, keepdim=True), s, held=dt) if terms else None,
    )


def _upcast(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt in (torch.float16, torch.bfloat16) else dt


def _sdpa_mask(hb: HeadBlock, dt: torch.dtype, into: torch.dtype) -> torch.Tensor | None:
    """The mask as SDPA holds it in ``dt`` (a boolean mask as -inf), in ``into`` for the addition."""
    _, _, mask_dt = mask_planes(hb.mask_float, hb.masked, dt, hb.sdpa_mask_value)
    return None if mask_dt is None else mask_dt.to(into)


def sdpa_math(hb: HeadBlock, dt: torch.dtype, terms: bool = False) -> PathGrads:
    """Autograd of PyTorch 2.13's math SDPA in ``dt`` (see the module docstring)."""
    up = _upcast(dt)
    qf, kf, vf = (cast(t, dt).to(up) for t in (hb.q, hb.k, hb.v))
    do = cast(hb.dout, dt)
    root = math.sqrt(hb.scale)
    qs = qf * root
    kts = kf.transpose(-1, -2) * root
    s = torch.matmul(qs, kts)  # (n, Tq, Tk) in fp32
    mask = _sdpa_mask(hb, dt, up)
    if mask is not None:
        s = s + mask
    p = torch._safe_softmax(s, -1)
    dof = do.to(up)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = torch._softmax_backward_data(dp, p, -1, up)
    dqs = torch.matmul(ds, kts.transpose(-1, -2))
    dkts = torch.matmul(qs.transpose(-1, -2), ds)
    dq32, dk32 = dqs * root, (dkts * root).transpose(-1, -2)
    inner, name = _label(up), _label(dt)
    held = [("dO", name), ("dP", inner), ("dS", inner), ("dQ", name), ("dK", name), ("dV", name)]
    ds_bad = _rows_bad(ds)
    return PathGrads(
        dq32,
        dk32,
        dv,
        _forward_causes(s, p, True),
        _rows_bad(dp),
        ds_bad,
        _nan_rows(ds, ds_bad),
        held,
        group_sum_dtype=up,
        terms=_terms(p, dp, (p * dp).sum(dim=-1, keepdim=True), s) if terms else None,
    )


def flash_forward(hb: HeadBlock, dt: torch.dtype, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the flash forward leaves for its backward: (S in fp32 with the mask, the log-sum-exp
    per row in fp32 (0 for a fully masked row, as the kernel stores it), O in ``dt``: the
    model's own output where it was recorded, else the flash path's forward)."""
    qf, kf = cast(hb.q, dt).float(), cast(hb.k, dt).float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * hb.scale  # (n, Tq, Tk)
    mask = _sdpa_mask(hb, dt, torch.float32)
    if mask is not None:
        s = s + mask
    if hb.causal:  # the kernel fills a query's future keys with -inf (NaN there does not stay)
        s = s.masked_fill(_future(s), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)
    total = torch.exp(s - m).sum(dim=-1, keepdim=True)
    lse = (m + torch.log(torch.where(total == 0, 1.0, total))).squeeze(-1)
    if hb.out is not None:
        out = cast(hb.out, dt)
    else:
        p = online_softmax(s.reshape(-1, s.shape[-1]), dt, min(block, s.shape[-1])).reshape(s.shape)
        out = torch.matmul(p, cast(hb.v, dt).float()).to(dt)
    return s, lse, out


def flash(hb: HeadBlock, dt: torch.dtype, blocks: bool = True, terms: bool = False) -> PathGrads:
    """The FlashAttention-2 backward as PyTorch's CPU flash kernel computes it (see the module
    docstring); ``blocks=False``: the sums in fp32 and rounded once, as FlashAttention on CUDA."""
    s, lse, out = flash_forward(hb, dt)
    do = cast(hb.dout, dt)
    dof, vf, kf, qf = do.float(), cast(hb.v, dt).float(), cast(hb.k, dt).float(), cast(hb.q, dt).float()
    p = torch.exp(s - lse.unsqueeze(-1))  # (n, Tq, Tk) fp32: 0 at masked keys and in fully masked rows
    if hb.causal:
        p = p.masked_fill(_future(p), 0.0)
    dsum = (dof * out.float()).sum(dim=-1, keepdim=True)  # (n, Tq, 1) D = rowsum(dO * O)
    dp = torch.matmul(dof, vf.transpose(-1, -2))  # fp32
    ds = p * (dp - dsum)  # fp32
    p_dt, ds_dt = p.to(dt).float(), ds.to(dt).float()
    n, tq, tk = s.shape
    if not blocks:
        dv = torch.matmul(p_dt.transpose(-1, -2), dof).to(dt)
        dq = (hb.scale * torch.matmul(ds_dt, kf)).to(dt)
        dk = (hb.scale * torch.matmul(ds_dt.transpose(-1, -2), qf)).to(dt)
    else:  # the sums held in dt, rounded after each block, as the CPU kernel's gemms accumulate into them
        dq = torch.zeros(n, tq, qf.shape[-1], dtype=dt)
        dk = torch.zeros(n, tk, kf.shape[-1], dtype=dt)
        dv = torch.zeros(n, tk, vf.shape[-1], dtype=dt)
        qb = flash_q_block(tq)
        for m0 in range(0, tq, qb):
            m1 = min(tq, m0 + qb)
            keys = min(m1, tk) if hb.causal else tk  # causal: the key blocks past the query block are skipped
            for n0 in range(0, keys, FLASH_KV_BLOCK):
                n1 = min(tk, n0 + FLASH_KV_BLOCK)
                pb, dsb = p_dt[:, m0:m1, n0:n1], ds_dt[:, m0:m1, n0:n1]
                dv[:, n0:n1] = (dv[:, n0:n1].float() + torch.matmul(pb.transpose(-1, -2), dof[:, m0:m1])).to(dt)
                dq[:, m0:m1] = (dq[:, m0:m1].float() + hb.scale * torch.matmul(dsb, kf[:, n0:n1])).to(dt)
                dk[:, n0:n1] = (dk[:, n0:n1].float() + hb.scale * torch.matmul(dsb.transpose(-1, -2), qf[:, m0:m1])).to(
                    dt
                )
    name = _label(dt)
    held = [("dO", name), ("dP", "fp32"), ("dS", "fp32"), ("dS", name), ("dQ", name), ("dK", name), ("dV", name)]
    ds_bad = _rows_bad(ds) | _rows_bad(ds_dt)
    return PathGrads(
        dq,
        dk,
        dv,
        _forward_causes(s, p, True),
        _rows_bad(dp),
        ds_bad,
        _nan_rows(ds, ds_bad),
        held,
        group_sum_dtype=torch.float32,
        terms=_terms(p, dp, dsum, s, lse) if terms else None,
    )


def _future(t: torch.Tensor) -> torch.Tensor:
    """(Tq, Tk) True at the keys after each query, aligned top left as SDPA's is_causal."""
    tq, tk = t.shape[-2], t.shape[-1]
    return torch.ones(tq, tk, dtype=torch.bool, device=t.device).triu(1)


def reference(hb: HeadBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Float64 dQ, dK, dV of the intended attention (see the module docstring), and the largest
    magnitude of each intermediate (dO, dP, dS, dQ, dK, dV): what each would reach in any path,
    rounding aside, and so what a dtype holding it must hold."""
    q, k, v, do = (t.to(torch.float64) for t in (hb.q, hb.k, hb.v, hb.dout))
    if hb.scores is not None:
        s = hb.scores.to(torch.float64)
    else:
        s = torch.matmul(q, k.transpose(-1, -2)) * hb.scale
        if hb.mask_float is not None:
            s = s + hb.mask_float
        if hb.masked is not None:
            sentinel = float("-inf") if hb.mask_value in ("-inf", "min") else float(hb.mask_value)
            s = s.masked_fill(hb.masked, sentinel)
    p = torch._safe_softmax(s, -1)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.transpose(-1, -2))
    ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k) * hb.scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * hb.scale
    peaks = {name: peak(t) for name, t in (("dO", do), ("dP", dp), ("dS", ds), ("dQ", dq), ("dK", dk), ("dV", dv))}
    return dq, dk, dv, peaks


def _label(dt: torch.dtype) -> str:
    return dtype_label(dt)
