"""Tests for attncheck.stream: row blocks equal the loaded tensors, same names and
errors as attncheck.loaders, and bounded memory on a file much larger than a block."""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import math
import os
import re
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import numpy as np
import numpy.lib.format as npformat
import pytest
import safetensors.torch
import torch

from attncheck.errors import AttncheckError
from attncheck.judge import diagnose, diagnose_chunks
from attncheck.loaders import SUPPORTED_SUFFIXES, TensorSource, load_tensors, open_sources
from attncheck.loaders.formats.safetensors import _read_safetensors_header
from attncheck.numerics.cells.diagnose import Options
from tests.loaders.test_loaders import Hostile, assert_bitwise_equal, make_tree, sample

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMPY_FLOATS = [torch.float16, torch.float32, torch.float64]  # numpy has no bf16
SHAPE = (2, 3, 7, 5)  # 42 rows of 5 keys
BLOCK_SIZES = [1, 4, 5, 42, 100]  # 4 and 5 do not divide 42; 100 is more than all rows
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------
# helpers


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Save with the format's own writer; a lone ``""`` key is a bare tensor."""
    fmt = path.suffix
    if fmt == ".npy":
        np.save(path, tensors[""].numpy())
    elif fmt == ".npz":
        np.savez(path, **{k: t.numpy() for k, t in tensors.items()})
    elif fmt == ".safetensors":
        safetensors.torch.save_file(tensors, str(path))
    else:
        torch.save(tensors[""] if list(tensors) == [""] else tensors, path)
    return path


def gather(source: TensorSource, rows_per_block: int) -> torch.Tensor:
    """All blocks, checked for shape and order, joined back into the tensor's shape."""
    blocks = list(source.row_blocks(rows_per_block))
    keys = source.shape[-1]
    assert [b.shape[0] for b in blocks[:-1]] == [rows_per_block] * (len(blocks) - 1)
    assert 1 <= blocks[-1].shape[0] <= rows_per_block
    for b in blocks:
        assert b.dim() == 2 and b.shape[1] == keys
        assert b.dtype == source.dtype and b.device.type == "cpu"
    assert sum(b.shape[0] for b in blocks) == source.rows
    return torch.cat(blocks).reshape(source.shape)


def assert_streams_like_loader(paths, keys=(), streams=True) -> list[TensorSource]:
    sources = open_sources(paths, keys)
    loaded = load_tensors(paths, keys)
    assert [s.name for s in sources] == [nt.name for nt in loaded]
    for source, nt in zip(sources, loaded):
        assert source.shape == tuple(nt.tensor.shape)
        assert source.dtype == nt.tensor.dtype
        assert source.streams is streams
        assert source.nbytes == nt.tensor.numel() * nt.tensor.element_size()
        for k in BLOCK_SIZES:
            assert_bitwise_equal(gather(source, k), nt.tensor)
    return sources


def error_of(fn) -> str:
    with pytest.raises(AttncheckError) as excinfo:
        fn()
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message and len(message) < 1000
    return message


def stream_all(paths, keys=()) -> None:
    """Open and read every block, as a diagnosis would."""
    for source in open_sources([str(p) for p in paths], keys):
        for _ in source.row_blocks(3):
            pass


def assert_same_error(paths, keys=()) -> str:
    """Streaming fails with exactly the message load_tensors gives."""
    expected = error_of(lambda: load_tensors([str(p) for p in paths], keys))
    assert error_of(lambda: stream_all(paths, keys)) == expected
    return expected


# --------------------------------------------------------------------------
# round trips: every block size, bit for bit


@pytest.mark.parametrize("dtype", NUMPY_FLOATS, ids=str)
def test_npy_blocks_equal_loaded(tmp_path, dtype):
    path = write(tmp_path / "s.npy", {"": sample(dtype, SHAPE)})
    [source] = assert_streams_like_loader([path])
    assert source.name == str(path) and source.rows == 42


