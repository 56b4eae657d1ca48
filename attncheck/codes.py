"""The finding codes: one registry entry per code with everything said about it anywhere.

Each ``Code`` holds its severity, the NaN/zero-row causes it stands for, and the text of its
reference page: what it means, the threshold or formula behind it, a minimal example that
triggers it (tests run every example) and its fix. Every layer reads this registry (findings,
the model report, ``--ignore`` and ``--fail-on``, ``attncheck explain``, the JSON's ``doc``
links), and ``docs/reference/findings.md`` is generated from it. Free of torch; imports nothing
of the package but the results' constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncheck.results import REAL_BOUND_TOLERANCE, UNEXPLAINED

SEVERITIES = ("error", "warning", "info")

# Where each code's reference page is, relative to the project; the site serves it at
# reference/findings/#CODE.
REFERENCE_PAGE = "docs/reference/findings.md"


@dataclass(frozen=True)
class Example:
    """A minimal input that triggers a code. ``python`` writes input files into the current
    directory and ``command`` diagnoses them (its ``--fail-on CODE`` exits 1 because the code is
    reported); or, without a command, ``python`` runs attncheck as a library and leaves the
    diagnosis in ``result``."""

    python: str
    command: str = ""


@dataclass(frozen=True)
class Code:
    name: str
    severity: str  # the usual severity; ``severity_note`` says when it differs
    group: str  # the section of the reference page
    summary: str  # one line
    meaning: str
    threshold: str
    fix: str
    example: Example
    severity_note: str = ""  # when it takes the other severity, ``also``
    also: str = ""
    causes: tuple[str, ...] = ()  # first causes of NaN/zero rows it stands for (--ignore leaves those rows out)
    grad_causes: tuple[str, ...] = ()  # first causes of NaN/inf gradient rows it stands for

    @property
    def severities(self) -> str:
        """'error', or 'error or warning' for a code whose severity follows its effect."""
        return f"{self.severity} or {self.also}" if self.also else self.severity

    @property
    def doc(self) -> str:
        return f"{REFERENCE_PAGE}#{self.name}"


GROUPS = {
    "input": "The scores as given",
    "mask": "Masks and scale (from Q and K)",
    "softmax": "Casts and the softmax",
    "accuracy": "Accuracy",
    "output": "The output O = P@V",
    "fp8": "FP8",
    "distribution": "The distribution",
    "backward": "The backward pass",
    "watch": "Watching a training run (attncheck watch)",
    "capture": "The capture itself",
}

_TORCH = "import torch\n\n"
_SEEDED = _TORCH + "g = torch.Generator().manual_seed(0)\n"


def _scores(body: str) -> str:
    return "import numpy as np\n\n" + body


def _watch_log(logit: str, limit: float = 3.4e38, nonfinite: str = "0") -> str:
    """A watch log of 40 steps whose one head's largest logit is ``logit`` (a Python expression of step)."""
    return f"""\
import json

with open("w.jsonl", "w") as fh:
    for step in range(1, 41):
        call = {{"module": "layers.0.attn", "kind": "sdpa", "dtype": "fp32", "path": "flash", "heads": 1,
                "max_logit": [{logit}], "collapsed": [0.0], "nonfinite_rows": {nonfinite}, "scale": 0.125,
                "limit": {{"logit": {limit!r}, "what": "S = Q@K^T"}}}}
        fh.write(json.dumps({{"schema": "attncheck.watch/1", "step": step, "calls": [call]}}) + "\\n")
"""


