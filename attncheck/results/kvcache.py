"""The KV-cache what-if (``--what-if kv:FORMAT[:SCALING]``): per layer and kv head, K and V through a quantised
cache at a scaling, and what attention computed from it gives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attncheck.results.common import Finding


@dataclass
class KVChannel:
    """The channel holding a kv head's amax of K or V, and how far above the head's median channel it sits."""

    tensor: str  # 'k' or 'v'
    channel: int
    ratio: float  # its max |x| over the median channel's
    token: int  # the position of the amax in the call
    call: int  # the call (its index) where it sits


@dataclass
class KVHead:
    """One kv head of one layer (a module's calls together) through the cache."""

    module: str  # the layer's attention module ('' for --q/--k/--v)
    kv_head: int
    query_heads: list[int]
    calls: int
    k_amax: float  # the largest |k| over the calls
    v_amax: float
    k_scale: float  # the scale the cache used (the first call's where it differs between calls: never here)
    v_scale: float
    k_saturated: int  # entries beyond the format's range at that scale, over the calls (clipped to its max)
    v_saturated: int
    k_flushed: int  # nonzero entries that became zero
    v_flushed: int
    k_entries: int
    v_entries: int
    # O through the cache against the same kernel on K and V as given (the model's cell), and against float64:
    # relative L2, the least cosine similarity of a row, max abs (worst over the calls)
    rel_l2: float
    cosine: float
    max_abs: float
    rel_l2_f64: float
    cosine_f64: float
    max_abs_f64: float
    base_cosine_f64: float  # the model's cell without the cache against float64: what the cache adds to
    # The scales that would hold K and V (amax / the format's max): the layer's (per tensor) and this head's
    hold_k_tensor: float
    hold_v_tensor: float
    hold_k_head: float
    hold_v_head: float
    channels: list[KVChannel] = field(default_factory=list)  # where K's and V's amax sit
    q_saturated: int = 0  # read by FlashAttention-3's FP8 path ('head:fa3'): Q's entries beyond the format's range
    # FlashAttention-3's FP8 path (NaN on the others): the largest |q| of the query heads reading this kv head over
    # the calls, the Q scale the path used, and the q_scale that would hold Q (amax / the format's max)
    q_amax: float = math.nan
    q_scale: float = math.nan
    hold_q: float = math.nan


@dataclass
class KVWhatIf:
    """One cache (format, scaling) over the calls: every layer's kv heads, and the findings they lead to."""

    format: str  # 'fp8_e4m3'
    scaling: str  # 'unit', 'tensor', 'head' or 'dynamic'; an integer cache's groups: 'g64', 'g64:r128'
    format_max: float  # FP8: the format's largest value; int4: its largest level, 15
    # FP8: where |x / scale| counts as saturated (the max plus half its last step: 464 in e4m3, 61,440 in e5m2)
    saturation_edge: float = math.nan
    heads: list[KVHead] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    summary: str = ""  # the one line a person reads first

    @property
    def name(self) -> str:
        return f"kv:{self.format}:{self.scaling}"

    @property
    def worst(self) -> KVHead | None:
        return min(self.heads, key=lambda h: h.cosine) if self.heads else None


@dataclass
class KVReport:
    """Every cache asked, and the calls left out (no v, or a kind without q, k and v) with why."""

    caches: list[KVWhatIf] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # Q, K and V given as files (--q/--k/--v): their implementation unknown, the cache's findings count under plain
    # --fail-on as the cells asked do; on a capture only --fail-on what-if:COND fails on them
    dumps: bool = False