@pytest.mark.parametrize("dtype", NUMPY_FLOATS, ids=str)
def test_npy_big_endian(tmp_path, dtype):
    expected = sample(dtype, SHAPE)
    np.save(tmp_path / "big.npy", expected.numpy().astype(expected.numpy().dtype.newbyteorder(">")))
    [source] = assert_streams_like_loader([tmp_path / "big.npy"])
    assert_bitwise_equal(gather(source, 4), expected)


@pytest.mark.parametrize("version", [(2, 0), (3, 0)])
def test_npy_format_versions(tmp_path, version):
    expected = sample(torch.float32, SHAPE)
    with open(tmp_path / "v.npy", "wb") as f:
        npformat.write_array(f, expected.numpy(), version=version)
    [source] = assert_streams_like_loader([tmp_path / "v.npy"])
    assert_bitwise_equal(gather(source, 5), expected)


def test_npy_unknown_format_version(tmp_path):
    path = write(tmp_path / "v.npy", {"": torch.ones(2)})
    data = bytearray(path.read_bytes())
    data[6] = 9  # major version
    path.write_bytes(bytes(data))
    assert "not (9, 0)" in assert_same_error([path])


def test_npy_fortran_order_is_loaded_whole(tmp_path):
    expected = sample(torch.float64, (9, 6))
    np.save(tmp_path / "f.npy", np.asfortranarray(expected.numpy()))
    np.save(tmp_path / "f3.npy", np.asfortranarray(sample(torch.float32, SHAPE).numpy()))
    [f2, f3] = assert_streams_like_loader([tmp_path / "f.npy", tmp_path / "f3.npy"], streams=False)
    assert_bitwise_equal(gather(f2, 2), expected)


def test_one_dimensional_tensor_is_one_row(tmp_path):
    expected = sample(torch.float32, (11,))
    path = write(tmp_path / "v.npy", {"": expected})
    [source] = open_sources([path])
    assert source.rows == 1
    [block] = list(source.row_blocks(4))
    assert block.shape == (1, 11)
    assert_bitwise_equal(block[0], expected)


def test_npz_stored_blocks_equal_loaded(tmp_path):
    tensors = {f"m{i}": sample(d, SHAPE) for i, d in enumerate(NUMPY_FLOATS)}
    path = write(tmp_path / "m.npz", tensors)
    with zipfile.ZipFile(path) as archive:
        assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}
    assert_streams_like_loader([path])


def test_npz_compressed_blocks_equal_loaded(tmp_path):
    arrays = {f"m{i}": sample(d, SHAPE).numpy() for i, d in enumerate(NUMPY_FLOATS)}
    arrays["big_endian"] = arrays["m1"].astype(">f4")
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    sources = assert_streams_like_loader([tmp_path / "c.npz"])
    assert [s.name.split(":")[-1] for s in sources] == list(arrays)


def test_npz_fortran_member_is_loaded_whole(tmp_path):
    expected = sample(torch.float16, (9, 6))
    np.savez(tmp_path / "f.npz", f=np.asfortranarray(expected.numpy()))
    [source] = assert_streams_like_loader([tmp_path / "f.npz"], streams=False)
    assert_bitwise_equal(gather(source, 4), expected)


