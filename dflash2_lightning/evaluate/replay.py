"""The T=0 replay: τ on many prompts at a fraction of the loop's cost, equal to the loop's τ.

The target decodes the prompts greedily in batches; the loop's cycles are then replayed along those
outputs with the teacher-forced forward (:mod:`dflash2_lightning.evaluate.teacher_forced`): same cycle
starts, same per-anchor acceptance, so the same τ as the sequential loop, with a narrow interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash2_lightning.decode.speculative import target_handles
from dflash2_lightning.evaluate.loop import category_rows, check_inputs, health_report
from dflash2_lightning.evaluate.teacher_forced import default_oracle_top_k, target_device, teacher_forced
from dflash2_lightning.intervals import RESAMPLES, replay_summary
from dflash2_lightning.model.draft import DraftModel


def replay_cycles(
    draft: DraftModel,
    target: Any,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    oracle_top_k: int | None = None,
    progress: bool = False,
) -> tuple[dict[str, list[list[int]]], dict[str, Any] | None]:
    """Per path (``selector``/``backbone`` where the draft has them, and ``oracle``): the accepted lengths
    of the loop's cycles replayed along each prompt's greedy ``outputs`` (one list per prompt); and the selector
    health of the selector's replayed cycles (:func:`~dflash2_lightning.evaluate.loop.health_report`; None for a
    DFlash draft)."""
    from tqdm.auto import tqdm

    from dflash2_lightning.train.metrics import SelectorHealth

    k = oracle_top_k or default_oracle_top_k(draft)
    health = SelectorHealth(draft.config.block_size) if draft.candidate_selector is not None else None
    lengths: dict[str, list[list[int]]] = {}
    for prompt, output in tqdm(list(zip(prompts, outputs)), desc="replay", unit="prompt", disable=not progress):
        for path, tf in teacher_forced(draft, target, prompt, output, oracle_top_k=k).items():
            lengths.setdefault(path, []).append(tf.replay())
            if path == "selector" and health is not None:
                tf.cycle_health(health)
    return lengths, health_report(health, draft.config.selector_top_k) if health is not None else None


def greedy_outputs(
    target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[int], batch_size: int = 96
) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (up to and including a stop token), decoded in
    batches of ``batch_size`` prompts of similar length (little padding)."""
    from dflash2_lightning.target.generate import generate

    hf = target_handles(target).hf
    pad = getattr(getattr(target, "tokenizer", None), "pad_token_id", None)
    pad = pad if pad is not None else (stop[0] if stop else 0)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, len(order), batch_size):
        rows = order[lo : lo + batch_size]
        for i, out in zip(rows, generate(hf, [prompts[i] for i in rows], max_new_tokens, list(stop), pad)):
            outputs[i] = out
    return outputs


