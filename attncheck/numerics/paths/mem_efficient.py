"""``mem-efficient``: PyTorch's CUDA memory-efficient attention (the CUTLASS kernel behind
``SDPBackend.EFFICIENT_ATTENTION``), emulated to its rounding points.

Source: pytorch/pytorch, ``aten/src/ATen/native/transformers/cuda/mem_eff_attention/``, read as
the search index stores it: ``kernel_forward.h`` at 4f4bcdbe6ddea60634d2af07a07c2e88dfd39a1e,
``epilogue/epilogue_rescale_output.h`` at 1338eea8cc9771ca6a8032529cbaace81a5a3412,
``gemm/mma_accum_lambda_iterator.h`` at a3ac496661544338918fbd1ed8e51e1032162406, ``kernels/cutlassF.h``
at 5ef5abf4ca22aa6c7821567b88c27dd23372a245 (the index keeps one version per file; the repository is
too large to fetch whole, so lines are cited by the function and the statement, not by number).

What PyTorch passes (``sdp_utils.cpp``, ``attention.cpp``, ``cuda/attention.cu``): ``p.scale`` is the
scale as an fp32 (``calculate_scale``: 1/sqrt(d) in double, then ``expect_float``); a boolean mask
becomes 0/-inf in q's dtype (``convert_boolean_attn_mask``) and a float mask must be in q's dtype;
``preprocess_mask`` expands the mask to (B, H, Tq, Tk) and, where its last axis is not a multiple
of 16 (8 in older versions), pads it and slices it back (``pad_bias``): an alignment of its rows in
memory, no value changes. (A single query with one shared kv head is run over heads instead of
queries, ``advance_to_block``: no rounding changes either.) ``is_causal`` is the kernel's own
``CausalFromTopLeft`` (key j of query i is -inf where j > i), not a mask tensor.

Rounding points, in the kernel's order (``AttentionKernel::attention_kernel`` and
``iterative_softmax`` in kernel_forward.h; every value fp32 unless said):

1. S = Q K^T on tensor cores from q and k in the dtype, fp32 accumulator (``MM0::Mma``). The
   accumulation order inside the MMA is not public: **assumed** the exact dot product rounded
   once to fp32 (float64 here; fp16/bf16 products are exact in it). fp32 inputs run 3xTF32
   (``OpMultiplyAddFastF32``) on sm80: close to fp32, not bit-exact with this.
2. ``accum = p.scale * accum``: the scale as its own fp32 multiply (the generated kernels all
   have ``kSupportsBias``).
3. ``accum[idx] += bias_tensor_ref.at(...)``: the mask, loaded in the dtype into shared memory
   (``BiasLoader``), added in fp32.
4. Causal (``custom_mask_type``): entries past the diagonal set to -inf, after the bias.
5. ``frag = multiplies(scaling * kLog2e, frag)`` with ``scaling = 1.0f``: times log2(e) as an
   fp32 constant, a second rounded multiply (no FMA with the max). A finite scaled score whose
   product overflows to +inf makes the row max +inf and ``exp2f(inf - inf)`` NaN: the event
   ``exp_overflow`` of this path.
6. Row max ``mi`` in log2 units over the key block (``cutlass::fast_max`` is ``fmaxf``: NaN
   ignored; NVIDIA/cutlass@082a375c14ba07be4d666243779266f9d8722bd9 include/cutlass/fast_math.h), kept across
   blocks; ``changed = m_prime < mi``. Only where it changed: ``out_rescale = exp2f(m_prime - mi)``
   and ``s_prime *= out_rescale`` (fp32 multiply); elsewhere ``out_rescale = 1``. A row whose max
   is still -inf uses ``mi = 0`` for this block (no ``exp2f(-inf - -inf)``) and keeps -inf.
7. ``frag = exp2f(frag - mi)``: fp32 subtraction, then exp2f. Modelled as exp2 in float64
   rounded once to fp32, subnormals kept: **assumed** (CUDA's exp2f is within 2 ulp of that;
   no ``--use_fast_math`` or flush-to-zero was found for these sources, not verified in the CMake
   files). Columns past the key length are 0.
8. Row sum, in the Sm80 accumulator layout (``AccumLambdaIteratorSm80``, sm75+): each thread
   adds its 8 values of a 32-key warp slice in fragment order (columns 2L, 2L+1, 8+2L, 9+2L,
   16+2L, 17+2L, 24+2L, 25+2L for lane L of the quad), from 0; ``reduceSameRow`` adds the quad
   by ``__shfl_xor`` 1 then 2: ``(t0 + t1) + (t2 + t3)``; each warp column's sum goes to
   ``addition_storage``; then ``s_prime = s_prime + a_0 + a_1 + ...`` over the warp columns in
   order (kKeysPerBlock / 32 of them). (sm50/sm70 kernels have other layouts: assumed the same.)
9. ``B2bGemm::accumToSmem``: P stored to shared memory **in the dtype** before P@V.
10. P@V on tensor cores, fp32 accumulator; accumulation order **assumed** one rounding of the
    exact sum. With the output in registers (``kKeepOutputInRF``: head_dim_v <= kKeysPerBlock)
    ``frag_o = frag_o * out_rescale`` (fp32) before each later block's MMA adds into it. Above
    that (head dim > 128 on sm80: the ``gmem`` kernels) each block's P_j@V_j is rounded to fp32
    and ``MemoryEfficientAttentionNormalize`` (epilogue_rescale_output.h) merges it with the
    global fp32 buffer: ``beta = alpha * out_rescale``, ``X = beta * source``,
    ``D = alpha * accum + X`` (``multiply_add``: an FMA; here float64 rounded once to fp32,
    which can differ from a true FMA in a rare double-rounding tie), ``alpha = 1 / denom`` on
    the row's last key block and 1 before it.
11. ``denom = s_prime == 0 ? 1 : s_prime``; ``alpha = 1 / denom`` (fp32 division); with the
    output in registers ``O = alpha * accum_o`` (fp32); O converted to the dtype (round to
    nearest). An empty row (every key masked) has ``s_prime = 0`` and ``accum_o = 0``: O = 0.
12. LSE (``logsumexp_ptr``, fp32) = ``mi / kLog2e + fast_log(s_prime)`` (``cutlass::fast_log`` is
    ``::logf`` in device code, fast_math.h above; modelled as the float64 log rounded to fp32,
    assumed); an empty row gets -inf + log(0) =
    -inf; only the padding past the last query (to a multiple of 32) is +inf.

Tiles (``kernels/cutlassF.h``; the first kernel whose kMaxK >= max(head_dim, head_dim_v)):
sm80+ (fp16, bf16, fp32): 64x64 (<= 64), 64x128 (<= 128), 32x128 with the global fp32 buffer
(> 128); sm50-sm75 (fp16, fp32): 64x64, 32x128 in registers (<= 128), 32x128 global. The query
tile changes no rounding; the key tile (kKeysPerBlock) is the online softmax's block.

Not emulated: dropout (the kernel multiplies the rounded P in shared memory by 0 or 1/(1-p)
from Philox; the path runs the call without it). Emulated for captured is_causal calls: the causal
kernel's shortened key loop (``advance_to_block`` stops at the query tile's diagonal: with the global buffer it moves the
final division to the last visited block; ``kernel_rows(key_limit=...)`` takes it, and a captured call's ``is_causal`` gives it).
"""  # noqa: E501 - this docstring feeds docs/reference/numerics.md as written

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from attncheck.numerics.paths.base import CallFacts, KernelRows, PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

