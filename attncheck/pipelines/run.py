"""``attncheck run`` as a library call: a ``RunRequest`` in, a ``RunResult`` out.

Score files stream in row blocks within ``options.chunk_elements``; Q, K and a mask
are loaded whole and their scores computed per dtype in row blocks. Under torchrun the
calls are split over the ranks (``_run_split``; ``pipelines.ranks``).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Callable

import torch

from attncheck import loaders, params
from attncheck.config.run import QKSpec, RunRequest, check_row_fits
from attncheck.demo import EXAMPLE_NAME, example_scores
from attncheck.devices import resolve_device
from attncheck.errors import AttncheckError, param
from attncheck.findings import apply_ignore
from attncheck.findings.kvcache import judge_kv
from attncheck.judge import attach_backward, diagnose, diagnose_attention, diagnose_call, diagnose_chunks
from attncheck.loaders import TensorSource, open_sources
from attncheck.loaders.calls import check_manifest_message, open_inputs
from attncheck.model import model_report, setting_choices
from attncheck.numerics.backward.diagnose import GradInputs
from attncheck.numerics.cells.calls import scores_report
from attncheck.numerics.cells.plan import cell_dtype_name, grid, judged_by, setting_cells
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.numerics.precision import dtype_from_name, dtype_label
from attncheck.options import rows_per_chunk
from attncheck.pipelines.kvcache import AmaxPass, KVCall, asks_of, capture_calls, needs_amax, run_kv
from attncheck.pipelines.lowsum import attach_lowsum
from attncheck.pipelines.ranks import Share, exchange, split_job, use_rank_gpu
from attncheck.pipelines.rope import capture_rope_checks
from attncheck.results import CallInfo, CallReport, RunResult, TensorDiagnosis

Track = Callable[[str, int], "Callable[[int], None] | None"]  # (tensor name, rows) -> rows-done callback


def run(request: RunRequest, track: Track | None = None, notice: Callable[[str], None] | None = None) -> RunResult:
    """Diagnose every tensor and call the request names; ``track`` gives a progress callback per
    tensor, ``notice`` hears one line before the fused kernels compile for the first time.

    Files are read as calls where they are: capture directories and call files, and files
    whose tensors are named like q/k/v/mask; other tensors are scores. The result holds a
    diagnosis per tensor, a report per call and the model report over them.
    """
    track = track or (lambda name, rows: None)
    if request.split_ranks:
        job = split_job()
        if job is not None:  # under torchrun: the calls split over the ranks
            return _run_split(request, job, track, notice)
    dev = resolve_device(request.options.device)
    options = replace(request.options, device=str(dev))  # 'auto' -> where it runs, as the report says
    budget = request.max_memory
    capture = None
    skipped: list[tuple[str, str]] = []
    prepared = None
    amax = None  # the KV cache's calibrated scales: the capture's amax, gathered as the calls are diagnosed
    if params.kv_what_ifs(request.what_if):
        amax = AmaxPass(request.max_memory) if needs_amax(asks_of(request.what_if)) else None
    if request.qk is not None:
        sources = open_sources_for(request)
        prepared = qk_inputs(request.qk, budget)
        diags = _run_qk(request.qk, sources, options, track, notice, budget, request.what_if, prepared)
        calls = [
            scores_report(CallInfo(i, d.name, "qk" if not sources else "scores", has_qk=True), d)
            for i, d in enumerate(diags)
        ]
    elif request.example:
        x = example_scores()
        diags = [diagnose(EXAMPLE_NAME, x, options, track(EXAMPLE_NAME, x.numel() // x.shape[-1]), notice)]
        calls = [scores_report(CallInfo(0, EXAMPLE_NAME, "scores"), diags[0])]
    else:
        calls, capture, skipped = _run_files(request, options, track, notice, amax)
        diags = [c.diagnosis for c in calls if c.diagnosis is not None]
    sums = _sums(request, options, diags, calls)
    if request.accumulate and options.bounded is not None and notice is not None:  # sums: not bounded by rows
        notice(
            "--accumulate: the 16-bit sums are computed over every row of every call, exactly: "
            "--budget/--rows do not bound them (as slow as without those options)"
        )
    model = _judged(request, diags, calls, skipped, capture)
    if params.WHAT_IF_NOSINKS in request.what_if and notice is not None and not any(c.sinks for c in calls):
        notice("--what-if nosinks: no call has learned sinks (gpt-oss's): nothing to drop, nothing computed")
    kv = _run_kv(request, prepared, amax) if params.kv_what_ifs(request.what_if) else None
    return RunResult(diags, device_label(dev), calls, model, kv=kv, sums=sums)


def _sums(request: RunRequest, options, diags: list, calls: list):
    """--accumulate: sums kept in 16 bits, judged beside the cells before --ignore applies; a capture's calls give
    their own report (pipelines.lowsum), returned (None without one)."""
    if not request.accumulate:
        return None
    return attach_lowsum(request, options, diags, calls, qk_inputs)


def _judged(request: RunRequest, diags: list, calls: list, skipped: list, capture):
    """The diagnoses less what --ignore drops, their settings chosen again, and the model report over the calls."""
    for d in diags + [c.what_if for c in calls if c.what_if is not None]:
        apply_ignore(d, request.ignore)
        d.choices = setting_choices(d, request.ignore)  # judged again on the findings that count
    return model_report(calls, request.ignore, skipped, capture)


def _run_split(request: RunRequest, job, track: Track, notice) -> RunResult:
    """Under torchrun: each rank diagnoses its share of the calls (and its layers' KV-cache what-if) on its own device,
    rank 0 puts the parts in call order and judges them as one process would, and every rank returns that result.
    A run of one computation (--q/--k, the example) is rank 0's alone."""
    share = Share(job)
    files = request.qk is None and not request.example

    def work():
        use_rank_gpu(job, request.options.device)
        if not files:
            return run(replace(request, split_ranks=False), track, notice) if job.rank == 0 else None
        dev = resolve_device(request.options.device)
        calls, capture, _ = _run_files(request, replace(request.options, device=str(dev)), track, notice, share=share)
        kv = _run_kv(request, None, share=share) if params.kv_what_ifs(request.what_if) else None
        return dev, list(zip(share.positions, calls)), capture, kv

    def merge(parts: list) -> RunResult:
        if not files:
            return parts[0]
        dev, _, capture, _ = parts[0]
        calls = [c for _, c in sorted((pc for part in parts for pc in part[1]), key=lambda pc: pc[0])]
        skipped = [(c.call.name, c.error) for c in calls if c.diagnosis is None and c.error is not None]  # --partial
        diags = [c.diagnosis for c in calls if c.diagnosis is not None]
        sums = _sums(request, request.options, diags, calls)  # rank 0 alone: after the calls are put in order
        model = _judged(request, diags, calls, skipped, capture)
        kv = _merge_kv(request, [part[3] for part in parts], share.kv_layers) if parts[0][3] is not None else None
        return RunResult(diags, device_label(dev), calls, model, kv=kv, sums=sums)

    return exchange(job, work, merge, lambda: share.at)


def _merge_kv(request: RunRequest, reports: list, layers: list[str]):
    """The KV-cache what-if's parts, one per rank (each a set of whole layers), as one report in the capture's layer
    order, judged over every head."""
    report = reports[0]
    for i, what in enumerate(report.caches):
        heads = [h for part in reports for h in part.caches[i].heads]
        what.heads = sorted(heads, key=lambda h: (layers.index(h.module), h.kv_head))
    judge_kv(report)
    for what in report.caches:
        what.findings = [f for f in what.findings if f.code not in request.ignore]
    return report


def _run_kv(request: RunRequest, prepared, amax=None, share=None):
    """--what-if kv:...: the KV cache over the capture's calls (or --q/--k/--v), its findings less those ignored;
    ``share``: one rank's layers alone (pipelines.ranks)."""
    asks = asks_of(request.what_if)
    if prepared is not None:
        q_name, k_name, q, v, inputs = prepared
        if v is None:
            raise AttncheckError(f"{param('what_if')} kv:... computes attention from the cache: give {param('v')}")
        calls, skipped = [KVCall("", 0, lambda: (inputs, _kv_dtype(q.dtype)))], []
    else:
        items = [i for i in open_inputs(request.paths, request.keys, request.max_memory)[0] if hasattr(i, "info")]
        calls, skipped = capture_calls(items, request.max_memory)
        if not calls:
            raise AttncheckError(
                f"{param('what_if')} kv:... replays attention calls whose q, k and v were recorded (SDPA, flash_attn, "
                "q/k/v files); these inputs hold none"
            )
        if share is not None:  # this rank's layers, each with every one of its calls: their amax computed here
            calls, amax = share.kv_calls(calls), None
    report = run_kv(asks, calls, skipped, None if prepared is not None else amax)
    report.dumps = prepared is not None
    if share is None:  # a rank's share may hold none of a cache's calls: the merged report is whole
        _nothing_replayed(report)
    for what in report.caches:
        what.findings = [f for f in what.findings if f.code not in request.ignore]
    return report


def _nothing_replayed(report) -> None:
    """A cache asked that replays no call (kv:int4:g7: no call is whole groups of 7) is refused in one line, its
    first call's reason given: an exit 0 with nothing computed would pass any --fail-on."""
    for what in report.caches:
        if not what.heads:
            why = next((w for _, w in report.skipped if w.startswith(f"{what.name}:")), "")
            why = f": {why.removeprefix(what.name + ': ')}" if why else ""
            raise AttncheckError(f"{param('what_if')} {what.name} replays no call{why}")


def _kv_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache's attention computes in for q given as a file: q's, where a cell computes in it, else fp32."""
    return dtype_from_name(cell_dtype_name(dtype_label(dtype)) or "fp32")


def open_sources_for(request: RunRequest):
    return open_sources(request.paths, request.keys, max_bytes=request.max_memory) if request.paths else []


def _run_files(request: RunRequest, options, track: Track, notice, amax=None, share=None):
    """Every input of the files as a call report, in natural order; bad calls raise, or with
    ``partial`` are skipped and listed. ``amax``: a KV-cache amax pass that sees each call's tensors;
    ``share``: one rank's share of the inputs alone (pipelines.ranks)."""
    inputs, manifests = open_inputs(
        request.paths, request.keys, request.max_memory
    )  # headers only: score tensors stream in row chunks
    if options.paths and all(isinstance(item, TensorSource) for item in inputs):
        raise AttncheckError(
            f"{param('paths')} applies to attention calls (a capture, q/k files) and to {param('q')}/{param('k')}; "
            f"{', '.join(request.paths)} hold{'s' if len(request.paths) == 1 else ''} scores only"
        )
    _check_scores_only(request, options, inputs, manifests)
    capture = _capture_of(request, manifests)
    if not request.partial:  # every call checked before the first is diagnosed
        for item in inputs:
            if not isinstance(item, TensorSource) and item.problem:
                raise AttncheckError(item.problem)
    captured = [
        item
        for item in inputs
        if not isinstance(item, TensorSource) and item.info.kind not in ("qk", "scores", "unknown")
    ]
    cell_what_if = _check_what_ifs(request, options, inputs, captured)
    calls, skipped = _diagnose_inputs(request, options, inputs, cell_what_if, track, notice, amax, share)
    return calls, capture, skipped


def _capture_of(request: RunRequest, manifests: list[dict]):
    """The capture's facts (every rank's under torchrun) and the RoPE checks of its rotary tables; None for files
    that are no capture."""
    capture = None
    ranked = all(isinstance(d.get("rank"), int) and (d.get("world") or 1) > 1 for d in manifests)
    if len(manifests) > 1 and ranked:  # every rank of one torchrun capture
        ranks = [dict(capture_facts(d), rank=d["rank"]) for d in manifests]
        notes = [f"rank {r['rank']}: {r['note']}" for r in ranks if r["note"]]
        capture = {
            "note": "; ".join(notes) or None,
            "world": manifests[0]["world"],
            "run_id": manifests[0].get("run_id"),
            "calls": sum(r["calls"] for r in ranks),
            "ranks": ranks,
        }
    elif manifests:
        capture = capture_facts(manifests[0])
    rope = capture_rope_checks(request.paths, request.rope_what_if)  # the rotary tables the calls ran under
    if rope:
        capture = {**(capture or {}), "rope": rope}
    elif request.rope_what_if:  # a capture of a model without RoPE: said in the report, not silently skipped
        capture = {**(capture or {}), "rope_what_if_unanswered": list(request.rope_what_if)}
    return capture


def _check_scores_only(request: RunRequest, options, inputs, manifests) -> None:
    """Options that apply to captures or Q/K calls alone, refused on files that give them nothing to act on (they
    were silently ignored): --what-if rope:DTYPE without a capture, --rows/--budget on scores alone."""
    held = f"{', '.join(request.paths)} hold{'s' if len(request.paths) == 1 else ''}"
    if request.rope_what_if and not manifests:
        raise AttncheckError(
            f"{param('what_if')} rope:DTYPE recomputes the rotary tables a capture recorded; {held} no capture, so "
            "no rotary table"
        )
    bounded = options.bounded
    if bounded is not None and inputs and all(isinstance(item, TensorSource) for item in inputs):
        name = param("rows") if bounded.rows is not None else param("budget")
        raise AttncheckError(
            f"{name} bounds the time of attention calls computed from Q and K (a capture, {param('q')}/{param('k')}); "
            f"{held} scores only, which are diagnosed whole"
        )


def _check_what_ifs(request: RunRequest, options, inputs, captured) -> tuple[str, ...]:
    """The cell what-ifs asked, refused where they do not apply (FA4 settings, the FP8 accumulator, files whose
    implementation is not known): the cell what-ifs."""
    cell_what_if = params.cell_what_ifs(request.what_if)  # the KV cache's what-ifs run apart (_run_kv)
    sweeps_only = all(w in params.setting_sweeps() for w in cell_what_if)  # asked of any Q/K input (fa4's grid)
    _check_fa4_applies(request, options, inputs, captured)
    if (options.fp8_accum != params.FP8_ACCUM_KERNEL or options.fp8_flush is not None) and not captured and inputs:
        if all(isinstance(item, TensorSource) for item in inputs):
            raise AttncheckError(
                f"{param('fp8_accum')} and {param('fp8_flush')} set the accumulator of the FP8 kernels' tensor-core "
                f"products, computed from {param('q')} and {param('k')} or a capture; "
                f"{'the file holds' if len(request.paths) == 1 else 'the files hold'} scores only"
            )
    if cell_what_if and inputs and not captured and not sweeps_only:
        raise AttncheckError(
            f"{param('what_if')} asks what would break if a captured model's calls ran otherwise; these files "
            f"hold plain scores or q/k tensors, whose implementation is not known: every cell asked is computed "
            f"already (choose them with {param('dtypes')}, {param('methods')}, {param('paths')})"
        )
    return cell_what_if


def _diagnose_inputs(request: RunRequest, options, inputs, cell_what_if, track: Track, notice, amax, share):
    """Each input diagnosed (this rank's share alone under torchrun): (the call reports, the calls skipped)."""
    calls: list[CallReport] = []
    skipped: list[tuple[str, str]] = []
    mine = share.calls([_cost(item) for item in inputs]) if share is not None else None
    for i, item in enumerate(inputs):
        if mine is not None:  # under torchrun: this rank's calls alone
            if i not in mine:
                continue
            share.at = (1, i)
        if isinstance(item, TensorSource):
            check_row_fits(item.name, item.shape[-1], request.max_memory)
            blocks = item.row_blocks(rows_per_chunk(item.shape[-1], options))
            diag = diagnose_chunks(
                item.name, item.shape, item.dtype, blocks, options, track(item.name, item.rows), notice=notice
            )
            calls.append(scores_report(CallInfo(i, item.name, "scores", dtype=dtype_label(item.dtype)), diag))
            continue
        info = item.info
        try:
            if item.problem:
                raise AttncheckError(item.problem)
            tensors = item.load()
            if amax is not None:
                amax.observe(info, tensors)
            rows = _score_rows(tensors)
            calls.append(
                diagnose_call(
                    info,
                    tensors,
                    options,
                    track(info.name, rows),
                    notice,
                    cell_what_if,
                    options if request.grid_asked else None,
                    max_bytes=request.max_memory,
                )
            )
        except AttncheckError as e:
            if not request.partial:
                raise
            skipped.append((info.name, e.render()))
            calls.append(CallReport(info, None, error=e.render()))
    return calls, skipped


def _cost(item) -> int:
    """The score elements of an input (a call's from its recorded shape), which splits calls over ranks evenly."""
    shape = item.info.shape if hasattr(item, "info") else item.shape
    return math.prod(shape) if shape else 1


def capture_facts(doc: dict) -> dict:
    """What the report says of a capture, from its manifest."""
    return {
        "note": check_manifest_message(doc),
        "stopped": doc.get("stopped"),
        "script": doc.get("script"),
        "calls": len(doc.get("calls", [])),
        "torch_version": doc.get("torch_version"),
        "compile": doc.get("compile"),
        "complete": doc.get("complete"),
        "error": doc.get("error"),
        "first_unrecorded": doc.get("first_unrecorded"),
        "rank": doc.get("rank"),
        "world": doc.get("world"),
    }


def _score_rows(tensors: dict) -> int:
    """Rows of the score tensor a call makes (for the progress bar)."""
    if "scores" in tensors:
        t = tensors["scores"]
        return t.numel() // max(1, t.shape[-1])
    q = tensors["q"]
    return q.numel() // max(1, q.shape[-1])


def device_label(dev: torch.device) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H100 ...)'."""
    label = str(dev)
    if dev.type == "cuda":
        label += f" ({torch.cuda.get_device_name(dev)})"
    return label


