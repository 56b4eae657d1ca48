"""FP8 cells end to end: the tiled/e4m3 cell and the flash-fp8 path against FP8 attention
written out here block by block (FlashAttention-3's recurrence: exp2 with a max offset of
8, the row sum before the cast, reverse key blocks), the P-cast counts against a count made
here, and the FP8 findings on inputs built to trigger them (and not otherwise)."""

import math

import pytest
import torch

from attncheck import Options
from attncheck.errors import AttncheckError
from attncheck.judge import diagnose, diagnose_attention
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.numerics.methods.fp8_attention import fa3_tile, hadamard

E4M3 = torch.float8_e4m3fn


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(E4M3).float()


def fa3_rows(s: torch.Tensor, block: int, p_scale: float, reverse: bool, v: torch.Tensor | None = None):
    """FlashAttention-3's FP8 softmax over key blocks, written out: s (R, T) fp32 natural-log
    scores. Returns the weight each key gets in O, which keys the cast flushed, and O (with v)."""
    r, t = s.shape
    order = list(range(0, t, block))
    if reverse:
        order = order[::-1]
    m = torch.full((r, 1), float("-inf"))
    l = torch.zeros(r, 1)
    acc = None if v is None else torch.zeros(r, v.shape[-1])
    kept, seen = {}, {}
    offset = math.log2(p_scale)
    for j in order:
        sj = s[:, j : j + block]
        m_new = torch.maximum(m, sj.amax(dim=-1, keepdim=True))
        scale_o = torch.exp2((m - m_new) * math.log2(math.e))
        p = torch.exp2(sj * math.log2(math.e) - (m_new * math.log2(math.e) - offset))  # in (0, p_scale]
        l = l * scale_o + p.sum(dim=-1, keepdim=True)
        p8 = fp8(p)
        if acc is not None:
            acc = acc * scale_o + p8 @ v[j : j + block]
        kept[j], seen[j] = (p8, p > 0), m_new
        m = m_new
    weights = torch.cat([kept[j][0] * torch.exp(seen[j] - m) / l for j in range(0, t, block)], dim=-1)
    flushed = torch.cat([kept[j][1] & (kept[j][0] == 0) for j in range(0, t, block)], dim=-1)
    return weights, flushed, None if acc is None else acc / l


def sink_scores(rows=512, keys=700, gap=9.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, keys, generator=g)
    s[:, :4] += gap
    return s


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("p_scale", [1.0, 256.0])
def test_tiled_e4m3_cell_is_fa3_softmax_written_out(reverse, p_scale):
    s = sink_scores()
    d = diagnose("s", s, Options(dtypes=("e4m3",), methods=("tiled",), block=128, reverse=reverse, p_scale=p_scale))
    (c,) = d.cells
    weights, flushed, _ = fa3_rows(s, 128, p_scale, reverse)
    ref = torch.softmax(s.double(), dim=-1)
    # exp vs exp2 with the offset differ by fp32 ulps; the FP8 values by at most one step where they straddle a
    # rounding point.
    err = (weights.double() - ref).abs().amax(dim=-1)
    assert c.max_abs_err == pytest.approx(float(err.max()), rel=0.05)
    live = ref > 0
    assert c.pcast_flushed_frac == pytest.approx(float(flushed[live].double().mean()), abs=2e-4)
    assert c.p_scale == p_scale and c.dtype == "e4m3" and c.name == "tiled/e4m3"
    mass = torch.where(flushed, ref, 0.0).sum(dim=-1)
    assert c.pcast_mass_rows == pytest.approx(int((mass >= 1e-3).sum()), abs=2)


