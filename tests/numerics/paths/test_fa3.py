"""fa3 (attncheck/numerics/paths/fa3.py) against an independent numpy write-out of FlashAttention-3's Hopper
mainloop as its module docstring states it, written here step by step as the kernel runs it (IntraWGOverlap:
block j's softmax beside block j-1's P V; RescaleOBeforeGemm for head dims above 128 moves the rescale of O
before the P V product), with explicit rounding at every point (tests/numerics/paths/test_fa2.py's ``rnd``,
itself checked against the exact integer rounding of tests/numerics/rounding.py): O, LSE and the effective
probabilities bit for bit. Plus: empty rows give O = 0 and LSE = -inf; a healthy bf16 input gives no event;
fa3's FP8 mode is flash-fp8 bit for bit; an SDPA capture whose flash implementation was fa3 is judged by fa3."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from attncheck.numerics.methods.fp8_attention import Fp8Setup
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths import fa3, flash_fp8
from attncheck.numerics.paths.base import CallFacts
from tests.numerics.paths.test_fa2 import FMT, _block, ex2, f32, make, rnd, same

LOG2E = math.log2(math.e)  # M_LOG2E, a double
LN2 = math.log(2.0)  # M_LN2, a double; the kernel takes float(M_LN2)


def kernel_tile(d, causal):
    """hopper/tile_size.h tile_size_fwd_sm90, element size 2, head_dim_v == head_dim, not paged, not local."""
    return {64: 128 if causal else 192, 96: 144, 128: 128 if causal else 176, 192: 112, 256: 80}[
        next(x for x in (64, 96, 128, 192, 256) if d <= x)
    ]


def reference(q, k, v, scale, dt, bn, bias=None):
    """(O (n, tq, dv), LSE (r,), probs (r, Tk)) of FlashAttention-3's mainloop, numpy float64 with each rounding
    written out. q (n, tq, d), k (n, Tk, d), v (n, Tk, dv); bias (r, Tk) in scaled units, -inf masked, or None."""
    fmt = FMT[dt]
    n, tq, d = q.shape
    tk = k.shape[1]
    r = n * tq
    qd, kd, vd = rnd(q, fmt), rnd(k, fmt), rnd(v, fmt)
    s = np.zeros((n, tq, tk))
    for c in range(0, d, 16):  # WGMMA k = 16: each instruction's exact sum added to the fp32 accumulator
        s = f32(s + qd[..., c : c + 16] @ kd[..., c : c + 16].transpose(0, 2, 1))
    sl2 = f32(f32(scale) * LOG2E)  # float(softmax_scale * M_LOG2E)
    s = s.reshape(r, tk)
    if bias is not None:
        s = f32(s + f32(bias / f32(scale)))
    nb = -(-tk // bn)
    s = np.concatenate([s, np.full((r, nb * bn - tk), -np.inf)], axis=1)
    vp = np.concatenate([vd, np.zeros((n, nb * bn - tk, vd.shape[-1]))], axis=1)

    def softmax_block(x, m, thread, first, check_inf):
        """max_get_scale then online_softmax for one block: (m, scale, thread sums, P in fp32)."""
        bmax = np.fmax.reduce(x, axis=1)
        if first:
            m, scl = bmax, np.ones(r)
        else:
            prev, m = m, np.fmax(m, bmax)
            cur = np.where(np.isneginf(m), 0.0, m) if check_inf else m
            scl = ex2(f32(f32(prev - cur) * sl2))
            thread = f32(thread * scl[:, None])
        ms = f32(m * sl2)
        if check_inf:
            ms = np.where(np.isneginf(m), 0.0, ms)
        p = ex2(f32(x * sl2 - ms[:, None]))  # one FFMA: the exact x*sl2 - ms, rounded once
        for col in range(bn):  # WGMMA C fragment: thread (col % 8) // 2 of the quad, columns in order
            t = (col % 8) // 2
            thread[:, t] = p[:, col] if (first and col < 8 and col % 2 == 0) else f32(thread[:, t] + p[:, col])
        return m, scl, thread, p

    def pv(o, p, j):
        pr = rnd(p, fmt).reshape(n, tq, bn)
        for c in range(0, bn, 16):
            o = f32(o + pr[..., c : c + 16] @ vp[:, j * bn + c : j * bn + c + 16])
        return o

    before = d > 128  # RescaleOBeforeGemm
    order = list(range(nb - 1, -1, -1))
    checks = [True] + [bias is not None] * (nb - 1)  # the first block, and the masked ones
    m, scl, thread, p = softmax_block(s[:, order[0] * bn : (order[0] + 1) * bn], None, np.zeros((r, 4)), True, True)
    kept = [(order[0], rnd(p, fmt), scl)]
    o = np.zeros((n, tq, vd.shape[-1]))  # clear(tOrO)
    for step in range(1, nb):  # fwd_step: S of block j, P V of the block before, softmax of block j
        j, jprev, p_prev = order[step], order[step - 1], p
        if before:
            o = f32(o * scl.reshape(n, tq, 1))  # scale of the block before (1 after the first)
        o = pv(o, p_prev, jprev)
        m, scl, thread, p = softmax_block(s[:, j * bn : (j + 1) * bn], m, thread, False, checks[step])
        if not before:
            o = f32(o * scl.reshape(n, tq, 1))
        kept.append((j, rnd(p, fmt), scl))
    if before:
        o = f32(o * scl.reshape(n, tq, 1))
    o = pv(o, p, order[-1])
    total = f32(f32(thread[:, 0] + thread[:, 2]) + f32(thread[:, 1] + thread[:, 3]))  # xor 2, then xor 1
    bad = (total == 0) | np.isnan(total)
    inv = np.where(bad, 0.0, f32(1.0 / np.where(bad, 1.0, total)))
    out = rnd(f32(o * inv.reshape(n, tq, 1)), fmt)
    lse = np.where(bad, -np.inf, f32(m * f32(sl2 * f32(LN2)) + f32(np.log(np.where(bad, 1.0, total)))))
    probs = np.zeros((r, nb * bn))
    later = np.ones(r)
    for j, pr, f in reversed(kept):
        probs[:, j * bn : (j + 1) * bn] = f32(pr.reshape(r, bn) * (later * inv)[:, None])
        later = later * f
    return out, lse, probs[:, :tk]


def causal_bias(n, tq, tk):
    """FlashAttention-3's causal mask (mask.h): key j of query i kept for j <= i + Tk - Tq (bottom right)."""
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    return np.tile(np.where(j > i + tk - tq, -np.inf, 0.0), (n, 1))


