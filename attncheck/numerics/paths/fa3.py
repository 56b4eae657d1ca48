"""``fa3``: FlashAttention-3's Hopper forward (``hopper/`` of the flash-attn package, ``flash_attn_interface``).

Follows Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced (``hopper/softmax.h``,
``mainloop_fwd_sm90_tma_gmma_ws.hpp``, ``flash_fwd_kernel_sm90.h``, ``epilogue_fwd.hpp``, ``tile_size.h``,
``utils.h``, ``mask.h``, ``flash_api.cpp``), in its default configuration (KV not paged, no local window, no split,
IntraWGOverlap). In fp16 and bf16 it is the 16-bit kernel below; in the FP8 dtypes (e4m3, e5m2) it is the
``flash-fp8`` path's forward (``attncheck.numerics.paths.flash_fp8``, called, not copied: FlashAttention-3's FP8
forward, descales per batch and kv head as the kernel takes them, ``--fp8-scaling head`` by default). The name
``flash-fp8`` stays a path of its own on the same code: its cells keep their names, and it is the FP8 kernel of
``--what-if e4m3``. ``kernel_rows`` takes both: in an FP8 dtype it is flash-fp8's forward on tensors, with the
kernel's fp32 descales (``flash_fwd_kernel_sm90.h:408-414`` folds the q and k descales into the softmax scale;
the v descale multiplies O at the end, ``mainloop_fwd_sm90_tma_gmma_ws.hpp:1241-1242``). FlashAttention-3 package
calls with FP8 descales are not judged yet (the loader refuses them). Rounding points of the 16-bit kernel, in
order (files at the commit):

1. Scales (``mainloop_fwd_sm90_tma_gmma_ws.hpp:543-562``, ``flash_api.cpp:130-131, 772``): ``softmax_scale_log2 =
   float(softmax_scale * M_LOG2E)`` (the float scale times a double, stored as float); with a softcap,
   ``softcap_val = softmax_scale / softcap`` (float / float) and ``softmax_scale_log2 = float(softcap * M_LOG2E)``.
2. S = Q K^T (``mainloop_fwd_sm90_tma_gmma_ws.hpp:1141, 1177``): q and k in the dtype, WGMMA with k = 16 per
   instruction in ascending head dims into an fp32 accumulator. **Assumed**: each instruction adds its 16 exact
   products with one round-to-nearest, as ``fa2`` (Hopper's internal alignment is not public).
3. Softcap (``:1075-1077``, ``utils.h:573-578``): ``fast_tanh(S * softcap_val)``, the product rounded to fp32;
   **assumed** tanh rounded once (``tanh.approx.f32`` not modelled). Before the mask.
4. Masking (``mask.h:47-101``): -inf for keys past Tk in the first (last-indexed) block and for the causal mask
   (bottom-right aligned: query i sees keys j <= i + Tk - Tq), in fp32. The kernel takes no attention mask: a
   float mask given here (units of the scaled scores) is divided by the exponent's scale and added in fp32, as in
   ``fa2``.
5. Key blocks of ``kBlockN`` keys (``tile_size.h:13-40``, element size 2: head dim <= 64: 192, 128 causal; <= 96:
   144; <= 128: 176, 128 causal; <= 192: 112 (128 with a v head dim <= 128); <= 256: 80), from the **last** to the
   first (``mainloop_fwd_sm90_tma_gmma_ws.hpp:1060, 1163, 1215-1226``).
6. Row max in fp32 (``softmax.h:102-113``; ``utils.h:64-67`` ``max`` = fmaxf, NaN ignored; the quad all-reduce
   ``utils.h:79-98``), exact.
7. Rescale on **every** block after the first (``softmax.h:114-121``): ``scores_scale = exp2f((m_prev - m_cur) *
   softmax_scale_log2)`` (subtract, multiply, each rounded), ``row_sum *= scores_scale``; ``m_cur`` 0 where the
   max is -inf only with ``Check_inf``: the first block (``:1152``) and masked blocks (``:1216``), not the fully
   visible ones (``:1226``). Here: the first block always, every block when a mask (causal or given) is given.
8. The exponent (``softmax.h:74-86``): ``max_scaled = m * softmax_scale_log2`` rounded to fp32 (0 where m is -inf
   under ``Check_inf``), ``exp2f(x * softmax_scale_log2 - max_scaled)``: no ``UNFUSE_FMA`` branch in ``hopper/``,
   and nvcc contracts it into one FFMA (the comment at ``:82-84``): one rounding, as ``fa2-fma``. At the row max it
   is the residue of rounding ``max_scaled``, not 0: from |max_scaled| >= 2^31 (fp16: 2^28) it can overflow exp2
   (or P in fp16): ``events["fused_max"]``, as ``fa2-fma``; the same cell limit (``limit``).
9. exp2f is ``ex2.approx.ftz.f32`` (fast math). **Assumed**: exact 2^x rounded once to fp32, results below 2^-126
   flushed to 0 (``fa2._exp2f``).
10. Row sum (``softmax.h:56-61, 126-135``): over the fp32 exps **before** P is rounded, per thread and without the
    all-reduce until ``finalize``: the WGMMA C fragment (``utils.h:124-134`` ``convert_layout_acc_rowcol``, SM90)
    gives thread t of a quad the columns ``8v + 2t + {0, 1}``, v ascending, summed in order; the thread's sum is
    rescaled by 7 before each later block; ``finalize`` all-reduces the quad as ``(s0 + s2) + (s1 + s3)``
    (``softmax.h:139``, ``utils.h:79-98``: xor 2, then xor 1).
11. P rounded to the dtype (``utils.h:210-223`` ``convert_type_out``, ``mainloop_fwd_sm90_tma_gmma_ws.hpp:1159,
    1202``) for the register-sourced P V WGMMA (``:1182, 1240``): 16 keys per instruction in ascending order into
    the fp32 ``tOrO``, cleared first (``:1166``); **assumed** as in 2.
12. The order of O's operations (``:1170-1206, 1238-1250``). With IntraWGOverlap the softmax of block j runs beside
    P V of block j-1. Head dims <= 128: ``tOrO += P_{j-1} V_{j-1}``, then ``tOrO *= scale_j`` (``:1205``);
    ``RescaleOBeforeGemm`` (head dims > 128, ``:356``): ``tOrO *= scale_{j-1}`` (``:1178``), then ``tOrO +=
    P_{j-1} V_{j-1}``, and ``tOrO *= scale_last`` before the last P V (``:1238``). Written out over the blocks
    b_0 (first), ..., b_L both are the same sequence, ``+P_0 V_0, *s_1, +P_1 V_1, ..., *s_L, +P_L V_L`` (the
    first rescale of ``RescaleOBeforeGemm`` multiplies the cleared O by 1): the flag moves the rescale in time, not
    in the order of the fp32 operations, so one emulation serves both (and it is FlashAttention-2's order).
13. Finalize (``softmax.h:137-153``): ``inv_sum = 0`` where the sum is 0 or NaN (``:144``; FlashAttention-2 has
    1), else ``1/sum`` in fp32; ``tOrO *= inv_sum`` (``:157-165``, ``mainloop_fwd_sm90_tma_gmma_ws.hpp:1250``),
    rounded to the dtype (``epilogue_fwd.hpp:242`` ``convert_type_out``); ``LSE = row_max * (softmax_scale_log2 *
    float(M_LN2)) + __logf(sum)``: the product of the two floats rounded to fp32, ``__logf`` **assumed** rounded
    once to fp32, the fma (contracted) rounded once; -inf where the sum is 0 or NaN (``:151``). An empty row: O = 0
    and LSE = -inf (a query tile with no key block gets the same from ``epilogue_fwd.hpp:411-441``
    ``store_zero``).

Not modelled: split-KV (``num_splits > 1``: partial O in fp32 combined by LSE), paged KV and the local window
(``supports`` refuses a window), PackGQA's row grouping (it changes which rows share a tile, not their
arithmetic), ``Check_inf`` off on fully visible blocks of causal calls (rows whose scores are -inf from fp32
overflow of q.k, as ``fa2``). FlashAttention-3's own backward is not emulated: the path's backward is ``recompute``
(FlashAttention-2's). The effective probabilities (``probs``) are the rounded P of each block times the later
rescales and ``inv_sum``, in float64 rounded to fp32: O = probs @ V up to the P V accumulation's rounding.

Tested by: ``tests/numerics/paths/test_fa3.py::test_fa3_bit_for_bit_against_written_out_kernel`` (random, causal
with Tq != Tk, fully masked rows, tile boundaries, fp16 and bf16, head dims 64/128/256, against the mainloop written
out with both orders of step 12),
``tests/numerics/paths/test_fa3.py::test_fa3_forward_on_a_gqa_causal_block``,
``tests/numerics/paths/test_fa3.py::test_lse_uses_the_kernels_float_product_of_scale_log2_and_ln2``,
``tests/numerics/paths/test_fa3.py::test_first_block_checks_for_an_all_minus_inf_max``,
``tests/numerics/paths/test_fa3.py::test_fa3_empty_rows_give_zero_and_minus_inf``,
``tests/numerics/paths/test_fa3.py::test_fa3_healthy_bf16_has_no_event``,
``tests/numerics/paths/test_fa3.py::test_fa3_fused_exponent_overflows_as_fa2_fma``,
``tests/numerics/paths/test_fa3.py::test_fa3_fp8_mode_is_flash_fp8``,
``tests/numerics/paths/test_fa3.py::test_kernel_rows_fp8_mode_is_flash_fp8_with_the_kernels_descales``,
``tests/numerics/paths/test_fa3.py::test_fa3_judges_an_sdpa_capture_with_flash_impl_fa3``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from attncheck.numerics.paths import fa2, fa2_fma, flash_fp8
from attncheck.numerics.paths.base import CallFacts, KernelRows, PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

FLASH_COMMIT = fa2.FLASH_COMMIT
SOURCE = (
    f"Dao-AILab/flash-attention@{FLASH_COMMIT} hopper/softmax.h, mainloop_fwd_sm90_tma_gmma_ws.hpp, "
    "flash_fwd_kernel_sm90.h, epilogue_fwd.hpp, tile_size.h, utils.h, mask.h, flash_api.cpp"
)
ASSUMED = (
    "WGMMA accumulation (one rounding per 16-term instruction), ex2.approx.ftz.f32 as exp2 rounded once with "
    "subnormals flushed, __logf and tanh.approx as correctly rounded: not public / hardware approximations; "
    "FlashAttention-3's own backward is not emulated (the path's backward is FlashAttention-2's recompute); "
    "FP8 mode: flash-fp8's assumptions (the FP8 accumulation taken as fp32)"
)
LN2_F32 = 0.693147182464599609375  # float(M_LN2): ln 2 rounded to fp32


def tile_n(head_dim: int, head_dim_v: int | None = None, causal: bool = False) -> int:
    """FlashAttention-3's kBlockN for 2-byte elements (``hopper/tile_size.h:13-40`` ``tile_size_fwd_sm90``, the
    default configuration: KV not paged, no local window), head dims rounded up to 64/96/128/192/256 as
    ``flash_api.cpp`` ``round_up_headdim`` does. The FP8 tile is ``fp8_attention.fa3_tile``."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if head_dim <= 64:
        if dv > 256:
            return 64
        if dv > 128:
            return 96
        return 128 if causal else 192
    if head_dim <= 96:
        return 144
    if head_dim <= 128:
        return 128 if causal else 176
    if head_dim <= 192:
        return 128 if dv <= 128 else 112
    return 80


