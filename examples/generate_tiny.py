"""model.generate() on a tiny Llama-style model from its config (random weights, nothing downloaded; 2 layers, GQA:
4 query heads over 2 kv heads, SDPA, bf16): a prompt of 96 tokens and 32 new ones, greedy. Captured, every decode
step is recorded and stored by its new K and V rows, and `attncheck run` groups them per layer:

    attncheck capture --out gen-capture -- examples/generate_tiny.py
    attncheck run gen-capture --fail-on error,warning,nan

    python examples/generate_tiny.py   (runs the generation once)
"""

import torch
import transformers

torch.manual_seed(0)
config = transformers.LlamaConfig(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=128,
    intermediate_size=256,
    vocab_size=256,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
prompt = torch.randint(1, 256, (1, 96), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
print(f"generated {out.shape[-1] - prompt.shape[-1]} tokens after a prompt of {prompt.shape[-1]}")
