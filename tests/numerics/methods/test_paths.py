"""Attention paths against the real kernels: PyTorch's own scaled_dot_product_attention on
the CPU, MATH and FLASH_ATTENTION backends (torch.nn.attention.sdpa_kernel), and
hand-written eager attention. sdpa-math must match the MATH backend bit for bit; flash
stays within the bound its rounding points give (see flash_bound)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attncheck.config.run import Options
from attncheck.judge import diagnose_attention
from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.online import online_softmax
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths import flash as flash_path
from attncheck.registry import PATHS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def case(name: str, dt: torch.dtype, seed: int = 0):
    """q, k, v in ``dt``, the SDPA keyword arguments, and attncheck's prepare_inputs arguments."""
    g = torch.Generator().manual_seed(seed)
    b, h, hk, lq, lk, d = 2, 4, 4, 33, 47, 64
    sdpa, ours = {}, {}
    if name == "gqa":
        hk = 2
        sdpa["enable_gqa"] = True
    if name == "causal-rect":
        lq, lk = 20, 50
        sdpa["is_causal"] = ours["causal"] = True
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, d, generator=g)
    if name == "large-logits":  # q.k up to 2.2e5 before the 1/8 scale: fp16 eager overflows
        q[0, 0, 3] = 72.0
        k[0, 0, 5] = 47.75
    if name == "fully-masked":
        keep = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        keep[0, 0, :3] = False  # three queries that may attend to nothing
        sdpa["attn_mask"] = ours["mask"] = keep
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if name == "float-mask":
        m = torch.where(torch.rand(b, 1, lq, lk, generator=g) > 0.3, 0.0, -1e4)
        m[1, 0, 2, :] = float("-inf")  # a fully masked row through -inf
        sdpa["attn_mask"] = m.to(dt)  # SDPA takes a float mask in the query dtype
        ours["mask"] = m
    return q, k, v, sdpa, ours


CASES = ["random", "large-logits", "fully-masked", "gqa", "causal-rect", "float-mask"]


def run_path(path: str, q, k, v, dt, block: int = 512, device: str = "cpu", **ours):
    """P (b, h, lq, lk) and O (b, h, lq, dv) of one path over whole heads (one block)."""
    inp = prepare_inputs(q, k, v=v, **ours)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device(device), start_audit(inp)))
    pb = PATHS.get(path).function()(blk, dt, ["torch"], MethodParams(block=block))
    out = pb.cells[0][1]
    return out.probs.reshape(inp.score_shape), out.out.reshape(*inp.score_shape[:-1], v.shape[-1]), pb, blk


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(nan=-7.0), b.nan_to_num(nan=-7.0))


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", CASES)
def test_sdpa_math_matches_the_math_backend_bit_for_bit(name, dt):
    q, k, v, sdpa, ours = case(name, dt)
    with sdpa_kernel(SDPBackend.MATH):
        o_torch = F.scaled_dot_product_attention(q, k, v, **sdpa)
    mask = sdpa.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=dt).masked_fill(~mask, float("-inf"))  # as SDPA converts it
    _, p_torch = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, mask, 0.0, sdpa.get("is_causal", False), None, enable_gqa=sdpa.get("enable_gqa", False)
    )
    p, o, _, _ = run_path("sdpa-math", q, k, v, dt, **ours)
    assert o.dtype == dt and same(o, o_torch)
    assert same(p.to(dt), p_torch)  # the math backend returns its weights cast to the dtype
    assert not torch.isnan(o).any()  # _safe_softmax: fully masked rows are zeros, not NaN


def flash_kernel(q, k, v, sdpa):
    """PyTorch's CPU flash kernel: output and logsumexp (GQA expanded, bool masks converted, as SDPA does)."""
    if sdpa.get("enable_gqa"):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = sdpa.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, sdpa.get("is_causal", False), attn_mask=mask
    )


FLUSH_BELOW = -86.0  # PyTorch's vectorised CPU exp returns 0 below about -86.99 (AVX2, torch 2.13)


