"""The watch's trends and alerts against logs whose answer is known: a growth is claimed only where
the fitted trend is real (its t statistic against numpy's own fit, a jump or noise is no growth,
growth per rank), rank_divergence names both ranks and the step, no_attention for a log without
calls, a call whose dtype changes mid-run judged against each step's limit, and explosive growth
(x1300 a step) reported without overflowing."""

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.loaders.watchlog import read_watch_log, read_watch_logs
from attncheck.watcher.trends import MIN_T, analyse, factor_text, rolling_fit

runner = CliRunner()


def write_log(path, values_of_step, steps=range(1, 41), rank=0, world=1, limits=None, dtype="fp32"):
    """One call, len(values) heads; ``values_of_step(step)`` gives each head's largest logit."""
    with open(path, "w") as fh:
        for step in steps:
            ml = values_of_step(step)
            lim = 3.4e38 if limits is None else limits(step)
            dt = dtype if isinstance(dtype, str) else dtype(step)
            call = {
                "module": "layers.0.attn",
                "kind": "sdpa",
                "dtype": dt,
                "path": "flash",
                "heads": len(ml),
                "max_logit": ml,
                "collapsed": [0.0] * len(ml),
                "scale": 0.125,
                "limit": {"logit": lim, "what": f"S in {dt}"},
            }
            fh.write(
                json.dumps({"schema": "attncheck.watch/1", "step": step, "rank": rank, "world": world, "calls": [call]})
                + "\n"
            )
    return path


def test_the_slopes_t_statistic_is_numpys_fit_over_its_standard_error():
    rng = np.random.default_rng(0)
    steps = list(range(1, 41))
    values = list(np.exp(0.03 * np.arange(40) + rng.normal(0, 0.2, 40)))
    slope, t = rolling_fit(steps, values, 20)
    for i in (19, 27, 39):
        (b, _), cov = np.polyfit(steps[i - 19 : i + 1], np.log(values[i - 19 : i + 1]), 1, cov="unscaled")
        resid = np.log(values[i - 19 : i + 1]) - np.polyval((b, _), steps[i - 19 : i + 1])
        se = math.sqrt(cov[0, 0] * (resid @ resid) / (20 - 2))
        assert slope[i] == pytest.approx(b, rel=1e-9) and t[i] == pytest.approx(b / se, rel=1e-6)


def test_a_rank_that_differs_is_divergence_not_growth(tmp_path):
    """The issue's case: rank 1's head near 1e4 from step 1 (noisy by a few percent), rank 0's near 1.4;
    no growth anywhere, one rank_divergence at step 1 on rank 1 against rank 0."""
    rng = np.random.default_rng(1)
    noise = {r: 1 + 0.05 * rng.standard_normal(41) for r in (0, 1)}
    logs = [
        write_log(tmp_path / f"w.rank{r}.jsonl", lambda s, r=r: [base * noise[r][s]], rank=r, world=2)
        for r, base in ((0, 1.4), (1, 1.0e4))
    ]
    report = analyse(read_watch_logs(logs))
    assert [(a.code, a.rank, a.other_rank, a.step) for a in report.alerts] == [("rank_divergence", 1, 0, 1)]
    assert all(s.growth is None or s.growth < 2 for s in report.series)
    r = runner.invoke(app, ["watch", *map(str, logs), "--fail-on", "rank_divergence"])
    assert r.exit_code == 1 and "on rank 1 (" in r.stdout and "times rank 0's" in r.stdout
    assert runner.invoke(app, ["watch", *map(str, logs), "--rank-factor", "1e5", "--fail-on", "warning"]).exit_code == 0
    assert runner.invoke(app, ["watch", *map(str, logs), "--rank-factor", "1"]).exit_code == 2


def test_healthy_ranks_on_other_batches_do_not_diverge(tmp_path):
    """Two ranks whose heads differ as batches do (up to 3x, and logits below 1): no alert at 10x."""
    rng = np.random.default_rng(2)
    logs = [
        write_log(
            tmp_path / f"w.rank{r}.jsonl",
            lambda s, r=r: [float(rng.uniform(2, 6)), float(rng.uniform(0.01, 0.5))],
            rank=r,
            world=2,
        )
        for r in (0, 1)
    ]
    assert analyse(read_watch_logs(logs)).alerts == []


def test_a_jump_is_not_growth_and_noise_is_not_growth(tmp_path):
    """A level shift (1.4 -> 1e4 at step 3, flat after) fits a steep slope over the window, and noise
    of 10% around 1e4 a slope of several x per 100 steps: neither is growth, neither gives headroom_low."""
    jump = write_log(tmp_path / "jump.jsonl", lambda s: [1.4 if s < 3 else 1.0e4])
    rng = np.random.default_rng(3)
    noisy = write_log(
        tmp_path / "noise.jsonl", lambda s: [1.0e4 * (1 + 0.1 * rng.standard_normal())], steps=range(1, 8)
    )
    for p in (jump, noisy):
        report = analyse([read_watch_log(p)], horizon=1e9)
        assert report.alerts == [], report.alerts
    slope, t = rolling_fit(range(1, 21), [1.4, 1.4] + [1.0e4] * 18, 20)
    assert slope[4] > math.log(2) / 100  # the fit alone would claim growth


