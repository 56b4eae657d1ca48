"""The backward pass: NaN gradient rows by first cause, intermediates overflowing under the loss scale, gradients
flushing to 0, FlashAttention's 2x rule on the gradients, and the model's recorded gradients against the emulation.
(cuDNN's padded tiles are a kernel hazard: attncheck.findings.hazards.)"""

from __future__ import annotations

import math

from attncheck.findings.base import _SEEDED, Code, Example
from attncheck.format import num, pct
from attncheck.results import REAL_BOUND_TOLERANCE, Cell, Finding

GRAD_UNDERFLOW_WARN_FRAC = 0.01  # a gradient losing this share of its non-zero entries to 0 is a warning

CODES: tuple[Code, ...] = (
    Code(
        "grad_nan_masked_row",
        "error",
        "backward",
        "a fully masked query row makes the backward NaN",
        "A query row with every key masked by -inf has a NaN softmax, and its backward is NaN even when the "
        "row's output is zeroed or left out of the loss (PyTorch issue 41508). Where the mask is added to the "
        "scores, the NaN dS reaches dQ of the row and dK, dV of every key of the head; with masked_fill, dQ and "
        "dK stay finite and only dV takes it. A capture traces which the model did; for dumps, `--mask-op`.",
        "NaN/inf gradient rows whose first cause in backward order is a fully masked row.",
        "a query row with every key masked by -inf has a NaN softmax, and its backward is NaN even when the row's "
        "output is zeroed or left out of the loss: use SDPA (its kernels and _safe_softmax give such rows zeros and "
        "zero gradients), mask with a finite value (torch.finfo(dtype).min), or let padded queries attend to one key "
        "(e.g. themselves)",
        Example(
            _SEEDED
            + """\
q, k, v, do = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(4))
keep = torch.ones(16, 16, dtype=torch.bool).tril()
keep[3] = False  # query 3 may attend to no key
torch.save({"q": q, "k": k, "v": v, "do": do, "mask": keep}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --mask qkv.pt:mask --grad-out qkv.pt:do --dtype fp32 "
            "--path eager --method torch --brief --fail-on grad_nan_masked_row",
        ),
        grad_causes=("fully_masked",),
    ),
    Code(
        "grad_nan_input",
        "error",
        "backward",
        "the output gradient dO already holds NaN or inf",
        "The NaN or inf is in dO, the gradient that reaches attention from the layers after it: the loss or a "
        "later layer made it (an overflowing loss scale, a NaN loss). Attention's backward passes it on. The "
        "rows' first cause says which: `grad_out_nan` (a NaN in the row of dO) or `grad_out_inf` (an inf, no NaN).",
        "NaN/inf gradient rows whose first cause is a NaN (grad_out_nan) or an inf (grad_out_inf) in dO.",
        "the NaN or inf is already in the output gradient dO: it comes from a later layer or the loss; trace it "
        "downstream (a loss scale that overflows, a NaN loss)",
        Example(
            _SEEDED
            + """\
q, k, v, do = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(4))
do[0, 1, 5, 7] = float("nan")  # the loss sent back a NaN
torch.save({"q": q, "k": k, "v": v, "do": do}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --grad-out qkv.pt:do --dtype fp32 --brief --fail-on "
            "grad_nan_input",
        ),
        grad_causes=("grad_out_nan", "grad_out_inf"),
    ),
    Code(
        "grad_nan_forward",
        "error",
        "backward",
        "rows the forward pass already broke make NaN gradients",
        "The forward pass gave NaN probabilities in these rows (NaN or +inf in the input, Q@K^T overflow, or "
        "another forward NaN), and the backward carries them into dQ, dK, dV. Fix the forward finding, named in "
        "the message, and the gradients follow.",
        "NaN/inf gradient rows whose first cause in backward order is input_nan, inf_input, qk_overflow or "
        "another forward NaN.",
        "the forward pass already gave NaN probabilities in these rows; fix the forward finding (its cause is named) "
        "and the gradients follow",
        Example(
            _SEEDED
            + """\
q, k, v, do = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(4))
q[0, 0, 2] = 40.0
k[0, 0, 9] = 40.0  # one score of 64 x 40 x 40 = 102400: beyond fp16
torch.save({"q": q, "k": k, "v": v, "do": do}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --grad-out qkv.pt:do --dtype fp16 --path eager "
            "--method torch --brief --fail-on grad_nan_forward",
        ),
        grad_causes=("input_nan", "inf_input", "qk_overflow", "forward_nan"),
    ),
    Code(
        "grad_overflow",
        "error",
        "backward",
        "an intermediate of the backward overflows the dtype it is held in",
        "Every backward quantity is linear in dO, so a loss scale multiplies them all. Where the path holds one "
        "in a low-precision dtype (eager fp16 holds dP = dO V^T in fp16; the SDPA paths hold it in fp32), a "
        "large loss scale overflows it. The message gives the largest safe loss scale, relative to the one this "
        "dO carries.",
        "NaN/inf gradient rows first caused by dO beyond the dtype, dP or dS overflowing, inf - inf in dP - D, "
        "or a product beyond the dtype; or `scale_headroom` < 1: dO cannot grow by any factor before an "
        "intermediate overflows.",
        "lower the loss scale (GradScaler's init_scale, or let it back off), hold dP and dS in fp32 (SDPA's math path, "
        "FlashAttention) instead of fp16 eager attention, or train in bf16",
        Example(
            _SEEDED
            + """\
q, k, v, do = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(4))
torch.save({"q": q, "k": k, "v": v * 4, "do": do * 2**16}, "qkv.pt")  # dO under an fp16 loss scale of 2^16
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --grad-out qkv.pt:do --dtype fp16 --path eager "
            "--method torch --brief --fail-on grad_overflow",
        ),
        grad_causes=("grad_out_overflow", "dp_overflow", "ds_nan", "ds_overflow", "grad_overflow"),
    ),
    Code(
        "grad_underflow",
        "warning",
        "backward",
        "gradient entries flush to zero in the dtype",
        "Gradient entries that float64 says are non-zero are exactly 0 in the dtype the gradients are computed "
        "in: fp16 without a loss scale, or a collapsed softmax whose Jacobian vanishes.",
        f"{GRAD_UNDERFLOW_WARN_FRAC:.0%} or more of a gradient's entries that are non-zero in float64 are 0 "
        "(`flushed_frac`).",
        "gradient entries flush to zero in this dtype: use a loss scale (torch.amp.GradScaler) or bf16; if the softmax "
        "is collapsed (near one-hot rows), its Jacobian vanishes: check the scale and the logit growth",
        Example(
            _SEEDED
            + """\
q, k, v, do = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(4))
torch.save({"q": q, "k": k, "v": v, "do": do * 1e-6}, "qkv.pt")  # a mean loss over many tokens, no loss scale
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --grad-out qkv.pt:do --dtype fp16 --path eager "
            "--method torch --brief --fail-on grad_underflow",
        ),
    ),
    Code(
        "grad_error",
        "warning",
        "backward",
        "a path's gradients are further from float64 than FlashAttention's test allows",
        "FlashAttention's tests hold the backward to at most 2x the error of plain attention in the same dtype "
        "(eager, softmax in the dtype, no upcast), plus two ulps of the largest gradient; they apply it in fp16 "
        "and bf16 (in fp32 both errors are rounding noise). On a CPU, PyTorch's flash backward keeps the sums "
        "of dQ over key blocks and of dK, dV over query blocks in the dtype, rounded after each block, which "
        "the example shows with a constant dO.",
        "max |g - g_float64| > 2 x plain attention's + 2 ulp(max|g_float64|) (twice the dtype's spacing there), "
        "for dQ, dK or dV, in fp16 and bf16.",
        "this path's gradients are further from float64 than FlashAttention's test allows (2x plain attention in the "
        "same dtype): keep dP and dS in fp32 and round only for the products, as FlashAttention does",
        Example(
            _SEEDED
            + """\
q = torch.zeros(1, 1, 4096, 8)  # every score 0: P = 1/16 exactly
k, v = (torch.randn(1, 1, 16, 8, generator=g) for _ in range(2))
do = torch.full((1, 1, 4096, 8), 1.8125)  # dV sums 4096 equal terms, block by block in bf16
torch.save({n: t.bfloat16() for n, t in dict(q=q, k=k, v=v, do=do).items()}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --grad-out qkv.pt:do --dtype bf16 --path flash "
            "--brief --fail-on grad_error",
        ),
    ),
    Code(
        "grad_emulation_mismatch",
        "error",
        "backward",
        "the model's recorded gradients differ from attncheck's emulation of its kernel",
        "`attncheck capture` records the gradients the model's kernel really produced, and each is compared "
        "with the backward of the cell the model runs. A disagreement means the backward numbers of that call "
        "cannot be trusted: attncheck does not reproduce this kernel (please report it), or the recorded "
        f"gradients are not the kernel's (a hook changed them). Within {REAL_BOUND_TOLERANCE:g}x of the bound it is an "
        "info: a kernel "
        "summing in another order can come near the bound, and the numbers stand.",
        "Per element, |real - cell| above the rounding bound derived from the kernel's (docs/reference/numerics.md, "
        "the backward pass: the dot products of S, dP and D in any order, the forward's exp_u20, the sums kept "
        f"in the dtype), more than {REAL_BOUND_TOLERANCE:g}x (REAL_BOUND_TOLERANCE), or an entry finite in one and not "
        "the other.",
        "attncheck's emulation of this kernel's backward does not reproduce the gradients the model really produced: "
        "the backward numbers of this call cannot be trusted; please report it with the capture",
        Example(
            """\
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import attncheck

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 32, generator=g).requires_grad_() for _ in range(3))
with attncheck.capture("cap"):
    F.scaled_dot_product_attention(q, k, v).sum().backward()
# Stand in for a kernel whose backward attncheck does not reproduce: its dQ 1% off.
grads = next(Path("cap").glob("*.grads.safetensors"))
with safe_open(grads, "pt") as f:
    tensors, meta = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
tensors["grad_q"] = tensors["grad_q"] * 1.01
save_file(tensors, grads, meta)
""",
            "attncheck run cap --brief --fail-on grad_emulation_mismatch",
        ),
        severity_note=f"info where every entry is finite in both and within {REAL_BOUND_TOLERANCE:g}x of the bound",
        also="info",
    ),
)

