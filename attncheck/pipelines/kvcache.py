"""The KV-cache what-if over a capture's calls (or Q, K and V given as files): each cache asked (format, scaling)
computed per call and gathered per layer (a module's calls) and kv head, then judged.

Scales need amax over calls: ``tensor`` and ``head`` the whole capture's per layer (calibrated scales), ``dynamic``
the layer's first call (vLLM's calculate_kv_scales). So where ``tensor`` or ``head`` is asked, the amax per layer and
kv head is gathered first: by ``AmaxPass`` while ``attncheck run`` diagnoses each call (which loads it anyway), or
by a pass of its own; then each call is loaded once more and every cache asked is computed from it (``unit`` and
``dynamic`` alone need no first pass: a layer's first call comes before its others).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from attncheck.errors import AttncheckError
from attncheck.findings.kvcache import judge_kv
from attncheck.numerics import kvcache as kc
from attncheck.numerics.cells.calls import call_inputs
from attncheck.numerics.cells.plan import cell_dtype_name
from attncheck.numerics.inputs.index_mask import IndexMask
from attncheck.numerics.precision import dtype_from_name, dtype_label
from attncheck.results.kvcache import KVChannel, KVHead, KVReport, KVWhatIf

# Calls whose q, k, v and mask are recorded (SDPA, flash_attn, q/k files) or traced (softmax: eager attention)
KV_KINDS = ("sdpa", "flash_attn", "qk", "softmax")


@dataclass
class KVCall:
    """One call the cache replays: its layer, index, inputs (AttentionInputs with v) and the dtype it ran in."""

    module: str
    index: int
    load: Callable[[], tuple[object, torch.dtype]]


@dataclass
class _Acc:
    """One (layer, kv head) under one cache, over its calls."""

    calls: int = 0
    k_sat: int = 0
    v_sat: int = 0
    k_flush: int = 0
    v_flush: int = 0
    k_entries: int = 0
    v_entries: int = 0
    rel: float = 0.0
    cos: float = 1.0
    mabs: float = 0.0
    rel64: float = 0.0
    cos64: float = 1.0
    mabs64: float = 0.0
    base_cos64: float = 1.0
    q_sat: int = 0  # FlashAttention-3's FP8 path: Q's entries clipped, over the calls
    q_amax: float = 0.0  # the largest |q| of the query heads reading the kv head, over the calls
    k_group_scale: float = 0.0  # an integer cache's largest group scale over the calls
    v_group_scale: float = 0.0


@dataclass
class _Layer:
    """A layer's amax per kv head over the calls seen, its first call's amax, and where each head's amax sits."""

    hq: int
    k_amax: torch.Tensor
    v_amax: torch.Tensor
    k_first: float
    v_first: float
    channels: dict[tuple[str, int], KVChannel] = field(default_factory=dict)
    q_first: float = 0.0  # the first call's Q amax: vLLM's dynamic Q scale for FlashAttention-3's FP8 path


def asks_of(what_if: Iterable[str]) -> list[tuple[str, str]]:
    """'kv:fp8_e4m3:unit' -> [('fp8_e4m3', 'unit')]; 'kv:fp8_e4m3' -> every scaling, side by side; 'kv:int4:g64'
    (validated: params.kv_token) -> [('int4', 'g64')], its groups in place of a scaling."""
    out: list[tuple[str, str]] = []
    for token in what_if:
        if not token.startswith("kv:"):
            continue
        parts = token.split(":")
        if parts[1] in kc.INT_FORMATS:
            ask = (parts[1], ":".join(parts[2:]) or f"g{kc.GROUP}")
            out += [] if ask in out else [ask]
            continue
        fa3 = parts[-1] == "fa3"  # FlashAttention-3's FP8 path reads the cache: 'head:fa3'
        for scaling in parts[2 : len(parts) - fa3] or kc.SCALINGS:
            scaling += ":fa3" if fa3 else ""
            if (parts[1], scaling) not in out:
                out.append((parts[1], scaling))
    return out


def kv_heads(layers: dict[str, "_Layer"], module: str, index: int, inp):
    """The call with K and V per kv head of its layer: K and V stored repeated over the query heads (transformers'
    ``repeat_kv`` before SDPA with a mask: a padded batch, a generate() prefill) mapped back to the kv heads they
    repeat, where the repeat is exact; the layer's kv heads are its first call's (the fewest it repeats exactly
    where K holds as many heads as Q). A call that holds another count, not as an exact repeat: refused."""
    hk, hq = inp.k.shape[1], inp.q.shape[1]
    layer = layers.get(module)
    target = layer.k_amax.shape[0] if layer is not None else (kc.fewest_heads(inp.k, inp.v) if hk == hq else hk)
    if target == hk:
        return inp
    if hq % target == 0 and kc.repeated_heads(inp.k, inp.v, target):
        g = hk // target
        return dataclasses.replace(inp, k=inp.k[:, ::g], v=inp.v[:, ::g], cache={})
    raise AttncheckError(
        f"{module or 'the call'} (call {index}): K holds {hk} heads where the layer's first call holds {target} kv "
        "heads, and not as each kv head repeated over its query heads: the KV-cache what-if cannot replay the layer "
        "per kv head"
    )


