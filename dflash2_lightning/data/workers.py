"""Whether DataLoader worker processes can be forked safely on this interpreter.

CPython 3.11.0-3.11.7 (and 3.8-3.10) can deadlock a child right after ``fork()`` when another thread of the
parent was starting or ending at that instant: the child inherits the interpreter's thread-state lock held and
waits on it forever (CPython gh-112275, fixed in 3.11.8). A training process has such threads (the queue feeders
of the training loader's persistent workers start just before the validation loader forks its own), so a
DataLoader worker can hang the fit with no error; it was seen once on 3.11.7 in this project's CI, a resumed DDP
fit stuck at its first validation. Python >= 3.11.8, the ``spawn``/``forkserver`` start methods, or
``num_workers: 0`` avoid it.
"""

from __future__ import annotations

import multiprocessing
import platform
import sys

__all__ = ["fork_deadlock_risk"]

FIXED_IN = (3, 11, 8)


def fork_deadlock_risk(version: tuple[int, ...] | None = None, start_method: str | None = None) -> str | None:
    """Why forked DataLoader workers may hang on this interpreter (a sentence for a warning), or None.

    Args:
        version: the interpreter's version (default: this one's ``sys.version_info``).
        start_method: the multiprocessing start method the workers use (default: this process's, ``fork`` on
            Linux unless set).
    """
    if version is None:
        if sys.implementation.name != "cpython":
            return None
        version = tuple(sys.version_info[:3])
    # Not get_start_method() unset: it would fix the default for the whole process as a side effect.
    method = (
        start_method or multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    )
    if method != "fork" or tuple(version[:3]) >= FIXED_IN:
        return None
    shown = platform.python_version() if version == tuple(sys.version_info[:3]) else ".".join(map(str, version))
    return (
        f"Python {shown} can deadlock a DataLoader worker as it forks (CPython gh-112275, fixed in 3.11.8), "
        "which hangs the fit without an error; use Python >= 3.11.8, or data num_workers 0"
    )