CODES: tuple[Code, ...] = (
    # ------------------------------------------------------------------ the scores as given
    Code(
        "input_nan",
        "error",
        "input",
        "a row of the scores holds NaN before any softmax runs",
        "Some rows of the scores as given already hold NaN. Every softmax of such a row is NaN, whatever the "
        "method or dtype, so the NaN comes from upstream: Q or K, the mask, an earlier layer, or the loss scale "
        "of a previous step. Its rows are counted under this cause first (pipeline order), so the softmax "
        "findings below it are about the other rows.",
        "Any NaN value in a row (`census.nan`, `nan_causes.input_nan` per cell).",
        "the NaN is already in the scores: trace it upstream (Q, K, the mask, an earlier layer); no softmax can repair "
        "it",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[1, 3] = np.nan  # a NaN that came from upstream
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on input_nan",
        ),
        causes=("input_nan",),
    ),
    Code(
        "inf_input",
        "error",
        "input",
        "a row of the scores holds +inf",
        "Some rows hold +inf in the scores as given. The softmax subtracts the row max (inf - inf = NaN) or "
        "divides inf by inf, so the row is NaN in every method. +inf usually means the scores overflowed before "
        "they were saved: Q@K^T in fp16 without the 1/sqrt(d_k) scale, or a growing logit.",
        "Any +inf value in a row. (-inf is a masked key, not an input error.)",
        "the scores hold +inf (softmax gives inf - inf = NaN): find where they overflow, e.g. Q@K^T in fp16 without "
        "1/sqrt(d_k); scale q first or compute scores in fp32",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[2, 5] = np.inf  # Q@K^T overflowed upstream
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on inf_input",
        ),
        causes=("inf_input",),
    ),
    Code(
        "fully_masked_rows",
        "warning",
        "input",
        "a query row has every key masked",
        "Every key of these rows is masked, so the row has no softmax: -inf everywhere gives 0/0 = NaN in "
        "naive, stable and torch.softmax; a finite sentinel (e.g. -1e9) gives a uniform row over the masked "
        "keys, which is garbage rather than attention; FlashAttention and PyTorch SDPA (>= 2.5) return zeros. "
        "The message says which cells return what. Left padding makes such rows on purpose: `--ignore "
        "fully_masked_rows` judges them expected.",
        "A key is masked when its score is -inf or at most -1e4; from Q and K, when the mask says so. A row "
        "counts when every key is masked.",
        "a query that may attend to nothing has no softmax: zero such rows (torch.where(keep.any(-1, keepdim=True), p, "
        "0)) and drop them from the loss, or use a kernel that returns zeros (FlashAttention, SDPA >= 2.5); even then "
        "their backward pass can poison gradients if a NaN reaches it",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[0] = -np.inf  # a query that may attend to no key (left padding)
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on fully_masked_rows",
        ),
        severity_note=(
            "warning where a cell turns the rows into NaN, else info (every cell gives zeros or a finite row, as "
            "SDPA's kernels do)"
        ),
        also="info",
        causes=("fully_masked",),
    ),
    # ------------------------------------------------------------------ masks and scale
    Code(
        "qk_overflow",
        "error",
        "mask",
        "S = Q@K^T rounds to inf in the dtype before the softmax",
        "The eager path (hand-written attention, Hugging Face's `eager`) holds S = Q@K^T in the dtype: the "
        "matmul accumulates in fp32 and rounds its result to the dtype, and a score beyond the dtype's range "
        "becomes inf. Its row is NaN in every softmax. The message gives max|q|, max|k|, max|q.k|, whether "
        "scaling q by the scale first (`--scale-order q`) would keep the scores in range, and, with paths, which "
        "implementations overflow (SDPA's math path and FlashAttention hold S in fp32).",
        "|q.k| >= the dtype's rounding limit, max + half an ulp (fp16: 65504 + 16 = 65520), for the product "
        "the path holds in the dtype: q.k before the scale, or (scale q).k with `--scale-order q`.",
        "scale q by 1/sqrt(d) before the matmul (--scale-order q shows the effect), compute Q@K^T in fp32, or find why "
        "q/k grew (no normalisation, exploding activations)",
        Example(
            _TORCH
            + """\
q = torch.full((1, 1, 4, 64), 40.0)  # q.k = 64 x 40 x 40 = 102400 > 65504
k = torch.full((1, 1, 4, 64), 40.0)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --dtype fp16 --method torch --brief --fail-on qk_overflow",
        ),
        causes=("qk_overflow",),
    ),
    Code(
        "softcap_overflow",
        "info",
        "mask",
        "S = Q@K^T rounds to inf before a soft cap, which hides it",
        "Soft-capped attention (Gemma-2's eager attention) computes cap x tanh(S x scale / cap) with every step "
        "in the scores' dtype, after S = Q@K^T is rounded to it. A score beyond the dtype's range is inf "
        "before the cap, and the cap turns it into exactly the cap: the logits stay finite, the softmax "
        "breaks nothing, and only S's headroom (the model report's `room`, measured before the cap) shows it. "
        "The severity is what the overflow does, asked of torch itself: info where tanh already rounds to 1 at "
        "the dtype's largest finite S, so the inf gives the same logit, and torch's backward through the cap "
        "gives 1 - tanh^2 = 0 there, the gradient of that saturated finite score (harmless forward and "
        "backward); warning where the cap does not saturate there (those logits become the cap instead of "
        "their true value); error where the backward through the cap gives NaN.",
        "|q.k| >= the dtype's rounding limit before the cap (fp16: 65520), on a call whose capture traced a "
        "tanh between Q@K^T and the softmax; saturation: cap x tanh(finfo.max x scale / cap) == cap in the dtype.",
        "harmless where it is info; else (or to keep the headroom) find why q/k grew so large, or compute Q@K^T "
        "in fp32 "
        "(bf16 or fp32 weights, or upcast q and k before the matmul)",
        Example(
            _SEEDED
            + """\
import attncheck


class SoftCapped(torch.nn.Module):  # as Gemma-2's eager attention
    def forward(self, q, k, v, cap=50.0):
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.0625
        s = torch.tanh(s / cap) * cap
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


q = torch.full((1, 1, 4, 32), 60.0, dtype=torch.float16)  # q.k = 32 x 60 x 60 = 115200 > 65504
k, v = q.clone(), torch.randn(1, 1, 4, 32, generator=g).half()
with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
    SoftCapped()(q, k, v)
result = cap.calls[0].diagnosis
"""
        ),
        severity_note="warning where the cap does not saturate at the dtype's largest S (the logits change); "
        "error where the backward through the cap gives NaN",
        also="warning",
    ),
    Code(
        "sentinel_overflow_on_add",
        "error",
        "mask",
        "adding the mask value to a negative score overflows to -inf",
        "A mask of finfo(dtype).min added to the scores leaves no room below it: a negative score plus the "
        "sentinel is beyond the dtype and rounds to -inf. Where that makes a whole row -inf, the row is NaN; "
        "where keys stay masked either way, nothing breaks yet, and the finding is a warning.",
        "sentinel + s rounds to -inf: sentinel + s <= -(rounding limit). With fp16's finfo.min (-65504), any "
        "score s <= -16.",
        "finfo(dtype).min plus a negative score overflows to -inf: use masked_fill / torch.where with the sentinel "
        "instead of adding it, or a boolean mask",
        Example(
            _TORCH
            + """\
q = torch.ones(1, 1, 4, 64)
k = torch.full((1, 1, 4, 64), -3.0)  # every score is -3 x 64 / sqrt(64) = -24
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value min --dtype fp16 --method torch --brief "
            "--fail-on sentinel_overflow_on_add",
        ),
        severity_note="error where rows became all -inf (NaN); warning where the keys stay masked",
        also="warning",
        causes=("mask_sentinel",),
    ),
    Code(
        "summed_mask_planes",
        "error",
        "mask",
        "two finfo.min mask planes were added together and overflowed",
        "Combining a causal mask and a padding mask by adding two planes of finfo(dtype).min gives -inf where "
        "both mask a key (-65504 + -65504 overflows fp16). A row that both planes mask everywhere is all -inf "
        "and NaN; otherwise the keys stay masked and the finding is a warning. Found in the Q/K pipeline, or "
        "in a float mask that holds -inf next to finite sentinels beyond half its dtype's range.",
        "sentinel_1 + sentinel_2 <= -(rounding limit), e.g. 2 x finfo(fp16).min = -131008 in fp16.",
        "two sentinel planes added together overflow: combine masks with logical and/or (or torch.where), then apply "
        "one sentinel once",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
low = torch.finfo(torch.float16).min
causal = torch.triu(torch.full((4, 4), low), diagonal=1)  # future keys
padding = torch.zeros(4, 4)
padding[:, :2] = low  # two padded keys
torch.save({"q": q, "k": k, "mask": (causal + padding).half()}, "qk.pt")  # -65504 + -65504 = -inf
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --mask qk.pt:mask --dtype fp16 --method torch --brief --fail-on "
            "summed_mask_planes",
        ),
        severity_note="error where rows became all -inf (NaN); warning where the keys stay masked",
        also="warning",
        causes=("mask_sentinel",),
    ),
    Code(
        "mask_leak",
        "warning",
        "mask",
        "masked keys still receive probability",
        "The mask value is too small in magnitude to mask: exp(sentinel - max) is not negligible, so the "
        "float64 softmax itself (no rounding involved) puts probability on keys that should get none.",
        "In float64, the probability on a row's masked keys exceeds 1e-6 (rows where not every key is masked).",
        "the masked keys still receive probability: use -inf, finfo(dtype).min or a boolean mask instead of this small "
        "sentinel",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value -10 --dtype fp32 --method torch --brief "
            "--fail-on mask_leak",
        ),
    ),
    Code(
        "float_mask_looks_boolean",
        "error",
        "mask",
        "a float mask of 0 and 1 is added to the scores",
        "The mask is a float tensor that holds only 0 and 1: a boolean mask converted with `.float()`. An "
        "additive mask adds +1 to the kept keys and masks nothing.",
        "A float mask whose every value is 0 or 1.",
        "a float mask of 0 and 1 is added to the scores, not applied: pass mask.bool() (True = attend) or an additive "
        "mask of 0 and -inf",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
keep = torch.ones(4, 4).tril()  # 1 = attend, as a float
torch.save({"q": q, "k": k, "mask": keep}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --mask qk.pt:mask --dtype fp32 --method torch --brief --fail-on "
            "float_mask_looks_boolean",
        ),
    ),
    Code(
        "missing_scale",
        "warning",
        "mask",
        "the scores are not scaled by 1/sqrt(d_k)",
        "The scale the scores carry is far above 1/sqrt(d_k): Var(q.k) grows as d_k, so unscaled logits "
        "collapse attention onto one key, kill the softmax gradient and overflow fp16 sooner. The scale is the "
        "one applied (`--scale`), or with a scores file and `--q/--k` the one fitted by least squares. A scale "
        "the model chose itself is not this finding but `model_scale` (info).",
        "ratio = scale x sqrt(d_k) > d_k^(1/4), i.e. scale > d_k^(-1/4) (d_k >= 4). Judged from the scale, not "
        "from the spread of the scores, which low-rank q/k, outlier channels or RoPE move.",
        "the scores are not scaled by 1/sqrt(d_k): divide by sqrt(d_k) (SDPA's default scale), or check the scale your "
        "model applies",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 16, 64, generator=g), torch.randn(1, 1, 16, 64, generator=g)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --scale none --dtype fp32 --method torch --brief --fail-on "
            "missing_scale",
        ),
    ),
    Code(
        "double_scale",
        "warning",
        "mask",
        "the scores are scaled about twice by 1/sqrt(d_k)",
        "The scale the scores carry is near 1/d_k: q was divided by sqrt(d_k) and the scores again (or SDPA's "
        "default scale on pre-scaled q). Attention flattens towards uniform. A scale the model chose itself is "
        "not this finding but `model_scale` (info).",
        "ratio = scale x sqrt(d_k) < d_k^(-1/4), i.e. scale < d_k^(-3/4) (d_k >= 4).",
        "the scores are scaled about twice by 1/sqrt(d_k): apply it once (SDPA scales by default; don't pre-scale q as "
        "well)",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 16, 64, generator=g), torch.randn(1, 1, 16, 64, generator=g)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --scale dk --dtype fp32 --method torch --brief --fail-on "
            "double_scale",
        ),
    ),
    Code(
        "model_scale",
        "info",
        "mask",
        "the model applies its own scale, not 1/sqrt(d_k)",
        "A captured call whose scale the model chose itself: SDPA's `scale=` argument, the factor its code "
        "applies (traced by `attncheck capture` through multiplications, divisions and a soft cap), or the "
        "`scaling` attribute of its attention module. The model was trained with that scale, so it is a fact, "
        "not a fault: T5 passes scale=1 because it folds 1/sqrt(d_k) into its weights' initialisation; Gemma-2 "
        "scales by 1/sqrt(query_pre_attn_scalar) whatever its head size.",
        "Said where missing_scale or double_scale would be: ratio = scale x sqrt(d_k) > d_k^(1/4) or < d_k^(-1/4) "
        "(d_k >= 4), for a scale the model chose.",
        "nothing to change: the model was trained with this scale (dividing T5's scores by sqrt(d_k) would change "
        "the model); "
        "reproduce it exactly when porting the model to another kernel (SDPA's scale=)",
        Example(
            _SEEDED
            + """\
import torch.nn.functional as F

import attncheck


class T5Attention(torch.nn.Module):  # T5 folds 1/sqrt(d_k) into its weights' initialisation
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)


q, k, v = (torch.randn(1, 2, 8, 64, generator=g) / 8 for _ in range(3))
with attncheck.capture(diagnose=True) as cap:
    T5Attention()(q, k, v)
result = cap.calls[0].diagnosis
"""
        ),
    ),
    Code(
        "scale_mismatch",
        "warning",
        "mask",
        "the scale a scores file carries is not 1/sqrt(d_head)",
        "With a scores file and the q and k that made it, attncheck fits the scale that maps q.k onto the "
        "scores and names the closest usual choice: 1/sqrt(d_head), 1, 1/sqrt(d_model) = 1/sqrt(heads x "
        "d_head), 1/d_head. Dividing by sqrt(d_model) instead of sqrt(d_head) is the usual slip.",
        "The least-squares scale s; reported when the closest choice (in |ln(s / choice)|) is not 1/sqrt(d_head), "
        "or |ln(s sqrt(d_head))| > 0.05. Not reported where missing_scale or double_scale already is.",
        "the scale your scores carry is not 1/sqrt(d_head): check which dimension the model divides by",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 4, 16, 64, generator=g), torch.randn(1, 4, 16, 64, generator=g)
