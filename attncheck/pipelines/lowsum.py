"""``attncheck run --accumulate``: the sums of each diagnosed tensor or call kept in 16 bits
(``numerics.methods.lowsum``), attached to its diagnosis and judged (``findings.lowsum``).

Runs after the diagnosis, on the same inputs read again in row blocks: score files as given (the denominator;
no V), and Q/K with V (the denominator and P@V). The inputs are re-read rather than threaded through the
diagnosis so that the cells' code stays as it is; reading costs a fraction of the diagnosis.

A capture's calls are run by kernels whose sums are known (torch's keep them in fp32): there the sums are a
what-if, as the KV cache's are. Each call gets its numbers (``CallSums``), its layer the worst of its calls
(``LayerSums``, one per attention module and sum, as the model report groups a module's decode steps), and the
findings name the layer and the call; they stay apart from the calls' diagnoses (``CaptureSums``)."""

from __future__ import annotations

from typing import Callable

import torch

from attncheck.config.run import RunRequest
from attncheck.demo import example_scores
from attncheck.judge import judge_capture_sums, judge_lowsum
from attncheck.loaders import TensorSource
from attncheck.loaders.calls import open_inputs
from attncheck.numerics.cells.calls import QK_KINDS, _model_inputs, _normalised
from attncheck.numerics.methods.lowsum import qk_blocks, rows_per_block, stats
from attncheck.results import CallReport, CallSums, CaptureSums, LayerSums, LowSumStats, TensorDiagnosis

FILE_KINDS = ("qk", "scores", "unknown")  # calls read from files, not from a capture: their implementation is unknown


def attach_lowsum(
    request: RunRequest, options, diags: list[TensorDiagnosis], calls: list[CallReport], qk_inputs: Callable
) -> CaptureSums | None:
    """Every diagnosis of ``diags`` (the q/k request or the built-in example) or of ``calls`` (files, in input
    order) gets ``lowsum``, one ``LowSumStats`` per accumulation asked, and the findings they lead to; a capture's
    calls give the returned ``CaptureSums`` instead (None when there is none).
    ``qk_inputs``: how ``pipelines.run`` reads and prepares --q/--k/--v (passed in: no import cycle)."""

    specs, chunk = request.accumulate, options.chunk_elements
    if request.qk is not None and not request.paths:
        inp = qk_inputs(request.qk, request.max_memory)[4]
        dv = 0 if inp.v is None else inp.v.shape[-1]
        rows = rows_per_block(inp.k.shape[2], dv, chunk)
        for d in diags:
            d.lowsum = stats(qk_blocks(inp, rows), specs)
            judge_lowsum(d)
        return None
    if request.example:
        x = example_scores()
        for d in diags:
            d.lowsum = stats([(x.reshape(-1, x.shape[-1]), None)], specs)
            judge_lowsum(d)
        return None

    inputs, _ = open_inputs(request.paths, request.keys, request.max_memory)
    captured: list[CallSums] = []
    for item, call in zip(inputs, calls):
        if call.diagnosis is None:  # skipped with --partial
            continue
        if isinstance(item, TensorSource):
            rows = rows_per_block(item.shape[-1], 0, chunk)
            blocks = ((b.to(torch.float64), None) for b in item.row_blocks(rows))
        else:
            blocks = _call_blocks(item, chunk, request.max_memory)
        found = stats(blocks, specs)
        if isinstance(item, TensorSource) or item.info.kind in FILE_KINDS:
            call.diagnosis.lowsum = found
            judge_lowsum(call.diagnosis)
        else:
            info = call.call
            captured.append(CallSums(info.index, info.name, info.module, info.rank, found))
    return _capture_sums(request, captured) if captured else None


def _capture_sums(request: RunRequest, captured: list[CallSums]) -> CaptureSums:
    """The captured calls' sums grouped per layer and judged, less the codes --ignore drops."""

    report = CaptureSums([st.label for st in captured[0].sums], captured, layer_sums(captured))
    judge_capture_sums(report)
    report.findings = [f for f in report.findings if f.code not in request.ignore]
    return report


def layer_sums(calls: list[CallSums]) -> list[LayerSums]:
    """Per attention module (and rank) and sum, in the order the modules first ran: the calls folded into one
    ``LowSumStats`` (rows summed, errors their largest, the mean over every finite row, the first overflow)."""
    layers: dict[tuple, list[LayerSums]] = {}
    for call in calls:
        key = (call.rank, call.module)
        if key not in layers:
            layers[key] = [
                LayerSums(
                    call.module, call.rank, st.label, [], 0, LowSumStats(st.label, dtype_max=st.dtype_max), call.index
                )
                for st in call.sums
            ]
        for layer, st in zip(layers[key], call.sums):
            _fold(layer, call.index, st)
    return [layer for group in layers.values() for layer in group]


def _fold(layer: LayerSums, index: int, st: LowSumStats) -> None:
    """One call's ``st`` folded into its layer's."""
    m = layer.stats
    if max(st.denom_err_max, st.out_err_max or 0.0) > max(m.denom_err_max, m.out_err_max or 0.0):
        layer.worst_call = index
    if layer.first_call is None and (st.denom_first is not None or st.out_first is not None):
        layer.first_call = index
    have, new = m.rows - m.denom_overflow_rows, st.rows - st.denom_overflow_rows
    if have + new:
        m.denom_err_mean = (m.denom_err_mean * have + st.denom_err_mean * new) / (have + new)
    layer.calls.append(index)
    layer.keys = m.keys = max(m.keys, st.keys)
    m.rows += st.rows
    m.denom_err_max = max(m.denom_err_max, st.denom_err_max)
    m.denom_overflow_rows += st.denom_overflow_rows
    m.denom_first = st.denom_first if m.denom_first is None else m.denom_first
    m.out_rows += st.out_rows
    if st.out_err_max is not None:  # None: no finite output row in this call (its rows count as non-finite)
        m.out_err_max = max(m.out_err_max or 0.0, st.out_err_max)
    m.out_overflow_rows += st.out_overflow_rows
    m.out_nonfinite_rows += st.out_nonfinite_rows
    m.out_first = st.out_first if m.out_first is None else m.out_first
    m.out_peak = max(m.out_peak, st.out_peak)


def _call_blocks(item, chunk: int, max_bytes: int):
    """Row blocks of a call: from its q, k (and v) where it has them, else its scores as given."""

    tensors = _normalised(item.info, item.load())
    if item.info.kind in QK_KINDS and "q" in tensors and "k" in tensors:
        inp = _model_inputs(item.info, tensors, max_bytes)
        dv = 0 if inp.v is None else inp.v.shape[-1]
        return qk_blocks(inp, rows_per_block(inp.k.shape[2], dv, chunk))
    x = tensors["scores"].to(torch.float64)
    x = x.reshape(-1, x.shape[-1])
    rows = rows_per_block(x.shape[-1], 0, chunk)
    return ((x[i : i + rows], None) for i in range(0, x.shape[0], rows))
