"""Decode steps grouped per module: ``generate()`` runs a module once over the prompt (the prefill: as many queries
as keys) and then once per new token over the KV cache (a decode step: fewer queries than keys, the key count
growing from call to call). A sliding-window layer (gpt-oss's, Mistral's ``sliding_window``) stops growing once
the window is full: transformers' ``DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1`` rows and
hands the attention those plus the new token's, so its steps keep ``sliding_window`` keys (fewer than a prefill
longer than the window). Such a call counts as a step when it follows the module's prefill or step: cross-attention
(a decoder's queries over the encoder's keys, as many each time) follows neither. The model report says each
module's run in one line and folds the steps that went well into one line of its calls table, rather than one line
per step and layer."""

from __future__ import annotations

import json
from dataclasses import replace

from attncheck.results import CallReport, DecodeRun, ModelLine


def _masked(report: CallReport) -> bool:
    try:
        shapes = json.loads(report.call.meta.get("shapes") or "{}")
    except ValueError:
        return False
    return isinstance(shapes, dict) and "attn_mask" in shapes


def _keys(line: ModelLine, report: CallReport) -> int:
    """The call's key count: a softmax over ``[S, sink]`` (learned sinks) has one column more than keys."""
    return line.shape[-1] - (1 if report.call.meta.get("sinks") == "true" else 0)


def _is_step(queries: int, keys: int, before: tuple[int, bool] | None) -> bool:
    """Fewer queries than keys, and more keys than the module's call before (a cache that grew), or at most as many
    where that call was a prefill (as many queries as keys) or a step (a sliding window, full)."""
    if before is None or queries >= keys:
        return False
    keys_before, prefill_or_step = before
    return keys > keys_before or prefill_or_step


def decode_runs(lines: list[ModelLine], calls: list[CallReport]) -> list[DecodeRun]:
    """Each module's runs of decode steps (a run ends where the module's next prefill begins), in call order."""
    open_runs: dict[tuple, tuple[list[tuple[ModelLine, CallReport]], list[tuple[ModelLine, CallReport]]]] = {}
    done: list[tuple[list, list]] = []
    keys: dict[tuple, tuple[int, bool]] = {}  # per module: its call before's keys, and whether a prefill or step
    for line, report in zip(lines, calls):
        if not line.module or len(line.shape) < 2:
            continue
        key = (line.rank, line.module)
        prefill, steps = open_runs.setdefault(key, ([], []))
        queries, n = line.shape[-2], _keys(line, report)
        step = _is_step(queries, n, keys.get(key))
        keys[key] = (n, step or queries == n)
        if step:
            steps.append((line, report))
        elif steps:  # a new prompt: the run before it is complete
            done.append((prefill, steps))
            open_runs[key] = ([(line, report)], [])
        else:
            prefill.append((line, report))
    done += [(p, s) for p, s in open_runs.values() if s]
    runs = [_run(prefill, steps) for prefill, steps in done]
    return sorted(runs, key=lambda r: r.steps[0])


def _run(prefill: list[tuple[ModelLine, CallReport]], steps: list[tuple[ModelLine, CallReport]]) -> DecodeRun:
    first = steps[0][0]
    good = [line for line, _ in steps if line.verdict == "ok"]
    return DecodeRun(
        module=first.module,
        prefill=[line.index for line, _ in prefill],
        prefill_keys=[_keys(line, report) for line, report in prefill],
        steps=[line.index for line, _ in steps],
        queries=sorted({line.shape[-2] for line, _ in steps}),
        keys_from=_keys(first, steps[0][1]),
        keys_to=_keys(*steps[-1]),
        causal=sum(r.call.is_causal for _, r in steps),
        masked=sum(_masked(r) for _, r in steps),
        bad=[line.index for line, _ in steps if line.verdict != "ok"],
        summary=_summary(good) if good else None,
        rank=first.rank,
    )


def _summary(good: list[ModelLine]) -> ModelLine:
    """The steps that went well as one line: the largest logit and error, the smallest room (with its limit)."""
    logits = [line.max_logit for line in good if line.max_logit is not None]
    errs = [line.worst_err for line in good if line.worst_err is not None]
    rooms = [line for line in good if line.headroom is not None]
    tightest = min(rooms, key=lambda line: line.headroom) if rooms else None
    cells = {line.cell for line in good}
    return replace(
        good[0],
        shape=good[-1].shape,
        cell=cells.pop() if len(cells) == 1 else None,
        max_logit=max(logits) if logits else None,
        headroom=None if tightest is None else tightest.headroom,
        limit=None if tightest is None else tightest.limit,
        nan_rows=sum(line.nan_rows for line in good),
        worst_err=max(errs) if errs else None,
        steps=len(good),
        last_index=good[-1].index,
    )