def test_npz_member_names_as_numpy_lists_them(tmp_path):
    # numpy lists member "x.npy" as "x", and a member without the suffix as is.
    member = tmp_path / "m.npy"
    np.save(member, sample(torch.float32, (4, 3)).numpy())
    path = tmp_path / "n.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(member, "x.npy")
        archive.write(member, "raw")
    for keys in [(), ("x",), ("raw",), ("*",)]:
        assert_streams_like_loader([path], keys)
    assert [s.name for s in open_sources([path])] == [f"{path}:x", f"{path}:raw"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_safetensors_blocks_equal_loaded(tmp_path, dtype):
    # Several tensors, so that each is read at its own data_offsets.
    tensors = {
        "a.first": sample(torch.float16, (3, 4)),
        "scores": sample(dtype, SHAPE),
        "z.last": sample(torch.float64, (3, 3)),
    }
    sources = assert_streams_like_loader([write(tmp_path / "s.safetensors", tensors)])
    assert [s.name.split(":")[-1] for s in sources] == sorted(tensors)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("bare", [True, False])
def test_pt_is_held_in_memory(tmp_path, dtype, bare):
    expected = sample(dtype, SHAPE)
    path = write(tmp_path / "p.pt", {"": expected} if bare else {"layer": expected})
    [source] = assert_streams_like_loader([path], streams=False)
    assert source.name == (str(path) if bare else f"{path}:layer")


def test_pt_non_contiguous_tensor(tmp_path):
    expected = sample(torch.float32, (6, 8)).t()  # (8, 6), not contiguous
    torch.save({"t": expected}, tmp_path / "t.pt")
    [source] = assert_streams_like_loader([tmp_path / "t.pt"], streams=False)
    assert_bitwise_equal(gather(source, 3), expected)


def test_streamed_blocks_are_fresh_tensors(tmp_path):
    path = write(tmp_path / "s.npy", {"": sample(torch.float32, SHAPE)})
    [source] = open_sources([path])
    blocks = list(source.row_blocks(8))
    pointers = {b.data_ptr() for b in blocks}
    assert len(pointers) == len(blocks)
    blocks[0].zero_()  # writable, and does not change what is read next time
    assert_bitwise_equal(gather(source, 8), load_tensors([path])[0].tensor)


def test_row_blocks_restarts_and_closes_its_file(tmp_path):
    for name, tensors in [
        ("a.npy", {"": sample(torch.float32, SHAPE)}),
        ("b.npz", {"x": sample(torch.float32, SHAPE)}),
        ("c.safetensors", {"x": sample(torch.bfloat16, SHAPE)}),
    ]:
        path = write(tmp_path / name, tensors)
        [source] = open_sources([path])
        first = source.row_blocks(4)
        head = next(first)
        again = next(source.row_blocks(4))
        assert_bitwise_equal(again, head)
        del first  # a generator left half-read closes its file: no ResourceWarning
        gc.collect()


@pytest.mark.parametrize("bad_size", [0, -1, 1.5, True])
def test_rows_per_block_must_be_positive_int(tmp_path, bad_size):
    [source] = open_sources([write(tmp_path / "s.npy", {"": torch.ones(3, 2)})])
    with pytest.raises(ValueError, match="rows_per_block must be a positive int"):
        source.row_blocks(bad_size)


# --------------------------------------------------------------------------
# names, directories and --key, exactly as load_tensors


@pytest.mark.parametrize("keys", [(), ("[sx]",), ("z.*",), ("k", "y"), ("*",)])
def test_directory_names_and_keys_match_loaders(tmp_path, keys):
    root = tmp_path / "dumps"
    make_tree(root)
    sources = open_sources([root, root / "z.npy"], keys)
    loaded = load_tensors([root, root / "z.npy"], keys)
    assert [s.name for s in sources] == [nt.name for nt in loaded]
    for source, nt in zip(sources, loaded):
        assert_bitwise_equal(gather(source, 1), nt.tensor)


def test_path_forms_and_lone_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("x.npy", np.ones((2, 3), np.float32))
    assert [s.name for s in open_sources(["./x.npy"])] == ["./x.npy"]
    assert [s.name for s in open_sources("x.npy")] == ["x.npy"]
    assert [s.name for s in open_sources(Path("x.npy"))] == ["x.npy"]


def test_unselected_members_are_not_checked(tmp_path):
    npz = tmp_path / "m.npz"
    np.savez(npz, good=np.ones(2, np.float32), objects=np.array([None, 1], dtype=object), ints=np.arange(3))
    st = tmp_path / "s.safetensors"
    safetensors.torch.save_file({"good": torch.ones(2), "ints": torch.arange(3)}, str(st))
    assert [s.name for s in open_sources([npz, st], ["good"])] == [f"{npz}:good", f"{st}:good"]


def test_key_matching_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.savez("many.npz", **{f"t{i:02d}": np.ones(1) for i in range(25)})
    message = assert_same_error(["many.npz"], ["t01", "nope"])
    assert message.startswith("keys 'nope' matches no tensor (available: many.npz:t00,")


# --------------------------------------------------------------------------
# bad input: the loaders' messages


def test_missing_unknown_and_empty_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "scores.csv").write_text("1,2\n")
    assert assert_same_error([tmp_path / "nope.npy"]).endswith("nope.npy: no such file or directory")
    assert "unsupported file type '.csv'" in assert_same_error([tmp_path / "scores.csv"])
    assert "directory holds no supported tensor files" in assert_same_error([tmp_path / "empty"])
    assert error_of(lambda: open_sources([])) == "no input files given (pass one or more tensor files or directories)"


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_random_bytes(tmp_path, suffix):
    path = tmp_path / f"junk{suffix}"
    path.write_bytes(os.urandom(4096))
    message = assert_same_error([path])
    assert re.search(rf"junk{re.escape(suffix)}: not a valid {re.escape(suffix)} file \(.+\)$", message)


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_empty_file(tmp_path, suffix):
    path = tmp_path / f"e{suffix}"
    path.write_bytes(b"")
    assert assert_same_error([path]).endswith(f"not a valid {suffix} file (the file is empty)")


