"""Loaders against unusual and hostile files: meta and nested tensors, pickle protocols 4
and 5, names that collide, pickles that share or nest containers without end, zip bombs
and zip archives that lie. Each input is a few KB; none is ever expanded in memory."""

from __future__ import annotations

import io
import pickle
import struct
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import numpy.lib.format as npformat
import pytest
import safetensors.torch
import torch

from attncheck.errors import AttncheckError
from attncheck.loaders import load_tensors, open_sources
from attncheck.loaders.formats.pt import MAX_DEPTH, MAX_TENSORS, key_text


def bad(paths, match: str, keys=(), **kw) -> AttncheckError:
    with pytest.raises(AttncheckError, match=match) as excinfo:
        load_tensors([str(p) for p in paths], keys, **kw)
    assert "\n" not in str(excinfo.value)
    return excinfo.value


def loaded(path, keys=(), **kw) -> dict[str, torch.Tensor]:
    return {t.name.removeprefix(f"{path}:"): t.tensor for t in load_tensors([str(path)], keys, **kw)}


def sources(path, keys=(), **kw) -> dict[str, torch.Tensor]:
    out = {}
    for s in open_sources([str(path)], keys, **kw):
        out[s.name.removeprefix(f"{path}:")] = torch.cat(list(s.row_blocks(2)))
    return out


# --------------------------------------------------------------------------- tensors without data


def test_meta_tensors_are_refused_in_one_line(tmp_path):
    p = tmp_path / "meta.pt"
    torch.save(torch.empty(4, 8, device="meta"), p)
    bad([p], r"meta\.pt is a meta tensor: it has a shape but no values")
    d = tmp_path / "meta_dict.pt"
    torch.save({"ok": torch.ones(2, 3), "w": torch.empty(2, 3, device="meta")}, d)
    bad([d], r"meta_dict\.pt:w is a meta tensor")
    assert set(loaded(d, ["ok"])) == {"ok"}  # the real tensor beside it still loads
    with pytest.raises(AttncheckError, match="is a meta tensor"):
        open_sources([str(d)])


def test_nested_tensors_are_refused_in_one_line(tmp_path):
    p = tmp_path / "nested.pt"
    with warnings.catch_warnings():  # torch's prototype notice, given once per process
        warnings.simplefilter("ignore")
        nt = torch.nested.as_nested_tensor([torch.ones(2, 4), torch.ones(3, 4)])
    torch.save({"n": nt}, p)
    bad([p], r"nested\.pt:n is a nested tensor \(rows of different lengths\)")


# --------------------------------------------------------------------------- pickle protocols


@pytest.mark.parametrize("protocol", [3, 4, 5])
@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_pt_of_every_pickle_protocol_loads(tmp_path, protocol, zip_format):
    # Strings reused as keys, as globals' names and inside nested dicts exercise the memo.
    obj = {
        "torch": torch.arange(6.0).view(2, 3),
        "a": {"torch": torch.ones(2, 2, dtype=torch.float16), "collections": [torch.zeros(1, 4)]},
        "_rebuild_tensor_v2": torch.full((3, 1), 2.5, dtype=torch.bfloat16),
    }
    p = tmp_path / "p.pt"
    torch.save(obj, p, pickle_protocol=protocol, _use_new_zipfile_serialization=zip_format)
    got = loaded(p)  # any warning fails the test (filterwarnings = error)
    assert set(got) == {"torch", "a.torch", "a.collections.0", "_rebuild_tensor_v2"}
    assert torch.equal(got["torch"], obj["torch"]) and torch.equal(got["a.torch"], obj["a"]["torch"])
    assert (
        torch.equal(got["_rebuild_tensor_v2"], obj["_rebuild_tensor_v2"])
        and got["_rebuild_tensor_v2"].dtype == torch.bfloat16
    )


def test_protocol_4_pickle_of_code_is_still_refused(tmp_path):
    # The rewrite to protocol 2 keeps every global: torch's allow-list still refuses code.
    p = tmp_path / "evil.pt"
    torch.save({"t": torch.ones(2, 2)}, p, pickle_protocol=4)
    with zipfile.ZipFile(p) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    name = next(n for n in records if n.endswith("data.pkl"))
    records[name] = pickle.dumps({"t": print}, protocol=4)
    with zipfile.ZipFile(p, "w") as z:
        for n, data in records.items():
            z.writestr(n, data)
    bad([p], r"refused to load: it holds pickled objects other than tensors, e\.g\. print")


# --------------------------------------------------------------------------- names


