"""model.generate() under capture: bytes and time against the prompt's prefill.

    python benchmarks/generate_capture.py [--prompt 128] [--new 64] [--impl sdpa] [--dtype bf16] [--layers 4]

A Llama-style model from its config (random weights; 4 layers, width 512, 8 query heads of 64 over 2 kv heads: GQA)
runs, each under attncheck.capture(DIR):

  prefill   one forward over the prompt (1 x PROMPT tokens)
  generate  model.generate(max_new_tokens=NEW, do_sample=False): the prefill and NEW - 1 decode steps per layer,
            each decode step stored by its new K and V rows (the default)
  whole     the same generate() with dedup_kv=False: every decode step's whole K and V written again
  plain     the same generate() without capture (its time alone)

For each: the calls recorded, the tensor bytes (the manifest's total_bytes, what --max-bytes bounds), the bytes of
its files on disk (headers and manifest included), the capture's wall time (the model's run included), and the time
of `attncheck run DIR` as a library call (default options), then the ratios against the prefill (after one
untimed capture and run, which pay for imports and compilation). Takes about a minute on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import transformers

import attncheck
from attncheck.config.run import RunRequest
from attncheck.pipelines.run import run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_of(impl: str, dtype: torch.dtype, layers: int, positions: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=512,
        intermediate_size=1024,
        vocab_size=1000,
        max_position_embeddings=positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def measure(directory: str, work) -> dict:
    t0 = time.perf_counter()
    with torch.no_grad():
        work()
    wall = time.perf_counter() - t0
    doc = json.loads(open(os.path.join(directory, "manifest.json"), encoding="utf-8").read())
    disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    t0 = time.perf_counter()
    result = run(RunRequest(paths=(directory,)))
    judged = time.perf_counter() - t0
    assert len(result.calls) == len(doc["calls"])
    return {"calls": len(doc["calls"]), "bytes": doc["total_bytes"], "disk": disk, "capture_s": wall, "run_s": judged}


def _warm(directory: str, model, ids) -> None:
    with attncheck.capture(directory):
        model(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--impl", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    model = model_of(args.impl, DTYPES[args.dtype], args.layers, args.prompt + args.new + 8)
    ids = torch.randint(1, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))

    def generate():
        model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        warm = os.path.join(tmp, "warm")  # the first capture and run pay for imports and compilation: not timed
        measure(warm, lambda: _warm(warm, model, ids))
        for name, dedup, work in (
            ("prefill", True, lambda: model(ids)),
            ("generate", True, generate),
            ("whole", False, generate),
        ):
            d = os.path.join(tmp, name)

            def captured(work=work, d=d, dedup=dedup):
                with attncheck.capture(d, dedup_kv=dedup):
                    work()

            rows[name] = measure(d, captured)
    t0 = time.perf_counter()
    with torch.no_grad():
        generate()
    plain = time.perf_counter() - t0
    print(
        f"Llama {args.layers} layers, 8 heads of 64 over 2 kv heads, {args.impl} {args.dtype}; prompt {args.prompt} "
        f"tokens, {args.new} new"
    )
    print(
        f"{'':9} {'calls':>5} {'tensor bytes':>13} {'x':>5} {'disk bytes':>11} {'x':>5} {'capture s':>9} {'run s':>6}"
    )
    base = rows["prefill"]
    for name, r in rows.items():
        print(
            f"{name:9} {r['calls']:5d} {r['bytes']:13,d} {r['bytes'] / base['bytes']:5.2f} {r['disk']:11,d} "
            f"{r['disk'] / base['disk']:5.2f} {r['capture_s']:9.2f} {r['run_s']:6.2f}"
        )
    print(f"generate() without capture: {plain:.2f} s")


if __name__ == "__main__":
    main()