def test_flash_fp8_path_is_fa3_written_out():
    """Per-(batch, kv head) descales, S in fp32, FA3's tile for d = 64 (160 keys), reverse order, O in bf16."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g) * 2 for _ in range(3))
    d = diagnose_attention(
        "x", prepare_inputs(q, k, v=v), Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",))
    )
    (c,) = d.cells
    assert c.name == "flash-fp8/e4m3" and fa3_tile(64) == (192, 160)
    outs = []
    for h in range(2):
        dq, dk, dv = (float(t[0, h].abs().max()) / 448 for t in (q, k, v))
        q8, k8, v8 = fp8(q[0, h] / dq), fp8(k[0, h] / dk), fp8(v[0, h] / dv)
        s = (q8 @ k8.T) * (dq * dk) / 8
        _, _, o = fa3_rows(s, 160, 256.0, True, v8)
        outs.append((o * dv).bfloat16().double())
    mine = torch.stack(outs)[None]
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, dim=-1) @ v.double()
    rmse = float((mine - exact).pow(2).mean().sqrt())
    assert c.out_rmse == pytest.approx(rmse, rel=0.02)
    assert 1e-3 < c.out_rmse < 0.3  # e4m3 keeps 3 mantissa bits: V (std 2) alone is off by ~2^-5 relative


def test_incoherent_rotation_is_orthogonal_and_keeps_qk():
    h = hadamard(128, seed=4)
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 128, generator=g, dtype=torch.float64), torch.randn(7, 128, generator=g, dtype=torch.float64)
    assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T, atol=1e-12)


def test_incoherent_processing_lowers_the_error_on_outliers():
    """FlashAttention-3's outlier inputs: the rotation spreads the outliers before quantising."""
    from attncheck.numerics.sweep.synthetic import make_qk

    q, k, v = make_qk(2, 256, 256, 128, dist="outliers", seed=1, with_v=True)
    inp = prepare_inputs(q[None], k[None], v=v[None])
    plain = diagnose_attention("x", inp, Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",)))
    rotated = diagnose_attention(
        "x", inp, Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",), incoherent=True)
    )
    assert rotated.cells[0].out_rmse < 0.8 * plain.cells[0].out_rmse


# --------------------------------------------------------------------------- docs/fp8.md, recomputed from its text

# docs/fp8.md's table of FlashAttention-3's FP8 tile (kBlockM queries, kBlockN keys), at and past each boundary
FA3_FP8_TILES = {
    64: (192, 160),
    65: (192, 128),
    96: (192, 128),
    97: (128, 224),
    128: (128, 224),
    129: (128, 160),
    192: (128, 160),
    193: (128, 128),
    256: (128, 128),
}


def one_path_block(path, q, k, v, dt=E4M3, **params):
    """The PathBlock of one path over whole heads (one block of rows)."""
    from attncheck.numerics.inputs.scores import score_blocks, start_audit
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.registry import PATHS

    inp = prepare_inputs(q, k, v=v)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    return inp, PATHS.get(path).function()(blk, dt, ["torch"], MethodParams(**params))


@pytest.mark.parametrize("d", sorted(FA3_FP8_TILES))
def test_block_scaling_and_key_blocks_are_fa3s_fp8_tile(d):
    """--fp8-scaling block: one descale (amax / 448) per kBlockM queries and per kBlockN keys, V one per
    head; flash-fp8 visits key blocks of kBlockN. Row i's largest |x| is i + 1, so a tile's descale is
    that of its last row: (last row + 1) / 448."""
    from attncheck.numerics.methods.fp8_attention import Fp8Setup, quantize_inputs

    bm, bn = FA3_FP8_TILES[d]
    t = 2 * 224 + 37  # not a multiple of any tile
    x = torch.full((1, 1, t, d), 0.5, dtype=torch.float64)
    x[0, 0, :, 0] = torch.arange(1, t + 1, dtype=torch.float64)
    quant = quantize_inputs(prepare_inputs(x, x.clone(), v=x.clone()), Fp8Setup(scaling="block"))
    i = torch.arange(t)

    def per_tile(block):
        return (torch.clamp((i // block + 1) * block, max=t).double() / 448).float()

    assert torch.equal(quant.dq[0], per_tile(bm)) and torch.equal(quant.dk[0], per_tile(bn))
    assert torch.equal(quant.dv[0], torch.tensor([t / 448], dtype=torch.float32))
    _, pb = one_path_block("flash-fp8", x.float()[..., :8, :], x.float(), None)
    r = pb.cells[0][1].pcast
    assert r.block == bn and r.block_position.shape[-1] == -(-t // bn)


def trunc13_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (exact) with their 10 low mantissa bits cleared: truncation to 13 bits, by the bits."""
    return (x.float().view(torch.int32) & ~0x3FF).view(torch.float32)


def test_flash_fp8_scores_fold_the_descales_into_the_scale():
    """flash-fp8's S (docs/fp8.md): q8 k8^T on the FP8 tensor cores times ((q descale x k descale) x scale),
    each product in fp32, descale = amax / 448 per batch and kv head. Q and K hold integers 1..8 in magnitude,
    so q8 = fp8(q 56) are integers and every partial sum of q8 . k8 is exact in fp32 (below 2^24); d = 48
    makes the scale no power of two and the product two MMA steps (32 + 16 elements), each result truncated
    to 13 mantissa bits (the kernel's default); with fp32 accumulation, the exact sum."""
    from attncheck.numerics.methods.fp8_attention import Fp8Setup

    g = torch.Generator().manual_seed(2)

    def ints(t):
        sign = torch.randint(0, 2, (1, 2, t, 48), generator=g) * 2 - 1
        x = torch.randint(1, 9, (1, 2, t, 48), generator=g).float() * sign
        x[..., 0, 0] = 8.0  # every head's amax is 8
        return x

    q, k = ints(50), ints(70)
    _, pb = one_path_block("flash-fp8", q, k, None)
    _, pb32 = one_path_block("flash-fp8", q, k, None, fp8=Fp8Setup(accum_bits=None))
    dq = torch.tensor(8 / 448, dtype=torch.float64).float()
    scale = torch.tensor(1 / math.sqrt(48), dtype=torch.float32)
    q8 = torch.stack([fp8(q[0, h] / dq) for h in range(2)])
    k8 = torch.stack([fp8(k[0, h] / dq) for h in range(2)])
    si = torch.stack([(q8[h].double() @ k8[h].double().T).float() for h in range(2)])
    assert torch.equal(pb32.scores.reshape(2, 50, 70), si * (dq * dq * scale))
    assert not torch.equal(si * (dq * dq * scale), si * (dq * dq) * scale)  # the order shows in the bits
    first = trunc13_f32(q8[..., :32] @ k8[..., :32].transpose(-1, -2))  # exact sums, then the low bits cleared
    st = trunc13_f32(first + q8[..., 32:] @ k8[..., 32:].transpose(-1, -2))
    assert torch.equal(pb.scores.reshape(2, 50, 70), st * (dq * dq * scale))
    assert not torch.equal(st, si)  # the truncation shows


def int8_written_out(x: torch.Tensor, groups: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/fp8.md's INT8 quantisation of x (T, d) fp32 per group of rows: scale = max|x| / 127 + 1e-7
    in fp32, x / scale rounded half away from zero."""
    ints, scale = torch.zeros_like(x), torch.zeros(x.shape[0])
    for rows in groups:
        sc = x[rows].abs().max() / 127 + 1e-7
        y = x[rows] / sc
        ints[rows] = torch.trunc(y + 0.5 * torch.where(y >= 0, 1.0, -1.0))
        scale[rows] = sc
    return ints, scale


def test_sage_scores_are_the_kernels_int8_products_in_its_order():
    """S of the sage path, recomputed from docs/fp8.md: bf16 q, k; K minus its bf16 mean; INT8 per
    thread group (Q rows {t, t+8} of each 16-row segment, K rows r mod 8 in {2t, 2t+1} of each
    128-key block); dq = q_scale k_scale; S = q.k (dq scale) in every key block but the last,
    (q.k dq) scale in the last; each product in fp32. Bit for bit."""
    g = torch.Generator().manual_seed(7)
    tq, tk, d = 40, 300, 96  # a scale 1 / sqrt(d) that is not a power of two: the product's order shows
    q = torch.randn(1, 2, tq, d, generator=g) * 3
    k, v = torch.randn(1, 2, tk, d, generator=g) + 0.5, torch.randn(1, 2, tk, d, generator=g)
    inp, pb = one_path_block("sage", q, k, v)
    scale = torch.tensor(1 / math.sqrt(d), dtype=torch.float32)
    qgroups = [[r for r in (s + t, s + t + 8) if r < tq] for s in range(0, tq, 16) for t in range(8)]
    kgroups = [
        [r for r in range(s, min(s + 128, tk)) if r % 8 in (2 * t, 2 * t + 1)]
        for s in range(0, tk, 128)
        for t in range(4)
    ]
    last = (tk - 1) // 128 * 128
    rows, alt = [], []
    for h in range(2):
        qb, kb = q[0, h].bfloat16(), k[0, h].bfloat16()
        qi, qs = int8_written_out(qb.float(), [r for r in qgroups if r])
        ki, ks = int8_written_out((kb - kb.mean(dim=0)).float(), [r for r in kgroups if r])
        si = (qi.double() @ ki.double().T).float()
        dq = qs[:, None] * ks[None, :]
        s = si * (dq * scale)
        s[:, last:] = si[:, last:] * dq[:, last:] * scale
        rows.append(s)
        alt.append(si * dq * scale)
    mine = torch.cat(rows)
    assert torch.equal(pb.scores, mine)
    assert not torch.equal(torch.cat(alt), mine)  # the order is visible in the bits: the test pins it


def test_sage_quantises_v_by_the_fast_math_reciprocal():
    """V in e4m3 per channel (docs/fp8.md): v times 448 fp32(1 / amax), cast; the scale amax fp32(1 / 448).
    Every non-negative bf16 value up to 3 in one channel (amax 3); a division by amax / 448 or a
    multiplication by a correctly rounded 448 / amax round some of them differently."""
    from attncheck.numerics.methods.fp8_attention import sage_v

    v = torch.arange(0, 0x4040 + 1, dtype=torch.int16).view(torch.bfloat16).float()  # 0 .. 3.0
    v8, scale = sage_v(v[None, :, None])
    three, top = torch.tensor(3.0), torch.tensor(448.0)
    assert torch.equal(v8.flatten(), fp8(v * (top * (1 / three))))
    assert torch.equal(scale.flatten(), (three * (1 / top))[None])
    assert int((fp8(v / (three / top)) != v8.flatten()).sum()) > 0
    assert int((fp8(v * (top / three)) != v8.flatten()).sum()) > 0


def test_sage_output_is_the_kernel_written_out():
    """O of the sage path against SageAttention's forward written out here: key blocks of 128 first to
    last, P scaled by 2^8.807 and cast, V8 = fp8(v 448 fp32(1 / amax)), O / l times amax / 448 in bf16."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 64, 64, generator=g) * 2, torch.randn(1, 2, 300, 64, generator=g)
    v = torch.randn(1, 2, 300, 64, generator=g) * 3
    opts = Options(dtypes=("e4m3",), methods=("torch",), paths=("sage",))
    (c,) = diagnose_attention("x", prepare_inputs(q, k, v=v), opts).cells
    assert c.name == "sage/e4m3"
    _, pb = one_path_block("sage", q, k, v)
    s = pb.scores.reshape(2, 64, 300)
    outs = []
    for h in range(2):
        vb = v[0, h].bfloat16().float()
        amax = vb.abs().amax(dim=0)
        v8 = fp8(vb * (448 * (1 / amax)))
        _, _, o = fa3_rows(s[h], 128, 2.0**8.807, False, v8)
        outs.append((o * (amax * (1 / torch.tensor(448.0)))).bfloat16().double())
    mine = torch.stack(outs)[None]
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, dim=-1) @ v.double()
    assert c.out_rmse == pytest.approx(float((mine - exact).pow(2).mean().sqrt()), rel=0.02)
    assert c.out_max_abs_err == pytest.approx(float((mine - exact).abs().max()), rel=0.05)
    # The bias (docs/reference/numerics.md): O against the float64 softmax of the path's own S times V as
    # given (an FP8 path's V quantisation is its own rounding), each row's mean signed error, averaged.
    o = pb.cells[0][1].out.double().reshape(2, 64, 64)
    own = torch.softmax(s.double(), dim=-1) @ v[0].double()
    assert c.out_bias == pytest.approx(float((o - own).mean()), rel=1e-9, abs=1e-15)


# --------------------------------------------------------------------------- findings


def codes(d):
    return {f.code for f in d.findings}


def test_p_cast_underflow_fires_for_forward_s1_and_not_for_reverse_s256():
    s = sink_scores()
    bad = diagnose("s", s, Options(dtypes=("e4m3",), methods=("tiled",), p_scale=1.0))
    f = next(f for f in bad.findings if f.code == "p_cast_underflow")
    assert "6.93 = 6.93 + ln S" in f.message and f.severity == "warning" and "reverse" in f.fix
    good = diagnose("s", s, Options(dtypes=("e4m3",), methods=("tiled",), p_scale=256.0, reverse=True))
    assert "p_cast_underflow" not in codes(good)


def test_fp8_overflow_of_p_scale_and_of_unscaled_q():
    s = sink_scores(rows=64)
    d = diagnose("s", s, Options(dtypes=("e4m3",), methods=("tiled",), p_scale=1000.0))
    f = next(f for f in d.findings if f.code == "fp8_overflow")
    assert "S = 1000 exceeds e4m3's largest value 448" in f.message
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 32, generator=g) for _ in range(3))
    q[0, 0, 3, 0] = 1000.0  # beyond 448: clipped without a descale
    k = k * 1e-3  # mostly below e4m3's normal range 2^-6 without a descale
    d = diagnose_attention(
        "x",
        prepare_inputs(q, k, v=v),
        Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",), fp8_scaling="none"),
    )
    msgs = {f.code: f.message for f in d.findings}
    assert "1 of 2048 q value(s) (amax 1000) beyond +-448" in msgs["fp8_overflow"]
    assert "without a descale" in msgs["fp8_unscaled"] and "of k fall below e4m3's normal range" in msgs["fp8_unscaled"]
    scaled = diagnose_attention(
        "x", prepare_inputs(q, k, v=v), Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",))
    )
    assert not codes(scaled) & {"fp8_overflow", "fp8_unscaled"}


def test_fp8_dtypes_need_a_p_cast_method_and_a_power_of_two_for_the_rotation():
    with pytest.raises(AttncheckError, match="only a softmax that casts P to FP8 runs"):
        diagnose("s", torch.randn(4, 8), Options(dtypes=("e4m3",), methods=("naive",)))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 8, 48, generator=g), torch.randn(1, 1, 8, 48, generator=g)
    with pytest.raises(AttncheckError, match="power of two; d = 48"):
        diagnose_attention("x", prepare_inputs(q, k), Options(dtypes=("e4m3",), paths=("flash-fp8",), incoherent=True))


def accum_inputs(tk: int):
    """O ~ 20 at every key length (V with a large common component), diffuse attention over ``tk`` keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 16, 64, generator=g) * 0.3
    k = torch.randn(1, 1, tk, 64, generator=g) * 0.3
    v = torch.randn(1, 1, tk, 64, generator=g) + 20
    return prepare_inputs(q, k, v=v)


def test_fp8_accumulator_fires_at_long_keys_and_names_the_flush():
    """FA3's FP8 P@V without a flush truncates O after every 32 keys: at 4096 keys its late additions are
    truncated away and O drifts below float64's (the bias), far past twice the same kernel's error with fp32
    accumulation; at 256 keys it stays within. A flush every 4 blocks, or fp32 accumulation, clears it."""
    opts = dict(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",))
    long = diagnose_attention("x", accum_inputs(4096), Options(**opts))
    (c,) = long.cells
    assert c.fp8_accum == "13 bits" and c.fp8_accum_keys == 4096
    assert set(c.fp8_accum_rmse) == {"fp32", "flush 1", "flush 4"}  # 26 blocks of 160: flush 64 is no flush
    assert c.out_rmse > 2 * c.fp8_accum_rmse["fp32"] and c.out_bias < 0  # truncation toward zero: O too small
    f = next(f for f in long.findings if f.code == "fp8_accumulator")
    assert "at 4096 keys" in f.message and f"{c.out_rmse:.3g}" in f.message
    assert f"{c.fp8_accum_rmse['fp32']:.3g}" in f.message and "flush to fp32 every 4 key blocks" in f.message
    assert "0.89 / 0.88 / 0.856" in f.message and f.severity == "warning"
    # the fp32 companion is the same kernel with --fp8-accum fp32
    (c32,) = diagnose_attention("x", accum_inputs(4096), Options(**opts, fp8_accum="fp32")).cells
    assert c32.out_rmse == c.fp8_accum_rmse["fp32"] and c32.fp8_accum == "fp32" and c32.fp8_accum_rmse is None
    flushed = diagnose_attention("x", accum_inputs(4096), Options(**opts, fp8_flush=4))
    assert flushed.cells[0].out_rmse == c.fp8_accum_rmse["flush 4"] and "fp8_accumulator" not in codes(flushed)
    short = diagnose_attention("x", accum_inputs(256), Options(**opts))
    assert short.cells[0].fp8_accum_rmse["fp32"] is not None and "fp8_accumulator" not in codes(short)


def test_sage_accumulates_each_block_then_fp32():
    """SageAttention 2 flushes every 128-key block: its FP22 error stays within the 2x rule at 4096 keys."""
    d = diagnose_attention("x", accum_inputs(4096), Options(dtypes=("e4m3",), methods=("torch",), paths=("sage",)))
    (c,) = d.cells
    assert c.fp8_accum == "13 bits, flush every 1 block" and set(c.fp8_accum_rmse) == {"fp32"}
    assert c.out_rmse <= 2 * c.fp8_accum_rmse["fp32"] and "fp8_accumulator" not in codes(d)
