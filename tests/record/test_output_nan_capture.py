"""A NaN planted in a v_proj output of a captured Llama (sdpa) reaches the attention output: the call's report has
output_nan naming the V entry, its rows counted against torch's own SDPA output (o_proj's input) and float64
attention; the same model without the NaN stays clean."""

import torch

import attncheck

from .conftest import VOCAB, llama_gqa

TOKEN, CHANNEL = 40, 5  # channel 5 of v_proj's output: kv head 0 (head_dim 8), dim 5


def run_model(plant: bool):
    model = llama_gqa()
    seen = {}

    def hook(mod, inp, out):
        out = out.clone()
        out[0, TOKEN, CHANNEL] = float("nan")
        return out

    if plant:
        model.model.layers[1].self_attn.v_proj.register_forward_hook(hook)
    # torch's attention output of that layer, as o_proj reads it: (1, tokens, heads x head_dim)
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.setdefault("o", i[0]))
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    with attncheck.capture(diagnose=True) as cap, torch.no_grad():
        model(ids)
    return cap, seen


def test_a_nan_in_v_proj_is_named_by_the_capture_report():
    cap, seen = run_model(True)
    first, second = cap.calls
    assert not [f for f in first.diagnosis.findings if f.code == "output_nan"]
    (f,) = [f for f in second.diagnosis.findings if f.code == "output_nan"]
    assert f.severity == "error" and f"(0, 0, {TOKEN}, {CHANNEL})" in f.message
    # torch's own SDPA output: rows (query, head) holding NaN
    real = int((~torch.isfinite(seen["o"].reshape(48, 4, 8)).all(dim=-1)).sum())
    # float64 causal attention with the NaN at (kv head 0, key 40): its NaN rows depend on V and the mask alone
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 48, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    v[0, 0, TOKEN, CHANNEL] = float("nan")
    s = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    s = s.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v.repeat_interleave(2, dim=1)
    want = int((~torch.isfinite(o).all(dim=-1)).sum())
    assert want == real == 96  # both query heads of kv head 0, every query (0 x NaN is NaN where a row masks the key)
    (cell,) = [c for c in second.diagnosis.cells if c.role == "model"]
    assert cell.out_nan_causes == {"v_nonfinite": want} and f.rows == want
    assert second.diagnosis.attention.v_nonfinite == 1
    assert cap.result.model.lines[1].verdict == "error"


def test_the_healthy_model_has_no_output_nan():
    cap, _ = run_model(False)
    assert all(f.severity == "info" for r in cap.calls for f in r.diagnosis.findings)
    assert all(c.out_nan_rows == 0 for r in cap.calls for c in r.diagnosis.cells if c.out_nan_rows is not None)
