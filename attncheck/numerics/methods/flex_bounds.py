"""Bounds of FlexAttention's compiled CPU kernel against torch's own: the error of the logits (another
q @ k^T order, another score_mod implementation: ``flex_score_err``) and, from the terms the emulation
accumulates, the per element bound on the output (``_bound``, which ``methods/flex.py:flex_bound`` returns).
Stated from the rounding points in the docstring of ``methods/flex.py``."""

from __future__ import annotations

import math

import torch

from attncheck.numerics.methods.flex_eager import _kv_for_heads, _scaled_scores
from attncheck.numerics.methods.flex_libm import _TINY, ETA_EXPF, NEG_INF, U32, _rounds_same, gamma, ulp


def _bound(MN, DN, ML, J, n_alpha, m_first, m, dm, pert, acc, l, y, dtype, W, kbp, Tk, kept):
    """Per element bound on |out' - out| from the accumulated terms (see ``flex_bound``)."""
    mf = torch.where(torch.isnan(m_first), 0.0, m_first)
    span = torch.where(m > NEG_INF, m.double() - mf, 0.0)
    # the alphas after a block, both sides: |ln A'_j - ln A_j - (m'_j - m_j) + (m'_final - m_final)|
    row = torch.where(
        pert,
        2 * U32 * (span + 2 * dm) + 2 * J * ETA_EXPF * (1 + 2.0**-20),
        n_alpha * ETA_EXPF * (1 + 2.0**-20),
    )
    lam = torch.where(pert, dm, 0.0) + row  # |ln(A'_j / c) - ln A_j|, c = exp(m_final - m'_final)
    grow = torch.exp(lam).unsqueeze(-1)
    n_kernel = Tk + 2 * J + 2  # roundings a term of the kernel's acc goes through, any GEMM order
    n_ours = n_kernel  # ours: the same chains (one more rounding than the kernel at most)
    n_l = kbp / W + math.log2(W) + W + 2 * J + 1  # the same for l (its order is the emulated one)
    g = lambda n: gamma(n).unsqueeze(-1)  # noqa: E731
    l64 = l.double()
    yhat = acc.double() / torch.where(l64 == 0, 1.0, l64).unsqueeze(-1)

    # sum over keys of e A |rho| (l's move, up to c) and, for fp32, of e A |rho| |v| and |v - y|
    rl = torch.zeros_like(ML)
    rn = torch.zeros_like(MN)
    s1 = torch.zeros_like(MN)
    decay = torch.ones_like(ML)
    for _, _, _, al, key, e_ref, rho_key, vb in reversed(kept):
        wr = torch.where(key, e_ref * torch.expm1(rho_key + row.unsqueeze(-1)) + _TINY, 0.0)
        wr = wr * decay.unsqueeze(-1)  # (B, H, nq, qbs, kbp)
        rl = rl + wr.sum(dim=-1)
        if dtype == torch.float32:
            rn = rn + wr @ vb.abs()
            for c0 in range(0, wr.shape[-1], W):  # |v_i - y| per row: W keys at a time
                dv = (vb[..., c0 : c0 + W, :].unsqueeze(-3) - yhat.unsqueeze(-2)).abs()
                s1 = s1 + (wr[..., c0 : c0 + W].unsqueeze(-1) * dv).sum(dim=-2)
        decay = decay * al.double()
    ml = ML * (1 + 2 * U32)
    d_l = rl + gamma(n_l) * (2 * ml + rl)  # |l'/c - l|

    # acc'/c - acc: P' against P (dp, stability), the alphas, both accumulations' roundings
    d_acc = grow * DN + torch.expm1(lam).unsqueeze(-1) * MN + g(n_ours) * MN + g(n_kernel) * (MN + DN) * grow
    den = (l64 - d_l).unsqueeze(-1)
    d_div = torch.where(den > 0, (d_acc + yhat.abs() * d_l.unsqueeze(-1)) / den.clamp(min=1e-300), math.inf)
    if dtype == torch.float32:
        # fp32 P is e itself: acc and l move by the same factors (1 + rho_i), so only
        # sum e A |rho| |v - y| is left of them
        num = s1 + g(n_ours) * MN + g(n_kernel) * (MN + rn) + yhat.abs() * (gamma(n_l) * (2 * ml + rl)).unsqueeze(-1)
        den2 = (l64 - gamma(n_l) * ml - rl - gamma(n_l) * (ml + rl)).unsqueeze(-1)
        d_div = torch.minimum(d_div, torch.where(den2 > 0, num / den2.clamp(min=1e-300), math.inf))
    delta = (d_div + 2 * U32 * (1 + 2 * U32) * (2 * yhat.abs() + d_div)) * (1 + 2.0**-20)
    if dtype == torch.float32:
        return delta
    y64 = y.double()
    stable = _rounds_same(y64 - delta, y64 + delta, dtype)
    return torch.where(stable, 0.0, delta + ulp(y64.abs() + delta, dtype))