COMMIT = "4f4bcdbe6ddea60634d2af07a07c2e88dfd39a1e"
LOG2E = 1.4426950408889634074  # kLog2e, held by the kernel as an fp32 constant

PATH = PathSpec(
    name="mem-efficient",
    summary="PyTorch's CUDA memory-efficient attention (CUTLASS): S in fp32, times the scale, plus the mask in "
    "the dtype, times log2(e), exp2 with a rescale only where the row max changed, per-warp row sums, P in the "
    "dtype before P@V, O divided by the sum (1 for empty rows: O = 0)",
    impl="attncheck.numerics.paths.mem_efficient:forward",
    kernel="PyTorch's memory-efficient attention forward",
    scores_in="fp32 registers, scaled then masked",
    probs_in="fp32",
    default=False,
    device="cuda",
    source=f"pytorch/pytorch@{COMMIT} aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h, "
    "epilogue/epilogue_rescale_output.h, gemm/mma_accum_lambda_iterator.h, kernels/cutlassF.h",
    assumed="the tensor cores' accumulation order (each MMA's exact sum rounded once to fp32), exp2f and logf "
    "(correctly rounded, no flush to zero); dropout is not emulated",
    stands_for=(Stands("sdpa", "efficient_attention", "cuda"),),
    supports="attncheck.numerics.paths.mem_efficient:supports",
    replay=True,
    backward="recompute",  # a fused backward with fp32 sums, each gradient rounded once (its tiling not emulated)
    row_local="noncausal",
)

