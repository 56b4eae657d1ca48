"""The theory the sweep measures against: pure math, no torch (reports import it).

Entries of q and k i.i.d., mean 0, E[x^2] = v, E[x^4] = m4:

- Var(q . k) = d_k v^2 (d_k independent products of variance v^2);
- Var(scale * q . k) = scale^2 d_k v^2: 1 for 1/sqrt(d_k), 1/d_k for 1/d_k,
  1/d_k^3 for 1/d_k^2 (with v = 1);
- the chance that a row of naive softmax hits an exp overflow, see
  ``naive_overflow_probability``.
"""

from __future__ import annotations

import math
import sys

from attncheck.draws import head_layout

_ERFC_LIMIT = 30.0  # log Q(z) through erfc up to here, Mills' ratio beyond
_MILLS_TERMS = 40
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_GOLDEN_STEPS = 120  # brackets the peak of the integrand to 1e-25 of its range
_LOG_RANGE = 80.0  # integrate where the integrand is within e^-80 of its peak
_NODES = 800  # trapezoid nodes over that range: 1e-13 relative against mpmath (tests)
LOG_SMALLEST_NORMAL = math.log(sys.float_info.min)


def var_qk_theory(dk: int, var_q: float, var_k: float) -> float:
    """Var(q . k) = d_k var_q var_k for independent zero-mean entries."""
    return dk * var_q * var_k


def var_qk_stderr(dk: int, rows: int, seq: int, m2: float, m4: float) -> float:
    """Standard error of the sample variance of all rows x seq logits q . k.

    With s = q . k and E[x^2] = m2, E[x^4] = m4 per entry:
    Var(s^2) = d m4^2 + (2 d^2 - 3 d) m2^4. Two logits sharing their q (same row)
    or their k (same head and key) are uncorrelated, but their squares are not:
    Cov(s^2, s'^2) = d m2^2 (m4 - m2^2). Rows are laid out by ``head_layout``.
    """
    heads, queries = head_layout(rows, seq)
    last = rows - (heads - 1) * queries  # queries of the (possibly cut) last head
    n = rows * seq
    var_s2 = dk * m4 * m4 + (2 * dk * dk - 3 * dk) * m2**4
    cov = dk * m2 * m2 * (m4 - m2 * m2)
    same_q = rows * seq * (seq - 1)
    same_k = seq * ((heads - 1) * queries * (queries - 1) + last * (last - 1))
    return math.sqrt((n * var_s2 + (same_q + same_k) * cov) / (n * n))


def uniform_limits(seq: int) -> tuple[float, float]:
    """(max probability, ||diag(p) - p p^T||_F) of the uniform softmax over ``seq`` keys:
    1/S and sqrt(S (1/S)^2 - 2 S (1/S)^3 + (1/S)^2) = sqrt(1/S - 1/S^2). A one-hot row gives (1, 0)."""
    return 1.0 / seq, math.sqrt(1.0 / seq - 1.0 / seq**2)


def log_gauss_tail(z: float) -> float:
    """log P(N(0, 1) > z) for z >= 0, accurate where the tail itself underflows.

    Up to z = 30 through math.erfc (relative error ~1e-15, no underflow: erfc(30/sqrt 2)
    ~ 5e-198); beyond, log phi(z) + log R(z) with R(z) = Q(z)/phi(z) Mills' ratio from its
    continued fraction 1/(z + 1/(z + 2/(z + 3/(z + ...)))), converged to float64 by 40
    terms for z >= 30."""
    if z <= _ERFC_LIMIT:
        return math.log(0.5 * math.erfc(z / math.sqrt(2.0)))
    t = z
    for n in range(_MILLS_TERMS, 0, -1):
        t = z + n / t
    return -0.5 * z * z - 0.5 * math.log(2.0 * math.pi) - math.log(t)


def _log_row_overflow(log_tail: float, seq: int) -> float:
    """log(1 - (1 - Q)^seq) from log Q."""
    if log_tail == -math.inf:
        return -math.inf
    q = math.exp(log_tail)
    if q < 1e-300:  # 1 - (1 - Q)^seq = seq Q (1 - (seq - 1) Q / 2 + ...): the rest is below 1e-290
        return math.log(seq) + log_tail
    if q >= 1.0:
        return 0.0
    return math.log(-math.expm1(seq * math.log1p(-q)))


