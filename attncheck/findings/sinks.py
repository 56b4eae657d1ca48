"""Learned attention sinks (gpt-oss: one logit per query head joining the softmax's denominator): a sink whose share
of the denominator is below the dtype's rounding changes nothing in the model's output. What a kernel that drops
the sinks would compute (``--what-if nosinks``) is reported as numbers beside the model's (report/sinks.py), never as
the model's finding."""

from __future__ import annotations

import math

from attncheck.findings.base import Code, Example
from attncheck.format import plain
from attncheck.results import Finding
from attncheck.results.sinks import SinkFacts

# A sink has no effect when its largest share of the float64 denominator over the head's rows stays below this many
# times half the dtype's smallest relative spacing (finfo.eps / 4; bf16: 2^-9 ~ 0.00195) and the model's output in
# the dtype is measured bit for bit the same without it.
SINK_NO_EFFECT_ROUNDINGS = 1.0

_EXAMPLE = """\
import torch

import attncheck


class Attention(torch.nn.Module):  # gpt-oss's eager attention: a learned sink logit per head joins the softmax
    def __init__(self, heads):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.full((heads,), -30.0))  # far below every row's max

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        c = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        c = c - c.max(dim=-1, keepdim=True).values
        return torch.softmax(c, dim=-1, dtype=c.dtype)[..., :-1] @ v


g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 32, generator=g).bfloat16() for _ in range(3))
with torch.no_grad(), attncheck.capture("cap"):
    Attention(2).bfloat16()(q, k, v)
"""

_IGNORED_EXAMPLE = """\
import torch
import torch.nn.functional as F

import attncheck


class Attention(torch.nn.Module):  # learned sinks (as gpt-oss's) held, but the call is SDPA's, which has none
    def __init__(self, heads):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.zeros(heads))  # near the rows' max: they would take a real share

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the sinks are dropped


g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))
with torch.no_grad(), attncheck.capture("cap"):
    Attention(2)(q, k, v)
"""

CODES: tuple[Code, ...] = (
    Code(
        "sinks_ignored",
        "error",
        "output",
        "the attention call drops the learned sinks its module holds",
        "The module holds learned sinks (a parameter `sinks`, one logit per query head, as gpt-oss's attention) and "
        "its attention call is PyTorch's SDPA, which has no sinks: transformers' SDPA integration ignores them "
        "without a word where `config._attn_implementation` is forced to 'sdpa' after loading (it refuses 'sdpa' "
        "for GptOss otherwise), so the model computes attention without them (as quantised-KV decode kernels that "
        "dropped sinks did, imp issue 1345). The message gives the output with and without them, computed "
        "eagerly in the call's dtype.",
        "The module's `sinks` hold one value per query head of an SDPA call. Error where the output computed with "
        "them differs from the one without in the call's dtype; info where they would change nothing there.",
        "run the model with an attention that takes the sinks: attn_implementation='eager', 'flex_attention' on a "
        "GPU, or a flash kernel given them (FlashAttention-4's learnable_sink); do not force "
        "config._attn_implementation to 'sdpa' for a model with sinks",
        Example(_IGNORED_EXAMPLE, "attncheck run cap --brief --fail-on sinks_ignored"),
        severity_note="info where the sinks, had they been given, would change nothing in the call's dtype",
        also="info",
    ),
    Code(
        "sink_no_effect",
        "info",
        "output",
        "a learned sink changes nothing in the call's dtype",
        "A learned sink (gpt-oss: one logit per query head, in the softmax's denominator only) takes exp(sink - m) / "
        "(sum_j exp(s_j - m) + exp(sink - m)) of each row. When that share is below the dtype's rounding, every "
        "probability moves by less than half a unit in the last place and the output is bit for bit what it is "
        "without the sink (TransformerEngine issue 2541): the parameter is dead in this dtype, and a kernel that "
        "drops it computes the same. Info: nothing is computed wrong, but a sink trained to absorb attention does "
        "not here.",
        f"The head's largest share over its rows < {SINK_NO_EFFECT_ROUNDINGS:g} x finfo(dtype).eps / 4 (bf16: 2^-9, "
        "fp16: 2^-12, fp32: 2^-25) and the output computed in the dtype with and without the sink is identical.",
        "nothing to fix if the model works; a sink meant to absorb attention needs a logit near the rows' max "
        "(check the checkpoint's sinks were loaded, and in which units: gpt-oss's are in the scaled scores' units)",
        Example(_EXAMPLE, "attncheck run cap --brief --fail-on sink_no_effect"),
    ),
)


def sink_findings(facts: SinkFacts | None) -> list[Finding]:
    """``sinks_ignored`` for a call that dropped its module's sinks; else ``sink_no_effect`` for the heads whose sink
    changes nothing in the call's dtype (one finding per call)."""
    if facts is None:
        return []
    if facts.ignored:
        return _ignored(facts)
    limit = SINK_NO_EFFECT_ROUNDINGS * facts.rounding
    dead = [h for h in facts.heads if h.share_max < limit and h.changed == 0]
    if not dead:
        return []
    heads = ", ".join(str(h.head) for h in dead[:8]) + (", ..." if len(dead) > 8 else "")
    top = max(h.share_max for h in dead)
    message = (
        f"the learned sink{'s' if len(dead) > 1 else ''} of head{'s' if len(dead) > 1 else ''} {heads} change"
        f"{'' if len(dead) > 1 else 's'} nothing in {facts.dtype}: largest share of the denominator {plain(top)} < "
        f"{facts.dtype}'s rounding {plain(limit)}, and the output is bit for bit the same without "
        f"{'them' if len(dead) > 1 else 'it'}"
    )
    return [add("sink_no_effect", message)]


def add(code: str, text: str, severity: str | None = None) -> Finding:
    """A finding of this group's ``code`` (its usual severity unless given)."""
    entry = next(c for c in CODES if c.name == code)
    return Finding(code, severity or entry.severity, text, entry.fix)


def _worst(values: list[float]) -> float:
    """The largest, NaN where any is (Python's max keeps or drops a NaN by its place)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _ignored(facts: SinkFacts) -> list[Finding]:
    moved = [h for h in facts.heads if h.changed]
    top = _worst([h.share_max for h in facts.heads])
    message = (
        f"the module holds learned sinks for its {len(facts.heads)} heads and its SDPA call has none: they are "
        f"dropped (largest share of a row's denominator {plain(top)}); "
        + (
            f"with them the {facts.dtype} output would differ in {len(moved)} of {len(facts.heads)} heads, by up to "
            f"{plain(_worst([h.diff_nosinks for h in facts.heads]))}, and the call's output is off by "
            f"{plain(_worst([h.err_nosinks for h in facts.heads]))} against float64 with them"
            if moved
            else f"they would change nothing in {facts.dtype}"
        )
    )
    return [add("sinks_ignored", message, None if moved else "info")]
