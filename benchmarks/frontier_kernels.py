"""FlashAttention-4's published error figures, reproduced on a CPU with attncheck's emulation (the ``fa4`` path).

    python benchmarks/frontier_kernels.py [--quick] [--json PATH] [--only a,b,c,d]

Prints, per figure, the setup, the published value, attncheck's, their ratio and PASS/FAIL against the
tolerance stated beside the figure (the tests in ``tests/benchmarks/test_frontier_kernels.py`` check the same),
and writes every figure to ``--json`` (default ``$OUT/frontier_kernels.json`` where ``$OUT`` is set, else
./frontier_kernels.json). ``--quick``: fewer query rows and key lengths (the orderings still checked; the
tolerances only on the full run). Every FlashAttention-4 number comes from
``attncheck.numerics.paths.fa4.kernel_rows``; the references are float64 computations written here.

Each figure's setup, as its thread gives it (Dao-AILab/flash-attention; the commits from the mirror's history):

(a) PR 2694 (lishunyang12, 2026-07-03, head 9a191c3f on 002cce0a): "Repro on B300, exactly-representable fp8
    inputs with descale=1, error vs the bf16 kernel on the same values, S=8192", by logit std 0.25 / 0.5 / 1.0 /
    1.5 / 2.0: max offset 8 gives 0.027 / 0.031 / 0.136 / 0.305 / 0.361, offset 4 gives 0.027 / 0.028 / 0.027 /
    0.024 / 0.022. The kernel then (002cce0a ``flash_fwd_sm100.py:2014-2026``): FP8 rescale threshold 4,
    max offset 8 (the PR makes it 4), bf16 threshold 8. The script in the description starts
    ``q8 = torch.randn(1, 2048, 1, 128).clamp(-3, 3).to(<fp8>)`` (one head, head dim 128); the rest of it
    is not in the stored thread. Taken here: q, k, v ~ N(0, 1) clamped to [-3, 3] and cast to e4m3
    (descale 1), one head, 8192 keys, the logit std set by the softmax scale = std / sqrt(128) (unit-variance
    inputs give q.k / sqrt(d) a std of about 1), non-causal. Both kernels read the same e4m3 values (exact in
    bf16). B300 is SM103, where FA4 computes every exp2 in hardware (``enable_ex2_emu`` is False for sm103 and
    its tuning rows have ``ex2_emu_freq`` 0, 002cce0a ``flash_fwd_sm100.py:84-101, 213``): here the kernel's
    configuration with ``sm103=True``. The metric ("error") is not named: both the relative L2 error
    ||O8 - O16|| / ||O16|| and the relative mean absolute error sum|O8 - O16| / sum|O16| are printed and both are
    held to the tolerance. Query rows are i.i.d., so the figure over a sample of them (512; 64 with ``--quick``)
    estimates the one over 2048 or 8192.
    Tolerance (issue 34): each figure within 25%, and the same ordering: the offset-8 row grows with the logit
    std from 0.5 on, offset 4 stays at or below offset 8, and offset 4 stays flat (max/min < 1.5).

(b) issue 2716 (GoblinFlash, 2026-07-18; B200, flash-attn-4 4.0.0b22) / PR 2717 (yunweili3; commit 620fcb0f
    on 77aacb68): FP8 forward with explicit q/k/v descales of shape (batch, kv heads), batch 2, 32 heads over 2
    kv heads (GQA 16:1), head dim 128, seed 0, "rel_l2 against an FP32 softmax(QK^T/sqrt(d)) V reference"; the
    fix (e4m3 max offset 8 -> 4, e5m2 keeps 8; FP8 rescale threshold 4 at 77aacb68 ``flash_fwd_sm100.py:2028-2040``)
    "restores e4m3 to ~2x lower error than e5m2 across seqlen 256-4096, uniform and peaked softmax". Taken here:
    q, k, v ~ N(0, 1) in fp32, quantised as the caller does, x8 = fp8(x / descale), descale = amax / fp8 max per
    (batch, kv head) (a query head takes its kv head's q descale), given to the kernel as it takes them (q x k
    descale folded into the softmax scale, v's on O: ``kernel_rows(qk_descale=, v_descale=)``); square,
    non-causal; "uniform": the default scale (logit std about 1), "peaked": q times 4 (logit std about 4) (the
    thread's two softmax shapes are not defined in its stored text); B200 is SM100: ``exp2="kernel"``. The
    reference is float64 attention of the fp32 tensors (torch's fp32 SDPA is within ~1e-6 of it). 8 query
    positions per head on every head (512 rows; 2 with ``--quick``). Tolerance: e5m2 / e4m3 within 25% of 2 at
    every key length and shape, and, before the fix (e4m3 with offset 8), e4m3 worse than e5m2 (the bug the
    issue reported). Printed beside them: e4m3 before / after the fix (issue 2716: its quantization-only emulation
    was 54.9-68.5% below the GPU's e4m3 error, a ratio of 2.22-3.17, and PR 2717's fixed kernel matches that
    emulation) and e4m3 before the fix / e5m2 (PR 2717: "up to 1.6x worse rel_l2, growing with seqlen").

(c) PR 2067 (ssxuwinter, comment 2025-12-16; head bba527f5 on e240e0f7, which adds ``rescale_threshold`` and
    ``disable_e2e``): FA4 bf16 against torch SDPA in fp32, batch 1, 8 heads, head dim 128, "MaxAbs" by sequence
    length: 3.014469e-02 at 128 for every configuration; 3.386784e-02 at 256; 4.688931e-02 (threshold None = 8)
    against 3.129482e-02 (threshold 0) at 512; "MeanAbs" 1.507348e-03 at 128, 1.511154e-03 / 1.474344e-03
    (threshold 8 / 0) at 256. The inputs are not in the stored thread. Taken here: q, k, v ~ N(0, 1) in fp32,
    cast to bf16 for the kernel, the reference float64 attention of the fp32 tensors, square, non-causal,
    ``exp2="kernel"`` (e2e on; the current commit's tuning, where the PR's had ``e2e_freq`` 16) and ``"hardware"``
    (e2e off), at two logit stds: 1 (the default scale on unit-variance inputs) and 3 (q times 3: the std at which
    the MeanAbs at 128 keys comes near the published 1.5e-3, chosen so; N(0, 1) inputs at the default scale give
    errors 4-15x below the thread's, and its MeanAbs, flat from 128 to 512 keys, says its softmax was peaked).
    Tolerance (issue 34): 3.014e-2 at 128 keys for every threshold; at 512 keys threshold 8 above threshold 0,
    each within 25%. The max is over 4096 x 128 outputs of a random draw (and CUDA's generator is not the
    CPU's), so only the structure is checked without tolerance: one key tile gives the same bits under every
    threshold, and the lazy rescale raises the mean error at 256 and 512 keys. At 128 keys the thread's e2e on
    and off agree to every digit: in the PR's kernel the emulation ran only on blocks without a mask function
    (bba527f5 ``flash_fwd_sm100.py:1921``, ``e2e=mask_fn is None``) and the first block (the last keys) always
    has one (``:1739-1740``), so one tile never emulates; dd15c025 (2026-03-03, "Tune ex2_emu_freq") dropped
    that condition, and fa4 follows 0251105a, where every block may: there e2e on and off differ at 128 keys.

(d) issue 2263 (henrylhtsang, GB200): the degree-3 ex2 emulation against the hardware ``ex2.approx``, outputs
    rounded to bf16, x uniform in [-20, 0) and [-10, 0), n = 1e6: 1.01% / 0.99% of results differ (all by one bf16
    ulp), largest fp32 difference 1428 ulps. Here: fa4's emulation against fa4's model of the hardware exp2, the
    same draw sizes (1e5 with ``--quick``). Tolerance: within 25% of each share.

Runs without attncheck installed (the repository root goes on sys.path).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as python benchmarks/frontier_kernels.py, attncheck installed or not

import torch  # noqa: E402 (after the sys.path insert above, so that the repo's attncheck is found)

from attncheck.numerics.paths import fa4  # noqa: E402 (after the sys.path insert above)

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
TOL = 0.25  # issue 34: within 25% of each published figure


@dataclass
class Row:
    """One published figure beside attncheck's."""

    figure: str  # 'a', 'b', 'c', 'd'
    setup: str
    metric: str
    published: float | None  # None: an ordering claim, measured a truth value
    measured: float | None
    check: str  # 'within 25%', 'order', 'info'
    ok: bool | None = None  # None: printed, not judged

    @property
    def ratio(self) -> float | None:
        if self.published in (None, 0) or self.measured is None:
            return None
        return self.measured / self.published


