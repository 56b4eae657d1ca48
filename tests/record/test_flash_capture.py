"""A capture knows what ran on a GPU, and records the flash-attn package's calls.

The flash-attn package needs a GPU; here a FAKE ``flash_attn`` package (written to a temporary folder put on
sys.path) has FlashAttention-2's interface (Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced,
flash_attn/flash_attn_interface.py:1156 and :1391) and computes attention with torch's SDPA after transposing
from flash-attn's (B, T, H, D) layout, causal aligned to the bottom right as flash-attn documents it. What is
checked: the calls are recorded as kind 'flash_attn' with their arguments, in attncheck's (B, H, T, D) layout (the
recorded tensors give the model's output back through torch's own SDPA), the fake's inner SDPA call is not
recorded a second time, the module attributes (and transformers' names) are restored after the block, also when
it fails, nothing is imported where the package is absent, and ``attncheck run`` judges a plain call and refuses,
in one line, one SDPA cannot express. The GPU facts (compute capability, flash implementation) are checked with a
fake capability on the CPU and for real where CUDA is present.
"""

import importlib
import json
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.loaders import jsondoc
from attncheck.loaders.calls import open_capture
from attncheck.loaders.capture_schema import CallMeta, meta_fields
from attncheck.record.flash import flash_impl, gpu_facts

runner = CliRunner()

FAKE = """
import torch
import torch.nn.functional as F

__version__ = "0.0.0+fake"
RAN = []


def _attend(q, k, v, softmax_scale, causal):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, D) -> (B, H, T, D)
    tq, tk = q.shape[-2], k.shape[-2]
    mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq) if causal else None  # bottom-right, as flash-attn
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    RAN.append("flash_attn_func")
    return _attend(q, k, v, softmax_scale, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    RAN.append("flash_attn_varlen_func")
    outs = []
    for i in range(len(cu_seqlens_q) - 1):  # through the module's own flash_attn_func: patched while recording
        a, b, c, d = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        outs.append(flash_attn_func(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale=softmax_scale,
                                    causal=causal)[0])
    return torch.cat(outs)
"""


@pytest.fixture
def fake_flash(tmp_path, monkeypatch):
    """The fake flash_attn package, importable; removed from sys.modules afterwards."""
    pkg = tmp_path / "site" / "flash_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    for name in _fakes():
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in _fakes():
        del sys.modules[name]


def _fakes() -> list[str]:
    return [n for n in sys.modules if n.split(".")[0] in ("flash_attn", "flash_attn_interface")]


class FlashAttention(torch.nn.Module):
    """A layer calling flash-attn as model code does: the package's attribute, looked up at the call."""

    def __init__(self, causal=False, scale=None, varlen=None, **extra):
        super().__init__()
        self.causal, self.scale, self.varlen, self.extra = causal, scale, varlen, extra

    def forward(self, q, k, v):
        import flash_attn

        if self.varlen is not None:
            cu = torch.tensor(self.varlen, dtype=torch.int32)
            return flash_attn.flash_attn_varlen_func(
                q, k, v, cu, cu, 8, 8, softmax_scale=self.scale, causal=self.causal
            )
        return flash_attn.flash_attn_func(q, k, v, softmax_scale=self.scale, causal=self.causal, **self.extra)


def bthd(b=2, t=6, h=4, hk=4, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).to(dtype)
    k = torch.randn(b, t, hk, d, generator=g).to(dtype)
    v = torch.randn(b, t, hk, d, generator=g).to(dtype)
    return q, k, v


def test_a_flash_attn_call_is_recorded_in_bhtd_layout_with_its_arguments(fake_flash):
    import flash_attn

    q, k, v = bthd(h=4, hk=2)
    model = FlashAttention(causal=True, scale=0.3)
    expected = model(q, k, v)
    with torch.no_grad(), attncheck.capture() as cap:
        out = model(q, k, v)
    assert torch.equal(out, expected) and flash_attn.RAN == ["flash_attn_func"] * 2
    (call,) = cap.calls  # the fake's own SDPA call inside it is not recorded again
    assert call.kind == "flash_attn" and call.module == "FlashAttention"
    t, m = call.tensors, call.meta
    assert all(torch.equal(t[role], x.transpose(1, 2)) for role, x in (("q", q), ("k", k), ("v", v)))
    assert t["q"].shape == (2, 4, 6, 8) and t["k"].shape == (2, 2, 6, 8)
    # the recorded tensors are attention in attncheck's layout: torch's SDPA on them gives the model's output
    # (Tq == Tk: flash-attn's bottom-right causal mask is SDPA's top-left one)
    again = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(again.transpose(1, 2), out, rtol=0, atol=1e-6)
    assert {
        key: m[key]
        for key in (
            "flash_fn",
            "flash_package",
            "is_causal",
            "scale",
            "scale_source",
            "enable_gqa",
            "window",
            "softcap",
            "descales",
            "sinks",
            "flash_extras",
            "dtype",
            "device",
        )
    } == {
        "flash_fn": "flash_attn_func",
        "flash_package": "fa2",
        "is_causal": "true",
        "scale": "0.3",
        "scale_source": "argument",
        "enable_gqa": "true",
        "window": "-1,-1",
        "softcap": "none",
        "descales": "none",
        "sinks": "false",
        "flash_extras": "none",
        "dtype": "float32",
        "device": "cpu",
    }
    assert "capability" not in m and "flash_impl" not in m  # a CPU call: no GPU facts
    c = jsondoc.convert(meta_fields(m), CallMeta, lax=True)
    assert (c.kind, c.flash_fn, c.window, c.is_causal, c.scale) == ("flash_attn", "flash_attn_func", "-1,-1", True, 0.3)


