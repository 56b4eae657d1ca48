"""Causal and padding masks as rules (inputs.index_mask.IndexMask): never a plane over every score, and every result
the same as the same mask given as a boolean plane (PyTorch's ones(L, S).tril(0) written out, an independent path)."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.errors import AttncheckError
from attncheck.format import to_jsonable
from attncheck.numerics.bounded import row_bounds, subset
from attncheck.numerics.cells.diagnose import diagnose_attention
from attncheck.numerics.inputs.index_mask import IndexMask
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.options import Bounded, Options

runner = CliRunner()


def _tril_masked(b: int, tq: int, tk: int, causal: bool, left=None, right=None) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool, True = masked, written out: the keys past the query (top-left aligned) and the pads."""
    masked = torch.zeros(b, 1, tq, tk, dtype=torch.bool)
    if causal:
        masked |= ~torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=0)
    for i in range(b):
        if left:
            masked[i, :, :, : left[i]] = True
        if right and right[i]:
            masked[i, :, :, tk - right[i] :] = True
    return masked


@pytest.mark.parametrize(
    "b, tq, tk, causal, left, right",
    [
        (1, 7, 7, True, None, None),
        (2, 5, 9, True, [2, 0], None),
        (2, 9, 5, True, None, [1, 5]),
        (2, 6, 6, False, [6, 1], [0, 2]),
    ],
)
def test_rule_gives_the_written_out_plane_in_every_block(b, tq, tk, causal, left, right):
    """Rows of any heads and queries, a subset of the positions, and the fully masked rows, against the plane."""
    h = 3
    rule = IndexMask(
        (b, h, tq, tk),
        causal,
        None if left is None else torch.tensor(left),
        None if right is None else torch.tensor(right),
    )
    want = _tril_masked(b, tq, tk, causal, left, right).expand(b, h, tq, tk).reshape(b * h, tq, tk)
    for bh, qs in (
        (slice(0, b * h), slice(0, tq)),
        (slice(1, b * h - 1), slice(1, tq - 1)),
        (slice(2, 3), slice(2, 3)),
    ):
        assert torch.equal(rule.rows(bh, qs), want[bh, qs])
    positions = torch.tensor([tq - 1, 0, tq // 2])
    assert torch.equal(rule.at(positions).rows(slice(0, b * h), slice(None)), want[:, positions])
    full = _tril_masked(b, tq, tk, causal, left, right).all(dim=-1)  # (B, 1, Tq)
    assert torch.equal(rule.fully_masked().expand(b, 1, tq), full)
    assert torch.equal(rule.at(positions).fully_masked().expand(b, 1, 3), full[..., positions])
    assert torch.equal(rule.expand(b, h, tq, tk), want.reshape(b, h, tq, tk))


def test_a_long_causal_call_holds_no_plane_over_its_scores():
    """65,536 queries and keys: the causal plane would be 4 GiB of booleans. The inputs hold a rule, the size check
    counts q and k alone (under 16 MiB), and a block of rows makes its own part."""
    t = 1 << 16
    q = torch.zeros(1, 1, t, 8, dtype=torch.bfloat16)
    inp = prepare_inputs(q, q, None, causal=True, pad_left=[3], max_bytes=16 << 20)  # 2 x 4 MiB in float64
    assert isinstance(inp.masked, IndexMask)
    part = inp.masked.rows(slice(0, 1), slice(t - 2, t))
    assert part.shape == (1, 2, t) and int(part[0, 0].sum()) == 3 + 1 and int(part[0, 1].sum()) == 3
    with pytest.raises(AttncheckError, match="over max_memory"):  # the same call with the plane given is refused
        prepare_inputs(q[..., :64, :], q[..., :64, :], torch.ones(64, 64, dtype=torch.bool), max_bytes=8 * 1024)


def _json(diag) -> str:
    return json.dumps(to_jsonable(diag), sort_keys=True, default=str)


def _dumps(tmp_path, b, hq, hk, tq, tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, tq, 16, generator=g) * 2).to(torch.bfloat16)
    k = (torch.randn(b, hk, tk, 16, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(b, hk, tk, 16, generator=g).to(torch.bfloat16)
    paths = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file({name: x}, str(paths[name]))
    return paths


@pytest.mark.parametrize(
    "b, hq, hk, tq, tk, pads",
    [(1, 2, 2, 24, 24, []), (2, 4, 2, 16, 40, ["--pad-left", "3,0"]), (2, 2, 1, 40, 16, ["--pad-right", "0,5"])],
)
def test_causal_json_equals_the_tril_given_as_a_mask_file(tmp_path, b, hq, hk, tq, tk, pads):
    """`--causal` (the rule, made per block) and the same tril written to a boolean --mask file (a plane held whole,
    sliced per block): the same JSON, but for how the mask was given (the kernel paths' facts: 'causal' or 'explicit',
    and the inputs' names)."""
    p = _dumps(tmp_path, b, hq, hk, tq, tk)
    keep = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=0)
    save_file({"mask": keep}, str(tmp_path / "mask.safetensors"))
    common = ["run", "--q", str(p["q"]), "--k", str(p["k"]), "--v", str(p["v"]), "--dtype", "fp16,bf16", *pads]
    docs = []
    for how in (["--causal"], ["--mask", str(tmp_path / "mask.safetensors")]):
        js = tmp_path / "out.json"
        r = runner.invoke(app, [*common, *how, "--quiet", "--json", str(js), "--path", "eager,sdpa-math,flash"])
        assert r.exit_code in (0, 1), r.output
        docs.append(json.loads(js.read_text()))
    a, m = (_strip(d) for d in docs)
    assert a == m
    assert '"masked_keys": 0' not in json.dumps(a)


def _strip(doc):
    """The JSON without what says how the mask was given."""
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in ("causal", "mask", "mask_source", "command", "inputs")}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


@pytest.mark.parametrize("bounded", [None, pytest.param(Bounded(rows=48, seed=3), marks=pytest.mark.slow)])
def test_library_diagnosis_equals_the_written_out_plane(bounded):
    """The whole diagnosis, exact and bounded (sampled rows: a subset of the positions keeps its rule), of causal,
    padded, GQA inputs with Tq != Tk, against the same planes given as a boolean mask, with the same call facts."""
    g = torch.Generator().manual_seed(5)
    b, hq, hk, tq, tk = 2, 2, 1, 96, 128
    q, k, v = (torch.randn(b, h, t, 16, generator=g) for h, t in ((hq, tq), (hk, tk), (hk, tk)))
    left = [5, 0]
    rule = prepare_inputs(q, k, None, v=v, causal=True, pad_left=left)
    plane = prepare_inputs(q, k, _tril_masked(b, tq, tk, True, left), v=v, mask_convention="ignore")
    assert isinstance(rule.masked, IndexMask) and isinstance(plane.masked, torch.Tensor)
    rule = replace(rule, call=rule.facts("", "causal"))
    plane = replace(plane, call=rule.call)
    opts = Options(dtypes=("fp16",), methods=("torch", "naive"), paths=("eager", "flash"), bounded=bounded)
    a, m = diagnose_attention("c", rule, opts), diagnose_attention("c", plane, opts)
    assert _json(a) == _json(m)
    assert (a.sampling is not None) == (bounded is not None)


def test_bounded_rows_and_subsets_read_the_rule_as_the_plane():
    """What the bounded diagnosis reads of the mask: the row bounds and fully masked rows (from the rule, no plane
    made), and the mask of a subset of the query positions, as of the same plane given whole."""
    g = torch.Generator().manual_seed(6)
    b, h, tq, tk = 2, 2, 40, 24
    q, k = torch.randn(b, h, tq, 8, generator=g), torch.randn(b, h, tk, 8, generator=g)
    left, right = [0, 20], [6, 0]
    rule = prepare_inputs(q, k, None, causal=True, pad_left=left, pad_right=right)
    plane = prepare_inputs(q, k, _tril_masked(b, tq, tk, True, left, right), mask_convention="ignore")
    for x, y in zip(row_bounds(rule), row_bounds(plane)):
        assert torch.equal(x, y)
    assert bool(row_bounds(rule)[3].any())  # rows fully masked: batch 1's first 20 queries see no key
    positions = torch.tensor([3, 17, 21, 39])
    got, want = subset(rule, positions).masked, subset(plane, positions).masked
    assert isinstance(got, IndexMask) and torch.equal(got.rows(slice(0, b * h), slice(None)), want.reshape(-1, 4, tk))
