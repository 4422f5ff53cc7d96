"""The drafting vocabulary: a draft step's head over the tokens the target actually writes.

Every draft step sends its block_size - 1 drafted slots through the target's lm_head, and on a CPU that
is the largest part of the step (SmolLM2-135M's head is 49152 x 576: 113 MB of float32 read per cycle).
The target's responses use a few thousand distinct tokens, and a draft token that is accepted is almost
always one of the frequent ones. :class:`DraftVocabHead` multiplies only those rows (they stay in the
cache) and gives every other token a logit of -inf: the same idea as FR-Spec's frequency-ranked drafting
and EAGLE-3's draft vocabulary, here without retraining (the rows are the target head's own). Lossless by
construction: the target verifies with its full head, so only τ can change (its effect on τ and on a
cycle's cost: docs/cpu-linears.md)::

    responses.jsonl --count tokens--> the size most frequent + the stop tokens --> DRAFT_VOCAB_FILE
                                                                                  (beside the checkpoint)
    DRAFT_VOCAB_FILE + the target's lm_head --> DraftVocabHead: hidden [.., H] -> logits [.., V]
                                                (those rows' logits, -inf elsewhere)

The file sits in the draft's checkpoint directory (serving engines ignore it); ``dflash2 eval`` and
the quickstart's evaluation draft with it when it is there. Write one for any run with
``dflash2 draft-vocab --draft DIR --responses FILE.jsonl --target SPEC``.
"""

from __future__ import annotations

import collections
import json
import operator
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.errors import bounded
from dflash2_lightning.target.arguments import TargetOptions

DRAFT_VOCAB_FILE = "draft_vocab.json"
DEFAULT_SIZE = 8192  # covers every distinct token of the quickstart's responses (8,036)
FORMAT = "dflash2-draft-vocab/1"


class DraftVocabError(ValueError):
    """A draft vocabulary file or setting that cannot be used (the message names the field and the bound)."""


