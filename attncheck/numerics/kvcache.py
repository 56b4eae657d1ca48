"""A quantised KV cache as serving engines write and read it: K and V divided by a scale and cast to FP8 on the
cache write, multiplied back on the read, and attention computed from the dequantised cache.

The engines, read at these commits:

- vLLM's cache write, ``reshape_and_cache_flash_kernel`` (vllm-project/vllm@693083ae80680811c9c2a22edad2568e6635e190,
  ``csrc/cache_kernels.cu``), stores ``fp8::scaled_convert<cache_t, scalar_t, kv_dt>(key, k_scale)`` per element;
  ``scaled_vec_conversion`` (vllm-project/vllm@03476e5c1184648abcfd1573b630bcd81741a555,
  ``csrc/quantization/fp8/nvidia/quant_utils.cuh``) is ``__nv_cvt_float_to_fp8(float(x) / scale, __NV_SATFINITE,
  fp8_type)``: the division in fp32, then a **saturating** round-to-nearest cast (beyond the format's largest
  value: that value). The read (the same file, fp8 -> bf16) is ``__float2bfloat16(float(fp8) * scale)``: the
  product in fp32, rounded once to the model's dtype, which the attention kernel consumes.
- vLLM's scales (vllm-project/vllm@5d4420da433893084e40e5ec8ead7ea37a9dfcc9, ``vllm/attention/layer.py``): 1.0 for
  a checkpoint without them (``set_default_quant_scales``); calibrated ``k_scale``/``v_scale`` loaded with the
  weights (amax / the format's max per layer); with ``calculate_kv_scales`` (``calc_kv_scales``) the scales of the
  first call, ``abs(key).max() / k_range`` and ``abs(value).max() / v_range``, where ``k_range`` and ``v_range``
  are ``K_SCALE_CONSTANT`` = 200 and ``V_SCALE_CONSTANT`` = 100 (``vllm/envs.py``), once, then kept.
- SGLang's ``MHATokenToKVPool.set_kv_buffer`` (sgl-project/sglang@14c3feee2390a7b5a06accc7af651bde8c5211c6,
  ``python/sglang/srt/mem_cache/memory_pool.py``): ``cache_k.div_(k_scale)`` in the model's dtype (a bf16
  division, one more rounding), then torch's ``cache_k.to(self.dtype)``. Whether that cast saturates is torch's:
  measured with torch 2.13 on CPU, float -> ``float8_e5m2`` is not saturating (61,440 and beyond become inf),
  float -> ``float8_e4m3fn`` gives 448 for everything above it, inf included; a torch whose e4m3fn cast is not
  saturating gives NaN there (e4m3fn has no inf).

Emulated here: vLLM's write and read (fp32 division, saturating cast, fp32 product rounded to the model's dtype),
and the attention of FlashInfer's and vLLM's FlashAttention-2 paths with an FP8 cache: the dequantised K and V in
the model's dtype, then FlashAttention-2's forward (``attncheck.numerics.paths.fa2.kernel_rows``) with its 16-bit
products. And, as a consumer of its own (``fa3_fp8_output``), vLLM's FlashAttention-3 path with an FP8 cache:
the cache's FP8 K and V read as they are, Q quantised too by ``ops.scaled_fp8_quant(query, layer._q_scale)``, whose
static kernel (vllm-project/vllm@006ccf0ea309e73ee3b7dc3bbb7017fa2bf7b721, ``csrc/quantization/fp8/common.cu``)
multiplies by ``inverted_scale = 1.0f / scale`` in fp32, clamps to +-448 and casts; the kernel takes
``q_descale``/``k_descale``/``v_descale`` (the scales, per batch and kv head) and computes FP8 products
(``attncheck.numerics.paths.fa3`` FP8 mode: S = q8 k8^T in fp32 times the descales and the softmax scale, P scaled
by 2^8 and cast to e4m3 per key block, O in fp32 times the v descale, written in bf16). vLLM's ``_q_scale`` is 1.0
unless a checkpoint carries one, or, with ``calculate_kv_scales``, the first call's ``abs(query).max() /
Q_SCALE_CONSTANT`` (200, ``vllm/envs.py``). FlashAttention-3's FP8 path reads e4m3 only.

Integer caches (``int4``) as transformers' ``QuantizedCache`` with its default backend (``generate``'s),
optimum-quanto, writes them (transformers 5.24 ``cache_utils.py``: ``QuantoQuantizedLayer`` with ``nbits`` 4,
``axis_key`` = ``axis_value`` = 0, ``q_group_size`` 64, ``residual_length`` 128; quanto read at
huggingface/optimum-quanto@e33f8202e6c755256b7448789a5ed765c45d5105): ``MaxOptimizer``
(``optimum/quanto/tensor/optimizers/max_optimizer.py``) takes each group's min and max, ``scale = (rmax - rmin) /
(qmax - qmin)`` = ``/ 15`` for qint4 and ``shift = -rmin``, in the tensor's own dtype;
``group`` (``tensor/grouped.py``) with axis 0 makes the groups ``base.reshape(-1, group_size)``: consecutive
elements of the contiguous (B, Hk, T, d) tensor (one token's channels where d is a multiple of the group; several
tokens of a head where d is smaller); ``quantize_affine`` (``library/quantize.py``) stores ``clamp(round((base +
shift) / scale), 0, 15)`` as uint8; ``QBitsDequantizer`` (``tensor/qbits.py``) reads ``scale * data - shift``, each
operation in the model's dtype. The cache keeps the most recent tokens (up to ``residual_length``: those written
since its last flush) in the model's dtype and quantises the rest as one tensor; its prefill attends to K and V
unquantised, and the prompt is quantised whole at that first write. Emulated here: the quantiser on each call's K and
V whole (the last ``residual`` tokens of the call kept); not the cache's timing on generate() (which tokens a step
reads quantised). Not emulated: int8 (quanto's 8-bit types
take no groups, and transformers' quanto layer accepts nbits 2 or 4 only; its HQQ backend's 8 bits run HQQ's
iterative half-quadratic optimiser by default, mobiusml/hqq@e0b1d00e095653359da9de1d7dbb35a994aa6b96
``hqq/core/quantize.py`` ``Quantizer.quantize(optimize=True)``, in float16 on CUDA and float32 elsewhere, stopping
early on the whole tensor's mean error), axis -1, and the drift of tokens quantised again at each flush.

**Saturated** entries are those a round-to-nearest cast without saturation would take out of the format's range:
``|x / scale|`` beyond the format's max plus half its last unit (448 + 16 = 464 for e4m3, the tie rounding to
448; 57,344 + 4,096 = 61,440 for e5m2, the tie rounding to inf: from ``torch.finfo``); the saturating cast clips
them to the max, a non-saturating one makes them NaN (e4m3fn) or inf (e5m2). **Flushed** entries are nonzero
before the cache and zero after it (below half the format's smallest subnormal, at that scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.numerics.methods.fp8_attention import fa3_tile
from attncheck.numerics.paths import fa2, fa3

# The cache formats and the torch dtypes that hold them (e4m3 is the 'fn' variant engines store: no inf).
FORMATS: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Integer formats quantised per group (transformers' quanto cache): their bits; groups of GROUP values by default
INT_FORMATS: dict[str, int] = {"int4": 4}
GROUP = 64  # transformers' QuantizedLayer q_group_size
RESIDUAL = 128  # transformers' QuantizedLayer residual_length: the most tokens it holds in the model's dtype
SCALINGS = ("unit", "tensor", "head", "dynamic")
# vLLM's calc_kv_scales divisors (vllm/envs.py K_SCALE_CONSTANT, V_SCALE_CONSTANT): the dynamic scale of the first
# call is its amax over these, leaving headroom for later calls.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
Q_SCALE_CONSTANT = 200.0  # the same for Q, where FlashAttention-3's FP8 path quantises it


def format_max(fmt: str) -> float:
    """The format's largest finite value (torch.finfo): 448 (e4m3), 57,344 (e5m2); an integer format's largest
    stored level (15 for int4: its values are ``scale * level - shift`` per group)."""
    if fmt in INT_FORMATS:
        return float(2 ** INT_FORMATS[fmt] - 1)
    return float(torch.finfo(FORMATS[fmt]).max)


def overflow_boundary(fmt: str) -> tuple[float, bool]:
    """Where a round-to-nearest-even cast without saturation leaves the format's range: the max plus half the unit
    in its last place (finfo: eps times the max's power of two), and whether the tie itself leaves it (the max's
    last mantissa bit odd: e5m2's 57,344 = 1.11b x 2^15, the tie 61,440 goes to inf; e4m3's 448 = 1.110b x 2^8 is
    even, the tie 464 stays at 448)."""
    fmax = format_max(fmt)
    ulp = 2.0 ** math.floor(math.log2(fmax)) * float(torch.finfo(FORMATS[fmt]).eps)
    return fmax + ulp / 2, round(fmax / ulp) % 2 == 1


def _fp32(x: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32)


@dataclass
class Quantised:
    """K or V through the cache: the values the kernel reads, and per kv head the entries counted."""

    values: torch.Tensor | None  # dequantised, in the model's dtype; same shape as the input
    saturated: torch.Tensor  # (Hk,) int64: |x/scale| beyond the format's range, clipped to its max
    flushed: torch.Tensor  # (Hk,) int64: nonzero before, zero after
    entries: int  # per kv head
    group_scale: torch.Tensor | None = None  # (Hk,) an integer cache's largest group scale over the head's groups

    def head(self, h: int) -> "Quantised":
        """kv head ``h``'s part (values (B, 1, T, d))."""
        values = None if self.values is None else self.values[:, h : h + 1]
        gs = None if self.group_scale is None else self.group_scale[h : h + 1]
        return Quantised(values, self.saturated[h : h + 1], self.flushed[h : h + 1], self.entries, gs)


