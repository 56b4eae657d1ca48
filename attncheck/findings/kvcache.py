"""Serving: a quantised KV cache (``--what-if kv:FORMAT[:SCALING]``). K or V beyond the format's range at the
cache's scale, and attention from the cache far from the model's own. What-ifs: reported apart, never the model's
verdict unless ``--fail-on what-if:...`` asks."""

from __future__ import annotations

from attncheck.findings.base import _TORCH, Code, Example
from attncheck.format import plain
from attncheck.results import Finding
from attncheck.results.kvcache import KVHead, KVReport, KVWhatIf

# The worst row's cosine similarity of O through the cache against the model's own kernel below which a head is
# broken, and the relative L2 error above which it is. The format's rounding alone, at a scale that holds the head,
# reaches about 0.995 in e4m3 (3 mantissa bits) and 0.989 in e5m2 (2 bits) on a row that sees one key (its output
# is that key's V, read back), with relative L2 errors of 2-3% and 6%.
KV_COSINE_MIN = 0.98
KV_REL_L2_MAX = 0.10
# A share of K's or V's nonzero entries flushed to zero that names flushing as the cause (a scale too large)
KV_FLUSH_SHARE = 0.01
# The amax channel named as the cause where its max |x| is at least this many times the head's median channel's
KV_CHANNEL_RATIO = 8.0

_EXAMPLE = Example(
    _TORCH
    + """\
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 32, 64, generator=g).bfloat16() for _ in range(3))
v[:, 1] *= 2000  # V of head 1 far beyond e4m3's 448 at scale 1.0
for name, t in (("q", q), ("k", k), ("v", v)):
    torch.save(t, f"{name}.pt")
""",
    "attncheck run --q q.pt --k k.pt --v v.pt --causal --what-if kv:fp8_e4m3:unit --brief "
    "--fail-on kv_cache_saturation",
)

CODES: tuple[Code, ...] = (
    Code(
        "kv_cache_saturation",
        "warning",
        "serving",
        "K or V beyond the FP8 cache format's range at the cache's scale (a what-if)",
        "A serving engine writes K and V to an FP8 cache as fp8(x / scale). Without calibrated scales the scale "
        "is 1.0, and any |x| beyond the format's largest value (448 in e4m3, 57,344 in e5m2) is clipped to it by "
        "vLLM's saturating cast (or becomes NaN/inf under a non-saturating one). The finding names the layer, the "
        "kv head, K or V, its amax against the format's max at that scale, the entries clipped, the channel "
        "holding the amax where one channel stands far above the others, and the scale that would hold it.",
        "Any entry with |x / scale| beyond the format's max plus half its last unit (e4m3: 464, e5m2: 61,440); "
        f"a warning where the head's output breaks (cosine similarity below {KV_COSINE_MIN}, or relative L2 above "
        f"{KV_REL_L2_MAX}), else info. A channel is named where its max |x| is at least {KV_CHANNEL_RATIO:g} "
        "times the head's median channel's.",
        "load calibrated k_scale/v_scale (amax / 448 per layer; vLLM reads them from the checkpoint), or per-head "
        "scales (the amax of each kv head / 448), or dynamic scales (vLLM's --calculate-kv-scales); the finding "
        "gives the scale that holds this head",
        _EXAMPLE,
        severity_note="info where the head's output stays within the thresholds",
        also="info",
    ),
    Code(
        "kv_cache_error",
        "warning",
        "serving",
        "attention from the quantised KV cache far from the model's own (a what-if)",
        "The call's output computed from the dequantised cache (FlashAttention-2 in the model's dtype on K and V "
        "read back from FP8, as FlashInfer and vLLM's FlashAttention-2 path consume it, or from transformers' int4 "
        "quanto cache, min-max per group; with ':fa3', FlashAttention-3's FP8 path, Q in FP8 too) against the same "
        "kernel on K and V as the model held them. The finding "
        "names the layer and kv head, the worst row's cosine similarity, the relative L2 error, and the cause: "
        "saturation (see kv_cache_saturation; never in int4, whose groups span their own min and max), entries "
        "flushed to zero (a scale too large for small values), or the format's rounding (int4: 16 levels between "
        "a group's min and max).",
        f"The worst row's cosine similarity below {KV_COSINE_MIN}, or relative L2 error above {KV_REL_L2_MAX}; "
        f"flushing is named as the cause where at least {KV_FLUSH_SHARE:.0%} of K's or V's nonzero entries "
        "became zero.",
        "by cause, as the finding gives it: per-head scales (amax / format max per kv head) for saturation; smaller "
        "scales for flushing; a q_scale that holds Q for Q's saturation (':fa3'); e4m3 instead of e5m2 for e5m2's "
        "rounding (int4: smaller groups, kv:int4:g32); where no scale computed holds the head (an outlier channel "
        "the finding names), keep that layer's cache in bf16",
        Example(_EXAMPLE.python, _EXAMPLE.command.replace("kv_cache_saturation", "kv_cache_error")),
    ),
)

SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}
# An integer cache's fix: its error is rounding within groups, which no scale changes
INTEGER_FIX = (
    "smaller groups (kv:int4:g32; transformers' q_group_size), more recent tokens kept in the model's dtype "
    "(residual_length), or an FP8 cache with per-head scales; keep the layer's cache in bf16 where none holds it"
)

_LABEL = {"fp8_e4m3": "FP8 e4m3", "fp8_e5m2": "FP8 e5m2", "int4": "int4"}


def add(code: str, severity: str, message: str, fix: str) -> Finding:
    return Finding(code, severity, message, fix)


def _breaks(h: KVHead) -> bool:
    return h.cosine < KV_COSINE_MIN or h.rel_l2 > KV_REL_L2_MAX


def _where(h: KVHead) -> str:
    reads = ", ".join(map(str, h.query_heads))
    return f"{h.module or 'the call'} kv head {h.kv_head} (query heads {reads})"


def _channel(h: KVHead, tensor: str) -> str:
    for c in h.channels:
        if c.tensor == tensor and c.ratio >= KV_CHANNEL_RATIO:
            return (
                f"; the amax sits in channel {c.channel}, {plain(c.ratio)}x the head's median channel "
                f"(token {c.token} of call {c.call})"
            )
    return ""


def _outlier(h: KVHead, tensor: str | None = None):
    """The head's amax channel in K (or V) standing at least KV_CHANNEL_RATIO times its median channel, if any."""
    return next((c for c in h.channels if c.ratio >= KV_CHANNEL_RATIO and tensor in (None, c.tensor)), None)


def _outlier_text(c) -> str:
    return f"{c.tensor.upper()} channel {c.channel} is {plain(c.ratio)}x its head's median channel"


def _same_head(report: KVReport | None, what: KVWhatIf, h: KVHead) -> dict[str, KVHead]:
    """The head under every FP8 scaling the report computed with the same consumer (FA2 or ':fa3'), by scaling."""
    consumer = what.scaling.partition(":")[2]
    out = {}
    for c in report.caches if report is not None else [what]:
        if c.format.startswith("int") or c.scaling.partition(":")[2] != consumer:
            continue
        other = next((x for x in c.heads if (x.module, x.kv_head) == (h.module, h.kv_head)), None)
        if other is not None:
            out[c.scaling.partition(":")[0]] = other
    return out


def _no_scale_holds(report: KVReport | None, what: KVWhatIf, h: KVHead) -> str:
    """Where the head breaks under every FP8 scaling computed (per-head among them), the sentence that says so,
    with each scaling's worst cosine and the outlier channel where there is one; '' otherwise."""
    heads = _same_head(report, what, h)
    if "head" not in heads or len(heads) < 2 or not all(_breaks(x) for x in heads.values()):
        return ""
    cosines = ", ".join(f"{s} {x.cosine:.4f}" for s, x in heads.items())
    c = _outlier(h, "k") or _outlier(h)
    why = f": {_outlier_text(c)}" if c is not None else ""
    return f"no FP8 scale computed holds this head (worst cosine {cosines}){why}; keep this layer's cache in bf16"


def _saturation(what: KVWhatIf, h: KVHead, report: KVReport | None = None) -> list[Finding]:
    out = []
    for tensor, sat, entries, amax, scale, hold_head, hold_tensor in (
        ("K", h.k_saturated, h.k_entries, h.k_amax, h.k_scale, h.hold_k_head, h.hold_k_tensor),
        ("V", h.v_saturated, h.v_entries, h.v_amax, h.v_scale, h.hold_v_head, h.hold_v_tensor),
    ):
        if not sat:
            continue
        severity = "warning" if _breaks(h) else "info"
        fix = _hold_fix(report, what, h, tensor, hold_head, hold_tensor)
        message = (
            f"{what.name}: {_where(h)}: {tensor} saturates at scale {plain(scale)} (amax {plain(amax)} > "
            f"{plain(what.format_max * scale)}): {sat:,} of {entries:,} entries beyond {plain(what.saturation_edge)} "
            f"at that scale clipped to {plain(what.format_max)}; "
            f"worst cosine {h.cosine:.4f}, relative L2 {h.rel_l2:.3g}{_channel(h, tensor.lower())}"
        )
        out.append(add("kv_cache_saturation", severity, message, fix))
    return out