def count_response_tokens(responses: str | os.PathLike, tokenizer: Any) -> collections.Counter[int]:
    """How often each token occurs in the assistant turns of a chat jsonl (``dflash2 regen``'s output)."""
    counts: collections.Counter[int] = collections.Counter()
    with open(responses, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            messages = json.loads(line).get("messages") or []
            for message in messages:
                if message.get("role") == "assistant":
                    counts.update(tokenizer(message["content"], add_special_tokens=False)["input_ids"])
    return counts


def hot_tokens(counts: collections.Counter[int], size: int = DEFAULT_SIZE, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent tokens of ``counts`` and every token of ``always`` (the stop tokens), sorted."""
    if size < 1:
        raise DraftVocabError(f"size={size} is invalid: must be >= 1 (tokens in the drafting vocabulary)")
    return sorted({t for t, _ in counts.most_common(size)} | {int(t) for t in always})


def write_draft_vocab(draft_dir: str | os.PathLike, token_ids: Sequence[int], vocab_size: int, source: str) -> Path:
    """Write ``draft_dir/draft_vocab.json`` atomically (readable by other users); returns its path."""
    from dflash2_lightning.files import atomic_write_text

    ids = _checked_ids(token_ids, vocab_size, "token_ids")
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    atomic_write_text(
        path,
        json.dumps({"format": FORMAT, "vocab_size": vocab_size, "source": source, "size": len(ids), "token_ids": ids})
        + "\n",
    )
    return path


def read_draft_vocab(path: str | os.PathLike, vocab_size: int) -> list[int]:
    """The token ids of a draft vocabulary file (or of ``DIR/draft_vocab.json``), checked against ``vocab_size``."""
    path = Path(path)
    if path.is_dir():
        path = path / DRAFT_VOCAB_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DraftVocabError(f"draft vocabulary {path} cannot be read: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DraftVocabError(
            f"draft vocabulary {path}: format={data.get('format') if isinstance(data, dict) else None!r} "
            f"is invalid: must be {FORMAT!r}"
        )
    if data.get("vocab_size") != vocab_size:
        raise DraftVocabError(
            f"draft vocabulary {path}: vocab_size={data.get('vocab_size')} is invalid: the "
            f"target's vocabulary has {vocab_size} tokens (the file was made for another target)"
        )
    return _checked_ids(data.get("token_ids"), vocab_size, f"{path}: token_ids")


def _checked_ids(token_ids: Any, vocab_size: int, field: str) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise DraftVocabError(f"{field} is invalid: must be a non-empty list of token ids")
    ids_seen = set()
    for t in token_ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids_seen.add(operator.index(t))  # ints, numpy and 0-d torch integers
        except TypeError:
            raise DraftVocabError(f"{field} holds {t!r}: token ids must be integers") from None
    ids = sorted(ids_seen)
    if ids[0] < 0 or ids[-1] >= vocab_size:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise DraftVocabError(f"{field} holds {bad}, out of range: token ids must be in [0, {vocab_size})")
    return ids


class DraftVocabHead:
    """A drafting head over ``token_ids`` only: ``hidden [.., H] -> logits [.., V]``, -inf off the set.

    Holds a contiguous copy of those rows of ``lm_head`` (taken once: the head is frozen while drafting).
    Full-vocabulary logits keep every caller unchanged (argmax, the selector walk's top-k, sampling,
    whose probabilities off the set are 0, so rejection sampling stays exact).
    """

    def __init__(self, lm_head: nn.Module, token_ids: Sequence[int]) -> None:
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise DraftVocabError(
                f"DraftVocabHead needs a linear lm_head with a [V, H] weight, not {type(lm_head).__name__}"
            )
        self.vocab_size = weight.shape[0]
        ids = _checked_ids(list(token_ids), self.vocab_size, "token_ids")
        self.token_ids = torch.tensor(ids, dtype=torch.long, device=weight.device)
        self.weight = weight.detach()[self.token_ids].contiguous()
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[self.token_ids].contiguous()

    @property
    def size(self) -> int:
        return len(self.token_ids)

    def __call__(self, hidden: Tensor) -> Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self.weight.dtype)
        logits = torch.nn.functional.linear(rows, self.weight, self.bias)
        out = logits.new_full((rows.shape[0], self.vocab_size), float("-inf"))
        out.index_copy_(1, self.token_ids, logits)
        return out.view(*hidden.shape[:-1], self.vocab_size)


def draft_vocab_head(target: Any, source: str | os.PathLike) -> DraftVocabHead:
    """The :class:`DraftVocabHead` of ``target`` (a project ``Target`` or an HF causal LM) for a vocabulary
    file or a checkpoint directory holding one."""
    hf = getattr(target, "hf", target)
    lm_head = hf.get_output_embeddings()
    return DraftVocabHead(lm_head, read_draft_vocab(source, lm_head.weight.shape[0]))


def find_draft_vocab(draft_dir: str | os.PathLike) -> Path | None:
    """``draft_dir/draft_vocab.json`` when it exists, else None."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    return path if path.is_file() else None


def make_draft_vocab(
    draft_dir: str | os.PathLike, responses: str | os.PathLike, target: Any, size: int = DEFAULT_SIZE
) -> Path:
    """Count ``responses``' tokens with ``target``'s tokenizer and write the drafting vocabulary beside the
    checkpoint in ``draft_dir``: the ``size`` most frequent tokens and the target's stop tokens."""
    hf = getattr(target, "hf", target)
    vocab_size = hf.get_output_embeddings().weight.shape[0]
    counts = count_response_tokens(responses, target.tokenizer)
    ids = hot_tokens(counts, size, getattr(target, "eos_token_ids", []))
    kept = set(ids)
    covered = sum(c for t, c in counts.items() if t in kept) / max(1, sum(counts.values()))
    return write_draft_vocab(
        draft_dir,
        ids,
        vocab_size,
        f"{size} most frequent of {len(counts)} distinct tokens in {Path(responses).name} "
        f"({sum(counts.values())} tokens, {covered:.4f} covered) + stop tokens",
    )


@dataclass(kw_only=True)
class DraftVocabOptions(TargetOptions):
    """``dflash2 draft-vocab``'s options."""

    draft: str = option(REQUIRED, "the draft checkpoint directory (the file is written there)")
    responses: str = option(REQUIRED, "chat jsonl of the target's responses (the training data)")
    size: int = option(DEFAULT_SIZE, "most frequent tokens kept (default {default})", parse=bounded(int, 1))


DESCRIPTION = (
    "Write DRAFT/draft_vocab.json: the tokens the draft step's head covers (the most frequent tokens of the "
    "target's responses, and its stop tokens). `dflash2 eval` drafts through those rows of the target head when "
    "the file is there; lossless (the target verifies with its full head), serving engines ignore the file."
)


def main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 draft-vocab``: write a draft checkpoint's drafting vocabulary."""
    from dflash2_lightning.target.load import load_target

    opts = parse_options(DraftVocabOptions, argv, prog="dflash2 draft-vocab", description=DESCRIPTION)
    path = make_draft_vocab(opts.draft, opts.responses, load_target(opts.target_spec()), opts.size)
    print(f"wrote {path}: {json.loads(path.read_text())['source']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
