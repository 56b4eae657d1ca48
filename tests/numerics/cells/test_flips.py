"""A top-1 flip counts only where the cell's own rounding cannot explain it (accumulate.real_flips): exact ties
and near-ties are near-ties; a flip against a clear gap is counted. The bound is computed here from
the scores and the dtype's unit roundoff, independently of the accumulator."""

import torch

from attncheck import METHODS, MethodSpec, Options
from attncheck.judge import diagnose
from attncheck.numerics.cells.accumulate import FLIP_UNITS, real_flips
from attncheck.numerics.methods.softmax import MethodOutput


def test_the_rule_on_exact_ties_near_ties_and_clear_gaps():
    x = torch.tensor(
        [
            [2.0, 2.0, 0.0],  # an exact tie: no order to keep
            [2.0, 2.0 - 2e-4, 0.0],  # a near-tie: fp16 holds 2 and 2 - 2e-4 ~2e-3 apart at most
            [2.0, 1.0, 0.0],
        ],
        dtype=torch.float64,
    )  # a clear gap of 1
    xc = x.half()  # the cell's scores (rounded to fp16)
    probs = torch.tensor([[0.3, 0.6, 0.1], [0.3, 0.6, 0.1], [0.3, 0.6, 0.1]])  # the cell puts key 1 first everywhere
    top = torch.zeros(3, 1, dtype=torch.long)  # float64's top key: key 0
    unit = torch.finfo(torch.float16).eps / 2
    got = real_flips(x, xc, probs, top, torch.arange(3), unit)
    err = (xc.double() - x).abs()
    bound = err[:, 0] + err[:, 1] + FLIP_UNITS * unit
    assert bound[1] > x[1, 0] - x[1, 1]  # the near-tie is within what fp16 rounding explains
    assert got.tolist() == [False, False, True]


def swapped(x, params):
    """A broken softmax: keys 0 and 1 swapped (in the cell's dtype)."""
    p = torch.softmax(x.float(), dim=-1)
    p[:, [0, 1]] = p[:, [1, 0]]
    return MethodOutput(p.to(x.dtype))


def test_flips_of_a_cell_count_real_ones_and_name_the_near_ties():
    METHODS.register(MethodSpec("swapped", "softmax with keys 0 and 1 swapped", swapped))
    try:
        x = torch.zeros(6, 8, dtype=torch.float32)
        x[:3, 0], x[:3, 1] = 3.0, 1.0  # key 0 clearly first: the swap is a real flip
        x[3:, 0] = 0.5
        x[3:, 1] = (
            torch.tensor(0.5).nextafter(torch.tensor(0.0)).nextafter(torch.tensor(0.0))
        )  # 2^-23 below: a near-tie in fp32
        assert 0 < float(x[3, 0] - x[3, 1]) < FLIP_UNITS * torch.finfo(torch.float32).eps / 2
        d = diagnose("x", x, Options(dtypes=("fp32",), methods=("swapped",)))
        c = d.cell("swapped", "fp32")
        assert c.argmax_flips == 3 and c.argmax_flips_near_tie == 3
        assert [e[0] for e in c.examples["flip"]] == [0, 1, 2]
        assert "argmax_flip" in {f.code for f in d.findings}
    finally:
        METHODS.unregister("swapped")
