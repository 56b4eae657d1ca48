"""What a diagnosis is asked to compute (``Options``, checked on construction) and the chunk sizes that follow
from its memory budget (torch-free).

Below numerics and config alike: the caller (config, pipelines, the recorder) builds the ``Options`` and numerics
reads it, the rows per chunk included, without asking config; ``config.run`` re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attncheck import params
from attncheck.errors import AttncheckError, param
from attncheck.format import size_text
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
        raise AttncheckError(
            f"{name}: a row of {keys:,} keys needs {size_text(need)} of working memory, over "
            f"{param('max_memory')} {size_text(max_memory)}; raise {param('max_memory')}"
        )


@dataclass(frozen=True)
class Bounded:
    """How a long Q/K call is diagnosed in bounded time (``numerics.bounded``): ``rows`` score rows sampled, or as
    many as ``budget`` seconds allow (a call whose whole diagnosis is estimated to fit the budget is computed
    exactly); ``seed`` the sample's; calls of fewer than ``min_rows`` score rows are computed exactly."""

    rows: int | None = None
    budget: float | None = None
    seed: int = 0
    min_rows: int = 0


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
    # The FP8 tensor cores' accumulator: 'kernel' (13 mantissa bits, each kernel's own flush), 'fp32' or a bit
    # count; fp8_flush: P@V's reduced accumulator added to an fp32 one every N key blocks (None: the kernel's).
    fp8_accum: str = params.FP8_ACCUM_KERNEL
    fp8_flush: int | None = None
    # The fa4 path's what-if: a paths.fa4.Fa4Setup (its rescale threshold and max offset); None: the kernel's defaults
    fa4: Any = None
    # --budget/--rows: a numerics.bounded.Bounded (diagnose exactly where a row can fail, sample the rest); None: exact
    bounded: Any = None

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
        object.__setattr__(self, "fp8_accum", params.fp8_accum(self.fp8_accum, from_text=False))
        if self.fp8_flush is not None:
            params.integer(self.fp8_flush, "fp8_flush", 1, from_text=False)
        # config imports no numerics: a Fa4Setup (paths.fa4) is recognised by its two fields
        if self.fa4 is not None and not all(hasattr(self.fa4, f) for f in ("rescale_threshold", "max_offset")):
            raise AttncheckError("fa4 is a Fa4Setup(rescale_threshold=..., max_offset=...) or None", param="fa4")
        if self.fa4 is not None:  # the numbers as --rescale-threshold and --max-offset take them: >= 0, sum below 128
            params.fa4_settings(self.fa4.rescale_threshold, self.fa4.max_offset, from_text=False)
