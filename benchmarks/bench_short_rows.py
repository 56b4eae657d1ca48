"""Peak memory and wall time of `attncheck run` by row length, within --max-memory.

    python benchmarks/bench_short_rows.py [DIR] [--shapes 4194304x1,1048576x64,65536x1024]
                                          [--budgets 512MiB,default] [--keep]

Writes one fp32 .npy file per shape (unit-variance logits x 3; default: 4M rows x 1 key,
2^20 x 64 and 65,536 x 1,024, 16 MiB, 256 MiB and 256 MiB) into DIR (default: a temporary
directory) and runs, in a fresh subprocess each,

    python -m attncheck run FILE --quiet --brief --json OUT [--max-memory BUDGET]

(all 12 default cells; `default` = no --max-memory, i.e. 1 GiB), printing the wall time and
the child's peak RSS (getrusage of a bare launcher, so the launcher's own memory does not
count), next to the peak of the interpreter with torch and attncheck imported. The chunk
size should keep each peak within the budget plus that base, whatever the row length.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAUNCHER = r"""
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
"""

BASE = "import torch, attncheck.pipelines.run, attncheck.numerics.backends.numba_rows"


def peak_mib(args: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()), time.perf_counter() - start


def write_scores(path: Path, rows: int, keys: int, seed: int = 0) -> None:
    """(rows, keys) fp32 logits, written in pieces so no copy of the whole is needed beyond the file."""
    g = np.random.default_rng(seed)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, keys))
    step = max(1, (1 << 24) // keys)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        arr[start:stop] = g.standard_normal((stop - start, keys), dtype=np.float32) * 3
    arr.flush()
    del arr


def shape_of(text: str) -> tuple[int, int]:
    rows, keys = text.lower().split("x")
    return int(rows), int(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", help="where to write the files (default: a temporary directory)")
    ap.add_argument("--shapes", default="4194304x1,1048576x64,65536x1024")
    ap.add_argument("--budgets", default="512MiB,default", help="--max-memory values; 'default' passes none")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="attncheck-short-"))
    root.mkdir(parents=True, exist_ok=True)
    base, _ = peak_mib([sys.executable, "-c", BASE])
    print(f"interpreter + torch + attncheck: {base} MiB peak RSS")
    print(f"{'file':<26} {'--max-memory':>12} {'wall':>8} {'peak RSS':>10} {'over base':>10}")
    try:
        for text in args.shapes.split(","):
            rows, keys = shape_of(text)
            path = root / f"scores_{rows}x{keys}.npy"
            if not path.exists():
                write_scores(path, rows, keys)
            for budget in args.budgets.split(","):
                cmd = [
                    sys.executable,
                    "-m",
                    "attncheck",
                    "run",
                    str(path),
                    "--quiet",
                    "--brief",
                    "--json",
                    str(root / "r.json"),
                ]
                if budget != "default":
                    cmd += ["--max-memory", budget]
                peak, wall = peak_mib(cmd)
                label = f"{rows:,} x {keys:,}"
                print(f"{label:<26} {budget:>12} {wall:>7.1f}s {peak:>7} MiB {peak - base:>6} MiB", flush=True)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
