"""One attention call -> its diagnosis, its heads, and the cell the model actually ran.

An SDPA call (or a file of q/k/mask tensors) is diagnosed in Q/K mode with SDPA's semantics:
a boolean mask is True where a query may attend, a float mask is added, ``is_causal`` masks
top-left aligned, ``scale`` None is 1/sqrt(d), and k may have fewer heads than q (GQA). A
softmax call is diagnosed as the scores it saw; with the q and k of the matmul that produced
them, also against Q/K (``diagnose_attention(..., scores=...)``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from attncheck import params
from attncheck.config.run import Options
from attncheck.errors import AttncheckError
from attncheck.findings import SEVERITIES
from attncheck.model import head_findings
from attncheck.numerics.precision import dtype_from_name, dtype_label
from attncheck.registry import DTYPES, METHODS, cell_dtype
from attncheck.results import CallInfo, CallReport, HeadStat, TensorDiagnosis

QK_KINDS = ("sdpa", "qk")


def model_cell(info: CallInfo) -> tuple[str, str] | None:
    """The cell whose computation the model ran for a call, as (method or path, dtype).

    - softmax: ``torch.softmax`` in its ``dtype=`` argument, else in the scores' dtype;
    - sdpa: the ``flash`` path in the call's dtype. PyTorch's fused SDPA kernels (the CPU
      flash kernel, CUDA's flash and memory-efficient ones) hold S = Q@K^T, its running
      max and sum in float32, round P to the dtype before P@V and return zeros for a fully
      masked row; the math backend (``sdpa-math``) is computed beside it;
    - qk files and plain scores: ``torch.softmax`` in the tensors' dtype (with q and k: on
      the ``eager`` path, as hand-written attention computes it).

    None when that dtype is not one a cell computes in (float64).
    """
    dtype = _cell_dtype_name(info.softmax_dtype or info.dtype)
    if dtype is None:
        return None
    return ("flash" if info.kind == "sdpa" else "torch", dtype)


def _cell_dtype_name(name: str | None) -> str | None:
    """'fp16' (or an alias) -> 'fp16' when a cell computes in it, else None."""
    if name is None or name not in DTYPES or not cell_dtype(DTYPES.get(name)):
        return None
    return DTYPES.get(name).name


def options_with(options: Options, cell: tuple[str, str] | None, qk: bool = False) -> Options:
    """The options with the model's own cell added where the user's choice left it out: its
    dtype, and its path (``flash``) or its method (with q and k, on the ``eager`` path)."""
    if cell is None:
        return options
    name, dtype = cell
    dtypes = options.dtypes if dtype in options.dtypes else (*options.dtypes, dtype)
    methods, paths = options.methods, options.paths
    if name in METHODS:
        methods = methods if name in methods else (*methods, name)
        if qk and paths and "eager" not in paths:
            paths = (*paths, "eager")
    elif paths and name not in paths:
        paths = (*paths, name)
    return replace(options, methods=methods, dtypes=dtypes, paths=paths)


def _scale(info: CallInfo) -> params.Scale:
    # repr keeps every digit: SDPA's scale is used exactly as the model passed it
    return params.Scale(repr(float(info.scale))) if info.scale is not None else params.Scale("auto")


def _in_call(info: CallInfo, run: Callable):
    """Run ``run()``; an input error names the call."""
    try:
        return run()
    except AttncheckError as e:
        where = f"{info.name} (call {info.index}, {info.kind}{' in ' + info.module if info.module else ''})"
        raise AttncheckError(f"{where}: {e.render()}") from None


def diagnose_call(
    info: CallInfo,
    tensors: dict[str, torch.Tensor],
    options: Options,
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
) -> CallReport:
    """Diagnose one call from its tensors (roles q, k, v, attn_mask, scores)."""
    from attncheck.numerics.cells.diagnose import diagnose, diagnose_attention
    from attncheck.numerics.inputs.heads import head_stats
    from attncheck.numerics.inputs.scores import prepare_inputs

    kind = info.kind
    scores = tensors.get("scores")
    q, k = tensors.get("q"), tensors.get("k")
    if info.dtype is None:
        ref = q if kind in QK_KINDS and q is not None else scores
        info = replace(info, dtype=dtype_label(ref.dtype) if ref is not None else None)
    num_heads = info.meta.get("num_heads", "")
    if scores is not None and scores.dim() == 3 and num_heads.isdigit() and scores.shape[0] % int(num_heads) == 0:
        h = int(num_heads)  # nn.MultiheadAttention's (B * H, T, ...) -> (B, H, T, ...)
        scores = scores.reshape(scores.shape[0] // h, h, *scores.shape[1:])
        if q is not None and k is not None and q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == scores.shape[0] * h:
            q, k = q.reshape(-1, h, *q.shape[1:]), k.reshape(-1, h, *k.shape[1:])
    cell = model_cell(info)
    opts = options_with(options, cell, qk=kind in QK_KINDS)
    inputs = None
    if kind in QK_KINDS:
        if q is None or k is None:
            raise AttncheckError(f"{info.name} (call {info.index}): needs q and k")
        mask = tensors.get("attn_mask")
        inputs = _in_call(info, lambda: prepare_inputs(q, k, mask, v=tensors.get("v"), scale=_scale(info), causal=info.is_causal, mask_convention="attend"))
        diag = _in_call(info, lambda: diagnose_attention(info.name, inputs, opts, progress, notice=notice))
    else:
        if scores is None:
            raise AttncheckError(f"{info.name} (call {info.index}): the softmax call has no scores")
        if q is not None and k is not None:
            try:
                inputs = prepare_inputs(q, k, None, scale=_scale(info))
            except AttncheckError:
                inputs = None  # q/k that do not make these scores: diagnose the scores alone
            if inputs is not None and tuple(inputs.score_shape) != tuple(scores.shape):
                inputs = None
        if inputs is not None and info.meta.get("q_prescaled") != "true":
            diag = _in_call(info, lambda: diagnose_attention(info.name, inputs, opts, progress, scores=scores, notice=notice))
        else:
            diag = _in_call(info, lambda: diagnose(info.name, scores, opts, progress, notice=notice))
    info = replace(info, shape=tuple(diag.shape), has_qk=inputs is not None)
    used = _cell_of(diag, cell)
    compute = _cell_dtype_name(info.dtype)  # Q@K^T overflow per head, in the dtype the model computed it in
    heads = head_stats(inputs, scores, dtype_from_name(compute) if compute else None, used)
    report = CallReport(info, diag, heads, cell)
    extra = head_findings(report, diag.findings)
    if extra:
        order = {s: i for i, s in enumerate(SEVERITIES)}
        diag.findings = sorted(diag.findings + extra, key=lambda f: order[f.severity])
    return report


def _cell_of(diag: TensorDiagnosis, cell: tuple[str, str] | None):
    if cell is None:
        return None
    try:
        return diag.cell(*cell)
    except KeyError:
        return None


def scores_report(info: CallInfo, diag: TensorDiagnosis) -> CallReport:
    """A plain score tensor (streamed, not held) as a call: its cell is torch.softmax in its dtype."""
    info = replace(info, shape=tuple(diag.shape), dtype=info.dtype or diag.dtype)
    cell = model_cell(info)
    used = _cell_of(diag, cell)
    heads = [HeadStat(h, None, None, None, 0, n) for h, n in enumerate(used.nan_rows_per_head)] if used is not None else []
    return CallReport(info, diag, heads, cell)