_DTYPES = ("fp16", "bf16", "fp32")


def tiles(head_dim: int, head_dim_v: int, capability: tuple[int, int] | None = None) -> tuple[int, int, bool]:
    """(queries per block, keys per block, output kept in registers) of the kernel PyTorch
    dispatches (``dispatch_cutlassF``: the first whose kMaxK covers max(head_dim, head_dim_v));
    ``capability`` None: sm80's."""
    kmax = max(head_dim, head_dim_v)
    sm80 = capability is None or tuple(capability) >= (8, 0)
    if kmax <= 64:
        return 64, 64, True
    if kmax <= 128:
        return (64, 128, True) if sm80 else (32, 128, True)
    return 32, 128, False


def _alignment(dtype: str, capability: tuple[int, int] | None) -> int:
    """``minimum_gemm_alignment`` (sdp_utils.cpp): head dims must be multiples of it."""
    major = 8 if capability is None else capability[0]
    half = dtype in ("fp16", "bf16")
    align = 4 if major >= 8 else 1
    tensor_cores = major >= 8 or (major >= 7 and half)
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def supports(facts: CallFacts) -> str | None:
    """Why PyTorch's efficient backend would not run this call (``use_mem_efficient_attention``
    in sdp_utils.cpp), or None. Dropout it runs (not emulated: the path runs the call without it)."""
    if facts.dtype not in _DTYPES:
        return f"takes fp16, bf16 and fp32, not {facts.dtype}"
    cap = facts.capability
    if cap is not None and tuple(cap) < (5, 0):
        return "needs sm50 or newer"
    if cap is not None and facts.dtype == "bf16" and tuple(cap) < (8, 0):
        return "bf16 needs sm80 or newer"
    if facts.gqa:
        return "no grouped-query attention (its dense check wants as many kv heads as query heads)"
    if facts.softcap is not None:
        return "no softcap"
    if facts.window is not None:
        return "no sliding window"
    if facts.tq == 0 or facts.tk == 0:
        return "no empty sequences"
    align = _alignment(facts.dtype, cap)
    if facts.head_dim <= 0 or facts.head_dim_v <= 0 or facts.head_dim % align or facts.head_dim_v % align:
        return f"head dims must be multiples of {align}"
    if max(facts.head_dim, facts.head_dim_v) > 65536:
        return "head dim above 65536"
    return None


def _f32(x: torch.Tensor) -> torch.Tensor:
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    return x.to(torch.float32)


