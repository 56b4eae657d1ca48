"""Sweep presets: published figures, reproduced by attncheck's paths and printed beside them.

``fa3``: FlashAttention-3 (Shah et al., arXiv 2407.08608), section 4.3, numerical error.
Q, K and V entries are drawn from N(0, 1) + N(0, 100) Bernoulli(0.001) (0.1% of the
entries get an extra term of std 10), and the RMSE of O against an fp64 reference is
reported: baseline attention in FP16 3.2e-4, FlashAttention-2/3 in FP16 1.9e-4, "1.7x
better because softmax stays in FP32". The paper gives neither the sequence length nor
the head dimension: attncheck uses d = 128 and 8 heads of 1024 queries over 1024 keys
with the 1/sqrt(d) scale. The paper's baseline is "standard attention" with the softmax
intermediates in FP16: attncheck's ``eager:stable`` (exp(x - max) and its row sum held
in FP16, as a softmax written with FP16 tensors keeps them); FlashAttention is the
``flash`` path (key blocks of 128).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit
from attncheck.numerics.methods.fp8 import flush_threshold, pcast_softmax, to_fp8
from attncheck.numerics.methods.fp8_attention import Fp8Setup, fa3_tile
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths.flash_fp8 import forward as flash_fp8
from attncheck.numerics.sweep.grid import measure_outputs
from attncheck.numerics.sweep.synthetic import make_qk
from attncheck.params import FP8_ACCUM_KERNEL_BITS
from attncheck.results import PresetCheck, PresetGrid, PresetResult, PresetRow

FA3_HEADS, FA3_SEQ, FA3_D, FA3_BLOCK = 8, 1024, 128, 128


def _nothing() -> None:
    pass


def fa3(seed: int = 0, device: str | torch.device = "cpu", step: Callable[[], None] = _nothing) -> PresetResult:
    start = time.perf_counter()
    q, k, v = make_qk(FA3_HEADS, FA3_SEQ, FA3_SEQ, FA3_D, dist="outliers", seed=seed, with_v=True)
    q, k, v = (t.to(device) for t in (q, k, v))
    outs = measure_outputs(
        q, k, v, 1 / math.sqrt(FA3_D), ("fp16",), ("eager", "flash"), FA3_BLOCK, device, methods={"eager": "stable"}
    )
    step()
    rmse = {o.path: o.rmse for o in outs}
    base, flash = rmse["eager"], rmse["flash"]
    rows = [
        PresetRow("baseline attention, FP16", "eager:stable/fp16", 3.2e-4, base),
        PresetRow("FlashAttention-2/3, FP16", "flash/fp16", 1.9e-4, flash),
    ]
    fp8 = fa3_fp8_rmse(q, k, v, seed, step)
    rows += [PresetRow(label, cell, paper, fp8[cell]) for label, cell, paper in FA3_FP8_ROWS]
    ratio = base / flash if base and flash else None
    b8, f8 = fp8[FA3_FP8_ROWS[0][1]], fp8[FA3_FP8_ROWS[1][1]]
    incoherent = max(fp8[FA3_FP8_ROWS[1][1]], fp8[FA3_FP8_ROWS[2][1]])
    plain = min(fp8[FA3_FP8_ROWS[3][1]], b8)
    checks = [
        PresetCheck("RMSE ratio baseline / FlashAttention, FP16 (paper 1.7)", ratio, 1.3, 2.3),
        PresetCheck(
            "RMSE ratio baseline FP8 / FlashAttention-3 FP8 (paper 2.6)", b8 / f8 if b8 and f8 else None, 1.8, 3.5
        ),
        PresetCheck(
            "ordering: worst incoherent FP8 row / best FP8 row without it (paper 9.3e-3 / 2.4e-2 = 0.39; below 1)",
            incoherent / plain if plain else None,
            0.0,
            1.0,
        ),
        *(
            PresetCheck(f"{r.label}: RMSE / paper's", None if r.measured is None else r.measured / r.paper, 0.5, 2.0)
            for r in rows
        ),
    ]
    return PresetResult(
        name="fa3",
        source="FlashAttention-3 (arXiv 2407.08608), section 4.3 and Table 3",
        setup=f"q, k, v entries N(0,1) + N(0,100) Bernoulli(0.001); {FA3_HEADS} heads x {FA3_SEQ} queries x "
        f"{FA3_SEQ} keys, d = {FA3_D}, scale 1/sqrt(d), flash key blocks of {FA3_BLOCK} (FP16) and "
        f"{fa3_tile(FA3_D)[1]} (FP8, FlashAttention-3's tile for d = {FA3_D}), seed {seed}",
        metric="RMSE of O against float64",
        rows=rows,
        checks=checks,
        notes=[
            "baseline = eager:stable: Q@K^T, the scale and the softmax's exp and row sum in FP16, as standard "
            "attention written with FP16 tensors; flash keeps S, the running max and sum in FP32 and rounds P to "
            "FP16 once, before P@V",
            "FP8: e4m3 Q, K, V. FlashAttention-3 FP8 = the flash-fp8 path with block quantisation (one scale per "
            "128-query and 224-key tile) and incoherent processing (seeded +-1 diagonal times Hadamard on Q and K); "
            "the ablations drop one each (per-tensor scales; no rotation); Q@K^T and P@V on the FP8 tensor cores' "
            "13-bit accumulator, as on the paper's H100 (at 1024 keys it moves these RMSEs by about 1e-4 of "
            "themselves against fp32 accumulation). The paper's baseline FP8 (per-tensor "
            "scaling, FP32 accumulation, softmax intermediates in FP16) is emulated as: S = q8 k8^T in FP32 times "
            "the descales, rounded to FP16, softmax in FP16, P cast to e4m3 unscaled, P8 V8 in FP32, times V's "
            "descale, rounded to BF16",
        ],
        seconds=time.perf_counter() - start,
    )


FA3_FP8_ROWS = [  # (label, attncheck cell, the paper's RMSE): Table 3
    ("baseline FP8 (per-tensor, FP16 softmax)", "baseline-fp8/e4m3", 2.4e-2),
    ("FlashAttention-3 FP8", "flash-fp8/e4m3 block, incoherent", 9.1e-3),
    ("  without block quantisation", "flash-fp8/e4m3 tensor, incoherent", 9.3e-3),
    ("  without incoherent processing", "flash-fp8/e4m3 block", 2.4e-2),
]


def fa3_fp8_rmse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int, step: Callable[[], None] = _nothing
) -> dict[str, float]:
    """RMSE of O against float64 for the FP8 rows of Table 3, q (H, T, d), k, v float64; ``step()`` after each row."""
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v  # (H, T, d) float64
    inp = prepare_inputs(q[None], k[None], v=v[None])
    out = {}
    for _, cell, _ in FA3_FP8_ROWS[1:]:
        scaling = "block" if "block" in cell else "tensor"
        setup = Fp8Setup(
            scaling=scaling,
            incoherent="incoherent" in cell,
            seed=seed,
            accum_bits=FP8_ACCUM_KERNEL_BITS,  # the paper measured on an H100: its FP8 MMA's accumulator
            accum_companions=False,
        )
        o = torch.cat(
            [
                flash_fp8(b, setup.fmt, [], MethodParams(fp8=setup)).cells[0][1].out
                for b in score_blocks(inp, inp.rows, q.device, start_audit(inp, statistics=False))
            ]
        )
        out[cell] = _rmse(o, exact)
        step()
    out[FA3_FP8_ROWS[0][1]] = _rmse(baseline_fp8(q, k, v), exact)
    step()
    return out


def baseline_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The FlashAttention-3 paper's baseline FP8 attention: per-tensor e4m3 Q, K, V; S in FP32
    rounded to FP16; softmax in FP16; P cast to e4m3 unscaled; P8 V8 in FP32; O in BF16."""
    e4m3 = torch.float8_e4m3fn
    top = torch.finfo(e4m3).max

    def quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ds = (x.abs().amax() / top).float()
        return to_fp8(x.float() / ds, e4m3).float(), ds

    (q8, dq), (k8, dk), (v8, dv) = quant(q), quant(k), quant(v)
    s = (torch.matmul(q8, k8.transpose(-1, -2)) * (dq * dk) * (1 / math.sqrt(q.shape[-1]))).half()
    z = s - s.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    p = e / e.sum(dim=-1, keepdim=True)  # FP16
    return (torch.matmul(to_fp8(p.float(), e4m3).float(), v8) * dv).to(torch.bfloat16)


