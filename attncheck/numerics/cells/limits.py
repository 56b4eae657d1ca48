"""The first failure a cell can have from finite inputs (its ``CellLimit``), and how far an input is from it."""

from __future__ import annotations

import math

import torch

from attncheck.numerics.cells.plan import CellKey
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.precision import (
    dtype_from_name,
    exp_overflow_threshold,
    exp_underflow_threshold,
    rounding_limit,
)
from attncheck.registry import PATHS, fp8_names, resolve
from attncheck.results import CellLimit


def cell_limit(
    key: CellKey,
    input_dtype: torch.dtype,
    census,
    spread: float | None,
    audit,
    p_scale: float,
    params: MethodParams | None = None,
) -> CellLimit | None:
    """The first failure ``key``'s cell can have from finite inputs, and how far this input is from it:

    - naive (any path): exp of the largest logit overflows the dtype (``exp_overflow_threshold``);
    - the eager path's other methods: S = Q@K^T, rounded to the dtype before the scale, passes the
      dtype's rounding limit (the scale applied to q first: q.k times the scale);
    - flash (S = Q@K^T in fp32, then the scale) and sdpa-math (q and k each times sqrt(scale)):
      S passes fp32's rounding limit;
    - FP8 cells: the P cast flushes keys more than ln(S) - exp_underflow(format) below the running
      max: the threshold against the largest spread of a row (its max minus its smallest unmasked score);
    - given scores in a dtype narrower than the input's: the cast of the largest score to inf;
      otherwise (torch, stable or tiled on scores the dtype holds) nothing fails: None.

    Thresholds come from ``torch.finfo`` (``precision``); the quantities from the census and the audit.
    """
    d = key.dtype
    dt = dtype_from_name(d)
    spec = PATHS.get(key.path) if key.path is not None else None
    # the kernel's own arithmetic breaks first (FlashAttention-4's lazy rescale: P's growth; the fused exponent of
    # fa2-fma and fa3 in 16 bits); None: not in this dtype
    own = (
        None
        if spec is None or spec.limit is None or audit is None
        else resolve(spec.limit)(dt, params or MethodParams())
    )
    if own is not None:
        kind, threshold, what, *bound = own
        return CellLimit(kind, threshold, bound[0] if bound else audit.raw_max_abs * audit.scale, what)
    if d in fp8_names():
        threshold = math.log(p_scale) - exp_underflow_threshold(dt)
        return CellLimit(
            "p_cast_flush",
            threshold,
            spread,
            f"the {d} P cast (S = {p_scale:g}) flushes keys more than {threshold:.4g} below the running max",
        )
    if key.method == "naive":
        top = next((h for h in census.headroom if h.dtype == d), None)
        value = census.max if top is None or top.headroom is None else top.exp_overflow_threshold - top.headroom
        return CellLimit(
            "exp_overflow",
            exp_overflow_threshold(dt),
            value,
            f"exp(x) = inf in {d} for x > {exp_overflow_threshold(dt):.4g}",
        )
    if key.path is not None and audit is not None:
        raw = audit.raw_max_abs
        how = PATHS.get(key.path).scores
        if how == "dtype":
            value = raw * audit.scale if audit.scale_order == "q" else raw
            return CellLimit(
                "qk_overflow",
                rounding_limit(dt),
                value,
                f"S = Q@K^T in {d} rounds to inf at |S| >= {rounding_limit(dt):.6g}",
            )
        s32 = rounding_limit(torch.float32)
        value = raw * audit.scale if how == "fp32-split" else raw
        return CellLimit("qk_overflow", s32, value, f"S = Q@K^T in fp32 rounds to inf at |S| >= {s32:.6g}")
    if key.path is None and rounding_limit(dt) < rounding_limit(input_dtype):
        return CellLimit(
            "cast_overflow",
            rounding_limit(dt),
            census.max,
            f"scores cast to {d} round to inf at |x| >= {rounding_limit(dt):.6g}",
        )
    return None