def _exp2f(x: torch.Tensor) -> torch.Tensor:
    """exp2 of fp32 values, rounded once to fp32 (subnormals kept)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    return torch.exp2(x.to(torch.float64)).to(torch.float32)


def _row_sum(e: torch.Tensor) -> torch.Tensor:
    """(r, W, 32) fp32 exps of W warp slices -> (r, W) per-warp sums in the kernel's order:
    each quad lane's 8 values in fragment order, then (t0 + t1) + (t2 + t3)."""
    r, w = e.shape[0], e.shape[1]
    # column = mma_n * 8 + lane * 2 + col; a lane adds mma_n-major, col-minor
    frag = e.reshape(r, w, 4, 4, 2)  # (rows, warp, mma_n, lane, col): views, no copy
    t = frag[:, :, 0, :, 0]
    for i in range(1, 8):  # the lane's eight fp32 additions, vectorised over rows and lanes
        t = t + frag[:, :, i // 2, :, i % 2]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def kernel_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    scale: float,
    dt: torch.dtype,
    bias: torch.Tensor | None = None,
    masked: torch.Tensor | None = None,
    block_n: int | None = None,
    in_registers: bool | None = None,
    capability: tuple[int, int] | None = None,
    key_limit: torch.Tensor | None = None,
) -> KernelRows:
    """The kernel on rows: q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) or None, any float dtype,
    rounded to ``dt``; ``bias`` (n, tq, Tk) the additive mask in dt as PyTorch passes it (a
    boolean mask already 0/-inf); ``masked`` (n, tq, Tk) bool: keys the kernel itself sets to -inf
    after the bias (is_causal); ``block_n`` / ``in_registers``: the key tile and where O lives
    (default: ``tiles`` for the head dims and ``capability``); ``key_limit`` (n*tq,) int: the keys
    the causal kernel's loop visits per row (default all)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    n, tq, d = q.shape
    tk = k.shape[1]
    dv = d if v is None else v.shape[-1]
    _, bn_default, rf_default = tiles(d, dv, capability)
    bn = block_n or bn_default
    rf = rf_default if in_registers is None else in_registers
    if bn % 32:
        raise ValueError(f"key block {bn} is not a multiple of 32")
    f64 = torch.float64
    scores, x = _scores(q, k, scale, dt, bias, masked, tk)
    r = x.shape[0]
    log2e_overflow = (torch.isposinf(x) & torch.isfinite(scores)).any(dim=-1)
    vd = None if v is None else cast(v.to(f64) if v.dtype != f64 else v, dt).to(f64)  # (n, Tk, dv)
    nblocks, mi, s_prime, acc, out32, p_blocks, rescales = _key_blocks(x, vd, n, tq, tk, r, dv, bn, rf, dt, key_limit)
    return _finalize(
        mi, s_prime, acc, out32, p_blocks, rescales, nblocks, bn, tk, r, rf, vd, dt, scores, log2e_overflow
    )


def _scores(q, k, scale: float, dt, bias, masked, tk: int):
    """The scores: S in fp32 (the exact dot rounded once), scaled, the bias added in fp32, the kernel's own -inf
    keys; (S as rows (r, Tk), S times log2(e) rounded to fp32)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    f64 = torch.float64
    qd, kd = cast(q.to(f64) if q.dtype != f64 else q, dt).to(f64), cast(k.to(f64) if k.dtype != f64 else k, dt).to(f64)
    s = _f32(torch.matmul(qd, kd.transpose(-1, -2)))  # the exact dot rounded once to fp32 (assumed MMA order)
    s = s * torch.tensor(scale, dtype=torch.float32)  # accum = p.scale * accum
    if bias is not None:
        s = s + bias.to(torch.float32)  # the mask in dt, added in fp32
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    scores = s.reshape(-1, tk)
    x = scores * torch.tensor(LOG2E, dtype=torch.float32)  # times kLog2e, rounded
    return scores, x