# (dtype, head dim, queries, keys, mask): tiles 192/128 (d 64), 176/128 (d 128), 80 (d 256)
CASES = [
    (torch.bfloat16, 64, 6, 192, "none"),  # Tk at the tile
    (torch.float16, 64, 6, 191, "none"),  # one below
    (torch.bfloat16, 64, 6, 193, "none"),  # one above
    (torch.float16, 128, 5, 192, "none"),  # T % 128 == 64, 176 + 16
    (torch.bfloat16, 128, 5, 177, "none"),
    (torch.float16, 128, 12, 140, "causal"),  # Tq != Tk, tile 128
    (torch.bfloat16, 64, 20, 9, "causal"),  # Tq > Tk: the first 11 queries see no key
    (torch.bfloat16, 256, 4, 161, "none"),  # RescaleOBeforeGemm, 80 x 2 + 1
    (torch.float16, 256, 5, 160, "causal"),
    (torch.bfloat16, 128, 4, 300, "rows"),  # some fully masked rows
]


@pytest.mark.parametrize("case", CASES, ids=[f"{FMT[c[0]][0]}b-d{c[1]}-{c[2]}x{c[3]}-{c[4]}" for c in CASES])
def test_fa3_bit_for_bit_against_written_out_kernel(case):
    dt, d, tq, tk, kind = case
    n = 2
    q, k, v, g = make(sum(map(ord, str(case))), n, tq, tk, d)
    bias = None
    if kind == "causal":
        bias = causal_bias(n, tq, tk)
    elif kind == "rows":
        bias = np.where(torch.rand(n * tq, tk, generator=g).numpy() < 0.2, -np.inf, 0.0)
        bias[[0, 5]] = -np.inf
    bn = fa3.tile_n(d, causal=kind == "causal")
    assert bn == kernel_tile(d, kind == "causal")
    res = fa3.kernel_rows(
        q,
        k,
        v,
        scale=1 / math.sqrt(d),
        dt=dt,
        block_n=bn,
        bias=None if bias is None else torch.from_numpy(bias).float(),
    )
    with np.errstate(all="ignore"):
        o, lse, probs = reference(q.numpy(), k.numpy(), v.numpy(), 1 / math.sqrt(d), dt, bn, bias)
    assert res.out.dtype == dt and res.lse.dtype == torch.float32
    assert same(res.out.double().numpy(), o.reshape(n * tq, -1))
    assert same(res.lse.numpy(), lse)
    assert same(res.probs.numpy(), probs)
    assert not res.events["fused_max"].any()
    if bias is not None and np.isneginf(bias).all(axis=1).any():  # empty rows: O = 0, LSE = -inf (not FA2's +inf)
        empty = np.isneginf(bias).all(axis=1)
        assert np.all(np.isneginf(res.lse.numpy()[empty])) and not res.out[torch.from_numpy(empty)].any()
        assert np.isfinite(res.lse.numpy()[~empty]).all()


