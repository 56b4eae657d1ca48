"""One attention call -> its report: the cell the model ran, its heads, and the what-if cells asked.

A captured call names its implementation (``plan.known_implementation``): an SDPA call runs the
backend PyTorch chose for it, a softmax call ``torch.softmax`` on the scores it saw. Its model
cell alone is computed by default, and alone decides the call's verdict and findings. What-if
cells (``plan.what_if_cells``) run in a pass of their own, on the model's inputs as the model
would build them in the other dtype: a float mask of ``finfo(dtype).min`` is rebuilt with the
what-if dtype's own minimum (as transformers builds its masks), and a softmax call's mask is
read back from the scores it recorded. Calls of unknown implementation (q/k files, plain
scores) keep every cell asked, as a bare score tensor does.

An SDPA call (or a file of q/k/mask tensors) is diagnosed in Q/K mode with SDPA's semantics: a
boolean mask is True where a query may attend, a float mask is added, ``is_causal`` masks top-left
aligned, ``scale`` None is 1/sqrt(d), and k may have fewer heads than q (GQA).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from attncheck import params
from attncheck.errors import AttncheckError, param
from attncheck.numerics.backward.diagnose import BackwardCell, GradInputs, diagnose_backward, has_backward
from attncheck.numerics.cells.diagnose import diagnose, diagnose_attention
from attncheck.numerics.cells.inputs import (
    QK_KINDS,
    _model_inputs,
    _normalised,
    _scale_source,
    _sdpa_what_if_inputs,
    _softmax_qk,
    _softmax_what_if_inputs,
)
from attncheck.numerics.cells.inputs import call_inputs as call_inputs  # re-exported: its users import it here
from attncheck.numerics.cells.plan import (
    CellKey,
    cell_dtype_name,
    grid,
    judged_by,
    kernel_dtype,
    kernel_refusals,
    known_implementation,
    model_cell,
    setting_cells,
    sweep_refusals,
    what_if_cells,
)
from attncheck.numerics.inputs.heads import kv_heads, qk_maxima, qk_overflow_per_head
from attncheck.numerics.inputs.scores import max_abs_qk, start_audit
from attncheck.numerics.inputs.sinks import split_sinks
from attncheck.numerics.inputs.softcap import softcap_facts
from attncheck.numerics.outliers import annotate_heads, call_activations
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, dtype_from_name, dtype_label, rounding_limit
from attncheck.options import Options, rows_per_chunk
from attncheck.registry import PATHS, eager_path
from attncheck.results import CallInfo, CallReport, CellLimit, HeadStat, TensorDiagnosis


def _in_call(info: CallInfo, run: Callable):
    """Run ``run()``; an input error names the call."""
    try:
        return run()
    except AttncheckError as e:
        where = f"{info.name} (call {info.index}, {info.kind}{' in ' + info.module if info.module else ''})"
        raise AttncheckError(
            f"{where}: {e.render(param)}"
        ) from None  # parameters stay marked: the CLI names them as flags


def diagnose_call(
    info: CallInfo,
    tensors: dict[str, torch.Tensor],
    options: Options,
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
    what_if: tuple[str, ...] = (),
    asked: Options | None = None,
    max_bytes: int | None = None,
) -> CallReport:
    """Diagnose one call from its tensors (roles q, k, v, attn_mask, scores).

    ``options`` say how cells compute (block, order, kernels, memory). A call of known
    implementation computes its model cell, and as what-ifs the dtypes ``what_if`` names
    (``params.what_if``) and the grid ``asked`` (an explicit --dtype/--method/--path); a call of
    unknown implementation computes every cell of ``options`` (and of ``asked``). ``max_bytes``:
    what the diagnosis holds whole (float64 q, k, v and the masks at their own size) must fit in it.
    """
    kind = info.kind
    what_if = params.what_if(list(what_if)) if what_if else ()
    tensors, sinks = _in_call(info, lambda: split_sinks(info.meta, _normalised(info, tensors)))  # learned sinks
    scores, q, k = tensors.get("scores"), tensors.get("q"), tensors.get("k")
    if info.dtype is None:
        ref = q if kind in QK_KINDS and q is not None else scores
        info = replace(info, dtype=dtype_label(ref.dtype) if ref is not None else None)
    if kind in QK_KINDS and (q is None or k is None):
        raise AttncheckError(f"{info.name} (call {info.index}): needs q and k")
    if kind not in QK_KINDS and scores is None:
        raise AttncheckError(f"{info.name} (call {info.index}): the softmax call has no scores")
    model = model_cell(info)
    known = known_implementation(info) and model is not None
    inputs = (
        _in_call(info, lambda: _model_inputs(info, tensors, max_bytes))
        if kind in QK_KINDS
        else _softmax_qk(info, tensors, max_bytes)
    )
    cells = _cells_of(info, model, known, inputs, what_if, asked, options)
    if kind in QK_KINDS:
        diag = _in_call(info, lambda: _qk_diagnosis(info, inputs, options, cells, progress, notice))
    else:
        diag = _in_call(info, lambda: _scores_diagnosis(info, scores, inputs, options, cells, progress, notice))
    info = replace(info, shape=tuple(diag.shape), has_qk=inputs is not None)
    what = None
    if known and (what_if or asked is not None):
        what = _in_call(info, lambda: _what_if(info, tensors, inputs, options, what_if, asked, notice, max_bytes))
    if "grad_out" in tensors:
        _in_call(info, lambda: _backward(info, tensors, inputs, diag, what, options, model if known else None))
    used = _cell_of(diag, model)
    _check_softcap(info, inputs, diag, tensors, what, known, what_if, asked)
    if known and kind == "softmax" and used is not None:
        used.limit = _scores_limit(info, diag)
    if known and kind == "flex" and used is not None and "scores_mod" in tensors:
        used.limit = _flex_limit(info, diag)
    heads = _head_stats(info, inputs, diag, used, model)
    acts = None if inputs is None or inputs.q.dim() != 4 else call_activations(inputs.q, inputs.k, inputs.v)
    annotate_heads(heads, diag.key_shares, acts)
    replayed = known and params.WHAT_IF_KERNELS in what_if and model is not None
    kernels = kernel_dtype(info, model) if replayed else None
    refused = kernel_refusals(info, kernels) if replayed else {}
    report = CallReport(
        info,
        diag,
        heads,
        None if model is None else (model.method, model.dtype),
        what_if=what,
        kernels_refused=refused,
        kernel_dtype=kernels,
        path_note=judged_by(info, model.dtype)[1] if known and model is not None else None,
        settings_refused=sweep_refusals(info, tuple(w for w in what_if if w in params.setting_sweeps()))
        if known and what is not None
        else {},
        sinks=sinks,
        activations=acts,
    )
    if sinks is not None:
        sinks.nosinks = params.WHAT_IF_NOSINKS in what_if or params.WHAT_IF_KERNELS in what_if
    return report


def _cells_of(info: CallInfo, model, known: bool, inputs, what_if, asked: Options | None, options: Options) -> list:
    """The cells a call computes: its model cell where its implementation is known; else every cell asked, the
    model's among them, and on Q/K inputs the settings grids swept."""
    kind = info.kind
    if known:
        cells = [model]
    else:
        qk = inputs is not None and kind in QK_KINDS
        cells = grid(asked or options, qk)
        if model is not None and not any(c.same_cell(model) for c in cells):
            cells.append(model)
        if qk:  # --what-if fa4 on q/k files: the kernel's settings grid in each dtype asked
            sweeps = tuple(w for w in what_if if w in params.setting_sweeps())
            cells += setting_cells(sweeps, (asked or options).dtypes, options=options)
    return cells


