"""The FP8 tensor cores' accumulator in FlashAttention-3's FP8 forward: error against float64 by key length.

    python benchmarks/fp8_accumulator.py [--quick] [--json out.json]

Inputs: one head, 16 queries, d = 128, q and k from N(0, 1) (scaled scores of standard deviation 1: diffuse
attention, every key a small share), V from N(mean, 1) for two means: 0, and 4 (a common component in V, as
value vectors have; O then sits near the mean at every key length). Q, K, V quantised to e4m3 per head, as the
flash-fp8 path does (attncheck.numerics.paths.flash_fp8). For each key length the RMSE of O against float64
softmax(q k^T / sqrt(d)) v is printed for the same kernel with:

- fp32 accumulation (what FlashAttention-3's code assumes);
- Hopper's FP8 MMA accumulator (13 mantissa bits truncated after every 32-element step;
  attncheck.numerics.methods.fp8_accum), accumulating into O for the whole key range as upstream FA3 does;
- the same with a flush into an fp32 accumulator every 1, 4 and 64 key blocks of 224 (vLLM's two-level
  accumulation, vllm-project/flash-attention PRs 104 and 122, Dao-AILab/flash-attention PR 2250).

The column "x fp32" is the no-flush RMSE over the fp32 one; above 2 breaks FlashAttention's 2x rule (the
fp8_accumulator finding). As context, vLLM PR 122's figures: needle-in-a-haystack (multikey 2) at 128k keys on
Llama-3.1-8B with an FP8 KV cache, 0.89 / 0.88 / 0.856 with a flush every 1 / 4 / 64 steps. Those are a model's
accuracy on a task, measured on H100s: no CPU emulation of one attention call reproduces them, and this table
does not claim to; it shows the mechanism (the error of O growing with the key length, and the flush bounding it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's attncheck first

from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit  # noqa: E402
from attncheck.numerics.methods.fp8_attention import Fp8Setup, fa3_tile  # noqa: E402
from attncheck.numerics.methods.softmax import MethodParams  # noqa: E402
from attncheck.numerics.paths.flash_fp8 import forward  # noqa: E402

D = 128
QUERIES = 16
V_MEANS = (0.0, 4.0)
VARIANTS = {  # name -> (accum_bits, accum_flush)
    "fp32": (None, None),
    "13 bits": (13, None),
    "flush 1": (13, 1),
    "flush 4": (13, 4),
    "flush 64": (13, 64),
}
VLLM_PR122_NIAH = {"flush 1": 0.89, "flush 4": 0.88, "flush 64": 0.856}  # Llama-3.1-8B, FP8 KV, 128k keys


def rmse_by_variant(keys: int, v_mean: float, seed: int = 0) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, QUERIES, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, keys, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, keys, D, generator=g, dtype=torch.float64) + v_mean
    exact = torch.softmax(q[0, 0] @ k[0, 0].T / math.sqrt(D), dim=-1) @ v[0, 0]
    inp = prepare_inputs(q, k, v=v)
    out = {}
    for name, (bits, flush) in VARIANTS.items():
        setup = Fp8Setup(accum_bits=bits, accum_flush=flush, accum_companions=False)
        (blk,) = list(score_blocks(inp, inp.rows, q.device, start_audit(inp, statistics=False)))
        o = forward(blk, setup.fmt, [], MethodParams(fp8=setup)).cells[0][1].out
        out[name] = float((o.double() - exact).pow(2).mean().sqrt())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="key lengths 1k and 4k only (a test runs this)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    lengths = [1024, 4096] if args.quick else [1024 << i for i in range(7)]  # 1k .. 64k
    block = fa3_tile(D)[1]
    print(
        f"FlashAttention-3 FP8 forward (flash-fp8, e4m3, d = {D}, key blocks of {block}), {QUERIES} queries; "
        "RMSE of O against float64"
    )
    results = []
    start = time.perf_counter()
    for v_mean in V_MEANS:
        print(f"\nV ~ N({v_mean:g}, 1)")
        print(f"{'keys':>7} " + " ".join(f"{n:>10}" for n in VARIANTS) + f" {'x fp32':>7}  2x rule")
        for keys in lengths:
            r = rmse_by_variant(keys, v_mean)
            ratio = r["13 bits"] / r["fp32"]
            print(
                f"{keys:>7} "
                + " ".join(f"{r[n]:>10.3e}" for n in VARIANTS)
                + f" {ratio:>7.2f}  {'breaks' if ratio > 2 else 'holds'}"
            )
            results.append({"keys": keys, "v_mean": v_mean, "rmse": r, "ratio_13_bits_to_fp32": ratio})
    print(
        "\nContext, not reproduced here: vLLM PR 122 (vllm-project/flash-attention), needle-in-a-haystack multikey 2 "
        "at 128k keys, Llama-3.1-8B with an FP8 KV cache on H100s: "
        + " / ".join(f"{v:g}" for v in VLLM_PR122_NIAH.values())
        + " with a flush every "
        + " / ".join(n.split()[1] for n in VLLM_PR122_NIAH)
        + " steps. A task accuracy of a whole model: a CPU emulation of one attention call cannot reproduce it."
    )
    print(f"{time.perf_counter() - start:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "vllm_pr122_niah": VLLM_PR122_NIAH}, indent=1))


if __name__ == "__main__":
    main()
