"""fa2 and fa2-fma (attncheck/numerics/paths/fa2.py, fa2_fma.py) against an independent numpy
re-implementation of the rounding points the module docstring states, written here with explicit
rounding at each one (an exact round-to-nearest-even on float64, checked against tests/numerics/rounding.py):
O and LSE bit for bit, the effective probabilities bit for bit; PyTorch issue 121558's input (bf16,
every element 133120) NaN under fa2-fma and finite under fa2 and torch's math backend; supports()."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths import fa2, fa2_fma
from attncheck.numerics.paths.base import CallFacts
from tests.numerics.rounding import nearest

LOG2E = math.log2(math.e)  # M_LOG2E as a double
FMT = {torch.float16: (11, -14, 15), torch.bfloat16: (8, -126, 127), torch.float32: (24, -126, 127)}
F32 = FMT[torch.float32]


def rnd(x, fmt) -> np.ndarray:
    """float64 x rounded to the nearest value of a binary format (significand bits, emin, emax), ties
    to even, subnormals kept, beyond the largest finite value + half an ulp: inf. Scaling by a power
    of two is exact and np.rint rounds ties to even."""
    x = np.array(x, dtype=np.float64)
    bits, emin, emax = fmt
    out = x.copy()
    fin = np.isfinite(x) & (x != 0)
    a = np.abs(x[fin])
    _, e = np.frexp(a)  # a = m 2^e, 0.5 <= m < 1
    quantum = np.maximum(e - bits, emin - bits + 1)
    y = np.ldexp(np.rint(np.ldexp(a, -quantum)), quantum)
    out[fin] = np.copysign(np.where(y >= 2.0 ** (emax + 1), np.inf, y), x[fin])
    return out


def f32(x) -> np.ndarray:
    return rnd(x, F32)


def ex2(x) -> np.ndarray:
    """ex2.approx.ftz.f32 as the path assumes it: 2^x rounded once to fp32, below 2^-126 flushed to 0."""
    y = f32(np.exp2(x))
    return np.where(y < 2.0**-126, 0.0, y)


def reference(q, k, v, scale, dt, bn, fused, bias=None, softcap=None):
    """(O (n, tq, dv) float64 holding dtype values, LSE (r,), probs (r, Tk)) of the stated rounding points.
    q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) float64 numpy; bias (r, Tk) or None."""
    fmt = FMT[dt]
    n, tq, d = q.shape
    tk = k.shape[1]
    r = n * tq
    qd, kd, vd = rnd(q, fmt), rnd(k, fmt), rnd(v, fmt)
    s = np.zeros((n, tq, tk))
    for c in range(0, d, 16):  # one mma per 16 head dims, each rounded into the fp32 accumulator
        s = f32(s + qd[..., c : c + 16] @ kd[..., c : c + 16].transpose(0, 2, 1))
    s32 = f32(scale)
    if softcap:
        cap = f32(softcap)
        s = f32(np.tanh(f32(s * f32(s32 / cap))))
        sl2, lse_scale = f32(cap * LOG2E), cap
    else:
        sl2, lse_scale = f32(s32 * LOG2E), s32
    s = s.reshape(r, tk)
    if bias is not None:  # in scaled units: divided by the exponent's scale (fp32), then added in fp32
        s = f32(s + f32(bias / lse_scale))
    nb = -(-tk // bn)
    s = np.concatenate([s, np.full((r, nb * bn - tk), -np.inf)], axis=1)
    vp = np.concatenate([vd, np.zeros((n, nb * bn - tk, vd.shape[-1]))], axis=1)
    thread = np.zeros((r, 4))
    acc = np.zeros((n, tq, vd.shape[-1]))
    kept = []
    for step, j in enumerate(range(nb - 1, -1, -1)):
        x = s[:, j * bn : (j + 1) * bn]
        bmax = np.fmax.reduce(x, axis=1)
        if step == 0:
            m, f = bmax, np.ones(r)
        else:
            prev, m = m, np.fmax(m, bmax)
            cur = np.where(np.isneginf(m), 0.0, m) if bias is not None else m
            f = ex2(f32(f32(prev - cur) * sl2))
            thread = f32(thread * f[:, None])
            acc = f32(acc * f.reshape(n, tq, 1))
        ms = np.where(np.isneginf(m), 0.0, f32(m * sl2))[:, None]
        p = ex2(f32(x * sl2 - ms) if fused else f32(f32(x * sl2) - ms))
        for col in range(bn):  # the mma C fragment: column col belongs to thread (col % 8) // 2 of the quad
            t = (col % 8) // 2
            thread[:, t] = f32(thread[:, t] + p[:, col])
        pr = rnd(p, fmt).reshape(n, tq, bn)
        for c in range(0, bn, 16):
            acc = f32(acc + pr[..., c : c + 16] @ vp[:, j * bn + c : j * bn + c + 16])
        kept.append((j, pr.reshape(r, bn), f))
    total = f32(f32(thread[:, 0] + thread[:, 2]) + f32(thread[:, 1] + thread[:, 3]))
    bad = (total == 0) | np.isnan(total)
    inv = np.where(bad, 1.0, f32(1.0 / np.where(bad, 1.0, total)))
    out = rnd(f32(acc * inv.reshape(n, tq, 1)), fmt)
    lse = np.where(bad, np.inf, f32(m * lse_scale + f32(np.log(np.where(bad, 1.0, total)))))
    probs = np.zeros((r, nb * bn))
    later = np.ones(r)
    for j, pr, f in reversed(kept):
        probs[:, j * bn : (j + 1) * bn] = f32(pr * (later * inv)[:, None])
        later = later * f
    return out, lse, probs[:, :tk]


def same(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def make(seed, n, tq, tk, d, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, tq, d, generator=g, dtype=torch.float64) * spread
    k = torch.randn(n, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, tk, d, generator=g, dtype=torch.float64)
    return q, k, v, g


def bias_of(kind, g, n, tq, tk):
    """(r, Tk) float32 numpy bias: -inf for masked keys."""
    if kind == "none":
        return None
    if kind == "bool":  # random keys masked, two rows fully masked
        masked = torch.rand(n, tq, tk, generator=g) < 0.3
        masked[0, :2] = True
        return np.where(masked.reshape(n * tq, tk).numpy(), -np.inf, 0.0)
    if kind == "float":  # -1e4 sentinels (as fp32), small biases (ALiBi-like), one row fully -inf
        u = torch.rand(n, tq, tk, generator=g).numpy()
        b = np.where(u < 0.3, -1e4, np.where(u < 0.6, -1.5 * u, 0.0)).reshape(n * tq, tk)
        b[1] = -np.inf
        return f32(b)
    if kind == "causal":  # FlashAttention-2's causal mask: key j of query i kept for j <= i + Tk - Tq
        i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
        return np.tile(np.where(j > i + tk - tq, -np.inf, 0.0), (n, 1))
    raise ValueError(kind)


# (dtype, head dim, queries, keys, mask, logit spread): tiles at 128 (d 64) and 64 (d 128, 256)
CASES = [
    (torch.float16, 64, 9, 128, "none", 1.0),
    (torch.bfloat16, 64, 9, 127, "none", 1.0),
    (torch.bfloat16, 64, 9, 129, "bool", 1.0),
    (torch.float16, 128, 7, 192, "bool", 1.0),  # T % 128 == 64
    (torch.bfloat16, 256, 5, 65, "float", 1.0),
    (torch.float16, 128, 20, 70, "causal", 1.0),  # Tq != Tk, bottom right
    (torch.bfloat16, 128, 6, 63, "none", 24.0),  # large logits: max_scaled ~ 1e3, the exponents round apart
    (torch.float32, 64, 5, 200, "causal", 1.0),
]


@pytest.mark.parametrize("fused", [False, True], ids=["fa2", "fa2-fma"])
@pytest.mark.parametrize("case", CASES, ids=[f"{FMT[c[0]][0]}b-d{c[1]}-{c[2]}x{c[3]}-{c[4]}-x{c[5]:g}" for c in CASES])
def test_kernel_rows_is_bit_exact_with_the_stated_rounding_points(case, fused):
    dt, d, tq, tk, kind, spread = case
    n = 2
    q, k, v, g = make(hash(case) % 1000, n, tq, tk, d, spread)
    bias = bias_of(kind, g, n, tq, tk)
    bn = fa2.tile_n(d)
    res = fa2.kernel_rows(
        q,
        k,
        v,
        scale=1 / math.sqrt(d),
        dt=dt,
        block_n=bn,
        fused=fused,
        bias=None if bias is None else torch.from_numpy(bias).float(),
    )
    with np.errstate(all="ignore"):
        o, lse, probs = reference(q.numpy(), k.numpy(), v.numpy(), 1 / math.sqrt(d), dt, bn, fused, bias)
    assert res.out.dtype == dt and res.lse.dtype == torch.float32 and res.probs.dtype == torch.float32
    assert same(res.out.double().numpy(), o.reshape(n * tq, -1))
    assert same(res.lse.numpy(), lse)
    assert same(res.probs.numpy(), probs)
    if kind in ("bool", "float"):  # fully masked rows: O = 0, LSE = +inf (softmax.h: inv_sum 1, LSE +inf)
        empty = np.isneginf(bias).all(axis=1)
        assert empty.any() and np.all(np.isposinf(lse[empty]))
        assert np.all(o.reshape(n * tq, -1)[empty] == 0)
    assert not res.events["fused_max"].any()  # logits far below 2^31 / scale_log2: no overflow


def test_large_logits_round_the_two_exponents_apart():
    """The fused and unfused exponents differ in their last bits once max_scaled is large; both stay
    within a few units of the dtype's rounding of the float64 softmax."""
    q, k, v, _ = make(3, 2, 6, 63, 128, 24.0)
    a = fa2.kernel_rows(q, k, v, scale=1 / math.sqrt(128), dt=torch.bfloat16, block_n=64, fused=False)
    b = fa2.kernel_rows(q, k, v, scale=1 / math.sqrt(128), dt=torch.bfloat16, block_n=64, fused=True)
    assert not torch.equal(a.probs, b.probs)
    qb, kb = q.to(torch.bfloat16).double(), k.to(torch.bfloat16).double()
    ref = torch.softmax(qb @ kb.transpose(-1, -2) / math.sqrt(128), dim=-1).reshape(12, 63)
    for res in (a, b):  # P rounded to bf16 (2^-9 relative); exponents near 1e3 rounded to fp32 (2^-14 absolute)
        assert float((res.probs.double() - ref).abs().max()) < 2**-8