# This group's views of its codes (attncheck.findings.registry joins every group's, and imports this module)
SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}
GRAD_CAUSES_OF = {c.name: c.grad_causes for c in CODES if c.grad_causes}


def _grad_rows(b) -> str:
    """'dq 3 row(s), dk 48, dv 48' for the gradients that hold NaN/inf rows."""
    parts = [f"{name} {g.nan_rows}" for name, g in b.grads() if g.nan_rows]
    return (parts[0] + " row(s)" + (", " + ", ".join(parts[1:]) if parts[1:] else "")) if parts else "none"


def _with_cause(b, causes: tuple[str, ...]) -> int:
    return sum(n for _, g in b.grads() for c, n in g.causes.items() if c in causes)


def _power_of_two(x: float) -> str:
    return f"2^{math.floor(math.log2(x))}" if x > 0 and math.isfinite(x) else "n/a"


def backward_findings(cells: list[Cell]) -> list[Finding]:
    """Findings of the backward of each cell that has one: NaN gradient rows by first cause, overflow
    under the loss scale, flushed gradients, FlashAttention's 2x rule, and the model's recorded
    gradients against the model's cell."""
    out: list[Finding] = []

    def add(code: str, cell: Cell, message: str, rows: int = 0, examples=(), severity: str | None = None) -> None:
        out.append(
            Finding(
                code,
                severity or SEVERITY[code],
                f"{cell.name} backward: {message}",
                FIX[code],
                [cell.name],
                rows,
                list(examples),
            )
        )

    for c in cells:
        b = c.backward
        if b is None:
            continue
        examples = next((g.examples for _, g in b.grads() if g.examples), [])
        _grad_nan_findings(add, c, b, examples)
        _grad_accuracy_findings(add, c, b)
    return out