def flash_bound(
    p_eff: torch.Tensor, v: torch.Tensor, o_a: torch.Tensor, o_b: torch.Tensor, dt, d: int, s: torch.Tensor
) -> torch.Tensor:
    """Largest |O_a - O_b| two faithful computations of the flash recurrence may show, per element.

    Both compute S from the same dtype inputs in fp32 (d-term sums in any order: |dS| <=
    2 d u32 sum|q_i k_i|), exps within a few fp32 ulp (PyTorch's vectorised exp_u20 against
    libm), the fp32 row sum and output over T keys in any order, and P rounded to the dtype
    (where the two exps differ, P may round to a neighbouring value: 2 u_dtype relative),
    then O rounded to the dtype (one ulp apart at most). The kernel's vectorised exp gives 0
    where S - m is below about -87, where exp rounded once to fp32 gives a subnormal or barely
    normal value: those keys' terms may be missing from one side entirely. So, with s the
    fp32 scores (to find those keys),
    |dO| <= ulp_dtype(|O|) + ((2d + T + 64) u32 + 2 u_dtype) sum_j p_j |v_j|
            + sum_{j: s_j - max s < -86} p_j |v_j|.
    A wrong scale, mask, block rescale or order of masking breaks it by orders of magnitude.
    """
    u32, ud = 2.0**-24, torch.finfo(dt).eps / 2
    t = p_eff.shape[-1]
    weight = torch.matmul(p_eff.double(), v.double().abs())  # sum_j p_j |v_j|
    s = s.double()
    flushable = (s - s.amax(dim=-1, keepdim=True)) < FLUSH_BELOW
    absolute = torch.matmul(p_eff.double() * flushable, v.double().abs())  # sum over keys the kernel may flush
    mag = torch.maximum(o_a.double().abs(), o_b.double().abs()).clamp_min(torch.finfo(dt).tiny)
    ulp = torch.finfo(dt).eps * torch.exp2(torch.floor(torch.log2(mag)))
    return ulp + weight * ((2 * d + t + 64) * u32 + (2 * ud if dt != torch.float32 else 0.0)) + absolute


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", CASES)
def test_flash_matches_pytorchs_cpu_flash_kernel_within_its_bound(name, dt):
    q, k, v, sdpa, ours = case(name, dt)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o_sdpa = F.scaled_dot_product_attention(q, k, v, **sdpa)
    o_kernel, lse_kernel = flash_kernel(q, k, v, sdpa)
    assert same(o_sdpa, o_kernel)  # the backend SDPA picks is that kernel
    p, o, pb, blk = run_path("flash", q, k, v, dt, block=512, **ours)  # the CPU kernel's key block
    vv = blk.v.reshape(*o.shape[:-2], v.shape[-2], v.shape[-1]).to(dt)
    assert not torch.isnan(o).any()
    diff = (o.double() - o_kernel.double()).abs()
    s = pb.scores.reshape(p.shape).double()
    assert bool((diff <= flash_bound(p, vv, o, o_kernel, dt, q.shape[-1], s)).all()), float(diff.max())
    assert bool((o_kernel[~live(p)] == 0).all() and (o[~live(p)] == 0).all())  # fully masked rows: zeros in both
    if dt == torch.float32:  # the running max and sum, through the kernel's logsumexp
        lse = torch.logsumexp(s, dim=-1)
        qk = torch.matmul(
            q.double().abs(),
            (k if not sdpa.get("enable_gqa") else k.repeat_interleave(2, dim=1)).double().abs().transpose(-1, -2),
        )
        u32 = 2.0**-24  # |dS| <= 2 d u32 sum|q_i k_i| scale; the sum of T exps in any order, the exp a few ulp
        bound = 2 * q.shape[-1] * u32 * float(qk.max()) / 8 + (p.shape[-1] + 64) * u32
        ok = torch.isfinite(lse)
        assert float((lse[ok] - lse_kernel.double()[ok]).abs().max()) <= bound


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_flash_bound_holds_where_the_kernel_flushes_exps_to_zero(dt):
    """Keys whose scores are 80 to 100 below the row max, and V zero at the max: O is the sum of
    those keys' terms alone. Exp rounded once to fp32 keeps them (subnormal below -87.3); the
    kernel's vectorised exp returns 0 below about -87. Its absolute term keeps the bound true."""
    d, t = 64, 64
    q = torch.zeros(1, 1, 4, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, t, d)
    k[0, 0, :, 0] = (
        torch.cat([torch.zeros(1), -torch.linspace(80.0, 100.0, t - 1)]) * 8
    )  # S = key 0's 0, then -80 ... -100 (scale 1/8)
    v = torch.ones(1, 1, t, d)
    v[0, 0, 0] = 0.0
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    o_kernel, _ = flash_kernel(q, k, v, {})
    p, o, pb, blk = run_path("flash", q, k, v, dt, block=512)
    s = pb.scores.reshape(p.shape).double()
    vv = blk.v.reshape(*o.shape[:-2], t, d).to(dt)
    diff = (o.double() - o_kernel.double()).abs()
    assert bool((diff <= flash_bound(p, vv, o, o_kernel, dt, d, s)).all()), float(diff.max())
    if dt == torch.float32:  # ours keeps every term: O = sum_j exp(S_j) (fp32, subnormals included) / l
        exact = torch.exp(s[0, 0, 0, 1:]).float().double().sum()
        assert float(o[0, 0, 0, 0]) == pytest.approx(float(exact), rel=1e-5)


