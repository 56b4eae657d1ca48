"""Is an FP8 KV cache safe for this model? A small Llama-style model (grouped-query attention, bf16, built from its
config: random weights, nothing downloaded) with V outliers planted in one kv head of one layer: the rows of layer
1's v_proj that make kv head 1 are scaled so that V's amax passes e4m3's 448. Captured, the KV-cache what-if names
that layer and head at unit scale (a checkpoint without k_scale/v_scale) and shows per-head scales holding it:

    attncheck capture --out kv-capture --quiet -- examples/kv_cache_outliers.py
    attncheck run kv-capture --what-if kv:fp8_e4m3 --brief

    python examples/kv_cache_outliers.py [--healthy]   (--healthy: no outliers planted)
"""

import sys

import torch
import transformers

LAYER, KV_HEAD, HEAD_DIM = 1, 1, 16

torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    initializer_range=0.1,  # activations of order 1, as a trained model's K and V are
)
model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
if "--healthy" not in sys.argv[1:]:
    with torch.no_grad():  # v_proj's output rows of kv head 1: V = x W^T, so that head's V grows 1,000 times
        model.model.layers[LAYER].self_attn.v_proj.weight[KV_HEAD * HEAD_DIM : (KV_HEAD + 1) * HEAD_DIM] *= 1000
ids = torch.randint(0, 128, (2, 32))
with torch.no_grad():
    logits = model(input_ids=ids).logits
print(f"logits {tuple(logits.shape)}, finite: {bool(torch.isfinite(logits).all())}")