def test_truncated_npy_says_how_much(tmp_path):
    path = write(tmp_path / "cut.npy", {"": torch.ones(64, 64)})
    data = path.read_bytes()
    header = len(data) - 64 * 64 * 4
    path.write_bytes(data[: len(data) // 2])
    found = len(data) // 2 - header
    message = error_of(lambda: open_sources([path]))  # before any data is read
    assert message == f"{path}: not a valid .npy file (truncated: expected 16384 bytes of data, found {found})"


def test_truncated_npy_header(tmp_path):
    path = write(tmp_path / "h.npy", {"": torch.ones(2)})
    path.write_bytes(path.read_bytes()[:40])
    assert re.search(r"h\.npy: not a valid \.npy file \(.*header", assert_same_error([path]))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".pt"])
def test_truncated_archives(tmp_path, suffix):
    # Cut in half, these lose their directory or fail safetensors' own check.
    path = write(tmp_path / f"cut{suffix}", {"scores": torch.randn(64, 64)})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = assert_same_error([path])
    assert re.search(rf"cut{re.escape(suffix)}: not a valid {re.escape(suffix)} file \(.+\)$", message)


@pytest.mark.parametrize("name", ["s.npy", "s.safetensors"])
def test_file_cut_after_opening(tmp_path, name):
    path = write(tmp_path / name, {"": torch.ones(64, 64)} if name.endswith("npy") else {"x": torch.ones(64, 64)})
    [source] = open_sources([path])
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    blocks = source.row_blocks(16)
    assert next(blocks).shape == (16, 64)
    message = error_of(lambda: list(blocks))
    shown = str(path) if name.endswith("npy") else f"{path}:x"
    found = 16384 - 1000
    assert (
        message == f"{shown}: not a valid {path.suffix} file (truncated: expected 16384 bytes of data, found {found})"
    )


def test_npz_member_shorter_than_its_header_says(tmp_path):
    member = tmp_path / "x.npy"
    np.save(member, np.ones((8, 8), np.float32))
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", member.read_bytes()[:-20])
    message = error_of(lambda: open_sources([path]))
    assert message == f"{path}:x: not a valid .npy member (truncated: expected 256 bytes of data, found 236)"
    load_error = error_of(lambda: load_tensors([path]))
    assert load_error.startswith(f"{path}:x: not a valid .npy member (")


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_corrupt_member_fails_before_its_last_block(tmp_path, compressed):
    path = tmp_path / "m.npz"
    (np.savez_compressed if compressed else np.savez)(path, x=np.arange(4000, dtype=np.float32))
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("x.npy")
    data = bytearray(path.read_bytes())
    # Flip bytes in the array data of the member (its local header is 30 + name + extra bytes).
    start = info.header_offset + 30 + len("x.npy") + 20 + 200
    data[start : start + 8] = bytes(b ^ 0xFF for b in data[start : start + 8])
    path.write_bytes(bytes(data))
    expected = error_of(lambda: load_tensors([path]))
    assert expected.startswith(f"{path}:x: not a valid .npy member (")
    if not compressed:
        assert "CRC" in expected
        assert error_of(lambda: stream_all([path])) == expected
    else:
        # A corrupt deflate stream may fail on decompression rather than on the CRC.
        assert error_of(lambda: stream_all([path])).startswith(f"{path}:x: not a valid .npy member (")


