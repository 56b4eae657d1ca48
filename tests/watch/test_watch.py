"""attncheck.watch in a training loop and `attncheck watch` on its logs: steps (automatic, marked,
every N, eval forwards left out), one record per step that the log reader takes back, the Trainer
callback, trends and alerts against logs whose answer is known, the logit-growth proxy, the plot,
and bad inputs."""

import contextlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.loaders.watchlog import read_watch_log
from attncheck.watcher import rank_log_path
from attncheck.watcher.trends import analyse, rolling_fit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
runner = CliRunner()


class Tiny(torch.nn.Module):
    def __init__(self, eager: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.eager = eager

    def forward(self, x):
        q, k, v = (z.view(2, 12, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        if self.eager:
            s = (q @ k.transpose(-1, -2)) * 0.5
            s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
            return s.softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def loop(model, w, steps, mark=False, evaluate=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0))
    for i in range(steps):
        model.train()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(x)
        if mark:
            w.step(loss=loss.item())


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_records_per_step_and_the_log_reads_back(tmp_path, eager):
    torch.manual_seed(0)
    model = Tiny(eager)
    with attncheck.watch(model, log=tmp_path / "w.jsonl") as w:
        loop(model, w, 4, evaluate=True)  # a step per training forward; the eval forwards are left out
    log = read_watch_log(tmp_path / "w.jsonl")
    assert [r.step for r in log.records] == [1, 2, 3, 4] and all(len(r.calls) == 1 for r in log.records)
    call = log.records[0].calls[0]
    assert call.kind == ("softmax" if eager else "sdpa") and call.heads == 4 and call.module == "Tiny"
    assert len(log.records[0].grads) == 1 and log.records[0].grads[0].nonfinite == 0
    # the numbers are the statistics of this call: recompute the first step's largest logit
    torch.manual_seed(0)
    fresh = Tiny(eager)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0))
    q, k, _ = (z.view(2, 12, 4, 4).transpose(1, 2) for z in fresh.qkv(x).split(16, -1))
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    want = s.amax(dim=(0, 2, 3)).tolist()
    got = call.max_logit
    for h in range(4):
        if eager or call.exact[h]:
            assert got[h] == pytest.approx(want[h], rel=1e-5)
        else:
            assert got[h] <= want[h] * (1 + 1e-6)


def test_marked_steps_every_n_and_losses(tmp_path):
    model = Tiny()
    with attncheck.watch(model, log=tmp_path / "w.jsonl", every=3) as w:
        loop(model, w, 7, mark=True)
    records = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 4, 7] and all(isinstance(r["loss"], float) for r in records)
    assert records[0]["schema"] == "attncheck.watch/1" and records[0]["rank"] == 0


def test_in_memory_and_bad_arguments(tmp_path):
    model = Tiny()
    with attncheck.watch(model) as w:
        loop(model, w, 2)
    assert len(w.records) == 2
    for kwargs, text in ((dict(every=0), "every"), (dict(every="x"), "every"), (dict(grads="yes"), "grads")):
        with pytest.raises(attncheck.AttncheckError, match=text):
            attncheck.watch(model, **kwargs)
    with pytest.raises(attncheck.AttncheckError, match="does not exist"):
        with attncheck.watch(model, log=tmp_path / "nope" / "w.jsonl"):
            pass


def test_rank_log_names():
    assert rank_log_path("w.jsonl", 0, 1) == Path("w.jsonl")
    assert rank_log_path("logs/w.jsonl", 1, 2) == Path("logs/w.rank1.jsonl")
    assert rank_log_path("w-{rank}.jsonl", 3, 4) == Path("w-3.jsonl")


