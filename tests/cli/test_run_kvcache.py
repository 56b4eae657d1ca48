"""--what-if kv:FORMAT[:SCALING] end to end: a Llama-style model (GQA, bf16, from its config) with V outliers planted
in one kv head of one layer is named at unit scale and held by per-head scales, checked against a float64
re-computation of the quantised attention written here; a healthy model stays quiet under every scaling; bad tokens
exit 2 with one line; --q/--k/--v dumps take the what-if too."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()
LAYER, KV_HEAD, D = 1, 1, 16
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E4M3_EDGE = E4M3_MAX + 32 / 2  # beyond 448 + half its step of 32, a plain round-to-nearest cast leaves the range


def capture_llama(out, planted: bool, attn: str = "sdpa"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    model.eval()
    if planted:
        with torch.no_grad():
            model.model.layers[LAYER].self_attn.v_proj.weight[KV_HEAD * D : (KV_HEAD + 1) * D] *= 1000
    with torch.no_grad(), attncheck.capture(out):
        model(input_ids=torch.randint(0, 128, (2, 32)))
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return capture_llama(tmp_path_factory.mktemp("kv") / "planted", True)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return capture_llama(tmp_path_factory.mktemp("kv") / "healthy", False)


def run_json(tmp_path, capture, *args, code=0):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["run", str(capture), "--quiet", "--json", str(out), *args])
    assert result.exit_code == code, result.output
    return json.loads(out.read_text())


def quantised_attention_f64(capture, v_scale: float):
    """Layer LAYER's call with V through an e4m3 cache at ``v_scale`` (K at scale 1: it stays within 448 here),
    written out: numpy float64, torch only for its float8 cast. -> (saturated V entries per kv head, worst-row
    cosine and relative L2 per kv head of O against float64 attention on K and V as recorded)."""
    t = load_file(str(capture / f"000{LAYER}-model.layers.{LAYER}.self_attn.safetensors"))
    q, k, v = (t[n].double().numpy() for n in ("q", "k", "v"))
    assert np.abs(k).max() < E4M3_MAX

    def cache(x, s):
        y = (x / s).astype(np.float32)
        stored = torch.from_numpy(np.clip(y, -E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn).float().numpy()
        return torch.from_numpy(stored * np.float32(s)).bfloat16().double().numpy()

    sat = (np.abs(v / v_scale) > E4M3_EDGE).sum(axis=(0, 2, 3))

    def attend(kk, vv):
        kk, vv = np.repeat(kk, 2, axis=1), np.repeat(vv, 2, axis=1)
        s = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(D)
        s = np.where(np.triu(np.ones((32, 32), bool), 1), -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ vv

    o, r = attend(cache(k, 1.0), cache(v, v_scale)), attend(k, v)
    cos, rel = [], []
    for h in range(2):
        a, b = o[:, 2 * h : 2 * h + 2].reshape(-1, D), r[:, 2 * h : 2 * h + 2].reshape(-1, D)
        cos.append(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())
        rel.append(np.linalg.norm(a - b) / np.linalg.norm(b))
    return sat, cos, rel


def int4_attention_f64(capture, group: int, residual: int):
    """Layer LAYER's call with K and V through quanto's int4 cache (tests/numerics/test_kvcache_int4.py's numpy
    re-computation), attention in float64 against float64 attention on K and V as recorded -> (flushed K and V
    entries, worst-row cosine, relative L2, largest group scale of K and of V) per kv head."""
    from tests.numerics.test_kvcache_int4 import int4_read_f64

    t = load_file(str(capture / f"000{LAYER}-model.layers.{LAYER}.self_attn.safetensors"))
    q, k, v = (t[n].double().numpy() for n in ("q", "k", "v"))
    (kq, ks), (vq, vs) = int4_read_f64(k, group, residual), int4_read_f64(v, group, residual)

    def attend(kk, vv):
        kk, vv = np.repeat(kk, 2, axis=1), np.repeat(vv, 2, axis=1)
        s = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(D)
        s = np.where(np.triu(np.ones((32, 32), bool), 1), -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ vv

    o, r = attend(kq, vq), attend(k, v)
    out = []
    for h in range(2):
        a, b = o[:, 2 * h : 2 * h + 2].reshape(-1, D), r[:, 2 * h : 2 * h + 2].reshape(-1, D)
        cos = ((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min()
        flushed = [int(((x[:, h] != 0) & (xq[:, h] == 0)).sum()) for x, xq in ((k, kq), (v, vq))]
        per_value = [np.repeat(sc, group, axis=1).reshape(2, 2, 32 - residual, D)[:, h].max() for sc in (ks, vs)]
        out.append((flushed, cos, np.linalg.norm(a - b) / np.linalg.norm(b), per_value))
    return out


def test_int4_cache_against_float64_written_here(planted, tmp_path):
    """kv:int4 (groups of 64: 4 tokens of a kv head at head_dim 16) and kv:int4:g16:r8 (one token's channels, the
    last 8 tokens in bf16) against the numpy re-computation; no saturation counted; the planted head's V groups
    coarse (their step the outliers' range / 15)."""
    doc = run_json(tmp_path, planted, "--what-if", "kv:int4,kv:int4:g16:r8")
    assert [c["what_if"] for c in doc["kv_cache"]["caches"]] == ["kv:int4:g64", "kv:int4:g16:r8"]
    for name, group, residual in (("kv:int4:g64", 64, 0), ("kv:int4:g16:r8", 16, 8)):
        cache, heads = heads_of(doc, name)
        assert cache["format_max"] == 15
        for h, (flushed, cos, rel, scales) in enumerate(int4_attention_f64(planted, group, residual)):
            got = heads[(str(LAYER), h)]
            assert [got["k_flushed"], got["v_flushed"]] == flushed
            assert got["k_saturated"] == got["v_saturated"] == 0 and got["hold_v_head"] is None
            assert [got["k_scale"], got["v_scale"]] == scales
            # O from the cache against float64 on K and V as recorded: the module's is FlashAttention-2 in bf16
            assert abs(got["cosine_f64"] - cos) < 5e-3 and abs(got["rel_l2_f64"] - rel) < 0.05 * rel + 5e-3
    heads = heads_of(doc, "kv:int4:g64")[1]
    assert heads[(str(LAYER), KV_HEAD)]["v_scale"] > 100 * heads[(str(LAYER), 1 - KV_HEAD)]["v_scale"]


def heads_of(doc, name):
    cache = next(c for c in doc["kv_cache"]["caches"] if c["what_if"] == name)
    return cache, {(h["module"].split(".")[2], h["kv_head"]): h for h in cache["heads"]}


def test_planted_v_outliers_named_at_unit_scale_and_held_per_head(planted, tmp_path):
    doc = run_json(tmp_path, planted, "--what-if", "kv:fp8_e4m3:unit,kv:fp8_e4m3:head")
    unit, heads = heads_of(doc, "kv:fp8_e4m3:unit")
    sat, cos, rel = quantised_attention_f64(planted, 1.0)
    bad = heads[(str(LAYER), KV_HEAD)]
    assert bad["v_saturated"] == sat[KV_HEAD] > 100 and sat[1 - KV_HEAD] == 0
    assert bad["v_amax"] > E4M3_EDGE and bad["k_saturated"] == 0
    # against the float64 re-computation (the module's is FlashAttention-2 in bf16: within its rounding)
    assert abs(bad["cosine"] - cos[KV_HEAD]) < 5e-3 and bad["cosine"] < 0.95
    assert abs(bad["rel_l2"] - rel[KV_HEAD]) < 0.02 * rel[KV_HEAD] and bad["rel_l2"] > 0.3
    for key, h in heads.items():
        if key != (str(LAYER), KV_HEAD):
            assert h["v_saturated"] == h["k_saturated"] == 0 and h["cosine"] > 0.98
    found = {(f["code"], f["severity"]) for f in unit["findings"]}
    assert found == {("kv_cache_saturation", "warning"), ("kv_cache_error", "warning")}
    message = next(f["message"] for f in unit["findings"] if f["code"] == "kv_cache_saturation")
    assert f"model.layers.{LAYER}.self_attn kv head {KV_HEAD} (query heads 2, 3): V saturates at scale 1" in message
    # per-head scales: amax / 448, nothing saturates, the head holds
    head, heads = heads_of(doc, "kv:fp8_e4m3:head")
    held = heads[(str(LAYER), KV_HEAD)]
    v_scale = float(np.float32(bad["v_amax"] / E4M3_MAX))
    assert held["v_scale"] == pytest.approx(v_scale, rel=1e-7) and held["v_saturated"] == 0
    sat, cos, rel = quantised_attention_f64(planted, v_scale)
    assert sat.sum() == 0 and abs(held["cosine"] - cos[KV_HEAD]) < 5e-3 and held["cosine"] > 0.99
    assert head["findings"] == []
    assert unit["summary"].startswith(f"FP8 e4m3 KV at unit scale: V saturates in 1 head of model.layers.{LAYER}")
    worst = min(h["cosine"] for h in head["heads"])  # the model's worst head under per-head scales
    assert unit["summary"].endswith(
        f"per-head scales bring the worst cosine similarity from {bad['cosine']:.4f} to {worst:.4f}"
    )


def test_healthy_model_small_errors_under_every_scaling(healthy, tmp_path):
    doc = run_json(tmp_path, healthy, "--what-if", "kv:fp8_e4m3,kv:fp8_e5m2", "--fail-on", "error,warning")
    caches = doc["kv_cache"]["caches"]
    assert [c["scaling"] for c in caches] == ["unit", "tensor", "head", "dynamic"] * 2
    for c in caches:
        assert all(f["severity"] == "info" for f in c["findings"]), c["findings"]
        for h in c["heads"]:
            assert h["k_saturated"] == h["v_saturated"] == 0
            assert h["cosine"] > 0.98 and h["rel_l2"] < 0.1
            if c["format"] == "fp8_e4m3":
                assert h["cosine"] > 0.99 and h["rel_l2"] < 0.05


@pytest.mark.slow
def test_fail_on_what_if_fails_only_when_asked(planted, tmp_path):
    run_json(tmp_path, planted, "--what-if", "kv:fp8_e4m3:unit", "--fail-on", "error,warning")
    result = runner.invoke(
        app, ["run", str(planted), "--quiet", "--what-if", "kv:fp8_e4m3:unit", "--fail-on", "what-if:warning"]
    )
    assert result.exit_code == 1
    assert "--fail-on what-if:warning: kv:fp8_e4m3:unit: kv_cache_saturation, kv_cache_error" in result.stderr


@pytest.mark.parametrize(
    "token, expected",
    [
        ("kv", "'kv' is not kv:FORMAT[:SCALING]"),
        ("kv:fp9", "'kv:fp9': the KV cache format must be one of fp8_e4m3, fp8_e5m2, int4"),
        ("kv:int4:head", "'kv:int4:head': int4's scale and shift are per group"),
        ("kv:int8", "'kv:int8': not emulated: transformers' quanto cache takes nbits 2 or 4 only"),
        ("kv:int4:g", "'kv:int4:g' is not kv:int4[:gGROUP][:rRESIDUAL]"),
        ("kv:fp8_e5m2:head:fa3", "'kv:fp8_e5m2:head:fa3': FlashAttention-3's FP8 path reads e4m3 only"),
        ("kv:fp8_e4m3:row:fa3", "'kv:fp8_e4m3:row:fa3' is not kv:fp8_e4m3[:SCALING]:fa3"),
        ("kv:fp8_e4m3:row", "'kv:fp8_e4m3:row': the KV cache scaling must be one of unit, tensor, head, dynamic"),
        ("kv:fp8_e4m3:unit:x", "is not kv:FORMAT[:SCALING]"),
    ],
)
def test_bad_tokens_exit_2_with_one_line(token, expected):
    result = runner.invoke(app, ["run", "nowhere", "--what-if", f"fp16,{token}"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("attncheck: error: --what-if")


def test_kv_on_example_or_without_v_refused():
    result = runner.invoke(app, ["run", "--example", "--what-if", "kv:fp8_e4m3"])
    assert result.exit_code == 2 and "give a capture, or --q, --k and --v" in result.stderr
    result = runner.invoke(app, ["run", "--q", "q.pt", "--k", "k.pt", "--what-if", "kv:fp8_e4m3"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1


def test_qkv_dumps(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 32, generator=g).bfloat16() for _ in range(3))
    v[:, 1] *= 2000
    for name, t in (("q", q), ("k", k), ("v", v)):
        torch.save(t, tmp_path / f"{name}.pt")
    args = ["run", *(x for n in "qkv" for x in (f"--{n}", str(tmp_path / f"{n}.pt"))), "--causal", "--quiet"]
    out = tmp_path / "r.json"
    result = runner.invoke(app, [*args, "--what-if", "kv:fp8_e4m3:unit", "--json", str(out)])
    assert result.exit_code == 0, result.output
    heads = json.loads(out.read_text())["kv_cache"]["caches"][0]["heads"]
    want = (v.double().abs() > E4M3_EDGE).sum(dim=(0, 2, 3)).tolist()
    assert [h["v_saturated"] for h in heads] == want and want[1] > 0 and want[0] == 0
    result = runner.invoke(app, [*args, "--what-if", "kv:fp8_e4m3:head", "--fail-on", "what-if:warning"])
    assert result.exit_code == 0, result.output
    assert "KV-cache what-ifs" in result.output
    # nothing saturates, no head breaks: the cache is its summary line, its table only with --full (every head)
    assert "FP8 e4m3 KV at head scale: nothing saturates; worst cosine" in result.output
    header = ["kv", "amax", "scale", "sat", "flush", "cos", "f64"]
    assert not any(line.split() == header for line in result.output.splitlines())
    result = runner.invoke(app, [*args, "--what-if", "kv:fp8_e4m3:head", "--full"], env={"COLUMNS": "80"})
    lines = result.output.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.split() == header) + 2 :][:4]
    assert sorted(line.split()[0] for line in table) == ["0", "1", "2", "3"]  # every kv head, one line each
    assert all(len(line.split()) == len(header) for line in table)
    # no model here (the tensors' implementation is not known): the cache counts as the cells asked do
    result = runner.invoke(app, [*args, "--what-if", "kv:fp8_e4m3:unit", "--fail-on", "warning"])
    assert result.exit_code == 1 and "--fail-on warning: kv:fp8_e4m3:unit: kv_cache_saturation" in result.stderr
    result = runner.invoke(app, [*args[:-1], "--what-if", "kv:fp8_e4m3:unit", "--fail-on", "warning"])
    header = "KV-cache what-ifs (--q/--k/--v: counted under --fail-on as the cells asked are)"
    assert result.exit_code == 1 and header in result.output and "never the model's verdict" not in result.output


@pytest.mark.slow
def test_eager_attention_replayed_from_its_traced_q_k_v(tmp_path):
    """transformers' eager attention: a softmax call whose q, k, v are traced (k and v after repeat_kv, one per
    query head, mapped back to the kv heads they repeat) and whose causal mask is read back from its scores."""
    capture = capture_llama(tmp_path / "eager", True, attn="eager")
    doc = run_json(tmp_path, capture, "--what-if", "kv:fp8_e4m3:unit")
    (cache,) = doc["kv_cache"]["caches"]
    # K and V repeated over the query heads mapped back to the model's kv heads: the planted one, read by 2 and 3
    bad = {(h["module"], h["kv_head"], tuple(h["query_heads"])) for h in cache["heads"] if h["v_saturated"]}
    assert bad == {(f"model.layers.{LAYER}.self_attn", KV_HEAD, (2, 3))}
    assert {h["kv_head"] for h in cache["heads"]} == {0, 1}
    assert {f["code"] for f in cache["findings"]} == {"kv_cache_saturation", "kv_cache_error"}
