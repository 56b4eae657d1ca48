"""Capture every attention call of a transformers model, then find the first one that goes wrong.

A 4-layer GPT-2 built from its config (random weights, nothing downloaded) runs in fp16 with
eager attention on a left-padded batch. One head of layer 2 has its q and k projections
scaled up, as after a training step that blew up: its Q@K^T overflows fp16, the softmax
sees +inf, and those rows come out NaN. ``attncheck.capture`` records every call without
touching the model; ``attncheck run`` on the capture names layer 2, head 5 and qk_overflow.

    python examples/capture_transformers.py [OUTDIR]
"""

import json
import sys

import torch
import transformers
from _common import output_dir

import attncheck
from attncheck.cli import app

out = output_dir()
torch.manual_seed(0)
config = transformers.GPT2Config(
    n_layer=4, n_head=8, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0, pad_token_id=0
)
model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager", dtype=torch.float16).eval()
layer, head, d, width = 2, 5, 8, 64
with torch.no_grad():  # c_attn's output columns: q | k | v, each head d wide
    w = model.transformer.h[layer].attn.c_attn.weight
    w[:, head * d : (head + 1) * d] *= 2500
    w[:, width + head * d : width + (head + 1) * d] *= 2500

ids = torch.randint(1, 128, (2, 16))
mask = torch.ones(2, 16, dtype=torch.long)
mask[0, :4] = 0  # left padding: those queries attend to nothing (a finfo(fp16).min row)

capture_dir = out / "gpt2-capture"
with torch.no_grad(), attncheck.capture(capture_dir) as cap:
    logits = model(input_ids=ids, attention_mask=mask).logits
print(f"recorded {len(cap.calls)} calls: {', '.join(c['file'] for c in cap.calls)}")
print("NaN in the model's logits:", bool(torch.isnan(logits).any()))

report = out / "gpt2-capture.json"
args = ["run", str(capture_dir), "--ignore", "fully_masked_rows", "--json", str(report)]
print("$ attncheck", " ".join(args), flush=True)
if app(args, standalone_mode=False) != 0:  # the command line, in this process
    sys.exit("attncheck run failed")
first = json.loads(report.read_text())["model"]["first_bad"]
if (first["module"], first["first_cause"], first["heads"]) != (f"transformer.h.{layer}.attn", "qk_overflow", [head]):
    sys.exit(f"expected layer {layer} head {head} with qk_overflow, got {first}")
print(f"\nfirst call that goes wrong: {first['module']} head {first['heads'][0]} ({first['first_cause']}), as expected")
