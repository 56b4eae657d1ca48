"""Calls -> the model report: one line per call, the first call that goes wrong, outlier heads, and
the answers to what-if questions.

Pure logic over the numbers in ``CallReport``s (no torch, no printing). A call whose implementation
is known (a capture's SDPA or softmax call) is judged by the cell the model ran alone
(``CallReport.cell``: for a softmax call torch.softmax in its dtype, for an SDPA call the path of
the backend PyTorch chose, in the call's dtype): its verdict, its findings, the counts and
``--fail-on``. The what-if cells of each call (``CallReport.what_if``) are gathered per cell into
``WhatIfAnswer``s: where each would break first. Calls of unknown implementation (plain scores,
q/k files) keep every cell as the question, as the per-tensor report does.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from attncheck.codes import CAUSES_OF, FIX, GRAD_CAUSES_OF, SEVERITY
from attncheck.findings import capture_findings, counted_rows, counted_verdict, ignored_causes
from attncheck.findings.activations import head_marks, sink_rate
from attncheck.findings.rope import rope_findings
from attncheck.format import plain
from attncheck.model_decode import decode_runs
from attncheck.registry import EVENTS, PATHS
from attncheck.results import (
    GRAD_CAUSES,
    MODEL,
    UNEXPLAINED,
    CallReport,
    Cell,
    Finding,
    HeadStat,
    KernelCall,
    KernelVerdict,
    ModelLine,
    ModelReport,
    Outlier,
    RankSummary,
    SettingChoice,
    SettingPoint,
    TensorDiagnosis,
    WhatIfAnswer,
)

# NaN causes in pipeline order (numerics.cells.diagnose attributes each row to its first).
PIPELINE = (
    "input_nan",
    "inf_input",
    "qk_overflow",
    "mask_sentinel",
    "fully_masked",
    "cast_overflow",
    "exp_overflow",
    "fused_max",
    "sum_overflow",
    "underflow",
    UNEXPLAINED,
)
BAD_VERDICTS = ("nan", "overflow", "zero", "error")
OUTLIER_RATIO = 10.0  # a head's max|q| (or |k|) this many times the median over the call's heads


def used_cell(report: CallReport) -> Cell | None:
    """The cell the model ran, in the call's diagnosis."""
    if report.diagnosis is None or report.cell is None:
        return None
    cells = [c for c in report.diagnosis.cells if (c.method, c.dtype) == report.cell]
    return next((c for c in cells if c.role == MODEL), cells[0] if cells else None)


def known(report: CallReport) -> bool:
    """The call names its implementation: its diagnosis holds the model's cell alone."""
    return report.diagnosis is not None and any(c.role == MODEL for c in report.diagnosis.cells)


def relevant_errors(diag: TensorDiagnosis, cell: Cell | None, every_cell: bool, ignore=()) -> list[str]:
    """Codes of error findings that count for a line: those of the cell judged and of the input
    itself, or with ``every_cell`` (an implementation unknown: every cell is the question) all."""
    name = cell.name if cell is not None else None
    out = [
        f.code
        for f in diag.findings
        if f.severity == "error" and f.code not in ignore and (every_cell or not f.cells or name in f.cells)
    ]
    return list(dict.fromkeys(out))


def cell_line(
    report: CallReport, diag: TensorDiagnosis, cell: Cell | None, ignore=(), every_cell: bool = False
) -> ModelLine:
    """A call judged by one of its cells: its verdict, NaN rows and their first cause, error, headroom."""
    info = report.call
    nan_rows, first, worst, heads = 0, None, None, []
    if cell is not None:
        verdict = counted_verdict(cell, ignore)
        nan_rows = counted_rows(cell.nan_rows, cell.nan_causes, ignore)
        skip = ignored_causes(ignore)
        causes = [c for c in PIPELINE if cell.nan_causes.get(c) and c not in skip]
        causes += [c for c in cell.nan_causes if c not in PIPELINE and c not in skip and cell.nan_causes[c]]
        first = causes[0] if causes and nan_rows else None
        worst = cell.max_abs_err
        per_head = cell.nan_rows_per_head
        heads = [h for h, n in enumerate(per_head) if n]
    else:
        verdict = "n/a"
    overflow_heads = [h.head for h in report.heads if h.qk_overflow]
    if first == "inf_input" and overflow_heads and "qk_overflow" not in ignore:
        first, heads = "qk_overflow", overflow_heads  # the +inf the softmax saw came from Q@K^T
    errors = relevant_errors(diag, cell, every_cell, ignore)
    if verdict in ("ok", "flip", "n/a") and errors:
        verdict = "error"
    limit = None if cell is None else cell.limit
    line = ModelLine(
        info.index,
        info.name,
        info.module,
        info.kind,
        tuple(diag.shape),
        cell.name if cell is not None else None,
        diag.census.max,
        None if limit is None else limit.headroom,
        nan_rows,
        first,
        worst,
        verdict,
        heads,
        errors,
        limit,
    )
    line.rank = info.rank
    if cell is not None and cell.backward is not None:
        _grad_facts(line, cell.backward, ignore)
    if info.kind == "flex" and info.meta.get("score_mod", "none") != "none":
        line.score_mod = info.meta["score_mod"]
        try:
            line.logit_before_mod = float(info.meta["logit_before_mod"])
        except (KeyError, TypeError, ValueError):
            line.logit_before_mod = None
    return line


