"""Outlier channels, kurtosis and massive activations on planted values whose ratio, channel and token are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attncheck.findings.activations import MASSIVE_ABS, MASSIVE_RATIO, massive
from attncheck.judge import diagnose_call
from attncheck.numerics.outliers import call_activations, channel_peaks, kurtosis, largest_activations, median
from attncheck.options import Options
from attncheck.results import CallInfo

G = torch.Generator().manual_seed(0)


def pearson_kurtosis(values) -> float:
    """E[(x - mean)^4] / E[(x - mean)^2]^2 over the values, by the definition (scipy.stats.kurtosis with
    fisher=False, bias=True), summed exactly with math.fsum so that it shares nothing with the code's moments."""
    v = [float(x) for x in np.asarray(values, dtype=np.float64).ravel()]
    mean = math.fsum(v) / len(v)
    d2 = math.fsum((x - mean) ** 2 for x in v) / len(v)
    d4 = math.fsum((x - mean) ** 4 for x in v) / len(v)
    return d4 / d2**2


def test_planted_channel_has_its_ratio_channel_and_token():
    x = torch.rand(2, 3, 10, 8, generator=G, dtype=torch.float64) * 0.5 + 0.5  # |x| in [0.5, 1)
    x[1, 2, 7, 5] = -40.0  # head 2, channel 5, batch 1, token 7
    peaks = channel_peaks(x)
    a = np.abs(x.numpy())
    maxima = a.max(axis=(0, 2))  # (H, d)
    p = peaks[2]
    assert (p.channel, p.batch, p.token) == (5, 1, 7)
    assert p.value == 40.0
    assert p.median == pytest.approx(float(np.median(maxima[2])), rel=1e-15)
    assert p.ratio == pytest.approx(40.0 / np.median(maxima[2]), rel=1e-15)
    for h in (0, 1):  # no plant: the largest channel is at most 2x the median (values within [0.5, 1))
        assert peaks[h].ratio < 2.0 and peaks[h].channel == int(maxima[h].argmax())


def test_kurtosis_against_its_definition():
    x = torch.randn(2, 3, 50, 16, generator=G, dtype=torch.float64)
    x[0, 1, 3, 2] = 25.0  # heavy tail in head 1
    want = [pearson_kurtosis(x[:, h].numpy()) for h in range(3)]
    assert kurtosis(x) == pytest.approx(want, rel=1e-12)
    assert kurtosis(x)[1] > 10 > kurtosis(x)[0]
    assert kurtosis(torch.ones(1, 1, 4, 4)) == [None]  # constant: no variance


def test_massive_activation_criterion():
    """arXiv 2402.17762: |x| > 100 and about 1000x the median magnitude of the tensor."""
    x = torch.randn(1, 4, 32, 16, generator=G, dtype=torch.float64)
    x[0, 3, 0, 9] = 3000.0
    x[0, 1, 5, 2] = 90.0  # large, but under 100: not massive
    top = largest_activations(x, "v")
    assert (top[0].head, top[0].token, top[0].channel, top[0].value) == (3, 0, 9, 3000.0)
    want_median = float(np.median(np.abs(x.numpy())))
    assert top[0].median == pytest.approx(want_median, rel=1e-15)
    assert median(torch.tensor([4.0, 1.0, 3.0, 2.0])) == 2.5  # numpy's median of an even count
    from attncheck.results import CallReport

    acts = call_activations(x, x, None)
    report = CallReport(CallInfo(0, "c", "qk"), None, activations=acts)
    found = massive(report)
    assert {(a.tensor, a.token, a.channel) for a in found} == {("q", 0, 9), ("k", 0, 9)}
    assert all(a.value > MASSIVE_ABS and a.ratio >= MASSIVE_RATIO for a in found)


def test_gqa_kv_head_peaks_and_call_findings():
    """k and v have 2 kv heads read by 4 query heads; an outlier channel planted in kv head 1's k is named once."""
    q = torch.randn(1, 4, 16, 8, generator=G)
    k = torch.randn(1, 2, 16, 8, generator=G)
    v = torch.randn(1, 2, 16, 8, generator=G)
    k[0, 1, 4, 6] = 60.0
    report = diagnose_call(CallInfo(0, "c", "sdpa", enable_gqa=True, dtype="fp32"), {"q": q, "k": k, "v": v}, Options())
    acts = [h.activations for h in report.heads]
    assert [a.k.channel for a in acts[2:]] == [6, 6] and acts[2].k.token == 4
    want = 60.0 / np.median(np.abs(k[0, 1].numpy()).max(axis=0))
    assert acts[3].k.ratio == pytest.approx(want, rel=1e-6)
    found = [f for f in report.diagnosis.findings if f.code == "outlier_channel"]
    assert len(found) == 1 and found[0].message.startswith("1 outlier channel(s): kv head 1 k channel 6")


def test_non_finite_entries_are_left_out():
    """A NaN and an inf in a head: its kurtosis, channel peaks and the tensor's median are those of the finite
    entries (numpy's nan-aware formulas on the same values)."""
    x = torch.randn(1, 2, 20, 4, generator=G, dtype=torch.float64)
    x[0, 0, 3, 1] = float("nan")
    x[0, 0, 5, 2] = float("inf")
    finite = x[:, 0].numpy().ravel()
    finite = finite[np.isfinite(finite)]
    assert kurtosis(x)[0] == pytest.approx(pearson_kurtosis(finite), rel=1e-12)
    a = np.abs(x.numpy())
    peak = channel_peaks(x)[0]
    maxima = np.where(np.isfinite(a), a, 0).max(axis=(0, 2))[0]
    assert peak.value == maxima.max() and peak.median == pytest.approx(float(np.median(maxima)), rel=1e-15)
    top = largest_activations(x, "k")
    assert top[0].median == pytest.approx(float(np.median(a[np.isfinite(a)])), rel=1e-15)
