"""Activations and the attention pattern, for serving: emergent attention sinks, outlier channels of q, k and v,
and massive activations. Information, never an error: trained models have all three, and each says where a
quantised KV cache or an FP8 P cast will lose accuracy first (docs/serving.md)."""

from __future__ import annotations

from attncheck.findings.base import _TORCH, Code, Example
from attncheck.format import num, plain
from attncheck.results import CallReport, Finding, HeadMark, HeadStat

# The attention-sink literature's epsilon: a key is a sink of a head when its importance (its attention averaged
# over the queries that see it) exceeds it (sail-sg/Attention-Sink, eval_sink_open_source.py, epsilon=0.3)
SINK_EPSILON = 0.3
# ... and, for the finding, at least this many times what uniform attention over each query's visible keys gives
# it: key 0 of a causal pattern gets H_T / T from uniform attention alone (0.34 at T = 8), no sink at all
SINK_OVER_UNIFORM = 2.0
OUTLIER_CHANNEL_RATIO = 10.0  # a channel's max |x| this many times the median of its head's channel maxima
# arXiv 2402.17762 (Sun et al., "Massive Activations in Large Language Models", section 2): an activation is
# massive when its magnitude exceeds 100 and is about 1,000 times the median magnitude of its hidden state
MASSIVE_ABS = 100.0
MASSIVE_RATIO = 1000.0
NAMED = 6  # heads (or activations) a message names before '...'

_QKV = (
    _TORCH
    + "g = torch.Generator().manual_seed(0)\nq, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))\n"
)

CODES: tuple[Code, ...] = (
    Code(
        "attention_sink",
        "info",
        "activations",
        "a head parks its attention on one key (an emergent attention sink)",
        "Averaged over the queries that can see it, one key (usually the first token) receives a large share of a "
        "head's attention: an attention sink. Trained language models grow them in most heads (Xiao et al., "
        "StreamingLLM; Gu et al., 'When Attention Sink Emerges'). Nothing is wrong in itself, but a sink sets each "
        "row's max: probabilities far below it are what an FP8 P cast flushes (p_cast_underflow), and a KV cache "
        "that evicts the sink's key changes every row. The model report prints the sink rate, the share of "
        "(batch, layer, head) triples whose first-token importance exceeds epsilon, as the literature defines it.",
        f"A head's key receives a share > {SINK_EPSILON:g} (the literature's epsilon) of the attention of the "
        f"queries that see it (float64 reference; masked keys, causal masks and fully masked rows respected), and at "
        f"least {SINK_OVER_UNIFORM:g}x what uniform attention over each query's visible keys would give it.",
        "nothing to fix: keep the sink's key in the cache (StreamingLLM keeps the first tokens), visit key blocks "
        "in reverse order for FP8 P casts, and check the KV cache's scales where the sink sits",
        Example(
            _QKV
            + """\
q[..., 0] += 3.0
k[:, :, 0, 0] = 10.0  # key 0 lines up with every query: the first token becomes a sink
torch.save({"q": q, "k": k, "v": v}, "call.pt")
""",
            "attncheck run call.pt --brief --fail-on attention_sink",
        ),
    ),
    Code(
        "outlier_channel",
        "info",
        "activations",
        "a channel of q, k or v is far larger than the rest of its head",
        "One channel (feature) of a head's q, k or v reaches a max |x| far above the head's other channels. Trained "
        "models have such channels in K (which is why KIVI and KVQuant quantise K per channel) and in V. One "
        "scale per head or tensor is then set by the outlier: the other channels lose their precision in an "
        "8-bit or 4-bit cache, and the outlier is what saturates first at a unit scale. The message names the "
        "channel, its ratio and the token where it peaks; the JSON report has every head's peaks and its k's "
        "kurtosis.",
        f"max |x| of a channel >= {OUTLIER_CHANNEL_RATIO:g}x the median over the head's channels of their max |x| "
        "(over the batch and tokens, finite values).",
        "quantise K per channel (KIVI, KVQuant) or per head with calibrated scales; rotate the channels first "
        "(QuaRot, SpinQuant's Hadamard rotations) where the kernel allows it",
        Example(
            _QKV
            + """\
k[..., 3] *= 50  # channel 3 of k dwarfs the others
torch.save({"q": q, "k": k, "v": v}, "call.pt")
""",
            "attncheck run call.pt --brief --fail-on outlier_channel",
        ),
    ),
    Code(
        "massive_activation",
        "info",
        "activations",
        "a few activations of q, k or v are thousands of times the rest",
        "A handful of activations, at a few tokens (often the first, or a delimiter), are thousands of times "
        "larger than the median magnitude: massive activations (Sun et al., arXiv 2402.17762). They act as fixed "
        "biases and go with attention sinks; in a low-precision cache they set the scale (or saturate), and in "
        "fp16 they are the first values near the range's end.",
        f"|x| > {MASSIVE_ABS:g} and >= {MASSIVE_RATIO:g}x the median |x| of the call's whole q, k or v (arXiv "
        "2402.17762's criterion, section 2: magnitude above 100 and about 1,000 times the median magnitude of its "
        "hidden state), among each tensor's largest activations.",
        "keep them in range: scales calibrated on data that holds the token (the first token), bf16 rather than "
        "fp16 around them, or an explicit bias (attention bias, a learned sink) that removes the need for them",
        Example(
            _QKV
            + """\
v[0, 1, 0, 5] = 5000.0  # one massive activation at token 0
torch.save({"q": q, "k": k, "v": v}, "call.pt")
""",
            "attncheck run call.pt --brief --fail-on massive_activation",
        ),
    ),
)


FIX = {c.name: c.fix for c in CODES}  # the registry imports this module: its own view, not the registry's


