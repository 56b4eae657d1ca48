"""Long calls in bounded time (numerics.bounded): the row bound against float64, planted failures found in full,
sampled figures inside their stated intervals, and the CLI's --budget/--rows/--exact."""

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.numerics.bounded import certify, row_bounds
from attncheck.numerics.cells.diagnose import diagnose_attention
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.options import Bounded, Options

runner = CliRunner()
FAST = Options(dtypes=("fp16",), methods=("torch",), paths=("eager", "flash"))


def _qkv(seed: int, h: int = 2, t: int = 512, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, t, d, generator=g) for _ in range(3))
    return q, k, v


def test_row_bound_holds_against_float64_and_fp16_matmul():
    """Every |scale q_i.k_j| of float64, and every finite score of Q@K^T in fp16, under the row's bound; causal rows
    bounded by their prefix of keys alone (a tighter bound for early rows)."""
    q, k, _ = _qkv(1, h=4, t=256, d=32)
    q = q * torch.linspace(0.1, 30, 256)[:, None]  # rows of very different norms
    k[:, :, 200:] *= 20  # late keys large: causal rows before 200 must not pay for them
    for causal in (False, True):
        inp = prepare_inputs(q, k, None, causal=causal)
        inp = inp if not causal else type(inp)(**{**inp.__dict__, "call": inp.facts("", "causal")})
        raw, logit, nonfinite, full = row_bounds(inp)
        s64 = q.double() @ k.double().transpose(-1, -2)
        if causal:
            s64 = s64.masked_fill(~torch.ones(256, 256, dtype=torch.bool).tril(), 0.0)
        assert not nonfinite.any() and not full.any()
        assert (s64.abs().amax(-1) <= raw).all()
        assert (s64.abs().amax(-1) * inp.scale <= logit).all()
        s16 = (q.half() @ k.half().transpose(-1, -2)).double()
        if causal:
            s16 = s16.masked_fill(~torch.ones(256, 256, dtype=torch.bool).tril(), 0.0)
        assert (s16.abs().amax(-1) <= raw).all()
        ratio = raw / s64.abs().amax(-1)  # a bound, not a guess: within |q||k|/|q.k| of the truth
        assert float(ratio.min()) >= 1.0
    early = logit[0, 0, :200]
    inp_full = prepare_inputs(q, k, None)
    assert (early < row_bounds(inp_full)[1][0, 0, :200]).all()