def _f32(x: float) -> float:
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    return float(torch.tensor(x, dtype=torch.float32))


def kernel_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    scale: float,
    dt: torch.dtype,
    block_n: int,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    q_descale: float | torch.Tensor = 1.0,
    k_descale: float | torch.Tensor = 1.0,
    v_descale: float | torch.Tensor = 1.0,
) -> KernelRows:
    """FlashAttention-3's forward on rows: q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) or None (float64 or any
    float; rounded to ``dt``), ``bias`` (n*tq, Tk) float32 in the units of the scaled scores (-inf: masked; the
    kernel's causal mask is such -inf) or None, ``block_n`` the key tile (``tile_n``; FP8: ``fa3_tile``). Rows are
    the (n, tq) pairs, flattened. fp16/bf16: the 16-bit kernel (the module docstring's rounding points);
    ``events["fused_max"]``: rows whose fused exponent overflowed (an exp of a finite score beyond the dtype's
    range, or a row sum of inf). FP8 dtypes (``float8_e4m3fn``, ``float8_e5m2``): q, k, v hold the FP8 values
    the kernel reads and the descales are the kernel's fp32 ones (a float, or (n,) per row head: per batch and
    kv head as the kernel takes them); the FP8 forward of ``flash-fp8`` (``fp8_attention.online_pcast_out``:
    S = q8 k8^T in fp32 times ((q descale x k descale) x scale), P scaled by 2^8 and cast to the format, O in
    fp32 times the v descale, rounded to bf16); its ``lse`` is the log-sum-exp of those fp32 scores in float64,
    rounded to fp32 (flash-fp8 models the exponent in natural units, not the kernel's exp2 and finalize)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    if dt.itemsize == 1:
        return _fp8_rows(q, k, v, scale, dt, block_n, bias, q_descale, k_descale, v_descale)

    n, tq, _ = q.shape
    tk = k.shape[1]
    r = n * tq
    if block_n % 16:
        raise ValueError(f"block_n {block_n} is not a multiple of 16 (one WGMMA k step)")
    qd, kd = cast(q.double(), dt).double(), cast(k.double(), dt).double()
    pre, exp_scale, scale_log2, lse_scale = _scales(scale, softcap)
    s = _scores(qd, kd, r, tk, pre, bias, exp_scale)
    nb = -(-tk // block_n)
    pad = nb * block_n - tk
    if pad:  # keys past Tk: -inf scores (Seqlenk_mask), zero V rows (TMA fills them with zeros)
        s = torch.cat([s, s.new_full((r, pad), float("-inf"))], dim=1)
    vd = None
    if v is not None:
        vd = cast(v.double(), dt).double()
        if pad:
            vd = torch.cat([vd, vd.new_zeros(n, pad, vd.shape[-1])], dim=1)
    lt, m, acc, blocks, rescales, broke = _key_blocks(s, vd, n, tq, r, nb, block_n, scale_log2, bias, dt)
    # 13. finalize: FlashAttention-2's, but inv_sum 0 for an empty row (O = 0, LSE -inf)
    return fa2.finalize(lt, m, acc, blocks, rescales, broke, s, lse_scale=lse_scale, dt=dt, tk=tk, empty_inv=0.0)


def _scales(scale: float, softcap: float | None) -> tuple[float | None, float, float, float]:
    """Step 1: the scales as the mainloop's arguments store them: (the softcap's pre-scale or None, the mask's
    divisor, the exponent's scale * log2(e), LSE's scale)."""
    # 1. the scales, as the mainloop's arguments store them (float fields; M_LOG2E a double)
    scale32 = _f32(scale)
    if softcap:
        cap32 = _f32(softcap)
        pre = _f32(scale32 / cap32)
        exp_scale, scale_log2 = cap32, _f32(cap32 * math.log2(math.e))
    else:
        pre, exp_scale, scale_log2 = None, scale32, _f32(scale32 * math.log2(math.e))
    lse_scale = _f32(scale_log2 * LN2_F32)  # softmax_scale_log2 * float(M_LN2), a float product
    return pre, exp_scale, scale_log2, lse_scale


def _scores(qd, kd, r: int, tk: int, pre: float | None, bias, exp_scale: float):
    """Steps 2-4: S (r, Tk) in fp32, softcapped, with the mask added."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    s = fa2._mma_accumulate(None, qd, kd.transpose(-1, -2)).reshape(r, tk)  # 2. (r, Tk) fp32
    if pre is not None:  # 3. softcap before the mask
        s = torch.tanh((s * pre).double()).float()
    if bias is not None:  # 4. the mask
        s = s + bias.float() / exp_scale
    return s