def test_npz_member_that_is_not_npy(tmp_path):
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", b"hello")
    assert assert_same_error([path]) == f"{path}:notes.txt: member is not a .npy array"


def test_renamed_formats(tmp_path):
    npy = write(tmp_path / "a.npy", {"": torch.ones(2)})
    npz = write(tmp_path / "a.npz", {"x": torch.ones(2)})
    (tmp_path / "b.npz").write_bytes(npy.read_bytes())
    (tmp_path / "b.npy").write_bytes(npz.read_bytes())
    assert "rename it to .npy" in assert_same_error([tmp_path / "b.npz"])
    assert "it is a zip archive" in assert_same_error([tmp_path / "b.npy"])


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_object_arrays_are_refused_unpickled(tmp_path, suffix):
    marker = tmp_path / "pwned"
    array = np.array([Hostile(marker), 1.0], dtype=object)
    path = tmp_path / f"obj{suffix}"
    if suffix == ".npy":
        np.save(path, array, allow_pickle=True)
    else:
        np.savez(path, objects=array)
    assert "holds an object array (pickled Python objects)" in assert_same_error([path])
    assert not marker.exists()


def test_hostile_pt_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"s": torch.ones(2), "evil": Hostile(marker)}, tmp_path / "evil.pt")
    assert "refused to load" in assert_same_error([tmp_path / "evil.pt"])
    assert not marker.exists()


@pytest.mark.parametrize(
    ("fmt", "value"),
    [
        ("npy", np.arange(3, dtype=np.int64)),
        ("npy", np.array([True, False])),
        ("npy", np.array([1 + 2j], dtype=np.complex64)),
        ("npy", np.array(["a", "b"])),
        ("npy", np.ones(2, dtype=np.longdouble)),
        ("npz", np.arange(3, dtype=np.int32)),
        ("safetensors", torch.ones(2).to(torch.float8_e5m2)),
        ("safetensors", torch.ones(2).to(torch.float8_e4m3fn)),
        ("safetensors", torch.ones(2, dtype=torch.uint8)),
        ("safetensors", torch.ones(2, dtype=torch.bool)),
        ("safetensors", torch.ones(2, dtype=torch.int64)),
        ("pt", torch.ones(2, dtype=torch.complex64)),
    ],
    ids=lambda v: str(getattr(v, "dtype", v)),
)
def test_non_float_dtypes_are_refused(tmp_path, fmt, value):
    path = tmp_path / f"x.{fmt}"
    if fmt == "npy":
        np.save(path, value)
    elif fmt == "npz":
        np.savez(path, v=value)
    elif fmt == "safetensors":
        safetensors.torch.save_file({"v": value}, str(path))
    else:
        torch.save(value, path)
    message = assert_same_error([path])
    assert message.endswith("; attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)")


