"""How every command reports a failure: ``dflash2: error: <what>, <where>, <what to do>`` on stderr.

:func:`run_command` wraps a command's entry function (every ``dflash2`` subcommand, LightningCLI's ``fit`` /
``validate`` included, and ``export/to_onnx.py``): a *user error* or a machine fault (a full disk, a dead rank)
prints one line and exits 2 without a traceback (a fit stopped by SIGTERM / SIGUSR1 exits ``128 + signal``,
``UserError.exit_status``; :class:`~dflash2_lightning.errors.ReportedByAnotherRank` exits quietly on the ranks
that did not report); anything else is a bug: the traceback, one line saying so, exit 1. ``--debug`` (anywhere on
the command line) or ``DFLASH2_DEBUG=1`` lets every exception through.

User errors are recognised here, in one place, so every command maps the same faults the same way:
:class:`~dflash2_lightning.errors.UserError` anywhere in the exception's cause/context chain (Lightning and
jsonargparse wrap them; it wins over an OS error beside it), file-system errors (:func:`describe_os_error`, a
temporary's name reported as its final path), network errors (:func:`describe_network_error`), and ``argparse``
usage errors of every subcommand, so a new subcommand gets this style without doing anything (out-of-range
values: :func:`dflash2_lightning.errors.bounded`). The faults users meet: docs/robustness.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dflash2_lightning.errors import (
    FULL_ERRNOS,
    USER_EXIT,
    ReportedByAnotherRank,
    UsageError,
    UserError,
    disk_full_message,
)
from dflash2_lightning.files import final_path, free_bytes

PROG = "dflash2"
DEBUG_FLAG = "--debug"
BUG_EXIT = 1


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the input is wrong", not "the program is wrong"."""
    return (UserError,)


_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
#: errno values that say something about a path the user gave (when the error names it).
PATH_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.EACCES,
        errno.EPERM,
        errno.EEXIST,
        errno.EROFS,
        errno.ENAMETOOLONG,
        errno.ELOOP,
    }
)


def _is_network_error(error: BaseException) -> bool:
    import http.client
    import urllib.error

    return isinstance(error, (ConnectionError, urllib.error.URLError, http.client.HTTPException, TimeoutError))


def _is_user_os_error(error: BaseException) -> bool:
    """A path the user gave is wrong, the disk is full, or a server cannot be reached."""
    if not isinstance(error, OSError):
        return _is_network_error(error)
    if _is_network_error(error):
        return True
    if error.errno in FULL_ERRNOS:
        return True
    if isinstance(error, _PATH_ERRORS) and error.errno is None:  # our own code raised it with a message
        return True
    return error.errno in PATH_ERRNOS and getattr(error, "filename", None) is not None


def exception_chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception in its cause/context chain, breadth first, each once."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        stack += [current.__cause__, current.__context__]
    return chain


def find_user_error(error: BaseException) -> BaseException | None:
    """The first user error in ``error``'s cause/context chain (``error`` itself first), or None.

    A :class:`UserError` anywhere in the chain is preferred to an OS or network error: it is the message
    the program wrote for this very case.
    """
    chain = exception_chain(error)
    types = user_error_types()
    found = next((e for e in chain if isinstance(e, types)), None)
    return found if found is not None else next((e for e in chain if _is_user_os_error(e)), None)


def _first_file_above(path: str) -> str | None:
    """The nearest ancestor of ``path`` that exists and is not a directory (why ENOTDIR was raised)."""
    from pathlib import Path

    for parent in Path(path).parents:
        if parent.exists():
            return None if parent.is_dir() else str(parent)
    return None


def describe_os_error(error: OSError) -> str:
    """One line for a file-system error: the (final) path, what is wrong with it, what to do."""
    raw = error.filename if error.filename is not None else getattr(error, "filename2", None)
    path = str(final_path(raw)) if raw is not None else None
    code = error.errno
    if code in FULL_ERRNOS or (code is None and "No space left" in str(error)):
        return disk_full_message(path, None, free_bytes(path) if path else None)
    if path is None:
        return error.strerror or str(error) or type(error).__name__
    if code == errno.ENOENT or isinstance(error, FileNotFoundError):
        return f"{path} does not exist: check the path given in the command or the config"
    if code == errno.EISDIR or isinstance(error, IsADirectoryError):
        return f"{path} is a directory, not a file: give a file path"
    if code == errno.ENOTDIR or isinstance(error, NotADirectoryError):
        blocker = _first_file_above(path)
        if blocker is not None:
            return f"{path} cannot be written: {blocker} is a file, not a directory; choose another path"
        return f"{path} is not a directory: check the path given in the command or the config"
    if code == errno.EEXIST or isinstance(error, FileExistsError):
        from pathlib import Path

        if Path(path).exists() and not Path(path).is_dir():
            return f"{path} is a file, where a directory is needed: remove it or choose another path"
        return f"{path} already exists: remove it or choose another path"
    if code == errno.EROFS:
        return (
            f"{path} is on a read-only file system: write somewhere writable (the --out / save_dir / "
            "cache_dir given, or run from a writable directory)"
        )
    if code in (errno.EACCES, errno.EPERM) or isinstance(error, PermissionError):
        return f"{path} cannot be accessed (permission denied): check its permissions, or choose another path"
    return f"{path}: {error.strerror or error}"


