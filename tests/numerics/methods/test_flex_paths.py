"""The flex paths against torch's own flex_attention: a call is recorded by the capture (its q, k,
v, the mask its mask_mod gives, its logits after the score_mod), its cell recomputed from the
recording, and compared with what flex_attention returned in the program. flex-math (flex without
torch.compile) is bit-exact; the fused kernel's cell (flex) is checked against the compiled kernel
in the slow tests. The float64 reference: the logits from float64 q and k through the same score_mod,
against an independent computation written out here."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attncheck
from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.registry import PATHS

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*:UserWarning")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
T = 80  # not a multiple of any block size


def causal(b, h, qi, ki):
    return qi >= ki


def window(b, h, qi, ki):
    return (qi >= ki) & (qi - ki < 16)


def late_start(b, h, qi, ki):  # rows 0..9 attend to no key at all
    return (qi >= 10) & (ki <= qi)


SLOPES = torch.tensor([2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4])


def alibi(score, b, h, qi, ki):
    return score + SLOPES[h] * (ki - qi)


def softcap(score, b, h, qi, ki):
    return 5.0 * torch.tanh(score / 5.0)


CASES = {  # name: (mask_mod, score_mod, kv heads)
    "plain": (None, None, 4),
    "causal-gqa": (causal, None, 2),
    "window": (window, None, 4),
    "alibi-causal": (causal, alibi, 4),
    "softcap-gqa": (causal, softcap, 2),
    "rows-without-keys": (late_start, softcap, 4),
}


class Flex(torch.nn.Module):
    def __init__(self, block_mask, score_mod):
        super().__init__()
        self.block_mask, self.score_mod = block_mask, score_mod

    def forward(self, q, k, v):
        return flex_attention(
            q, k, v, score_mod=self.score_mod, block_mask=self.block_mask, enable_gqa=q.shape[1] != k.shape[1]
        )


def tensors(dt, hkv, seed=0, size=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, 4, T, 16, generator=g) * size).to(dt)
    k = (torch.randn(2, hkv, T, 16, generator=g) * size).to(dt)
    v = torch.randn(2, hkv, T, 16, generator=g).to(dt)
    return q, k, v


def record(name, dt, compiled=False):
    mask_mod, score_mod, hkv = CASES[name]
    q, k, v = tensors(dt, hkv)
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, T, T, device="cpu")
    model = Flex(bm, score_mod)
    with attncheck.capture() as cap:
        out = (torch.compile(model) if compiled else model)(q, k, v)
    (call,) = cap.calls
    return call, out


def run_recorded(path, call):
    t = call.tensors
    logits = (t["scores_mod"], t["scores_mod64"]) if "scores_mod" in t else None
    inp = prepare_inputs(
        t["q"], t["k"], t.get("attn_mask"), v=t["v"], scale=repr(float(call.meta["scale"])), logits=logits
    )
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    pb = PATHS.get(path).function()(blk, t["q"].dtype, [path], MethodParams())
    out = pb.cells[0][1]
    return out.probs.reshape(inp.score_shape), out.out.reshape(*inp.score_shape[:-1], t["v"].shape[-1]), blk


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_flex_math_is_torchs_flex_attention_bit_for_bit(name, dt):
    call, out = record(name, DTYPES[dt])
    assert call.kind == "flex" and call.meta["flex_impl"] == "math"
    _, o, _ = run_recorded("flex-math", call)
    assert o.dtype == out.dtype and torch.equal(o, out)
    if name == "rows-without-keys":
        assert torch.equal(out[:, :, :10], torch.zeros_like(out[:, :, :10]))  # flex gives zeros there, not NaN


def written_out_reference(name, q, k, scale):
    """float64 logits from float64 q and k, the score_mod and mask_mod written out (not through torch's vmap)."""
    mask_mod, score_mod, _ = CASES[name]
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    qi = torch.arange(T).view(T, 1)
    ki = torch.arange(T).view(1, T)
    if score_mod is alibi:
        s = s + SLOPES.double().view(1, 4, 1, 1) * (ki - qi).double()
    elif score_mod is softcap:
        s = 5.0 * torch.tanh(s / 5.0)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(None, None, qi, ki), -math.inf)
    return s


@pytest.mark.parametrize("name", ["alibi-causal", "softcap-gqa"])
def test_the_recorded_float64_logits_are_the_score_mod_in_float64(name):
    call, _ = record(name, torch.bfloat16)
    t = call.tensors
    ref = written_out_reference(name, t["q"], t["k"], float(call.meta["scale"]))
    torch.testing.assert_close(t["scores_mod64"], ref, rtol=1e-14, atol=1e-14)
    # the fp32 logits are flex's own: within fp32 rounding of the float64 ones
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(t["scores_mod"]), fin)
    assert float((t["scores_mod"].double() - ref)[fin].abs().max()) < 1e-5 * float(ref[fin].abs().max())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's import of torch.jit on this torch
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_the_flex_cell_of_a_recorded_compiled_call_is_the_kernel_within_its_bound(dt):
    """A torch.compile'd flex call (soft-capped, GQA, rows with no key, no BlockMask) recorded by the
    capture, its flex cell recomputed from the recording: every element of O within
    ``flex_bound`` of the compiled kernel's output (from the logits as recorded; the kernel's own
    logits differ by ``flex_score_err``)."""
    from attncheck.numerics.methods.flex import flex_bound, flex_score_err, ulp

    torch._dynamo.reset()
    dtype = DTYPES[dt]
    q, k, v = tensors(dtype, 2, seed=3)
    compiled = torch.compile(flex_attention, dynamic=False)
    real = compiled(q, k, v, score_mod=softcap, enable_gqa=True)
    with attncheck.capture() as cap:
        again = compiled(q, k, v, score_mod=softcap, enable_gqa=True)  # run as its eager code under capture
    (call,) = cap.calls
    assert call.meta["flex_impl"] == "compiled" and call.meta["compiled"] == "eager"
    assert torch.isfinite(again).all()
    _, o, _ = run_recorded("flex", call)
    t = call.tensors
    sig = flex_score_err(t["q"], t["k"], None, t["scores_mod"], enable_gqa=True, mod_ulps=4.0)
    bound = flex_bound(t["scores_mod"], t["v"], dtype, score_err=sig, enable_gqa=True)
    diff = (o.double() - real.double()).abs()
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} elements outside the bound"
    # not vacuous: about an ulp of the output where the roundings may go the other way, 0 elsewhere
    assert (bound / ulp(real.double().abs(), dtype)).median() <= 2 and bool((bound == 0).any())
