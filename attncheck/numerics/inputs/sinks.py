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
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, dtype_label
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


# What one block of rows may hold at once (float64 scores, exponentials and outputs, a few copies): calls are
# computed in blocks of heads, or of one head's queries, within it; each row's numbers do not depend on the block.
SINK_BLOCK_BYTES = 1 << 28


def _blocks(batch: int, heads: int, tq: int, tk: int, d: int) -> list[tuple[slice, slice]]:
    """(heads, queries) blocks in order: whole heads while they fit ``SINK_BLOCK_BYTES``, else one head's queries."""
    per_row = 8 * (6 * (tk + 1) + 6 * d) * batch
    rows = max(1, SINK_BLOCK_BYTES // per_row)
    if rows >= tq:
        per = max(1, rows // tq)
        return [(slice(h, min(h + per, heads)), slice(0, tq)) for h in range(0, heads, per)]
    return [(slice(h, h + 1), slice(q, min(q + rows, tq))) for h in range(heads) for q in range(0, tq, rows)]


def _head_sums(x: torch.Tensor, op: str) -> torch.Tensor:
    """(batch, heads, ...) -> per head: the sum or the max (NaN where any is NaN) over everything else."""
    flat = x.transpose(0, 1).reshape(x.shape[1], -1)
    if op == "sum":
        return flat.sum(1)
    top = flat.nan_to_num(nan=0.0).amax(1) if flat.shape[1] else torch.zeros(flat.shape[0], dtype=flat.dtype)
    return torch.where(torch.isnan(flat).any(dim=1), torch.tensor(float("nan"), dtype=flat.dtype), top)


def _block_numbers(scores: torch.Tensor, sinks: torch.Tensor, v: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One block's per-head sums and maxima (and its rows' shares, (heads, batch x queries)). A row that sees no key
    (every score -inf or a mask sentinel: a padded query) gives its sink the whole denominator, share 1 by
    definition, and without the sink has no softmax (NaN) or a uniform one over masked keys: such rows are counted
    (``masked``) and left out of the shares and of the comparison with the cell that drops the sinks, so that they
    hide neither the real share nor the real difference."""
    ref, share = reference_with_sinks(scores, sinks, v)
    model = eager_sink_output(scores, sinks, v)
    dropped = eager_sink_output(scores, None, v)
    blind = (scores <= MASK_SENTINEL_LIMIT).all(dim=-1)  # (batch, heads, Tq): rows that see no key (-inf or sentinel)
    seen = ~blind.unsqueeze(-1)
    same = (model == dropped) | (torch.isnan(model) & torch.isnan(dropped)) | ~seen
    m64, d64 = model.double(), dropped.double()
    zero = torch.zeros((), dtype=torch.float64)
    return {
        "changed": _head_sums((~same).long(), "sum"),
        "masked": _head_sums(blind.long(), "sum"),
        "err_model": _head_sums((m64 - ref).abs(), "max"),
        "err_nosinks": _head_sums(torch.where(seen, (d64 - ref).abs(), zero), "max"),
        "diff_nosinks": _head_sums(torch.where(seen, (d64 - m64).abs(), zero), "max"),
        "sq_model": _head_sums((m64 - ref).square(), "sum"),
        "sq_nosinks": _head_sums(torch.where(seen, (d64 - ref).square(), zero), "sum"),
        "sq_ref": _head_sums(ref.square(), "sum"),
        # rows that see no key: -1, dropped before the max and median (a NaN share, of a NaN sink or scores, is kept)
        "share": torch.where(blind, -1.0, share).transpose(0, 1).reshape(share.shape[1], -1),
    }


def _rel(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny), num).sqrt()


def sink_facts(scores: torch.Tensor, sinks: torch.Tensor, v: torch.Tensor | None) -> SinkFacts:
    """Per query head of a call with learned sinks: the sink's share of the float64 denominator (max and median
    over rows), and the output in the scores' dtype with the sink (the model's cell) and without it (a kernel that
    drops it): how many elements differ, and each one's error against float64. ``scores`` (batch, heads, Tq, Tk)
    scaled and masked as the softmax sees them, ``sinks`` (heads,), ``v`` (batch, heads or kv heads, Tk, d)."""
    batch, heads, tq, tk = scores.shape
    if v is not None and v.shape[1] != heads and v.shape[1] and heads % v.shape[1] == 0:
        v = v.repeat_interleave(heads // v.shape[1], dim=1)  # GQA: each query head reads its kv head
    d = 1 if v is None else v.shape[-1]
    per_head: dict[str, list] = {}
    for hs, qs in _blocks(batch, heads, tq, tk, d):
        got = _block_numbers(scores[:, hs, qs], sinks[hs], None if v is None else v[:, hs])
        for key, value in got.items():
            per_head.setdefault(key, []).append((hs.start, value))
    joined: dict[str, list] = {key: [[] for _ in range(heads)] for key in per_head}
    for key, parts in per_head.items():
        for start, value in parts:
            for i in range(value.shape[0]):  # heads of the block (one block holds at most every head)
                joined[key][start + i].append(value[i])
    total = {key: [_combine(key, parts) for parts in rows] for key, rows in joined.items()}
    return SinkFacts(
        dtype=dtype_label(scores.dtype),
        rounding=torch.finfo(scores.dtype).eps / 4,  # eps: the spacing at 1, twice the smallest relative one
        elements=batch * tq * (d if v is not None else tk),
        heads=[
            SinkHead(
                head=h,
                sink=float(sinks[h]),
                share_max=_share(total["share"][h], "max"),
                share_median=_share(total["share"][h], "median"),
                masked_rows=int(total["masked"][h]),
                changed=int(total["changed"][h]),
                err_model=float(total["err_model"][h]),
                err_nosinks=float(total["err_nosinks"][h]),
                diff_nosinks=float(total["diff_nosinks"][h]),
                rel_model=float(_rel(total["sq_model"][h], total["sq_ref"][h])),
                rel_nosinks=float(_rel(total["sq_nosinks"][h], total["sq_ref"][h])),
            )
            for h in range(heads)
        ],
    )


def _share(shares: torch.Tensor, op: str) -> float:
    """The max or median of a head's shares over the rows that see a key (0 where none does); NaN where any is."""
    rows = shares[shares != -1.0]
    if not rows.numel():
        return 0.0
    if torch.isnan(rows).any():
        return float("nan")
    return float(rows.amax() if op == "max" else rows.median())


def _combine(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One head's numbers over its blocks: shares joined, maxima maxed (NaN kept), sums summed."""
    if key == "share":
        return torch.cat(parts)
    stacked = torch.stack(parts)
    if key.startswith(("err_", "diff_")):
        return torch.where(torch.isnan(stacked).any(), torch.tensor(float("nan"), dtype=stacked.dtype), stacked.amax())
    return stacked.sum()


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
    facts.grads_left_out = any(role.startswith("grad_") for role in tensors)
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
