"""The inverse frequencies of transformers' RoPE types (``rope_type`` in the config's ``rope_parameters``), each twice:
from its definition in float64 (the reference a recorded table is judged against), and as transformers 5.24 computes
it in fp32 (``modeling_rope_utils.py``), for what the same table computed in fp32 would be off by.

- ``default``: theta^(-2j/d), j = 0 .. d/2 - 1 (d: the rotated width, the table's last axis).
- ``linear`` (kaiokendev's position interpolation): theta^(-2j/d) / factor, i.e. position p read as p / factor.
- ``llama3`` (Llama 3.1's ``apply_scaling``, meta-llama/llama-models): with wavelength w = 2 pi / f of each default
  frequency f, L = original_max_position_embeddings, lo = low_freq_factor, hi = high_freq_factor: f where
  w < L / hi, f / factor where w > L / lo, and between them (1 - s) f / factor + s f with s = (L / w - lo) / (hi - lo).
- ``yarn`` (arXiv 2309.00071): f where the frequency index j lies below the correction range, f / factor above it,
  a linear ramp in j between (the range from beta_fast and beta_slow rotations over L, floored and ceiled unless
  ``truncate`` is false); cos and sin are then multiplied by the attention factor (given, else 0.1 ln(factor) + 1, or
  the ratio of the mscale terms).
- ``longrope`` (Phi-3; microsoft/LongRoPE): f / r_j, with r the ``long_factor`` list where the forward's longest
  position + 1 passes L, else ``short_factor`` (transformers' ``longrope_frequency_update`` picks per forward, from
  ``max(position_ids) + 1``: no state beyond that); cos and sin times the attention factor (given, else
  sqrt(1 + ln(s) / ln(L)) with s = factor, or max_position_embeddings / L).

``dynamic`` recomputes its frequencies from the longest sequence the model has seen so far (transformers'
``dynamic_rope_update`` keeps that state between forwards); ``proportional`` and ``axial`` lay them out otherwise:
not judged here, and said so by name.

Pure functions over tensors; no verdicts.
"""

from __future__ import annotations

import math

import torch

# The types whose frequencies are written below; every other type a config may name is reported as not judged.
JUDGED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# The parameters each judged type needs from the config (recorded with the table); yarn's others have defaults.
REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings",),
}
NOT_JUDGED_WHY = {
    "dynamic": "its frequencies are recomputed from the longest sequence the model has seen so far (state kept "
    "between forwards)",
    "proportional": "its frequencies cover part of the head by a per-layer rule this check does not model",
    "axial": "its frequencies run over two or more axes of positions, not one",
}


def why_not_judged(rope_type: str, parameters: dict, frequencies: int | None = None) -> str | None:
    """Why a table of this type cannot be judged (None: it can): a type not written here, or a parameter it needs
    that was not recorded (``frequencies``: the table's d/2, which longrope's factor lists must match)."""
    if rope_type not in JUDGED_ROPE_TYPES:
        why = NOT_JUDGED_WHY.get(rope_type, "a RoPE type this check does not model")
        return f"rope_type {rope_type}: not judged ({why})"
    missing = [k for k in REQUIRED[rope_type] if not isinstance(parameters.get(k), (int, float))]
    if rope_type in ("yarn", "longrope") and not isinstance(parameters.get("factor"), (int, float)):
        if not isinstance(parameters.get("max_position_embeddings"), (int, float)):
            missing.append("factor")  # without it the factor is max_position_embeddings / original_max_...
    if rope_type == "longrope":
        for key in ("long_factor", "short_factor"):
            got = parameters.get(key)
            if not isinstance(got, list) or (frequencies is not None and len(got) != frequencies):
                missing.append(f"{key} (a list of d/2 = {frequencies} numbers)" if isinstance(got, list) else key)
    if missing:
        return f"rope_type {rope_type}: not judged (its parameter {', '.join(missing)} was not recorded)"
    return None


