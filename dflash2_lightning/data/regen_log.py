"""The resumable work log of a regeneration, shared by in-process and server regeneration.

Work goes to an append-only log ``<out>.partial`` beside the output:

- line 1 is a header with the settings that shape the responses; a resume with different settings is
  refused instead of mixing two generations in one file;
- then one line per finished response, ``{"index", "hash", "messages"}``, in the order they finish;
  lines are appended in batches with one ``write``, flushed and fsynced (:func:`append_lines`);
- on start the log is read back (:func:`open_log`): a torn last line (a kill in the middle of a write)
  is cut off, and a record whose prompt changed is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from dflash2_lightning.errors import UserError

LOG_SUFFIX = ".partial"
LOG_FORMAT = 1


class RegenError(UserError, RuntimeError):
    """The partial log cannot be resumed with these settings or this prompts file (the message says why)."""


def prompt_hash(messages: list[dict[str, str]]) -> str:
    """A short content hash of a prompt (detects a prompts file edited between two runs)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def read_log(path: Path) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
    """Header and finished records of a partial log, after cutting off a torn last line."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # a kill in the middle of a write: drop the incomplete line for good
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    header: dict[str, Any] | None = None
    records: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(data[:end].splitlines(), 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise RegenError(f"{path}:{n} is not valid JSON: the log is damaged; delete it to start over") from None
        if n == 1:
            header = item.get("regen")
            if header is None:
                raise RegenError(f"{path}:1 is not a regen log header; delete the file to start over")
        else:
            records[int(item["index"])] = item
    return header, records


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines in one write, then flush and fsync (the batch is durable once this returns).

    A write that fails (a full disk) is cut back off, so the log keeps every line finished before it.
    """
    if not lines:
        return
    from dflash2_lightning.files import append_durably

    append_durably(path, "".join(line + "\n" for line in lines))


def output_paths(out_file: str | Path, overwrite: bool) -> tuple[Path, Path, bool]:
    """``(out, its resumable log, finished)``: ``overwrite`` removes both; a finished output drops a stale log.

    Only a finished run leaves both files (the output is renamed into place before the log is removed),
    so an existing output means there is nothing left to generate.
    """
    out = Path(out_file)
    log = out.with_name(out.name + LOG_SUFFIX)
    if overwrite:
        out.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
    if out.exists():
        log.unlink(missing_ok=True)
        return out, log, True
    return out, log, False


def open_log(log: Path, settings: dict[str, Any], hashes: list[str], per_prompt: int = 1) -> dict[int, dict[str, Any]]:
    """The finished records of ``log`` (job ``j`` answers prompt ``j // per_prompt``), or a new log with its header.

    A log started with other ``settings``, or whose records answer prompts that changed or are no longer
    among ``hashes``, is refused (:class:`RegenError`): two generations are never mixed in one file.
    """
    header, done = read_log(log) if log.exists() else (None, {})
    if header is None:  # a fresh run (or a kill before the header was complete)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        append_lines(log, [json.dumps({"regen": settings})])
        return {}
    if header != settings:
        raise RegenError(
            f"{log} was started with other settings ({header}), not {settings}: finish it with "
            "the same settings, or pass --overwrite to start over"
        )
    for j, rec in done.items():
        if j >= len(hashes) * per_prompt or rec["hash"] != hashes[j // per_prompt]:
            raise RegenError(
                f"{log}: prompt {j // per_prompt} differs from the one already generated, or is not "
                f"among the {len(hashes)} prompts of this run (the prompts file or --max-prompts "
                "changed since the interrupted run); pass --overwrite to start over"
            )
    return done
