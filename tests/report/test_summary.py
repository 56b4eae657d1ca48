"""`attncheck run --summary`: the one-screen answer, exact at 80 columns: the README's capture example
(the verdict, the first bad call, its cause and fix in ten lines, and the README shows the same
text), a healthy model in one line, the built-in example's saved scores, and its option checks."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config.run import Options
from attncheck.findings import apply_ignore
from attncheck.judge import diagnose_call
from attncheck.model import model_report
from attncheck.report.summary import model_summary
from attncheck.results import CallInfo

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def render(renderable, width=80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


@pytest.fixture(scope="module")
def gpt2_capture(tmp_path_factory):
    """examples/capture_transformers.py's capture: a 4-layer fp16 GPT-2 from its config, eager
    attention, left padding, head 5 of layer 2 with its q and k projections scaled by 2500."""
    transformers = pytest.importorskip("transformers")
    import attncheck

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_head=8, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0, pad_token_id=0
    )
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager", dtype=torch.float16).eval()
    with torch.no_grad():
        w = model.transformer.h[2].attn.c_attn.weight
        w[:, 5 * 8 : 6 * 8] *= 2500
        w[:, 64 + 5 * 8 : 64 + 6 * 8] *= 2500
    ids = torch.randint(1, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :4] = 0
    out = tmp_path_factory.mktemp("dumps") / "gpt2-capture"
    with torch.no_grad(), attncheck.capture(out):
        model(input_ids=ids, attention_mask=mask)
    return out


README_SUMMARY = """\
ERROR: 4 calls on cpu, 3 errors, 0 warnings (ignored: fully_masked_rows)
first bad call: #2 transformer.h.2.attn (torch/fp16): NaN in 32 rows, head 5
error[qk_overflow]: Q@K^T overflows fp16 in 32 row(s) (441 score(s) beyond
    +-65504; max|q| 1363, max|k| 1472, max|q.k| 2.187e+06, scale 0.3536 applied
    to the scores); scaling q first would not avoid it: the scaled scores…
   = fix: scale q by 1/sqrt(d) before the matmul (--scale-order q shows the
          effect), compute Q@K^T in fp32, or find why q/k grew (no
          normalisation, exploding activations)
