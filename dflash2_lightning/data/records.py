"""Training records: jsonl files of text, chat or ShareGPT samples, read and validated, and the validation split.

Data files are jsonl, one sample per line, in any of three shapes:

- ``{"text": "..."}``: plain text, every token supervised;
- ``{"messages": [{"role": "user", "content": "..."}, ...]}``: chat, rendered with the tokenizer's
  chat template; only assistant turns (content + end-of-turn token) are supervised;
- ``{"conversations": [{"from": "human", "value": "..."}, ...]}``: ShareGPT, mapped onto ``messages``.

A malformed line is a :class:`DataError` naming the file, the line and what to fix; so is a chat turn
whose role no chat template knows (a misspelt ``asistant`` would otherwise leave the sample without a
supervised token, skipped without a word about why).

The validation split (:func:`validation_split`) holds out whole prompts, says what it held out, and
refuses a split that would leave training a small part of the records.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from dflash2_lightning.errors import UserError

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
#: roles of a ``messages`` turn (OpenAI / HF chat conventions); anything else is a data error naming it
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
SPLIT_SEED = 0  # the held-out validation split is a fixed permutation of the training records' prompts
SPLIT_RULE = "by_prompt"  # recorded in the cache manifest: caches split by record before it are rebuilt


class DataError(UserError, ValueError):
    """Bad data: the message names the file and line (or the cache directory and field)."""


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", record)`` for each non-blank line; a malformed line raises :class:`DataError`.

    A missing or unreadable file, bytes that are not UTF-8 and invalid JSON are errors naming the file,
    the line and the column.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(
            f"data file {path} does not exist; check the path (train_files / val_files / --prompts)"
        ) from None
    except IsADirectoryError:
        raise DataError(f"data file {path} is a directory: give jsonl files (one JSON object per line)") from None
    except PermissionError:
        raise DataError(f"data file {path} is not readable (permission denied)") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                at = "at the end of the line" if e.pos >= len(line) else f"at column {e.colno}"
                raise DataError(f"{where}: invalid JSON ({e.msg} {at}); fix or remove that line") from None
            yield where, record


def parse_record(record: Any, where: str) -> str | list[dict[str, str]]:
    """A record's text (``str``) or its chat messages (``[{"role", "content"}]``), validated."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object with 'text', 'messages' or 'conversations', got {type(record).__name__}"
        )
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' must be a string, got {type(record['text']).__name__}")
        return record["text"]
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise DataError(f"{where}: expected a key 'text', 'messages' or 'conversations', got {sorted(record)}")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: '{'messages' if role_key == 'role' else 'conversations'}' must be a non-empty list")
    messages = []
    for k, turn in enumerate(turns):
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get(role_key), str)
            or not isinstance(turn.get(content_key), str)
        ):
            raise DataError(f"{where}: turn {k} must be an object with string '{role_key}' and '{content_key}'")
        role = turn[role_key]
        if role_key == "from":
            if role.lower() not in SHAREGPT_ROLES:
                raise DataError(
                    f"{where}: turn {k} has unknown ShareGPT role from={role!r} (known: {sorted(SHAREGPT_ROLES)})"
                )
            role = SHAREGPT_ROLES[role.lower()]
        elif role not in CHAT_ROLES:
            raise DataError(
                f"{where}: turn {k} has unknown role {role!r} (known: {', '.join(CHAT_ROLES)}); "
                "fix the role (a misspelt 'assistant' turn would never be trained on) or remove the turn"
            )
        messages.append({"role": role, "content": turn[content_key]})
    return messages


def prompt_key(parsed: str | list[dict[str, str]]) -> str:
    """What a record answers: its conversation before the last assistant turn (a text record: the text).

    Records that share it (a greedy and sampled responses to one prompt) belong in the same split, so that
    validation measures prompts the draft has not seen, not other answers to prompts it trained on.
    """
    if isinstance(parsed, str):
        return parsed
    last = max((k for k, m in enumerate(parsed) if m["role"] == "assistant"), default=len(parsed))
    return json.dumps(parsed[:last], sort_keys=True, ensure_ascii=False)


def held_out_by_prompt(records: list[tuple[str, Any]], n_val: int) -> set[int]:
    """Indices of the validation records: whole prompt groups (:func:`prompt_key`), in a fixed random order,
    until at least ``n_val`` records are held out; never every group. Where all records answer one prompt
    it holds out single records instead, and says so (validation then shares that prompt)."""
    if n_val <= 0:
        return set()
    groups: dict[str, list[int]] = {}
    for i, (where, record) in enumerate(records):
        groups.setdefault(prompt_key(parse_record(record, where)), []).append(i)
    rng = np.random.default_rng(SPLIT_SEED)
    if len(groups) < 2:
        log.warning(
            "all %d training records answer one prompt: validation holds out %d of its responses, "
            "so it measures that prompt again",
            len(records),
            n_val,
        )
        return set(rng.permutation(len(records))[:n_val].tolist())
    members = list(groups.values())
    held: set[int] = set()
    for g in rng.permutation(len(members))[:-1]:  # the last group always trains
        if len(held) >= n_val:
            break
        held.update(members[g])
    return held


class Split(NamedTuple):
    """Which training records :func:`validation_split` holds out for validation, and how it chose them."""

    held: set[int]
    records: int
    prompts: int
    held_prompts: int
    requested: int

    def describe(self) -> str:
        """One line saying what the split did."""
        return (
            f"validation split by prompt: {len(self.held)} of {self.records} records held out "
            f"({self.held_prompts} of {self.prompts} prompts, about {self.requested} asked), "
            f"{self.records - len(self.held)} train"
        )


#: a split must leave training at least this share of what ``val_fraction`` alone would leave it
MIN_TRAIN_SHARE = 0.5


def validation_split(records: list[tuple[str, Any]], val_fraction: float) -> Split:
    """Hold out ``val_fraction`` of ``records`` for validation, whole prompts at a time (:func:`held_out_by_prompt`).

    Refuses (:class:`DataError`, naming the cause and what to do) a split that would leave training less than
    :data:`MIN_TRAIN_SHARE` of the ``1 - val_fraction`` it asked for: prompts with very many responses each
    (30 answers to one prompt and 1 to another) cannot be split by prompt at that fraction.
    """
    n = len(records)
    n_val = max(int(round(n * val_fraction)), 1) if val_fraction > 0 and n > 1 else 0
    held = held_out_by_prompt(records, n_val)
    keys = [prompt_key(parse_record(record, where)) for where, record in records] if n_val else []
    prompts = len(set(keys))
    held_keys = {keys[i] for i in held}
    split = Split(held, n, prompts, len(held_keys), n_val)
    train = n - len(held)
    if n_val and train < MIN_TRAIN_SHARE * (1 - val_fraction) * n:
        largest = max(sum(1 for k in keys if k == key) for key in held_keys)
        raise DataError(
            f"the validation split by prompt would hold out {len(held)} of {n} records and train on {train}: "
            f"val_fraction={val_fraction} asks for about {n_val}, but whole prompts are held out and a held-out "
            f"prompt has {largest} responses; give validation files (data val_files), or set data val_fraction=0 "
            "to train on every record"
        )
    return split
