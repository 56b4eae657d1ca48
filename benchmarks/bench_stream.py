"""Streaming diagnosis of score files larger than a memory budget: wall time and peak RSS.

    python benchmarks/bench_stream.py [DIR] [--rows 1048576] [--keys 1024] [--block-rows N]
                                      [--formats npy,safetensors] [--dtype ...] [--method ...]
                                      [--also-load] [--keep]

Writes (rows, keys) fp32 scores (default 1,048,576 x 1024 = 4 GiB per file: unit-variance
logits x 3 under a causal -inf mask, rows grouped in heads of `keys` queries) as .npy and
.safetensors into DIR (default: a temporary directory), block by block, never as one array.
Then, for each format, in a fresh subprocess:

  read      attncheck.loaders row_blocks only (I/O and conversion to tensors)
  diagnose  diagnose_chunks(name, shape, dtype, row_blocks(k), options)
  load      (--also-load) load_tensors + diagnose: the whole tensor in memory, for comparison

and prints wall time, throughput, and peak RSS from getrusage (with the RSS after imports,
before reading, so the growth is visible). The files are deleted afterwards unless --keep.
This is a benchmark, not a test: the default size takes minutes and 8 GiB of disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time
import torch
from attncheck.cli.common import reuse_freed_memory
from attncheck.judge import diagnose, diagnose_chunks
from attncheck.numerics.cells.diagnose import Options, rows_per_chunk
from attncheck.loaders import load_tensors, open_sources

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

mode, path, block_rows, dtypes, methods = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
reuse_freed_memory()  # as the attncheck command does
options = Options(dtypes=tuple(dtypes.split(",")), methods=tuple(methods.split(",")))
base = peak_mib()
t0 = time.perf_counter()
if mode == "load":
    [nt] = load_tensors([path])
    result = diagnose(nt.name, nt.tensor, options)
    rows = result.census.rows
else:
    [source] = open_sources([path])
    k = block_rows or rows_per_chunk(source.shape[-1], options)
    if mode == "read":
        rows = 0
        for block in source.row_blocks(k):
            rows += block.shape[0]
    else:
        result = diagnose_chunks(source.name, source.shape, source.dtype, source.row_blocks(k), options)
        rows = result.census.rows
wall = time.perf_counter() - t0
out = {"mode": mode, "rows": rows, "wall_s": wall, "base_mib": base, "peak_mib": peak_mib(),
       "threads": torch.get_num_threads()}
if mode != "read":
    out["nan_rows_fp16_naive"] = next((c.nan_rows for c in result.cells if c.name == "naive/fp16"), None)
print(json.dumps(out))
"""


def score_block(start: int, rows: int, keys: int, rng: np.random.Generator) -> np.ndarray:
    """Rows [start, start + rows) of heads of `keys` queries: logits x 3, causal -inf mask."""
    x = rng.standard_normal((rows, keys), dtype=np.float32) * np.float32(3)  # (r, T)
    query = (np.arange(start, start + rows) % keys)[:, None]  # position of each row in its head
    x[np.arange(keys)[None, :] > query] = -np.inf
    return x


def write_files(directory: Path, rows: int, keys: int, formats: list[str]) -> list[Path]:
    from numpy.lib import format as npformat

    nbytes = rows * keys * 4
    handles = {}
    for fmt in formats:
        path = directory / f"scores.{fmt}"
        f = open(path, "wb")
        if fmt == "npy":
            npformat.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, keys)})
        else:
            header = json.dumps({"scores": {"dtype": "F32", "shape": [rows, keys], "data_offsets": [0, nbytes]}})
            header += " " * (-len(header) % 8)
            f.write(len(header).to_bytes(8, "little") + header.encode())
        handles[path] = f
    rng = np.random.default_rng(0)
    step = max(1, (16 << 20) // (keys * 4))  # 16 MiB a block
    try:
        for start in range(0, rows, step):
            data = score_block(start, min(step, rows - start), keys, rng).tobytes()
            for f in handles.values():
                f.write(data)
    finally:
        for f in handles.values():
            f.close()
    return list(handles)


def run_child(mode: str, path: Path, args: argparse.Namespace) -> dict:
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path), str(args.block_rows), args.dtype, args.method],
        capture_output=True,
        text=True,
        cwd=repo,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {path.name} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", nargs="?", type=Path, help="where to write the files (default: a temp dir)")
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--block-rows", type=int, default=0, help="rows per block (default: diagnose's rows_per_chunk)")
    ap.add_argument("--formats", default="npy,safetensors")
    ap.add_argument("--dtype", default="fp16,bf16,fp32")
    ap.add_argument("--method", default="naive,stable,tiled,torch")
    ap.add_argument("--also-load", action="store_true", help="also time load_tensors + diagnose (whole file in memory)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    directory = args.directory or Path(tempfile.mkdtemp(prefix="bench_stream_"))
    directory.mkdir(parents=True, exist_ok=True)
    size_mib = args.rows * args.keys * 4 / 2**20
    try:
        t0 = time.perf_counter()
        paths = write_files(directory, args.rows, args.keys, formats)
        print(
            f"wrote {len(paths)} x {size_mib:.0f} MiB fp32 ({args.rows} rows x {args.keys} keys) "
            f"to {directory} in {time.perf_counter() - t0:.1f} s; cells: {args.dtype} x {args.method}"
        )
        modes = ["read", "diagnose"] + (["load"] if args.also_load else [])
        print(
            f"{'file':<20} {'mode':<9} {'wall s':>8} {'MiB/s':>8} {'rows/s':>10} "
            f"{'RSS after import':>17} {'peak RSS':>9} {'growth':>8}"
        )
        for path in paths:
            for mode in modes:
                r = run_child(mode, path, args)
                assert r["rows"] == args.rows, r
                print(
                    f"{path.name:<20} {mode:<9} {r['wall_s']:>8.2f} {size_mib / r['wall_s']:>8.0f} "
                    f"{args.rows / r['wall_s']:>10.0f} {r['base_mib']:>13.0f} MiB {r['peak_mib']:>5.0f} MiB "
                    f"{r['peak_mib'] - r['base_mib']:>4.0f} MiB"
                )
    finally:
        if args.keep:
            print(f"kept {directory}")
        elif args.directory is None:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for fmt in formats:
                (directory / f"scores.{fmt}").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
