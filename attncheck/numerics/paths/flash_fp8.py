"""**flash-fp8** (see [FP8 attention](../fp8.md)) follows FlashAttention-3's hopper kernel (Dao-AILab/flash-attention,
`hopper/`: `softmax.h`, `mainloop_fwd_sm90_tma_gmma_ws.hpp`, `flash_api.cpp`):

- Q, K and V arrive in e4m3 with fp32 descale factors (the kernel takes one per batch and
  kv head; it does not quantise). attncheck quantises them as the caller would,
  x8 = fp8(x / descale) with descale = amax / max_fp8 over the tensor (`tensor`), per
  batch and kv head (`head`, the kernel's own granularity; a query head uses its kv
  head's q descale), per block of queries and of keys (`block`, the FlashAttention-3
  paper's block quantisation, done outside the released kernel; V keeps one scale per
  head because the kernel applies it to O at the end), or not at all (`none`). With
  `incoherent`, Q and K are first multiplied by the same random orthogonal matrix
  (a seeded +-1 diagonal times a normalised Hadamard matrix; Q K^T is unchanged in exact
  arithmetic), as the paper's incoherent processing.
- S = q8 k8^T in fp32 times ((q descale x k descale) x softmax scale), each product in fp32, the
  kernel's order (`hopper/flash_fwd_kernel_sm90.h` folds the descales into the scale); the key blocks
  (FlashAttention-3's FP8 tile for the head dim, `fa3_tile`) are visited last to first;
  the running max and row sum are fp32, the sum taken over the exps before the cast;
  P~ = exp(s - m_j) * 2^8 (the kernel's max offset of 8 in its exp2) is cast to e4m3
  with round-to-nearest-even and saturation (cvt.rn.satfinite); O accumulates
  P8 @ V8 with the running rescale: the CUDA cores rescale O in fp32, then the P@V WGMMAs
  (32 keys each) accumulate into O itself, each truncating it to 13 mantissa bits (upstream
  FlashAttention-3 keeps O in the WGMMA accumulator for the whole key range: no flush;
  `--fp8-flush N` models vLLM's two-level accumulation, vllm-project/flash-attention PRs 104 and
  122, Dao-AILab PR 2250: a working accumulator added to an fp32 O every N key blocks); O is
  divided by the row sum, multiplied by V's descale and rounded to bf16, the kernel's output
  type for FP8 inputs. `--fp8-accum fp32` gives the same kernel with fp32 accumulation.
- Assumed: the accumulator model (13 bits, truncated once per 32-element step: SageAttention 2's
  measurement, no NVIDIA documentation; see `fp8_accum`); exp2's approximation (ex2.approx, ~2
  ulp of fp32) is not emulated.

Tested by: `tests/numerics/methods/test_fp8_cells.py::test_block_scaling_and_key_blocks_are_fa3s_fp8_tile`,
`tests/numerics/methods/test_fp8_cells.py::test_flash_fp8_path_is_fa3_written_out`,
`tests/numerics/methods/test_fp8_cells.py::test_flash_fp8_scores_fold_the_descales_into_the_scale`,
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
    "flash-fp8",
    "FlashAttention-3's FP8 forward: e4m3 Q, K, V with descales (--fp8-scaling, --incoherent), S in "
    "the FP8 MMA's 13-bit accumulator, key blocks last to first, P scaled by --p-scale (2^8) and cast to FP8, "
    "O in the same accumulator then bf16",
    f"{__name__}:forward",
    scores_in="fp32 from FP8 q and k",
    fp8=True,
    kernel="FlashAttention-3's FP8 forward",
    device="cuda",
    fp8_accumulator=True,
    assumed="the FP8 tensor cores' accumulator as a model (13 mantissa bits truncated per 32-element MMA step, "
    "SageAttention 2's measurement); exp2 is exp rounded to fp32",
)


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.inputs.scores import _kv_heads
    from attncheck.numerics.methods.fp8_accum import DEFAULT_MANTISSA_BITS, mma_accumulate_fp8
    from attncheck.numerics.methods.fp8_attention import (
        OUT_DTYPE,
        Fp8Setup,
        accum_companions,
        accum_label,
        add_bf16_mask,
        fa3_tile,
        online_pcast_out,
        quantize_inputs,
        record_audit,
    )
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock

    setup = params.fp8 or Fp8Setup(fmt=dt, accum_bits=DEFAULT_MANTISSA_BITS)
    quant = quantize_inputs(block.inp, setup)
    record_audit(block, dt, setup, quant)
    bh, qs = block.rows
    kv = _kv_heads(block.inp, bh)
    q8, dq = quant.q8[bh, qs], quant.dq[bh, qs]  # (n, tq, d), (n, tq)
    k8, dk = quant.k8[kv], quant.dk[kv]
    _, block_n = fa3_tile(block.inp.d)
    v8 = None if quant.v8 is None else quant.v8[kv]

    def scores(bits: int | None) -> torch.Tensor:
        # The kernel folds the descales into the softmax scale (flash_fwd_kernel_sm90.h: softmax_scale_log2 *=
        # q_descale * k_descale), then multiplies the accumulator by it: S = q8.k8 x ((dq x dk) x scale), each
        # product in fp32. q8.k8 on the FP8 tensor cores from a zeroed accumulator (the QK GEMM's zero_init).
        qk = (
            torch.matmul(q8, k8.transpose(-1, -2))
            if bits is None
            else mma_accumulate_fp8(None, q8, k8.transpose(-1, -2), mantissa_bits=bits)
        )
        s = qk * (dq[..., None] * dk[:, None, :] * block.inp.scale)  # (n, tq, Tk) fp32
        return add_bf16_mask(block, s)

    def output(s: torch.Tensor, bits: int | None, flush: int | None) -> tuple:
        r, o = online_pcast_out(
            s, v8, setup.fmt, setup.p_scale, block_n, reverse=True, accum_bits=bits, accum_flush=flush
        )
        if o is not None:
            o = (o * quant.dv[kv][:, None, :]).to(OUT_DTYPE).reshape(-1, o.shape[-1])
        return r, o

    s = scores(setup.accum_bits)
    r, o = output(s, setup.accum_bits, setup.accum_flush)
    out = MethodOutput(r.probs.reshape(-1, s.shape[-1]), pcast=r, out=o)
    out.accum = accum_label(setup.accum_bits, setup.accum_flush)
    if o is not None and setup.accum_bits is not None and setup.accum_companions:
        out.companions = accum_companions(
            lambda bits, flush: output(scores(None) if bits is None else s, bits, flush)[1],
            setup.accum_bits,
            setup.accum_flush,
            -(-s.shape[-1] // block_n),
        )
    flat = s.reshape(-1, s.shape[-1])
    return PathBlock(flat, [], [], [(PATH.name, out)])