scores = q @ k.transpose(-1, -2) / (4 * 64) ** 0.5  # divided by sqrt(d_model), not sqrt(d_head)
torch.save({"q": q, "k": k, "scores": scores}, "qk.pt")
""",
            "attncheck run qk.pt --key scores --q qk.pt:q --k qk.pt:k --dtype fp32 --method torch --brief --fail-on "
            "scale_mismatch",
        ),
    ),
    # ------------------------------------------------------------------ casts and the softmax
    Code(
        "sentinel_not_representable",
        "warning",
        "softmax",
        "a mask value cannot be held by the dtype and becomes -inf",
        "A mask constant such as -1e9 (or finfo(fp32).min) is beyond the dtype's range: cast to fp16 or bf16 "
        "it becomes -inf. Partly masked rows stay masked; rows masked only by it become all -inf, which is "
        "NaN in naive, stable and torch.softmax. From scores alone, any value <= -1e4 that the cast turns into "
        "-inf is read as a sentinel; from Q and K, the mask's values and `--mask-value`.",
        "|sentinel| >= the dtype's rounding limit (fp16: 65520, so -1e9 and -65520 become -inf; -65504 stays).",
        "use a boolean mask (masked_fill(~keep, torch.finfo(dtype).min) or SDPA's bool attn_mask) instead of a "
        "constant the dtype cannot hold",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[:, 4:] = -1e9  # keys masked by adding -1e9
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method torch --brief --fail-on sentinel_not_representable",
        ),
        severity_note="error where rows became all -inf or NaN; warning where the keys stay masked",
        also="error",
        causes=("mask_sentinel",),
    ),
    Code(
        "cast_overflow",
        "error",
        "softmax",
        "casting the scores to the dtype turns finite values into +-inf",
        "Finite scores beyond the dtype's range become +-inf when cast: +inf makes its row NaN (inf - inf), "
        "-inf masks a key that was not masked. The cast rounds once to the nearest value of the dtype (float64 "
        "scores too).",
        "|x| >= the dtype's rounding limit: fp16 65520; bf16 and fp32 about 3.40e38.",
        "upcast to fp32 before the softmax, or keep the logits in range (scale by 1/sqrt(d_k), clamp)",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[3, 0] = 70000.0  # finite in fp32, beyond fp16's 65504
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method torch --brief --fail-on cast_overflow",
        ),
        causes=("cast_overflow",),
    ),
    Code(
        "exp_overflow",
        "error",
        "softmax",
        "exp of a finite score overflows to inf",
        "A softmax that takes exp(x) without subtracting the row max (the textbook `naive` one) overflows once "
        "a score passes ln(max): inf / inf makes the row NaN, or the other keys' probabilities 0. Methods that "
        "subtract the max never see an exp above 1.",
        "x > ln(rounding limit): fp16 11.09; bf16 and fp32 88.72 (in bf16 x itself rounds first: 88.5 stays, "
        "88.75 and above become 89 and overflow). Taken from torch.finfo, never typed in.",
        "subtract the row max before exp (stable softmax, torch.softmax), or upcast to fp32 before the softmax",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[0, 0] = 12.0  # exp(12) = 162755 > 65504
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method naive --brief --fail-on exp_overflow",
        ),
        causes=("exp_overflow",),
    ),
    Code(
        "fused_max",
        "error",
        "softmax",
        "the kernel's fused max subtraction overflows exp2",
        "FlashAttention-2 as the flash-attn package builds it (path `fa2-fma`) computes each exponent with one "
        "fused multiply-add, exp2f(fma(x, scale x log2e, -max_scaled)), where max_scaled = m x scale x log2e was "
        "rounded to fp32 beforehand. At the row max the exponent is then not 0 but the rounding residue of "
        "m x scale x log2e, up to half an fp32 ulp of it: for scores large enough that residue passes 128, exp2 "
        "overflows, the row sum is inf and O is NaN, although every score is finite and far inside fp32 "
        "(PyTorch issue 121558: bf16 Q, K, V all 133120 give NaN from the flash kernel and finite outputs from the "
        "efficient and math kernels). PyTorch builds its FlashAttention-2 with UNFUSE_FMA since then (path `fa2`: "
        "the product rounded, then the subtraction, so the exponent is <= 0 at every score, rounding being "
        "monotone). FlashAttention-4 (path `fa4`) has no unfused build: fma(x, scale x log2e, max_offset - "
        "max_scaled), the same residue. The message names the kernel, the largest score, half an ulp there and "
        "the threshold, and the paths computed that stay finite.",
        "Rows where an exp2 of a finite score is inf in fp32 or beyond the P dtype's range, or whose row sum is "
        "inf. It can happen once half an fp32 ulp of |m x scale x log2e| (2^(e-24) for a value in [2^e, 2^(e+1))) "
        "reaches log2 of the largest value exp2 may return: 128 for fp32's exp2 (127.997 for bf16's P; either way "
        "|m x scale x log2e| >= 2^31, "
        "|S x scale| >= 2^31 / log2e = 1.489e9), log2(65520) = 15.9996 for fp16's P (>= 2^28, |S x scale| >= "
        "1.861e8); the limits are torch.finfo's.",
        "run FlashAttention-2 unfused: PyTorch's flash backend (path fa2, built with UNFUSE_FMA), or the efficient or "
        "math backend instead of the flash-attn package; or keep |S x scale| below 2^31 / log2e = 1.49e9 (fp16: "
        "2^28 / log2e = 1.86e8), e.g. normalise q and k (qk-layernorm): scores that large mean q and k grew unchecked",
        Example(
            _TORCH
            + """\
