"""FlexAttention's forward on CPU as torch 2.13 computes it, from the logits after score_mod and mask.

A tool that recorded flex's post-mod logits recomputes the output here with the rounding points
of the code torch 2.13.0 runs, and compares it with a float64 reference. Paths below are under
``torch/`` of the installed torch 2.13.0 wheel.

Eager flex (``flex_attention`` without ``torch.compile``; it runs the ``flex_attention`` HOP under
dynamo's "eager" backend, which lands in ``sdpa_dense`` -> ``math_attention``,
``_higher_order_ops/flex_attention.py`` lines 177-292):

- k and v repeated over the query heads (``repeat_interleave``, GQA) and expanded over the batch;
- q, k upcast to the working precision (fp32, fp64 when q is fp64); S = q @ k^T by torch's matmul;
  ``(S * scale)`` in the working precision; ``score_mod`` vmapped over (b, h, q, kv) with
  ``_vmap_for_bhqkv`` under ``TransformGetItemToIndex``; masked scores -> -inf (line 210);
- lse = ``logsumexp`` in the working precision, -inf on rows with no key, returned divided by
  ln 2 (line 287) and multiplied by ln 2 again at the top level (``_finalize_outputs`` in
  ``nn/attention/flex_attention.py`` line 2442): two roundings, not the identity;
- ``torch._safe_softmax`` in the working precision (rows with no key: 0), P cast to q's dtype,
  O = P @ V by torch's matmul in that dtype (line 286). O for a row with no key is 0.

Compiled flex on CPU (inductor's C++ template ``_inductor/codegen/cpp_flex_attention_template.py``,
``FLEX_ATTENTION_TEMPLATE``, lowered by ``_inductor/kernel/flex/flex_cpu.py:lower_cpu``):

- blocks: the BlockMask's sizes (``kv_block_size=SPARSE_KV_BLOCK_SIZE``, flex_cpu.py line 335;
  ``create_block_mask`` defaults to 128, a call without a BlockMask gets 1 << 30), capped at the
  sequence lengths (template lines 264-265). For each q block the kernel visits the kv blocks of
  ``kv_indices`` (partial blocks, ascending) and then those of ``full_kv_indices`` (line 468);
  empty blocks are skipped. A block is full when every entry of its padded Q_BLOCK x KV_BLOCK tile
  is unmasked (``_convert_mask_to_block_mask`` pads with False, so ragged tiles are never full);
- S = q @ k^T by the template's micro-GEMM in fp32, times the scale in fp32 (line 517), score_mod
  and (on partial blocks) mask_mod by inductor-generated C++ in fp32 (``score_dtype = torch.float``,
  flex_cpu.py line 124): these logits differ from eager's at the fp32 rounding level (another
  summation order), which ``flex_score_err`` bounds;
- per row and block: running max m (exact); ``e = exp(s - m)`` with the subtraction in fp32, then
  ``Vectorized<float>::exp_u20`` (a degree-5 polynomial with FMAs, 0 below about -87,
  ``ATen/cpu/vec/vec256/vec256_float.h``) on whole vectors of W = 8 (AVX2) or 16 (AVX512) keys
  and, on the block's last ``L % W`` keys, the C library's *double* ``exp`` (``exp(tmp1)`` at
  template line 53 resolves to ``::exp(double)`` with the headers the kernel is built with);
- P: fp32 e kept in fp32 for fp32; for bf16/fp16 e is rounded to the dtype once (``_store``,
  line 43; the tail's double value through float, then the dtype);
- the block's sum: W lane sums in fp32 over the vectors in order, the lanes added by
  ``vec_reduce_all`` as a halving tree (i + W/2, then i + W/4, ...), then the tail added one by
  one as ``float = float + double``; ``alpha = std::exp(m_old - m_new)`` (float ``expf``, line 582);
  ``l = t + alpha * l`` in fp32, two roundings (``-ffp-contract=off``, line 584);
- O accumulator in fp32: ``acc *= alpha`` (line 590, from the second visited block on), then
  ``acc += P @ V`` (lines 605-640): fp32 and bf16 by ``cpublas::brgemm``, which on AVX2 forms, per
  output, one chain of fp32 FMAs over the block's keys in order from 0 and adds it to acc
  (beta = 1); fp16 by the template's micro-GEMM (``CppMicroGemmFP32Vec``, ``_inductor/codegen/
  cpp_micro_gemm.py``), which loads acc and continues the chain from it (the first block from 0).
  brgemm's order is not in the Python sources: it was identified by the emulation agreeing with the
  kernel on every bit where the logits are exact (tests/numerics/methods/test_flex.py);
- out = ``acc * (1 / l)`` in fp32 (l == 0 -> 1), rounded once to the dtype (lines 671-673); a row
  with no key (no block to visit, or all its keys masked) gives 0, like eager;
- the CPU template writes no lse: ``return_lse`` raises NotImplementedError under torch.compile on
  CPU (flex_cpu.py line 100). ``flex_compiled`` returns m + log(l) of its running statistics.

The template is not used for decoding (``FLEX_DECODING_TEMPLATE``: Tq == 1 and Tk / B >= 512);
that path is not emulated here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ETA_U20, NEG_INF, flex_eager, flex_post_mod_scores, flex_score_err, fma32 and ulp are re-exported (noqa): the
# flex paths and tests import them from here
from attncheck.numerics.methods.flex_bounds import _bound, flex_score_err  # noqa: F401
from attncheck.numerics.methods.flex_eager import _kv_for_heads, flex_eager, flex_post_mod_scores  # noqa: F401
from attncheck.numerics.methods.flex_libm import (
    _MANT,
    _TINY,
    ETA_TAIL,
    ETA_U20,
    NEG_INF,
    U32,
    _rounds_same,
    exp_u20,
    expf,
    fma32,
    ulp,
    vec_width,
)

TORCH_VERSION = "2.13"


# ----------------------------------------------------------------------------- compiled (C++ template)


@dataclass
class CompiledTrace:
    """The emulated kernel's results, in the row layout of the input (B, Hq, Tq, ...)."""

    out: torch.Tensor  # (B, Hq, Tq, Ev) in the dtype
    lse: torch.Tensor  # (B, Hq, Tq) fp32, natural log; -inf on rows with no key
    y: torch.Tensor  # (B, Hq, Tq, Ev) fp32: acc * (1/l) before the cast to the dtype
    probs: torch.Tensor  # (B, Hq, Tq, Tk) fp32: the effective weights P_i prod(alpha) / l
    bound: torch.Tensor | None  # (B, Hq, Tq, Ev) float64 when asked for


