"""Many attention calls (a capture, or call files): what was recorded of a call, its report and heads, the model
report's lines, outlier heads, what-if answers, kernel replays and ranks; and ``RunResult``, what ``attncheck run``
returns (its tensors' diagnoses, the calls and the model report over them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attncheck.format import plain
from attncheck.results.activations import CallActivations, HeadActivations
from attncheck.results.common import Finding
from attncheck.results.kvcache import KVReport
from attncheck.results.lowsum import CaptureSums
from attncheck.results.run import CellLimit, SettingChoice, TensorDiagnosis
from attncheck.results.sinks import SinkFacts


@dataclass
class HeadStat:
    """One attention head of a call: its q/k magnitudes, its largest logit, and what went wrong in it."""

    head: int
    q_max_abs: float | None  # max |q| over batch, tokens and d; None without q
    k_max_abs: float | None  # of the kv head this query head reads (GQA)
    max_logit: float | None  # largest finite unmasked score (scaled, as the softmax sees it)
    qk_overflow: int = 0  # scores of Q@K^T beyond the call's dtype, computed as the model rounds them
    nan_rows: int = 0  # NaN rows of the cell the model uses, over all batch elements
    kv_head: int | None = None  # the kv head it reads (GQA: shared by a group of query heads); None: its own
    nan_causes: dict[str, int] = field(default_factory=dict)  # its NaN rows by first cause (--ignore leaves some out)
    # The attention each key receives, averaged over the queries that see it (float64 reference; numerics.sinks)
    first_share: float | None = None  # key 0's
    top_key: int | None = None  # the key receiving the most, and its share
    top_share: float | None = None
    activations: HeadActivations | None = None  # its q, k, v channel peaks and k's kurtosis (numerics.outliers)


@dataclass
class CallInfo:
    """What was recorded about one attention call (from a capture, or read from a file).

    ``kind``: 'sdpa' (scaled_dot_product_attention: q, k, v, mask), 'softmax' (the scores a
    softmax saw, with q/k/v where the matmuls around it were found), 'qk' (a file of q/k/mask
    tensors) or 'scores' (a plain score tensor).
    """

    index: int  # position in call order
    name: str  # how reports name it: the file, or file:key group
    kind: str
    module: str = ""  # module path in the model ('' outside any module or unknown)
    file: str | None = None
    dtype: str | None = None  # the dtype the call computed in ('fp16', ...; autocast's when it was on)
    softmax_dtype: str | None = None  # a softmax's dtype= argument
    shape: tuple[int, ...] = ()  # of the scores (batch..., heads, queries, keys)
    is_causal: bool = False
    scale: float | None = None  # None: SDPA's default 1/sqrt(d), or unknown for a softmax
    enable_gqa: bool = False
    dropout_p: float = 0.0
    has_qk: bool = False
    forward: int | None = None  # which forward pass of the top module (1-based); None: outside one
    meta: dict[str, str] = field(default_factory=dict)  # everything else the capture wrote
    rank: int | None = None  # the process that made the call, in a capture of several (torchrun); None: one process


@dataclass
class CallReport:
    """One call diagnosed: the diagnosis of the cell the model ran, its heads, and the what-if cells.

    For a call whose implementation is known (a capture's sdpa and softmax calls), ``diagnosis``
    holds the model's cell alone and its findings are the call's; ``what_if`` holds the cells asked
    as what-ifs with their own findings, never counted as the model's. For a call of unknown
    implementation (q/k files, plain scores) ``diagnosis`` holds every cell asked."""

    call: CallInfo
    diagnosis: TensorDiagnosis | None
    heads: list[HeadStat] = field(default_factory=list)
    cell: tuple[str, str] | None = None  # (method or path, dtype) of the computation the model ran
    error: str | None = None  # why the call could not be diagnosed (partial results)
    what_if: TensorDiagnosis | None = None
    # --what-if kernels: the kernel paths that could not have run the call, each with why (its support)
    kernels_refused: dict[str, str] = field(default_factory=dict)
    kernel_dtype: str | None = None  # the dtype the kernels were replayed in (q, k and v's); None: no replay
    # Where the path judging the call is not the kernel the capture names (an unknown backend or device, a kernel
    # that would not run the call): which path judged it instead, and why
    path_note: str | None = None
    # --what-if fa4: each kernel grid and dtype the kernel would not run the call in ('fa4/e4m3'), with why
    settings_refused: dict[str, str] = field(default_factory=dict)
    sinks: SinkFacts | None = None  # a call with learned sinks (gpt-oss): each head's share, and what it changes
    activations: CallActivations | None = None  # q, k, v channel peaks and largest activations; None without q/k


@dataclass
class ModelLine:
    """One row of the model report."""

    index: int
    name: str
    module: str
    kind: str
    shape: tuple[int, ...]
    cell: str | None  # 'torch/fp16': the cell the model ran
    max_logit: float | None
    headroom: float | None  # the model cell's distance to its first failure (CellLimit.headroom)
    nan_rows: int  # of the cell the model ran, less those with an ignored cause
    first_cause: str | None  # first cause of those NaN rows in pipeline order
    worst_err: float | None  # max |p - p_float64| of that cell
    verdict: str  # 'nan', 'overflow', 'zero', 'flip', 'ok', 'error' (error finding), 'skipped'
    heads: list[int] = field(default_factory=list)  # heads the cause sits in
    errors: list[str] = field(default_factory=list)  # codes of error findings of the model's cell, not ignored
    limit: CellLimit | None = None  # what ``headroom`` is measured to
    # The backward of that cell, where the call's output gradient is known (None: no backward)
    grad_nan_rows: int | None = None  # NaN/inf rows of dq, dk and dv together, less those with an ignored cause
    grad_cause: str | None = None  # their first cause in backward order (results.GRAD_CAUSES)
    grad_which: list[str] = field(default_factory=list)  # the gradients holding them: 'dq', 'dk', 'dv'
    grad_headroom: float | None = None  # dO may grow this many times before an intermediate overflows
    grad_headroom_at: str | None = None
    # A flex call with a score_mod: its name and the largest unmasked logit before it (max_logit is after it)
    score_mod: str | None = None
    logit_before_mod: float | None = None
    rank: int | None = None  # the process that made the call (a capture of several, under torchrun)
    # A line standing for a module's decode steps that went well (``DecodeRun.summary``): how many, the last's index
    steps: int = 0
    last_index: int | None = None

    @property
    def grad_verdict(self) -> str | None:
        """'nan', 'error' (a backward error finding), 'ok', or None without a backward."""
        if self.grad_nan_rows is None:
            return None
        if self.grad_nan_rows:
            return "nan"
        return "error" if any(code.startswith("grad_") for code in self.errors) else "ok"


@dataclass
class DecodeRun:
    """A module's steps over a KV cache (``generate()``'s decode steps: fewer queries than keys), grouped: the calls
    before them (the prefill) and the run of steps, with the key counts they span (``model_decode``)."""

    module: str
    prefill: list[int]  # indices of the module's calls with as many queries as keys (or more), before the steps
    prefill_keys: list[int]  # their key counts
    steps: list[int]  # indices of the decode steps, in order
    queries: list[int]  # the distinct query counts of the steps (1 for plain decoding)
    keys_from: int  # key count of the first step and of the last
    keys_to: int
    causal: int  # steps with is_causal set
    masked: int  # steps with a mask
    bad: list[int]  # steps whose verdict is not ok (each listed in the calls table)
    summary: ModelLine | None = None  # the steps that went well, as one line of the calls table (logit: the largest,
    # room: the smallest, NaN: the sum, err: the largest)
    rank: int | None = None


@dataclass
class Outlier:
    """A head whose q or k is far larger than the other heads' of the same call."""

    index: int
    module: str
    head: int
    tensor: str  # 'q' or 'k'
    value: float
    median: float
    ratio: float
    kv_head: int | None = None  # k under GQA: the kv head (``head`` is the first query head reading it)
    query_heads: list[int] = field(default_factory=list)  # ... and every query head that reads it
    rank: int | None = None  # the process that made the call (a capture of several ranks)
    position: int | None = None  # the call's place among the report's calls (unique where indices repeat)

    @property
    def message(self) -> str:
        where = ("" if self.rank is None else f"rank {self.rank} ") + (self.module or f"call {self.index}")
        if self.kv_head is not None:
            reads = ", ".join(map(str, self.query_heads))
            return (
                f"{where} kv head {self.kv_head} (query heads {reads}): max|{self.tensor}| {plain(self.value)} "
                f"vs median {plain(self.median)} over the other kv heads"
            )
        return (
            f"{where} head {self.head}: max|{self.tensor}| {plain(self.value)} vs median {plain(self.median)} "
            "over the other heads"
        )


