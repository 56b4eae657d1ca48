"""FlashAttention-4's settings, the lazy rescale threshold and the FP8 max offset: the grid ``--what-if fa4``
computes (``PathSpec.settings`` of the fa4 path) and the headroom they leave P (``PathSpec.limit``).

The kernel keeps a row's old max until the new one passes it by more than ``rescale_threshold`` (log2
units), and in FP8 adds ``max_offset`` to the exponent before the cast, so P may reach
2^(rescale_threshold + max_offset) before it is cast to the input dtype; above that dtype's largest value
the FP8 cast saturates (the top probabilities clip while the fp32 row sum counts them in full). At
Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced the defaults are threshold 8 for 16-bit
inputs, threshold 0 and offset 8 for FP8 (``flash_attn/cute/flash_fwd_sm100.py:2182-2190``), and the kernel
asserts ``max_offset + rescale_threshold < log2(dtype max)`` (``flash_fwd_sm100.py:2192``): a grid point
past it is computed (the kernel ran it before that assert, PR 2694: threshold 4, offset 8) and marked.

The grid follows the FA4 threads: PR 2694 (FP8 threshold 4 with offsets 8 and 4), PR 2717 (offset 4 for
e4m3), PR 2731 (FP8 threshold 0), PR 2067 (the 16-bit threshold as a knob: 0 against 8). The fa4 path names
this module by its import path (``PathSpec.settings``, ``.limit``): it is imported when a diagnosis asks, never
when the registry reads the spec at the CLI's start.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from attncheck.numerics.paths.base import Setting
from attncheck.numerics.paths.fa4 import (
    FA4_DEFAULT_OFFSET_FP8,
    FA4_DEFAULT_THRESHOLD_16,
    FA4_DEFAULT_THRESHOLD_FP8,
    Fa4Setup,
)
from attncheck.numerics.precision import dtype_from_name, dtype_label
from attncheck.registry import fp8_names  # no cycle: fa4 names this module by its path, imported when called

if TYPE_CHECKING:
    from attncheck.numerics.methods.softmax import MethodParams

SOURCE = "flash_attn/cute/flash_fwd_sm100.py:2192 at 0251105a"
THRESHOLDS_16 = (0.0, 4.0, 8.0, 16.0)  # 16-bit inputs: PR 2067's 0 and 8, 4 between, 16 past fp16's range
THRESHOLDS_FP8 = (0.0, 4.0)  # PR 2731's 0 (the default now), PR 2694's 4
OFFSETS_FP8 = (4.0, 8.0)  # PR 2717's 4 for e4m3, the default 8


def defaults(dtype_name: str) -> tuple[float, float]:
    """(rescale threshold, max offset) the kernel takes for inputs of this dtype (16-bit: offset 0)."""
    if dtype_name in fp8_names():
        return FA4_DEFAULT_THRESHOLD_FP8, FA4_DEFAULT_OFFSET_FP8
    return FA4_DEFAULT_THRESHOLD_16, 0.0


def log2_max(dtype_name: str) -> float:
    """log2 of the dtype's largest finite value: how far P may grow before its cast runs out."""
    return math.log2(float(torch.finfo(dtype_from_name(dtype_name)).max))


def refused(dtype_name: str, threshold: float, offset: float) -> str | None:
    """Why the kernel refuses this setting (its assert), or None."""
    top = log2_max(dtype_name)
    if threshold + offset < top:
        return None
    return (
        f"the kernel asserts max_offset + rescale_threshold < log2(max {dtype_name}) = {top:.4g} "
        f"({threshold:g} + {offset:g}; {SOURCE})"
    )


def label(threshold: float, offset: float, fp8: bool) -> str:
    """'t8' (16-bit, no offset), 't4,o8' (FP8, or a 16-bit offset asked with --max-offset)."""
    return f"t{threshold:g},o{offset:g}" if fp8 or offset else f"t{threshold:g}"


def settings(dtype_name: str, options=None) -> tuple[Setting, ...]:
    """The grid of ``--what-if fa4`` in one dtype: FP8 thresholds x offsets, 16-bit thresholds; fp32 none (the
    kernel takes 16-bit and FP8 inputs). ``options`` (``config.run.Options``): a setting asked with
    --rescale-threshold/--max-offset (``Options.fa4``) joins the grid where it is not in it already."""
    fp8 = dtype_name in fp8_names()
    if not fp8 and dtype_name not in ("fp16", "bf16"):
        return ()
    points = [(t, o) for t in THRESHOLDS_FP8 for o in OFFSETS_FP8] if fp8 else [(t, 0.0) for t in THRESHOLDS_16]
    own = defaults(dtype_name)
    asked = getattr(options, "fa4", None)
    if asked is not None:
        t = own[0] if asked.rescale_threshold is None else float(asked.rescale_threshold)
        o = own[1] if asked.max_offset is None or not fp8 else float(asked.max_offset)  # the offset is FP8's
        points += [] if (t, o) in points else [(t, o)]
    return tuple(
        Setting(
            label=label(t, o, fp8),
            params=(("fa4", Fa4Setup(rescale_threshold=t, max_offset=o if fp8 else None)),),
            values=(("rescale_threshold", t), ("max_offset", o)),
            default=(t, o) == own,
            refused=refused(dtype_name, t, o),
        )
        for t, o in points
    )


def limit(dt: "torch.dtype", params: "MethodParams | None" = None) -> tuple[str, float, str, float]:
    """The lazy rescale's headroom: P may reach 2^(threshold + offset) before its cast to the dtype (FP8: the
    format), whose largest value is 2^log2(max). In |S scale| units (ln 2 per log2 unit, as the other limits of
    the headroom column): threshold ln(max), value (threshold + offset) ln 2, so the headroom is how far a logit
    may pass the max the kernel holds before P runs out of its dtype (negative: the setting saturates P)."""
    name = dtype_label(dt)
    own_t, own_o = defaults(name)
    setup = getattr(params, "fa4", None)
    t = own_t if setup is None or setup.rescale_threshold is None else float(setup.rescale_threshold)
    fp8 = dt.itemsize == 1
    o = own_o if setup is None or setup.max_offset is None or not fp8 else float(setup.max_offset)  # FP8's only
    top = float(torch.finfo(dt).max)
    return (
        "p_saturation",
        math.log(top),
        f"the lazy rescale lets P reach 2^{t + o:g} (threshold {t:g} + offset {o:g}) before its cast to {name}, "
        f"whose max is {top:g} = 2^{math.log2(top):.4g} (in |S scale| units: ln 2 per power of 2)",
        (t + o) * math.log(2.0),
    )
