"""``attncheck run`` as a library call: a ``RunRequest`` in, a ``RunResult`` out.

Score files stream in row blocks within ``options.chunk_elements``; Q, K and a mask
are loaded whole and their scores computed per dtype in row blocks.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

import torch

from attncheck import params
from attncheck.config.run import QKSpec, RunRequest
from attncheck.errors import AttncheckError, param
from attncheck.results import RunResult, TensorDiagnosis

Track = Callable[[str, int], "Callable[[int], None] | None"]  # (tensor name, rows) -> rows-done callback


def run(request: RunRequest, track: Track | None = None, notice: Callable[[str], None] | None = None) -> RunResult:
    """Diagnose every tensor and call the request names; ``track`` gives a progress callback per
    tensor, ``notice`` hears one line before the fused kernels compile for the first time.

    Files are read as calls where they are: capture directories and call files, and files
    whose tensors are named like q/k/v/mask; other tensors are scores. The result holds a
    diagnosis per tensor, a report per call and the model report over them.
    """
    from attncheck.devices import resolve_device
    from attncheck.findings import apply_ignore
    from attncheck.judge import diagnose
    from attncheck.model import model_report, setting_choices
    from attncheck.numerics.cells.calls import scores_report
    from attncheck.results import CallInfo

    track = track or (lambda name, rows: None)
    dev = resolve_device(request.options.device)
    options = replace(request.options, device=str(dev))  # 'auto' -> where it runs, as the report says
    budget = request.max_memory
    capture = None
    skipped: list[tuple[str, str]] = []
    if request.qk is not None:
        sources = open_sources_for(request)
        diags = _run_qk(request.qk, sources, options, track, notice, budget, request.what_if)
        calls = [
            scores_report(CallInfo(i, d.name, "qk" if not sources else "scores", has_qk=True), d)
            for i, d in enumerate(diags)
        ]
    elif request.example:
        from attncheck.demo import EXAMPLE_NAME, example_scores

        x = example_scores()
        diags = [diagnose(EXAMPLE_NAME, x, options, track(EXAMPLE_NAME, x.numel() // x.shape[-1]), notice)]
        calls = [scores_report(CallInfo(0, EXAMPLE_NAME, "scores"), diags[0])]
    else:
        calls, capture, skipped = _run_files(request, options, track, notice)
        diags = [c.diagnosis for c in calls if c.diagnosis is not None]
    for d in diags + [c.what_if for c in calls if c.what_if is not None]:
        apply_ignore(d, request.ignore)
        d.choices = setting_choices(d, request.ignore)  # judged again on the findings that count
    model = model_report(calls, request.ignore, skipped, capture)
    return RunResult(diags, device_label(dev), calls, model)


def open_sources_for(request: RunRequest):
    from attncheck.loaders import open_sources

    return open_sources(request.paths, request.keys, max_bytes=request.max_memory) if request.paths else []


def _run_files(request: RunRequest, options, track: Track, notice):
    """Every input of the files as a call report, in natural order; bad calls raise, or with
    ``partial`` are skipped and listed."""
    from attncheck.config.run import check_row_fits
    from attncheck.judge import diagnose_call, diagnose_chunks
    from attncheck.loaders import TensorSource
    from attncheck.loaders.calls import open_inputs
    from attncheck.numerics.cells.calls import scores_report
    from attncheck.numerics.precision import dtype_label
    from attncheck.options import rows_per_chunk
    from attncheck.results import CallInfo, CallReport

    inputs, manifests = open_inputs(
        request.paths, request.keys, request.max_memory
    )  # headers only: score tensors stream in row chunks
    if options.paths and all(isinstance(item, TensorSource) for item in inputs):
        raise AttncheckError(
            f"{param('paths')} applies to attention calls (a capture, q/k files) and to {param('q')}/{param('k')}; "
            f"{', '.join(request.paths)} hold{'s' if len(request.paths) == 1 else ''} scores only"
        )
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
    from attncheck.pipelines.rope import capture_rope_checks

    rope = capture_rope_checks(request.paths, request.rope_what_if)  # the rotary tables the calls ran under
    if rope:
        capture = {**(capture or {}), "rope": rope}
    if not request.partial:  # every call checked before the first is diagnosed
        for item in inputs:
            if not isinstance(item, TensorSource) and item.problem:
                raise AttncheckError(item.problem)
    calls: list[CallReport] = []
    skipped: list[tuple[str, str]] = []
    captured = [
        item
        for item in inputs
        if not isinstance(item, TensorSource) and item.info.kind not in ("qk", "scores", "unknown")
    ]
    sweeps_only = all(w in params.setting_sweeps() for w in request.what_if)  # asked of any Q/K input (fa4's grid)
    _check_fa4_applies(request, options, inputs, captured)
    if (options.fp8_accum != params.FP8_ACCUM_KERNEL or options.fp8_flush is not None) and not captured and inputs:
        if all(isinstance(item, TensorSource) for item in inputs):
            raise AttncheckError(
                f"{param('fp8_accum')} and {param('fp8_flush')} set the accumulator of the FP8 kernels' tensor-core "
                f"products, computed from {param('q')} and {param('k')} or a capture; "
                f"{'the file holds' if len(request.paths) == 1 else 'the files hold'} scores only"
            )
    if request.what_if and inputs and not captured and not sweeps_only:
        raise AttncheckError(
            f"{param('what_if')} asks what would break if a captured model's calls ran otherwise; these files "
            f"hold plain scores or q/k tensors, whose implementation is not known: every cell asked is computed "
            f"already (choose them with {param('dtypes')}, {param('methods')}, {param('paths')})"
        )
    for i, item in enumerate(inputs):
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
            rows = _score_rows(tensors)
            calls.append(
                diagnose_call(
                    info,
                    tensors,
                    options,
                    track(info.name, rows),
                    notice,
                    request.what_if,
                    options if request.grid_asked else None,
                    max_bytes=request.max_memory,
                )
            )
        except AttncheckError as e:
            if not request.partial:
                raise
            skipped.append((info.name, e.render()))
            calls.append(CallReport(info, None, error=e.render()))
    return calls, capture, skipped


def capture_facts(doc: dict) -> dict:
    """What the report says of a capture, from its manifest."""
    from attncheck.loaders.calls import check_manifest_message

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
    from attncheck.loaders import load_tensors

    path, key = split_spec(spec)
    found = load_tensors([path], [key] if key else [], kind=kind, max_bytes=max_bytes)
    if len(found) != 1:
        names = ", ".join(t.name for t in found[:6])
        raise AttncheckError(
            f"{param(name)} {spec} selects {len(found)} tensors ({names}); pick one with {param(name)} PATH:KEY"
        )
    return found[0].name, found[0].tensor


def _with_mask_facts(inputs, mask: str):
    """Q/K files' inputs with what a kernel path reads of how the mask was given: a mask tensor or padding
    ('explicit'), --causal alone ('causal', the kernels' own causal mask), or none."""
    from dataclasses import replace

    return replace(inputs, call=inputs.facts("", mask))


def _run_qk(
    qk: QKSpec, sources, options, track: Track, notice, max_bytes: int | None = None, what_if: tuple[str, ...] = ()
) -> list[TensorDiagnosis]:
    from attncheck.judge import diagnose_attention
    from attncheck.numerics.cells.plan import grid, setting_cells
    from attncheck.numerics.inputs.scores import prepare_inputs

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
        from attncheck.judge import attach_backward
        from attncheck.numerics.backward.diagnose import GradInputs

        dout = load_one(qk.grad_out, "grad_out", max_bytes=max_bytes)[1]
        want = (*q.shape[:-1], v.shape[-1])
        if tuple(dout.shape) != want:
            raise AttncheckError(
                f"{param('grad_out')} {qk.grad_out} has shape {tuple(dout.shape)}; the output gradient of these q "
                f"and v has shape {want}"
            )
        attach_backward(diag, None, inputs, GradInputs(dout, causal=qk.causal), options, mask_op=qk.mask_op or "add")
    return [diag]


def _check_fa4_applies(request: RunRequest, options, inputs, captured) -> None:
    """--what-if fa4, --rescale-threshold and --max-offset compute FlashAttention-4 from Q and K: refused in one line
    on files of scores alone, and the two knobs where no fa4 cell is computed (not in --path, not asked by
    --what-if, no captured call run by FlashAttention-4)."""
    from attncheck.loaders import TensorSource
    from attncheck.numerics.cells.plan import judged_by

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
