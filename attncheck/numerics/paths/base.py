"""What a path is, free of torch: ``PathSpec`` (an implementation and what it stands for),
``CallFacts`` (the facts of a call a kernel's support depends on) and ``Stands`` (a captured
implementation a path stands for)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Union

Impl = Union[str, Callable]


def resolve(impl: Impl) -> Callable:
    """An implementation given as the function or as 'module:function', imported on first use."""
    if callable(impl):
        return impl
    module, _, name = impl.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Stands:
    """A captured implementation: the call's kind ('sdpa', 'flex', 'flash_attn', 'qk'), the
    implementation the capture recorded for it (an SDPA backend: 'flash_attention'; a flex
    implementation: 'compiled'; a flash-attn function: 'flash_attn_func'; '' for any), and the
    device type it ran on ('cuda', 'cpu'; '' for any). A ``fallback`` judges the calls no other
    path that stands for them can run (SDPA with dropout and no backend recorded: the math path)."""

    kind: str
    impl: str = ""
    device: str = ""
    fallback: bool = False

    def matches(self, kind: str, impl: str, device: str) -> bool:
        return self.kind == kind and self.impl in ("", impl) and self.device in ("", device)

    def exactness(self) -> int:
        """How much of a call it names: a path naming the implementation and the device wins
        over one that names less."""
        return (not self.fallback) * 4 + (self.impl != "") * 2 + (self.device != "")


@dataclass(frozen=True)
class CallFacts:
    """The facts of one call a kernel's support and tiles depend on."""

    dtype: str  # the cell's dtype: 'fp16', 'bf16', 'fp32', 'e4m3', ...
    head_dim: int  # d of q and k
    head_dim_v: int  # d of v
    tq: int
    tk: int
    mask: str = "none"  # 'none', 'causal' (is_causal alone), 'explicit' (an attn_mask tensor, with or without causal)
    dropout: float = 0.0
    capability: tuple[int, int] | None = None  # the GPU's compute capability where the capture recorded it
    gqa: bool = False  # fewer kv heads than query heads
    softcap: float | None = None
    window: tuple[int, int] | None = None  # a sliding window (left, right) in keys; None: none
    flex: bool = False  # a FlexAttention call (its score_mod, mask_mod and block sizes recorded)


@dataclass
class KernelRows:
    """What an emulated kernel computes for r rows (its ``kernel_rows``): tensors, typed loosely here so
    that this module stays free of torch."""

    probs: Any  # (r, Tk) float32 effective probabilities: O = probs @ V up to the P@V accumulation's rounding
    out: Any  # (r, dv) in the dtype, or None without V
    lse: Any  # (r,) float32 natural-log log-sum-exp, as the kernel stores it for its backward
    events: dict = field(default_factory=dict)  # hazard name -> (r,) bool rows
    scores: Any = None  # (r, Tk) float32: the scores as the kernel's softmax sees them, where it keeps them
    margin: Any = None  # (r,) float64 -ln(FLT_MAX) - LSE where a hazard depends on it
    saturated: Any = None  # (r,) int64: how many P of the row exceeded the P format's largest value before the cast


@dataclass(frozen=True)
class Setting:
    """One point of a kernel's settings grid (``PathSpec.settings``; ``--what-if NAME`` computes each): the
    MethodParams fields it sets, the numbers it stands for, whether it is the kernel's own default for the
    dtype, and why the kernel refuses it at the commit the path follows (an assert), else None."""

    label: str  # 't4,o8': short, no spaces or brackets (part of a cell's name: 'fa4(t4,o8)/e4m3')
    params: tuple[tuple[str, Any], ...]  # (MethodParams field, value): (('fa4', Fa4Setup(4.0, 8.0)),)
    values: tuple[tuple[str, float], ...]  # (('rescale_threshold', 4.0), ('max_offset', 8.0))
    default: bool = False
    refused: str | None = None