def test_the_arguments_sdpa_has_no_counterpart_for_are_recorded(fake_flash):
    q, k, v = bthd()
    slopes = torch.rand(4)
    with torch.no_grad(), attncheck.capture() as cap:
        FlashAttention(window_size=(3, 0), softcap=30.0, alibi_slopes=slopes, dropout_p=0.0)(q, k, v)
    m = cap.calls[0].meta
    got = (m["window"], m["softcap"], m["flash_extras"], m["scale"], m["scale_source"])
    assert got == ("3,0", "30.0", "alibi_slopes", "none", "default")


def test_varlen_is_recorded_one_call_per_sequence(fake_flash):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 4, 8, generator=g) for _ in range(3))  # two sequences packed: rows 0-2 and 3-7
    with torch.no_grad(), attncheck.capture() as cap:
        out = FlashAttention(causal=True, varlen=[0, 3, 8])(q, k, v)
    assert [c.kind for c in cap.calls] == ["flash_attn", "flash_attn"]  # not the fake's inner flash_attn_func calls
    for call, (lo, hi), seq in zip(cap.calls, [(0, 3), (3, 8)], ["0", "1"]):
        t, m = call.tensors, call.meta
        assert (m["flash_fn"], m["varlen_seq"], m["varlen_seqs"]) == ("flash_attn_varlen_func", seq, "2")
        for role, x in (("q", q), ("k", k), ("v", v)):
            assert torch.equal(t[role], x[lo:hi].transpose(0, 1)[None])  # (1, H, T_i, D)
        again = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True)[0].transpose(0, 1)
        torch.testing.assert_close(again, out[lo:hi], rtol=0, atol=1e-6)


FA3 = """
import torch
import torch.nn.functional as F


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=softmax_scale).transpose(1, 2)
"""

FA4 = """
import torch
import torch.nn.functional as F


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=softmax_scale).transpose(1, 2)
    return out, torch.zeros(out.shape[:-1])
"""