def _grad_nan_findings(add, c: Cell, b, examples) -> None:
    """grad_nan_masked_row, grad_nan_input, grad_nan_forward, grad_overflow: NaN/inf gradient rows by first cause,
    and an intermediate that overflows under the loss scale."""
    masked = _with_cause(b, GRAD_CAUSES_OF["grad_nan_masked_row"])
    if masked:
        how = (
            "the mask is added to the scores, so the NaN dS reaches dQ of the row and dK of every key"
            if "added" in b.how
            else "masked_fill zeroes dS at the filled keys, so dQ and dK stay finite, but dV = P^T dO takes the NaN row"
        )
        add(
            "grad_nan_masked_row",
            c,
            "query rows with every key masked by -inf have a NaN softmax, and the backward spreads it: NaN in "
            f"{_grad_rows(b)} ({how})",
            masked,
            examples,
        )
    if _with_cause(b, GRAD_CAUSES_OF["grad_nan_input"]):
        add(
            "grad_nan_input",
            c,
            f"the output gradient dO already holds NaN or inf in {b.dout_nan_rows} row(s): NaN in {_grad_rows(b)}",
            b.dout_nan_rows,
            examples,
        )
    spread = _with_cause(b, GRAD_CAUSES_OF["grad_nan_forward"])
    if spread:
        which = sorted(
            {cause for _, g in b.grads() for cause in g.causes if cause in GRAD_CAUSES_OF["grad_nan_forward"]}
        )
        add(
            "grad_nan_forward",
            c,
            f"rows the forward pass already broke ({', '.join(which)}) make NaN gradients: {_grad_rows(b)}",
            spread,
            examples,
        )
    over = _with_cause(b, GRAD_CAUSES_OF["grad_overflow"])
    if over or (b.scale_headroom is not None and b.scale_headroom < 1):
        stage = b.headroom_at or "an intermediate"
        factor = b.scale_headroom
        safe = (
            (
                f"; the backward stays finite for dO up to {num(factor)}x this one ({_power_of_two(factor)}): the "
                "largest safe loss scale is "
                f"{_power_of_two(factor)} times the one this dO carries"
            )
            if factor
            else ""
        )
        add("grad_overflow", c, f"{stage} overflows ({_grad_rows(b)} hold NaN or inf){safe}", over, examples)


