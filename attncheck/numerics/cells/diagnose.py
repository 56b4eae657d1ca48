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
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from attncheck.devices import resolve_device
from attncheck.errors import AttncheckError, param
from attncheck.numerics.backends import AlgoReference, ChunkFacts, RowBackend, select_backend
from attncheck.numerics.backends.torch_rows import TorchRows
from attncheck.numerics.bounded import diagnose_bounded
from attncheck.numerics.cells.accumulate import CellAcc, CensusAcc, DistAcc, HeadMax
from attncheck.numerics.cells.groups import GroupTaps
from attncheck.numerics.cells.limits import cell_limit
from attncheck.numerics.cells.plan import CellKey, grid, stages
from attncheck.numerics.inputs.scores import fit_scale, given_blocks, score_blocks, start_audit
from attncheck.numerics.methods.fp8_attention import Fp8Setup
from attncheck.numerics.methods.softmax import Buffers, MethodParams
from attncheck.numerics.precision import (
    cast,
    check_scores_dtype,
    dtype_from_name,
    dtype_label,
    limits_of,
)
from attncheck.numerics.reduce import any_true, count, row_counts
from attncheck.numerics.sinks import KeyShareAcc, visible_keys
from attncheck.options import Options, chunk_elements_for, rows_per_chunk  # noqa: F401  (part of this module's API)
from attncheck.params import fp8_accum_bits
from attncheck.registry import METHODS, PATHS, fp8_names
from attncheck.results import ASKED, TensorDiagnosis
from attncheck.sources import TensorSource, memory_source

if TYPE_CHECKING:
    from attncheck.numerics.inputs.scores import AttentionInputs, QKBlock

__all__ = ["Options", "diagnose", "diagnose_attention", "diagnose_chunks", "resolve_device"]


def check_scores(name: str, x: torch.Tensor) -> None:
    """Refuse tensors the diagnosis cannot take, naming what was found."""
    check_scores_dtype(name, x.dtype)
    if x.dim() == 0:
        raise AttncheckError(f"{name}: is a scalar; scores need at least one axis (the last axis holds the keys)")
    if x.numel() == 0:
        raise AttncheckError(f"{name}: is empty (shape {tuple(x.shape)})")


def diagnose(
    name: str,
    scores: torch.Tensor,
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
    cells: list[CellKey] | None = None,
    attention=None,
) -> TensorDiagnosis:
    """Diagnose one score tensor; the softmax runs over its last axis. ``cells``: which to
    compute (default: every method x dtype of ``options``); ``attention``: a Q/K audit to attach."""
    options = options or Options()
    check_scores(name, scores)
    keys = scores.shape[-1]
    rows = scores.numel() // keys
    flat = scores.reshape(rows, keys)  # (R, T); a view when contiguous
    step = rows_per_chunk(keys, options, cells)
    chunks = (flat[start : start + step] for start in range(0, rows, step))
    return diagnose_chunks(
        name,
        tuple(scores.shape),
        scores.dtype,
        chunks,
        options,
        progress,
        attention=attention,
        notice=notice,
        cells=cells,
    )