def quantise(x: torch.Tensor, fmt: str, scale: torch.Tensor | float, dt: torch.dtype) -> Quantised:
    """x (B, Hk, T, d) as the model holds it (rounded to ``dt``) written to an FP8 cache with ``scale`` (a number,
    or (Hk,) per kv head; fp32) and read back: ``dt(fp32(fp8_satfinite(fp32(x) / scale)) * scale)``."""
    fp8 = FORMATS[fmt]
    fmax = format_max(fmt)
    s = _fp32(scale).reshape(-1, 1, 1) if _fp32(scale).dim() else _fp32(scale)  # (Hk, 1, 1) or ()
    x32 = x.to(dt).float()  # (B, Hk, T, d)
    y = x32 / s  # fp32 division, as scaled_vec_conversion
    edge, tie_out = overflow_boundary(fmt)
    over = (y.abs() >= edge) if tie_out else (y.abs() > edge)  # NaN compares False: not counted
    stored = y.clamp(-fmax, fmax).to(fp8)  # __NV_SATFINITE: beyond the max, the max; then round to nearest
    values = (stored.float() * s).to(dt)  # the read: fp32 product, rounded once to the model's dtype
    flushed = (x32 != 0) & (values == 0)
    axes = [a for a in range(x.dim()) if a != 1]
    entries = x.numel() // max(1, x.shape[1])
    return Quantised(values, over.sum(dim=axes), flushed.sum(dim=axes), entries)


