"""**flex-math**: FlexAttention (`torch.nn.attention.flex_attention`) without torch.compile, as
torch 2.13 computes it (`math_attention` in torch/_higher_order_ops/flex_attention.py), for recorded
flex calls (and `--path` on Q/K files). It starts from flex's logits: S = q @ k^T in fp32 from q and
k upcast, times the scale in fp32, the `score_mod` applied in fp32 and keys the `mask_mod` masks set
to -inf (with a score_mod, the logits the capture recorded, computed by torch's own
`_math_attention_inner`; their float64 twin, from float64 q and k through the same score_mod, is the
reference); `_safe_softmax` in fp32 (a row with no key gives zeros), P cast to the dtype, O = P @ V
by torch's matmul in the dtype; bit for bit torch's own output. No backward cell.

Tested by: `tests/numerics/methods/test_flex_paths.py::test_flex_math_is_torchs_flex_attention_bit_for_bit`,
`tests/numerics/methods/test_flex_paths.py::test_the_recorded_float64_logits_are_the_score_mod_in_float64`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from attncheck.numerics.paths.base import CallFacts, PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

PATH = PathSpec(
    "flex-math",
    "FlexAttention without torch.compile: S in fp32, the score_mod and mask in fp32, _safe_softmax "
    "in fp32, P cast to the dtype, P@V in the dtype",
    f"{__name__}:forward",
    default=False,
    scores_in="fp32 (the score_mod applied in fp32)",
    probs_in="the dtype",
    logits=True,
    stands_for=(Stands("flex", "math"),),
    replay=True,
    replay_kinds=("flex",),
    supports=f"{__name__}:supports",
)


def supports(facts: CallFacts) -> str | None:
    return None if facts.flex else "not a flex_attention call (no score_mod or BlockMask to run)"


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock, matmul_rows, safe_softmax
    from attncheck.numerics.precision import cast

    s, before = block.fp32_scores(dt, PATH)  # (r, Tk) float32: the logits after flex's score_mod and mask
    p = safe_softmax(s).to(dt)  # P as flex's math path casts it, to the query's dtype
    out = MethodOutput(p)  # kept in the dtype, as the eager path's: the KL floor is the dtype's smallest subnormal
    if block.v is not None:
        out.out = matmul_rows(p, cast(block.v, dt))  # torch's matmul in the dtype
    return PathBlock(s, before, [], [(PATH.name, out)])