def within(figure: str, setup: str, metric: str, published: float, measured: float, tol: float = TOL) -> Row:
    return Row(figure, setup, metric, published, measured, f"within {tol:.0%}", abs(measured / published - 1) <= tol)


def order(figure: str, setup: str, claim: str, holds: bool) -> Row:
    return Row(figure, setup, claim, None, None, "order", bool(holds))


def rel_l2(o: torch.Tensor, ref: torch.Tensor) -> float:
    return float((o - ref).norm() / ref.norm())


def rel_mean_abs(o: torch.Tensor, ref: torch.Tensor) -> float:
    return float((o - ref).abs().sum() / ref.abs().sum())


def fa4_out(q, k, v, *, scale: float, dt, threshold=None, offset=None, exp2: str = "kernel", **kw) -> torch.Tensor:
    """FA4's O (r, dv) as float64 from the emulation; q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) float64 holding the
    values the kernel reads; ``kw``: kernel_rows' configuration (seqlen_q, sm103, descales, ...). The figures need
    O alone: the effective probabilities are not formed."""
    rows = fa4.kernel_rows(
        q, k, v, scale=scale, dt=dt, rescale_threshold=threshold, max_offset=offset, exp2=exp2, want_probs=False, **kw
    )
    return rows.out.double()


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v over (n, tq, d) x (n, Tk, d) x (n, Tk, dv), flattened to (n * tq, dv)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # (n, tq, Tk)
    return (torch.softmax(s, dim=-1) @ v.double()).reshape(-1, v.shape[-1])


