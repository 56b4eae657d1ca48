"""What the synthetic generator draws (its distributions, rows laid out as whole heads) and what a draw costs.

Free of torch, and below config (which checks a sweep's and a check's sizes with it) and numerics (whose sweep
draws the inputs): ``config.sweep`` re-exports these names.
"""

from __future__ import annotations

DIST_NAMES = ("normal", "outliers")


# FlashAttention-3's numerical-error inputs: N(0,1) + N(0,100) * Bernoulli(0.001).
OUTLIER_PROB = 0.001


OUTLIER_VAR = 100.0


MEMORY_BUDGET_BYTES = 2 * 1024**3


OUTPUT_ROWS = (
    1024  # rows (whole heads) whose output O = P@V each point measures: enough for its RMSE, a quarter of the cost
)


def head_layout(rows: int, seq: int) -> tuple[int, int]:
    """(heads, queries per head) holding at least ``rows`` rows.

    Like self-attention, a head has up to ``seq`` queries that share its ``seq``
    keys; every query is drawn on its own. The last head may be cut short.
    """
    queries = min(rows, seq)
    return -(-rows // queries), queries


def qk_bytes(heads: int, queries: int, seq: int, dk: int, dist: str = "normal") -> int:
    """Peak memory of drawing float64 q (heads, queries, dk) and k (heads, seq, dk): both,
    plus for ``outliers`` the second normal draw of the larger one and two boolean masks."""
    both = 8 * heads * (queries + seq) * dk
    return both + (10 * heads * max(queries, seq) * dk if dist == "outliers" else 0)


def gib(n: float) -> str:
    """Bytes as GiB for messages: 2.5 GiB, 152,588 GiB."""
    v = n / 1024**3
    return f"{v:,.0f} GiB" if v >= 100 else f"{v:.3g} GiB"
