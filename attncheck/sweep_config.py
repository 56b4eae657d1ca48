"""What ``attncheck sweep`` is asked to compute: the grid, its scale policies and its size.

Free of torch and numpy, so bad options fail in milliseconds, before the heavy
imports. ``sweep`` (numerics) and ``synthetic`` (the generator) take their
names, distribution constants and memory budget from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attncheck.errors import AttncheckError
from attncheck.names import DTYPE_NAMES, METHOD_NAMES

SCALE_NAMES = ("none", "sqrt", "dk", "dk2")
SCALE_MEANINGS = {"none": "1", "sqrt": "1/sqrt(d_k)", "dk": "1/d_k", "dk2": "1/d_k^2"}
DIST_NAMES = ("normal", "outliers")
DEVICE_NAMES = ("cpu", "auto", "cuda")

# FlashAttention-3's numerical-error inputs: N(0,1) + N(0,100) * Bernoulli(0.001).
OUTLIER_PROB = 0.001
OUTLIER_VAR = 100.0

MEMORY_BUDGET_BYTES = 2 * 1024**3
# float64 (rows, seq) tensors alive at once while one grid point is measured:
# unscaled scores, scaled logits, reference, a cell's probabilities in float64,
# their difference, a temporary, plus the low-precision copies (counted as two).
_LIVE_ROW_TENSORS = 8

DEFAULT_DKS = (16, 32, 64, 128, 256, 512)
DEFAULT_SEQ = 128
DEFAULT_ROWS = 4096
DEFAULT_BLOCK = 32


@dataclass(frozen=True)
class Scale:
    """A scale policy as given on the command line: 'none', 'sqrt', 'dk', 'dk2' or a number."""

    name: str

    def value(self, dk: int) -> float:
        """The factor the logits q.k are multiplied by at this d_k."""
        if self.name == "none":
            return 1.0
        if self.name == "sqrt":
            return 1.0 / math.sqrt(dk)
        if self.name == "dk":
            return 1.0 / dk
        if self.name == "dk2":
            return 1.0 / (dk * dk)
        return float(self.name)

    @property
    def meaning(self) -> str:
        """'1/sqrt(d_k)' for 'sqrt'; a number stands for itself."""
        return SCALE_MEANINGS.get(self.name, self.name)


def parse_scale(text: str) -> Scale:
    """'sqrt' -> Scale('sqrt'); '0.125' -> Scale('0.125'); anything else is an input error."""
    name = text.strip().lower()
    if name in SCALE_NAMES:
        return Scale(name)
    try:
        value = float(name)
    except ValueError:
        raise AttncheckError(
            f"--scale: unknown scale {text.strip()!r} (use none, sqrt = 1/sqrt(d_k), dk = 1/d_k, dk2 = 1/d_k^2, or a positive number)"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise AttncheckError(f"--scale: a numeric scale must be a positive finite number, got {text.strip()!r}")
    return Scale(text.strip())


def _items(text: str, option: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise AttncheckError(f"{option} is empty")
    return items


def parse_int(text: str, option: str, minimum: int, what: str) -> int:
    """'128' -> 128; non-integers and values below ``minimum`` are input errors naming ``what``."""
    try:
        value = int(text.strip())
    except ValueError:
        raise AttncheckError(f"{option}: {what} must be an integer >= {minimum}, got {text.strip()!r}") from None
    if value < minimum:
        raise AttncheckError(f"{option}: {what} must be an integer >= {minimum}, got {value}")
    return value


def parse_positive_float(text: str, option: str, what: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise AttncheckError(f"{option}: {what} must be a positive number, got {text.strip()!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise AttncheckError(f"{option}: {what} must be a positive finite number, got {text.strip()!r}")
    return value


def parse_int_list(text: str, option: str, minimum: int, what: str) -> tuple[int, ...]:
    """'16, 32,64' -> (16, 32, 64), duplicates dropped, order kept."""
    return tuple(dict.fromkeys(parse_int(v, option, minimum, what) for v in _items(text, option)))


def parse_float_list(text: str, option: str, what: str) -> tuple[float, ...]:
    return tuple(dict.fromkeys(parse_positive_float(v, option, what) for v in _items(text, option)))


def parse_scales(text: str) -> tuple[Scale, ...]:
    return tuple(dict.fromkeys(parse_scale(v) for v in _items(text, "--scale")))


def parse_name(text: str, allowed: tuple[str, ...], option: str) -> str:
    name = text.strip().lower()
    if name not in allowed:
        raise AttncheckError(f"{option}: unknown value {text.strip()!r} (choose from {', '.join(allowed)})")
    return name


def head_layout(rows: int, seq: int) -> tuple[int, int]:
    """(heads, queries per head) holding at least ``rows`` rows.

    Like self-attention, a head has up to ``seq`` queries that share its ``seq``
    keys; every query is drawn on its own. The last head may be cut short.
    """
    queries = min(rows, seq)
    return -(-rows // queries), queries


def point_bytes(rows: int, seq: int, dk: int) -> int:
    """Peak memory of one grid point: float64 Q and K, plus the (rows, seq) working set."""
    heads, queries = head_layout(rows, seq)
    qk = 8 * heads * (queries + seq) * dk
    return qk + 8 * _LIVE_ROW_TENSORS * rows * seq


def gib(n: float) -> str:
    """Bytes as GiB for messages: 2.5 GiB, 152,588 GiB."""
    v = n / 1024**3
    return f"{v:,.0f} GiB" if v >= 100 else f"{v:.3g} GiB"


@dataclass(frozen=True)
class SweepConfig:
    """One sweep: the grid is dks x scales x seqs x stds, each point run for dtypes x methods."""

    dks: tuple[int, ...] = DEFAULT_DKS
    scales: tuple[Scale, ...] = tuple(Scale(s) for s in SCALE_NAMES)
    dtypes: tuple[str, ...] = DTYPE_NAMES
    methods: tuple[str, ...] = METHOD_NAMES
    seqs: tuple[int, ...] = (DEFAULT_SEQ,)
    stds: tuple[float, ...] = (1.0,)
    rows: int = DEFAULT_ROWS
    dist: str = "normal"
    seed: int = 0
    block: int = DEFAULT_BLOCK
    device: str = "cpu"

    def __post_init__(self) -> None:
        for option, values, minimum, what in (("--dk", self.dks, 1, "d_k"), ("--seq", self.seqs, 2, "keys per row")):
            if not values:
                raise AttncheckError(f"{option} is empty")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                    raise AttncheckError(f"{option}: {what} must be an integer >= {minimum}, got {v!r}")
        for v in self.stds:
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise AttncheckError(f"--std: the standard deviation must be a positive finite number, got {v!r}")
        if not self.stds:
            raise AttncheckError("--std is empty")
        if not self.scales:
            raise AttncheckError("--scale is empty")
        for name, allowed, option in ((self.dtypes, DTYPE_NAMES, "--dtype"), (self.methods, METHOD_NAMES, "--method")):
            if not name:
                raise AttncheckError(f"{option} is empty (choose from {', '.join(allowed)})")
            bad = [n for n in name if n not in allowed]
            if bad:
                raise AttncheckError(f"{option}: unknown value {bad[0]!r} (choose from {', '.join(allowed)})")
        if self.dist not in DIST_NAMES:
            raise AttncheckError(f"--dist: unknown value {self.dist!r} (choose from {', '.join(DIST_NAMES)})")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 2:
            raise AttncheckError(f"--rows: the number of rows must be an integer >= 2, got {self.rows!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise AttncheckError(f"--seed: the seed must be an integer >= 0, got {self.seed!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise AttncheckError(f"--block: the key block size must be an integer >= 1, got {self.block!r}")
        self.check_memory()

    def check_memory(self, budget: int = MEMORY_BUDGET_BYTES) -> None:
        """Refuse a grid whose largest point would not fit in ``budget`` bytes."""
        seq, dk = max(self.seqs), max(self.dks)
        need = point_bytes(self.rows, seq, dk)
        if need > budget:
            raise AttncheckError(
                f"a sweep point of {self.rows} rows x {seq} keys x d_k {dk} needs about {gib(need)} of memory, "
                f"over the {gib(budget)} budget: lower --rows, --seq or --dk"
            )

    @property
    def points(self) -> int:
        return len(self.dks) * len(self.scales) * len(self.seqs) * len(self.stds)