def _hold_fix(report, what: KVWhatIf, h: KVHead, tensor: str, hold_head: float, hold_tensor: float) -> str:
    """The scale that keeps the tensor from saturating, and whether the head scaling computed holds the head."""
    keeps = f"a {tensor.lower()}_scale of {plain(hold_head)} keeps {tensor} from saturating"
    keeps += f" (per tensor: {plain(hold_tensor)})"
    nothing = _no_scale_holds(report, what, h)
    if nothing:
        return f"{keeps}, but {nothing}"
    at_head = _same_head(report, what, h).get("head")
    if at_head is None or at_head is h:
        return keeps + f"; {_head_ask(what)} computes whether it holds the head"
    if _breaks(at_head):
        return f"{keeps}, but at head scale the worst cosine is still {at_head.cosine:.4f}"
    return f"{keeps} and holds this head (at head scale worst cosine {at_head.cosine:.4f})"


def _head_ask(what: KVWhatIf) -> str:
    consumer = what.scaling.partition(":")[2]
    return f"kv:{what.format}:head" + (f":{consumer}" if consumer else "")


def _error(what: KVWhatIf, h: KVHead, report: KVReport | None = None) -> Finding | None:
    if not _breaks(h):
        return None
    integer = what.format.startswith("int")  # min-max per group: nothing saturates; flushing and rounding do
    if h.k_saturated or h.v_saturated:
        which = " and ".join(t for t, n in (("K", h.k_saturated), ("V", h.v_saturated)) if n)
        cause = f"{which} saturate{'' if ' and ' in which else 's'} (kv_cache_saturation)"
    elif h.q_saturated:  # FlashAttention-3's FP8 path quantises Q at its own scale (1.0 unless dynamic)
        cause = (
            f"Q saturates in FP8 ({h.q_saturated:,} entries beyond the format's max at Q's scale "
            f"{plain(h.q_scale)}: amax {plain(h.q_amax)} > {plain(what.format_max * h.q_scale)})"
        )
    elif h.k_flushed >= KV_FLUSH_SHARE * h.k_entries or h.v_flushed >= KV_FLUSH_SHARE * h.v_entries:
        why = "a group's step, its (max - min) / 15, is coarse beside them" if integer else "the scale is too large"
        cause = f"{h.k_flushed:,} K and {h.v_flushed:,} V entries flushed to zero ({why})"
    elif integer:
        cause = (
            f"the format's rounding ({_LABEL.get(what.format, what.format)}: 16 levels between each group's min and "
            f"max, the largest step {plain(h.k_scale)} in K and {plain(h.v_scale)} in V)"
        )
    else:
        cause = f"the format's rounding ({_LABEL.get(what.format, what.format)})"
    c = None if integer else (_outlier(h, "k") or _outlier(h))
    if c is not None:  # the scale its range needs, or its clipping, costs the head: it is the cause under any scaling
        cause += f"; {_outlier_text(c)}"
    message = (
        f"{what.name}: {_where(h)}: attention from the cache has worst cosine {h.cosine:.4f}, relative L2 "
        f"{h.rel_l2:.3g}, max abs {plain(h.max_abs)} against the model's cell; cause: {cause}"
    )
    return add("kv_cache_error", "warning", message, INTEGER_FIX if integer else _error_fix(report, what, h))


def _error_fix(report, what: KVWhatIf, h: KVHead) -> str:
    """An FP8 cache's fix by its cause: where no scale computed holds the head, bf16 for its layer; saturation,
    per-head scales; flushing, smaller scales; e5m2's rounding, e4m3; else bf16 for the layer."""
    nothing = _no_scale_holds(report, what, h)
    if nothing:
        return nothing
    if h.k_saturated or h.v_saturated:
        return "per-head scales (amax / format max per kv head: kv_cache_saturation gives them)"
    if h.q_saturated:
        return (
            f"a q_scale of {plain(h.hold_q)} holds Q (its amax {plain(h.q_amax)} / {plain(what.format_max)}; vLLM's "
            "q_scale from the checkpoint, or --calculate-kv-scales)"
        )
    if h.k_flushed >= KV_FLUSH_SHARE * h.k_entries or h.v_flushed >= KV_FLUSH_SHARE * h.v_entries:
        return "smaller scales (the entries read back as zero are below the format's smallest at this scale)"
    if what.format == "fp8_e5m2":
        return "e4m3 instead of e5m2 (one more mantissa bit); keep this layer's cache in bf16 where none holds it"
    at_head = _same_head(report, what, h).get("head")
    if at_head is not None and not _breaks(at_head):
        return f"per-head scales hold this head (at head scale worst cosine {at_head.cosine:.4f})"
    if at_head is None:
        return (
            f"{_head_ask(what)} computes whether per-head scales hold this head; else keep this layer's cache in bf16"
        )
    return "keep this layer's cache in bf16 (the format's rounding at this scale breaks it)"


