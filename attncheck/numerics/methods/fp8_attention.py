"""FP8 attention machinery shared by the FP8 paths (``attncheck.numerics.paths.flash_fp8`` and
``attncheck.numerics.paths.sage``, whose docstrings state their rounding points): quantisation of
Q, K and V with descales, FlashAttention-3's FP8 tiles, the online softmax with P cast to FP8, and
SageAttention 2's INT8 groups and V quantisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.methods.fp8 import PCastSoftmax, cast_overflow, fp8_values, pcast_softmax
from attncheck.numerics.methods.fp8_accum import mma_accumulate_fp8
from attncheck.numerics.precision import dtype_label
from attncheck.params import DEFAULT_P_SCALE
from attncheck.results import DtypeAudit

if TYPE_CHECKING:
    from attncheck.numerics.inputs.scores import AttentionInputs, QKBlock

FA3_P_SCALE = DEFAULT_P_SCALE  # 2^8: the max offset of 8 in FlashAttention-3's exp2
SAGE_P_SCALE = 2.0**8.807  # ~447.97: SageAttention's exponent offset S_FP8_OFFSET = 8.807
SAGE_P_SCALE_V = 448.0  # V's per-channel scale maps amax to e4m3's max
SAGE_BLOCK = 128  # CTA_K of the SM90 kernel
OUT_DTYPE = torch.bfloat16  # what both kernels write for FP8 inputs (bf16 models)


def fa3_tile(d: int) -> tuple[int, int]:
    """FlashAttention-3's FP8 tile (kBlockM queries, kBlockN keys) for head dim ``d``: ``tile_size_fwd_sm90``
    with element size 1 in Dao-AILab/flash-attention ``hopper/tile_size.h`` (read at commit
    07602adc2baa7a3ea037321ef2ca71c83096e5d5), its default tile (KV not paged, no local window, V
    row-major, two MMA warpgroups): d <= 64: 192 x 160, <= 96: 192 x 128, <= 128: 128 x 224,
    <= 192: 128 x 160, above: 128 x 128. ``block`` scaling quantises per kBlockM queries and kBlockN keys."""
    if d <= 64:
        return 192, 160
    if d <= 96:
        return 192, 128
    if d <= 128:
        return 128, 224
    if d <= 192:
        return 128, 160
    return 128, 128


def hadamard(d: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The random orthogonal matrix of incoherent processing: diag(+-1, seeded) H / sqrt(d), float64 (d, d)."""
    if d & (d - 1):
        raise ValueError(f"incoherent processing needs a head dim that is a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (d,), generator=g, dtype=torch.float64) * 2 - 1
    return (sign[:, None] * h / math.sqrt(d)).to(device)


@dataclass(frozen=True)
class Fp8Setup:
    """How Q, K and V are put into FP8 before the kernel."""

    fmt: torch.dtype = torch.float8_e4m3fn
    scaling: str = "head"
    incoherent: bool = False
    seed: int = 0
    p_scale: float = FA3_P_SCALE
    # The FP8 tensor cores' accumulator (numerics.methods.fp8_accum): mantissa bits kept after each 32-element
    # MMA step (None: fp32 accumulation), and a flush of P@V's reduced accumulator into an fp32 one every
    # accum_flush key blocks (None: the kernel's own scheme; FlashAttention-3 has none, SageAttention 2 flushes
    # every block).
    accum_bits: int | None = None
    accum_flush: int | None = None
    # with a reduced accumulator, also compute the same kernel under fp32 accumulation and the flush grid
    # (accum_companions), for the fp8_accumulator finding; off where only the output is wanted
    accum_companions: bool = True

    def quantisation(self) -> "Fp8Setup":
        """This setup without its accumulator settings: what Q, K and V's quantisation depends on."""
        return replace(self, accum_bits=None, accum_flush=None, accum_companions=True)


@dataclass
class Quantized:
    """Q, K, V of a whole input in FP8 (values as float32) with their fp32 descales per row."""

    q8: torch.Tensor  # (B*Hq, Tq, d)
    dq: torch.Tensor  # (B*Hq, Tq)
    k8: torch.Tensor  # (B*Hk, Tk, d)
    dk: torch.Tensor  # (B*Hk, Tk)
    v8: torch.Tensor | None  # (B*Hk, Tk, dv)
    dv: torch.Tensor | None  # (B*Hk, 1) or (B*Hk, dv)
    clipped: dict[str, int]  # values beyond the FP8 range (clipped by the satfinite cast), per tensor
    flushed: dict[str, int]  # non-zero values that became 0, per tensor
    subnormal: dict[str, int]  # non-zero values left below the format's smallest normal
    values: dict[str, int]  # non-zero values, per tensor
    amax: dict[str, float]  # largest |x| before quantisation (after the incoherent rotation)


def _descale(x: torch.Tensor, groups: torch.Tensor | None, top: float, scaling: str, qheads: int = 1) -> torch.Tensor:
    """fp32 descale per row of ``x`` (n, T, d): amax / top over the tensor, the head, or the row
    ``groups`` (n, T) (ids of row blocks); 1 where nothing is scaled or amax is 0."""
    n, t = x.shape[:2]
    if scaling == "none":
        return torch.ones(n, t, dtype=torch.float32, device=x.device)
    absx = x.abs().amax(dim=-1)  # (n, T) per row
    if scaling == "tensor":
        amax = absx.amax().expand(n, t)
    elif scaling == "head":
        per = absx.amax(dim=-1)  # (n,)
        if qheads > 1:  # query heads of a kv group share its q descale
            per = per.reshape(-1, qheads).amax(dim=-1).repeat_interleave(qheads)
        amax = per[:, None].expand(n, t)
    else:
        nb = int(groups.max()) + 1
        per = torch.zeros(n, nb, dtype=absx.dtype, device=x.device).scatter_reduce(
            1, groups, absx, "amax", include_self=True
        )
        amax = per.gather(1, groups)
    ds = (amax / top).float()
    return torch.where(ds > 0, ds, torch.ones_like(ds))


def _quantize(x: torch.Tensor, ds: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, dict[str, int]]:
    """x / descale in fp32, cast to ``fmt`` as the kernels' callers do; what the cast did, counted."""
    y = x.float() / ds[..., None]
    x8 = fp8_values(y, fmt)
    nonzero = x != 0
    counts = {
        "clipped": int(cast_overflow(y, fmt).sum()),
        "flushed": int((nonzero & (x8 == 0)).sum()),
        "subnormal": int((nonzero & (x8 != 0) & (x8.abs() < torch.finfo(fmt).smallest_normal)).sum()),
        "values": int(nonzero.sum()),
    }
    return x8, counts


def quantize_inputs(inp: "AttentionInputs", setup: Fp8Setup) -> Quantized:
    """Q, K, V of ``inp`` in FP8 as ``setup`` says, computed once per input and setup."""
    setup = setup.quantisation()  # one quantisation whatever the accumulator
    cached = inp.cache.get(("fp8", setup))
    if cached is not None:
        return cached
    b, hq, tq, d = inp.q.shape
    hk, tk = inp.k.shape[1], inp.k.shape[2]
    q = inp.q.reshape(b * hq, tq, d).to(torch.float64)
    k = inp.k.reshape(b * hk, tk, d).to(torch.float64)
    if setup.incoherent:
        if d & (d - 1):
            raise AttncheckError(
                f"rotates Q and K by a Hadamard matrix, which needs a head dim that is a power of two; d = {d}",
                param="incoherent",
            )
        h = hadamard(d, setup.seed, q.device)
        q, k = q @ h, k @ h
    top = float(torch.finfo(setup.fmt).max)
    block_m, block_n = fa3_tile(d)
    qg = (torch.arange(tq, device=q.device) // block_m).expand(b * hq, tq)
    kg = (torch.arange(tk, device=q.device) // block_n).expand(b * hk, tk)
    dq = _descale(q, qg, top, setup.scaling, hq // hk)
    dk = _descale(k, kg, top, setup.scaling)
    tensors = {"q": q, "k": k}
    q8, counts_q = _quantize(q, dq, setup.fmt)
    k8, counts_k = _quantize(k, dk, setup.fmt)
    counts = {"q": counts_q, "k": counts_k}
    v8 = dv = None
    if inp.v is not None:
        v = inp.v.reshape(b * hk, tk, -1).to(torch.float64)
        dv_rows = _descale(
            v, kg, top, "head" if setup.scaling == "block" else setup.scaling
        )  # (n, Tk): one value per head
        v8, counts["v"] = _quantize(v, dv_rows, setup.fmt)
        dv = dv_rows[:, :1]
        tensors["v"] = v
    amax = {name: float(t.abs().max()) if t.numel() else 0.0 for name, t in tensors.items()}
    out = Quantized(
        q8,
        dq,
        k8,
        dk,
        v8,
        dv,
        *({name: c[key] for name, c in counts.items()} for key in ("clipped", "flushed", "subnormal", "values")),
        amax,
    )
    inp.cache[("fp8", setup)] = out
    return out


def online_pcast_out(
    s: torch.Tensor,
    v8: torch.Tensor | None,
    fmt: torch.dtype,
    p_scale: float,
    block: int,
    reverse: bool,
    accum_bits: int | None = None,
    accum_flush: int | None = None,
) -> tuple[PCastSoftmax, torch.Tensor | None]:
    """The P-cast softmax of ``s`` (n, tq, T) float32 and, with ``v8`` (n, T, dv) float32, the
    fp32 output sum_j fp8(P~_j) @ V8_j accumulated block by block with the running rescale,
    divided by the fp32 row sum (times p_scale, as the kernels' sum of scaled exps).

    ``accum_bits`` None: P@V accumulates in fp32. Otherwise the FP8 tensor cores' accumulator
    (``fp8_accum.mma_accumulate_fp8``, 32 keys per step): without ``accum_flush`` the WGMMAs accumulate
    into O itself (FlashAttention-3: O lives in registers, the CUDA cores rescale it in fp32 between
    blocks, and every step truncates it again); with ``accum_flush`` = N, a working accumulator takes
    N key blocks (rescaled with O) and is then added to an fp32 O in fp32 and cleared (vLLM's PR 122
    with N, PR 104 and SageAttention 2 with N = 1)."""
    r = pcast_softmax(s, fmt, p_scale, block, reverse)
    if v8 is None:
        return r, None
    n, tq, t = s.shape
    nb = -(-t // block)
    m = torch.full((n, tq, 1), float("-inf"), device=s.device)
    l = torch.zeros((n, tq, 1), device=s.device)
    acc = torch.zeros((n, tq, v8.shape[-1]), device=s.device)  # O (fp32, or the FP8 MMA's accumulator)
    work = torch.zeros_like(acc) if accum_bits is not None and accum_flush is not None else None
    for i, j in enumerate(range(nb - 1, -1, -1) if reverse else range(nb)):  # loop over key blocks, not rows
        keys = slice(j * block, min((j + 1) * block, t))
        m_new = torch.maximum(m, s[..., keys].amax(dim=-1, keepdim=True))
        base = torch.where(m_new == float("-inf"), 0.0, m_new)
        e = torch.exp(s[..., keys] - base)
        alpha = torch.exp(m - base)
        l = l * alpha + e.sum(dim=-1, keepdim=True)
        p8 = fp8_values(e * p_scale, fmt)
        if accum_bits is None:
            acc = acc * alpha + torch.matmul(p8, v8[:, keys])
        elif work is None:  # the reduced accumulator is O itself
            acc = mma_accumulate_fp8(acc * alpha, p8, v8[:, keys], mantissa_bits=accum_bits)
        else:  # two-level: the working accumulator, rescaled with O, merged every accum_flush blocks
            acc = acc * alpha
            work = mma_accumulate_fp8(work * alpha, p8, v8[:, keys], mantissa_bits=accum_bits)
            if (i + 1) % accum_flush == 0 or i == nb - 1:
                acc, work = acc + work, torch.zeros_like(work)
        m = m_new
    inv = torch.where(l == 0, 0.0, 1.0 / (l * p_scale))  # fully masked rows: 0, as the kernels' finalize
    return r, acc * inv


ACCUM_FLUSH_GRID = (1, 4, 64)  # vLLM PR 122's measured intervals (needle-in-a-haystack 0.89 / 0.88 / 0.856)
# Below this many key blocks the grid is not computed: each flush costs one more float64 pass of P@V, and over a
# few blocks the reduced accumulator stays near fp32 (benchmarks/fp8_accumulator.py: at most 1.1x at 5 blocks)
ACCUM_GRID_MIN_BLOCKS = 8


def accum_companions(
    run: "Callable[[int | None, int | None], torch.Tensor | None]", bits: int, flush: int | None, blocks: int
) -> dict[str, torch.Tensor]:
    """The same kernel's output under other accumulators, for the fp8_accumulator finding: ``run(bits, flush)``
    gives O; 'fp32' is fp32 accumulation throughout; where the cell itself does not flush and spans at least
    ACCUM_GRID_MIN_BLOCKS key ``blocks``, 'flush N' is the reduced accumulator flushed every N key blocks for N
    in ACCUM_FLUSH_GRID below ``blocks`` (from N on it is the same as no flush)."""
    out = {"fp32": run(None, None)}
    if flush is None and blocks >= ACCUM_GRID_MIN_BLOCKS:
        out.update({f"flush {n}": run(bits, n) for n in ACCUM_FLUSH_GRID if n < blocks})
    return {name: o for name, o in out.items() if o is not None}


def accum_label(bits: int | None, flush: int | None) -> str:
    """How a cell's FP8 MMAs accumulate, in words: 'fp32', '13 bits', '13 bits, flush every 4 blocks'."""
    if bits is None:
        return "fp32"
    return f"{bits} bits" + ("" if flush is None else f", flush every {flush} block{'s' if flush > 1 else ''}")


def record_audit(block: "QKBlock", dt: torch.dtype, setup: Fp8Setup, quant: Quantized) -> None:
    """What the quantisation did, in the input's audit (the same for every block)."""
    label = dtype_label(dt)
    a = block.audit.dtypes.setdefault(label, DtypeAudit(label))
    a.fp8_scaling = setup.scaling + (", incoherent" if setup.incoherent else "")
    a.fp8_clipped, a.fp8_flushed, a.fp8_subnormal = dict(quant.clipped), dict(quant.flushed), dict(quant.subnormal)
    a.fp8_values, a.fp8_amax = dict(quant.values), dict(quant.amax)


def add_bf16_mask(block: "QKBlock", s: torch.Tensor) -> torch.Tensor:
    """The mask, as a bf16 model holds it, added to fp32 scores (n, tq, Tk)."""
    _, _, mask_dt = block._mask_planes(OUT_DTYPE)
    return s if mask_dt is None else s + mask_dt.float()


SAGE_Q_WARP = 16  # WARPQ of the SM90 kernel: rows {t, t+8} of each 16-row segment share a scale
SAGE_K_BLOCK = 128  # BLKK: rows r mod 8 in {2t, 2t+1} of each 128-key block share a scale


def sage_groups(t: int, kind: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Group id of each of ``t`` rows in SageAttention's per-thread INT8 quantisation."""
    r = torch.arange(t, device=device)
    if kind == "q":
        return (r // SAGE_Q_WARP) * 8 + r % 8
    return (r // SAGE_K_BLOCK) * 4 + (r % 8) // 2


def int8_per_group(x: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, T, d) -> (integers as float64, fp32 scale per row): scale = max|x| / 127 + 1e-7
    over each group of rows, x / scale rounded half away from zero (SageAttention's per_thread_int8)."""
    x32 = x.float()
    n, t = x32.shape[:2]
    absx = x32.abs().amax(dim=-1)
    nb = int(groups.max()) + 1 if t else 0
    g = groups.expand(n, t)
    per = torch.zeros(n, nb, dtype=torch.float32, device=x.device).scatter_reduce(1, g, absx, "amax", include_self=True)
    scale = per.gather(1, g) / 127 + 1e-7  # (n, T) fp32
    y = x32 / scale[..., None]
    ints = torch.trunc(y + 0.5 * torch.sign(y))
    return ints.double(), scale


def sage_v(v: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """V (n, T, dv) in FP8 per channel as SageAttention's ``scale_fuse_quant`` (csrc/fused/fused.cu) does
    it: v in bf16, amax over the tokens of each channel, v times recp = 448 / amax, cast (satfinite).
    Returns the values (float32) and the scale amax / 448 (n, 1, dv) that O is multiplied by. The
    kernel is built with --use_fast_math, where a / b is div.approx, a * (1 / b): both divisions are
    taken that way, with 1 / b rounded to fp32 (the hardware's rcp.approx is within an ulp of it).
    An all-zero channel gets amax 1 (the kernel's 448 / 0 would make it NaN)."""
    v = v.to(OUT_DTYPE).float()
    amax = v.abs().amax(dim=1, keepdim=True)  # (n, 1, dv) per channel
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    top = torch.tensor(SAGE_P_SCALE_V, dtype=torch.float32, device=v.device)
    recp = top * amax.reciprocal()
    return fp8_values(v * recp, fmt), amax * top.reciprocal()


def sage_scores(si: torch.Tensor, qscale: torch.Tensor, kscale: torch.Tensor, scale: float) -> torch.Tensor:
    """S (n, tq, Tk) fp32 from the integer dot products ``si`` (fp32, exact) and the fp32 scales
    (n, tq) and (n, Tk), in the order of the SM90 kernel's fp32 products (``qk_int_sv_f8_cuda_sm90.cu``):
    dq = q_scale * k_scale; in every key block but the last, the softmax scale is folded into it first,
    S = si * (dq * scale); in the last block (the one that holds key Tk - 1) the kernel dequantises
    before the mask, S = (si * dq) * scale."""
    dq = qscale[..., None] * kscale[:, None, :]  # (n, tq, Tk) fp32
    s = si * (dq * scale)
    last = (s.shape[-1] - 1) // SAGE_BLOCK * SAGE_BLOCK
    s[..., last:] = si[..., last:] * dq[..., last:] * scale
    return s