from safetensors.torch import save_file

x = torch.full((1, 1, 1, 64), 133120.0, dtype=torch.bfloat16)  # PyTorch issue 121558: every element 133120
save_file({"q": x, "k": x.clone(), "v": x.clone()}, "qk.safetensors")
""",
            "attncheck run qk.safetensors --path fa2-fma --dtype bf16 --fail-on fused_max",
        ),
        causes=("fused_max",),
    ),
    Code(
        "sum_overflow",
        "error",
        "softmax",
        "every exp is finite but the row sum overflows",
        "Each exp fits the dtype but their sum does not: dividing by inf gives an all-zero row (or NaN where an "
        "exp is inf too). With the row max subtracted the sum is at most the number of keys, so it overflows "
        "only with more keys than the dtype's max (fp16: 65520 keys).",
        "sum_j exp(x_j) >= the rounding limit with every exp(x_j) finite: fp16 65520, e.g. 100 keys of 7.0 "
        "(100 x 1097 = 109663).",
        "the row sum exceeds the dtype's range: subtract the row max before exp (the sum is then at most the number of "
        "keys), or keep the sum and the division in fp32 (torch.softmax does)",
        Example(
            _scores("""\
np.save("scores.npy", np.full((4, 100), 7.0, dtype=np.float32))  # 100 x exp(7) = 109663 > 65504
"""),
            "attncheck run scores.npy --dtype fp16 --method naive --brief --fail-on sum_overflow",
        ),
        causes=("sum_overflow",),
    ),
    Code(
        "underflow",
        "error",
        "softmax",
        "every exp of a row flushes to 0, so the row is 0/0",
        "Without the row max subtracted, a row whose scores are all very negative has every exp round to 0: "
        "0/0 = NaN. Subtracting the max makes the largest term exp(0) = 1.",
        "Every score of the row below ln(smallest subnormal / 2): fp16 -17.33, bf16 -92.9, fp32 -103.97 "
        "(half the smallest subnormal rounds to even, i.e. to 0).",
        "subtract the row max before exp: then the largest term is exp(0) = 1 and the sum cannot be 0",
        Example(
            _scores("""\
