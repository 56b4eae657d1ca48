"""Tests for attncheck.loaders: formats, naming, selection and bad input."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from attncheck.errors import AttncheckError
from attncheck.loaders import SUPPORTED_SUFFIXES, NamedTensor, load_tensors

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NUMPY_DTYPES = [np.float16, np.float32, np.float64]  # numpy has no bf16
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------
# helpers


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    """Values that stress exactness: random, extremes, subnormal, inf, nan, -0."""
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    flat = t.view(-1)
    info = torch.finfo(dtype)
    specials = [info.max, -info.max, info.tiny, info.tiny / 4, float("inf"), float("-inf"), float("nan"), -0.0]
    flat[: len(specials)] = torch.tensor(specials, dtype=torch.float64).to(dtype)
    return t


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.device.type == "cpu"
    bits = _BITS[expected.element_size()]
    assert torch.equal(actual.contiguous().view(bits), expected.contiguous().view(bits))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def truncate_half(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def bad(paths, match: str, keys=()) -> AttncheckError:
    """load_tensors must raise one clean, one-line AttncheckError matching `match`."""
    with pytest.raises(AttncheckError, match=match) as excinfo:
        load_tensors([str(p) for p in paths], keys)
    message = str(excinfo.value)
    assert "\n" not in message and "\r" not in message
    assert "Traceback" not in message
    assert len(message) < 1000
    return excinfo.value


def names(result: list[NamedTensor]) -> list[str]:
    return [nt.name for nt in result]


class Hostile:
    """Unpickling this creates `marker`: proof that pickled code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# --------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: d.__name__)
def test_npy_round_trip(tmp_path, dtype):
    expected = sample(torch.from_numpy(np.zeros(0, dtype)).dtype)
    path = tmp_path / "scores.npy"
    np.save(path, as_numpy(expected))
    [nt] = load_tensors([path])
    assert nt.name == str(path)
    assert_bitwise_equal(nt.tensor, expected)


def test_npy_big_endian_and_fortran_order(tmp_path):
    expected = sample(torch.float32, (4, 6))
    big = as_numpy(expected).astype(">f4")
    np.save(tmp_path / "big.npy", big)
    np.save(tmp_path / "fortran.npy", np.asfortranarray(as_numpy(expected)))
    result = load_tensors([tmp_path / "big.npy", tmp_path / "fortran.npy"])
    for nt in result:
        assert_bitwise_equal(nt.tensor, expected)


def test_npz_round_trip(tmp_path):
    arrays = {f"m_{d.__name__}": as_numpy(sample(torch.from_numpy(np.zeros(0, d)).dtype)) for d in NUMPY_DTYPES}
    path = tmp_path / "many.npz"
    np.savez(path, **arrays)
    result = load_tensors([path])
    assert names(result) == [f"{path}:{k}" for k in arrays]
    for nt, array in zip(result, arrays.values()):
        assert_bitwise_equal(nt.tensor, torch.from_numpy(array))


def test_npz_compressed(tmp_path):
    expected = sample(torch.float16, (8, 8))
    path = tmp_path / "c.npz"
    np.savez_compressed(path, scores=as_numpy(expected))
    [nt] = load_tensors([path])
    assert nt.name == f"{path}:scores"
    assert_bitwise_equal(nt.tensor, expected)
    nt.tensor.add_(0)  # writable, and no warning


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_pt_bare_tensor_round_trip(tmp_path, dtype, suffix):
    expected = sample(dtype)
    path = tmp_path / f"scores{suffix}"
    torch.save(expected, path)
    [nt] = load_tensors([path])
    assert nt.name == str(path)
    assert_bitwise_equal(nt.tensor, expected)


def test_pt_dict_round_trip_all_dtypes(tmp_path):
    expected = {str(d).removeprefix("torch."): sample(d) for d in FLOAT_DTYPES}
    path = tmp_path / "d.pt"
    torch.save(expected, path)
    result = load_tensors([path])
    assert names(result) == [f"{path}:{k}" for k in expected]
    for nt, t in zip(result, expected.values()):
        assert_bitwise_equal(nt.tensor, t)