def describe_network_error(error: BaseException) -> str:
    """One line for a server that cannot be reached, answers with an HTTP error, or does not speak HTTP."""
    import http.client
    import urllib.error

    if isinstance(error, urllib.error.HTTPError):
        return (
            f"{error.url or error.filename} answered HTTP {error.code} ({error.reason}): check the server's log "
            "and the URL, then rerun"
        )
    if isinstance(error, http.client.IncompleteRead):
        return (
            f"the server's answer was cut off ({len(error.partial)} bytes of "
            f"{len(error.partial) + (error.expected or 0)} received): check the server's log, then rerun"
        )
    if isinstance(error, http.client.HTTPException) and not isinstance(error, ConnectionError):
        return (
            f"the server did not answer with HTTP ({type(error).__name__}: '{printable(str(error), 80)}'): is the "
            "URL the server's HTTP address (host and port)?"
        )
    reason = getattr(error, "reason", None) or error
    return (
        f"cannot reach the server ({printable(str(reason), 200)}): is it running, and is the URL right? Rerun the "
        "same command once it answers"
    )


def printable(text: str, limit: int | None = None) -> str:
    """``text`` on one line, as a terminal shows it safely: line breaks, carriage returns and tabs become spaces,
    other control bytes (NUL, escape sequences) their ``\\xNN`` escapes; cut to ``limit`` characters (``...`` added).

    What a message echoes from outside (a server's answer, a file's bytes) goes through this, so an error stays
    one readable line."""
    out = []
    for ch in text:
        if ch in "\n\r\t\v\f":
            out.append(" ")
        elif not ch.isprintable():
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    line = "".join(out)
    return line if limit is None or len(line) <= limit else line[:limit] + " ..."


def describe(error: BaseException) -> str:
    """The message of a user error, without Python's decoration."""
    if not isinstance(error, UserError):
        if _is_network_error(error):
            return describe_network_error(error)
        if isinstance(error, OSError):
            return describe_os_error(error)
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and len(error.args) == 1:
        text = str(error.args[0])
    return text


def print_error(message: str, prog: str = PROG) -> None:
    """``<prog>: error: <message>`` on stderr, always one line (:func:`printable`)."""
    print(f"{prog}: error: {printable(message)}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _argparse_errors_raise() -> Iterator[None]:
    """Within the block, a stdlib ``argparse`` usage error raises :class:`UsageError` instead of exiting.

    ``argparse.ArgumentParser.error`` prints the whole usage text and exits; every subcommand's parser
    (including ones added later) reports through this instead. jsonargparse's parser (LightningCLI)
    overrides ``error`` itself and is configured separately (``exit_on_error=False``).
    """
    original = argparse.ArgumentParser.error

    def error(self: argparse.ArgumentParser, message: str) -> Any:
        raise UsageError(f"{self.prog}: {message}; run `{self.prog} --help` for the options")

    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


def split_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (before a ``--``), and whether it was there or ``DFLASH2_DEBUG`` is set."""
    args, debug, rest = [], os.environ.get("DFLASH2_DEBUG", "") not in ("", "0"), False
    for a in argv:
        if not rest and a == DEBUG_FLAG:
            debug = True
            continue
        rest = rest or a == "--"
        args.append(a)
    return args, debug


def run_command(
    function: Callable[[list[str]], Any],
    argv: Sequence[str],
    prog: str = PROG,
    formatters: Sequence[Callable[[BaseException], str | None]] = (),
) -> int | None:
    """Run ``function(argv)`` under the error style of this module; returns its exit status.

    ``formatters`` turn an exception the caller knows how to explain (jsonargparse's errors) into a
    user-error message (or None: not theirs). ``SystemExit`` (``--help``, a command's own exit) passes.
    """
    args, debug = split_debug(argv)
    with _argparse_errors_raise():
        if debug:
            return function(args)
        try:
            return function(args)
        except KeyboardInterrupt:
            print_error("interrupted", prog)
            return 130
        except Exception as error:
            for formatter in formatters:
                message = formatter(error)
                if message is not None:
                    print_error(message, prog)
                    return USER_EXIT
            cause = find_user_error(error)
            if cause is not None:
                if not isinstance(cause, ReportedByAnotherRank):  # rank 0 prints that one
                    print_error(describe(cause), prog)
                return getattr(cause, "exit_status", USER_EXIT)  # an OS error has none: 2
            traceback.print_exc()
            print_error(
                f"internal error ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                f"this is a bug, please report it with the traceback above (rerun with {DEBUG_FLAG} "
                "for the full chain)",
                prog,
            )
            return BUG_EXIT