def test_flash_cell_is_the_online_softmax_written_out():
    """The flash cell's effective probabilities, recomputed from the rounding points stated in
    docs/reference/numerics.md with numpy float32 and Python's float64 exp: bit for bit."""
    g = torch.Generator().manual_seed(3)
    block = 64
    for dt in DTYPES:
        q = torch.randn(1, 2, 8, 32, generator=g) * 2
        k, v = torch.randn(1, 2, 150, 32, generator=g) * 2, torch.randn(1, 2, 150, 32, generator=g)
        k[0, 1, 64:128] -= 40.0  # a block far below the running max: P_j near 0
        p, _, pb, _ = run_path("flash", q.to(dt), k.to(dt), v.to(dt), dt, block=block)
        s = pb.scores.float().numpy()  # (rows, 150) fp32 S, as the path computed it
        assert np.array_equal(p.reshape(s.shape).numpy(), online_written_out(s, dt, block))


def online_written_out(s: np.ndarray, p_dtype: torch.dtype, block: int) -> np.ndarray:
    """Per row, per key block in order: m_j = max(m_{j-1}, max S_j); e = exp(S - m_j) (the
    subtraction in fp32, exp in float64 rounded once to fp32); the block's sum as a halving tree
    in fp32; l_j = fp32(fp32(exp(m_{j-1} - m_j) l_{j-1}) + sum_j); P_j = e rounded to p_dtype;
    p = fp32(P_j fp32(exp(m_j - m_final) / l))."""
    f32 = np.float32
    rows, n = s.shape
    out = np.zeros((rows, n), dtype=f32)
    for r in range(rows):
        m_prev, l, parts = f32(-np.inf), f32(0), []
        for j0 in range(0, n, block):
            sb = s[r, j0 : j0 + block]
            m = max(m_prev, sb.max())
            e = np.array([f32(math.exp(float(f32(x - m)))) for x in sb], dtype=f32)
            tree = np.concatenate([e, np.zeros((1 << (block - 1).bit_length()) - len(e), dtype=f32)])
            while len(tree) > 1:
                tree = (tree[: len(tree) // 2] + tree[len(tree) // 2 :]).astype(f32)
            decay = f32(0) if m_prev == -np.inf else f32(math.exp(float(f32(m_prev - m))))
            l = f32(f32(decay * l) + tree[0])
            parts.append((j0, m, e))
            m_prev = m
        inv = f32(f32(1) / l)
        for j0, m, e in parts:
            pj = e if p_dtype == torch.float32 else torch.from_numpy(e).to(p_dtype).float().numpy()
            out[r, j0 : j0 + len(e)] = pj * f32(f32(math.exp(float(f32(m - m_prev)))) * inv)
    return out


CUDA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available: GPU test skipped")
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", list(CUDA_BACKENDS))
@pytest.mark.parametrize("name", CASES)
def test_paths_on_cuda_match_the_cuda_kernels(name, backend, dt):
    """On the GPU, the flash path (computed there) against SDPA's CUDA flash and efficient
    kernels, and the sdpa-math path against the CUDA MATH backend, within flash_bound plus
    the error of folding the scale into exp2 (|S| scale log2(e) u32 in the exponent)."""
    q, k, v, sdpa, ours = case(name, dt)
    sdpa = {key: (val.cuda() if isinstance(val, torch.Tensor) else val) for key, val in sdpa.items()}
    try:
        with sdpa_kernel(CUDA_BACKENDS[backend]):
            o_kernel = F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), **sdpa)
    except RuntimeError as e:  # e.g. the flash kernel takes no attn_mask
        pytest.skip(f"SDPA's CUDA {backend} backend does not run the {name} case: {str(e).splitlines()[0]}")
    path = "sdpa-math" if backend == "math" else "flash"
    p, o, pb, blk = run_path(
        path, q, k, v, dt, block=128, device="cuda", **ours
    )  # inputs read on the CPU, computed on the GPU
    assert o.device.type == "cuda"
    vv = blk.v.reshape(*o.shape[:-2], v.shape[-2], v.shape[-1]).to(dt)
    p, o, o_kernel, vv = p.cpu(), o.cpu(), o_kernel.cpu(), vv.cpu()
    alive = live(p)
    o_kernel = torch.where(alive[..., None], o_kernel, 0)  # fully masked rows: kernels differ (0 or NaN); ours are 0
    s = pb.scores.reshape(p.shape).double().cpu()
    exp_arg = (s.abs().amax(dim=-1) * math.log2(math.e) * 2.0**-24 * 4).nan_to_num(posinf=0.0)  # per row
    weight = torch.matmul(p.double(), vv.double().abs())
    bound = flash_bound(p, vv, o, o_kernel, dt, q.shape[-1], s) + weight * exp_arg[..., None]
    diff = (o.double() - o_kernel.double()).abs()
    assert bool((diff[alive] <= bound[alive]).all()), float(diff.max())