@dataclass(frozen=True)
class PathSpec:
    """An attention implementation from Q, K (and V) to P and O = P@V, with its rounding points.

    Declared as ``PATH`` by its module in ``attncheck.numerics.paths``, whose docstring states the
    rounding points (the numerics reference is generated from it). ``impl`` computes one block of
    rows: ``(block: QKBlock, dt, methods, params) -> PathBlock``.
    """

    name: str
    summary: str
    impl: Impl = field(repr=False)
    runs_methods: bool = False  # True: cells are (path, method) for the chosen eager methods (hand-written attention)
    aliases: tuple[str, ...] = ()
    default: bool = True  # in the default set of Q/K mode
    scores_in: str = "the dtype"  # where S = Q@K^T lives: says why a path does or does not overflow
    # The dtypes it computes in: False the fp16/bf16/fp32 ones only, True the FP8 dtypes (P formats) only, "both"
    # both (a kernel with an FP8 mode: ``computes_in``)
    fp8: bool | str = False
    # Its FP8 mode accumulates on Hopper's FP8 tensor cores as modelled by ``methods.fp8_accum`` (--fp8-accum,
    # --fp8-flush): flash-fp8 and fa3's FP8 mode, sage
    fp8_accumulator: bool = False
    # The fused kernel the path is (judged by FlashAttention's 2x rule against torch.softmax); None: not a kernel
    kernel: str | None = None
    # The dtype its probabilities are in (the eager path: the method's): "fp32" where they are fp32
    # products (flash's P_j times the rescale over l), "the dtype" where P is cast to the dtype;
    # the KL floor is that dtype's smallest subnormal
    probs_in: str = "fp32"
    # How its scores are formed from Q and K (``QKBlock``): 'dtype' (S rounded to the dtype, the scale
    # and mask in it: ``in_dtype``), 'fp32' (S in fp32 from q and k in the dtype, times the scale in
    # fp32), 'fp32-split' (q and k each times sqrt(scale), then S in fp32: PyTorch's math SDPA)
    scores: str = "fp32"
    logits: bool = False  # consumes a flex call's recorded fp32 logits (after its score_mod) where there are some
    # Its backward (``attncheck.numerics.backward.paths``): 'eager', 'math' (fp32 inside), 'recompute' (the
    # FlashAttention-2 backward, P recomputed from the log-sum-exp: on the CPU the CPU kernel's blocked sums,
    # on CUDA fp32 sums); None: none
    backward: str | None = None
    # Where it runs: 'cpu' (judged where attncheck runs), 'cuda' (a GPU kernel, emulated on any CPU)
    device: str = "cpu"
    # The source its rounding points follow: 'Dao-AILab/flash-attention@<commit> csrc/...'
    source: str = ""
    # Where its rounding points are assumed, not read from a source (closed source, a hardware
    # approximation): said in the report of every cell of the path and in the docs
    assumed: str | None = None
    # The captured implementations it stands for: a call recorded as one of them is judged by this path
    stands_for: tuple[Stands, ...] = ()
    # '(facts: CallFacts) -> str | None': why the kernel could not run a call (None: it can); None: any call
    supports: Impl | None = field(default=None, repr=False)
    # '(dt, params: MethodParams) -> (kind, threshold on |S scale|, what) or None': where the kernel's own
    # arithmetic first breaks, when that is sooner than S overflowing fp32 (the cell's limit and headroom; None
    # from it: not in this dtype); None: S's overflow. A
    # fourth item, where given, is the value measured against the threshold (a bound the cell's settings fix,
    # e.g. how far the lazy rescale lets P grow) instead of the input's largest |S scale|.
    limit: Impl | None = field(default=None, repr=False)
    # '(dtype name, options: config.run.Options | None) -> tuple[Setting, ...]': the grid of the kernel's settings
    # that ``--what-if NAME`` computes in that dtype (with a setting the options ask for; empty: none there);
    # None: the kernel has no settings to sweep
    settings: Impl | None = field(default=None, repr=False)
    # In the replay of ``--what-if kernels``: a kernel a call could have run under; ``replay_kinds``: the
    # kinds of call it replays (empty: every call with Q and K)
    replay: bool = False
    replay_kinds: tuple[str, ...] = ()
    # Whether each query row is computed from its own scores alone, so that a subset of a call's rows
    # (``--budget``/``--rows``) is computed as in the whole call: True, False, or "noncausal" (only without the
    # kernel's own causal loop, whose tiles stop at the diagonal)
    row_local: bool | str = False

    def __post_init__(self) -> None:
        if self.row_local not in (False, True, "noncausal"):
            raise ValueError(f"path {self.name}: row_local must be False, True or 'noncausal', got {self.row_local!r}")
        if self.scores not in ("dtype", "fp32", "fp32-split"):
            raise ValueError(f"path {self.name}: scores must be 'dtype', 'fp32' or 'fp32-split', got {self.scores!r}")
        if self.backward not in (None, "eager", "math", "recompute"):
            raise ValueError(f"path {self.name}: unknown backward {self.backward!r}")
        if self.fp8 not in (False, True, "both"):
            raise ValueError(f"path {self.name}: fp8 must be False, True or 'both', got {self.fp8!r}")

    def computes_in(self, fp8_dtype: bool) -> bool:
        """Whether it computes in an FP8 dtype (``fp8_dtype``), or in fp16/bf16/fp32 (not ``fp8_dtype``)."""
        return self.fp8 == "both" or self.fp8 is fp8_dtype

    @property
    def fp8_only(self) -> bool:
        """It computes in the FP8 dtypes only (flash-fp8, sage)."""
        return self.fp8 is True

    def function(self) -> Callable:
        return resolve(self.impl)

    def why_not(self, facts: CallFacts) -> str | None:
        """Why this kernel could not run a call with these facts, or None."""
        return None if self.supports is None else resolve(self.supports)(facts)

    @property
    def doc(self) -> str:
        """Its rounding points: the docstring of the module that declares it."""
        module = self.impl.partition(":")[0] if isinstance(self.impl, str) else self.impl.__module__
        return (sys.modules.get(module) or importlib.import_module(module)).__doc__ or ""
