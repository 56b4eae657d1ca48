"""One call's backward, per cell: dQ, dK, dV of each path against float64, their NaN rows and first
causes, the loss-scale headroom, FlashAttention's 2x rule, and the model's recorded gradients.

The heads are taken in blocks of whole GQA groups (a block's float64 work stays within the chunk
budget); per block the float64 reference is computed once for every cell. No printing, no paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from attncheck.numerics.backward import paths as bw
from attncheck.numerics.inputs.index_mask import IndexMask
from attncheck.numerics.inputs.scores import AttentionInputs
from attncheck.numerics.precision import cast, dtype_from_name, dtype_label, rounding_limit, smallest_subnormal, ulp
from attncheck.registry import PATHS
from attncheck.results import GRAD_CAUSES, CellBackward, GradStats


def has_backward(path: str | None) -> bool:
    """A path with a backward (``PathSpec.backward``; the FP8 and flex kernels have none)."""
    return path is not None and PATHS.get(path).backward is not None


def backward_of(cell: "BackwardCell") -> str:
    """The backward algorithm of a cell's path: 'eager', 'math' or 'recompute'."""
    return PATHS.get(cell.path).backward or ""


def cpu_blocks(cell: "BackwardCell", grads: "GradInputs") -> bool:
    """The CPU flash kernel's backward, with its sums rounded to the dtype per block: a flash backward
    of a path that runs on the CPU, for gradients not recorded on a GPU."""
    return backward_of(cell) == "recompute" and PATHS.get(cell.path).device == "cpu" and grads.device_type != "cuda"


MAX_EXAMPLES = 5


@dataclass(frozen=True)
class BackwardCell:
    """A cell whose backward is asked: a path and dtype, and for eager how the model applied its
    mask and in which dtype its softmax ran."""

    path: str  # a path with a backward (``has_backward``)
    dtype: str
    mask_op: str = "add"  # eager: 'add' or 'fill'
    softmax_dtype: str | None = None  # eager: torch.softmax(..., dtype=)
    scores_dtype: str | None = None  # eager: the dtype the scores reach the softmax in, where not ``dtype`` (autocast)
    model: bool = False  # the model's own cell: compared with the recorded gradients


@dataclass
class GradInputs:
    """What the backward reads beyond the forward's inputs, shaped like them: the output gradient
    dO (lead..., Hq, Tq, dv), and for a captured call the scores its softmax saw, the output its
    kernel gave and the gradients it produced (dq like q, dk and dv like k and v)."""

    dout: torch.Tensor
    scores: torch.Tensor | None = None
    out: torch.Tensor | None = None
    real: dict[str, torch.Tensor] = field(default_factory=dict)  # 'dq', 'dk', 'dv'
    device_type: str = (
        "cpu"  # where the model ran: the flash backward's sums per block in the dtype on the CPU, fp32 on CUDA
    )
    dropout_p: float = (
        0.0  # dropout the call applied to its probabilities: judged without it (its random mask is not recorded)
    )
    causal: bool = False  # SDPA's is_causal: the flash kernel fills and skips the keys past each query


def _as_heads(t: torch.Tensor, heads: int, tokens: int) -> torch.Tensor:
    """(lead..., H, T, x) -> (B*H, T, x), the way the inputs were normalised."""
    return t.reshape(-1, heads, tokens, t.shape[-1]).reshape(-1, tokens, t.shape[-1])


def _slice_heads(t: torch.Tensor | IndexMask | None, h0: int, h1: int, heads: int) -> torch.Tensor | None:
    """Query heads [h0, h1) of the flattened (batch x heads) axis of a (B?, H?, Tq, Tk) tensor
    that may broadcast over batch or heads, without materialising the broadcast. Causal and padding alone
    (``IndexMask``) make those planes from their rules."""
    if t is None:
        return None
    if isinstance(t, IndexMask):
        return t.rows(slice(h0, h1), slice(None))
    idx = torch.arange(h0, h1)
    b = idx // heads if t.shape[0] > 1 else torch.zeros_like(idx)
    h = idx % heads if t.shape[1] > 1 else torch.zeros_like(idx)
    return t[b, h]


