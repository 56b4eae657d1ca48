"""The numba kernels behind ``numba_rows`` (importing this module imports numba; import it
through ``numba_rows.kernels()``, which points numba's disk cache at the user's cache
directory first).

Every kernel works one row at a time: a row is widened to float64 into a
per-thread buffer, checked for NaN and +inf, and then, when it has neither, run
through loops compiled with relaxed floating-point rules (``FAST``: sums may be
reordered, NaN is assumed absent) so that they vectorise. Rows holding NaN or
+inf take plain scalar code. ``exp_neg`` and ``log_pos`` are compiled without
reordering, so their argument reductions keep their extra precision; LLVM still
inlines them into the vectorised loops.

fp16 and bf16 arrive as their raw 16-bit patterns: fp16 as uint16, bf16 as
int16 (numpy has no bfloat16); ``to_f64`` widens either exactly.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic, overload

from attncheck.numerics.backends.cache import cache_dir

# numba picks each kernel's cache folder when the kernel is decorated: point it at the
# user's cache directory for this module only (restored at the end of the module).
_CACHE_DIR_BEFORE = numba.core.config.CACHE_DIR
_FOLDER = cache_dir()
numba.core.config.CACHE_DIR = "" if _FOLDER is None else str(_FOLDER)

FAST = {"nnan", "nsz", "reassoc", "contract"}  # only for loops over rows without NaN (checked first)
EXACT = {"contract"}  # fused multiply-add only: nothing reordered
ROWS_PER_TASK = 16  # rows per parallel task: one set of row buffers is allocated per task
SERIES_LIMIT = 0.1  # |delta| below this: KL term from its series to delta^14, error < 1e-15 relative
SHORT_LIMIT = 2.0**-10  # |delta| below this: the series to delta^6 (KL_SHORT) suffices, error < 1e-16 relative

F64_MAX = float(np.finfo(np.float64).max)
LOG2E = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that k * LN2_HI is exact for |k| < 2^11
LN2_LO = 1.90821492927058770002e-10
SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # bit pattern of sqrt(1/2)

# Polynomial coefficients, highest degree first (for _horner and _estrin):
EXP_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(13, -1, -1))  # exp(r), |r| <= ln(2)/2
ATANH_SERIES = tuple(1.0 / (2 * n + 1) for n in range(11, -1, -1))  # atanh(s) / s in s^2
KL_SERIES = tuple((-1.0) ** n / (n * (n - 1)) for n in range(14, 1, -1))  # ((1+d) log(1+d) - d) / d^2
KL_SHORT = KL_SERIES[-5:]  # its first five terms: for fp32 cells, whose |delta| is ~1e-7

# error_model="numpy": x / 0 gives inf as IEEE says, with no Python-style check that stops vectorisation
_CACHE = _FOLDER is not None  # False where no cache directory is writable: compile in memory
_jit = numba.njit(cache=_CACHE, nogil=True, error_model="numpy", fastmath=FAST)
_jit_exact = numba.njit(cache=_CACHE, nogil=True, error_model="numpy", fastmath=EXACT)
_jit_plain = numba.njit(cache=_CACHE, nogil=True, error_model="numpy")
_parallel = numba.njit(cache=_CACHE, nogil=True, error_model="numpy", parallel=True)
# inlined into its caller by numba itself: a call that passes a dozen arrays costs ~100 ns,
# which a row of a few keys cannot amortise (16-key rows: 9.0 -> 7.1 ns per key and cell)
_jit_inline = numba.njit(cache=_CACHE, nogil=True, error_model="numpy", inline="always")


# --------------------------------------------------------------------------- bit-level helpers


@intrinsic
def _f64_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def _bits_of_f64(typingctx, value):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _pointer_like(typingctx, address, like):
    """The int64 ``address`` as a pointer to elements of ``like``'s dtype (see cell_rows)."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(like.dtype)(types.int64, like), codegen


@intrinsic
def _half_bits_to_f64(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.DoubleType())

    return types.float64(types.uint16), codegen