def _check_softcap(info: CallInfo, inputs, diag: TensorDiagnosis, tensors, what, known: bool, what_if, asked) -> None:
    """A softmax call's softcap audited (when the model has one), and what it could not judge named."""
    kind = info.kind
    cap = softcap(info)
    if cap is not None and kind == "softmax" and inputs is not None and diag.attention is not None:
        _in_call(info, lambda: _softcap_audit(info, inputs, diag, cap))
        if diag.attention.softcap is not None:  # asked for, but no backward or what-if cell has the cap
            wanted_what_if = what is None and known and (what_if or asked is not None)
            asked_for = [("gradients", "grad_out" in tensors), ("what-if cells", wanted_what_if)]
            diag.attention.softcap.not_judged = [name for name, hit in asked_for if hit]


def softcap(info: CallInfo) -> float | None:
    """The cap of a soft-capped softmax call (``cap * tanh(S * scale / cap)``, traced by the capture); None
    without one or where the trace could not name it."""
    try:
        cap = float(info.meta.get("softcap", "none"))
    except ValueError:
        return None
    return cap if math.isfinite(cap) and cap > 0 else None


def _softcap_audit(info: CallInfo, inputs, diag: TensorDiagnosis, cap: float) -> None:
    """S = Q@K^T before the cap, in the scores' dtype: the facts (``judge.judge_call`` finds what they mean)."""
    dt = dtype_from_name(cell_dtype_name(info.dtype) or "fp32")
    diag.attention.softcap = softcap_facts(inputs, dt, cap, diag.attention.raw_max_abs)


def _backward(
    info: CallInfo,
    tensors,
    inputs,
    diag: TensorDiagnosis,
    what: TensorDiagnosis | None,
    options: Options,
    model: CellKey | None,
) -> None:
    """The backward of a call's cells from its recorded output gradient (see ``attach_backward``):
    the model's own cell is the eager path as the model ran it (a softmax call: its recorded scores,
    the mask applied as the capture traced it, the matmuls in autocast's dtype or v's) or the SDPA
    backend's path, compared with the gradients its kernel produced where they were recorded."""
    _check_grads(info, tensors)
    if info.kind == "softmax" and info.meta.get("softcap", "none") != "none":
        return  # the backward paths have no soft cap (its tanh Jacobian): judged without it they would be wrong
    if info.kind == "softmax":
        bw_inputs = None if inputs is None else _softmax_what_if_inputs(info, tensors, inputs, options)
    else:
        bw_inputs = inputs
    if bw_inputs is None or bw_inputs.v is None:
        return
    mask_op = info.meta.get("mask_op") if info.kind == "softmax" else None
    mask_op = (
        mask_op if mask_op in ("add", "fill") else "add"
    )  # SDPA ported to eager attention, as transformers writes it, adds its mask
    own = None
    used = _cell_of(diag, model) if model is not None else None
    if used is not None:
        if info.kind == "softmax":
            # the matmuls ran in autocast's dtype where it was on, else in v's; the softmax on the scores as recorded
            autocast = cell_dtype_name(info.meta.get("autocast_dtype"))
            matmuls = autocast or cell_dtype_name(dtype_label(tensors["v"].dtype)) or info.dtype
            own = (
                BackwardCell(
                    eager_path(),
                    matmuls,
                    mask_op,
                    info.softmax_dtype,
                    info.dtype if info.dtype != matmuls else None,
                    model=True,
                ),
                used,
            )
        else:
            own = (BackwardCell(model.path, model.dtype, model=True), used)
    # Dropout's random mask is not recorded: the cells are judged without it, and the gradients the
    # model really produced (with it) cannot be compared.
    real = (
        {}
        if info.dropout_p > 0
        else {
            name: tensors[role]
            for name, role in (("dq", "grad_q"), ("dk", "grad_k"), ("dv", "grad_v"))
            if role in tensors
        }
    )
    grads = GradInputs(
        tensors["grad_out"],
        scores=tensors.get("scores") if info.kind == "softmax" else None,
        out=tensors.get("out"),
        real=real,
        device_type=info.meta.get("device", "cpu").split(":")[0],
        dropout_p=info.dropout_p,
        causal=info.is_causal and info.kind in ("sdpa", "flash_attn"),
    )
    attach_backward(diag, what, bw_inputs, grads, options, mask_op, own)