# (a) PR 2694
A_STDS = (0.25, 0.5, 1.0, 1.5, 2.0)
A_PUBLISHED = {8.0: (0.027, 0.031, 0.136, 0.305, 0.361), 4.0: (0.027, 0.028, 0.027, 0.024, 0.022)}


def measure_a(r: int, tk: int = 8192, d: int = 128) -> dict[float, dict[str, list[float]]]:
    """offset -> metric -> the error by logit std (A_STDS), over r query rows and tk keys."""
    g = torch.Generator().manual_seed(0)

    def e4m3(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).clamp(-3, 3).to(E4M3).double()

    q, k, v = e4m3(1, r, d), e4m3(1, tk, d), e4m3(1, tk, d)  # (1, r, d), (1, Tk, d), (1, Tk, d)
    got: dict[float, dict[str, list[float]]] = {off: {"rel_l2": [], "rel_mean_abs": []} for off in A_PUBLISHED}
    for std in A_STDS:
        scale = std / math.sqrt(d)
        # B300 is SM103: the kernel's own configuration there computes every exp2 in hardware
        cfg = {"exp2": "kernel", "sm103": True, "seqlen_q": 8192}
        o16 = fa4_out(q, k, v, scale=scale, dt=BF16, **cfg)  # threshold 8: the bf16 default
        for off in A_PUBLISHED:
            o8 = fa4_out(q, k, v, scale=scale, dt=E4M3, threshold=4.0, offset=off, **cfg)
            got[off]["rel_l2"].append(rel_l2(o8, o16))
            got[off]["rel_mean_abs"].append(rel_mean_abs(o8, o16))
    return got


