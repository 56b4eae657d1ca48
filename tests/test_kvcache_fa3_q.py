"""kv:...:fa3 where Q saturates (FlashAttention-3's FP8 path quantises Q at its own scale, 1.0 without one): the
summary counts it, the heads give Q's amax and the q_scale that holds it (amax / 448, written here), the table a Q
column, the fix names the q_scale."""

import io

import torch
from rich.console import Console

from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.pipelines.kvcache import KVCall, run_kv
from attncheck.report.kvcache import kv_block

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def test_q_saturation_counted_with_its_amax_and_the_q_scale_that_holds_it():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 8, 16, generator=g)
    q[:, :2] *= 300  # the query heads of kv head 0 beyond 448 at Q's scale 1.0; K and V well within
    q = q.bfloat16()
    k, v = (torch.randn(1, 2, 8, 16, generator=g).bfloat16() for _ in range(2))
    inp = prepare_inputs(q, k, None, v=v, causal=True)
    report = run_kv([("fp8_e4m3", "unit:fa3")], [KVCall("layer", 0, lambda: (inp, torch.bfloat16))])
    what = report.caches[0]
    heads = {h.kv_head: h for h in what.heads}
    for h in range(2):
        amax = float(q[:, 2 * h : 2 * h + 2].double().abs().max())
        assert heads[h].q_amax == amax and heads[h].q_scale == 1.0
        assert heads[h].hold_q == float(torch.tensor(amax / E4M3_MAX, dtype=torch.float32))
    assert heads[0].q_saturated > 0 and heads[1].q_saturated == 0
    assert what.summary.startswith("FP8 e4m3 KV at unit scale via FA3's FP8 path: Q saturates in 1 head of layer")
    assert f"a q_scale of {heads[0].hold_q:.3g} holds it" in what.summary
    assert "nothing saturates" not in what.summary
    err = [f for f in what.findings if f.code == "kv_cache_error"]
    assert err and err[0].fix.startswith(f"a q_scale of {heads[0].hold_q:.3g} holds Q")
    console = Console(file=io.StringIO(), width=80)
    console.print(kv_block(report))
    header = next(line for line in console.file.getvalue().splitlines() if "amax" in line and "cos" in line)
    assert header.split()[-1] == "q"
