"""The learned sinks block on a padded batch and on a NaN sink: a padded query sees no key, so its sink takes the
whole denominator (share 1 in every head); the block says how many such rows there are and shows the share over the
others, checked against a float64 softmax over [S, sink] computed here from the captured scores. A NaN sink is said
to be NaN, never a share of 0 with a finite error."""

import pytest
import torch

import attncheck
from attncheck.report.model_sinks import sinks_block

from .test_learned_sinks import gpt_oss

PAD = 3


def padded(model):
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap, attncheck.capture() as raw:
        model(input_ids=ids, attention_mask=mask)
    return cap, raw


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_padded_rows_are_counted_apart_and_the_share_is_the_others(impl):
    model = gpt_oss(torch.bfloat16, sinks=0.0)
    if impl == "sdpa":
        model.config._attn_implementation = "sdpa"  # forced: the sinks are dropped (sinks_ignored)
    cap, raw = padded(model)
    text = " ".join(sinks_block(cap.calls).plain.split())
    assert "nan" not in text.lower(), text
    assert f"{PAD} row(s) per head see no key" in text
    if impl == "eager":
        # the test's own share: float64 softmax over [S, sink] on the rows that see a key (a mask at finfo.min)
        call = raw.calls[0]
        s, sinks = call.tensors["scores"].double(), call.tensors["sinks"].double()
        c = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], dim=-1)
        share = torch.softmax(c, dim=-1)[..., -1]
        seen = (s > -1e4).any(-1)
        for h in cap.calls[0].sinks.heads:
            assert h.masked_rows == PAD
            assert h.share_max == pytest.approx(float(share[:, h.head][seen[:, h.head]].max()), rel=1e-9)
            assert h.share_max < 1
    else:
        for h in cap.calls[0].sinks.heads:
            assert h.masked_rows == PAD and h.diff_nosinks == h.diff_nosinks  # finite, not NaN


def test_a_nan_sink_is_said_to_be_nan():
    model = gpt_oss(torch.bfloat16, sinks=0.0)
    with torch.no_grad():
        model.model.layers[0].self_attn.sinks[1] = float("nan")
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(input_ids=ids)
    first = " ".join(sinks_block(cap.calls).plain.split()).split("#0 ")[1].split("#1 ")[0]
    assert "h1 NaN sink" in first and "the sink is NaN in head(s) 1" in first
    assert "changes the output" not in first and "output err" not in first and "h1 0 " not in first


@pytest.mark.slow  # two captures and three runs of the CLI (~7 s)
def test_nosinks_on_a_capture_without_sinks_says_so_and_a_what_if_condition_is_refused(tmp_path):
    """--what-if nosinks where no call has learned sinks computes nothing: a note says so; --fail-on what-if:COND
    then judges nothing and is refused (exit 2, one line), where on gpt-oss it passes (the what-if was computed)."""
    from typer.testing import CliRunner

    from attncheck.cli import app

    from .conftest import gpt2

    with torch.no_grad(), attncheck.capture(tmp_path / "plain"):
        gpt2("eager")(input_ids=torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(6)))
    with torch.no_grad(), attncheck.capture(tmp_path / "oss"):
        gpt_oss(torch.float32)(input_ids=torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(6)))
    runner = CliRunner()
    r = runner.invoke(app, ["run", str(tmp_path / "plain"), "--what-if", "nosinks"])
    assert r.exit_code == 0 and "--what-if nosinks: no call has learned sinks" in r.stderr, r.output
    r = runner.invoke(app, ["run", str(tmp_path / "plain"), "--what-if", "nosinks", "--fail-on", "what-if:warning"])
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.exit_code == 2 and len(errors) == 1 and "what-if:warning judges nothing" in errors[0], r.output
    r = runner.invoke(app, ["run", str(tmp_path / "oss"), "--what-if", "nosinks", "--fail-on", "what-if:warning"])
    assert r.exit_code == 0 and "no call has learned sinks" not in r.stderr, r.output
