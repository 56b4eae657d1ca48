"""``attncheck.numerics.methods.flex`` against torch 2.13's own FlexAttention on CPU.

Eager flex (no torch.compile) from the logits ``flex_post_mod_scores`` gives: output and lse equal
to torch's on every bit, in fp32, bf16 and fp16, with and without GQA, for no mask, a causal and a
sliding-window BlockMask, an ALiBi and a tanh soft-cap score_mod, and a mask that leaves rows
without any key (torch gives 0 and lse -inf there; so does the emulation). The float64 logits are
checked against a float64 computation written out here.

The compiled kernel (slow): every element of ``flex_compiled`` within ``flex_bound`` of torch's
compiled output, the bound shown to be no wider than the differences it has to tell apart (below
the eager-vs-compiled difference for bf16, within a few times it for fp16, and, for fp32, a
worst-case bound far below the output's scale), and, on logits that every summation order gives
exactly, the emulation equal to the kernel on every bit (AVX2 CPUs, where the kernel's P @ V order
is the one emulated).
"""

import functools
import math
import zlib

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from attncheck.numerics.methods.flex import (
    ETA_U20,
    NEG_INF,
    _tile_order,
    exp_u20,
    flex_bound,
    flex_compiled,
    flex_compiled_trace,
    flex_eager,
    flex_kernel_rows,
    flex_post_mod_scores,
    flex_score_err,
    fma32,
    ulp,
)

EAGER_WARNING = "ignore:flex_attention called without torch.compile:UserWarning"
# inductor's CPU lowering imports torch.utils.mkldnn, whose module body uses torch.jit.script_method
JIT_WARNING = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
pytestmark = pytest.mark.filterwarnings(EAGER_WARNING)

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
B, HQ, E = 2, 4, 64
SLOPES = torch.tensor([2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4])  # ALiBi, one per query head
LATE = 130  # rows before it attend to no key


def causal(b, h, qi, ki):
    return qi >= ki


def window(b, h, qi, ki):
    return (qi - ki).abs() < 16


def late_start(b, h, qi, ki):
    return (qi >= LATE) & (ki <= qi)


def early_rows_empty(b, h, qi, ki):  # rows 0..9 without a key, for short sequences
    return (qi >= 10) & (ki <= qi)


def alibi(score, b, h, qi, ki):
    return score + SLOPES[h] * (ki - qi)


def softcap(score, b, h, qi, ki):
    return 50 * torch.tanh(score / 50)


MOD_ULPS = {None: 0.0, alibi: 1.0, softcap: 8.0}  # flex_score_err's mod_ulps for each score_mod


def dense(mask_mod, tq, tk):
    """The mask a mask_mod gives, (1, 1, Tq, Tk) (none of these depends on b or h)."""
    if mask_mod is None:
        return None
    i = torch.arange(tq).view(1, 1, tq, 1)
    j = torch.arange(tk).view(1, 1, 1, tk)
    z = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    return mask_mod(z, z, i, j).expand(1, 1, tq, tk)


def inputs(dt, t, hkv, seed, dyadic=False):
    g = torch.Generator().manual_seed(seed)
    if dyadic:  # q, k multiples of 1/16 in [-1, 1]: every order of every sum gives the logits exactly
        q = torch.randint(-16, 17, (B, HQ, t, E), generator=g) / 16
        k = torch.randint(-16, 17, (B, hkv, t, E), generator=g) / 16
    else:
        q = torch.randn(B, HQ, t, E, generator=g)
        k = torch.randn(B, hkv, t, E, generator=g)
    v = torch.randn(B, hkv, t, E, generator=g)
    return q.to(dt), k.to(dt), v.to(dt)


@functools.lru_cache(maxsize=None)
def block_mask(mask_mod, t):
    return None if mask_mod is None else create_block_mask(mask_mod, None, None, t, t, device="cpu")


