"""Decode steps of a sliding-window layer (gpt-oss: every other layer has ``sliding_window``): once the window is
full, transformers' sliding cache hands each step a constant number of keys. They are decode steps all the same:
grouped in the report and model.decode, the learned sinks block folding them into one line per module. The key
counts are those of the K each call was given, against transformers' rule (min(window, keys so far))."""

import json

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

from .test_learned_sinks import gpt_oss

PROMPT, NEW, WINDOW = 4, 7, 6  # the window fills during the generation: steps of 5, 6, 6, ... keys


def generate(model):
    ids = torch.randint(3, 64, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    return model.generate(
        input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=1
    )


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sliding")
    model = gpt_oss(torch.bfloat16)
    with torch.no_grad(), attncheck.capture(tmp / "raw", dedup_kv=False) as raw:
        generate(model)
    res = CliRunner().invoke(app, ["run", str(tmp / "raw"), "--json", str(tmp / "r.json")], env={"COLUMNS": "200"})
    return raw, res, json.loads((tmp / "r.json").read_text()), tmp / "raw"


def test_the_steps_of_a_full_sliding_window_are_grouped(sliding):
    raw, res, report, _ = sliding
    assert res.exit_code == 0, res.output
    # the key counts: each call's K as recorded
    keys = {0: [], 1: []}
    for call in raw.calls:
        keys[int(call["module"].split(".")[2])].append(call["tensors"]["k"]["shape"][-2])
    assert keys[0] == [PROMPT] + [min(WINDOW, PROMPT + i) for i in range(1, NEW)]  # layer 0: sliding
    assert keys[1] == [PROMPT + i for i in range(NEW)]  # layer 1: full attention
    runs = {r["module"]: r for r in report["model"]["decode"]}
    for layer in (0, 1):
        run = runs[f"model.layers.{layer}.self_attn"]
        assert run["prefill"] == [layer] and run["prefill_keys"] == [PROMPT]
        assert run["steps"] == NEW - 1 and run["keys_from"] == keys[layer][1] and run["keys_to"] == keys[layer][-1]
    out = " ".join(res.output.split())
    assert f"2-{2 * (NEW - 1)} 0.self_attn decode x{NEW - 1}" in out
    assert f"(1 query, {PROMPT + 1}..{WINDOW} keys; no mask)" in out
    assert f"(1 query, {PROMPT + 1}..{PROMPT + NEW - 1} keys; no mask)" in out


def test_the_sinks_block_folds_the_decode_steps(sliding):
    _, res, report, _ = sliding
    block = res.output.split("Learned sinks")[1].split("Findings")[0]
    lines = [line for line in block.splitlines() if line.lstrip().startswith("#")]
    assert len(lines) == 4, block  # two prefills, one folded line per module's steps
    # the folded line's largest share is the largest over the steps' own (the JSON's, per call)
    calls = [c for c in report["model"]["calls"] if c["sinks"] and c["index"] >= 2 and c["index"] % 2 == 0]
    top = max(h["share_max"] for c in calls for h in c["sinks"]["heads"] if h["head"] == 0)
    assert f"h0 {top:.3g}" in lines[2] or f"h0 {top:.3g}" in lines[3]


def test_wrapped_lines_of_the_decode_and_sinks_blocks_keep_their_indent(sliding):
    *_, capture = sliding
    res = CliRunner().invoke(app, ["run", str(capture)], env={"COLUMNS": "60"})
    for name in ("Decode steps", "Learned sinks"):
        block = res.output.split(name)[1].split("\n")
        head = next(i for i, line in enumerate(block) if line.startswith("  "))  # the head's own lines come first
        entries = block[head : next(i for i, line in enumerate(block[head:], head) if not line.startswith("  "))]
        assert len(entries) >= 4 and all(line.startswith(("  #", "  0.", "  1.", "    ")) for line in entries), block
        assert any(line.startswith("    ") for line in entries)  # a wrapped line, indented under its entry


@pytest.mark.parametrize("prompt", [PROMPT, WINDOW + 3])  # the window fills during the steps; at the prefill
def test_sliding_steps_are_stored_by_their_new_row_and_rebuilt_bit_exactly(tmp_path, prompt):
    """Steps of a full window keep window - 1 rows of the call before and append one: stored as that row with
    kv_drop (the rows of the base gone from its front), rebuilt bit for bit as the capture written whole holds
    them."""
    from .test_generate_capture import bits, loaded

    model = gpt_oss(torch.bfloat16)
    ids = torch.randint(3, 64, (2, prompt), generator=torch.Generator().manual_seed(2))
    for dedup in (True, False):
        with torch.no_grad(), attncheck.capture(tmp_path / str(dedup), dedup_kv=dedup):
            model.generate(input_ids=ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    manifest = json.loads((tmp_path / "True" / "manifest.json").read_text())
    sliding = [c for c in manifest["calls"] if c["module"].endswith("0.self_attn") and c["index"] >= 2]
    whole = {
        c["index"]: c["tensors"]["k"]["shape"][-2]
        for c in json.loads((tmp_path / "False" / "manifest.json").read_text())["calls"]
    }
    for c in sliding:
        assert c["tensors"]["k_tail"]["shape"][-2] == 1  # one new row, wherever the window is full
        before = whole[c["kv_base"]]
        assert c.get("kv_drop", 0) == before - (whole[c["index"]] - 1)  # rows of the base gone from its front
    assert any(c.get("kv_drop") for c in sliding)
    got, ref = loaded(tmp_path / "True"), loaded(tmp_path / "False")
    assert len(got) == len(ref) == 2 * 5
    for (_, a), (_, b) in zip(got, ref):
        for role in ("k", "v"):
            assert a[role].shape == b[role].shape and torch.equal(bits(a[role]), bits(b[role]))
