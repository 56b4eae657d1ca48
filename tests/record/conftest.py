"""Tiny transformers models built from configs with random init (nothing is downloaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 64


def gpt2(impl: str, dtype=torch.float32, layers: int = 2, heads: int = 4, width: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def llama_gqa(impl: str = "sdpa", dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def bert(impl: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.BertModel._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def qwen2(impl: str = "sdpa", dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def t5(impl: str = "sdpa", dtype=torch.float32, seed: int = 0):
    """T5 scales nothing: its scale is folded into the weights' initialisation (SDPA gets scale=1.0)."""
    torch.manual_seed(seed)
    cfg = transformers.T5Config(
        num_layers=2,
        num_heads=4,
        d_model=32,
        d_kv=8,
        d_ff=64,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5Model._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def gemma2(dtype=torch.float32, seed: int = 0, softcap: float | None = 50.0):
    """Gemma-2 as it ships: eager attention, logits soft-capped (cap x tanh(S x scale / cap)), its scale
    1/sqrt(query_pre_attn_scalar) = 1/16 with head_dim 32 (not 1/sqrt(32)), GQA 4 query heads over 2 kv heads."""
    torch.manual_seed(seed)
    cfg = transformers.Gemma2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        head_dim=32,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=softcap,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    return transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=dtype).eval()


def vit(impl: str = "sdpa", dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    return transformers.ViTModel._from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def batch(b: int = 2, t: int = 12, left_pad: int = 0, right_pad: int = 0, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    if left_pad:
        mask[0, :left_pad] = 0
    if right_pad:
        mask[0, t - right_pad :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def mark_cuda(capture_dir, backend: str, capability: str = "9.0") -> None:
    """A CPU capture rewritten as a GPU capture writes it (CI has no GPU)."""
    from attncheck.testing import as_gpu_capture

    as_gpu_capture(capture_dir, backend, capability)