def test_fa3_empty_rows_give_zero_and_minus_inf():
    """softmax.h:144, 151: inv_sum 0 and LSE -inf where the row sum is 0; FlashAttention-2 keeps inv_sum 1 and
    writes +inf."""
    from attncheck.numerics.paths import fa2

    q, k, v, _ = make(7, 1, 3, 40, 64)
    bias = torch.zeros(3, 40)
    bias[1] = float("-inf")
    a = fa3.kernel_rows(q, k, v, scale=0.125, dt=torch.float16, block_n=192, bias=bias)
    b = fa2.kernel_rows(q, k, v, scale=0.125, dt=torch.float16, block_n=128, fused=True, bias=bias)
    assert math.isinf(float(a.lse[1])) and float(a.lse[1]) < 0 and float(b.lse[1]) == math.inf
    assert not a.out[1].any() and not a.probs[1].any()
    assert torch.isfinite(a.lse[[0, 2]]).all()


def test_fa3_healthy_bf16_has_no_event():
    q, k, v, _ = make(1, 4, 16, 500, 128)
    res = fa3.kernel_rows(q, k, v, scale=1 / math.sqrt(128), dt=torch.bfloat16, block_n=176)
    assert not res.events["fused_max"].any() and torch.isfinite(res.out.float()).all()
    qb, kb, vb = (x.to(torch.bfloat16).double() for x in (q, k, v))
    ref = torch.softmax(qb @ kb.transpose(-1, -2) / math.sqrt(128), dim=-1) @ vb
    assert float((res.out.double() - ref.reshape(64, 128)).abs().max()) < 2**-6  # bf16's rounding of O and P


def test_fa3_fused_exponent_overflows_as_fa2_fma():
    """PyTorch issue 121558's input (bf16, every element 133120): the fused exponent at the row max overflows."""
    q = torch.full((1, 4, 64), 133120.0, dtype=torch.float64)
    res = fa3.kernel_rows(q, q, q, scale=0.125, dt=torch.bfloat16, block_n=192)
    assert res.events["fused_max"].all() and torch.isnan(res.out.float()).all()


