"""The cudnn path against an independent float64 write-out of its stated (assumed) rounding points,
and its padded-tile hazard against the published repros: PyTorch issue 196678 (keys: L % 128 == 64,
an explicit mask, every logit about -120) and cudnn-frontend issue 1072 (queries: Sq = 1, Sk = 128,
logits shifted by -128). Each repro is predicted NaN under cudnn while its forward is finite and its
float64 autograd gradients are finite: the NaN is the kernel's, not the input's."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths import cudnn
from tests.numerics.rounding import nearest

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
FORMAT = {torch.float32: (24, -126, 127), torch.float16: (11, -14, 15), torch.bfloat16: (8, -126, 127)}
F32_MAX = float(torch.finfo(torch.float32).max)
LN_F32_MAX = math.log(F32_MAX)  # 88.7228...: the threshold, from finfo, not from the module


def f32(x: float) -> float:
    """x rounded once to float32 (numpy's float64 -> float32 cast, round to nearest even)."""
    return float(np.float32(x))


def written_out(s: np.ndarray, v: np.ndarray | None, dt: torch.dtype, tile: int = 128):
    """The stated rounding points, per row and per 128-key tile, in Python floats with explicit rounding:
    m_j = max(m_{j-1}, max S_j) (a max of -inf taken as 0 in the subtraction); e = f32(exp(f32(S - m)));
    the tile sum a halving tree in f32 (zero-padded to a power of two); l = f32(f32(decay l) + sum),
    decay = f32(exp(f32(m_{j-1} - m_j))) (0 for a first finite max); P_j = e rounded to dt;
    p = f32(P_j f32(f32(exp(f32(m_j - m_final))) f32(1 / l))) (1 / l = 1 where l is 0);
    LSE = f32(m_final + f32(log l)); O64 = sum p v (float64) with v in dt.
    Returns (p (rows, n) float32, lse (rows,) float32, O64 (rows, dv) float64 or None)."""
    rows, n = s.shape
    p = np.zeros((rows, n), dtype=np.float32)
    lse = np.zeros(rows, dtype=np.float32)
    for r in range(rows):
        m_prev, l, parts = -math.inf, 0.0, []
        for j0 in range(0, n, tile):
            sb = [float(x) for x in s[r, j0 : j0 + tile]]
            m = max([m_prev] + sb)
            ms = 0.0 if m == -math.inf else m
            e = [f32(math.exp(f32(x - ms))) if x != -math.inf else 0.0 for x in sb]
            width = 1 << (tile - 1).bit_length()
            tree = e + [0.0] * (width - len(e))
            while len(tree) > 1:
                h = len(tree) // 2
                tree = [f32(a + b) for a, b in zip(tree[:h], tree[h:])]
            decay = 0.0 if m_prev == -math.inf else f32(math.exp(f32(m_prev - ms)))
            l = f32(f32(decay * l) + tree[0])
            parts.append((j0, m, e))
            m_prev = m
        m_fin = 0.0 if m_prev == -math.inf else m_prev
        inv = 1.0 if l == 0 else f32(1.0 / l)
        for j0, m, e in parts:
            scale = 0.0 if m == -math.inf else f32(f32(math.exp(f32(m - m_fin))) * inv)
            pj = round_dt(np.array(e, dtype=np.float32), dt).astype(np.float64)
            p[r, j0 : j0 + len(e)] = (pj * scale).astype(np.float32)  # one product, rounded once to fp32
        lse[r] = -math.inf if l == 0 else f32(m_prev + f32(math.log(l)))
    o64 = None if v is None else np.einsum("rk,rkd->rd", p.astype(np.float64), v)
    return p, lse, o64


def round_dt(x: np.ndarray, dt: torch.dtype) -> np.ndarray:
    """float32 ``x`` rounded to ``dt`` (round to nearest even), as float32: numpy's half cast for fp16;
    for bf16 the float32 bits rounded to their top 16 (add 0x7FFF plus the kept last bit, truncate)."""
    if dt == torch.float32:
        return x
    if dt == torch.float16:
        return x.astype(np.float16).astype(np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def test_round_dt_is_the_exact_rounding():
    """The fast casts of the write-out against exact integer rounding (tests/numerics/rounding.py)."""
    x = np.random.default_rng(0).standard_normal(4000) * np.exp2(np.random.default_rng(1).integers(-30, 10, 4000))
    x = x.astype(np.float32)
    for dt in (torch.float16, torch.bfloat16):
        bits, emin, emax = FORMAT[dt]
        assert [float(y) for y in round_dt(x, dt)] == [nearest(float(y), bits, emin, emax) for y in x]


def dt_ulp(x: np.ndarray, dt: torch.dtype) -> np.ndarray:
    bits, emin, _ = FORMAT[dt]
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0**emin)))
    return 2.0 ** (e - bits + 1)


