"""`attncheck run` on the inputs of the hostile-input audit: each gets one line on stderr
and exit 2, or (where the input is valid) the right tensors and nothing on stderr. Inputs
are a few KB; the zip bomb only claims its size."""

from __future__ import annotations

import io
import json
import time
import warnings
import zipfile

import numpy as np
import numpy.lib.format as npformat
import pytest
import torch
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r, match: str | None = None) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attncheck: error: "), r.stderr
    assert "Traceback" not in r.output
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


def report(r) -> dict:
    assert r.exit_code == 0, r.output
    assert r.stderr == "", r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def qk(tmp_path):
    g = torch.Generator().manual_seed(0)
    torch.save(
        {"q": torch.randn(1, 2, 8, 4, generator=g), "k": torch.randn(1, 2, 8, 4, generator=g)}, tmp_path / "qk.pt"
    )
    return tmp_path / "qk.pt"


# --------------------------------------------------------------------------- crashes


def test_meta_tensors_as_scores_q_and_mask(tmp_path, qk):
    meta = tmp_path / "meta.pt"
    torch.save({"s": torch.empty(2, 8, device="meta")}, meta)
    one_error(invoke("run", meta), "meta.pt:s is a meta tensor")
    one_error(invoke("run", "--q", meta, "--k", f"{qk}:k"), "meta.pt:s is a meta tensor")
    one_error(invoke("run", "--q", f"{qk}:q", "--k", f"{qk}:k", "--mask", meta), "meta.pt:s is a meta tensor")


def test_nested_tensor(tmp_path):
    p = tmp_path / "nested.pt"
    with warnings.catch_warnings():  # torch's prototype notice, given once per process
        warnings.simplefilter("ignore")
        torch.save(torch.nested.as_nested_tensor([torch.ones(2, 4), torch.ones(3, 4)]), p)
    one_error(invoke("run", p), "nested.pt is a nested tensor")


def test_file_name_longer_than_the_file_system_allows(tmp_path):
    long = tmp_path / ("a" * 300 + ".npy")
    one_error(invoke("run", long), "cannot read it (File name too long)")
    one_error(invoke("run", "--q", long, "--k", long), "cannot read it (File name too long)")


# --------------------------------------------------------------------------- hangs and memory


def test_shared_and_deeply_nested_containers_end_quickly(tmp_path):
    level = [torch.ones(1, 4)]
    for _ in range(64):
        level = [level, level]  # 2^64 paths
    torch.save(level, tmp_path / "dag.pt")
    deep = tmp_path / "deep.pt"
    torch.save(torch.ones(1), deep)
    with zipfile.ZipFile(deep) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(deep, "w") as z:
        for name, data in records.items():
            z.writestr(
                name, b"\x80\x02" + b"]" * 200_000 + b"a" * 199_999 + b"." if name.endswith("data.pkl") else data
            )
    start = time.perf_counter()
    one_error(invoke("run", tmp_path / "dag.pt"), "containers nested more than 64 deep")
    one_error(invoke("run", deep), "containers nested more than 64 deep")
    assert time.perf_counter() - start < 20


def test_zip_bomb_given_as_q_and_mask_is_refused_with_its_size(tmp_path, qk):
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("m.npy", "w", force_zip64=True) as f:
            header = io.BytesIO()
            npformat.write_array_header_1_0(
                header, {"descr": "<f4", "fortran_order": False, "shape": (1, 2, 8, 1 << 20)}
            )
            f.write(header.getvalue())
            zeros = bytes(1 << 20)
            for _ in range(64):  # 64 MiB of zeros, ~64 KB compressed
                f.write(zeros)
    assert bomb.stat().st_size < 200_000
    one_error(
        invoke("run", "--q", f"{qk}:q", "--k", f"{qk}:k", "--mask", bomb, "--max-memory", "16MiB"),
        "bomb.npz:m: loading it whole needs 64 MiB, over --max-memory 16 MiB",
    )
    one_error(
        invoke("run", "--q", bomb, "--k", f"{qk}:k", "--max-memory", "16MiB"), "needs 64 MiB, over --max-memory 16 MiB"
    )


