"""Learned attention sinks (gpt-oss): one logit per query head that joins the softmax's denominator and has no
value. transformers' eager gpt-oss attention (``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``)
computes, every tensor in the scores' dtype: ``c = cat([S, sink], -1)``; ``c = c - c.max(-1)``; ``P =
softmax(c, dtype=dtype)``; the sink's column dropped; ``O = P @ V``. The float64 reference puts the sink in the
denominator only: ``P_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink - m))``, m the max over keys and sink.

A kernel that drops the sinks (as quantised-KV decode kernels have done silently) computes the same without the
column; a sink whose share of the denominator is below the dtype's rounding leaves the model's output bit for bit
the same as without it, which is measured here, not assumed."""

from __future__ import annotations

import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.precision import dtype_label
from attncheck.results.sinks import SinkFacts, SinkHead


def sink_column(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``[S, sink]``: the scores (batch, heads, Tq, Tk) with one column per row holding the head's sink logit."""
    col = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.cat([scores, col], dim=-1)


def sink_logits(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """What the model's softmax receives: ``[S, sink]`` minus its row max, in the scores' dtype (gpt-oss's eager
    code subtracts the max itself, so the rounding of that subtraction is the model's)."""
    c = sink_column(scores, sinks)
    return c - c.max(dim=-1, keepdim=True).values


def eager_sink_output(scores: torch.Tensor, sinks: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
    """The model's cell as gpt-oss's eager code computes it, in the scores' dtype: softmax over ``[S, sink]`` (max
    subtracted first), the sink's column dropped, P @ V in v's dtype. ``sinks`` None: the same without the column
    (a kernel that drops the sinks). Without v: the probabilities."""
    if sinks is None:
        c = scores - scores.max(dim=-1, keepdim=True).values
        p = torch.softmax(c, dim=-1, dtype=scores.dtype)
    else:
        p = torch.softmax(sink_logits(scores, sinks), dim=-1, dtype=scores.dtype)[..., :-1]
    return p if v is None else p.to(v.dtype) @ v


def reference_with_sinks(
    scores: torch.Tensor, sinks: torch.Tensor, v: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64: (the output with the sink in the denominator only, the sink's share of each row's denominator)."""
    s = scores.double()
    sink = sinks.double().reshape(1, -1, 1, 1)
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)  # a row of -inf keys: the sink is its max
    e = torch.exp(s - m)
    es = torch.exp(sink - m)
    den = e.sum(dim=-1, keepdim=True) + es
    p = e / den
    out = p if v is None else p @ v.double()
    return out, (es / den).squeeze(-1)


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, ...) -> (heads, everything else of that head)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per head: max |a - b| over the head's elements (NaN where either holds NaN: the difference is NaN)."""
    d = _per_head((a.double() - b.double()).abs())
    return torch.where(torch.isnan(d).any(dim=1), torch.tensor(float("nan"), dtype=d.dtype), d.nan_to_num().amax(1))


def _rel_l2(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    num = _per_head((a.double() - ref).square()).sum(1)
    den = _per_head(ref.square()).sum(1)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny), num).sqrt()


def sink_facts(scores: torch.Tensor, sinks: torch.Tensor, v: torch.Tensor | None) -> SinkFacts:
    """Per query head of a call with learned sinks: the sink's share of the float64 denominator (max and median
    over rows), and the output in the scores' dtype with the sink (the model's cell) and without it (a kernel that
    drops it): how many elements differ, and each one's error against float64. ``scores`` (batch, heads, Tq, Tk)
    scaled and masked as the softmax sees them, ``sinks`` (heads,), ``v`` (batch, heads or kv heads, Tk, d)."""
    heads = scores.shape[1]
    if v is not None and v.shape[1] != heads and v.shape[1] and heads % v.shape[1] == 0:
        v = v.repeat_interleave(heads // v.shape[1], dim=1)  # GQA: each query head reads its kv head
    ref, share = reference_with_sinks(scores, sinks, v)
    model = eager_sink_output(scores, sinks, v)
    dropped = eager_sink_output(scores, None, v)
    same = (model == dropped) | (torch.isnan(model) & torch.isnan(dropped))
    changed = _per_head(~same).sum(1)
    rows = _per_head(share).nan_to_num(nan=0.0)
    err_model, err_nosinks, diff = _max_abs(model, ref), _max_abs(dropped, ref), _max_abs(dropped, model)
    rel_model, rel_nosinks = _rel_l2(model, ref), _rel_l2(dropped, ref)
    share_max, share_median = rows.amax(1), rows.median(1).values
    return SinkFacts(
        dtype=dtype_label(scores.dtype),
        rounding=torch.finfo(scores.dtype).eps / 4,  # eps: the spacing at 1, twice the smallest relative one
        elements=int(model[:, 0].numel()),
        heads=[
            SinkHead(
                head=h,
                sink=float(sinks[h]),
                share_max=float(share_max[h]),
                share_median=float(share_median[h]),
                changed=int(changed[h]),
                err_model=float(err_model[h]),
                err_nosinks=float(err_nosinks[h]),
                diff_nosinks=float(diff[h]),
                rel_model=float(rel_model[h]),
                rel_nosinks=float(rel_nosinks[h]),
            )
            for h in range(heads)
        ],
    )


def split_sinks(
    meta: dict[str, str], tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], SinkFacts | None]:
    """A captured call with learned sinks and the tensors its diagnosis reads. A softmax call over ``[S, sink]``
    (metadata ``sinks`` 'true'): its scores become ``sink_logits``, what the model's softmax received (the sink is one
    more column there, and q and k no longer make those scores). An SDPA call whose module holds sinks it was not
    given (``module_sinks`` 'ignored'): as recorded, and the facts of the sinks it dropped (``ignored_sink_facts``).
    Any other call: as given, no facts."""
    sinks = tensors.get("sinks")
    if sinks is not None and meta.get("module_sinks") == "ignored" and "q" in tensors and "k" in tensors:
        rest = {role: t for role, t in tensors.items() if role != "sinks"}
        return rest, ignored_sink_facts(meta, rest, sinks)
    if meta.get("sinks") != "true" or sinks is None or "scores" not in tensors:
        return tensors, None
    scores = tensors["scores"]
    _check_sinks(scores, sinks)
    facts = sink_facts(scores, sinks, tensors.get("v"))
    # the backward of a softmax with sinks is not computed yet: its gradients are left out, not judged without them
    out = {role: t for role, t in tensors.items() if role not in ("sinks", "q", "k") and not role.startswith("grad_")}
    out["scores"] = sink_logits(scores, sinks)
    return out, facts


def _check_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> None:
    if scores.dim() != 4 or sinks.dim() != 1 or sinks.shape[0] != scores.shape[1]:
        raise AttncheckError(
            f"its sinks (shape {list(sinks.shape)}) must hold one logit per head of its scores (shape "
            f"{list(scores.shape)}: batch, heads, queries, keys)"
        )


def eager_scores(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """An SDPA call's scores as eager attention computes them in q's dtype: Q@K^T (each query head reading its kv
    head), times the scale (the call's, else 1/sqrt(d)), a float mask added, a boolean mask's False keys and the
    causal mask's (top-left aligned, as SDPA's is_causal) at -inf."""
    q, k, mask = tensors["q"], tensors["k"], tensors.get("attn_mask")
    if k.shape[1] != q.shape[1] and k.shape[1] and q.shape[1] % k.shape[1] == 0:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = meta.get("scale", "none")
    s = (q @ k.transpose(-1, -2)) * (float(scale) if scale not in ("none", "") else q.shape[-1] ** -0.5)
    if isinstance(mask, torch.Tensor):
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    if meta.get("is_causal") == "true":
        tq, tk = s.shape[-2], s.shape[-1]
        above = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def ignored_sink_facts(meta: dict[str, str], tensors: dict[str, torch.Tensor], sinks: torch.Tensor) -> SinkFacts:
    """The sinks an SDPA call dropped: their facts on the scores eager attention computes for the call
    (``eager_scores``), the cell with them being what the module should have computed."""
    scores = eager_scores(meta, tensors)
    _check_sinks(scores, sinks)
    facts = sink_facts(scores, sinks, tensors.get("v"))
    facts.ignored = True
    return facts
