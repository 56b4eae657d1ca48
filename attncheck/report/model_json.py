"""The model report as JSON: every call's diagnosis, its findings, the what-ifs and kernel replays, in the
schema of ``report.run``. Formatting only."""

from __future__ import annotations

from typing import Any, Sequence

from attncheck import __version__
from attncheck.codes import doc_link
from attncheck.format import to_jsonable
from attncheck.report.kernels import kernel_outcome, kernel_sentence
from attncheck.report.run import JSON_SCHEMA, diagnosis_json
from attncheck.results import CallReport, ModelLine, ModelReport, TensorDiagnosis


def model_json(report: ModelReport, calls: list[CallReport]) -> dict[str, Any]:
    out_calls = []
    for line, c in zip(report.lines, calls):
        out_calls.append(_call_json(line, c))
    first = None if report.first_bad is None else _first_json(report.lines[report.first_bad])
    return to_jsonable(
        {
            "calls": out_calls,
            "first_bad": first,
            "outliers": [dict(to_jsonable(o), message=o.message) for o in report.outliers],
            "head_marks": [to_jsonable(m) for m in report.head_marks],
            "sink_rate": {"rate": report.sink_rate, "hits": report.sink_hits, "triples": report.sink_pairs},
            "ignored": list(report.ignored),
            "skipped": [{"name": n, "error": why} for n, why in report.skipped],
            "capture": report.capture,
            "decode": [_decode_json(r) for r in report.decode],
            "ranks": [_rank_json(report, r) for r in report.ranks],
            "findings": [
                {"code": f.code, "severity": f.severity, "message": f.message, "fix": f.fix, "doc": doc_link(f.code)}
                for f in report.findings
            ],
            "known_implementation": report.known,
            "recorded_on": report.recorded_on,
            "first_grad_bad": None
            if report.first_grad_bad is None
            else _first_json(report.lines[report.first_grad_bad]),
            "what_if": [_what_if_json(a) for a in report.what_if],
            "kernels": [_kernels_json(report, c) for c in report.kernels],
            "settings": [to_jsonable(c) for c in report.settings],  # --what-if fa4: each grid over the calls
            "settings_refused": [{"grid": g, "calls": n, "why": why} for g, n, why in report.settings_refused],
        }
    )


def _call_json(line, c: CallReport) -> dict[str, Any]:
    """One call's line of the model report, its call's facts and its diagnosis."""
    info = c.call
    return {
        "index": line.index,
        "rank": line.rank,
        "name": line.name,
        "module": line.module,
        "kind": line.kind,
        "file": info.file,
        "forward": info.forward,
        "shape": list(line.shape),
        "dtype": info.dtype,
        "softmax_dtype": info.softmax_dtype,
        "is_causal": info.is_causal,
        "scale": info.scale,
        "enable_gqa": info.enable_gqa,
        "has_qk": info.has_qk,
        "cell": line.cell,
        "max_logit": line.max_logit,
        "score_mod": None
        if line.score_mod is None
        else {"name": line.score_mod, "max_logit_before": line.logit_before_mod},
        "headroom": line.headroom,
        "limit": _limit_json(line.limit),
        "nan_rows": line.nan_rows,
        "first_cause": line.first_cause,
        "cause_heads": line.heads,
        "max_abs_err": line.worst_err,
        "verdict": line.verdict,
        "errors": line.errors,
        "heads": to_jsonable(c.heads),
        "sinks": None if c.sinks is None else to_jsonable(c.sinks),
        "largest_activations": None if c.activations is None else to_jsonable(c.activations.largest),
        "error": c.error,
        "device": info.meta.get("device"),  # where the call ran, as the capture recorded it
        "capability": info.meta.get("capability"),
        "sdpa_backend": info.meta.get("sdpa_backend"),
        "path_note": c.path_note,
        "what_if": None if c.what_if is None else diagnosis_json(c.what_if),
        "backward": None
        if line.grad_verdict is None
        else {
            "verdict": line.grad_verdict,
            "nan_rows": line.grad_nan_rows,
            "first_cause": line.grad_cause,
            "grads": line.grad_which,
            "scale_headroom": line.grad_headroom,
            "headroom_at": line.grad_headroom_at,
        },
    }


def _decode_json(r) -> dict[str, Any]:
    """One run of decode steps (a module's calls one query at a time)."""
    return {
        "module": r.module,
        "rank": r.rank,
        "prefill": r.prefill,
        "prefill_keys": r.prefill_keys,
        "steps": len(r.steps),
        "first_step": r.steps[0],
        "last_step": r.steps[-1],
        "queries": r.queries,
        "keys_from": r.keys_from,
        "keys_to": r.keys_to,
        "causal": r.causal,
        "masked": r.masked,
        "bad": r.bad,
    }


def _rank_json(report: ModelReport, r) -> dict[str, Any]:
    """One rank's totals and its first bad call."""
    return {
        "rank": r.rank,
        "calls": r.calls,
        "errors": r.errors,
        "warnings": r.warnings,
        "complete": r.complete,
        "first_bad": None if r.first_bad is None else _first_json(report.lines[r.first_bad]),
    }


def _what_if_json(a) -> dict[str, Any]:
    """One what-if cell over the calls."""
    return {
        "cell": a.cell,
        "calls": a.calls,
        "bad_calls": a.bad_calls,
        "verdict": a.verdict,
        "nan_rows": a.nan_rows,
        "max_abs_err": a.worst_err,
        "headroom": a.headroom,
        "limit": _limit_json(a.limit),
        "findings": a.findings,
        "first_bad": None if a.first is None else _first_json(a.first),
    }


def _kernels_json(report: ModelReport, c) -> dict[str, Any]:
    """One call's kernels replayed (--what-if kernels)."""
    return {
        "index": report.lines[c.position].index,
        "name": c.name,
        "summary": kernel_sentence(c),
        "kernels": [dict(to_jsonable(k), breaks=k.breaks, outcome=kernel_outcome(k)) for k in c.kernels],
    }


def _limit_json(limit) -> dict[str, Any] | None:
    """A CellLimit with its headroom (non-finite numbers become null)."""
    return None if limit is None else to_jsonable(dict(to_jsonable(limit), headroom=limit.headroom))


def _first_json(line: ModelLine) -> dict[str, Any]:
    return {
        "index": line.index,
        "rank": line.rank,
        "name": line.name,
        "module": line.module,
        "verdict": line.verdict,
        "first_cause": line.first_cause,
        "heads": line.heads,
        "nan_rows": line.nan_rows,
        "errors": line.errors,
    }


def run_json(
    diags: Sequence[TensorDiagnosis], device: str, failed: Sequence[str] = (), model=None, calls=()
) -> dict[str, Any]:
    """The run's JSON: every tensor's diagnosis and, for files, the ``model`` section (one entry
    per call, the first that goes wrong, outlier heads)."""
    opts = diags[0].settings if diags else None
    return {
        "schema": JSON_SCHEMA,
        "attncheck_version": __version__,
        "device": device,
        "options": None if opts is None else to_jsonable(opts),
        "tensors": [diagnosis_json(d) for d in diags],
        "failed": list(failed),
        "model": None if model is None else model_json(model, list(calls)),
    }