def _grad_facts(line: ModelLine, b, ignore=()) -> None:
    """The backward of the line's cell: NaN/inf gradient rows (less ignored causes), their first cause
    in backward order, the gradients holding them, and the loss-scale headroom."""
    skip = {cause for code in ignore for cause in GRAD_CAUSES_OF.get(code, ())}
    counted = {name: sum(n for c, n in g.causes.items() if c not in skip) for name, g in b.grads()}
    causes = {c for _, g in b.grads() for c, n in g.causes.items() if n and c not in skip}
    line.grad_nan_rows = sum(counted.values())
    line.grad_which = [name for name, n in counted.items() if n]
    line.grad_cause = next((c for c in GRAD_CAUSES if c in causes), None)
    line.grad_headroom, line.grad_headroom_at = b.scale_headroom, b.headroom_at


def call_line(report: CallReport, ignore=()) -> ModelLine:
    info, d = report.call, report.diagnosis
    if d is None:
        return ModelLine(
            info.index,
            info.name,
            info.module,
            info.kind,
            info.shape,
            None,
            None,
            None,
            0,
            None,
            None,
            "skipped",
            rank=info.rank,
        )
    line = cell_line(report, d, used_cell(report), ignore, every_cell=not known(report))
    if report.cell is not None and line.cell is None:
        line.cell = f"{report.cell[0]}/{report.cell[1]}"
    return line


def outliers(report: CallReport, ratio: float = OUTLIER_RATIO) -> list[Outlier]:
    """Heads whose max|q| or max|k| is at least ``ratio`` times the median over the call's other heads. k is
    judged per kv head: under GQA a group of query heads reads one kv head, and a median over the query heads
    would count a bad kv head once per head of its group (half the heads with 2 kv heads: no outlier at all)."""
    out = []
    heads = report.heads
    if any(h.q_max_abs is None or h.k_max_abs is None for h in heads):
        return out
    groups: dict[int, list[HeadStat]] = {}
    for h in heads:
        groups.setdefault(h.head if h.kv_head is None else h.kv_head, []).append(h)
    shared = any(len(g) > 1 for g in groups.values())
    units = {"q": [(h.q_max_abs, [h]) for h in heads], "k": [(g[0].k_max_abs, g) for g in groups.values()]}
    for tensor, values in units.items():
        if len(values) < 2:
            continue
        for i, (v, members) in enumerate(values):
            median = statistics.median(x for j, (x, _) in enumerate(values) if j != i)
            if median > 0 and v >= ratio * median:
                kv = members[0].kv_head if tensor == "k" and shared else None
                reads = [h.head for h in members] if kv is not None else []
                out.append(
                    Outlier(
                        report.call.index,
                        report.call.module,
                        members[0].head,
                        tensor,
                        v,
                        median,
                        v / median,
                        kv_head=kv,
                        query_heads=reads,
                        rank=report.call.rank,
                    )
                )
    return out


# A what-if judges each call on the inputs it recorded: NaN or inf already in them came from an
# earlier call (or the data), not from the dtype or implementation asked about; the model's own
# report has them.
INHERITED = ("input_nan", "inf_input")


