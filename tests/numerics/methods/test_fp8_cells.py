"""FP8 cells end to end: the tiled/e4m3 cell and the flash-fp8 path against FP8 attention
written out here block by block (FlashAttention-3's recurrence: exp2 with a max offset of
8, the row sum before the cast, reverse key blocks), the P-cast counts against a count made
here, and the FP8 findings on inputs built to trigger them (and not otherwise)."""

import math

import pytest
import torch

from attncheck import Options
from attncheck.errors import AttncheckError
from attncheck.numerics.cells.diagnose import diagnose, diagnose_attention
from attncheck.numerics.methods.fp8_attention import fa3_tile, hadamard
from attncheck.numerics.inputs.scores import prepare_inputs

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
    # exp vs exp2 with the offset differ by fp32 ulps; the FP8 values by at most one step where they straddle a rounding point.
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
    d = diagnose_attention("x", prepare_inputs(q, k, v=v), Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",)))
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
    rotated = diagnose_attention("x", inp, Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",), incoherent=True))
    assert rotated.cells[0].out_rmse < 0.8 * plain.cells[0].out_rmse


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
    d = diagnose_attention("x", prepare_inputs(q, k, v=v), Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",), fp8_scaling="none"))
    msgs = {f.code: f.message for f in d.findings}
    assert "1 of 2048 q value(s) (amax 1000) beyond +-448" in msgs["fp8_overflow"]
    assert "without a descale" in msgs["fp8_unscaled"] and "of k fall below e4m3's normal range" in msgs["fp8_unscaled"]
    scaled = diagnose_attention("x", prepare_inputs(q, k, v=v), Options(dtypes=("e4m3",), methods=("torch",), paths=("flash-fp8",)))
    assert not codes(scaled) & {"fp8_overflow", "fp8_unscaled"}


def test_fp8_dtypes_need_a_p_cast_method_and_a_power_of_two_for_the_rotation():
    with pytest.raises(AttncheckError, match="only a softmax that casts P to FP8 runs"):
        diagnose("s", torch.randn(4, 8), Options(dtypes=("e4m3",), methods=("naive",)))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 8, 48, generator=g), torch.randn(1, 1, 8, 48, generator=g)
    with pytest.raises(AttncheckError, match="power of two; d = 48"):
        diagnose_attention("x", prepare_inputs(q, k), Options(dtypes=("e4m3",), paths=("flash-fp8",), incoherent=True))
