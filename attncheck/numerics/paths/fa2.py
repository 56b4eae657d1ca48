"""``fa2``: FlashAttention-2's CUDA forward as PyTorch's CUDA flash backend builds it (``UNFUSE_FMA`` set).

Follows Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced (``csrc/flash_attn/src/``
and ``csrc/flash_attn/flash_api.cpp``) and PyTorch's vendored copy at
pytorch/pytorch@00a1abb4ef74f047662e57678240bbe3dfe46ef0
(``aten/src/ATen/native/transformers/cuda/flash_attn/softmax.h``, the same code with the ``UNFUSE_FMA``
branch; its launch template at pytorch/pytorch@04ff5bebd3a737cd53c7858de8998a37a4003c49 keeps head dims 160
and 224, whose tiles ``tile_n`` gives). ``fa2-fma`` (``attncheck.numerics.paths.fa2_fma``) is the same kernel
with the fused exponent.
Rounding points, in the kernel's order (files at the flash-attention commit):

1. Scales (``flash_api.cpp:130-139``): ``scale_softmax_log2 = softmax_scale * M_LOG2E`` evaluated in
   double and stored as float; with a softcap, ``params.softcap = softmax_scale / softcap`` (float),
   ``scale_softmax = softcap`` and ``scale_softmax_log2 = softcap * M_LOG2E``.
2. S = Q K^T (``flash_fwd_kernel.h:326``, ``utils.h:139-160``): q and k in the dtype, one tensor-core
   ``mma`` per 16 head dims in ascending order into an fp32 accumulator. **Assumed**: each mma adds its
   16 exact products to the accumulator with one round-to-nearest (the hardware's internal alignment
   and truncation are not public).
3. Softcap (``flash_fwd_kernel.h:331-333``, ``utils.h:396-400``): ``fast_tanh(S * params.softcap)``, the
   product rounded to fp32. **Assumed**: tanh rounded once to fp32 (``tanh.approx.f32``'s error, about
   2^-11 relative, is not modelled).
4. Masking (``flash_fwd_kernel.h:335``, ``mask.h``): masked keys (causal, window, keys past Tk in the
   last tile) set to -inf in fp32, after the softcap. The kernel takes no attention mask: a float mask given
   here (in the units of the scaled scores, as SDPA takes it) is divided by the exponent's scale in fp32
   and added to S in fp32, so it reaches the exponent as given (-inf for boolean-masked keys), with the
   -inf guard of 7.
5. Key blocks of ``kBlockN`` keys (``flash_fwd_launch_template.h:194-325``; PyTorch's copy differs at head dims
   129-160: ``tile_n``) from the
   **last** to the first (``flash_fwd_kernel.h:274, 309, 385``).
6. Row max in fp32 (``softmax.h:142, 148``; ``utils.h:97-100``: ``fmaxf``, NaN ignored), exact.
7. Rescale, every block after the first, unconditionally (``softmax.h:153-161``):
   ``scores_scale = exp2f((m_prev - m_cur) * scale_log2)`` (subtract and multiply each rounded to fp32),
   ``row_sum *= scores_scale``, ``acc_o *= scores_scale`` (fp32). ``m_cur`` is taken as 0 where the
   running max is -inf only with ``Check_inf`` (causal, local; here: whenever a mask is given);
   without it -inf - -inf is NaN, as in the kernel.
8. The exponent (``softmax.h:76, 85-89``): ``max_scaled = m * scale_log2`` rounded to fp32 (0 where m is
   -inf); ``fa2``: ``exp2f(__fmul_rn(x, scale_log2) - max_scaled)``, two roundings; ``fa2-fma``:
   ``exp2f(fma(x, scale_log2, -max_scaled))``, one rounding. At the row max the fused exponent is
   ``x*scale_log2 - round(x*scale_log2)``, not 0: up to half an ulp of ``max_scaled``. Where it exceeds 128
   (|max_scaled| >= 2^31) exp2 overflows fp32 (PyTorch issue 121558); in fp16, where it exceeds ~16
   (|max_scaled| >= 2^28), P overflows the dtype and O is inf or NaN. Such rows: ``events["fused_max"]``
   (an exp of a finite score beyond the dtype's range, or a row sum of inf); the unfused exponent is
   <= 0 for every score (rounding is monotone), so ``fa2`` has none.
9. exp2f under ``--use_fast_math`` is ``ex2.approx.ftz.f32``. **Assumed**: exp2 computed exactly and
   rounded once to fp32, results below 2^-126 flushed to 0 (the approximation's ulp error is not
   modelled).
10. Row sum (``softmax.h:23-36, 59-63, 144, 165, 172``): over the fp32 exps **before** P is rounded. Each of
    the 4 threads of a quad sums, in fp32 and in order, the columns ``8j + 2t + {0, 1}`` of every block
    it holds (the mma C-fragment layout, ``utils.h`` ``convert_layout_acc_rowcol``), its sum rescaled by
    7 between blocks; at the end the quad all-reduce gives ``(s0 + s2) + (s1 + s3)`` (``utils.h:111-131``).
11. P rounded to the dtype (``flash_fwd_kernel.h:354, 416``) for P V (``:374, 435``): one mma per 16 keys in
    ascending order into the fp32 ``acc_o``; **assumed** as in 2 (one rounding per mma).
12. Finalize (``softmax.h:177-184``): ``inv_sum = 1`` where the sum is 0 or NaN, else ``1/sum`` in fp32;
    O = ``acc_o * inv_sum`` (fp32) rounded to the dtype (``flash_fwd_kernel.h:443``);
    ``LSE = m * scale_softmax + __logf(sum)``, contracted to one fma by nvcc: **assumed** ln(sum) rounded
    once to fp32 (``__logf``'s approximation not modelled), then the fma rounded once; +inf where the
    sum is 0 or NaN (a row with no key: O = 0, LSE = +inf; ``flash_fwd_kernel.h:99-134`` writes the same
    for a tile with no key block).

Not modelled: dropout (Philox), ALiBi, split-KV (the flash-attn package's ``mha_fwd`` splits the keys
when batch x heads x query tiles < 0.8 x 2 x SMs, ``flash_api.cpp:281-344``: partial O in fp32 combined
by LSE), the sliding window (its mask is 4; ``supports`` refuses it), and, in causal calls, rows whose
scores are -inf from fp32 overflow of q.k (the kernel skips the -inf guard on fully visible blocks).

The effective probabilities (``probs``) are the rounded P of each block times the later rescales
and ``inv_sum``, in float64 rounded to fp32: O = probs @ V up to the P V accumulation's rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attncheck.numerics.paths.base import CallFacts, KernelRows, PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

FLASH_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
TORCH_COMMIT = "00a1abb4ef74f047662e57678240bbe3dfe46ef0"
TORCH_TILES_COMMIT = "04ff5bebd3a737cd53c7858de8998a37a4003c49"
SOURCE = (
    f"Dao-AILab/flash-attention@{FLASH_COMMIT} csrc/flash_attn/src/softmax.h, flash_fwd_kernel.h, "
    "flash_fwd_launch_template.h, utils.h, mask.h, csrc/flash_attn/flash_api.cpp; "
    f"pytorch/pytorch@{TORCH_COMMIT} aten/src/ATen/native/transformers/cuda/flash_attn/softmax.h (UNFUSE_FMA), "
    f"@{TORCH_TILES_COMMIT} flash_fwd_launch_template.h (tiles)"
)
ASSUMED = (
    "tensor-core mma accumulation (one rounding per 16-term mma), ex2.approx.ftz.f32 as exp2 rounded once "
    "with subnormals flushed, __logf and tanh.approx as correctly rounded: not public / hardware approximations"
)
MMA_K = 16  # mma.sync m16n8k16: the k extent of one tensor-core instruction
FLT_MIN = 2.0**-126  # the smallest normal fp32: ex2.approx.ftz flushes results below it


def tile_n(
    head_dim: int, capability: tuple[int, int] | None = None, causal: bool = False, torch_copy: bool = True
) -> int:
    """The forward kernel's key tile kBlockN (no dropout). ``torch_copy``: PyTorch's vendored launch template
    (pytorch/pytorch@04ff5bebd3a737cd53c7858de8998a37a4003c49 ``flash_fwd_launch_template.h``; head dims
    rounded up to 32/64/96/128/160/192/224/256 by ``static_switch.h``@035290b77d8b4bd106cf5f9a728516d4335d5a42);
    else the flash-attn package's (``flash_fwd_launch_template.h:194-325`` at the flash-attention commit; no
    160 and 224 kernels: rounded to 192 and 256). Head dim <= 64: 128 keys; 96 < d <= 128 on sm86/sm89
    without causal: 32; PyTorch's 128 < d <= 160: 32 on sm80/sm90, 64 on sm86/sm89; otherwise 64.
    ``capability`` None: sm80/sm90 (the two agree on kBlockN)."""
    sm8x = capability is not None and capability[0] == 8 and capability[1] > 0
    if head_dim <= 64:
        return 128
    if 96 < head_dim <= 128 and sm8x and not causal:
        return 32
    if torch_copy and 128 < head_dim <= 160 and not sm8x:
        return 32
    return 64


def _exp2f(x: torch.Tensor) -> torch.Tensor:
    """ex2.approx.ftz.f32 as assumed: 2^x (x fp32) exactly, rounded once to fp32, results below 2^-126 -> 0."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    y = torch.exp2(x.double()).float()
    return torch.where(y < FLT_MIN, torch.zeros_like(y), y)