@contextmanager
def bookkeeping(device: torch.device):
    """Per-row bookkeeping (accumulators over vectors of one value per row) on one torch
    thread. Those ops are small; spread over threads that sleep between ops (the command
    sets OMP_WAIT_POLICY=PASSIVE, so that a busy machine is not slowed by spinning), each
    paid a wake-up: 64-key rows spent 1.6 s of a 5 s run in them, against 0.5 s on one
    thread. The kernels and whole-tensor ops keep every thread."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def diagnose_chunks(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    chunks: Iterable,
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    attention=None,
    notice: Callable[[str], None] | None = None,
    qk: bool = False,
    cells: list[CellKey] | None = None,
    taps: GroupTaps | None = None,
) -> TensorDiagnosis:
    """Diagnose a score tensor that arrives as consecutive (rows, keys) blocks, in row order.

    A block is a (rows, keys) tensor of scores (cast to each dtype), or, with ``qk``, a
    ``scores.QKBlock`` from which each attention path computes its scores, probabilities
    and output per dtype. Results do not depend on how the rows are split. ``cells``: the
    cells to compute (``plan.CellKey``; default: every cell ``options`` asks for), each fed
    by the stage that computes its scores. ``progress`` is called with the number of rows
    finished after each block; ``notice`` hears one line when the fused kernels compile for
    the first time. ``attention`` is the Q/K audit to attach. ``taps``: a bounded diagnosis's groups, whose
    blocks also feed their group's accumulators (``groups.GroupTaps``; its ``figures`` once finished).
    """
    options = options or Options()
    device = resolve_device(options.device)
    lead = shape[:-1]
    rows = math.prod(lead) if lead else 1
    plan = cells if cells is not None else grid(options, qk)
    if not plan:
        raise AttncheckError(_no_cell(options, qk))
    census = _census(plan, qk)
    dist = DistAcc(options.collapse_threshold)
    heads = tuple(shape[:-2]) if len(shape) >= 3 else ()  # (batch, heads, ...) of (..., queries, keys)
    queries = shape[-2] if heads else 1

    accs = _cell_accs(plan, options, heads, queries)
    if taps is not None:
        taps.start(lambda: _cell_accs(plan, options, heads, queries), lambda: DistAcc(options.collapse_threshold))
    head_max = HeadMax(heads[-1] if heads else 0, queries)
    per_query = shape[-2] if len(shape) >= 2 else 1  # key shares: rows grouped by (leading..., query)
    shares = KeyShareAcc(rows // max(per_query, 1), heads[-1] if heads else 1, per_query)
    backend = select_backend(options.kernels, device, math.prod(shape), notice)
    plain = TorchRows()  # metrics of methods the fused kernel does not serve
    # given scores: naive, stable and torch write into buffers reused from chunk to chunk
    method_params = MethodParams(
        block=options.block,
        reverse=options.reverse,
        accum=options.accum,
        buffers=None if qk else Buffers(),
        fa4=options.fa4,
    )
    accums = (accs, census, dist, head_max, shares, taps)
    start = _feed(chunks, plan, qk, device, options, accums, backend, plain, method_params, progress)
    if start != rows:
        raise AttncheckError(f"{name}: got {start} rows, expected {rows} for shape {shape}")

    census_result = census.finish(shape, dtype_label(dtype), rows)
    if taps is not None:
        taps.finish(plan, lead)
    result_cells = _finish_cells(plan, accs, lead, method_params, options, dtype, census_result, census, attention)
    result = TensorDiagnosis(
        name=name,
        shape=shape,
        dtype=dtype_label(dtype),
        census=census_result,
        distribution=dist.finish(),
        cells=result_cells,
        findings=[],
        settings=settings_of(options),
        attention=attention,
        # fp32's too: the kernels' exps and statistics are fp32 whatever the cell's dtype (the kernel hazards' limits)
        limits={d: limits_of(dtype_from_name(d)) for d in dict.fromkeys([*(k.dtype for k in plan), "fp32"])},
        backend=backend.name,
        head_max_logits=head_max.values(),
        key_shares=shares.finish(),
    )
    return result


def _cell_accs(plan, options: Options, heads: tuple[int, ...], queries: int) -> dict:
    """A fresh accumulator per cell of ``plan``."""
    return {
        key: CellAcc(key.method, key.dtype, options.max_examples, heads, queries, path=key.path, role=key.role)
        for key in plan
    }


def _census(plan, qk: bool) -> CensusAcc:
    """The census's accumulator, with the dtypes whose headroom it measures."""
    fp8 = set(fp8_names())
    # headroom per dtype: the scores each dtype's cells hold (given scores cast; eager's S)
    census = CensusAcc(
        tuple(
            dict.fromkeys(
                c.dtype for c in plan if c.dtype not in fp8 and (not qk or PATHS.get(c.path).scores == "dtype")
            )
        )
    )
    return census


