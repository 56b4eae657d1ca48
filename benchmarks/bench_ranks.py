"""`attncheck run CAPTURE` in one process against the same command split over torchrun's ranks.

    python benchmarks/bench_ranks.py [--seq 2048] [--layers 4] [--heads 8] [--ranks 2] [--repeat 2] [--what-if fp16]

A Llama-style model (head dim 64, --heads heads over 2 kv heads, --layers layers) built from its config with random
weights runs one forward over one sequence of --seq tokens in bf16 with SDPA, captured. Then, alternately, --repeat
times each (the least printed): `attncheck run CAPTURE --quiet --json FILE` as one process, and the same command under
`torchrun --standalone --nproc-per-node RANKS` (torchrun gives each rank OMP_NUM_THREADS=1 where it is not set; the
single process gets every core, as a user's would). Both are whole commands: the interpreter's start, torch's import
and (for torchrun) its agent and rendezvous are included. The two JSON reports are compared: they must be the same.

On a machine whose cores other work shares, the times move with it: run it on a quiet machine to quote it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def capture(out: Path, layers: int, heads: int, seq: int) -> None:
    import transformers

    import attncheck

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64 * heads,
        intermediate_size=128 * heads,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=max(seq, 2048),
    )
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attncheck.capture(out, max_bytes=None):
        model(input_ids=ids)


def timed(cmd: list[str], env: dict) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return seconds, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--what-if", default=None)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="attncheck-bench-ranks-") as tmp:
        work = Path(tmp)
        cap = work / "cap"
        capture(cap, args.layers, args.heads, args.seq)
        extra = ["--what-if", args.what_if] if args.what_if else []
        one = [sys.executable, "-m", "attncheck", "run", str(cap), "--quiet", *extra, "--json", str(work / "one.json")]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)]
        split = [*torchrun, "-m", "attncheck", "run", str(cap), "--quiet", *extra, "--json", str(work / "two.json")]
        t_one, t_split = [], []
        for _ in range(args.repeat):  # alternated, so that a busy spell of the machine falls on both
            t_one.append(timed(one, env)[0])
            t_split.append(timed(split, env)[0])
        same = (work / "one.json").read_text() == (work / "two.json").read_text()
    print(
        f"{args.layers} layers x {args.heads} heads (2 kv heads), head dim 64, bf16, SDPA, 1 x {args.seq} tokens: "
        f"{args.layers} calls; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    runs_one, runs_split = (", ".join(f"{t:.1f}" for t in ts) for ts in (t_one, t_split))
    print(f"  attncheck run, 1 process       {min(t_one):.1f} s  (runs: {runs_one})")
    print(f"  torchrun, {args.ranks} ranks               {min(t_split):.1f} s  (runs: {runs_split}); ", end="")
    print(f"{min(t_one) / min(t_split):.2f}x")
    print(f"  JSON reports identical: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
