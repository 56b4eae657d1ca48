"""Overhead of ``attncheck.watch`` on a training step, with ``every=1``.

    python benchmarks/bench_watch.py [--layers 6] [--width 384] [--heads 6] [--seq 512] [--batch 1] [--steps 5]
        [--impl sdpa|eager]

A GPT-2-style model built from its config (random weights) trains on one batch of --seq tokens
with AdamW: blocks of --steps steps are timed alone and under one attncheck.watch(model, log=FILE)
(recording every step, with its backward's gradient counts), --rounds of each, interleaved; each
figure is the median over the steps (the first of each block left out: it sets the watch up). The
goal is at most 5% of a step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    import transformers

    import attncheck
    from attncheck.cli.common import reuse_freed_memory

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="steps per block")
    ap.add_argument("--rounds", type=int, default=4, help="blocks of each, interleaved")
    ap.add_argument("--impl", default="sdpa", choices=("sdpa", "eager"))
    args = ap.parse_args()
    reuse_freed_memory()  # as the attncheck command does
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=args.heads,
        vocab_size=1000,
        n_positions=args.seq,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation=args.impl).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    folder = Path(tempfile.mkdtemp(prefix="attncheck-bench-watch-"))
    step()
    with attncheck.watch(model, log=folder / "warm.jsonl"):
        step()
    alone, watched = [], []
    for r in range(
        args.rounds
    ):  # blocks of steps, interleaved: the machine's drift hits both alike; each block's first step left out
        alone += [step() for _ in range(args.steps + 1)][1:]
        with attncheck.watch(model, log=folder / f"round{r}.jsonl", every=1) as w:
            watched += [step() for _ in range(args.steps + 1)][1:]
    a, b = statistics.median(alone), statistics.median(watched)
    print(
        f"GPT-2 style: {args.layers} layers, width {args.width}, {args.heads} heads, {args.impl}, {args.batch} x "
        f"{args.seq} tokens, AdamW; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"  training step alone        {a:.3f} s (median of {len(alone)}; min {min(alone):.3f})")
    print(f"  under attncheck.watch      {b:.3f} s (median; min {min(watched):.3f})")
    print(
        f"  overhead                   {100 * (b - a) / a:+.1f}% of a step (goal <= 5%); {len(w.records)} records, "
        f"last with {len(w.records[-1]['calls'])} calls"
    )


if __name__ == "__main__":
    main()