@dataclass
class HeadMark:
    """A head the model report marks for its activations (not the q/k ``Outlier`` heads by magnitude): an emergent
    attention sink ('sink': ``key`` receives ``share``) or an outlier channel ('channel': ``channel`` of ``tensor``
    at ``ratio`` times its head's median channel). ``findings.activations`` finds them."""

    position: int  # the call's place among the report's calls
    index: int
    module: str
    head: int
    what: str  # 'sink' or 'channel'
    message: str
    key: int | None = None
    share: float | None = None
    tensor: str | None = None
    channel: int | None = None
    ratio: float | None = None
    rank: int | None = None


@dataclass
class WhatIfAnswer:
    """One what-if cell over every call it was computed for: does it break, and where first."""

    cell: str  # 'flash/fp16', 'eager:torch/fp16'
    calls: int  # calls it was computed for
    bad_calls: int  # calls where it goes wrong (NaN, overflow, zero rows or an error finding)
    first: ModelLine | None  # the first call where it goes wrong, as a model line judged by this cell
    nan_rows: int  # over all calls
    worst_err: float | None  # largest max |p - p_float64| over the calls
    headroom: float | None  # the least headroom over the calls (to ``limit``)
    limit: CellLimit | None = None
    findings: dict[str, int] = field(default_factory=dict)  # finding code -> calls where this cell's findings hold it

    @property
    def verdict(self) -> str:
        return "ok" if not self.bad_calls else (self.first.verdict if self.first is not None else "error")


