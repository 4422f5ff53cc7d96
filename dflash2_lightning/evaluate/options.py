"""The option groups the measuring actions share, each declared once (:mod:`dflash2_lightning.action_options`).

``dflash2 eval``, ``dflash2 acceptance-record`` and ``dflash2 compare`` build their options dataclasses from
these groups by inheritance, so a flag means the same thing, with the same bounds and help, in every action that
takes it::

    DraftOptions, PromptFitOptions, TargetOptions    -> RecordOptions   (acceptance-record)
    PromptOptions + SamplingOptions + MeasureOptions = LoopOptions (what run_eval takes besides draft, target, out)
    DraftOptions, TargetOptions, LoopOptions          -> EvalOptions     (eval; + its own: --out, estimate, llama.cpp)
    TargetOptions, LoopOptions, two drafts            -> CompareOptions  (compare)

The groups are also the settings the evaluation functions take and hand down, one object each: ``run_compare``
and ``run_eval`` a :class:`LoopOptions`, the loop (``evaluate_draft``, ``evaluate_block_sizes``) its
:class:`SamplingOptions` and :class:`MeasureOptions` parts (the same object). A new setting is declared here and
read where it is used; no signature in between changes. Every group checks its values when it is made (the
command line's bounds are checked first, by the flags' parsers, with the flag's name), so a library caller's bad
value fails before any work too.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash2_lightning.action_options import REQUIRED, option
from dflash2_lightning.data.prompts import PROMPT_OVERFLOW_HELP, PromptOverflow
from dflash2_lightning.data.prompts.standard import PROMPT_SETS
from dflash2_lightning.decode.drafter import DraftPath
from dflash2_lightning.errors import ConfigError, UsageError, bounded, check
from dflash2_lightning.evaluate.teacher_forced import PATHS
from dflash2_lightning.intervals import RESAMPLES
from dflash2_lightning.model.sampling import Sampling


class _Checked:
    """A group checks its values when it is made and again on :meth:`validate` (the options are plain dataclasses: a
    caller may change a field after). Each group's ``validate`` checks its own fields, then hands on (``super()``),
    so an action's options made of several groups run every group's checks."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse a value out of its bounds, naming the field (:class:`~dflash2_lightning.errors.ConfigError`)."""


@dataclass(kw_only=True)
class DraftOptions:
    """The draft checkpoint an action measures."""

    draft: str = option(REQUIRED, "draft checkpoint directory (config.json + model.safetensors)")


@dataclass(kw_only=True)
class PromptFitOptions:
    """What happens to a held-out prompt that does not fit the target's context with the response budget."""

    prompt_overflow: PromptOverflow = option("refuse", PROMPT_OVERFLOW_HELP)


@dataclass(kw_only=True)
class PromptOptions(PromptFitOptions, _Checked):
    """The held-out prompts the speculative loop decodes, and its budget per prompt."""

    prompts: str | None = option(
        None,
        "held-out prompts: a chat jsonl file {'messages': [...]}, or a standard set by name, reported per "
        f"category: {', '.join(PROMPT_SETS)} (an existing file wins over a name; docs/prompt-sets.md) "
        "(default: the shipped eval prompts)",
    )
    max_new_tokens: int = option(128, "generation budget per prompt (default {default})", parse=bounded(int, 1))
    max_prompts: int | None = option(None, "evaluate only the first N prompts", parse=bounded(int, 1))

    def validate(self) -> None:
        check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1")
        check(
            self.max_prompts is None or self.max_prompts >= 1,
            "max_prompts",
            self.max_prompts,
            ">= 1 (or None for all prompts)",
        )
        super().validate()