def quantise_groups(x: torch.Tensor, fmt: str, dt: torch.dtype, group: int = GROUP, residual: int = 0) -> Quantised:
    """x (B, Hk, T, d) written to transformers' quanto cache and read back (see the module's docstring): the tokens
    before the last ``residual`` quantised as one tensor in groups of ``group`` consecutive values (axis 0), each
    with its min-max scale and shift in ``dt``; the last ``residual`` tokens kept in ``dt``. quanto refuses a
    tensor whose size per batch row is not a multiple of the group: so does this (ValueError)."""
    bits = INT_FORMATS[fmt]
    x = x.to(dt)
    kept = max(0, x.shape[2] - residual)
    old = x[:, :, :kept].contiguous()
    b, hk = x.shape[:2]
    if old.numel() and (old.numel() // max(1, b)) % group:
        raise ValueError(f"{old.numel() // max(1, b)} values per batch row are not groups of {group}")
    g = old.reshape(-1, group)  # quanto's group(base, axis=0, group_size)
    rmin, rmax = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    scale = (rmax - rmin) / (2**bits - 1)  # MaxOptimizer: (rmax - rmin) / (qmax - qmin), in dt
    shift = -rmin
    level = torch.round((g + shift) / scale)  # quantize_affine, each operation rounded to dt
    # a constant group has scale 0 and level 0/0; quanto casts that NaN to uint8, which torch makes 0: its value
    # reads back as -shift, the group's value
    level = torch.where(scale == 0, torch.zeros_like(level), level).clamp(0, 2**bits - 1).to(torch.uint8)
    read = (scale * level - shift).reshape(old.shape)  # QBitsDequantizer: scale * data, then - shift, in dt
    values = torch.cat([read, x[:, :, kept:]], dim=2)
    flushed = (x != 0) & (values == 0)
    axes = [a for a in range(x.dim()) if a != 1]
    per_value = scale.expand(-1, group).reshape(old.shape).float()  # each value's group scale
    group_scale = per_value.transpose(0, 1).reshape(hk, -1).amax(dim=1) if old.numel() else torch.zeros(hk)
    zeros = torch.zeros(hk, dtype=torch.int64)
    return Quantised(values, zeros, flushed.sum(dim=axes), x.numel() // max(1, hk), group_scale)


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """(Hk,) float64: the largest finite |x| of each kv head of x (B, Hk, T, d); 0 where none."""
    a = x.double().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.transpose(0, 1).reshape(x.shape[1], -1).amax(dim=1) if x.numel() else torch.zeros(x.shape[1])


def scale_from(amax: torch.Tensor | float, divisor: float) -> torch.Tensor:
    """amax / divisor in fp32, as the engines store a scale; 1.0 where amax is 0 (nothing to scale)."""
    a = torch.as_tensor(amax, dtype=torch.float64)
    return torch.where(a > 0, a / divisor, torch.ones_like(a)).float()


@dataclass
class Channel:
    """Where a kv head's amax sits: its channel, how far above the head's median channel (max |x| per channel),
    and the token."""

    channel: int
    ratio: float
    token: int
    amax: float


def amax_channel(x: torch.Tensor, head: int) -> Channel:
    """The channel holding kv head ``head``'s amax in x (B, Hk, T, d), its max over the median channel's, and the
    token (position in T) where it sits."""
    a = x[:, head].double().abs()  # (B, T, d)
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    per_channel = a.reshape(-1, a.shape[-1]).amax(dim=0)  # (d,)
    channel = int(per_channel.argmax())
    median = float(per_channel.median())
    top = float(per_channel[channel])
    token = int(a[..., channel].amax(dim=0).argmax()) if a.shape[0] else 0
    return Channel(channel, top / median if median > 0 else math.inf, token, top)


def expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hk, T, d) -> (B, Hq, T, d): each kv head repeated for the query heads that read it (GQA)."""
    return t.repeat_interleave(hq // t.shape[1], dim=1) if t.shape[1] != hq else t


def repeated_heads(k: torch.Tensor, v: torch.Tensor, hk: int) -> bool:
    """Whether k and v (B, H, T, ...) are ``hk`` kv heads each repeated H / hk times, exactly (transformers'
    ``repeat_kv`` before a kernel without GQA: SDPA with a mask); NaN anywhere makes it False."""
    h = k.shape[1]
    if hk <= 0 or h % hk or v.shape[1] != h:
        return False
    g = h // hk
    return all(torch.equal(t, t[:, ::g].repeat_interleave(g, dim=1)) for t in (k, v))


def fewest_heads(k: torch.Tensor, v: torch.Tensor) -> int:
    """The fewest kv heads k and v (B, H, T, ...) are an exact repeat of (``repeated_heads``); H where none."""
    h = k.shape[1]
    return next((n for n in range(1, h) if repeated_heads(k, v, n)), h)


def mask_bias(masked: torch.Tensor | None, mask_float: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """(B, Hq, Tq, Tk) float64: the additive mask in the units of the scaled scores, -inf where masked."""
    bias = torch.zeros(shape, dtype=torch.float64)
    if mask_float is not None:
        bias = bias + mask_float.double()
    if masked is not None:
        bias = bias.masked_fill(masked.expand(shape), float("-inf"))
    return bias


def kernel_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, dt: torch.dtype
) -> torch.Tensor:
    """O (B, Hq, Tq, dv) float64 of FlashAttention-2's forward in ``dt`` on q (B, Hq, Tq, d), k and v
    (B, Hk, Tk, ...; the cache as the kernel reads it), ``bias`` (B, Hq, Tq, Tk)."""
    b, hq, tq, d = q.shape
    kx, vx = expand_kv(k, hq), expand_kv(v, hq)
    n, tk = b * hq, kx.shape[2]
    rows = fa2.kernel_rows(
        q.reshape(n, tq, d),
        kx.reshape(n, tk, d),
        vx.reshape(n, tk, vx.shape[-1]),
        scale=scale,
        dt=dt,
        block_n=fa2.tile_n(d, None, False),
        bias=bias.reshape(n * tq, tk).float(),
    )
    return rows.out.double().reshape(b, hq, tq, -1)


def fa3_fp8_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    fmt: str,
    scales: tuple[torch.Tensor | float, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """O (B, Hq, Tq, dv) float64 of vLLM's FlashAttention-3 path on an FP8 cache (module docstring): q (B, Hq, Tq,
    d) quantised with Q's scale (fp32 reciprocal, then the product), k and v (B, Hk, Tk, ...) as the cache stores
    them (fp32 division by their scales, per kv head), FP8 products with the three scales as descales."""
    fp8, fmax = FORMATS[fmt], format_max(fmt)
    qs, ks, vs = (_fp32(x).reshape(-1) for x in scales)
    b, hq, tq, d = q.shape
    hk = k.shape[1]
    q8 = (q.float() * (1.0 / qs).reshape(-1, 1, 1)).clamp(-fmax, fmax).to(fp8).float()  # one Q scale: (1,)

    def stored(x, s):  # the cache write, without the read's product: what the FP8 kernel reads
        return (x.float() / s.reshape(-1, 1, 1)).clamp(-fmax, fmax).to(fp8).float()

    k8, v8 = expand_kv(stored(k, ks), hq), expand_kv(stored(v, vs), hq)
    per_row = ks.expand(hk).repeat_interleave(hq // hk).repeat(b)  # (B * Hq,): each row head's kv head's descale
    n, tk = b * hq, k.shape[2]
    rows = fa3.kernel_rows(
        q8.reshape(n, tq, d),
        k8.reshape(n, tk, d),
        v8.reshape(n, tk, v8.shape[-1]),
        scale=scale,
        dt=fp8,
        block_n=fa3_tile(d)[1],
        bias=bias.reshape(n * tq, tk).float(),
        q_descale=qs.expand(n),
        k_descale=per_row,
        v_descale=vs.expand(hk).repeat_interleave(hq // hk).repeat(b),
    )
    return rows.out.double().reshape(b, hq, tq, -1)


def reference_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float):
    """O (B, Hq, Tq, dv) in float64 from q, k and v as given: softmax(q k^T scale + bias) v; 0 for a row with no
    key."""
    hq = q.shape[1]
    s = torch.matmul(q.double(), expand_kv(k, hq).double().transpose(-1, -2)) * scale + bias
    p = torch.softmax(s, dim=-1)
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)
    return torch.matmul(p, expand_kv(v, hq).double())


@dataclass
class OutputError:
    """O against a reference, per kv head (over the query heads reading it)."""

    rel_l2: torch.Tensor  # (Hk,) ||O - R|| / ||R||
    cosine: torch.Tensor  # (Hk,) the least cosine similarity of a row (1 where both rows are 0)
    max_abs: torch.Tensor  # (Hk,)


def output_error(out: torch.Tensor, ref: torch.Tensor, hk: int) -> OutputError:
    """Errors of ``out`` against ``ref`` (B, Hq, Tq, dv) per kv head of ``hk`` (non-finite rows: cosine 0)."""
    b, hq = out.shape[:2]
    o = out.transpose(0, 1).reshape(hk, -1, out.shape[-1])  # (Hk, rows, dv): query heads of a group together
    r = ref.transpose(0, 1).reshape(hk, -1, ref.shape[-1])
    diff = o - r
    num = diff.pow(2).sum(dim=(1, 2)).sqrt()
    den = r.pow(2).sum(dim=(1, 2)).sqrt()
    rel = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))
    no, nr = o.norm(dim=-1), r.norm(dim=-1)  # (Hk, rows)
    cos = (o * r).sum(dim=-1) / (no * nr).clamp_min(1e-300)
    cos = torch.where((no == 0) & (nr == 0), 1.0, torch.where((no == 0) | (nr == 0), 0.0, cos))
    cos = torch.where(torch.isfinite(cos), cos, 0.0)
    max_abs = torch.where(torch.isfinite(diff), diff.abs(), math.inf).amax(dim=(1, 2))
    return OutputError(rel, cos.amin(dim=1), max_abs)


@dataclass
class CacheCall:
    """One call through one cache (format and scales): K's and V's counts, O's errors against the model's
    kernel without the cache and against float64."""

    k: Quantised
    v: Quantised
    vs_model: OutputError
    vs_float64: OutputError
    q_saturated: int = 0  # FlashAttention-3's FP8 path: Q's entries beyond the format's range at its scale


def cache_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    dt: torch.dtype,
    fmt: str,
    scales: tuple[torch.Tensor, torch.Tensor],
    model_out: torch.Tensor,
    reference: torch.Tensor,
    read: tuple[Quantised, Quantised] | None = None,
    q_scale: torch.Tensor | float | None = None,
) -> CacheCall:
    """The call with K and V through the cache at ``scales`` (k's and v's, per kv head), attention by
    FlashAttention-2 in ``dt`` on the dequantised cache; ``model_out``: the same kernel on K and V as given,
    ``reference``: float64 (``kernel_output``, ``reference_output``); ``read``: K and V already through the cache
    (an integer cache, whose groups are the whole call's: ``quantise_groups``), in place of ``scales``; ``q_scale``
    given: attention by FlashAttention-3's FP8 path instead (``fa3_fp8_output``), Q quantised at that scale."""
    kq, vq = read if read is not None else (quantise(k, fmt, scales[0], dt), quantise(v, fmt, scales[1], dt))
    if q_scale is None:
        out = kernel_output(q, kq.values, vq.values, bias, scale, dt)
    else:
        out = fa3_fp8_output(q.to(dt), k.to(dt), v.to(dt), bias, scale, fmt, (q_scale, scales[0], scales[1]))
    hk = k.shape[1]
    kq.values = vq.values = None  # the counts are what is kept
    q_sat = 0
    if q_scale is not None:  # counted as K's and V's are: beyond the max plus half its last unit
        edge, tie_out = overflow_boundary(fmt)
        y = (q.to(dt).float() * (1.0 / _fp32(q_scale).reshape(-1))[0]).abs()
        q_sat = int(((y >= edge) if tie_out else (y > edge)).sum())
    return CacheCall(kq, vq, output_error(out, model_out, hk), output_error(out, reference, hk), q_sat)