def _check_grads(info: CallInfo, tensors: dict[str, torch.Tensor]) -> None:
    """The gradients (and the output) of a call must have the shapes of what they are the gradient
    of: an input error naming the call otherwise (a hand-made or damaged gradients file)."""
    q, v = tensors.get("q"), tensors.get("v")
    if q is None or v is None:
        return
    want = {
        "grad_out": (*q.shape[:-1], v.shape[-1]),
        "out": (*q.shape[:-1], v.shape[-1]),
        "grad_q": tuple(q.shape),
        "grad_k": tuple(tensors["k"].shape) if "k" in tensors else None,
        "grad_v": tuple(v.shape),
    }
    for role, shape in want.items():
        t = tensors.get(role)
        if t is None or shape is None:
            continue
        if not t.is_floating_point():
            raise AttncheckError(
                f"{role} has dtype {str(t.dtype).removeprefix('torch.')}; a gradient is floating point"
            )
        if tuple(t.shape) != tuple(shape):
            raise AttncheckError(
                f"{role} has shape {tuple(t.shape)}; for q {tuple(q.shape)} and v {tuple(v.shape)} it must be "
                f"{tuple(shape)}"
            )


def attach_backward(
    diag: TensorDiagnosis, what: TensorDiagnosis | None, inputs, grads, options: Options, mask_op: str = "add", own=None
) -> None:
    """The backward of the cells of ``diag`` (or, with ``own`` = (BackwardCell, its Cell), of that
    model cell alone) and of the what-if cells of ``what``: every cell of a path with a backward
    (eager with torch.softmax, its mask applied as ``mask_op`` says; sdpa-math; flash) in fp16, bf16
    or fp32. Fills ``Cell.backward``; ``judge.attach_backward`` adds the backward findings."""
    wanted: dict = {}  # BackwardCell -> the forward cell it belongs to
    if own is not None:
        wanted[own[0]] = own[1]
    asked = [] if own is not None else list(diag.cells)
    asked += [] if what is None else list(what.cells)
    for c in asked:
        if (
            has_backward(c.path)
            and (not PATHS.get(c.path).runs_methods or c.method == "torch")
            and c.dtype in ("fp16", "bf16", "fp32")
        ):
            wanted[BackwardCell(c.path, c.dtype, mask_op if PATHS.get(c.path).runs_methods else "add")] = c
    if not wanted:
        return
    results = diagnose_backward(inputs, grads, list(wanted), options.chunk_elements)
    for key, result in results.items():
        wanted[key].backward = result


def _qk_diagnosis(info, inputs, options, cells, progress, notice) -> TensorDiagnosis:
    return diagnose_attention(
        info.name, inputs, options, progress, notice=notice, cells=cells, scale_source=_scale_source(info)
    )


def _scores_diagnosis(info, scores, inputs, options, cells, progress, notice) -> TensorDiagnosis:
    """A softmax call: the scores it saw, as recorded. With its q and k, the scale they carry: the
    traced one (the model's code), or fitted to the scores where the trace found none."""
    if inputs is None or info.meta.get("q_prescaled") == "true":
        return diagnose(info.name, scores, options, progress, notice=notice, cells=cells)
    source = _scale_source(info)
    if source is None or softcap(info) is not None or _near_overflow(info, scores):
        # the Q/K pipeline beside the scores (max|q.k|, Q@K^T overflow per dtype); a scale fitted where none was traced
        return diagnose_attention(
            info.name,
            inputs,
            options,
            progress,
            scores=scores,
            notice=notice,
            cells=cells,
            scale_source=source,
            fit=source is None,
        )
    # far from any overflow: the scores alone, with the audit's max|q.k| (the --detail panel said 0)
    audit = start_audit(inputs)
    audit.scale_source = source
    audit.raw_max_abs = max_abs_qk(inputs, rows_per_chunk(scores.shape[-1], options, cells))
    return diagnose(info.name, scores, options, progress, notice=notice, cells=cells, attention=audit)