def test_q_and_k_that_would_not_fit(tmp_path):
    torch.save({"q": torch.ones(1, 8, 2048, 64), "k": torch.ones(1, 8, 2048, 64)}, tmp_path / "big.pt")
    one_error(
        invoke(
            "run",
            "--q",
            f"{tmp_path / 'big.pt'}:q",
            "--k",
            f"{tmp_path / 'big.pt'}:k",
            "--causal",
            "--max-memory",
            "15MiB",
        ),
        # q and k alone: the causal mask is a rule, no plane is held (inputs.index_mask)
        "q, k and the mask (batch 1, heads 8, queries 2048, keys 2048) need 16 MiB in float64, over --max-memory 15 "
        "MiB",
    )


# --------------------------------------------------------------------------- valid input refused, bad input accepted


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_pt_saved_with_pickle_protocol_4_and_5(tmp_path, protocol, zip_format):
    p = tmp_path / "p.pt"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.save({"layer": {"scores": x}}, p, pickle_protocol=protocol, _use_new_zipfile_serialization=zip_format)
    (t,) = report(invoke("run", p, "--json", "-", "--quiet"))["tensors"]
    assert t["name"] == f"{p}:layer.scores" and t["census"]["max"] == float(x.max())


def test_boolean_mask_in_npy(tmp_path, qk):
    keep = np.tril(np.ones((8, 8), bool))
    np.save(tmp_path / "mask.npy", keep)
    torch.save(torch.from_numpy(keep), tmp_path / "mask.pt")
    a = report(
        invoke(
            "run",
            "--q",
            f"{qk}:q",
            "--k",
            f"{qk}:k",
            "--mask",
            tmp_path / "mask.npy",
            "--dtype",
            "fp32",
            "--json",
            "-",
            "--quiet",
        )
    )
    b = report(
        invoke(
            "run",
            "--q",
            f"{qk}:q",
            "--k",
            f"{qk}:k",
            "--mask",
            tmp_path / "mask.pt",
            "--dtype",
            "fp32",
            "--json",
            "-",
            "--quiet",
        )
    )
    assert a["tensors"][0]["census"] == b["tensors"][0]["census"]
    assert a["tensors"][0]["attention"]["masked_keys"] == 2 * 28


def test_npy_whose_header_does_not_match_its_data(tmp_path):
    header = io.BytesIO()
    npformat.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": True, "shape": (4,)})
    (tmp_path / "f.npy").write_bytes(header.getvalue() + np.arange(12, dtype="<f4").tobytes())
    one_error(invoke("run", tmp_path / "f.npy"), "accounts for 16 bytes of data, but 48 follow it")


def test_npz_whose_directory_lies(tmp_path):
    buf = io.BytesIO()
    np.save(buf, np.ones((2, 4), np.float32))
    p = tmp_path / "lie.npz"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("x.npy", buf.getvalue())
    data = bytearray(p.read_bytes())
    at = data.rindex(b"PK\x01\x02") + 24  # uncompressed size in the central directory
    data[at : at + 4] = (int.from_bytes(data[at : at + 4], "little") + 64).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    one_error(invoke("run", p), "lie.npz:x: not a valid .npy member")
    name = tmp_path / "name.npz"
    with zipfile.ZipFile(name, "w") as z:
        z.writestr("x.npy", buf.getvalue())
    data = bytearray(name.read_bytes())
    data[data.index(b"x.npy")] = ord("y")  # the local header names another member
    name.write_bytes(bytes(data))
    one_error(invoke("run", name), "File name in directory 'x.npy' and header 'y.npy' differ.")


# --------------------------------------------------------------------------- names


def test_colliding_names_are_distinct_and_key_selects_exactly(tmp_path):
    npz = tmp_path / "c.npz"
    np.savez(npz, **{"x": np.ones((2, 4), np.float32), "x.npy": np.zeros((2, 4), np.float32)})
    pt = tmp_path / "c.pt"
    torch.save(
        {
            1: torch.full((2, 4), 1.0),
            "1": torch.full((2, 4), 2.0),
            "a.b": torch.full((2, 4), 3.0),
            "a": {"b": torch.full((2, 4), 4.0)},
        },
        pt,
    )
    seen = {t["name"]: t["census"]["max"] for t in report(invoke("run", npz, pt, "--json", "-", "--quiet"))["tensors"]}
    assert seen == {
        f"{npz}:x": 1.0,
        f"{npz}:x.npy": 0.0,
        f"{pt}:1": 1.0,
        f"{pt}:['1']": 2.0,
        f"{pt}:['a.b']": 3.0,
        f"{pt}:a.b": 4.0,
    }
    for path, key, value in (
        (npz, "x.npy", 0.0),
        (npz, "x", 1.0),
        (pt, "['1']", 2.0),
        (pt, "a.b", 4.0),
        (pt, "['a.b']", 3.0),
    ):
        (t,) = report(invoke("run", path, "--key", key, "--json", "-", "--quiet"))["tensors"]
        assert (t["name"], t["census"]["max"]) == (f"{path}:{key}", value)


