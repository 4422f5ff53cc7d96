"""The error types every stage raises for bad input, and the one wording of their messages.

:class:`UserError` (and its subclasses per stage: ``ConfigError``, ``TargetError``, ``DataError``,
``CheckpointError`` ...) means "the input is wrong", not "the program is wrong";
:mod:`dflash2_lightning.reporting` turns it into one line, ``dflash2: error: <what>, <where>, <what to do>``,
and exit status 2. Here too: :func:`check` (the one form of a setting's range check), :func:`bounded` (an
argparse ``type=`` that says the bound, checked when the command line is parsed) and the wording of a full
disk (:func:`disk_full_message`, :class:`DiskFullError`).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
from collections.abc import Callable
from typing import Any

#: exit status of a user error (a bug exits with 1: see :mod:`dflash2_lightning.reporting`).
USER_EXIT = 2


class UserError(Exception):
    """Base of every error that means "the input is wrong", not "the program is wrong".

    Subclasses name their stage (``ConfigError``, ``TargetError``, ``DataError``, ``CheckpointError`` ...);
    :func:`~dflash2_lightning.reporting.run_command` prints their message as one line and exits with
    :attr:`exit_status`: 2, unless the error says otherwise (a fit stopped by a signal exits ``128 + signal``,
    as a process killed by it would: :class:`~dflash2_lightning.train.preemption.FitInterrupted`).
    """

    exit_status: int = USER_EXIT


class ConfigError(UserError, ValueError):
    """A setting is out of its allowed range (the message names the field, the value and the bound)."""


class UsageError(UserError):
    """A command-line usage error (unknown option, bad value); the message says which and how to get help."""


def check(ok: bool, name: str, value: Any, bound: str, error: type[UserError] = ConfigError, verb: str = "be") -> None:
    """Unless ``ok``, raise ``error`` saying ``<name>=<value> is invalid: must <verb> <bound>``: the one form of
    every setting's range check (``verb="satisfy"`` where the bound is an expression,
    ``1 <= conv_kernel_size <= block_size=4``)."""
    if not ok:
        raise error(f"{name}={value!r} is invalid: must {verb} {bound}")


class ReportedByAnotherRank(UserError):
    """A user error of a multi-process job that rank 0 reports: this process exits with status 2 (or
    ``exit_status``, rank 0's own) and prints nothing, so the user reads the error once, not once per process."""

    def __init__(self, message: str = "", exit_status: int = USER_EXIT) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class DiskFullError(UserError):
    """A write ran out of space; the message names the final path, what it needed and what is free."""


def format_bytes(n: float | None) -> str:
    """``1.2 MB``-style size (decimal units, as ``df -H`` and file managers print them)."""
    if n is None:
        return "unknown"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_full_message(
    path: str | os.PathLike | None, needed: int | None = None, free: int | None = None, at_least: bool = False
) -> str:
    """``disk full while writing PATH (needed N, free M): ...``: the one wording of a full disk (``path``
    None: the writer did not say which file)."""
    parts = []
    if needed is not None:
        parts.append(f"needed {'more than ' if at_least else ''}{format_bytes(needed)}")
    if free is not None:
        parts.append(f"free {format_bytes(free)}")
    detail = f" ({', '.join(parts)})" if parts else ""
    what = f"while writing {path}" if path is not None else "(no space left on device)"
    return f"disk full {what}{detail}: free space on that disk, or write to another one (earlier files are unchanged)"


def bounded(
    kind: Callable[[str], Any], low: Any = None, high: Any = None, low_open: bool = False
) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses with ``kind`` and refuses a value outside ``[low, high]``
    (``(low, high]`` with ``low_open``), saying the bound: ``argument --concurrency: 0 is invalid: must be >= 1``.
    A float that is not finite (``nan``, ``inf``) is refused whatever the bounds.

    Checked when the command line is parsed, before anything is loaded or computed.
    """

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: must be a{'n' if kind is int else ''} {getattr(kind, '__name__', 'value')}"
            ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is invalid: must be a finite number")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and value > high
        if too_low or too_high:
            bound = " and ".join(
                b
                for b in (
                    f"{'>' if low_open else '>='} {low}" if low is not None else "",
                    f"<= {high}" if high is not None else "",
                )
                if b
            )
            raise argparse.ArgumentTypeError(f"{text} is invalid: must be {bound}")
        return value

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


#: errno values of a full disk or quota: always the machine's state, never a bug.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