def test_scalars_and_empty_tensors_are_refused(tmp_path):
    np.save(tmp_path / "s.npy", np.float32(1.5))
    np.save(tmp_path / "e.npy", np.zeros((0, 8), np.float32))
    np.savez(tmp_path / "e.npz", e=np.zeros((3, 0), np.float16))
    safetensors.torch.save_file({"e": torch.zeros(4, 0), "s": torch.tensor(2.0)}, str(tmp_path / "e.safetensors"))
    assert "s.npy is a 0-d scalar" in assert_same_error([tmp_path / "s.npy"])
    assert assert_same_error([tmp_path / "e.npy"]).endswith("e.npy is empty (shape (0, 8))")
    assert assert_same_error([tmp_path / "e.npz"]).endswith("e.npz:e is empty (shape (3, 0))")
    assert assert_same_error([tmp_path / "e.safetensors"], ["e"]).endswith("e.safetensors:e is empty (shape (4, 0))")
    assert "e.safetensors:s is a 0-d scalar" in assert_same_error([tmp_path / "e.safetensors"], ["s"])


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (b"[1, 2]", "header is not a JSON object"),
        (b"{not json", "header is not JSON"),
        (
            b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}',
            "tensor 'x': data_offsets span 4 bytes, but F32 (2,) needs 8",
        ),
        (b'{"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "bad shape"),
        (b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', "bad data_offsets"),
        (b'{"x": {"shape": [1], "data_offsets": [0, 4]}}', "has no dtype"),
        (b'{"x": 3}', "header entry 'x' is not an object"),
    ],
)
def test_safetensors_header_checks(tmp_path, header, why):
    # safetensors itself catches these when the file is opened; the streaming
    # reader re-parses the header and must not trust it either.
    path = tmp_path / "h.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with open(path, "rb") as f:
        message = error_of(lambda: _read_safetensors_header(f, "not a valid .safetensors file", str(path)))
    assert message.startswith(f"{path}: not a valid .safetensors file (") and why in message


def test_safetensors_header_length_past_the_end(tmp_path):
    path = tmp_path / "h.safetensors"
    path.write_bytes((1 << 20).to_bytes(8, "little") + b"{}")
    with open(path, "rb") as f:
        message = error_of(lambda: _read_safetensors_header(f, "not a valid .safetensors file", str(path)))
    assert "header length 1048576 runs past the end of the 10-byte file" in message


# --------------------------------------------------------------------------
# the diagnosis over blocks equals the diagnosis of the whole tensor


def stressful_scores() -> torch.Tensor:
    """Rows that trip every NaN cause: masked, -1e9 sentinel, huge, nan, +inf."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 16, 40, generator=g, dtype=torch.float64) * 4  # (B, H, T, T)
    x[0, 0, 1] = float("-inf")  # fully masked
    x[0, 1, 2, 10:] = -1e9  # sentinel: -inf in fp16
    x[0, 2, 3, 5] = 300.0  # exp overflows in every dtype
    x[1, 0, 4, 7] = float("nan")
    x[1, 1, 5, 0] = float("inf")
    x[1, 2, 6] = -200.0  # every exp flushes to zero unless the max is subtracted
    return x


def normalised(value):
    """Dataclasses as nested data, NaN made comparable."""
    if dataclasses.is_dataclass(value):
        return {f.name: normalised(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalised(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("s.npy", torch.float32),
        pytest.param("s.safetensors", torch.bfloat16, marks=pytest.mark.slow),
        pytest.param("s.npz", torch.float16, marks=pytest.mark.slow),
        pytest.param("s.pt", torch.float64, marks=pytest.mark.slow),
    ],
)  # 3 s each: one format in the default run, all four in the slow one
def test_diagnose_chunks_over_row_blocks_equals_diagnose(tmp_path, name, dtype):
    scores = stressful_scores().to(dtype)
    path = write(tmp_path / name, {"" if name.endswith(("npy", "pt")) else "scores": scores})
    [source] = open_sources([path])
    [nt] = load_tensors([path])
    whole = diagnose(nt.name, nt.tensor)
    for k in (1, 7, 96):
        streamed = diagnose_chunks(source.name, source.shape, source.dtype, source.row_blocks(k), Options())
        for part in ("name", "shape", "dtype", "census", "distribution", "cells", "findings"):
            assert normalised(getattr(streamed, part)) == normalised(getattr(whole, part)), part
    assert whole.cell("naive", "fp16").nan_rows > 0  # the scores do stress the diagnosis


# --------------------------------------------------------------------------
# memory: a file 64x larger than a block is read with bounded resident memory

MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np, torch
    from attncheck.loaders import open_sources

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    def now_mib():  # resident now, so that an earlier peak cannot hide growth
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    out = {}
    start = peak_mib()  # the interpreter with numpy, torch and attncheck imported
    for path in sys.argv[1:]:
        [source] = open_sources([path])
        next(iter(source.row_blocks(1)))  # warm up lazy imports
        base = min(now_mib(), peak_mib())
        total, rows = 0.0, 0
        for block in source.row_blocks(1024):  # (1024, 1024) fp32: 4 MiB a block
            total += float(block.numpy().sum(dtype=np.float64))  # no large temporaries
            rows += block.shape[0]
        out[path] = {"base": base, "peak": peak_mib(), "start": start, "rows": rows, "total": total,
                     "streams": source.streams}
    # Control: touching a memory map of the same file keeps it resident.
    base = min(now_mib(), peak_mib())
    np.load(sys.argv[1], mmap_mode="r").sum(dtype=np.float64)
    out["mmap"] = {"base": base, "peak": peak_mib()}
    print(json.dumps(out))
    """
)