def figure_a(quick: bool) -> tuple[list[Row], dict]:
    d, tk, r = 128, 8192, (64 if quick else 512)
    got = measure_a(r, tk, d)
    rows: list[Row] = []
    for metric in ("rel_l2", "rel_mean_abs"):
        for off, pub in A_PUBLISHED.items():
            for std, p, m in zip(A_STDS, pub, got[off][metric]):
                setup = f"e4m3 thr 4 offset {off:g}, logit std {std:g}"
                rows.append(within("a", setup, metric, p, m) if not quick else Row("a", setup, metric, p, m, "info"))
        o8, o4 = got[8.0][metric], got[4.0][metric]
        rows.append(
            order(
                "a",
                "offset 8",
                f"{metric} grows with the logit std from 0.5",
                all(x < y for x, y in zip(o8[1:], o8[2:])),
            )
        )
        rows.append(
            order(
                "a",
                "offset 4 vs 8",
                f"{metric}: offset 4 <= offset 8 (+1%)",
                all(a <= b * 1.01 for a, b in zip(o4, o8)),
            )
        )
        rows.append(order("a", "offset 4", f"{metric} flat: max/min < 1.5", max(o4) / min(o4) < 1.5))
    return rows, {"query_rows": r, "keys": tk, "head_dim": d, "stds": list(A_STDS), "measured": got}


# (b) issue 2716 / PR 2717
B_SHAPES = {"uniform": 1.0, "peaked": 4.0}  # q multiplied by this: the logit std at the default scale
B_VARIANTS = {  # name -> (dtype, max offset); FP8 rescale threshold 4 at the fix's base commit
    "e4m3 (fixed: offset 4)": (E4M3, 4.0),
    "e4m3 (before: offset 8)": (E4M3, 8.0),
    "e5m2 (offset 8)": (E5M2, 8.0),
}


def quantise(x: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, float]:
    """x8 = fp8(x / descale) with descale = amax(x) / max_fp8, as float64, and the descale (fp32)."""
    descale = (x.abs().amax() / torch.finfo(dt).max).float()
    return (x / descale).to(dt).double(), float(descale)


B_GEOMETRY = {"batch": 2, "heads": 32, "kv_heads": 2, "head_dim": 128}


def measure_b(lengths: tuple[int, ...], positions: int) -> dict[str, dict[int, dict[str, float]]]:
    """shape -> key length -> variant -> rel_l2, over ``positions`` query positions on every head."""
    batch, hq, hkv, d = B_GEOMETRY.values()
    per = hq // hkv
    scale = 1 / math.sqrt(d)
    got: dict[str, dict[int, dict[str, float]]] = {shape: {} for shape in B_SHAPES}
    for t in lengths:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(batch, hq, t, d, generator=g)  # fp32, (B, Hq, T, d)
        k = torch.randn(batch, hkv, t, d, generator=g)
        v = torch.randn(batch, hkv, t, d, generator=g)
        pos = torch.randperm(t, generator=g)[:positions]
        for shape, mult in B_SHAPES.items():
            outs: dict[str, list[torch.Tensor]] = {name: [] for name in B_VARIANTS}
            refs = []
            for b in range(batch):
                for h in range(hkv):
                    qg = q[b, h * per : (h + 1) * per] * mult  # (16, T, d): the kv head's query heads
                    kg = k[b, h].expand(per, t, d)
                    vg = v[b, h].expand(per, t, d)
                    refs.append(attention64(qg[:, pos], kg, vg, scale))
                    for name, (dt, off) in B_VARIANTS.items():
                        q8, dq = quantise(qg, dt)  # the descale over the whole (batch, kv head) group
                        k8, dk = quantise(kg[0], dt)
                        v8, dv = quantise(vg[0], dt)
                        o = fa4_out(
                            q8[:, pos],
                            k8.expand(per, t, d),
                            v8.expand(per, t, d),
                            scale=scale,
                            dt=dt,
                            threshold=4.0,
                            offset=off,
                            exp2="kernel",  # B200: SM100, the kernel's mix of hardware and emulated exp2
                            seqlen_q=t,
                            qhead_per_kvhead=per,
                            qk_descale=float(torch.tensor(dq, dtype=torch.float32) * torch.tensor(dk)),
                            v_descale=dv,
                        )
                        outs[name].append(o)
            ref = torch.cat(refs)
            got[shape][t] = {name: rel_l2(torch.cat(o), ref) for name, o in outs.items()}
    return got