def test_rounding_helper_is_the_exact_cast():
    g = np.random.default_rng(0)
    xs = np.concatenate(
        [
            g.normal(size=300) * 10.0 ** g.integers(-8, 8, 300),
            [1 + 2**-11, 1 + 3 * 2**-11, 65519.99, 65520.0, 2**-24 * 1.5, 3.5e38, 1 + 2**-24],
        ]
    )
    for fmt in FMT.values():
        want = [nearest(float(x), fmt[0], fmt[1], fmt[2]) for x in xs]
        assert same(rnd(xs, fmt), want)


def test_softcap_follows_flash_api():
    """flash_api.cpp: S * (scale / softcap) rounded, tanh, then exp2 with softcap * log2e; LSE with softcap."""
    q, k, v, _ = make(5, 2, 8, 100, 64, 3.0)
    res = fa2.kernel_rows(q, k, v, scale=0.125, dt=torch.bfloat16, block_n=128, fused=True, softcap=30.0)
    with np.errstate(all="ignore"):
        o, lse, _ = reference(q.numpy(), k.numpy(), v.numpy(), 0.125, torch.bfloat16, 128, True, softcap=30.0)
    assert same(res.out.double().numpy(), o.reshape(16, -1)) and same(res.lse.numpy(), lse)
    assert float(res.lse.max()) <= 30.0 + math.log(100) + 1e-4  # capped logits bound the LSE


