"""What a diagnosis is asked to compute: ``Options``, checked on construction (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from attncheck import params
from attncheck.codes import SEVERITY
from attncheck.errors import AttncheckError, param
from attncheck.options import (  # noqa: F401  (defined below numerics; re-exported: config.run's API)
    CACHE_CHUNK_ELEMENTS,
    ROW_BYTES,
    ROW_BYTES_PER_CELL,
    WORKING_BYTES_PER_ELEMENT,
    Options,
    check_row_fits,
    chunk_elements_for,
    chunk_row_bytes,
    rows_per_chunk,
)


def ignore_codes(value, param_name: str = "ignore") -> tuple[str, ...]:
    """'fully_masked_rows, mask_leak' or a list -> the finding codes, each checked."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value or ())
    for code in items:
        if not isinstance(code, str) or code not in SEVERITY:
            raise AttncheckError(
                f"unknown finding code {params.show(code)} (known: {', '.join(SEVERITY)})", param=param_name
            )
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class QKSpec:
    """Scores to compute from Q, K and a mask (and the output with V), as files to read (PATH or PATH:KEY)."""

    q: str
    k: str
    mask: str | None = None
    v: str | None = None
    scale: params.Scale = params.Scale("auto")
    scale_order: str = "scores"
    causal: bool = False
    pad_left: tuple[int, ...] = ()
    pad_right: tuple[int, ...] = ()
    mask_value: str | None = None  # None: -inf; given, it must apply (a boolean mask, causal or padding)
    mask_convention: str | None = None  # None: 'attend'; given, the mask must be boolean
    grad_out: str | None = None  # the output gradient dO: with it (and v) every path's backward is diagnosed too
    mask_op: str | None = None  # the eager path's backward: a boolean mask added ('add', default) or filled ('fill')

    def __post_init__(self) -> None:
        if self.mask_op is not None:
            object.__setattr__(self, "mask_op", params.choice(self.mask_op, params.MASK_OPS, "mask_op"))
        if not isinstance(self.scale, params.Scale):
            object.__setattr__(self, "scale", params.scale(self.scale))
        object.__setattr__(self, "scale_order", params.choice(self.scale_order, params.SCALE_ORDERS, "scale_order"))
        if self.mask_value is not None:
            object.__setattr__(self, "mask_value", params.mask_value(self.mask_value))
        if self.mask_convention is not None:
            object.__setattr__(
                self, "mask_convention", params.choice(self.mask_convention, params.MASK_CONVENTIONS, "mask_convention")
            )


@dataclass(frozen=True)
class RunRequest:
    """What ``attncheck run`` diagnoses: score files, the built-in example, or the scores of
    Q and K (with score files too: those are diagnosed and the scale they carry is fitted)."""

    paths: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    example: bool = False
    qk: QKSpec | None = None
    options: Options = Options()
    max_memory: int = params.size(params.DEFAULT_MAX_MEMORY, "max_memory")  # bytes: the most any input may hold whole
    ignore: tuple[str, ...] = ()  # finding codes the user judged expected: dropped, their rows not counted
    partial: bool = False  # diagnose the calls that can be, and report the others, instead of stopping at the first
    # Calls of known implementation (a capture) compute their model cell; as what-ifs also the dtypes
    # ``what_if`` names (params.what_if: 'fp16', ..., or 'all') and, with ``grid_asked`` (--dtype,
    # --method or --path given), every cell of ``options``. Bare scores compute every cell of ``options``.
    what_if: tuple[str, ...] = ()
    grid_asked: bool = False
    # --accumulate: sums kept in 16 bits (params.SumSpec or their text, 'fp16-seq'), beside the cells
    accumulate: tuple = ()
    # Under torchrun (WORLD_SIZE > 1 and a rendezvous in the environment, or an initialised process group) the
    # calls are split over the ranks and every rank returns the one result (pipelines.ranks); False: this process
    # runs every call itself (capture judging its own rank's calls)
    split_ranks: bool = True
    rope_what_if: tuple[str, ...] = ()  # --what-if rope:DTYPE: a capture's rotary tables recomputed in these dtypes

    def __post_init__(self) -> None:
        params.integer(self.max_memory, "max_memory", 1, from_text=False)
        object.__setattr__(self, "ignore", ignore_codes(self.ignore))
        object.__setattr__(self, "what_if", params.what_if(list(self.what_if)) if self.what_if else ())
        if self.accumulate and not all(isinstance(a, params.SumSpec) for a in self.accumulate):
            object.__setattr__(self, "accumulate", params.sum_specs([getattr(a, "label", a) for a in self.accumulate]))
        if self.example and (self.paths or self.qk):
            raise AttncheckError("give files or the built-in example, not both")
        if self.example and self.keys:
            raise AttncheckError(
                f"{param('keys')} selects tensors inside files; it does not apply to the built-in example"
            )
        if self.keys and not self.paths and self.qk is not None:
            raise AttncheckError(
                f"{param('keys')} selects tensors inside score files, and none is given; pick q and k inside files "
                f"with {param('q')} PATH:KEY"
            )
        if not (self.example or self.paths or self.qk):
            raise AttncheckError(
                f"no input: give score files or directories, {param('q')} and {param('k')}, or {param('example')} "
                "for a built-in one"
            )