def test_nan_in_a_step_is_the_nonfinite_alert_at_that_step(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 12, 16)
    with attncheck.watch(model, log=tmp_path / "w.jsonl"):
        for i in range(4):
            if i == 2:
                with torch.no_grad():
                    model.qkv.weight[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--fail-on", "nan", "--json", "-"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["first_alert"]["code"] == "nonfinite" and doc["first_alert"]["step"] == 3


# --------------------------------------------------------------------------- trends and alerts


def synthetic_log(path, steps, logit_of_step, heads=2, rank=0, world=1, collapsed=0.0, dtype="fp32", limit=3.4e38):
    with open(path, "w") as fh:
        for step in steps:
            ml = [logit_of_step(step, h) for h in range(heads)]
            fh.write(
                json.dumps(
                    {
                        "schema": "attncheck.watch/1",
                        "step": step,
                        "rank": rank,
                        "world": world,
                        "loss": 1.0,
                        "calls": [
                            {
                                "module": "layers.0.attn",
                                "kind": "sdpa",
                                "dtype": dtype,
                                "path": "flash",
                                "heads": heads,
                                "max_logit": ml,
                                "exact": [True] * heads,
                                "entropy_min": [1.0] * heads,
                                "entropy_mean": [2.0] * heads,
                                "collapsed": [collapsed] * heads,
                                "nonfinite_rows": 0,
                                "scale": 0.125,
                                "limit": {"logit": limit, "what": "S in fp32"},
                            }
                        ],
                        "grads": [],
                    }
                )
                + "\n"
            )


def test_rolling_slope_is_least_squares_of_the_logarithm():
    steps = list(range(1, 41))
    values = [2.0 * math.exp(0.05 * s) * (1 + 0.01 * math.sin(s)) for s in steps]
    got = rolling_fit(steps, values, 20)[0]  # the ln-slope per step
    for i in (19, 30, 39):
        want = np.polyfit(steps[i - 19 : i + 1], np.log(values[i - 19 : i + 1]), 1)[0]
        assert got[i] == pytest.approx(want, rel=1e-9)
    assert np.isnan(got[:4]).all() and np.isfinite(got[4])


def test_logit_growth_alert_at_the_step_it_first_holds(tmp_path):
    # head 1 grows x2 every 10 steps from 1 (x1024 per 100 steps): it passes 50 at step 57 (2^5.7 = 52)
    synthetic_log(tmp_path / "w.jsonl", range(1, 101), lambda s, h: 3.0 if h == 0 else 2 ** ((s - 1) / 10))
    report = analyse([read_watch_log(tmp_path / "w.jsonl")])
    growth = [a for a in report.alerts if a.code == "logit_growth"]
    assert [(a.head, a.step) for a in growth] == [(1, 58)]  # the first recorded step at or above 50
    s = next(x for x in report.series if x.head == 1)
    assert s.growth == pytest.approx(2**10, rel=1e-6)
    assert s.steps_to_limit == pytest.approx(math.log(3.4e38 / 2**9.9) / (math.log(2) / 10), rel=1e-6)


def test_headroom_low_in_the_calls_dtype_and_as_a_what_if(tmp_path):
    # fp16 eager attention: S before the scale holds 65520 at most -> the largest logit 65520 x 0.125 = 8190
    synthetic_log(tmp_path / "w.jsonl", range(1, 61), lambda s, h: 60 * 1.05**s, heads=1, dtype="fp16", limit=8190.0)
    report = analyse([read_watch_log(tmp_path / "w.jsonl")], horizon=50)
    first = next(a for a in report.alerts if a.code == "headroom_low")
    left = lambda s: math.log(8190.0 / (60 * 1.05**s)) / math.log(1.05)  # noqa: E731  steps until 8190 at x1.05 a step
    assert left(first.step) < 50 <= left(first.step - 1) and first.step == 51
    wi = analyse([read_watch_log(tmp_path / "w.jsonl")], horizon=50, what_if={"bf16": 3.3961e38})
    assert any(a.what_if == "bf16" for a in wi.alerts) is False  # bf16's limit is ~1e37 logits away: no what-if alert


def test_two_ranks_the_alert_names_its_rank(tmp_path):
    synthetic_log(tmp_path / "w.rank0.jsonl", range(1, 41), lambda s, h: 3.0, rank=0, world=2)
    synthetic_log(tmp_path / "w.rank1.jsonl", range(1, 41), lambda s, h: 3.0 if h == 0 else 5 * 1.3**s, rank=1, world=2)
    r = runner.invoke(
        app,
        [
            "watch",
            str(tmp_path / "w.rank0.jsonl"),
            str(tmp_path / "w.rank1.jsonl"),
            "--fail-on",
            "logit_growth",
            "--json",
            "-",
        ],
    )
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    growth = [x for x in out["alerts"] if x["code"] == "logit_growth"]
    # 5 x 1.3^s passes 50 at step 9 (53.0; 40.8 at step 8), on rank 1 only: growth is per rank
    assert [(x["rank"], x["head"], x["step"]) for x in growth] == [(1, 1, 9)]
    # and it is 10 times rank 0's 3.0 from step 7 (31.4; 24.1 at step 6): the ranks differ first
    first = out["first_alert"]
    assert (first["code"], first["rank"], first["other_rank"], first["head"], first["step"]) == (
        "rank_divergence",
        1,
        0,
        1,
        7,
    )
    r = runner.invoke(app, ["watch", str(tmp_path / "w.rank1.jsonl"), str(tmp_path / "w.rank1.jsonl")])
    assert r.exit_code == 2 and "both logs of rank 1" in r.stderr


def test_collapse_alert_and_ignore(tmp_path):
    synthetic_log(tmp_path / "w.jsonl", range(1, 11), lambda s, h: 3.0, collapsed=0.8)
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--fail-on", "warning"])
    assert r.exit_code == 1 and "entropy_collapse" in r.stdout
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--fail-on", "warning", "--ignore", "entropy_collapse"])
    assert r.exit_code == 0


def test_the_logit_growth_proxy_short(tmp_path):
    """examples/logit_growth.py, shortened: at lr 0.1 the largest logit grows past 50 within a few steps
    and logit_growth is raised on layer 0; with qk-layernorm and at lr 3e-3 it is not."""
    from logit_growth import train

    codes = {}
    for name, (lr, qk_norm) in {"high": (0.1, False), "qknorm": (0.1, True), "low": (3e-3, False)}.items():
        train(tmp_path / f"{name}.jsonl", lr, qk_norm, 15)
        report = analyse([read_watch_log(tmp_path / f"{name}.jsonl")])
        codes[name] = [(a.module, a.step) for a in report.alerts if a.code == "logit_growth"]
    assert codes["high"] and codes["high"][0][0] == "blocks.0" and codes["high"][0][1] <= 10
    assert codes["qknorm"] == [] and codes["low"] == []


def test_plot_renders(tmp_path):
    pytest.importorskip("matplotlib")
    synthetic_log(tmp_path / "w.jsonl", range(1, 41), lambda s, h: 2 * 1.2**s)
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--plot", str(tmp_path / "w.png"), "--quiet"])
    assert r.exit_code == 0 and (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_two_ranks_says_which_rank_its_heatmaps_draw_and_curves_the_tables_worst_heads(tmp_path):
    """Rank 0's heads hold 2 and 3, rank 1's 10 and 20 (no alert: 20 / 2 < the factor 10 per head): the
    worst heads, largest logit first, are rank 1's h1, h0, then rank 0's h1, h0, each named with its rank;
    the heatmaps draw rank 0 (no alert: the first) and the note says rank 1 is left out of them; 3 steps
    give the whole-number ticks 1, 2, 3."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from attncheck.report.watch import watch_figure

    logs = [
        synthetic_log(
            tmp_path / f"w.rank{r}.jsonl",
            range(1, 4),
            lambda s, h, r=r: [[2.0, 3.0], [10.0, 20.0]][r][h],
            rank=r,
            world=2,
        )
        or tmp_path / f"w.rank{r}.jsonl"
        for r in (0, 1)
    ]
    report = analyse([read_watch_log(p) for p in logs])
    assert report.alerts == []
    fig, note = watch_figure(report)
    try:
        heat, _, curves = fig.axes[0], fig.axes[1], fig.axes[2]
        legend = [t.get_text() for t in curves.get_legend().get_texts()]
        assert legend == [f"rank {r} layers.0.attn h{h}" for r, h in ((1, 1), (1, 0), (0, 1), (0, 0))]
        assert "rank 0 (the first) of ranks 0, 1" in heat.get_title()
        for ax in (heat, curves):
            ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
    finally:
        plt.close(fig)
    assert "heatmaps of rank 0 (the first), not of rank(s) 1" in note
    r = runner.invoke(app, ["watch", *map(str, logs), "--plot", str(tmp_path / "w.png")])
    assert r.exit_code == 0 and "not of rank(s) 1" in r.stderr


def test_trainer_callback_writes_a_log_that_attncheck_watch_reads(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from attncheck.integrations import WatchCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(
        transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    )
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": torch.randint(0, 64, (16,), generator=g), "labels": torch.randint(0, 64, (16,), generator=g)}
        for _ in range(8)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[WatchCallback(tmp_path / "w.jsonl")]
    ).train()
    log = read_watch_log(tmp_path / "w.jsonl")
    assert [r.step for r in log.records] == [1, 2, 3] and all(r.loss is not None for r in log.records)
    assert [c.module for c in log.records[0].calls] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--fail-on", "error"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "holds no watch record"),
        ("hello\n", "line 1: not a watch log"),
        ('{"schema": "attncheck.capture/1", "calls": []}\n', "line 1: not a watch log"),
        ('{"schema": "attncheck.watch/1", "step": 0, "calls": []}\n', "step"),
        (
            '{"schema": "attncheck.watch/1", "step": 1, "calls": [{"module": "m", "kind": "sdpa", "heads": 2, '
            '"max_logit": [1.0]}]}\n',
            "max_logit: 1 values for 2 heads",
        ),
        (
            '{"schema": "attncheck.watch/1", "step": 2, "calls": []}\n'
            '{"schema": "attncheck.watch/1", "step": 1, "calls": []}\n',
            "step 1 after step 2",
        ),
        ('{"schema": "attncheck.watch/1", "step": 1, "calls": [], "loss": NaN}\n', "line 1"),
        ('{"schema": "attncheck.watch/1", "step": ' + "9" * 5001 + ', "calls": []}\n', "line 1"),
        ("[" * 50000 + "]" * 50000 + "\n", "line 1"),
    ],
)
def test_bad_logs_are_one_line_and_exit_2(tmp_path, text, message):
    (tmp_path / "w.jsonl").write_text(text)
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_a_last_line_cut_short_is_left_out_and_said(tmp_path):
    synthetic_log(tmp_path / "w.jsonl", range(1, 6), lambda s, h: 3.0)
    text = (tmp_path / "w.jsonl").read_text()
    (tmp_path / "w.jsonl").write_text(text + text.splitlines()[0][:40])
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--json", "-"])
    assert r.exit_code == 0 and json.loads(r.stdout)["records"] == 5 and "cut short" in json.loads(r.stdout)["notes"][0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "1"], "window"),
        (["--growth", "0.5"], "growth"),
        (["--collapse", "2"], "collapse"),
        (["--fail-on", "bogus"], "unknown condition"),
        (["--logit-level", "-1"], "logit"),
        (["--plot", "/nonexistent/x.png"], "plot"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, args, message):
    synthetic_log(tmp_path / "w.jsonl", range(1, 6), lambda s, h: 3.0)
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), *args])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_the_recorder_is_on_only_inside_a_forward_and_off_after_an_error():
    """The watch's mode is on the torch-function stack only while a top module's forward runs (the
    optimizer step and the rest of the loop pass no op through it), and a forward that raises
    leaves it off."""
    from torch.overrides import _get_current_function_mode_stack

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x, fail=False):
            seen.append(len(_get_current_function_mode_stack()))
            if fail:
                raise ValueError("inside the forward")
            return F.scaled_dot_product_attention(x, x, x)

    probe, x = Probe().train(), torch.randn(1, 2, 4, 8)
    with attncheck.watch(probe) as w:
        assert _get_current_function_mode_stack() == []
        probe(x)
        with pytest.raises(ValueError):
            probe(x, fail=True)
        assert _get_current_function_mode_stack() == []
        F.scaled_dot_product_attention(x, x, x)  # outside every module: not a step's call
        probe(x)
    assert seen == [1, 1, 1] and _get_current_function_mode_stack() == []
    assert [len(r["calls"]) for r in w.records] == [1, 1]


def test_a_compiled_model_trains_unchanged_under_the_watch_which_says_what_it_cannot_see():
    """torch.compile'd code: the watch's hooks stay out of dynamo's graphs (no crash, the same
    losses), and it warns that the compiled code's calls are not seen; the log says no call was
    recorded (one record without calls), and compile='eager' records them."""
    torch._dynamo.reset()

    def train(watch, **how):
        torch.manual_seed(0)
        inner = Tiny()
        model = torch.compile(inner, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0))
        losses = []
        with attncheck.watch(model if watch == "wrapper" else inner, **how) if watch else contextlib.nullcontext() as w:
            for _ in range(3):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, w

    alone, _ = train(False)
    with pytest.warns(UserWarning, match="torch.compile'd code, whose attention calls the watch does not see") as said:
        watched, w = train("wrapper")
    assert watched == pytest.approx(alone, rel=1e-6) and len(said) == 1
    assert [(r["step"], r["calls"], r["forwards"]) for r in w.records] == [(3, [], 1)]
    for watched_module in ("wrapper", "inner"):  # the compiled module, or the module it wraps
        eager, w = train(watched_module, compile="eager")
        assert eager == pytest.approx(alone, rel=1e-5)
        assert [(r["step"], [c["module"] for c in r["calls"]]) for r in w.records] == [(s, ["Tiny"]) for s in (1, 2, 3)]


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*:UserWarning")
def test_flex_calls_are_watched_on_their_logits_after_the_score_mod():
    """A soft-capped flex call with a sliding window (rows 0..3 keep keys, none is empty) and GQA:
    the largest logit is the capped one, the window's rows are not non-finite."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def softcap(score, b, h, qi, ki):
        return 4.0 * torch.tanh(score / 4.0)

    def late(b, h, qi, ki):  # rows 0..3 attend to no key: flex gives 0 there
        return (qi >= 4) & (ki <= qi)

    bm = create_block_mask(late, None, None, 32, 32, device="cpu")

    class Flex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x).view(1, 32, 4, 2).transpose(1, 2) * 10
            k = x.view(1, 32, 2, 4)[..., :2].transpose(1, 2) * 10
            return flex_attention(q, k, k, score_mod=softcap, block_mask=bm, enable_gqa=True)

    model = Flex().train()
    with torch.no_grad(), attncheck.watch(model) as w:
        model(torch.randn(1, 32, 8))
    (call,) = w.records[0]["calls"]
    assert call["kind"] == "flex" and call["path"] == "flex-math" and call["heads"] == 4
    assert max(call["max_logit"]) <= 4.0 and call["nonfinite_rows"] == 0
    assert "the logits after " in call["limit"]["what"]  # the score_mod by its name, or the traced one (flex traces it)