_MAX_DOUBLINGS = 1100  # past float64's largest power of two


def naive_overflow_log_probability(
    threshold: float, scale: float, dk: int, seq: int, var_q: float, var_k: float
) -> float:
    """Natural log of ``naive_overflow_probability``, exact where the probability itself is
    below float64's range (-inf when it is 0)."""
    if scale == 0:
        return -math.inf
    a = threshold / (scale * math.sqrt(var_q * var_k))  # x_j > threshold <=> w Z_j > a
    log_norm = (0.5 * dk - 1.0) * math.log(2.0) + math.lgamma(0.5 * dk)

    def g(w: float) -> float:  # log of (chi_d density at w) x P(row overflows | w)
        if w <= 0.0:
            return -math.inf
        return (dk - 1) * math.log(w) - 0.5 * w * w - log_norm + _log_row_overflow(log_gauss_tail(a / w), seq)

    # The integrand is log-concave with one peak: near sqrt(d) while a row overflows for a
    # typical |q|, far out in the chi tail (where |q| is large enough) when it does not;
    # there w^4 ~ d w^2 + a^2. Find the peak, take the range where g is within 80 of it,
    # and integrate on that range in log space (trapezoid; its ends are ~e^-80 of the peak).
    w_hi = 2.0 * math.sqrt(0.5 * (dk + math.sqrt(dk * dk + 4.0 * a * a))) + 20.0
    lo, hi = 0.0, w_hi
    for _ in range(_GOLDEN_STEPS):
        m1, m2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
        if g(m1) < g(m2):
            lo = m1
        else:
            hi = m2
    peak_w = 0.5 * (lo + hi)
    peak = g(peak_w)
    if not peak > -math.inf:  # -inf, or NaN from inputs past float64's range: no row overflows that can be told
        return -math.inf
    ends = []
    for direction in (-1.0, 1.0):
        step = 0.5
        w = peak_w
        for _ in range(_MAX_DOUBLINGS):  # g falls like -w^2/2: a handful of doublings; a bound all the same
            w = peak_w + direction * step
            if w <= 0.0 or not g(w) >= peak - _LOG_RANGE:
                break
            step *= 2.0
        ends.append(max(w, 0.0))
    lo, hi = ends
    h = (hi - lo) / _NODES
    values = [g(lo + i * h) for i in range(_NODES + 1)]
    values[0] -= math.log(2.0)
    values[-1] -= math.log(2.0)
    top = max(values)
    return top + math.log(h * math.fsum(math.exp(v - top) for v in values))


def naive_overflow_probability(threshold: float, scale: float, dk: int, seq: int, var_q: float, var_k: float) -> float:
    """Chance that a row of ``seq`` logits x_j = scale * q . k_j has some x_j > ``threshold``.

    A Gaussian-tail prediction. Given q, x_j ~ N(0, scale^2 var_k |q|^2), independent
    over j (exact for normal keys; for the outlier mixture a Gaussian
    approximation with the same variance), and w = |q| / sqrt(var_q) follows a chi
    distribution with d_k degrees of freedom, so

        P = E_w[ 1 - (1 - Q(threshold / (scale sqrt(var_q var_k) w)))^seq ],

    Q the standard normal tail, the mean over w an integral over the chi density taken in
    log space (``naive_overflow_log_probability``), so that deep tails (1e-261 at d_k = 64,
    1/sqrt(d_k), bf16) come out right. Below float64's smallest normal number (2.2e-308)
    it returns 0.0; the log is exact there too. It predicts single-exp overflow; naive
    softmax can also overflow through its row sum alone, which this does not count, and
    the cast of x to the dtype moves the threshold by under half an ulp.
    """
    return probability_from_log(naive_overflow_log_probability(threshold, scale, dk, seq, var_q, var_k))


def probability_from_log(log_p: float) -> float:
    """exp(log_p), or 0.0 where that is below float64's smallest normal number (2.2e-308),
    so that no float with too few digits stands for a probability."""
    return 0.0 if log_p < LOG_SMALLEST_NORMAL else min(1.0, math.exp(log_p))