def test_fa3_forward_on_a_gqa_causal_block():
    g = torch.Generator().manual_seed(3)
    b, h, hk, t, d = 1, 4, 2, 130, 64
    q, k, v = (torch.randn(b, x, t, d, generator=g).to(torch.bfloat16) for x in (h, hk, hk))
    inp, blk = _block(q, k, v, causal=True)
    ((name, out),) = fa3.forward(blk, torch.bfloat16, [], MethodParams()).cells
    assert name == "fa3"
    kx, vx = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    with np.errstate(all="ignore"):
        o, _, probs = reference(
            q.double().reshape(h, t, d).numpy(),
            kx.double().reshape(h, t, d).numpy(),
            vx.double().reshape(h, t, d).numpy(),
            inp.scale,
            torch.bfloat16,
            192,  # a causal block without a captured call: the non-causal tile, the mask as -inf
            causal_bias(h, t, t),
        )
    assert same(out.out.double().numpy(), o.reshape(h * t, d)) and same(out.probs.numpy(), probs)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fa3_fp8_mode_is_flash_fp8(fmt):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(3))
    _, blk = _block(q, k, v)
    params = MethodParams(fp8=Fp8Setup(fmt=fmt))
    a = fa3.forward(blk, fmt, [], params)
    _, blk = _block(q, k, v)
    b = flash_fp8.forward(blk, fmt, [], params)
    ((na, oa),), ((nb_, ob),) = a.cells, b.cells
    assert (na, nb_) == ("fa3", "flash-fp8")
    assert torch.equal(a.scores, b.scores) and torch.equal(oa.probs, ob.probs)
    assert oa.out.dtype == torch.bfloat16 and torch.equal(oa.out, ob.out)
    assert Fp8Setup().scaling == "head"  # descales per batch and kv head, as the kernel takes them


def facts(**kw):
    base = dict(dtype="bf16", head_dim=128, head_dim_v=128, tq=64, tk=64)
    return CallFacts(**{**base, **kw})


def test_supports_by_shape_and_dtype_not_capability():
    assert fa3.supports(facts()) is None
    assert fa3.supports(facts(capability=(8, 0))) is None  # --what-if kernels: on a Hopper GPU
    assert fa3.supports(facts(dtype="e4m3")) is None
    assert "head dim 288" in fa3.supports(facts(head_dim=288, head_dim_v=288))
    assert "multiple of 8" in fa3.supports(facts(head_dim=100, head_dim_v=100))
    assert "explicit mask" in fa3.supports(facts(mask="explicit"))
    assert "dropout" in fa3.supports(facts(dropout=0.1))
    assert "fp32" in fa3.supports(facts(dtype="fp32"))
    assert fa3.supports(facts(mask="causal", tq=1, tk=64)) is None  # decode: the kernel drops causal


def test_path_spec_and_registry():
    from attncheck.config.run import Options
    from attncheck.numerics.cells.plan import grid
    from attncheck.registry import PATHS, fp8_what_if_path

    spec = PATHS.get("fa3")
    assert spec.fp8 == "both" and spec.computes_in(True) and spec.computes_in(False) and not spec.fp8_only
    assert spec.replay and spec.backward == "recompute" and spec.device == "cuda" and not spec.default
    assert fp8_what_if_path() == "flash-fp8"
    cells = grid(Options(dtypes=("bf16", "e4m3"), methods=("torch",), paths=("fa3", "flash-fp8", "fa2")), qk=True)
    assert [c.name for c in cells] == ["fa3/bf16", "fa3/e4m3", "flash-fp8/e4m3", "fa2/bf16"]
    assert fa3.limit(torch.float8_e4m3fn) is None and fa3.limit(torch.bfloat16)[0] == "fused_max"


