"""Capture overhead and the time to diagnose a capture, on a 12-layer, 12-head, 768-wide model.

    python benchmarks/bench_capture.py [--impl sdpa,eager] [--seq 1024] [--repeat 3] [--max-bytes 256MiB]
        [--skip-diagnose]

A GPT-2 with 12 layers, 12 heads and width 768 (built from its config, random weights) runs
one forward pass over a batch of 1 x SEQ tokens in fp32, for each attention implementation:

  plain     the forward alone
  capture   the forward under attncheck.capture(DIR): every call's tensors written to DIR
  direct    the same tensors (read back from DIR) written with safetensors.torch.save_file,
            one file per call, outside any forward: the bare cost of writing them
  inline    the forward with the same calls found by the same recorder but written on the spot
            with save_file (contiguous copies), as hand-written hooks would: writing them during
            a forward, on the same cores
  overhead  (capture - plain) / direct and (capture - plain) / (inline - plain): the goal is at most 2
            (--repeat rounds of the four, interleaved; the minimum and median of each)
  peak      peak RSS above the plain forward's (Linux: VmHWM after resetting it), for a capture
            to DIR (one call's tensors at a time) and kept in memory with --max-bytes
  diagnose  `attncheck run DIR` as a library call, all 12 cells (default options)

This is a benchmark, not a test: it takes minutes and ~1 GiB of disk for eager attention.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def model_for(impl: str, seq: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=12, n_head=12, n_embd=768, n_positions=seq, vocab_size=1024, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2Model._from_config(cfg, attn_implementation=impl).eval()


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from safetensors.torch import load_file, save_file

    import attncheck

    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="sdpa,eager")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-bytes", default="256MiB")
    ap.add_argument("--skip-diagnose", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    work = Path(tempfile.mkdtemp(prefix="attncheck-bench-"))
    try:
        for impl in args.impl.split(","):
            model = model_for(impl, args.seq)
            ids = torch.randint(0, 1024, (1, args.seq), generator=torch.Generator().manual_seed(1))

            def plain():
                with torch.no_grad():
                    model(input_ids=ids)

            def captured():
                out = work / "cap"
                shutil.rmtree(out, ignore_errors=True)
                with torch.no_grad(), attncheck.capture(out, max_bytes=None, max_calls=None):
                    model(input_ids=ids)

            plain()  # warm up
            captured()
            calls = sorted((work / "cap").glob("*.safetensors"))
            tensors = [load_file(str(p)) for p in calls]
            total = sum(t.numel() * t.element_size() for call in tensors for t in call.values())

            def direct():
                out = work / "direct"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                for i, call in enumerate(tensors):
                    save_file(call, str(out / f"{i:04d}.safetensors"))

            def inline():
                from attncheck.record.mode import Recorder

                out = work / "inline"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()

                def save(call):
                    save_file(
                        {k: v.detach().contiguous() for k, v in call.tensors.items()},
                        str(out / f"{call.index:04d}.safetensors"),
                    )

                with torch.no_grad(), Recorder(save):
                    model(input_ids=ids)

            # interleaved, so that the load of a shared machine drifts alike for all; the
            # minimum of each is its cost with the least interference
            runs = [
                (timed(plain, 1), timed(captured, 1), timed(direct, 1), timed(inline, 1)) for _ in range(args.repeat)
            ]
            t_plain, t_capture, t_direct, t_inline = (min(r[i] for r in runs) for i in range(4))
            m_plain, m_capture, m_direct, m_inline = (statistics.median(r[i] for r in runs) for i in range(4))
            tensors = []
            reset_peak()
            plain()
            peak_plain = peak_mib()
            reset_peak()
            captured()
            peak_dir = peak_mib()
            reset_peak()
            with torch.no_grad(), attncheck.capture(max_bytes=args.max_bytes, max_calls=None) as cap:  # kept in memory
                model(input_ids=ids)
            peak_mem = peak_mib()
            kept = sum(t.numel() * t.element_size() for c in cap.calls for t in c.tensors.values())
            one = max(sum(t.numel() * t.element_size() for t in load_file(str(p)).values()) for p in calls)
            del cap
            mib = 1 << 20
            print(f"{impl}: {len(calls)} calls, {total / mib:.0f} MiB of tensors (largest call {one / mib:.1f} MiB)")
            for label, (a, b, c, d) in (
                ("min", (t_plain, t_capture, t_direct, t_inline)),
                ("median", (m_plain, m_capture, m_direct, m_inline)),
            ):
                print(
                    f"  {label} of {args.repeat}: forward {a:.2f} s, under capture {b:.2f} s ({b / a:.2f}x, "
                    f"+{b - a:.2f} s); "
                    f"save_file after the forward {c:.2f} s, during it +{d - a:.2f} s; "
                    f"capture overhead / save_file: {(b - a) / c:.2f} after, {(b - a) / max(d - a, 1e-9):.2f} during"
                )
            print(
                f"  peak RSS above the plain forward: capture to a directory {peak_dir - peak_plain:+.0f} MiB; "
                f"in memory with max_bytes {args.max_bytes} {peak_mem - peak_plain:+.0f} MiB ({kept / mib:.0f} MiB "
                "kept)"
            )
            if not args.skip_diagnose:
                from attncheck.config.run import RunRequest
                from attncheck.pipelines.run import run

                t0 = time.perf_counter()
                result = run(RunRequest((str(work / "cap"),)))
                print(
                    f"  attncheck run on the capture (12 cells): {time.perf_counter() - t0:.1f} s, "
                    f"first call that goes wrong: {result.model.first_bad}"
                )
            model = None
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
