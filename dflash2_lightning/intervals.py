"""Bootstrap intervals over prompts for the measured acceptance (τ, ``accept_k``) and speed, and the τ summary of
replayed cycles (:func:`replay_summary`).

Statistics every τ the project reports uses (``dflash2 eval``'s report, the acceptance record, ``dflash2
check-serving``'s expected interval), beside the stages, so each of them reads it.

The unit of resampling is the *prompt*: cycles of one prompt (and the several samples drawn for it at
a temperature) are correlated, prompts are not. One resample draws ``n`` prompts with replacement
from the ``n`` evaluated ones and recomputes every figure exactly as the point estimate pools it
(τ = mean accepted + 1 over the untruncated cycles of the drawn prompts, tokens/s = their tokens over
their seconds, the speed-up against the target-only runs of the same prompts). The interval is the
percentile interval of ``resamples`` such draws from a fixed seed, so a report is reproducible. With
a handful of prompts the interval is itself uncertain (and it is ``[x, x]`` for a single prompt): it
describes how much τ moves between prompt sets of that size, not a guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def resample_weights(n: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, n]``: how often each of ``n`` prompts is drawn in each resample (with replacement)."""
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    weights = np.zeros((resamples, n))
    np.add.at(weights, (np.arange(resamples)[:, None], picks), 1.0)
    return weights


def percentile_bounds(x: np.ndarray, level: float = LEVEL) -> list[float | None]:
    """The central ``level`` percentile interval of the finite values of ``x`` (``[None, None]`` if none)."""
    x = x[np.isfinite(x)]
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    return [float(np.percentile(x, lo)), float(np.percentile(x, hi))] if x.size else [None, None]