def _named(parts: list[str]) -> str:
    return ", ".join(parts[:NAMED]) + (", ..." if len(parts) > NAMED else "")


def sink_marks(report: CallReport, position: int = 0) -> list[HeadMark]:
    """The heads of a call whose key passes the sink thresholds, each with its key and share."""
    shares = None if report.diagnosis is None else report.diagnosis.key_shares
    if shares is None:
        return []
    out = []
    for h in range(shares.heads):
        first, base0 = shares.first_share[h], shares.first_uniform[h]
        top, share, base = shares.top_key[h], shares.top_share[h], shares.top_uniform[h]
        if first is not None and base0 and first > SINK_EPSILON and first >= SINK_OVER_UNIFORM * base0:
            key, share, base = 0, first, base0
        elif top is None or share is None or not base or share <= SINK_EPSILON or share < SINK_OVER_UNIFORM * base:
            continue
        else:
            key = top
        msg = f"head {h} key {key} {num(share, 3)} (uniform {num(base, 2)})"
        out.append(_mark(report, position, h, "sink", msg, key=key, share=share))
    return out


def _mark(report: CallReport, position: int, head: int, what: str, message: str, **kw) -> HeadMark:
    info = report.call
    return HeadMark(position, info.index, info.module or info.name, head, what, message, rank=info.rank, **kw)


def channel_marks(report: CallReport, position: int = 0) -> list[HeadMark]:
    """The heads of a call with a q, k or v channel at least OUTLIER_CHANNEL_RATIO times the head's median (k and
    v once per kv head: the query heads of a GQA group read the same)."""
    out, seen = [], set()
    readers: dict[int, int] = {}
    for h in report.heads:
        readers[_kv(h)] = readers.get(_kv(h), 0) + 1
    for h in report.heads:
        a = h.activations
        if a is None:
            continue
        for tensor, peak in (("q", a.q), ("k", a.k), ("v", a.v)):
            if peak is None or peak.ratio is None or peak.ratio < OUTLIER_CHANNEL_RATIO:
                continue
            unit = (tensor, h.head if tensor == "q" else _kv(h))
            if unit in seen:
                continue
            seen.add(unit)
            shared = tensor != "q" and readers[_kv(h)] > 1  # GQA: name the kv head the group reads
            head = f"kv head {_kv(h)}" if shared else f"head {h.head}"
            kurt = f", kurtosis {plain(a.k_kurtosis)}" if tensor == "k" and a.k_kurtosis is not None else ""
            msg = (
                f"{head} {tensor} channel {peak.channel}: max|{tensor}| {plain(peak.value)} = "
                f"{plain(peak.ratio)}x the median channel ({plain(peak.median)}), at token {peak.token}"
                f"{'' if peak.batch == 0 else f' of batch {peak.batch}'}{kurt}"
            )
            out.append(
                _mark(report, position, h.head, "channel", msg, tensor=tensor, channel=peak.channel, ratio=peak.ratio)
            )
    return out


def _kv(h: HeadStat) -> int:
    return h.head if h.kv_head is None else h.kv_head


def massive(report: CallReport) -> list:
    """The call's activations that pass arXiv 2402.17762's criterion (among each tensor's largest)."""
    acts = report.activations
    if acts is None:
        return []
    return [a for a in acts.largest if a.value > MASSIVE_ABS and a.ratio is not None and a.ratio >= MASSIVE_RATIO]


def activation_findings(report: CallReport) -> list[Finding]:
    """attention_sink, outlier_channel and massive_activation for one call (info)."""
    out = []

    def add(code: str, message: str) -> None:
        out.append(Finding(code, "info", message, FIX[code]))

    sinks = sink_marks(report)
    if sinks:
        msg = f"{len(sinks)} head(s) put a share > {SINK_EPSILON:g} on one key: " + _named([m.message for m in sinks])
        add("attention_sink", msg)
    channels = channel_marks(report)
    if channels:
        channels.sort(key=lambda m: -(m.ratio or 0))
        msg = f"{len(channels)} outlier channel(s): " + _named([m.message for m in channels])
        add("outlier_channel", msg)
    big = massive(report)
    if big:
        tokens = sorted({(a.batch, a.token) for a in big})
        said = [
            f"{a.tensor} token {a.token}{'' if a.batch == 0 else f' of batch {a.batch}'} head {a.head} channel "
            f"{a.channel}: |x| {plain(a.value)} = {plain(a.ratio)}x the median |{a.tensor}| "
            f"({plain(a.median)})"
            for a in big
        ]
        msg = f"{len(big)} massive activation(s) at {len(tokens)} token(s): " + _named(said)
        add("massive_activation", msg)
    return out


def sink_rate(calls: list[CallReport]) -> tuple[int, int]:
    """(triples whose first-token importance exceeds SINK_EPSILON, triples with one): the sink rate's numerator
    and denominator over every (batch, call, head) of the calls, sail-sg/Attention-Sink's definition (no uniform
    baseline here: the rate is the literature's number)."""
    values = [
        v
        for c in calls
        if c.diagnosis is not None and c.diagnosis.key_shares is not None
        for v in c.diagnosis.key_shares.first_importance
        if v is not None
    ]
    return sum(v > SINK_EPSILON for v in values), len(values)


def head_marks(calls: list[CallReport], ignore=()) -> list[HeadMark]:
    """Every call's sink and outlier-channel heads, in call order (``position``: the call's place in the report),
    less those whose code is ignored."""
    sinks, channels = "attention_sink" not in ignore, "outlier_channel" not in ignore
    return [
        m
        for at, c in enumerate(calls)
        for m in (sink_marks(c, at) if sinks else []) + (channel_marks(c, at) if channels else [])
    ]
