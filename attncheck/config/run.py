"""What a diagnosis is asked to compute: ``Options``, checked on construction (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attncheck import params
from attncheck.errors import AttncheckError, param
from attncheck.registry import dtype_names, method_names

# Bytes of working memory per score element of a chunk: the float64 reference and the
# reference of the cast scores, the cast scores, one cell's probabilities and its
# float64 temporaries (torch backend; the fused kernels need about half).
WORKING_BYTES_PER_ELEMENT = 96


# Bytes of working memory per row of a chunk, whatever its length: the per-row facts
# every pass keeps (row max and sum, census counts, entropy, the float64 reference's
# row statistics) and, per cell, its row sums, errors, KL and flags, with their
# temporaries. Measured on 1-key rows (all 12 default cells: about 1.2 KB a row) and
# rounded up; with short rows they outweigh the scores.
ROW_BYTES = 512
ROW_BYTES_PER_CELL = 128


def chunk_elements_for(max_memory: int) -> int:
    """Elements per chunk that keep the diagnosis working set within ``max_memory`` bytes
    (``Options.chunk_elements``; ``rows_per_chunk`` turns it back into bytes)."""
    return max(1, max_memory // WORKING_BYTES_PER_ELEMENT)


def chunk_row_bytes(keys: int, options: "Options", cells=None) -> int:
    """Estimated working bytes of one row of ``keys`` scores in a chunk: its elements (the
    tiled method pads a row longer than its block to whole blocks) and the per-row facts
    of every cell (``cells``, the cells computed, when known; else every cell ``options`` asks for)."""
    methods = options.methods if cells is None else {c.method for c in cells}
    width = keys
    if "tiled" in methods and keys > options.block:
        width = -(-keys // options.block) * options.block
    count = len(options.dtypes) * (len(options.methods) + len(options.paths)) if cells is None else len(cells)
    return width * WORKING_BYTES_PER_ELEMENT + ROW_BYTES + ROW_BYTES_PER_CELL * count


# A chunk larger than this is no faster, but slower: its float64 temporaries no longer stay in the
# caches between the passes over it. A default run on 2^26 fp32 scores at 1024 keys took 1.9 s in
# chunks of 2^20 elements, 2.1 s at 2^21, 2.2 s at 2^22 and 2.5 s at the 1 GiB budget's 11.2M; a
# model's SDPA calls 1.9 s at 2^21 against 2.2 s at 2^20 and 2.6 s at 2^22; 64-key rows 2.3 s at
# 2^21 and 2^22, 2.5 s at 11.2M.
CACHE_CHUNK_ELEMENTS = 1 << 21


def rows_per_chunk(keys: int, options: "Options", cells=None) -> int:
    """Rows per chunk so that the chunk's working set, elements and per-row facts together,
    stays within the budget ``options.chunk_elements`` stands for, and within CACHE_CHUNK_ELEMENTS."""
    budget = min(options.chunk_elements, CACHE_CHUNK_ELEMENTS) * WORKING_BYTES_PER_ELEMENT
    return max(1, budget // chunk_row_bytes(keys, options, cells))


def check_row_fits(name: str, keys: int, max_memory: int | None) -> None:
    """A row is never split across chunks: one whose working set alone passes ``max_memory`` (a
    stride-0 row of 2e9 keys in a few bytes of .pt) is refused before anything is allocated."""
    need = keys * WORKING_BYTES_PER_ELEMENT
    if max_memory is not None and need > max_memory:
        from attncheck.format import size_text

        raise AttncheckError(
            f"{name}: a row of {keys:,} keys needs {size_text(need)} of working memory, over "
            f"{param('max_memory')} {size_text(max_memory)}; raise {param('max_memory')}"
        )


@dataclass(frozen=True)
class Options:
    """The cells (dtypes x methods) and how they are computed.

    Names are made canonical ('half' -> 'fp16', 'online' -> 'tiled') and aliases of
    one name count once. ``kernels``: 'fused' (numba, CPU), 'torch', or 'auto' (fused
    for CPU inputs from ``numerics.backends.FUSED_MIN_ELEMENTS`` elements when numba is
    installed); asking for 'fused' without numba is an error when the diagnosis runs.
    """

    dtypes: tuple[str, ...] = dtype_names()
    methods: tuple[str, ...] = method_names()
    block: int = params.DEFAULT_BLOCK
    reverse: bool = False
    accum: str = "fp32"
    device: str = "cpu"
    chunk_elements: int = params.DEFAULT_CHUNK_ELEMENTS
    collapse_threshold: float = params.COLLAPSE_THRESHOLD
    max_examples: int = params.MAX_EXAMPLES
    kernels: str = "auto"
    paths: tuple[str, ...] = ()  # with Q and K: the attention paths (registry.PATHS); empty: the default set
    # FP8 cells (dtypes e4m3, e5m2, ...): P is multiplied by p_scale before the cast (FlashAttention-3: 256);
    # with Q and K, how they and V are quantised (fp8_scaling) and whether a seeded Hadamard rotation comes first.
    p_scale: float = params.DEFAULT_P_SCALE
    fp8_scaling: str = "head"
    incoherent: bool = False
    # The fa4 path's what-if: a paths.fa4.Fa4Setup (its rescale threshold and max offset); None: the kernel's defaults
    fa4: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.dtypes, str) or isinstance(self.methods, str):
            raise AttncheckError("dtypes and methods are tuples of names, e.g. ('fp16',)")
        object.__setattr__(self, "dtypes", params.dtypes(list(self.dtypes), "dtypes") if self.dtypes else ())
        object.__setattr__(self, "methods", params.methods(list(self.methods), "methods") if self.methods else ())
        if not self.dtypes:
            raise AttncheckError("no dtype selected", param="dtypes")
        if not self.methods:
            raise AttncheckError("no method selected", param="methods")
        params.integer(self.block, "block", 1, from_text=False)
        params.choice(self.accum, params.ACCUMULATIONS, "accum")
        params.choice(self.kernels, params.KERNELS, "kernels")
        params.integer(self.chunk_elements, "chunk_elements", 1, from_text=False)
        object.__setattr__(self, "device", params.device(self.device))
        if isinstance(self.paths, str):
            raise AttncheckError("paths is a tuple of names, e.g. ('flash',)")
        object.__setattr__(self, "paths", params.paths(list(self.paths)) if self.paths else ())
        object.__setattr__(self, "p_scale", params.number(self.p_scale, "p_scale", positive=True, from_text=False))
        params.choice(self.fp8_scaling, params.FP8_SCALINGS, "fp8_scaling")
        # config imports no numerics: a Fa4Setup (paths.fa4) is recognised by its two fields
        if self.fa4 is not None and not all(hasattr(self.fa4, f) for f in ("rescale_threshold", "max_offset")):
            raise AttncheckError("fa4 is a Fa4Setup(rescale_threshold=..., max_offset=...) or None", param="fa4")


def ignore_codes(value, param_name: str = "ignore") -> tuple[str, ...]:
    """'fully_masked_rows, mask_leak' or a list -> the finding codes, each checked."""
    from attncheck.codes import SEVERITY

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

    def __post_init__(self) -> None:
        params.integer(self.max_memory, "max_memory", 1, from_text=False)
        object.__setattr__(self, "ignore", ignore_codes(self.ignore))
        object.__setattr__(self, "what_if", params.what_if(list(self.what_if)) if self.what_if else ())
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
