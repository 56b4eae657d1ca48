"""Time the default ``attncheck sweep`` grid in-process.

    .venv/bin/python benchmarks/bench_sweep.py [--repeat 3] [--threads N] [--render]

Prints the grid, torch's thread count and seconds per run (best and median).
The issue's budget is 10 s on a 2-core CPU. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch
from rich.console import Console

from attncheck.config.sweep import SweepConfig
from attncheck.pipelines.sweep import run_sweep
from attncheck.report.sweep import print_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--render", action="store_true", help="include rendering the tables (to a string)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = SweepConfig()
    print(
        f"default grid: d_k {list(config.dks)}, scales {[s.name for s in config.scales]}, "
        f"dtypes {list(config.dtypes)}, methods {list(config.methods)}, seq {list(config.seqs)}, "
        f"rows {config.rows}: {config.points} points x {len(config.dtypes) * len(config.methods)} cells"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    times = []
    for i in range(args.repeat):
        start = time.perf_counter()
        result = run_sweep(config)
        if args.render:
            print_sweep(Console(file=io.StringIO(), width=120), result)
        times.append(time.perf_counter() - start)
        print(f"run {i + 1}: {times[-1]:.2f} s")
    print(f"best {min(times):.2f} s, median {statistics.median(times):.2f} s (budget 10 s on 2 cores)")


if __name__ == "__main__":
    main()