def _key_blocks(x, vd, n: int, tq: int, tk: int, r: int, dv: int, bn: int, rf: bool, dt, key_limit):
    """The main loop over key blocks, in the kernel's order: the running max and sum, P in the dtype and O,
    in registers or through the global fp32 buffer: (blocks, mi, s_prime, acc, out32, P per block, rescales)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    f64 = torch.float64
    nblocks = max(1, -(-tk // bn))
    pad = nblocks * bn - tk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    valid = torch.arange(nblocks * bn) < tk
    limit = None if key_limit is None else key_limit.reshape(-1)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float32)
    mi = torch.full((r,), float("-inf"), dtype=torch.float32)
    s_prime = torch.zeros(r, dtype=torch.float32)
    acc = torch.zeros(r, dv, dtype=torch.float32)  # accum_o (registers) or the global fp32 buffer
    out32 = torch.zeros(r, dv, dtype=torch.float32)  # the gmem kernels' final D per row
    p_blocks, rescales = [], []
    for j in range(nblocks):  # key blocks in the kernel's order; rows are vectorised
        cols = slice(j * bn, (j + 1) * bn)
        xb = x[:, cols]
        ok = valid[cols]
        active = torch.ones(r, dtype=torch.bool) if limit is None else limit > j * bn
        bmax = torch.where(torch.isnan(xb) | ~ok, neg_inf, xb).amax(dim=-1)  # fast_max ignores NaN
        mi_new = torch.where(active, torch.maximum(mi, bmax), mi)
        changed = mi < mi_new
        rescale = torch.where(changed, _exp2f(mi - mi_new), torch.ones_like(mi))
        s_prime = torch.where(changed, s_prime * rescale, s_prime)
        mi_use = torch.where(~changed & torch.isneginf(mi_new), torch.zeros_like(mi_new), mi_new)
        e = torch.where(ok, _exp2f(xb - mi_use[:, None]), torch.zeros((), dtype=torch.float32))
        e = torch.where(active[:, None], e, torch.zeros((), dtype=torch.float32))
        parts = _row_sum(e.reshape(r, bn // 32, 32))
        total = s_prime
        for w in range(parts.shape[1]):  # addition_storage, warp columns in order
            total = total + parts[:, w]
        s_prime = torch.where(active, total, s_prime)
        mi = mi_new
        p = e.to(dt).to(f64)  # accumToSmem: P in the dtype
        p_blocks.append(p)
        rescales.append(rescale.to(f64))
        if vd is None:
            continue
        pv = torch.matmul(p.reshape(n, tq, bn)[..., : min(bn, tk - j * bn)], vd[:, cols]).reshape(r, dv)
        if rf:  # frag_o * out_rescale, then the MMA adds P_j @ V_j into it (one rounding, assumed)
            new = _f32(_f32(acc * rescale[:, None]).to(f64) + pv) if j else _f32(pv)
            acc = torch.where(active[:, None], new, acc)
            continue
        pv32 = _f32(pv)  # accum_o cleared per block: P_j @ V_j in fp32
        last = (torch.full((r,), (j + 1) * bn >= tk) if limit is None else (j + 1) * bn >= limit) & active
        denom = torch.where(s_prime == 0, torch.ones_like(s_prime), s_prime)
        alpha = torch.where(last, _f32(1 / denom.to(f64)), torch.ones_like(denom))
        if j == 0:
            dnew = alpha[:, None] * pv32
        else:
            beta = alpha * rescale
            xsrc = beta[:, None] * acc
            dnew = _f32(alpha[:, None].to(f64) * pv32.to(f64) + xsrc.to(f64))  # multiply_add
        acc = torch.where(active[:, None], dnew, acc)
        out32 = torch.where(last[:, None], dnew, out32)
    return nblocks, mi, s_prime, acc, out32, p_blocks, rescales


def _finalize(mi, s_prime, acc, out32, p_blocks, rescales, nblocks, bn, tk, r, rf, vd, dt, scores, log2e_overflow):
    """O over the final sum, the effective probabilities and the LSE."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    f64 = torch.float64
    denom = torch.where(s_prime == 0, torch.ones_like(s_prime), s_prime)
    out = None
    if vd is not None:
        if rf:
            alpha = _f32(1 / denom.to(f64))
            out = (alpha[:, None] * acc).to(dt)
        else:
            out = out32.to(dt)
    # The effective probabilities: P_j in the dtype times every later block's rescale, over the
    # final sum (float64, then fp32), so that O = probs @ V up to P@V's own rounding.
    later = torch.ones(r, dtype=f64)
    probs = torch.empty(r, nblocks * bn, dtype=f64)
    for j in range(nblocks - 1, -1, -1):
        probs[:, j * bn : (j + 1) * bn] = p_blocks[j] * later[:, None]
        later = later * rescales[j]
    probs = _f32(probs[:, :tk] / denom.to(f64)[:, None])
    log_s = _f32(torch.log(s_prime.to(f64)))
    lse = _f32(mi.to(f64) / torch.tensor(LOG2E, dtype=torch.float32).to(f64)) + log_s
    return KernelRows(probs, out, lse, {"log2e_overflow": log2e_overflow}, scores=scores)


def forward(block: QKBlock, dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    """The path on a block of rows: the mask as the model holds it in dt is the kernel's bias
    (causal included, as the block holds it: -inf either way)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock

    _, before = block.fp32_scores(dt, "flash")  # the causes before 'fully_masked' (qk overflow, mask sentinel)
    _, _, mask_dt = block._mask_planes(dt)
    call = block.inp.call  # a captured call: the GPU's capability picks the tiles; is_causal shortens the key loop
    capability = None if call is None else call.capability
    limit = None
    if (
        call is not None and call.mask == "causal"
    ):  # the kernel's own causal mask: its loop stops at the tile's diagonal
        # torch stays off --help: the registry reads this module's PATH when the CLI starts
        import torch

        q_block = tiles(block.q.shape[-1], block.q.shape[-1] if block.v is None else block.v.shape[-1], capability)[0]
        queries = torch.arange(block.inp.q.shape[2])[block.rows[1]]
        per_query = torch.clamp((queries // q_block + 1) * q_block, max=block.k.shape[1])
        limit = per_query.repeat(block.q.shape[0])
    kr = kernel_rows(
        block.q, block.k, block.v, scale=block.inp.scale, dt=dt, bias=mask_dt, capability=capability, key_limit=limit
    )
    out = MethodOutput(kr.probs, events={"exp_overflow": kr.events["log2e_overflow"]})
    out.out = kr.out
    return PathBlock(kr.scores, before, [], [(PATH.name, out)])
