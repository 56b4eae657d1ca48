"""The model report at model scale: `attncheck run CAPTURE` and `attncheck.capture(diagnose=True)`
against the model's own forward, measured in this one script.

    python benchmarks/bench_model.py [--seq 1024] [--layers 8] [--repeat 3] [--max-memory 1GiB] [--what-if fp16]

A Llama-style model (hidden 1024, 16 heads, 4 kv heads, head dim 64, --layers layers) built from
its config with random weights runs one forward over one sequence of --seq tokens in bf16 with
SDPA. Printed, each the least over --repeat runs after a warm-up:

  forward   the forward alone (torch.no_grad), as the model runs in a process of its own, and again once
            the attncheck command's glibc setting (freed memory kept for reuse) is on: it speeds up
            the forward too, so both ratios are printed
  run       `attncheck run DIR` as a library call on the capture of that forward (the options the
            command line gives it: chunks within --max-memory), and its ratio to the forward
  diagnose  the forward under attncheck.capture(diagnose=True) (nothing written), and its ratio
  cli       `attncheck run DIR --quiet` as a command (the interpreter's start and torch's import included)
  peak      the peak RSS of the first library run above the RSS before it (Linux: VmHWM after resetting it)

With --what-if, the run also answers that what-if (its cost is printed on its own line).
This is a benchmark, not a test: it takes a minute or two.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_run import best_of  # this folder: run as python benchmarks/bench_model.py


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def model_for(layers: int, seq: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=max(seq, 2048),
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16).eval()


def main() -> None:
    import attncheck
    from attncheck import params
    from attncheck.cli.common import reuse_freed_memory
    from attncheck.config.run import Options, RunRequest, chunk_elements_for
    from attncheck.pipelines.run import run

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-memory", default="1GiB")
    ap.add_argument("--what-if", default=None)
    args = ap.parse_args()
    memory = params.size(args.max_memory, "max_memory")
    options = Options(chunk_elements=chunk_elements_for(memory))
    model = model_for(args.layers, args.seq)
    ids = torch.randint(0, 1000, (1, args.seq), generator=torch.Generator().manual_seed(1))

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    forward()
    t_own = best_of(args.repeat, forward)  # the model in a process of its own
    reuse_freed_memory()  # as the attncheck command does, from here on
    work = Path(tempfile.mkdtemp(prefix="attncheck-bench-model-"))
    try:
        cap = work / "cap"
        with torch.no_grad(), attncheck.capture(cap, max_bytes=None):
            model(input_ids=ids)
        request = RunRequest((str(cap),), options=options, max_memory=memory)

        def diagnose_run():
            with torch.no_grad(), attncheck.capture(diagnose=True, options=options) as c:
                model(input_ids=ids)
            return c

        forward()
        rss = status_mib("VmRSS")
        reset_peak()
        result = run(
            request
        )  # the first run: its peak is the one a user sees (kernels compiled, or read from their cache)
        peak = status_mib("VmHWM") - rss
        diagnose_run()  # warm
        t_forward = best_of(args.repeat, forward)
        t_run = best_of(args.repeat, lambda: run(request))
        t_diag = best_of(args.repeat, diagnose_run)
        calls = len(result.calls)
        print(
            f"{args.layers} layers x 16 heads (4 kv heads), head dim 64, bf16, SDPA, 1 x {args.seq} tokens: {calls} "
            "calls, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print(
            f"  forward                      {t_own:.3f} s in a process of its own; {t_forward:.3f} s with freed "
            "memory kept for reuse"
        )
        print(
            f"  attncheck run CAPTURE        {t_run:.3f} s  ({t_run / t_own:.1f}x the forward; "
            f"{t_run / t_forward:.1f}x the tuned one)"
        )
        print(
            f"  capture(diagnose=True)       {t_diag:.3f} s  ({t_diag / t_own:.1f}x the forward; "
            f"{t_diag / t_forward:.1f}x the tuned one; the forward included)"
        )
        print(f"  peak RSS of the run          +{peak:.0f} MiB above {rss:.0f} MiB (--max-memory {args.max_memory})")
        line = result.model.lines[0]
        print(
            f"  verdict: first call that goes wrong {result.model.first_bad}; cell {line.cell}, room "
            f"{line.headroom:.3g}"
        )
        if args.what_if:
            asked = RunRequest((str(cap),), options=options, max_memory=memory, what_if=(args.what_if,))
            t_what = best_of(args.repeat, lambda: run(asked))
            answers = ", ".join(f"{a.cell} {a.verdict}" for a in run(asked).model.what_if)
            print(f"  run --what-if {args.what_if:<13} {t_what:.3f} s  ({t_what / t_own:.1f}x the forward): {answers}")
        cmd = [sys.executable, "-m", "attncheck", "run", str(cap), "--quiet", "--max-memory", args.max_memory]
        t_cli = best_of(args.repeat, lambda: subprocess.run(cmd, check=True, capture_output=True))
        print(f"  the command (start included) {t_cli:.3f} s  ({t_cli / t_own:.1f}x the forward)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