@dataclass
class ReplayRun:
    """The raw T=0 replay: the prompts, the target's greedy outputs and, per path, each prompt's replayed
    cycle lengths (what :func:`replay_eval` summarises and an acceptance record keeps)."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    lengths: dict[str, list[list[int]]]
    stop_token_ids: list[int]
    max_new_tokens: int
    oracle_top_k: int
    seconds: dict[str, float]
    selector_health: dict[str, Any] | None = None  # the selector path's, over the replayed cycles


def run_replay(
    draft: DraftModel,
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    batch_size: int = 96,
    oracle_top_k: int | None = None,
    progress: bool = True,
) -> ReplayRun:
    """Decode ``prompts`` greedily with the target (batches of ``batch_size``) and replay the loop's cycles
    along the outputs (see :func:`replay_eval`); returns the raw :class:`ReplayRun`."""
    import time

    from dflash2_lightning.errors import ConfigError

    check_inputs(prompts, max_new_tokens, oracle_top_k, "replay")
    if batch_size < 1:
        raise ConfigError(f"replay batch_size={batch_size} is invalid: must be >= 1")
    draft = draft.to(target_device(target)).eval()
    stop = list(stop_token_ids if stop_token_ids is not None else getattr(target, "eos_token_ids", []))
    start = time.perf_counter()
    outputs = greedy_outputs(target, prompts, max_new_tokens, stop, batch_size)
    generated = time.perf_counter() - start
    k = oracle_top_k or default_oracle_top_k(draft)
    lengths, health = replay_cycles(draft, target, prompts, outputs, k, progress)
    return ReplayRun(
        [list(p) for p in prompts],
        outputs,
        lengths,
        stop,
        max_new_tokens,
        k,
        {"generate": generated, "replay": time.perf_counter() - start - generated},
        health,
    )


def replay_report(
    run: ReplayRun,
    block_size: int,
    resamples: int = RESAMPLES,
    seed: int = 0,
    categories: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``replay`` section of an eval report from a :class:`ReplayRun` (see :func:`replay_eval`); with
    ``categories`` (one name per replayed prompt) also ``categories``: per category its prompts and each path's
    τ summary over them."""
    from dflash2_lightning.errors import ConfigError

    if categories is not None and len(categories) != len(run.prompts):
        raise ConfigError(f"categories has {len(categories)} names for {len(run.prompts)} replayed prompts")
    stop = run.stop_token_ids
    report: dict[str, Any] = {
        "temperature": 0.0,
        "prompts": len(run.prompts),
        "max_new_tokens": run.max_new_tokens,
        "generated_tokens": sum(len(o) for o in run.outputs),
        "stopped_at_eos": sum(bool(o) and o[-1] in stop for o in run.outputs),
        "seconds": dict(run.seconds),
        "paths": {x: replay_summary(v, block_size, resamples, seed) for x, v in run.lengths.items() if x != "oracle"},
        "oracle": {"top_k": run.oracle_top_k, **replay_summary(run.lengths["oracle"], block_size, resamples, seed)},
        "method": "teacher-forced replay of the loop's cycles along the target's greedy outputs "
        "(equals the measured tau at T=0)",
    }
    if run.selector_health is not None and "selector" in report["paths"]:
        report["paths"]["selector"]["selector_health"] = run.selector_health
    if categories is not None:
        report["categories"] = {
            name: {
                "prompts": len(rows),
                "paths": {
                    x: replay_summary([v[i] for i in rows], block_size, resamples, seed)
                    for x, v in run.lengths.items()
                    if x != "oracle"
                },
            }
            for name, rows in category_rows(categories).items()
        }
    return report


def replay_block_sizes(
    draft: DraftModel,
    target: Any,
    run: ReplayRun,
    block_sizes: Sequence[int],
    resamples: int = RESAMPLES,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """The replay's part of an eval report's ``served_block_sizes``: the loop's cycles at each served block size
    (:func:`~dflash2_lightning.evaluate.loop.evaluate_block_sizes`) replayed along ``run``'s greedy outputs (the
    target decodes once; the draft at each size, :meth:`~dflash2_lightning.model.draft.DraftModel.at_block_size`,
    replays them). Per size, each path's τ summary with its interval and the top-k oracle's."""
    from dflash2_lightning.evaluate.loop import check_block_sizes

    sizes = check_block_sizes(block_sizes, draft.config)
    per_size: dict[str, Any] = {}
    for b in sizes:
        lengths = (
            run.lengths
            if b == draft.config.block_size  # the trained size: the run has replayed it already
            else replay_cycles(draft.at_block_size(b), target, run.prompts, run.outputs, run.oracle_top_k, progress)[0]
        )
        per_size[str(b)] = {
            "paths": {x: replay_summary(v, b, resamples, seed) for x, v in lengths.items() if x != "oracle"},
            "oracle": {"top_k": run.oracle_top_k, **replay_summary(lengths["oracle"], b, resamples, seed)},
        }
    return {
        "temperature": 0.0,
        "prompts": len(run.prompts),
        "generated_tokens": sum(len(o) for o in run.outputs),
        "sizes": per_size,
    }


def replay_eval(
    draft: DraftModel,
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    batch_size: int = 96,
    resamples: int = RESAMPLES,
    seed: int = 0,
    oracle_top_k: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """τ at T=0 on many more prompts than the loop can afford: the loop's cycles replayed, teacher-forced.

    The target decodes every prompt greedily in batches of ``batch_size``
    (:func:`~dflash2_lightning.target.generate.generate`, many times the throughput of one stream on a CPU;
    measured in docs/measuring-tau.md), then :func:`teacher_forced` replays the loop along each output:
    at T=0 the replay is the loop's τ exactly (same cycle starts, same per-anchor acceptance; tested,
    and every report checks it on the loop's own prompts: ``estimated.replayed_tau``), at a
    fraction of its cost, so the interval can be narrow. No timings: the loop's figures give the speed.
    """
    check_inputs(prompts, max_new_tokens, oracle_top_k, "replay", resamples)  # before the decoding, not after
    run = run_replay(draft, target, prompts, max_new_tokens, stop_token_ids, batch_size, oracle_top_k, progress)
    return replay_report(run, draft.config.block_size, resamples, seed)
