"""Rounding to a binary format in exact integer arithmetic: the tests' independent cast."""

import math


def nearest(v: float, bits: int, emin: int, emax: int) -> float:
    """v rounded to ``bits`` significant bits, ties to even, in exact integer arithmetic: the
    nearest value of a binary format with exponents emin..emax (subnormals below 2**emin;
    beyond the largest finite value + half an ulp: inf)."""
    if not math.isfinite(v) or v == 0:
        return v
    m, e = math.frexp(abs(v))  # |v| = m 2^e, 0.5 <= m < 1
    quantum = max(e - bits, emin - bits + 1)  # exponent of the last kept bit
    num, den = (abs(v) / 2.0**quantum).as_integer_ratio()
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2):
        q += 1
    out = math.ldexp(q, quantum)
    if out >= 2.0 ** (emax + 1):
        out = math.inf
    return math.copysign(out, v)
