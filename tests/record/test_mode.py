"""What the recorder sees and keeps: SDPA and softmax calls, module paths, metadata, bounds,
filters, nn.MultiheadAttention, and that the wrapped computation is unchanged."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import attncheck
from attncheck.errors import AttncheckError
from attncheck.loaders.calls import file_part

from .conftest import batch, gpt2


class Eager(torch.nn.Module):
    """Hand-written attention: q.k^T / sqrt(d) (or * a tensor), a mask, softmax, P @ V."""

    def __init__(self, how="div", softmax="F"):
        super().__init__()
        self.how, self.softmax = how, softmax

    def forward(self, q, k, v, mask=None):
        s = q @ k.transpose(-1, -2)
        if self.how == "div":
            s = s / math.sqrt(q.shape[-1])
        elif self.how == "mul":
            s = 0.25 * s
        elif self.how == "tensor":
            s = s * torch.full((1, 1, 1, 1), 0.25)  # a tensor factor: the scale is not traced
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        if self.softmax == "F":
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        elif self.softmax == "torch":
            p = torch.softmax(s, -1)
        else:
            p = s.softmax(dim=-1)
        return torch.matmul(p, v)


def qkv(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(3)]


def test_plain_sdpa_outside_any_module_is_recorded_as_given(tmp_path):
    q, k, v = qkv(2, 4, 6, 8)
    k2, v2 = k[:, :2], v[:, :2]
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 4, 6, 6)  # an expanded view: kept at (1, 1, 6, 6)
    expected = F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask, scale=0.3, enable_gqa=True)
    with attncheck.capture(tmp_path / "cap") as cap:
        out = F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask, scale=0.3, enable_gqa=True)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
    assert torch.equal(out, expected)
    assert [c["file"] for c in cap.calls] == ["0000-global.safetensors", "0001-global.safetensors"]
    path = str(tmp_path / "cap" / "0000-global.safetensors")
    t = load_file(path)
    assert torch.equal(t["q"], q) and torch.equal(t["k"], k2) and torch.equal(t["v"], v2)
    assert t["attn_mask"].shape == (1, 1, 6, 6) and torch.equal(t["attn_mask"].expand(2, 4, 6, 6), mask)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert (
        meta["kind"] == "sdpa" and meta["module"] == "" and meta["scale"] == repr(0.3) and meta["enable_gqa"] == "true"
    )
    assert (
        meta["is_causal"] == "false"
        and meta["torch_version"] == torch.__version__
        and json.loads(meta["dtypes"])["q"] == "float32"
    )
    with safe_open(str(tmp_path / "cap" / "0001-global.safetensors"), "pt") as f:
        second = f.metadata()
    assert second["is_causal"] == "true" and second["scale"] == "none"
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert doc["schema"] == "attncheck.capture/1" and doc["complete"] and [c["index"] for c in doc["calls"]] == [0, 1]


@pytest.mark.parametrize("how,scale", [("div", 1 / math.sqrt(8)), ("mul", 0.25), ("tensor", None)])
@pytest.mark.parametrize("softmax", ["F", "torch", "method"])
def test_eager_softmax_records_scores_qkv_and_the_traced_scale(how, scale, softmax):
    q, k, v = qkv(1, 2, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    module = Eager(how, softmax)
    expected = module(q, k, v, mask)
    with attncheck.capture() as cap:
        out = module(q, k, v, mask)
    assert torch.equal(out, expected)
    (call,) = cap.calls
    assert call.kind == "softmax" and call.module == "Eager"
    assert torch.equal(call.tensors["q"], q) and torch.equal(call.tensors["k"], k) and torch.equal(call.tensors["v"], v)
    s = q @ k.transpose(-1, -2)
    s = s / math.sqrt(8) if how == "div" else (0.25 * s if how == "mul" else s * torch.full((1, 1, 1, 1), 0.25))
    assert torch.equal(call.tensors["scores"], s.masked_fill(~mask, float("-inf")))
    assert call.meta["has_qk"] == "true"
    assert call.meta.get("scale") == (None if scale is None else repr(scale))
    assert call.meta["softmax_dtype"] == ("float32" if softmax == "F" else "none")


def test_softmax_not_over_the_last_axis_or_outside_a_module_is_not_recorded():
    x = torch.randn(2, 3, 4)

    class Other(torch.nn.Module):
        def forward(self, x):
            return x.softmax(dim=1) + torch.softmax(x[0], -1).sum()  # axis 1; a 2-D tensor

    with attncheck.capture() as cap:
        torch.softmax(x, dim=-1)  # outside any module
        Other()(x)
    assert cap.calls == []


def test_module_paths_are_the_deepest_module_named_from_the_top_module(tmp_path):
    model = gpt2("sdpa", layers=3)
    with torch.no_grad(), attncheck.capture(tmp_path / "cap", modules="*.h.[12].*") as cap:
        model(**batch())
    assert [c["module"] for c in cap.calls] == ["transformer.h.1.attn", "transformer.h.2.attn"]
    assert [c["file"] for c in cap.calls] == [
        "0000-transformer.h.1.attn.safetensors",
        "0001-transformer.h.2.attn.safetensors",
    ]


def test_forwards_picks_forward_passes_of_the_top_module():
    model = gpt2("sdpa")
    inputs = batch()
    with torch.no_grad(), attncheck.capture(forwards="2-3") as cap:
        for _ in range(4):
            model(**inputs)
    assert [(c.forward, c.module) for c in cap.calls] == [
        (2, "transformer.h.0.attn"),
        (2, "transformer.h.1.attn"),
        (3, "transformer.h.0.attn"),
        (3, "transformer.h.1.attn"),
    ]
    with pytest.raises(AttncheckError, match="forwards"):
        attncheck.capture(forwards="0")


def test_max_calls_and_max_bytes_stop_recording_and_say_so(tmp_path):
    q, k, v = qkv(1, 2, 16, 8)
    one_call = 3 * q.numel() * 4
    heard = []
    with attncheck.capture(max_calls=2, notice=heard.append) as cap:
        for _ in range(5):
            F.scaled_dot_product_attention(q, k, v)
    assert len(cap.calls) == 2 and "max_calls 2" in cap.stopped and len(heard) == 1 and "2 call(s) recorded" in heard[0]
    with attncheck.capture(tmp_path / "cap", max_bytes=3 * one_call + one_call // 2) as cap:
        for _ in range(5):
            F.scaled_dot_product_attention(q, k, v)
    assert len(cap.calls) == 3 and "max_bytes" in cap.stopped
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert (
        doc["stopped"] == cap.stopped and not doc["complete"] and doc["total_bytes"] == 3 * one_call <= doc["max_bytes"]
    )
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == [
        "0000-global.safetensors",
        "0001-global.safetensors",
        "0002-global.safetensors",
        "manifest.json",
    ]


def test_in_memory_tensors_are_copies():
    q, k, v = qkv(1, 1, 4, 8)
    with attncheck.capture() as cap:
        F.scaled_dot_product_attention(q, k, v)
    q.add_(1.0)  # the model changes its buffer afterwards (a KV cache does)
    assert not torch.equal(cap.calls[0].tensors["q"], q)


def test_multihead_attention_and_encoder_layer_are_recorded_and_unchanged(tmp_path):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [True, False, False, False, False]])
    fast = torch.backends.mha.get_fastpath_enabled()

    def run():
        with torch.no_grad():
            return (
                mha(x, x, x)[0],
                mha(x, x, x, need_weights=False, key_padding_mask=pad)[0],
                layer(x, src_key_padding_mask=pad),
            )

    torch.backends.mha.set_fastpath_enabled(False)  # what capture compares against: the non-fused path
    try:
        expected = run()
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    torch.backends.mha.set_fastpath_enabled(True)
    try:
        with attncheck.capture(tmp_path / "cap") as cap:
            assert not torch.backends.mha.get_fastpath_enabled()  # off while recording
            got = run()
        assert torch.backends.mha.get_fastpath_enabled()  # and restored
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [(c["kind"], c["module"]) for c in cap.calls] == [
        ("softmax", "MultiheadAttention"),
        ("sdpa", "MultiheadAttention"),
        ("sdpa", "self_attn"),
    ]
    assert cap.calls[0]["tensors"]["scores"]["shape"] == [8, 5, 5]  # (batch * heads, queries, keys)
    from attncheck.config.run import RunRequest
    from attncheck.pipelines.run import run as run_files

    result = run_files(RunRequest((str(tmp_path / "cap"),)))
    assert [c.diagnosis.shape for c in result.calls] == [(2, 4, 5, 5), (2, 4, 5, 5), (2, 2, 5, 5)]
    # the padded key is masked in the SDPA calls: one key of batch element 1 in every row of its heads
    assert result.calls[1].diagnosis.census.masked == 4 * 5


def test_file_names_stay_inside_the_directory(tmp_path):
    assert (
        file_part("../../etc/passwd") == "_.._etc_passwd"
        and "/" not in file_part("a/b\\c")
        and file_part("") == "global"
    )

    class Outer(torch.nn.Module):
        def forward(self, *a):
            return getattr(self, "x/y\\z")(*a)

    outer = Outer()
    outer.add_module("x/y\\z", Eager())  # module names cannot hold '.', but may hold path separators
    q, k, v = qkv(1, 1, 4, 8)
    out = tmp_path / "cap"
    before = sorted(p.name for p in tmp_path.iterdir())
    with attncheck.capture(out) as cap:
        outer(q, k, v)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["cap"])
    assert [p.name for p in out.iterdir() if p.name != "manifest.json"] == [cap.calls[0]["file"]]
    assert cap.calls[0]["file"] == "0000-x_y_z.safetensors"


def test_directory_must_be_new_empty_or_a_previous_capture(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(AttncheckError, match="not empty"):
        with attncheck.capture(busy):
            pass
    assert (busy / "notes.txt").read_text() == "mine"
    q, k, v = qkv(1, 1, 4, 8)
    for n in (3, 1):  # a second capture replaces the first one's files
        with attncheck.capture(tmp_path / "cap"):
            for _ in range(n):
                F.scaled_dot_product_attention(q, k, v)
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == ["0000-global.safetensors", "manifest.json"]
    with pytest.raises(AttncheckError, match="does not exist"):
        attncheck.capture(tmp_path / "no" / "cap").__enter__()


def test_autocast_dtype_is_the_calls_dtype():
    q, k, v = qkv(1, 2, 4, 8)
    with attncheck.capture() as cap, torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, k, v)
    meta = cap.calls[0].meta
    assert (
        meta["dtype"] == "bfloat16"
        and meta["autocast_dtype"] == "bfloat16"
        and json.loads(meta["dtypes"])["q"] == "float32"
    )


def test_a_write_that_fails_stops_recording_and_the_model_runs_on(tmp_path, monkeypatch):
    import errno

    from attncheck.record import store

    written = []

    def full_disk(path, tensors, meta):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        real(path, tensors, meta)

    real = store.write_safetensors
    monkeypatch.setattr(store, "write_safetensors", full_disk)
    q, k, v = qkv(1, 1, 4, 8)
    heard = []
    with attncheck.capture(tmp_path / "cap", notice=heard.append) as cap:
        for _ in range(4):
            out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert "No space left on device" in cap.stopped
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert [c["file"] for c in doc["calls"]] == ["0000-global.safetensors"] and not doc["complete"]
