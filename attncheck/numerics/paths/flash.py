"""**flash**: the FlashAttention-2 forward as PyTorch's CPU flash kernel computes it
(`cpu_flash_attention` in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, torch 2.13). S = q @ k^T
in fp32 from q and k in the dtype, times the scale in fp32, plus the mask; then the probabilities
with exactly tiled's rounding points above, on the fp32 S (bit for bit: the test recomputes them
from this text with numpy): running max m and sum l in fp32, P_j = exp(S_j - m_j) rounded to the
dtype, a running max of -inf treated as 0, so fully masked rows give zeros; O = P_eff @ V in fp32,
rounded to the dtype once. This is the kernel's algorithm, but not its bits: the kernel takes exp
with its vectorised fp32 routine, a few fp32 ulp from the correctly rounded value, and accumulates O
block by block with a running rescale. Its vectorised exp returns 0 for arguments below about -87
(measured -86.99 on an AVX2 build of torch 2.13; the last keys of a row that fill no vector go
through the scalar exp, which keeps float32's subnormals), where exp rounded once to float32 gives a
value down to 2^-149. So the cell and the kernel agree per element within

    |O - O_kernel| <= ulp_dtype(|O|) + ((2d + T + 64) u_fp32 + 2 u_dtype) sum_j p_j |v_j|
                      + sum over keys j with S_j - max S < -86 of p_j |v_j|

(u the unit roundoff, d the head dimension, T the keys; 2 u_dtype only below fp32). The last
term is the mass of the keys whose exp the kernel may flush, at most T e^-86 max|v| (about
T 4.5e-38 max|v|); without it the bound fails where O is made of such keys alone. A wrong scale,
mask, rescale or rounding point breaks the bound by orders of magnitude. P is rounded to the
dtype where the kernel rounds it: with V the identity, O is the kernel's P, and the cell's P is
within 2 ulp of it everywhere and equal to it on at least 90% of the entries, where the same
recurrence without that rounding is equal on at most 80% (fp16 and bf16). It judges the SDPA calls
made on a CPU (and, where a capture names no backend, every SDPA call without dropout).

Tested by: `tests/numerics/methods/test_paths.py::test_flash_cell_is_the_online_softmax_written_out`,
`tests/numerics/methods/test_paths.py::test_flash_matches_pytorchs_cpu_flash_kernel_within_its_bound`,
`tests/numerics/methods/test_paths.py::test_flash_bound_holds_where_the_kernel_flushes_exps_to_zero`,
`tests/numerics/methods/test_paths.py::test_flash_rounds_p_where_the_kernel_does`,
`tests/numerics/methods/test_tiled_kernel.py::test_flash_online_softmax_of_fp32_scores_is_the_torch_implementation_bit_for_bit`.
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
    "flash",
    "FlashAttention-2 forward as PyTorch's CPU flash kernel computes it: S in fp32, online softmax over "
    "key blocks, P rounded to the dtype before P@V, O in fp32 divided by l at the end, zeros for fully masked rows",
    f"{__name__}:forward",
    aliases=("cpu-flash",),
    scores_in="fp32 registers",
    kernel="FlashAttention-2's forward",
    backward="recompute",
    replay=True,
    source="pytorch/pytorch v2.13.0 aten/src/ATen/native/cpu/FlashAttentionKernel.cpp",
    stands_for=(Stands("sdpa", "flash_attention", "cpu"), Stands("sdpa")),
    supports=f"{__name__}:supports",
    row_local=True,
)


def supports(facts: CallFacts) -> str | None:
    if facts.dropout > 0:
        return "dropout: PyTorch's CPU flash kernel takes none"
    if facts.dtype not in ("fp16", "bf16", "fp32"):
        return f"{facts.dtype}: the CPU flash kernel computes in fp16, bf16 and fp32"
    return None


def forward(block: "QKBlock", dt: "torch.dtype", methods: Sequence[str], params: "MethodParams") -> "PathBlock":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock, matmul_rows
    from attncheck.numerics.precision import cast

    s, before = block.fp32_scores(dt, PATH)  # (r, Tk) float32
    p = (params.online or _online)(s, dt, params.block, params.reverse)  # (r, Tk) effective probabilities, float32
    out = MethodOutput(p)
    if block.v is not None:  # O = P_eff @ V in fp32, rounded to the dtype once
        out.out = matmul_rows(p, cast(block.v, dt).float()).to(dt)
    return PathBlock(s, before, [], [(PATH.name, out)])


def _online(s: "torch.Tensor", p_dtype: "torch.dtype", block: int, reverse: bool = False) -> "torch.Tensor":
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.online import online_softmax

    return online_softmax(s, p_dtype, min(block, s.shape[-1]), reverse)
