"""The cells of a diagnosis: which implementation x dtype is computed, and what it is asked for.

A cell is (path, method, dtype, role):

- ``path``: the attention path computed from Q, K (and V) (``registry.PATHS``: eager, sdpa-math,
  flash, flash-fp8, sage), or None for scores as given;
- ``method``: the softmax method (``registry.METHODS``) the cell runs; a path with a softmax of
  its own (every path but eager) names itself;
- ``role``: ``MODEL`` (the computation a captured call ran), ``WHAT_IF`` (asked as 'what would
  break if the model ran this instead') or ``ASKED`` (bare scores, Q/K files: every cell is the
  question). Only a call's MODEL cell decides its verdict.

Cells that read the same scores form a stage (given scores: one per dtype; Q/K: one per path and
dtype): the stage computes the scores and their float64 reference once for all its cells.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from attncheck.numerics.paths.base import CallFacts, Setting
from attncheck.options import Options
from attncheck.params import WHAT_IF_ALL, WHAT_IF_FP8, WHAT_IF_KERNELS, WHAT_IF_NOSINKS, setting_sweeps
from attncheck.registry import (
    DTYPES,
    METHODS,
    PATHS,
    cell_dtype,
    dtype_names,
    eager_path,
    fp8_names,
    fp8_what_if_path,
    method_names,
    path_names,
    resolve,
)
from attncheck.results import ASKED, MODEL, WHAT_IF, CallInfo

EAGER_SOFTMAX = "torch"  # the softmax hand-written attention calls (torch.softmax / F.softmax)


@dataclass(frozen=True)
class CellKey:
    path: str | None
    method: str
    dtype: str
    role: str = ASKED
    setting: Setting | None = None  # one point of the path's settings grid (``--what-if fa4``); None: as configured

    @property
    def name(self) -> str:
        """'stable/fp16'; with Q and K: 'eager:stable/fp16', 'flash/fp16'; a setting: 'fa4(t4,o8)/e4m3' (as
        ``results.Cell.name``)."""
        variant = f"({self.setting.label})" if self.setting is not None else ""
        if self.path and self.path != self.method:
            return f"{self.path}:{self.method}{variant}/{self.dtype}"
        return f"{self.method}{variant}/{self.dtype}"

    def same_cell(self, other: "CellKey") -> bool:
        return (self.path, self.method, self.dtype, self.setting) == (
            other.path,
            other.method,
            other.dtype,
            other.setting,
        )


def grid(options: Options, qk: bool, role: str = ASKED) -> list[CellKey]:
    """Every cell ``options`` asks for, in report order. Given scores: every method x dtype (in an
    FP8 dtype, only methods that cast P to it). With Q and K: every path x dtype (FP8 paths in the
    FP8 dtypes, the others in the rest), the eager path once per chosen method that can be eager's
    softmax (tiled is the flash path's)."""
    fp8 = set(fp8_names())
    if not qk:
        return [
            CellKey(None, m, d, role)
            for m in options.methods
            for d in options.dtypes
            if d not in fp8 or METHODS.get(m).p_cast
        ]
    cells = []
    for p in options.paths or path_names(lambda spec: spec.default):
        spec = PATHS.get(p)
        dtypes = [d for d in options.dtypes if spec.computes_in(d in fp8)]
        methods = [m for m in options.methods if METHODS.get(m).eager] if spec.runs_methods else [p]
        cells += [CellKey(p, m, d, role) for m in methods for d in dtypes]
    return cells


def stages(cells: list[CellKey]) -> list[tuple[str | None, str, list[CellKey]]]:
    """(path, dtype, cells) groups of the cells that share their scores and settings, in first-seen order."""
    out: dict[tuple[str | None, str, Setting | None], list[CellKey]] = {}
    for c in cells:
        out.setdefault((c.path, c.dtype, c.setting), []).append(c)
    return [(p, d, cs) for (p, d, _), cs in out.items()]


def known_implementation(info: CallInfo) -> bool:
    """A captured call (SDPA, softmax, flex, a flash-attn function) says what it ran; q/k files and
    plain scores do not."""
    return info.kind not in ("qk", "scores", "unknown")


def cell_dtype_name(name: str | None) -> str | None:
    """'fp16' (or an alias) -> 'fp16' when a cell computes in it, else None (float64, unknown)."""
    if name is None or name not in DTYPES or not cell_dtype(DTYPES.get(name)):
        return None
    return DTYPES.get(name).name


def call_device(info: CallInfo) -> str:
    """The device type a captured call ran on ('cuda', 'cpu'), '' where the capture did not say."""
    return info.meta.get("device", "").split(":")[0]


def recorded_implementation(info: CallInfo) -> str:
    """What the capture recorded about the implementation that ran a call: the SDPA backend PyTorch
    chose ('flash_attention'; on CUDA with the flash implementation PyTorch was set to where it is not its
    default FlashAttention-2: 'flash_attention:fa3', 'flash_attention:fa4'), a flex call's implementation
    ('compiled', 'math'), a flash-attn package's generation ('fa2', 'fa3', 'fa4'); '' where it recorded none."""
    if info.kind == "sdpa":
        backend = info.meta.get("sdpa_backend", "") or ""
        flash_impl = info.meta.get("flash_impl", "") or ""
        if backend == "flash_attention" and call_device(info) == "cuda" and flash_impl in ("fa3", "fa4"):
            return f"{backend}:{flash_impl}"
        return backend
    if info.kind == "flex":
        return info.meta.get("flex_impl", "") or "compiled"
    return info.meta.get("flash_package", "") or "fa2"  # a flash-attn call: the package's generation (fa2, fa3, fa4)


def _shapes(info: CallInfo) -> dict[str, list[int]]:
    try:
        shapes = json.loads(info.meta.get("shapes", "") or "{}")
    except ValueError:
        return {}
    return shapes if isinstance(shapes, dict) else {}


def _capability(text: str) -> tuple[int, int] | None:
    major, _, minor = (text or "").partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else None


def call_facts(info: CallInfo, dtype: str) -> CallFacts:
    """The facts of a call a kernel's support depends on, from what the capture recorded (its
    tensors' shapes, mask, dropout, device); a fact not recorded is left at what any kernel takes."""
    shapes = _shapes(info)
    q, k, v = shapes.get("q") or [], shapes.get("k") or [], shapes.get("v") or []
    score = list(info.shape)
    tq = score[-2] if len(score) >= 2 else (q[-2] if len(q) >= 2 else 0)
    tk = score[-1] if score else (k[-2] if len(k) >= 2 else 0)
    d = q[-1] if q else 0
    # a mask tensor given to the call, or (an eager softmax call) a mask the code added or filled into the scores
    given = "attn_mask" in shapes or "mask" in shapes or info.meta.get("mask_op") in ("add", "fill")
    mask = "explicit" if given else ("causal" if info.is_causal else "none")
    gqa = len(q) >= 3 and len(k) >= 3 and k[-3] < q[-3]
    softcap = info.meta.get("softcap", "")
    window = info.meta.get("window", "")
    return CallFacts(
        dtype=dtype,
        head_dim=d,
        head_dim_v=v[-1] if v else d,
        tq=tq,
        tk=tk,
        mask=mask,
        dropout=info.dropout_p,
        capability=_capability(info.meta.get("capability", "")),
        gqa=gqa,
        softcap=_number(softcap),
        window=_window(window),
        flex=info.kind == "flex",
    )


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


def _window(text: str) -> tuple[int, int] | None:
    left, _, right = (text or "").partition(",")
    try:
        pair = (int(left), int(right))
    except ValueError:
        return None
    return None if pair[0] < 0 and pair[1] < 0 else pair


def model_path(info: CallInfo, dtype: str | None = None) -> str | None:
    """The path of the kernel that ran a captured call: among the paths that stand for what the capture
    recorded (``PathSpec.stands_for``: the call's kind, the implementation it recorded, its device), the one
    that names the call most exactly and could run it; None for a call no path stands for (softmax, scores).

    SDPA: the backend PyTorch chose for it where the capture recorded it (``torch._fused_sdp_choice``), on
    the device it ran on (a capture made on a GPU is judged by the GPU kernel's path on any machine); else
    the CPU flash kernel, or the math path with dropout. Flex: FlexAttention's fused kernel where the
    program compiled it, its math path where flex_attention ran without torch.compile."""
    return judged_by(info, dtype)[0]


def judged_by(info: CallInfo, dtype: str | None = None) -> tuple[str | None, str | None]:
    """(``model_path``, and a note where that path is not the kernel the capture names: the capture names a
    device or backend no path stands for, or the kernel it names would not have run the call; else None)."""
    kind, impl, device = info.kind, recorded_implementation(info), call_device(info)
    found = [(i, spec, st) for i, spec in enumerate(PATHS) for st in spec.stands_for if st.matches(kind, impl, device)]
    if not found:
        return None, None
    found.sort(key=lambda t: (-t[2].exactness(), t[0]))
    facts = call_facts(info, dtype or cell_dtype_name(info.dtype) or "fp32")
    named = next((spec for _, spec, st in found if st.impl and st.impl == impl and st.device in ("", device)), None)
    chosen = next((spec for _, spec, st in found if not st.fallback and spec.why_not(facts) is None), None)
    if chosen is None:
        chosen = ([spec for _, spec, st in found if st.fallback] or [found[0][1]])[0]
    note = None
    if kind == "sdpa" and impl and named is not None and named is not chosen:
        note = f"the capture names {impl} ({named.name}), which would not run this call ({named.why_not(facts)})"
    elif kind == "sdpa" and device not in ("", "cpu") and chosen.device != device and impl != "math":
        what = f"backend {impl!r}" if impl else "no backend"
        note = f"the capture names {what} on {device}, which no path emulates"
    if note is not None:
        note += f": judged by {chosen.name} ({chosen.summary.split(':')[0]}) instead"
    return chosen.name, note


def model_cell(info: CallInfo) -> CellKey | None:
    """The cell whose computation the model ran for a call.

    - softmax: ``torch.softmax`` in its ``dtype=`` argument, else in the scores' dtype, on the
      scores the softmax saw (recorded as they were);
    - sdpa: the path of the backend PyTorch chose (``sdpa_path``) in the call's dtype (autocast's
      when it was on): q, k, v and the mask as the call was given them;
    - flex: FlexAttention's fused kernel where the program compiled it, else its math path
      (``flex_path``), in q's dtype, on the logits after its score_mod;
    - qk files and plain scores: ``torch.softmax`` in the tensors' dtype (with q and k: on the
      eager path, as hand-written attention computes it), the cell their model line shows.

    None when that dtype is not one a cell computes in (float64).
    """
    dtype = cell_dtype_name(info.softmax_dtype or info.dtype)
    if dtype is None:
        return None
    role = MODEL if known_implementation(info) else ASKED
    path = model_path(info, dtype)
    if path is None:
        return CellKey(None, EAGER_SOFTMAX, dtype, role)
    spec = PATHS.get(path)
    return CellKey(path, EAGER_SOFTMAX if spec.runs_methods else path, dtype, role)


def what_if_cells(
    info: CallInfo,
    qk: bool,
    dtypes: tuple[str, ...] = (),
    options: Options | None = None,
    configured: Options | None = None,
) -> list[CellKey]:
    """The what-if cells of a call of known implementation, computed from Q and K when ``qk``
    (else on the scores as recorded).

    ``dtypes`` (``params.what_if``): in each, the model's implementation and the eager one
    (hand-written attention with torch.softmax, as ``attn_implementation='eager'`` runs); in an
    FP8 dtype, the FP8 kernel (flash-fp8; without Q and K, the tiled softmax with its P cast).
    ``('all',)``: every path and method in fp16, bf16, fp32 and e4m3. ``options``: the grid a
    user asked for explicitly (--dtype, --method, --path); ``configured``: the run's options (a kernel setting
    asked, --rescale-threshold, joins its grid). The model's own cell is never a what-if.
    """
    model = model_cell(info)
    cells: list[CellKey] = []
    sweeps = [w for w in dtypes if w in setting_sweeps()]
    if sweeps:
        dtypes = tuple(d for d in dtypes if d not in sweeps)
        if qk and model is not None:
            refused = sweep_refusals(info, tuple(sweeps))
            for p in sweeps:  # the call's dtype and FP8 (e4m3): each kernel's grid where it takes the call
                takes = [d for d in sweep_dtypes(info, model, p) if f"{p}/{d}" not in refused]
                cells += setting_cells((p,), tuple(takes), WHAT_IF, configured)
    dtypes = tuple(d for d in dtypes if d != WHAT_IF_NOSINKS)  # a call's sinks' what-if: not a cell (sinks.py)
    if WHAT_IF_KERNELS in dtypes:
        dtypes = tuple(d for d in dtypes if d != WHAT_IF_KERNELS)
        if qk and model is not None:
            cells += [
                CellKey(p, p, kernel_dtype(info, model), WHAT_IF)
                for p in kernel_replays(info, kernel_dtype(info, model))
            ]
    if dtypes == (WHAT_IF_ALL,):
        every = Options(dtypes=(*dtype_names(), WHAT_IF_FP8), methods=method_names(), paths=path_names())
        cells += grid(every, qk, WHAT_IF)
    else:
        fp8 = set(fp8_names())
        eager, fp8_path = eager_path(), fp8_what_if_path()
        own = (model.path or eager) if qk and model is not None else None
        for d in dtypes:
            if d in fp8:
                cells.append(CellKey(fp8_path, fp8_path, d, WHAT_IF) if qk else CellKey(None, "tiled", d, WHAT_IF))
                continue
            if not qk:
                cells.append(CellKey(None, EAGER_SOFTMAX, d, WHAT_IF))
                continue
            if own is not None and not PATHS.get(own).runs_methods:
                cells.append(CellKey(own, own, d, WHAT_IF))
            cells.append(CellKey(eager, EAGER_SOFTMAX, d, WHAT_IF))
    if options is not None:
        cells += grid(options, qk, WHAT_IF)
        if qk:  # an FP8 what-if dtype: also the kernels asked with --path that have an FP8 mode (fa3, fa4)
            fp8 = set(fp8_names())
            cells += [
                CellKey(p, p, d, WHAT_IF)
                for d in dtypes
                if d in fp8
                for p in options.paths
                if PATHS.get(p).computes_in(True) and not PATHS.get(p).fp8_only
            ]
    out: list[CellKey] = []
    for c in cells:
        if any(c.same_cell(o) for o in out) or (model is not None and _is_model(c, model, qk)):
            continue
        if qk and c.path is not None and c.setting is None and _refuses(info, c):
            continue  # a GPU kernel that would not run the call in that dtype (fa4 in fp32): not its cell
        out.append(c)
    return out


def _refuses(info: CallInfo, cell: CellKey) -> bool:
    """A GPU kernel path whose support refuses the call in the cell's dtype."""
    spec = PATHS.get(cell.path)
    return (
        spec.device == "cuda" and spec.supports is not None and spec.why_not(call_facts(info, cell.dtype)) is not None
    )


SWEEP_16 = "bf16"  # the 16-bit dtype a sweep runs an fp32 call in: the kernels' (FlashAttention-4 takes no fp32)


def sweep_dtypes(info: CallInfo, model: CellKey, sweep: str) -> tuple[str, ...]:
    """The dtypes a settings sweep of a captured call runs in: the call's own (its q, k, v's; bf16 where the
    kernel has no grid in it, an fp32 model) and FP8 (e4m3)."""
    own = kernel_dtype(info, model)
    if not resolve(PATHS.get(sweep).settings)(own, None):
        own = SWEEP_16
    return tuple(dict.fromkeys((own, WHAT_IF_FP8)))


def sweep_refusals(info: CallInfo, sweeps: tuple[str, ...]) -> dict[str, str]:
    """'fa4/e4m3' -> why the kernel would not run the call in that dtype (its support), for each sweep and dtype
    of ``sweep_dtypes`` it has a grid in and refuses: said in the report, not left out silently."""
    model = model_cell(info)
    if model is None:
        return {}
    out = {}
    for p in sweeps:
        spec = PATHS.get(p)
        for d in sweep_dtypes(info, model, p):
            why = spec.why_not(call_facts(info, d))
            if why is not None and spec.settings is not None and resolve(spec.settings)(d, None):
                out[f"{p}/{d}"] = why
    return out


def setting_cells(
    sweeps: tuple[str, ...], dtypes: tuple[str, ...], role: str = ASKED, options: Options | None = None
) -> list[CellKey]:
    """One cell per point of each named kernel's settings grid (``PathSpec.settings``) in each dtype it has one
    for: what ``--what-if fa4`` computes."""
    cells = []
    for p in sweeps:
        grid_of = resolve(PATHS.get(p).settings)
        cells += [CellKey(p, p, d, role, s) for d in dtypes for s in grid_of(d, options)]
    return cells


def kernel_dtype(info: CallInfo, model: CellKey) -> str:
    """The dtype a kernel replay runs a call in: its q, k and v's (a softmax call upcast to fp32 by its
    ``dtype=`` argument, as transformers' eager attention does, ran its matmuls in the tensors' dtype, and a
    fused kernel would have taken them in it), else the model cell's."""
    return cell_dtype_name(info.dtype) or model.dtype


def kernel_replays(info: CallInfo, dtype: str) -> list[str]:
    """The kernel paths a call could have run under (``PathSpec.replay``, and the kernel takes the call:
    ``why_not``), in registration order: what ``--what-if kernels`` computes."""
    facts = call_facts(info, dtype)
    return [spec.name for spec in _replays(info) if spec.why_not(facts) is None]


def kernel_refusals(info: CallInfo, dtype: str) -> dict[str, str]:
    """The kernel paths of the replay that could not have run a call, each with why."""
    facts = call_facts(info, dtype)
    return {spec.name: why for spec in _replays(info) if (why := spec.why_not(facts)) is not None}


def _replays(info: CallInfo) -> list:
    return [spec for spec in PATHS if spec.replay and (not spec.replay_kinds or info.kind in spec.replay_kinds)]


def _is_model(c: CellKey, model: CellKey, qk: bool) -> bool:
    """The model's own computation: its cell, or for a softmax call recomputed from Q and K, the
    eager path with torch.softmax in its dtype."""
    if c.same_cell(model):
        return True
    return qk and model.path is None and (c.path, c.method, c.dtype) == (eager_path(), model.method, model.dtype)