def _feed(chunks, plan, qk, device, options, accums, backend, plain, method_params, progress):
    """Each chunk of rows into the accumulators ``accums`` (cells, census, distribution, head maxima, key shares,
    a bounded diagnosis's group taps): the census, distribution, head maxima and key shares, then each stage's cells,
    and a group's cells and distribution where the chunk is a group's. Returns the rows fed."""
    accs, census, dist, head_max, shares, taps = accums
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
            block.mark_masked(c)  # masked keys and rows from the mask itself, not from score values
            block.audit_reference(c.ref, c.ref_ok)
        start += c.x.shape[0]
        group = None if taps is None else taps.of(block)
        with bookkeeping(device):
            census.update(c)
            dist.update(c)
            if group is not None:
                group[1].update(c)
            head_max.update(c)
            shares.update(c.ref, c.offset, visible_keys(c.x, getattr(block, "key_masked", None), c.masked), c.ref_ok)
        out_ref: list = []  # P64 @ V64 of the chunk, computed by the first stage that needs it
        fed = (accs,) if group is None else (accs, group[0])
        for path, d, keys in stages(plan):
            if qk:
                _path_stage(block, c, path, d, keys, options, fed, census, backend, plain, method_params, out_ref)
            else:
                _method_stage(block, c, d, keys, options, accs, census, backend, plain, method_params)
        if progress is not None:
            progress(c.x.shape[0])
        del c, x, block, out_ref  # free this chunk before the next one is read
    return start


def _finish_cells(plan, accs, lead, method_params, options, dtype, census_result, census, attention) -> list:
    """Each cell finished, with its limit (``cell_limit``) and, for a settings sweep, its setting."""
    result_cells = []
    for key in plan:
        cell = accs[key].finish(lead)
        cell_params = _cell_params(method_params, options, key)
        cell.limit = cell_limit(key, dtype, census_result, census.spread.value, attention, options.p_scale, cell_params)
        if key.setting is not None:
            s = key.setting
            cell.variant = s.label
            cell.setting = dict(s.values, default=s.default, refused=s.refused)
        result_cells.append(cell)
    return result_cells


def settings_of(options: Options) -> dict:
    """How the cells were computed, as plain values (the JSON report's ``options``)."""
    return {f.name: getattr(options, f.name) for f in fields(options) if f.name != "bounded"}  # bounded: .sampling


def _kernels_that_run(
    inputs: "AttentionInputs", cells: list[CellKey], notice: Callable[[str], None] | None
) -> list[CellKey]:
    """The cells asked of Q/K files (``ASKED``), less those of a GPU kernel that would not run these inputs
    (``PathSpec.why_not``: fa2 in fp32, cudnn at head dim 512, ...): each left out is one notice line, and
    none left is an input error. A captured call's cells were chosen by what ran it and are kept."""
    kept, dropped = [], []
    for c in cells:
        spec = PATHS.get(c.path) if c.path is not None else None
        facts = inputs.facts(c.dtype)
        # a GPU kernel's limits (dtypes, head dims, masks); the CPU paths compute whatever they are asked
        why = None if spec is None or c.role != ASKED or spec.device != "cuda" else spec.why_not(facts)
        (dropped if why else kept).append((c, why))
    if not kept and dropped:
        raise AttncheckError(
            "no cell to compute: the kernels would not run these inputs: "
            + "; ".join(f"{c.name}: {why}" for c, why in dropped)
        )
    if dropped and notice is not None:
        for c, why in dropped:
            notice(f"{c.name}: not computed, the kernel would not run these inputs ({why})")
    return [c for c, _ in kept]