def _grad_accuracy_findings(add, c: Cell, b) -> None:
    """grad_underflow, grad_error, grad_emulation_mismatch: finite gradients that flush, that break
    FlashAttention's rule, or that differ from the model's recorded ones."""
    flushed = [
        (name, g.flushed_frac)
        for name, g in b.grads()
        if g.flushed_frac is not None and g.flushed_frac >= GRAD_UNDERFLOW_WARN_FRAC
    ]
    if flushed:
        add(
            "grad_underflow",
            c,
            "gradient entries that are non-zero in float64 are exactly 0 in "
            + (b.dtype or c.dtype)
            + ": "
            + ", ".join(f"{name} {pct(f)}" for name, f in flushed),
        )
    broken = [(name, g) for name, g in b.grads() if g.rule_holds is False]
    if broken:
        add(
            "grad_error",
            c,
            "max |g - g_float64| above 2x plain attention's in "
            + (b.dtype or c.dtype)
            + " (eager, softmax in the dtype): "
            + ", ".join(f"{name} {num(g.max_abs_err)} > {num(g.rule_bound)}" for name, g in broken),
        )
    disagree = [(name, g) for name, g in b.grads() if g.real_agrees is False]
    if disagree:
        near = all(g.real_near for _, g in disagree)
        add(
            "grad_emulation_mismatch",
            c,
            "the model's recorded gradients differ from this cell's beyond its rounding bound: "
            + ", ".join(
                f"{name} max |real - cell| {num(g.real_max_diff)} ({num(g.real_bound_ratio)}x the bound"
                + (f", {g.real_nan_mismatch} entries finite in one and not the other" if g.real_nan_mismatch else "")
                + ")"
                for name, g in disagree
            )
            + (
                f"; within {REAL_BOUND_TOLERANCE:g}x of it, which a kernel summing in another order can reach: "
                "the numbers stand"
                if near
                else ""
            ),
            severity="info" if near else None,
        )