def split_spec(spec: str) -> tuple[str, str | None]:
    """PATH or PATH:KEY -> (path, key): the key starts after the first ':' at which the part
    before it names an existing file (keys may hold ':' themselves), else after the last."""
    if _exists(spec) or ":" not in spec:
        return spec, None
    cuts = [i for i, ch in enumerate(spec) if ch == ":"]
    for i in cuts:
        if _exists(spec[:i]):
            return spec[:i], spec[i + 1 :]
    return spec[: cuts[-1]], spec[cuts[-1] + 1 :]


def _exists(path: str) -> bool:
    try:
        return os.path.isfile(path)
    except (OSError, ValueError):
        return False


def load_one(spec: str, name: str, kind: str = "scores", max_bytes: int | None = None) -> tuple[str, torch.Tensor]:
    """PATH or PATH:KEY -> (name, tensor); the file must hold exactly one selected tensor.
    ``name`` is the parameter the spec was given as (q, k, mask)."""
    path, key = split_spec(spec)
    # loaders.load_tensors looked up when called: tests replace it to prove that a path never loads a file whole
    found = loaders.load_tensors([path], [key] if key else [], kind=kind, max_bytes=max_bytes)
    if len(found) != 1:
        names = ", ".join(t.name for t in found[:6])
        raise AttncheckError(
            f"{param(name)} {spec} selects {len(found)} tensors ({names}); pick one with {param(name)} PATH:KEY"
        )
    return found[0].name, found[0].tensor