def _no_cell(options: Options, qk: bool) -> str:
    fp8 = [d for d in options.dtypes if d in fp8_names()]
    if not qk:
        casts = ", ".join(METHODS.names(lambda spec: spec.p_cast))
        return (
            f"no cell to compute: in {', '.join(fp8)} only a softmax that casts P to FP8 runs ({casts}); "
            f"add it to {param('methods')} or a dtype such as fp16"
        )
    fp8_paths = ", ".join(PATHS.names(lambda spec: spec.computes_in(True)))
    return (
        f"no cell to compute: the paths {', '.join(options.paths)} do not run in {', '.join(options.dtypes)} "
        f"(FP8 dtypes take {fp8_paths}; the others take the rest)"
    )


def _cell_params(method_params: MethodParams, options: Options, key: CellKey) -> MethodParams:
    """The method parameters a cell computes with: FP8 dtypes' setup, and its point of a settings grid."""
    params_d = _fp8_params(method_params, options, key.dtype) if key.dtype in fp8_names() else method_params
    return params_d if key.setting is None else replace(params_d, **dict(key.setting.params))


def _fp8_params(method_params: MethodParams, options: Options, d: str) -> MethodParams:
    """The method parameters of FP8 dtype ``d``'s cells: its format, the P scale, the quantisation."""
    setup = Fp8Setup(
        fmt=dtype_from_name(d),
        scaling=options.fp8_scaling,
        incoherent=options.incoherent,
        p_scale=options.p_scale,
        accum_bits=fp8_accum_bits(options.fp8_accum),
        accum_flush=options.fp8_flush,
    )
    return replace(method_params, fp8=setup)


def _method_stage(
    block, c: ChunkFacts, d: str, keys, options: Options, accs, census, backend, plain, method_params
) -> None:
    """Given scores: the cast to one dtype, and its methods on the cast scores."""
    specs = [METHODS.get(k.method) for k in keys]
    params_d = method_params
    if d in fp8_names():  # P formats: the scores stay fp32 (as FlashAttention-3's S), P is cast inside the method
        params_d = _fp8_params(method_params, options, d)
        algo, before, after = _in_dtype(block, c, torch.float32, census, "fp32", backend)
    else:
        algo, before, after = _in_dtype(block, c, dtype_from_name(d), census, d, backend)
        extremes = _extremes_in_dtype(block, c, algo.xc)
        with bookkeeping(c.x.device):
            census.update_headroom(d, c, *extremes)
    causes = [("input_nan", c.nan), ("inf_input", c.posinf), *before, ("fully_masked", c.all_masked), *after]
    outs = [backend.method(spec, algo, params_d) or _run(spec, algo.xc, params_d) for spec in specs]
    metrics = _cell_metrics(
        backend, plain, c, [s.fused for s in specs], [o.probs for o in outs], algo, d == "fp32"
    )  # one pass for the stage's cells
    with bookkeeping(c.x.device):
        for key, out, m in zip(keys, outs, metrics):
            accs[key].update(
                c, out.probs, out.events, algo, causes, m, pcast=out.pcast, extremes=out.extremes, counts=out.counts
            )


