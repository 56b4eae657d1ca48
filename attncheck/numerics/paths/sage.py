"""**sage** (see [FP8 attention](../fp8.md)) follows SageAttention 2's SM90 kernel (thu-ml/SageAttention,
`sageattn_qk_int8_pv_fp8_cuda_sm90`, default settings): q, k, v rounded to bf16 (the
model's dtype); K smoothed by its mean over tokens (taken in bf16, the difference rounded
to bf16); Q and K quantised to INT8 per thread group (scale = max|x| / 127 + 1e-7 in fp32,
round half away from zero; Q: rows {t, t+8} of each 16-row warp segment, K: rows with
r mod 8 in {2t, 2t+1} of each 128-key block); S from (q8 . k8) exactly and the fp32 scales in
the kernel's order (`sage_scores`); key blocks of 128 visited first to last; P~ =
exp(s - m_j) * 448 (its exponent offset 8.807) cast to e4m3 (satfinite); V in e4m3
per channel as `scale_fuse_quant` in csrc/fused/fused.cu does it: V times 448 / amax (the
reciprocal rounded to fp32 first), the scale amax / 448 kept; P8 @ V8 of each 128-key block
on a zeroed accumulator by four k = 32 WGMMAs, each result truncated to 13 mantissa bits (FP22,
the accumulator model of `attncheck.numerics.methods.fp8_accum`), then added to the fp32 O after
O's rescale (the kernel's two-level accumulation: `RO_temp`, `RO += RO_temp` in
csrc/qattn/qk_int_sv_f8_cuda_sm90.cuh at thu-ml/SageAttention@6ed9e0671ff4e7049bd20c49508a9bae4a634f68);
O divided by the row sum, times V's scale, rounded to bf16. `--fp8-accum fp32` gives the same kernel
with fp32 accumulation. Assumed: the accumulator model (SageAttention 2's measurement). Not emulated:
the kernel's base-2 arithmetic (log2 e folded into the scale).

Tested by: `tests/numerics/methods/test_fp8_cells.py::test_sage_scores_are_the_kernels_int8_products_in_its_order`,
`tests/numerics/methods/test_fp8_cells.py::test_sage_quantises_v_by_the_fast_math_reciprocal`,
`tests/numerics/methods/test_fp8_cells.py::test_sage_output_is_the_kernel_written_out`,
`tests/numerics/methods/test_fp8_accum.py::test_online_p_at_v_is_the_accumulator_written_out`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from attncheck.numerics.paths.base import PathSpec

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

PATH = PathSpec(
    "sage",
    "SageAttention 2 (SM90): K smoothed, Q and K in INT8 per thread group, P scaled by 448 and cast to "
    "FP8, V in FP8 per channel, key blocks first to last, P@V per block in FP22 then fp32, O in bf16",
    f"{__name__}:forward",
    scores_in="fp32 from INT8 q and k",
    fp8=True,
    kernel="SageAttention 2",
    device="cuda",
    fp8_accumulator=True,
    assumed="the FP8 MMA's FP22 accumulator as a model (13 mantissa bits truncated per 32-element step, flushed "
    "to fp32 every 128-key block); the kernel's base-2 arithmetic as natural exp",
)


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.inputs.scores import _kv_heads
    from attncheck.numerics.methods.fp8_accum import DEFAULT_MANTISSA_BITS
    from attncheck.numerics.methods.fp8_attention import (
        OUT_DTYPE,
        SAGE_BLOCK,
        SAGE_P_SCALE,
        Fp8Setup,
        accum_companions,
        accum_label,
        add_bf16_mask,
        int8_per_group,
        online_pcast_out,
        sage_groups,
        sage_scores,
        sage_v,
    )
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock

    inp = block.inp
    setup = params.fp8 or Fp8Setup(fmt=dt, accum_bits=DEFAULT_MANTISSA_BITS)
    key = ("sage", setup.fmt)
    prep = inp.cache.get(key)
    if prep is None:
        b, hq, tq, d = inp.q.shape
        hk, tk = inp.k.shape[1], inp.k.shape[2]
        q = inp.q.reshape(b * hq, tq, d).to(OUT_DTYPE)
        k = inp.k.reshape(b * hk, tk, d).to(OUT_DTYPE)
        k = k - k.mean(dim=1, keepdim=True)  # smoothing: the mean over tokens in bf16, the difference rounded to bf16
        qi, qscale = int8_per_group(q, sage_groups(tq, "q", q.device))
        ki, kscale = int8_per_group(k, sage_groups(tk, "k", k.device))
        v8 = vscale = None
        if inp.v is not None:
            v8, vscale = sage_v(inp.v.reshape(b * hk, tk, -1), setup.fmt)
        prep = (qi, qscale, ki, kscale, v8, vscale)
        inp.cache[key] = prep
    qi, qscale, ki, kscale, v8, vscale = prep
    bh, qs = block.rows
    kv = _kv_heads(inp, bh)
    si = torch.matmul(qi[bh, qs], ki[kv].transpose(-1, -2)).float()  # exact: |q.k| <= 127^2 d < 2^24
    s = sage_scores(si, qscale[bh, qs], kscale[kv], inp.scale)
    s = add_bf16_mask(block, s)
    # P@V: each 128-key block's four k = 32 WGMMAs on a zeroed accumulator (RO_temp), added to the fp32 O (RO)
    flush = setup.accum_flush or 1

    def output(bits: int | None, flush: int | None) -> tuple:
        r, o = online_pcast_out(
            s, None if v8 is None else v8[kv], setup.fmt, SAGE_P_SCALE, SAGE_BLOCK, False, bits, flush
        )
        return r, None if o is None else (o * vscale[kv]).to(OUT_DTYPE).reshape(-1, o.shape[-1])

    r, o = output(setup.accum_bits, flush)
    out = MethodOutput(r.probs.reshape(-1, s.shape[-1]), pcast=r, out=o)
    out.accum = accum_label(setup.accum_bits, None if setup.accum_bits is None else flush)
    if o is not None and setup.accum_bits is not None and setup.accum_companions:
        out.companions = accum_companions(lambda b, f: output(b, f)[1], setup.accum_bits, flush, 0)
    return PathBlock(s.reshape(-1, s.shape[-1]), [], [], [(PATH.name, out)])