def _mma_accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 acc (or 0) plus a @ b over their shared axis, one mma of 16 terms at a time in ascending
    order, each adding its exact sum once rounded (assumed). a, b float64 holding dtype values: their
    products are exact in float64 (at most 11 + 11 significant bits), and so are the 16-term sums unless
    their exponents spread over more than about 20 binades."""
    kk = a.shape[-1]
    for c in range(0, kk, MMA_K):
        part = a[..., c : c + MMA_K] @ b[..., c : c + MMA_K, :]
        acc = part.float() if acc is None else part.add_(acc).float()  # part is fresh: add in place, in float64
    return acc


def kernel_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    scale: float,
    dt: torch.dtype,
    block_n: int,
    fused: bool = False,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> KernelRows:
    """FlashAttention-2's forward on rows: q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) or None (float64
    or any float; rounded to ``dt``), ``bias`` (n*tq, Tk) float32 in the units of the scaled scores, added
    to the fp32 scores after the softcap (divided by the scale: the kernel scales inside exp2; -inf: masked;
    the kernel's causal and window masks are such -inf) or None, ``block_n`` the
    key tile, ``fused``: the fused exponent of the flash-attn package (else PyTorch's UNFUSE_FMA one).
    Rows are the (n, tq) pairs, flattened. See the module docstring for the rounding points."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    n, tq, _ = q.shape
    tk = k.shape[1]
    r = n * tq
    if block_n % 8:
        raise ValueError(f"block_n {block_n} is not a multiple of 8")
    qd, kd = cast(q.double(), dt).double(), cast(k.double(), dt).double()
    pre, lse_scale, scale_log2 = _scales(scale, softcap)
    s = _scores(qd, kd, r, tk, pre, bias, lse_scale)
    check_inf = bias is not None
    nb = -(-tk // block_n)
    pad = nb * block_n - tk
    if pad:  # keys past Tk in the last tile: -inf scores, zero V rows (the kernel clears them)
        s = torch.cat([s, s.new_full((r, pad), float("-inf"))], dim=1)
    vd = None
    if v is not None:
        vd = cast(v.double(), dt).double()
        if pad:
            vd = torch.cat([vd, vd.new_zeros(n, pad, vd.shape[-1])], dim=1)
    lt, m, acc, blocks, rescales, broke = _key_blocks(s, vd, n, tq, r, nb, block_n, scale_log2, check_inf, fused, dt)
    # 12. finalize: the quad all-reduce, inv_sum (1 for an empty row), O, LSE (+inf for an empty row)
    return finalize(lt, m, acc, blocks, rescales, broke, s, lse_scale=lse_scale, dt=dt, tk=tk, empty_inv=1.0)


def _scales(scale: float, softcap: float | None) -> tuple[float | None, float, float]:
    """Step 1: the scales as flash_api.cpp stores them: (the softcap's pre-scale or None, LSE's scale, the
    exponent's scale * log2(e))."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    # 1. the scales, as flash_api.cpp stores them (float fields; M_LOG2E a double)
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    if softcap:
        cap32 = float(torch.tensor(softcap, dtype=torch.float32))
        pre = float(torch.tensor(scale32 / cap32, dtype=torch.float32))  # float / float, rounded to fp32
        lse_scale = cap32
        scale_log2 = float(torch.tensor(cap32 * math.log2(math.e), dtype=torch.float32))
    else:
        pre, lse_scale = None, scale32
        scale_log2 = float(torch.tensor(scale32 * math.log2(math.e), dtype=torch.float32))
    return pre, lse_scale, scale_log2


def _scores(qd, kd, r: int, tk: int, pre: float | None, bias, lse_scale: float):
    """Steps 2-4: S (r, Tk) in fp32, softcapped, with the mask added."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    # 2. S in fp32, one rounding per 16 head dims
    s = _mma_accumulate(None, qd, kd.transpose(-1, -2)).reshape(r, tk)  # (r, Tk) float32
    if pre is not None:  # 3. softcap: product rounded, tanh assumed correctly rounded
        s = torch.tanh((s * pre).double()).float()
    if bias is not None:  # 4. the mask, -inf where masked
        # The kernel takes no additive mask: a float mask (given in the units of the scaled scores) is added to
        # the unscaled S divided by the exponent's scale (lse_scale: the softmax scale, or the softcap), in fp32,
        # so that it reaches the exponent as given; -inf stays -inf, 0 adds nothing
        s = s + bias.float() / lse_scale
    return s


def _key_blocks(
    s, vd, n: int, tq: int, r: int, nb: int, block_n: int, scale_log2: float, check_inf: bool, fused: bool, dt
):
    """Steps 5-11, the main loop over key blocks, the last first: the running max, the rescale, the exponent, the
    quad's thread sums and P @ V: (lt, m, acc, blocks, rescales, broke) for ``finalize``."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    ninf = torch.tensor(float("-inf"), dtype=torch.float32)
    m = None  # (r,) running max, fp32
    lt = None  # (r, 4) the quad's thread-local sums, fp32
    acc = None  # (n, tq, dv) acc_o, fp32
    blocks: list[tuple[int, torch.Tensor]] = []  # (block, its P in dt as float64) in processing order
    rescales: list[torch.Tensor] = []  # (r,) float32 the rescale applied before block i (1 for the first)
    broke = torch.zeros(r, dtype=torch.bool)
    for j in range(nb - 1, -1, -1):  # 5. the last key block first
        sb = s[:, j * block_n : (j + 1) * block_n]  # (r, BN) float32
        bmax = torch.where(torch.isnan(sb), ninf, sb).amax(dim=1)  # 6. fmaxf ignores NaN
        if m is None:
            m, f = bmax, torch.ones(r, dtype=torch.float32)
        else:  # 7. the rescale, every block after the first
            prev, m = m, torch.fmax(m, bmax)
            cur = torch.where(torch.isneginf(m), torch.zeros_like(m), m) if check_inf else m
            f = _exp2f((prev - cur) * torch.tensor(scale_log2, dtype=torch.float32))
            lt = lt * f[:, None]
            if acc is not None:
                acc = acc * f.reshape(n, tq, 1)
        rescales.append(f)
        # 8. the exponent
        max_scaled = torch.where(torch.isneginf(m), 0.0, (m.double() * scale_log2).float()).double()[:, None]
        if fused:
            # x * scale_log2 of two fp32 values has at most 48 significant bits: exact in float64's 53, so the
            # fma's one rounding is the float64 difference rounded to fp32 (exact too, unless max_scaled and the
            # product lie more than ~2^5 apart, where the result is the larger one's rounding anyway)
            e = (sb.double() * scale_log2 - max_scaled).float()
        else:  # __fmul_rn rounds the product, then an fp32 subtraction (exact in float64, then rounded)
            e = ((sb.double() * scale_log2).float().double() - max_scaled).float()
        p = _exp2f(e)  # 9. (r, BN) float32
        # 10. thread t of the quad holds columns 8j' + 2t + {0, 1}, in that order
        pt = p.reshape(r, block_n // 8, 4, 2).permute(0, 2, 1, 3).reshape(r, 4, block_n // 4)
        start = 0
        if lt is None:
            lt, start = pt[:, :, 0].clone(), 1
        for c in range(start, block_n // 4):
            lt = lt + pt[:, :, c]
        pd = cast(p, dt).double()  # 11. P in the dtype
        inf_p = torch.isposinf(pd)
        if bool(inf_p.any()):  # an exp of a finite score beyond the dtype's range: only the fused exponent exceeds 1
            broke |= (inf_p & torch.isfinite(sb)).any(dim=1)
        blocks.append((j, pd))
        if vd is not None:
            acc = _mma_accumulate(acc, pd.reshape(n, tq, block_n), vd[:, j * block_n : (j + 1) * block_n])
    return lt, m, acc, blocks, rescales, broke


def finalize(lt, m, acc, blocks, rescales, broke, s, *, lse_scale: float, dt, tk: int, empty_inv: float) -> KernelRows:
    """FlashAttention-2's and -3's finalize, which differ only in what a row whose sum is 0 or NaN gets:
    ``inv_sum = empty_inv`` (FA2: 1, LSE +inf; FA3: 0, LSE -inf). The quad all-reduce of the thread sums ``lt``
    (r, 4) is ``(s0 + s2) + (s1 + s3)``; O = ``acc * inv_sum`` (fp32) rounded to ``dt``; ``LSE = m * lse_scale +
    ln(sum)`` (ln rounded once to fp32, then the fma rounded once); the effective probabilities are P_j (``blocks``,
    in processing order) times the rescales after block j and inv_sum, in float64 then fp32; ``fused_max`` rows are
    ``broke`` and rows whose sum overflowed although no score was +inf."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    r, block_n = lt.shape[0], blocks[0][1].shape[1]
    total = (lt[:, 0] + lt[:, 2]) + (lt[:, 1] + lt[:, 3])  # (r,) float32
    bad = (total == 0) | torch.isnan(total)
    inv = torch.where(bad, torch.full_like(total, empty_inv), 1.0 / total)
    out = None if acc is None else (acc * inv.reshape(*acc.shape[:2], 1)).to(dt).reshape(r, -1)  # (r, dv)
    log_sum = torch.log(total.double()).float().double()
    empty_lse = float("inf") if empty_inv else float("-inf")
    lse = torch.where(bad, empty_lse, (m.double() * lse_scale + log_sum).float())
    later = torch.ones(r, dtype=torch.float64)
    probs = torch.empty(r, len(blocks) * block_n, dtype=torch.float32)
    for i in range(len(blocks) - 1, -1, -1):
        j, pd = blocks[i]
        probs[:, j * block_n : (j + 1) * block_n] = (pd * (later * inv.double())[:, None]).float()
        later = later * rescales[i].double()
    has_posinf = torch.isposinf(s).any(dim=1)
    events = {"fused_max": broke | (torch.isposinf(total) & ~has_posinf)}
    return KernelRows(probs[:, :tk], out, lse, events)


def block_bias(block: QKBlock, dt: torch.dtype) -> torch.Tensor | None:
    """(r, Tk) float32: the block's mask as the kernel would meet it: -inf where boolean-masked (causal
    included), the float mask as the dtype holds it elsewhere; None without a mask."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    if block.masked is None and block.mask_float is None:
        return None
    base = (
        torch.zeros(block.given.shape, dtype=torch.float32)
        if block.mask_float is None
        else cast(block.mask_float, dt).float().reshape(block.given.shape)
    )
    if block.masked is not None:
        base = base.masked_fill(block.masked.reshape(block.given.shape), float("-inf"))
    return base


def run(block: QKBlock, dt: torch.dtype, name: str, fused: bool) -> PathBlock:
    """The forward of ``fa2`` / ``fa2-fma`` on a block of rows."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock

    s, before = block.fp32_scores(dt, PATH)  # (r, Tk) S*scale+mask in fp32: the reference's input and causes
    d = block.q.shape[-1]
    call = block.inp.call  # a captured call's facts: the GPU's capability and is_causal pick the tile
    tile = tile_n(
        d, None if call is None else call.capability, call is not None and call.mask == "causal", torch_copy=not fused
    )
    res = kernel_rows(
        block.q,
        block.k,
        block.v,
        scale=block.inp.scale,
        dt=dt,
        block_n=tile,
        fused=fused,
        bias=block_bias(block, dt),
        softcap=None if call is None else call.softcap,
    )
    out = MethodOutput(res.probs, events={"fused_max": res.events["fused_max"]})
    out.out = res.out
    return PathBlock(s, before, [], [(name, out)])


def forward(block: QKBlock, dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    return run(block, dt, PATH.name, fused=False)


def _common(facts: CallFacts, who: str) -> str | None:
    if facts.mask == "explicit":
        return f"an explicit mask: {who} takes is_causal only"
    if facts.dtype not in ("fp16", "bf16"):
        return f"{facts.dtype}: {who} runs fp16 and bf16 only"
    if facts.head_dim > 256:
        return f"head dim {facts.head_dim}: {who} takes at most 256"
    if facts.head_dim != facts.head_dim_v:
        return f"head dims {facts.head_dim} (q, k) and {facts.head_dim_v} (v): {who} needs one head dim"
    if facts.capability is not None and facts.capability < (8, 0):
        return f"sm{facts.capability[0]}{facts.capability[1]}: FlashAttention-2 needs sm80 or newer"
    if facts.dropout > 0:
        return f"dropout {facts.dropout}: the kernel's Philox dropout is not emulated"
    return None


def supports(facts: CallFacts) -> str | None:
    """Why PyTorch's CUDA flash backend would not run this call (``sdp_utils.cpp``
    ``can_use_flash_attention``), or None."""
    who = "PyTorch's flash backend"
    why = _common(facts, who)
    if why:
        return why
    if facts.head_dim % 8:
        return f"head dim {facts.head_dim}: {who} needs a multiple of 8"
    if facts.mask == "causal" and facts.tq != facts.tk:
        return f"is_causal with {facts.tq} queries and {facts.tk} keys: {who} refuses non-square causal calls"
    if facts.softcap:
        return f"a softcap: {who} has none"
    if facts.window is not None:
        return f"a sliding window: {who} has none"
    return None


PATH = PathSpec(
    name="fa2",
    summary="FlashAttention-2's CUDA forward as PyTorch's flash backend builds it (UNFUSE_FMA): S in fp32, key "
    "blocks last to first, exp2f(__fmul_rn(x, scale*log2e) - max*scale*log2e), every block rescaled, the "
    "row sum over fp32 exps, P rounded to the dtype, inv_sum 1 for empty rows",
    impl="attncheck.numerics.paths.fa2:forward",
    kernel="FlashAttention-2's CUDA forward",
    scores_in="fp32 registers (tensor-core accumulator)",
    probs_in="fp32",
    default=False,
    device="cuda",
    source=SOURCE,
    assumed=ASSUMED,
    stands_for=(Stands("sdpa", "flash_attention", "cuda"),),
    supports="attncheck.numerics.paths.fa2:supports",
    replay=True,
    backward="recompute",  # FlashAttention-2's backward as on CUDA: fp32 sums, each gradient rounded once
    row_local=True,
)
