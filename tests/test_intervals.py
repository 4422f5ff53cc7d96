"""Bootstrap intervals over prompts: they cover the pooled estimate, shrink with more prompts, are seeded."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_lightning.intervals import (
    bootstrap_intervals,
    paired_ratio_interval,
    paired_tau_ratio_interval,
)


def _prompts(n: int, seed: int) -> tuple[list[list[int]], list[float], list[float]]:
    """``n`` prompts whose cycles accept 0..3 drafts, each prompt with its own difficulty."""
    rng = np.random.default_rng(seed)
    hists = [list(rng.multinomial(20, rng.dirichlet([2.0, 1.0, 1.0, 1.0]))) for _ in range(n)]
    tokens = [float(sum((a + 1) * h for a, h in enumerate(hist))) for hist in hists]
    return hists, tokens, [t / 50.0 for t in tokens]


def _pooled_tau(hists: list[list[int]]) -> float:
    pooled = np.sum(hists, axis=0)
    return float((np.arange(len(pooled)) + 1) @ pooled / pooled.sum())


def test_interval_covers_the_pooled_estimate_and_shrinks_with_prompts() -> None:
    widths = []
    for n in (10, 160):
        hists, tokens, seconds = _prompts(n, seed=n)
        iv = bootstrap_intervals(hists, tokens, seconds, tokens, [s * 2 for s in seconds], resamples=2000)
        lo, hi = iv["tau"]
        assert lo < _pooled_tau(hists) < hi
        assert iv["tokens_per_second"] == pytest.approx([50.0, 50.0])  # every prompt runs at 50 tok/s
        assert iv["speedup"] == pytest.approx([2.0, 2.0])
        assert len(iv["accept"]) == 3 and all(a <= b for a, b in iv["accept"])
        # accept_k is non-increasing in k, and so are its bounds
        assert iv["accept"][0][1] >= iv["accept"][1][1] >= iv["accept"][2][1]
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2.5  # ~1/sqrt(n): 16x the prompts, ~4x narrower


def test_interval_is_seeded_and_degenerate_for_identical_prompts() -> None:
    hists, tokens, seconds = _prompts(12, seed=0)
    a = bootstrap_intervals(hists, tokens, seconds, seed=5)
    assert a == bootstrap_intervals(hists, tokens, seconds, seed=5)
    assert a["tau"] != bootstrap_intervals(hists, tokens, seconds, seed=6)["tau"]
    assert a["speedup"] is None
    same = bootstrap_intervals([[2, 1, 1]] * 5, [9.0] * 5, [1.0] * 5)
    assert same["tau"] == pytest.approx([1.75, 1.75])


def test_interval_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="resamples=0"):
        bootstrap_intervals([[1, 0]], [1.0], [1.0], resamples=0)
    with pytest.raises(ValueError, match="level=1"):
        bootstrap_intervals([[1, 0]], [1.0], [1.0], level=1)
    with pytest.raises(ValueError, match="histograms is empty"):
        bootstrap_intervals([], [], [])


def test_paired_ratio_interval():
    base = [3, 10, 1, 7, 5, 2]
    same = paired_ratio_interval(base, base)
    assert same["ratio"] == 1.0 and same["interval"] == [1.0, 1.0]  # pairing: every resample gives exactly 1
    assert same["prompts_better"] == same["prompts_worse"] == 0
    doubled = paired_ratio_interval([2 * x for x in base], base)
    assert doubled["ratio"] == 2.0 and doubled["interval"] == [2.0, 2.0] and doubled["prompts_better"] == 6
    mixed = paired_ratio_interval([4, 9, 3, 7, 8, 2], base)
    lo, hi = mixed["interval"]
    assert lo < mixed["ratio"] < hi and mixed["prompts_better"] == 3 and mixed["prompts_worse"] == 1
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_ratio_interval([1, 2], [1])


def test_paired_tau_ratio_interval():
    accepted, cycles = [3, 10, 1, 7, 5, 2], [10, 12, 9, 11, 10, 8]
    same = paired_tau_ratio_interval(accepted, cycles, accepted, cycles)
    assert same["ratio"] == 1.0 and same["interval"] == [1.0, 1.0]  # pairing: every resample gives exactly 1
    more = [a + 2 for a in accepted]  # two more accepted drafts on every prompt, same cycles
    r = paired_tau_ratio_interval(more, cycles, accepted, cycles)
    assert r["ratio"] == pytest.approx((1 + sum(more) / sum(cycles)) / (1 + sum(accepted) / sum(cycles)))
    lo, hi = r["interval"]
    assert 1.0 < lo <= r["ratio"] <= hi  # better on every prompt: the whole interval lies above 1
    # tau counts the constant 1: a 1.22x ratio of accepted drafts is a much smaller tau ratio
    assert r["ratio"] < paired_ratio_interval(more, accepted)["ratio"]
    with pytest.raises(ValueError, match="four equal, non-empty"):
        paired_tau_ratio_interval([1, 2], [3, 4], [1], [3])
    assert bootstrap_intervals([[2, 1, 0, 1]], resamples=5)["tokens_per_second"] is None  # no timings given


def test_paired_speed_ratio_interval():
    """tokens/s of two settings timed on the same prompts: the pooled ratio, resampling the prompts together."""
    from dflash2_lightning.intervals import paired_speed_ratio_interval

    tokens, seconds = [30, 40, 25, 50, 35], [1.0, 1.5, 0.8, 2.0, 1.1]
    same = paired_speed_ratio_interval(tokens, seconds, tokens, seconds)
    assert same["ratio"] == 1.0 and same["interval"] == pytest.approx([1.0, 1.0])
    faster = [s / 1.25 for s in seconds]  # the same tokens in 80% of the time on every prompt
    r = paired_speed_ratio_interval(tokens, faster, tokens, seconds, resamples=500)
    assert r["ratio"] == pytest.approx(1.25) and r["interval"] == pytest.approx([1.25, 1.25])
    mixed = paired_speed_ratio_interval(tokens, [0.9, 1.6, 0.5, 1.7, 1.2], tokens, seconds, resamples=500)
    assert mixed["ratio"] == pytest.approx((sum(tokens) / 5.9) / (sum(tokens) / sum(seconds)))
    assert mixed["interval"][0] < mixed["ratio"] < mixed["interval"][1]
    with pytest.raises(ValueError, match="four equal, non-empty"):
        paired_speed_ratio_interval([1, 2], [3, 4], [1], [3])