def test_pt_legacy_format(tmp_path):
    expected = sample(torch.bfloat16)
    path = tmp_path / "legacy.pt"
    torch.save({"s": expected}, path, _use_new_zipfile_serialization=False)
    [nt] = load_tensors([path])
    assert nt.name == f"{path}:s"
    assert_bitwise_equal(nt.tensor, expected)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_safetensors_round_trip(tmp_path, dtype):
    expected = sample(dtype)
    path = tmp_path / "s.safetensors"
    safetensors.torch.save_file({"attn.scores": expected}, str(path))
    [nt] = load_tensors([path])
    assert nt.name == f"{path}:attn.scores"
    assert_bitwise_equal(nt.tensor, expected)


def test_names_use_path_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("x.npy", np.ones(3, np.float32))
    assert names(load_tensors(["x.npy"])) == ["x.npy"]
    assert names(load_tensors([Path("x.npy")])) == ["x.npy"]
    assert names(load_tensors(["./x.npy"])) == ["./x.npy"]
    assert names(load_tensors("x.npy")) == ["x.npy"]  # a lone path is accepted


def test_named_tensor_is_frozen(tmp_path):
    np.save(tmp_path / "x.npy", np.ones(3, np.float32))
    [nt] = load_tensors([tmp_path / "x.npy"])
    with pytest.raises(AttributeError):
        nt.name = "other"  # type: ignore[misc]


# --------------------------------------------------------------------------
# nested .pt naming


def test_pt_nested_naming_skips_non_tensor_leaves(tmp_path):
    t0, t1, t2, t3 = (torch.full((2, 3), float(i)) for i in range(4))
    obj = {
        "layers": [
            {"scores": t0, "step": 3, "note": "head 0", "mask": None},
            {"scores": t1},
        ],
        "meta": (t2, 7, 1.5),
        "empty": {},
        5: t3,
    }
    path = tmp_path / "dump.pt"
    torch.save(obj, path)
    result = load_tensors([path])
    assert names(result) == [
        f"{path}:layers.0.scores",
        f"{path}:layers.1.scores",
        f"{path}:meta.0",
        f"{path}:5",
    ]
    for nt, t in zip(result, (t0, t1, t2, t3)):
        assert torch.equal(nt.tensor, t)


def test_pt_top_level_list_and_parameter(tmp_path):
    p = torch.nn.Parameter(torch.ones(2, 2))
    path = tmp_path / "list.pt"
    torch.save([p, torch.zeros(3, dtype=torch.float16)], path)
    result = load_tensors([path])
    assert names(result) == [f"{path}:0", f"{path}:1"]
    assert type(result[0].tensor) is torch.Tensor
    assert not result[0].tensor.requires_grad


def test_pt_single_tensor_in_dict_keeps_its_key(tmp_path):
    path = tmp_path / "one.pt"
    torch.save({"only": torch.ones(2)}, path)
    assert names(load_tensors([path])) == [f"{path}:only"]


# --------------------------------------------------------------------------
# directories


def make_tree(root: Path) -> list[str]:
    (root / "b" / "deep").mkdir(parents=True)
    np.save(root / "z.npy", np.ones(2, np.float32))
    torch.save({"s": torch.ones(2)}, root / "a.pt")
    np.savez(root / "b" / "m.npz", x=np.ones(2), y=np.zeros(2))
    safetensors.torch.save_file({"k": torch.ones(2)}, str(root / "b" / "deep" / "t.safetensors"))
    (root / "notes.txt").write_text("not a tensor")
    (root / "b" / "README").write_text("ignored")
    return [
        f"{root / 'a.pt'}:s",
        f"{root / 'b' / 'deep' / 't.safetensors'}:k",
        f"{root / 'b' / 'm.npz'}:x",
        f"{root / 'b' / 'm.npz'}:y",
        str(root / "z.npy"),
    ]


def test_directory_is_recursive_and_sorted(tmp_path):
    expected = make_tree(tmp_path / "dumps")
    assert names(load_tensors([tmp_path / "dumps"])) == expected


def test_directory_and_files_mix_without_duplicates(tmp_path):
    expected = make_tree(tmp_path / "dumps")
    np.save(tmp_path / "extra.npy", np.ones(1, np.float64))
    result = load_tensors([tmp_path / "extra.npy", tmp_path / "dumps", tmp_path / "dumps"])
    assert names(result) == [str(tmp_path / "extra.npy")] + expected


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    bad([tmp_path / "empty"], r"empty: directory holds no supported tensor files")


