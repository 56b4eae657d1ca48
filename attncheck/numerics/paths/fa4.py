"""``fa4``: FlashAttention-4's forward (Blackwell, ``flash_attn/cute``), in fp16/bf16 and in its FP8 mode.

Follows Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced: ``flash_attn/cute/softmax.py``
(``SoftmaxSm100``), ``flash_attn/cute/flash_fwd_sm100.py``, ``flash_attn/cute/utils.py`` and
``flash_attn/cute/interface.py`` (files and lines below at that commit). Rounding points, in the kernel's order:

1. Scales (``flash_fwd_sm100.py:797``, ``utils.py:183-195``): ``scale_log2 = softmax_scale * LOG2_E`` as an
   fp32 product (the scale is a ``Float32`` kernel argument, ``flash_fwd_sm100.py:433``). FP8: the q and k
   descales of the call's (batch, kv head) are folded in (``:2003-2019``, ``:2183-2185``):
   ``scale_log2_eff = scale_log2 * (q_descale * k_descale)``, each product rounded to fp32; the v descale
   multiplies the final ``1/row_sum`` (``:2746``).
2. S = Q K^T (tcgen05 UMMA into fp32 tensor memory, ``flash_fwd_sm100.py:200-203``). **Assumed**: as
   FlashAttention-2's ``mma`` (``fa2._mma_accumulate``): each instruction's K extent (16 for fp16/bf16, 32 for
   FP8, the 256-bit K step of ``tcgen05.mma``) adds its exact products to the fp32 accumulator with one
   round-to-nearest, in ascending head dims; the hardware's internal alignment is not public.
3. Masking (``mask.py:615`` ``apply_mask_sm100``): masked keys and keys past Tk in the last tile are -inf in fp32.
   A float mask (not a kernel input: FA4 takes ``mask_mod``/``score_mod``) is added as ``fa2`` does.
4. Key blocks of ``n_block_size = 128`` keys (``interface.py:318``: ``FwdConfig(128, 128)`` on sm100), the
   **last** block first, then descending (``flash_fwd_sm100.py:2302-2345``). One thread holds one whole row of
   the 128 x 128 S tile (``SoftmaxSm100`` has ``num_rows = 1``, ``softmax.py:256``); its registers are
   **assumed** to hold the columns in order (the ``tcgen05.ld`` 32x32b layout).
5. Row max (``softmax.py:315-332``, ``utils.py:365-412``): ``fmax`` over the block and the previous max, exact
   (NaN ignored). ``row_max_safe`` is 0 where the max is -inf. After the first block,
   ``acc_scale_ = (m_old - m_new) * scale_log2`` (subtract, multiply: two fp32 roundings) and, **lazy rescale**
   (``softmax.py:326-330``): where ``rescale_threshold > 0`` and ``acc_scale_ >= -rescale_threshold`` the kernel
   keeps ``m_old`` and ``acc_scale = 1``; otherwise ``acc_scale = exp2(acc_scale_)`` (hardware, 9). So P may
   exceed 1 by up to ``2^rescale_threshold``. Defaults (``flash_fwd_sm100.py:2182, 2190``): threshold 8 for
   16-bit inputs and 0 (always rescale) for FP8; ``Fa4Setup.rescale_threshold`` asks for another.
6. The exponent (``softmax.py:344-358``): ``bias = max_offset - row_max_safe * scale_log2`` (product and
   difference each rounded to fp32), then ``x = fma(S, scale_log2, bias)``, one rounding (emulated exactly:
   the float64 product is exact and the sum is rounded to odd in float64 before fp32, ``_fma32``). ``max_offset``
   is 8 for FP8 and 0 for 16-bit (``flash_fwd_sm100.py:2182``), so FP8's P lies in (0, 2^(8 + threshold)].
   At this commit the kernel asserts ``max_offset + rescale_threshold < log2(dtype max)``
   (``flash_fwd_sm100.py:2191-2195``) of its own constants; ``Fa4Setup`` values that break it (e4m3:
   log2 448 = 8.81, so offset 8 with threshold 4, the setting of PR 2694 that issue 2716 reported) are still
   computed: that is the what-if. At the row max the fused exponent is the rounding residue of
   ``m * scale_log2`` plus the offset, as in ``fa2-fma``: once ``|m scale_log2| >= 2^24`` it can pass a binade and
   then exp2's or the dtype's range (PyTorch issue 121558's input): such rows are ``events["fused_max"]``, not
   saturation; so are rows whose fp32 row sum is inf although every exp is finite.
7. exp2 (``softmax.py:361-402``): per row, the 128 columns in fragments of 32; the pair (k, k+1) of fragment j
   takes the **emulation** where ``ex2_emu_freq > 0``, ``k % freq >= freq - res``, ``start <= j < frg_cnt - 1``,
   else the hardware exp2. ``res`` is 4 (the default of ``apply_exp2_convert``: the call at
   ``flash_fwd_sm100.py:2518-2523`` passes freq and start only, so the table's ``ex2_emu_res`` is unused).
   ``freq`` and ``start`` come from ``_TUNING_CONFIG``/``_FP8_TUNING_CONFIG`` (``flash_fwd_sm100.py:100-119``)
   keyed by (2-CTA, causal, padded head dim, sm103) as ``:244-246, 359-363, 507-532`` pick them (``emu_config``),
   with ``use_2cta_instrs`` from ``interface.py:822-840``. E.g. head dim 128, non-causal, Tq > 256: freq 10,
   start 1: columns 38-41, 48-51, 58-61, 70-73, 80-83, 90-93 of each block; head dim 64: freq 16, start 1;
   causal 128: 16 (FP8: 8); sm103 (B300): none.
8. The emulation ``ex2_emulation_2`` (``utils.py:771-786``, ``:700-735``), **bit for bit**: ``max(x, -127)``;
   ``r = x + (2^23 + 2^22)`` rounded **down** (``add.rm``), so the integer floor(x) sits in r's low bits;
   ``f = x - (r - (2^23 + 2^22))`` (two round-to-nearest subtractions; f in [0, 1]); the degree-3 polynomial
   ``p = fma(fma(fma(c3, f, c2), f, c1), f, c0)`` with the fp32 coefficients (``utils.py:42-46``, hex
   ``0x3D9DF09D, 0x3E6906A4, 0x3F31F519, 0x3F800000`` in ``e2e_asm2``, ``utils.py:806-813``); the result's bits
   are ``(bits(r) << 23) + bits(p)`` modulo 2^32: floor(x) added to p's exponent. -inf gives +0 exactly;
   floor(x) = -127 gives an exponent field of 0, i.e. the subnormal ``(p - 1) 2^-126``, not ``p 2^-127``.
   **Assumed**: the packed adds and fmas do not flush subnormal inputs (nvvm's packed ops without ``.ftz``).
9. Hardware exp2 (``cute.math.exp2(fastmath=True)``: ``ex2.approx.ftz.f32``). **Assumed**: 2^x rounded once to
   fp32, results below 2^-126 flushed to 0. The PTX ISA documents a maximum error of 2 ulp from the correctly
   rounded result; the model ignores it. Issue 2263 measured, on a GB200, 1.01% and 0.99% of bf16-rounded
   results differing by one bf16 ulp between the emulation and the instruction (10^6 uniform fp32 inputs on
   [-20, 0) and [-10, 0)), and up to 1428 fp32 ulp between them. Against this model (exact rounding) the
   emulation's bf16 results differ on ``EX2_BF16_DIFF_20`` = 1.00% and ``EX2_BF16_DIFF_10`` = 1.00% of such
   inputs (1.00-1.02% and 1.00% over seeds), up to 1429 fp32 ulp (``test_fa4.py``): the share is the
   polynomial's error (about 2^-13.5 relative, ~1400 fp32 ulp) meeting bf16's rounding boundaries; the
   instruction's own 2 ulp move it by at most ~2/1400 of that, which is why the model and the GPU agree to
   about 0.01%. A bitwise model of the instruction is not public.
10. P converted to the input dtype (``softmax.py:400-402``): fp16/bf16 round to nearest (fp16 beyond 65504:
    inf); FP8 ``cvt.rn.satfinite``: P above the format's largest value (448 e4m3, 57344 e5m2) becomes that
    value. Such rows: ``events["p_saturation"]`` and ``KernelRows.saturated`` (how many per row), counted
    before the cast; the fp32 row sum (11) still counts them in full, so O shrinks (issue 2716).
11. Row sum (``softmax.py:334-339``, ``utils.py:416-455``, ``flash_fwd_sm100.py:2546``): over the fp32 exps
    **before** the cast, by the thread that holds the row: eight fp32 lanes, lane l adds columns l, l+8, ...,
    in order; the previous sum times ``acc_scale`` (an fp32 product) enters lane 0 before column 0; at the end
    ``((l0 + l2) + (l4 + l6)) + ((l1 + l3) + (l5 + l7))``.
12. O (``flash_fwd_sm100.py:2680-2697``): before each block after the first, ``acc_O *= acc_scale`` (fp32; the
    correction warp skips it where every row of the warp has ``acc_scale >= 1``, which changes nothing since
    then ``acc_scale = 1``), then ``acc_O += P V`` of the block, as 2.
13. Finalize (``flash_fwd_sm100.py:2722-2746, 2834-2840``): with a learnable sink (one logit per query head,
    ``interface.py:655-658``, in the units of the scaled scores), ``row_sum += exp2(sink * LOG2_E -
    row_max * scale_log2 + max_offset)`` (hardware exp2; each product and sum rounded to fp32, **assumed**
    not contracted into fmas), the sink only in the denominator; a row with no key (max -inf) takes
    ``row_max = sink * (LOG2_E / scale_log2)``, ``row_sum = 2^max_offset``. Then
    ``scale = rcp_approx(row_sum)`` (1 where the sum is 0 or NaN) times the v descale; **assumed**
    ``rcp.approx.ftz.f32`` correctly rounded (the PTX ISA documents at most 1 ulp of error). O = ``acc_O *
    scale`` rounded to the output dtype (the input dtype; bf16 for FP8 inputs, ``interface.py:697-700``).
    LSE = ``(row_max * scale_log2 + (log2(row_sum) - max_offset)) * LN2`` (``lg2.approx`` **assumed**
    correctly rounded, each step rounded to fp32), -inf where the sum is 0 or NaN: an empty row gives O = 0
    and LSE = -inf. FP8: no backward (``interface.py:698-699``).

Not modelled: softcap and score_mod (``supports`` refuses softcap), split-KV (``num_splits=1`` by default,
``interface.py:3382``), the head-dim-256 kernel (``sm100_hd256_2cta_fmha_forward``, ``interface.py:839``:
refused), sliding windows, paged KV, varlen.

The effective probabilities (``probs``) are the converted P of each block times the later ``acc_scale`` and the
final ``scale`` (without the v descale), in float64 rounded to fp32: O = probs @ V (V times its descale for FP8)
up to the P V accumulation's rounding.

Tested by: `tests/numerics/paths/test_fa4.py::test_kernel_rows_is_bit_exact_with_the_stated_rounding_points`,
`tests/numerics/paths/test_fa4.py::test_ex2_emulation_is_bit_exact_with_its_steps`,
`tests/numerics/paths/test_fa4.py::test_exp2_emulation_differs_from_the_model_as_issue_2263`,
`tests/numerics/paths/test_fa4.py::test_emulated_columns_follow_the_tuning_table`,
`tests/numerics/paths/test_fa4.py::test_lazy_rescale_keeps_the_old_max_within_the_threshold`,
`tests/numerics/paths/test_fa4.py::test_fp8_saturation_with_offset_8_and_threshold_4`,
`tests/numerics/paths/test_fa4.py::test_sinks_only_in_the_denominator`,
`tests/numerics/paths/test_fa4.py::test_empty_rows_give_zero_output_and_minus_inf_lse`,
`tests/numerics/paths/test_fa4.py::test_p_saturation_finding_with_offset_8_and_not_4`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attncheck.numerics.paths.base import CallFacts, KernelRows, PathSpec, Stands
from attncheck.numerics.paths.fa2 import block_bias

# EX2_BF16_DIFF_10, EX2_BF16_DIFF_20 and POLY3 are re-exported (noqa): the tests read them from the path
from attncheck.numerics.paths.fa4_exp2 import (  # noqa: F401
    EX2_BF16_DIFF_10,
    EX2_BF16_DIFF_20,
    FRG_TILE,
    POLY3,
    _f32,
    _fma32,
    emu_config,
    emulated_columns,
    ex2_emulation,
    hardware_exp2,
)

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

FLASH_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
SOURCE = (
    f"Dao-AILab/flash-attention@{FLASH_COMMIT} flash_attn/cute/softmax.py, flash_fwd_sm100.py, utils.py, "
    "interface.py, mask.py"
)
ASSUMED = (
    "tcgen05 UMMA accumulation (one rounding per instruction's K step), ex2.approx.ftz.f32, rcp.approx and "
    "lg2.approx as correctly rounded (documented: at most 2, 1 ulp), register columns in order: not public / "
    "hardware approximations"
)

FA4_DEFAULT_THRESHOLD_16 = 8.0  # flash_fwd_sm100.py:2190, 16-bit inputs
FA4_DEFAULT_THRESHOLD_FP8 = 0.0  # flash_fwd_sm100.py:2190, FP8 inputs (PR 2731; 4.0 in PR 2694)
FA4_DEFAULT_OFFSET_FP8 = 8.0  # flash_fwd_sm100.py:2182
FA4_DEFAULT_OFFSET_16 = 0.0
N_BLOCK = 128  # interface.py:318 FwdConfig(128, 128) on sm100
# log2 of the largest finite value of each input dtype (flash_fwd_sm100.py:93-98)
LOG2_MAX = {"e4m3": math.log2(448.0), "e5m2": math.log2(57344.0), "fp16": math.log2(65504.0), "bf16": 128.0}


@dataclass(frozen=True)
class Fa4Setup:
    """What-if settings of the fa4 path; None: the kernel's default for the dtype (threshold 8 for fp16/bf16,
    0 for FP8; offset 0 for fp16/bf16, 8 for FP8). The kernel asserts ``max_offset + rescale_threshold <
    log2(dtype max)`` of its own constants; values here that break it are computed all the same (P then
    saturates in FP8, or overflows fp16): that is what the what-if asks."""

    rescale_threshold: float | None = None
    max_offset: float | None = None


def is_fp8(dt: torch.dtype) -> bool:
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    return dt in (torch.float8_e4m3fn, torch.float8_e5m2)


def defaults(dt: torch.dtype) -> tuple[float, float]:
    """(rescale_threshold, max_offset) the kernel uses for input dtype ``dt``."""
    if is_fp8(dt):
        return FA4_DEFAULT_THRESHOLD_FP8, FA4_DEFAULT_OFFSET_FP8
    return FA4_DEFAULT_THRESHOLD_16, FA4_DEFAULT_OFFSET_16


def _mma(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, step: int) -> torch.Tensor:
    """fp32 acc (or 0) plus a @ b, one instruction of ``step`` terms at a time in ascending order, each adding its
    exact float64 sum once rounded (assumed)."""
    for c in range(0, a.shape[-1], step):
        part = a[..., c : c + step] @ b[..., c : c + step, :]
        acc = part.float() if acc is None else part.add_(acc).float()
    return acc


def _row_sum(e: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """utils.py:416-455 (arch 100): eight fp32 lanes over the block's columns, ``init`` into lane 0 first."""
    lanes = e[:, 0:8].clone()
    if init is not None:
        lanes[:, 0] = init + e[:, 0]
    for c in range(8, e.shape[1], 8):
        lanes = lanes + e[:, c : c + 8]
    pairs = lanes.reshape(-1, 4, 2)  # packed pairs (l0, l1), (l2, l3), (l4, l5), (l6, l7)
    a = pairs[:, 0] + pairs[:, 1]
    b = pairs[:, 2] + pairs[:, 3]
    a = a + b
    return a[:, 0] + a[:, 1]