def findings_in_order(
    calls: list[CallReport], first_bad: int | None = None, ignore=()
) -> list[tuple[str, str, int, str, str | None]]:
    """Each finding code once: (code, its worst severity, the calls holding it, the first of them, and for a
    consequence the call it follows from), causes before consequences. The first call that goes wrong
    (``first_bad``, a position in ``calls``; found here when None) holds the root cause: its codes come
    first, the one of its line's first cause leading (qk_overflow before the +inf it put in the scores);
    NaN or +inf a later call inherits in its inputs (``INHERITED``: input_nan, inf_input) is that cause's
    consequence and follows it, whatever its severity; the rest by severity."""
    if first_bad is None:
        first_bad = next((i for i, c in enumerate(calls) if call_line(c, ignore).verdict in BAD_VERDICTS), None)
    rank = {"error": 0, "warning": 1, "info": 2}
    seen: dict[str, list] = {}  # code -> [severity, calls, first call's name, position of the first call]
    for i, c in enumerate(calls):
        if c.diagnosis is None:
            continue
        for f in c.diagnosis.findings:
            on = "" if c.call.rank is None else f"r{c.call.rank} "  # a capture of several processes
            entry = seen.setdefault(f.code, [f.severity, 0, on + (c.call.module or c.call.name), i])
            entry[1] += 1
            if rank[f.severity] < rank[entry[0]]:
                entry[0] = f.severity
    root = None if first_bad is None else calls[first_bad]
    root_name = (
        None
        if root is None
        else (
            f"#{root.call.index} "
            + ("" if root.call.rank is None else f"r{root.call.rank} ")
            + (root.call.module or root.call.name)
        )
    )
    cause = None if root is None else call_line(root, ignore).first_cause

    def place(item) -> tuple[int, int, int]:
        code, (severity, _, _, at) = item
        if root is not None and at == first_bad:
            return 0, 0 if cause in CAUSES_OF.get(code, ()) else 2 if code in INHERITED else 1, rank[severity]
        if root is not None and code in INHERITED and at > first_bad:
            return 1, 0, rank[severity]
        return 2, 0, rank[severity]

    ordered = sorted(seen.items(), key=place)
    return [
        (code, sev, n, name, root_name if place((code, (sev, n, name, at)))[0] == 1 else None)
        for code, (sev, n, name, at) in ordered
    ]


def what_if_answers(calls: list[CallReport], ignore=()) -> list[WhatIfAnswer]:
    """Per what-if cell (by name, over the calls that computed it): how many calls it breaks, the
    first, and its findings (inherited NaN and inf left to the model's report)."""
    ignore = (*ignore, *INHERITED)
    by_name: dict[str, list[tuple[CallReport, Cell]]] = {}
    for report in calls:
        if report.what_if is None:
            continue
        for cell in report.what_if.cells:
            by_name.setdefault(cell.name, []).append((report, cell))
    answers = []
    for name, hits in by_name.items():
        lines = [cell_line(r, r.what_if, c, ignore) for r, c in hits]
        bad = [line for line in lines if line.verdict in BAD_VERDICTS]
        rooms = [line for line in lines if line.headroom is not None]
        least = min(rooms, key=lambda line: line.headroom) if rooms else None
        errs = [line.worst_err for line in lines if line.worst_err is not None]
        codes: dict[str, int] = {}
        for r, c in hits:
            for code in dict.fromkeys(f.code for f in r.what_if.findings if not f.cells or c.name in f.cells):
                if code not in ignore:
                    codes[code] = codes.get(code, 0) + 1
        answers.append(
            WhatIfAnswer(
                name,
                len(lines),
                len(bad),
                bad[0] if bad else None,
                sum(line.nan_rows for line in lines),
                max(errs) if errs else None,
                None if least is None else least.headroom,
                None if least is None else least.limit,
                codes,
            )
        )
    return answers


# Two settings whose errors differ by less than this share of the larger one tie (a tie goes to the kernel's
# default): the grid's errors are maxima over rows, and a few percent between two settings is one row's rounding.
SETTING_TIE = 0.01