def _integer_summary(what: KVWhatIf) -> str:
    """An integer cache's line: its groups (min-max per group: nothing saturates by construction), the worst head
    and how many break."""
    opts = {p[0]: int(p[1:]) for p in what.scaling.split(":")}
    label = f"{_LABEL.get(what.format, what.format)} KV in groups of {opts['g']}"
    label += f", the last {opts['r']} tokens in the model's dtype" if opts.get("r") else ""
    worst = what.worst
    if worst is None:
        return f"{label}: no call replayed"
    broken = sum(_breaks(h) for h in what.heads)
    where = f"{worst.module or 'the call'} kv head {worst.kv_head}"
    line = f"{label}: worst cosine {worst.cosine:.4f} ({where})"
    return line + (f"; {broken} head{'s break' if broken > 1 else ' breaks'} (kv_cache_error)" if broken else "")


def _summary(what: KVWhatIf, report: KVReport) -> str:
    if what.format.startswith("int"):
        return _integer_summary(what)
    scaling, _, consumer = what.scaling.partition(":")
    label = f"{_LABEL.get(what.format, what.format)} KV at {scaling} scale"
    label += " via FA3's FP8 path" if consumer == "fa3" else ""
    worst = what.worst
    if worst is None:
        return f"{label}: no call replayed"
    counts = (("K", "k_saturated"), ("V", "v_saturated"), ("Q", "q_saturated"))
    sat = [(h, t) for h in what.heads for t, n in counts if getattr(h, n)]
    if not sat:
        where = f"{worst.module or 'the call'} kv head {worst.kv_head}"
        return f"{label}: nothing saturates; worst cosine {worst.cosine:.4f} ({where})" + _broken_tail(what, report)
    parts = []
    for tensor in ("K", "V", "Q"):
        hit = [h for h, t in sat if t == tensor]
        if hit:
            layers = list(dict.fromkeys(h.module or "the call" for h in hit))
            top = max(hit, key=lambda h: getattr(h, f"{tensor.lower()}_amax"))
            amax = getattr(top, f"{tensor.lower()}_amax")
            limit = what.format_max * (top.q_scale if tensor == "Q" else 1.0)  # Q: at Q's own scale
            parts.append(
                f"{tensor} saturates in {len(hit)} head{'s' if len(hit) > 1 else ''} of "
                f"{', '.join(layers)} (amax {plain(amax)} > {plain(limit)})"
                + (f", a q_scale of {plain(top.hold_q)} holds it" if tensor == "Q" else "")
            )
    line = f"{label}: {'; '.join(parts)}"
    if all(t == "Q" for _, t in sat):  # K's and V's scales do not change Q's saturation
        return line + _broken_tail(what, report)
    per_head = next(
        (c for c in report.caches if c.format == what.format and c.scaling == _head_ask(what).split(":", 2)[2]),
        None,
    )
    if per_head is not None and per_head is not what and per_head.worst is not None:
        still = " (still broken)" if _breaks(per_head.worst) else ""
        line += (
            f"; per-head scales bring the worst cosine similarity from {worst.cosine:.4f} to "
            f"{per_head.worst.cosine:.4f}{still}"
        )
        return line + _broken_tail(what, report, counted=False)
    return line + (
        f"; per-head scales (amax / {plain(what.format_max)}) keep it from saturating ({_head_ask(what)} computes "
        "whether they hold it)"
    )


def _broken_tail(what: KVWhatIf, report: KVReport, counted: bool = True) -> str:
    """How many heads break, and, for the worst of them that no FP8 scale computed holds, that sentence."""
    broken = [h for h in what.heads if _breaks(h)]
    if not broken:
        return ""
    tail = f"; {len(broken)} head{'s break' if len(broken) > 1 else ' breaks'} (kv_cache_error)" if counted else ""
    for h in sorted(broken, key=lambda h: h.cosine):
        nothing = _no_scale_holds(report, what, h)
        if nothing:
            where = f"{h.module or 'the call'} kv head {h.kv_head}"
            return tail + f"; {where}: " + nothing.replace("this head", "it").replace("this layer", "that layer")
    return tail


def judge_kv(report: KVReport) -> None:
    """Each cache's findings (saturation per head and tensor, output error per head) and its summary line."""
    for what in report.caches:
        what.findings = []
        for h in what.heads:
            what.findings += _saturation(what, h, report)
            err = _error(what, h, report)
            if err is not None:
                what.findings.append(err)
        what.summary = _summary(what, report)