def kernel_dot_terms(e: int) -> int:
    """How many roundings a product q_d k_d goes through in torch 2.13's compiled kernel's q @ k^T,
    for head dim ``e``: on an AVX2 CPU the template's ``CppMicroGemmFP32Vec`` with B transposed
    (``_inductor/codegen/cpp_micro_gemm.py``, lines 684-830) takes, for e >= 24 or e not a multiple of 8,
    its "second implementation": 8 lane accumulators of FMAs along k (e/8 steps; bf16/fp16 load 16
    and make two FMAs per step), then ``vec_reduce_all``'s 3 levels; else a single chain of e FMAs.
    Elsewhere (AVX512, where oneDNN's packed brgemm may take bf16/fp16) the order is not known: e."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or (e % 8 == 0 and e < 24):
        return e
    return min(e, -(-e // 8) + 1 + 3)


def flex_score_err(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    post_mod_scores: torch.Tensor | None = None,
    enable_gqa: bool = False,
    mod_lipschitz: float = 1.0,
    mod_ulps: float = 0.0,
    dot_terms: int | None = None,
) -> torch.Tensor:
    """A per-element bound (B, Hq, Tq, Tk) float64 on |the compiled kernel's post-mod logit -
    ``flex_post_mod_scores``'s| (torch 2.13: the template's micro-GEMM and inductor's score_mod code
    against the math path's torch matmul and vmapped score_mod).

    Before score_mod: ours is known exactly against the exact product T = (q . k) * scale (float64),
    the kernel's dot product is within gamma_n sum_d |q_d k_d| of it (n = ``dot_terms``, the number
    of roundings on a product's way to the sum: default ``kernel_dot_terms(E)``, which is E, any
    order, where the kernel's order is not known; every product of bf16 or fp16 inputs is exact,
    of fp32 ones fused into an FMA),
    and its product with the scale rounds once:
    sigma_pre = |S_ours - T| + scale gamma_n sum|q k| + u (|T| + scale gamma_n sum|q k|) + float64's own error.
    After score_mod: sigma = ``mod_lipschitz`` sigma_pre + ``mod_ulps`` ulp_fp32(max(|S_pre|, |S_post|)),
    where ``mod_ulps`` counts the fp32 ulps by which the two implementations of the score_mod may
    differ on the same input plus one per rounded operation whose input moved (0 for none; 1 for
    ``score + bias`` with an exact bias, e.g. ALiBi with power-of-two slopes; a few for a tanh
    soft-cap: the division, the two tanh implementations, the product). Masked entries (-inf in
    ``post_mod_scores``) get 0: both sides mask them the same.
    """
    s_pre, working, scale = _scaled_scores(q, k, scale, enable_gqa, torch.float32)
    key = _kv_for_heads(k, q.size(1), q.size(0), enable_gqa)
    q64, k64 = q.double(), key.double()
    sc = float(torch.tensor(scale, dtype=torch.float32))
    exact = (q64 @ k64.transpose(-2, -1)) * sc
    absdot = q64.abs() @ k64.abs().transpose(-2, -1)
    e = q.size(-1)
    n = kernel_dot_terms(e) if dot_terms is None else int(dot_terms)
    kern = sc * gamma(n) * absdot
    f64err = (e + 2) * 2.0**-53 * sc * absdot  # the float64 dot product's own rounding
    sig_pre = (s_pre.double() - exact).abs() + kern + U32 * (exact.abs() + kern) + 2 * f64err
    mag = s_pre.double().abs()
    if post_mod_scores is not None:
        post = post_mod_scores.double()
        mag = torch.maximum(mag, torch.where(post.isfinite(), post.abs(), 0.0))
    sig = mod_lipschitz * sig_pre + mod_ulps * ulp(mag, torch.float32)
    if post_mod_scores is not None:
        sig = torch.where(post_mod_scores == NEG_INF, 0.0, sig)
    return sig