def _point(diag: TensorDiagnosis, cell: Cell, metric: str, ignore=()) -> SettingPoint:
    codes = [f.code for f in diag.findings if cell.name in f.cells and f.code not in ignore]
    errors = [f for f in diag.findings if cell.name in f.cells and f.severity == "error" and f.code not in ignore]
    # a saturating cast (FP8 P above the format's max) corrupts O without a NaN: the setting breaks the call
    clipped = any(n and EVENTS.get(e) == "saturation" and e not in ignore for e, n in cell.events.items())
    bad = counted_verdict(cell, ignore) in BAD_VERDICTS or bool(errors) or clipped
    setting = cell.setting or {}
    return SettingPoint(
        label=cell.variant or "",
        cell=cell.name,
        values={k: v for k, v in setting.items() if k not in ("default", "refused")},
        default=bool(setting.get("default")),
        refused=setting.get("refused"),
        err=getattr(cell, metric),
        verdict=counted_verdict(cell, ignore),
        findings=list(dict.fromkeys(codes)),
        events={e: n for e, n in cell.events.items() if n and e not in ignore},
        headroom=None if cell.limit is None else cell.limit.headroom,
        calls_bad=int(bad),
    )


def _choose(points: list[SettingPoint]) -> str | None:
    """The best point: the least error among those the kernel takes (not refused) that break nothing; a point
    within SETTING_TIE of the least ties with it, and a tie goes to the default."""
    fit = [p for p in points if p.refused is None and not p.calls_bad and p.err is not None]
    if not fit:
        return None
    least = min(p.err for p in fit)
    tied = [p for p in fit if p.err - least <= SETTING_TIE * max(p.err, least)]
    return next((p for p in tied if p.default), min(tied, key=lambda p: p.err)).label


def _metric(cells: list[Cell]) -> str:
    """The output's error where the cells computed O (V given), else the probabilities': a mean over the row
    (relative L1, RMSE), not the largest element's error, which the FP8 P cast's rounding of one row sets alike
    for every setting (on PR 2694's setup max |O - O64| was 0.166 at each setting that does not saturate)."""
    return "out_rel_l1" if any(c.out_rel_l1 is not None for c in cells) else "rmse"


def setting_choices(diag: TensorDiagnosis, ignore=()) -> list[SettingChoice]:
    """Each settings grid of a diagnosis (cells of one path and dtype with a ``variant``: ``--what-if fa4``), its
    points judged by their error against float64 and the best named."""
    groups: dict[tuple[str, str], list[Cell]] = {}
    for c in diag.cells:
        if c.variant is not None and c.path is not None:
            groups.setdefault((c.path, c.dtype), []).append(c)
    out = []
    for (path, dtype), cells in groups.items():
        metric = _metric(cells)
        points = [_point(diag, c, metric, ignore) for c in cells]
        default = next((p.label for p in points if p.default), None)
        out.append(SettingChoice(path, dtype, metric, points, _choose(points), default, tie=SETTING_TIE))
    return out


def call_settings(report: CallReport, ignore=()) -> list[SettingChoice]:
    """One call's settings grids (its what-if cells, or a q/k file's asked cells), each with its best."""
    ignore = (*ignore, *INHERITED)
    return [
        ch for diag in (report.diagnosis, report.what_if) if diag is not None for ch in setting_choices(diag, ignore)
    ]


def settings_refused(calls: list[CallReport]) -> list[tuple[str, int, str]]:
    """The grids a kernel would not run some calls in: (grid, how many calls, the first call's why)."""
    found: dict[str, list[str]] = {}
    for report in calls:
        for grid, why in report.settings_refused.items():
            found.setdefault(grid, []).append(why)
    return [(grid, len(whys), whys[0]) for grid, whys in found.items()]


def model_settings(calls: list[CallReport], ignore=()) -> list[SettingChoice]:
    """Each settings grid over every call that computed it: a point's error is its worst call's, its findings
    those of any call, ``calls_bad`` the calls it broke; the best named as for one call."""
    gathered: dict[tuple[str, str, str], list[SettingChoice]] = {}
    for report in calls:
        for choice in call_settings(report, ignore):
            gathered.setdefault((choice.path, choice.dtype, choice.metric), []).append(choice)
    out = []
    for (path, dtype, metric), choices in gathered.items():
        points: dict[str, SettingPoint] = {}
        for choice in choices:
            for p in choice.points:
                if p.label not in points:
                    points[p.label] = replace(p, findings=list(p.findings), events=dict(p.events))
                    continue
                q = points[p.label]
                q.err = max((e for e in (q.err, p.err) if e is not None), default=None)
                q.verdict = q.verdict if q.verdict in BAD_VERDICTS else p.verdict
                q.findings = list(dict.fromkeys(q.findings + p.findings))
                q.events = {e: q.events.get(e, 0) + p.events.get(e, 0) for e in {**q.events, **p.events}}
                rooms = [h for h in (q.headroom, p.headroom) if h is not None]
                q.headroom = min(rooms) if rooms else None
                q.calls_bad += p.calls_bad
        found = list(points.values())
        default = next((p.label for p in found if p.default), None)
        out.append(SettingChoice(path, dtype, metric, found, _choose(found), default, len(choices), SETTING_TIE))
    return out


