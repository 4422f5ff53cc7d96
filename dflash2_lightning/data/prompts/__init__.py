"""Prompt sets shipped with the package, and reading / encoding chat prompts.

``seed.jsonl``
    A few hundred varied user prompts (instructions, questions, code, maths, chat, writing) whose
    target responses ``dflash2 regen`` generates: the training data of a drafter on the target's own
    distribution.
``eval.jsonl``
    A small held-out set (no overlap with the seed prompts) for ``dflash2 eval``.

Both are chat jsonl: one ``{"messages": [{"role": "user", "content": ...}]}`` per line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PROMPTS_DIR = Path(__file__).resolve().parent
SEED_PROMPTS = PROMPTS_DIR / "seed.jsonl"
EVAL_PROMPTS = PROMPTS_DIR / "eval.jsonl"


def read_prompts(path: str | os.PathLike, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The chat prompts of a jsonl file (``messages`` or ShareGPT ``conversations`` records).

    Trailing assistant turns are dropped: what remains is what the target answers. A plain ``text``
    record becomes a single user turn. ``limit`` keeps the first ``limit`` prompts.
    """
    from dflash2_lightning.config import ConfigError
    from dflash2_lightning.data.records import DataError, parse_record, read_jsonl

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
