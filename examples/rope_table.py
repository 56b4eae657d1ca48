"""A transformers Llama whose rotary table is computed in bf16, for `attncheck capture` to record.

A 1-layer Llama built from its config (random weights, nothing downloaded) reads 512 tokens. With
``--bf16-table`` its rotary embedding computes the positions and inverse frequencies in bf16 before
the product, as candle's qwen2 did before huggingface/candle PR 3520: bf16 holds integers exactly
only up to 256, so from position 257 on neighbouring positions share one row of the table. Without
the flag the model computes the table as transformers does (fp32, then cast). With ``--bf16-weights``
the model is loaded in bf16 with ``dtype=`` (its ``inv_freq`` and angles stay fp32, cos and sin are
cast to bf16, q and k are bf16): a healthy bf16 model. With ``--llama3`` the config
carries Llama 3.1's RoPE scaling (rope_type llama3, theta 500,000, factor 8 over 8,192 original positions), whose
inverse frequencies are the default ones rescaled by wavelength.

    attncheck capture --out rope-bf16 -- examples/rope_table.py --bf16-table
    attncheck capture --out rope-llama3 -- examples/rope_table.py --llama3
"""

import sys

import torch
import transformers

torch.manual_seed(0)
llama3 = {  # Llama 3.1's rope_scaling (meta-llama/Llama-3.1-8B's config.json)
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
config = transformers.LlamaConfig(
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,  # head dim 16
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=131072 if "--llama3" in sys.argv[1:] else 4096,  # Llama 3.1's, beyond its 8,192
    rope_parameters=llama3 if "--llama3" in sys.argv[1:] else None,
)
dtype = torch.bfloat16 if "--bf16-weights" in sys.argv[1:] else torch.float32
model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype).eval()

if "--bf16-table" in sys.argv[1:]:
    rope = model.model.rotary_emb

    def bf16_table(x, position_ids):
        freqs = position_ids[..., None].bfloat16() * rope.inv_freq.bfloat16()  # (B, T, d/2) in bf16
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rope.forward = bf16_table

with torch.no_grad():
    model(torch.randint(0, 64, (1, 512), generator=torch.Generator().manual_seed(1)))
