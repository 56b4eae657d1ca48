"""**flex**: the fused kernel of torch.compile'd flex_attention as inductor builds it for a CPU in
torch 2.13 (`cpp_flex_attention_template.py`), in `attncheck.numerics.methods.flex`, on the same fp32
logits as **flex-math**: key blocks of the BlockMask's size (one block without a BlockMask), the
running max, `exp(s - m)` by the vectorised `exp_u20` on whole vectors of 8 keys (16 with AVX512)
and the C library's double `exp` on the block's last keys, P rounded once to the dtype (kept in fp32
for fp32), the block's sum as lane sums and a halving tree, `alpha = expf(m_old - m_new)`,
`l = t + alpha l` and `acc = alpha acc + P @ V` in fp32, O = acc (1/l) rounded once to the dtype,
zeros for rows with no key. On logits every summation order gives exactly, it is the compiled
kernel bit for bit (fp32, bf16, fp16, AVX2); on real logits the kernel's own q @ k^T and score_mod
move them by up to `flex_score_err`, and the two outputs agree per element within `flex_bound`: 0
where neither P's rounding nor the output's can go the other way, about one ulp of the output
elsewhere in bf16 and fp16, and a worst-case fp32 term (sums of unknown order) for fp32. The
diagnosis visits a row's key blocks in ascending order; the kernel visits a BlockMask's partial
blocks before its full ones, so with a BlockMask the cell is the kernel's to fp32 rounding, not bit
for bit. The CPU kernel returns no log-sum-exp (`return_lse` is refused on CPU); compiled flex has no
CPU backward in torch 2.13, so the flex paths have no backward cell.

Tested by: `tests/numerics/methods/test_flex.py::test_eager_bit_exact`,
`tests/numerics/methods/test_flex.py::test_float64_reference`,
`tests/numerics/methods/test_flex.py::test_compiled_within_bound`,
`tests/numerics/methods/test_flex.py::test_compiled_bit_exact_on_exact_logits`,
`tests/numerics/methods/test_flex.py::test_tile_order_is_the_block_masks`,
`tests/numerics/methods/test_flex_paths.py::test_the_flex_cell_of_a_recorded_compiled_call_is_the_kernel_within_its_bound`.
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
    "flex",
    "FlexAttention's fused kernel (torch.compile'd flex_attention): S in fp32, the score_mod and mask "
    "in fp32, online softmax over key blocks, O in fp32 then the dtype, zeros for rows with no key",
    f"{__name__}:forward",
    default=False,
    scores_in="fp32 (the score_mod applied in fp32)",
    kernel="FlexAttention's fused forward",
    logits=True,
    stands_for=(Stands("flex"),),
    replay=True,
    replay_kinds=("flex",),
    supports=f"{__name__}:supports",
)


def supports(facts: CallFacts) -> str | None:
    return None if facts.flex else "not a flex_attention call (no score_mod or BlockMask to run)"


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.flex import flex_kernel_rows
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock
    from attncheck.numerics.precision import cast

    s, before = block.fp32_scores(dt, PATH)  # (r, Tk) float32
    v = None if block.v is None else cast(block.v, dt)
    p, o = flex_kernel_rows(
        s, v, dt, block=block.inp.flex_block
    )  # effective probabilities (r, Tk) float32; O (r, dv) in dt
    out = MethodOutput(p)
    out.out = o
    return PathBlock(s, before, [], [(PATH.name, out)])
