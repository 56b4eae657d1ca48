"""Kernel hazards: rows a kernel breaks for a reason of its own, which the paths replay as events (the fused max
subtraction's exp2 overflow, P beyond its format before the cast, cuDNN's padded tiles in the backward), and the
FP8 tensor cores' reduced accumulator."""

from __future__ import annotations

import math

from attncheck.findings.base import _SEEDED, _TORCH, Code, Example
from attncheck.params import FP8_ACCUM_KERNEL_BITS
from attncheck.registry import PATHS
from attncheck.results import Cell, DtypeLimits, TensorDiagnosis

LOG2E = 1 / math.log(2)  # exp(x) = exp2(x log2 e): the kernels fold it into the scale
# cuDNN's key and query tiles as attncheck.numerics.paths.cudnn assumes them (KEY_TILE, Q_TILE; the judgement layer
# imports no numerics, tests/test_kernel_hazards.py holds them equal): which tile a padded_tile row's call pads
CUDNN_KEY_TILE, CUDNN_Q_TILE = 128, 64
FP8_ACCUM_RULE = 2.0  # FlashAttention's rule: a kernel's error may be at most twice that of its fp32-accumulating twin
VLLM_NIAH = "vLLM PR 122: needle-in-a-haystack at 128k 0.89 / 0.88 / 0.856 with a flush every 1 / 4 / 64 blocks"

