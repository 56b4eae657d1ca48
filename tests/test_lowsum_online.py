"""``--accumulate fp16-online``: llama.cpp's CPU flash attention with an f16 V (numerics.methods.lowsum.online_f16)
against the kernel's loop written out here in exact rational arithmetic, every fp32 and fp16 rounding done by hand
(tests/test_lowsum.py's ``round_to`` and ``f32``), and the facts derived from that loop."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.methods.lowsum import online_f16, row_sums
from attncheck.params import SumSpec, sum_specs
from tests.test_lowsum import f32, round_to


def expf(x: Fraction) -> Fraction:
    """fp32 exp of an fp32 value: the exact exponential rounded to fp32 (through a double, whose own rounding is
    far below fp32's half ulp)."""
    return f32(Fraction(math.exp(float(x))))


def f16(q: Fraction) -> Fraction:
    out = round_to(q, "fp16")
    assert isinstance(out, Fraction), "the exact replay keeps its rows in range"
    return out


def ref_row(scores: list[float], v: list[list[float]]) -> tuple[list[Fraction], Fraction, list[Fraction], int]:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk (llama.cpp 1f08e2d, ggml/src/ggml-cpu/ops.cpp) for one
    query row with an f16 V: (VKQ16 at the end, S, the output row, how many times VKQ16 was rescaled)."""
    top: Fraction | None = None  # M = -INFINITY
    big = Fraction(0)  # S
    acc = [Fraction(0)] * len(v[0])  # VKQ16, memset to 0
    rescales = 0
    for x, vj in zip(scores, v):
        if x == -math.inf:  # mv == -INFINITY: continue
            continue
        s = f32(Fraction(x))
        ms, vs = Fraction(1), Fraction(1)
        if top is None or s > top:
            rescales += top is not None  # the first key scales an empty accumulator by expf(-inf) = 0
            ms = Fraction(0) if top is None else expf(f32(top - s))  # expf(Mold - M)
            top = s
            acc = [f16(f32(a * ms)) for a in acc]  # ggml_vec_scale_f16
        else:
            vs = expf(f32(s - top))
        acc = [f16(f32(a + Fraction(w) * vs)) for a, w in zip(acc, vj)]  # ggml_vec_mad_f16, fused in fp32
        big = f32(big * ms + vs)  # S = S*ms + vs
    inv = f32(1 / big)
    return acc, big, [f32(a * inv) for a in acc], rescales


def test_online_matches_the_kernel_loop_in_exact_arithmetic() -> None:
    """Rows whose logits climb (a new running max, so a rescale of the f16 accumulator, at many keys), with a
    masked key, and V of mixed signs: VKQ16, S and the output bit for bit."""
    g = torch.Generator().manual_seed(3)
    r, n, dv = 6, 40, 3
    scores = torch.randn(r, n, generator=g, dtype=torch.float64) * 1.5 + torch.linspace(0, 12, n, dtype=torch.float64)
    scores[2, 7] = -math.inf
    v = (torch.randn(r, n, dv, generator=g) * 8).to(torch.float16)
    got = online_f16(scores, v)
    rescaled = 0
    for i in range(r):
        acc, big, out, rescales = ref_row(scores[i].tolist(), v[i].tolist())
        rescaled += rescales
        assert [Fraction(x) for x in got.acc[i].tolist()] == acc
        assert Fraction(float(got.S[i])) == big
        assert [Fraction(x) for x in got.out[i].tolist()] == out
    assert rescaled >= 3 * r  # the rescale path was taken, not only the first key's
    assert bool((got.over == -1).all())


def test_equal_logits_never_rescale_so_online_is_the_sequential_sum() -> None:
    """With equal logits the running max is set at the first key (ms = expf(-inf) = 0 on an empty accumulator) and
    never again: every later key adds exp(0) v in f16, the sequential sum. So V = 17 passes fp16's range at the same
    key as fp16-seq (3,064 keys, test_lowsum.py's exact simulation), and the fp32 S counts the keys exactly."""
    n = 3100
    v = torch.full((1, n, 1), 17.0, dtype=torch.float16)
    online = row_sums(torch.zeros(1, n), SumSpec("fp16", "online"), v)
    seq = row_sums(torch.zeros(1, n), SumSpec("fp16", "seq"), v)
    assert int(online.out_over) == int(seq.out_over) == 3063
    assert float(online.out_partial) == float(seq.out_partial) and math.isinf(float(online.out_value))
    assert float(online.denom[0]) == n and int(online.denom_over) == -1


def test_v1_equal_logits_stall_at_2048_instead_of_overflowing() -> None:
    """ik_llama.cpp PR 1196's case (V = 1, weights near 1, 64k keys) in llama.cpp's CPU kernel: VKQ16 climbs by
    1 per key and stalls at 2,048, where 1 is half fp16's spacing (2,049 ties to even, 2,048): it never nears 65,520,
    so no NaN, however long the row; S = n in fp32, and the output is 2,048 / n instead of 1."""
    n = 4096
    got = online_f16(torch.zeros(1, n, dtype=torch.float64), torch.ones(1, n, 1, dtype=torch.float16))
    assert float(got.acc) == 2048.0 and float(got.S) == n and float(got.out) == 0.5 and int(got.over) == -1


@pytest.mark.slow
def test_v1_equal_logits_at_64k_keys_give_one_32nd() -> None:
    """The same at PR 1196's 65,536 keys: the output is 2,048 / 65,536 = 1/32 (a relative error of 31/32), where
    blocks of 64 summed in fp32 (the CUDA kernel's tiles) overflow at the 65,536th key (test_lowsum.py)."""
    n = 65536
    r = row_sums(torch.zeros(1, n), SumSpec("fp16", "online"), torch.ones(1, n, 1, dtype=torch.float16))
    assert int(r.out_over) == -1 and float(r.out_err) == 31 / 32
    blocks = row_sums(torch.zeros(1, n), SumSpec("fp16", "block", 64), torch.ones(1, n, 1, dtype=torch.float16))
    assert int(blocks.out_over) == n - 1


def test_online_overflows_where_the_final_max_keeps_the_sum_finite() -> None:
    """The running max M_t <= the row's max m, so the online accumulator holds e^(m - M_t) times the two-pass sum:
    2,048 keys at logit 0 with V = 32 reach 2,047 x 32 = 65,504 and then 65,536 >= 65,520, inf at the 2,048th key,
    before a key at logit 20 arrives whose rescale by expf(-20) cannot bring inf back. The two-pass sum against the
    final max holds 32 (2,048 e^-20 + 1) ~ 32.0001 and stays finite."""
    scores = torch.zeros(1, 2049, dtype=torch.float64)
    scores[0, -1] = 20.0
    v = torch.full((1, 2049, 1), 32.0, dtype=torch.float16)
    online = row_sums(scores, SumSpec("fp16", "online"), v)
    assert int(online.out_over) == 2047 and float(online.out_partial) == 65504.0
    assert math.isinf(float(online.out_err))
    seq = row_sums(scores, SumSpec("fp16", "seq"), v)
    assert int(seq.out_over) == -1 and float(seq.out_err) < 1e-3


def test_online_spec_is_fp16_only() -> None:
    assert [s.label for s in sum_specs("fp16-online,fp16-seq")] == ["fp16-online", "fp16-seq"]
    with pytest.raises(AttncheckError, match="f16 V cache"):
        sum_specs("bf16-online")
    with pytest.raises(AttncheckError, match="only order block takes"):
        sum_specs("fp16-online:8")


def _pv_err(g: torch.Generator, keys: int, orders: tuple[str, ...]) -> list[float]:
    """The mean P@V error of 2 rows of N(0,1) logits and V (fp16, head dim 16) per order."""
    x = torch.randn(2, keys, generator=g, dtype=torch.float64)
    v = torch.randn(2, keys, 16, generator=g).half()
    return [float(row_sums(x, SumSpec("fp16", o), v).out_err.mean()) for o in orders]


@pytest.mark.slow
def test_online_pv_error_grows_with_the_keys() -> None:
    """docs/long-context.md's P@V table: llama.cpp's f16 VKQ16 loses more as the keys grow (every key is
    rounded into it): over 2x from 1,024 to 16,384 keys (seeds 0-3 give 3.8x, 2.8x, 3.3x, 2.9x)."""
    g = torch.Generator().manual_seed(0)
    short = _pv_err(g, 1024, ("online",))[0]
    assert _pv_err(g, 16384, ("online",))[0] > 2 * short


def test_online_pv_error_between_the_tree_and_the_sequential_sum() -> None:
    """docs/long-context.md's P@V table at 4,096 keys: llama.cpp's kernel (fp32 S) stays above a tree's log2(n) u
    error and far below the two-pass sequential sum, whose own f16 denominator has lost most of the row."""
    g = torch.Generator().manual_seed(0)
    pair, online, seq = _pv_err(g, 4096, ("pairwise", "online", "seq"))
    assert pair < online < 0.05 < seq