def figure_b(quick: bool) -> tuple[list[Row], dict]:
    lengths = (256, 1024) if quick else (256, 512, 1024, 2048, 4096)
    positions = 2 if quick else 8  # query positions per head
    got = measure_b(lengths, positions)
    rows: list[Row] = []
    fixed, before, e5 = B_VARIANTS
    for shape in B_SHAPES:
        for t in lengths:
            e = got[shape][t]
            setup = f"{shape}, T={t}"
            ratio = e[e5] / e[fixed]
            rows.append(Row("b", setup, f"rel_l2 {fixed}", None, e[fixed], "info"))
            rows.append(Row("b", setup, f"rel_l2 {e5}", None, e[e5], "info"))
            rows.append(within("b", setup, "e5m2 / e4m3 (fixed)", 2.0, ratio))
            rows.append(order("b", setup, f"before the fix: e4m3 ({e[before]:.4f}) worse than e5m2", e[before] > e[e5]))
            # issue 2716: the quantization-only emulation's e4m3 error was
            # 54.9-68.5% below the GPU's, i.e. GPU / emulation = 2.22-3.17; PR 2717: the fixed kernel matches that
            # emulation. Over which of its five (length, softmax) configurations is not in the stored text: printed
            rows.append(
                Row("b", setup, "e4m3 before / after the fix (2716: 2.22-3.17)", None, e[before] / e[fixed], "info")
            )
            rows.append(
                Row("b", setup, "e4m3 before / e5m2 (2717: up to 1.6, growing with T)", None, e[before] / e[e5], "info")
            )
    return rows, {**B_GEOMETRY, "lengths": list(lengths), "positions_per_head": positions, "measured": got}


# (c) PR 2067
C_PUBLISHED = {  # (keys, threshold) -> (MaxAbs, MeanAbs or None): the e2e-on column
    (128, 8.0): (3.014469e-02, 1.507348e-03),
    (128, 0.0): (3.014469e-02, 1.507348e-03),
    (256, 8.0): (3.386784e-02, 1.511154e-03),
    (256, 0.0): (3.386784e-02, 1.474344e-03),
    (512, 8.0): (4.688931e-02, None),
    (512, 0.0): (3.129482e-02, None),
}
C_STDS = (1.0, 3.0)


def measure_c(lengths: tuple[int, ...], stds: tuple[float, ...] = C_STDS, h: int = 8, d: int = 128):
    """(std -> key length -> configuration -> {max_abs, mean_abs}, std -> whether thresholds 8 and 0 give the same
    bits at 128 keys)."""
    got: dict[float, dict[int, dict[str, dict]]] = {}
    same_bits_128: dict[float, bool] = {}
    for std in stds:
        got[std] = {}
        for t in lengths:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(h, t, d, generator=g) for _ in range(3))  # fp32 (H, T, d)
            q = q * std  # logit std ~ std at the default scale
            scale = 1 / math.sqrt(d)
            ref = attention64(q, k, v, scale)
            qb, kb, vb = (x.to(BF16).double() for x in (q, k, v))
            cell: dict[str, dict] = {}
            outs = {}
            for thr in (8.0, 0.0):
                for exp2 in ("kernel", "hardware"):
                    o = fa4_out(qb, kb, vb, scale=scale, dt=BF16, threshold=thr, exp2=exp2, seqlen_q=t)
                    outs[(thr, exp2)] = o
                    err = (o - ref).abs()
                    cell[f"thr {thr:g}, e2e {'on' if exp2 == 'kernel' else 'off'}"] = {
                        "max_abs": float(err.max()),
                        "mean_abs": float(err.mean()),
                    }
            if t == 128:
                same_bits_128[std] = bool(torch.equal(outs[(8.0, "kernel")], outs[(0.0, "kernel")]))
                cell["e2e on == off"] = bool(torch.equal(outs[(8.0, "kernel")], outs[(8.0, "hardware")]))
            got[std][t] = cell
    return got, same_bits_128


