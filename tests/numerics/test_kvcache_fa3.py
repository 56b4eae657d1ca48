"""FlashAttention-3's FP8 path reading an FP8 KV cache (kvcache.fa3_fp8_output) against a float64 re-computation
of its rounding points written here: Q times the fp32 reciprocal of its scale and K, V divided by theirs, each
clamped to 448 and cast to e4m3 (torch only for the cast); S = q8 k8^T times the descales and the softmax scale; key
blocks of 160 (FlashAttention-3's FP8 tile at head dim 16), visited last first, the running max rescaling the sums
and P = e4m3(exp(S - running max) x 2^8); O = sum P V8 / (sum x 2^8) times V's descale, rounded to bf16."""

import math

import numpy as np
import torch

from attncheck.numerics import kvcache as kc

E4M3 = torch.float8_e4m3fn
T, D, BLOCK = 360, 16, 160


def e4m3(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.clip(x, -448.0, 448.0).astype(np.float32)).to(E4M3).double().numpy()


def fa3_fp8_f64(q, k, v, causal, scale, qs, ks, vs):
    """q (Hq, T, D), k, v (T, D) float64 holding bf16 values; one kv head read by every query head."""
    q8 = e4m3(q.astype(np.float32) * (np.float32(1) / np.float32(qs)))
    k8 = e4m3((k.astype(np.float32) / np.float32(ks)).astype(np.float64))
    v8 = e4m3((v.astype(np.float32) / np.float32(vs)).astype(np.float64))
    s = q8 @ k8.T * (qs * ks * scale)
    s = np.where(causal, -np.inf, s)
    m = np.full(s.shape[:2] + (1,), -np.inf)
    total = np.zeros_like(m)
    acc = np.zeros(s.shape[:2] + (D,))
    for j in reversed(range(math.ceil(T / BLOCK))):
        keys = slice(j * BLOCK, min((j + 1) * BLOCK, T))
        new = np.maximum(m, s[..., keys].max(axis=-1, keepdims=True))
        base = np.where(np.isneginf(new), 0.0, new)
        e = np.exp(s[..., keys] - base)
        alpha = np.exp(m - base)
        total = total * alpha + e.sum(axis=-1, keepdims=True)
        acc = acc * alpha + e4m3(e * 256) @ v8[keys]
        m = new
    out = acc / (total * 256) * vs
    return torch.from_numpy(out).bfloat16().double().numpy()


def test_fa3_fp8_reading_the_cache_against_float64_written_here():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, T, D, generator=g).bfloat16()
    k = torch.randn(1, 1, T, D, generator=g).bfloat16()
    v = (torch.randn(1, 1, T, D, generator=g) * 40).bfloat16()
    v[0, 0, 7, 3] = 900.0  # beyond 448 at scale 1: clipped on the write
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    bias = kc.mask_bias(causal, None, (1, 2, T, T))
    scale = D**-0.5
    for qs, ks, vs in ((1.0, 1.0, 1.0), (0.02, 0.01, 900.0 / 448)):
        got = kc.fa3_fp8_output(q, k, v, bias, scale, "fp8_e4m3", (qs, torch.tensor([ks]), torch.tensor([vs])))[0]
        want = fa3_fp8_f64(
            q[0].double().numpy(), k[0, 0].double().numpy(), v[0, 0].double().numpy(), causal.numpy(), scale, qs, ks, vs
        )
        # fp32 in the kernel, float64 here: an FP8 rounding of P may fall the other way, rarely; O's bf16 otherwise
        close = np.abs(got.numpy() - want) <= 2**-7 * np.abs(want) + 1e-6
        assert close.mean() > 0.999
        rel = np.linalg.norm(got.numpy() - want) / np.linalg.norm(want)
        assert rel < 1e-3, rel
    # the same cache read back to bf16 by FlashAttention-2 (16-bit products, Q not quantised) is not this: the FP8
    # products' error is what the consumer adds
    kq, vq = kc.quantise(k, "fp8_e4m3", ks, torch.bfloat16), kc.quantise(v, "fp8_e4m3", vs, torch.bfloat16)
    fa2 = kc.kernel_output(q, kq.values, vq.values, bias, scale, torch.bfloat16)[0].numpy()
    assert np.linalg.norm(fa2 - want) / np.linalg.norm(want) > 1e-2
