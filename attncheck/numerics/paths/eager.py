"""**eager** (`eager:naive`, `eager:stable`, `eager:torch`): hand-written attention, as Hugging
Face's `eager` implementation and most user code compute it. Q and K cast to the dtype, S = Q@K^T
by torch's matmul in the dtype (float32 accumulation, rounded to the dtype), the scale applied to
the scores (or to q first) and the mask added in the dtype (`QKBlock.in_dtype`), the chosen
softmax, P in the dtype, O = P@V by torch's matmul in the dtype. The same torch ops as user code,
so the same bits on the same device.

Tested by: `tests/numerics/methods/test_paths.py::test_eager_is_hand_written_attention`.
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
    "eager",
    "hand-written attention (HF eager): Q@K^T rounded to the dtype, scale and mask in the dtype, "
    "the chosen softmax, P@V in the dtype",
    f"{__name__}:forward",
    runs_methods=True,
    scores="dtype",
    probs_in="the dtype",
    backward="eager",
    stands_for=(Stands("qk"),),
    row_local=True,
)


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts; and the registry imports
    # this module as it loads, so its METHODS from the top would be a cycle
    from attncheck.numerics.paths.common import PathBlock, matmul_rows
    from attncheck.numerics.precision import cast
    from attncheck.registry import METHODS

    xc, before, after = block.in_dtype(dt)  # (r, Tk) scores in dt
    v = None if block.v is None else cast(block.v, dt)
    cells = []
    for name in methods:
        out = METHODS.get(name).function()(xc, params)
        if v is not None:  # P in the dtype (as .to(value.dtype) leaves it), torch's matmul in the dtype
            out.out = matmul_rows(out.probs.to(dt), v)
        cells.append((name, out))
    return PathBlock(xc, before, after, cells)