def test_directory_without_supported_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hi")
    bad([tmp_path / "d"], r"d: directory holds no supported tensor files \(looked for \.pt")


def test_no_paths():
    bad([], r"no input files given")


# --------------------------------------------------------------------------
# --key selection


def test_keys_glob_across_files(tmp_path):
    root = tmp_path / "dumps"
    make_tree(root)
    result = load_tensors([root], keys=["[sx]"])
    assert names(result) == [f"{root / 'a.pt'}:s", f"{root / 'b' / 'm.npz'}:x"]


def test_key_matches_bare_tensor_by_file_name(tmp_path):
    np.save(tmp_path / "layer3.npy", np.ones(2, np.float32))
    np.save(tmp_path / "layer4.npy", np.ones(2, np.float32))
    result = load_tensors([tmp_path], keys=["layer3.*"])
    assert names(result) == [str(tmp_path / "layer3.npy")]


def test_keys_are_case_sensitive_and_dotted(tmp_path):
    path = tmp_path / "d.pt"
    torch.save({"layers": [{"scores": torch.ones(1)}, {"scores": torch.ones(1)}], "Scores": torch.ones(1)}, path)
    result = load_tensors([path], keys=["layers.*.scores"])
    assert names(result) == [f"{path}:layers.0.scores", f"{path}:layers.1.scores"]
    assert names(load_tensors([path], keys=["Sc*"])) == [f"{path}:Scores"]