def _recorded_on(info) -> str | None:
    """'cuda:0, NVIDIA H100 80GB HBM3, sm 9.0' for a call the capture recorded on a GPU; None on a CPU."""
    device = info.meta.get("device", "")
    if not device or device.split(":")[0] == "cpu":
        return None
    parts = [
        device,
        info.meta.get("gpu_name", ""),
        f"sm {info.meta['capability']}" if info.meta.get("capability") else "",
    ]
    return ", ".join(p for p in parts if p)


def kernel_call(report: CallReport, position: int, ignore=()) -> KernelCall | None:
    """A call replayed under every kernel that could have run it (``--what-if kernels``): the kernel that
    ran it (the model's cell, where it is a kernel path), each what-if cell of a kernel path in the call's
    dtype, and the kernels that could not have run it with why. None for a call not replayed."""
    used = used_cell(report)
    if used is None or report.kernel_dtype is None:
        return None
    dtype = report.kernel_dtype
    replays = [(True, report.diagnosis, used)] if used.path is not None and PATHS.get(used.path).replay else []
    if report.what_if is not None:
        replays += [
            (False, report.what_if, c)
            for c in report.what_if.cells
            if c.path is not None and PATHS.get(c.path).replay and c.dtype == dtype and c.variant is None
        ]
    kernels = []
    for ran, diag, cell in replays:
        line = cell_line(report, diag, cell, ignore)
        spec = PATHS.get(cell.path)
        hazard = next(
            (e for e, kind in EVENTS.items() if kind == "backward" and cell.events.get(e) and e not in ignore), None
        )
        kernels.append(
            KernelVerdict(
                cell.path,
                dtype,
                ran,
                line.verdict,
                line.nan_rows,
                line.first_cause,
                cell.events.get(hazard, 0) if hazard else 0,
                hazard,
                cell.event_values.get(hazard) if hazard else None,
                None,
                cell.out_max_abs_err,
                spec.assumed is not None,
            )
        )
    kernels += [KernelVerdict(p, dtype, verdict="refused", refused=why) for p, why in report.kernels_refused.items()]
    order = {spec.name: i for i, spec in enumerate(PATHS)}
    kernels.sort(key=lambda k: (not k.ran, order.get(k.path, len(order))))
    info = report.call
    return KernelCall(position, info.module or info.name, kernels)


def model_report(calls: list[CallReport], ignore=(), skipped=(), capture: dict | None = None) -> ModelReport:
    lines = [call_line(c, ignore) for c in calls]
    first = next((i for i, line in enumerate(lines) if line.verdict in BAD_VERDICTS), None)
    first_grad = next((i for i, line in enumerate(lines) if line.grad_verdict in ("nan", "error")), None)
    found = [replace(o, position=at) for at, c in enumerate(calls) for o in outliers(c)]
    by_rank = capture_findings_by_rank(capture, ignore)
    findings = [f for found in by_rank.values() for f in found]
    caps = [
        c.diagnosis.attention.softcap
        for c in calls
        if c.diagnosis is not None
        and c.diagnosis.attention is not None
        and c.diagnosis.attention.softcap is not None
        and c.diagnosis.attention.softcap.not_judged
    ]
    if caps:  # said, not silently left out: no backward or what-if cell emulates a soft cap (calls.py)
        what = " and ".join(dict.fromkeys(w for cap in caps for w in cap.not_judged))
        said = f"{len(caps)} soft-capped call(s): {what} not computed (no backward or what-if path has the cap's tanh)"
        capture = dict(capture or {})
        capture["note"] = "; ".join(n for n in (capture.get("note"), said) if n)
    kernels = [k for at, c in enumerate(calls) if (k := kernel_call(c, at, ignore)) is not None]
    places = {_recorded_on(c.call) for c in calls}
    sinks, pairs = sink_rate(calls)
    return ModelReport(
        lines,
        first,
        found,
        tuple(ignore),
        list(skipped),
        capture,
        what_if_answers(calls, ignore),
        known=any(known(c) for c in calls),
        first_grad_bad=first_grad,
        findings=findings,
        ranks=rank_summaries(calls, lines, capture, by_rank),
        kernels=kernels,
        recorded_on=places.pop() if len(places) == 1 else None,
        settings=model_settings(calls, ignore),
        call_settings=[(at, found) for at, c in enumerate(calls) if (found := call_settings(c, ignore))],
        settings_refused=settings_refused(calls),
        decode=decode_runs(lines, calls),
        head_marks=head_marks(calls, ignore),
        sink_hits=sinks,
        sink_pairs=pairs,
    )


