"""The dtypes and softmax methods attncheck knows, each defined once.

Everything else derives from these registries: the names users type and their
aliases, option validation and help texts, the order of cells in reports and
JSON, which dtypes the fused kernels read and how, which methods they serve.
Free of torch: a method's implementation is named by an import path and only
imported when a diagnosis runs; a dtype's torch dtype and thresholds come from
``attncheck.numerics.precision``.

Adding a method: register a ``MethodSpec`` whose ``impl`` is a function
``(x, params) -> MethodOutput`` (see ``attncheck.numerics.methods.softmax``). Adding a
dtype: register a ``DtypeSpec``; its thresholds follow from ``torch.finfo``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from attncheck.errors import AttncheckError
from attncheck.numerics.paths.base import Impl, PathSpec, resolve


@dataclass(frozen=True)
class DtypeSpec:
    """A floating-point format, as attncheck computes in it or reads it."""

    name: str  # what users type: 'fp16'
    torch_name: str  # attribute of the torch module; a torch version may lack it
    summary: str
    aliases: tuple[str, ...] = ()
    has_inf: bool = True  # without inf (e4m3fn), a value beyond the range becomes NaN
    kernel_view: str | None = None  # numpy dtype the fused kernels read its elements as; None: not served
    cell: bool = True  # a softmax can be computed in it
    scores: bool = True  # accepted as the dtype of given scores, q and k
    # An FP8 format: its cells cast P to it (after scaling by --p-scale) for the P@V product,
    # as FlashAttention-3's FP8 forward does; scores, max and sums stay fp32. Only methods
    # with p_cast (tiled) and paths with fp8 compute in it. Not in the default dtype set.
    p_format: bool = False


# Row events a method can report (MethodOutput.events), in pipeline order, and what
# they count as in a cell: 'overflow' rows, 'underflow' rows, 'backward' (a hazard of the
# kernel's backward on a row whose forward is finite: no forward cause), or a kind of its own
# ('saturation'): counted per event only (Cell.events), never as an overflow or underflow row
EVENTS: dict[str, str] = {
    "exp_overflow": "overflow",  # an exp of a finite score is inf
    "sum_overflow": "overflow",  # every exp is finite, their row sum is inf
    "underflow": "underflow",  # every exp flushed to 0 although the row had finite scores
    # a kernel's fused max subtraction: x*scale - round(m*scale) at the row max overflows exp2 (FlashAttention-2 with
    # FMA)
    "fused_max": "overflow",
    # a hazard of the kernel's backward, predicted from the forward's log-sum-exp: the row's forward is finite
    "padded_tile": "backward",
    # P above the P format's largest value before the cast (FlashAttention-4's FP8 max offset plus its lazy
    # rescale): FP8 saturates it while the fp32 row sum counts it in full, so O shrinks; the row stays finite
    "p_saturation": "saturation",
}


@dataclass(frozen=True)
class MethodSpec:
    """A softmax implementation: how it computes, and what the diagnosis may expect of it."""

    name: str
    summary: str
    impl: Impl = field(repr=False)  # 'module:function' or the function (x, params) -> MethodOutput
    output: str = "dtype"  # its probabilities are in the cell's dtype ('dtype') or in 'fp32'
    events: tuple[str, ...] = ()  # which of EVENTS it reports
    path: str = "scores"  # the score tensor it consumes: the scores of the cell's dtype
    fused: bool = True  # the fused CPU kernel computes its metrics (else the torch row backend)
    aliases: tuple[str, ...] = ()
    eager: bool = True  # with Q and K given, it can be the softmax of the eager path (tiled is the flash path's)
    # The kernel that models run which this method reproduces ('FlashAttention's online softmax'),
    # or None for a textbook formula. Only such methods are held to FlashAttention's 2x rule
    # in the worse_than_torch finding: a hand-written softmax in fp16 rounds three times
    # against torch.softmax's once and misses the rule on every real input, by construction.
    kernel: str | None = None
    p_cast: bool = False  # computes in FP8 dtypes: casts P to the format (registry DtypeSpec.p_format)
    # A fused CPU kernel that computes its probabilities (and P-cast counts) bit for bit as
    # ``impl`` does, used where the fused row backend runs; None: ``impl`` always runs.
    rows_kernel: str | None = None

    def __post_init__(self) -> None:
        if self.output not in ("dtype", "fp32"):
            raise ValueError(f"method {self.name}: output must be 'dtype' or 'fp32', got {self.output!r}")
        unknown = [e for e in self.events if e not in EVENTS]
        if unknown:
            raise ValueError(f"method {self.name}: unknown events {unknown} (known: {', '.join(EVENTS)})")

    def function(self) -> Callable:
        return resolve(self.impl)


S = TypeVar("S")


class Registry(Generic[S]):
    """Specs by name, in registration order; names and aliases are case-insensitive."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._specs: dict[str, S] = {}
        self._aliases: dict[str, str] = {}

    def register(self, spec: S, *, replace: bool = False) -> S:
        key = spec.name.lower()
        taken = [n for n in (key, *spec.aliases) if n.lower() in self._aliases and self._aliases[n.lower()] != key]
        if taken or (key in self._specs and not replace):
            raise ValueError(f"{self.kind} {spec.name!r}: name {(taken or [key])[0]!r} is taken")
        self._specs[key] = spec
        for alias in (key, *spec.aliases):
            self._aliases[alias.lower()] = key
        return spec

    def unregister(self, name: str) -> None:
        key = self._aliases.get(name.lower(), name.lower())
        spec = self._specs.pop(key)
        for alias in (key, *spec.aliases):
            self._aliases.pop(alias.lower(), None)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._specs.values()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.strip().lower() in self._aliases

    def names(self, where: Callable[[S], bool] = lambda spec: True) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs.values() if where(s))

    def aliases(self) -> dict[str, str]:
        """alias -> name, without the names themselves."""
        return {a: n for a, n in self._aliases.items() if a != n}

    def get(self, name: str, *, where: Callable[[S], bool] = lambda spec: True, param: str | None = None) -> S:
        """The spec a name or alias stands for; unknown names (or ones ``where`` refuses) are input errors."""
        key = self._aliases.get(name.strip().lower())
        choices = ", ".join(self.names(where))
        if key is None:
            raise AttncheckError(f"unknown {self.kind} {name.strip()!r} (choose from {choices})", param=param)
        spec = self._specs[key]
        if not where(spec):
            raise AttncheckError(f"{self.kind} {spec.name!r} cannot be used here (choose from {choices})", param=param)
        return spec

    def canonical(self, name: str, **kw) -> str:
        return self.get(name, **kw).name