def test_npz_members_x_and_x_npy_are_two_tensors(tmp_path):
    p = tmp_path / "c.npz"
    np.savez(p, **{"x": np.ones((2, 4), np.float32), "x.npy": np.zeros((2, 4), np.float32)})
    for read in (loaded, sources):
        got = read(p)
        assert set(got) == {"x", "x.npy"}
        assert (got["x"] == 1).all() and (got["x.npy"] == 0).all()
    assert set(loaded(p, ["x.npy"])) == {"x.npy"} and (loaded(p, ["x.npy"])["x.npy"] == 0).all()
    assert set(loaded(p, ["x"])) == {"x"} and (loaded(p, ["x"])["x"] == 1).all()


def test_npz_members_that_would_share_a_name_are_bracketed(tmp_path):
    p = tmp_path / "c.npz"
    with zipfile.ZipFile(p, "w") as z:
        for member, value in (("y", 1.0), ("y.npy", 2.0)):
            buf = io.BytesIO()
            np.save(buf, np.full((1, 3), value, np.float32))
            z.writestr(member, buf.getvalue())
    got = loaded(p)
    assert set(got) == {"['y']", "['y.npy']"}
    assert (got["['y']"] == 1).all() and (got["['y.npy']"] == 2).all()
    assert (loaded(p, ["['y']"])["['y']"] == 1).all()  # --key of a name with brackets selects it exactly


def test_pt_keys_that_print_alike_get_distinct_names(tmp_path):
    p = tmp_path / "k.pt"
    torch.save(
        {
            1: torch.ones(2, 2),
            "1": torch.zeros(2, 2),
            "a.b": torch.full((2, 2), 3.0),
            "a": {"b": torch.full((2, 2), 4.0)},
            "plain name": torch.full((2, 2), 5.0),
            (0, 1): torch.full((2, 2), 6.0),
        },
        p,
    )
    got = loaded(p)
    assert {k: float(v[0, 0]) for k, v in got.items()} == {
        "1": 1.0,
        "['1']": 0.0,
        "['a.b']": 3.0,
        "a.b": 4.0,
        "plain name": 5.0,
        "[(0, 1)]": 6.0,
    }
    for key, value in (("1", 1.0), ("['1']", 0.0), ("['a.b']", 3.0), ("a.b", 4.0)):
        only = loaded(p, [key])
        assert list(only) == [key] and float(only[key][0, 0]) == value


def test_key_text_is_unambiguous():
    paths = [
        (1,),
        ("1",),
        ("a.b",),
        ("a", "b"),
        (True,),
        ("True",),
        (1.5,),
        ("x", 0, "y"),
        ("x", "0", "y"),
        ("",),
        ("a]b",),
        ("-1",),
        (-1,),
    ]
    texts = [key_text(p) for p in paths]
    assert len(set(texts)) == len(texts), texts
    assert key_text(("layers", 0, "attn", "scores")) == "layers.0.attn.scores"


# --------------------------------------------------------------------------- containers without end


def test_shared_containers_are_walked_once(tmp_path):
    # 64 levels of [l, l]: 2^64 paths in a pickle of about a KB.
    level = [torch.ones(1, 2)]
    for _ in range(12):
        level = [level, level]
    p = tmp_path / "dag12.pt"
    torch.save(level, p)
    assert p.stat().st_size < 3000
    start = time.perf_counter()
    assert list(loaded(p)) == [".".join(["0"] * 13)]  # the first path only
    assert time.perf_counter() - start < 5
    for _ in range(52):
        level = [level, level]
    torch.save(level, tmp_path / "dag64.pt")
    bad([tmp_path / "dag64.pt"], rf"containers nested more than {MAX_DEPTH} deep")


def _pt_with_pickle(path: Path, data: bytes) -> Path:
    """A torch.save zip archive whose data.pkl is ``data``."""
    torch.save(torch.ones(1), path)
    with zipfile.ZipFile(path) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(path, "w") as z:
        for n, rec in records.items():
            z.writestr(n, data if n.endswith("data.pkl") else rec)
    return path


def test_lists_nested_200000_deep_are_refused(tmp_path):
    depth = 200_000
    data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."  # EMPTY_LIST x n, then APPEND x (n - 1)
    p = _pt_with_pickle(tmp_path / "deep.pt", data)
    start = time.perf_counter()
    bad([p], rf"deep\.pt: containers nested more than {MAX_DEPTH} deep")
    assert time.perf_counter() - start < 10


def test_too_many_tensors_are_refused(tmp_path):
    t = torch.ones(1, 2)
    p = tmp_path / "many.pt"
    torch.save([t] * (MAX_TENSORS + 1), p)  # one storage, pickled once
    bad([p], rf"many\.pt: holds more than {MAX_TENSORS} tensors")


