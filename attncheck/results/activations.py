"""What a call's activations and attention pattern say beside its numerics: the attention each key receives (emergent
sinks), the channels of q, k and v far above their head's others (outlier channels), and the activations thousands
of times the rest (massive activations). Numbers only: ``findings.activations`` judges them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KeyShares:
    """The attention each key receives from the float64 reference, averaged over the queries that can see it
    (masked keys, causal masks and fully masked rows respected): the attention-sink literature's importance
    (sail-sg/Attention-Sink, eval_sink_open_source.py). Per head, pooled over the batch."""

    heads: int  # the axis before the queries (1 for a 2-d score tensor)
    first_share: list[float | None]  # per head: key 0's share; None where no query sees key 0
    first_uniform: list[float | None]  # ... what uniform attention over each query's visible keys would give key 0
    top_key: list[int | None]  # per head: the key receiving the largest share
    top_share: list[float | None]
    top_uniform: list[float | None]  # uniform attention's share of that key
    # key 0's share per (batch..., head) group in row-major order: the unit the sink rate counts
    first_importance: list[float | None] = field(default_factory=list)


@dataclass
class ChannelPeak:
    """A head's channel with the largest max |x| over the batch and tokens, against the head's median channel."""

    channel: int
    value: float  # max |x| of that channel
    median: float  # the median over the head's channels of their max |x|
    ratio: float | None  # value / median (None where the median is 0)
    batch: int  # where the channel peaks
    token: int


@dataclass
class HeadActivations:
    """One head's q, k and v channel peaks (k and v: of the kv head it reads) and the kurtosis of its k."""

    q: ChannelPeak | None = None
    k: ChannelPeak | None = None
    v: ChannelPeak | None = None
    k_kurtosis: float | None = None  # Pearson's: E[(x - mean)^4] / var^2 over the kv head's k (3 for a Gaussian)


@dataclass
class LargeActivation:
    """One of the largest activations of a call's q, k or v, beside the median magnitude of the whole tensor: what
    arXiv 2402.17762's criterion of a massive activation reads (``findings.activations`` applies it)."""

    tensor: str  # 'q', 'k' or 'v'
    batch: int
    head: int  # the tensor's own head (k and v: the kv head)
    token: int
    channel: int
    value: float
    median: float  # median |x| over the call's whole tensor
    ratio: float | None  # |value| / median


@dataclass
class CallActivations:
    """A call's activation facts: per head (query heads), and per tensor its largest activations (largest first)."""

    heads: list[HeadActivations] = field(default_factory=list)
    largest: list[LargeActivation] = field(default_factory=list)
