"""Prompt sets shipped with the package, and reading / encoding chat prompts.

``seed.jsonl``
    A few hundred varied user prompts (instructions, questions, code, maths, chat, writing) whose
    target responses ``dflash2 regen`` generates: the training data of a drafter on the target's own
    distribution.
``eval.jsonl``
    A small held-out set (no overlap with the seed prompts) for ``dflash2 eval``.

Both are chat jsonl: one ``{"messages": [{"role": "user", "content": ...}]}`` per line.

Prompts longer than the target's context. A prompt whose tokens plus the response budget exceed the
target's ``max_position_embeddings`` is refused by default (``--prompt-overflow refuse``): generating
past the positions a target was trained for gives text no server would produce, and a very long prompt
can exhaust the machine's memory. ``--prompt-overflow truncate`` keeps each such prompt's *last* tokens
(the end of the conversation and the assistant prefix) and the command says how many prompts it cut
(:func:`fit_to_context`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, NamedTuple

from dflash2_lightning.engines.acceptance_record import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPTS

PROMPTS_DIR = Path(__file__).resolve().parent
SEED_PROMPTS = PROMPTS_DIR / "seed.jsonl"
EVAL_PROMPTS = PROMPTS_DIR / "eval.jsonl"
PromptOverflow = Literal["refuse", "truncate"]
PROMPT_OVERFLOW_CHOICES: tuple[str, ...] = ("refuse", "truncate")
PROMPT_OVERFLOW_HELP = (
    "what to do with a prompt whose tokens plus the response budget exceed the target's "
    "context (max_position_embeddings): 'refuse' (default: an error naming the first one) or "
    "'truncate' (keep its last tokens; the summary says how many prompts were cut)"
)


class FittedPrompts(NamedTuple):
    """Prompts that fit the target's context, and how many of them :func:`fit_to_context` had to cut."""

    prompts: list[list[int]]
    cut: int
    kept_tokens: int | None  # the longest a prompt may be (None: the target does not state its context)

    def note(self, what: str = "prompts") -> str | None:
        """The summary line of a cut (None when nothing was cut)."""
        if not self.cut:
            return None
        return (
            f"{self.cut} of {len(self.prompts)} {what} were longer than the target's context allows and were "
            f"cut to their last {self.kept_tokens} tokens (--prompt-overflow truncate)"
        )


def read_prompts(path: str | os.PathLike, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The chat prompts of a jsonl file (``messages`` or ShareGPT ``conversations`` records).

    Trailing assistant turns are dropped: what remains is what the target answers. A plain ``text``
    record becomes a single user turn. ``limit`` keeps the first ``limit`` prompts.
    """
    from dflash2_lightning.data.records import DataError, parse_record, read_jsonl
    from dflash2_lightning.errors import ConfigError

    if limit is not None and limit < 1:
        raise ConfigError(f"limit={limit} is invalid: must be >= 1 (or None for all prompts)")
    prompts: list[list[dict[str, str]]] = []
    for where, record in read_jsonl(path):
        parsed = parse_record(record, where)
        messages = [{"role": "user", "content": parsed}] if isinstance(parsed, str) else parsed
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DataError(f"{where}: the record has only assistant turns: nothing to prompt with")
        prompts.append(messages)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DataError(f"{path} holds no prompts (empty file): give a chat jsonl with one prompt per line")
    return prompts


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the assistant generation prompt.

    Rendered and tokenised exactly as :func:`dflash2_lightning.data.encode.encode_chat` does for training
    (template text, no extra special tokens), so prompts look the same at training and at eval time.
    """
    from dflash2_lightning.target.spec import TargetError

    if not getattr(tokenizer, "chat_template", None):
        raise TargetError("the target's tokenizer has no chat template: chat prompts cannot be rendered")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_to_context(
    prompts: list[list[int]],
    context: int | None,
    max_new_tokens: int,
    overflow: PromptOverflow = "refuse",
    where: str | os.PathLike = "the prompts file",
    budget: str = "--max-new-tokens",
) -> FittedPrompts:
    """Check every tokenised prompt plus ``max_new_tokens`` against the target's ``context`` (positions).

    ``overflow="refuse"`` raises a :class:`~dflash2_lightning.config.ConfigError` naming the first prompt
    that does not fit and how many do not; ``"truncate"`` keeps each such prompt's last
    ``context - max_new_tokens`` tokens. Checked before any generation (it costs a tokenisation).
    ``budget``: the option that set ``max_new_tokens``, as the messages name it: ``--max-new-tokens`` (commands
    that also take ``--prompt-overflow``), or ``--model.init_args.export.acceptance_tokens`` (fit's record).
    """
    from dflash2_lightning.errors import ConfigError, check

    check(overflow in PROMPT_OVERFLOW_CHOICES, "prompt_overflow", overflow, "'refuse' or 'truncate'")
    if context is None:
        return FittedPrompts(list(prompts), 0, None)
    room = context - max_new_tokens
    name = budget.lstrip("-").replace("-", "_")
    if room < 1:
        raise ConfigError(
            f"{name}={max_new_tokens} is invalid: must be < the target's context of {context} "
            f"positions (max_position_embeddings), leaving room for the prompt; lower {budget}"
        )
    long = [i for i, p in enumerate(prompts) if len(p) > room]
    if long and overflow == "refuse":
        first = long[0]
        raise ConfigError(
            f"{len(long)} of {len(prompts)} prompts do not fit the target's context: prompt {first + 1} "
            f"of {where} has {len(prompts[first])} tokens, and with {name}={max_new_tokens} "
            f"the target's {context} positions leave room for {room}; shorten those prompts"
            + (
                f", lower {budget}, or pass --prompt-overflow truncate to keep their last tokens"
                if budget == "--max-new-tokens"
                else f" or lower {budget}"
            )
        )
    cut = set(long)
    return FittedPrompts([p[-room:] if i in cut else p for i, p in enumerate(prompts)], len(long), room)


def record_prompts(
    target: Any,
    prompts_file: str | os.PathLike | None = None,
    num_prompts: int = DEFAULT_PROMPTS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    prompt_overflow: PromptOverflow = "refuse",
    budget: str = "--max-new-tokens",
) -> Any:
    """The acceptance record's prompts as token ids (:class:`FittedPrompts`): the first
    ``num_prompts`` of ``prompts_file`` (default: the shipped evaluation prompts), rendered with the loaded
    ``target``'s chat template and checked, with ``max_new_tokens``, against its context as ``dflash2 eval``
    checks them (:func:`fit_to_context`; ``budget`` names the setting).

    Cheap (a tokenisation): ``fit`` calls it before it trains, so a record that cannot be made is refused then."""
    where = Path(prompts_file) if prompts_file is not None else EVAL_PROMPTS
    prompts = [encode_prompt(target.tokenizer, m) for m in read_prompts(where, num_prompts)]
    return fit_to_context(
        prompts, getattr(target, "context_length", None), max_new_tokens, prompt_overflow, where, budget=budget
    )
