"""model.generate() under capture: every decode step recorded, stored by its new rows (record.kvdedup), rebuilt
bit-exactly by the reader (loaders.kv_chain), judged as a capture written whole is, and about one prefill's bytes."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.loaders.calls import open_inputs

from .conftest import VOCAB, llama_gqa

PROMPT, NEW = 24, 8


class SdpaTap(TorchFunctionMode):
    """The test's own record of what SDPA was given (clones), independent of attncheck's recorder."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask")
            bound = {**dict(zip(names, args)), **kwargs}
            self.calls.append(
                {
                    r: bound[n].clone()
                    for r, n in zip(("q", "k", "v", "attn_mask"), names)
                    if isinstance(bound.get(n), torch.Tensor)
                }
            )
        return func(*args, **kwargs)


def generate(model, inputs):
    return model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def prompt(b=1, left_pad=0):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (b, PROMPT), generator=g)
    mask = torch.ones(b, PROMPT, dtype=torch.long)
    mask[0, :left_pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def loaded(path):
    sources, _ = open_inputs([path])
    return [(s.info, s.load()) for s in sources]


def file_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


@pytest.mark.parametrize("left_pad", [0, 5])
def test_generate_capture_rebuilds_every_decode_step_bit_exactly(tmp_path, left_pad):
    """The K, V and mask each SDPA call was given, as the test's own mode saw them, come back bit for bit from a
    capture whose decode steps hold only their new rows; one call per layer per forward (prefill + NEW - 1
    decode steps: generate() feeds the last token back for no forward)."""
    model, inputs = llama_gqa("sdpa"), prompt(b=2, left_pad=left_pad)
    with torch.no_grad():
        tap = SdpaTap()
        with tap:
            ref = generate(model, inputs)
        with attncheck.capture(tmp_path / "cap"):
            out = generate(model, inputs)
    assert torch.equal(ref, out)  # capturing changed nothing
    layers = model.config.num_hidden_layers
    assert len(tap.calls) == layers * NEW
    calls = loaded(tmp_path / "cap")
    assert len(calls) == len(tap.calls)
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    bases = [c.get("kv_base") for c in doc["calls"]]
    # the prefill is whole; the first decode step extends it where SDPA got the same layout (no mask: GQA in both;
    # with a padding mask transformers repeats K and V for the prefill only), every later step the step before
    assert bases[:layers] == [None] * layers and all(b == i - layers for i, b in enumerate(bases) if i >= 2 * layers)
    assert bases[layers : 2 * layers] == ([None] * layers if left_pad else list(range(layers)))
    for (info, got), want in zip(calls, tap.calls):
        assert set(got) == set(want), info.index
        for role, t in want.items():
            assert got[role].dtype == t.dtype and torch.equal(bits(got[role]), bits(t)), (info.index, role)
    tails = [c["tensors"]["k_tail"]["shape"] for c in doc["calls"] if "kv_base" in c]
    assert all(s[-2] == 1 for s in tails)  # one new row per decode step


def test_decode_steps_judged_as_a_whole_capture_and_about_one_prefill(tmp_path):
    """attncheck run gives the same report (JSON) on the dedup'd capture as on the capture written whole; the
    generate capture, healthy, holds no error or warning; its tensor bytes stay within 2x of the prompt's
    prefill capture (a prompt of PROMPT tokens, NEW new ones) where the whole one is several times over."""
    model, inputs = llama_gqa("sdpa", torch.bfloat16), prompt()
    with torch.no_grad():
        with attncheck.capture(tmp_path / "prefill"):
            model(**inputs)
        with attncheck.capture(tmp_path / "gen"):
            generate(model, inputs)
        with attncheck.capture(tmp_path / "whole", dedup_kv=False):
            generate(model, inputs)
    totals = {
        n: json.loads((tmp_path / n / "manifest.json").read_text())["total_bytes"] for n in ("prefill", "gen", "whole")
    }
    # each step stores one token's q, k and v rows, as the prefill stores PROMPT of them (no mask here)
    assert totals["gen"] * PROMPT == totals["prefill"] * (PROMPT + NEW - 1), totals
    assert totals["gen"] < 2 * totals["prefill"] and totals["whole"] > 3 * totals["prefill"], totals
    runner = CliRunner()
    reports = {}
    for n in ("gen", "whole"):
        res = runner.invoke(
            app,
            [
                "run",
                str(tmp_path / n),
                "--json",
                str(tmp_path / f"{n}.json"),
                "--quiet",
                "--fail-on",
                "error,warning,nan",
            ],
        )
        assert res.exit_code == 0, res.output
        reports[n] = json.loads((tmp_path / f"{n}.json").read_text())

    def strip(doc):
        return (
            json.dumps([doc["tensors"], doc["model"]["calls"]], sort_keys=True)
            .replace("/gen/", "/X/")
            .replace("/whole/", "/X/")
        )

    assert strip(reports["gen"]) == strip(reports["whole"])


def test_static_cache_is_written_whole_and_still_reads(tmp_path):
    """StaticCache hands SDPA its fixed-size buffers every step: nothing extends, every call is written whole
    (as without dedup), and the reader takes them as before."""
    model, inputs = llama_gqa("sdpa"), prompt()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        model.generate(
            **inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static"
        )
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert len(doc["calls"]) == 2 * 4 and all("kv_base" not in c for c in doc["calls"])
    assert all(set(t) >= {"q", "k", "v"} for _, t in loaded(tmp_path / "cap"))


def test_a_decode_step_file_alone_says_it_needs_its_capture(tmp_path):
    model, inputs = llama_gqa("sdpa"), prompt()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        generate(model, inputs)
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    last = doc["calls"][-1]
    res = CliRunner().invoke(app, ["run", str(tmp_path / "cap" / last["file"])])
    assert res.exit_code == 2 and "read it in its capture directory" in res.output, res.output
    assert f"(call {last['index']}, " in res.output and last["index"] > 0  # its own index, not the file's place


@pytest.mark.slow
def test_eager_decode_steps_rebuild(tmp_path):
    """The eager path: q, k (repeated to the query heads), v traced around the softmax; k and v extend too."""
    model, inputs = llama_gqa("eager", torch.bfloat16), prompt()
    with torch.no_grad():
        with attncheck.capture(tmp_path / "gen"):
            generate(model, inputs)
        with attncheck.capture(tmp_path / "whole", dedup_kv=False):
            generate(model, inputs)
    gen, whole = loaded(tmp_path / "gen"), loaded(tmp_path / "whole")
    assert len(gen) == len(whole) == 2 * NEW
    for (_, a), (_, b) in zip(gen, whole):
        assert set(a) == set(b) and all(torch.equal(bits(a[r]), bits(b[r])) for r in a)
    doc = json.loads((tmp_path / "gen" / "manifest.json").read_text())
    assert sum("kv_base" in c for c in doc["calls"]) == 2 * (NEW - 1)


def test_report_groups_the_decode_steps(tmp_path):
    """The model report says each layer's prefill and its run of decode steps (q 1, keys growing by one) in one
    line, folds the steps that went well into one table line per layer, and the JSON lists the runs."""
    model, inputs = llama_gqa("sdpa"), prompt()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        generate(model, inputs)
    res = CliRunner().invoke(
        app,
        ["run", str(tmp_path / "cap"), "--json", str(tmp_path / "r.json"), "--fail-on", "error,warning"],
    )
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())  # the lines as wrapped at any width
    for layer in (0, 1):
        first, last = 2 + layer, 2 * (NEW - 1) + layer
        assert (
            f"{layer}.self_attn: prefill #{layer} ({PROMPT} keys) + {NEW - 1} decode steps #{first}-#{last} "
            f"(1 query, {PROMPT + 1}..{PROMPT + NEW - 1} keys; no mask)"
        ) in out
        assert f"{first}-{last} {layer}.self_attn decode x{NEW - 1}" in out
    assert "0 error(s), 0 warning(s)" in out
    runs = json.loads((tmp_path / "r.json").read_text())["model"]["decode"]
    assert [
        (r["module"], r["prefill"], r["prefill_keys"], r["steps"], r["keys_from"], r["keys_to"], r["queries"])
        for r in runs
    ] == [(f"model.layers.{i}.self_attn", [i], [PROMPT], NEW - 1, PROMPT + 1, PROMPT + NEW - 1, [1]) for i in (0, 1)]