def _block(q, k, v, **kw):
    inp = prepare_inputs(q, k, v=v, **kw)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    return inp, blk


@pytest.mark.parametrize("mod", [fa2, fa2_fma], ids=["fa2", "fa2-fma"])
def test_forward_on_a_gqa_block_with_a_mask(mod):
    """The path's forward on a QKBlock: GQA (k, v expanded per query head) and a boolean mask."""
    g = torch.Generator().manual_seed(11)
    b, h, hk, tq, tk, d = 1, 4, 2, 5, 130, 64
    q = torch.randn(b, h, tq, d, generator=g).to(torch.float16)
    k = torch.randn(b, hk, tk, d, generator=g).to(torch.float16)
    v = torch.randn(b, hk, tk, d, generator=g).to(torch.float16)
    keep = torch.rand(b, 1, tq, tk, generator=g) > 0.3
    keep[0, 0, 1] = False  # a fully masked row
    inp, blk = _block(q, k, v, mask=keep)
    pb = mod.forward(blk, torch.float16, [], MethodParams())
    ((name, out),) = pb.cells
    assert name == mod.PATH.name
    kx, vx = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    bias = np.where(~keep.expand(b, h, tq, tk).reshape(h * tq, tk).numpy(), -np.inf, 0.0)
    with np.errstate(all="ignore"):
        o, _, probs = reference(
            q.double().reshape(h, tq, d).numpy(),
            kx.double().reshape(h, tk, d).numpy(),
            vx.double().reshape(h, tk, d).numpy(),
            inp.scale,
            torch.float16,
            128,
            mod is fa2_fma,
            bias,
        )
    assert same(out.out.double().numpy(), o.reshape(h * tq, d))
    assert same(out.probs.numpy(), probs)
    assert np.all(o.reshape(h, tq, d)[:, 1] == 0)  # the fully masked query: zeros