def _with_mask_facts(inputs, mask: str):
    """Q/K files' inputs with what a kernel path reads of how the mask was given: a mask tensor or padding
    ('explicit'), --causal alone ('causal', the kernels' own causal mask), or none."""
    return replace(inputs, call=inputs.facts("", mask))


def _run_qk(
    qk: QKSpec,
    sources,
    options,
    track: Track,
    notice,
    max_bytes: int | None = None,
    what_if: tuple[str, ...] = (),
    prepared: tuple | None = None,
) -> list[TensorDiagnosis]:
    q_name, k_name, q, v, inputs = prepared or qk_inputs(qk, max_bytes)
    if sources:  # scores given too: diagnose them and fit the scale they carry
        if qk.grad_out:
            raise AttncheckError(
                f"{param('grad_out')} judges the backward of attention computed from {param('q')} and {param('k')}; "
                f"give no score files with it"
            )
        return [
            diagnose_attention(src.name, inputs, options, track(src.name, src.rows), scores=src, notice=notice)
            for src in sources
        ]
    name = f"{q_name} @ {k_name}"
    sweeps = tuple(w for w in what_if if w in params.setting_sweeps())  # --what-if fa4: its grid beside the cells
    for sweep in sweeps:  # a grid in none of the dtypes asked: said, not left out
        if not setting_cells((sweep,), options.dtypes, options=options):
            raise AttncheckError(
                f"{param('what_if')} {sweep}: FlashAttention-4 has no settings grid in {', '.join(options.dtypes)} "
                f"(add fp16, bf16 or e4m3 to {param('dtypes')})"
            )
    cells = grid(options, True) + setting_cells(sweeps, options.dtypes, options=options) if sweeps else None
    diag = diagnose_attention(name, inputs, options, track(name, inputs.rows), notice=notice, cells=cells)
    if qk.grad_out:
        dout = load_one(qk.grad_out, "grad_out", max_bytes=max_bytes)[1]
        want = (*q.shape[:-1], v.shape[-1])
        if tuple(dout.shape) != want:
            raise AttncheckError(
                f"{param('grad_out')} {qk.grad_out} has shape {tuple(dout.shape)}; the output gradient of these q "
                f"and v has shape {want}"
            )
        attach_backward(diag, None, inputs, GradInputs(dout, causal=qk.causal), options, mask_op=qk.mask_op or "add")
    return [diag]


