"""Records to token ids and loss masks: plain text, and chat rendered with the target's own chat template.

Each sample is cut (truncated) or right-padded to ``seq_len``; only assistant turns (content + the
end-of-turn token) of a chat are supervised (:func:`encode_chat` says how the spans are found).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dflash2_lightning.data.records import DataError, parse_record


def encode_text(tokenizer: Any, text: str) -> tuple[list[int], list[bool]]:
    """Token ids of plain text (with the tokenizer's own special tokens), every token supervised."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return ids, [True] * len(ids)


def render_chat(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], where: str = "<chat>") -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation; supervised = assistant content + its end-of-turn token.

    The assistant spans come from, in order of preference:

    1. the template's ``{% generation %}`` markers, when it has them (the author's own statement);
    2. rendering prefixes: the text between ``render(msgs[:i], generation prompt)`` and
       ``render(msgs[:i+1])`` (trailing whitespace dropped) is turn ``i``; needs a template that renders
       prefixes consistently (ChatML: SmolLM2, the tiny target);
    3. searching each message's content, in order, in the rendered text (Qwen3-style templates that
       render the last turn differently), plus the end-of-turn token right after it.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError(f"{where}: chat sample but the target's tokenizer has no chat template")
    if "{% generation %}" in str(template).replace("{%-", "{%").replace("-%}", "%}"):
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]
    full = render_chat(tokenizer, messages, False)
    spans = _prefix_spans(tokenizer, messages, full)
    if spans is None:
        spans = _content_spans(tokenizer, messages, full, where)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _prefix_spans(tokenizer: Any, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]] | None:
    """Assistant spans by rendering prefixes, or None when the template renders them inconsistently."""
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = render_chat(tokenizer, messages[:i], True)
        upto = render_chat(tokenizer, messages[: i + 1], False)
        if not (full.startswith(upto) and upto.startswith(prefix)):
            return None
        spans.append((len(prefix), len(upto.rstrip())))
    return spans


def _content_spans(tokenizer: Any, messages: list[dict[str, str]], full: str, where: str) -> list[tuple[int, int]]:
    """Assistant spans found by searching each message's content, in order, in the rendered text.

    For templates that render a turn differently once later turns follow (Qwen3 drops earlier
    ``<think>`` blocks). The span is the content plus an end-of-turn token right after it, if any.
    """
    enders = [t for t in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>") if t]
    spans, cursor = [], 0
    for k, msg in enumerate(messages):
        content = msg["content"]
        pos = full.find(content, cursor)
        if pos < 0 and content.strip():
            content = content.strip()
            pos = full.find(content, cursor)
        if pos < 0:
            raise DataError(
                f"{where}: cannot locate assistant tokens: turn {k}'s content is not rendered "
                "verbatim by the chat template and it has no {% generation %} markers"
            )
        end = pos + len(content)
        if msg["role"] == "assistant":
            closer = next((t for t in enders if full.startswith(t, end)), "")
            spans.append((pos, end + len(closer)))
        cursor = end
    return spans


class EncodedSplit(NamedTuple):
    """One split tokenised: the arrays, where the skipped samples are, and how many samples were cut."""

    arrays: dict[str, np.ndarray]
    skipped: list[str]  # "file:line" of each sample with no supervised token (within seq_len)
    cut: int  # samples longer than seq_len, cut to it


def encode_records(tokenizer: Any, records: list[tuple[str, Any]], seq_len: int) -> tuple[dict[str, np.ndarray], int]:
    """Tokenise, cut/pad to ``seq_len``; returns the arrays and the number of skipped samples.

    A sample with no supervised token left after cutting is skipped (and counted).
    """
    encoded = encode_split(tokenizer, records, seq_len)
    return encoded.arrays, len(encoded.skipped)


def encode_split(tokenizer: Any, records: list[tuple[str, Any]], seq_len: int) -> EncodedSplit:
    """:func:`encode_records`, also saying which samples were skipped and how many were cut to ``seq_len``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows_ids, rows_mask, rows_len, skipped, cut = [], [], [], [], 0
    for where, record in records:
        parsed = parse_record(record, where)
        ids, mask = encode_text(tokenizer, parsed) if isinstance(parsed, str) else encode_chat(tokenizer, parsed, where)
        cut += len(ids) > seq_len
        ids, mask = ids[:seq_len], mask[:seq_len]
        if not any(mask):
            skipped.append(where)
            continue
        rows_ids.append(ids)
        rows_mask.append(mask)
        rows_len.append(len(ids))
    n = len(rows_ids)
    arrays = {
        "input_ids": np.full((n, seq_len), pad, dtype=np.int32),
        "loss_mask": np.zeros((n, seq_len), dtype=bool),
        "attention_mask": np.zeros((n, seq_len), dtype=bool),
    }
    for r, (ids, mask, length) in enumerate(zip(rows_ids, rows_mask, rows_len)):
        arrays["input_ids"][r, :length] = ids
        arrays["loss_mask"][r, :length] = mask
        arrays["attention_mask"][r, :length] = True
    return EncodedSplit(arrays, skipped, cut)