@pytest.mark.slow
def test_two_prompts_in_one_capture_each_rebuilt(tmp_path):
    """A second generate() over another prompt: its prefill extends nothing (written whole), its steps extend
    its own; every call still comes back as SDPA got it."""
    model = llama_gqa("sdpa")
    first, second = prompt(), {"input_ids": prompt()["input_ids"].flip(-1)}
    with torch.no_grad():
        tap = SdpaTap()
        with tap:
            generate(model, first)
            generate(model, second)
        with attncheck.capture(tmp_path / "cap"):
            generate(model, first)
            generate(model, second)
    calls = loaded(tmp_path / "cap")
    assert len(calls) == len(tap.calls) == 2 * 2 * NEW
    for (info, got), want in zip(calls, tap.calls):
        assert all(torch.equal(bits(got[r]), bits(t)) for r, t in want.items()), info.index
    bases = [c.get("kv_base") for c in json.loads((tmp_path / "cap" / "manifest.json").read_text())["calls"]]
    assert bases[2 * NEW : 2 * NEW + 2] == [None, None]  # the second prompt's prefill


def test_two_threads_generating_through_one_model(tmp_path):
    """Two threads generate at once through the same modules: each step extends its own thread's previous call
    (calls of the two interleave in the capture's numbering), and every call rebuilt is one SDPA was given,
    matched by content against the test's own record of the same two generations run one after the other."""
    import threading

    model = llama_gqa("sdpa")
    prompts = [prompt(), {"input_ids": prompt()["input_ids"].flip(-1)}]
    with torch.no_grad():
        tap = SdpaTap()
        with tap:
            for p in prompts:
                generate(model, p)
        with attncheck.capture(tmp_path / "cap"):

            def work(p):
                with torch.no_grad():
                    generate(model, p)

            threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    calls = loaded(tmp_path / "cap")
    assert len(calls) == len(tap.calls) == 2 * 2 * NEW
    want = {}
    for c in tap.calls:
        want.setdefault(tuple(c["k"].shape), []).append(c)
    for info, got in calls:
        same = [c for c in want[tuple(got["k"].shape)] if all(torch.equal(bits(got[r]), bits(c[r])) for r in c)]
        assert same and set(got) == set(same[0]), info.index
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert sum("kv_base" in c for c in doc["calls"]) == 2 * 2 * (NEW - 1)  # every step of both threads extends


def test_max_bytes_bounds_what_is_stored(tmp_path):
    """--max-bytes counts the bytes written: a bound the whole decode steps would pass holds the dedup'd ones."""
    model, inputs = llama_gqa("sdpa"), prompt()
    with torch.no_grad():
        with attncheck.capture(tmp_path / "whole", dedup_kv=False):
            generate(model, inputs)
        with attncheck.capture(tmp_path / "gen"):
            generate(model, inputs)
    whole = json.loads((tmp_path / "whole" / "manifest.json").read_text())["total_bytes"]
    stored = json.loads((tmp_path / "gen" / "manifest.json").read_text())["total_bytes"]
    with torch.no_grad(), attncheck.capture(tmp_path / "bounded", max_bytes=stored) as cap:
        generate(model, inputs)
    assert stored < whole // 2 and cap.stopped is None
    with torch.no_grad(), attncheck.capture(tmp_path / "short", max_bytes=stored - 1) as cap:
        generate(model, inputs)
    assert cap.stopped is not None and "max_bytes" in cap.stopped


def rewrite(cap, index, tensors=None, meta=None, entry=None):
    """Call ``index``'s file and manifest entry with tensors or metadata changed (a tampered capture)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    doc = json.loads((cap / "manifest.json").read_text())
    e = next(c for c in doc["calls"] if c["index"] == index)
    path = cap / e["file"]
    with safe_open(str(path), framework="pt") as f:
        old_meta = f.metadata()
        old = {k: f.get_tensor(k) for k in f.keys()}
    old.update(tensors or {})
    old_meta.update(meta or {})
    save_file(old, str(path), metadata=old_meta)
    e["tensors"] = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for k, t in old.items()}
    e.update(entry or {})
    (cap / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "tamper, says",
    [
        (lambda last: ({}, {"kv_base": str(last)}, {"kv_base": last}), "which is not an earlier call of the capture"),
        (lambda last: ({}, {"kv_base": "0"}, {"kv_base": 1}), "its file and the manifest name different base calls"),
        (lambda last: ({"k_tail": torch.zeros(1, 2, 1, 4)}, {}, {}), "does not extend call"),
        (lambda last: ({}, {"kv_drop": "1000"}, {"kv_drop": 1000}), "drops 1000 rows of call"),
        (lambda last: ({}, {"kv_drop": "1"}, {}), "its file and the manifest drop different rows of its base call"),
    ],
)
def test_a_tampered_decode_step_is_one_line(tmp_path, tamper, says):
    model, inputs = llama_gqa("sdpa"), prompt()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        generate(model, inputs)
    last = 2 * NEW - 1
    tensors, meta, entry = tamper(last)
    rewrite(tmp_path / "cap", last, tensors, meta, entry)
    res = CliRunner().invoke(app, ["run", str(tmp_path / "cap"), "--quiet"])
    assert res.exit_code == 2 and says in " ".join(res.output.split()) and "Traceback" not in res.output, res.output


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_generate_64_tokens_over_128_within_2x_of_the_prefill(tmp_path, impl):
    """The issue's bound: generate() of 64 new tokens over a 128-token prompt (bf16, GQA): every decode call
    recorded (layers x 64 calls), the tensor bytes within 2x of the prompt's prefill capture (what --max-bytes
    counts), and a healthy report."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=256,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl, dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 256, (1, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with attncheck.capture(tmp_path / "prefill"):
            model(ids)
        with attncheck.capture(tmp_path / "gen"):
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    docs = {n: json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("prefill", "gen")}
    assert len(docs["gen"]["calls"]) == 2 * 64 and docs["gen"]["complete"]
    assert docs["gen"]["total_bytes"] < 2 * docs["prefill"]["total_bytes"], (
        docs["gen"]["total_bytes"],
        docs["prefill"]["total_bytes"],
    )
    # on disk each call file adds its header and its manifest entry (about 1.3 KiB), whatever its tensors
    assert file_bytes(tmp_path / "gen") < docs["gen"]["total_bytes"] + 2048 * len(docs["gen"]["calls"])
    res = CliRunner().invoke(app, ["run", str(tmp_path / "gen"), "--quiet", "--fail-on", "error,warning,nan"])
    assert res.exit_code == 0, res.output