def _default64(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return torch.tensor(float(theta), dtype=torch.float64) ** -exponents  # (d/2,)


def _longrope_factors(p: dict, longest: int) -> list[float]:
    """transformers' choice per forward: the long factors where max(position_ids) + 1 passes L, else the short."""
    return p["long_factor"] if longest > p["original_max_position_embeddings"] else p["short_factor"]


def longrope_attention_factor(p: dict) -> float:
    """``attention_factor`` where given, else sqrt(1 + ln(s) / ln(L)) for s = factor (or max_position_embeddings /
    L) above 1, else 1."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    s = _yarn_factor(p)
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(p["original_max_position_embeddings"]))


def _yarn_factor(p: dict) -> float:
    factor = p.get("factor")
    return float(factor) if factor is not None else p["max_position_embeddings"] / p["original_max_position_embeddings"]


def yarn_attention_factor(p: dict) -> float:
    """The factor yarn multiplies cos and sin by: ``attention_factor`` where given, else 0.1 ln(s) + 1 (s > 1), or
    (0.1 mscale ln(s) + 1) / (0.1 mscale_all_dim ln(s) + 1) where both mscales are given."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    s = _yarn_factor(p)

    def m(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return m(s, p["mscale"]) / m(s, p["mscale_all_dim"])
    return m(s)


def _yarn_range(theta: float, dim: int, p: dict) -> tuple[float, float]:
    """The frequency indices between which yarn ramps from extrapolation to interpolation: the index whose
    wavelength fits beta rotations into original_max_position_embeddings, for beta_fast and beta_slow."""
    length = p["original_max_position_embeddings"]

    def index(rotations: float) -> float:
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(p.get("beta_fast") or 32), index(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, (high + 0.001 if low == high else high)  # transformers' guard against a zero-width ramp


def reference_frequencies(
    rope_type: str, theta: float, dim: int, parameters: dict, longest: int = 0
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies in float64 (d/2,), the factor cos and sin are multiplied by) from the type's definition;
    ``why_not_judged`` must be None for it. ``longest``: the forward's largest position + 1 (longrope's choice)."""
    p, f = parameters, _default64(theta, dim)
    if rope_type == "longrope":
        factors = torch.tensor(_longrope_factors(p, longest), dtype=torch.float64)
        return f / factors, longrope_attention_factor(p)
    if rope_type == "linear":
        return f / p["factor"], 1.0
    if rope_type == "llama3":
        length, lo, hi, factor = (
            p["original_max_position_embeddings"],
            p["low_freq_factor"],
            p["high_freq_factor"],
            p["factor"],
        )
        wavelength = 2 * math.pi / f
        smooth = (length / wavelength - lo) / (hi - lo)
        between = (1 - smooth) * f / factor + smooth * f
        return torch.where(wavelength < length / hi, f, torch.where(wavelength > length / lo, f / factor, between)), 1.0
    if rope_type == "yarn":
        low, high = _yarn_range(theta, dim, p)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 0: f, 1: f / s
        return f * (1 - ramp) + f / _yarn_factor(p) * ramp, yarn_attention_factor(p)
    return f, 1.0


def model_frequencies(rope_type: str, theta: float, dim: int, parameters: dict, longest: int = 0) -> torch.Tensor:
    """The inverse frequencies as transformers 5.24 computes them, in fp32 (d/2,) (its ``_compute_*_parameters``,
    operation for operation, so that the fp32 recipe and the what-ifs start from the model's own numbers)."""
    p = parameters
    if rope_type == "longrope":
        factors = torch.tensor(_longrope_factors(p, longest), dtype=torch.float32)
        return 1.0 / (factors * float(theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (d/2,) fp32
    if rope_type == "linear":
        return inv / p["factor"]
    if rope_type == "llama3":
        length, lo, hi, factor = (
            p["original_max_position_embeddings"],
            p["low_freq_factor"],
            p["high_freq_factor"],
            p["factor"],
        )
        wavelength = 2 * math.pi / inv
        scaled = torch.where(wavelength > length / lo, inv / factor, inv)
        smooth = (length / wavelength - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < length / hi) * ~(wavelength > length / lo)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "yarn":
        low, high = _yarn_range(theta, dim, p)
        pos = float(theta) ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos, 1.0 / (_yarn_factor(p) * pos)
        keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        return interpolation * (1 - keep) + extrapolation * keep
    return inv
