"""The watch's per-head statistics against float64 computed here from the same q, k and mask: the
largest logit (certified exact where the Cauchy-Schwarz bound holds, a lower bound otherwise),
entropy and collapse of the sampled rows, max |q| and |k|, broken rows, gradient counts."""

import math

import pytest
import torch

from attncheck.watcher.stats import _sample_rows, grad_counts, scores_stats, sdpa_stats


def full_scores(q, k, scale, causal=False, keep=None):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def entropy_of_rows(s, rows):
    sub = s[:, :, rows]  # (B, H, R, Tk)
    p = torch.softmax(sub, -1)
    keys = torch.isfinite(sub)
    ent = -(torch.where(keys, p * torch.log(p), 0.0)).sum(-1)
    valid = keys.sum(-1) >= 2
    return ent, p.amax(-1), valid


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_stats_against_float64(causal):
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 3, 40, 16
    q, k = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    q[:, 1, 7] *= 20  # one query row of head 1 carries the largest logits: certified
    out = torch.randn(b, h, t, d, generator=g)
    out[1, 2, 3, 0] = float("nan")
    st = sdpa_stats(q, k, out, None, None, causal)
    s = full_scores(q, k, 1 / math.sqrt(d), causal)
    true_max = s.amax(dim=(0, 2, 3))
    assert bool(st.exact[1])
    for hh in range(h):
        if bool(st.exact[hh]):
            assert float(st.max_logit[hh]) == pytest.approx(float(true_max[hh]), rel=1e-5)
        else:
            assert float(st.max_logit[hh]) <= float(true_max[hh]) * (1 + 1e-6)
    ent, top, valid = entropy_of_rows(s, _sample_rows(t, "cpu"))
    for hh in range(h):
        v = valid[:, hh]
        # the watch takes S in fp32 (statistics, not the kernel's rounding): its entropy is float64's to ~1e-7
        assert float(st.entropy_min[hh]) == pytest.approx(float(ent[:, hh][v].min()), abs=1e-5)
        assert float(st.entropy_mean[hh]) == pytest.approx(float(ent[:, hh][v].mean()), abs=1e-5)
        assert float(st.collapsed[hh]) == pytest.approx(float((top[:, hh][v] > 0.99).double().mean()), abs=1e-9)
    assert torch.equal(st.q_max, q.abs().amax(dim=(0, 2, 3))) and torch.equal(st.k_max, k.abs().amax(dim=(0, 2, 3)))
    assert int(st.nonfinite_rows) == 1


def test_sdpa_stats_with_a_boolean_mask_gqa_and_a_row_with_no_key():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 24, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g)
    keep = torch.ones(1, 1, 24, 24, dtype=torch.bool).tril()
    keep[0, 0, 10] = False  # a query row with no key
    st = sdpa_stats(q, k, None, keep, 0.5, False)
    s = full_scores(q, k.repeat_interleave(2, dim=1), 0.5, keep=keep)
    true_max = s.amax(dim=(0, 2, 3))
    assert all(float(st.max_logit[h]) <= float(true_max[h]) * (1 + 1e-6) for h in range(4))
    assert torch.equal(st.k_max, k.abs().amax(dim=(0, 2, 3)).repeat_interleave(2))
    assert int(st.nonfinite_rows) == 0 and bool(torch.isfinite(st.entropy_mean).all())


def test_logits_of_1e5_keep_their_entropy():
    """A collapsed head with huge logits (as at a high learning rate): entropy near 0, never negative."""
    q = torch.zeros(1, 1, 32, 8)
    k = torch.zeros(1, 1, 32, 8)
    q[..., 0] = 300.0
    k[0, 0, :, 0] = torch.linspace(-1, 1, 32) * 3
    st = sdpa_stats(q, k, None, None, 1.0, False)
    assert float(st.max_logit[0]) == pytest.approx(900.0) and bool(st.exact[0])
    assert 0.0 <= float(st.entropy_min[0]) < 1e-6 and float(st.collapsed[0]) == 1.0


def test_scores_stats_against_the_scores():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 3, 20, 20, generator=g).half() * 4
    s = s.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), torch.finfo(torch.float16).min)
    s[0, 1, 5] = float("-inf")  # every key -inf: torch.softmax gives NaN
    s[1, 2, 9, 3] = float("nan")
    st = scores_stats(s, None, None)
    s64 = s.double().masked_fill(s.double() <= -1e4, float("-inf"))
    finite = torch.where(torch.isfinite(s64), s64, float("-inf"))
    assert torch.allclose(st.max_logit.double(), finite.amax(dim=(0, 2, 3)))
    assert int(st.nonfinite_rows) == 2 and st.q_max is None