# --------------------------------------------------------------------------- only the watched module's calls


class Attend(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x)
        return F.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("marked", [True, False], ids=["step-marked", "forward-steps"])
def test_a_module_not_watched_gives_no_calls_no_gradients_and_no_step(tmp_path, marked):
    """An unwatched module of the same class runs first in each iteration, and its output turns NaN
    from the third: the watched module's records hold its one call and its one set of gradients, the
    steps count the loop's iterations from 1, and the NaN of the other module raises no alert."""
    torch.manual_seed(0)
    watched, other = Attend(), Attend()
    with attncheck.watch(watched, log=tmp_path / "w.jsonl") as w:
        for i in range(4):
            x = torch.randn(1, 2, 4, 8)
            y = other(x) * (float("nan") if i >= 2 else 1.0)
            (watched(x).sum() + y.sum()).backward()
            if marked:
                w.step()
    records = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(len(r["calls"]) == 1 and len(r["grads"]) == 1 for r in records)
    assert all(r["grads"][0]["nonfinite"] == 0 for r in records)
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--fail-on", "error,warning,nan"])
    assert r.exit_code == 0, r.output


def test_a_sibling_not_watched_inside_the_same_top_module_gives_no_gradients():
    """The watched module is one layer of a model (as DDP's module.layers.1): the other layer's
    gradients are not its own; without any attention in the watched module nothing is recorded."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(Attend(), Attend())
    with attncheck.watch(layers[1]) as w:
        for _ in range(2):
            layers(torch.randn(1, 2, 4, 8)).sum().backward()
            w.step()
    assert [(len(r["calls"]), len(r["grads"])) for r in w.records] == [(1, 1), (1, 1)]
    assert {r["calls"][0]["module"] for r in w.records} == {g["module"] for r in w.records for g in r["grads"]}
    mha, linear = torch.nn.MultiheadAttention(16, 2, batch_first=True), torch.nn.Linear(16, 16)
    with pytest.warns(UserWarning, match="no training forward of the watched module"):
        with attncheck.watch(linear) as w:
            for _ in range(2):
                x = torch.randn(1, 4, 16)
                mha(x, x, x)[0].sum().backward()
                w.step()
    assert [(r["calls"], r["grads"]) for r in w.records] == [([], []), ([], [])]