# --------------------------------------------------------------------------- size before allocation


def _npy_bytes(shape, dtype="<f4", fortran=False, data=b"") -> bytes:
    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": fortran, "shape": shape})
    return buf.getvalue() + data


def _zip(path: Path, members: dict[str, bytes], compress=zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", compress) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_npz_zip_bomb_is_refused_with_its_size(tmp_path):
    # 64 MiB of zeros that deflate to ~64 KB: the header's size is refused before any of it is read.
    n = 16 * 1024 * 1024
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("q.npy", "w", force_zip64=True) as f:
            f.write(_npy_bytes((1, n)))
            zeros = bytes(1 << 20)
            for _ in range(n * 4 // len(zeros)):
                f.write(zeros)
    assert p.stat().st_size < 200_000
    for kind in ("scores", "mask"):
        bad([p], r"bomb\.npz:q: loading it whole needs 64 MiB, over max_memory 16 MiB", kind=kind, max_bytes=16 << 20)
    # Within the budget the member is decompressed in pieces into one buffer of its size.
    got = loaded(p, max_bytes=128 << 20)["q"]
    assert got.shape == (1, n) and not got.any()


def test_npz_member_claiming_a_huge_shape_is_refused_before_reading(tmp_path):
    p = _zip(tmp_path / "claim.npz", {"q.npy": _npy_bytes((1 << 20, 1 << 20), fortran=True)})
    bad([p], r"claim\.npz:q: not a valid \.npy member \(truncated: expected 4398046511104 bytes of data, found 0\)")
    huge = tmp_path / "claim2.npz"
    with zipfile.ZipFile(huge, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("q.npy", "w", force_zip64=True) as f:
            f.write(_npy_bytes((4, 1 << 20), fortran=True))
            zeros = bytes(1 << 20)
            for _ in range(16):
                f.write(zeros)
    with pytest.raises(
        AttncheckError,
        match=r"claim2\.npz:q: a Fortran-ordered array is read whole: it needs 16 MiB, over max_memory 1 MiB",
    ):
        open_sources([str(huge)], max_bytes=1 << 20)


def test_pt_larger_than_the_budget_is_refused_before_loading(tmp_path):
    p = tmp_path / "big.pt"
    torch.save({"s": torch.zeros(256, 1024)}, p)
    bad([p], r"big\.pt: loading it whole needs 1(\.\d+)? MiB, over max_memory 512 KiB", max_bytes=512 << 10)
    with pytest.raises(AttncheckError, match="over max_memory"):
        open_sources([str(p)], max_bytes=512 << 10)


def test_safetensors_whole_load_is_checked_against_the_budget(tmp_path):
    p = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"mask": torch.ones(512, 512, dtype=torch.bool)}, str(p))
    bad([p], r"m\.safetensors:mask: loading it whole needs 256 KiB, over max_memory 1 KiB", kind="mask", max_bytes=1024)


# --------------------------------------------------------------------------- headers and directories that lie


def test_npy_header_whose_shape_does_not_match_the_data(tmp_path):
    p = tmp_path / "f.npy"
    p.write_bytes(_npy_bytes((4,), fortran=True, data=np.arange(12, dtype="<f4").tobytes()))
    msg = (
        r"f\.npy: not a valid \.npy file \(the header's shape \(4,\), Fortran order of float32 accounts for 16 "
        r"bytes of data, but 48 follow it\)"
    )
    bad([p], msg)
    with pytest.raises(AttncheckError, match=msg):
        open_sources([str(p)])
    ok = tmp_path / "ok.npy"
    ok.write_bytes(_npy_bytes((12,), fortran=True, data=np.arange(12, dtype="<f4").tobytes()))
    assert torch.equal(loaded(ok)[str(ok)], torch.arange(12.0))


def _stored_npz(path: Path) -> Path:
    buf = io.BytesIO()
    np.save(buf, np.arange(8, dtype=np.float32).reshape(2, 4))
    return _zip(path, {"x.npy": buf.getvalue()}, zipfile.ZIP_STORED)


def _central(data: bytes) -> int:
    return data.rindex(b"PK\x01\x02")


@pytest.mark.parametrize("field,delta", [("file_size", 64), ("file_size", -8), ("compress_size", 64)])
def test_npz_central_directory_that_lies_about_sizes(tmp_path, field, delta):
    p = _stored_npz(tmp_path / "lie.npz")
    data = bytearray(p.read_bytes())
    at = _central(data) + {"compress_size": 20, "file_size": 24}[field]
    (value,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at, value + delta)
    p.write_bytes(bytes(data))
    for read in (loaded, sources):
        with pytest.raises(AttncheckError, match=r"lie\.npz(:x)?: not a valid \.npy (member|file)"):
            read(p)


def test_npz_central_directory_that_lies_about_a_name(tmp_path):
    p = _stored_npz(tmp_path / "name.npz")
    data = bytearray(p.read_bytes())
    local = data.index(b"x.npy")
    data[local : local + 5] = b"y.npy"  # the local header now names another member
    p.write_bytes(bytes(data))
    for read in (loaded, sources):
        with pytest.raises(
            AttncheckError,
            match=r"name\.npz:x: not a valid \.npy member \(File name in directory 'x\.npy' and header 'y\.npy' "
            r"differ\.\)",
        ):
            read(p)


def test_npz_with_two_members_of_one_name(tmp_path):
    p = tmp_path / "dup.npz"
    buf = io.BytesIO()
    np.save(buf, np.ones(3, np.float32))
    with pytest.warns(UserWarning, match="Duplicate name"):
        _zip(p, {"x.npy": buf.getvalue()})
        with zipfile.ZipFile(p, "a") as z:
            z.writestr("x.npy", buf.getvalue())
    bad([p], r"dup\.npz: not a valid \.npz file \(two members are named 'x\.npy'\)")


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".pt", ".safetensors"])
def test_masks_have_the_same_dtype_rules_in_every_format(tmp_path, suffix):
    def write(path, t):
        if suffix == ".npy":
            np.save(path, t.numpy())
        elif suffix == ".npz":
            np.savez(path, m=t.numpy())
        elif suffix == ".pt":
            torch.save({"m": t}, path)
        else:
            safetensors.torch.save_file({"m": t}, str(path))

    keep = torch.tensor([[True, False, True]])
    p = tmp_path / f"bool{suffix}"
    write(p, keep)
    (t,) = load_tensors([str(p)], kind="mask")
    assert t.tensor.dtype == torch.bool and torch.equal(t.tensor, keep)
    bad([p], "has dtype bool; attncheck needs floating-point scores")  # as scores: refused
    q = tmp_path / f"int{suffix}"
    write(q, keep.to(torch.int8))
    bad(
        [q],
        r"has dtype int8; use a boolean mask \(True = attend; mask_convention ignore for True = masked\) or an "
        r"additive float mask",
        kind="mask",
    )


