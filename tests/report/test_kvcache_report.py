"""The KV-cache what-if's tables at 80 columns (Rich's width when not a terminal): every head's row on one line
under four scalings side by side, the numbers in 3 significant digits (2 for scales), the worst heads first and
the others counted; a cache where nothing saturates and no head breaks is its summary line alone; --full lists
every head and the cosine against float64. Results are built here, rendered into Console(width=80)."""

from __future__ import annotations

import io

from rich.console import Console

from attncheck.format import compact
from attncheck.report.kvcache import KV_ROWS, kv_block
from attncheck.results import Finding
from attncheck.results.kvcache import KVHead, KVReport, KVWhatIf

LAYERS, KV_HEADS = 4, 2  # 8 heads per cache


def head(layer: int, kv: int, scaling: str, bad: bool) -> KVHead:
    """A head with wide numbers: amax in the thousands, counts in the thousands, scales below 0.01."""
    amax = 2864.0 if bad else 2.41 + layer
    scale = 1.0 if scaling == "unit" else 0.00579 + 0.001 * kv
    return KVHead(
        module=f"model.layers.{layer}.self_attn",
        kv_head=kv,
        query_heads=[2 * kv, 2 * kv + 1],
        calls=3,
        k_amax=1234.5 if bad else 2.59,
        v_amax=amax,
        k_scale=scale,
        v_scale=scale,
        k_saturated=12345 if bad else 0,
        v_saturated=98765 if bad else 0,
        k_flushed=1500 if bad else layer,
        v_flushed=999,
        k_entries=200000,
        v_entries=200000,
        rel_l2=0.6 if bad else 0.01,
        cosine=0.8737 if bad else 0.999 - 0.0001 * (layer * KV_HEADS + kv),
        max_abs=1536.0,
        rel_l2_f64=0.6,
        cosine_f64=0.87361 if bad else 0.9989,
        max_abs_f64=1536.0,
        base_cosine_f64=0.99999,
        hold_k_tensor=2.76,
        hold_v_tensor=6.39,
        hold_k_head=0.000123 * (kv + 1),
        hold_v_head=6.39 if bad else 0.00538,
    )


def cache(scaling: str, bad: bool) -> KVWhatIf:
    what = KVWhatIf("fp8_e4m3", scaling, 448.0)
    what.heads = [head(layer, kv, scaling, bad and (layer, kv) == (1, 1)) for layer in range(LAYERS) for kv in range(2)]
    what.summary = f"FP8 e4m3 KV at {scaling} scale: ..."
    if bad:
        what.findings = [Finding("kv_cache_saturation", "warning", "V saturates", "a v_scale of 6.39")]
    return what


def render(report: KVReport, full: bool = False) -> list[str]:
    console = Console(width=80, file=io.StringIO(), color_system=None)
    console.print(kv_block(report, full=full))
    return console.file.getvalue().splitlines()


def rows(lines: list[str]) -> list[str]:
    """The tables' body rows, stripped: a line starting with an 'L:kv' value ('1:1 '); none cut ('…')."""
    out = [line.strip() for line in lines if line.strip()[:1].isdigit() and ":" in line.strip()[:4]]
    assert not any("…" in line for line in out)
    return out


def test_compact_numbers_written_out():
    assert [compact(x) for x in (2864.0, 2.41, 0.0264, 448.0, 0.00579, 98765, 1.0, 0.0, 999.6)] == [
        "2.86k", "2.41", "0.0264", "448", "5.79e-3", "98.8k", "1", "0", "1k",
    ]  # fmt: skip
    assert [compact(x, 2) for x in (0.00579, 6.39, 448.0, 0.0264)] == ["5.8e-3", "6.4", "450", "0.026"]


def test_four_scalings_at_80_columns_one_line_per_head():
    report = KVReport(caches=[cache(s, True) for s in ("unit", "tensor", "head", "dynamic")])
    lines = render(report)
    assert max(len(line) for line in lines) <= 80
    body = rows(lines)
    assert len(body) == 4 * KV_ROWS  # the worst 5 of 8 per cache, each on one line
    # the saturating head first, every one of its cells on its row (nothing wrapped onto a next line)
    bad = [line.split() for line in body if line.startswith("1:1 ")]
    assert len(bad) == 4
    unit, tensor = bad[0], bad[1]
    assert unit == ["1:1", "1.23k/2.86k", "12.3k/98.8k", "1.5k/999", "0.8737", "2.5e-4/6.4"]  # no scale at unit: 1
    assert tensor == ["1:1", "1.23k/2.86k", "6.8e-3/6.8e-3", "12.3k/98.8k", "1.5k/999", "0.8737", "2.5e-4/6.4"]
    assert lines.count(f"{2 * LAYERS - KV_ROWS} more heads of kv:fp8_e4m3:unit (--full lists all)") == 1
    assert not any("f64" in line.split() for line in lines)
    # the legend, once: what L stands for
    assert sum("L:kv: layer model.layers.L.self_attn, kv head" in line for line in lines) == 1


def test_a_quiet_cache_is_its_summary_line():
    report = KVReport(caches=[cache("unit", True), cache("head", False)])
    lines = render(report)
    after = lines[lines.index("FP8 e4m3 KV at head scale: ...") + 1]
    assert after.startswith("L:kv: layer")  # the legend: no table for the quiet cache
    assert len(rows(lines)) == KV_ROWS


def test_full_lists_every_head_and_the_float64_cosine():
    report = KVReport(caches=[cache("unit", True), cache("head", False)])
    lines = render(report, full=True)
    assert max(len(line) for line in lines) <= 80
    body = rows(lines)
    assert len(body) == 2 * LAYERS * KV_HEADS
    assert {line.split()[0] for line in body} == {f"{layer}:{kv}" for layer in range(LAYERS) for kv in range(2)}
    assert sum(
        line.split()[:1] == ["L:kv"] and "f64" in line.split() for line in lines
    ) == 2 and "more head" not in "\n".join(lines)
    assert body[0].split()[5] == "0.8736"  # cos f64 of the worst head, in 4 digits
    # head scale: the hold column would repeat the scale, and nothing saturates: no hold column
    header = next(line for line in lines[lines.index("FP8 e4m3 KV at head scale: ...") :] if " f64" in line)
    assert header.split() == ["L:kv", "amax", "scale", "sat", "flush", "cos", "f64"]