def bootstrap_intervals(
    histograms: Sequence[Sequence[int] | np.ndarray],
    tokens: Sequence[float] | None = None,
    seconds: Sequence[float] | None = None,
    base_tokens: Sequence[float] | None = None,
    base_seconds: Sequence[float] | None = None,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> dict[str, Any]:
    """Percentile intervals of τ, ``accept_k``, tokens/s and speed-up, resampling prompts.

    Args:
        histograms: per prompt, ``histogram[a]`` = its untruncated cycles that accepted ``a`` drafts.
        tokens, seconds: per prompt, tokens generated and seconds taken by speculative decoding (``None``:
            no timings, e.g. a teacher-forced replay; then the tokens/s and speed-up bounds are ``None``).
        base_tokens, base_seconds: per prompt, the target-only run (for the speed-up interval).
        resamples: bootstrap draws; level: central coverage of the interval; seed: the draws' seed.

    Returns ``{"tau": [lo, hi], "accept": [[lo, hi] per offset], "tokens_per_second": [lo, hi] or None,
    "speedup": [lo, hi] or None, "level", "resamples", "seed", "unit": "prompt"}``; a bound is None
    where no resample had a full cycle.
    """
    from dflash2_lightning.errors import check

    check(resamples >= 1, "resamples", resamples, ">= 1")
    check(0 < level < 1, "level", level, "in (0, 1)")
    hist = np.asarray(histograms, dtype=np.float64)
    n = hist.shape[0]
    if n == 0:
        raise ValueError("histograms is empty: need at least one prompt")
    weights = resample_weights(n, resamples, seed)

    pooled = weights @ hist  # [R, bs]
    full = pooled.sum(1, keepdims=True)
    tail = np.cumsum(pooled[:, ::-1], axis=1)[:, ::-1]  # tail[:, k] = cycles that accepted >= k
    with np.errstate(invalid="ignore", divide="ignore"):
        accept = np.where(full > 0, tail[:, 1:] / full, np.nan)  # [R, bs-1]
        tau = 1.0 + accept.sum(1)
        timed = tokens is not None and seconds is not None
        tps = (
            (weights @ np.asarray(tokens, dtype=np.float64)) / (weights @ np.asarray(seconds, dtype=np.float64))
            if timed
            else None
        )
        speedup = None
        if timed and base_tokens is not None and base_seconds is not None:
            base = (weights @ np.asarray(base_tokens, dtype=np.float64)) / (
                weights @ np.asarray(base_seconds, dtype=np.float64)
            )
            speedup = tps / base

    def bounds(x: np.ndarray) -> list[float | None]:
        return percentile_bounds(x, level)

    return {
        "tau": bounds(tau),
        "accept": [bounds(accept[:, k]) for k in range(accept.shape[1])],
        "tokens_per_second": bounds(tps) if tps is not None else None,
        "speedup": bounds(speedup) if speedup is not None else None,
        "level": level,
        "resamples": resamples,
        "seed": seed,
        "unit": "prompt",
    }


def paired_ratio_interval(
    ours: Sequence[float], base: Sequence[float], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> dict[str, Any]:
    """``sum(ours) / sum(base)`` over prompts with its percentile interval, prompts resampled *together*.

    For two drafts measured on the same prompts (e.g. accepted drafted tokens per prompt): pairing
    removes the prompts' own difficulty from the interval. Returns ``{"ratio", "interval": [lo, hi],
    "prompts_better", "prompts_worse", "level", "resamples", "seed", "unit": "prompt"}``.
    """
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(
            f"paired_ratio_interval needs two equal, non-empty per-prompt lists (got {a.size} and {b.size})"
        )
    weights = resample_weights(a.size, resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = (weights @ a) / (weights @ b)
    return {
        "ratio": float(a.sum() / b.sum()) if b.sum() else None,
        "interval": percentile_bounds(ratios, level),
        "prompts_better": int((a > b).sum()),
        "prompts_worse": int((a < b).sum()),
        "level": level,
        "resamples": resamples,
        "seed": seed,
        "unit": "prompt",
    }


def paired_speed_ratio_interval(
    tokens: Sequence[float],
    seconds: Sequence[float],
    base_tokens: Sequence[float],
    base_seconds: Sequence[float],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> dict[str, Any]:
    """``tokens/s(ours) / tokens/s(base)`` (each pooled over prompts: their tokens over their seconds) and its
    percentile interval, prompts resampled *together* (two settings timed on the same prompts).

    Returns ``{"ratio", "interval": [lo, hi], "level", "resamples", "seed", "unit": "prompt"}``.
    """
    t, s, bt, bs = _four_lists("paired_speed_ratio_interval", tokens, seconds, base_tokens, base_seconds)
    weights = resample_weights(t.size, resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = ((weights @ t) / (weights @ s)) / ((weights @ bt) / (weights @ bs))
    ratio = (t.sum() / s.sum()) / (bt.sum() / bs.sum()) if s.sum() and bs.sum() and bt.sum() else None
    return _ratio_result(ratio, ratios, level, resamples, seed)


def _four_lists(name: str, *lists: Sequence[float]) -> list[np.ndarray]:
    """Four per-prompt lists as float arrays; a ValueError unless they are equal in length and not empty."""
    arrays = [np.asarray(x, dtype=np.float64) for x in lists]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1 or arrays[0].size == 0:
        raise ValueError(f"{name} needs four equal, non-empty per-prompt lists (got {[a.size for a in arrays]})")
    return arrays


def _ratio_result(ratio: float | None, ratios: np.ndarray, level: float, resamples: int, seed: int) -> dict[str, Any]:
    """A paired ratio's report: the point ratio and the percentile interval of its resampled values."""
    return {
        "ratio": float(ratio) if ratio is not None else None,
        "interval": percentile_bounds(ratios, level),
        "level": level,
        "resamples": resamples,
        "seed": seed,
        "unit": "prompt",
    }


def paired_tau_ratio_interval(
    accepted: Sequence[float],
    cycles: Sequence[float],
    base_accepted: Sequence[float],
    base_cycles: Sequence[float],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> dict[str, Any]:
    """``tau(ours) / tau(base)`` with ``tau = 1 + sum(accepted) / sum(cycles)`` over prompts, and its
    percentile interval, prompts resampled *together* (two drafts on the same prompts and outputs).

    Returns ``{"ratio", "interval": [lo, hi], "level", "resamples", "seed", "unit": "prompt"}``.
    """
    a, c, ba, bc = _four_lists("paired_tau_ratio_interval", accepted, cycles, base_accepted, base_cycles)
    weights = resample_weights(a.size, resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = (1.0 + (weights @ a) / (weights @ c)) / (1.0 + (weights @ ba) / (weights @ bc))
    ratio = (1.0 + a.sum() / c.sum()) / (1.0 + ba.sum() / bc.sum()) if c.sum() and bc.sum() else None
    return _ratio_result(ratio, ratios, level, resamples, seed)


def replay_summary(
    lengths: Sequence[Sequence[int]], block_size: int, resamples: int = RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """τ, per-offset acceptance and their 95% bootstrap intervals (prompts resampled) of replayed cycles.

    ``lengths``: per prompt, the accepted drafted tokens of each cycle (``0 .. block_size - 1``).
    """
    hist = [np.bincount(np.asarray(x, dtype=np.int64), minlength=block_size)[:block_size] for x in lengths]
    pooled = np.sum(hist, axis=0)
    cycles = int(pooled.sum())
    accept = [float(pooled[k:].sum() / cycles) if cycles else None for k in range(1, block_size)]
    iv = bootstrap_intervals(hist, resamples=resamples, seed=seed)
    return {
        "tau": 1.0 + sum(a for a in accept if a is not None) if cycles else None,  # with cycles, none is None
        "interval": iv["tau"],
        "accept": accept,
        "accept_interval": iv["accept"],
        "accepted": int(sum(sum(x) for x in lengths)),
        "cycles": cycles,
        "per_prompt_accepted": [int(sum(x)) for x in lengths],
        "per_prompt_cycles": [len(x) for x in lengths],
    }
