"""One error style for every command: ``dflash2: error: <what>, <where>, <what to do>`` on stderr.

:func:`run_command` wraps a command's entry function (every ``dflash2`` subcommand, LightningCLI's
``fit`` / ``validate`` included, and ``export/to_onnx.py``):

- a *user error* (bad config, data, target, checkpoint, file path or argument) prints one short
  message and exits with status 2, no traceback;
- anything else is a bug: the traceback is printed, then one line saying so, exit status 1;
- ``--debug`` (anywhere on the command line) or ``DFLASH2_DEBUG=1`` lets every exception through
  with its full traceback.

User errors are recognised by type (:class:`UserError` and its subclasses, found anywhere in the
exception's cause/context chain, since Lightning and jsonargparse wrap them), plus file-system errors that
name a file (a missing or unreadable path the user gave). ``argparse`` usage errors of any subcommand are
routed here too, so a new subcommand gets this style without doing anything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

PROG = "dflash2"
DEBUG_FLAG = "--debug"
USER_EXIT = 2
BUG_EXIT = 1

class UserError(Exception):
    """Base of every error that means "the input is wrong", not "the program is wrong".

    Subclasses name their stage (``ConfigError``, ``TargetError``, ``DataError``, ``CheckpointError`` ...);
    :func:`run_command` prints their message as one line and exits with status 2.
    """


class ConfigError(UserError, ValueError):
    """A setting is out of its allowed range (the message names the field, the value and the bound)."""


class UsageError(UserError):
    """A command-line usage error (unknown option, bad value); the message says which and how to get help."""


def check(ok: bool, name: str, value: Any, bound: str, error: type[UserError] = ConfigError,
          verb: str = "be") -> None:
    """Unless ``ok``, raise ``error`` saying ``<name>=<value> is invalid: must <verb> <bound>``: the one form of
    every setting's range check (``verb="satisfy"`` where the bound is an expression,
    ``1 <= conv_kernel_size <= block_size=4``)."""
    if not ok:
        raise error(f"{name}={value!r} is invalid: must {verb} {bound}")


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the input is wrong", not "the program is wrong"."""
    return (UserError,)


_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def _is_user_os_error(error: BaseException) -> bool:
    """A path the user gave is wrong: the OS names the file, or our own code raised it with a message."""
    return isinstance(error, _PATH_ERRORS) and (getattr(error, "filename", None) is not None or error.errno is None)


def find_user_error(error: BaseException) -> BaseException | None:
    """The first user error in ``error``'s cause/context chain (``error`` itself first), or None."""
    types = user_error_types()
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, types) or _is_user_os_error(current):
            return current
        stack += [current.__cause__, current.__context__]
    return None


def describe(error: BaseException) -> str:
    """The message of a user error, without Python's decoration."""
    if _is_user_os_error(error) and isinstance(error, OSError) and error.filename is not None:
        what = {FileNotFoundError: "does not exist", IsADirectoryError: "is a directory, not a file",
                NotADirectoryError: "is not a directory", PermissionError: "cannot be accessed (permission denied)"}
        text = next((v for k, v in what.items() if isinstance(error, k)), error.strerror or str(error))
        return f"{error.filename} {text}: check the path given in the command or the config"
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and len(error.args) == 1:
        text = str(error.args[0])
    return text


def print_error(message: str, prog: str = PROG) -> None:
    """``<prog>: error: <message>`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


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


def run_command(function: Callable[[list[str]], Any], argv: Sequence[str], prog: str = PROG,
                formatters: Sequence[Callable[[BaseException], str | None]] = ()) -> int | None:
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
                print_error(describe(cause), prog)
                return USER_EXIT
            traceback.print_exc()
            print_error(f"internal error ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                        f"this is a bug, please report it with the traceback above (rerun with {DEBUG_FLAG} "
                        "for the full chain)", prog)
            return BUG_EXIT