def _observe(layers: dict[str, _Layer], module: str, index: int, inp) -> _Layer:
    """Fold a call's K and V amax into its layer's (recording the channel of each head's new amax)."""
    k, v = inp.k, inp.v
    ka, va = kc.head_amax(k), kc.head_amax(v)
    layer = layers.get(module)
    if layer is None:
        layer = layers[module] = _Layer(
            inp.q.shape[1], torch.zeros_like(ka), torch.zeros_like(va), float(ka.max()), float(va.max())
        )
        layer.q_first = float(kc.head_amax(inp.q).max())
    for name, t, new, old in (("k", k, ka, layer.k_amax), ("v", v, va, layer.v_amax)):
        for h in torch.nonzero(new > old).flatten().tolist():
            ch = kc.amax_channel(t, h)
            layer.channels[(name, h)] = KVChannel(name, ch.channel, ch.ratio, ch.token, index)
    layer.k_amax, layer.v_amax = torch.maximum(layer.k_amax, ka), torch.maximum(layer.v_amax, va)
    return layer


def _scales(layer: _Layer, fmt: str, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K's and V's scale per kv head (fp32) for a scaling, from the layer's amax (the capture's, or its first
    call's for ``dynamic``)."""
    fmax, hk = kc.format_max(fmt), layer.k_amax.shape[0]
    scaling = scaling.split(":")[0]  # 'head:fa3': the consumer does not change K's and V's scales
    if scaling == "unit" or fmt in kc.INT_FORMATS:  # an integer cache's scales are its groups' (quantise_groups)
        one = torch.ones(hk, dtype=torch.float32)
        return one, one
    if scaling == "tensor":
        k, v = kc.scale_from(layer.k_amax.max(), fmax), kc.scale_from(layer.v_amax.max(), fmax)
    elif scaling == "head":
        return kc.scale_from(layer.k_amax, fmax), kc.scale_from(layer.v_amax, fmax)
    else:  # dynamic: vLLM's calc_kv_scales on the layer's first call
        k = kc.scale_from(layer.k_first, kc.K_SCALE_CONSTANT)
        v = kc.scale_from(layer.v_first, kc.V_SCALE_CONSTANT)
    return k.expand(hk), v.expand(hk)


def needs_amax(asks: list[tuple[str, str]]) -> bool:
    """Whether a cache asked takes its scales from the capture's amax (calibrated: 'tensor', 'head')."""
    return any(s in ("tensor", "head") for _, s in asks)


class AmaxPass:
    """The capture's K and V amax per layer and kv head, gathered from each call's tensors as another pass loads
    them (``observe``); a call whose inputs cannot be read is left to the cache's own pass, which says why."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.layers: dict[str, _Layer] = {}
        self.max_bytes = max_bytes

    def observe(self, info, tensors: dict) -> None:
        if info.kind not in KV_KINDS or tensors.get("v") is None:
            return
        try:
            inp = call_inputs(info, tensors, self.max_bytes)
        except AttncheckError:
            return
        if inp is not None and inp.v is not None:
            module = info.module or info.name
            try:
                inp = kv_heads(self.layers, module, info.index, inp)
            except AttncheckError:
                return
            _observe(self.layers, module, info.index, inp)


def run_kv(
    asks: list[tuple[str, str]],
    calls: list[KVCall],
    skipped: list[tuple[str, str]] = (),
    amax: AmaxPass | None = None,
) -> KVReport:
    """Every cache asked over ``calls`` (in call order), per layer and kv head, judged; ``amax``: the capture's
    amax already gathered (else, where a calibrated scaling is asked, a first pass over ``calls`` gathers it)."""
    calibrated = needs_amax(asks)
    layers: dict[str, _Layer] = amax.layers if amax is not None and calibrated else {}
    if calibrated and amax is None:  # the first pass: the capture's amax per layer and kv head
        for call in calls:
            _observe(layers, call.module, call.index, kv_heads(layers, call.module, call.index, call.load()[0]))
    accs: dict[tuple[int, str, int], _Acc] = {}
    frozen: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # scales fixed at a layer's first call
    skipped = list(skipped)
    for call in calls:
        inp, dt = call.load()
        inp = kv_heads(layers, call.module, call.index, inp)
        known = calibrated and call.module in layers  # else (a call the amax pass could not read): seen now
        layer = layers[call.module] if known else _observe(layers, call.module, call.index, inp)
        scales = [frozen.setdefault((i, call.module), _scales(layer, f, s)) for i, (f, s) in enumerate(asks)]
        reads = _integer_reads(asks, inp, dt, call, skipped)
        for h in range(inp.k.shape[1]):  # one kv head and its query heads at a time: memory bounded by a group's
            q, k, v, bias = _group(inp, h)
            model_out = kc.kernel_output(q, k, v, bias, inp.scale, dt)
            reference = kc.reference_output(q, k, v, bias, inp.scale)
            base = kc.output_error(model_out, reference, 1)
            q_amax = float(kc.head_amax(q).max())  # the query heads reading kv head h
            for i, (fmt, _) in enumerate(asks):
                if fmt in kc.INT_FORMATS and i not in reads:
                    continue  # the call's size is not whole groups: said in skipped
                pair = (scales[i][0][h : h + 1], scales[i][1][h : h + 1])
                read = (reads[i][0].head(h), reads[i][1].head(h)) if i in reads else None
                qs = _q_scale(layer, asks[i][1])
                res = kc.cache_call(q, k, v, bias, inp.scale, dt, fmt, pair, model_out, reference, read, qs)
                acc = accs.setdefault((i, call.module, h), _Acc())
                _fold(acc, res, base, 0)
                acc.q_amax = max(acc.q_amax, q_amax)
    report = KVReport(skipped=skipped)
    for i, (fmt, scaling) in enumerate(asks):
        what = KVWhatIf(fmt, scaling, kc.format_max(fmt))
        what.saturation_edge = math.nan if fmt in kc.INT_FORMATS else kc.overflow_boundary(fmt)[0]
        for module, layer in layers.items():
            for h in range(layer.k_amax.shape[0]):
                acc = accs.get((i, module, h))
                if acc is not None:
                    integer = fmt in kc.INT_FORMATS
                    head = _head(module, h, layer, acc, frozen[(i, module)], what.format_max, integer)
                    qs = _q_scale(layer, scaling)
                    if qs is not None:  # FlashAttention-3's FP8 path: Q's amax, scale and the scale that holds it
                        head.q_amax, head.q_scale = acc.q_amax, float(qs[0])
                        head.hold_q = float(kc.scale_from(acc.q_amax, what.format_max))
                    what.heads.append(head)
        report.caches.append(what)
    judge_kv(report)
    return report


def _q_scale(layer: _Layer, scaling: str) -> torch.Tensor | None:
    """Q's scale where FlashAttention-3's FP8 path reads the cache ('head:fa3'): vLLM's ``_q_scale``, 1.0 (a
    checkpoint's k_scale/v_scale carry none) or, under 'dynamic', the layer's first call's amax / 200; None for the
    16-bit path."""
    if not scaling.endswith(":fa3"):
        return None
    if scaling.startswith("dynamic"):
        return kc.scale_from(layer.q_first, kc.Q_SCALE_CONSTANT).reshape(1)
    return torch.ones(1)


def _integer_reads(asks, inp, dt, call: KVCall, skipped: list) -> dict[int, tuple[kc.Quantised, kc.Quantised]]:
    """K and V of the whole call through each integer cache asked (its groups may span kv heads), by the ask's
    index; a call quanto would refuse (not whole groups) is left out of that cache, with why."""
    reads = {}
    for i, (fmt, spec) in enumerate(asks):
        if fmt not in kc.INT_FORMATS:
            continue
        opts = {p[0]: int(p[1:]) for p in spec.split(":")}
        try:
            reads[i] = tuple(kc.quantise_groups(t, fmt, dt, opts["g"], opts.get("r", 0)) for t in (inp.k, inp.v))
        except ValueError as e:
            skipped.append(
                (f"{call.module or 'the call'} (call {call.index})", f"kv:{fmt}:{spec}: {e} (quanto refuses it)")
            )
    return reads


def _group(inp, h: int):
    """kv head ``h``'s slice of a call: q of the query heads reading it (B, g, Tq, d), its k and v (B, 1, Tk, ...),
    and their mask as an additive bias (B, g, Tq, Tk)."""
    hq, hk = inp.q.shape[1], inp.k.shape[1]
    g = hq // hk
    heads = slice(h * g, (h + 1) * g)

    def part(m):  # a mask broadcast over heads keeps its single head; causal and padding alone: their plane
        if isinstance(m, IndexMask):
            return m.plane()  # (B | 1, 1, Tq | 1, Tk)
        return None if m is None else (m if m.dim() < 4 or m.shape[1] == 1 else m[:, heads])

    q = inp.q[:, heads]
    shape = (q.shape[0], g, q.shape[2], inp.k.shape[2])
    return q, inp.k[:, h : h + 1], inp.v[:, h : h + 1], kc.mask_bias(part(inp.masked), part(inp.mask_float), shape)


def _fold(acc: _Acc, res: kc.CacheCall, base: kc.OutputError, h: int) -> None:
    acc.calls += 1
    acc.k_sat += int(res.k.saturated[h])
    acc.v_sat += int(res.v.saturated[h])
    acc.k_flush += int(res.k.flushed[h])
    acc.v_flush += int(res.v.flushed[h])
    acc.k_entries += res.k.entries
    acc.v_entries += res.v.entries
    acc.rel = max(acc.rel, float(res.vs_model.rel_l2[h]))
    acc.cos = min(acc.cos, float(res.vs_model.cosine[h]))
    acc.mabs = max(acc.mabs, float(res.vs_model.max_abs[h]))
    acc.rel64 = max(acc.rel64, float(res.vs_float64.rel_l2[h]))
    acc.cos64 = min(acc.cos64, float(res.vs_float64.cosine[h]))
    acc.mabs64 = max(acc.mabs64, float(res.vs_float64.max_abs[h]))
    acc.base_cos64 = min(acc.base_cos64, float(base.cosine[h]))
    acc.q_sat += res.q_saturated
    if res.k.group_scale is not None:
        acc.k_group_scale = max(acc.k_group_scale, float(res.k.group_scale[h]))
        acc.v_group_scale = max(acc.v_group_scale, float(res.v.group_scale[h]))


def _head(module: str, h: int, layer: _Layer, acc: _Acc, scales, fmax: float, integer: bool) -> KVHead:
    hk = layer.k_amax.shape[0]
    group = layer.hq // hk
    ka, va = float(layer.k_amax[h]), float(layer.v_amax[h])
    if integer:  # scales per group: the largest; nothing saturates, so no scale is needed to hold the head
        scales = (torch.tensor([acc.k_group_scale] * hk), torch.tensor([acc.v_group_scale] * hk))
    return KVHead(
        module=module,
        kv_head=h,
        query_heads=list(range(h * group, (h + 1) * group)),
        calls=acc.calls,
        k_amax=ka,
        v_amax=va,
        k_scale=float(scales[0][h]),
        v_scale=float(scales[1][h]),
        k_saturated=acc.k_sat,
        v_saturated=acc.v_sat,
        k_flushed=acc.k_flush,
        v_flushed=acc.v_flush,
        k_entries=acc.k_entries,
        v_entries=acc.v_entries,
        rel_l2=acc.rel,
        cosine=acc.cos,
        max_abs=acc.mabs,
        rel_l2_f64=acc.rel64,
        cosine_f64=acc.cos64,
        max_abs_f64=acc.mabs64,
        base_cosine_f64=acc.base_cos64,
        hold_k_tensor=math.nan if integer else float(kc.scale_from(layer.k_amax.max(), fmax)),
        hold_v_tensor=math.nan if integer else float(kc.scale_from(layer.v_amax.max(), fmax)),
        hold_k_head=math.nan if integer else float(kc.scale_from(ka, fmax)),
        hold_v_head=math.nan if integer else float(kc.scale_from(va, fmax)),
        channels=[c for key, c in sorted(layer.channels.items()) if key[1] == h],
        q_saturated=acc.q_sat,
    )


def capture_calls(items, max_bytes: int | None) -> tuple[list[KVCall], list[tuple[str, str]]]:
    """A capture's calls the cache can replay (q, k, v and the mask recorded), and the others with why."""
    calls, skipped = [], []
    for item in items:
        info = item.info
        name = info.module or info.name
        if info.kind not in KV_KINDS or item.problem:
            why = item.problem or f"a {info.kind} call: the KV-cache what-if replays SDPA, flash_attn and eager calls"
            skipped.append((name, why))
            continue

        def load(item=item, info=info):
            tensors = item.load()
            if tensors.get("v") is None:
                raise AttncheckError(f"{info.name} (call {info.index}): the KV-cache what-if needs v, not recorded")
            inp = call_inputs(info, tensors, max_bytes)
            if inp is None or inp.v is None:
                raise AttncheckError(
                    f"{info.name} (call {info.index}): the KV-cache what-if needs the q, k and v that made the "
                    "call's scores, not all traced"
                )
            label = cell_dtype_name(info.dtype) or cell_dtype_name(_label(tensors["q"].dtype)) or "fp32"
            return inp, dtype_from_name(label)

        calls.append(KVCall(name, info.index, load))
    return calls, skipped


def _label(dtype: torch.dtype) -> str:
    return dtype_label(dtype)