def _sparse_safetensors(path: Path) -> np.ndarray:
    """A valid .safetensors of 128 GiB that takes a few KB on disk: 'big' (F32, 2^17 x 2^18) is a hole,
    'small' (4 x 8) holds real numbers after it."""
    import json

    big = 1 << 37
    small = np.linspace(-4.0, 4.0, 32, dtype=np.float32).reshape(4, 8)
    header = {
        "big": {"dtype": "F32", "shape": [1 << 17, 1 << 18], "data_offsets": [0, big]},
        "small": {"dtype": "F32", "shape": [4, 8], "data_offsets": [big, big + small.nbytes]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.seek(8 + len(text) + big)
        f.write(small.tobytes())
    return small


def test_a_large_valid_safetensors_under_an_address_space_limit_is_short_memory_not_invalid(tmp_path):
    """safetensors maps the whole file; under `ulimit -v` a valid 128 GiB file failed there and was
    called 'not a valid .safetensors file'. Now its tensors are listed from the header and streamed
    (no mapping), and a tensor that must be loaded whole says that memory is short."""
    import os
    import subprocess
    import sys

    path = tmp_path / "sparse.safetensors"
    small = _sparse_safetensors(path)
    if os.stat(path).st_blocks * 512 > 1 << 30:
        pytest.skip("this file system does not keep holes in files")
    np.save(tmp_path / "small.npy", small)
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (32 << 30, 32 << 30))  # far below the file's 128 GiB
import numpy as np, torch
from attncheck.errors import AttncheckError
from attncheck.loaders import load_tensors, open_sources
(src,) = open_sources([{str(path)!r}], ["small"])
assert src.shape == (4, 8), src.shape
got = torch.cat(list(src.row_blocks(3)))
assert torch.equal(got, torch.from_numpy(np.load({str(tmp_path / "small.npy")!r}))), got
try:
    load_tensors([{str(path)!r}], ["small"])
except AttncheckError as e:
    print(e)
else:
    print("loaded")
"""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip()
    if line == "loaded":  # this machine mapped 128 GiB within 32 GiB of address space: nothing to test here
        pytest.skip("the 128 GiB mapping succeeded under the limit")
    assert "memory is short: the 128 GiB file could not be mapped" in line and "its header is valid" in line, line
    assert "not a valid" not in line and "ulimit -v" in line