def test_real_growth_is_claimed_and_is_per_rank(tmp_path):
    """Geometric growth with 2% noise is real (t far above MIN_T); a flat rank beside it is not merged in."""
    rng = np.random.default_rng(4)
    grow = write_log(tmp_path / "w.rank0.jsonl", lambda s: [2 ** (s / 4) * (1 + 0.02 * rng.standard_normal())], world=2)
    flat = write_log(tmp_path / "w.rank1.jsonl", lambda s: [2 ** (40 / 4)], rank=1, world=2)
    report = analyse(read_watch_logs([grow, flat]))
    growth = [a for a in report.alerts if a.code == "logit_growth"]
    # 2^(s/4) passes 50 at s = 23 (45.3 at 22, 53.8 at 23), noise of 2% moves it by less than a step's 19%
    assert [(a.rank, a.step) for a in growth] == [(0, 23)]
    s0 = next(s for s in report.series if s.rank == 0)
    assert s0.growth == pytest.approx(2**25, rel=0.5)
    _, t = rolling_fit(s0.steps, s0.max_logit, 20)
    assert t[-1] > 10 * MIN_T


def test_explosive_growth_is_reported_without_overflow(tmp_path):
    """x1300 a step: e^(100 ln 1300) overflows a float; the message says x10^311 per 100 steps."""
    p = write_log(tmp_path / "w.jsonl", lambda s: [min(1.5 * 1300.0 ** (s - 1), 1e300)], steps=range(1, 11))
    r = runner.invoke(app, ["watch", str(p), "--fail-on", "logit_growth", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1, r.output
    assert factor_text(math.log(1300.0)) == f"x10^{100 * math.log10(1300.0):.0f}" == "x10^311"
    assert "x10^311 per 100 steps" in r.stdout

    def refuse(token):
        raise AssertionError(f"{token} in the JSON report")

    doc = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)  # strict JSON: no inf, no NaN
    assert doc["first_alert"]["code"] == "logit_growth"


def test_a_dtype_change_mid_run_is_judged_by_each_steps_limit(tmp_path):
    """Steps 1-20 in fp32 (S's limit 3.4e38), then fp16 eager (8190 logits): the head grows x1.05 a
    step from 60; headroom_low holds against fp16's limit after the change, never fp32's."""
    p = write_log(
        tmp_path / "w.jsonl",
        lambda s: [60 * 1.05**s],
        steps=range(1, 61),
        limits=lambda s: 3.4e38 if s <= 20 else 8190.0,
        dtype=lambda s: "fp32" if s <= 20 else "fp16",
    )
    report = analyse([read_watch_log(p)], horizon=200)
    first = [a for a in report.alerts if a.code == "headroom_low"]
    left = math.log(8190.0 / (60 * 1.05**21)) / math.log(1.05)  # steps from 21 to the fp16 limit: 80.8 < 200
    assert left < 200 and [a.step for a in first] == [21]
    assert report.series[0].limit_logit == 8190.0 and report.series[0].dtype == "fp16"


def test_a_headroom_alert_names_the_limit_of_its_own_step(tmp_path):
    """fp16 first (65504), then fp32: the alert at an fp16 step names fp16's limit and says 'S in fp16',
    not the last record's fp32 text beside fp16's number."""
    p = write_log(
        tmp_path / "w.jsonl",
        lambda s: [100 * 1.2**s],
        limits=lambda s: 65504.0 if s <= 20 else 3.4e38,
        dtype=lambda s: "fp16" if s <= 20 else "fp32",
    )
    alert = next(a for a in analyse([read_watch_log(p)], horizon=200).alerts if a.code == "headroom_low")
    assert alert.step <= 20 and "reaches 6.55e+04" in alert.message and alert.message.endswith(": S in fp16")


def test_a_log_without_calls_is_no_attention_never_no_alert(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text(
        "".join(
            json.dumps({"schema": "attncheck.watch/1", "step": s, "forwards": 0, "calls": [], "grads": []}) + "\n"
            for s in (1, 2, 3)
        )
    )
    r = runner.invoke(app, ["watch", str(p)])
    assert r.exit_code == 0 and "error[no_attention]" in r.stdout and "no alert" not in r.stdout.lower()
    assert "steps 1, 2, 3" in r.stdout and "1 error(s)" in r.stdout and "Heads" not in r.stdout
    assert runner.invoke(app, ["watch", str(p), "--fail-on", "error"]).exit_code == 1
    r = runner.invoke(app, ["watch", str(p), "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "no attention call" in r.stderr
    assert not (tmp_path / "p.png").exists() and "Traceback" not in r.output


def test_rank_divergence_says_the_magnitude_its_ratio_divides(tmp_path):
    """Rank 0's logit 0.5 is compared as 1 (the floor): the ratio printed is 500 / max(|0.5|, 1) = 500, and
    the message says 0.5 was taken as 1; without the floor in play it prints the two logits and their quotient."""
    logs = [
        write_log(tmp_path / f"w.rank{r}.jsonl", lambda s, v=v: [v], steps=range(1, 4), rank=r, world=2)
        for r, v in ((0, 0.5), (1, 500.0))
    ]
    (alert,) = analyse(read_watch_logs(logs)).alerts
    assert f"(500) is {500 / max(abs(0.5), 1.0):g} times rank 0's (0.5, taken as 1)" in alert.message
    assert "those below 1 as 1" in alert.message
    logs = [
        write_log(tmp_path / f"v.rank{r}.jsonl", lambda s, v=v: [v], steps=range(1, 4), rank=r, world=2)
        for r, v in ((0, 4.0), (1, 100.0))
    ]
    (alert,) = analyse(read_watch_logs(logs)).alerts
    assert f"(100) is {100 / 4:g} times rank 0's (4) at step 1" in alert.message and "taken as" not in alert.message
