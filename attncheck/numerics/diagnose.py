"""Tensors -> diagnosis: census of the input, one result per (method, dtype) cell,
the distribution of the reference, and findings with a fix.

The score tensor is viewed as (rows, keys) and processed in row chunks; every
statistic is aggregated across chunks (``accumulate``), so no float64 copy of the
whole input is ever made. A row backend (``backends``) computes each chunk's row
facts; the registered methods compute the cells. No printing, no paths, no typer
or rich here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from attncheck.config.run import Options, chunk_elements_for  # noqa: F401  (part of this module's API)
from attncheck.errors import AttncheckError, param
from attncheck.findings import findings_for
from attncheck.numerics.accumulate import CellAcc, CensusAcc, DistAcc
from attncheck.numerics.backends import AlgoReference, ChunkFacts, RowBackend, select_backend
from attncheck.numerics.backends.torch_rows import TorchRows
from attncheck.numerics.precision import cast, check_scores_dtype, dtype_from_name, dtype_label, limits_of
from attncheck.numerics.softmax import MethodParams
from attncheck.registry import METHODS
from attncheck.results import TensorDiagnosis

if TYPE_CHECKING:
    from attncheck.numerics.scores import AttentionInputs, QKBlock

__all__ = ["Options", "diagnose", "diagnose_attention", "diagnose_chunks", "resolve_device"]

def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cuda' without CUDA is an input error."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise AttncheckError(f"{param('device')} cuda requested but CUDA is not available (torch.cuda.is_available() is False); use {param('device')} cpu")
        return torch.device(name)
    raise AttncheckError(f"unknown device {name!r} (choose from auto, cpu, cuda)", param="device")


def check_scores(name: str, x: torch.Tensor) -> None:
    """Refuse tensors the diagnosis cannot take, naming what was found."""
    check_scores_dtype(name, x.dtype)
    if x.dim() == 0:
        raise AttncheckError(f"{name}: is a scalar; scores need at least one axis (the last axis holds the keys)")
    if x.numel() == 0:
        raise AttncheckError(f"{name}: is empty (shape {tuple(x.shape)})")


def rows_per_chunk(keys: int, options: Options) -> int:
    """Rows per chunk so that one float64 working tensor stays near options.chunk_elements."""
    return max(1, options.chunk_elements // keys)


def diagnose(
    name: str,
    scores: torch.Tensor,
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
) -> TensorDiagnosis:
    """Diagnose one score tensor; the softmax runs over its last axis."""
    options = options or Options()
    check_scores(name, scores)
    keys = scores.shape[-1]
    rows = scores.numel() // keys
    flat = scores.reshape(rows, keys)  # (R, T); a view when contiguous
    step = rows_per_chunk(keys, options)
    chunks = (flat[start : start + step] for start in range(0, rows, step))
    return diagnose_chunks(name, tuple(scores.shape), scores.dtype, chunks, options, progress, notice=notice)


def diagnose_chunks(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    chunks: Iterable,
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    attention=None,
    notice: Callable[[str], None] | None = None,
) -> TensorDiagnosis:
    """Diagnose a score tensor that arrives as consecutive (rows, keys) blocks, in row order.

    A block is a (rows, keys) tensor of scores (cast to each dtype), or a
    ``scores.QKBlock`` that computes its scores per dtype from Q and K. Results do
    not depend on how the rows are split. ``progress`` is called with the number of
    rows finished after each block; ``notice`` hears one line when the fused kernels
    compile for the first time. ``attention`` is the Q/K audit to attach.
    """
    options = options or Options()
    device = resolve_device(options.device)
    lead = shape[:-1]
    rows = math.prod(lead) if lead else 1
    census = CensusAcc(options.dtypes)
    dist = DistAcc(options.collapse_threshold)
    heads = tuple(shape[:-2]) if len(shape) >= 3 else ()  # (batch, heads, ...) of (..., queries, keys)
    cells = {(m, d): CellAcc(m, d, options.max_examples, heads, shape[-2] if heads else 1) for d in options.dtypes for m in options.methods}
    backend = select_backend(options.kernels, device, math.prod(shape), notice)
    plain = TorchRows()  # metrics of methods the fused kernel does not serve
    specs = [METHODS.get(m) for m in options.methods]
    method_params = MethodParams(block=options.block, reverse=options.reverse, accum=options.accum)
    start = 0
    shift = None
    for block in chunks:  # loop over row chunks, never over rows
        raw = isinstance(block, torch.Tensor)
        x = (block if raw else block.given).to(device)
        if shift is None:  # the first finite value in row-major order, whatever the chunking
            shift = _first_finite(x)
            census.shift = shift or 0.0
        c = backend.chunk(x, start, census.shift if shift is not None else 0.0)
        if not raw:
            c.masked_rows = block.all_masked
            block.audit_reference(c.ref, c.ref_ok)
        start += c.x.shape[0]
        census.update(c)
        dist.update(c)
        for d in options.dtypes:
            algo, before, after = _in_dtype(block, c, dtype_from_name(d), census, d, backend)
            causes = [("input_nan", c.nan), ("inf_input", c.posinf), *before, ("fully_masked", c.all_masked), *after]
            outs = [_run(spec, algo.xc, method_params) for spec in specs]
            metrics = _cell_metrics(backend, plain, c, specs, [o.probs for o in outs], algo)  # one pass for the dtype's cells
            for spec, out, m in zip(specs, outs, metrics):
                cells[(spec.name, d)].update(c, out.probs, out.events, algo, causes, m)
            del algo, outs, metrics
        if progress is not None:
            progress(c.x.shape[0])
        del c, x, block  # free this chunk before the next one is read
    if start != rows:
        raise AttncheckError(f"{name}: got {start} rows, expected {rows} for shape {shape}")

    result = TensorDiagnosis(
        name=name,
        shape=shape,
        dtype=dtype_label(dtype),
        census=census.finish(shape, dtype_label(dtype), rows),
        distribution=dist.finish(),
        cells=[cells[(m, d)].finish(lead) for m in options.methods for d in options.dtypes],
        findings=[],
        options=options,
        attention=attention,
        limits={d: limits_of(dtype_from_name(d)) for d in options.dtypes},
        backend=backend.name,
    )
    result.findings = findings_for(result)
    return result


def _run(spec, xc: torch.Tensor, method_params: MethodParams):
    """One registered method on the cast scores, its output dtype checked against the registry."""
    out = spec.function()(xc, method_params)
    want = xc.dtype if spec.output == "dtype" else torch.float32
    if out.probs.dtype != want or out.probs.shape != xc.shape:
        raise TypeError(f"method {spec.name} returned {out.probs.dtype} {tuple(out.probs.shape)}; its registry entry promises {want} {tuple(xc.shape)}")
    return out


def _cell_metrics(backend: RowBackend, plain: TorchRows, c: ChunkFacts, specs, probs, algo: AlgoReference):
    """Row metrics of each cell: the backend's, except for methods the fused kernel does not serve."""
    served = [i for i, spec in enumerate(specs) if spec.fused or backend is plain]
    rest = [i for i in range(len(specs)) if i not in served]
    out = [None] * len(specs)
    for group, b in ((served, backend), (rest, plain)):
        if group:
            for i, m in zip(group, b.cell_metrics(c, [probs[i] for i in group], algo)):
                out[i] = m
    return out


