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

from attncheck.config.sweep import head_layout

_CHI_NODES = 1200  # quadrature nodes over |q| for the overflow prediction
_CHI_HALF_WIDTH = 12.0  # chi_d has std < 0.71: +-12 around sqrt(d) holds all its mass


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


def _gauss_tail(z: float) -> float:
    """P(N(0, 1) > z)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def naive_overflow_probability(threshold: float, scale: float, dk: int, seq: int, var_q: float, var_k: float) -> float:
    """Chance that a row of ``seq`` logits x_j = scale * q . k_j has some x_j > ``threshold``.

    A Gaussian-tail prediction. Given q, x_j ~ N(0, scale^2 var_k |q|^2), independent
    over j (exact for normal keys; for the outlier mixture a Gaussian
    approximation with the same variance), and w = |q| / sqrt(var_q) follows a chi
    distribution with d_k degrees of freedom, so

        P = E_w[ 1 - (1 - Q(threshold / (scale sqrt(var_q var_k) w)))^seq ],

    Q the standard normal tail (via math.erfc), the mean over w taken by
    quadrature. It predicts single-exp overflow; naive softmax can also overflow
    through its row sum alone, which this does not count, and the cast of x to
    the dtype moves the threshold by under half an ulp.
    """
    if scale == 0:
        return 0.0
    sigma1 = scale * math.sqrt(var_q * var_k)  # std of x_j for |q| = sqrt(var_q)
    centre = math.sqrt(dk)
    lo = max(0.0, centre - _CHI_HALF_WIDTH)
    step = (centre + _CHI_HALF_WIDTH - lo) / _CHI_NODES
    total = weight_sum = 0.0
    logs = []
    for i in range(_CHI_NODES):
        w = lo + (i + 0.5) * step
        logs.append((w, (dk - 1) * math.log(w) - 0.5 * w * w))  # chi_d log-density up to a constant
    top = max(lw for _, lw in logs)
    for w, lw in logs:
        weight = math.exp(lw - top)
        if weight == 0.0:
            continue
        tail = _gauss_tail(threshold / (sigma1 * w))
        row = 1.0 if tail >= 1.0 else -math.expm1(seq * math.log1p(-tail))
        total += weight * row
        weight_sum += weight
    return total / weight_sum
