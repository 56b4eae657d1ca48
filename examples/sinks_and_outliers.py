"""A tiny GPT-2 from its config (random weights, nothing downloaded) with an attention sink, an outlier channel
and a massive activation planted in head 0 of layer 0, as trained models grow them: the first position's
embedding points along one direction, k's channel 0 of head 0 reads that direction (so the first token's k is
massive there, and the channel dwarfs the head's others) and q's bias reads it back (so every query looks at the
first token). Captured and run, the report marks head 0 of layer 0:

    attncheck capture --out sinks --quiet -- examples/sinks_and_outliers.py
    attncheck run sinks

    python examples/sinks_and_outliers.py   (runs the model once)
"""

import torch
import transformers

torch.manual_seed(0)
n_embd, n_head, head_dim = 64, 4, 16
config = transformers.GPT2Config(
    n_layer=2, n_head=n_head, n_embd=n_embd, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
)
model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
with torch.no_grad():
    e = torch.zeros(n_embd)
    e[0], e[1] = 1.0, -1.0  # zero mean: LayerNorm keeps the direction
    model.transformer.wpe.weight[0] += 50.0 * e  # position 0 points along e
    attn = model.transformer.h[0].attn.c_attn  # Conv1D: (n_embd, 3 * n_embd), q | k | v
    attn.weight[:, n_embd + 0] = 25.0 * e  # k channel 0 of head 0 reads e: ~200 at the first token
    attn.bias[0] = 0.2  # q channel 0 of head 0: every query weighs that channel
ids = torch.randint(0, 128, (1, 32))
with torch.no_grad():
    logits = model(input_ids=ids).logits
print(f"logits {tuple(logits.shape)}, finite: {bool(torch.isfinite(logits).all())}")
