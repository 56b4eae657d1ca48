"""``attncheck run --accumulate``: the sums of each diagnosed tensor or call kept in 16 bits
(``numerics.methods.lowsum``), attached to its diagnosis and judged (``findings.lowsum``).

Runs after the diagnosis, on the same inputs read again in row blocks: score files as given (the denominator;
no V), and Q/K with V (the denominator and P@V). The inputs are re-read rather than threaded through the
diagnosis so that the cells' code stays as it is; reading costs a fraction of the diagnosis."""

from __future__ import annotations

from typing import Callable

import torch

from attncheck.config.run import RunRequest
from attncheck.demo import example_scores
from attncheck.errors import AttncheckError, param
from attncheck.judge import judge_lowsum
from attncheck.loaders import TensorSource
from attncheck.loaders.calls import open_inputs
from attncheck.numerics.cells.calls import QK_KINDS, _model_inputs, _normalised
from attncheck.numerics.methods.lowsum import qk_blocks, rows_per_block, stats
from attncheck.results import CallReport, TensorDiagnosis


def attach_lowsum(
    request: RunRequest, options, diags: list[TensorDiagnosis], calls: list[CallReport], qk_inputs: Callable
) -> None:
    """Every diagnosis of ``diags`` (the q/k request or the built-in example) or of ``calls`` (files, in input
    order) gets ``lowsum``, one ``LowSumStats`` per accumulation asked, and the findings they lead to.
    ``qk_inputs``: how ``pipelines.run`` reads and prepares --q/--k/--v (passed in: no import cycle)."""
    specs, chunk = request.accumulate, options.chunk_elements
    if request.qk is not None and not request.paths:
        inp = qk_inputs(request.qk, request.max_memory)[4]
        dv = 0 if inp.v is None else inp.v.shape[-1]
        rows = rows_per_block(inp.k.shape[2], dv, chunk)
        for d in diags:
            d.lowsum = stats(qk_blocks(inp, rows), specs)
            judge_lowsum(d)
        return
    if request.example:
        x = example_scores()
        for d in diags:
            d.lowsum = stats([(x.reshape(-1, x.shape[-1]), None)], specs)
            judge_lowsum(d)
        return
    inputs, _ = open_inputs(request.paths, request.keys, request.max_memory)
    for item, call in zip(inputs, calls):
        if call.diagnosis is None:  # skipped with --partial
            continue
        if isinstance(item, TensorSource):
            rows = rows_per_block(item.shape[-1], 0, chunk)
            blocks = ((b.to(torch.float64), None) for b in item.row_blocks(rows))
        else:
            blocks = _call_blocks(item, chunk, request.max_memory)
        call.diagnosis.lowsum = stats(blocks, specs)
        judge_lowsum(call.diagnosis)


def check_lowsum_inputs(request: RunRequest) -> None:
    """Before any work: --accumulate on a capture's calls is refused in one line (their kernels' sums are known;
    the what-if report has no place for them yet), from the files' headers alone."""
    if not request.accumulate or not request.paths:
        return
    inputs, _ = open_inputs(request.paths, request.keys, request.max_memory)
    for item in inputs:
        if not isinstance(item, TensorSource) and item.info.kind not in ("qk", "scores", "unknown"):
            raise AttncheckError(
                f"{param('accumulate')} asks how sums kept in 16 bits would do on score files and q/k/v dumps; "
                f"{item.info.name} is a captured call, run by a kernel whose sums are known: dump its q, k and v and "
                f"give them with {param('q')}, {param('k')} and {param('v')}"
            )


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
