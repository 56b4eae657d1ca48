"""Capture directories, call files and q/k-named files as calls: order, checks, messages."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import attncheck
from attncheck.errors import AttncheckError
from attncheck.loaders import TensorSource
from attncheck.loaders.calls import CallSource, open_capture, open_inputs, qk_groups, role_of
from attncheck.loaders.paths import natural_key


def make_capture(path, calls=3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 8, generator=g)
    with attncheck.capture(path):
        for _ in range(calls):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return path


def test_natural_order():
    names = ["layer_10.npy", "layer_2.npy", "layer_1.npy", "Layer_3.npy"]
    assert sorted(names, key=natural_key) == ["Layer_3.npy", "layer_1.npy", "layer_2.npy", "layer_10.npy"]


def test_directories_are_read_in_natural_order(tmp_path):
    for i in (10, 2, 1):
        np.save(tmp_path / f"layer_{i}.npy", np.zeros((2, 4), np.float32))
    found, _ = open_inputs([tmp_path])
    assert [s.name for s in found] == [str(tmp_path / f"layer_{i}.npy") for i in (1, 2, 10)]


def test_safetensors_keys_in_natural_order(tmp_path):
    p = tmp_path / "s.safetensors"
    save_file({f"layers.{i}.scores": torch.zeros(2, 4) for i in (10, 9, 1)}, str(p))
    found, _ = open_inputs([p])
    assert [s.name.rsplit(":", 1)[1] for s in found] == ["layers.1.scores", "layers.9.scores", "layers.10.scores"]


@pytest.mark.parametrize(
    "key,expected",
    [
        ("q", ("", "q")),
        ("layers.3.query", ("layers.3", "q")),
        ("blk/Key_States", ("blk", "k")),
        ("attn_mask", ("", "attn_mask")),
        ("a.value", ("a", "v")),
        ("layers.3.scores", ("layers.3", "scores")),
        ("layer0.weights", ("layer0.weights", None)),
    ],
)
def test_roles(key, expected):
    assert role_of(key) == expected


def test_qk_groups_take_q_and_k_with_their_prefix():
    groups, rest = qk_groups(
        [
            "layers.10.q",
            "layers.10.k",
            "layers.2.query",
            "layers.2.key",
            "layers.2.mask",
            "layers.2.v",
            "other",
            "layers.3.q",
        ]
    )
    assert groups == [
        ("layers.2", {"q": "layers.2.query", "k": "layers.2.key", "attn_mask": "layers.2.mask", "v": "layers.2.v"}),
        ("layers.10", {"q": "layers.10.q", "k": "layers.10.k"}),
    ]
    assert rest == ["other", "layers.3.q"]  # no k beside it: a score tensor


def test_a_file_of_q_k_mask_is_one_call_not_three_score_tensors(tmp_path):
    p = tmp_path / "qk.pt"
    torch.save(
        {
            "query": torch.randn(1, 2, 4, 8),
            "key": torch.randn(1, 2, 4, 8),
            "attn_mask": torch.ones(4, 4, dtype=torch.bool),
        },
        p,
    )
    found, _ = open_inputs([p])
    assert len(found) == 1 and isinstance(found[0], CallSource) and found[0].info.kind == "qk"
    assert set(found[0].load()) == {"q", "k", "attn_mask"} and found[0].load()["attn_mask"].dtype == torch.bool


def test_capture_directory_calls_in_call_order(tmp_path):
    d = make_capture(tmp_path / "cap")
    found, manifests = open_inputs([d])
    assert [s.info.index for s in found] == [0, 1, 2] and all(s.problem is None for s in found)
    assert found[0].info.kind == "sdpa" and found[0].info.is_causal and found[0].info.module == ""
    assert manifests[0]["schema"] == "attncheck.capture/1"


def test_a_call_file_on_its_own_is_a_call(tmp_path):
    d = make_capture(tmp_path / "cap", 1)
    single = tmp_path / "one.safetensors"
    shutil.copy(d / "0000-global.safetensors", single)
    found, _ = open_inputs([single])
    assert isinstance(found[0], CallSource) and found[0].info.kind == "sdpa"


def problem(tmp_path, change):
    d = make_capture(tmp_path / "cap")
    change(d)
    try:
        found, _ = open_inputs([d])
    except AttncheckError as e:
        return e.message
    return next(s.problem for s in found if s.problem)


def test_missing_file_names_the_call(tmp_path):
    msg = problem(tmp_path, lambda d: (d / "0001-global.safetensors").unlink())
    assert (
        msg == f"{tmp_path / 'cap' / '0001-global.safetensors'} (call 1, sdpa): listed in "
        f"{tmp_path / 'cap' / 'manifest.json'} but missing"
    )


def test_truncated_file_names_the_call(tmp_path):
    def cut(d):
        p = d / "0002-global.safetensors"
        p.write_bytes(p.read_bytes()[:-100])

    msg = problem(tmp_path, cut)
    assert msg.startswith(
        f"{tmp_path / 'cap' / '0002-global.safetensors'} (call 2, sdpa): not a valid .safetensors file (truncated"
    )


def test_unlisted_file_is_a_mismatch(tmp_path):
    msg = problem(tmp_path, lambda d: shutil.copy(d / "0000-global.safetensors", d / "0007-global.safetensors"))
    assert (
        msg == f"{tmp_path / 'cap' / 'manifest.json'} does not match the files: "
        f"{tmp_path / 'cap' / '0007-global.safetensors'} is not listed in it"
    )


def test_manifest_entry_that_does_not_match_the_file(tmp_path):
    def edit(d):
        doc = json.loads((d / "manifest.json").read_text())
        doc["calls"][1]["kind"] = "softmax"
        doc["calls"][2]["tensors"]["q"]["shape"] = [9]
        (d / "manifest.json").write_text(json.dumps(doc))

    d = tmp_path / "cap"
    problem(tmp_path, edit)
    found, _ = open_inputs([d])
    assert found[1].problem.endswith(
        "does not match " + str(d / "manifest.json") + " (kind 'sdpa' in the file, 'softmax' in the manifest)"
    )
    assert "tensor 'q': shape (1, 2, 6, 8) in the file, shape (9,) in the manifest" in found[2].problem
    assert found[0].problem is None


@pytest.mark.parametrize(
    "text,why",
    [
        ("{", "not JSON"),
        ('{"schema": "x"}', "not an attncheck capture manifest"),
        (
            '{"schema": "attncheck.capture/1", "calls": [{"file": "../x.safetensors", "index": 0}]}',
            "not a call file of this directory",
        ),
    ],
)
def test_bad_manifest(tmp_path, text, why):
    msg = problem(tmp_path, lambda d: (d / "manifest.json").write_text(text))
    assert why in msg and "manifest.json" in msg


def test_plain_files_stay_score_sources(tmp_path):
    np.save(tmp_path / "s.npy", np.zeros((2, 3, 4), np.float32))
    found, manifests = open_inputs([tmp_path / "s.npy"])
    assert isinstance(found[0], TensorSource) and manifests == []


def test_a_call_file_that_cannot_be_mapped_says_memory_is_short(tmp_path, monkeypatch):
    """safetensors maps a call file whole; under an address-space limit that fails with ENOMEM, which
    says nothing about the file (the same error text as safetensors' own, os error 12)."""
    import safetensors

    cap = make_capture(tmp_path / "cap", calls=1)
    (call,) = open_capture(cap)[0]

    def refuse(*args, **kwargs):
        raise RuntimeError("unable to mmap 1234 bytes from file <x>: Cannot allocate memory (12)")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    with pytest.raises(AttncheckError, match="memory is short: the call's file could not be mapped .*ulimit -v"):
        call.load()
