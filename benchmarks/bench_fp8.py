"""Cost of the FP8 cells against one torch.softmax pass over the same scores.

    python benchmarks/bench_fp8.py [--elements-log2 24] [--keys 1024] [--repeat 3]

Scores mode: an fp32 score tensor of 2**N elements (logits x 3). The marginal cost of the
``tiled/e4m3`` cell (FlashAttention's online softmax with P scaled by S = 256 and cast to
e4m3, with every metric, the P-cast counts and the accumulation) is the time of one
``diagnose`` call computing tiled in fp32 and e4m3 less the time of the call computing
tiled in fp32 alone; the same for ``e5m2``.

Q/K mode: q, k, v of (1, H, T, 128) with T = keys and H*T rows, 2**N scores; the
marginal cost of the ``flash-fp8/e4m3`` and ``sage/e4m3`` cells is measured the same way
against the ``flash/fp16`` call (their quantisation of Q, K, V included).

All figures are ratios to one float32 torch.softmax pass over a tensor of the same shape,
each the least over --repeat runs, in this one process (glibc told to reuse freed memory,
as the attncheck command does). The target (issue: an FP8 cell costs at most 3x that pass)
is the scores-mode figure.
"""

from __future__ import annotations

import argparse

import torch
from bench_run import best_of  # this folder is on sys.path when run as a script

from attncheck.cli.common import reuse_freed_memory
from attncheck.judge import diagnose, diagnose_attention
from attncheck.numerics.cells.diagnose import Options
from attncheck.numerics.inputs.scores import prepare_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements-log2", type=int, default=24)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    reuse_freed_memory()

    n = 1 << args.elements_log2
    rows = n // args.keys
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, args.keys, generator=g) * 3  # (R, T) fp32
    print(
        f"scores: {rows} rows x {args.keys} keys = 2^{args.elements_log2} fp32 elements; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    base = best_of(args.repeat, lambda: torch.softmax(x, dim=-1))
    print(f"torch.softmax fp32, one pass: {base * 1e3:.1f} ms (= 1.00x)")
    buf = torch.empty_like(x)
    pre = best_of(args.repeat, lambda: torch._softmax(x, -1, False, out=buf))
    print(
        f"torch.softmax fp32 into a preallocated output: {pre * 1e3:.1f} ms (= {pre / base:.2f}x; the cells below are "
        f"{base / pre:.1f} times as many of these)"
    )
    buf = None  # 256 MiB given back before the diagnosis

    def run(dtypes):
        opts = Options(dtypes=dtypes, methods=("tiled",))
        return best_of(args.repeat, lambda: diagnose("bench", x, opts))

    run(("fp32", "e4m3"))  # warm-up: numba kernels compiled or loaded from the cache
    alone = run(("fp32",))
    print(f"diagnose, tiled/fp32 alone: {alone:.3f} s = {alone / base:.1f}x")
    for d in ("e4m3", "e5m2"):
        both = run(("fp32", d))
        print(f"tiled/{d} cell (marginal): {(both - alone) * 1e3:.1f} ms = {(both - alone) / base:.2f}x")

    heads = max(1, rows // args.keys)
    q, k, v = (torch.randn(1, heads, args.keys, 128, generator=g) for _ in range(3))
    inputs = prepare_inputs(q, k, v=v)

    def run_qk(paths, dtypes):
        opts = Options(dtypes=dtypes, methods=("torch",), paths=paths)
        return best_of(args.repeat, lambda: diagnose_attention("bench", inputs, opts))

    flash = run_qk(("flash",), ("fp16",))
    print(
        f"Q/K mode, {heads} heads x {args.keys} queries x {args.keys} keys, d 128: diagnose_attention flash/fp16 "
        "alone: "
        f"{flash:.3f} s = {flash / base:.1f}x"
    )
    for path in ("flash-fp8", "sage"):
        both = run_qk(("flash", path), ("fp16", "e4m3"))
        print(f"{path}/e4m3 cell (marginal): {(both - flash) * 1e3:.1f} ms = {(both - flash) / base:.2f}x")


if __name__ == "__main__":
    main()
