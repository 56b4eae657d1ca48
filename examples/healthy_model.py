"""A healthy transformers model for CI: a small GPT-2 built from its config (random weights, nothing
downloaded), SDPA attention, a left-padded batch. Captured, it reports 0 errors and 0 warnings:

    attncheck capture --out ci-model --quiet --fail-on error,warning,nan -- examples/healthy_model.py
    attncheck run ci-model --quiet --what-if fp16,bf16 --fail-on error,warning,nan,what-if:nan

    python examples/healthy_model.py [OUTDIR]   (runs the model once; OUTDIR is ignored)
"""

import torch
import transformers

torch.manual_seed(0)
config = transformers.GPT2Config(
    n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
)
model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
ids = torch.randint(0, 128, (2, 24))
mask = torch.ones(2, 24, dtype=torch.long)
mask[1, :5] = 0  # left padding: the first queries of row 1 may attend to nothing
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
print(f"logits {tuple(logits.shape)}, finite: {bool(torch.isfinite(logits).all())}")
