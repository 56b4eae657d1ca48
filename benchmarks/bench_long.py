"""Long calls in bounded time: a Llama-style model's captured forward and one long causal call, diagnosed with
``--budget`` against the model's own forward, the exact mode beside it, and the planted faults found.

    python benchmarks/bench_long.py [--seq 16384] [--layers 4] [--long 65536] [--long-heads 4] [--budget 10]
        [--long-budget 150] [--max-memory 8GiB] [--exact] [--ranks 2] [--out DIR] [--skip-model] [--skip-long]

Model: transformers' Llama from a config (random init): --layers layers, 16 heads over 4 kv heads, head dim
128, hidden 2048, MLP 512, vocabulary 256, bf16, SDPA, one sequence of --seq tokens. Planted faults, through
forward hooks on the projections: in layer 1, one query row whose |q| is raised (q_proj output, one token) so
that its Q@K^T reaches past 65,504 (fp16's limit) while bf16 and the fp32 scores of SDPA hold it; in the last
layer, a NaN in one row of q; and the rotary table computed in bf16 (positions and inverse frequencies cast before
their product, candle PR 3520), which the RoPE audit reports as ``rope_precision`` (``--no-rope`` leaves it out).

Timed (wall clock, this machine as loaded): the model's forward without capture; ``attncheck run CAPTURE
--what-if fp16 --budget B`` (a subprocess, its peak resident memory from getrusage); with ``--exact`` the same
command with every row (else its time is the sum of the calls' extrapolated exact times, said as an estimate);
with ``--ranks N`` the same command under ``torchrun --nproc-per-node N`` (issue 37: the 2-rank time).
Then one causal call of --long-heads heads x --long tokens (head dim 128, bf16) as q, k, v dumps:
``attncheck run --q --k --v --causal --budget B``. Goals (issue 37): the capture's run within 10x the forward;
the long call within 3 minutes on a 2-core CPU; peak memory within --max-memory plus the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def _run(argv: list[str], prefix: list[str] | None = None) -> tuple[float, float, dict, str]:
    """(seconds, peak RSS in GiB, JSON report, stdout) of one attncheck command in a child process (``prefix``:
    the interpreter's arguments before ``attncheck``, ``["-m"]`` unless given, e.g. torchrun's)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "report.json")
        proc = subprocess.run(
            [sys.executable, *(prefix or ["-m"]), "attncheck", *argv, "--quiet", "--json", js],
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        if proc.returncode not in (0, 1) or not os.path.exists(js):
            raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        with open(js) as f:
            doc = json.load(f)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB; the largest child so far
    return seconds, max(peak, before) / 2**20, doc, proc.stdout


def _dicts_with(doc, *keys: str) -> list[dict]:
    """Every dict anywhere in a JSON report that holds all of ``keys``, in document order."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if all(k in x for k in keys):
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    return found


def _codes(doc: dict) -> list[tuple]:
    """Every finding anywhere in a report as (code, severity), sorted: what two runs must agree on (their sampled
    figures may differ, a budget in seconds sampling as many rows as the time allows)."""
    return sorted((f["code"], f["severity"]) for f in _dicts_with(doc, "code", "severity"))


def _diagnoses(doc: dict) -> list[dict]:
    """Every tensor diagnosis in a report (a dict with cells and a census)."""
    return _dicts_with(doc, "cells", "census")


def model_part(args, out: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import attncheck

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=2048,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=max(args.seq, 2048),
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(1))
    row = args.seq * 5 // 7  # the query row whose Q@K^T overflows fp16 in an eager port (layer 1)
    nan_row = args.seq // 3  # the row of q holding a NaN (last layer: it does not reach other layers' keys)
    last = args.layers - 1

    def big(_, __, y):
        y = y.clone()
        y[0, row] *= args.factor
        return y

    def nan(_, __, y):
        y = y.clone()
        y[0, nan_row, 5] = float("nan")
        return y

    hooks = [
        model.model.layers[1 % args.layers].self_attn.q_proj.register_forward_hook(big),
        model.model.layers[last].self_attn.q_proj.register_forward_hook(nan),
    ]
    if not args.no_rope:  # the RoPE table in bf16 (candle PR 3520's recipe), judged by the RoPE audit (rope_precision)
        rope = model.model.rotary_emb

        def forward(x, position_ids):
            freqs = position_ids[..., None].bfloat16() * rope.inv_freq.bfloat16()
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        rope.forward = forward
    with torch.no_grad():
        model(ids)  # warm-up
        t0 = time.perf_counter()
        model(ids)
        forward = time.perf_counter() - t0
        with attncheck.capture(out, max_bytes=None, max_calls=None):
            model(ids)
    for h in hooks:
        h.remove()
    argv = ["run", out, "--what-if", "fp16", "--max-memory", args.max_memory]
    seconds, peak, doc, _ = _run([*argv, "--budget", str(args.budget)])
    diags = _diagnoses(doc)
    estimated = sum((d.get("sampling") or {}).get("estimated_exact_s") or 0 for d in diags)
    exact = _run(argv)[0] if args.exact else None
    ranks = None
    if args.ranks > 1:  # the same command split over torchrun's ranks (the agent's start and rendezvous included)
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), "-m"]
        ranks_s, ranks_peak, ranks_doc, _ = _run([*argv, "--budget", str(args.budget)], prefix=torchrun)
        ranks = {
            "ranks": args.ranks,
            "run_budget_s": round(ranks_s, 2),
            "ratio_to_forward": round(ranks_s / forward, 1),
            "peak_rss_gib_one_rank": round(ranks_peak, 2),
            "same_findings": _codes(ranks_doc) == _codes(doc),
        }
    found_overflow = any(
        c.get("dtype") == "fp16" and (c.get("nan_causes") or {}).get("qk_overflow") for d in diags for c in d["cells"]
    )
    found_nan = any((c.get("nan_causes") or {}).get("input_nan") for d in diags for c in d["cells"])
    return {
        "model": f"Llama {args.layers} layers, 16/4 heads, d 128, hidden 2048, bf16, SDPA, {args.seq:,} tokens",
        "forward_s": round(forward, 3),
        "run_budget_s": round(seconds, 2),
        "ratio_to_forward": round(seconds / forward, 1),
        "budget_s": args.budget,
        "exact_s": None if exact is None else round(exact, 2),
        "exact_estimate_s": round(estimated, 1) if estimated else None,
        "peak_rss_gib": round(peak, 2),
        "planted_qk_overflow_found": found_overflow,
        "planted_nan_found": found_nan,
        "planted_rope_bf16_found": None if args.no_rope else "rope_precision" in json.dumps(doc),
        "sampled_calls": sum(1 for d in diags if d.get("sampling")),
        "calls": len(diags),
        "torchrun": ranks,
    }


def long_part(args, out: str) -> dict:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    paths = []
    for name in ("q", "k", "v"):
        x = torch.randn(1, args.long_heads, args.long, 128, generator=g).to(torch.bfloat16)
        p = os.path.join(out, f"{name}.safetensors")
        save_file({name: x}, p)
        paths.append(p)
    del x
    argv = ["run", "--q", paths[0], "--k", paths[1], "--v", paths[2], "--causal", "--dtype", args.long_dtypes]
    argv += ["--max-memory", args.max_memory]
    seconds, peak, doc, _ = _run([*argv, "--budget", str(args.long_budget)])
    s = next((d.get("sampling") for d in _diagnoses(doc) if d.get("sampling")), None) or {}
    return {
        "call": f"causal, {args.long_heads} heads x {args.long:,} tokens, d 128, bf16; cells in {args.long_dtypes}",
        "run_budget_s": round(seconds, 2),
        "budget_s": args.long_budget,
        "exact_estimate_s": s.get("estimated_exact_s"),
        "sampled_rows": s.get("sampled_rows"),
        "exact_rows": s.get("exact_rows"),
        "peak_rss_gib": round(peak, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--factor", type=float, default=3000.0, help="how much the planted row's q is raised")
    ap.add_argument("--budget", type=float, default=10.0, help="--budget of the capture's run (seconds per diagnosis)")
    ap.add_argument("--long", type=int, default=65536)
    ap.add_argument("--long-heads", type=int, default=4)
    ap.add_argument("--long-budget", type=float, default=150.0)
    ap.add_argument("--long-dtypes", default="bf16", help="--dtype of the long call (fp16's naive softmax: see docs)")
    ap.add_argument("--max-memory", default="8GiB")
    ap.add_argument("--exact", action="store_true", help="also time the exact run of the capture")
    ap.add_argument("--ranks", type=int, default=1, help="also time the capture's run split over this many ranks")
    ap.add_argument("--no-rope", action="store_true", help="leave out the planted RoPE table in bf16")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--out", default=None, help="where the capture and dumps go (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        result = {"load_average": os.getloadavg(), "cpus": os.cpu_count()}
        if not args.skip_model:
            result["model"] = model_part(args, os.path.join(out, "capture"))
        if not args.skip_long:
            result["long"] = long_part(args, out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