def _near_overflow(info: CallInfo, scores: torch.Tensor) -> bool:
    """The scores a softmax call saw hold +inf or NaN, or a logit whose Q@K^T (before the traced scale) is within
    a factor 4 of the scores' dtype's rounding limit: then the Q/K pipeline says where and why."""
    if not scores.numel():
        return False
    finite = torch.isfinite(scores)
    if not bool(finite.all()) and bool((torch.isposinf(scores) | torch.isnan(scores)).any()):
        return True
    logits = finite & (scores > MASK_SENTINEL_LIMIT)  # masked keys (-inf, sentinels) left out
    top = float(torch.where(logits, scores.abs(), torch.zeros((), dtype=scores.dtype)).amax())
    scale = abs(info.scale) if info.scale else 1.0
    limit = rounding_limit(dtype_from_name(cell_dtype_name(info.dtype) or "fp32"))
    return top / scale >= limit / 4


def _what_if(
    info: CallInfo, tensors, inputs, options: Options, what_if, asked, notice, max_bytes: int | None = None
) -> TensorDiagnosis | None:
    """The what-if cells of a call of known implementation, in a pass of their own (the model's inputs
    are held beside them: both count against ``max_bytes``)."""
    left = None if max_bytes is None else max(1, max_bytes // 2)
    if info.kind == "softmax" and info.meta.get("softcap", "none") != "none":
        return None  # a what-if rebuilds the scores from q.k and the mask, without the cap: not this model's scores
    if info.kind in ("sdpa", "flex", "flash_attn"):
        wi_inputs = _sdpa_what_if_inputs(info, tensors, left)
    else:
        wi_inputs = None if inputs is None else _softmax_what_if_inputs(info, tensors, inputs, options, left)
    cells = what_if_cells(info, wi_inputs is not None, what_if, asked, options)
    if not cells:
        return None
    name = f"{info.name} (what if)"
    if wi_inputs is None:
        return diagnose(name, tensors["scores"], options, notice=notice, cells=cells)
    return diagnose_attention(
        name, wi_inputs, options, notice=notice, cells=cells, scale_source=_scale_source(info) or "traced"
    )


def _scores_limit(info: CallInfo, diag: TensorDiagnosis) -> CellLimit | None:
    """The first failure of a softmax call's model: its scores S, computed in the scores' dtype, pass
    that dtype's rounding limit (torch.softmax itself cannot fail on finite scores). Measured on the
    largest finite real logit (above the sentinel limit) divided by the traced scale (the model scales
    after Q@K^T; nn.MultiheadAttention scales q first, so its scores are S); +inf where the scores
    already hold +inf."""
    dt = dtype_from_name(cell_dtype_name(info.dtype) or "fp32")
    limit = rounding_limit(dt)
    if softcap(info) is not None:  # the capped logits stay within the cap: what can overflow is S before it
        cap = diag.attention.softcap if diag.attention is not None else None
        return CellLimit(
            "qk_overflow",
            limit,
            None if cap is None else cap.max_qk,
            f"S = Q@K^T before the soft cap in {dtype_label(dt)} rounds to inf at |S| >= {limit:.6g}",
        )
    c = diag.census
    logits = [abs(v) for v in (c.max, c.unmasked_min) if v is not None and v > MASK_SENTINEL_LIMIT]
    scale = info.scale if _scale_source(info) and info.meta.get("q_prescaled") != "true" and info.scale else 1.0
    value = math.inf if c.posinf else (max(logits) / abs(scale) if logits else None)
    unscaled = " (before the scale)" if scale != 1.0 else ""
    return CellLimit(
        "qk_overflow", limit, value, f"S = Q@K^T{unscaled} in {dtype_label(dt)} rounds to inf at |S| >= {limit:.6g}"
    )


def _flex_limit(info: CallInfo, diag: TensorDiagnosis) -> CellLimit:
    """The first failure of a flex call with a score_mod: its logits after the mod, in fp32, pass
    fp32's rounding limit (a soft cap keeps them within the cap, whatever Q@K^T does: the headroom
    is the cap's); measured on the largest finite logit after the mod."""
    c = diag.census
    logits = [abs(v) for v in (c.max, c.unmasked_min) if v is not None and v > MASK_SENTINEL_LIMIT]
    limit = rounding_limit(torch.float32)
    value = math.inf if c.posinf else (max(logits) if logits else None)
    mod = info.meta.get("score_mod", "score_mod")
    return CellLimit("qk_overflow", limit, value, f"the logits after {mod} in fp32 round to inf at |x| >= {limit:.6g}")


def _cell_of(diag: TensorDiagnosis, key: CellKey | None):
    if key is None:
        return None
    return next((c for c in diag.cells if (c.path, c.method, c.dtype) == (key.path, key.method, key.dtype)), None)


def _head_stats(info: CallInfo, inputs, diag: TensorDiagnosis, cell, model: CellKey | None) -> list[HeadStat]:
    """One HeadStat per head: max |q| and |k| (GQA: of the kv head it reads), the largest unmasked
    logit (from the diagnosis's own pass), Q@K^T overflow in the call's dtype where the model holds S
    in it and the scores show +inf (the only place it can break), and the model cell's NaN rows."""
    logits = diag.head_max_logits
    heads = len(logits)
    if not heads:
        return []
    q_max = k_max = [None] * heads
    overflow = [0] * heads
    kv: list[int | None] = [None] * heads
    if inputs is not None and inputs.q.shape[1] == heads:
        q_max, k_max = qk_maxima(inputs)
        kv = kv_heads(inputs)
        compute = cell_dtype_name(info.dtype)
        eager = model is None or model.path is None or PATHS.get(model.path).scores == "dtype"
        inf_seen = cell is not None and (cell.nan_causes.get("inf_input") or cell.nan_causes.get("qk_overflow"))
        capped = diag.attention is not None and diag.attention.softcap is not None and diag.attention.softcap.overflow
        if compute is not None and (inf_seen or (eager and diag.census.posinf) or capped):
            overflow = qk_overflow_per_head(inputs, dtype_from_name(compute) if eager else torch.float32)
    nan = cell.nan_rows_per_head if cell is not None and len(cell.nan_rows_per_head) == heads else [0] * heads
    per_cause = {} if cell is None else {c: n for c, n in cell.nan_causes_per_head.items() if len(n) == heads}
    return [
        HeadStat(
            h,
            q_max[h],
            k_max[h],
            logits[h],
            overflow[h],
            nan[h],
            kv[h],
            {c: n[h] for c, n in per_cause.items() if n[h]},
        )
        for h in range(heads)
    ]


def scores_report(info: CallInfo, diag: TensorDiagnosis) -> CallReport:
    """A plain score tensor (streamed, not held) as a call: its cell is torch.softmax in its dtype."""
    info = replace(info, shape=tuple(diag.shape), dtype=info.dtype or diag.dtype)
    cell = model_cell(info)
    used = _cell_of(diag, cell)
    heads = []
    if used is not None and len(used.nan_rows_per_head) == len(diag.head_max_logits):
        per_cause = {c: n for c, n in used.nan_causes_per_head.items() if len(n) == len(diag.head_max_logits)}
        heads = [
            HeadStat(h, None, None, m, 0, n, None, {c: k[h] for c, k in per_cause.items() if k[h]})
            for h, (m, n) in enumerate(zip(diag.head_max_logits, used.nan_rows_per_head))
        ]
        annotate_heads(heads, diag.key_shares, None)
    return CallReport(info, diag, heads, None if cell is None else (cell.method, cell.dtype))
