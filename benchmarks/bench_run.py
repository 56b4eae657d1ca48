"""Cost of each `attncheck run` cell against one torch.softmax pass.

    python benchmarks/bench_run.py [--elements-log2 26] [--keys 1024] [--repeat 3] [--kernels fused|torch] [--causal]

Builds an fp32 score tensor of 2**26 elements (256 MiB; logits x 3, with --causal
under a causal -inf mask in heads of `keys` queries) and times one float32
torch.softmax pass over it. Then it runs the chunk loop of `diagnose` itself
(the same functions, chunks and reused buffers) with a clock around each stage:
the shared work per chunk (census, float64 reference, entropy, distribution),
each dtype's cast (with the float64 reference of the cast scores, shared by the
dtype's 4 methods), and each cell's softmax method and error metrics. A cell's
cost is its method + its metrics + a quarter of its dtype's cast. Each stage's
time is the least over --repeat passes. All figures are ratios to the
torch.softmax pass (allocating its output; the pass into a preallocated output is
printed too, and the whole call against both), measured in this one process (with glibc told to reuse
freed memory, as the attncheck command does); last comes one whole `diagnose`
call (the least over --repeat), whose time also includes the accumulators and findings.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from attncheck.cli.common import reuse_freed_memory
from attncheck.config.run import rows_per_chunk
from attncheck.judge import diagnose
from attncheck.numerics.backends import select_backend
from attncheck.numerics.cells.accumulate import CellAcc, CensusAcc, DistAcc
from attncheck.numerics.cells.diagnose import Options, _extremes_in_dtype, _in_dtype, bookkeeping
from attncheck.numerics.methods.softmax import Buffers, MethodParams
from attncheck.numerics.precision import dtype_from_name
from attncheck.registry import METHODS, dtype_names, method_names


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def staged_pass(x: torch.Tensor, opts: Options) -> dict:
    """One pass of diagnose's chunk loop with a clock around each stage; seconds per stage."""
    spent: dict = defaultdict(float)
    keys = x.shape[-1]
    step = rows_per_chunk(keys, opts)  # diagnose's own chunks
    backend = select_backend(opts.kernels, x.device, x.numel())
    census, dist = CensusAcc(opts.dtypes), DistAcc(opts.collapse_threshold)
    cells = {(m, d): CellAcc(m, d, opts.max_examples) for d in opts.dtypes for m in opts.methods}
    clock = time.perf_counter
    params = MethodParams(block=opts.block, buffers=Buffers())  # as diagnose runs the methods: into reused buffers
    for start in range(0, x.shape[0], step):
        t0 = clock()
        c = backend.chunk(x[start : start + step], start, 0.0)
        with bookkeeping(c.x.device):  # as diagnose runs it: on one torch thread
            census.update(c)
            dist.update(c)
        spent["shared"] += clock() - t0
        for d in opts.dtypes:
            block = c.x
            t0 = clock()
            algo, before, after = _in_dtype(block, c, dtype_from_name(d), census, d, backend)
            extremes = _extremes_in_dtype(block, c, algo.xc)
            with bookkeeping(c.x.device):
                census.update_headroom(d, c, *extremes)
            spent[("cast", d)] += clock() - t0
            causes = [("input_nan", c.nan), ("inf_input", c.posinf), *before, ("fully_masked", c.all_masked), *after]
            outs = {}
            for m in opts.methods:
                t0 = clock()
                # the fused kernel where the backend has one for the method (tiled), else its torch ops
                outs[m] = backend.method(METHODS.get(m), algo, params) or METHODS.get(m).function()(algo.xc, params)
                spent[("method", m, d)] += clock() - t0
            t0 = clock()
            metrics = backend.cell_metrics(c, [outs[m].probs for m in opts.methods], algo, d == "fp32")
            t_rows = (clock() - t0) / len(opts.methods)  # one kernel call serves the dtype's methods
            for m, r in zip(opts.methods, metrics):
                t0 = clock()
                o = outs[m]
                with bookkeeping(c.x.device):
                    cells[(m, d)].update(c, o.probs, o.events, algo, causes, r)
                spent[("metrics", m, d)] += clock() - t0 + t_rows
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements-log2", type=int, default=26)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--kernels",
        choices=("fused", "torch"),
        default="fused",
        help="fused numba kernels (CPU default for large inputs) or torch ops",
    )
    ap.add_argument(
        "--causal", action="store_true", help="mask keys after each query with -inf (heads of `keys` queries)"
    )
    args = ap.parse_args()
    reuse_freed_memory()  # as the attncheck command does

    n = 1 << args.elements_log2
    rows = n // args.keys
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, args.keys, generator=g) * 3  # (R, T) fp32
    if args.causal:
        query = (torch.arange(rows) % args.keys).unsqueeze(-1)  # (R, 1) position of each row in its head
        x.masked_fill_(torch.arange(args.keys) > query, float("-inf"))
    opts = Options(kernels=args.kernels)
    chunk = rows_per_chunk(args.keys, opts)
    print(
        f"scores: {rows} rows x {args.keys} keys = 2^{args.elements_log2} fp32 elements ({x.numel() * 4 / 2**20:.0f} "
        f"MiB{', causal mask' if args.causal else ''}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; chunks of {chunk} rows; {args.kernels} kernels"
    )
    if args.kernels == "fused":  # compile outside the timings (numba caches it on disk for later runs)
        diagnose("warm-up", x[: 2 * chunk], opts)

    base = best_of(args.repeat, lambda: torch.softmax(x, dim=-1))
    print(f"torch.softmax fp32, one pass: {base * 1e3:.1f} ms (= 1.00x)")
    buf = torch.empty_like(x)
    pre = best_of(
        args.repeat, lambda: torch._softmax(x, -1, False, out=buf)
    )  # the same kernel into a preallocated output
    print(f"torch.softmax fp32 into a preallocated output: {pre * 1e3:.1f} ms (= {pre / base:.2f}x)")
    buf = None  # 256 MiB given back before the diagnosis

    passes = [staged_pass(x, opts) for _ in range(args.repeat)]
    best = {k: min(p[k] for p in passes) for k in passes[0]}
    print(
        f"shared per tensor (census, float64 reference, entropy, distribution): {best['shared'] * 1e3:.1f} ms = "
        f"{best['shared'] / base:.2f}x"
    )
    print(
        f"{'cell':<12} {'cast+ref':>9} {'method':>8} {'metrics':>8} {'cell total':>11}   (cast+ref: once per dtype, "
        "shared by its 4 methods)"
    )
    for d in dtype_names():
        t_cast = best[("cast", d)]
        for m in method_names():
            t_method, t_metrics = best[("method", m, d)], best[("metrics", m, d)]
            total = t_cast / len(method_names()) + t_method + t_metrics
            print(
                f"{m + '/' + d:<12} {t_cast / base:>8.2f}x {t_method / base:>7.2f}x {t_metrics / base:>7.2f}x "
                f"{total / base:>10.2f}x"
            )

    t = best_of(args.repeat, lambda: diagnose("bench", x, opts))
    print(
        f"whole diagnose (12 cells + shared work, one call): {t:.2f} s = {t / base:.1f}x one torch.softmax pass "
        f"({t / pre:.1f}x one pass into a preallocated output)"
    )
    floor = (
        best["shared"]
        + sum(best[("cast", d)] for d in dtype_names())
        + sum(best[("method", m, d)] for d in dtype_names() for m in method_names())
    )
    print(
        f"the cells' method passes plus the shared float64 work (census, references, casts): {floor:.2f} s; "
        f"the whole run is {t / floor:.2f}x that (the metrics, bookkeeping and findings on top)"
    )


if __name__ == "__main__":
    main()
