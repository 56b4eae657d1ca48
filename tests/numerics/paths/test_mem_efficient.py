"""The mem-efficient path against an independent float64 re-implementation of the rounding
points its docstring states (PyTorch's CUTLASS kernel_forward.h): numpy float64 with an explicit
rounding to fp32 or the dtype at each point, one row at a time, written from the kernel's source
and not from the module. O, LSE and the effective probabilities are compared bit for bit (the two
share only the stated assumptions: each MMA's exact sum rounded once, exp2/log correctly rounded)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths.base import CallFacts
from attncheck.numerics.paths.mem_efficient import PATH, kernel_rows, supports, tiles

LOG2E32 = float(np.float32(1.4426950408889634074))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def r32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def rdt(x, dt):
    """fp32 values rounded to the dtype, ties to even (bf16 on the fp32 bit pattern)."""
    x = r32(x)
    if dt == "fp32":
        return x
    if dt == "fp16":
        return x.astype(np.float16).astype(np.float64)
    b = np.atleast_1d(x.astype(np.float32)).view(np.uint32).astype(np.uint64)
    finite = np.isfinite(np.atleast_1d(x))
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = np.where(finite, rounded.view(np.float32).astype(np.float64), np.atleast_1d(x))
    return out.reshape(np.shape(x))


def ref_row(q, k, v, scale, bias, masked, dt, bn, rf, limit=None):
    """One query row (q (d,), k (Tk, d), v (Tk, dv)) as the kernel computes it -> (O, LSE, p_eff)."""
    tk = k.shape[0]
    s = r32(k @ q)  # the MMA's exact sum, rounded once (assumed)
    s = r32(s * float(np.float32(scale)))  # accum = p.scale * accum
    if bias is not None:
        s = r32(s + bias)  # bias loaded in the dtype, added in fp32
    if masked is not None:
        s = np.where(masked, -np.inf, s)  # causal: -inf after the bias
    x = r32(s * LOG2E32)  # times kLog2e
    nb = max(1, -(-tk // bn))
    limit = tk if limit is None else limit
    mi, sp = -np.inf, 0.0
    acc = np.zeros(v.shape[1])
    ps, rescales = [], []
    for j in range(nb):
        if j * bn >= limit:  # the causal kernel's loop stops at the diagonal
            ps.append(np.zeros(bn))
            rescales.append(1.0)
            continue
        xb = np.full(bn, -np.inf)
        n_here = min(bn, tk - j * bn)
        xb[:n_here] = x[j * bn : j * bn + n_here]
        finite_or_inf = xb[~np.isnan(xb)]
        bmax = finite_or_inf.max() if finite_or_inf.size else -np.inf
        new = max(mi, bmax)
        changed = mi < new
        resc = float(r32(np.exp2(r32(mi - new)))) if changed else 1.0
        if changed:
            sp = float(r32(sp * resc))
        mu = 0.0 if (not changed and new == -np.inf) else new
        e = r32(np.exp2(r32(xb - mu)))
        e[n_here:] = 0.0
        for w in range(bn // 32):  # per warp column: 4 lanes of a quad, 8 values each
            lanes = []
            for lane in range(4):
                t = 0.0
                for mma_n in range(4):
                    for c in range(2):
                        t = float(r32(t + e[w * 32 + mma_n * 8 + 2 * lane + c]))
                lanes.append(t)
            ws = float(r32(r32(lanes[0] + lanes[1]) + r32(lanes[2] + lanes[3])))
            sp = float(r32(sp + ws))
        mi = new
        p = rdt(e, dt)  # accumToSmem: P in the dtype
        ps.append(p)
        rescales.append(resc)
        pv = p[:n_here] @ v[j * bn : j * bn + n_here]
        if rf:
            acc = r32(r32(acc * resc) + pv) if j else r32(pv)
        else:
            pv32 = r32(pv)
            last = (j + 1) * bn >= limit
            alpha = float(r32(1.0 / (1.0 if sp == 0 else sp))) if last else 1.0
            if j == 0:
                acc = r32(alpha * pv32)
            else:
                beta = float(r32(alpha * resc))
                acc = r32(alpha * pv32 + r32(beta * acc))
    denom = 1.0 if sp == 0 else sp
    if rf:
        o = rdt(r32(float(r32(1.0 / denom)) * acc), dt)
    else:
        o = rdt(acc, dt)
    lse = float(r32(r32(mi / LOG2E32) + r32(np.log(sp))))
    later = 1.0
    peff = np.zeros(nb * bn)
    for j in range(nb - 1, -1, -1):
        peff[j * bn : (j + 1) * bn] = ps[j] * later
        later *= rescales[j]
    return o, lse, r32(peff[:tk] / denom)


def reference(q, k, v, scale, dt, bias=None, masked=None, bn=64, rf=True, limit=None):
    """(n, tq, d) float64 arrays -> O (r, dv), LSE (r,), p_eff (r, Tk), row by row."""
    n, tq, _ = q.shape
    outs, lses, ps = [], [], []
    with np.errstate(all="ignore"):
        for h in range(n):
            for i in range(tq):
                row = h * tq + i
                o, lse, p = ref_row(
                    q[h, i],
                    k[h],
                    v[h],
                    scale,
                    None if bias is None else bias[h, i],
                    None if masked is None else masked[h, i],
                    dt,
                    bn,
                    rf,
                    None if limit is None else int(limit[row]),
                )
                outs.append(o)
                lses.append(lse)
                ps.append(p)
    return np.stack(outs), np.array(lses), np.stack(ps)


def inputs(dt, n, tq, tk, d, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    t = DTYPES[dt]
    q = (torch.randn(n, tq, d, generator=g) * spread).to(t).double()
    k = (torch.randn(n, tk, d, generator=g) * spread).to(t).double()
    v = torch.randn(n, tk, d, generator=g).to(t).double()
    return q, k, v


def assert_same(kr, ref, dt):
    o, lse, p = ref
    got_o = kr.out.double().numpy()
    np.testing.assert_array_equal(got_o, o)
    np.testing.assert_array_equal(kr.lse.double().numpy(), lse)
    np.testing.assert_array_equal(kr.probs.double().numpy(), p)
    assert kr.out.dtype == DTYPES[dt]


def test_tiles_follow_cutlassF():
    assert tiles(64, 64) == (64, 64, True)
    assert tiles(128, 128) == (64, 128, True)
    assert tiles(256, 256) == (32, 128, False)  # the gmem kernel: the global fp32 accumulator
    assert tiles(64, 128) == (64, 128, True)  # kMaxK covers max(d, dv)
    assert tiles(128, 128, (7, 5)) == (32, 128, True)


TILE_EDGES = [(64, 63), (64, 64), (64, 65), (128, 128), (128, 129), (128, 192), (256, 127), (256, 128), (256, 257)]


@pytest.mark.parametrize("dt", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("d,tk", TILE_EDGES)
def test_random_bit_exact(dt, d, tk):
    q, k, v = inputs(dt, 2, 3, tk, d, seed=d + tk, spread=1.5)
    scale = d**-0.5
    _, bn, rf = tiles(d, d)
    kr = kernel_rows(q, k, v, scale=scale, dt=DTYPES[dt])
    assert_same(kr, reference(q.numpy(), k.numpy(), v.numpy(), scale, dt, bn=bn, rf=rf), dt)


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_float_mask_large_negative_and_empty_rows(dt):
    d, tk = 64, 130
    q, k, v = inputs(dt, 2, 4, tk, d, seed=3, spread=2.0)
    t = DTYPES[dt]
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(2, 4, tk, generator=g).to(t)
    bias[0, 0, :100] = torch.finfo(t).min  # large negative, finite: still in the softmax
    bias[0, 1, 64:] = -1e4
    bias[1, 2, :] = float("-inf")  # a fully masked row
    bias[1, 3, :70] = float("-inf")  # the first key block empty, the rest not
    kr = kernel_rows(q, k, v, scale=d**-0.5, dt=t, bias=bias)
    ref = reference(q.numpy(), k.numpy(), v.numpy(), d**-0.5, dt, bias=bias.double().numpy(), bn=64)
    assert_same(kr, ref, dt)
    row = 1 * 4 + 2  # the empty row: O = 0 (denom 1, accumulator 0), LSE = -inf + log(0) = -inf
    assert torch.equal(kr.out[row].float(), torch.zeros(d))
    assert kr.lse[row].item() == float("-inf")
    assert torch.isfinite(kr.out).all() and torch.isfinite(kr.lse[torch.arange(8) != row]).all()


@pytest.mark.parametrize("dt,d", [("fp16", 64), ("bf16", 128), ("fp32", 256)])
def test_causal_tq_ne_tk(dt, d):
    tq, tk = 5, 200
    q, k, v = inputs(dt, 1, tq, tk, d, seed=7)
    # top-left causal (the kernel's CausalFromTopLeft): key j of query i masked where j > i + 150
    masked = (torch.arange(tk)[None, :] > torch.arange(tq)[:, None] + 150)[None]
    _, bn, rf = tiles(d, d)
    kr = kernel_rows(q, k, v, scale=d**-0.5, dt=DTYPES[dt], masked=masked)
    assert_same(kr, reference(q.numpy(), k.numpy(), v.numpy(), d**-0.5, dt, masked=masked.numpy(), bn=bn, rf=rf), dt)


def test_causal_key_loop_stops_at_the_diagonal_with_the_global_buffer():
    d, tq, tk = 256, 4, 300
    q, k, v = inputs("bf16", 1, tq, tk, d, seed=11)
    masked = (torch.arange(tk)[None, :] > torch.arange(tq)[:, None] + 100)[None]
    limit = torch.full((tq,), 132)  # the query tile's diagonal: later blocks are never visited
    kr = kernel_rows(q, k, v, scale=d**-0.5, dt=torch.bfloat16, masked=masked, key_limit=limit)
    ref = reference(
        q.numpy(), k.numpy(), v.numpy(), d**-0.5, "bf16", masked=masked.numpy(), bn=128, rf=False, limit=limit.numpy()
    )
    assert_same(kr, ref, "bf16")


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_forward_gqa_bool_mask(dt):
    """The path's forward on a block: k and v with fewer heads (expanded per query head), a
    boolean mask (SDPA makes it 0/-inf in the dtype) with one fully masked row."""
    t = DTYPES[dt]
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 3, 64, generator=g).to(t)
    k = torch.randn(1, 2, 96, 64, generator=g).to(t)
    v = torch.randn(1, 2, 96, 64, generator=g).to(t)
    keep = torch.rand(1, 1, 3, 96, generator=g) > 0.3
    keep[..., 1, :] = False
    inp = prepare_inputs(q, k, keep.expand(1, 4, 3, 96), v=v)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    pb = PATH.function()(blk, t, [], MethodParams())
    ((name, out),) = pb.cells
    assert name == "mem-efficient"
    kx, vx = k.double().repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)
    bias = torch.where(keep, 0.0, float("-inf")).expand(1, 4, 3, 96).reshape(4, 3, 96).numpy()
    o, _, p = reference(q.double()[0].numpy(), kx[0].numpy(), vx[0].numpy(), 64**-0.5, dt, bias=bias, bn=64)
    np.testing.assert_array_equal(out.out.double().numpy(), o)
    np.testing.assert_array_equal(out.probs.double().numpy(), p)
    assert torch.equal(out.out.reshape(4, 3, 64)[:, 1].float(), torch.zeros(4, 64))  # fully masked: zeros


def test_issue_121558_bf16_133120_is_finite():
    """bf16 Q, K, V all 133120 (PyTorch issue 121558): NaN from the fused-FMA flash kernel,
    finite from the efficient kernel, whose max subtraction is exact at the row max."""
    x = torch.full((1, 2, 8, 64), 133120.0).to(torch.bfloat16)
    inp = prepare_inputs(x, x, v=x)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    out = PATH.function()(blk, torch.bfloat16, [], MethodParams()).cells[0][1]
    assert torch.isfinite(out.out).all()
    assert torch.equal(out.out.float(), torch.full((16, 64), 133120.0))
    assert not out.events["exp_overflow"].any()


def test_log2e_overflow_is_an_event():
    """A finite scaled score above FLT_MAX / log2(e): times kLog2e it is inf, the row max inf,
    exp2f(inf - inf) NaN; a row below it stays finite."""
    q = torch.full((1, 2, 4), 8e18, dtype=torch.float64)
    q[0, 1] = 1.0
    k = torch.full((1, 8, 4), 8e18, dtype=torch.float64)
    kr = kernel_rows(q, k, k, scale=1.0, dt=torch.float32)
    assert torch.isfinite(kr.scores[0]).all()  # 2.56e38 < FLT_MAX
    assert kr.events["log2e_overflow"].tolist() == [True, False]
    assert torch.isnan(kr.out[0]).all() and torch.isfinite(kr.out[1]).all()


def test_supports():
    ok = CallFacts(dtype="bf16", head_dim=256, head_dim_v=256, tq=10, tk=10, dropout=0.1)
    assert supports(ok) is None  # dropout: run by the kernel (not emulated)
    assert supports(CallFacts(dtype="fp32", head_dim=4, head_dim_v=4, tq=1, tk=1)) is None
    assert "e4m3" in supports(CallFacts(dtype="e4m3", head_dim=64, head_dim_v=64, tq=1, tk=1))
    assert "multiples of 8" in supports(CallFacts(dtype="fp16", head_dim=60, head_dim_v=60, tq=1, tk=1))
    assert "sm80" in supports(CallFacts(dtype="bf16", head_dim=64, head_dim_v=64, tq=1, tk=1, capability=(7, 5)))
    assert "sm50" in supports(CallFacts(dtype="fp16", head_dim=64, head_dim_v=64, tq=1, tk=1, capability=(3, 7)))
    assert "grouped" in supports(CallFacts(dtype="fp16", head_dim=64, head_dim_v=64, tq=1, tk=1, gqa=True))
    assert PATH.why_not(ok) is None


def test_module_imports_without_torch():
    code = "import sys, attncheck.numerics.paths.mem_efficient as m; m.PATH; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