def test_issue_121558_nan_under_fa2_fma_only():
    """PyTorch issue 121558: bf16 q, k, v of shape (1, 1, 1, 64), every element 133120."""
    x = torch.full((1, 1, 1, 64), 133120.0, dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.MATH):
        math_out = F.scaled_dot_product_attention(x, x, x)
    assert torch.isfinite(math_out).all()
    _, blk = _block(x, x, x)
    fused = fa2_fma.forward(blk, torch.bfloat16, [], MethodParams()).cells[0][1]
    plain = fa2.forward(blk, torch.bfloat16, [], MethodParams()).cells[0][1]
    assert torch.isnan(fused.out).all()
    assert torch.equal(plain.out, math_out.reshape(1, 64))  # one key: O = V exactly
    rows = fa2.kernel_rows(
        x.double().reshape(1, 1, 64),
        x.double().reshape(1, 1, 64),
        x.double().reshape(1, 1, 64),
        scale=0.125,
        dt=torch.bfloat16,
        block_n=128,
        fused=True,
    )
    assert rows.events["fused_max"].tolist() == [True] and math.isinf(float(rows.lse[0]))
    # why: S = 64 * 133120^2 = 4225 * 2^28 exactly; max_scaled = fp32(S * scale_log2) rounds away
    # up to 2^13 (half an ulp at 2^37), and the fused exponent keeps that residue
    s, sl2 = 64 * 133120.0**2, f32(f32(0.125) * LOG2E)
    residue = s * sl2 - f32(s * sl2)
    assert residue > 128  # exp2 of it overflows fp32
    plain_rows = fa2.kernel_rows(
        x.double().reshape(1, 1, 64),
        x.double().reshape(1, 1, 64),
        x.double().reshape(1, 1, 64),
        scale=0.125,
        dt=torch.bfloat16,
        block_n=128,
    )
    assert plain_rows.events["fused_max"].tolist() == [False]


def test_fp16_breaks_earlier_p_overflows_the_dtype():
    """fp16 q = k = v = 6832, d 64: S = 64 * 6832^2 (exact in fp32), max_scaled ~ 5.4e8, residue ~ 31.9:
    the fused exp is 2^31.9, finite in fp32 but inf as fp16 P, so O is inf; fa2 gives V exactly."""
    x = torch.full((1, 1, 64), 6832.0, dtype=torch.float64)
    s, sl2 = 64 * 6832.0**2, f32(f32(0.125) * LOG2E)
    residue = s * sl2 - f32(s * sl2)
    assert 16 < residue < 128
    fused = fa2.kernel_rows(x, x, x, scale=0.125, dt=torch.float16, block_n=128, fused=True)
    plain = fa2.kernel_rows(x, x, x, scale=0.125, dt=torch.float16, block_n=128, fused=False)
    assert torch.isinf(fused.out).all() and fused.events["fused_max"].tolist() == [True]
    assert math.isfinite(float(fused.lse[0]))  # the sum stayed finite: only P broke
    assert (plain.out == 6832.0).all() and plain.events["fused_max"].tolist() == [False]
    with sdpa_kernel(SDPBackend.MATH):
        xh = x.to(torch.float16).reshape(1, 1, 1, 64)
        assert torch.isfinite(F.scaled_dot_product_attention(xh, xh, xh)).all()