class _GradAcc:
    """Accumulates one gradient of one cell over the head blocks."""

    def __init__(self, heads: int) -> None:
        self.rows = 0
        self.nan_rows = 0
        self.causes = torch.zeros(len(GRAD_CAUSES), dtype=torch.int64)
        self.per_head = torch.zeros(heads, dtype=torch.int64)
        self.examples: list[tuple[int, ...]] = []
        self.compared = 0
        self.max_err = 0.0
        self.sq_err = 0.0
        self.sq_ref = 0.0
        self.max_ref = 0.0
        self.nonzero = 0
        self.flushed = 0
        self.real_diff: float | None = None
        self.real_ratio: float | None = None
        self.real_mismatch = 0

    def update(self, g: torch.Tensor, ref: torch.Tensor, cause: torch.Tensor, head0: int, heads: int) -> None:
        """g, ref (n, T, x) for heads head0.. of the flattened (batch x heads) axis; cause (n, T)
        the index in GRAD_CAUSES of each row's first cause."""
        self.rows += g.shape[0] * g.shape[1]
        bad = ~torch.isfinite(g).all(dim=-1)  # (n, T)
        n_bad = int(bad.sum())
        if n_bad:
            self.nan_rows += n_bad
            self.causes += torch.bincount(cause[bad], minlength=len(GRAD_CAUSES))
            per = bad.sum(dim=-1)  # (n,)
            hs = torch.arange(head0, head0 + g.shape[0]) % heads
            self.per_head.index_add_(0, hs, per)
            if len(self.examples) < MAX_EXAMPLES:
                for i, t in bad.nonzero()[: MAX_EXAMPLES - len(self.examples)].tolist():
                    flat = head0 + i
                    self.examples.append((flat // heads, flat % heads, t))
        g64, r = g.to(torch.float64), ref
        both = torch.isfinite(g64) & torch.isfinite(r)
        err = torch.where(both, (g64 - r).abs(), 0.0)
        rr = torch.where(both, r, 0.0)
        self.compared += int(both.sum())
        if err.numel():
            self.max_err = max(self.max_err, float(err.max()))
            self.max_ref = max(self.max_ref, float(rr.abs().max()))
        self.sq_err += float((err * err).sum())
        self.sq_ref += float((rr * rr).sum())
        nz = both & (r != 0)
        self.nonzero += int(nz.sum())
        self.flushed += int((nz & (g64 == 0)).sum())

    def compare_real(self, real: torch.Tensor, g: torch.Tensor, tol: torch.Tensor) -> None:
        """The model's recorded gradient against this cell's, elementwise within ``tol``."""
        a, b = real.to(torch.float64), g.to(torch.float64)
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        self.real_mismatch += int((fa != fb).sum())
        both = fa & fb
        diff = torch.where(both, (a - b).abs(), 0.0)
        ratio = torch.where(both, diff / tol, 0.0)
        if diff.numel():
            self.real_diff = max(self.real_diff or 0.0, float(diff.max()))
            self.real_ratio = max(self.real_ratio or 0.0, float(ratio.max()))
        elif self.real_diff is None:
            self.real_diff, self.real_ratio = 0.0, 0.0

    def result(self, baseline: float | None, dt: torch.dtype) -> GradStats:
        causes = {GRAD_CAUSES[i]: int(n) for i, n in enumerate(self.causes.tolist()) if n}
        first = next((c for c in GRAD_CAUSES if c in causes), None)  # the earliest in backward order: the others' root
        compared = self.compared > 0
        # FlashAttention's rule: 2x the baseline's error plus two ulps of the largest gradient
        bound = None if baseline is None or not compared else 2.0 * baseline + 2.0 * ulp(self.max_ref, dt)
        return GradStats(
            rows=self.rows,
            nan_rows=self.nan_rows,
            first_cause=first,
            causes=causes,
            compared=self.compared,
            max_abs_err=self.max_err if compared else None,
            rel_err=(
                math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else (0.0 if self.sq_err == 0 else math.inf)
            )
            if compared
            else None,
            max_abs_ref=self.max_ref if compared else None,
            flushed_frac=self.flushed / self.nonzero if self.nonzero else None,
            nan_rows_per_head=self.per_head.tolist(),
            examples=list(self.examples),
            baseline_err=baseline,
            rule_bound=bound,
            real_max_diff=self.real_diff,
            real_bound_ratio=self.real_ratio,
            real_nan_mismatch=self.real_mismatch,
        )


def _without_recorded(hb: bw.HeadBlock) -> bw.HeadBlock:
    """A head block for a cell other than the model's: it computes its own scores and output."""
    return replace(hb, scores=None, out=None) if hb.scores is not None or hb.out is not None else hb


def _is_baseline(cell: BackwardCell) -> bool:
    """Plain attention in the cell's own dtype (eager, softmax in the dtype): the 2x rule's yardstick."""
    return (
        backward_of(cell) == "eager"
        and cell.softmax_dtype in (None, cell.dtype)
        and cell.scores_dtype in (None, cell.dtype)
    )


def _unit_roundoff(dt: torch.dtype) -> float:
    return torch.finfo(dt).eps / 2


def _cause_index(
    pg: bw.PathGrads, dout_bad: torch.Tensor, dout_nan: torch.Tensor, dout_cast_bad: torch.Tensor, v_bad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the index in GRAD_CAUSES of the first stage that broke it (for dq), and per
    query row the same over the stages that reach dV (dO, its cast to the dtype, and the forward
    probabilities). A row of dO holding NaN is grad_out_nan, one holding inf (and no NaN) grad_out_inf."""
    last = len(GRAD_CAUSES) - 1
    idx = torch.full(dout_bad.shape, last, dtype=torch.int64)
    idx_v = torch.full(dout_bad.shape, last, dtype=torch.int64)
    dp_cause = torch.where(
        v_bad.unsqueeze(-1).expand_as(pg.dp_bad), GRAD_CAUSES.index("input_nan"), GRAD_CAUSES.index("dp_overflow")
    )
    later = [
        (pg.ds_bad & ~pg.ds_nan, GRAD_CAUSES.index("ds_overflow")),
        (pg.ds_nan, GRAD_CAUSES.index("ds_nan")),
        (pg.dp_bad, dp_cause),
    ]
    early = [(rows, GRAD_CAUSES.index(name)) for name, rows in reversed(pg.forward_causes)]
    early += [
        (dout_cast_bad, GRAD_CAUSES.index("grad_out_overflow")),
        (dout_bad, GRAD_CAUSES.index("grad_out_inf")),
        (dout_nan, GRAD_CAUSES.index("grad_out_nan")),
    ]
    for rows, at in later + early:  # the earliest stage is written last, so it wins
        idx = torch.where(rows, at, idx)
    for rows, at in early:
        idx_v = torch.where(rows, at, idx_v)
    return idx, idx_v


def _key_cause(row_cause: torch.Tensor, groups: int, tk: int) -> torch.Tensor:
    """dK/dV rows take the earliest cause over every query row of their kv head's group: (n_kv, Tk)."""
    per_head = row_cause.amin(dim=-1)  # (n,)
    per_kv = per_head.reshape(-1, groups).amin(dim=-1)  # (n_kv,)
    return per_kv.unsqueeze(-1).expand(-1, tk)


def _group_sum(t: torch.Tensor, groups: int, held: torch.dtype | None, dt: torch.dtype) -> torch.Tensor:
    if groups == 1:
        return t.to(dt)
    t = t if held is None else t.to(held)
    return t.reshape(-1, groups, *t.shape[1:]).sum(dim=1).to(dt)


def _run_path(
    cell: BackwardCell, hb: bw.HeadBlock, dt: torch.dtype, grads: GradInputs, exact: bool = True, terms: bool = False
) -> bw.PathGrads:
    kind = backward_of(cell)
    if kind == "eager":
        sd = None if cell.softmax_dtype is None else dtype_from_name(cell.softmax_dtype)
        s_dt = None if cell.scores_dtype is None else dtype_from_name(cell.scores_dtype)
        return bw.eager(hb, dt, cell.mask_op, sd, s_dt, exact=exact, terms=terms)
    if kind == "math":
        return bw.sdpa_math(hb, dt, terms=terms)
    return bw.flash(hb, dt, blocks=cpu_blocks(cell, grads), terms=terms)


def _how(cell: BackwardCell, dt: torch.dtype, grads: GradInputs) -> str:
    kind = backward_of(cell)
    if kind == "eager":
        parts = ["mask filled (masked_fill)" if cell.mask_op == "fill" else "mask added"]
        if cell.scores_dtype and cell.scores_dtype != cell.dtype:
            parts.append(f"matmuls in {cell.dtype}, scores in {cell.scores_dtype}")
        if cell.softmax_dtype and cell.softmax_dtype != (cell.scores_dtype or cell.dtype):
            parts.append(f"softmax in {cell.softmax_dtype}")
        return ", ".join(parts)
    if kind == "recompute":
        if dt == torch.float32:
            return "sums in fp32"
        return (
            f"sums rounded to {cell.dtype} per block (CPU kernel)"
            if cpu_blocks(cell, grads)
            else "sums in fp32, rounded once (CUDA)"
        )
    return "fp32 inside" if dt != torch.float32 else ""


def diagnose_backward(
    inp: AttentionInputs, grads: GradInputs, cells: list[BackwardCell], chunk_elements: int
) -> dict[BackwardCell, CellBackward]:
    """The backward of every cell for one call (``inp``: its q, k, v, mask and scale, as
    ``scores.prepare_inputs`` normalised them)."""
    if inp.v is None:
        return {}
    b, hq, tq, d = inp.q.shape
    hk, tk = inp.k.shape[1], inp.k.shape[2]
    groups = hq // hk
    q = inp.q.reshape(-1, tq, d)
    k = inp.k.reshape(-1, tk, d)
    v = inp.v.reshape(-1, tk, inp.v.shape[-1])
    dout = _as_heads(grads.dout, hq, tq)
    scores = None if grads.scores is None else grads.scores.reshape(-1, tq, tk)
    out = None if grads.out is None else _as_heads(grads.out, hq, tq)
    real = {
        name: _as_heads(t, hq if name == "dq" else hk, tq if name == "dq" else tk) for name, t in grads.real.items()
    }
    accs = {c: {"dq": _GradAcc(hq), "dk": _GradAcc(hk), "dv": _GradAcc(hk)} for c in cells}
    peaks: dict[str, float] = {}  # the largest |dO|, |dP|, |dS|, |dQ|, |dK|, |dV| of the float64 backward
    # FlashAttention's rule compares each path with plain attention in the same dtype: eager, softmax in the
    # dtype. Its tests apply it in fp16 and bf16; in fp32 both errors are rounding noise, so it is not applied.
    baselines = {c.dtype: BackwardCell("eager", c.dtype) for c in cells if not _is_baseline(c) and c.dtype != "fp32"}
    base_err: dict[str, dict[str, float | None]] = {
        d: {"dq": None, "dk": None, "dv": None} for d in baselines
    }  # None: no entry compared
    held: dict[BackwardCell, list[tuple[str, str]]] = {}
    units_per_block = max(1, chunk_elements // max(1, groups * tq * tk))
    dout_rows = 0
    for u0 in range(0, b * hk, units_per_block):
        u1 = min(b * hk, u0 + units_per_block)
        h0, h1 = u0 * groups, u1 * groups
        hb = _head_block(inp, grads, q, k, v, dout, scores, out, u0, u1, h0, h1, groups, hq)
        rq, rk, rv = _reference(hb, groups, tk, d, peaks)
        dout_bad = ~torch.isfinite(hb.dout).all(dim=-1)  # (n, Tq)
        dout_nan = torch.isnan(hb.dout).any(dim=-1)
        dout_rows += int(dout_bad.sum())
        v_bad = ~torch.isfinite(hb.v).reshape(hb.v.shape[0], -1).all(dim=-1)  # (n,)
        _baseline_errors(baselines, hb, grads, groups, rq, rk, rv, base_err)
        _cell_errors(
            cells,
            hb,
            grads,
            real,
            accs,
            held,
            (rq, rk, rv),
            (dout_bad, dout_nan, v_bad),
            (h0, h1, u0, u1),
            groups,
            tk,
            hq,
            hk,
        )
    return _results(cells, accs, base_err, held, peaks, grads, dout_rows, real)


def _head_block(inp, grads, q, k, v, dout, scores, out, u0, u1, h0, h1, groups, hq) -> bw.HeadBlock:
    """Query heads h0..h1 (kv heads u0..u1, repeated over their group) with their dO, mask and recorded tensors."""
    kx, vx = k[u0:u1], v[u0:u1]
    if groups > 1:
        kx, vx = kx.repeat_interleave(groups, dim=0), vx.repeat_interleave(groups, dim=0)
    hb = bw.HeadBlock(
        q=q[h0:h1],
        k=kx,
        v=vx,
        dout=dout[h0:h1],
        masked=_slice_heads(inp.masked, h0, h1, hq),
        mask_float=_slice_heads(inp.mask_float, h0, h1, hq),
        scale=inp.scale,
        scale_order=inp.scale_order,
        mask_value=inp.eager_value,
        sdpa_mask_value=inp.mask_value,
        scores=None if scores is None else scores[h0:h1],
        out=None if out is None else out[h0:h1],
        causal=grads.causal,
    )
    return hb


def _reference(hb, groups, tk, d, peaks):
    """The float64 backward of the block: (dQ, dK, dV), dK and dV summed over each kv head's group; the
    largest magnitudes folded into ``peaks``."""
    rq, rk, rv, ref_peaks = bw.reference(hb)
    rk, rv = rk.reshape(-1, groups, tk, d).sum(dim=1), rv.reshape(-1, groups, tk, rv.shape[-1]).sum(dim=1)
    if groups > 1:  # a kv head's dK, dV are the sums over its group; each query head's share is held too
        for name, summed in (("dK", rk), ("dV", rv)):
            ref_peaks[f"{name} per query head"] = ref_peaks[name]
            ref_peaks[name] = bw.peak(summed)
    for name, top in ref_peaks.items():
        peaks[name] = max(peaks.get(name, 0.0), top)
    return rq, rk, rv


def _baseline_errors(baselines, hb, grads, groups, rq, rk, rv, base_err) -> None:
    """FlashAttention's yardstick: plain attention's error in each dtype, its largest per gradient into ``base_err``."""
    for dtype_name, base in baselines.items():
        dt = dtype_from_name(dtype_name)
        pg = _run_path(
            base, hb, dt, grads, exact=False
        )  # a yardstick: its products through fp32, rounded as torch's are
        for name, g, r in (
            ("dq", pg.dq.to(dt), rq),
            ("dk", _group_sum(pg.dk, groups, None, dt), rk),
            ("dv", _group_sum(pg.dv, groups, None, dt), rv),
        ):
            g64 = g.to(torch.float64)
            both = torch.isfinite(g64) & torch.isfinite(r)
            if both.any():
                err = float(torch.where(both, (g64 - r).abs(), 0.0).max())
                base_err[dtype_name][name] = max(base_err[dtype_name][name] or 0.0, err)


def _cell_errors(cells, hb, grads, real, accs, held, ref, bad, at, groups, tk, hq, hk) -> None:
    """Each cell's backward on the block: its gradients against the reference (with each bad entry's
    cause) into ``accs``, what its path holds into ``held``, the recorded gradients compared."""
    rq, rk, rv = ref
    dout_bad, dout_nan, v_bad = bad
    h0, h1, u0, u1 = at
    for cell in cells:
        dt = dtype_from_name(cell.dtype)
        compare = cell.model and bool(real)
        pg = _run_path(cell, hb if cell.model else _without_recorded(hb), dt, grads, terms=compare)
        gq = pg.dq.to(dt)
        gk = _group_sum(pg.dk, groups, pg.group_sum_dtype, dt)
        gv = _group_sum(pg.dv, groups, pg.group_sum_dtype, dt)
        dout_cast_bad = (
            ~torch.isfinite(cast(hb.dout, dt)).all(dim=-1) & ~dout_bad
        )  # dO finite as given, beyond the dtype's range
        q_cause, v_cause = _cause_index(pg, dout_bad, dout_nan, dout_cast_bad, v_bad)
        acc = accs[cell]
        acc["dq"].update(gq, rq, q_cause, h0, hq)
        acc["dk"].update(gk, rk, _key_cause(q_cause, groups, tk), u0, hk)
        acc["dv"].update(gv, rv, _key_cause(v_cause, groups, tk), u0, hk)
        share = _label(_share_dtype(cell, pg, dt, grads))
        held[cell] = pg.held + ([(f"{name} per query head", share) for name in ("dK", "dV")] if groups > 1 else [])
        if compare:
            _compare_real(cell, acc, real, hb, pg, (gq, gk, gv), dt, groups, h0, h1, u0, u1, grads)


def _results(cells, accs, base_err, held, peaks, grads, dout_rows, real) -> dict[BackwardCell, CellBackward]:
    """Each cell's CellBackward: its gradients' errors (against the dtype's yardstick), headroom and how it computes."""
    results = {}
    for cell in cells:
        dt = dtype_from_name(cell.dtype)
        base = None if _is_baseline(cell) else base_err.get(cell.dtype)
        stats = {
            name: a.result(None if base is None else base[name], dt)  # type: ignore[index]
            for name, a in accs[cell].items()
        }
        headroom, at = _headroom(held.get(cell, []), peaks)
        how = _how(cell, dt, grads)
        if grads.dropout_p > 0:
            how = (how + "; " if how else "") + (
                f"without the call's dropout (p={grads.dropout_p:g}): its mask is not recorded, so neither are "
                "the real gradients compared"
            )
        results[cell] = CellBackward(
            stats["dq"],
            stats["dk"],
            stats["dv"],
            dout_rows,
            headroom,
            at,
            how,
            real_compared=cell.model and bool(real),
            dtype=cell.dtype,
        )
    return results


def _share_dtype(cell: BackwardCell, pg: bw.PathGrads, dt: torch.dtype, grads: GradInputs) -> torch.dtype:
    """The dtype a query head's share of a kv head's dK, dV is held in before the group sum: the
    dtype itself on the eager path (repeat_kv's autograd) and in the CPU flash kernel (which adds each
    head's share into the kv head's gradient in the dtype); fp32 in the math SDPA and on CUDA."""
    if backward_of(cell) == "eager" or cpu_blocks(cell, grads):
        return dt
    return pg.group_sum_dtype or dt


def _label(dt: torch.dtype) -> str:
    return dtype_label(dt)


def _headroom(held: list[tuple[str, str]], peaks: dict[str, float]) -> tuple[float | None, str | None]:
    """The least factor by which dO may grow before an intermediate overflows the dtype the path
    holds it in (every backward quantity is linear in dO): the rounding limit over the float64
    backward's largest magnitude of that intermediate."""
    best, at = None, None
    for name, held_in in held:
        peak = peaks.get(name, 0.0)
        if peak <= 0 or not math.isfinite(peak):
            continue
        factor = rounding_limit(dtype_from_name(held_in)) / peak
        if best is None or factor < best:
            best, at = factor, f"{name} in {held_in}"
    return best, at


# The constants of the bound below, each from the kernel's source (PyTorch's CPU flash kernel,
# aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) or from the emulation's own ops.
EXP_ULPS_FORWARD = 20  # the forward's row sums take exp_u20 (a vectorised exp within 20 ulp) before the log-sum-exp
EXP_ULPS = 1  # the backward's exp(S - lse) and torch.exp here: Sleef's u10 (within 1 ulp)
LOG_ULPS = 1  # the log of the row sum, in the kernel and here


def _gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u): a sum of n products in any order lies within gamma_n of the sum of
    their magnitudes from the exact one (Higham, Accuracy and Stability, 3.1); two orders differ by
    twice that."""
    return n * u / max(1.0 - n * u, 0.5)


def _compare_real(cell, acc, real, hb, pg, cell_grads, dt, groups, h0, h1, u0, u1, grads) -> None:
    """The recorded gradients of the model's kernel against the model cell, each element within the
    first-order bound of what two evaluations of the same formulas can differ by, when each rounds
    where the kernel rounds but sums in its own order and takes its own exp (docs/reference/numerics.md
    derives it). With u the dtype's unit roundoff, u32 fp32's, g2(n) = 2 gamma_n (two sums of n terms
    in different orders), A = scale |Q||K|^T, F = |dO||V|^T, E = rowsum(P F) (what the dot products of
    S, dP and D = rowsum(dO O) sum in magnitude):

    - S = scale q.k (+ mask): dS_S = g2(d) A + 4 u_h |S|, u_h the unit roundoff of the lowest precision
      the path holds S, dP, P and dS in (fp32 in SDPA's kernels; the dtype on the eager path, whose bits
      move where the model's code differs by an op, e.g. dividing the scores by sqrt(d));
    - the log-sum-exp (kept from the forward, recomputed here): dL = max over the row's keys of dS_S
      + g2(Tk) + (2 EXP_ULPS_FORWARD + 2 EXP_ULPS + 2 LOG_ULPS) u32 + 4 u32 |lse|;
    - P = exp(S - lse), relative: eP = dS_S + dL + 4 EXP_ULPS u32; held in the dtype, + 2u (one rounding
      that may fall on either side);
    - dS = P (dP - D): e_dS = P ((eP + 4 u32 + 2u') |dP - D| + (g2(max(dv, Tk)) + 2 u_h) (F + E)), u' = u
      where P and dS are rounded to a low-precision dtype for the products, else 0;
    - dQ = scale dS K: scale e_dS |K| + (g2(Tk) + 4 u32) scale |dS||K|; dK = scale dS^T Q likewise over the
      Tq G query rows of a kv head's group; dV = P^T dO: e_P^T |dO| + g2(Tq G) P^T |dO|;
    - and the sums the gradient is kept in: 2u (R + 1) |g|, R its roundings in the dtype (the CPU
      kernel's blocks), and under GQA (G > 1 heads per kv head) each head's share rounded before the
      group sum: 2u (R + 1) T, T the sum of the magnitudes of the element's terms;
    - where gradients are as small as the dtype's subnormals, rounding is absolute: (R + 1) s + 2 s A'
      with s the subnormal step and A' the sum of the magnitudes of the factors of one term's flip.
    """
    u = _unit_roundoff(dt)
    u32 = _unit_roundoff(torch.float32)
    low = dt != torch.float32 and backward_of(cell) in (
        "recompute",
        "eager",
    )  # P and dS rounded to the dtype for the products
    u_low = u if low else 0.0
    step = smallest_subnormal(dt)
    gq, gk, gv = cell_grads
    tq, tk, d, dv = hb.q.shape[1], hb.k.shape[1], hb.q.shape[2], hb.v.shape[2]
    kf, qf = bw.finite_abs(hb.k), bw.finite_abs(hb.q)
    vf, dof = bw.finite_abs(hb.v), bw.finite_abs(hb.dout)
    tm: bw.Terms = pg.terms
    scale = abs(hb.scale)
    g2 = lambda n: 2 * _gamma(n, u32)  # noqa: E731
    a = scale * torch.matmul(qf, kf.transpose(-1, -2))  # (n, Tq, Tk)
    f = torch.matmul(dof, vf.transpose(-1, -2))
    e = (tm.p * f).sum(dim=-1, keepdim=True)  # (n, Tq, 1)
    u_h = max(u32, _unit_roundoff(tm.held))
    err_s = torch.where(tm.p > 0, g2(d) * a + 4 * u_h * tm.s, 0.0)
    exp_log = (2 * EXP_ULPS_FORWARD + 2 * EXP_ULPS + 2 * LOG_ULPS) * u32
    err_lse = (err_s.amax(dim=-1) + g2(tk) + exp_log + 4 * u32 * tm.lse).unsqueeze(-1)
    rel_p = err_s + err_lse + 4 * EXP_ULPS * u32
    err_ds = tm.p * ((rel_p + 4 * u32 + 2 * u_low) * tm.dsd + (g2(max(dv, tk)) + 2 * u_h) * (f + e))
    err_p = tm.p * (rel_p + 2 * u_low)
    ds_abs = tm.p * tm.dsd
    blocked = cpu_blocks(cell, grads) and dt != torch.float32
    r_q = math.ceil(tk / bw.FLASH_KV_BLOCK) if blocked else 1
    r_kv = math.ceil(tq / bw.flash_q_block(tq)) if blocked else 1
    shares = 2 * u * (r_kv + 1) if groups > 1 else 0.0  # each head's share rounded before the group sum: on T, linear
    # Each product's error and the sum-order term on its terms T, in one matmul per gradient (both are linear in T)
    e_q = scale * torch.matmul(err_ds + (g2(tk) + 4 * u32) * ds_abs, kf)
    e_k = scale * torch.matmul((err_ds + (g2(tq * groups) + 4 * u32 + shares) * ds_abs).transpose(-1, -2), qf)
    e_v = torch.matmul((err_p + (g2(tq * groups) + shares) * tm.p).transpose(-1, -2), dof)
    summed = lambda x: _group_sum(x, groups, torch.float32, torch.float32)  # noqa: E731
    a_q = scale * kf.sum(dim=-2, keepdim=True)  # (n, 1, d)
    a_k = summed(scale * qf.sum(dim=-2, keepdim=True))
    a_v = summed(dof.sum(dim=-2, keepdim=True))
    for name, g, err, a_sub, rounds, lo, hi in (
        ("dq", gq, e_q, a_q, r_q, h0, h1),
        ("dk", gk, summed(e_k), a_k, r_kv, u0, u1),
        ("dv", gv, summed(e_v), a_v, r_kv, u0, u1),
    ):
        if name not in real:
            continue
        rg = real[name][lo:hi]
        mag = torch.maximum(rg.abs().to(torch.float64), g.abs().to(torch.float64))
        tol = (
            2 * u * (rounds + 1) * mag
            + err.to(torch.float64)
            + (rounds + 1) * step
            + 2 * step * a_sub.to(torch.float64)
        )
        acc[name].compare_real(rg, g, tol)