DTYPES: Registry[DtypeSpec] = Registry("dtype")
for _spec in (
    DtypeSpec("fp16", "float16", "IEEE half: max 65504, 10 mantissa bits", ("float16", "half"), kernel_view="uint16"),
    DtypeSpec("bf16", "bfloat16", "bfloat16: fp32's range, 7 mantissa bits", ("bfloat16",), kernel_view="int16"),
    DtypeSpec("fp32", "float32", "IEEE single", ("float32", "float"), kernel_view="float32"),
    DtypeSpec(
        "fp64",
        "float64",
        "IEEE double: the reference's dtype",
        ("float64", "double"),
        kernel_view="float64",
        cell=False,
    ),
    # FP8 formats: P-cast cells (tiled; the flash-fp8 and sage paths). The kernels convert with
    # satfinite (beyond the range: +-max); torch's own cast beyond the range is measured.
    DtypeSpec(
        "e4m3",
        "float8_e4m3fn",
        "FP8 E4M3 (fn): max 448, smallest subnormal 2^-9, no inf",
        ("float8_e4m3fn", "fp8_e4m3"),
        has_inf=False,
        scores=False,
        p_format=True,
    ),
    DtypeSpec(
        "e5m2",
        "float8_e5m2",
        "FP8 E5M2: max 57344, smallest subnormal 2^-16, has inf",
        ("float8_e5m2", "fp8_e5m2"),
        scores=False,
        p_format=True,
    ),
    DtypeSpec(
        "e4m3fnuz",
        "float8_e4m3fnuz",
        "FP8 E4M3 (fnuz, AMD): max 240, no inf, no -0",
        ("float8_e4m3fnuz",),
        has_inf=False,
        scores=False,
        p_format=True,
    ),
    DtypeSpec(
        "e5m2fnuz",
        "float8_e5m2fnuz",
        "FP8 E5M2 (fnuz, AMD): max 57344, no inf, no -0",
        ("float8_e5m2fnuz",),
        has_inf=False,
        scores=False,
        p_format=True,
    ),
):
    DTYPES.register(_spec)


