"""A hostile corpus of capture directories, generated from one small valid capture: every field of
the manifest, of a call entry, of a tensor entry and of a call file's metadata takes values of the
wrong type, out of range (negative, NaN, inf, 1e400, 5,001 digits), nested 50,000 deep, holding
markup or control characters, or is left out; entries are listed twice or 10,000 times; files are
truncated, missing, unlisted, replaced by folders or by links out of the directory.

`attncheck run DIR` (in process) on each: exit 2 with one line on stderr, or exit 0/1 with a report
that lists every call once; never a traceback, never a hang, nothing written anywhere. Cases the
issue named as refused must be refused. The default run takes a sample that still touches every
field; ``-m slow`` runs the whole product."""

from __future__ import annotations

import json
import shutil
import struct
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import typer.main
import typer.testing
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()
HOLE = "\x00HOLE\x00"  # where a raw JSON fragment goes (json.dumps writes it as below)
HOLE_JSON = json.dumps(HOLE)
DEEP = 50_000
RAW = ("\x1b", "\r", "\x07", "\u202e")  # never written raw to the terminal


# --------------------------------------------------------------------------- the valid capture


class _Eager(nn.Module):
    def forward(self, q, k, v, mask):
        s = q @ k.transpose(-1, -2) * 0.35
        s = s.masked_fill(~mask, float("-inf"))
        return s.softmax(-1) @ v


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.eager = _Eager()

    def forward(self, q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
        c = flex_attention(
            q, k, v, score_mod=_softcap, block_mask=create_block_mask(_causal, None, None, 4, 4, device="cpu")
        )
        return self.eager(q, k, v, mask) + a + b + c


def _softcap(score, b, h, qi, ki):
    return 5.0 * torch.tanh(score / 5.0)


def _causal(b, h, qi, ki):
    return qi >= ki


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    """Four calls: SDPA with a boolean mask, SDPA causal with a scale, a flex call with a causal block
    mask and a soft cap (its mask and logits recorded), an eager softmax with q, k, v."""
    d = tmp_path_factory.mktemp("valid") / "cap"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    with torch.no_grad(), attncheck.capture(d), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention without torch.compile says so
        _Model()(q, k, v, mask)
    return d


# --------------------------------------------------------------------------- editing a copy


def read_manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def write_json_with_hole(path: Path, doc, fragment: str | None) -> None:
    text = json.dumps(doc, indent=1)
    if fragment is not None:
        assert HOLE_JSON in text
        text = text.replace(HOLE_JSON, fragment)
    path.write_text(text, encoding="utf-8")


def read_call_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_call_file(path: Path, header: dict, data: bytes, fragment: str | None = None) -> None:
    text = json.dumps(header, separators=(",", ":"))
    if fragment is not None:
        text = text.replace(HOLE_JSON, fragment)
    body = text.encode("utf-8")
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def set_path(doc, keys: tuple, value) -> None:
    """doc[k0][k1]... = value; ``DELETE`` removes the key."""
    for k in keys[:-1]:
        doc = doc[k]
    if value is DELETE:
        del doc[keys[-1]]
    else:
        doc[keys[-1]] = value


DELETE = object()


@dataclass
class Case:
    id: str
    edit: Callable[[Path], None]
    refused: bool = False  # the issue says: must be refused (exit 2)
    args: tuple[str, ...] = ()
    core: bool = False  # in the default sample
    extra: dict = field(default_factory=dict)


# JSON values by kind: raw fragments, so that NaN, 1e400 and 5,001-digit integers reach the reader as written.
JSON_VALUES = {
    "null": "null",
    "true": "true",
    "false": "false",
    "zero": "0",
    "negative": "-1",
    "half": "0.5",
    "negative_float": "-2.5",
    "uint64_plus": str(2**64),
    "int63": str(2**63 - 1),
    "digits_5001": "1" + "0" * 5000,
    "float_1e400": "1e400",
    "nan": "NaN",
    "inf": "Infinity",
    "minus_inf": "-Infinity",
    "string": '"abc"',
    "empty_string": '""',
    "digit_string": '"12"',
    "superscript_two": '"\\u00b2"',
    "markup": '"[/]"',
    "control": '"a\\nb\\r\\u001b[31m\\u202e"',
    "long_string": json.dumps("x" * 100_000),
    "list": "[1, 2]",
    "empty_list": "[]",
    "list_of_strings": '["a", "b"]',
    "object": '{"a": 1}',
    "empty_object": "{}",
    "deep_list": "[" * DEEP + "]" * DEEP,
    "deep_object": '{"a":' * DEEP + "1" + "}" * DEEP,
}
CORE_JSON = (
    "null",
    "negative",
    "digits_5001",
    "float_1e400",
    "nan",
    "string",
    "control",
    "list",
    "object",
    "deep_list",
)

# Metadata values (strings, as safetensors holds them).
META_VALUES = {
    "nan": "nan",
    "inf": "inf",
    "minus_inf": "-inf",
    "negative": "-1",
    "zero": "0",
    "huge": "1e400",
    "word": "abc",
    "empty": "",
    "superscript_two": "\u00b2",
    "digits_5001": "1" + "0" * 5000,
    "control": "a\nb\r\x1b[31m\u202e",
    "markup": "[/]",
    "fp8": "float8_e4m3fn",
    "true": "true",
    "false": "false",
    "none": "none",
    "number": "0.125",
    "long": "x" * 100_000,
    "json_deep": "[" * DEEP + "]" * DEEP,
    "int32": "int32",
}
CORE_META = ("nan", "negative", "huge", "word", "superscript_two", "digits_5001", "control", "fp8", "none", "json_deep")

# Metadata fields the issue names: these values must be refused.
REFUSED_META = {
    "scale": (
        "nan",
        "inf",
        "minus_inf",
        "negative",
        "zero",
        "huge",
        "word",
        "superscript_two",
        "digits_5001",
        "control",
        "markup",
        "fp8",
        "true",
        "false",
        "long",
        "json_deep",
        "int32",
    ),
    "dtype": ("nan", "inf", "negative", "fp8", "word", "int32", "control", "digits_5001", "long"),
    "forward": ("superscript_two", "negative", "digits_5001", "nan", "word", "huge"),
    "call": ("superscript_two", "negative", "digits_5001", "nan", "word", "empty"),
    "kind": tuple(v for v in META_VALUES),
    "format": tuple(v for v in META_VALUES),
    "dropout_p": ("nan", "inf", "negative", "huge", "word", "superscript_two", "digits_5001"),
}


def manifest_cases(valid_doc: dict) -> list[Case]:
    cases: list[Case] = []
    targets: list[tuple] = [(k,) for k in valid_doc]
    targets += [("calls", 1, k) for k in valid_doc["calls"][1]]
    targets += [
        ("calls", 0, "tensors", "q"),
        ("calls", 0, "tensors", "q", "shape"),
        ("calls", 0, "tensors", "q", "dtype"),
        ("calls", 0, "tensors", "q", "shape", 0),
    ]
    must = {("schema",), ("calls",), ("calls", 1, "index"), ("calls", 1, "file"), ("calls", 1, "kind")}
    for t, keys in enumerate(targets):
        label = ".".join(map(str, keys))
        for v, (name, fragment) in enumerate(JSON_VALUES.items()):

            def edit(d, keys=keys, fragment=fragment):
                doc = read_manifest(d)
                set_path(doc, keys, HOLE)
                write_json_with_hole(d / "manifest.json", doc, fragment)

            refused = (
                keys in must
                or name in ("digits_5001", "float_1e400", "nan", "inf", "minus_inf", "deep_list", "deep_object")
                or (
                    keys == ("calls", 1, "module")
                    and name
                    not in (
                        "string",
                        "empty_string",
                        "digit_string",
                        "superscript_two",
                        "markup",
                        "control",
                        "long_string",
                    )
                )
            )
            # the sample: every core value on the fields a reader uses, every other one (in turn) on the rest
            core = name in CORE_JSON and (keys in must or (t + v) % 2 == 0)
            cases.append(Case(f"manifest:{label}={name}", edit, refused, core=core))
            if keys == ("calls", 1, "module"):  # the module path is what --key matches
                cases.append(Case(f"manifest:{label}={name}:--key", edit, refused, args=("--key", "*"), core=core))

        def remove(d, keys=keys):
            doc = read_manifest(d)
            set_path(doc, keys, DELETE)
            write_json_with_hole(d / "manifest.json", doc, None)

        cases.append(Case(f"manifest:{label}=missing", remove, keys in must, core=True))
    return cases


def meta_cases(valid: Path) -> list[Case]:
    cases: list[Case] = []
    files = sorted(p.name for p in valid.glob("*.safetensors"))
    for which in (0, 3, 2):  # an SDPA call, a softmax call, a flex call (soft cap, block mask)
        name = files[which]
        header, _ = read_call_file(valid / name)
        for t, key in enumerate(header["__metadata__"]):
            for v, (vname, value) in enumerate(META_VALUES.items()):

                def edit(d, name=name, key=key, value=value):
                    header, data = read_call_file(d / name)
                    header["__metadata__"][key] = value
                    write_call_file(d / name, header, data)

                refused = vname in REFUSED_META.get(key, ())
                core = which == 0 and vname in CORE_META and (key in REFUSED_META or (t + v) % 2 == 0)
                cases.append(Case(f"meta:{name}:{key}={vname}", edit, refused, core=core))

            def remove(d, name=name, key=key):
                header, data = read_call_file(d / name)
                del header["__metadata__"][key]
                write_call_file(d / name, header, data)

            cases.append(Case(f"meta:{name}:{key}=missing", remove, key in ("format", "kind", "call"), core=which == 0))
    return cases


def structure_cases(valid: Path) -> list[Case]:
    """Whole files: the manifest and the call files cut, emptied, nested, duplicated, swapped; call
    files missing, unlisted, replaced by a folder or by a link out of the directory."""
    first = sorted(p.name for p in valid.glob("*.safetensors"))[0]
    cases: list[Case] = []

    def manifest_text(text: str | bytes, refused=True, label=""):
        def edit(d):
            (d / "manifest.json").write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))

        cases.append(Case(f"manifest-file:{label}", edit, refused, core=True))

    size = len((valid / "manifest.json").read_bytes())
    for cut in (0, 1, 2, size // 3, size // 2, size - 3, size - 2):  # the last byte is a newline

        def truncate(d, cut=cut):
            p = d / "manifest.json"
            p.write_bytes(p.read_bytes()[:cut])

        cases.append(Case(f"manifest-file:truncated@{cut}", truncate, True, core=True))
    manifest_text("[" * 100_000 + "]" * 100_000, label="deep_100000")
    manifest_text('{"schema": "attncheck.capture/1", "calls": ' + "[" * DEEP + "]" * DEEP + "}", label="deep_calls")
    manifest_text("{}", label="empty_object")
    manifest_text("[]", label="empty_list")
    manifest_text("", label="empty_file")
    manifest_text(b"\xff\xfe{}", label="not_utf8")
    manifest_text("\ufeff" + (valid / "manifest.json").read_text(), label="bom")
    manifest_text('{"schema": "attncheck.capture/1", "calls": []}', label="no_calls")
    manifest_text('{"schema": "attncheck.capture/1"}', label="no_calls_key")

    def duplicate(times):
        def edit(d):
            doc = read_manifest(d)
            doc["calls"] = doc["calls"] + [doc["calls"][1]] * times
            write_json_with_hole(d / "manifest.json", doc, None)

        return edit

    for times in (1, 2, 10_000):
        cases.append(Case(f"calls:listed_again_x{times}", duplicate(times), True, core=True))

    def same_index(d):
        doc = read_manifest(d)
        doc["calls"][2]["index"] = doc["calls"][1]["index"]
        write_json_with_hole(d / "manifest.json", doc, None)

    def swapped_index(d):
        doc = read_manifest(d)
        doc["calls"][1]["index"], doc["calls"][2]["index"] = doc["calls"][2]["index"], doc["calls"][1]["index"]
        write_json_with_hole(d / "manifest.json", doc, None)

    def reversed_order(d):  # listed in another order: still each call once, in call order
        doc = read_manifest(d)
        doc["calls"].reverse()
        write_json_with_hole(d / "manifest.json", doc, None)

    def parent_file(d):
        doc = read_manifest(d)
        doc["calls"][1]["file"] = "../" + doc["calls"][1]["file"]
        write_json_with_hole(d / "manifest.json", doc, None)

    def absolute_file(d):
        doc = read_manifest(d)
        doc["calls"][1]["file"] = str(d / doc["calls"][1]["file"])
        write_json_with_hole(d / "manifest.json", doc, None)

    def dropped_entry(d):  # a file the manifest does not list
        doc = read_manifest(d)
        del doc["calls"][1]
        write_json_with_hole(d / "manifest.json", doc, None)

    def missing_file(d):
        (d / first).unlink()

    def folder_for_file(d):
        (d / first).unlink()
        (d / first).mkdir()

    def link_out(d):
        outside = d.parent / "outside.safetensors"
        shutil.copy(d / first, outside)
        (d / first).unlink()
        (d / first).symlink_to(outside)

    def manifest_link(d):
        outside = d.parent / "outside.json"
        shutil.copy(d / "manifest.json", outside)
        (d / "manifest.json").unlink()
        (d / "manifest.json").symlink_to(outside)

    def unlisted_extra(d):
        shutil.copy(d / first, d / "0099-extra.safetensors")

    def empty_call_file(d):
        (d / first).write_bytes(b"")

    for name, edit, refused in (
        ("same_index", same_index, True),
        ("swapped_index", swapped_index, True),
        ("reversed_order", reversed_order, False),
        ("parent_file", parent_file, True),
        ("absolute_file", absolute_file, True),
        ("unlisted_file", dropped_entry, True),
        ("missing_file", missing_file, True),
        ("folder_for_file", folder_for_file, True),
        ("link_out", link_out, True),
        ("manifest_link", manifest_link, True),
        ("unlisted_extra", unlisted_extra, True),
        ("empty_call_file", empty_call_file, True),
    ):
        cases.append(Case(f"files:{name}", edit, refused, core=True))

    call_size = len((valid / first).read_bytes())
    for cut in (0, 4, 8, 16, 100, call_size // 2, call_size - 1):

        def truncate(d, cut=cut):
            p = d / first
            p.write_bytes(p.read_bytes()[:cut])

        cases.append(Case(f"call-file:truncated@{cut}", truncate, True, core=True))

    header, _ = read_call_file(valid / first)
    tensor_targets = [("q", "shape"), ("q", "dtype"), ("q", "data_offsets"), ("q",), ("__metadata__",)]
    for t, keys in enumerate(tensor_targets):
        for v, (name, fragment) in enumerate(JSON_VALUES.items()):

            def edit(d, keys=keys, fragment=fragment):
                header, data = read_call_file(d / first)
                set_path(header, keys, HOLE)
                write_call_file(d / first, header, data, fragment)

            ok_values = {("q", "dtype"): (), ("__metadata__",): ()}
            refused = name not in ok_values.get(keys, ())
            cases.append(
                Case(f"header:{'.'.join(keys)}={name}", edit, refused, core=name in CORE_JSON and (t + v) % 2 == 0)
            )

    def deep_header(d):
        header, data = read_call_file(d / first)
        header["x"] = HOLE
        write_call_file(d / first, header, data, "[" * 100_000 + "]" * 100_000)

    cases.append(Case("header:deep_100000", deep_header, True, core=True))
    del header
    return cases


def all_cases(valid: Path) -> list[Case]:
    return manifest_cases(read_manifest(valid)) + meta_cases(valid) + structure_cases(valid)


# --------------------------------------------------------------------------- running them


def run_case(case: Case, valid: Path, root: Path) -> str | None:
    """The violation this case finds, or None."""
    work = root / case.id.replace("/", "_")[:150].encode("ascii", "backslashreplace").decode()
    work.mkdir()
    d = work / "cap"
    shutil.copytree(valid, d)
    case.edit(d)
    before = sorted(p for p in work.rglob("*"))
    start = time.perf_counter()
    r = runner.invoke(app, ["run", str(d), "--quiet", "--json", "-", *case.args])
    took = time.perf_counter() - start
    after = sorted(p for p in work.rglob("*"))
    if took > 10:
        return f"took {took:.1f} s"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return f"{type(r.exception).__name__}: {r.exception}"[:300]
    if "Traceback" in r.output:
        return "traceback"
    if before != after:
        return f"wrote {set(after) - set(before)}"
    if r.exit_code == 2:
        lines = r.stderr.split("\n")
        if len(lines) != 2 or lines[1] != "" or not lines[0].startswith("attncheck: error: "):
            return f"exit 2 with {len(lines) - 1} stderr lines: {r.stderr[:300]!r}"
        if any(ch in r.stderr for ch in RAW):
            return f"raw control character on stderr: {r.stderr[:300]!r}"
        return None
    if case.refused:
        return f"accepted (exit {r.exit_code}), but must be refused"
    if r.exit_code not in (0, 1):
        return f"exit {r.exit_code}: {r.output[:300]!r}"
    report = json.loads(r.stdout)
    listed = sorted(c["index"] for c in read_manifest(d)["calls"])
    got = [c["index"] for c in report["model"]["calls"]]
    if got != listed or len(report["tensors"]) != len(listed):
        return f"calls in the report {got} ({len(report['tensors'])} diagnosed), listed {listed}"
    return None


@pytest.fixture(autouse=True)
def one_command(monkeypatch):
    """typer builds the command anew on every invoke, which costs more than a refused case: build it once."""
    command = typer.main.get_command(app)
    monkeypatch.setattr(typer.testing, "_get_command", lambda _: command)


def check_corpus(cases: list[Case], valid: Path, root: Path) -> None:
    violations = []
    for case in cases:
        why = run_case(case, valid, root)
        if why is not None:
            violations.append(f"{case.id}: {why}")
    assert not violations, f"{len(violations)} of {len(cases)} cases:\n" + "\n".join(violations)


def test_the_valid_capture_is_diagnosed(valid, tmp_path):
    assert run_case(Case("valid", lambda d: None), valid, tmp_path) is None


def test_corpus_sample(valid, tmp_path):
    cases = [c for c in all_cases(valid) if c.core]
    assert len(cases) >= 300
    start = time.perf_counter()
    check_corpus(cases, valid, tmp_path)
    assert time.perf_counter() - start < 60


@pytest.mark.slow
def test_corpus_whole(valid, tmp_path):
    cases = all_cases(valid)
    assert len(cases) >= 1500
    check_corpus(cases, valid, tmp_path)


def test_optional_tensors_and_metadata_of_a_newer_writer_read(valid, tmp_path):
    """Call files may gain tensors (grad_out, grad_q, ...) and metadata keys (grads, mask_kind): read, not refused."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "cap"
    shutil.copytree(valid, d)
    doc = read_manifest(d)
    entry = doc["calls"][0]
    path = d / entry["file"]
    header, _ = read_call_file(path)
    tensors = load_file(str(path))
    for role in ("grad_out", "grad_q", "grad_k", "grad_v"):
        tensors[role] = torch.zeros_like(tensors["q"])
        entry["tensors"][role] = {"shape": list(tensors["q"].shape), "dtype": "float32"}
    save_file(tensors, str(path), metadata={**header["__metadata__"], "grads": "true", "mask_kind": "boolean"})
    write_json_with_hole(d / "manifest.json", doc, None)
    r = runner.invoke(app, ["run", str(d), "--quiet", "--json", "-"])
    assert r.exit_code == 0, r.output
    assert [c["index"] for c in json.loads(r.stdout)["model"]["calls"]] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- gradients files


class _Train(nn.Module):
    def forward(self, q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.eager(q, k, v, mask) + a

    def __init__(self):
        super().__init__()
        self.eager = _Eager()


@pytest.fixture(scope="module")
def valid_grads(tmp_path_factory) -> Path:
    """A training step: an SDPA call and an eager softmax call, each with its gradients file."""
    d = tmp_path_factory.mktemp("valid_grads") / "cap"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g).requires_grad_() for _ in range(3))
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    with attncheck.capture(d):
        _Train()(q, k, v, mask).sum().backward()
    assert all("grads" in c for c in read_manifest(d)["calls"])
    return d


def grads_cases(valid: Path) -> list[Case]:
    """The gradients of a capture as hostile input: each call's manifest 'grads' entry with every kind
    of wrong value, its file cut, emptied, missing, a folder, a link out, unlisted; its header's tensors
    reshaped, retyped or given another role; its metadata not a gradients file's; NaN gradients (a
    correct report: grad_nan_input)."""
    cases: list[Case] = []
    doc = read_manifest(valid)
    for i, entry in enumerate(doc["calls"]):
        gname = entry["grads"]["file"]
        for keys in (
            ("calls", i, "grads"),
            ("calls", i, "grads", "file"),
            ("calls", i, "grads", "bytes"),
            ("calls", i, "grads", "tensors"),
            ("calls", i, "grads", "tensors", "grad_out", "shape"),
        ):
            for name, fragment in JSON_VALUES.items():

                def edit(d, keys=keys, fragment=fragment):
                    doc = read_manifest(d)
                    set_path(doc, keys, HOLE)
                    write_json_with_hole(d / "manifest.json", doc, fragment)

                refused = (
                    keys[-1] in ("grads", "file")
                    and name != "null"
                    or name in ("digits_5001", "float_1e400", "nan", "inf", "minus_inf", "deep_list", "deep_object")
                )
                if keys[-1] == "grads" and name == "null":
                    refused = False  # no gradients: the forward alone
                cases.append(Case(f"grads:{i}:{'.'.join(map(str, keys[3:])) or 'entry'}={name}", edit, refused))
        size = len((valid / gname).read_bytes())

        def cut(d, at, gname=gname):
            p = d / gname
            p.write_bytes(p.read_bytes()[:at])

        for at in (0, 4, 8, 16, 100, size // 2, size - 1):
            cases.append(Case(f"grads-file:{i}:truncated@{at}", lambda d, at=at, cut=cut: cut(d, at), True))

        def missing(d, gname=gname):
            (d / gname).unlink()

        def folder(d, gname=gname):
            (d / gname).unlink()
            (d / gname).mkdir()

        def link_out(d, gname=gname):
            outside = d.parent / "outside.grads.safetensors"
            shutil.copy(d / gname, outside)
            (d / gname).unlink()
            (d / gname).symlink_to(outside)

        def other_call(d, i=i):  # the entry names the other call's gradients file
            doc = read_manifest(d)
            doc["calls"][i]["grads"]["file"] = doc["calls"][1 - i]["grads"]["file"]
            write_json_with_hole(d / "manifest.json", doc, None)

        def unlisted(d, i=i):
            doc = read_manifest(d)
            del doc["calls"][i]["grads"]
            write_json_with_hole(d / "manifest.json", doc, None)

        for name, edit in (
            ("missing", missing),
            ("folder", folder),
            ("link_out", link_out),
            ("other_call", other_call),
            ("unlisted", unlisted),
        ):
            cases.append(Case(f"grads-file:{i}:{name}", edit, True))

        header, _ = read_call_file(valid / gname)
        for role in ("grad_out", "grad_q", "grad_k", "grad_v"):
            for what, value in (("shape", [1, 2, 3, 8]), ("shape", [4, 8]), ("dtype", "I32"), ("dtype", "F16")):

                def retype(d, role=role, what=what, value=value, gname=gname):
                    from safetensors.torch import load_file, save_file

                    tensors = load_file(str(d / gname))
                    header, _ = read_call_file(d / gname)
                    t = tensors[role]
                    if what == "shape":
                        t = torch.zeros(value)
                    else:
                        t = t.to(torch.int32 if value == "I32" else torch.float16)
                    save_file({**tensors, role: t}, str(d / gname), metadata=header["__metadata__"])
                    doc = read_manifest(d)
                    doc["calls"][i]["grads"]["tensors"][role] = {
                        "shape": list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch."),
                    }
                    write_json_with_hole(d / "manifest.json", doc, None)

                cases.append(
                    Case(f"grads-tensor:{i}:{role}:{what}={value}", retype, not (what == "dtype" and value == "F16"))
                )
        for key, value in (("grads", "false"), ("grads", "\x1b[31m"), ("format", "nope")):

            def meta(d, key=key, value=value, gname=gname):
                header, data = read_call_file(d / gname)
                header["__metadata__"][key] = value
                write_call_file(d / gname, header, data)

            cases.append(Case(f"grads-meta:{i}:{key}={value!r}", meta, True))

        def nan_grad_out(d, gname=gname):
            from safetensors.torch import load_file, save_file

            tensors = load_file(str(d / gname))
            header, _ = read_call_file(d / gname)
            tensors["grad_out"][0, 0, 1, 0] = float("nan")
            save_file(tensors, str(d / gname), metadata=header["__metadata__"])

        cases.append(Case(f"grads-values:{i}:nan_in_grad_out", nan_grad_out, False))
    return cases


def test_gradients_corpus_sample(valid_grads, tmp_path):
    """Every file, tensor and metadata case, and every third value of the manifest's 'grads' fields."""
    cases = grads_cases(valid_grads)
    assert len(cases) >= 250
    check_corpus([c for i, c in enumerate(cases) if not c.id.startswith("grads:") or i % 3 == 0], valid_grads, tmp_path)
    d = tmp_path / "nan"
    shutil.copytree(valid_grads, d)
    next(c for c in cases if c.id == "grads-values:0:nan_in_grad_out").edit(d)
    r = runner.invoke(app, ["run", str(d), "--quiet", "--json", "-", "--fail-on", "nan"])
    assert r.exit_code == 1 and "grad_nan_input" in {
        f["code"] for t in json.loads(r.stdout)["tensors"] for f in t["findings"]
    }


@pytest.mark.slow
def test_gradients_corpus_whole(valid_grads, tmp_path):
    check_corpus(grads_cases(valid_grads), valid_grads, tmp_path)