def qk_inputs(qk: QKSpec, max_bytes: int | None = None):
    """--q, --k, --v and --mask read and prepared: (q's name, k's name, q, v, AttentionInputs)."""
    q_name, q = load_one(qk.q, "q", max_bytes=max_bytes)
    k_name, k = load_one(qk.k, "k", max_bytes=max_bytes)
    v = load_one(qk.v, "v", max_bytes=max_bytes)[1] if qk.v else None
    mask = load_one(qk.mask, "mask", "mask", max_bytes)[1] if qk.mask else None
    boolean = mask is not None and mask.dtype == torch.bool
    if qk.mask_convention is not None and not boolean:
        raise AttncheckError(
            f"{param('mask_convention')} applies to a boolean {param('mask')}"
            + (
                f"; {qk.mask} is {str(mask.dtype).removeprefix('torch.')}"
                if mask is not None
                else ", which is not given"
            )
        )
    if qk.mask_value is not None and not (boolean or qk.causal or qk.pad_left or qk.pad_right):
        raise AttncheckError(
            f"{param('mask_value')} is what keys masked by a boolean {param('mask')}, {param('causal')} or "
            f"{param('pad_left')}/{param('pad_right')} become; none is given"
            + (" (a float mask carries its own values)" if mask is not None else "")
        )
    inputs = prepare_inputs(
        q,
        k,
        mask,
        v=v,
        scale=qk.scale,
        scale_order=qk.scale_order,
        causal=qk.causal,
        pad_left=list(qk.pad_left),
        pad_right=list(qk.pad_right),
        mask_value=qk.mask_value or "-inf",
        mask_convention=qk.mask_convention or "attend",
        max_bytes=max_bytes,
    )
    inputs = _with_mask_facts(
        inputs, "explicit" if mask is not None or qk.pad_left or qk.pad_right else "causal" if qk.causal else "none"
    )
    return q_name, k_name, q, v, inputs