def _key_blocks(s, vd, n: int, tq: int, r: int, nb: int, block_n: int, scale_log2: float, bias, dt):
    """Steps 5-12, the main loop over key blocks, the last first: the running max, the rescale, the fused
    exponent, the quad's thread sums, O rescaled and P @ V: (lt, m, acc, blocks, rescales, broke) for
    ``fa2.finalize``."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    ninf = torch.tensor(float("-inf"), dtype=torch.float32)
    sl2 = torch.tensor(scale_log2, dtype=torch.float32)
    m = lt = None  # (r,) running max; (r, 4) the quad's thread-local sums; fp32
    acc = None if vd is None else torch.zeros(n, tq, vd.shape[-1], dtype=torch.float32)  # tOrO, cleared (11)
    blocks: list[tuple[int, torch.Tensor]] = []  # (block, its P in dt as float64), in processing order
    rescales: list[torch.Tensor] = []  # (r,) float32 the rescale after the block before (1 for the first)
    broke = torch.zeros(r, dtype=torch.bool)
    for j in range(nb - 1, -1, -1):  # 5. the last key block first
        sb = s[:, j * block_n : (j + 1) * block_n]
        bmax = torch.where(torch.isnan(sb), ninf, sb).amax(dim=1)  # 6.
        check_inf = m is None or bias is not None
        if m is None:
            m, f = bmax, torch.ones(r, dtype=torch.float32)
        else:  # 7. every block after the first
            prev, m = m, torch.fmax(m, bmax)
            cur = torch.where(torch.isneginf(m), torch.zeros_like(m), m) if check_inf else m
            f = fa2._exp2f((prev - cur) * sl2)
            lt = lt * f[:, None]
        rescales.append(f)
        # 8. max_scaled (0 for an all -inf row under Check_inf), then the fused exponent: the product of two fp32
        # values is exact in float64, so the fma's one rounding is the float64 difference rounded to fp32
        ms = (m.double() * scale_log2).float()
        if check_inf:
            ms = torch.where(torch.isneginf(m), torch.zeros_like(ms), ms)
        p = fa2._exp2f((sb.double() * scale_log2 - ms.double()[:, None]).float())  # 9.
        # 10. thread t of the quad holds columns 8v + 2t + {0, 1}, v ascending
        pt = p.reshape(r, block_n // 8, 4, 2).permute(0, 2, 1, 3).reshape(r, 4, block_n // 4)
        start = 0
        if lt is None:
            lt, start = pt[:, :, 0].clone(), 1
        for c in range(start, block_n // 4):
            lt = lt + pt[:, :, c]
        pd = cast(p, dt).double()  # 11. P in the dtype
        inf_p = torch.isposinf(pd)
        if bool(inf_p.any()):
            broke |= (inf_p & torch.isfinite(sb)).any(dim=1)
        blocks.append((j, pd))
        if acc is not None:  # 12. O rescaled, then this block's P V: FlashAttention-2's order, for every head dim
            acc = fa2._mma_accumulate(
                acc * f.reshape(n, tq, 1), pd.reshape(n, tq, block_n), vd[:, j * block_n : (j + 1) * block_n]
            )
    return lt, m, acc, blocks, rescales, broke


def _fp8_rows(q, k, v, scale, dt, block_n, bias, q_descale, k_descale, v_descale) -> KernelRows:
    """``kernel_rows`` in an FP8 dtype: flash-fp8's forward on tensors (see ``kernel_rows``)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.methods.fp8 import fp8_values
    from attncheck.numerics.methods.fp8_attention import FA3_P_SCALE, OUT_DTYPE, online_pcast_out

    n, tq, _ = q.shape
    tk = k.shape[1]

    def per_head(x) -> torch.Tensor:  # (n, 1, 1) float32
        return torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 1).expand(n, 1, 1)

    q8, k8 = fp8_values(q, dt), fp8_values(k, dt)
    # flash_fwd_kernel_sm90.h:414 folds the descales into the softmax scale: S = q8.k8 x ((dq x dk) x scale) in fp32
    s = torch.matmul(q8, k8.transpose(-1, -2)) * (per_head(q_descale) * per_head(k_descale) * scale)
    if bias is not None:
        s = s + bias.float().reshape(n, tq, tk)
    v8 = None if v is None else fp8_values(v, dt)
    r, o = online_pcast_out(s, v8, dt, FA3_P_SCALE, block_n, reverse=True)
    out = None if o is None else (o * per_head(v_descale)).to(OUT_DTYPE).reshape(n * tq, -1)
    flat = s.reshape(n * tq, tk).double()
    m = flat.amax(dim=1, keepdim=True)
    base = torch.where(torch.isneginf(m), 0.0, m)
    lse = (base[:, 0] + torch.log(torch.exp(flat - base).sum(dim=1))).float()  # -inf for an empty row
    return KernelRows(r.probs.reshape(n * tq, tk), out, lse, {"fused_max": torch.zeros(n * tq, dtype=torch.bool)})