def _tile_order(finite: torch.Tensor, qb: int, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Visiting order of the kv tiles per (b, h, q tile) as the kernel takes them from a BlockMask
    made by ``create_block_mask``: partial tiles ascending, then full tiles ascending, empty tiles
    never (``_convert_mask_to_block_mask`` pads with False; ``_dense_to_ordered`` orders by a stable
    descending argsort). Returns (order (B, H, nq, nk) int64, visited count (B, H, nq))."""
    b, h, tq, tk = finite.shape
    nq, nk = -(-tq // qb), -(-tk // kb)
    f = torch.nn.functional.pad(finite.to(torch.int32), (0, nk * kb - tk, 0, nq * qb - tq))
    counts = f.view(b, h, nq, qb, nk, kb).sum(dim=(3, 5))
    full = counts == qb * kb
    partial = (counts > 0) & ~full
    t = torch.arange(nk, device=finite.device)
    key = torch.where(partial, t, torch.where(full, nk + t, 2 * nk + t))
    return key.argsort(dim=-1), (partial | full).sum(dim=-1)


def _pv(
    acc: torch.Tensor, p: torch.Tensor, vb: torch.Tensor, n: int, first: bool, onto_acc: bool, exact_product: bool
) -> torch.Tensor:
    """acc (.., rows, Ev) fp32 plus P (.., rows, keys) @ V (.., keys, Ev): per output one chain of
    fp32 FMAs over the block's keys in order. fp32, bf16: ``cpublas::brgemm`` forms the chain from 0
    and adds it to acc (beta = 1) once; fp16: the template's micro-GEMM (``CppMicroGemmFP32Vec``,
    ``accum``) loads acc and goes on from it. Both as they run on AVX2, where the kernel's outputs
    agree with these bit for bit on logits every order gives exactly (tests/numerics/methods/test_flex.py)."""
    c = acc if (onto_acc and not first) else torch.zeros_like(acc)
    for kk in range(n):  # the keys of the block in order, each an FMA on every row and column
        pk, vk = p[..., kk : kk + 1], vb[..., kk, :].unsqueeze(-2)
        c = c + pk * vk if exact_product else fma32(pk, vk, c)  # bf16/fp16 products are exact in fp32
    return c if (first or onto_acc) else acc + c


def _compiled(
    scores_fp32: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    enable_gqa: bool,
    block: int | None,
    q_block: int | None,
    width: int | None,
    score_err: torch.Tensor | float | None,
) -> CompiledTrace:
    """The template's forward on fp32 logits (see the module docstring), vectorised over rows; the
    Python loops run over the kv blocks a q block visits and, inside a block, over the kernel's
    sequential steps (its vectors of W keys, its tail keys), each step on every row at once."""
    s = scores_fp32
    if s.dtype != torch.float32:
        raise TypeError(f"the compiled kernel's logits are float32, got {s.dtype}")
    if dtype not in _MANT:
        raise TypeError(f"compiled flex on CPU takes float32, bfloat16 and float16, got {dtype}")
    B, H, Tq, Tk = s.shape
    dev = s.device
    W = vec_width(width)
    vv = _kv_for_heads(v, H, B, enable_gqa).to(dtype)  # the kernel reads V in the dtype
    Ev = vv.size(-1)

    if block is None:  # no BlockMask: one block of every key, every row in one q block
        QB, KB = Tq, Tk
    else:
        KB = int(block)
        QB = int(q_block) if q_block is not None else KB
    qbs, kbs = min(QB, Tq), min(KB, Tk)  # qSplitSize, kvSplitSize (template lines 264-265)
    finite = s > NEG_INF
    if block is None:
        order = torch.zeros(B, H, 1, 1, dtype=torch.int64, device=dev)
        nvis = torch.ones(B, H, 1, dtype=torch.int64, device=dev)
    else:
        order, nvis = _tile_order(finite, QB, KB)
    nq, nslots = order.shape[-2], order.shape[-1]

    # rows in q tiles: (B, H, nq, qbs, ...); rows past Tq are all -inf and change nothing
    pad_rows = nq * qbs - Tq
    st = torch.nn.functional.pad(s, (0, 0, 0, pad_rows), value=NEG_INF).view(B, H, nq, qbs, Tk)
    kbp = -(-kbs // W) * W  # the block padded to whole vectors
    ar = torch.arange(kbp, device=dev)
    v_all = vv.unsqueeze(2).expand(B, H, nq, Tk, Ev)
    rowshape = (B, H, nq, qbs)

    want_bound = score_err is not None
    terms = None  # the bound's running terms, where it is asked
    if want_bound:
        terms = _bound_start(score_err, finite, pad_rows, rowshape, Ev, B, H, Tq, Tk, nq, qbs, dev)
    tiles = (B, H, Tq, Tk, nq, qbs, kbs, kbp, W, Ev, rowshape, dev)
    m, l, acc, J, kept, terms = _kv_blocks(order, nvis, nslots, st, v_all, ar, tiles, dtype, want_bound, terms)
    return _finish(m, l, acc, J, kept, nvis, dtype, tiles, want_bound, terms)


def _bound_start(score_err, finite, pad_rows, rowshape, Ev, B, H, Tq, Tk, nq, qbs, dev):
    """The bound's per-key sigmas in q tiles, each row's largest (how far its max may move), and its
    running terms at zero: (sig_t, dm, pert, MN, DN, ML, n_alpha, m_first)."""
    sig = torch.as_tensor(score_err, dtype=torch.float64, device=dev).expand(B, H, Tq, Tk)
    sig = torch.where(finite, sig, 0.0)
    sig_t = torch.nn.functional.pad(sig, (0, 0, 0, pad_rows)).view(B, H, nq, qbs, Tk)
    dm = sig_t.amax(dim=-1)  # |m' - m| <= the largest sigma of the row
    pert = dm > 0
    MN = torch.zeros(*rowshape, Ev, dtype=torch.float64, device=dev)  # sum P A |v|
    DN = torch.zeros_like(MN)  # sum |P' - P| A |v|
    ML = torch.zeros(rowshape, dtype=torch.float64, device=dev)  # sum e A
    n_alpha = torch.zeros_like(ML)  # alphas other than 0 and 1
    m_first = torch.full_like(ML, math.nan)  # the running max at the first block with a key
    return sig_t, dm, pert, MN, DN, ML, n_alpha, m_first


def _kv_blocks(order, nvis, nslots, st, v_all, ar, tiles, dtype, want_bound, terms):
    """The template's main loop over the kv blocks each q block visits, in its order: the running max
    m, sum l and fp32 accumulator acc (and the bound's terms), with what each block kept for the
    effective probabilities."""
    B, H, Tq, Tk, nq, qbs, kbs, kbp, W, Ev, rowshape, dev = tiles
    m = torch.full(rowshape, NEG_INF, dtype=torch.float32, device=dev)
    l = torch.zeros(rowshape, dtype=torch.float32, device=dev)
    acc = torch.zeros(*rowshape, Ev, dtype=torch.float32, device=dev)
    J = torch.zeros(rowshape, dtype=torch.float64, device=dev)  # blocks visited with a key
    kept = []  # per block: P in fp32, its columns, where it is a key, its alpha
    for j in range(nslots):  # the kv blocks, in the order each q block visits them
        t = order[..., j]  # (B, H, nq)
        vis = j < nvis
        start = t * kbs
        L = (Tk - start).clamp(max=kbs)  # cur_kvSplitSize
        valid = (ar < L.unsqueeze(-1)) & vis.unsqueeze(-1)  # (B, H, nq, kbp)
        colc = (start.unsqueeze(-1) + ar).clamp(max=Tk - 1)
        idx = colc.unsqueeze(-2).expand(*rowshape, kbp)
        sb = torch.where(valid.unsqueeze(-2), torch.gather(st, -1, idx), NEG_INF)
        nvec = (L // W) * W
        isvec = (ar < nvec.unsqueeze(-1)).unsqueeze(-2)  # keys on exp_u20's vectors
        istail = ((ar >= nvec.unsqueeze(-1)) & valid).unsqueeze(-2)  # keys on the double exp

        tmax = torch.maximum(m, sb.amax(dim=-1))
        live = (tmax > NEG_INF) & vis.unsqueeze(-1)  # the kernel's tmp_max != -inf branch
        mg = torch.where(live, tmax, 0.0)
        a = sb - mg.unsqueeze(-1)  # fp32
        keep = valid.unsqueeze(-2) & live.unsqueeze(-1)
        e_tail = torch.where(keep & istail, torch.exp(a.double()), 0.0)  # the double tmp2
        e32 = torch.where(keep, torch.where(isvec, exp_u20(a), e_tail.float()), 0.0)
        p = e32 if dtype == torch.float32 else e32.to(dtype)

        # the block's sum: W lane sums in fp32, the halving tree, then the tail as float + double
        tsum = _block_sum(e32, e_tail, isvec, nvec, L, rowshape, kbp, W, B, H, nq)
        alpha = expf(m - mg)  # 0 at the first block with a key (m = -inf)
        l = torch.where(live, tsum + alpha * l, l)
        if j > 0:
            acc = torch.where(live.unsqueeze(-1), acc * alpha.unsqueeze(-1), acc)
        vb = torch.gather(v_all, 3, colc.unsqueeze(-1).expand(B, H, nq, kbp, Ev))
        vb = torch.where(valid.unsqueeze(-1), vb, 0).float()
        acc = _pv(acc, p.float(), vb, int(L.max()), j == 0, dtype == torch.float16, dtype != torch.float32)
        vb = vb.double()
        al = torch.where(live, alpha, 1.0)
        kept.append([p.float(), colc, keep, al])

        if want_bound:
            terms = _bound_block(
                terms, kept, dtype, keep, sb, idx, a, isvec, e32, e_tail, istail, al, vb, p, live, alpha, tmax
            )

        J = J + live.double()
        m = torch.where(live, tmax, m)
    return m, l, acc, J, kept, terms


def _block_sum(e32, e_tail, isvec, nvec, L, rowshape, kbp, W, B, H, nq):
    """One block's sum: W lane sums in fp32, the halving tree, then the tail as float + double."""
    lanes = torch.where(isvec, e32, 0.0).view(*rowshape, kbp // W, W)
    tsum = lanes[..., 0, :]
    for c in range(1, kbp // W):
        tsum = tsum + lanes[..., c, :]
    while tsum.shape[-1] > 1:
        half = tsum.shape[-1] // 2
        tsum = tsum[..., :half] + tsum[..., half:]
    tsum = tsum[..., 0]
    tail_at = nvec.view(B, H, nq, 1, 1).expand(*rowshape, 1)
    for i in range(W - 1):
        ti = torch.gather(e_tail, -1, (tail_at + i).clamp(max=kbp - 1)).squeeze(-1)
        ti = torch.where((nvec + i < L).unsqueeze(-1), ti, 0.0)
        tsum = (tsum.double() + ti).float()
    return tsum


def _bound_block(terms, kept, dtype, keep, sb, idx, a, isvec, e32, e_tail, istail, al, vb, p, live, alpha, tmax):
    """One block's part of the bound: how far each key's e may move and whether P's rounding moves
    with it, added to the running terms; the key's terms appended to what the block kept."""
    sig_t, dm, pert, MN, DN, ML, n_alpha, m_first = terms
    key = keep & (sb > NEG_INF)  # the block's unmasked keys
    pr = pert.unsqueeze(-1) & key
    sg = torch.gather(sig_t, -1, idx)
    # |a' - a|: the key's sigma, the max's move, the two subtractions' roundings
    da = torch.where(pr, sg + dm.unsqueeze(-1) + 2 * U32 * a.double().abs(), 0.0)
    eta = torch.where(isvec, ETA_U20, ETA_TAIL)
    e_ref = torch.where(isvec, e32.double(), e_tail)  # the value summed into l
    de_pert = e_ref / (1 - eta) * (torch.expm1(da) + eta * (1 + torch.exp(da))) + _TINY
    de_same = torch.where(istail, 2.0**-51 * e_ref, 0.0)  # glibc's double exp vs torch's
    de = torch.where(pr, de_pert, torch.where(key, de_same, 0.0))
    # P' = P where rounding to P's format is constant on [e - de, e + de]
    stable = _rounds_same(e_ref - de, e_ref + de, dtype)
    if dtype == torch.float32:
        jump = torch.where(isvec, 0.0, ulp(e_ref + de, dtype))
    else:
        jump = ulp(e_ref + de, dtype) + ulp(e_ref + de, torch.float32)
    dp = torch.where(key & ~stable, de + jump, 0.0)
    al64 = al.double()
    vab = vb.abs()
    MN = MN * al64.unsqueeze(-1) + p.double() @ vab
    DN = DN * al64.unsqueeze(-1) + dp @ vab
    ML = ML * al64 + e_ref.sum(dim=-1)
    n_alpha = n_alpha + (live & (alpha != 0) & (alpha != 1)).double()
    m_first = torch.where(live & torch.isnan(m_first), tmax.double(), m_first)
    # |ln(e' A') - ln(e A)| up to the row's common factor exp(m_final - m'_final): the
    # key's sigma, the roundings of s - m and of exp on both sides (the alphas: in _bound)
    rho_key = torch.where(
        pr,
        sg * (1 + U32) + 2 * U32 * a.double().abs() + U32 * dm.unsqueeze(-1) + 2 * eta,
        torch.where(istail, 2.0**-50, 0.0),
    )
    kept[-1] += [key, e_ref, torch.where(key, rho_key, 0.0), vb]
    return sig_t, dm, pert, MN, DN, ML, n_alpha, m_first


def _finish(m, l, acc, J, kept, nvis, dtype, tiles, want_bound, terms):
    """The template's finalize (y = acc / l, skipped rows 0, the cast, lse), the effective
    probabilities, the bound; rows back out of their q tiles."""
    B, H, Tq, Tk, nq, qbs, kbs, kbp, W, Ev, rowshape, dev = tiles
    if want_bound:
        sig_t, dm, pert, MN, DN, ML, n_alpha, m_first = terms
    skip = (nvis == 0).view(B, H, nq, 1, 1)  # no block to visit: is_skip_kv
    lz = torch.where(l == 0, 1.0, l)
    r = 1.0 / lz
    y = torch.where(skip, 0.0, acc * r.unsqueeze(-1))
    out = y.to(dtype)
    lse = torch.where(m == NEG_INF, NEG_INF, m + torch.log(lz))

    # effective weights P_i * (the alphas of the blocks after its own) / l, in fp32
    probs = torch.zeros(*rowshape, Tk, dtype=torch.float64, device=dev)
    decay = torch.ones(rowshape, dtype=torch.float64, device=dev)
    for p32, colc, keep, al, *_ in reversed(kept):
        w = torch.where(keep, p32.double() * decay.unsqueeze(-1), 0.0)
        probs.scatter_add_(-1, colc.unsqueeze(-2).expand_as(w), w)
        decay = decay * al.double()
    probs = (probs * torch.where(l == 0, 0.0, r.double()).unsqueeze(-1)).float()

    bound = None
    if want_bound:
        bound = _bound(MN, DN, ML, J, n_alpha, m_first, m, dm, pert, acc, l, y, dtype, W, kbp, Tk, kept)
        bound = torch.where(skip | (m == NEG_INF).view(*rowshape, 1), 0.0, bound)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, H, nq * qbs, *x.shape[4:])[:, :, :Tq]

    return CompiledTrace(rows(out), rows(lse), rows(y), rows(probs), None if bound is None else rows(bound))


def flex_compiled(
    scores_fp32: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    enable_gqa: bool = False,
    block: int | None = None,
    q_block: int | None = None,
    vec: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``torch.compile(flex_attention)`` on CPU from the fp32 post-mod logits, with the
    rounding points of torch 2.13's C++ template (``_inductor/codegen/cpp_flex_attention_template.py``,
    ``FLEX_ATTENTION_TEMPLATE`` and ``SOFTMAX_FUSIONS``; listed in the module docstring).

    ``scores_fp32`` (B, Hq, Tq, Tk) float32 with -inf where masked; v (B, Hkv, Tk, Ev); ``dtype`` the
    inputs' dtype (fp32, bf16, fp16). ``block``: the BlockMask's KV_BLOCK_SIZE (128 for
    ``create_block_mask``'s default), None for a call without a BlockMask (one block of every key);
    ``q_block``: its Q_BLOCK_SIZE (default ``block``); they set the kernel's blocks and, through the
    -inf pattern of the logits, which blocks are partial, full or skipped and so the order the
    kernel visits them in. ``vec``: floats per vector of the kernel (default: 16 with AVX512, else 8).

    exp_u20, the lane sums, the halving tree, the tail's double exp, alpha, l, the P @ V chains and
    the final ``acc * (1/l)`` follow the kernel bit for bit (on logits every summation order gives
    exactly, out equals torch's compiled output on every bit on an AVX2 CPU, in fp32, bf16 and fp16);
    on recorded logits out differs from the kernel's by what the kernel's own logits (another
    q @ k^T order, another score_mod implementation) move, which ``flex_bound`` bounds. Rows with no
    key give 0 (the kernel's ``is_skip_kv`` and l = 0 cases), lse is -inf there. The kernel itself
    returns no lse on CPU (flex_cpu.py line 100): lse here is m + log(l) of the emulated running
    statistics, in fp32. Vectorised over rows; Python loops run over the kv blocks and, inside a
    block, over the kernel's own sequential steps (its vectors of W keys, its tail keys, its FMA
    chain over the keys), each step on all rows at once.
    """
    tr = _compiled(scores_fp32, v, dtype, enable_gqa, block, q_block, vec, None)
    return tr.out, tr.lse


def flex_bound(
    scores_fp32: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    score_err: torch.Tensor | float = 0.0,
    enable_gqa: bool = False,
    block: int | None = None,
    q_block: int | None = None,
    vec: int | None = None,
) -> torch.Tensor:
    """Per element (B, Hq, Tq, Ev) float64 bound on |``flex_compiled``'s out - torch 2.13's compiled
    CPU kernel's out| when the kernel's own logits are within ``score_err`` (a tensor broadcastable
    to the logits, or a number; ``flex_score_err`` gives it from q and k) of ``scores_fp32``.

    It follows the rounding points of ``flex_compiled`` and is stated from them, a posteriori (from
    the emulation's own values), with sigma the score error and Delta m its row maximum (how far the
    kernel's running max can move):

    - e = exp(s - m): |e' - e| <= e/(1-eta) (expm1(da) + eta (1 + exp(da))), da = sigma + Delta m +
      2u|s - m| (the subtraction on both sides), eta = exp_u20's error (8 * 2^-24 from a measurement
      of 9.2e7 inputs, largest seen 6.43 * 2^-24) or the double exp's rounding to float (tail keys);
      rows with sigma = 0 give identical e (the emulation is bit-exact), except one double ulp on
      tail keys (glibc's exp against torch's);
    - P: where rounding to P's format is constant on [e - de, e + de], P' = P exactly; elsewhere
      |P' - P| <= de + ulp_dtype (+ ulp_fp32 for the double rounding of bf16/fp16);
    - A_j, the product of the alphas after block j (the running rescale), against the factor
      c = exp(m_final - m'_final) common to a row (it cancels in acc / l): |ln(A'_j / c) - ln A_j|
      <= lambda = Delta m + 2u (m_final - m_first + 2 Delta m) + 2 J eta_expf (J blocks, the
      subtractions m_old - m_new and expf within 2^-23, both sides);
    - |acc'/c - acc| <= e^lambda sum |P' - P| A |v| + expm1(lambda) sum P A |v| + the roundings of
      both accumulations, gamma_{Tk+2J+2} sum P A |v| each (the kernel's in any order: the P @ V
      order is not assumed here);
      |l'/c - l| <= sum e A expm1(rho) + gamma_n (2 sum e A + ...), rho = sigma + 2u|s - m| +
      2 eta + lambda's alpha part (no Delta m), n the steps of l's (emulated) summation;
    - y = acc * fl(1/l): |y' - y| <= delta = (|acc'/c - acc| + |y||l'/c - l|) / (l - |l'/c - l|)
      plus the two roundings of 1/l and of the product on each side (2u |y|). For fp32, where P is
      e itself, acc and l move by the same factors (1 + rho_i) and delta is also at most
      (sum e A |rho| |v - y| + the roundings) / (l - ...): the smaller of the two is taken;
    - out: fp32 out = y, so the bound is delta. For bf16/fp16: 0 where rounding to the dtype is
      constant on [y - delta, y + delta] (the two outputs are then the same number), else delta +
      one ulp of the dtype at |y| + delta: the output's unit roundoff twice (one per side) on top of
      delta.

    delta holds fp32 terms and, for bf16/fp16, the P keys whose rounding may go the other way (each
    an ulp of P's dtype times A |v| / l: more than an output ulp where such a P is large). The fp32
    terms are worst case (gamma_n for sums, the dot products of ``flex_score_err``), so for fp32 the
    bound is two to three orders of magnitude above the differences seen (both sides' roundings are
    random walks, the bound adds them up); for bf16 it is 0 on most elements and about an output ulp on the rest, for
    fp16 (whose ulp is 8 times finer) 0 on a third to two thirds and one to a few ulps on the rest.
    Rows with no key: 0 (both give 0). Arguments as in ``flex_compiled``.
    """
    return _compiled(scores_fp32, v, dtype, enable_gqa, block, q_block, vec, score_err).bound


def flex_compiled_trace(
    scores_fp32: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    enable_gqa: bool = False,
    block: int | None = None,
    q_block: int | None = None,
    vec: int | None = None,
    score_err: torch.Tensor | float | None = None,
) -> CompiledTrace:
    """``flex_compiled`` with its intermediate values: the fp32 y before the cast, the effective
    probabilities P_i prod(alpha)/l (B, Hq, Tq, Tk) fp32, and ``flex_bound`` when ``score_err`` is
    given."""
    return _compiled(scores_fp32, v, dtype, enable_gqa, block, q_block, vec, score_err)


def flex_kernel_rows(
    s: torch.Tensor, v: torch.Tensor | None, dt: torch.dtype, block: int | None = None, vec: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows (r, Tk) of fp32 logits of n heads (r = n * rows) through ``flex_compiled`` without a
    BlockMask (each row one block of every key; with a BlockMask the visiting order depends on where
    the rows sit in their q block, which rows alone do not say): (effective probabilities (r, Tk)
    fp32, O (r, Ev) in ``dt``, None without v (n, Tk, Ev))."""
    r, tk = s.shape
    n = 1 if v is None else v.shape[0]
    s4 = s.float().reshape(1, n, r // n, tk)
    v4 = (torch.zeros(1, n, tk, 1, dtype=dt) if v is None else v).reshape(1, n, tk, -1)
    tr = _compiled(s4, v4, dt, False, block, None, vec, None)
    out = None if v is None else tr.out.reshape(r, -1)
    return tr.probs.reshape(r, tk), out