def _to_dtype(p: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """fp32 P converted to the input dtype as the kernel does (FP8 saturating), as float64 values."""
    if is_fp8(dt):
        # inside the function: the module imports without torch (the registry reads its spec at CLI start)
        from attncheck.numerics.methods.fp8 import fp8_values

        return fp8_values(p, dt).double()
    return p.to(dt).double()


def kernel_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    scale: float,
    dt: torch.dtype,
    rescale_threshold: float | None = None,
    max_offset: float | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    exp2: str = "kernel",
    block_n: int = N_BLOCK,
    head_dim_v: int | None = None,
    causal: bool = False,
    seqlen_q: int | None = None,
    qhead_per_kvhead: int = 1,
    sm103: bool = False,
    emu: tuple[int, int, int] | None = None,
    qk_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
    want_probs: bool = True,
) -> KernelRows:
    """FlashAttention-4's forward on rows (module docstring for the rounding points).

    q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) or None: float64 (or any float) holding the values the kernel
    reads (rounded to ``dt`` here; for FP8 the quantised values, the descales given apart as ``qk_descale``
    (q descale x k descale, per plane (n,) or one number) and ``v_descale`` (n,) or a number). ``dt``: fp16, bf16,
    float8_e4m3fn or float8_e5m2. ``bias`` (n*tq, Tk) float32 in the units of the scaled scores (-inf:
    masked) or None; ``sinks`` (n,) learnable sink logits of the planes' query heads, or None. ``exp2``: 'kernel'
    (the configuration's mix: ``emu`` (freq, res, start) or ``emu_config`` of head dim, ``causal``,
    ``seqlen_q`` (default tq), ``qhead_per_kvhead``, ``head_dim_v``, ``sm103``), 'hardware' or 'emulated'.
    Rows are the (n, tq) pairs, flattened; ``out`` is in ``dt`` (bf16 for FP8). ``want_probs`` False: ``probs`` is
    None and no block's P is kept (O and LSE alone, for long key lengths); callers chunk rows, S being (r, Tk)."""
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    from attncheck.numerics.precision import cast

    n, tq, d = q.shape
    tk = k.shape[1]
    r = n * tq
    fp8 = is_fp8(dt)
    if block_n % FRG_TILE:
        raise ValueError(f"block_n {block_n} is not a multiple of {FRG_TILE}")
    if exp2 not in ("kernel", "hardware", "emulated"):
        raise ValueError(f"exp2 must be 'kernel', 'hardware' or 'emulated', got {exp2!r}")
    thr0, off0 = defaults(dt)
    thr = thr0 if rescale_threshold is None else float(rescale_threshold)
    off = _f32(off0 if max_offset is None else float(max_offset))
    out_dt = torch.bfloat16 if fp8 else dt
    emu_cols, emu_mask = _exp2_columns(
        exp2, emu, d, fp8, causal, tq, seqlen_q, qhead_per_kvhead, head_dim_v, v, sm103, block_n
    )
    step = 32 if fp8 else 16

    def rd(x: torch.Tensor) -> torch.Tensor:  # the dtype's values as float64 (one rounding from float64)
        return _to_dtype(x.float(), dt) if fp8 else cast(x.double(), dt).double()

    scale_log2, unit, vds = _scales(scale, qk_descale, v_descale, n, tq, r)
    # 2. S in fp32
    qd, kd = rd(q), rd(k)
    s = _mma(None, qd, kd.transpose(-1, -2), step).reshape(r, tk)
    if bias is not None:  # 3. -inf masks; a float mask in scaled units reaches the exponent as given
        s = s + bias.float() / unit[:, None]
    nb = -(-tk // block_n)
    pad = nb * block_n - tk
    if pad:
        s = torch.cat([s, s.new_full((r, pad), -math.inf)], dim=1)
    vd = None
    if v is not None:
        vd = rd(v)
        if pad:
            vd = torch.cat([vd, vd.new_zeros(n, pad, vd.shape[-1])], dim=1)
    geo = (n, tq, tk, r, nb, block_n)
    run = _key_blocks(s, vd, scale_log2, dt, thr, off, emu_cols, emu_mask, step, want_probs, geo)
    return _finalize(run, s, sinks, vds, scale_log2, off, out_dt, want_probs, geo)


def _exp2_columns(exp2, emu, d, fp8, causal, tq, seqlen_q, qhead_per_kvhead, head_dim_v, v, sm103, block_n):
    """The columns of a key block whose exp2 is emulated (the configuration's mix, all, or none): (their
    indices, a (block_n,) bool mask of them)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    dv_dim = head_dim_v if head_dim_v is not None else (v.shape[-1] if v is not None else d)
    if exp2 == "kernel":
        freq, res, start = emu or emu_config(
            d,
            fp8=fp8,
            causal=causal,
            seqlen_q=tq if seqlen_q is None else seqlen_q,
            qhead_per_kvhead=qhead_per_kvhead,
            head_dim_v=dv_dim,
            sm103=sm103,
        )
        emu_cols = emulated_columns(block_n, freq, res, start)
    else:
        emu_cols = list(range(block_n)) if exp2 == "emulated" else []
    emu_mask = torch.zeros(block_n, dtype=torch.bool)
    emu_mask[emu_cols] = True
    return emu_cols, emu_mask


def _scales(scale: float, qk_descale, v_descale, n: int, tq: int, r: int):
    """Step 1: per row the exponent's scale (scale * log2(e), times the q and k descales), the scaled scores'
    unit, and the v descale or None."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    # 1. scales
    scale_log2 = torch.full((r,), _f32(_f32(scale) * _f32(math.log2(math.e))), dtype=torch.float32)
    unit = torch.full((r,), _f32(scale), dtype=torch.float32)  # S x unit: the scaled scores (a float mask's units)
    if qk_descale is not None:
        qkd = torch.as_tensor(qk_descale, dtype=torch.float32).reshape(-1)
        qkd = (qkd.expand(n) if qkd.numel() == 1 else qkd).repeat_interleave(tq)
        scale_log2 = scale_log2 * qkd
        unit = unit * qkd
    vds = None
    if v_descale is not None:
        vds = torch.as_tensor(v_descale, dtype=torch.float32).reshape(-1)
        vds = (vds.expand(n) if vds.numel() == 1 else vds).repeat_interleave(tq)
    return scale_log2, unit, vds


def _key_blocks(s, vd, scale_log2, dt, thr: float, off: float, emu_cols, emu_mask, step: int, want_probs: bool, geo):
    """Steps 4-12, the main loop over key blocks, the last first: the running max with the lazy rescale, the
    exponent with the max offset, exp2 (emulated and hardware columns), P's saturation and cast, the row sum and
    P @ V: (m, row_sum, acc, blocks, scales, saturated, fused)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    n, tq, tk, r, nb, block_n = geo
    top = float(torch.finfo(dt).max)
    ninf = torch.tensor(-math.inf)
    m = row_sum = acc = None
    blocks: list[tuple[int, torch.Tensor]] = []
    scales: list[torch.Tensor] = []  # acc_scale before block i (1 for the first)
    saturated = torch.zeros(r, dtype=torch.int64)
    fused = torch.zeros(r, dtype=torch.bool)
    log2_top = math.log2(top)
    sl2 = scale_log2
    for j in range(nb - 1, -1, -1):  # 4. the last block first
        sb = s[:, j * block_n : (j + 1) * block_n]
        bmax = torch.where(torch.isnan(sb), ninf, sb).amax(dim=1)  # 5. fmax ignores NaN
        if m is None:
            m_new = bmax
            safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
            acc_scale = torch.ones(r, dtype=torch.float32)
        else:
            m_new = torch.fmax(m, bmax)
            safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
            acc_scale_ = (m - safe) * sl2  # two fp32 roundings
            acc_scale = hardware_exp2(acc_scale_)
            if thr > 0.0:
                keep = acc_scale_ >= _f32(-thr)
                m_new = torch.where(keep, m, m_new)
                safe = torch.where(keep, m, safe)
                acc_scale = torch.where(keep, 1.0, acc_scale)
        m = m_new
        scales.append(acc_scale)
        # 6. the exponent: bias = max_offset - m * scale_log2, x = fma(S, scale_log2, bias)
        bias_b = off - safe * sl2
        x = _fma32(sb, sl2[:, None], bias_b[:, None])
        # 7-9. exp2: the emulated columns and the hardware ones
        p = hardware_exp2(x)
        if emu_cols:
            p[:, emu_mask] = ex2_emulation(x[:, emu_mask])
        # 10. P in the input dtype, saturation counted before the cast. A P above the dtype's range whose exact
        # exponent (S - m) scale_log2 + offset lies a binade or more below log2(max) comes from the fused rounding
        # residue of m * scale_log2 (|m scale_log2| >= 2^24), not from the offset and threshold: fused_max
        over = p > top
        if bool(over.any()):
            exact = (sb.double() - safe.double()[:, None]) * sl2.double()[:, None] + off
            residue = over & (exact <= log2_top - 1) & torch.isfinite(sb)
            fused |= residue.any(dim=1)
            over = over & ~residue
        saturated += over.sum(dim=1)
        pd = _to_dtype(p, dt)
        if want_probs:  # the dtype's values, exact in fp32
            blocks.append((j, pd.float()))
        # 11. the row sum over the fp32 exps, the previous sum rescaled into lane 0
        row_sum = _row_sum(p, None if row_sum is None else row_sum * acc_scale)
        # 12. O rescaled, then P V
        if vd is not None:
            if acc is not None:
                acc = acc * acc_scale.reshape(n, tq, 1)
            acc = _mma(acc, pd.reshape(n, tq, block_n), vd[:, j * block_n : (j + 1) * block_n], step)
    return m, row_sum, acc, blocks, scales, saturated, fused


def _finalize(run, s, sinks, vds, sl2, off: float, out_dt, want_probs: bool, geo) -> KernelRows:
    """Step 13: the sinks, 1/row_sum, O, LSE, the effective probabilities and the rows' events."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    n, tq, tk, r, nb, block_n = geo
    m, row_sum, acc, blocks, scales, saturated, fused = run
    # 13. finalize
    log2e = _f32(math.log2(math.e))
    if sinks is not None:
        sk = torch.as_tensor(sinks).float().reshape(-1)
        sk = (sk.expand(n) if sk.numel() == 1 else sk).repeat_interleave(tq)
        empty = torch.isneginf(m)
        e_sink = hardware_exp2((sk * log2e - m * sl2) + off)
        m = torch.where(empty, sk * (torch.tensor(log2e) / sl2), m)
        row_sum = torch.where(empty, torch.tensor(2.0**off, dtype=torch.float32), row_sum + e_sink)
    bad = (row_sum == 0) | torch.isnan(row_sum)
    rcp = 1.0 / torch.where(bad, torch.ones_like(row_sum), row_sum)  # rcp.approx, modelled correctly rounded
    fscale = rcp if vds is None else rcp * vds
    out = None if acc is None else (acc * fscale.reshape(n, tq, 1)).to(out_dt).reshape(r, -1)
    ln2 = _f32(math.log(2.0))
    log_sum = torch.log2(row_sum.double()).float()
    lse = torch.where(bad, -math.inf, (m * sl2 + (log_sum - off)) * ln2)
    # effective probabilities: P_j times the later acc_scales and the final 1/row_sum, float64 then fp32
    probs = None
    if want_probs:
        later = torch.ones(r, dtype=torch.float64)
        probs = torch.empty(r, nb * block_n, dtype=torch.float32)
        for i in range(len(blocks) - 1, -1, -1):
            j, pd = blocks[i]
            probs[:, j * block_n : (j + 1) * block_n] = (pd.double() * (later * rcp.double())[:, None]).float()
            later = later * scales[i].double()
        probs = probs[:, :tk]
    # a row sum of inf from finite exps (more keys than fp32 holds at 2^(offset + threshold)) counts with fused_max,
    # as fa2's events do
    fused |= torch.isposinf(row_sum) & (saturated == 0) & ~torch.isposinf(s).any(dim=1)
    events = {"p_saturation": saturated > 0, "fused_max": fused}
    return KernelRows(probs, out, lse, events, scores=s[:, :tk], saturated=saturated)


def block_setup(params: MethodParams) -> Fa4Setup:
    setup = getattr(params, "fa4", None)
    return setup if setup is not None else Fa4Setup()


def forward(block: QKBlock, dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    """The fa4 forward on a block of rows in ``dt`` (fp16, bf16, or an FP8 format: then Q, K, V are quantised
    with descales per (batch, kv head) as ``fp8_attention.quantize_inputs`` does, and O is bf16)."""
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock

    setup = block_setup(params)
    inp = block.inp
    call = inp.call
    causal = call is not None and call.mask == "causal"
    hq, hk = inp.q.shape[1], inp.k.shape[1]
    common = dict(
        rescale_threshold=setup.rescale_threshold,
        max_offset=setup.max_offset if is_fp8(dt) else None,  # the FP8 max offset: 16-bit inputs run offset 0
        causal=causal,
        seqlen_q=inp.q.shape[2],
        qhead_per_kvhead=hq // hk,
        sm103=call is not None and call.capability == (10, 3),
    )
    if is_fp8(dt):
        # inside the function: the module imports without torch (the registry reads its spec at CLI start)
        from attncheck.numerics.inputs.scores import _kv_heads
        from attncheck.numerics.methods.fp8_attention import OUT_DTYPE, Fp8Setup, quantize_inputs, record_audit

        fsetup = params.fp8 or Fp8Setup(fmt=dt)
        if fsetup.fmt != dt or fsetup.scaling == "block":  # the kernel takes one descale per (batch, kv head)
            fsetup = dataclasses.replace(
                fsetup, fmt=dt, scaling="head" if fsetup.scaling == "block" else fsetup.scaling
            )
        quant = quantize_inputs(inp, fsetup)
        record_audit(block, dt, fsetup, quant)
        bh, qs = block.rows
        kv = _kv_heads(inp, bh)
        q8, dq = quant.q8[bh, qs], quant.dq[bh, qs][:, 0]  # one descale per plane
        k8, dk = quant.k8[kv], quant.dk[kv][:, 0]
        qkd = dq * dk  # fp32 (flash_fwd_sm100.py:2010-2016: 1.0 * q_descale * k_descale)
        v8 = None if quant.v8 is None else quant.v8[kv]
        bias = block_bias(block, OUT_DTYPE)
        res = kernel_rows(
            q8,
            k8,
            v8,
            scale=inp.scale,
            dt=dt,
            bias=bias,
            qk_descale=qkd,
            v_descale=None if quant.dv is None else quant.dv[kv][:, 0],
            **common,
        )
        s = res.scores * (qkd.repeat_interleave(q8.shape[1])[:, None] * torch.tensor(inp.scale, dtype=torch.float32))
        before: list = []
    else:
        s, before = block.fp32_scores(dt, PATH)
        res = kernel_rows(block.q, block.k, block.v, scale=inp.scale, dt=dt, bias=block_bias(block, dt), **common)
    out = MethodOutput(res.probs, events=dict(res.events), counts={"p_saturation": res.saturated})
    out.out = res.out
    return PathBlock(s, before, [], [(PATH.name, out)])


def supports(facts: CallFacts) -> str | None:
    """Why FlashAttention-4's forward would not run this call (interface.py), by its shape and dtype."""
    who = "FlashAttention-4"
    if facts.dtype not in ("fp16", "bf16", "e4m3", "e5m2"):
        return f"{facts.dtype}: {who} takes fp16, bf16, e4m3 and e5m2 (interface.py:637)"
    if facts.mask == "explicit":
        return f"an explicit mask: {who} takes causal (or a mask_mod), not a mask tensor"
    d, dv = facts.head_dim, facts.head_dim_v
    align = 16 if facts.dtype in ("e4m3", "e5m2") else 8
    standard = 8 <= d <= 128 and 8 <= dv <= 128
    if not (standard or (d == 192 and dv == 128)) or d % align or dv % align:
        if d == 256 and dv == 256:
            return f"head dim 256: {who} runs a dedicated kernel (sm100_hd256_2cta_fmha_forward), not emulated"
        return (
            f"head dims ({d}, {dv}): {who} on sm100 takes 8-128 (multiples of {align}), (192, 128) or (256, 256) "
            "(interface.py:112-131)"
        )
    if facts.dropout > 0:
        return f"dropout {facts.dropout}: {who} has no dropout"
    if facts.softcap:
        return f"a softcap: {who}'s score_mod softcap is not emulated"
    if facts.window is not None:
        return f"a sliding window: not emulated for {who}"
    return None


PATH = PathSpec(
    name="fa4",
    summary="FlashAttention-4's forward (Blackwell): S in fp32, 128-key blocks last to first, the lazy rescale "
    "(threshold 8 for fp16/bf16, 0 for FP8), exp2 partly by the degree-3 emulation, max offset 8 and saturating "
    "cast for FP8, the row sum over fp32 exps, 1/sum by rcp.approx",
    impl="attncheck.numerics.paths.fa4:forward",
    kernel="FlashAttention-4's forward",
    scores_in="fp32 tensor memory (tcgen05 accumulator)",
    probs_in="fp32",
    fp8="both",
    default=False,
    device="cuda",
    source=SOURCE,
    assumed=ASSUMED,
    stands_for=(Stands("flash_attn", "fa4"), Stands("sdpa", "flash_attention:fa4", "cuda")),
    supports="attncheck.numerics.paths.fa4:supports",
    replay=True,
    # the lazy rescale's headroom (how far P may grow before its dtype runs out) and --what-if fa4's grid
    limit="attncheck.numerics.paths.fa4_settings:limit",
    settings="attncheck.numerics.paths.fa4_settings:settings",
)