def _check_fa4_applies(request: RunRequest, options, inputs, captured) -> None:
    """--what-if fa4, --rescale-threshold and --max-offset compute FlashAttention-4 from Q and K: refused in one line
    on files of scores alone, and the two knobs where no fa4 cell is computed (not in --path, not asked by
    --what-if, no captured call run by FlashAttention-4)."""
    sweeps = [w for w in request.what_if if w in params.setting_sweeps()]
    knobs = [
        param(name)
        for name in ("rescale_threshold", "max_offset")
        if options.fa4 is not None and getattr(options.fa4, name) is not None
    ]
    asked = [f"{param('what_if')} {w}" for w in sweeps] + knobs
    if not asked or not inputs:
        return
    if all(isinstance(item, TensorSource) for item in inputs):
        raise AttncheckError(
            f"{' and '.join(asked)} ask{'s' if len(asked) == 1 else ''} for FlashAttention-4, computed from Q and K; "
            f"{', '.join(request.paths)} hold{'s' if len(request.paths) == 1 else ''} scores only (give a capture, "
            f"q/k files or {param('q')}/{param('k')})"
        )
    fa4_asked = set(params.setting_sweeps()) & set(options.paths) or sweeps or params.WHAT_IF_KERNELS in request.what_if
    if knobs and not fa4_asked and not any(judged_by(item.info)[0] in params.setting_sweeps() for item in captured):
        raise AttncheckError(
            f"{' and '.join(knobs)} set FlashAttention-4's lazy rescale, and no call here is run by it: ask "
            f"{param('what_if')} fa4 (or kernels), or add fa4 to {param('paths')}"
        )