@dataclass(kw_only=True)
class SamplingOptions(_Checked):
    """The sampling settings measured (T=0 is greedy) and the seed of the sampled runs and the bootstrap."""

    temperatures: list[float] = option(
        [0.0],
        "sampling temperatures to measure, e.g. --temperature 0 0.7 1.0 (repeatable; default 0 = greedy)",
        flag="--temperature",
        parse=bounded(float, 0.0),
        metavar="T",
    )
    top_p: float = option(
        1.0, "nucleus sampling mass in (0, 1] (default {default})", parse=bounded(float, 0.0, 1.0, low_open=True)
    )
    top_k: int = option(0, "sample among the top k tokens (default {default} = all)", parse=bounded(int, 0))
    seed: int = option(0, "seed of the sampled runs and the bootstrap (default {default})")
    samples: int = option(
        1,
        "generations per prompt at temperature > 0 (default {default}; T=0 is deterministic: one)",
        parse=bounded(int, 1),
    )

    def validate(self) -> None:
        self.settings()
        super().validate()

    def settings(self) -> list[Sampling]:
        """One :class:`~dflash2_lightning.model.sampling.Sampling` per temperature, in order: what the loop measures
        (a :class:`~dflash2_lightning.errors.ConfigError` naming the field for a bad value)."""
        check(self.samples >= 1, "samples", self.samples, ">= 1 (generations per prompt)")
        temperatures = [float(t) for t in self.temperatures]
        if not temperatures or len(set(temperatures)) != len(temperatures):
            raise ConfigError(f"temperatures={temperatures} is invalid: need at least one, without repeats")
        return [Sampling(t, self.top_p, self.top_k) for t in temperatures]

    def samples_at(self, setting: Sampling) -> int:
        """Generations per prompt at ``setting``: ``samples`` sampled, one greedy (T=0 is deterministic)."""
        return 1 if setting.greedy else self.samples


@dataclass(kw_only=True)
class MeasureOptions(_Checked):
    """How the loop and the T=0 replay run and are reported: paths, intervals, replay, threads, draft vocabulary."""

    paths: list[DraftPath] = option(list(PATHS), "decoding paths to measure (default: {default})", choices=list(PATHS))
    resamples: int = option(
        RESAMPLES,
        "bootstrap resamples over prompts for the 95%% intervals (default {default})",
        parse=bounded(int, 1),
    )
    replay_prompts: int = option(
        0,
        "also replay the loop at T=0 (teacher-forced along the target's batched greedy outputs, equal to the "
        "measured tau) on the first N prompts: a narrow tau interval at a fraction of the loop's cost "
        "(default {default} = off)",
        parse=bounded(int, 0),
    )
    replay_max_new_tokens: int | None = option(
        None, "tokens per replayed prompt (default: --max-new-tokens)", parse=bounded(int, 1)
    )
    threads: str = option(
        "auto",
        "torch CPU threads: a number, or 'auto' (default: the cores other processes leave free by the 1-minute "
        "load average, as the quickstart chooses; the report records it)",
    )
    draft_vocab: str = option(
        "auto",
        "draft through the target head's rows of a drafting vocabulary only (lossless: the target verifies with "
        "its full head): 'auto' (default) uses DRAFT/draft_vocab.json when it exists, 'off' never, or a file "
        "(written by dflash2 draft-vocab)",
        metavar="auto|off|FILE",
    )
    progress: bool = option(True, "no progress bar", flag="--no-progress")

    def validate(self) -> None:
        if self.threads != "auto" and not (self.threads.isdigit() and int(self.threads) >= 1):
            raise UsageError(f"--threads {self.threads!r} is invalid: must be 'auto' or an integer >= 1")
        check(self.resamples >= 1, "resamples", self.resamples, ">= 1 (bootstrap draws of the intervals)")
        check(self.replay_prompts >= 0, "replay_prompts", self.replay_prompts, ">= 0 (0 = no replay)")
        check(
            self.replay_max_new_tokens is None or self.replay_max_new_tokens >= 1,
            "replay_max_new_tokens",
            self.replay_max_new_tokens,
            ">= 1 (or None: max_new_tokens)",
        )
        super().validate()

    def set_threads(self) -> None:
        """Set torch's CPU threads as ``--threads`` says (``auto``: the cores other processes leave free)."""
        import torch

        from dflash2_lightning.threads import auto_threads

        torch.set_num_threads(auto_threads(torch.get_num_threads()) if self.threads == "auto" else int(self.threads))


@dataclass(kw_only=True)
class LoopOptions(PromptOptions, SamplingOptions, MeasureOptions):
    """The speculative loop's and the replay's settings together: ``dflash2 eval``'s and ``dflash2 compare``'s."""

    @property
    def replay_max_tokens(self) -> int:
        """Tokens per replayed prompt: ``replay_max_new_tokens``, or the loop's ``max_new_tokens``."""
        return self.max_new_tokens if self.replay_max_new_tokens is None else self.replay_max_new_tokens