def scores_case(name: str, n: int, dt: torch.dtype, seed: int = 0):
    """fp32 scores (rows, n) with the features of ``name`` and v (rows, n, 64) in dt (as float64)."""
    g = torch.Generator().manual_seed(seed)
    rows = 4
    s = (torch.randn(rows, n, generator=g) * 3).float()
    if name == "masked":  # a boolean mask's -inf and a float mask's -1e4 side by side
        s[torch.rand(rows, n, generator=g) < 0.3] = -math.inf
        s[1, : n // 2] += -1e4
    if name == "fully-masked":
        s[2] = -math.inf
        s[3, :-1] = -math.inf  # one key left
    if name == "far-tile":  # a tile far below the running max: P_j near 0, then a new max
        s[:, : min(n, 128)] -= 40.0
    if name == "causal":
        s = s.masked_fill(torch.ones(rows, n, dtype=torch.bool).triu(n - rows + 1), -math.inf)
    v = torch.randn(rows, n, 64, generator=g).to(dt).double()
    return s, v


CASES = ["random", "masked", "fully-masked", "far-tile", "causal"]


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [127, 128, 129, 192])
@pytest.mark.parametrize("name", CASES)
def test_softmax_rows_are_the_stated_rounding_points_written_out(name, n, dt):
    """probs and LSE bit for bit; O within the fp32 accumulation bound plus the dtype's rounding."""
    s, v = scores_case(name, n, dt, seed=n)
    probs, out, lse = _rows(s, v, dt)
    p_ref, lse_ref, o64 = written_out(s.numpy(), v.numpy(), dt)
    assert np.array_equal(probs.numpy(), p_ref)
    assert np.array_equal(lse.numpy(), lse_ref)
    o = out.double().numpy()
    acc = n * 2.0**-24 * np.einsum("rk,rkd->rd", np.abs(p_ref.astype(np.float64)), np.abs(v.numpy()))
    bound = acc + dt_ulp(np.abs(o64) + acc, dt)  # fp32 accumulation, then one rounding to dt
    assert (np.abs(o - o64) <= bound).all()
    if name == "fully-masked":
        assert (o[2] == 0).all() and lse[2] == -math.inf


def _rows(s: torch.Tensor, v: torch.Tensor, dt: torch.dtype):
    """softmax_rows with one head per row: v (rows, n, dv) as (n=rows heads, Tk, dv), one query each."""
    return cudnn.softmax_rows(s, v.to(dt), dt)


def run_forward(q, k, v, dt, **ours):
    """The path's forward over whole heads (one block): (its cell, the block)."""
    inp = prepare_inputs(q, k, v=v, **ours)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    pb = cudnn.forward(blk, dt, ["torch"], MethodParams())
    assert pb.cells[0][0] == "cudnn"
    return pb, blk