def test_flashattention_3_and_4_interfaces_are_recorded_with_descales_and_sinks(fake_flash, tmp_path, monkeypatch):
    """FA3's top-level flash_attn_interface (q_descale, k_descale, v_descale) and FA4's flash_attn.cute
    (learnable_sink, window_size of None), as their interfaces are at the commit cited above."""
    site = tmp_path / "site"
    (site / "flash_attn_interface.py").write_text(textwrap.dedent(FA3))
    (site / "flash_attn" / "cute").mkdir()
    (site / "flash_attn" / "cute" / "__init__.py").write_text(textwrap.dedent(FA4))
    importlib.invalidate_caches()
    import flash_attn.cute
    import flash_attn_interface

    fa3, fa4 = flash_attn_interface.flash_attn_func, flash_attn.cute.flash_attn_func
    q, k, v = bthd()
    scales = {f"{r}_descale": torch.full((2, 4), 0.5) for r in "qk"}
    sink = torch.linspace(-1, 1, 4)
    with torch.no_grad(), attncheck.capture() as cap:
        flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=0.25, window_size=(-1, 2), **scales)
        out, _ = flash_attn.cute.flash_attn_func(q, k, v, learnable_sink=sink, window_size=(None, None))
    assert flash_attn_interface.flash_attn_func is fa3 and flash_attn.cute.flash_attn_func is fa4
    three, four = cap.calls
    assert (three.meta["flash_package"], three.meta["descales"], three.meta["window"], three.meta["scale"]) == (
        "fa3",
        "q,k",
        "-1,2",
        "0.25",
    )
    assert torch.equal(three.tensors["q_descale"], scales["q_descale"]) and "v_descale" not in three.tensors
    assert (four.meta["flash_package"], four.meta["sinks"], four.meta["window"], four.meta["flash_extras"]) == (
        "fa4",
        "true",
        "-1,-1",
        "none",
    )
    assert torch.equal(four.tensors["sinks"], sink) and torch.equal(four.tensors["q"], q.transpose(1, 2))
    m = jsondoc.convert(meta_fields(three.meta), CallMeta, lax=True)
    assert (m.descales, m.flash_package) == ("q,k", "fa3")
    q16, k16, v16 = bthd(dtype=torch.float16)
    with torch.no_grad(), attncheck.capture(tmp_path / "fa3"):  # a plain FA3 call: judged by FlashAttention-3's path
        flash_attn_interface.flash_attn_func(q16, k16, v16)
    r = runner.invoke(app, ["run", str(tmp_path / "fa3"), "--fail-on", "error,warning,nan", "--json", "-"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["calls"][0]["cell"] == "fa3/fp16"
    with torch.no_grad(), attncheck.capture(tmp_path / "fa3-fp8"):  # FP8 descales: FA3's FP8 call stays refused
        flash_attn_interface.flash_attn_func(q16, k16, v16, **scales)
    r = runner.invoke(app, ["run", str(tmp_path / "fa3-fp8")])
    assert r.exit_code == 2 and "(fa3 flash_attn_func) with descales of q,k" in r.stderr, r.output
    with torch.no_grad(), attncheck.capture(tmp_path / "fa4"):  # a plain FA4 call: judged by FlashAttention-4's path
        flash_attn.cute.flash_attn_func(q16, k16, v16)
    r = runner.invoke(app, ["run", str(tmp_path / "fa4"), "--fail-on", "error,warning,nan", "--json", "-"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["calls"][0]["cell"] == "fa4/fp16"
    with torch.no_grad(), attncheck.capture(tmp_path / "fa4-sink"):  # learnable sinks: not read from a capture yet
        flash_attn.cute.flash_attn_func(q16, k16, v16, learnable_sink=sink)
    r = runner.invoke(app, ["run", str(tmp_path / "fa4-sink")])
    assert r.exit_code == 2 and "(fa4 flash_attn_func) with sinks" in r.stderr, r.output


def test_attributes_are_restored_after_the_block_also_when_it_fails(fake_flash, monkeypatch):
    import flash_attn
    import transformers.modeling_flash_attention_utils as tf

    func, varlen = flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func
    monkeypatch.setattr(tf, "_flash_fn", func)  # as transformers holds it once it loaded flash-attn
    with attncheck.capture():
        assert flash_attn.flash_attn_func is not func and flash_attn.flash_attn_func.__wrapped__ is func
        assert tf._flash_fn is flash_attn.flash_attn_func  # transformers' name routed too
    assert flash_attn.flash_attn_func is func and flash_attn.flash_attn_varlen_func is varlen and tf._flash_fn is func
    with pytest.raises(RuntimeError, match="boom"), attncheck.capture():
        raise RuntimeError("boom")
    assert flash_attn.flash_attn_func is func and flash_attn.flash_attn_varlen_func is varlen and tf._flash_fn is func
    tf._flash_fn = None
    with attncheck.capture():  # transformers loads its implementation while recording: its names are put back too
        tf._flash_fn = flash_attn.flash_attn_func
        assert tf._flash_fn is not func
    assert tf._flash_fn is func


def test_without_the_package_nothing_is_imported(monkeypatch):
    for name in ("flash_attn", "flash_attn_interface"):
        if importlib.util.find_spec(name) is not None:
            pytest.skip(f"{name} is installed here")
    q, k, v = bthd()
    with torch.no_grad(), attncheck.capture() as cap:
        F.scaled_dot_product_attention(q, k, v)
    assert [c.kind for c in cap.calls] == ["sdpa"]
    assert not any(n.split(".")[0] in ("flash_attn", "flash_attn_interface") for n in sys.modules)


def test_run_judges_a_plain_flash_attn_call_by_fa2_fma_and_refuses_one_it_cannot(fake_flash, tmp_path):
    q, k, v = bthd(h=4, hk=2, dtype=torch.float16)
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        FlashAttention(causal=True)(q, k, v)
    (src,), _ = open_capture(tmp_path / "cap")
    info = src.info
    got = (info.kind, info.meta["kind"], info.is_causal, info.enable_gqa, info.dtype)
    assert got == ("flash_attn", "flash_attn", True, True, "fp16")
    assert src.load()["q"].shape == (2, 4, 6, 8)
    r = runner.invoke(app, ["run", str(tmp_path / "cap"), "--fail-on", "error,warning,nan", "--json", "-"])
    assert r.exit_code == 0, r.output
    call = json.loads(r.stdout)["model"]["calls"][0]
    assert call["kind"] == "flash_attn" and call["cell"] == "fa2-fma/fp16", call
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:  # diagnosed as it comes: the same reading
        FlashAttention(causal=True)(q, k, v)
    (report,) = cap.calls
    assert report.call.kind == "flash_attn" and [c.name for c in report.diagnosis.cells] == ["fa2-fma/fp16"]
    with torch.no_grad(), attncheck.capture(tmp_path / "capped"):
        FlashAttention(softcap=30.0)(q, k, v)
    r = runner.invoke(app, ["run", str(tmp_path / "capped")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "a flash_attn call (fa2 flash_attn_func) with softcap 30.0: attncheck has no path for it yet" in r.stderr
    q1 = q[:, :2]  # causal with fewer queries than keys: flash-attn's mask is bottom-right, SDPA's top-left
    with torch.no_grad(), attncheck.capture(tmp_path / "decode"):
        FlashAttention(causal=True)(q1, k, v)
    r = runner.invoke(app, ["run", str(tmp_path / "decode")])
    assert r.exit_code == 2 and "causal with 2 queries and 6 keys (bottom-right aligned)" in r.stderr, r.output


# --------------------------------------------------------------------------- the GPU's facts


def test_gpu_facts_on_cpu_are_none_and_a_fake_cuda_device_says_its_capability():
    assert gpu_facts(torch.device("cpu")) == {} and gpu_facts("cpu", capability=(9, 0), sdpa=True) == {}
    facts = gpu_facts(torch.device("cuda:0"), capability=(9, 0), name="NVIDIA H100 80GB HBM3")
    assert facts == {"capability": "9.0", "gpu_name": "NVIDIA H100 80GB HBM3"}
    assert gpu_facts("cuda:1", capability=(12, 1), sdpa=True)["capability"] == "12.1"


def test_flash_impl_is_what_torch_registry_has_active(monkeypatch):
    import torch.nn.attention as attention

    if not hasattr(attention, "current_flash_attention_impl"):
        assert flash_impl() is None
        return
    # torch's registry: None means nothing activated, the FA2 kernels PyTorch is built with
    assert attention.current_flash_attention_impl() is None and flash_impl() == "fa2"
    assert gpu_facts("cuda:0", capability=(9, 0), sdpa=True)["flash_impl"] == "fa2"
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: "FA4")
    assert flash_impl() == "fa4" and gpu_facts("cuda:0", capability=(10, 0), sdpa=True)["flash_impl"] == "fa4"


@pytest.mark.parametrize(
    "field,value",
    [
        ("capability", "sm90"),
        ("capability", "9"),
        ("flash_impl", "fa 2"),
        ("window", "3;0"),
        ("window", "a,b"),
        ("descales", "x"),
        ("flash_fn", "flash_attn_with_kvcache"),
        ("flash_package", "fa5"),
        ("sinks", "maybe"),
        ("varlen_seqs", "0"),
    ],
)
def test_bad_gpu_and_flash_fields_are_refused(field, value):
    meta = {"format": "attncheck.capture/1", "kind": "flash_attn", "call": "0", field: value}
    with pytest.raises(jsondoc.JSONError, match=f"^{field}: "):
        jsondoc.convert(meta_fields(meta), CallMeta, lax=True)


def test_a_bad_capability_in_a_capture_is_one_line_exit_2(tmp_path):
    q, k, v = bthd()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    path = str(tmp_path / "cap" / "0000-global.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    save_file(tensors, path, metadata={**meta, "device": "cuda:0", "capability": "sm_90", "flash_impl": "fa2"})
    r = runner.invoke(app, ["run", str(tmp_path / "cap")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "metadata: capability: " in r.stderr and "'sm_90'" in r.stderr and "a CUDA compute capability" in r.stderr
    save_file(tensors, path, metadata={**meta, "device": "cuda:0", "capability": "9.0", "flash_impl": "fa2"})
    (src,), _ = open_capture(tmp_path / "cap")
    assert src.problem is None and (src.info.meta["capability"], src.info.meta["flash_impl"]) == ("9.0", "fa2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available: GPU test skipped")
def test_a_capture_on_cuda_records_the_device_capability_and_flash_impl():
    q, k, v = (t.transpose(1, 2).cuda().half() for t in bthd())
    with torch.no_grad(), attncheck.capture() as cap:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    m = cap.calls[0].meta
    major, minor = torch.cuda.get_device_capability(q.device)
    assert m["device"].startswith("cuda") and m["capability"] == f"{major}.{minor}"
    assert m["gpu_name"] == torch.cuda.get_device_name(q.device)[:128]
    assert m["flash_impl"] == flash_impl()
    assert m["sdpa_backend"] in ("flash_attention", "efficient_attention", "cudnn_attention", "math")
    jsondoc.convert(meta_fields(m), CallMeta, lax=True)
