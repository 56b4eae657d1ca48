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

from attncheck.numerics.sweep import measure_outputs
from attncheck.numerics.synthetic import make_qk
from attncheck.results import PresetCheck, PresetResult, PresetRow

FA3_HEADS, FA3_SEQ, FA3_D, FA3_BLOCK = 8, 1024, 128, 128


def fa3(seed: int = 0, device: str | torch.device = "cpu") -> PresetResult:
    start = time.perf_counter()
    q, k, v = make_qk(FA3_HEADS, FA3_SEQ, FA3_SEQ, FA3_D, dist="outliers", seed=seed, with_v=True)
    q, k, v = (t.to(device) for t in (q, k, v))
    outs = measure_outputs(q, k, v, 1 / math.sqrt(FA3_D), ("fp16",), ("eager", "flash"), FA3_BLOCK, device, methods={"eager": "stable"})
    rmse = {o.path: o.rmse for o in outs}
    base, flash = rmse["eager"], rmse["flash"]
    rows = [
        PresetRow("baseline attention, FP16", "eager:stable/fp16", 3.2e-4, base),
        PresetRow("FlashAttention-2/3, FP16", "flash/fp16", 1.9e-4, flash),
    ]
    ratio = base / flash if base and flash else None
    checks = [
        PresetCheck("RMSE ratio baseline / FlashAttention (paper 1.7)", ratio, 1.3, 2.3),
        *(PresetCheck(f"{r.label}: RMSE / paper's", None if r.measured is None else r.measured / r.paper, 0.5, 2.0) for r in rows),
    ]
    return PresetResult(
        name="fa3",
        source="FlashAttention-3 (arXiv 2407.08608), section 4.3, FP16",
        setup=f"q, k, v entries N(0,1) + N(0,100) Bernoulli(0.001); {FA3_HEADS} heads x {FA3_SEQ} queries x {FA3_SEQ} keys, "
        f"d = {FA3_D}, scale 1/sqrt(d), flash key blocks of {FA3_BLOCK}, seed {seed}",
        metric="RMSE of O against float64",
        rows=rows,
        checks=checks,
        notes=[
            "baseline = eager:stable: Q@K^T, the scale and the softmax's exp and row sum in FP16, as standard attention written "
            "with FP16 tensors; flash keeps S, the running max and sum in FP32 and rounds P to FP16 once, before P@V",
        ],
        seconds=time.perf_counter() - start,
    )


PRESETS: dict[str, Callable[..., PresetResult]] = {"fa3": fa3}