def _path_stage(
    block: "QKBlock",
    c: ChunkFacts,
    path: str,
    d: str,
    keys,
    options: Options,
    accs,
    census,
    backend,
    plain,
    method_params,
    out_ref: list,
) -> None:
    """With Q and K: one path in one dtype computes its scores, probabilities and output, into each of ``accs``
    (the cells' accumulators, and a group's where the chunk is a group's). ``out_ref`` holds the chunk's
    P64 @ V64 once a stage has computed it (shared by the stages)."""
    fp8 = d in fp8_names()
    dt = dtype_from_name(d)
    params_d = _fp8_params(method_params, options, d) if fp8 else replace(method_params, online=backend.online)
    if keys[0].setting is not None:  # a stage's cells share one setting (plan.stages)
        params_d = replace(params_d, **dict(keys[0].setting.params))
    spec = PATHS.get(path)
    pb = spec.function()(block, dt, [k.method for k in keys], params_d)
    if spec.scores == "dtype":
        census.update_headroom(d, c, *_extremes_in_dtype(block, c, pb.scores))
    algo = backend.algo_reference(pb.scores)
    causes = [("input_nan", c.nan), ("inf_input", c.posinf), *pb.before, ("fully_masked", c.all_masked), *pb.after]
    in_dtype = spec.probs_in == "the dtype" and not spec.runs_methods
    for m, out in pb.cells:
        held = (in_dtype or spec.runs_methods and METHODS.get(m).output == "dtype") and not fp8
        _check_output(m, out, dt if held else torch.float32, pb.scores.shape)
    fused = [METHODS.get(m).fused if spec.runs_methods else True for m, _ in pb.cells]
    metrics = _cell_metrics(backend, plain, c, fused, [o.probs for _, o in pb.cells], algo, d == "fp32")
    tied = out_algo = None
    if block.v is not None:
        if not out_ref:
            out_ref.append(block.reference_out(c.ref))  # (r, dv) float64: P64 @ V64
        tied = _tied_rows(pb.scores)
        # The path's own rounding: float64 softmax of its scores times V as the dtype holds it
        # (FP8 paths: V as given; its quantisation is the path's).
        ref_algo = algo.ref if bool(algo.ok.all()) else torch.where(algo.ok[:, None], algo.ref, torch.nan)
        out_algo = block.reference_out(ref_algo, None if fp8 else dt)
    for key, (m, out), met in zip(keys, pb.cells, metrics):
        for acc in (a[key] for a in accs):
            with bookkeeping(c.x.device):
                acc.update(
                    c,
                    out.probs,
                    out.events,
                    algo,
                    causes,
                    met,
                    pcast=out.pcast,
                    extremes=out.extremes,
                    counts=out.counts,
                )
            if out.out is not None:
                acc.update_out(out.out, out_ref[0], tied, out_algo)
                acc.out.causes.update(block.v, out.probs, out.out, None if fp8 else dt, c.offset)
                acc.tied_rows += count(tied)
                for name, o in out.companions.items():  # the same kernel under other FP8 accumulators
                    acc.update_companion(name, o, out_ref[0])
            if out.accum is not None:
                acc.accum, acc.accum_keys = out.accum, pb.scores.shape[-1]


def _tied_rows(s: torch.Tensor) -> torch.Tensor:
    """(r,) rows whose largest (finite) score is held by two or more keys."""
    top = s.amax(dim=-1, keepdim=True)
    return (row_counts(s == top) >= 2) & torch.isfinite(top.squeeze(-1))


def _check_output(name: str, out, want: torch.dtype, shape) -> None:
    if out.probs.dtype != want or tuple(out.probs.shape) != tuple(shape):
        raise TypeError(
            f"method {name} returned {out.probs.dtype} {tuple(out.probs.shape)}; its registry entry promises {want} "
            f"{tuple(shape)}"
        )


def _run(spec, xc: torch.Tensor, method_params: MethodParams):
    """One registered method on the cast scores, its output dtype checked against the registry."""
    out = spec.function()(xc, method_params)
    _check_output(spec.name, out, xc.dtype if spec.output == "dtype" else torch.float32, xc.shape)
    return out


def _cell_metrics(
    backend: RowBackend,
    plain: TorchRows,
    c: ChunkFacts,
    fused: list[bool],
    probs,
    algo: AlgoReference,
    precise: bool = False,
):
    """Row metrics of each cell: the backend's, except for methods the fused kernel does not serve.
    ``precise``: the cells are fp32 ones (see ``RowBackend.cell_metrics``)."""
    served = [i for i, f in enumerate(fused) if f or backend is plain]
    rest = [i for i in range(len(fused)) if i not in served]
    out = [None] * len(fused)
    for group, b in ((served, backend), (rest, plain)):
        if group:
            for i, m in zip(group, b.cell_metrics(c, [probs[i] for i in group], algo, precise)):
                out[i] = m
    return out