def live(p: torch.Tensor) -> torch.Tensor:
    """Rows with some probability (not fully masked)."""
    return p.sum(dim=-1) > 0


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flash_rounds_p_where_the_kernel_does(dt):
    """With V the identity, O = P: the kernel's own probabilities. Ours equal them on nearly
    every entry (the rest one or two ulp apart, where the two exps round differently); the same
    recurrence without rounding P to the dtype before P@V matches far fewer: the rounding point
    is real, and ours is where the kernel's is."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 48, 64, generator=g).to(dt), torch.randn(2, 2, 64, 64, generator=g).to(dt)
    v = torch.eye(64).to(dt).expand(2, 2, 64, 64).contiguous()
    p_kernel, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    _, p_ours, pb, blk = run_path("flash", q, k, v, dt)
    s = pb.scores.reshape(4, 48, 64)
    p_unrounded = online_softmax(s, torch.float32, 512).to(dt).reshape(p_kernel.shape)  # V is the identity: O = P
    ulp = torch.finfo(dt).eps * torch.exp2(torch.floor(torch.log2(p_kernel.double().abs().clamp_min(1e-30))))
    assert float(((p_ours.double() - p_kernel.double()).abs() / ulp).max()) <= 2
    assert float((p_ours == p_kernel).double().mean()) >= 0.9
    assert float((p_unrounded == p_kernel).double().mean()) <= 0.8


def test_flash_blocks_forward_and_reverse_give_the_same_numbers_in_fp32_up_to_rounding():
    q, k, v, _, _ = case("random", torch.float32)
    _, fwd, _, _ = run_path("flash", q, k, v, torch.float32, block=16)
    inp = prepare_inputs(q, k, v=v)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    rev = (
        flash_path.forward(blk, torch.float32, [], MethodParams(block=16, reverse=True))
        .cells[0][1]
        .out.reshape(fwd.shape)
    )
    exact = torch.softmax(torch.matmul(q.double(), k.double().transpose(-1, -2)) / 8, -1) @ v.double()
    for o in (fwd, rev):
        assert float((o.double() - exact).abs().max()) < 2e-6


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_eager_is_hand_written_attention(dt):
    """The eager path against the code people write (Hugging Face eager style) with torch ops
    in the dtype: bit for bit, scores, P and O."""
    q, k, v, _, _ = case("random", dt)
    mask = torch.zeros(q.shape[-2], k.shape[-2]).masked_fill(
        torch.rand(q.shape[-2], k.shape[-2]) > 0.7, torch.finfo(dt).min
    )
    w = torch.matmul(q, k.transpose(2, 3)) * (1 / math.sqrt(q.shape[-1])) + mask.to(dt)
    p_ref = torch.softmax(w, dim=-1)
    o_ref = torch.matmul(p_ref, v)
    p, o, pb, _ = run_path("eager", q, k, v, dt, mask=mask.double())
    assert torch.equal(pb.scores.reshape(w.shape), w) and torch.equal(p, p_ref) and torch.equal(o, o_ref)


def test_the_issue_example_no_sdpa_backend_gives_nan_but_eager_fp16_does():
    """q, k (1, 2, 16, 64) with one q row at 72 and one k row at 47.75 (q.k = 220,000 before
    the 1/8 scale): SDPA's MATH and FLASH backends give no NaN row; hand-written fp16 does."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
    q[0, 0, 3], k[0, 0, 5] = 72.0, 47.75
    q, k, v = q.half(), k.half(), v.half()
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            assert not torch.isnan(F.scaled_dot_product_attention(q, k, v)).any()
    hand = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / 8, -1) @ v
    assert torch.isnan(hand).any()
    d = diagnose_attention("x", prepare_inputs(q, k, v=v), Options(dtypes=("fp16",), methods=("torch",)))
    nan = {c.name: c.nan_rows for c in d.cells}
    assert nan == {"eager:torch/fp16": 1, "sdpa-math/fp16": 0, "flash/fp16": 0}
    assert nan["eager:torch/fp16"] == int(torch.isnan(hand).any(-1).sum())
    f = next(f for f in d.findings if f.code == "qk_overflow")
    assert (
        "by path: eager overflows (S in fp16), sdpa-math does not (S in fp32, from q and k each scaled by "
        "sqrt(scale)), flash does not (S in fp32 registers)" in f.message
    )


