"""Cost of diagnosing a call's backward against diagnosing its forward, on one attention call of
model size.

    python benchmarks/bench_backward.py [--seq 1024] [--heads 16] [--kv-heads 4] [--dim 64] [--dtype bf16]
        [--repeat 3] [--max-memory 1GiB]

One SDPA call (batch 1, --heads query heads over --kv-heads kv heads, head dim --dim, --seq tokens,
causal, in --dtype) runs through PyTorch's CPU flash kernel with autograd, giving dO, dQ, dK, dV.
Then, as ``attncheck run`` diagnoses a captured call (its model cell: flash in the dtype):

  forward    diagnose_call with q, k, v only
  backward   diagnose_call with the output, dO and the kernel's gradients too, minus the forward
             (the backward of the model cell against float64, with FlashAttention's 2x rule's
             plain-attention baseline, and the recorded gradients compared)

Each is the least over --repeat runs after a warm-up, in one process; the goal is backward <= 3x forward.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_run import best_of  # noqa: E402  this folder: run as python benchmarks/bench_backward.py


def main() -> None:
    from attncheck import params
    from attncheck.cli.common import reuse_freed_memory
    from attncheck.config.run import Options, chunk_elements_for
    from attncheck.judge import diagnose_call
    from attncheck.numerics.precision import dtype_from_name
    from attncheck.results import CallInfo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-memory", default="1GiB")
    args = ap.parse_args()
    reuse_freed_memory()  # as the attncheck command does
    dt = dtype_from_name(args.dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.seq, args.dim, generator=g).to(dt).requires_grad_()
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.dim, generator=g).to(dt).requires_grad_() for _ in range(2))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=args.kv_heads != args.heads)
    dout = (torch.randn(out.shape, generator=g) * 1e-3).to(dt)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    forward = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
    backward = {**forward, "out": out.detach(), "grad_out": dout, "grad_q": dq, "grad_k": dk, "grad_v": dv}
    info = CallInfo(
        0,
        "bench",
        "sdpa",
        module="layers.0.self_attn",
        dtype=args.dtype,
        is_causal=True,
        enable_gqa=args.kv_heads != args.heads,
        meta={"sdpa_backend": "flash_attention", "device": "cpu"},
    )
    options = Options(chunk_elements=chunk_elements_for(params.size(args.max_memory, "max_memory")))
    report = diagnose_call(info, backward, options)  # warm-up (kernels compiled or read from their cache)
    t_fwd = best_of(args.repeat, lambda: diagnose_call(info, forward, options))
    t_both = best_of(args.repeat, lambda: diagnose_call(info, backward, options))
    t_bwd = t_both - t_fwd
    b = report.diagnosis.cells[0].backward
    print(
        f"one SDPA call: 1 x {args.heads} heads ({args.kv_heads} kv) x {args.seq} tokens x {args.dim}, {args.dtype}, "
        "causal; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"  forward diagnosis   {t_fwd:.3f} s (model cell {report.diagnosis.cells[0].name})")
    print(
        f"  backward diagnosis  {t_bwd:.3f} s = {t_bwd / t_fwd:.2f}x the forward's (goal <= 3x); both together "
        f"{t_both:.3f} s"
    )
    print(
        f"  backward: NaN rows {b.nan_rows}; recorded gradients agree: {all(g.real_agrees for _, g in b.grads())}; "
        f"max ratio to the bound {max(g.real_bound_ratio or 0 for _, g in b.grads()):.3f}"
    )


if __name__ == "__main__":
    main()