def test_grad_counts():
    g = {
        "grad_q": torch.tensor([[1.0, 0.0], [float("nan"), -3.0]]),
        "grad_k": torch.tensor([0.0, float("inf")]),
        "grad_v": torch.tensor([2.0]),
    }
    c = grad_counts(g)
    assert (int(c.nonfinite), int(c.zeros), c.total, float(c.max_abs)) == (
        2,
        2,
        7,
        2.0,
    )  # dq and dk hold NaN or inf; dv's peak is 2
    c = grad_counts({"grad_q": torch.tensor([0.5, -4.0]).half()})
    assert (int(c.nonfinite), int(c.zeros), float(c.max_abs)) == (0, 0, 4.0)


def test_layers_computed_together_give_each_layers_own_numbers():
    """sdpa_stats_many stacks the calls that share shapes (a model's layers): every number is the one
    the call gets alone; a mask per batch element and a second shape in between included."""
    from attncheck.watcher.stats import grad_counts_many, sdpa_stats_many

    g = torch.Generator().manual_seed(3)
    keep = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    keep[1, 0, :, 12:] = False
    calls = [
        (
            torch.randn(2, 4, 16, 8, generator=g) * (1 + i),
            torch.randn(2, 4, 16, 8, generator=g),
            torch.randn(2, 4, 16, 8, generator=g),
            keep,
            None,
            False,
        )
        for i in range(3)
    ]
    calls.insert(
        1, (torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g), None, None, 0.5, True)
    )
    together = sdpa_stats_many(calls)
    for call, got in zip(calls, together):
        alone = sdpa_stats(*call)
        for name in (
            "max_logit",
            "exact",
            "entropy_min",
            "entropy_mean",
            "collapsed",
            "q_max",
            "k_max",
            "nonfinite_rows",
        ):
            a, b = getattr(alone, name), getattr(got, name)
            assert a.shape == b.shape and torch.allclose(
                a.double(), b.double(), rtol=1e-6, atol=1e-6, equal_nan=True
            ), name
    grads = [
        {"grad_q": torch.randn(3, 4, generator=g), "grad_k": torch.zeros(3, 4), "grad_v": torch.randn(5, generator=g)}
        for _ in range(3)
    ]
    grads[1]["grad_q"][0, 0] = float("nan")
    for c, got in zip(grads, grad_counts_many(grads)):
        ts = list(c.values())
        broken = [t for t in ts if not bool(torch.isfinite(t).all())]
        peak = max(float(t.abs().max()) for t in ts if bool(torch.isfinite(t).all()))
        assert (int(got.nonfinite), int(got.zeros), got.total) == (
            len(broken),
            sum(int((t == 0).sum()) for t in ts),
            sum(t.numel() for t in ts),
        )
        assert float(got.max_abs) == peak


@pytest.mark.parametrize("causal", [False, True])
def test_first_token_share_against_a_float64_softmax(causal):
    """Key 0's probability averaged over the sampled rows that see it, against float64 softmax of the same rows; a
    key 0 built to draw attention gives a large share, and a mask that hides key 0 from a row leaves the row out."""
    g = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 3, 40, 16
    q, k = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    q[:, 0, :, 0] += 3.0
    k[:, 0, 0, 0] = 10.0  # head 0: every query looks at key 0
    st = sdpa_stats(q, k, None, None, None, causal)
    rows = _sample_rows(t, "cpu")
    p = torch.softmax(full_scores(q, k, 1 / math.sqrt(d), causal)[:, :, rows], -1)  # (B, H, R, Tk) float64
    want = p[..., 0].mean(dim=(0, 2))
    assert st.first_share.double() == pytest.approx(want, abs=1e-6)
    assert float(st.first_share[0]) > 0.5 > float(want[1:].max())
    keep = torch.ones(1, 1, t, t, dtype=torch.bool)
    keep[..., 1::2, 0] = False  # odd rows may not see key 0
    st = sdpa_stats(q, k, None, keep, None, False)
    s = full_scores(q, k, 1 / math.sqrt(d), keep=keep)[:, :, rows]
    sees = keep[0, 0, rows, 0]
    want = torch.softmax(s, -1)[:, :, sees, 0].mean(dim=(0, 2))
    assert st.first_share.double() == pytest.approx(want, abs=1e-6)