def figure_c(quick: bool) -> tuple[list[Row], dict]:
    h, d = 8, 128
    lengths = (128, 512) if quick else (128, 256, 512)
    got, same_bits_128 = measure_c(lengths, C_STDS, h, d)
    rows: list[Row] = []
    for std in C_STDS:
        for t in lengths:
            for thr in (8.0, 0.0):
                pub_max, pub_mean = C_PUBLISHED[(t, thr)]
                m = got[std][t][f"thr {thr:g}, e2e on"]
                setup = f"logit std {std:g}, T={t}, thr {thr:g}"
                rows.append(
                    Row("c", setup, "MaxAbs", pub_max, m["max_abs"], "info")
                    if quick
                    else within("c", setup, "MaxAbs", pub_max, m["max_abs"])
                )
                if pub_mean is not None:
                    rows.append(Row("c", setup, "MeanAbs", pub_mean, m["mean_abs"], "info"))
        rows.append(
            Row(
                "c",
                f"logit std {std:g}, T=128",
                "e2e on and off give the same bits (published: yes; see (c) in the docstring)",
                None,
                None,
                "info",
                got[std][128]["e2e on == off"],
            )
        )
        rows.append(
            order(
                "c",
                f"logit std {std:g}, T=128",
                "thr 8 and thr 0 give the same bits (one key tile)",
                same_bits_128[std],
            )
        )
        for t in lengths[1:]:
            c = got[std][t]
            rows.append(
                order(
                    "c",
                    f"logit std {std:g}, T={t}",
                    "MeanAbs: thr 8 > thr 0 (lazy rescale)",
                    c["thr 8, e2e on"]["mean_abs"] > c["thr 0, e2e on"]["mean_abs"],
                )
            )
            # a stale max leaves the block's largest P != 1, so it is rounded too: the published 1.511154e-03 /
            # 1.474344e-03 at 256 keys is this ratio
            ratio = c["thr 8, e2e on"]["mean_abs"] / c["thr 0, e2e on"]["mean_abs"]
            pub = C_PUBLISHED[(256, 8.0)][1] / C_PUBLISHED[(256, 0.0)][1] if t == 256 else None
            rows.append(Row("c", f"logit std {std:g}, T={t}", "MeanAbs thr 8 / thr 0", pub, ratio, "info"))
        c = got[std][512]
        rows.append(
            Row(
                "c",
                f"logit std {std:g}, T=512",
                "MaxAbs thr 8 > thr 0",
                None,
                None,
                "info",
                c["thr 8, e2e on"]["max_abs"] > c["thr 0, e2e on"]["max_abs"],
            )
        )
    return rows, {
        "heads": h,
        "head_dim": d,
        "lengths": list(lengths),
        "stds": list(C_STDS),
        "measured": {str(s): v for s, v in got.items()},
    }


# (d) issue 2263
D_PUBLISHED = {(-20.0, 0.0): 0.0101, (-10.0, 0.0): 0.0099}  # share of bf16-rounded results that differ
D_MAX_ULP = 1428  # the largest fp32 difference, in ulps, the issue measured


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).view(torch.int16)


def measure_d(n: int) -> dict[str, dict]:
    """range -> {share, one_ulp, max_fp32_ulps} over n uniform draws."""
    got = {}
    for lo, hi in D_PUBLISHED:
        g = torch.Generator().manual_seed(0)
        x = (lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).float()  # (n,) fp32 in [lo, hi)
        emu, hw = fa4.ex2_emulation(x), fa4.hardware_exp2(x)  # (n,) float32 each
        differ = bf16_bits(emu) != bf16_bits(hw)
        # the bf16 results that differ differ by one ulp (their bit patterns are adjacent: positive values)
        one_ulp = bool(((bf16_bits(emu) - bf16_bits(hw)).abs()[differ] == 1).all())
        ulps = (emu.view(torch.int32) - hw.view(torch.int32)).abs().max()
        share = float(differ.double().mean())
        got[f"[{lo:g}, {hi:g})"] = {"share": share, "one_ulp": one_ulp, "max_fp32_ulps": int(ulps)}
    return got