@dataclass
class KernelVerdict:
    """One kernel path on one call (``--what-if kernels``): what it gives, or why it could not run it."""

    path: str
    dtype: str
    ran: bool = False  # the kernel the capture says ran the call (the model's cell)
    verdict: str = "ok"  # a model line's verdict ('nan', 'overflow', 'zero', 'error', 'flip', 'ok'), or 'refused'
    nan_rows: int = 0
    cause: str | None = None  # the first cause of the NaN rows
    backward_rows: int = 0  # rows whose backward the kernel breaks although its forward is finite (padded_tile)
    backward_cause: str | None = None  # that hazard's event ('padded_tile')
    lse: float | None = None  # the lowest log-sum-exp of those rows
    refused: str | None = None  # why the kernel could not have run the call
    out_err: float | None = None  # max |O - O_float64| where both are finite
    assumed: bool = False  # the path's rounding points are assumed (closed source)

    @property
    def breaks(self) -> bool:
        return self.verdict in ("nan", "overflow", "zero", "error") or self.backward_rows > 0


@dataclass
class KernelCall:
    """A call replayed under every kernel that could have run it."""

    position: int  # in the model report's calls
    name: str  # the call as the report names it (its module)
    kernels: list[KernelVerdict] = field(default_factory=list)

    @property
    def disagree(self) -> bool:
        """Some kernel breaks the call and another does not."""
        run = [k for k in self.kernels if k.refused is None]
        return any(k.breaks for k in run) and not all(k.breaks for k in run)


@dataclass
class RankSummary:
    """One rank of a capture of several processes: its calls and findings, and its first call that goes wrong."""

    rank: int
    calls: int
    errors: int
    warnings: int
    first_bad: int | None  # position in the model report's ``lines``
    complete: bool = True


@dataclass
class ModelReport:
    """Many calls in one view: a line per call, the first one that goes wrong, outlier heads, and
    the answers to what-if questions."""

    lines: list[ModelLine]
    first_bad: int | None  # position in ``lines`` of the first call that goes wrong
    outliers: list[Outlier]
    ignored: tuple[str, ...] = ()
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (call, why) not diagnosed
    capture: dict | None = None  # the manifest's facts: stopped, script error, calls recorded
    what_if: list[WhatIfAnswer] = field(default_factory=list)
    known: bool = False  # the calls name their implementation (a capture): the model's cells alone decide
    first_grad_bad: int | None = None  # position in ``lines`` of the first call whose gradients go wrong
    findings: list[Finding] = field(default_factory=list)  # of the capture itself, not of a call (capture_incomplete)
    ranks: list[RankSummary] = field(default_factory=list)  # a capture of several processes: each rank's own account
    kernels: list[KernelCall] = field(
        default_factory=list
    )  # --what-if kernels: each call under every kernel that could run it
    recorded_on: str | None = (
        None  # the GPU every call was recorded on ('cuda:0, NVIDIA H100, sm 9.0'); None: a CPU or mixed
    )
    settings: list[SettingChoice] = field(default_factory=list)  # --what-if fa4: each grid over the calls, its best
    # --what-if fa4: each call's own grids (position in ``lines``, its choices): the best may differ call by call
    call_settings: list[tuple[int, list[SettingChoice]]] = field(default_factory=list)
    # grids not computed: ('fa4/e4m3', calls the kernel would not run in that dtype, the first call's why)
    settings_refused: list[tuple[str, int, str]] = field(default_factory=list)
    decode: list[DecodeRun] = field(default_factory=list)  # each module's decode steps, grouped (model_decode)
    head_marks: list[HeadMark] = field(default_factory=list)  # heads with an attention sink or an outlier channel
    # The sink rate (sail-sg/Attention-Sink): (batch, call, head) triples whose first-token importance exceeds 0.3,
    # of those with one
    sink_hits: int = 0
    sink_pairs: int = 0

    @property
    def sink_rate(self) -> float | None:
        return self.sink_hits / self.sink_pairs if self.sink_pairs else None


@dataclass
class RunResult:
    """What ``attncheck run`` returns: a diagnosis per tensor, and where it ran; for files, the
    calls they hold and the model report over them."""

    tensors: list[TensorDiagnosis]
    device: str
    calls: list[CallReport] = field(default_factory=list)
    model: ModelReport | None = None
    kv: KVReport | None = None  # --what-if kv:...: the KV cache's what-ifs
    sums: CaptureSums | None = None  # --accumulate on a capture: the sums kept in 16 bits, per call and layer