def test_fa3_judges_an_sdpa_capture_with_flash_impl_fa3(tmp_path):
    import torch.nn.functional as F
    from typer.testing import CliRunner

    import attncheck
    from attncheck.cli import app
    from attncheck.loaders.calls import open_capture
    from attncheck.numerics.cells.plan import judged_by, recorded_implementation
    from attncheck.testing import as_gpu_capture

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    as_gpu_capture(tmp_path / "cap", "flash_attention", flash_impl="fa3")
    info = open_capture(tmp_path / "cap")[0][0].info
    assert recorded_implementation(info) == "flash_attention:fa3"
    assert judged_by(info) == ("fa3", None)
    r = CliRunner().invoke(app, ["run", str(tmp_path / "cap"), "--json", "-", "--fail-on", "error,warning,nan"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["calls"][0]["cell"] == "fa3/bf16"
    as_gpu_capture(tmp_path / "cap", "flash_attention", flash_impl="fa2")
    info = open_capture(tmp_path / "cap")[0][0].info
    assert recorded_implementation(info) == "flash_attention" and judged_by(info)[0] == "fa2"


def test_lse_uses_the_kernels_float_product_of_scale_log2_and_ln2():
    """softmax.h:151 takes row_max * (softmax_scale_log2 * float(M_LN2)): at a scale where that fp32 product is not
    the fp32 scale itself, the LSE follows the product."""
    scale = next(s for s in (1 / math.sqrt(x) for x in range(2, 400)) if f32(f32(f32(s) * LOG2E) * f32(LN2)) != f32(s))
    q, k, v, _ = make(9, 2, 5, 200, 64, 3.0)
    res = fa3.kernel_rows(q, k, v, scale=scale, dt=torch.bfloat16, block_n=192)
    with np.errstate(all="ignore"):
        o, lse, _ = reference(q.numpy(), k.numpy(), v.numpy(), scale, torch.bfloat16, 192)
    assert same(res.lse.numpy(), lse) and same(res.out.double().numpy(), o.reshape(10, -1))


def test_first_block_checks_for_an_all_minus_inf_max():
    """The first block runs with Check_inf (mainloop_fwd_sm90_tma_gmma_ws.hpp:1152, 1155) even without a mask: a
    first (last-indexed) block whose scores are all -inf gives P = 0 there, not NaN."""
    q, k, v, _ = make(4, 1, 3, 193, 64)
    q = q.abs()
    k[:, 192] = float("-inf")  # the first block processed holds key 192 alone (and 191 padded keys)
    res = fa3.kernel_rows(q, k, v, scale=0.125, dt=torch.float16, block_n=192)
    with np.errstate(all="ignore"):
        o, lse, probs = reference(q.numpy(), k.numpy(), v.numpy(), 0.125, torch.float16, 192)
    assert torch.isfinite(res.out.float()).all() and not res.probs[:, 192].any()
    assert same(res.out.double().numpy(), o.reshape(3, -1)) and same(res.lse.numpy(), lse)
    assert same(res.probs.numpy(), probs)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernel_rows_fp8_mode_is_flash_fp8_with_the_kernels_descales(fmt):
    """kernel_rows in an FP8 dtype, given the FP8 values and the descales per (batch, kv head) as the kernel takes
    them, gives flash-fp8's bits; its LSE is the float64 log-sum-exp of the fp32 scores it states."""
    from attncheck.numerics.methods.fp8_attention import fa3_tile, quantize_inputs

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 24, 64, generator=g) * 3 for _ in range(3))
    inp, blk = _block(q, k, v)
    setup = Fp8Setup(fmt=fmt, scaling="head")
    ((_, want),) = flash_fp8.forward(blk, fmt, [], MethodParams(fp8=setup)).cells
    quant = quantize_inputs(inp, setup)
    assert bool((quant.dq != 1).any())  # real descales, one per (batch, head)
    res = fa3.kernel_rows(
        quant.q8.double(),
        quant.k8.double(),
        quant.v8.double(),
        scale=inp.scale,
        dt=fmt,
        block_n=fa3_tile(64)[1],
        q_descale=quant.dq[:, 0],
        k_descale=quant.dk[:, 0],
        v_descale=quant.dv.reshape(4, -1)[:, 0],
    )
    assert res.out.dtype == torch.bfloat16 and torch.equal(res.out, want.out) and torch.equal(res.probs, want.probs)
    s = (quant.q8.double() @ quant.k8.double().transpose(-1, -2)).float() * (
        quant.dq[:, :1, None] * quant.dk[:, None, :1] * inp.scale
    )
    assert torch.equal(res.lse, torch.logsumexp(s.double(), dim=-1).float().reshape(-1))
