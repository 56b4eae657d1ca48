"""A hostile corpus of watch logs, generated from one valid log of three records: every field of a
record, of a call and of a gradient entry takes values of the wrong type, out of range, 5,001 digits,
NaN, nested 50,000 deep, markup and control characters, or is left out; lines are cut, doubled,
swapped, emptied, replaced by another program's output or by binary. `attncheck watch LOG` on each:
exit 2 with one line on stderr, or a report of the records that are there; no traceback, no hang."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from tests.cli.test_capture_corpus import HOLE, HOLE_JSON, JSON_VALUES, RAW

runner = CliRunner()


def valid_records() -> list[dict]:
    call = {
        "module": "layers.0.attn",
        "kind": "sdpa",
        "dtype": "bf16",
        "path": "flash",
        "heads": 2,
        "max_logit": [1.5, 2.5],
        "exact": [True, False],
        "entropy_min": [0.5, 0.7],
        "entropy_mean": [1.0, 1.2],
        "collapsed": [0.0, 0.25],
        "q_max": [1.0, 2.0],
        "k_max": [1.0, 2.0],
        "nonfinite_rows": 0,
        "scale": 0.125,
        "limit": {"logit": 3.4e38, "what": "S in fp32"},
    }
    return [
        {
            "schema": "attncheck.watch/1",
            "attncheck_version": "0.1.0",
            "step": s,
            "rank": 0,
            "world": 1,
            "time": 1.0 + s,
            "loss": 2.0,
            "calls": [dict(call)],
            "grads": [{"module": "layers.0.attn", "nonfinite": 0, "zero_frac": 0.1, "max_abs": 0.01}],
        }
        for s in (1, 2, 3)
    ]


def lines_with(records, where, fragment) -> str:
    out = []
    for i, r in enumerate(records):
        text = json.dumps(r)
        if i == where and HOLE_JSON in text:
            text = text.replace(HOLE_JSON, fragment)
        out.append(text)
    return "\n".join(out) + "\n"


def set_field(rec, keys, value):
    for k in keys[:-1]:
        rec = rec[k]
    if value is None:
        del rec[keys[-1]]
    else:
        rec[keys[-1]] = value


def cases() -> list[tuple[str, str, bool]]:
    """(id, log text, refused)."""
    base = valid_records()
    out = []
    must = {
        ("schema",),
        ("step",),
        ("calls",),
        ("calls", 0, "module"),
        ("calls", 0, "kind"),
        ("calls", 0, "heads"),
        ("calls", 0, "max_logit"),
        ("grads", 0, "module"),
    }
    fields = (
        [(k,) for k in base[0]]
        + [("calls", 0, k) for k in base[0]["calls"][0]]
        + [("grads", 0, k) for k in base[0]["grads"][0]]
    )
    fields += [("calls", 0, "max_logit", 0), ("calls", 0, "limit", "logit")]
    strings = {
        "string",
        "empty_string",
        "digit_string",
        "superscript_two",
        "markup",
        "control",
    }  # a name may be any short string
    accepted = {
        ("calls", 0, "module"): strings,
        ("grads", 0, "module"): strings,
        ("calls",): {"empty_list"},
        ("calls", 0, "max_logit"): {"list"},
    }
    for keys in fields:
        for name, fragment in JSON_VALUES.items():
            recs = json.loads(json.dumps(base))
            set_field(recs[1], keys, HOLE)
            refused = keys in must and name not in accepted.get(keys, ())
            out.append((f"{'.'.join(map(str, keys))}={name}", lines_with(recs, 1, fragment), refused))
        recs = json.loads(json.dumps(base))
        set_field(recs[1], keys, None)
        out.append((f"{'.'.join(map(str, keys))}=missing", lines_with(recs, 1, "null"), keys in must))
    text = "".join(json.dumps(r) + "\n" for r in base)
    for cut in (1, 10, len(text) // 2, len(text) - 2):
        out.append((f"cut@{cut}", text[:cut], cut < len(json.dumps(base[0]))))
    out += [
        ("empty", "", True),
        ("blank_lines", "\n\n\n", True),
        ("binary", "\x00\xff\xfe" * 100, True),
        ("another_program", "epoch 1 loss 2.3\nepoch 2 loss 2.1\n", True),
        ("csv", "step,loss\n1,2.0\n", True),
        ("same_step_twice", json.dumps(base[0]) + "\n" + json.dumps(base[0]) + "\n", True),
        ("steps_swapped", json.dumps(base[1]) + "\n" + json.dumps(base[0]) + "\n", True),
        ("mixed_ranks", json.dumps(base[0]) + "\n" + json.dumps({**base[1], "rank": 1}) + "\n", True),
        ("a_list", "[1, 2, 3]\n", True),
        ("a_number", "42\n", True),
        ("deep", "[" * 100_000 + "]" * 100_000 + "\n", True),
        ("long_line", json.dumps({**base[0], "pad": "x" * (17 << 20)}) + "\n", True),
        ("heads_mismatch", json.dumps({**base[0], "calls": [{**base[0]["calls"][0], "heads": 3}]}) + "\n", True),
        ("no_calls", json.dumps({**base[0], "calls": []}) + "\n", False),
        ("flex_kind", json.dumps({**base[0], "calls": [{**base[0]["calls"][0], "kind": "flex"}]}) + "\n", False),
        ("no_forward_seen", json.dumps({**base[0], "forwards": 0, "calls": [], "grads": []}) + "\n", False),
        ("forwards_negative", json.dumps({**base[0], "forwards": -1}) + "\n", True),
        (
            "markup_module",
            json.dumps({**base[0], "calls": [{**base[0]["calls"][0], "module": "[red]x[/]\x1b[31m"}]}) + "\n",
            False,
        ),
    ]
    return out


def run_case(text: str, refused: bool, tmp_path) -> str | None:
    log = tmp_path / "w.jsonl"
    log.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    start = time.perf_counter()
    r = runner.invoke(app, ["watch", str(log), "--json", "-"])
    if time.perf_counter() - start > 10:
        return "took over 10 s"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return f"{type(r.exception).__name__}: {r.exception}"[:300]
    if "Traceback" in r.output:
        return "traceback"
    if r.exit_code == 2:
        lines = r.stderr.split("\n")
        if len(lines) != 2 or not lines[0].startswith("attncheck: error: "):
            return f"exit 2 with {len(lines) - 1} stderr lines: {r.stderr[:300]!r}"
        if any(ch in r.stderr for ch in RAW):
            return f"raw control character on stderr: {r.stderr[:200]!r}"
        return None
    if refused:
        return f"accepted (exit {r.exit_code}), but must be refused"
    if r.exit_code not in (0, 1):
        return f"exit {r.exit_code}"
    doc = json.loads(r.stdout)
    lines = [line for line in text.split("\n") if line.strip()]
    if doc["records"] not in (len(lines), len(lines) - 1):  # a last line cut short is left out, and said
        return f"{doc['records']} records of {len(lines)} lines"
    return None


def check(all_cases, tmp_path):
    violations = []
    for i, (case_id, text, refused) in enumerate(all_cases):
        d = tmp_path / str(i)
        d.mkdir()
        why = run_case(text, refused, d)
        if why is not None:
            violations.append(f"{case_id}: {why}")
    assert not violations, f"{len(violations)} of {len(all_cases)}:\n" + "\n".join(violations)


def test_watch_log_corpus_sample(tmp_path):
    """Every third case (every kind of value still meets every field): a few seconds."""
    all_cases = cases()
    assert len(all_cases) >= 500
    check(all_cases[::3], tmp_path)


@pytest.mark.slow
def test_watch_log_corpus_whole(tmp_path):
    check(cases(), tmp_path)
