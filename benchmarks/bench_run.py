"""Cost of each `attncheck run` cell against one torch.softmax pass.

    python benchmarks/bench_run.py [--elements-log2 26] [--keys 1024] [--repeat 3]

Builds an fp32 score tensor of 2**26 elements (256 MiB), times one float32
torch.softmax pass over it, then, over the same row chunks `diagnose` uses:
the shared work (census + float64 reference + distribution, once per chunk), and
for each default cell its cast (with the float64 reference of the cast scores,
shared by the 4 methods of a dtype), its softmax method, and its error metrics;
"cell total" counts a quarter of the shared cast.
Prints each as a ratio to the torch.softmax pass, then the whole `diagnose` call.
Best of --repeat runs; one process, so the ratios share one machine state.
"""

from __future__ import annotations

import argparse
import time

import torch

from attncheck.diagnose import Options, _cast, _CellAcc, _CensusAcc, _Chunk, _DistAcc, diagnose
from attncheck.names import DTYPE_NAMES, METHOD_NAMES
from attncheck.precision import dtype_from_name
from attncheck.softmax import run_method


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements-log2", type=int, default=26)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kernels", choices=("fused", "torch"), default="fused", help="fused numba kernels (CPU default for large inputs) or torch ops")
    args = ap.parse_args()

    n = 1 << args.elements_log2
    rows = n // args.keys
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, args.keys, generator=g) * 3  # (R, T) fp32
    opts = Options(kernels=args.kernels)
    fused = args.kernels == "fused"
    chunk = max(1, opts.chunk_elements // args.keys)
    chunks = [x[i : i + chunk] for i in range(0, rows, chunk)]
    print(f"scores: {rows} rows x {args.keys} keys = 2^{args.elements_log2} fp32 elements ({x.numel() * 4 / 2**20:.0f} MiB); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; chunks of {chunk} rows; {args.kernels} kernels")
    if fused:  # compile outside the timings (numba caches it on disk for later runs)
        diagnose("warm-up", x[: 2 * chunk], Options(kernels="fused"))

    base = best_of(args.repeat, lambda: torch.softmax(x, dim=-1))
    print(f"torch.softmax fp32, one pass: {base * 1e3:.1f} ms (= 1.00x)")

    census = _CensusAcc(opts.dtypes)

    def shared():
        dist = _DistAcc(opts.collapse_threshold)
        out = []
        for i, c in enumerate(chunks):
            ch = _Chunk.of(c, i * chunk, 0.0, fused)
            census.update(ch)
            dist.update(ch)
            out.append(ch)
        return out

    t = best_of(args.repeat, shared)
    print(f"shared per tensor (census, float64 reference, entropy, distribution): {t * 1e3:.1f} ms = {t / base:.2f}x")
    facts = shared()
    print(f"{'cell':<12} {'cast+ref':>9} {'method':>8} {'metrics':>8} {'cell total':>11}   (cast+ref: once per dtype, shared by its 4 methods)")
    for d in DTYPE_NAMES:
        dt = dtype_from_name(d)
        t_cast = best_of(args.repeat, lambda: [_cast(ch, dt, census, d) for ch in facts])
        casts = [_cast(ch, dt, census, d) for ch in facts]
        for m in METHOD_NAMES:
            t_method = best_of(args.repeat, lambda: [run_method(m, xc, block=opts.block) for xc, *_ in casts])
            outs = [run_method(m, xc, block=opts.block) for xc, *_ in casts]

            def metrics():
                acc = _CellAcc(m, d, opts.max_examples)
                for ch, o, (_, made, ra, aok) in zip(facts, outs, casts):
                    causes = [("input_nan", ch.nan), ("inf_input", ch.posinf), ("fully_masked", ch.all_masked), ("cast_overflow", made)]
                    acc.update(ch, o.probs, o.overflow_rows, o.underflow_rows, ra, aok, causes)

            t_metrics = best_of(args.repeat, metrics)
            total = t_cast / len(METHOD_NAMES) + t_method + t_metrics
            print(f"{m + '/' + d:<12} {t_cast / base:>8.2f}x {t_method / base:>7.2f}x {t_metrics / base:>7.2f}x {total / base:>10.2f}x")

    t = best_of(1, lambda: diagnose("bench", x, opts))
    print(f"whole diagnose (12 cells + shared work, one call): {t:.2f} s = {t / base:.1f}x one torch.softmax pass")


if __name__ == "__main__":
    main()