def test_output_metrics_against_an_independent_float64_computation():
    q, k, v, _, _ = case("random", torch.bfloat16)
    d = diagnose_attention("x", prepare_inputs(q, k, v=v), Options(dtypes=("bf16",), methods=("torch",)))
    exact = torch.softmax(torch.matmul(q.double(), k.double().transpose(-1, -2)) / 8, -1) @ v.double()
    _, o, _, _ = run_path("flash", q, k, v, torch.bfloat16, block=128)
    diff = o.double() - exact
    c = d.cell("flash", "bf16")
    assert c.out_rows == exact.shape[0] * exact.shape[1] * exact.shape[2] and c.out_nan_rows == 0
    assert c.out_max_abs_err == pytest.approx(float(diff.abs().max()), rel=1e-12)
    assert c.out_rmse == pytest.approx(float(diff.pow(2).mean().sqrt()), rel=1e-9)
    assert c.out_rel_l1 == pytest.approx(float(diff.abs().sum() / exact.abs().sum()), rel=1e-9)
    cos = (o.double() * exact).sum(-1) / (o.double().norm(dim=-1) * exact.norm(dim=-1))
    assert c.out_cos_min == pytest.approx(float(cos.min()), rel=1e-12)
    assert c.out_cos_mean == pytest.approx(float(cos.mean()), rel=1e-9)
    # The bias leaves out V's cast: against float64 softmax of flash's fp32 scores times V in bf16.
    s32 = torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.125  # 1/sqrt(64): exact in fp32
    own = torch.softmax(s32.double(), -1) @ v.double()
    assert c.out_bias == pytest.approx(float((o.double() - own).mean()), rel=1e-3)
    assert c.tied_rows == 0 and c.out_bias_tied is None and c.out_bias_tied_z is None


def test_tied_maxima_and_their_bias_against_an_independent_count():
    """Eight identical keys dominate every row: their scores tie the row max exactly, in every
    path; the tied rows' bias is the mean of each row's mean signed error, its z over rows."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    k[..., 1:8, :] = k[..., :1, :]
    q = q + 2 * k[..., :1, :]
    v = v - 0.5
    d = diagnose_attention("x", prepare_inputs(q, k, v=v), Options(dtypes=("bf16",), methods=("torch",)))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    s32 = torch.matmul(qb.float(), kb.float().transpose(-1, -2)) / math.sqrt(32)
    assert bool(((s32 == s32.amax(-1, keepdim=True)).sum(-1) >= 8).all())
    c = d.cell("flash", "bf16")
    assert c.tied_rows == 128
    _, o, _, _ = run_path("flash", qb, kb, vb, torch.bfloat16, block=128)
    own = torch.softmax(s32.double(), -1) @ vb.double()
    e = (o.double() - own).mean(-1).reshape(-1)  # each row's mean signed error
    assert c.out_bias_tied == pytest.approx(float(e.mean()), rel=1e-3)
    assert c.out_bias_tied_z == pytest.approx(float(e.mean() / (e.std() / math.sqrt(e.numel()))), rel=1e-3)