@intrinsic
def _bfloat_bits_to_f64(typingctx, bits):
    def codegen(context, builder, sig, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.fpext(builder.bitcast(wide, ir.FloatType()), ir.DoubleType())

    return types.float64(types.int16), codegen


def _min_max(name):
    """llvm.minnum / llvm.maxnum on float64 marked NaN-free: the form of a min or max that
    LLVM vectorises as a reduction (a compare and select is left scalar)."""

    @intrinsic
    def call(typingctx, a, b):
        def codegen(context, builder, sig, args):
            f64 = ir.DoubleType()
            fn = builder.module.declare_intrinsic(name, [f64], ir.FunctionType(f64, [f64, f64]))
            return builder.call(fn, args, fastmath=("nnan", "nsz"))

        return types.float64(types.float64, types.float64), codegen

    return call


max_nn = _min_max("llvm.maxnum")  # only on values known not to be NaN
min_nn = _min_max("llvm.minnum")


def to_f64(v):
    """Exact float64 value of one array element (fp16 bits as uint16, bf16 bits as int16)."""
    raise NotImplementedError("only callable from compiled code")


@overload(to_f64)
def _to_f64(v):
    if v == types.uint16:
        return lambda v: _half_bits_to_f64(v)
    if v == types.int16:
        return lambda v: _bfloat_bits_to_f64(v)
    if isinstance(v, types.Float):
        return lambda v: np.float64(v)
    return None


@_jit_exact
def _horner(x, coefficients):
    """sum c_i x^(n-i) for coefficients c_0..c_n, highest degree first (unrolled by LLVM).
    The most accurate order: exp_neg and log_pos use it."""
    p = 0.0
    for c in coefficients:
        p = p * x + c
    return p


def _estrin(x, coefficients):
    """sum c_i x^(n-i) for coefficients c_0..c_n, highest degree first, by Estrin's scheme:
    pairs c + c' x, then pairs of those times x^2, x^4, ... A degree-12 polynomial is a
    chain of 5 dependent operations instead of Horner's 12. The metrics kernel, which
    evaluates KL_SERIES once per key, was bound by that chain's latency and costs ~17%
    less per key with it. It rounds more often than Horner where the low-order terms
    dominate (exp_neg with it: 40% of results 1 ulp off libm's instead of 8%), so it serves
    only the KL series, whose value (~1/2) the last additions barely move."""
    raise NotImplementedError("only callable from compiled code")


def _estrin_source(n: int) -> str:
    """Straight-line Python for ``_estrin`` with ``n`` coefficients."""
    lines = ["def impl(x, coefficients):", "    c = coefficients"]
    terms = [f"c[{n - 1 - i}]" for i in range(n)]  # lowest degree first
    power, level = "x", 0
    while len(terms) > 1:
        pairs = []
        for j in range(0, len(terms), 2):
            if j + 1 < len(terms):
                pairs.append(f"t{level}_{j // 2}")
                lines.append(f"    {pairs[-1]} = {terms[j]} + {terms[j + 1]} * {power}")
            else:
                pairs.append(terms[j])
        terms, level = pairs, level + 1
        if len(terms) > 1:
            lines.append(f"    x{level} = {power} * {power}")
            power = f"x{level}"
    lines.append(f"    return {terms[0]}")
    return "\n".join(lines)


@overload(_estrin, jit_options=dict(fastmath=EXACT))
def _estrin_impl(x, coefficients):
    if not isinstance(coefficients, types.UniTuple):
        return None
    scope: dict = {}
    exec(_estrin_source(coefficients.count), scope)
    return scope["impl"]


@_jit_exact
def exp_neg(z):
    """exp(z) for z <= 0 (-inf gives 0): Cody-Waite reduction, degree-13 Taylor polynomial,
    and 2^k applied in two halves so subnormal results round once. Within 2 ulp of exp.

    Masked keys (-inf, or a sentinel such as -1e4) are computed as exp(0) and then
    replaced by 0: letting them underflow to 0 would cost a microcode assist per key."""
    under = not z > -746.0  # exp(z) rounds to 0 in float64
    zc = 0.0 if under else z
    kf = np.floor(zc * LOG2E + 0.5)
    r = (zc - kf * LN2_HI) - kf * LN2_LO  # |r| <= ln(2)/2
    p = _horner(r, EXP_TAYLOR)
    k = np.int64(kf)  # in [-1076, 0]
    k1 = k >> 1
    e = (p * _f64_from_bits((k1 + 1023) << 52)) * _f64_from_bits((k - k1 + 1023) << 52)
    return 0.0 if under else e


@_jit_exact
def log_pos(y):
    """log(y) for normal y > 0: y = 2^e f with f in [sqrt(1/2), sqrt(2)), log f = 2 atanh(s)
    with s = (f - 1) / (f + 1), |s| <= 0.172, summed to s^23. Within a few ulp of log."""
    bits = _bits_of_f64(y)
    e = (bits - SQRT_HALF_BITS) >> 52
    f = _f64_from_bits(bits - (e << 52))
    s = (f - 1.0) / (f + 1.0)
    q = _horner(s * s, ATANH_SERIES)
    ef = np.float64(e)
    return ef * LN2_HI + (2.0 * s * q + ef * LN2_LO)


# --------------------------------------------------------------------------- row helpers


@_jit_plain
def _load(a, i, buf):
    """Row i of ``a`` into ``buf`` as float64; returns (count of NaN or +inf, count of -inf)."""
    bad = 0
    neginf = 0
    for j in range(buf.size):
        v = to_f64(a[i, j])
        buf[j] = v
        if not v < np.inf:
            bad += 1
        if v == -np.inf:
            neginf += 1
    return bad, neginf


@_jit
def _row_max(xb):
    m = -np.inf
    for j in range(xb.size):
        v = xb[j]
        m = max_nn(m, v)
    return m


@_jit
def _exp_row(xb, m, out):
    """out = exp(xb - m) (m finite, xb <= m); returns the sum."""
    s = 0.0
    for j in range(xb.size):
        e = exp_neg(xb[j] - m)
        out[j] = e
        s += e
    return s


@_jit
def _scale_row(out, s):
    inv = 1.0 / s
    for j in range(out.size):
        out[j] = out[j] * inv


@_jit
def _census_fast(xb, shift, limit):
    """Census of a row without NaN or +inf: max, min of finite values, min of finite
    values above ``limit``, masked count, sums of finite (x - shift) and its square.

    A key left out of a min counts as the largest float64, not as +inf: LLVM folds
    ``min(lo, inf)`` into a conditional update, which it does not vectorise (1.2 ns a
    key instead of 0.1). Every finite score is at most that value, so the mins are
    exact wherever a key counts; rows with none get +inf after the loop."""
    m = -np.inf
    lo = F64_MAX
    ulo = F64_MAX
    a = 0.0
    b = 0.0
    masked = 0
    for j in range(xb.size):
        v = xb[j]
        m = max_nn(m, v)
        fin = v > -np.inf
        lo = min_nn(lo, v if fin else F64_MAX)
        ulo = min_nn(ulo, v if v > limit else F64_MAX)
        if v <= limit:
            masked += 1
        w = v - shift if fin else 0.0
        a += w
        b += w * w
    if m == -np.inf:  # no finite key
        lo = np.inf
    if not m > limit:  # no key above the limit
        ulo = np.inf
    return m, lo, ulo, masked, a, b


@_jit
def _first_index_of(xb, m):
    for j in range(xb.size):
        if xb[j] == m:
            return j
    return 0


@_jit
def _normalise_row(xb, m, s, top, out):
    """out = out / s (the reference); returns sum p (x - max), the count of p > 0, and
    ||diag(p) - p p^T||_F, computed from the keys other than ``top`` (the most likely
    one) without cancellation (see ``rowmath.jacobian_frobenius``)."""
    inv = 1.0 / s
    sz = 0.0
    e = 0.0
    a2 = 0.0
    a4 = 0.0
    b = 0.0
    k = 0
    for j in range(xb.size):
        p = out[j] * inv
        out[j] = p
        z = xb[j] - m
        z = z if z > -746.0 else -746.0  # p = 0 there; keeps p * z = 0 for -inf keys
        sz += p * z
        w = p if j != top else 0.0  # the other keys
        w2 = w * w
        e += w
        a2 += w2
        a4 += w2 * w2
        u = w - w2
        b += u * u
        if p > 0.0:
            k += 1
    pm = out[top]
    f2 = pm * pm * (e * e + 2.0 * a2) + b + (a2 * a2 - a4)
    return sz, k, math.sqrt(f2) if f2 > 0.0 else 0.0


@_jit_plain
def _census_slow(xb, shift, limit):
    """Census of a row holding NaN or +inf (its softmax is undefined)."""
    m = -np.inf
    hi = -np.inf
    lo = np.inf
    ulo = np.inf
    a = 0.0
    b = 0.0
    n_nan = 0
    n_pinf = 0
    n_mask = 0
    arg = 0
    for j in range(xb.size):
        v = xb[j]
        if v != v:
            n_nan += 1
            continue
        if v > m:
            m = v
            arg = j
        if v == np.inf:
            n_pinf += 1
        elif v == -np.inf:
            n_mask += 1
        else:
            hi = max(hi, v)
            lo = min(lo, v)
            if v <= limit:
                n_mask += 1
            elif v < ulo:
                ulo = v
            w = v - shift
            a += w
            b += w * w
    return n_nan, n_pinf, n_mask, hi, lo, ulo, a, b, arg


@_jit
def _metrics(pb, ref, ra, floor, rest_at, two, short):
    """Metrics of a NaN-free row of probabilities against its reference ``ref`` and,
    where ``two``, against ``ra`` (else those errors are the ones against ``ref``, taken
    once: the cells' scores are the chunk's own): max, sum, sum of squared and max absolute error against each,
    flushed count, and the generalised KL(ref || q) with q = max(p, floor), the sum of
    r log(r/q) - r + q. Each KL term comes from its series when
    |delta| = |r - q| / q < SERIES_LIMIT (no cancellation there) and is q where r = 0;
    the rest, counted in the last value and marked 1 in ``rest_at``, are left to
    ``_kl_rest``. With ``short`` (cells computed in fp32, whose |delta| is ~1e-7) the
    series stops at delta^6 and serves |delta| < SHORT_LIMIT, which is 6 operations per
    key instead of 15; the keys beyond it go to ``_kl_rest`` too, which takes the long
    series up to SERIES_LIMIT: every term is the same to ~1e-16 relative either way."""
    hi = -np.inf
    s = 0.0
    sq = 0.0
    mx = 0.0
    sqa = 0.0
    mxa = 0.0
    kl = 0.0
    fl = 0
    rest = 0
    for j in range(pb.size):
        v = pb[j]
        r = ref[j]
        hi = max_nn(hi, v)
        s += v
        e = abs(v - r)
        sq += e * e
        mx = max_nn(mx, e)
        if two:  # loop-invariant: LLVM compiles the loop once for each value
            ea = abs(v - ra[j])
            sqa += ea * ea
            mxa = max_nn(mxa, ea)
        if v == 0.0 and r > 0.0:
            fl += 1
        q = v if v > floor else floor
        d = (r - q) / q
        # q ((1+d) log(1+d) - d) = q sum_{n>=2} (-d)^n / (n (n-1))
        if short:  # loop-invariant, as ``two``
            c = _estrin(d, KL_SHORT)
            small = abs(d) < SHORT_LIMIT
        else:
            c = _estrin(d, KL_SERIES)
            small = abs(d) < SERIES_LIMIT
        kl += q * d * d * c if small else (q if r == 0.0 else 0.0)
        left = 1 if not small and r > 0.0 else 0
        rest_at[j] = left
        rest += left
    if not two:
        sqa, mxa = sq, mx
    return hi, s, sq, mx, sqa, mxa, kl, fl, rest


@_jit_plain
def _kl_rest_gather(pb, ref, floor, rest_at, n_rest, kb):
    """The ``n_rest`` KL terms ``_metrics`` left out (flags of one byte in ``rest_at``, padded
    with zeros to whole 8-byte words), gathered: their r into ``kb[0]`` and their q into
    ``kb[1]``, side by side, so that ``_kl_rest`` runs over them as one vectorised loop.
    Returns how many (``n_rest``). Each slot is written always and kept only when flagged (no
    branch per key); where the rest are few (flushed and subnormal probabilities) a word of
    eight zero flags is skipped at once; where they are many (1/8 of the keys or more) every
    key is visited without that branch, which would mispredict."""
    rb = kb[0]
    qb = kb[1]
    n = 0
    if 8 * n_rest >= rest_at.size:  # dense: one flat pass (a loop nested by word is slower)
        for j in range(pb.size):
            v = pb[j]
            rb[n] = ref[j]
            qb[n] = v if v > floor else floor
            n += rest_at[j]
        return n
    words = rest_at.view(np.uint64)
    for w in range(words.size):
        if words[w] == 0:
            continue
        for j in range(8 * w, min(8 * w + 8, pb.size)):  # the padding past the row is never flagged
            v = pb[j]
            rb[n] = ref[j]
            qb[n] = v if v > floor else floor
            n += rest_at[j]
    return n


@_jit
def _kl_rest(kb, n):
    """Sum of r log(r/q) - r + q over the gathered keys: through log where |delta| >=
    SERIES_LIMIT, from the long series below it (keys a short series left out)."""
    kl = 0.0
    rb = kb[0]
    qb = kb[1]
    for k in range(n):
        r = rb[k]
        q = qb[k]
        y = r / q
        d = (r - q) / q
        y = y if y > 1e-300 else 1e-300  # r < 1e-300 q: r log(r/q) is below 1e-297, q dominates
        by_log = r * log_pos(y) + (q - r)
        kl += q * d * d * _estrin(d, KL_SERIES) if abs(d) < SERIES_LIMIT else by_log
    return kl


@_jit_plain
def _max_with_nan(pb):
    """max of a row, NaN when it holds a NaN."""
    hi = -np.inf
    for j in range(pb.size):
        v = pb[j]
        if v != v:
            return np.nan
        hi = max(hi, v)
    return hi


# --------------------------------------------------------------------------- kernels


@_parallel
def reference_rows(x, shift, limit, ref):
    """Census facts and the float64 max-subtracted softmax of each row of ``x`` (r, T).

    Writes the reference into ``ref`` (r, T) float64 and returns per-row arrays, in
    this order: nan, posinf, neginf counts; masked (-inf or <= limit) count; finite
    count; max and min of finite values (-inf / +inf when none); min of finite
    values above ``limit`` (+inf when none); sum and sum of squares of finite
    (x - shift); S = sum exp(x - max) (NaN where the softmax is undefined);
    entropy log S - sum(p z); the Frobenius norm of the softmax Jacobian
    diag(p) - p p^T; count of p > 0; index of the max.
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
    ssum = np.full(r, np.nan)
    ent = np.full(r, np.nan)
    jac = np.zeros(r)
    pos = np.zeros(r, np.int64)
    top = np.zeros(r, np.int64)
    for task in prange((r + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        xb = np.empty(t)
        for i in range(task * ROWS_PER_TASK, min(r, (task + 1) * ROWS_PER_TASK)):
            bad, n_ninf = _load(x, i, xb)
            neginf[i] = n_ninf
            if bad:
                n_nan, n_pinf, n_mask, hi, lo, ulo, a, b, arg = _census_slow(xb, shift, limit)
                nan[i] = n_nan
                posinf[i] = n_pinf
                masked[i] = n_mask
                finite[i] = t - n_nan - n_pinf - n_ninf
                fmax[i] = hi
                fmin[i] = lo
                umin[i] = ulo
                s1[i] = a
                s2[i] = b
                top[i] = arg
                ref[i, :] = np.nan
                continue
            m, lo, ulo, n_mask, a, b = _census_fast(xb, shift, limit)
            masked[i] = n_mask
            finite[i] = t - n_ninf
            fmax[i] = m
            fmin[i] = lo
            umin[i] = ulo
            s1[i] = a
            s2[i] = b
            j_top = _first_index_of(xb, m)
            top[i] = j_top
            if m == -np.inf:  # every key masked with -inf: undefined
                ref[i, :] = np.nan
                continue
            row = ref[i]
            s = _exp_row(xb, m, row)
            sz, k, f = _normalise_row(xb, m, s, j_top, row)
            ssum[i] = s
            h = math.log(s) - sz
            ent[i] = h if h > 0.0 else 0.0
            jac[i] = f
            pos[i] = k
    return nan, posinf, neginf, masked, finite, fmax, fmin, umin, s1, s2, ssum, ent, jac, pos, top


@_parallel
def algo_reference_rows(x, ref):
    """float64 max-subtracted softmax of each row of ``x`` into ``ref``, where defined.

    Returns per row whether the softmax is defined (no NaN or +inf, not all -inf);
    rows where it is not are left unwritten.
    """
    r, t = x.shape
    defined = np.zeros(r, np.bool_)
    for task in prange((r + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        xb = np.empty(t)
        for i in range(task * ROWS_PER_TASK, min(r, (task + 1) * ROWS_PER_TASK)):
            bad, neginf = _load(x, i, xb)
            if bad == 0 and neginf < t:
                defined[i] = True
                row = ref[i]
                _scale_row(row, _exp_row(xb, _row_max(xb), row))
    return defined


@_jit_inline
def _cell_row(
    p, i, k, row, algo, two, short, ok, top_i, floor, pb, rest_at, kb, pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop
):
    """The metrics of row i of ``p`` into slot k of the outputs (see ``cell_rows``); errors
    against ``algo`` too where ``two`` (else ``algo`` is ``row`` and they are the same)."""
    bad, _ = _load(p, i, pb)
    attop[k, i] = pb[top_i]
    if bad:
        pmax[k, i] = _max_with_nan(pb)
        return
    if not ok:
        pmax[k, i] = _row_max(pb)
        return
    hi, s, a, b, a2, b2, div, fl, rest = _metrics(pb, row, algo, floor, rest_at, two, short)
    if rest:
        div += _kl_rest(kb, _kl_rest_gather(pb, row, floor, rest_at, rest, kb))
    pmax[k, i] = hi
    psum[k, i] = s
    sq[k, i] = a
    mx[k, i] = b
    sqa[k, i] = a2
    mxa[k, i] = b2
    kl[k, i] = div if div > 0.0 else 0.0
    flushed[k, i] = fl


@_parallel
def cell_rows(ptrs_a, like_a, ptrs_b, like_b, floors, ra, use_algo, algo_ok, ref, ref_ok, top, short):
    """Per-row metrics of any number of cells of one dtype against the float64 reference
    ``ref`` (r, T): the probabilities of cell k are an (r, T) C-contiguous array at
    address ``ptrs_a[k]`` with ``like_a``'s element type (the scores' dtype), then those
    at ``ptrs_b`` with ``like_b``'s (float32). The caller keeps those arrays alive.

    One call serves all the methods of a dtype, so each row of ``ref`` and ``ra`` is
    read from memory once. With ``use_algo``, errors are also taken against ``ra``,
    the float64 softmax of the cells' cast scores (rows where ``algo_ok``).
    ``floors[k]`` is the smallest subnormal of slot k's dtype. Returns (K, r) arrays,
    in order: max p (NaN if any NaN), sum p, sum (p - ref)^2, max |p - ref|, the same
    two against ``ra``, generalised KL(ref || max(p, floor)), count of p == 0 where
    ref > 0, and p at the reference's top key. Metrics other than max p are 0 where
    ``ref_ok`` is False. ``short``: the cells were computed in fp32 (see ``_metrics``);
    a hint for speed, the numbers are the same to ~1e-16 relative without it.
    """
    r, t = ref.shape
    na = ptrs_a.size
    k_all = na + ptrs_b.size
    pmax = np.empty((k_all, r))
    psum = np.zeros((k_all, r))
    sq = np.zeros((k_all, r))
    mx = np.zeros((k_all, r))
    sqa = np.zeros((k_all, r))
    mxa = np.zeros((k_all, r))
    kl = np.zeros((k_all, r))
    flushed = np.zeros((k_all, r), np.int64)
    attop = np.empty((k_all, r))
    for task in prange((r + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        pb = np.empty(t)
        rest_at = np.zeros(-(-t // 8) * 8, np.uint8)  # whole words for _kl_rest_gather; the padding stays 0
        kb = np.empty((2, t + 1))  # _kl_rest_gather writes one slot past the last key it keeps
        for i in range(task * ROWS_PER_TASK, min(r, (task + 1) * ROWS_PER_TASK)):
            row = ref[i]
            two = use_algo and algo_ok[i]
            algo = ra[i] if two else row
            ok = ref_ok[i]
            j = top[i]
            for k in range(na):
                p = numba.carray(_pointer_like(ptrs_a[k], like_a), (r, t))
                _cell_row(
                    p,
                    i,
                    k,
                    row,
                    algo,
                    two,
                    short,
                    ok,
                    j,
                    floors[k],
                    pb,
                    rest_at,
                    kb,
                    pmax,
                    psum,
                    sq,
                    mx,
                    sqa,
                    mxa,
                    kl,
                    flushed,
                    attop,
                )
            for k in range(ptrs_b.size):
                p = numba.carray(_pointer_like(ptrs_b[k], like_b), (r, t))
                _cell_row(
                    p,
                    i,
                    na + k,
                    row,
                    algo,
                    two,
                    short,
                    ok,
                    j,
                    floors[na + k],
                    pb,
                    rest_at,
                    kb,
                    pmax,
                    psum,
                    sq,
                    mx,
                    sqa,
                    mxa,
                    kl,
                    flushed,
                    attop,
                )
    return pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop


# --------------------------------------------------------------------------- tiled (online) softmax

F32 = np.float32
BEFORE, AT, AFTER = 0, 1, 2  # fp8.BEFORE, AT, AFTER: a key block against the row max's block, in visiting order


@_jit_plain
def round_to_format(v, mb, emin, top):
    """v >= 0 (float64) rounded to nearest even in a binary format with ``mb`` mantissa bits
    and smallest normal 2^emin (subnormals below it), saturating at ``top``: fp16, bf16 and
    the FP8 formats as the kernels convert to them (satfinite)."""
    e = ((_bits_of_f64(v) >> 52) & 0x7FF) - 1023
    e = e if e > emin else emin
    k = e - mb  # the spacing is 2^k
    r = np.rint(v * _f64_from_bits((1023 - k) << 52)) * _f64_from_bits((1023 + k) << 52)
    return r if r < top else top


@_jit_plain
def _widen_row(x, i, sb):
    """Row i of ``x`` into ``sb`` as float32 (exact); returns whether it holds NaN or +inf."""
    bad = 0
    for k in range(sb.size):
        v = to_f64(x[i, k])
        sb[k] = F32(v)
        if not v < np.inf:
            bad += 1
    return bad


@_jit_plain
def _block_max(sb):
    m = -np.inf
    for k in range(sb.size):
        m = max_nn(m, np.float64(sb[k]))
    return F32(m)


@_jit_plain
def _block_exps(sb, ms, row, tree):
    """exp(s - ms) of a block's keys ``sb`` into ``row``, the subtraction in float32 and the
    exp rounded once to float32; returns their halving-tree float32 sum (``tree``: scratch of
    a power of two >= the block). Loops run over whole slices, so that LLVM vectorises them."""
    n = sb.size
    for k in range(n):
        row[k] = F32(exp_neg(np.float64(sb[k] - ms)))
    head = tree[:n]
    for k in range(n):
        head[k] = row[k]
    tail = tree[n:]
    for k in range(tail.size):
        tail[k] = F32(0.0)
    h = tree.size
    while h > 1:
        h //= 2
        a = tree[:h]
        b = tree[h : 2 * h]
        for k in range(h):
            a[k] = a[k] + b[k]
    return tree[0]


@_jit_plain
def _scale_block(row, resc):
    for k in range(row.size):
        row[k] = row[k] * resc


@_jit_plain
def _round_block(row, mb, emin, top, resc):
    for k in range(row.size):
        row[k] = F32(round_to_format(np.float64(row[k]), mb, emin, top)) * resc


@_jit_plain
def _pcast_block(row, mb, emin, top, ps, resc, limit, flag):
    """The P cast of one block: row = fp8(row * ps) * resc / ps, flag = the cast flushed a
    positive value to 0; returns whether a scaled value reached ``limit``."""
    over = 0
    for k in range(row.size):
        sc = row[k] * ps
        p8 = F32(round_to_format(np.float64(sc), mb, emin, top))
        over |= np.int64(sc >= limit)
        flag[k] = (p8 == F32(0.0)) & (sc > F32(0.0))
        row[k] = (p8 * resc) / ps
    return over > 0


@_jit
def _count_block(ref, flag):
    """Keys where ``ref`` > 0, those of them ``flag``ged, and their summed ``ref``."""
    n_live = 0
    n_flushed = 0
    lost = 0.0
    for k in range(ref.size):
        r = ref[k]
        lv = r > 0.0
        f = flag[k] & lv
        n_live += np.int64(lv)
        n_flushed += np.int64(f)
        lost += r if f else 0.0
    return n_live, n_flushed, lost


@_parallel
def tiled_rows(x, block, reverse, mb, emin, top, fp8, p_scale, limit, ref, ref_ok, out):
    """FlashAttention's one-pass softmax of each row of ``x`` (r, T) over key blocks of
    ``block``, into ``out`` (r, T) float32, with the rounding points of
    ``attncheck.numerics.methods.online`` (bit for bit the torch implementation's).

    P is e rounded by ``round_to_format(e, mb, emin, top)`` (mb < 0: kept in float32); with
    ``fp8``, e is first scaled by ``p_scale`` (float32) and the result divided by it again,
    and each row's keys are counted by block position (BEFORE, AT, AFTER): where the
    reference ``ref`` (r, T) float64 is > 0 in rows where ``ref_ok`` ("live"), and those of
    them that the cast flushed to 0; the reference mass of the flushed ones is summed, and a
    scaled value at or above ``limit`` marks the row's overflow. Rows holding NaN or +inf
    are left to the caller. Returns done (r,), overflow (r,), live (r, 3), flushed (r, 3), mass (r,).
    """
    r, t = x.shape
    nb = (t + block - 1) // block
    width = 1
    while width < block:
        width *= 2
    done = np.zeros(r, np.bool_)
    overflow = np.zeros(r, np.bool_)
    live = np.zeros((r, 3), np.int64)
    flushed = np.zeros((r, 3), np.int64)
    mass = np.zeros(r)
    ps = F32(p_scale)
    one = F32(1.0)
    for task in prange((r + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        sb = np.empty(t, np.float32)
        m_at = np.empty(nb, np.float32)
        tree = np.empty(width, np.float32)
        flag = np.empty(block, np.bool_)
        for i in range(task * ROWS_PER_TASK, min(r, (task + 1) * ROWS_PER_TASK)):
            if _widen_row(x, i, sb):
                continue
            done[i] = True
            row = out[i]
            m = F32(-np.inf)
            for jj in range(nb):  # running max after each visited block
                j = nb - 1 - jj if reverse else jj
                bm = _block_max(sb[j * block : min(t, j * block + block)])
                m = bm if bm > m else m
                m_at[j] = m
            m_final = m if m > -np.inf else F32(0.0)
            first = 0
            for jj in range(nb):
                j = nb - 1 - jj if reverse else jj
                if m_at[j] == m:
                    first = jj
                    break
            l = F32(0.0)
            m_prev = F32(-np.inf)
            for jj in range(nb):
                j = nb - 1 - jj if reverse else jj
                lo = j * block
                hi = min(t, lo + block)
                mj = m_at[j]
                ms = mj if mj > -np.inf else F32(0.0)
                bs = _block_exps(sb[lo:hi], ms, row[lo:hi], tree)
                decay = F32(exp_neg(np.float64(m_prev - ms)))
                l = decay * l + bs
                m_prev = mj
            inv_l = one if l == 0 or l != l else one / l
            ok = fp8 and ref_ok[i]
            lost = 0.0
            for jj in range(nb):
                j = nb - 1 - jj if reverse else jj
                lo = j * block
                hi = min(t, lo + block)
                resc = F32(exp_neg(np.float64(m_at[j] - m_final))) * inv_l
                if fp8:
                    pos = BEFORE if jj < first else (AT if jj == first else AFTER)
                    if _pcast_block(row[lo:hi], mb, emin, top, ps, resc, limit, flag):
                        overflow[i] = True
                    if ok:
                        n_live, n_flushed, gone = _count_block(ref[i, lo:hi], flag[: hi - lo])
                        live[i, pos] += n_live
                        flushed[i, pos] += n_flushed
                        lost += gone
                elif mb >= 0:
                    _round_block(row[lo:hi], mb, emin, top, resc)
                else:
                    _scale_block(row[lo:hi], resc)
            mass[i] = lost
    return done, overflow, live, flushed, mass


numba.core.config.CACHE_DIR = _CACHE_DIR_BEFORE