later: 1 more call goes wrong, first #3 transformer.h.3.attn (input_nan)
more: --detail transformer.h.2.attn; attncheck explain qk_overflow
"""


def test_the_readmes_example_in_ten_lines_at_80_columns(gpt2_capture):
    args = ["run", str(gpt2_capture), "--ignore", "fully_masked_rows", "--summary", "--quiet"]
    r = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.stderr
    assert r.stdout == README_SUMMARY
    assert len(r.stdout.splitlines()) <= 10 and max(len(line) for line in r.stdout.splitlines()) <= 80
    # by construction: layer 2's head 5 is the scaled one, and all its 2 x 16 query rows are NaN
    from safetensors.torch import load_file

    call = load_file(next(gpt2_capture.glob("0002-*.safetensors")))
    q, k = call["q"][:, 5].float(), call["k"][:, 5].float()  # (2, 16, 8)
    s = q @ k.transpose(-1, -2)  # fp32 accumulation, rounded to fp16 as eager attention does
    assert int(torch.isinf(s.half()).sum()) == 441
    assert round(float(q.abs().max())) == 1363 and round(float(k.abs().max())) == 1472
    # the README shows this very output under its command
    readme = (ROOT / "README.md").read_text()
    command = "$ attncheck run dumps/gpt2-capture --ignore fully_masked_rows --summary\n"
    block = re.search("```text\n" + re.escape(command) + "(.*?)```", readme, flags=re.S)
    assert block is not None and block.group(1) == README_SUMMARY


def test_the_json_report_is_the_same_with_summary(gpt2_capture, tmp_path):
    args = ["run", str(gpt2_capture), "--quiet", "--json"]
    plain = runner.invoke(app, [*args, str(tmp_path / "a.json")])
    short = runner.invoke(app, [*args, str(tmp_path / "b.json"), "--summary"])
    assert plain.exit_code == short.exit_code == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


OPTS = Options(dtypes=("fp16",), methods=("torch",))


def softmax_call(index, scores):
    info = CallInfo(index, f"c{index}", "softmax", module=f"model.layers.{index}.self_attn")
    return diagnose_call(info, {"scores": scores}, OPTS)


def test_a_healthy_model_is_one_line():
    g = torch.Generator().manual_seed(0)
    calls = [softmax_call(i, torch.randn(2, 4, 8, 8, generator=g).half()) for i in range(32)]
    text = render(model_summary(model_report(calls), calls, "cpu"))
    assert text == "OK: 32 calls on cpu, 0 errors, 0 warnings; no call goes wrong\n"


def test_a_fully_masked_row_names_its_call_and_the_ignored_one_goes():
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 4, 8, 8, generator=g).half() for _ in range(3)]
    scores[1][1, 2, 5] = float("-inf")  # query 5 of head 2 attends to nothing: NaN in torch.softmax
    calls = [softmax_call(i, s) for i, s in enumerate(scores)]
    text = render(model_summary(model_report(calls), calls, "cpu"))
    lines = text.splitlines()
    assert lines[0] == "WARNING: 3 calls on cpu, 0 errors, 1 warning"  # the word is the worst severity found
    assert lines[1] == "first bad call: #1 model.layers.1.self_attn (torch/fp16): NaN in 1 row, head 2"
    assert lines[2].startswith("warning[fully_masked_rows]: ")
    assert lines[-1] == "more: --detail model.layers.1.self_attn; attncheck explain fully_masked_rows"
    assert len(lines) <= 10 and max(map(len, lines)) <= 80
    ignored = model_report(calls, ignore=("fully_masked_rows",))
    for c in calls:  # as the pipeline does with --ignore
        apply_ignore(c.diagnosis, ("fully_masked_rows",))
    assert render(model_summary(ignored, calls, "cpu")) == (
        "OK: 3 calls on cpu, 0 errors, 0 warnings (ignored: fully_masked_rows); no call\n    goes wrong\n"
    )


EXAMPLE_SUMMARY = """\
ERROR: 1 tensor on cpu, 2 errors, 2 warnings
first error: example:layer0.scores (2x4x64x64, fp32): 5 of 12 cells break:
    naive/fp16, naive/bf16, naive/fp32, ...
error[exp_overflow]: naive softmax in fp16: exp overflows to inf in 100 row(s)
    (exp(x) = inf for x > 11.09; largest score 27.15) -> 100 NaN row(s)
   = fix: subtract the row max before exp (stable softmax, torch.softmax), or
          upcast to fp32 before the softmax
also: sum_overflow (error); fully_masked_rows, sentinel_not_representable
    (warning)
more: attncheck explain exp_overflow; without --summary: the full report
"""


def test_saved_scores_get_the_short_answer_too():
    r = runner.invoke(app, ["run", "--example", "--summary", "--quiet"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and r.stdout == EXAMPLE_SUMMARY
    # the naive fp16 exp overflows above ln(65504) + ...: the example's largest score is past it
    assert 27.15 > float(torch.log(torch.tensor(torch.finfo(torch.float16).max, dtype=torch.float64)))


def test_summary_with_full_is_refused_in_one_line():
    r = runner.invoke(app, ["run", "--example", "--summary", "--full"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == "attncheck: error: --summary and --full ask for two different reports; give one\n"


def test_what_ifs_take_one_line_and_never_count():
    from attncheck.results import WhatIfAnswer

    g = torch.Generator().manual_seed(0)
    calls = [softmax_call(i, torch.randn(2, 4, 8, 8, generator=g).half()) for i in range(4)]
    report = model_report(calls)
    report.what_if = [
        WhatIfAnswer("eager:naive/fp16", 4, 1, report.lines[3], 8, 1e-3, -2.0, None, {"exp_overflow": 1}),
        WhatIfAnswer("flash/bf16", 4, 0, None, 0, 1e-3, 88.0, None, {}),
    ]
    assert render(model_summary(report, calls, "cpu")) == (
        "OK: 4 calls on cpu, 0 errors, 0 warnings; no call goes wrong\n"
        "what-if: 1 of 2 cells asked would break: eager:naive/fp16 (#3) (not counted)\n"
    )