def _first_finite(x: torch.Tensor) -> float | None:
    flat = x.reshape(-1)
    if flat.numel() and math.isfinite(first := float(flat[0])):
        return first
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
    if any_true(suspect):
        idx = torch.nonzero(suspect).flatten()
        census.update_cast(name, x, xc, idx)
        xcb = xc[idx]
        cast_made[idx] = (torch.isposinf(xcb).any(dim=-1) & ~c.posinf[idx]) | (
            torch.isneginf(xcb).all(dim=-1) & ~c.all_neginf[idx]
        )
    return cast_made, algo


def _extremes_in_dtype(block, c: ChunkFacts, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r,) float64: each row's largest finite score and smallest unmasked one as the cells of
    xc's dtype see them; where the dtype turns a finite score into +inf, the score as given."""
    if isinstance(block, torch.Tensor) or hasattr(block, "audit_dtype"):  # scores as given
        # Rounding is monotonic, so the cast of a row's extremes are the cast row's extremes;
        # the cast rounds once from the input's dtype, as the cells' cast does.
        top = cast(c.max_finite.to(c.x.dtype), xc.dtype).to(torch.float64)
        low = cast(c.unmasked_min.to(c.x.dtype), xc.dtype).to(torch.float64)
        return torch.where(torch.isposinf(top), c.max_finite, top), low
    return block.extremes(xc)


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
    cells: list[CellKey] | None = None,
    scale_source: str | None = None,
    fit: bool = True,
    cuts: list[int] | None = None,
    taps: GroupTaps | None = None,
) -> TensorDiagnosis:
    """Diagnose the scores that Q, K and a mask produce in each dtype.

    With ``scores`` (what the model actually produced: a tensor, or a
    ``loaders.TensorSource`` read in row blocks) also given, those are diagnosed
    instead, and the scale that maps q.k onto them is fitted. ``cells``: which to compute
    (default: every path x dtype of ``options``); ``scale_source``: 'argument' or 'traced'
    when the scale is the model's own choice (``AttentionAudit.scale_source``); ``fit`` False: the
    given scores' scale is known (that one), so none is fitted. ``cuts`` and ``taps``: a bounded diagnosis's
    segments of the query axis, no block of rows across one, and its groups' accumulators (``diagnose_chunks``).
    """
    options = options or Options()
    if scores is not None:
        audit = start_audit(inputs)
        audit.scale_source = scale_source
        source = scores if isinstance(scores, TensorSource) else memory_source(name, scores)
        check_scores_dtype(name, source.dtype)
        step = rows_per_chunk(source.shape[-1], options, cells)
        audit.fitted_scale = fit_scale(source, inputs, step) if fit else None
        blocks = given_blocks(source, inputs, step, resolve_device(options.device), audit)
        return diagnose_chunks(
            name, source.shape, source.dtype, blocks, options, progress, attention=audit, notice=notice, cells=cells
        )
    cells = _kernels_that_run(inputs, cells if cells is not None else grid(options, True), notice)
    if options.bounded is not None:  # --budget/--rows: the rows that can fail in full, a sample of the rest
        return diagnose_bounded(name, inputs, options, cells, progress, notice, scale_source, diagnose_attention)
    audit = start_audit(inputs)  # after the bounded diagnosis's branch: each of its diagnoses audits its own rows
    audit.scale_source = scale_source
    step = rows_per_chunk(inputs.k.shape[2], options, cells)
    blocks: Iterable[QKBlock] = score_blocks(inputs, step, resolve_device(options.device), audit, cuts)
    return diagnose_chunks(
        name,
        inputs.score_shape,
        inputs.q.dtype,
        blocks,
        options,
        progress,
        attention=audit,
        notice=notice,
        qk=True,
        cells=cells,
        taps=taps,
    )
