"""**sdpa-math**: PyTorch's math backend of `scaled_dot_product_attention`, as torch 2.13 computes
it (`_scaled_dot_product_attention_math` in aten/src/ATen/native/transformers/attention.cpp):
fp16/bf16 q, k and v upcast to fp32 (unless `allow_fp16_bf16_reduction_math_sdp` is set), q and
k^T each times sqrt(scale), S = q @ k^T in fp32, the mask added (a boolean mask as 0/-inf),
`_safe_softmax` (a row whose every score is -inf gives zeros), O = P @ v in fp32 cast to the dtype.
Bit for bit the MATH backend's output and weights.

Tested by: `tests/numerics/methods/test_paths.py::test_sdpa_math_matches_the_math_backend_bit_for_bit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from attncheck.numerics.paths.base import PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

PATH = PathSpec(
    "sdpa-math",
    "PyTorch SDPA's math backend: fp16/bf16 upcast to fp32, q and k scaled by sqrt(scale) each, "
    "_safe_softmax (zeros for fully masked rows), O cast back to the dtype",
    f"{__name__}:forward",
    aliases=("math",),
    scores_in="fp32, from q and k each scaled by sqrt(scale)",
    scores="fp32-split",
    backward="math",
    replay=True,
    stands_for=(Stands("sdpa", "math"), Stands("sdpa", fallback=True)),
    row_local=True,
)


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock, matmul_rows, safe_softmax
    from attncheck.numerics.precision import cast

    s, before = block.fp32_scores(dt, PATH)  # (r, Tk) float32
    p = safe_softmax(s)
    out = MethodOutput(p)
    if block.v is not None:
        out.out = matmul_rows(p, cast(block.v, dt).float()).to(dt)
    return PathBlock(s, before, [], [(PATH.name, out)])
