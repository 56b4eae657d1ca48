"""FP8: the P cast flushing probabilities that carry weight, values beyond the format's range, and Q, K, V cast
without a descale. (The FP8 tensor cores' accumulator is a kernel hazard: attncheck.findings.hazards.)"""

from __future__ import annotations

import math

from attncheck.findings.base import _SEEDED, Code, Example, _scores
from attncheck.findings.hazards import fp8_accumulator
from attncheck.registry import fp8_what_if_path
from attncheck.results import TensorDiagnosis

FP8_UNSCALED_FRAC = 0.01  # share of q/k/v values left subnormal or flushed by an unscaled cast

CODES: tuple[Code, ...] = (
    Code(
        "p_cast_underflow",
        "warning",
        "fp8",
        "the FP8 P cast flushes probabilities that carry weight",
        "FP8 kernels multiply P_j = exp(S_j - m_j) by a scale S and cast it to e4m3 before P@V. A probability "
        "far below the running max m_j flushes to 0, and the row loses that mass. An attention sink in the first "
        "key block sets a high running max early, so forward order flushes the most; FlashAttention-3 visits "
        "blocks in reverse and scales by 256 (arXiv 2606.06521). The message gives the share flushed by "
        "block position (before the row max's block, in it, after it).",
        "exp(s - m_j) x S < half e4m3's smallest subnormal (2^-10), i.e. s < m_j - (6.93 + ln S) (e5m2: 11.78 "
        "+ ln S); reported for rows that lose at least 0.1% of their probability.",
        "scale P by S = 256 before the cast (FlashAttention-3's max offset of 8; 448 for SageAttention) and visit the "
        "key blocks in reverse order (--order reverse, as FlashAttention-3 does), so that an attention sink in the "
        "first block sets the running max last (arXiv 2606.06521)",
        Example(
            _scores("""\
scores = np.zeros((4, 256), dtype=np.float32)
scores[:, 0] = 10.0  # an attention sink in the first key block
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype e4m3 --method tiled --p-scale 1 --brief --fail-on p_cast_underflow",
        ),
    ),
    Code(
        "fp8_overflow",
        "error",
        "fp8",
        "values beyond the FP8 format's range are clipped",
        "Either P scaled by S exceeds the format's largest value (the largest probabilities of every row are "
        "clipped), or Q, K or V quantised with the chosen scaling fall beyond +-max (448 in e4m3): the kernels' "
        "satfinite cast clips them silently, and a non-saturating cast gives NaN.",
        "S >= the format's rounding limit (e4m3: 464), or |x / descale| >= it for a value of Q, K or V.",
        "scale before the FP8 cast: x8 = fp8(x / descale) with descale = amax / max_fp8 per tensor or per (batch, kv "
        "head) (--fp8-scaling; FlashAttention-3's q_descale/k_descale/v_descale), or clamp; a kernel's satfinite cast "
        "clips silently and a non-saturating cast (older torch, the fnuz formats) gives NaN",
        Example(
            _scores("""\
np.save("scores.npy", np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
"""),
            "attncheck run scores.npy --dtype e4m3 --method tiled --p-scale 512 --brief --fail-on fp8_overflow",
        ),
    ),
    Code(
        "fp8_unscaled",
        "warning",
        "fp8",
        "Q, K, V are cast to FP8 without a descale while their range needs one",
        "With `--fp8-scaling none`, Q, K and V are cast to the format as they are. Values beyond its max are "
        "clipped, and small activations fall below its normal range (e4m3: 2^-6) where they keep fewer bits or "
        "flush to 0.",
        f"Scaling none, and a value clipped, or {FP8_UNSCALED_FRAC:.0%} or more of a tensor's values subnormal or "
        "flushed in the format.",
        "quantise with a descale (amax / max_fp8) per tensor or per (batch, kv head) and pass it to the kernel "
        "(FlashAttention-3: q_descale, k_descale, v_descale; vLLM: the layer's k_scale/v_scale); --fp8-scaling tensor "
        "or head shows the effect",
        Example(
            _SEEDED
            + """\
q, k, v = (torch.randn(1, 2, 64, 64, generator=g) * 1e-3 for _ in range(3))  # far below e4m3's normal range
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype e4m3 --fp8-scaling none --brief --fail-on "
            "fp8_unscaled",
        ),
    ),
)


def fp8_findings(diag: TensorDiagnosis, add) -> None:
    """FP8 cells: the P cast flushing probabilities, and Q/K/V clipped or left unscaled by their quantisation."""
    hit = [c for c in diag.cells if c.pcast_mass_rows]
    for d in dict.fromkeys(c.dtype for c in hit):
        cells = [c for c in hit if c.dtype == d]
        lim = diag.limits.get(d)
        parts = []
        for c in cells:
            pos = ", ".join(
                f"{name.replace('_', ' ')} {share:.2%}"
                for name, share in (c.pcast_flushed_by_position or {}).items()
                if share is not None
            )
            thr = (
                f"; with S = {c.p_scale:.4g} it flushes a score more than "
                f"{math.log(c.p_scale) - lim.exp_underflow:.3g} = {-lim.exp_underflow:.3g} + ln S below the running max"
                if lim and c.p_scale
                else ""
            )
            parts.append(
                f"{c.name}: {c.pcast_mass_rows} row(s) lose at least 0.1% of their probability (up to "
                f"{c.pcast_mass_max:.3g}); "
                f"{c.pcast_flushed_frac:.2%} of the probabilities flushed (by key block against the row max's block, "
                f"in visiting order: {pos}){thr}"
            )
        add(
            "p_cast_underflow",
            f"the {d} P cast flushes probabilities to 0 that carry weight: " + "; ".join(parts),
            cells,
            max(c.pcast_mass_rows for c in cells),
        )
    fp8_accumulator(diag, add)
    for d in dict.fromkeys(c.dtype for c in diag.cells if c.p_scale):
        lim = diag.limits.get(d)
        over = [c for c in diag.cells if c.dtype == d and c.p_scale and lim and c.p_scale >= lim.rounding_limit]
        if over:
            add(
                "fp8_overflow",
                f"P scaled by S = {over[0].p_scale:g} exceeds {d}'s largest value {lim.max:g}: the cast clips the "
                "largest probabilities of every row",
                over,
            )
    _quantisation_findings(diag, add)


def _quantisation_findings(diag: TensorDiagnosis, add) -> None:
    """fp8_overflow and fp8_unscaled of Q, K, V: values clipped by their quantisation, or cast without a descale."""
    if diag.attention is None:
        return
    for d, a in diag.attention.dtypes.items():
        if not a.fp8_values:
            continue
        lim = diag.limits.get(d)
        top = f"{lim.max:g}" if lim else "the format's max"
        clipped = {k: n for k, n in a.fp8_clipped.items() if n}
        cells = [c for c in diag.cells if c.dtype == d and c.path == fp8_what_if_path()]
        if clipped:
            what = ", ".join(
                f"{n} of {a.fp8_values[k]} {k} value(s) (amax {a.fp8_amax[k]:.4g})" for k, n in clipped.items()
            )
            add(
                "fp8_overflow",
                f"quantising to {d} with scaling '{a.fp8_scaling}' puts {what} beyond +-{top}: the kernels' satfinite "
                f"cast clips them to +-{top}",
                cells,
            )
        small = {k: a.fp8_subnormal.get(k, 0) + a.fp8_flushed.get(k, 0) for k in a.fp8_values}
        lost = {k: n for k, n in small.items() if a.fp8_values[k] and n / a.fp8_values[k] >= FP8_UNSCALED_FRAC}
        if a.fp8_scaling and a.fp8_scaling.startswith("none") and (clipped or lost):
            why = []
            if clipped:
                why.append(f"{', '.join(clipped)} exceed {top}")
            if lost:
                why.append(
                    ", ".join(
                        f"{small[k] / a.fp8_values[k]:.1%} of {k} fall below {d}'s normal range (fewer bits, or 0)"
                        for k in lost
                    )
                )
            amax = ", ".join(f"{k} {v:.4g}" for k, v in a.fp8_amax.items())
            add(
                "fp8_unscaled",
                f"q, k, v are cast to {d} without a descale (amax: {amax}; {d} holds {top} at most): " + "; ".join(why),
                cells,
            )
