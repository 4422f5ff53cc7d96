"""The acceptance record's file: what a served drafter must achieve, kept beside the exported draft.

``acceptance.json`` (format :data:`RECORD_FORMAT`) holds, for a handful of held-out prompts: their token ids
(rendered with the target tokenizer's chat template as training and ``dflash2 eval`` render them, so no
server-side template is involved), the target's greedy continuation (ids, and its text as engines return it),
the accepted drafts at every verify step of the T=0 loop along it (on the path the engines decode with), and the
expected τ with its 95% bootstrap interval over prompts and ``accept_k``. The format string changes when a field
changes meaning; readers refuse other formats.

This module is the file: its fields, writing (atomically), reading and checking it, and whether it describes a
draft's weights. Making one (the replay) is :mod:`dflash2_lightning.evaluate.record`; comparing a running engine
with it is :mod:`dflash2_lightning.engines.check_serving`. Who writes one and what it holds: docs/serving-check.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash2_lightning.errors import UserError

RECORD_FORMAT = "dflash2-acceptance-record/1"
RECORD_NAME = "acceptance.json"
GGUF_RECORD_SUFFIX = ".acceptance.json"
DEFAULT_PROMPTS = 8
DEFAULT_MAX_NEW_TOKENS = 64


class RecordError(UserError, ValueError):
    """An acceptance record is missing, unreadable, of another format, or inconsistent."""


def weights_digest(draft_dir: str | os.PathLike) -> str:
    """sha256 of the draft's ``model.safetensors`` (which weights the record describes)."""
    from dflash2_lightning.model.checkpoint import WEIGHTS_NAME

    h = hashlib.sha256()
    with open(Path(draft_dir) / WEIGHTS_NAME, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def continuation_text(tokenizer: Any, continuation: Sequence[int], stop: Sequence[int]) -> str:
    """The text an engine returns for ``continuation``: the final stop token and special tokens left out,
    spaces not cleaned up (what vLLM, SGLang and llama-server detokenize to)."""
    ids = list(continuation)
    if ids and ids[-1] in stop:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


def expected(record: dict[str, Any], count: int | None = None) -> dict[str, Any]:
    """τ, ``accept_k``, the 95% interval and per-prompt accepted counts / steps over the first ``count``
    prompts of ``record`` (all by default): recomputed, so a check on fewer prompts gets their interval."""
    from dflash2_lightning.intervals import replay_summary

    prompts = record["prompts"][:count] if count is not None else record["prompts"]
    boot = record.get("bootstrap") or {}
    summary = replay_summary(
        [p["accepted_per_step"] for p in prompts],
        int(record["draft"]["block_size"]),
        **({"resamples": boot["resamples"]} if "resamples" in boot else {}),
        seed=int(boot.get("seed", 0)),
    )
    return {
        "prompts": len(prompts),
        "tau": summary["tau"],
        "interval": summary["interval"],
        "level": boot.get("level", 0.95),
        "accept": summary["accept"],
        "accepted": summary["accepted"],
        "steps": summary["cycles"],
        "per_prompt_accepted": summary["per_prompt_accepted"],
        "per_prompt_steps": summary["per_prompt_cycles"],
    }


def write_record(record: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``record`` as JSON to ``path`` atomically (a directory: ``<path>/acceptance.json``)."""
    from dflash2_lightning.files import atomic_write_text

    path = Path(path)
    if path.is_dir():
        path = path / RECORD_NAME
    atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


def record_path(where: str | os.PathLike) -> Path:
    """The record of a draft directory (``<dir>/acceptance.json``) or a record file itself."""
    where = Path(where).expanduser()
    return where / RECORD_NAME if where.is_dir() else where


def read_record(where: str | os.PathLike) -> dict[str, Any]:
    """The record of a draft directory or file, checked (format, fields, per-prompt consistency).

    Raises :class:`RecordError` saying what is missing and how to write one.
    """
    path = record_path(where)
    if not path.is_file():
        raise RecordError(
            f"no acceptance record at {path}: write one with `dflash2 acceptance-record --draft "
            f"{path.parent if path.name == RECORD_NAME else 'DIR'} --target TARGET` (or `dflash2 eval "
            "--replay-prompts N`, which writes it into the draft directory)"
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RecordError(f"{path} is not valid JSON ({error}): truncated? write it again") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise RecordError(
            f"{path} has format {found!r}, not {RECORD_FORMAT!r}: write it again with this version "
            "(`dflash2 acceptance-record`)"
        )
    for key in ("draft", "prompts", "max_new_tokens", "stop_token_ids", "path"):
        if key not in record:
            raise RecordError(f"{path} lacks {key!r}: write it again (`dflash2 acceptance-record`)")
    prompts = record["prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise RecordError(f"{path} holds no prompts: write it again with --num-prompts >= 1")
    for i, p in enumerate(prompts):
        missing = [
            k for k in ("prompt_ids", "continuation_ids", "continuation_text", "accepted_per_step") if k not in p
        ]
        if missing:
            raise RecordError(f"{path}: prompt {i} lacks {missing}: write the record again")
    return record


def stale_weights(record: dict[str, Any], draft_dir: str | os.PathLike) -> str | None:
    """Why ``record`` does not describe the weights in ``draft_dir`` (its ``weights_sha256`` is another
    ``model.safetensors``'s), or None when it does, or when the directory holds no weights to compare with."""
    from dflash2_lightning.model.checkpoint import WEIGHTS_NAME

    weights = Path(draft_dir) / WEIGHTS_NAME
    if not weights.is_file():
        return None
    recorded, actual = (record.get("draft") or {}).get("weights_sha256"), weights_digest(draft_dir)
    if recorded == actual:
        return None
    return (
        f"the acceptance record was made for other weights than {weights} (its weights_sha256 "
        f"{str(recorded)[:12]}..., the file's {actual[:12]}...)"
    )


def check_record_weights(record: dict[str, Any], draft_dir: str | os.PathLike) -> None:
    """Refuse (:class:`RecordError`) a record of other weights than ``draft_dir``'s (see :func:`stale_weights`)."""
    why = stale_weights(record, draft_dir)
    if why is not None:
        raise RecordError(
            f"{why}: write it again for these weights (`dflash2 acceptance-record --draft {draft_dir} "
            "--target TARGET`), or pass --allow-stale-record to check against it anyway"
        )


def remove_stale_record(draft_dir: str | os.PathLike) -> Path | None:
    """Remove ``draft_dir/acceptance.json`` when it does not describe the weights now in ``draft_dir`` (or cannot
    be read); returns the removed path, or None. A fit calls this after it writes new weights, so a record of the
    previous run's weights is never left beside them."""
    path = Path(draft_dir) / RECORD_NAME
    if not path.is_file():
        return None
    try:
        stale = stale_weights(read_record(path), draft_dir) is not None
    except RecordError:
        stale = True
    if not stale:
        return None
    path.unlink()
    return path


def gguf_record_path(gguf: str | os.PathLike) -> Path:
    """Where the record of a GGUF lives: ``draft.gguf`` -> ``draft.acceptance.json`` beside it."""
    gguf = Path(gguf)
    return gguf.with_name(gguf.stem + GGUF_RECORD_SUFFIX)


def copy_beside_gguf(draft_dir: str | os.PathLike, gguf: str | os.PathLike, outtype: str) -> Path | None:
    """Copy the draft directory's record beside its GGUF (noting which GGUF); None if the draft has none.

    The copy is for the same weights only: a record whose ``weights_sha256`` is not the draft's is not copied.
    """
    source = Path(draft_dir) / RECORD_NAME
    if not source.is_file():
        return None
    try:
        record = read_record(source)
    except RecordError:  # an unreadable record is not copied; check-serving says so when it is used
        return None
    if stale_weights(record, draft_dir) is not None:
        return None
    record["gguf"] = {"file": Path(gguf).name, "outtype": outtype}
    return write_record(record, gguf_record_path(gguf))


def summary_line(record: dict[str, Any], path: str | os.PathLike | None = None) -> str:
    """One line: the expected τ with its interval, prompts and tokens (and where the record is)."""
    e = record["expected"]
    lo, hi = e["interval"]
    tokens = sum(len(p["continuation_ids"]) for p in record["prompts"])
    iv = f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
    return (
        f"acceptance record: expected tau {e['tau']:.2f}{iv} ({record['path']}, T=0) on {e['prompts']} prompts, "
        f"{tokens} tokens" + (f" -> {path}" if path is not None else "")
    )
