"""A gpt-oss-style model with learned attention sinks, for `attncheck capture`: a tiny GptOss built from its config
(random weights, nothing downloaded; 2 layers, one sliding-window and one full, GQA, 4 experts), eager attention in
bf16, where every head's sink logit joins the softmax's denominator. Random init draws the sinks from N(0, 0.02):
near the rows' max, so each sink takes a real share of its rows. ``--sinks VALUE`` sets every sink to VALUE (-30:
far below every row's max, a sink that changes nothing in bf16).

    attncheck capture --out gptoss --quiet -- examples/learned_sinks.py [--sinks VALUE]
    python examples/learned_sinks.py [--sinks VALUE]   (runs the model once)
"""

import argparse

import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("--sinks", type=float, default=None, help="set every head's sink logit to this value")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
parser.add_argument("scratch", nargs="?", help="a scratch directory, as every example takes one (unused here)")
args = parser.parse_args()

torch.manual_seed(0)
config = transformers.GptOssConfig(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=128,
    sliding_window=8,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # no YaRN for a 64-token toy
)
dtype = getattr(torch, args.dtype)
model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype).eval()
if args.sinks is not None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(args.sinks)
ids = torch.randint(0, 128, (2, 16))
with torch.no_grad():
    logits = model(input_ids=ids).logits
sinks = torch.stack([layer.self_attn.sinks.float() for layer in model.model.layers])
print(
    f"logits {tuple(logits.shape)} {args.dtype}, finite: {bool(torch.isfinite(logits).all())}; sinks {sinks.tolist()}"
)
