"""``fa2-fma``: FlashAttention-2's CUDA forward as the flash-attn package ships it: the kernel of
``attncheck.numerics.paths.fa2`` (same commit, same rounding points) with the exponent fused,
``exp2f(fma(x, scale_log2, -max_scaled))`` (``softmax.h:88`` at
Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced; ``UNFUSE_FMA`` unset): one rounding
instead of two. At a row's max the exponent is ``x*scale_log2 - round(x*scale_log2)``, not 0; where
``max_scaled`` reaches 2^31 that residue can exceed 128, exp2 overflows, the sum is inf and O is NaN
(PyTorch issue 121558: bf16 Q, K, V all 133120); in fp16 P overflows the dtype from 2^28 (the residue
above 16). This is the cell's limit (its headroom): |S scale| from 2^e / log2 e, e the least exponent
where half an fp32 ulp of ``max_scaled`` can pass the exponent exp2's result or P's dtype holds (from
``torch.finfo``: fp32 and bf16 2^31, about 1.49e9; fp16 2^28, about 1.86e8). ``kernel_rows`` emulates the
package's softcap (tanh assumed correctly rounded); a captured soft-capped call is not judged yet (its
float64 reference has no cap), nor are its sliding window and split-KV.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attncheck.numerics.paths import fa2
from attncheck.numerics.paths.base import CallFacts, PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock


def forward(block: QKBlock, dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    return fa2.run(block, dt, PATH.name, fused=True)


def limit(dt: torch.dtype, params: MethodParams | None = None) -> tuple[str, float, str]:
    """The cell's limit on |S scale|: (kind, threshold, what) where the fused exponent can first break
    (see the module docstring), from the dtypes' rounding limits."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import rounding_limit

    room = min(math.log2(rounding_limit(torch.float32)), math.log2(rounding_limit(dt)))
    e = math.ceil(math.log2(2 * room / torch.finfo(torch.float32).eps))
    threshold = 2.0**e / math.log2(math.e)
    return (
        "fused_max",
        threshold,
        f"the fused exponent at the row max (half an fp32 ulp of m scale log2e) can "
        f"overflow from |S scale| >= {threshold:.4g} (|m scale log2e| >= 2^{e})",
    )


def supports(facts: CallFacts) -> str | None:
    """Why the flash-attn package's FlashAttention-2 (``flash_api.cpp`` ``mha_fwd``) would not run this
    call as emulated here, or None. Head dims not a multiple of 8 are padded by the package's Python
    interface (zeros: the same scores)."""
    why = fa2._common(facts, "flash_attn_func")
    if why:
        return why
    if facts.window is not None:
        return "a sliding window: the kernel's local mask is not emulated"
    return None


PATH = PathSpec(
    name="fa2-fma",
    summary="FlashAttention-2's CUDA forward as the flash-attn package ships it: fa2 with the exponent fused, "
    "exp2f(fma(x, scale*log2e, -max*scale*log2e)): at the row max not 0, so large scores overflow exp2",
    impl="attncheck.numerics.paths.fa2_fma:forward",
    kernel="FlashAttention-2's CUDA forward (fused exponent)",
    scores_in="fp32 registers (tensor-core accumulator)",
    probs_in="fp32",
    default=False,
    device="cuda",
    source=fa2.SOURCE.split(";")[0],
    assumed=fa2.ASSUMED,
    stands_for=(Stands("flash_attn", "fa2"),),
    supports="attncheck.numerics.paths.fa2_fma:supports",
    limit="attncheck.numerics.paths.fa2_fma:limit",
    replay=True,
    backward="recompute",  # FlashAttention-2's backward as on CUDA: fp32 sums, each gradient rounded once
    row_local=True,
)
