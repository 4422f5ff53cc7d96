"""τ measured by real speculative decoding, per decoding path and temperature, beside the trainer's estimate.

For every prompt of a held-out prompts file (chat jsonl) the target decodes greedily on its own (the
reference output and the tokens/s baseline), then speculatively with the draft, once per decoding path
(DFlash2's selector walk and the backbone argmax). Every speculative output is checked token for token
against the reference. The report gives, per path, the measured acceptance length τ, the per-position
acceptance, the histogram of accepted lengths and the speed-up, and beside it two teacher-forced figures
computed from the draft's *training* forward on the target's own continuations
(:mod:`dflash2_lightning.evaluate.teacher_forced`).

Temperatures (``--temperature 0 0.7 1``): every one is measured in turn and reported under
``temperatures`` (the top-level ``paths``/``tau`` are the first one's). At ``T > 0`` the target alone
and the loop sample (``--top-p``/``--top-k``, ``--samples`` generations per prompt, each seeded from
``--seed``); the estimate beside the measurement is then the trainer's expected acceptance under
sampling (:class:`~dflash2_lightning.train.metrics.SampledAcceptance`) on the target's sampled continuation.
Every measured figure carries a 95% bootstrap interval over prompts (:mod:`dflash2_lightning.intervals`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from dflash2_lightning.decode.drafter import DraftPath, Head, TorchDrafter
from dflash2_lightning.decode.speculative import (
    AcceptanceStats,
    GreedyResult,
    SpecResult,
    speculative_generate,
    target_greedy,
    target_handles,
    target_sample,
)
from dflash2_lightning.evaluate.options import MeasureOptions, SamplingOptions
from dflash2_lightning.evaluate.teacher_forced import (
    EstimateStats,
    default_oracle_top_k,
    target_device,
    teacher_forced,
    usable_paths,
)
from dflash2_lightning.intervals import bootstrap_intervals
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.model.sampling import Sampling

if TYPE_CHECKING:
    from dflash2_lightning.config import DraftConfig
    from dflash2_lightning.train.metrics import SelectorHealth


@dataclass
class PathRun:
    """Everything measured for one decoding path over the prompts."""

    results: list[SpecResult]
    estimate: EstimateStats | None
    mismatched: list[int]
    by_prompt: list[list[SpecResult]] = field(default_factory=list)  # the bootstrap's unit


def evaluate_draft(
    draft: DraftModel,
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingOptions | None = None,
    measure: MeasureOptions | None = None,
    *,
    estimate: bool = True,
    oracle_top_k: int | None = None,
    draft_head: Head | None = None,
    categories: Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    """Measure ``draft`` against ``target`` on tokenised ``prompts``; the report as a dict (see :func:`~dflash2_lightning.evaluate.command.run_eval`).

    ``sampling`` (default: greedy only): every temperature of ``sampling.temperatures`` is measured (``0`` greedy,
    checked token for token against the target; ``> 0`` sampled with its ``top_p``/``top_k``, ``samples``
    generations per prompt, each seeded from ``seed``, the prompt and the sample; ``seed`` also seeds the
    bootstrap). ``measure`` (default: :class:`~dflash2_lightning.evaluate.options.MeasureOptions`' defaults): the
    ``paths`` measured (those not available to the draft, the selector of a DFlash baseline, are skipped and
    noted), the bootstrap's ``resamples`` and the ``progress`` bar; its replay, threads and drafting-vocabulary
    fields are :func:`~dflash2_lightning.evaluate.command.run_eval`'s. The top-level ``paths``/``tau``/``target_only``
    are those of the first temperature; ``temperatures`` holds every one. Intervals: bootstrap over prompts
    (:mod:`~dflash2_lightning.intervals`).

    ``estimate``: also the trainer's teacher-forced estimate on the target's continuations (and, at T=0, the
    top-k oracle). ``oracle_top_k``: candidates of the T=0 top-k oracle (default: the selector's ``top_k``, or
    :data:`~dflash2_lightning.evaluate.teacher_forced.ORACLE_TOP_K` for a DFlash draft). ``draft_head``: the loop
    drafts through this head instead of the target's (e.g. a :class:`~dflash2_lightning.decode.draft_vocab.DraftVocabHead`;
    the target still verifies with its own); the teacher-forced estimates keep the target's head. ``categories``:
    one name per prompt (e.g. a named set's, :mod:`~dflash2_lightning.data.prompts.standard`); each temperature's
    block then gains ``categories``, per category its prompts and per path the same measured figures and intervals
    over its prompts. ``stop_token_ids`` default to the target's eos ids; ``warmup``: run a few tokens of every run
    kind first, untimed.
    """
    from dflash2_lightning.errors import ConfigError

    sampling = sampling if sampling is not None else SamplingOptions()
    measure = measure if measure is not None else MeasureOptions()
    check_inputs(prompts, max_new_tokens, oracle_top_k, "evaluate", measure.resamples)
    if categories is not None and len(categories) != len(prompts):
        raise ConfigError(f"categories has {len(categories)} names for {len(prompts)} prompts: give one per prompt")
    settings = sampling.settings()
    if hasattr(target, "check_fits"):
        target.check_fits(draft.config, "the draft")
    device = target_device(target)
    draft = draft.to(device).eval()
    stop = list(stop_token_ids if stop_token_ids is not None else getattr(target, "eos_token_ids", []))
    usable = usable_paths(measure.paths, draft)
    notes = [
        f"path {x!r} skipped: a DFlash baseline draft has no candidate selector"
        for x in measure.paths
        if x not in usable
    ]
    drafters = {x: TorchDrafter(draft, x, head=draft_head) for x in usable}
    if warmup:
        _warm_up(target, drafters.values(), prompts[0], max_new_tokens, stop, settings, sampling.seed)
    if any(not st.greedy for st in settings):
        notes.append(SAMPLED_NOTE)

    oracle_k = oracle_top_k if oracle_top_k is not None else default_oracle_top_k(draft)
    blocks = {}
    for ti, st in enumerate(settings):
        gen = Generations(target, max_new_tokens, stop, st, ti, sampling.seed, sampling.samples_at(st))
        blocks[_temperature_key(st.temperature)] = _evaluate_at(
            draft, drafters, prompts, gen, measure, estimate, oracle_k, categories
        )
    first = next(iter(blocks.values()))
    report: dict[str, Any] = {
        "architecture": draft.config.architecture,
        "block_size": draft.config.block_size,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "generated_tokens": first["target_only"]["tokens"],
        "stopped_at_eos": first["stopped_at_eos"],
        "target_only": first["target_only"],
        "machine": {
            "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "target_dtype": str(next(target_handles(target).hf.parameters()).dtype).replace("torch.", ""),
            "draft_dtype": str(next(draft.parameters()).dtype).replace("torch.", ""),
        },
        "sampling": {
            "temperatures": [st.temperature for st in settings],
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed,
            "samples_per_prompt": sampling.samples,
            "bootstrap_resamples": measure.resamples,
        },
        "paths": first["paths"],
        "tau": first["tau"],
        "temperatures": blocks,
        "notes": notes,
    }
    return report


SAMPLED_NOTE = (
    "temperature > 0: outputs are samples, so losslessness is not checked token for token "
    "(lossless: null); the loop's output law is proven equal to the target's in "
    "tests/model/test_sampling.py"
)


def evaluate_block_sizes(
    draft: DraftModel,
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_sizes: Sequence[int],
    sampling: SamplingOptions | None = None,
    measure: MeasureOptions | None = None,
    *,
    draft_head: Head | None = None,
    stop_token_ids: Sequence[int] | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    """τ and tokens/s of ``draft`` served at each of ``block_sizes`` (the loop's part of an eval report's
    ``served_block_sizes``).

    At block ``b`` the draft runs as an engine serving it at ``b`` runs it (:meth:`~dflash2_lightning.model.draft.DraftModel.at_block_size`):
    ``[anchor, MASK x (b-1)]``, ``b - 1`` drafts per cycle, the target verifying ``b`` tokens. Every size is
    measured on every prompt right after the target alone decoded it (sizes and paths interleaved, so a change in
    the machine's load falls on all of them alike), with the settings and seeds :func:`evaluate_draft` takes and
    uses (``sampling``, ``measure``, ``draft_head``, ``stop_token_ids``, ``warmup``), and checked token for token
    at T=0. Per temperature: the target alone, per size and path the measured figures with intervals
    (:func:`measured_figures`), ``lossless``, and ``fastest``: per path the size with the most tokens/s and its
    speed over the runner-up (paired over prompts). The top-level ``fastest`` is the fastest size and path at the
    first temperature, with each engine's flag that serves it (:func:`~dflash2_lightning.engines.rules.served_block_flags`).
    """
    from tqdm.auto import tqdm

    from dflash2_lightning.engines.rules import served_block_flags

    sampling = sampling if sampling is not None else SamplingOptions()
    measure = measure if measure is not None else MeasureOptions()
    check_inputs(prompts, max_new_tokens, None, "evaluate", measure.resamples)
    sizes = check_block_sizes(block_sizes, draft.config)
    settings = sampling.settings()
    if hasattr(target, "check_fits"):
        target.check_fits(draft.config, "the draft")
    draft = draft.to(target_device(target)).eval()
    stop = list(stop_token_ids if stop_token_ids is not None else getattr(target, "eos_token_ids", []))
    usable = usable_paths(measure.paths, draft)
    drafters = {
        b: {x: TorchDrafter(served, x, head=draft_head) for x in usable}
        for b in sizes
        for served in [draft.at_block_size(b)]
    }
    if warmup:
        _warm_up(
            target,
            [d for ds in drafters.values() for d in ds.values()],
            prompts[0],
            max_new_tokens,
            stop,
            settings,
            sampling.seed,
        )
    resamples, seed = measure.resamples, sampling.seed
    blocks: dict[str, Any] = {}
    for ti, st in enumerate(settings):
        gen = Generations(target, max_new_tokens, stop, st, ti, seed, sampling.samples_at(st))
        references: list[list[GreedyResult]] = []
        runs = {(b, x): PathRun([], None, []) for b in sizes for x in usable}
        desc = "block sizes" + ("" if st.greedy else f" T={st.temperature:g}")
        for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt", disable=not measure.progress)):
            references.append([])
            for run in runs.values():
                run.by_prompt.append([])
            for j in range(gen.samples):
                ref = gen.reference(prompt, i, j)
                references[-1].append(ref)
                for (b, x), run in runs.items():
                    r = gen.speculative(drafters[b][x], prompt, i, j, 1 + usable.index(x))
                    run.by_prompt[-1].append(r)
                    if st.greedy and r.tokens != ref.tokens:
                        run.mismatched.append(i)
        per_size: dict[str, Any] = {
            str(b): {
                "paths": {
                    x: {
                        **measured_figures(runs[b, x].by_prompt, references, resamples, seed),
                        "lossless": not runs[b, x].mismatched if st.greedy else None,
                        "mismatched_prompts": runs[b, x].mismatched,
                    }
                    for x in usable
                }
            }
            for b in sizes
        }
        blocks[_temperature_key(st.temperature)] = {
            "temperature": st.temperature,
            "top_p": st.top_p,
            "top_k": st.top_k,
            "samples_per_prompt": gen.samples,
            "target_only": target_only(references),
            "sizes": per_size,
            "fastest": {x: _fastest_size({b: runs[b, x].by_prompt for b in sizes}, resamples, seed) for x in usable},
        }
    first = next(iter(blocks.values()))
    best = max(
        ((x, f) for x, f in first["fastest"].items() if f is not None),
        key=lambda xf: xf[1]["tokens_per_second"],
        default=None,
    )
    return {
        "trained_block_size": draft.config.block_size,
        "block_sizes": sizes,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "method": "the draft served at block b drafts b - 1 tokens per cycle from [anchor, MASK x (b-1)], its "
        "convolution reset at that block's start (what vLLM's num_speculative_tokens = b - 1, SGLang's "
        "--speculative-num-draft-tokens b and llama.cpp's --spec-draft-n-max b - 1 run); every size measured on "
        "every prompt in turn, beside the target alone",
        "temperatures": blocks,
        "fastest": None
        if best is None
        else {
            "temperature": first["temperature"],
            "path": best[0],
            **best[1],
            "serve_with": served_block_flags(best[1]["block_size"]),
        },
        "notes": [SAMPLED_NOTE] if any(not st.greedy for st in settings) else [],
    }


def _fastest_size(by_size: dict[int, list[list[SpecResult]]], resamples: int, seed: int) -> dict[str, Any] | None:
    """The size with the most tokens/s (``by_size``: each size's runs per prompt), its τ, and its speed over the
    runner-up with a paired interval over prompts (None with one size); None when nothing was timed."""
    from dflash2_lightning.intervals import paired_speed_ratio_interval

    stats = {b: AcceptanceStats.from_results([r for rs in runs for r in rs]) for b, runs in by_size.items()}
    timed = {b: s.tokens / s.seconds for b, s in stats.items() if s.seconds > 0}
    if not timed:
        return None
    ranked = sorted(timed, key=lambda b: -timed[b])
    best, runner_up = ranked[0], ranked[1] if len(ranked) > 1 else None

    def per_prompt(b: int) -> tuple[list[int], list[float]]:
        return [sum(len(r.tokens) for r in rs) for rs in by_size[b]], [sum(r.seconds for r in rs) for rs in by_size[b]]

    return {
        "block_size": best,
        "tokens_per_second": timed[best],
        "tau": stats[best].tau,
        "runner_up": None
        if runner_up is None
        else {
            "block_size": runner_up,
            "tokens_per_second": timed[runner_up],
            "speed_ratio": paired_speed_ratio_interval(
                *per_prompt(best), *per_prompt(runner_up), resamples=resamples, seed=seed
            ),
        },
    }


def check_block_sizes(block_sizes: Sequence[int], config: DraftConfig) -> list[int]:
    """The served block sizes to measure, ascending; a :class:`~dflash2_lightning.errors.ConfigError` unless each
    is one the draft can be served at (:func:`~dflash2_lightning.engines.rules.served_block_sizes`), without repeats."""
    from dflash2_lightning.engines.rules import served_block_sizes
    from dflash2_lightning.errors import ConfigError

    sizes = [int(b) for b in block_sizes]
    if not sizes or len(set(sizes)) != len(sizes):
        raise ConfigError(f"served_block_sizes={sizes} is invalid: give at least one size, without repeats")
    allowed = served_block_sizes(config)
    wrong = [b for b in sizes if b not in allowed]
    if wrong:
        floor = (
            f"conv_kernel_size={config.conv_kernel_size} (the convolution's taps)"
            if allowed[0] > 2
            else "2 (the anchor and one draft)"
        )
        raise ConfigError(
            f"served_block_sizes={sizes} is invalid: {wrong} outside {allowed[0]}..{allowed[-1]}; each must be at least "
            f"{floor} and at most the trained block_size={config.block_size}"
        )
    return sorted(sizes)


def _warm_up(
    target: Any,
    drafters: Iterable[TorchDrafter],
    prompt: Sequence[int],
    max_new_tokens: int,
    stop: list[int],
    settings: Sequence[Sampling],
    seed: int,
) -> None:
    """A few tokens of every run kind: first calls pay for allocation and lazy init; keep them out of the timings."""
    n = min(4, max_new_tokens)
    target_greedy(target, prompt, n, stop)
    for drafter in drafters:
        speculative_generate(target, drafter, prompt, n, stop)
        if any(not st.greedy for st in settings):
            speculative_generate(target, drafter, prompt, n, stop, temperature=1.0, seed=seed)


def check_inputs(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, oracle_top_k: int | None, verb: str, resamples: int = 1
) -> None:
    """The checks every evaluation (the loop's, the replay's) makes before any work."""
    from dflash2_lightning.errors import ConfigError

    if resamples < 1:  # the intervals come last: a bad value must not cost the whole decoding loop first
        raise ConfigError(f"resamples={resamples} is invalid: must be >= 1 (bootstrap draws of the intervals)")
    if not prompts:
        raise ConfigError(f"prompts is empty: need at least one prompt to {verb}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    if oracle_top_k is not None and oracle_top_k < 1:
        raise ConfigError(f"oracle_top_k={oracle_top_k} is invalid: must be >= 1 (candidates per position)")


def _temperature_key(t: float) -> str:
    return f"{t:g}"


def _run_seed(seed: int, *parts: int) -> int:
    """A seed for one generation, fixed by the run's seed and (temperature, prompt, sample, stream)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0])


@dataclass(frozen=True)
class Generations:
    """The generations of one measured sampling setting: the target alone on a prompt (the reference and the
    tokens/s baseline) and the speculative loop, each seeded from the run's ``seed``, the setting's ``index``, the
    prompt, the sample and the stream (0 the target alone, ``1 + i`` the ``i``-th path), so a measurement with the
    same settings draws the same tokens."""

    target: Any
    max_new_tokens: int
    stop: list[int]
    setting: Sampling
    index: int
    seed: int
    samples: int  # generations per prompt

    def reference(self, prompt: Sequence[int], i: int, j: int) -> GreedyResult:
        """The target alone on prompt ``i``, its sample ``j``: greedy, or sampled at the setting."""
        if self.setting.greedy:
            return target_greedy(self.target, prompt, self.max_new_tokens, self.stop)
        return target_sample(self.target, prompt, self.max_new_tokens, self.stop, **self._sampled(i, j, 0))

    def speculative(self, drafter: TorchDrafter, prompt: Sequence[int], i: int, j: int, stream: int) -> SpecResult:
        """One speculative generation of prompt ``i``, its sample ``j``, by ``drafter`` (seed stream ``stream``),
        without its draft cache."""
        sampled = {} if self.setting.greedy else self._sampled(i, j, stream)
        result = speculative_generate(self.target, drafter, prompt, self.max_new_tokens, self.stop, **sampled)
        result.context = None  # drop the cache: the report keeps only numbers
        return result

    def _sampled(self, i: int, j: int, stream: int) -> SampledRun:
        st = self.setting
        seed = _run_seed(self.seed, self.index, i, j, stream)
        return {"temperature": st.temperature, "top_p": st.top_p, "top_k": st.top_k, "seed": seed}


class SampledRun(TypedDict, total=False):
    """The keywords of one sampled generation (:func:`~dflash2_lightning.decode.speculative.target_sample`,
    :func:`~dflash2_lightning.decode.speculative.speculative_generate`); none: greedy."""

    temperature: float
    top_p: float
    top_k: int
    seed: int


def _evaluate_at(
    draft: DraftModel,
    drafters: dict[DraftPath, TorchDrafter],
    prompts: Sequence[Sequence[int]],
    gen: Generations,
    measure: MeasureOptions,
    estimate: bool,
    oracle_top_k: int,
    categories: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One sampling setting (``gen``): target-only and speculative runs of every prompt, the per-path figures and
    intervals (and per category, with ``categories``: one name per prompt)."""
    from tqdm.auto import tqdm

    from dflash2_lightning.train.metrics import SelectorHealth

    st, resamples, seed = gen.setting, measure.resamples, gen.seed
    usable = list(drafters)
    references: list[list[GreedyResult]] = []
    runs: dict[str, PathRun] = {
        x: PathRun([], EstimateStats.empty(draft.config.block_size, not st.greedy) if estimate else None, [])
        for x in usable
    }
    oracle = EstimateStats.empty(draft.config.block_size) if estimate and st.greedy else None
    # Selector health of the loop's cycles (replayed, teacher-forced: equal to the loop's at T=0).
    health = SelectorHealth(draft.config.block_size) if oracle is not None and "selector" in usable else None
    desc = "eval" if st.greedy else f"eval T={st.temperature:g}"
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt", disable=not measure.progress)):
        refs = []
        for x in usable:
            runs[x].by_prompt.append([])
        for j in range(gen.samples):
            ref = gen.reference(prompt, i, j)
            refs.append(ref)
            for xi, x in enumerate(usable):
                r = gen.speculative(drafters[x], prompt, i, j, 1 + xi)
                runs[x].results.append(r)
                runs[x].by_prompt[-1].append(r)
                if st.greedy and r.tokens != ref.tokens:
                    runs[x].mismatched.append(i)
        references.append(refs)
        if estimate:
            # At temperature > 0 on the target's first sampled continuation, with the sampled estimate.
            for path, tf in teacher_forced(
                draft, gen.target, prompt, refs[0].tokens, usable, sampling=st, oracle_top_k=oracle_top_k
            ).items():
                stats = oracle if path == "oracle" else runs[path].estimate
                assert stats is not None  # estimate: every path's, and at T=0 (the oracle's only) the oracle's
                stats.add(tf)
                if path == "selector" and health is not None:
                    tf.cycle_health(health)

    flat = [r for refs in references for r in refs]
    block: dict[str, Any] = {
        "temperature": st.temperature,
        "top_p": st.top_p,
        "top_k": st.top_k,
        "samples_per_prompt": gen.samples,
        "stopped_at_eos": sum(r.stopped for r in flat),
        "target_only": target_only(references),
        "paths": {},
    }
    for path, run in runs.items():
        block["paths"][path] = {
            **measured_figures(run.by_prompt, references, resamples, seed),
            "estimated": run.estimate.summary() if run.estimate is not None else None,
            "lossless": not run.mismatched if st.greedy else None,
            "mismatched_prompts": run.mismatched,
            "per_prompt_accepted": [int(sum(sum(r.accepted) for r in rs)) for rs in run.by_prompt],
            "per_prompt": per_prompt_figures(run.by_prompt),
        }
    if "selector" in block["paths"]:
        block["paths"]["selector"]["selector_health"] = (
            health_report(health, draft.config.selector_top_k) if health is not None else None
        )
    block["tau"] = {x: v["measured"]["tau"] for x, v in block["paths"].items()}
    if categories is not None:
        block["categories"] = {
            name: {
                "prompts": len(rows),
                "target_only": target_only([references[i] for i in rows]),
                "paths": {
                    x: measured_figures(
                        [run.by_prompt[i] for i in rows], [references[i] for i in rows], resamples, seed
                    )
                    for x, run in runs.items()
                },
            }
            for name, rows in category_rows(categories).items()
        }
    if oracle is not None:
        block["oracle"] = {"top_k": oracle_top_k, **oracle.summary()}
    return block


HEALTH_CONDITIONING = (
    "per draft position (index 0 = offset 1), over the cycles that reached it: every earlier draft accepted"
)


def health_report(health: SelectorHealth, top_k: int) -> dict[str, Any]:
    """A report's ``selector_health``: per draft position, the shares of the cycles that reached it in which the
    target's token was among the selector's ``top_k`` candidates (``recall``), was drafted by the walk (``picked``)
    or was among them but passed over (``passed_over``); ``reached`` counts those cycles, ``cycles`` all of them."""
    figures = health.summary()
    return {"top_k": top_k, "counted": HEALTH_CONDITIONING, "cycles": figures["reached"][0], **figures}


def category_rows(categories: Sequence[str]) -> dict[str, list[int]]:
    """The prompts (their indices) of each category, categories in order of first appearance."""
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(categories):
        rows.setdefault(name, []).append(i)
    return rows


def target_only(references: Sequence[Sequence[GreedyResult]]) -> dict[str, Any]:
    """Tokens, seconds and tokens/s of the target-only runs of some prompts (each prompt's runs)."""
    tokens = sum(len(r.tokens) for refs in references for r in refs)
    seconds = sum(r.seconds for refs in references for r in refs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds > 0 else None}


def per_prompt_figures(by_prompt: Sequence[Sequence[SpecResult]]) -> dict[str, list[Any]]:
    """Per prompt (its runs pooled), what τ and tokens/s are pooled from: the untruncated cycles
    (``full_cycles``), the drafts they accepted (``full_accepted``; τ = 1 + their sums' ratio), the tokens
    generated and the seconds taken. What a paired comparison of two drafts resamples (``dflash2 compare``)."""
    stats = [AcceptanceStats.from_results(rs) for rs in by_prompt]
    return {
        "full_cycles": [s.full_cycles for s in stats],
        "full_accepted": [sum(a * n for a, n in enumerate(s.histogram)) for s in stats],
        "tokens": [s.tokens for s in stats],
        "seconds": [s.seconds for s in stats],
    }


def measured_figures(
    by_prompt: Sequence[Sequence[SpecResult]],
    references: Sequence[Sequence[GreedyResult]],
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    """τ, acceptance and speed of the speculative runs of some prompts (``by_prompt``, each prompt's runs) against
    the same prompts' target-only runs (``references``), with their bootstrap intervals over those prompts."""
    measured = AcceptanceStats.from_results([r for rs in by_prompt for r in rs]).summary()
    tps, base_tps = measured["tokens_per_second"], target_only(references)["tokens_per_second"]
    per_prompt = [AcceptanceStats.from_results(rs) for rs in by_prompt]
    return {
        "measured": measured,
        "speedup": tps / base_tps if tps and base_tps else None,
        "interval": bootstrap_intervals(
            [s.histogram for s in per_prompt],
            [s.tokens for s in per_prompt],
            [s.seconds for s in per_prompt],
            [sum(len(r.tokens) for r in refs) for refs in references],
            [sum(r.seconds for r in refs) for refs in references],
            resamples=resamples,
            seed=seed,
        ),
    }