def reference(q, k, v, score_mod, mask_mod):
    """The float64 output, written out: logits from float64 q, k, softmax, P @ V; rows without a key 0."""
    q64, v64 = q.double(), v.double()
    g = q.size(1) // k.size(1)
    k64 = k.double().repeat_interleave(g, dim=1)
    v64 = v64.repeat_interleave(g, dim=1)
    s = (q64 @ k64.transpose(-2, -1)) / math.sqrt(q.size(-1))
    t = q.size(-2)
    if score_mod is alibi:
        s = s + SLOPES.double().view(1, -1, 1, 1) * (
            torch.arange(t).view(1, 1, 1, t) - torch.arange(t).view(1, 1, t, 1)
        )
    elif score_mod is softcap:
        s = 50 * torch.tanh(s / 50)
    if mask_mod is not None:
        s = s.masked_fill(~dense(mask_mod, t, t), NEG_INF)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return s, p @ v64


# ----------------------------------------------------------------------------- eager, bit-exact

EAGER_CASES = {  # name: (mask_mod, score_mod, Hkv, T)
    "plain": (None, None, 4, 64),
    "causal-gqa": (causal, None, 2, 200),
    "window": (window, None, 4, 256),
    "alibi-gqa": (causal, alibi, 2, 100),
    "softcap": (None, softcap, 4, 130),
    "rows-without-key-gqa": (early_rows_empty, softcap, 2, 100),
}


@pytest.mark.parametrize("dt", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(EAGER_CASES))
def test_eager_bit_exact(name, dt):
    mask_mod, score_mod, hkv, t = EAGER_CASES[name]
    q, k, v = inputs(dt, t, hkv, seed=zlib.crc32(name.encode()) % 1000)
    gqa = hkv != HQ
    out, aux = flex_attention(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask(mask_mod, t),
        enable_gqa=gqa,
        return_aux=AuxRequest(lse=True),
    )
    s = flex_post_mod_scores(q, k, None, score_mod, dense(mask_mod, t, t), enable_gqa=gqa)
    assert s.dtype == FP32
    o, lse = flex_eager(s, v, dt, enable_gqa=gqa)
    assert o.dtype == dt and torch.equal(o, out)
    assert torch.equal(lse, aux.lse)
    empty = torch.all(s == NEG_INF, dim=-1)
    if name.startswith("rows-without-key"):
        assert empty[:, :, :10].all() and not empty[:, :, 10:].any()
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # torch gives 0 there
        assert torch.isneginf(aux.lse[empty]).all()
    else:
        assert not empty.any()