def forward(block: QKBlock, dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    """fp16/bf16 (and fp32, as a what-if): the 16-bit kernel; the FP8 dtypes: flash-fp8's forward, named fa3."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock

    if dt.itemsize == 1:  # an FP8 format
        pb = flash_fp8.forward(block, dt, methods, params)
        return replace(pb, cells=[(PATH.name, out) for _, out in pb.cells])
    s, before = block.fp32_scores(dt, PATH)
    call = block.inp.call
    causal = call is not None and call.mask == "causal" and block.q.shape[1] > 1
    tile = tile_n(block.q.shape[-1], None if block.v is None else block.v.shape[-1], causal)
    res = kernel_rows(
        block.q,
        block.k,
        block.v,
        scale=block.inp.scale,
        dt=dt,
        block_n=tile,
        bias=fa2.block_bias(block, dt),
        softcap=None if call is None else call.softcap,
    )
    out = MethodOutput(res.probs, events={"fused_max": res.events["fused_max"]})
    out.out = res.out
    return PathBlock(s, before, [], [(PATH.name, out)])


def limit(dt: torch.dtype, params: MethodParams | None = None) -> tuple[str, float, str] | None:
    """The cell's limit in fp16/bf16: the fused exponent's, as ``fa2-fma`` (the same exponent); None in the FP8
    dtypes (flash-fp8's forward: S's fp32 overflow)."""
    return None if dt.itemsize == 1 else fa2_fma.limit(dt)


def supports(facts: CallFacts) -> str | None:
    """Why FlashAttention-3 (``flash_api.cpp`` ``mha_fwd``, ``flash_attn_interface``) would not run this call as
    emulated here, by its shape and dtype only (not the recorded GPU: ``--what-if kernels`` asks what it would do
    on a Hopper GPU), or None."""
    if facts.mask == "explicit":
        return "an explicit mask: FlashAttention-3 takes is_causal (and a window) only"
    if facts.dtype not in ("fp16", "bf16", "e4m3"):
        return f"{facts.dtype}: FlashAttention-3 runs fp16, bf16 and e4m3"
    if facts.head_dim > 256:
        return f"head dim {facts.head_dim}: FlashAttention-3 takes at most 256"
    if facts.head_dim % 8:
        return f"head dim {facts.head_dim}: FlashAttention-3 needs a multiple of 8"
    if facts.head_dim != facts.head_dim_v:
        return f"head dims {facts.head_dim} (q, k) and {facts.head_dim_v} (v): the emulation takes one head dim"
    if facts.dropout > 0:
        return f"dropout {facts.dropout}: FlashAttention-3 has no dropout"
    if facts.mask == "causal" and facts.tq != facts.tk and facts.tq > 1:
        return (
            f"is_causal with {facts.tq} queries and {facts.tk} keys: the kernel aligns the causal mask to the "
            "bottom right, the diagnosis to the top left"
        )
    if facts.window is not None:
        return "a sliding window: the kernel's local mask is not emulated"
    return None


PATH = PathSpec(
    name="fa3",
    summary="FlashAttention-3's Hopper forward: S in fp32, key blocks last to first (tile per head dim), "
    "exp2f(fma(x, scale*log2e, -max*scale*log2e)), every block rescaled, the row sum over fp32 exps, P rounded "
    "to the dtype, inv_sum 0 for empty rows (O = 0, LSE -inf); in e4m3/e5m2 flash-fp8's FP8 forward",
    impl="attncheck.numerics.paths.fa3:forward",
    kernel="FlashAttention-3's Hopper forward",
    scores_in="fp32 registers (tensor-core accumulator)",
    probs_in="fp32",
    fp8="both",
    default=False,
    device="cuda",
    fp8_accumulator=True,
    source=SOURCE,
    assumed=ASSUMED,
    stands_for=(Stands("flash_attn", "fa3"), Stands("sdpa", "flash_attention:fa3", "cuda")),
    supports="attncheck.numerics.paths.fa3:supports",
    limit="attncheck.numerics.paths.fa3:limit",
    replay=True,
    backward="recompute",  # the closest there is: FlashAttention-2's backward (FlashAttention-3's is not emulated)
)
