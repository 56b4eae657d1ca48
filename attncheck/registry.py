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
from typing import Callable, Generic, Iterator, TypeVar, Union

from attncheck.errors import AttncheckError


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
# they count as in a cell: 'overflow' rows or 'underflow' rows.
EVENTS: dict[str, str] = {
    "exp_overflow": "overflow",  # an exp of a finite score is inf
    "sum_overflow": "overflow",  # every exp is finite, their row sum is inf
    "underflow": "underflow",  # every exp flushed to 0 although the row had finite scores
}

Impl = Union[str, Callable]


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


def resolve(impl: Impl) -> Callable:
    """An implementation given as the function or as 'module:function', imported on first use."""
    if callable(impl):
        return impl
    module, _, name = impl.partition(":")
    return getattr(importlib.import_module(module), name)


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
    DtypeSpec("fp64", "float64", "IEEE double: the reference's dtype", ("float64", "double"), kernel_view="float64", cell=False),
    # FP8 formats: P-cast cells (tiled; the flash-fp8 and sage paths). The kernels convert with
    # satfinite (beyond the range: +-max); torch's own cast beyond the range is measured.
    DtypeSpec("e4m3", "float8_e4m3fn", "FP8 E4M3 (fn): max 448, smallest subnormal 2^-9, no inf", ("float8_e4m3fn", "fp8_e4m3"),
              has_inf=False, scores=False, p_format=True),
    DtypeSpec("e5m2", "float8_e5m2", "FP8 E5M2: max 57344, smallest subnormal 2^-16, has inf", ("float8_e5m2", "fp8_e5m2"),
              scores=False, p_format=True),
    DtypeSpec("e4m3fnuz", "float8_e4m3fnuz", "FP8 E4M3 (fnuz, AMD): max 240, no inf, no -0", ("float8_e4m3fnuz",),
              has_inf=False, scores=False, p_format=True),
    DtypeSpec("e5m2fnuz", "float8_e5m2fnuz", "FP8 E5M2 (fnuz, AMD): max 57344, no inf, no -0", ("float8_e5m2fnuz",),
              has_inf=False, scores=False, p_format=True),
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
    MethodSpec("naive", "exp(x) / sum(exp(x)) in the dtype", "attncheck.numerics.methods.softmax:naive_method",
               events=("exp_overflow", "sum_overflow", "underflow")),
    MethodSpec("stable", "z = x - max(x); exp(z) / sum(exp(z)) in the dtype", "attncheck.numerics.methods.softmax:stable_method",
               events=("sum_overflow",)),
    MethodSpec("tiled", "FlashAttention's online softmax over key blocks, running max and sum in fp32",
               "attncheck.numerics.methods.softmax:tiled_method", output="fp32", aliases=("online",), eager=False,
               kernel="FlashAttention's online softmax", p_cast=True, rows_kernel="tiled_rows"),
    MethodSpec("torch", "torch.softmax on the dtype (fp32 inside)", "attncheck.numerics.methods.softmax:torch_method"),
):
    METHODS.register(_spec)
del _spec