def test_key_holding_a_colon_selects_its_tensor_as_q(tmp_path, qk):
    p = tmp_path / "colon.pt"
    q = torch.load(qk)["q"]
    torch.save({"enc:q": q}, p)
    r = invoke("run", "--q", f"{p}:enc:q", "--k", f"{qk}:k", "--dtype", "fp32", "--json", "-", "--quiet")
    assert report(r)["tensors"][0]["name"] == f"{p}:enc:q @ {qk}:k"


def test_stderr_is_empty_on_success(tmp_path):
    p = tmp_path / "p4.pt"
    torch.save(torch.ones(2, 3), p, pickle_protocol=4)
    r = invoke("run", p, "--brief")
    assert r.exit_code == 0 and r.stderr == ""


# --------------------------------------------------------------------------- --max-memory


def test_max_memory_has_a_floor_and_takes_large_units(tmp_path):
    np.save(tmp_path / "s.npy", np.zeros((4, 8), np.float32))
    one_error(
        invoke("run", tmp_path / "s.npy", "--max-memory", "1B"), "--max-memory must be at least 1MiB"
    )  # 200,000 rows at 1 byte never ended
    report(invoke("run", tmp_path / "s.npy", "--max-memory", "1PB", "--json", "-", "--quiet"))
    one_error(invoke("run", tmp_path / "s.npy", "--max-memory", "1" + "0" * 5000), "is not a size")


def test_a_row_larger_than_the_budget_is_refused(tmp_path):
    """One row of 2e9 keys, a stride-0 view of one element (a few bytes on disk): refused, not allocated."""
    torch.save({"s": torch.zeros(1).expand(2_000_000_000).reshape(1, -1)}, tmp_path / "row.pt")
    assert (tmp_path / "row.pt").stat().st_size < 10_000
    one_error(
        invoke("run", tmp_path / "row.pt"),
        "a row of 2,000,000,000 keys needs 178.8 GiB of working memory, over --max-memory",
    )


def _capture(path, q, mask=None):
    import torch.nn.functional as F

    import attncheck

    with torch.no_grad(), attncheck.capture(path):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    return path


def test_a_call_larger_than_the_budget_is_refused_from_its_header(tmp_path):
    d = _capture(tmp_path / "cap", torch.ones(1, 4, 256, 256))  # q, k, v: 3 MiB
    one_error(
        invoke("run", d, "--max-memory", "2MiB"),
        "(call 0, sdpa): loading the call whole needs 3 MiB, over --max-memory 2 MiB",
    )
    r = invoke("run", d, "--max-memory", "2MiB", "--partial", "--quiet")
    assert (
        r.exit_code == 2
        and len(r.stderr.strip().splitlines()) == 1
        and "loading the call whole needs 3 MiB" in r.stderr
    )


def test_a_mask_broadcast_over_heads_is_not_expanded(tmp_path):
    """A (T, T) boolean mask over 64 heads: q, k, v and the mask count at their own size (the expanded
    planes alone would be 16 MiB, over the budget)."""
    g = torch.Generator().manual_seed(0)
    d = _capture(
        tmp_path / "cap", torch.randn(1, 64, 512, 4, generator=g), torch.tril(torch.ones(512, 512, dtype=torch.bool))
    )
    r = invoke("run", d, "--max-memory", "8MiB", "--json", "-", "--quiet")
    data = report(r)
    assert (
        data["model"]["calls"][0]["nan_rows"] == 0
        and data["tensors"][0]["attention"]["masked_keys"] == 64 * 512 * 511 // 2
    )
    one_error(
        invoke("run", d, "--max-memory", "3MiB"),
        "q, k, v and the mask (batch 1, heads 64, queries 512, keys 512) need 3.25 MiB in float64, over --max-memory "
        "3 MiB",
    )
    one_error(
        invoke("run", d, "--max-memory", "1MiB"), "loading the call whole needs 1.75 MiB, over --max-memory 1 MiB"
    )
