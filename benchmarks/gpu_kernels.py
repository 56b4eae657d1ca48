"""PyTorch's CUDA attention backends against their emulated paths, case by case.

    python benchmarks/gpu_kernels.py [--json out.json] [--quick] [--cpu-only] [--time-limit 270]

For a grid of cases (random inputs; large logits, scores of ~1e3-1e4; boolean and float masks; fully
masked rows; GQA; causal, square and with Tq != Tk; key lengths at a tile, one either side and
T % 128 == 64; fp16 and bf16; head dims 64, 128, 256; and the published hazard repros: PyTorch issue
121558, bf16 q, k, v all 133120; PyTorch issue 196678 and cudnn-frontend issue 1072, cuDNN's padded
tile in the backward) it runs, on the GPU, each of PyTorch's FLASH_ATTENTION, EFFICIENT_ATTENTION and
CUDNN_ATTENTION backends alone (``sdpa_kernel``), takes the output and the log-sum-exp (the aten ops
``_scaled_dot_product_{flash,efficient,cudnn}_attention``), and compares them with the path that stands
for that backend on CUDA (``PathSpec.stands_for``: fa2, mem-efficient, cudnn), computed on the CPU by
the path's ``kernel_rows`` from the same inputs: the share of bit-identical output elements, the
largest |O_gpu - O_path| in ulps of the dtype at |O_path| (the CUDA paths state no bound: fa2 claims
bits up to its assumed mma rounding, mem-efficient and cudnn assume their rounding points), the
largest LSE difference, and whether the NaN/inf patterns of O are equal. A backend that refuses a
case is 'refused', with torch's reason, beside the path's ``why_not`` for the same facts. The repros
marked backward also run the backward on the GPU: NaN in dQ, dK, dV against cudnn's
``padded_tile_rows`` (NaN predicted for the cudnn backend only).

FlashAttention-3 (``FLASH_ATTN_3``, the fa3 path): where ``flash_attn_interface`` (the flash-attn package's
``hopper/`` build) imports on a Hopper GPU (sm90), each case without an explicit mask runs through its
``flash_attn_func`` (no split: ``num_splits=1``; causal aligned to the bottom right, as the emulation is given it
for this comparison) and is compared with ``fa3.kernel_rows`` as the backends are with theirs; elsewhere it is
skipped with the reason printed (the lent GPUs' image has no flash-attn build).

``--cpu-only`` needs no GPU: every path (fa2, fa2-fma, fa3, mem-efficient, cudnn, the CPU flash kernel's and
the math backend's) on every case, each checked against float64 (O finite wherever the float64
reference is, except on the rows a path's own hazard event names); it exits 1 if an emulation crashes
or gives NaN/inf where it must not. ``--quick``: a reduced grid. The table is printed last; the JSON
holds every figure (default ``$OUT/gpu_kernels.json`` where ``$OUT`` is set, else ./gpu_kernels.json).
The repros run first; cases not begun after ``--time-limit`` seconds are skipped and listed in the JSON, so
that a lent GPU's short time still returns figures.

Runs without attncheck installed (the repository root goes on sys.path) and imports only the paths
and their numerics (no typer, rich or msgspec: a GPU machine's bare image has torch and numpy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as python benchmarks/gpu_kernels.py, attncheck installed or not

import torch  # noqa: E402 (after the sys.path insert above, so that the repo's attncheck is found)

from attncheck.numerics.paths import (  # noqa: E402 (after the sys.path insert above, so that the repo's attncheck is found)
    cudnn,
    fa2,
    fa2_fma,
    fa3,
    flash,
    mem_efficient,
    sdpa_math,
)
from attncheck.numerics.paths.base import CallFacts  # noqa: E402 (after the sys.path insert above, so that the repo's attncheck is found)

PATH_MODULES = (fa2, fa2_fma, fa3, mem_efficient, cudnn, flash, sdpa_math)
FA3_BACKEND = "FLASH_ATTN_3"  # FlashAttention-3 through flash_attn_interface, where it imports on sm90
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
DT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


@dataclass(frozen=True)
class Case:
    """One attention call: batch 1, ``hq`` query heads over ``hkv`` kv heads."""

    name: str
    dt: str  # 'fp16', 'bf16'
    d: int
    tq: int
    tk: int
    hq: int = 2
    hkv: int = 2
    mask: str = "none"  # 'none', 'bool' (True = attend), 'float' (additive, in the dtype), 'causal' (is_causal)
    inputs: str = "random"  # 'random', 'large' (scores ~1e3-1e4), 'const133120', 'repro196678', 'repro1072'
    fully_masked: int = 0  # leading query rows with every key masked (bool mask)
    backward: bool = False  # run the backward on the GPU (the cuDNN padded-tile repros)
    shift: float = -128.0  # cudnn-frontend 1072's logit shift (0: its control)
    seed: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.dt]

    @property
    def label(self) -> str:
        return f"{self.name}/{self.dt}/d{self.d}/{self.tq}x{self.tk}"


def grid(quick: bool) -> list[Case]:
    cases: list[Case] = []
    # the hazard repros (bf16, d 64): PyTorch issues 121558 and 196678 (keys; with controls), cudnn-frontend 1072
    cases.append(Case("121558", "bf16", 64, 8, 8, hq=1, hkv=1, inputs="const133120"))
    cases.append(
        Case(
            "196678",
            "bf16",
            64,
            704 if not quick else 192,
            704 if not quick else 192,
            hq=1,
            hkv=1,
            mask="bool",
            inputs="repro196678",
            backward=True,
        )
    )
    cases.append(
        Case("196678-ctl-640", "bf16", 64, 640, 640, hq=1, hkv=1, mask="bool", inputs="repro196678", backward=True)
        if not quick
        else Case("196678-ctl-256", "bf16", 64, 256, 256, hq=1, hkv=1, mask="bool", inputs="repro196678", backward=True)
    )
    if not quick:
        cases.append(
            Case(
                "196678-ctl-causal",
                "bf16",
                64,
                704,
                704,
                hq=1,
                hkv=1,
                mask="causal",
                inputs="repro196678",
                backward=True,
            )
        )
    cases.append(Case("1072", "bf16", 64, 1, 128, inputs="repro1072", backward=True))
    cases.append(Case("1072-ctl-sk97", "bf16", 64, 1, 97, inputs="repro1072", backward=True))
    cases.append(Case("1072-ctl-shift0", "bf16", 64, 1, 128, inputs="repro1072", backward=True, shift=0.0))
    dts = ("bf16",) if quick else ("fp16", "bf16")
    dims = (64,) if quick else (64, 128, 256)
    for dt in dts:
        for d in dims:
            cases += [
                Case("random", dt, d, 64, 128),
                Case("large-logits", dt, d, 64, 128, inputs="large"),
                Case("bool-mask", dt, d, 32, 192, mask="bool"),
                Case("float-mask", dt, d, 32, 129, mask="float"),
                Case("fully-masked", dt, d, 32, 128, mask="bool", fully_masked=3),
                Case("causal", dt, d, 64, 64, mask="causal"),
            ]
            if quick:
                continue
            cases += [
                Case("gqa", dt, d, 32, 128, hq=4, hkv=2),
                Case("causal-rect", dt, d, 32, 160, mask="causal"),
                Case("T%128=64", dt, d, 16, 320),
            ]
            cases += [Case(f"tile{t}{off:+d}", dt, d, 16, t + off) for t in (64, 128) for off in (-1, 0, 1)]
    return cases


@dataclass
class Inputs:
    q: torch.Tensor  # (1, hq, tq, d) in the dtype
    k: torch.Tensor  # (1, hkv, tk, d)
    v: torch.Tensor
    keep: torch.Tensor | None  # (1, hq, tq, tk) bool, True = attend (a boolean mask)
    fmask: torch.Tensor | None  # (1, hq, tq, tk) additive float mask in the dtype
    causal: bool
    do: torch.Tensor  # (1, hq, tq, d): the output gradient for the backward

    def sdpa_mask(self) -> torch.Tensor | None:
        return self.keep if self.keep is not None else self.fmask


def make_inputs(c: Case) -> Inputs:
    g = torch.Generator().manual_seed(c.seed * 7919 + c.d + c.tk)
    dt = c.dtype

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = randn(1, c.hq, c.tq, c.d), randn(1, c.hkv, c.tk, c.d), randn(1, c.hkv, c.tk, c.d)
    keep = fmask = None
    if c.inputs == "large":  # scores q.k / sqrt(d) ~ N(0, 2000^2): up to ~1e4 over a few thousand entries
        a = math.sqrt(2000.0)
        q, k = q * a, k * a
    elif c.inputs == "const133120":  # PyTorch issue 121558
        q = torch.full_like(q, 133120.0)
        k, v = torch.full_like(k, 133120.0), torch.full_like(v, 133120.0)
    elif c.inputs == "repro196678":  # every logit ~ -120: every LSE < -88.7 (tests/numerics/paths/test_cudnn.py)
        q, k = q * 0.1, k * 0.1
        q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(c.d)
    elif c.inputs == "repro1072":  # Sq = 1, logits shifted by -128 (or 0 for the shift control)
        q[..., 0], k[..., 0] = 1.0, c.shift * math.sqrt(c.d)
    if c.mask == "bool":
        if c.inputs == "repro196678":
            keep = torch.ones(c.tq, c.tk, dtype=torch.bool).tril().expand(1, c.hq, c.tq, c.tk).clone()
        else:
            keep = torch.rand(1, c.hq, c.tq, c.tk, generator=g) > 0.3
            keep[..., 0] = True
            keep[:, :, : c.fully_masked] = False
    elif c.mask == "float":
        fmask = (randn(1, c.hq, c.tq, c.tk) * 2).to(dt)
    do = randn(1, c.hq, c.tq, c.d).to(dt)
    return Inputs(q.to(dt), k.to(dt), v.to(dt), keep, fmask, c.mask == "causal", do)


def top_left_causal(tq: int, tk: int) -> torch.Tensor:
    """(tq, tk) bool, True = masked: key j of query i where j > i (PyTorch's is_causal, top-left aligned)."""
    return torch.ones(tq, tk, dtype=torch.bool).triu(1)


@dataclass
class Rows:
    """The case as the paths take it: rows are (head, query) pairs, kv heads expanded per query head."""

    q: torch.Tensor  # (n, tq, d) float64
    k: torch.Tensor  # (n, tk, d) float64
    v: torch.Tensor  # (n, tk, d) float64
    masked: torch.Tensor | None  # (n, tq, tk) bool, True = masked (boolean mask or causal)
    fbias: torch.Tensor | None  # (n, tq, tk) float64: the float mask's values in the dtype
    scale: float


def as_rows(c: Case, x: Inputs) -> Rows:
    rep = c.hq // c.hkv
    k, v = x.k.repeat_interleave(rep, dim=1), x.v.repeat_interleave(rep, dim=1)
    masked = None
    if x.keep is not None:
        masked = ~x.keep[0]
    elif x.causal:
        masked = top_left_causal(c.tq, c.tk).expand(c.hq, c.tq, c.tk)
    fbias = None if x.fmask is None else x.fmask[0].double()
    return Rows(x.q[0].double(), k[0].double(), v[0].double(), masked, fbias, 1.0 / math.sqrt(c.d))


def reference(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax(S * scale + mask) @ V from the inputs in the dtype, (r, d) (NaN for a row with no key),
    and (r, d) sum_j p_j |v_j|: the scale of O's accumulation error."""
    s = rows.q @ rows.k.transpose(-1, -2) * rows.scale
    if rows.fbias is not None:
        s = s + rows.fbias
    if rows.masked is not None:
        s = s.masked_fill(rows.masked, float("-inf"))
    p = torch.softmax(s, dim=-1)
    dv = rows.v.shape[-1]
    return (p @ rows.v).reshape(-1, dv), (p @ rows.v.abs()).reshape(-1, dv)


def in_units(o: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, dt: torch.dtype) -> float:
    """max |O - O64| / (u * sum_j p_j |v_j|) over the entries where both are finite, u the dtype's unit roundoff:
    a few for a path that rounds as the dtype allows, however O cancels; 0 where there is none."""
    fin = torch.isfinite(o) & torch.isfinite(ref) & (mag > 0)
    if not fin.any():
        return 0.0
    return float(((o.double() - ref).abs()[fin] / (mag[fin] * 2.0 ** -(MANTISSA[dt] + 1))).max())


def dense_bias(rows: Rows, dt: torch.dtype) -> torch.Tensor | None:
    """(n, tq, tk) the additive mask in the dtype as PyTorch passes it to a kernel that takes one (a boolean
    mask as 0/-inf), causal included; None without a mask."""
    if rows.masked is None and rows.fbias is None:
        return None
    base = torch.zeros(rows.masked.shape if rows.fbias is None else rows.fbias.shape, dtype=torch.float64)
    if rows.fbias is not None:
        base = rows.fbias.clone()
    if rows.masked is not None:
        base = base.masked_fill(rows.masked, float("-inf"))
    return base.to(dt)


@dataclass
class PathResult:
    out: torch.Tensor  # (r, dv) in the dtype
    lse: torch.Tensor | None  # (r,) float32
    events: dict  # name -> (r,) bool
    extra: dict  # path-specific figures (tiles)


def run_path(mod, c: Case, x: Inputs, rows: Rows, capability: tuple[int, int] | None) -> PathResult:
    """The path's kernel on the case's rows, on the CPU."""
    dt = c.dtype
    if mod in (fa2, fa2_fma):
        tile = fa2.tile_n(c.d, capability, c.mask == "causal", torch_copy=mod is fa2)
        bias = dense_bias(rows, dt)
        bias = None if bias is None else bias.float().reshape(-1, c.tk)
        r = fa2.kernel_rows(
            rows.q, rows.k, rows.v, scale=rows.scale, dt=dt, block_n=tile, fused=mod is fa2_fma, bias=bias
        )
        return PathResult(r.out, r.lse, r.events, {"block_n": tile})
    if mod is fa3:  # the mask as fa2 takes it (top left, a given mask as -inf / float): against float64
        return fa3_rows(c, rows, dense_bias(rows, dt))
    if mod is mem_efficient:
        _, bn, rf = mem_efficient.tiles(c.d, c.d, capability)
        if x.causal:  # the kernel's own causal mask, after the bias
            r = mem_efficient.kernel_rows(
                rows.q, rows.k, rows.v, scale=rows.scale, dt=dt, masked=rows.masked, capability=capability
            )
        else:
            r = mem_efficient.kernel_rows(
                rows.q, rows.k, rows.v, scale=rows.scale, dt=dt, bias=dense_bias(rows, dt), capability=capability
            )
        return PathResult(r.out, r.lse, r.events, {"block_n": bn, "in_registers": rf})
    if mod is cudnn:
        explicit = c.mask in ("bool", "float")
        r = cudnn.kernel_rows(
            rows.q,
            rows.k,
            rows.v,
            scale=rows.scale,
            bias=dense_bias(rows, dt),
            dt=dt,
            explicit_mask=explicit,
            capability=capability,
        )
        return PathResult(r.out, r.lse, r.events, {"block_n": cudnn.KEY_TILE})
    # flash (the CPU kernel) and sdpa-math have no kernel_rows: their forward on the case as one block
    from attncheck.numerics.inputs.scores import (
        prepare_inputs,
        score_blocks,
        start_audit,
    )
    from attncheck.numerics.methods.softmax import MethodParams

    mask = x.keep if x.keep is not None else x.fmask
    inp = prepare_inputs(x.q, x.k, mask, causal=x.causal, v=x.v)
    (blk,) = list(score_blocks(inp, 1 << 40, torch.device("cpu"), start_audit(inp)))
    pb = mod.forward(blk, dt, ["torch"], MethodParams())
    return PathResult(pb.cells[0][1].out, None, {}, {})


def fa3_rows(c: Case, rows: Rows, bias: torch.Tensor | None) -> PathResult:
    """fa3's kernel on the case's rows with ``bias`` ((n, tq, tk) in the dtype, -inf masked) or None."""
    causal = c.mask == "causal" and c.tq > 1  # FlashAttention-3 drops causal for one query (flash_api.cpp)
    tile = fa3.tile_n(c.d, causal=causal)
    b = None if bias is None else bias.float().reshape(-1, c.tk)
    r = fa3.kernel_rows(rows.q, rows.k, rows.v, scale=rows.scale, dt=c.dtype, block_n=tile, bias=b)
    return PathResult(r.out, r.lse, r.events, {"block_n": tile})


def bottom_right_causal(c: Case, n: int) -> torch.Tensor:
    """(n, tq, tk) in the dtype: FlashAttention-3's causal mask, key j of query i kept for j <= i + Tk - Tq."""
    i, j = torch.arange(c.tq)[:, None], torch.arange(c.tk)[None, :]
    keep = j <= i + c.tk - c.tq
    return torch.zeros(c.tq, c.tk).masked_fill(~keep, float("-inf")).to(c.dtype).expand(n, c.tq, c.tk)


def fa3_interface(cuda: bool):
    """(flash_attn_interface, None) where FlashAttention-3 can run here, else (None, why not)."""
    if not cuda:
        return None, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return None, f"sm{major}{minor}: FlashAttention-3's kernels run on Hopper (sm90) only"
    try:
        import flash_attn_interface
    except Exception as e:  # noqa: BLE001  any failure to import is the reason printed
        return None, (
            f"flash_attn_interface does not import ({type(e).__name__}: {str(e)[:200]}): FlashAttention-3 is "
            "built from the flash-attn repository's hopper/ directory and is not in this image"
        )
    return flash_attn_interface, None


def fa3_figures(iface, c: Case, x: Inputs, rows: Rows, mag: torch.Tensor, ref: torch.Tensor, dev, capability) -> dict:
    """FlashAttention-3 on one case against fa3's emulation (its own causal mask, no split)."""
    why = fa3.PATH.why_not(facts(c, capability))
    fig = {"path": fa3.PATH.name, "path_why_not": why}
    if x.keep is not None or x.fmask is not None:
        fig.update(status="refused", refusal_agrees_with_path=why is not None)
        fig["torch_reason"] = "FlashAttention-3 takes no attention mask"
        return fig
    q, k, v = (t.to(dev).transpose(1, 2).contiguous() for t in (x.q, x.k, x.v))  # (b, t, h, d)
    try:
        with torch.no_grad():
            res = iface.flash_attn_func(q, k, v, causal=x.causal, num_splits=1, return_attn_probs=True)
        _sync(dev)
    except Exception as e:  # noqa: BLE001  a refusal or failure is a figure
        fig.update(status="refused", refusal_agrees_with_path=why is not None)
        fig["torch_reason"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return fig
    o, lse = (res[0], res[1]) if isinstance(res, tuple) else (res, None)
    o = o.transpose(1, 2).reshape(-1, c.d).cpu()
    lse = None if lse is None else lse.float().reshape(-1).cpu()
    n = rows.q.shape[0]
    p = fa3_rows(c, rows, bottom_right_causal(c, n) if x.causal else None)
    fig.update(status="ran", refusal_agrees_with_path=why is None or (x.causal and c.tq != c.tk))
    fig.update(compare(o, lse, p, c.dtype))
    fig["max_err_u"] = in_units(o, p.out.double(), mag, c.dtype)
    if not (x.causal and c.tq != c.tk):  # the float64 reference has the top-left mask
        fin = torch.isfinite(ref) & torch.isfinite(o)
        e = ulps(o[fin], ref.to(c.dtype)[fin], c.dtype)
        fig["gpu_max_err_vs_float64_ulp"] = float(e.max()) if e.numel() else 0.0
        fig["gpu_max_err_vs_float64_u"] = in_units(o, ref, mag, c.dtype)
    return fig


def ulps(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """|a - b| in ulps of ``dt`` at |b| (float64), over a and b of the same shape."""
    fi = torch.finfo(dt)
    mag = b.double().abs().clamp_min(fi.tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA[dt])
    return (a.double() - b.double()).abs() / ulp


def finite_max(t: torch.Tensor) -> float | None:
    t = t[torch.isfinite(t)]
    return None if t.numel() == 0 else float(t.max())


def compare(o: torch.Tensor, lse: torch.Tensor | None, p: PathResult, dt: torch.dtype) -> dict:
    """A backend's output (r, dv) in dt and LSE (r,) (CPU) against the path's."""
    both_nan = torch.isnan(o) & torch.isnan(p.out)
    same = (o == p.out) | both_nan
    fin = torch.isfinite(o) & torch.isfinite(p.out)
    err = ulps(o[fin], p.out[fin], dt)
    res = {
        "identical_pct": 100.0 * float(same.double().mean()),
        "max_err_ulp": float(err.max()) if err.numel() else 0.0,
        "nan_pattern_equal": bool(
            torch.equal(torch.isnan(o), torch.isnan(p.out))
            and torch.equal(torch.isposinf(o), torch.isposinf(p.out))
            and torch.equal(torch.isneginf(o), torch.isneginf(p.out))
        ),
        "nan_gpu": int(torch.isnan(o).sum()),
        "nan_path": int(torch.isnan(p.out).sum()),
        "lse_max_diff": None,
        "lse_inf_pattern_equal": None,
    }
    if lse is not None and p.lse is not None:
        lp = p.lse.float()
        both = torch.isfinite(lse) & torch.isfinite(lp)
        res["lse_max_diff"] = float((lse[both].double() - lp[both].double()).abs().max()) if both.any() else 0.0
        res["lse_inf_pattern_equal"] = bool(
            torch.equal(torch.isfinite(lse), torch.isfinite(lp))
            and torch.equal(lse[~torch.isfinite(lse)], lp[~torch.isfinite(lp)])
        )
    return res


def facts(c: Case, capability: tuple[int, int] | None) -> CallFacts:
    mask = {"bool": "explicit", "float": "explicit", "causal": "causal"}.get(c.mask, "none")
    return CallFacts(
        dtype=c.dt, head_dim=c.d, head_dim_v=c.d, tq=c.tq, tk=c.tk, mask=mask, capability=capability, gqa=c.hq != c.hkv
    )


def path_for(backend: str):
    """The path module standing for this SDPA backend on CUDA (its PATH.stands_for)."""
    impl = backend.lower()
    for mod in PATH_MODULES:
        if any(s.matches("sdpa", impl, "cuda") and s.impl and s.device and not s.fallback for s in mod.PATH.stands_for):
            return mod
    raise LookupError(f"no path stands for sdpa {impl} on cuda")


def emulate(
    c: Case, x: Inputs, rows: Rows, ref: torch.Tensor, mag: torch.Tensor, capability
) -> tuple[dict, dict, bool]:
    """Every path on the case: (results by path name, figures by path name, whether all are sound)."""
    results, figures, sound = {}, {}, True
    ref_fin = torch.isfinite(ref)
    for mod in PATH_MODULES:
        name = mod.PATH.name
        t0 = time.perf_counter()
        try:
            p = run_path(mod, c, x, rows, capability)
        except Exception as e:  # noqa: BLE001  an emulation that crashes is what this mode exists to catch
            figures[name] = {"error": f"{type(e).__name__}: {e}"}
            sound = False
            continue
        ms = 1000 * (time.perf_counter() - t0)
        results[name] = p
        flagged = torch.zeros(ref.shape[0], dtype=torch.bool)
        for ev in p.events.values():
            flagged |= ev.reshape(-1)
        bad = (~torch.isfinite(p.out) & ref_fin).any(dim=-1)  # a row non-finite where float64 is finite
        unexplained = bad & ~flagged
        err = ulps(p.out[ref_fin & torch.isfinite(p.out)], ref.to(c.dtype)[ref_fin & torch.isfinite(p.out)], c.dtype)
        figures[name] = {
            "ms": round(ms, 2),
            "why_not": mod.PATH.why_not(facts(c, capability)),
            "finite_where_reference_is": not bool(bad.any()),
            "nonfinite_rows_explained_by_events": int((bad & flagged).sum()),
            "nonfinite_rows_unexplained": int(unexplained.sum()),
            "events": {k: int(v.sum()) for k, v in p.events.items()},
            "event_rows": int(flagged.sum()),
            "max_err_vs_float64_ulp": float(err.max()) if err.numel() else 0.0,
            "max_err_vs_float64_u": in_units(p.out, ref, mag, c.dtype),
            **p.extra,
        }
        if unexplained.any():
            sound = False
    return results, figures, sound


# ---- the GPU side -----------------------------------------------------------------------------------------


def _expand_kv(c: Case, t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(c.hq // c.hkv, dim=1) if c.hq != c.hkv else t


def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """The bias in memory whose rows are multiples of 16 elements long (as SDPA's ``preprocess_mask`` pads it)."""
    tk = bias.shape[-1]
    pad = -tk % 16
    if not pad:
        return bias.contiguous()
    full = torch.zeros(*bias.shape[:-1], tk + pad, dtype=bias.dtype, device=bias.device)
    full[..., :tk] = bias
    return full[..., :tk]


def backend_lse(backend: str, c: Case, q, k, v, bias) -> tuple[torch.Tensor | None, torch.Tensor | None, str | None]:
    """(O, LSE (1, hq, tq) float32, error) from the backend's aten op (kv heads expanded: it takes no enable_gqa)."""
    aten = torch.ops.aten
    k, v = _expand_kv(c, k), _expand_kv(c, v)
    try:
        if backend == "FLASH_ATTENTION" and q.device.type == "cpu":  # --device cpu: the CPU flash kernel's op
            res = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, c.mask == "causal", attn_mask=bias)
        elif backend == "FLASH_ATTENTION":
            res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c.mask == "causal")
        elif backend == "EFFICIENT_ATTENTION":
            b = None if bias is None else _aligned_bias(bias)
            res = aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, c.mask == "causal")
        else:
            b = None if bias is None else _aligned_bias(bias)
            res = aten._scaled_dot_product_cudnn_attention(q, k, v, b, True, 0.0, c.mask == "causal", False)
    except Exception as e:  # noqa: BLE001  the op's refusal is a figure, not a crash
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    lse = res[1].float().reshape(1, c.hq, -1)[..., : c.tq]  # efficient pads the queries to a multiple of 32
    return res[0], lse, None


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_backend(backend: str, c: Case, x: Inputs, dev: torch.device) -> dict:
    """The backend alone on the case: status, torch's reason for a refusal, O and LSE on the CPU."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(dev) for t in (x.q, x.k, x.v))
    mask = x.sdpa_mask()
    mask = None if mask is None else mask.to(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)), torch.no_grad():
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=x.causal, enable_gqa=c.hq != c.hkv
                )
            _sync(dev)
        except Exception as e:  # noqa: BLE001  torch warns each reason, then raises RuntimeError 'No available kernel'
            first = str(e).splitlines()[0] if str(e) else ""
            reasons = [str(w.message) for w in caught] + [f"{type(e).__name__}: {first}"]
            status = "refused" if isinstance(e, RuntimeError) else "error"
            return {"status": status, "reason": " | ".join(r.strip() for r in reasons)[:1000]}
    bias = mask  # for the ops: a boolean mask as SDPA converts it, 0 / -inf in the dtype
    if mask is not None and mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=c.dtype, device=dev).masked_fill(~mask, float("-inf"))
    with torch.no_grad():
        o_op, lse, op_err = backend_lse(backend, c, q, k, v, bias)
    _sync(dev)
    res = {
        "status": "ran",
        "out": o[0].reshape(-1, c.d).cpu(),
        "lse": None if lse is None else lse.reshape(-1).cpu(),
        "op_error": op_err,
    }
    res["op_out_identical"] = None if o_op is None else bool(torch.equal(torch.nan_to_num(o_op), torch.nan_to_num(o)))
    if c.backward:
        res["backward"] = run_backward(backend, c, x, dev)
    return res


def run_backward(backend: str, c: Case, x: Inputs, dev: torch.device) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(dev, copy=True).requires_grad_(True) for t in (x.q, x.k, x.v))  # never the case's own tensors
    mask = x.sdpa_mask()
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask.to(dev), is_causal=x.causal, enable_gqa=c.hq != c.hkv
            )
            o.backward(x.do.to(dev))
        _sync(dev)
    except Exception as e:  # noqa: BLE001  a backward the backend refuses or breaks on is a figure
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {f"{n}_nonfinite": int((~torch.isfinite(t.grad)).sum()) for n, t in (("dq", q), ("dk", k), ("dv", v))}


def predicted_backward(backend_mod, results: dict) -> dict:
    """What the paths predict for the backward: NaN only under cudnn, in dQ of the key form's rows and in
    dK, dV for the query form's."""
    if backend_mod is not cudnn or "cudnn" not in results:
        return {"nan_dq_rows": 0, "nan_dkdv": False}
    ev = results["cudnn"].events
    return {"nan_dq_rows": int(ev["padded_key_tile"].sum()), "nan_dkdv": bool(ev["padded_query_tile"].any())}


def backend_figures(
    backend: str,
    mod,
    c: Case,
    x: Inputs,
    ref: torch.Tensor,
    mag: torch.Tensor,
    results: dict,
    figures: dict,
    capability,
    dev: torch.device,
) -> dict:
    """One backend on one case against its path's results: every figure of the JSON's ``backends`` entry."""
    why = mod.PATH.why_not(facts(c, capability))
    b = run_backend(backend, c, x, dev)
    fig = {
        "path": mod.PATH.name,
        "path_why_not": why,
        "status": b["status"],
        "refusal_agrees_with_path": (b["status"] == "refused") == (why is not None),
    }
    if b["status"] != "ran":
        fig["torch_reason"] = b["reason"]
    elif mod.PATH.name in results:
        fig.update(compare(b["out"], b["lse"], results[mod.PATH.name], c.dtype))
        # the same difference over u * sum_j p_j |v_j| (float64): O's rounding scale, where ulps at |O| blow up
        # on entries that cancel to near 0
        fig["max_err_u"] = in_units(b["out"], results[mod.PATH.name].out.double(), mag, c.dtype)
        fig["op_error"], fig["op_out_identical"] = b["op_error"], b["op_out_identical"]
        ref_fin = torch.isfinite(ref)
        fin = ref_fin & torch.isfinite(b["out"])
        e = ulps(b["out"][fin], ref.to(c.dtype)[fin], c.dtype)
        fig["gpu_max_err_vs_float64_ulp"] = float(e.max()) if e.numel() else 0.0
        fig["gpu_max_err_vs_float64_u"] = in_units(b["out"], ref, mag, c.dtype)
        fig["path_max_err_vs_float64_u"] = figures[mod.PATH.name]["max_err_vs_float64_u"]
        if "backward" in b:
            fig["backward"] = b["backward"]
            fig["backward_predicted"] = pred = predicted_backward(mod, results)
            bw = b["backward"]
            if "error" not in bw:
                seen = bw["dq_nonfinite"] > 0 or bw["dk_nonfinite"] > 0 or bw["dv_nonfinite"] > 0
                fig["backward_nan_as_predicted"] = seen == (pred["nan_dq_rows"] > 0 or pred["nan_dkdv"])
    return fig


# ---- the table ----------------------------------------------------------------------------------------------

COLUMNS = (
    "case",
    "backend",
    "dtype",
    "d",
    "Tq",
    "Tk",
    "status",
    "ident %",
    "max err ulp",
    "err/u.sum|pv|",
    "LSE max diff",
    "NaN eq",
)
CPU_COLUMNS = ("case", "path", "dtype", "d", "Tq", "Tk", "status", "err vs f64 (u)", "event rows", "finite as f64")


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.3g}" if v != int(v) or abs(v) >= 1e6 else str(int(v))
    return str(v)


def table(rows: list[tuple], columns: tuple[str, ...]) -> str:
    cells = [columns] + [tuple(fmt(v) for v in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(s.ljust(w) for s, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--json", default=None, help="where to write every figure (default $OUT/gpu_kernels.json or ./gpu_kernels.json)"
    )
    ap.add_argument("--quick", action="store_true", help="a reduced grid (bf16, d 64, the repros)")
    ap.add_argument("--cpu-only", action="store_true", help="the emulations alone, checked against float64; no GPU")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=270.0,
        help="seconds after which the cases not yet begun are skipped (listed in the JSON; default 270)",
    )
    # The backends on another device: 'cpu' runs the GPU side's plumbing against PyTorch's CPU kernels (its flash
    # kernel, which is not fa2; the others refuse): a smoke test of the script, not a figure of any GPU kernel.
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out_path = Path(args.json or os.path.join(os.environ.get("OUT") or ".", "gpu_kernels.json"))
    t_start = time.perf_counter()
    gpu = not args.cpu_only
    cuda = gpu and args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device; run with --cpu-only for the emulations alone", file=sys.stderr)
        return 2
    dev = torch.device(args.device) if gpu else None
    capability = torch.cuda.get_device_capability() if cuda else None
    fa3_iface, fa3_why = fa3_interface(cuda)
    if fa3_iface is None:
        print(f"gpu_kernels: FlashAttention-3 skipped: {fa3_why}", file=sys.stderr)
    meta = {
        "mode": "cpu-only" if args.cpu_only else f"backends on {args.device}",
        "quick": args.quick,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": capability,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "threads": torch.get_num_threads(),
        "attncheck": str(Path(sys.modules["attncheck"].__file__).parent),
        "fa3_skipped": fa3_why,
    }
    records, table_rows, sound = [], [], True
    t_emulation = 0.0
    skipped = []
    for c in grid(args.quick):
        if time.perf_counter() - t_start > args.time_limit:  # a lent GPU's time is short: keep what was measured
            skipped.append(c.label)
            continue
        x = make_inputs(c)
        rows = as_rows(c, x)
        ref, mag = reference(rows)
        t0 = time.perf_counter()
        results, figures, ok = emulate(c, x, rows, ref, mag, capability)
        t_emulation += time.perf_counter() - t0
        sound &= ok
        rec = {**asdict(c), "label": c.label, "paths": figures, "backends": {}}
        if not gpu:
            for name, f in figures.items():
                err = f.get("max_err_vs_float64_u")
                finite = f.get("finite_where_reference_is")
                if finite is False and not f["nonfinite_rows_unexplained"]:
                    finite = "no: events"  # NaN/inf only on the rows the path's own hazard event names
                table_rows.append(
                    (
                        c.name,
                        name,
                        c.dt,
                        c.d,
                        c.tq,
                        c.tk,
                        "error" if "error" in f else "emulated",
                        err,
                        f.get("event_rows"),
                        finite,
                    )
                )
        for backend in (*BACKENDS, *((FA3_BACKEND,) if fa3_iface is not None else ())) if gpu else ():
            mod = fa3 if backend == FA3_BACKEND else path_for(backend)
            try:
                if backend == FA3_BACKEND:
                    fig = fa3_figures(fa3_iface, c, x, rows, mag, ref, dev, capability)
                else:
                    fig = backend_figures(backend, mod, c, x, ref, mag, results, figures, capability, dev)
            except Exception as e:  # noqa: BLE001  one case's failure must not lose the others' figures
                fig = {
                    "path": mod.PATH.name,
                    "status": "error",
                    "refusal_agrees_with_path": False,
                    "torch_reason": f"{type(e).__name__}: {e}"[:500],
                }
            rec["backends"][backend] = fig
            status = fig["status"] if fig["refusal_agrees_with_path"] else fig["status"] + "!"
            if "backward_nan_as_predicted" in fig:
                status += " bw:" + ("ok" if fig["backward_nan_as_predicted"] else "MISS")
            table_rows.append(
                (
                    c.name,
                    f"{backend.split('_')[0].lower()}({mod.PATH.name})",
                    c.dt,
                    c.d,
                    c.tq,
                    c.tk,
                    status,
                    fig.get("identical_pct"),
                    fig.get("max_err_ulp"),
                    fig.get("max_err_u"),
                    fig.get("lse_max_diff"),
                    fig.get("nan_pattern_equal"),
                )
            )
        records.append(rec)
    meta["emulation_s"] = round(t_emulation, 2)
    meta["total_s"] = round(time.perf_counter() - t_start, 2)
    meta["emulations_sound"] = sound
    meta["skipped_past_time_limit"] = skipped
    # what a GPU machine's bare image lacks: none of it may be needed (checked by tests/benchmarks)
    meta["imported_outside_the_image"] = sorted(m for m in ("msgspec", "typer", "rich") if m in sys.modules)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "cases": records}, indent=1))
    if skipped:
        print(f"gpu_kernels: {len(skipped)} cases skipped past --time-limit {args.time_limit:g} s", file=sys.stderr)
    print(
        f"{len(records)} cases, emulation {meta['emulation_s']} s, total {meta['total_s']} s on {meta['device']}; "
        f"figures in {out_path}"
    )
    if gpu:
        print(
            "status: 'refused!'/'ran!' where torch and the path's why_not disagree; bw: the backward's NaN against "
            "cudnn's padded_tile prediction; max err |O_gpu - O_path| in ulps of the dtype at |O_path| (the paths "
            "state no bound) and over u sum_j p_j |v_j| (u the dtype's unit roundoff, p and v float64)"
        )
    print(table(table_rows, COLUMNS if gpu else CPU_COLUMNS))
    if not sound:
        print(
            "gpu_kernels: an emulation crashed or gave NaN/inf where float64 is finite (see the JSON)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