def capture_findings_by_rank(capture: dict | None, ignore=()) -> dict[int | None, list[Finding]]:
    """The findings of the capture itself, less the ignored codes: per rank for a capture of several
    processes (torchrun), else under None."""
    if not capture:
        return {}
    ranks = capture.get("ranks")
    if isinstance(ranks, list):
        rope = capture.get("rope") or ()  # each rank's own tables, named by its rank
        found = {
            r.get("rank"): capture_findings(r, r.get("rank"))
            + rope_findings([c for c in rope if c.rank == r.get("rank")])
            for r in ranks
        }
    else:
        rank = capture.get("rank") if (capture.get("world") or 1) > 1 else None
        found = {rank: capture_findings(capture, rank) + rope_findings(capture.get("rope"))}
    return {rank: [f for f in fs if f.code not in ignore] for rank, fs in found.items()}


def rank_summaries(
    calls: list[CallReport], lines: list[ModelLine], capture: dict | None, by_rank: dict[int | None, list[Finding]]
) -> list[RankSummary]:
    """Each rank's own account, where the calls come from several processes (a torchrun capture)."""
    ranks = sorted({c.call.rank for c in calls if c.call.rank is not None})
    facts = {r.get("rank"): r for r in (capture or {}).get("ranks") or [] if isinstance(r, dict)}
    if not facts and capture and isinstance(capture.get("rank"), int):
        facts = {capture["rank"]: capture}
    out = []
    for rank in ranks:
        mine = [i for i, c in enumerate(calls) if c.call.rank == rank]
        diags = [calls[i].diagnosis for i in mine if calls[i].diagnosis is not None]
        sev = [f.severity for d in diags for f in d.findings] + [f.severity for f in by_rank.get(rank, [])]
        first = next((i for i in mine if lines[i].verdict in BAD_VERDICTS), None)
        complete = facts.get(rank, {}).get("complete") is not False
        out.append(RankSummary(rank, len(mine), sev.count("error"), sev.count("warning"), first, complete))
    return out


def head_findings(report: CallReport, diag_findings: list[Finding]) -> list[Finding]:
    """A ``qk_overflow`` finding naming the heads whose Q@K^T overflows the call's dtype, when
    the diagnosis has none of its own (scores recorded at a softmax carry the +inf it made)."""
    over = [h for h in report.heads if h.qk_overflow]
    audit = None if report.diagnosis is None else report.diagnosis.attention
    capped = audit is not None and audit.softcap is not None  # a soft cap's overflow is softcap_overflow
    if not over or capped or any(f.code == "qk_overflow" for f in diag_findings):
        return []
    dtype = report.call.dtype or "its dtype"
    cell = used_cell(report)
    hit = [cell.name] if cell is not None and cell.nan_causes.get("inf_input") else []
    rows = cell.nan_causes.get("inf_input", 0) if hit else 0
    where = ", ".join(f"head {h.head} ({h.qk_overflow})" for h in over[:6]) + (", ..." if len(over) > 6 else "")
    qk = "; ".join(f"head {h.head}: max|q| {plain(h.q_max_abs)}, max|k| {plain(h.k_max_abs)}" for h in over[:3])
    message = f"Q@K^T overflows {dtype} as the model computes it, in {where} score(s); {qk}" + (
        f"; the softmax saw +inf there -> {rows} NaN row(s) in {hit[0]}" if hit else ""
    )
    return [Finding("qk_overflow", SEVERITY["qk_overflow"], message, FIX["qk_overflow"], hit, rows)]