np.save("scores.npy", np.full((4, 8), -20.0, dtype=np.float32))  # exp(-20) = 2e-9 flushes to 0 in fp16
"""),
            "attncheck run scores.npy --dtype fp16 --method naive --brief --fail-on underflow",
        ),
        causes=("underflow",),
    ),
    Code(
        "zero_rows",
        "error",
        "softmax",
        "rows come out all zero with no known cause",
        "A cell returned rows whose every probability is 0, and none of the known causes explains them (a "
        "fully masked row, a cast overflow, an exp or sum overflow; those are reported under their own codes). "
        "All-zero rows lose all attention: the layer passes zeros on.",
        "Rows of the cell whose every probability is exactly 0, less those attributed to fully_masked, "
        "cast_overflow, exp_overflow or sum_overflow.",
        "these rows lost all probability mass: subtract the row max and accumulate in fp32",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def drops_last_row(x, params):  # a kernel that never writes the last row of its tile
    p = torch.softmax(x.float(), dim=-1)
    p[..., -1, :] = 0
    return MethodOutput(p.to(x.dtype))


METHODS.register(MethodSpec("drops_last_row", "softmax whose last row stays 0", drops_last_row))
result = diagnose("scores", torch.randn(4, 8), Options(dtypes=("fp32",), methods=("drops_last_row",)))
print([f.code for f in result.findings])
"""),
    ),
    Code(
        "unexplained_nan",
        "error",
        "softmax",
        "NaN rows that no known cause explains",
        "A cell returned NaN rows, and none of the causes attncheck traces (NaN or +inf in the input, Q@K^T or "
        "cast overflow, a mask sentinel, a fully masked row, exp or sum overflow, underflow) holds for them. "
        "With the built-in methods this points at attncheck itself; with a method of your own, at that method.",
        "NaN rows of the cell left after attributing every known cause in pipeline order.",
        "NaN with no cause attributable by attncheck: please report it with the dump",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def bad_reciprocal(x, params):  # e / (sum - sum): a NaN no input explains
    e = torch.exp(x - x.amax(-1, keepdim=True))
    s = e.sum(-1, keepdim=True)
    return MethodOutput(e * (s - s) / (s - s))


METHODS.register(MethodSpec("bad_reciprocal", "softmax with a broken reciprocal", bad_reciprocal))
result = diagnose("scores", torch.randn(4, 8), Options(dtypes=("fp32",), methods=("bad_reciprocal",)))
print([f.code for f in result.findings])
"""),
        causes=(UNEXPLAINED,),
    ),
    # ------------------------------------------------------------------ accuracy
    Code(
        "argmax_flip",
        "warning",
        "accuracy",
        "the most likely key differs from float64's beyond what rounding explains",
        "In some rows the cell's top key is not float64's, and the two keys' scores are further apart than the "
        "cell's own rounding can account for. Near-ties within rounding are counted apart "
        "(`argmax_flips_near_tie`) and are not findings. The built-in methods round every probability of a row "
        "the same way, so a counted flip points at an implementation that reorders or corrupts keys, as in "
        "the example.",
        "With a the float64 top key and b the cell's (the first of ties), s the float64 scores and s' the "
        "scores as the cell computed them: s_a - s_b > |s'_a - s_a| + |s'_b - s_b| + 4u, u the unit roundoff "
        "of the cell's dtype.",
        "the most likely key changes against float64: upcast the softmax to fp32 where decisions depend on the top key",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def swapped(x, params):  # a softmax with a bug: keys 0 and 1 trade places
    p = torch.softmax(x.float(), dim=-1)
    return MethodOutput(p[..., [1, 0, *range(2, x.shape[-1])]].to(x.dtype))


METHODS.register(MethodSpec("swapped", "softmax with keys 0 and 1 swapped", swapped))
scores = torch.zeros(4, 8)
scores[:, 0] = 3.0  # key 0 first by a clear margin
result = diagnose("scores", scores, Options(dtypes=("fp32",), methods=("swapped",)))
print([f.code for f in result.findings])
"""),
    ),
    Code(
        "worse_than_torch",
        "info",
        "accuracy",
        "a kernel's error is above 2x torch.softmax's in the same dtype",
        "FlashAttention's tests hold a kernel to at most 2x the error of a plain PyTorch implementation in the "
        "same dtype. attncheck applies that rule to the methods that reproduce a kernel models run (`tiled`, "
        "and with `--q/--k` the `flash`, `flash-fp8` and `sage` paths against `eager:torch`, and any method "
        "registered with `kernel=`), comparing algorithmic errors: against float64 of the scores after the "
        "cast, so that the input's rounding does not hide the implementation's. A hand-written naive or stable "
        "softmax rounds three times where torch.softmax rounds once, so it is not held to the rule.",
        "max_abs_err_algo > 2 x torch's max_abs_err_algo in the same dtype, for cells whose verdict is ok.",
        "this kernel loses more accuracy than torch.softmax in the same dtype: keep the max and sum in fp32 and round "
        "only the result (smaller key blocks keep P_j closer to the final max)",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def bf16_inside(x, params):  # a kernel that rounds P through bf16 inside an fp16 cell
    p = torch.softmax(x.float(), dim=-1).bfloat16()
    return MethodOutput(p.to(x.dtype))


METHODS.register(MethodSpec("bf16_inside", "softmax rounded through bf16", bf16_inside, kernel="a fused kernel"))
scores = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
result = diagnose("scores", scores, Options(dtypes=("fp16",), methods=("bf16_inside", "torch")))
print([f.code for f in result.findings])
"""),
    ),
    # ------------------------------------------------------------------ the output
    Code(
        "output_error",
        "warning",
        "output",
        "an attention path's output is further from float64 than 2x PyTorch attention's",
        "With `--v`, every cell computes O = P@V. FlashAttention's test rule applied to O: a path's max error "
        "against float64 (P64 @ V64) may be at most 2x that of hand-written PyTorch attention with "
        "torch.softmax in the same dtype (`eager:torch`).",
        "max |O - O_float64| > 2 x eager:torch's in the same dtype, over rows where both are finite.",
        "this attention path's output is further from float64 than FlashAttention's test allows (2x the same-dtype "
        "PyTorch attention): keep S and the softmax in fp32 and round P only for P@V, or use SDPA",
        Example(
            _SEEDED
            + """\
q = torch.randn(1, 1, 32, 64, generator=g) * 0.1
k = torch.randn(1, 1, 4096, 64, generator=g) * 0.1  # long rows: 4096 keys
v = torch.randn(1, 1, 4096, 64, generator=g) + 3
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype fp16 --method stable,torch --accum dtype "
            "--path eager --brief --fail-on output_error",
        ),
    ),
    Code(
        "tied_max_bias",
        "warning",
        "output",
        "the rounding of O is biased in rows whose maximum is tied",
        "Where several keys share a row's largest score, exp(s - max) is exactly 1 at each of them and the "
        "rounding of O = P@V is biased, and a bias does not average out over steps (Qiu and Yao 2025, arXiv "
        "2510.04212: similar low-rank keys in bf16). attncheck counts such rows per path and tests their mean "
        "signed error, with the rows as samples.",
        "At least 16 tied rows, and their mean signed error of O (against float64 of the path's own scores "
        "and V as the dtype holds it) more than 4 standard errors from 0.",
        "a bias does not average out over steps (Qiu and Yao 2025, arXiv 2510.04212): when the row max repeats, "
        "subtract a slightly larger max (their fix: m = beta * max for a positive max) so that no exp(s - m) is "
        "exactly 1, or keep O in fp32 where the next layer reads it",
        Example(
            _SEEDED
            + """\
q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
k[..., 1:8, :] = k[..., :1, :]  # eight identical keys
q = q + 2 * k[..., :1, :]  # that every query prefers: each row's max is tied eight times
torch.save({"q": q, "k": k, "v": v + 1}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype bf16 --method torch --brief --fail-on "
            "tied_max_bias",
        ),
    ),
    Code(
        "probability_flush",
        "info",
        "accuracy",
        "small probabilities round to 0 in the dtype",
        "Probabilities that float64 says are non-zero become exactly 0 in the cell: they are below half the "
        "dtype's smallest subnormal. Harmless for most models; it matters where those keys carry meaning (long "
        "contexts, retrieval).",
        "1% or more of the probabilities float64 holds non-zero are exactly 0 in the cell (`flushed_frac`). "
        "FP8 cells whose P cast loses probability are reported as p_cast_underflow instead.",
        "small probabilities round to 0 in this dtype; harmless for most models, upcast if those keys matter",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[:, 0] = 20.0  # the other keys get exp(-20) = 2e-9: below fp16's smallest subnormal
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method torch --brief --fail-on probability_flush",
        ),
    ),
    # ------------------------------------------------------------------ FP8
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
        "fp8_accumulator",
        "warning",
        "fp8",
        "the FP8 tensor cores' reduced accumulator costs more than twice fp32 accumulation's error",
        "Hopper's (and Ada's) FP8 MMA keeps about 22 bits of its fp32 accumulator: after each 32-element step the "
        "low 10 mantissa bits are truncated (SageAttention 2; thu-ml/SageAttention issue 287; DeepSeek-V3 reports "
        "about 14 bits of each product). FlashAttention-3's FP8 forward accumulates P@V into O on the tensor cores "
        "over the whole key range, so at long key lengths O's small late additions are truncated away and O "
        "drifts toward zero. vLLM's fork (vllm-project/flash-attention PRs 104, 122; Dao-AILab/flash-attention "
        "PR 2250) adds the reduced accumulator to an fp32 one every N key blocks; SageAttention 2 does it every "
        "block. The cell's output is compared with the same kernel with fp32 accumulation and with flushes every "
        "1, 4 and 64 key blocks (vLLM PR 122 measured needle-in-a-haystack at 128k keys 0.89 / 0.88 / 0.856).",
        "An FP8 cell on the reduced accumulator (--fp8-accum, default the kernel's 13 bits) whose output RMSE "
        "against float64 exceeds 2x that of the same kernel with fp32 accumulation (FlashAttention's 2x rule).",
        "flush the FP8 accumulator into fp32 every few key blocks (vLLM's flash-attention fork: "
        "FLASH_ATTENTION_FP8_TWO_LEVEL_INTERVAL, 4 by default; --fp8-flush N shows the effect; the message names "
        "the longest interval of 1 / 4 / 64 that holds the 2x rule), or keep P@V in bf16 for long contexts",
        Example(
            _SEEDED
            + """q = torch.randn(1, 1, 16, 64, generator=g) * 0.3
k = torch.randn(1, 1, 8192, 64, generator=g) * 0.3
v = torch.randn(1, 1, 8192, 64, generator=g) + 20  # a large common component: O ~ 20 at every key length
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype e4m3 --path flash-fp8 --brief --fail-on "
            "fp8_accumulator",
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
        "Scaling none, and a value clipped, or 1% or more of a tensor's values subnormal or flushed in the format.",
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
    Code(
        "p_saturation",
        "warning",
        "fp8",
        "P exceeds its format's largest value before the cast (FlashAttention-4's max offset and lazy rescale)",
        "FlashAttention-4 (path `fa4`) keeps a row's max until it has grown by more than rescale_threshold log2 "
        "units, and in FP8 adds max_offset to every exponent so that P fills the format: P = 2^(x log2e - m log2e + "
        "max_offset) can reach 2^(max_offset + rescale_threshold). Above the format's largest value (e4m3: 448 = "
        "2^8.81; e5m2: 57344 = 2^15.81) the kernel's saturating cast (cvt.rn.satfinite) clips those probabilities "
        "while its fp32 row sum counts them in full, so the row's largest weights shrink in O and O shrinks toward "
        "0. flash-attention issue 2716: with the FP8 threshold 4 of PR 2694 and offset 8, P reached 2^12 = 4096 "
        "and decode cosine similarity against bf16 fell off a cliff at a tile boundary (issue 2577; PRs 2713, 2717: "
        "offset 4 for e4m3; PR 2731: FP8 threshold 0). The kernel's own defaults (FP8: threshold 0, offset 8; "
        "fp16/bf16: threshold 8, offset 0) cannot saturate: this shows for other values asked as a what-if. In "
        "fp16 (no saturating cast) a threshold above 15.99 turns P into inf and the row into NaN. The message "
        "gives the rows, the heads of the examples and the cell's output error.",
        "Rows where some P exceeds the format's largest value before the cast; possible once max_offset + "
        "rescale_threshold > log2(max) (e4m3 8.81, e5m2 15.81, fp16 15.999, the assertion of flash_fwd_sm100.py), in "
        "rows whose max grows between key blocks by more than log2(max) - max_offset and less than the threshold.",
        "keep max_offset + rescale_threshold below log2 of the format's largest value: lower the max offset (4 "
        "for e4m3, PR 2717) or the rescale threshold (0 for FP8, PR 2731, the current kernel's default), or run "
        "the call in bf16",
        Example(
            _SEEDED
            + """\
from attncheck import Options
from attncheck.judge import diagnose_attention
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.numerics.paths.fa4 import Fa4Setup

q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
inputs = prepare_inputs(q * 2, k, v=v)  # logits with a standard deviation of 2
setup = Fa4Setup(rescale_threshold=4.0, max_offset=8.0)  # PR 2694's FP8 threshold with the offset of 8
result = diagnose_attention("qkv", inputs, Options(dtypes=("e4m3",), paths=("fa4",), fa4=setup))
print([f.code for f in result.findings])
""",
        ),
        severity_note="error where P overflowed fp16 to inf (no saturating cast: those rows of O are NaN); "
        "warning where the FP8 cast saturated it (O shrinks)",
        also="error",
        causes=("p_saturation",),
    ),
    # ------------------------------------------------------------------ distribution
    Code(
        "entropy_collapse",
        "warning",
        "distribution",
        "attention is near one-hot in most rows",
        "Most rows of the float64 softmax put nearly all their probability on one key. Unscaled or growing "
        "logits do this; the softmax gradient then vanishes. A head meant to be sharp (a copy or induction "
        "head) is fine. `attncheck watch` raises the same code for a head whose sampled rows collapse during "
        "training.",
        "At least 50% of the rows put >= 0.99 of their probability on one key (the reference, float64); in a "
        "watch log, --collapse (half) of a head's sampled rows, at the first step it holds.",
        "attention is near one-hot: check the scores are scaled by 1/sqrt(d_k) and whether the logits grow during "
        "training (attncheck watch: logit_growth); ignore if the head is meant to be sharp",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[:, 0] = 10.0  # every row puts 99.9% on key 0
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on entropy_collapse",
        ),
    ),
    # ------------------------------------------------------------------ backward
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
        "1% or more of a gradient's entries that are non-zero in float64 are 0 (`flushed_frac`).",
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
        "padded_tile",
        "warning",
        "backward",
        "cuDNN's backward gives NaN gradients on this call (padded tile)",
        "A prediction for cuDNN's SDPA backward (PyTorch's CUDNN_ATTENTION backend, path `cudnn`), from its forward "
        "log-sum-exp. The backward recomputes P = exp(S - LSE) tile by tile; where a tile runs past the tensor's "
        "end its zero-filled entries are scored 0 instead of -inf, and in a row whose LSE is below -ln(FLT_MAX) = "
        "-88.72, exp(0 - LSE) overflows fp32 and inf x 0 gives NaN. Two published forms: the key tile (PyTorch "
        "issue 196678: an explicit attn_mask and a key length with Tk % 128 == 64, NaN in dQ of those rows; seen "
        "with cuDNN 9.20 on H100/H200, fixed in cuDNN 9.26, PyTorch PR 196861) and the query tile (cudnn-frontend "
        "issue 1072: Sq = 1, Sk = 128, no mask, NaN in dK and dV; cuDNN 9.25.1 and 9.26, open). The forward is "
        "finite; the gradients depend on the cuDNN version and the GPU (both were seen on sm90), so it is a warning. "
        "A q/k file cannot say whether its mask was a tensor or is_causal: a mask given counts as explicit. A row "
        "whose every open key scores below -88 is most often a mask bug (a row that should have been masked whole, "
        "or a sentinel added twice).",
        "Rows with a finite forward LSE and exp(-LSE) = inf in fp32 (LSE < -ln(finfo(fp32).max) = -88.72), in a "
        "call with an explicit mask and Tk % 128 == 64 (key form), or with Tq % 64 != 0 and Tk % 128 == 0 (query "
        "form); none on a recorded GPU other than sm90.",
        "key form: update cuDNN to 9.26 or later; either form (the query form has no fix yet): run another "
        "backend for this call "
        "(torch.backends.cuda.enable_cudnn_sdp(False), or torch.nn.attention.sdpa_kernel with the flash or "
        "efficient backend); and check the mask: a row whose open keys all score below -88 is usually a mask bug",
        Example(
            _TORCH
            + """\
import math

from safetensors.torch import save_file

g = torch.Generator().manual_seed(0)
L, D = 192, 64  # PyTorch issue 196678, small: 192 % 128 == 64 leaves the last key tile half padding
q, k = (torch.randn(1, 1, L, D, generator=g) * 0.1 for _ in range(2))
v = torch.randn(1, 1, L, D, generator=g)
q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)  # every logit about -120: every row's LSE below -88.72
mask = torch.ones(L, L, dtype=torch.bool).tril()  # an explicit mask tensor (True = attend)
save_file({"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), "mask": mask}, "qk.safetensors")
""",
            "attncheck run qk.safetensors --path cudnn --dtype bf16 --fail-on padded_tile",
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
    # ------------------------------------------------------------------ capture
    Code(
        "capture_incomplete",
        "warning",
        "capture",
        "the capture did not record every attention call the script made",
        "Recording stopped before the script ended (--max-bytes or --max-calls would have been passed, or a "
        "call could not be written), or the script failed: the calls judged are only those recorded, and "
        "nothing is known of the rest, where the problem may sit. The finding names the first call not "
        "recorded and why.",
        "Any call (or a call's gradients) not recorded once recording stopped, or a script that failed while "
        "captured; reported once per capture (per rank under torchrun).",
        "raise --max-bytes or --max-calls, or record fewer calls (--module, --forward, --no-grads); "
        "--ignore capture_incomplete where the first calls are enough",
        Example(
            """\
import torch
import torch.nn.functional as F

import attncheck

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))  # 12 KiB per call
with attncheck.capture("cap", max_bytes=40_000):  # room for three calls of four
    for layer in range(4):
        F.scaled_dot_product_attention(q, k, v)
""",
            "attncheck run cap --brief --fail-on capture_incomplete",
        ),
    ),
    # ------------------------------------------------------------------ watch
    Code(
        "logit_growth",
        "warning",
        "watch",
        "a head's largest attention logit grows geometrically past a level",
        "A watch log (attncheck.watch) records every head's largest unmasked logit per step. Its logarithm, "
        "fitted by least squares over the last records, grows fast, and the logit has passed a level healthy "
        "heads stay below: the attention-logit growth that precedes divergence at high learning rates "
        "(Dehghani et al. 2023; Wortsman et al. 2023, whose small-scale proxy examples/logit_growth.py "
        "reproduces).",
        "The fitted growth over the last --window records (20) is at least --growth (x2) per 100 steps, and "
        "the largest logit at least --logit-level (50); reported at the first step both hold.",
        "the attention logits grow geometrically, as before divergence at a high learning rate: normalise q and k "
        "(qk-layernorm, Dehghani et al. 2023; Wortsman et al. 2023), lower the learning rate or clip the logits "
        "(QK-clip, soft-capping)",
        Example(_watch_log("2.0 ** (step / 4)"), "attncheck watch w.jsonl --fail-on logit_growth"),
    ),
    Code(
        "headroom_low",
        "warning",
        "watch",
        "at its growth, a head reaches its dtype's first failure soon",
        "The head's largest logit grows and, at the fitted rate, reaches the largest logit the call's dtype "
        "allows (SDPA's kernels: S in fp32; hand-written attention: S = Q@K^T in its dtype, before the scale) "
        "within the horizon. With --what-if DTYPES, the same for hand-written attention in those dtypes, "
        "reported apart.",
        "Steps until the limit, ln(limit / logit) / (fitted growth per step), below --horizon (1000), once the "
        "logit has passed --logit-level (50) or the limit.",
        "at this growth the head's logits reach the first failure of its dtype within the horizon: act on the growth "
        "(qk-layernorm, learning rate, clipping) or hold the scores in a wider dtype",
        Example(
            _watch_log("60 * 1.05 ** step", limit=8190.0),
            "attncheck watch w.jsonl --horizon 200 --fail-on headroom_low",
        ),
    ),
    Code(
        "nonfinite",
        "error",
        "watch",
        "NaN or inf in a call's attention output or its gradients, during training",
        "A watch record counts, per attention call, the rows of its output holding NaN or inf (for eager "
        "softmax: NaN, +inf, or every key -inf in its scores) and the gradients of dq, dk, dv holding them.",
        "Any such row or gradient; reported at the first step it holds, per call, with its rank.",
        "NaN or inf in the attention output or its gradients: capture the step (attncheck capture, or "
        "attncheck.capture around it) to find the call, the head and the cause",
        Example(_watch_log("1.0", nonfinite="3 if step == 5 else 0"), "attncheck watch w.jsonl --fail-on nonfinite"),
    ),
    Code(
        "rank_divergence",
        "warning",
        "watch",
        "the same head's largest logit differs across ranks by a large factor",
        "Under torchrun each rank writes its own watch log. With DistributedDataParallel every rank holds the "
        "same weights, so a head's largest logit differs across ranks only as their batches differ, by far less "
        "than the factor. A head whose logit on one rank is many times another's means the ranks' weights have "
        "diverged (a change made on one rank after the wrap, parameters DDP does not synchronise, a broken "
        "all-reduce). Each rank's own trends are fitted apart: a rank that differs is never taken for growth. "
        "Where ranks hold different heads under one module name (tensor parallelism), the alert is expected: "
        "--ignore rank_divergence.",
        "At one step, max over ranks / min over ranks of the head's largest logit, magnitudes below 1 counted "
        "as 1, at least --rank-factor (10); reported at the first such step, on the rank with the larger logit, "
        "naming the other.",
        "the ranks' weights differ where DDP keeps them identical: check that nothing changes parameters on one rank "
        "after the wrap, that every parameter is registered before wrapping, and that the ranks start from the same "
        "weights; with tensor parallelism (other heads on each rank) ignore it",
        Example(
            """\
import json

for rank, logit in ((0, 1.4), (1, 1.0e4)):
    with open(f"w.rank{rank}.jsonl", "w") as fh:
        for step in range(1, 11):
            call = {"module": "layers.0.attn", "kind": "sdpa", "dtype": "fp32", "path": "flash", "heads": 1,
                    "max_logit": [logit], "collapsed": [0.0], "scale": 0.125, "limit": {"logit": 3.4e38, "what": "S"}}
            fh.write(json.dumps({"schema": "attncheck.watch/1", "step": step, "rank": rank, "world": 2, "calls": [call]}) + "\\n")
""",  # noqa: E501 - the example script's line, as the findings page shows it
            "attncheck watch w.rank0.jsonl w.rank1.jsonl --fail-on rank_divergence",
        ),
    ),
    Code(
        "no_attention",
        "error",
        "watch",
        "a watch log holds no attention call: nothing was watched",
        "attncheck.watch records the attention calls of the training forwards of the module it watches. A log "
        "without any call watched nothing: the module the training loop runs is not the one watched (and does "
        "not wrap it), the model ran in eval mode, or its calls were not seen (torch.compile'd code without "
        "compile='eager'). attncheck.watch warns at run time and writes a record with forwards 0 for a step "
        "that ended without a forward of the watched module; a log of such records is never 'no alert'.",
        "A rank's log with no call in any record.",
        "nothing was watched: watch the module the training loop calls, or the model inside a wrapper (DDP, FSDP, "
        "torch.compile and accelerate's wrappers are followed), train it in training mode, and pass compile='eager' "
        "for torch.compile'd code",
        Example(
            """\
import json

with open("w.jsonl", "w") as fh:
    for step in range(1, 4):
        fh.write(json.dumps({"schema": "attncheck.watch/1", "step": step, "forwards": 0, "calls": []}) + "\\n")
""",
            "attncheck watch w.jsonl --fail-on no_attention",
        ),
    ),
)

REGISTRY: dict[str, Code] = {c.name: c for c in CODES}

# The views every layer reads.
SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}
# The NaN/zero-row causes each finding code stands for: rows whose cause a user ignores
# no longer count for --fail-on nan/zero, nor for a call's verdict.
CAUSES_OF = {c.name: c.causes for c in CODES if c.causes}
# The first causes of NaN/inf gradient rows (results.GRAD_CAUSES) each backward finding code stands for.
GRAD_CAUSES_OF = {c.name: c.grad_causes for c in CODES if c.grad_causes}


FAIL_ON_WORDS = ("nan", "overflow", "zero", "flip", "error", "warning")
WHAT_IF_PREFIX = "what-if:"  # a --fail-on condition on the what-if cells: what-if:nan, what-if:exp_overflow, ...


def valid_fail_on(token: str) -> bool:
    token = token.removeprefix(WHAT_IF_PREFIX)
    return token in FAIL_ON_WORDS or token in SEVERITY


def valid_code(token: str) -> bool:
    """A finding code (what --ignore takes)."""
    return token in SEVERITY


def doc_link(code: str) -> str | None:
    """Where a code's reference page is: 'docs/reference/findings.md#exp_overflow'."""
    entry = REGISTRY.get(code)
    return None if entry is None else entry.doc


def closest_codes(token: str, n: int = 3) -> list[str]:
    """The codes nearest a mistyped one ('exp_overflw' -> exp_overflow), and those that contain it."""
    import difflib

    near = difflib.get_close_matches(token, list(REGISTRY), n=n, cutoff=0.6)
    near += [c for c in REGISTRY if token and token in c and c not in near]
    return near[:n]