def cell_dtype(spec: DtypeSpec) -> bool:
    return spec.cell


def float_cell_dtype(spec: DtypeSpec) -> bool:
    """A dtype whole softmaxes compute in (not a P format): the default set."""
    return spec.cell and not spec.p_format


def scores_dtype(spec: DtypeSpec) -> bool:
    return spec.scores


METHODS: Registry[MethodSpec] = Registry("method")
for _spec in (
    MethodSpec(
        "naive",
        "exp(x) / sum(exp(x)) in the dtype",
        "attncheck.numerics.methods.softmax:naive_method",
        events=("exp_overflow", "sum_overflow", "underflow"),
    ),
    MethodSpec(
        "stable",
        "z = x - max(x); exp(z) / sum(exp(z)) in the dtype",
        "attncheck.numerics.methods.softmax:stable_method",
        events=("sum_overflow",),
    ),
    MethodSpec(
        "tiled",
        "FlashAttention's online softmax over key blocks, running max and sum in fp32",
        "attncheck.numerics.methods.softmax:tiled_method",
        output="fp32",
        aliases=("online",),
        eager=False,
        kernel="FlashAttention's online softmax",
        p_cast=True,
        rows_kernel="tiled_rows",
    ),
    MethodSpec("torch", "torch.softmax on the dtype (fp32 inside)", "attncheck.numerics.methods.softmax:torch_method"),
):
    METHODS.register(_spec)
del _spec


PATHS: Registry[PathSpec] = Registry("path")
# One line per path: the module attncheck.numerics.paths.<name> declares its PATH (see that package).
PATH_MODULES = (
    "eager",
    "sdpa_math",
    "flash",
    "fa2",
    "fa2_fma",
    "mem_efficient",
    "cudnn",
    "flash_fp8",
    "fa4",
    "sage",
    "flex",
    "flex_math",
)
for _module in PATH_MODULES:
    PATHS.register(importlib.import_module(f"attncheck.numerics.paths.{_module}").PATH)
del _module


def eager_path() -> str:
    """The path of hand-written attention (the one that runs the softmax methods)."""
    return next(spec.name for spec in PATHS if spec.runs_methods)


def fp8_what_if_path() -> str:
    """The FP8 kernel an FP8 what-if runs and --fp8-scaling quantises for: the first FP8 path
    registered (FlashAttention-3's)."""
    return next(spec.name for spec in PATHS if spec.fp8_only)


def path_names(where: Callable[[PathSpec], bool] = lambda spec: True) -> tuple[str, ...]:
    return PATHS.names(where)


def dtype_names() -> tuple[str, ...]:
    """Dtypes a whole softmax computes in, in report order: the default set (FP8 formats are asked for)."""
    return DTYPES.names(float_cell_dtype)


def fp8_names() -> tuple[str, ...]:
    """The P formats: FP8 dtypes whose cells cast P to them."""
    return DTYPES.names(lambda spec: spec.cell and spec.p_format)


def method_names() -> tuple[str, ...]:
    return METHODS.names()


def choices_help(registry: Registry, where: Callable = lambda spec: True) -> str:
    """'naive, stable, tiled (alias online), torch' for help texts."""
    parts = []
    for spec in registry:
        if where(spec):
            alias = f" (alias {', '.join(spec.aliases)})" if registry is METHODS and spec.aliases else ""
            parts.append(spec.name + alias)
    return ", ".join(parts)
