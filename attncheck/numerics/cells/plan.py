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

from dataclasses import dataclass

from attncheck.config.run import Options
from attncheck.params import WHAT_IF_ALL, WHAT_IF_FP8
from attncheck.registry import DTYPES, METHODS, PATHS, cell_dtype, dtype_names, fp8_names, method_names, path_names
from attncheck.results import ASKED, MODEL, WHAT_IF, CallInfo

# torch.nn.attention.SDPBackend names (as the capture records them) -> the path that computes as it does.
# The fused kernels (flash, memory-efficient, cuDNN) hold S, the running max and sum in fp32 and round
# P to the dtype before P@V: the flash path. The math backend upcasts: sdpa-math.
SDPA_BACKENDS = {"flash_attention": "flash", "efficient_attention": "flash", "cudnn_attention": "flash", "math": "sdpa-math"}
EAGER_SOFTMAX = "torch"  # the softmax hand-written attention calls (torch.softmax / F.softmax)


@dataclass(frozen=True)
class CellKey:
    path: str | None
    method: str
    dtype: str
    role: str = ASKED

    @property
    def name(self) -> str:
        """'stable/fp16'; with Q and K: 'eager:stable/fp16', 'flash/fp16' (as ``results.Cell.name``)."""
        if self.path and self.path != self.method:
            return f"{self.path}:{self.method}/{self.dtype}"
        return f"{self.method}/{self.dtype}"

    def same_cell(self, other: "CellKey") -> bool:
        return (self.path, self.method, self.dtype) == (other.path, other.method, other.dtype)


def grid(options: Options, qk: bool, role: str = ASKED) -> list[CellKey]:
    """Every cell ``options`` asks for, in report order. Given scores: every method x dtype (in an
    FP8 dtype, only methods that cast P to it). With Q and K: every path x dtype (FP8 paths in the
    FP8 dtypes, the others in the rest), the eager path once per chosen method that can be eager's
    softmax (tiled is the flash path's)."""
    fp8 = set(fp8_names())
    if not qk:
        return [CellKey(None, m, d, role) for m in options.methods for d in options.dtypes if d not in fp8 or METHODS.get(m).p_cast]
    cells = []
    for p in options.paths or path_names(lambda spec: spec.default):
        spec = PATHS.get(p)
        dtypes = [d for d in options.dtypes if (d in fp8) == spec.fp8]
        methods = [m for m in options.methods if METHODS.get(m).eager] if spec.runs_methods else [p]
        cells += [CellKey(p, m, d, role) for m in methods for d in dtypes]
    return cells


def stages(cells: list[CellKey]) -> list[tuple[str | None, str, list[CellKey]]]:
    """(path, dtype, cells) groups of the cells that share their scores, in first-seen order."""
    out: dict[tuple[str | None, str], list[CellKey]] = {}
    for c in cells:
        out.setdefault((c.path, c.dtype), []).append(c)
    return [(p, d, cs) for (p, d), cs in out.items()]


def known_implementation(info: CallInfo) -> bool:
    """A captured SDPA, softmax or flex call says what it ran; q/k files and plain scores do not."""
    return info.kind in ("sdpa", "softmax", "flex")


def cell_dtype_name(name: str | None) -> str | None:
    """'fp16' (or an alias) -> 'fp16' when a cell computes in it, else None (float64, unknown)."""
    if name is None or name not in DTYPES or not cell_dtype(DTYPES.get(name)):
        return None
    return DTYPES.get(name).name


def sdpa_path(info: CallInfo) -> str:
    """The path of an SDPA call: the backend PyTorch chose for it where the capture recorded it
    (``torch._fused_sdp_choice`` at the call), else flash, or sdpa-math with dropout (PyTorch's CPU
    flash kernel takes no dropout)."""
    backend = info.meta.get("sdpa_backend", "")
    if backend in SDPA_BACKENDS:
        return SDPA_BACKENDS[backend]
    return "sdpa-math" if info.dropout_p > 0 else "flash"


def flex_path(info: CallInfo) -> str:
    """A flex call's path: 'flex' (the fused kernel) where it ran inside torch.compile'd code (as
    transformers runs it), 'flex-math' where flex_attention ran without torch.compile."""
    return "flex-math" if info.meta.get("flex_impl") == "math" else "flex"


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
    if info.kind == "sdpa":
        path = sdpa_path(info)
        return CellKey(path, path, dtype, role)
    if info.kind == "flex":
        path = flex_path(info)
        return CellKey(path, path, dtype, role)
    if info.kind == "qk":
        return CellKey("eager", EAGER_SOFTMAX, dtype, role)
    return CellKey(None, EAGER_SOFTMAX, dtype, role)


def what_if_cells(info: CallInfo, qk: bool, dtypes: tuple[str, ...] = (), options: Options | None = None) -> list[CellKey]:
    """The what-if cells of a call of known implementation, computed from Q and K when ``qk``
    (else on the scores as recorded).

    ``dtypes`` (``params.what_if``): in each, the model's implementation and the eager one
    (hand-written attention with torch.softmax, as ``attn_implementation='eager'`` runs); in an
    FP8 dtype, the FP8 kernel (flash-fp8; without Q and K, the tiled softmax with its P cast).
    ``('all',)``: every path and method in fp16, bf16, fp32 and e4m3. ``options``: the grid a
    user asked for explicitly (--dtype, --method, --path). The model's own cell is never a what-if.
    """
    model = model_cell(info)
    cells: list[CellKey] = []
    if dtypes == (WHAT_IF_ALL,):
        every = Options(dtypes=(*dtype_names(), WHAT_IF_FP8), methods=method_names(), paths=path_names())
        cells += grid(every, qk, WHAT_IF)
    else:
        fp8 = set(fp8_names())
        own = (model.path or "eager") if qk and model is not None else None
        for d in dtypes:
            if d in fp8:
                cells.append(CellKey("flash-fp8", "flash-fp8", d, WHAT_IF) if qk else CellKey(None, "tiled", d, WHAT_IF))
                continue
            if not qk:
                cells.append(CellKey(None, EAGER_SOFTMAX, d, WHAT_IF))
                continue
            if own is not None and own != "eager":
                cells.append(CellKey(own, own, d, WHAT_IF))
            cells.append(CellKey("eager", EAGER_SOFTMAX, d, WHAT_IF))
    if options is not None:
        cells += grid(options, qk, WHAT_IF)
    out: list[CellKey] = []
    for c in cells:
        if any(c.same_cell(o) for o in out) or (model is not None and _is_model(c, model, qk)):
            continue
        out.append(c)
    return out


def _is_model(c: CellKey, model: CellKey, qk: bool) -> bool:
    """The model's own computation: its cell, or for a softmax call recomputed from Q and K, the
    eager path with torch.softmax in its dtype."""
    if c.same_cell(model):
        return True
    return qk and model.path is None and (c.path, c.method, c.dtype) == ("eager", model.method, model.dtype)