def test_tiles_follow_the_launch_template():
    # PyTorch's copy keeps a 160 kernel (128 x 32 on sm80/sm90); the package rounds 160 up to 192 (128 x 64)
    assert [fa2.tile_n(d) for d in (32, 64, 96, 128, 160, 192, 224, 256)] == [128, 128, 64, 64, 32, 64, 64, 64]
    assert [fa2.tile_n(d, torch_copy=False) for d in (64, 128, 160, 256)] == [128, 64, 64, 64]
    assert fa2.tile_n(160, (8, 6)) == 64
    assert fa2.tile_n(128, (8, 6)) == 32 and fa2.tile_n(128, (8, 6), causal=True) == 64
    assert fa2.tile_n(128, (9, 0)) == 64 and fa2.tile_n(96, (8, 9)) == 64


def facts(**kw):
    base = {"dtype": "bf16", "head_dim": 64, "head_dim_v": 64, "tq": 128, "tk": 128}
    base.update(kw)
    return CallFacts(**base)


def test_supports_says_why_pytorchs_flash_backend_would_not_run():
    assert fa2.supports(facts()) is None and fa2.supports(facts(mask="causal")) is None
    assert fa2.supports(facts(mask="explicit")) == "an explicit mask: PyTorch's flash backend takes is_causal only"
    assert fa2.supports(facts(dtype="fp32")) == "fp32: PyTorch's flash backend runs fp16 and bf16 only"
    who = "PyTorch's flash backend"
    assert fa2.supports(facts(head_dim=320, head_dim_v=320)) == f"head dim 320: {who} takes at most 256"
    assert fa2.supports(facts(head_dim=60, head_dim_v=60)) == f"head dim 60: {who} needs a multiple of 8"
    assert fa2.supports(facts(capability=(7, 5))) == "sm75: FlashAttention-2 needs sm80 or newer"
    assert "non-square causal" in fa2.supports(facts(mask="causal", tq=20, tk=50))
    assert fa2.supports(facts(softcap=30.0)) == "a softcap: PyTorch's flash backend has none"
    assert "dropout" in fa2.supports(facts(dropout=0.1))


def test_supports_of_the_flash_attn_package():
    assert fa2_fma.supports(facts(softcap=30.0)) is None
    assert fa2_fma.supports(facts(mask="causal", tq=20, tk=50)) is None  # bottom-right causal
    assert fa2_fma.supports(facts(head_dim=60, head_dim_v=60)) is None  # padded to 64 by the interface
    assert fa2_fma.supports(facts(window=(64, 0))) == "a sliding window: the kernel's local mask is not emulated"
    assert fa2_fma.supports(facts(mask="explicit")).startswith("an explicit mask")
    assert fa2_fma.supports(facts(dtype="fp32")).startswith("fp32")


def test_path_specs():
    for mod, name in ((fa2, "fa2"), (fa2_fma, "fa2-fma")):
        spec = mod.PATH
        assert spec.name == name and spec.device == "cuda" and spec.replay and not spec.default
        assert fa2.FLASH_COMMIT in spec.source and spec.assumed
        assert spec.function() is mod.forward and spec.why_not(facts(dtype="fp32"))
    assert fa2.TORCH_COMMIT in fa2.PATH.source


def test_modules_import_without_torch():
    code = (
        "import sys; import attncheck.numerics.paths.fa2, attncheck.numerics.paths.fa2_fma; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_forward_without_v_gives_the_probabilities_alone():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 4, 64, generator=g), torch.randn(1, 2, 70, 64, generator=g)
    _, blk = _block(q.to(torch.bfloat16), k.to(torch.bfloat16), None)
    out = fa2.forward(blk, torch.bfloat16, [], MethodParams()).cells[0][1]
    assert out.out is None and out.probs.shape == (8, 70)
    with np.errstate(all="ignore"):  # v of zeros: the reference's probabilities do not depend on it
        _, _, probs = reference(
            q.double().reshape(2, 4, 64).numpy(),
            k.double().reshape(2, 70, 64).numpy(),
            np.zeros((2, 70, 64)),
            blk.inp.scale,
            torch.bfloat16,
            128,
            False,
        )
    assert same(out.probs.numpy(), probs)
