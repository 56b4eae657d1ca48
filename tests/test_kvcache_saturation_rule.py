"""The saturation count's rule, said where users read it: entries whose |x / scale| a round-to-nearest cast would
take beyond the format's max (e4m3: beyond 448 + half its last step of 32 = 464; those between round to 448 as any
value rounds), in the finding's message and the table's legend, and the number agreeing with it."""

import io

import torch
from rich.console import Console

from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.pipelines.kvcache import KVCall, run_kv
from attncheck.report.kvcache import kv_block

E4M3 = torch.finfo(torch.float8_e4m3fn)
EDGE = float(E4M3.max) + float(E4M3.max) / 1.75 * float(E4M3.eps) / 2  # 448 = 1.75 x 2^8: half of 2^8 x eps = 16


def test_count_and_text_agree_on_the_rule():
    assert EDGE == 464.0
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 8, 16, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 2, 8, 16, generator=g)
    v[0, 1, 0, :4] = torch.tensor([450.0, 464.0, 472.0, -1000.0])  # 450 and 464 round to 448: not clipped
    v = v.bfloat16()
    inp = prepare_inputs(q, k, None, v=v, causal=True)
    report = run_kv([("fp8_e4m3", "unit")], [KVCall("layer", 0, lambda: (inp, torch.bfloat16))])
    want = int((v[:, 1].double().abs() > EDGE).sum())
    assert want == 2
    sat = next(f for f in report.caches[0].findings if f.code == "kv_cache_saturation")
    assert f"{want} of 128 entries beyond 464 at that scale clipped to 448" in sat.message
    console = Console(file=io.StringIO(), width=200)
    console.print(kv_block(report))
    assert "sat: entries whose |x / scale| rounds beyond the format's max, > 464" in console.file.getvalue()