def _planted(seed: int, t: int = 256):
    """A call with failures in random rows: q rows whose Q@K^T overflows fp16, NaN in q, fully masked rows."""
    q, k, v = _qkv(seed, t=t)
    g = torch.Generator().manual_seed(seed + 1000)
    rows = torch.randperm(2 * t, generator=g)[:6].tolist()
    big, nan, masked = rows[:2], rows[2:4], rows[4:]
    for r in big:
        q[0, r // t, r % t] = 6000.0 * k[0, r // t, 0]  # q.k_0 = 6000 |k_0|^2: far past fp16's 65,504
    for r in nan:
        q[0, r // t, r % t, 3] = float("nan")
    mask = torch.ones(1, 2, t, t, dtype=torch.bool)
    for r in masked:
        mask[0, r // t, r % t] = False
    inp = prepare_inputs(q, k, mask, v=v, mask_convention="attend")
    return inp, {"big": big, "nan": nan, "masked": masked}, t


def _failures(d):
    return {c.name: (c.nan_rows, c.overflow_rows, dict(c.nan_causes), sorted(c.examples.items())) for c in d.cells}


@pytest.mark.parametrize("seed", [0])
def test_planted_failures_are_found_by_the_bounded_diagnosis(seed):
    inp, planted, t = _planted(seed)
    exact = diagnose_attention("x", inp, FAST)
    bounded = diagnose_attention("x", inp, Options(**{**FAST.__dict__, "bounded": Bounded(rows=64, seed=seed)}))
    s = bounded.sampling
    assert s is not None and s.sampled_rows == 64 and s.exact_rows + s.certified_rows == 2 * t
    assert _failures(bounded) == _failures(exact)
    assert bounded.census.fully_masked_rows == exact.census.fully_masked_rows == 2
    eager = bounded.cell("torch", "fp16", "eager")
    assert eager.nan_rows == 6  # two overflowing Q@K^T rows, two NaN rows in q, two fully masked rows
    found = {r for rows in eager.examples.values() for r in rows}
    for r in planted["big"] + planted["nan"] + planted["masked"]:
        assert (0, r // t, r % t) in found
    # each planted position is computed in both heads: the reasons count those rows and add up to the rows in full
    assert s.exact_why.get("nonfinite") == 4 and s.exact_why.get("fully_masked") == 4 and s.exact_why.get("bound")
    assert sum(s.exact_why.values()) == s.exact_rows


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_planted_failures_over_seeds(seed):
    test_planted_failures_are_found_by_the_bounded_diagnosis(seed)


def _planted_casts(seed: int, t: int = 256):
    """Small k, and q entries past fp16's range in random rows: |q||k| stays far below every limit, yet the cast of
    q to fp16 is inf (the review's dump B)."""
    q, k, v = _qkv(seed, t=t)
    k = k * 1e-3
    g = torch.Generator().manual_seed(seed + 2000)
    rows = torch.randperm(2 * t, generator=g)[:3].tolist()
    for r in rows:
        q[0, r // t, r % t, r % 16] = 1e5
    return prepare_inputs(q, k, None, v=v), rows, t


def _outputs(d):
    return {c.name: (c.nan_rows, c.out_nan_rows, c.overflow_rows) for c in d.cells}


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_rows_past_the_dtype_are_never_certified(seed):
    """A q entry that is inf once cast to fp16 is computed in full: the failures are the exact run's."""
    inp, rows, t = _planted_casts(seed)
    exact = diagnose_attention("x", inp, FAST)
    bounded = diagnose_attention("x", inp, Options(**{**FAST.__dict__, "bounded": Bounded(rows=64, seed=seed)}))
    s = bounded.sampling
    assert s is not None and s.exact_why.get("cast") == 2 * len(set(r % t for r in rows))
    assert _failures(bounded) == _failures(exact) and _outputs(bounded) == _outputs(exact)
    assert bounded.cell("torch", "fp16", "eager").nan_rows == len(rows)  # independent: one NaN row per planted q


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "seed, value",
    [(0, float("nan")), (0, 70000.0)] + [pytest.param(s, v, marks=SLOW) for s, v in ((1, 1e5), (1, float("inf")))],
)
def test_a_nonfinite_or_huge_v_is_never_certified(seed, value):
    """V past fp16's range, or not finite, at a random key: no row whose output can be NaN or inf is certified;
    the output's NaN rows equal the exact run's, counted independently from float64 of the same V cast."""
    q, k, v = _qkv(seed, t=256)
    g = torch.Generator().manual_seed(seed + 3000)
    key, head = int(torch.randint(0, 256, (1,), generator=g)), int(torch.randint(0, 2, (1,), generator=g))
    v[0, head, key, 3] = value
    inp = prepare_inputs(q, k, None, v=v)
    exact = diagnose_attention("x", inp, FAST)
    bounded = diagnose_attention("x", inp, Options(**{**FAST.__dict__, "bounded": Bounded(rows=64, seed=seed)}))
    assert _outputs(bounded) == _outputs(exact)
    # every row of the head attends to the key with a positive probability: its output in fp16 is not finite
    assert bounded.cell("torch", "fp16", "eager").out_nan_rows >= 256
    assert bounded.sampling is None or bounded.sampling.certified_rows == 0


def _coverage(seed: int) -> tuple[int, int]:
    """(figures whose 95% interval holds the whole call's value, figures) for one sample seed."""
    q, k, v = _qkv(7, t=256)
    q = q * 3  # peaked rows: errors vary from row to row
    inp = prepare_inputs(q, k, None, v=v)
    opts = Options(dtypes=("bf16",), methods=("torch",), paths=("eager",))
    exact = diagnose_attention("x", inp, opts)
    bounded = diagnose_attention("x", inp, Options(**{**opts.__dict__, "bounded": Bounded(rows=128, seed=seed)}))
    assert bounded.sampling.exact_rows == 0  # nothing can fail: every row certified, the sample is uniform
    hit = n = 0
    for f in bounded.sampling.figures:
        truth = getattr(exact.distribution if f.owner == "reference" else exact.cells[0], f.figure)
        if f.kind == "max":
            assert f.estimate <= truth * (1 + 1e-12)  # the sampled max never exceeds the call's
            continue
        n += 1
        hit += f.low <= truth <= f.high
    return hit, n


def test_sampled_figures_fall_within_their_intervals():
    hit, n = _coverage(0)
    assert n >= 8 and hit == n


@pytest.mark.slow
def test_sampled_intervals_cover_over_seeds():
    """95% intervals: over 10 seeds, at least 85% of the figures' intervals hold the call's value."""
    hits = [_coverage(seed) for seed in range(10)]
    assert sum(h for h, _ in hits) >= 0.85 * sum(n for _, n in hits)


def _causal_row_figures(t: int = 2048):
    """Float64 max probability and entropy of every row of a causal call like the review's H (N(0,1) q and k,
    d 64, 2 heads), by position (mean over the heads: the sampling unit is a position)."""
    q, k, _ = _qkv(11, t=t, d=64)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(s, dim=-1)[0]
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return {"max_prob_mean": p.amax(-1).mean(0), "entropy_mean": entropy.mean(0)}


def _simulated_coverage(x: torch.Tensor, n: int, seeds: int) -> float:
    """The share of seeds whose interval (the module's draw: causal_head, a uniform sample of the rest in GROUPS
    groups, mean_figure) holds the mean over every position."""
    from attncheck.numerics.bounded import GROUPS, causal_head, mean_figure

    free = torch.arange(x.numel())
    head, rest = causal_head(free, n)
    truth, hit = float(x.mean()), 0
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        sample = rest[torch.randperm(rest.numel(), generator=gen)[:n]]
        groups = [float(x[g].mean()) for g in sample.chunk(GROUPS)]
        f = mean_figure("reference", "x", groups, False, float(x[head].mean()), head.numel() / free.numel())
        hit += f.low <= truth <= f.high
    return hit / seeds


@pytest.mark.slow
def test_causal_intervals_cover_their_figure():
    """Causal rows' figures depend on how many keys they see (row 0's max probability is 1): with the first
    positions computed in full, the 95% intervals of the mean max probability and entropy hold the call's value in
    at least 88% of 400 draws for 16 sampled positions and 93% from 64 (measured: 90.5/95/97.5% and 95/97/97%),
    where a uniform draw of every position held the max probability's in 75-90% (16-256 positions)."""
    figures = _causal_row_figures()
    for name, x in figures.items():
        for n in (16, 64, 256):
            assert _simulated_coverage(x, n, 400) >= (0.88 if n == 16 else 0.93), (name, n)


@pytest.mark.slow
def test_causal_interval_of_the_tool_is_the_simulated_one():
    """The tool's estimate on the causal call equals the draw simulated from float64 figures (same seed)."""
    q, k, v = _qkv(11, t=2048, d=64)
    inp = prepare_inputs(q, k, None, v=v, causal=True)
    inp = type(inp)(**{**inp.__dict__, "call": inp.facts("", "causal")})
    opts = Options(dtypes=("fp32",), methods=("torch",), paths=("eager",), bounded=Bounded(rows=128, seed=0))
    d = diagnose_attention("x", inp, opts)
    assert d.sampling.head_rows == 2 * 64
    fig = {f.figure: f for f in d.sampling.figures if f.owner == "reference"}
    from attncheck.numerics.bounded import GROUPS, causal_head

    truth = _causal_row_figures()
    head, rest = causal_head(torch.arange(2048), 64)
    sample = rest[torch.randperm(rest.numel(), generator=torch.Generator().manual_seed(0))[:64]]
    for name in ("max_prob_mean", "entropy_mean"):
        x = truth[name]
        groups = torch.stack([x[g].mean() for g in sample.chunk(GROUPS)])
        want = float(x[head].mean()) * 64 / 2048 + float(groups.mean()) * (1 - 64 / 2048)
        assert fig[name].estimate == pytest.approx(want, rel=1e-9)


def test_certified_rows_never_hide_a_failure_at_the_limit():
    """A row whose bound reaches fp16's rounding limit is computed; one far below is certified."""
    q, k, _ = _qkv(3, t=128)
    q[0, 0, 5] *= 4000.0
    inp = prepare_inputs(q, k, None)
    from attncheck.numerics.cells.plan import grid

    cert = certify(inp, grid(Options(dtypes=("fp16",), methods=("torch",), paths=("eager",)), True))
    assert bool(cert.must[5]) and int(cert.must.sum()) == 1 and cert.why == {"bound": 2}  # both heads of it
    assert cert.bound_max < 65504 / 4


# ----------------------------------------------------------------------------------------------------- the CLI


def _dump(tmp_path, t=256):
    q, k, v = _qkv(5, t=t)
    paths = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        p = tmp_path / f"{name}.safetensors"
        save_file({name: x.contiguous()}, str(p))
        paths.append(p)
    return paths


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_exact_equals_todays_output_and_small_calls_stay_exact(tmp_path):
    q, k, v = _dump(tmp_path, t=16)
    outs = []
    for extra in ([], ["--exact"], ["--rows", "8"]):
        js = tmp_path / f"out{len(outs)}.json"
        r = _run("run", "--q", q, "--k", k, "--v", v, "--causal", "--quiet", "--json", js, *extra)
        assert r.exit_code == 0, r.output
        doc = json.loads(js.read_text())
        outs.append(json.dumps(doc.get("tensors", doc), sort_keys=True, default=str))
    assert outs[0] == outs[1] == outs[2]
    assert '"sampling"' not in outs[0]


def test_rows_reports_exact_and_sampled(tmp_path):
    q, k, v = _dump(tmp_path, t=256)
    js = tmp_path / "b.json"
    r = _run("run", "--q", q, "--k", k, "--v", v, "--causal", "--dtype", "fp16", "--rows", "64", "--json", js)
    assert r.exit_code == 0, r.output
    assert "Bounded diagnosis: 512 score rows" in r.output and "Sampled figures" in r.output
    text = js.read_text()
    s = json.loads(text)
    sampling = [t["sampling"] for t in _tensors(s) if "sampling" in t]
    assert sampling and sampling[0]["sampled_rows"] == 64 and sampling[0]["rows"] == 512
    assert sampling[0]["certified_rows"] + sampling[0]["exact_rows"] == 512
    census = _tensors(s)[0]["census"]  # the census is of the rows computed, and says so
    assert census["call_shape"] == [1, 2, 256, 256] and census["shape"][2] < 256 and "rows computed" in census["scope"]


@pytest.mark.slow
def test_sampled_figures_fit_80_columns(tmp_path):
    """At 80 columns every number of the 'Sampled figures' table is whole (no '…')."""
    q, k, v = _dump(tmp_path, t=256)
    r = subprocess.run(
        [sys.executable, "-m", "attncheck", "run", "--q", str(q), "--k", str(k), "--v", str(v), "--causal"]
        + ["--dtype", "fp16", "--path", "eager,flash", "--method", "torch", "--rows", "64", "--brief"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "COLUMNS": "80"},
    )
    table = r.stdout[r.stdout.index("Sampled figures") :]
    assert r.returncode == 0 and "max_abs_err" in table and "…" not in table


def _tensors(doc):
    for key in ("tensors", "diagnoses"):
        if key in doc:
            return doc[key]
    return [c["diagnosis"] for c in doc.get("calls", []) if c.get("diagnosis")]


@pytest.mark.parametrize(
    "args, line",
    [
        (["--budget", "0"], "--budget must be a number > 0, got 0"),
        (["--budget", "nan"], "--budget must be a number > 0, got nan"),
        (["--rows", "0"], "--rows must be an integer >= 1, got 0"),
        (["--rows", "x"], "--rows must be an integer >= 1, got 'x'"),
        (["--exact", "--rows", "5"], "--exact computes every row; give it without --budget and --rows"),
        (["--budget", "1", "--rows", "5"], "give --budget or --rows, not both"),
    ],
)
def test_bad_budget_and_rows_exit_2_with_one_line(args, line):
    r = _run("run", "--example", *args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [f"attncheck: error: {line}"], r.stderr


def test_bad_rows_do_not_import_torch():
    code = (
        "import sys\nsys.argv = ['attncheck', 'run', '--rows', '0', 'x.pt']\nfrom attncheck.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nsys.exit(3 if 'torch' in sys.modules else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_interval_arithmetic():
    """mean +- t s / sqrt(g) of the groups' values; rmse through its square."""
    from attncheck.numerics.bounded import mean_figure

    vals = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    f = mean_figure("c", "kl_mean", vals, False)
    s = math.sqrt(sum((x - 4.5) ** 2 for x in vals) / 7)
    assert f.estimate == 4.5 and math.isclose(f.high - 4.5, 2.364624251592785 * s / math.sqrt(8), rel_tol=1e-8)
    r = mean_figure("c", "rmse", [2.0] * 8, True)
    assert r.estimate == r.low == r.high == 2.0


@pytest.mark.slow
def test_healthy_llama_stays_clean_under_the_bounded_diagnosis(tmp_path):
    """A transformers Llama from a config, its calls long enough to be sampled: 0 errors, 0 warnings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import attncheck

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap", max_bytes=None):
        model(torch.randint(0, 128, (1, 512)))
    js = tmp_path / "r.json"
    r = _run(
        "run", tmp_path / "cap", "--rows", "256", "--what-if", "fp16", "--fail-on", "error,warning,nan", "--json", js
    )
    assert r.exit_code == 0, r.output
    assert "0 error(s), 0 warning(s)" in r.output and "Bounded diagnosis" in r.output