def _rmse(o: torch.Tensor, exact: torch.Tensor) -> float:
    return float((o.double().reshape(exact.shape) - exact).pow(2).mean().sqrt())


# --------------------------------------------------------------------------- pcast

PCAST_ROWS, PCAST_KEYS, PCAST_BLOCK, PCAST_SINKS = 1024, 1024, 128, 4
PCAST_GAPS = (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0)
PCAST_SCALES = (1.0, 256.0, 448.0)


def expected_max(k: int) -> float:
    """delta_k = E[max of k standard normals], by the trapezoid rule (k = 4: 1.0294)."""
    x = torch.linspace(-12, 12, 240_001, dtype=torch.float64)
    pdf = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    return float(torch.trapezoid(x * k * pdf * cdf ** (k - 1), x))


def pcast(seed: int = 0, device: str | torch.device = "cpu", step: Callable[[], None] = _nothing) -> PresetResult:
    """P-cast underflow with an attention sink (arXiv 2606.06521): forward and reverse key order,
    S in {1, 256, 448}, beside the closed form Phi(gap + delta_k - 6.93 - ln S)."""
    start = time.perf_counter()
    e4m3 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(PCAST_ROWS, PCAST_KEYS, generator=g, dtype=torch.float32).to(device)
    delta = expected_max(PCAST_SINKS)
    rows, worst_gap, reverse_out, fwd_ge_rev = [], 0.0, 0.0, True
    for gap in PCAST_GAPS:
        s = base.clone()
        s[:, :PCAST_SINKS] += gap
        for scale in PCAST_SCALES:
            thr = flush_threshold(e4m3, scale)
            closed = 0.5 * (1 + math.erf((gap + delta - thr) / math.sqrt(2)))
            fwd = pcast_softmax(s, e4m3, scale, PCAST_BLOCK).flushed[:, PCAST_SINKS:]
            rev = pcast_softmax(s, e4m3, scale, PCAST_BLOCK, reverse=True).flushed
            f, r = float(fwd.double().mean()), float(rev[:, PCAST_SINKS:].double().mean())
            r_out = float(rev[:, PCAST_BLOCK:].double().mean())
            rows.append([f"{gap:g}", f"{scale:g}", thr, closed, f, r, r_out])
            worst_gap = max(worst_gap, abs(f - closed))
            fwd_ge_rev &= f >= r
            if scale == 256.0:
                reverse_out = max(reverse_out, r_out)
            step()
    grid = PresetGrid(
        "share of non-sink probabilities the e4m3 P cast flushes to 0",
        ["gap", "S", "6.93 + ln S", "closed form", "forward", "reverse", "reverse, other blocks"],
        rows,
    )
    checks = [
        PresetCheck(
            "largest |forward - closed form| over the grid (the closed form is to leading order)", worst_gap, 0.0, 0.1
        ),
        PresetCheck(
            "reverse with S = 256: largest share flushed beyond the sink's block (must be 0)", reverse_out, 0.0, 0.0
        ),
        PresetCheck(
            "forward flushes at least as much as reverse everywhere (1 = yes)", 1.0 if fwd_ge_rev else 0.0, 1.0, 1.0
        ),
    ]
    return PresetResult(
        name="pcast",
        source="P-Cast Precision in FP8 Attention (arXiv 2606.06521)",
        setup=f"{PCAST_ROWS} rows x {PCAST_KEYS} keys of N(0,1) logits, the first {PCAST_SINKS} keys an attention "
        f"sink raised by the gap; key blocks of {PCAST_BLOCK}; delta_k = E[max of {PCAST_SINKS} N(0,1)] = "
        f"{delta:.4f}; seed {seed}",
        metric="underflow of the P cast to e4m3 (the tiled softmax, P scaled by S before the cast)",
        rows=[],
        checks=checks,
        notes=[
            "forward: the sink's block sets the running max first, and every later key is cast against it; reverse (as "
            "FlashAttention-3) visits the sink's block last, so only keys sharing that block see the sink's max",
        ],
        grids=[grid],
        seconds=time.perf_counter() - start,
    )


PRESETS: dict[str, Callable[..., PresetResult]] = {"fa3": fa3, "pcast": pcast}
PRESET_STEPS = {"fa3": 1 + len(FA3_FP8_ROWS), "pcast": len(PCAST_GAPS) * len(PCAST_SCALES)}  # the calls to step()