def _first_finite(x: torch.Tensor) -> float | None:
    fin = torch.isfinite(x).reshape(-1)
    idx = torch.nonzero(fin)
    return float(x.reshape(-1)[idx[0, 0]]) if idx.numel() else None


def _cast(c: ChunkFacts, dt: torch.dtype, census: CensusAcc, name: str, backend: RowBackend):
    """Cast the chunk to ``dt``; return the rows the cast broke and the cast scores with
    their algo reference."""
    x = c.x
    if dt == x.dtype:
        return torch.zeros_like(c.bad), backend.same_reference(c)
    xc = cast(x, dt)
    algo = backend.algo_reference(xc)
    # Rounding is monotonic, so only a finite value beyond dt's largest can round to inf:
    # the rows to check are known from the census, whatever -inf masks the rows carry.
    top = torch.finfo(dt).max
    suspect = (c.max_finite > top) | (c.min_finite < -top)
    cast_made = torch.zeros_like(c.bad)
    if bool(suspect.any()):
        idx = torch.nonzero(suspect).flatten()
        census.update_cast(name, x, xc, idx)
        xcb = xc[idx]
        cast_made[idx] = (torch.isposinf(xcb).any(dim=-1) & ~c.posinf[idx]) | (torch.isneginf(xcb).all(dim=-1) & ~c.all_neginf[idx])
    return cast_made, algo


def _in_dtype(block, c: ChunkFacts, dt: torch.dtype, census: CensusAcc, name: str, backend: RowBackend):
    """Scores of one block in ``dt`` with their algo reference, and the pipeline causes
    before and after 'fully_masked'."""
    if isinstance(block, torch.Tensor) or hasattr(block, "audit_dtype"):
        if not isinstance(block, torch.Tensor):  # given scores: the Q/K pipeline runs for the audit
            block.audit_dtype(dt)
        cast_made, algo = _cast(c, dt, census, name, backend)
        return algo, [], [("cast_overflow", cast_made)]
    xc, before, after = block.in_dtype(dt)  # scores the model computes in dt (Q@K^T, scale, mask)
    return backend.algo_reference(xc), before, after


def diagnose_attention(
    name: str,
    inputs: "AttentionInputs",
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    scores=None,
    notice: Callable[[str], None] | None = None,
) -> TensorDiagnosis:
    """Diagnose the scores that Q, K and a mask produce in each dtype.

    With ``scores`` (what the model actually produced: a tensor, or a
    ``loaders.TensorSource`` read in row blocks) also given, those are diagnosed
    instead, and the scale that maps q.k onto them is fitted.
    """
    from attncheck.loaders import TensorSource, memory_source
    from attncheck.numerics.scores import fit_scale, given_blocks, score_blocks, start_audit

    options = options or Options()
    audit = start_audit(inputs)
    if scores is not None:
        source = scores if isinstance(scores, TensorSource) else memory_source(name, scores)
        check_scores_dtype(name, source.dtype)
        step = rows_per_chunk(source.shape[-1], options)
        audit.fitted_scale = fit_scale(source, inputs, step)
        blocks = given_blocks(source, inputs, step, resolve_device(options.device), audit)
        return diagnose_chunks(name, source.shape, source.dtype, blocks, options, progress, attention=audit, notice=notice)
    step = rows_per_chunk(inputs.k.shape[2], options)
    blocks: Iterable[QKBlock] = score_blocks(inputs, step, resolve_device(options.device), audit)
    return diagnose_chunks(name, inputs.score_shape, inputs.q.dtype, blocks, options, progress, attention=audit, notice=notice)