@dataclass(frozen=True)
class PathSpec:
    """An attention implementation from Q, K (and V) to P and O = P@V, with its rounding points.

    ``methods``: the softmax methods it runs (the eager path runs the chosen ones); empty
    when the path has its own (sdpa-math: torch's _safe_softmax in fp32; flash: the
    online softmax). ``impl`` computes one block of rows; see ``attncheck.numerics.methods.paths``.
    """

    name: str
    summary: str
    impl: Impl = field(repr=False)
    runs_methods: bool = False  # True: cells are (path, method) for the chosen eager methods
    aliases: tuple[str, ...] = ()
    default: bool = True  # in the default set of Q/K mode
    scores_in: str = "the dtype"  # where S = Q@K^T lives: says why a path does or does not overflow
    fp8: bool = False  # computes in the FP8 dtypes (P formats) only; the others in fp16/bf16/fp32 only
    # The fused kernel the path is (judged by FlashAttention's 2x rule against torch.softmax); None: not a kernel
    kernel: str | None = None
    # The dtype its probabilities are in (the eager path: the method's): "fp32" where they are fp32
    # products (flash's P_j times the rescale over l), "the dtype" where P is cast to the dtype;
    # the KL floor is that dtype's smallest subnormal
    probs_in: str = "fp32"
    # Where it runs: 'cpu' (judged where attncheck runs), 'cuda' (a GPU kernel, emulated on any CPU)
    device: str = "cpu"
    # The source its rounding points follow: 'Dao-AILab/flash-attention@<commit> csrc/...'
    source: str = ""
    # Where its rounding points are assumed, not read from a source (closed source, a hardware
    # approximation): said in the report of every cell of the path and in the docs
    assumed: str | None = None
    # The captured implementations it stands for (``attncheck.numerics.paths.base.Stands``): a call
    # recorded as one of them is judged by this path
    stands_for: tuple = ()
    # '(facts: CallFacts) -> str | None': why the kernel could not run a call (None: it can); None: any call
    supports: Impl | None = field(default=None, repr=False)
    # In the replay of ``--what-if kernels``: a kernel a call could have run under
    replay: bool = False

    def function(self) -> Callable:
        return resolve(self.impl)

    def why_not(self, facts) -> str | None:
        """Why this kernel could not run a call with these facts (``CallFacts``), or None."""
        return None if self.supports is None else resolve(self.supports)(facts)


PATHS: Registry[PathSpec] = Registry("path")
for _path in (
    PathSpec("eager", "hand-written attention (HF eager): Q@K^T rounded to the dtype, scale and mask in the dtype, "
             "the chosen softmax, P@V in the dtype", "attncheck.numerics.methods.paths:eager", runs_methods=True),
    PathSpec("sdpa-math", "PyTorch SDPA's math backend: fp16/bf16 upcast to fp32, q and k scaled by sqrt(scale) each, "
             "_safe_softmax (zeros for fully masked rows), O cast back to the dtype", "attncheck.numerics.methods.paths:sdpa_math",
             aliases=("math",), scores_in="fp32, from q and k each scaled by sqrt(scale)"),
    PathSpec("flash", "FlashAttention-2 forward: S in fp32, online softmax over key blocks, P rounded to the dtype "
             "before P@V, O in fp32 divided by l at the end, zeros for fully masked rows", "attncheck.numerics.methods.paths:flash",
             scores_in="fp32 registers", kernel="FlashAttention-2's forward"),
    PathSpec("flash-fp8", "FlashAttention-3's FP8 forward: e4m3 Q, K, V with descales (--fp8-scaling, --incoherent), S in "
             "fp32, key blocks last to first, P scaled by --p-scale (2^8) and cast to FP8, O in fp32 then bf16",
             "attncheck.numerics.methods.fp8_attention:flash_fp8", scores_in="fp32 from FP8 q and k", fp8=True,
             kernel="FlashAttention-3's FP8 forward"),
    PathSpec("sage", "SageAttention 2 (SM90): K smoothed, Q and K in INT8 per thread group, P scaled by 448 and cast to "
             "FP8, V in FP8 per channel, key blocks first to last, O in bf16", "attncheck.numerics.methods.fp8_attention:sage",
             scores_in="fp32 from INT8 q and k", fp8=True, kernel="SageAttention 2"),
    PathSpec("flex", "FlexAttention's fused kernel (torch.compile'd flex_attention): S in fp32, the score_mod and mask "
             "in fp32, online softmax over key blocks, O in fp32 then the dtype, zeros for rows with no key",
             "attncheck.numerics.methods.paths:flex", default=False, scores_in="fp32 (the score_mod applied in fp32)",
             kernel="FlexAttention's fused forward"),
    PathSpec("flex-math", "FlexAttention without torch.compile: S in fp32, the score_mod and mask in fp32, _safe_softmax "
             "in fp32, P cast to the dtype, P@V in the dtype", "attncheck.numerics.methods.paths:flex_math", default=False,
             scores_in="fp32 (the score_mod applied in fp32)", probs_in="the dtype"),
):
    PATHS.register(_path)
del _path


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