def test_eager_float64_inputs_bit_exact():
    q, k, v = inputs(torch.float64, 100, 2, seed=3)
    out, aux = flex_attention(
        q, k, v, score_mod=alibi, block_mask=block_mask(causal, 100), enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    s = flex_post_mod_scores(q, k, None, alibi, dense(causal, 100, 100), enable_gqa=True)
    assert s.dtype == torch.float64
    o, lse = flex_eager(s, v, torch.float64, enable_gqa=True)
    assert torch.equal(o, out) and torch.equal(lse, aux.lse)


@pytest.mark.parametrize(
    "score_mod,mask_mod",
    [(None, None), (alibi, window), (softcap, early_rows_empty)],
    ids=["plain", "alibi-window", "softcap-rows-without-key"],
)
def test_float64_reference(score_mod, mask_mod):
    t = 100
    q, k, v = inputs(BF16, t, 2, seed=5)
    s64 = flex_post_mod_scores(
        q.double(), k.double(), None, score_mod, dense(mask_mod, t, t), enable_gqa=True, working=torch.float64
    )
    s_ref, o_ref = reference(q, k, v, score_mod, mask_mod)
    assert s64.dtype == torch.float64
    assert torch.equal(s64 == NEG_INF, s_ref == NEG_INF)
    fin = s_ref.isfinite()
    assert torch.allclose(s64[fin], s_ref[fin], rtol=1e-13, atol=1e-13)
    o64, lse64 = flex_eager(s64, v.double(), torch.float64, enable_gqa=True)
    assert torch.allclose(o64, o_ref, rtol=1e-12, atol=1e-13)
    assert torch.allclose(lse64, torch.logsumexp(s_ref, dim=-1), rtol=1e-13, atol=1e-13)
    # working=float64 on float32 q, k: the same logits (q, k upcast first)
    s64b = flex_post_mod_scores(
        q.float(), k.float(), None, score_mod, dense(mask_mod, t, t), enable_gqa=True, working=torch.float64
    )
    assert torch.equal(s64b, s64)


def test_gqa_needs_enable_gqa():
    q, k, v = inputs(FP32, 64, 2, seed=1)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_post_mod_scores(q, k, None)
    s = flex_post_mod_scores(q, k, None, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_eager(s, v, FP32)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_compiled(s, v, FP32)


# ----------------------------------------------------------------------------- the kernel's pieces


def test_fma32_rounds_once():
    from fractions import Fraction

    g = torch.Generator().manual_seed(0)
    a = torch.randn(400, generator=g)
    b = torch.randn(400, generator=g)
    c = -(a.double() * b.double()).float() * (1 + torch.randn(400, generator=g) * 1e-6)  # cancellations
    c[:100] = torch.randn(100, generator=g)
    got = fma32(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        lo = torch.tensor(float(exact), dtype=torch.float64).float()  # candidates around the exact value
        cand = [torch.nextafter(lo, torch.tensor(d)).item() for d in (-math.inf, math.inf)] + [lo.item()]
        best = min(abs(Fraction(w) - exact) for w in cand)
        assert abs(Fraction(r) - exact) == best  # the nearest float32 (ties to even checked below)
    # a tie: 1 + 2^-24 is halfway between 1 and 1 + 2^-23, plus a tiny product decides it
    one = torch.tensor([1.0])
    assert fma32(torch.tensor([2.0**-24]), torch.tensor([1.0 + 2.0**-23]), one).item() == 1.0 + 2.0**-23
    assert fma32(torch.tensor([2.0**-24]), one, one).item() == 1.0


def test_exp_u20_accuracy():
    x = -torch.linspace(0, 86, 200001).float()
    e = exp_u20(x)
    ref = torch.exp(x.double())
    assert ((e.double() - ref).abs() / ref).max() <= ETA_U20
    assert exp_u20(torch.tensor([0.0])).item() == 1.0
    assert exp_u20(torch.tensor([-88.0, -1000.0, NEG_INF])).eq(0).all()


def test_ulp():
    x = torch.tensor([1.0, 1.5, 2.0, 0.0, 1e-30])
    assert ulp(x, FP32).tolist()[:3] == [2.0**-23, 2.0**-23, 2.0**-22]
    assert ulp(x, BF16).tolist()[:3] == [2.0**-7, 2.0**-7, 2.0**-6]
    assert ulp(x, FP16)[3].item() == 2.0**-24 and ulp(x, FP32)[3].item() == 2.0**-149


@pytest.mark.parametrize("mask_mod", [causal, window, late_start], ids=["causal", "window", "late-start"])
@pytest.mark.parametrize("t", [100, 300])
def test_tile_order_is_the_block_masks(mask_mod, t):
    """The kv blocks each q block visits, in order: those of torch's BlockMask, kv_indices (partial
    blocks) then full_kv_indices (ragged tiles are never full; tiles without a key are skipped)."""
    bm = create_block_mask(mask_mod, None, None, t, t, device="cpu")
    order, nvis = _tile_order(dense(mask_mod, t, t), 128, 128)
    for qt in range(order.shape[-2]):
        npart, nfull = int(bm.kv_num_blocks[0, 0, qt]), int(bm.full_kv_num_blocks[0, 0, qt])
        want = bm.kv_indices[0, 0, qt, :npart].tolist() + bm.full_kv_indices[0, 0, qt, :nfull].tolist()
        assert order[0, 0, qt, : int(nvis[0, 0, qt])].tolist() == want


@pytest.mark.parametrize("dt", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_compiled_rows_without_key(dt):
    t = 200
    q, k, v = (x[:1] for x in inputs(dt, t, 2, seed=7))  # one batch: q tile 0 skipped, rows 128..129 l = 0
    s = flex_post_mod_scores(q, k, None, softcap, dense(late_start, t, t), enable_gqa=True)
    tr = flex_compiled_trace(
        s, v, dt, enable_gqa=True, block=128, score_err=flex_score_err(q, k, None, s, enable_gqa=True, mod_ulps=8)
    )
    empty = torch.all(s == NEG_INF, dim=-1)
    assert empty[:, :, :LATE].all() and not empty[:, :, LATE:].any()
    assert torch.equal(tr.out[empty], torch.zeros_like(tr.out[empty]))  # skipped tile and l = 0 rows alike
    assert torch.isneginf(tr.lse[empty]).all() and tr.lse[~empty].isfinite().all()
    assert tr.bound[empty].eq(0).all()
    p = tr.probs[~empty].double().sum(-1)
    assert (p - 1).abs().max() < (1e-5 if dt == FP32 else 2.0**-7)  # a row's weights sum to 1 (but P's rounding)
    o, lse = flex_compiled(s, v, dt, enable_gqa=True, block=128)
    assert torch.equal(o, tr.out) and torch.equal(lse, tr.lse)


def test_compiled_close_to_eager_and_rows_adapter():
    t = 100
    q, k, v = inputs(FP32, t, 4, seed=11)
    s = flex_post_mod_scores(q, k, None)
    o, lse = flex_compiled(s, v, FP32)
    oe, lsee = flex_eager(s, v, FP32)
    assert torch.allclose(o, oe, atol=1e-5) and torch.allclose(lse, lsee, atol=1e-5)
    p, o_rows = flex_kernel_rows(s.reshape(-1, t), v.reshape(-1, t, E), FP32)
    assert torch.equal(o_rows, o.reshape(-1, E))
    assert (p.double().sum(-1) - 1).abs().max() < 1e-5
    assert torch.allclose(p, torch.softmax(s, dim=-1).reshape(-1, t), rtol=1e-5, atol=1e-7)


def test_bound_zero_score_err_is_small():
    t = 64
    q, k, v = inputs(BF16, t, 4, seed=13)
    s = flex_post_mod_scores(q, k, None)
    bd = flex_bound(s, v, BF16, 0.0)  # the same logits on both sides: only the kernel's P @ V order is open
    out, _ = flex_compiled(s, v, BF16)
    assert (bd > 0).double().mean() < 0.2
    assert (bd <= 1.01 * ulp(out.double().abs(), BF16) + 2.0**-16 * v.abs().max()).all()


# ----------------------------------------------------------------------------- the compiled kernel (slow)

COMPILED_CASES = {  # name: (dtype, T, Hkv, mask_mod, score_mod)
    "fp32-causal-gqa": (FP32, 200, 2, causal, None),
    "bf16-window-alibi": (BF16, 256, 4, window, alibi),
    "fp16-rows-without-key-softcap-gqa": (FP16, 200, 2, late_start, softcap),
    "fp16-plain": (FP16, 100, 4, None, None),
}


def _compiled_run(name, dyadic=False, seed=17):
    dt, t, hkv, mask_mod, score_mod = COMPILED_CASES[name]
    gqa = hkv != HQ
    q, k, v = inputs(dt, t, hkv, seed=seed, dyadic=dyadic)
    bm = block_mask(mask_mod, t)
    real = torch.compile(flex_attention, dynamic=False)(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
    eager = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
    s = flex_post_mod_scores(q, k, None, score_mod, dense(mask_mod, t, t), enable_gqa=gqa)
    sig = flex_score_err(q, k, None, s, enable_gqa=gqa, mod_ulps=MOD_ULPS[score_mod])
    tr = flex_compiled_trace(s, v, dt, enable_gqa=gqa, block=None if bm is None else 128, score_err=sig)
    return q, k, v, real, eager, s, tr


@pytest.mark.slow
@pytest.mark.filterwarnings(JIT_WARNING)
@pytest.mark.parametrize("name", list(COMPILED_CASES))
def test_compiled_within_bound(name):
    dt, t, hkv, mask_mod, score_mod = COMPILED_CASES[name]
    q, k, v, real, eager, s, tr = _compiled_run(name)
    assert real.dtype == dt and tr.out.dtype == dt
    diff = (tr.out.double() - real.double()).abs()
    bound = tr.bound
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} elements outside the bound"
    assert torch.equal(
        tr.out, flex_compiled(s, v, dt, enable_gqa=hkv != HQ, block=None if mask_mod is None else 128)[0]
    )

    empty = torch.all(s == NEG_INF, dim=-1)
    if empty.any():  # what torch's kernel gives on rows without a key: 0, and so does the emulation
        assert torch.equal(real[empty], torch.zeros_like(real[empty]))
        assert torch.equal(tr.out[empty], real[empty])

    # the bound is not vacuous
    _, ref = reference(q, k, v, score_mod, mask_mod)
    err64 = (real.double() - ref).abs()
    eager_gap = (eager.double() - real.double()).abs()
    if dt == FP32:
        # worst case (gamma_n over sums of unknown order): far above the fp32 differences seen, far
        # below the output's scale and below bf16's and fp16's rounding of it
        assert bound.max() < 2.0**-13 * v.abs().max()
        assert bound.max() < 1000 * eager_gap.max()
    else:
        # 0 where the kernel's roundings of P and of the output cannot go the other way, else about
        # an ulp of the output (more where a large P may round the other way)
        # Where the kernel's q @ k^T order is not known (not AVX2: kernel_dot_terms takes any order of E
        # roundings) the bound is looser by design; measured on an AVX512 CPU: fp16 median 2.45 ulps,
        # mean 7.1x the eager gap and 7.4x the float64 error, against <= 2 and < 6x on AVX2; and it is 0
        # (no rounding can go the other way) on 2% of fp16-plain's elements, so that share is an AVX2 fact.
        loose = 1 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 2
        in_ulps = bound / ulp(tr.y.double().abs(), dt)
        assert in_ulps.median() <= 2 * loose
        if loose == 1:
            assert (bound == 0).double().mean() > (0.5 if dt == BF16 else 0.2)
        assert bound.mean() < 6 * loose * eager_gap.mean() and bound.mean() < 6 * loose * err64.mean()
        assert (eager_gap > bound).any()  # it tells the eager path's rounding points from the kernel's
    if dt == BF16:
        assert bound.mean() < eager_gap.mean() and bound.mean() < err64.mean()


@pytest.mark.slow
@pytest.mark.filterwarnings(JIT_WARNING)
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX2", reason="the P @ V order emulated is the AVX2 kernel's"
)
@pytest.mark.parametrize("name", ["fp32-causal-gqa", "bf16-window-alibi", "fp16-plain"])
def test_compiled_bit_exact_on_exact_logits(name):
    """Logits that every summation order gives exactly (q, k multiples of 1/16, a power-of-two scale
    and ALiBi slopes): the emulated kernel and torch's agree on every bit; the same logits visited
    as one block (the wrong blocking and order for a BlockMask) do not."""
    dt, t, hkv, mask_mod, score_mod = COMPILED_CASES[name]
    q, k, v, real, eager, s, tr = _compiled_run(name, dyadic=True, seed=23)
    assert torch.equal(tr.out, real)
    if mask_mod is not None:
        wrong, _ = flex_compiled(s, v, dt, enable_gqa=hkv != HQ, block=None)
        assert not torch.equal(wrong, real)
    if dt == FP32:
        assert not torch.equal(eager, real)  # the eager path rounds elsewhere