def test_several_patterns_union_in_file_order(tmp_path):
    path = tmp_path / "d.safetensors"
    safetensors.torch.save_file({"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1)}, str(path))
    assert names(load_tensors([path], keys=["c", "a", "?"])) == [f"{path}:a", f"{path}:b", f"{path}:c"]


def test_key_matching_nothing(tmp_path):
    path = tmp_path / "a.pt"
    torch.save({"x": torch.ones(1), "y": torch.ones(1)}, path)
    bad([path], re.escape(f"keys 'foo*' matches no tensor (available: {path}:x, {path}:y)"), keys=["x", "foo*"])


def test_key_matching_nothing_lists_at_most_ten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.savez("many.npz", **{f"t{i:02d}": np.ones(1) for i in range(25)})
    listed = ", ".join(f"many.npz:t{i:02d}" for i in range(10))
    bad(
        ["many.npz"],
        re.escape(f"keys 'nope' matches no tensor (available: {listed}, ... (15 more))") + "$",
        keys=["nope"],
    )


def test_keys_select_before_loading(tmp_path):
    # Members that are not selected are never read, so their problems don't matter.
    npz = tmp_path / "m.npz"
    np.savez(npz, good=np.ones(2, np.float32), objects=np.array([None, 1], dtype=object), ints=np.arange(3))
    st = tmp_path / "s.safetensors"
    safetensors.torch.save_file({"good": torch.ones(2), "ints": torch.arange(3)}, str(st))
    result = load_tensors([npz, st], keys=["good"])
    assert names(result) == [f"{npz}:good", f"{st}:good"]


# --------------------------------------------------------------------------
# bad paths and suffixes


def test_missing_path(tmp_path):
    err = bad([tmp_path / "nope.pt"], r"nope\.pt: no such file or directory$")
    assert str(err).startswith(str(tmp_path))


def test_unknown_extension(tmp_path):
    path = write_bytes(tmp_path / "scores.csv", b"1,2,3\n")
    bad(
        [path],
        r"scores\.csv: unsupported file type '\.csv' \(supported: \.pt, \.pth, "
        r"\.npy, \.npz, \.safetensors\)",
    )


def test_no_extension(tmp_path):
    path = write_bytes(tmp_path / "scores", b"x")
    bad([path], r"scores: unsupported file type \(no extension\)")


def test_supported_suffixes():
    assert SUPPORTED_SUFFIXES == (".pt", ".pth", ".npy", ".npz", ".safetensors")


# --------------------------------------------------------------------------
# corrupt files


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_random_bytes(tmp_path, suffix):
    path = write_bytes(tmp_path / f"junk{suffix}", os.urandom(4096))
    err = bad([path], rf"junk{re.escape(suffix)}: not a valid {re.escape(suffix)} file \(.+\)$")
    assert err.__cause__ is not None or suffix in (".npy", ".npz", ".safetensors")  # headers attncheck checks itself


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_empty_file(tmp_path, suffix):
    path = write_bytes(tmp_path / f"e{suffix}", b"")
    bad([path], rf"e{re.escape(suffix)}: not a valid {re.escape(suffix)} file \(the file is empty\)")


def _write_valid(path: Path) -> None:
    t = torch.randn(64, 64)
    suffix = path.suffix
    if suffix in (".pt", ".pth"):
        torch.save({"scores": t}, path)
    elif suffix == ".npy":
        np.save(path, t.numpy())
    elif suffix == ".npz":
        np.savez(path, scores=t.numpy())
    else:
        safetensors.torch.save_file({"scores": t}, str(path))


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_truncated(tmp_path, suffix):
    path = tmp_path / f"cut{suffix}"
    _write_valid(path)
    load_tensors([path])  # valid before the cut
    truncate_half(path)
    err = bad([path], rf"cut{re.escape(suffix)}: not a valid {re.escape(suffix)} file \(.+\)$")
    assert err.__cause__ is not None or "truncated: expected" in str(err)  # .npy: its header's size against the file's


def test_truncated_npy_header(tmp_path):
    path = tmp_path / "h.npy"
    np.save(path, np.ones(2, np.float32))
    truncate_half(path)
    bad([path], r"h\.npy: not a valid \.npy file \(.*header")


def test_npz_with_corrupt_member(tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, x=np.ones(1000, np.float32))
    data = bytearray(path.read_bytes())
    data[200:400] = bytes(200)  # zero part of the stored member, keep the directory
    path.write_bytes(bytes(data))
    bad([path], r"m\.npz:x: not a valid \.npy member \(.*CRC")


def test_renamed_formats(tmp_path):
    npy = tmp_path / "a.npy"
    np.save(npy, np.ones(2, np.float32))
    npz = tmp_path / "a.npz"
    np.savez(npz, x=np.ones(2))
    as_npz = write_bytes(tmp_path / "b.npz", npy.read_bytes())
    as_npy = write_bytes(tmp_path / "b.npy", npz.read_bytes())
    as_pt = write_bytes(tmp_path / "b.pt", npz.read_bytes())
    bad([as_npz], r"b\.npz: not a valid \.npz file \(it is a single \.npy array; rename it to \.npy\)")
    bad([as_npy], r"b\.npy: not a valid \.npy file \(it is a zip archive")
    bad([as_pt], r"b\.pt: not a valid \.pt file \(a zip archive without data\.pkl")


# --------------------------------------------------------------------------
# pickles


def test_hostile_payload_is_live(tmp_path):
    # Guard for the tests below: unpickling Hostile really does create the marker.
    marker = tmp_path / "proof"
    pickle.loads(pickle.dumps(Hostile(marker))).close()
    assert marker.exists()


@pytest.mark.parametrize("writer", ["torch.save", "pickle", "pickle-protocol-2"])
def test_hostile_pickle_is_refused_not_run(tmp_path, writer):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {"scores": torch.ones(2), "evil": Hostile(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2 if writer.endswith("2") else None)
    bad(
        [path],
        r"evil\.pt: refused to load: it holds pickled objects other than tensors.*"
        r"\(attncheck loads \.pt files with weights_only=True and never runs pickled code\)$",
    )
    assert not marker.exists()


def test_torchscript_archive_is_refused(tmp_path):
    # torch.jit.script/save are deprecated (they warn), so mark a torch.save
    # archive the way torch.load recognises TorchScript: a constants.pkl record.
    path = tmp_path / "module.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path, "a") as archive:
        root = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{root}/constants.pkl", pickle.dumps(()))
    bad([path], r"module\.pt: refused to load: it is a TorchScript archive \(torch\.jit\.save\)")


def test_plain_pickle_without_tensors(tmp_path):
    path = tmp_path / "data.pt"
    with open(path, "wb") as f:
        pickle.dump({"a": [1, 2.0, "x"]}, f)
    bad([path], r"data\.pt: holds no tensors \(it is a plain pickle")


def test_pt_without_tensors(tmp_path):
    path = tmp_path / "meta.pt"
    torch.save({"step": 3, "name": "run", "none": None, "nested": [1, {"a": 2}]}, path)
    bad([path], r"meta\.pt: holds no tensors \(only a dict without tensors\)")


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_object_arrays_are_refused(tmp_path, suffix):
    marker = tmp_path / "pwned"
    array = np.array([Hostile(marker), 1.0], dtype=object)
    path = tmp_path / f"obj{suffix}"
    if suffix == ".npy":
        np.save(path, array, allow_pickle=True)
        what = r"obj\.npy"
    else:
        np.savez(path, objects=array)
        what = r"obj\.npz:objects"
    bad(
        [path],
        what + r": holds an object array \(pickled Python objects\), which attncheck "
        r"does not support; nothing was unpickled",
    )
    assert not marker.exists()


# --------------------------------------------------------------------------
# tensor validation


@pytest.mark.parametrize(
    ("fmt", "value", "shown"),
    [
        ("npy", np.arange(3, dtype=np.int64), "int64"),
        ("npy", np.array([True, False]), "bool"),
        ("npy", np.array([1 + 2j], dtype=np.complex64), "complex64"),
        ("npy", np.array(["a", "b"]), "<U1"),
        ("npz", np.arange(3, dtype=np.int32), "int32"),
        ("pt", torch.arange(3), "int64"),
        ("pt", torch.tensor([True]), "bool"),
        ("pt", torch.ones(2, dtype=torch.complex64), "complex64"),
        ("pt", torch.ones(2).to(torch.float8_e4m3fn), "float8_e4m3fn"),
        ("safetensors", torch.ones(2).to(torch.float8_e5m2), "float8_e5m2"),
        ("safetensors", torch.ones(2, dtype=torch.uint8), "uint8"),
    ],
)
def test_non_float_dtypes_are_refused(tmp_path, fmt, value, shown):
    path = tmp_path / f"x.{fmt}"
    if fmt == "npy":
        np.save(path, value)
        name = r"x\.npy"
    elif fmt == "npz":
        np.savez(path, v=value)
        name = r"x\.npz:v"
    elif fmt == "pt":
        torch.save(value, path)
        name = r"x\.pt"
    else:
        safetensors.torch.save_file({"v": value}, str(path))
        name = r"x\.safetensors:v"
    bad(
        [path],
        name + rf" has dtype {re.escape(shown)}; attncheck needs floating-point "
        r"scores \(fp16, bf16, fp32 or fp64\)$",
    )


def test_scalars_are_refused(tmp_path):
    np.save(tmp_path / "s.npy", np.float32(1.5))
    torch.save({"s": torch.tensor(1.5)}, tmp_path / "s.pt")
    bad(
        [tmp_path / "s.npy"],
        r"s\.npy is a 0-d scalar; attncheck needs at least one axis "
        r"\(the last axis holds the keys\)",
    )
    bad([tmp_path / "s.pt"], r"s\.pt:s is a 0-d scalar")


def test_empty_tensors_are_refused(tmp_path):
    np.save(tmp_path / "e.npy", np.zeros((0, 8), np.float32))
    safetensors.torch.save_file({"e": torch.zeros(4, 0)}, str(tmp_path / "e.safetensors"))
    bad([tmp_path / "e.npy"], r"e\.npy is empty \(shape \(0, 8\)\)$")
    bad([tmp_path / "e.safetensors"], r"e\.safetensors:e is empty \(shape \(4, 0\)\)$")


def test_sparse_tensors_are_refused(tmp_path):
    path = tmp_path / "sp.pt"
    torch.save({"s": torch.eye(3).to_sparse()}, path)
    bad([path], r"sp\.pt:s has layout sparse_coo; attncheck needs a dense tensor")


def test_formats_come_from_one_suffix_registry(tmp_path):
    from attncheck.loaders import open_file
    from attncheck.loaders.formats import FORMATS, SUPPORTED_SUFFIXES

    assert SUPPORTED_SUFFIXES == tuple(FORMATS) == (".pt", ".pth", ".npy", ".npz", ".safetensors")
    odd = tmp_path / "scores.csv"
    odd.write_text("1,2,3")
    with pytest.raises(
        AttncheckError, match=r"scores.csv: unsupported file type \(supported: .pt, .pth, .npy, .npz, .safetensors\)"
    ):
        open_file(str(odd))