def write_large(path: Path, rows: int, keys: int) -> float:
    """A (rows, keys) fp32 file whose first and last 1024 rows are random and the
    rest a hole (a sparse file: no data to write, reads see zeros); returns the sum."""
    block = np.random.default_rng(0).standard_normal((1024, keys)).astype(np.float32).tobytes()
    nbytes = rows * keys * 4
    npy_header = io.BytesIO()
    npformat.write_array_header_1_0(npy_header, {"descr": "<f4", "fortran_order": False, "shape": (rows, keys)})
    if path.suffix == ".npy":
        prefix, suffix = npy_header.getvalue(), b""
    elif path.suffix == ".safetensors":
        header = json.dumps({"scores": {"dtype": "F32", "shape": [rows, keys], "data_offsets": [0, nbytes]}})
        header += " " * (-len(header) % 8)
        prefix, suffix = len(header).to_bytes(8, "little") + header.encode(), b""
    else:  # .npz: one stored member "scores.npy", the zip records written by hand
        member = npy_header.getvalue()
        crc = zlib.crc32(member + block)
        zeros = bytes(len(block))
        for _ in range(nbytes // len(block) - 2):
            crc = zlib.crc32(zeros, crc)
        crc = zlib.crc32(block, crc)
        size = len(member) + nbytes
        name = b"scores.npy"
        prefix = (
            struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, size, size, len(name), 0) + name + member
        )
        central = (
            struct.pack(
                "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, size, size, len(name), 0, 0, 0, 0, 0, 0
            )
            + name
        )
        end_offset = len(prefix) + nbytes
        suffix = central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central), end_offset, 0)
    with open(path, "wb") as f:
        f.write(prefix + block)
        f.seek(len(prefix) + nbytes - len(block))  # skip the middle: a hole
        f.write(block + suffix)
    return 2 * float(np.frombuffer(block, np.float32).astype(np.float64).sum())


def test_memory_stays_bounded_on_a_file_64x_the_block(tmp_path):
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc/self/statm (Linux) to read the resident size")
    rows, keys = 65536, 1024  # 256 MiB of fp32 per file
    size_mib = rows * keys * 4 / 2**20
    paths = [tmp_path / "big.npy", tmp_path / "big.safetensors", tmp_path / "big.npz"]
    sums = [write_large(p, rows, keys) for p in paths]
    # ru_maxrss starts at the parent's resident size when the parent forks the probe
    # (the kernel carries it over exec); a bare Python in between keeps it honest.
    launcher = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, *sys.argv[1:]]).returncode)"
    probe = subprocess.run(
        [sys.executable, "-c", launcher, "-c", MEMORY_PROBE, *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout)
    for path, expected_sum in zip(paths, sums):
        r = out[str(path)]
        assert r["streams"] and r["rows"] == rows
        assert r["total"] == pytest.approx(expected_sum, rel=1e-12)
        growth = r["peak"] - r["base"]
        assert growth < 32, f"{path.name}: resident memory grew by {growth:.0f} MiB reading {size_mib:.0f} MiB"
    assert out[str(paths[0])]["start"] < 1024  # not inflated by the parent's size
    # The measurement does see a file kept resident: the mmap control grows by ~the file.
    assert out["mmap"]["peak"] - out["mmap"]["base"] > 0.75 * size_mib