CODES: tuple[Code, ...] = (
    Code(
        "fused_max",
        "error",
        "softmax",
        "the kernel's fused max subtraction overflows exp2",
        "FlashAttention-2 as the flash-attn package builds it (path `fa2-fma`) computes each exponent with one "
        "fused multiply-add, exp2f(fma(x, scale x log2e, -max_scaled)), where max_scaled = m x scale x log2e was "
        "rounded to fp32 beforehand. At the row max the exponent is then not 0 but the rounding residue of "
        "m x scale x log2e, up to half an fp32 ulp of it: for scores large enough that residue passes 128, exp2 "
        "overflows, the row sum is inf and O is NaN, although every score is finite and far inside fp32 "
        "(PyTorch issue 121558: bf16 Q, K, V all 133120 give NaN from the flash kernel and finite outputs from the "
        "efficient and math kernels). PyTorch builds its FlashAttention-2 with UNFUSE_FMA since then (path `fa2`: "
        "the product rounded, then the subtraction, so the exponent is <= 0 at every score, rounding being "
        "monotone). FlashAttention-4 (path `fa4`) has no unfused build: fma(x, scale x log2e, max_offset - "
        "max_scaled), the same residue. The message names the kernel, the largest score, half an ulp there and "
        "the threshold, and the paths computed that stay finite.",
        "Rows where an exp2 of a finite score is inf in fp32 or beyond the P dtype's range, or whose row sum is "
        "inf. It can happen once half an fp32 ulp of |m x scale x log2e| (2^(e-24) for a value in [2^e, 2^(e+1))) "
        "reaches log2 of the largest value exp2 may return: 128 for fp32's exp2 (127.997 for bf16's P; either way "
        "|m x scale x log2e| >= 2^31, "
        "|S x scale| >= 2^31 / log2e = 1.489e9), log2(65520) = 15.9996 for fp16's P (>= 2^28, |S x scale| >= "
        "1.861e8); the limits are torch.finfo's.",
        "run FlashAttention-2 unfused: PyTorch's flash backend (path fa2, built with UNFUSE_FMA), or the efficient or "
        "math backend instead of the flash-attn package; or keep |S x scale| below 2^31 / log2e = 1.49e9 (fp16: "
        "2^28 / log2e = 1.86e8), e.g. normalise q and k (qk-layernorm): scores that large mean q and k grew unchecked",
        Example(
            _TORCH
            + """\
from safetensors.torch import save_file

x = torch.full((1, 1, 1, 64), 133120.0, dtype=torch.bfloat16)  # PyTorch issue 121558: every element 133120
save_file({"q": x, "k": x.clone(), "v": x.clone()}, "qk.safetensors")
""",
            "attncheck run qk.safetensors --path fa2-fma --dtype bf16 --fail-on fused_max",
        ),
        causes=("fused_max",),
    ),
    Code(
        "p_saturation",
        "warning",
        "fp8",
        "P exceeds its format's largest value before the cast (FlashAttention-4's max offset and lazy rescale)",
        "FlashAttention-4 (path `fa4`) keeps a row's max until it has grown by more than rescale_threshold log2 "
        "units, and in FP8 adds max_offset to every exponent so that P fills the format: P = 2^(x log2e - m log2e + "
        "max_offset) can reach 2^(max_offset + rescale_threshold). Above the format's largest value (e4m3: 448 = "
        "2^8.81; e5m2: 57344 = 2^15.81) the kernel's saturating cast (cvt.rn.satfinite) clips those probabilities "
        "while its fp32 row sum counts them in full, so the row's largest weights shrink in O and O shrinks toward "
        "0. flash-attention issue 2716: with the FP8 threshold 4 of PR 2694 and offset 8, P reached 2^12 = 4096 "
        "and decode cosine similarity against bf16 fell off a cliff at a tile boundary (issue 2577; PRs 2713, 2717: "
        "offset 4 for e4m3; PR 2731: FP8 threshold 0). The kernel's own defaults (FP8: threshold 0, offset 8; "
        "fp16/bf16: threshold 8, offset 0) cannot saturate: this shows for other values asked as a what-if. In "
        "fp16 (no saturating cast) a threshold above 15.99 turns P into inf and the row into NaN. The message "
        "gives the rows, the heads of the examples and the cell's output error.",
        "Rows where some P exceeds the format's largest value before the cast; possible once max_offset + "
        "rescale_threshold > log2(max) (e4m3 8.81, e5m2 15.81, fp16 15.999, the assertion of flash_fwd_sm100.py), in "
        "rows whose max grows between key blocks by more than log2(max) - max_offset and less than the threshold.",
        "keep max_offset + rescale_threshold below log2 of the format's largest value: lower the max offset (4 "
        "for e4m3, PR 2717) or the rescale threshold (0 for FP8, PR 2731, the current kernel's default), or run "
        "the call in bf16",
        Example(
            _SEEDED
            + """\
from attncheck import Options
from attncheck.judge import diagnose_attention
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.numerics.paths.fa4 import Fa4Setup

q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
inputs = prepare_inputs(q * 2, k, v=v)  # logits with a standard deviation of 2
setup = Fa4Setup(rescale_threshold=4.0, max_offset=8.0)  # PR 2694's FP8 threshold with the offset of 8
result = diagnose_attention("qkv", inputs, Options(dtypes=("e4m3",), paths=("fa4",), fa4=setup))
print([f.code for f in result.findings])
""",
        ),
        severity_note="error where P overflowed fp16 to inf (no saturating cast: those rows of O are NaN); "
        "warning where the FP8 cast saturated it (O shrinks)",
        also="error",
        causes=("p_saturation",),
    ),
    Code(
        "padded_tile",
        "warning",
        "backward",
        "cuDNN's backward gives NaN gradients on this call (padded tile)",
        "A prediction for cuDNN's SDPA backward (PyTorch's CUDNN_ATTENTION backend, path `cudnn`), from its forward "
        "log-sum-exp. The backward recomputes P = exp(S - LSE) tile by tile; where a tile runs past the tensor's end "
        "its zero-filled entries are scored 0 instead of -inf, and in a row whose LSE is below -ln(FLT_MAX) = -88.72, "
        "exp(0 - LSE) overflows fp32 and inf x 0 gives NaN. Two published forms: the key tile (PyTorch issue 196678: "
        f"an explicit attn_mask and a key length with Tk % {CUDNN_KEY_TILE} == {CUDNN_KEY_TILE // 2}, NaN in dQ of "
        "those rows; seen with cuDNN 9.20 on H100/H200, fixed in cuDNN 9.26, PyTorch PR 196861) and the query tile "
        "(cudnn-frontend issue 1072: Sq = 1, Sk = 128, no mask, NaN in dK and dV; cuDNN 9.25.1 and 9.26, open). The "
        "forward is finite; the gradients depend on the cuDNN version and the GPU (both were seen on sm90), so it is "
        "a warning. A q/k file cannot say whether its mask was a tensor or is_causal: a mask given counts as "
        "explicit. A row whose every open key scores below -88 is most often a mask bug (a row that should have been "
        "masked whole, or a sentinel added twice).",
        "Rows with a finite forward LSE and exp(-LSE) = inf in fp32 (LSE < -ln(finfo(fp32).max) = -88.72), in a "
        f"call with an explicit mask and Tk % {CUDNN_KEY_TILE} == {CUDNN_KEY_TILE // 2} (key form), or with Tq % "
        f"{CUDNN_Q_TILE} != 0 and Tk % {CUDNN_KEY_TILE} == 0 (query "
        "form); none on a recorded GPU other than sm90.",
        "key form: update cuDNN to 9.26 or later; either form (the query form has no fix yet): run another "
        "backend for this call "
        "(torch.backends.cuda.enable_cudnn_sdp(False), or torch.nn.attention.sdpa_kernel with the flash or "
        "efficient backend); and check the mask: a row whose open keys all score below -88 is usually a mask bug",
        Example(
            _TORCH
            + """\
import math

from safetensors.torch import save_file

g = torch.Generator().manual_seed(0)
L, D = 192, 64  # PyTorch issue 196678, small: 192 % 128 == 64 leaves the last key tile half padding
q, k = (torch.randn(1, 1, L, D, generator=g) * 0.1 for _ in range(2))
v = torch.randn(1, 1, L, D, generator=g)
q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)  # every logit about -120: every row's LSE below -88.72
mask = torch.ones(L, L, dtype=torch.bool).tril()  # an explicit mask tensor (True = attend)
save_file({"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), "mask": mask}, "qk.safetensors")
""",
            "attncheck run qk.safetensors --path cudnn --dtype bf16 --fail-on padded_tile",
        ),
    ),
    Code(
        "fp8_accumulator",
        "warning",
        "fp8",
        "the FP8 tensor cores' reduced accumulator costs more than twice fp32 accumulation's error",
        "Hopper's (and Ada's) FP8 MMA keeps about 22 bits of its fp32 accumulator: after each 32-element step the "
        "low 10 mantissa bits are truncated (SageAttention 2; thu-ml/SageAttention issue 287; DeepSeek-V3 reports "
        "about 14 bits of each product). FlashAttention-3's FP8 forward accumulates P@V into O on the tensor cores "
        "over the whole key range, so at long key lengths O's small late additions are truncated away and O "
        "drifts toward zero. vLLM's fork (vllm-project/flash-attention PRs 104, 122; Dao-AILab/flash-attention "
        "PR 2250) adds the reduced accumulator to an fp32 one every N key blocks; SageAttention 2 does it every "
        "block. The cell's output is compared with the same kernel with fp32 accumulation and with flushes every "
        "1, 4 and 64 key blocks (vLLM PR 122 measured needle-in-a-haystack at 128k keys 0.89 / 0.88 / 0.856).",
        f"An FP8 cell on the reduced accumulator (--fp8-accum, default the kernel's {FP8_ACCUM_KERNEL_BITS} bits) "
        f"whose output RMSE against float64 exceeds {FP8_ACCUM_RULE:g}x that of the same kernel with fp32 accumulation "
        f"(FlashAttention's {FP8_ACCUM_RULE:g}x rule).",
        "flush the FP8 accumulator into fp32 every few key blocks (vLLM's flash-attention fork: "
        "FLASH_ATTENTION_FP8_TWO_LEVEL_INTERVAL, 4 by default; --fp8-flush N shows the effect; the message names the "
        f"longest interval of 1 / 4 / 64 that holds the {FP8_ACCUM_RULE:g}x rule), or keep P@V in bf16 for long "
        "contexts",
        Example(
            _SEEDED
            + """q = torch.randn(1, 1, 16, 64, generator=g) * 0.3
k = torch.randn(1, 1, 8192, 64, generator=g) * 0.3
v = torch.randn(1, 1, 8192, 64, generator=g) + 20  # a large common component: O ~ 20 at every key length
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype e4m3 --path flash-fp8 --brief --fail-on "
            "fp8_accumulator",
        ),
    ),
)


def hazard_findings(diag: TensorDiagnosis, c: Cell, add) -> None:
    """fused_max, p_saturation, padded_tile: rows a kernel breaks for a reason of its own (its events)."""
    n_fused = c.events.get("fused_max", 0)
    if n_fused:
        add("fused_max", _fused_max_message(diag, c, n_fused), [c], n_fused, c.examples.get("event:fused_max", []))
    n_sat = c.events.get("p_saturation", 0)
    if n_sat:
        add(
            "p_saturation",
            _p_saturation_message(diag, c, n_sat),
            [c],
            n_sat,
            c.examples.get("event:p_saturation", []),
            severity="error" if c.nan_causes.get("p_saturation") else None,
        )
    n_pad = c.events.get("padded_tile", 0)
    if n_pad:
        add("padded_tile", _padded_tile_message(diag, c, n_pad), [c], n_pad, c.examples.get("event:padded_tile", []))


def fused_max_threshold(fp32: DtypeLimits, p_dtype: DtypeLimits) -> int:
    """The least e such that a row max m with |m scale log2e| >= 2^e can break the fused exponent
    ``exp2f(fma(x, scale_log2, -round(m scale_log2)))`` (FlashAttention-2 without UNFUSE_FMA): at the row max
    the exponent is the rounding residue of m scale log2e to fp32, up to half an fp32 ulp there, 2^e x eps / 2
    (eps: fp32's ulp of one); exp2 of it overflows once 2^residue reaches fp32's rounding limit, and P once it
    reaches the P dtype's. fp32 and bf16: 2^31 (residue 128); fp16: 2^28 (residue 16 > log2 65520)."""
    room = _exp2_room(fp32, p_dtype)
    return math.ceil(math.log2(2 * room / fp32.eps))


def _exp2_room(fp32: DtypeLimits, p_dtype: DtypeLimits) -> float:
    """log2 of the least value that overflows exp2's fp32 result or P's dtype: the largest safe exponent."""
    return min(math.log2(fp32.rounding_limit), math.log2(p_dtype.rounding_limit))


def _fused_max_message(diag: TensorDiagnosis, c: Cell, rows: int) -> str:
    """The rows, the kernel, the largest score and the threshold, from the limits (torch.finfo)."""
    spec = PATHS.get(c.path) if c.path in PATHS else None
    kernel = spec.kernel if spec is not None else c.method
    nan = c.nan_causes.get("fused_max", 0)
    census = diag.census
    top = None if census.max is None or census.min is None else max(abs(census.max), abs(census.min))
    fp32, own = diag.limits.get("fp32"), diag.limits.get(c.dtype)
    parts = [
        f"{c.name}: {kernel} computes exp2f(fma(x, scale*log2e, -round(m*scale*log2e))): at the row max m the "
        f"exponent is the rounding residue of m*scale*log2e to fp32, not 0, and exp2 of it overflows in {rows} "
        f"row(s) -> {nan} NaN row(s)"
    ]
    if top is not None and fp32 is not None and top > 0:
        scaled = top * LOG2E
        half_ulp = 2.0 ** (math.floor(math.log2(scaled)) - 1) * fp32.eps  # half an fp32 ulp of m*scale*log2e
        parts.append(
            f"largest score |S*scale| {top:.4g}, times log2e {scaled:.4g}, where half an fp32 ulp is {half_ulp:.6g}"
        )
    if fp32 is not None and own is not None:
        e = fused_max_threshold(fp32, own)
        where = c.dtype if own.rounding_limit < fp32.rounding_limit else "fp32"
        parts.append(
            f"exp2 of the residue overflows {where} above {_exp2_room(fp32, own):.6g} (log2 of its rounding "
            f"limit), which half an ulp can reach once |S*scale*log2e| >= 2^{e}, i.e. |S*scale| >= "
            f"{2.0**e / LOG2E:.4g}"
        )
    safe = [o.name for o in diag.cells if o.dtype == c.dtype and o is not c and o.path and not o.nan_rows]
    if safe:
        parts.append("finite in " + ", ".join(safe))
    if "FlashAttention-2" not in (kernel or ""):  # FlashAttention-4: fma(S, scale*log2e, max_offset - m*scale*log2e)
        parts.append(f"{kernel} computes every exponent this way (with its max offset added), and has no unfused build")
    else:
        parts.append(
            "the flash-attn package builds FlashAttention-2 this way; PyTorch's flash backend builds it with "
            "UNFUSE_FMA (PyTorch issue 121558), whose exponent is <= 0 at every score"
        )
    return "; ".join(parts)


def _p_saturation_message(diag: TensorDiagnosis, c: Cell, rows: int) -> str:
    """The rows, the heads of the examples, the format's largest value and what it did to O (the cell's error)."""
    lim = diag.limits.get(c.dtype)
    top = f" {lim.max:.6g} (2^{math.log2(lim.max):.3f})" if lim is not None else ""
    spec = PATHS.get(c.path) if c.path in PATHS else None
    kernel = spec.kernel if spec is not None else c.name
    heads = sorted({e[-2] for e in c.examples.get("event:p_saturation", []) if len(e) >= 2})
    where = f" (heads {', '.join(map(str, heads))} among the examples)" if heads else ""
    nan = c.nan_causes.get("p_saturation", 0)
    if nan:
        effect = f"P overflows {c.dtype} to inf (no saturating cast): {nan} NaN row(s)"
    else:
        effect = (
            "the saturating cast clips those probabilities while the fp32 row sum counts them in full, so O shrinks"
        )
    why = "the max offset plus the lazy rescale's threshold passes log2 of it"
    if c.limit is not None and c.limit.kind == "p_saturation":  # the cell's own setting, as its limit states it
        why = c.limit.what.split(" (in |S scale| units")[0]
    hit = c.event_counts.get("p_saturation")
    values = f" ({hit} probabilit{'y' if hit == 1 else 'ies'})" if hit else ""
    parts = [
        f"{c.name}: {kernel} lets P exceed {c.dtype}'s largest value{top} before the cast in {rows} of {c.rows} "
        f"row(s){values}{where}: {why}; {effect}"
    ]
    if c.out_max_abs_err is not None:
        cos = f", cosine similarity down to {c.out_cos_min:.4g}" if c.out_cos_min is not None else ""
        rows_of = " on the rows that stayed finite" if nan else ""
        parts.append(f"O against float64{rows_of}: max abs error {c.out_max_abs_err:.3g}{cos}")
    if lim is not None and c.dtype in ("fp16", "bf16"):  # no FP8 offset in 16 bits: the threshold alone
        parts.append(f"in {c.dtype} keep the rescale threshold below log2({lim.max:.6g}) = {math.log2(lim.max):.4g}")
    else:
        parts.append("flash-attention issue 2716 (threshold 4, offset 8); PRs 2717, 2731 lowered them")
    return "; ".join(parts)


def _padded_tile_message(diag: TensorDiagnosis, c: Cell, rows: int) -> str:
    """The rows, the form (which tile is padded, which gradient breaks), the lowest LSE against -ln(FLT_MAX)."""
    tq, tk = (diag.shape[-2], diag.shape[-1]) if len(diag.shape) >= 2 else (None, None)
    fp32 = diag.limits.get("fp32")
    low = c.event_values.get("padded_tile")
    limit = f" -ln(FLT_MAX) = {-math.log(fp32.max):.2f}" if fp32 is not None else " -ln(FLT_MAX)"
    lse = f" (lowest LSE {low:.4g})" if low is not None else ""
    tile = CUDNN_KEY_TILE
    if tk is not None and tk % tile == tile // 2:
        form = (
            f"key tile: Tk = {tk} leaves the last {tile}-key tile half padding and the call has an explicit "
            "mask; the backward scores the padded keys 0 instead of -inf, exp(0 - LSE) overflows fp32 and inf x 0 "
            "(zero-filled K) gives NaN in dQ of these rows (PyTorch issue 196678: seen with cuDNN 9.20 on sm90, "
            "fixed in cuDNN 9.26)"
        )
    else:
        form = (
            f"query tile: Tq = {tq} is not a multiple of the {CUDNN_Q_TILE}-query tile (Tk = {tk}, whole "
            f"{tile}-key tiles); the zero-filled query rows score 0 against every key, exp(0 - LSE) overflows "
            "fp32 and dK and dV of the head's keys are NaN (cudnn-frontend issue 1072: cuDNN 9.25.1 and 9.26 on "
            "sm90, open: no cuDNN release fixes it, run another backend for this call)"
        )
    return (
        f"{c.name}: {rows} row(s) have a forward log-sum-exp below{limit}{lse}; the forward is finite, but "
        f"cuDNN's backward gives NaN gradients on this call (padded {form})"
    )


def fp8_accumulator(diag: TensorDiagnosis, add) -> None:
    """FP8 cells on the tensor cores' reduced accumulator whose output error passes twice that of the same
    kernel with fp32 accumulation, with the cheapest flush interval of the grid that holds it."""
    for c in diag.cells:
        rmse = c.fp8_accum_rmse or {}
        ref = rmse.get("fp32")
        if c.out_rmse is None or ref is None or not c.out_rmse > FP8_ACCUM_RULE * ref:
            continue
        holds = [
            (int(name.split()[1]), r)
            for name, r in rmse.items()
            if name.startswith("flush ") and r is not None and r <= FP8_ACCUM_RULE * ref
        ]
        if holds:
            n, r = max(holds)  # the longest interval that holds: the fewest fp32 adds
            cure = f"a flush to fp32 every {n} key block{'s' if n > 1 else ''} holds it (RMSE {r:.3g})"
        else:
            cure = "a flush to fp32 every key block (SageAttention 2's and vLLM PR 104's scheme) bounds it by one block"
        add(
            "fp8_accumulator",
            f"{c.name}: at {c.fp8_accum_keys} keys, P@V accumulated on the FP8 tensor cores ({c.fp8_accum}) gives O "
            f"an RMSE of {c.out_rmse:.3g} against float64, {c.out_rmse / ref:.1f}x the {ref:.3g} of the same kernel "
            f"with fp32 accumulation (more than {FP8_ACCUM_RULE:g}x); {cure} ({VLLM_NIAH})",
            [c],
        )