def figure_d(quick: bool) -> tuple[list[Row], dict]:
    n = 100_000 if quick else 1_000_000
    got = measure_d(n)
    rows: list[Row] = []
    for (lo, hi), pub in D_PUBLISHED.items():
        m = got[f"[{lo:g}, {hi:g})"]
        setup = f"x in [{lo:g}, {hi:g}), n={n}"
        rows.append(within("d", setup, "share of bf16 results that differ", pub, m["share"]))
        rows.append(order("d", setup, "every difference is one bf16 ulp", m["one_ulp"]))
        rows.append(Row("d", setup, "largest fp32 difference (ulps)", D_MAX_ULP, float(m["max_fp32_ulps"]), "info"))
    return rows, {"n": n, "measured": got}


FIGURES = {"a": figure_a, "b": figure_b, "c": figure_c, "d": figure_d}
TITLES = {
    "a": "(a) PR 2694: FA4 FP8 forward vs the bf16 kernel, 8192 keys, by logit std (FP8 threshold 4)",
    "b": "(b) issue 2716 / PR 2717: e4m3 vs e5m2 after the fix, rel_l2 vs fp32, key lengths 256-4096",
    "c": "(c) PR 2067: FA4 bf16 vs fp32 SDPA, B=1, H=8, D=128, by threshold",
    "d": "(d) issue 2263: ex2 emulation vs the hardware exp2, bf16-rounded",
}


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"


def verdict(row: Row) -> str:
    if row.check == "info":
        return "-" if row.ok is None else f"({'yes' if row.ok else 'no'})"
    return "PASS" if row.ok else "FAIL"


def print_table(key: str, rows: list[Row], seconds: float) -> None:
    print(f"\n{TITLES[key]}  [{seconds:.1f} s]")
    head = ("setup", "metric", "published", "attncheck", "ratio", "check", "")
    table = [head] + [
        (r.setup, r.metric, fmt(r.published), fmt(r.measured), fmt(r.ratio), r.check, verdict(r)) for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows and key lengths (the orderings only)")
    ap.add_argument("--json", default=None, help="where to write every figure (default $OUT/frontier_kernels.json)")
    ap.add_argument("--only", default="a,b,c,d", help="which figures, comma-separated (default a,b,c,d)")
    args = ap.parse_args(argv)
    keys = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in keys if x not in FIGURES]
    if unknown:
        print(f"error: --only takes a, b, c, d; got {', '.join(unknown)}", file=sys.stderr)
        return 2
    out_path = Path(args.json or os.path.join(os.environ.get("OUT") or ".", "frontier_kernels.json"))
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    doc: dict = {
        "meta": {"quick": args.quick, "attncheck": str(Path(fa4.__file__).parent.parent.parent)},
        "figures": {},
    }
    failed = 0
    for key in keys:
        t0 = time.perf_counter()
        rows, facts = FIGURES[key](args.quick)
        seconds = time.perf_counter() - t0
        print_table(key, rows, seconds)
        judged = [r for r in rows if r.check != "info"]
        failed += sum(not r.ok for r in judged)
        doc["figures"][key] = {
            "title": TITLES[key],
            "seconds": seconds,
            "facts": facts,
            "rows": [{**asdict(r), "ratio": r.ratio} for r in rows],
            "passed": sum(bool(r.ok) for r in judged),
            "failed": sum(not r.ok for r in judged),
        }
    out_path.write_text(json.dumps(doc, indent=1))
    print(f"\n{failed} check(s) failed; every figure in {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