FORWARD_CASES = [
    ("random", 64),
    ("random", 128),
    ("random", 256),
    ("gqa", 128),
    ("causal-rect", 64),
    ("bool-mask", 64),
    ("float-mask", 256),
]


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("name,d", FORWARD_CASES)
def test_forward_on_model_inputs_is_the_written_out_kernel(name, d, dt):
    """GQA, causal with Tq != Tk, boolean and float masks, head dims 64/128/256, Tk = 192 (% 128 == 64):
    the scores within the fp32 bound of float64 q.k (q, k in dt) times the scale plus the mask in dt,
    the probabilities bit for bit from those scores, O within its bound."""
    g = torch.Generator().manual_seed(d)
    b, h, hk, lq, lk = 1, 2, 2, 3, 192
    ours = {}
    if name == "gqa":
        h, hk = 4, 2
    if name == "causal-rect":
        ours["causal"] = True
    q, k = torch.randn(b, h, lq, d, generator=g), torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, 64, generator=g)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    mask64 = None
    if name == "bool-mask":
        keep = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        keep[0, 0, 1] = False  # a row with no key
        ours["mask"] = keep
        mask64 = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -math.inf)
    if name == "float-mask":
        mask64 = torch.where(torch.rand(b, 1, lq, lk, generator=g) > 0.3, 0.0, -1e4).double()
        ours["mask"] = mask64
        mask64 = mask64.to(dt).double()  # the mask as the model holds it in dt
    if name == "causal-rect":  # PyTorch's is_causal: tril aligned top left
        upper = torch.ones(lq, lk, dtype=torch.bool).triu(1)
        mask64 = torch.zeros(lq, lk, dtype=torch.float64).masked_fill(upper, -math.inf)
    pb, _ = run_forward(q, k, v, dt, **ours)
    scale = 1 / math.sqrt(d)
    kx = k.double().repeat_interleave(h // hk, dim=1)
    vx = v.double().repeat_interleave(h // hk, dim=1)
    s64 = (q.double() @ kx.transpose(-1, -2)) * f32(scale)
    absum = (q.double().abs() @ kx.abs().transpose(-1, -2)) * f32(scale)
    if mask64 is not None:
        s64 = s64 + mask64
    s32 = pb.scores.double().reshape(s64.shape)
    fin = torch.isfinite(s64)
    assert torch.equal(fin, torch.isfinite(s32))
    # fp32 accumulation of d products, the scale multiply, the mask add: each within these ulps
    bound = (d + 2) * 2.0**-24 * (absum + s64.abs().nan_to_num(posinf=0, neginf=0))
    assert ((s32 - s64).abs()[fin] <= bound[fin]).all()
    out = pb.cells[0][1]
    s = pb.scores.float()
    v_rows = vx.reshape(-1, 1, lk, 64).expand(-1, lq, -1, -1).reshape(-1, lk, 64).numpy()  # each row's V
    p_ref, _, o64 = written_out(s.numpy(), v_rows, dt)
    assert np.array_equal(out.probs.numpy(), p_ref)
    acc = lk * 2.0**-24 * np.einsum("rk,rkd->rd", np.abs(p_ref.astype(np.float64)), np.abs(v_rows))
    assert (np.abs(out.out.double().numpy() - o64) <= acc + dt_ulp(np.abs(o64) + acc, dt)).all()
    assert out.out.dtype == dt


def test_the_float64_reference_is_not_the_kernel():
    """The write-out can tell another tile from 128: a row whose max arrives in its second 64 keys
    gives other bits with 64-key tiles (so the bit-for-bit checks above can fail)."""
    s, v = scores_case("far-tile", 192, torch.bfloat16, seed=5)
    p128, _, _ = written_out(s.numpy(), v.numpy(), torch.bfloat16, tile=128)
    p64, _, _ = written_out(s.numpy(), v.numpy(), torch.bfloat16, tile=64)
    probs, _, _ = _rows(s, v, torch.bfloat16)
    assert np.array_equal(probs.numpy(), p128) and not np.array_equal(probs.numpy(), p64)


def float64_grads(q, k, v, bias, seed: int = 1):
    """dQ, dK, dV of softmax(q k^T / sqrt(d) + bias) v in float64 by torch.autograd, dO random."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.double()
    out = torch.softmax(s, dim=-1) @ v64
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q64.grad, k64.grad, v64.grad


def repro_196678(L: int = 704, D: int = 64, shift: bool = True, mask: str = "tril"):
    """PyTorch issue 196678's repro, built on the CPU (its RNG differs from the thread's CUDA draws, the
    construction is the thread's): q, k = randn * 0.1, v = randn in bf16, q[..., 0] = 1 and
    k[..., 0] = -120 sqrt(D) ("every logit ~ -120, so every row's logsumexp < -88.7"), a tril bool mask."""
    torch.manual_seed(0)
    q = torch.randn(1, 1, L, D, dtype=torch.bfloat16) * 0.1
    k = torch.randn(1, 1, L, D, dtype=torch.bfloat16) * 0.1
    v = torch.randn(1, 1, L, D, dtype=torch.bfloat16)
    if shift:
        q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)
    keep = torch.ones(L, L, dtype=torch.bool).tril() if mask == "tril" else torch.ones(L, L, dtype=torch.bool)
    bias = torch.zeros(L, L, dtype=torch.bfloat16).masked_fill(~keep, -math.inf)  # PyTorch's bool -> bias in dt
    return q, k, v, bias


def test_pytorch_196678_repro_is_predicted_nan_in_every_rows_dq():
    """L = 704 (% 128 == 64), an explicit mask, every LSE < -88.7: every row a hazard row (the thread:
    45056 = 704 x 64 non-finite grad_q elements), by the key form; the forward finite; float64 grads finite."""
    q, k, v, bias = repro_196678()
    r = cudnn.kernel_rows(q[0], k[0], v[0], scale=1 / 8, bias=bias[None], dt=torch.bfloat16)
    assert r.events["padded_tile"].all() and r.events["padded_key_tile"].all()
    assert not r.events["padded_query_tile"].any()
    assert torch.isfinite(r.out).all() and torch.isfinite(r.lse).all()
    # LSE about -120 + ln(i + 1) for row i: the tril mask leaves i + 1 keys of logit ~ -120
    expect = -120 + torch.log(torch.arange(1, 705, dtype=torch.float64))
    assert ((r.lse.double() - expect).abs() < 0.5).all()
    assert torch.allclose(r.margin, -LN_F32_MAX - r.lse.double())
    assert r.margin.min() > 24 and r.margin.max() < 32
    assert all(torch.isfinite(g).all() for g in float64_grads(q, k, v, bias))


@pytest.mark.parametrize(
    "L,mask,explicit,shift",
    [
        (640, "tril", True, True),  # "640 and 768 are clean"
        (768, "tril", True, True),
        (704, "tril", False, True),  # "0 with ... is_causal=True" (no mask tensor)
        (704, "tril", True, False),  # healthy logits: LSE near log of the key count
    ],
)
def test_pytorch_196678_controls_give_no_hazard_rows(L, mask, explicit, shift):
    q, k, v, bias = repro_196678(L, shift=shift, mask=mask)
    r = cudnn.kernel_rows(q[0], k[0], v[0], scale=1 / 8, bias=bias[None], dt=torch.bfloat16, explicit_mask=explicit)
    assert not r.events["padded_tile"].any()
    assert torch.isfinite(r.out).all()


def test_pytorch_196678_all_true_mask_fails_too():
    """ "an all-True mask fails too": every row, L = 192 as well as 704."""
    for L in (192, 704):
        q, k, v, bias = repro_196678(L, mask="all")
        r = cudnn.kernel_rows(q[0], k[0], v[0], scale=1 / 8, bias=bias[None], dt=torch.bfloat16)
        assert r.events["padded_tile"].all()


def repro_1072(sk: int = 128, shift: float = -128.0, seed: int = 0):
    """cudnn-frontend issue 1072's configuration: B = 1, Hq = Hkv = 2, Sq = 1, Sk = 128, D = 64, bf16,
    non-causal, no mask, logits shifted by -128 (the thread does not print its inputs: q, k randn with
    q[..., 0] = 1, k[..., 0] = shift sqrt(D), so each scaled logit is shift + q'.k' / 8)."""
    g = torch.Generator().manual_seed(seed)
    D = 64
    q = torch.randn(1, 2, 1, D, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2, sk, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, 2, sk, D, generator=g).to(torch.bfloat16)
    q[..., 0], k[..., 0] = 1.0, shift * math.sqrt(D)
    return q, k, v


def test_cudnn_frontend_1072_repro_is_predicted_nan_in_dk_dv():
    """Sq = 1, Sk = 128 (a full tile), no mask, LSE in the thread's -122.6 .. -122.3 (give or take the
    noise of other draws): both rows hazard rows by the query form; forward and float64 grads finite."""
    q, k, v = repro_1072()
    r = cudnn.kernel_rows(q[0], k[0], v[0], scale=1 / 8, bias=None, dt=torch.bfloat16)
    assert ((r.lse > -123.5) & (r.lse < -121.5)).all(), r.lse
    assert r.events["padded_tile"].all() and r.events["padded_query_tile"].all()
    assert not r.events["padded_key_tile"].any()
    assert torch.isfinite(r.out).all()
    assert all(torch.isfinite(g).all() for g in float64_grads(q, k, v, None))


@pytest.mark.parametrize("sk,shift", [(97, -128.0), (128, 0.0)])  # the thread's "--sk 97" and "--shift 0"
def test_cudnn_frontend_1072_controls_give_no_hazard_rows(sk, shift):
    q, k, v = repro_1072(sk, shift)
    r = cudnn.kernel_rows(q[0], k[0], v[0], scale=1 / 8, bias=None, dt=torch.bfloat16)
    assert not r.events["padded_tile"].any()


@pytest.mark.parametrize("tk", [127, 128, 129, 192, 320])
def test_healthy_inputs_give_no_hazard_rows(tk):
    """Random q, k, masked, Tk % 128 == 64 among them: LSE near log(Tk) > 0, far from -88.7."""
    g = torch.Generator().manual_seed(tk)
    q, k = torch.randn(2, 3, 64, generator=g), torch.randn(2, tk, 64, generator=g)
    v = torch.randn(2, tk, 64, generator=g)
    bias = torch.zeros(2, 3, tk).masked_fill(torch.rand(2, 3, tk, generator=g) < 0.3, -math.inf)
    for dt in (torch.float16, torch.bfloat16):
        r = cudnn.kernel_rows(q, k, v, scale=1 / 8, bias=bias, dt=dt)
        assert not r.events["padded_tile"].any() and (r.lse > 0).all()


def test_padded_tile_rows_threshold_and_margin():
    """Rows count where exp(0 - LSE) is inf in fp32 (from finfo: ln(FLT_MAX) = 88.7228...): -88.7228 is
    finite, -88.7229 overflows; no-key rows (-inf) and NaN do not count; the margin of LSE -121 is 32.28."""
    lse = torch.tensor([-88.7228, -88.7229, -121.0, 0.0, -math.inf, math.nan])
    assert math.exp(88.7228) < F32_MAX < math.exp(88.7229)
    rows = cudnn.padded_tile_rows(lse, tk=192, tq=192, explicit_mask=True)
    assert rows.tolist() == [False, True, True, False, False, False]
    assert not cudnn.padded_tile_rows(lse, tk=192, tq=192, explicit_mask=False).any()  # is_causal alone
    assert not cudnn.padded_tile_rows(lse, tk=200, tq=192, explicit_mask=True).any()  # remainder 72, not 64
    assert cudnn.padded_tile_rows(lse, tk=256, tq=1, explicit_mask=False).tolist() == rows.tolist()
    assert not cudnn.padded_tile_rows(lse, tk=256, tq=128, explicit_mask=False).any()
    # reported on sm90 (H100, H200) only: another recorded capability flags nothing, sm90 the same rows
    assert not cudnn.padded_tile_rows(lse, tk=192, tq=192, explicit_mask=True, capability=(8, 0)).any()
    assert cudnn.padded_tile_rows(lse, tk=192, tq=192, explicit_mask=True, capability=(9, 0)).tolist() == rows.tolist()
    assert abs(float(cudnn.lse_margin(torch.tensor([-121.0]))[0]) - (121.0 - LN_F32_MAX)) < 1e-9
    assert abs(float(cudnn.lse_margin(torch.tensor([-121.0]))[0]) - 32.28) < 0.01


def facts(**kw):
    from attncheck.numerics.paths.base import CallFacts

    base = {
        "dtype": "bf16",
        "head_dim": 128,
        "head_dim_v": 128,
        "tq": 704,
        "tk": 704,
        "mask": "explicit",
        "capability": (9, 0),
    }
    return CallFacts(**{**base, **kw})


@pytest.mark.parametrize(
    "kw,refused",
    [
        ({}, None),
        ({"dtype": "fp16", "capability": (8, 0)}, None),
        ({"dtype": "fp32"}, "fp16 and bf16 only"),  # check_dtypes_low_precision
        ({"dtype": "e4m3"}, "fp16 and bf16 only"),
        ({"capability": (7, 5)}, "sm80 to sm121"),  # check_cudnn_hardware_support
        ({"head_dim": 100, "head_dim_v": 100}, "multiples of 8"),  # check_cudnn_tensor_shapes
        ({"head_dim": 256, "head_dim_v": 256}, None),  # 256 on sm90 (cuDNN > 9.22)
        ({"head_dim": 256, "head_dim_v": 256, "capability": (8, 0)}, "up to 128"),
        ({"head_dim": 256, "head_dim_v": 256, "capability": None}, None),  # unknown device: the widest limit
        ({"head_dim": 264, "head_dim_v": 264}, "up to 256"),
        ({"dropout": 0.1}, "1/16"),  # check_cudnn_dropout
        ({"dropout": 0.125}, None),
        ({"tk": 1}, "key length of 1"),
        ({"dropout": 0.125, "tq": 1}, "query length of 1"),
        ({"softcap": 30.0}, "softcap"),
    ],
)
def test_supports_says_what_pytorchs_cudnn_backend_refuses(kw, refused):
    why = cudnn.supports(facts(**kw))
    assert (why is None) if refused is None else (refused in why)


def test_path_spec():
    from attncheck.numerics.paths.base import Stands

    p = cudnn.PATH
    assert p.name == "cudnn" and p.device == "cuda" and p.replay and not p.default
    assert p.assumed and "assumed" in p.assumed
    assert Stands("sdpa", "cudnn_attention", "cuda") in p.stands_for
    assert p.stands_for[0].matches("sdpa", "cudnn_attention", "cuda")
    assert not p.stands_for[0].matches("sdpa", "flash_attention", "cuda")
    assert p.function() is cudnn.forward
    assert p.why_not(facts(dtype="fp32"))
    import re

    assert len(re.findall(r"@[0-9a-f]{40} ", p.source)) == 2


def test_importing_the_module_does_not_import_torch():
    code = (
        "import sys, attncheck.numerics.paths.cudnn as c; assert 'torch' not in sys.modules, 'torch'; "
        "print(c.PATH.name)"
    )
    root = str(Path(__file__).resolve().parents[3])  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, cwd=root, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cudnn"


def test_forward_reports_the_hazard_rows_once_the_event_is_registered(monkeypatch):
    """The path's forward on the 196678 repro as a model call (bool mask): no event the registry does not
    know (MethodOutput's event_rows looks every name up), and every row once 'padded_tile' is known."""
    from attncheck.registry import EVENTS

    q, k, v, bias = repro_196678()
    keep = torch.isfinite(bias.float())
    pb, _ = run_forward(q, k, v, torch.bfloat16, mask=keep)
    assert set(pb.cells[0][1].events) <= set(EVENTS)
    monkeypatch.setitem(EVENTS, cudnn.EVENT, "overflow")
    pb, _ = run_forward(q, k, v, torch.bfloat16, mask=keep)
    out = pb.cells[0][1]
    assert out.events[cudnn.EVENT].all() and torch.isfinite(out.out).all()
