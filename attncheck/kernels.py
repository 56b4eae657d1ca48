"""Fused per-row kernels for the CPU (numba): the numbers of diagnose's torch code path
in one pass over each row instead of a dozen whole-tensor passes.

Used for large inputs on the CPU when numba is installed; the torch path in
``diagnose`` is the reference, runs everywhere else (CUDA, small inputs, no
numba, or ATTNCHECK_KERNELS=torch), and tests check that both give the same
numbers. The functions below are plain Python until ``compiled()`` JITs them.
Rows are processed in parallel; each row is read in key order, so a row's
values never depend on the chunking.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np

prange = range  # numba.prange once compiled; plain Python semantics otherwise
_compiled: dict | None = None


def available() -> bool:
    """numba is installed and not switched off with ATTNCHECK_KERNELS=torch (imports nothing)."""
    return os.environ.get("ATTNCHECK_KERNELS", "auto") != "torch" and importlib.util.find_spec("numba") is not None


def compiled() -> dict:
    """JIT-compile the kernels on first use (cached on disk by numba across runs)."""
    global _compiled, prange, _kl_term
    if _compiled is None:
        import numba

        prange = numba.prange
        _kl_term = numba.njit(cache=True, inline="always")(_kl_term)
        par = numba.njit(parallel=True, cache=True, nogil=True)
        _compiled = {f.__name__: par(f) for f in (reference_rows, softmax64_rows, cell_rows)}
    return _compiled


SERIES_LIMIT = 1e-2  # |delta| below this: KL term from its series, error < delta^5 / 21 relative


def reference_rows(x, shift, limit, ref):
    """Census facts and the float64 max-subtracted softmax of each row of ``x`` (r, T).

    Writes the reference into ``ref`` (r, T) float64 and returns per-row arrays, in
    this order: nan, posinf, neginf counts; masked (-inf or <= limit) count; finite
    count; max and min of finite values (-inf / +inf when none); min of finite
    values above ``limit`` (+inf when none); sum and sum of squares of finite
    (x - shift); S = sum exp(x - max) (NaN where the softmax is undefined);
    entropy log S - sum(p z); sum p^2; sum p^3; count of p > 0; index of the max.
    """
    r, t = x.shape
    nan = np.zeros(r, np.int64)
    posinf = np.zeros(r, np.int64)
    neginf = np.zeros(r, np.int64)
    masked = np.zeros(r, np.int64)
    finite = np.zeros(r, np.int64)
    fmax = np.empty(r)
    fmin = np.empty(r)
    umin = np.empty(r)
    s1 = np.zeros(r)
    s2 = np.zeros(r)
    ssum = np.empty(r)
    ent = np.empty(r)
    p2 = np.zeros(r)
    p3 = np.zeros(r)
    pos = np.zeros(r, np.int64)
    top = np.zeros(r, np.int64)
    for i in prange(r):
        m = -np.inf
        hi = -np.inf
        lo = np.inf
        ulo = np.inf
        a = 0.0
        b = 0.0
        n_nan = 0
        n_pinf = 0
        n_ninf = 0
        n_mask = 0
        n_fin = 0
        arg = 0
        for j in range(t):
            v = np.float64(x[i, j])
            if v != v:
                n_nan += 1
                continue
            if v > m:
                m = v
                arg = j
            if v == np.inf:
                n_pinf += 1
            elif v == -np.inf:
                n_ninf += 1
                n_mask += 1
            else:
                n_fin += 1
                if v > hi:
                    hi = v
                if v < lo:
                    lo = v
                if v <= limit:
                    n_mask += 1
                elif v < ulo:
                    ulo = v
                w = v - shift
                a += w
                b += w * w
        nan[i] = n_nan
        posinf[i] = n_pinf
        neginf[i] = n_ninf
        masked[i] = n_mask
        finite[i] = n_fin
        fmax[i] = hi
        fmin[i] = lo
        umin[i] = ulo
        s1[i] = a
        s2[i] = b
        top[i] = arg
        if n_nan > 0 or n_pinf > 0 or m == -np.inf:
            for j in range(t):
                ref[i, j] = np.nan
            ssum[i] = np.nan
            ent[i] = np.nan
            continue
        s = 0.0
        for j in range(t):
            e = math.exp(np.float64(x[i, j]) - m)
            ref[i, j] = e
            s += e
        sz = 0.0
        q2 = 0.0
        q3 = 0.0
        k = 0
        for j in range(t):
            p = ref[i, j] / s
            ref[i, j] = p
            if p > 0.0:
                k += 1
                sz += p * (np.float64(x[i, j]) - m)
                q2 += p * p
                q3 += p * p * p
        ssum[i] = s
        h = math.log(s) - sz
        ent[i] = h if h > 0.0 else 0.0
        p2[i] = q2
        p3[i] = q3
        pos[i] = k
    return nan, posinf, neginf, masked, finite, fmax, fmin, umin, s1, s2, ssum, ent, p2, p3, pos, top


def softmax64_rows(x, ref):
    """float64 max-subtracted softmax of each row into ``ref``; returns which rows are defined."""
    r, t = x.shape
    ok = np.zeros(r, np.bool_)
    for i in prange(r):
        m = -np.inf
        bad = False
        for j in range(t):
            v = np.float64(x[i, j])
            if v != v or v == np.inf:
                bad = True
            elif v > m:
                m = v
        if bad or m == -np.inf:
            for j in range(t):
                ref[i, j] = np.nan
            continue
        s = 0.0
        for j in range(t):
            e = math.exp(np.float64(x[i, j]) - m)
            ref[i, j] = e
            s += e
        for j in range(t):
            ref[i, j] = ref[i, j] / s
        ok[i] = True
    return ok


def _kl_term(r, q):
    """r log(r/q) - r + q for r >= 0, q > 0, accurate when q is within rounding of r."""
    if r == 0.0:
        return q
    d = (r - q) / q
    if abs(d) < SERIES_LIMIT:
        # q ((1+d) log(1+d) - d) = q (d^2/2 - d^3/6 + d^4/12 - d^5/20 + d^6/30 - ...)
        return q * d * d * (0.5 + d * (-1.0 / 6.0 + d * (1.0 / 12.0 + d * (-1.0 / 20.0 + d * (1.0 / 30.0)))))
    return r * math.log1p(d) + (q - r)


def cell_rows(p, ref, ref_algo, use_algo, top, floor):
    """Per-row metrics of probabilities ``p`` (r, T) against the float64 reference.

    Returns, in order: max p (NaN if any NaN), sum p, sum (p - ref)^2, max |p - ref|,
    the same two against ``ref_algo`` (when ``use_algo``), generalised KL(ref || max(p, floor)),
    count of p == 0 where ref > 0, and p at the reference's top key.
    """
    r, t = p.shape
    pmax = np.empty(r)
    psum = np.zeros(r)
    sq = np.zeros(r)
    mx = np.zeros(r)
    sqa = np.zeros(r)
    mxa = np.zeros(r)
    kl = np.zeros(r)
    flushed = np.zeros(r, np.int64)
    attop = np.empty(r)
    for i in prange(r):
        hi = -np.inf
        s = 0.0
        a = 0.0
        b = 0.0
        aa = 0.0
        ba = 0.0
        k = 0.0
        fl = 0
        has_nan = False
        for j in range(t):
            v = np.float64(p[i, j])
            if v != v:
                has_nan = True
            elif v > hi:
                hi = v
            s += v
            rv = ref[i, j]
            d = v - rv
            a += d * d
            if abs(d) > b:
                b = abs(d)
            if use_algo:
                da = v - ref_algo[i, j]
                aa += da * da
                if abs(da) > ba:
                    ba = abs(da)
            if v == 0.0 and rv > 0.0:
                fl += 1
            q = v if v > floor else floor
            k += _kl_term(rv, q)
        pmax[i] = np.nan if has_nan else hi
        psum[i] = s
        sq[i] = a
        mx[i] = b
        sqa[i] = aa
        mxa[i] = ba
        kl[i] = k if k > 0.0 else 0.0
        flushed[i] = fl
        attop[i] = np.float64(p[i, top[i]])
    return pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop
