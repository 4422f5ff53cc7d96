"""The prompts ``dflash2 eval`` measures on a named set (``--prompts mt-bench``): every turn of every question.

A question of several turns (MT-Bench's two) is measured once per turn, as MT-Bench and Spec-Bench run it: turn
``k`` is asked after the earlier turns *and the target's own answers to them*. Those answers are the target's
greedy continuations (batched, up to the same token budget), generated here before the measurement; at T=0 they are
what the lossless loop answers too. The turns of one question come together, so ``--max-prompts N`` takes whole
questions first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from dflash2_lightning.data.prompts import PromptOverflow, encode_prompt, fit_to_context
from dflash2_lightning.data.prompts.standard import PromptRecord
from dflash2_lightning.evaluate.replay import greedy_outputs


class Turn(NamedTuple):
    """One measured prompt of a named set: a question's turn ``turn`` (0 = the first)."""

    record: PromptRecord
    turn: int


def turns_of(records: Sequence[PromptRecord]) -> list[Turn]:
    """Every turn of every record, in record order, a record's turns together."""
    return [Turn(r, k) for r in records for k in range(len(r.turns))]


def turn_chats(
    turns: Sequence[Turn],
    target: Any,
    max_new_tokens: int,
    prompt_overflow: PromptOverflow = "refuse",
    where: str = "the prompt set",
) -> list[list[dict[str, str]]]:
    """The chat of each turn: the question's earlier turns with the target's greedy answers, then the turn.

    The answers are generated one turn depth at a time (all questions' first answers in one batched pass, then the
    second ...), each prompt checked against the target's context first (``prompt_overflow``, as the eval's).
    """
    answers: dict[tuple[str, int], str] = {}
    deepest = max((t.turn for t in turns), default=0)
    for depth in range(deepest):  # the answers to turn `depth` that a later turn asks after
        asked = list({t.record.id: t.record for t in turns if t.turn > depth}.values())
        chats = [history(r, depth, answers) for r in asked]
        prompts = fit_to_context(
            [encode_prompt(target.tokenizer, c) for c in chats],
            getattr(target, "context_length", None),
            max_new_tokens,
            prompt_overflow,
            where,
        ).prompts
        stop = list(getattr(target, "eos_token_ids", []))
        for r, out in zip(asked, greedy_outputs(target, prompts, max_new_tokens, stop)):
            answers[(r.id, depth)] = target.tokenizer.decode(out, skip_special_tokens=True)
    return [history(t.record, t.turn, answers) for t in turns]


def history(record: PromptRecord, turn: int, answers: dict[tuple[str, int], str]) -> list[dict[str, str]]:
    """The chat that asks ``record``'s turn ``turn``: each earlier turn and its answer (from ``answers``), then it."""
    chat: list[dict[str, str]] = []
    for k in range(turn):
        chat += [
            {"role": "user", "content": record.turns[k]},
            {"role": "assistant", "content": answers[(record.id, k)]},
        ]
    return [*chat, {"role": "user", "content": record.turns[turn]}]
