"""Files the project writes: atomically, readable by other users, with temporaries a crash can clean up.

Atomic writes (:func:`atomic_write`, :func:`atomic_write_text`): the bytes go to a temporary file in the
final path's own directory, are fsynced and renamed into place, and the directory is fsynced, so a kill
at any moment leaves the previous complete file or the new one. Files and directories get the mode the
umask gives (:func:`file_mode`, :func:`dir_mode`), not ``mkstemp``'s private ``0600``: engines and
servers often run as another user.

Temporaries. Every atomic write in the project (checkpoints, the HF export, the feature cache, a converted GGUF)
goes to a temporary file or directory in the final path's own directory and is renamed into place.
A ``kill -9`` in the middle leaves the temporary behind, and at real scale those are gigabytes. The
name says who made it::

    .<final name>.<host>-<pid>.<random>.tmp

so :func:`remove_stale` can delete exactly the leftovers of *dead* processes of this host, and never a
file another live process (a second run, a DDP rank, another user's job on a shared directory) is
still writing. Names without an owner (other tools, older versions) are left alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SUFFIX = ".tmp"


def _host() -> str:
    # Dots and dashes would blur the name's fields; a host name is only compared, never parsed further.
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def owner_prefix(name: str) -> str:
    """The temporary-name prefix for final name ``name`` owned by this process: ``.<name>.<host>-<pid>.``."""
    return f".{name}.{_host()}-{os.getpid()}."


def make_temp_file(final: str | os.PathLike) -> tuple[int, str]:
    """``mkstemp`` beside ``final`` with an owner-stamped name; returns ``(fd, path)`` like ``mkstemp``."""
    final = Path(final)
    return tempfile.mkstemp(prefix=owner_prefix(final.name), suffix=SUFFIX, dir=final.parent)


def make_temp_dir(final: str | os.PathLike) -> Path:
    """``mkdtemp`` beside ``final`` with an owner-stamped name."""
    final = Path(final)
    return Path(tempfile.mkdtemp(prefix=owner_prefix(final.name), suffix=SUFFIX, dir=final.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    return True


def stale(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Owner-stamped temporaries in ``directory`` (for final name ``name``, or any) whose owner has died.

    Only this host's processes can be checked; another host's temporaries are never listed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)\.[^.]+" + re.escape(SUFFIX) + "$")
    host, me = _host(), os.getpid()
    found = []
    for entry in directory.iterdir():
        m = pattern.match(entry.name)
        if m is None or m["host"] != host or (name is not None and m["name"] != name):
            continue
        pid = int(m["pid"])
        if pid != me and not _alive(pid):
            found.append(entry)
    return sorted(found)


def remove_stale(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Delete :func:`stale` temporaries (files or directories); returns what was removed."""
    removed = []
    for path in stale(directory, name):
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:  # another process cleaning the same directory got there first
            continue
        removed.append(path)
    if removed:
        log.info("removed %d temporary file(s) left by killed runs in %s", len(removed), directory)
    return removed


# ----------------------------------------------------------------------------- atomic writes
def _umask() -> int:
    umask = os.umask(0)  # the only portable way to read it: set and restore at once
    os.umask(umask)
    return umask


def file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask (``0o644`` under umask 022)."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode ``mkdir`` gives a new directory under the current umask (``0o755`` under umask 022)."""
    return 0o777 & ~_umask()


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then atomically rename ``tmp_path`` to ``path`` (same directory, fsynced).

    The file ends up with the ordinary mode the umask gives (``0o644`` under umask 022), whatever
    ``write`` did: ``mkstemp`` creates ``0o600`` and some writers (``safetensors``) replace the temporary
    file with a fresh one, so the mode is set *after* writing. Engines often run as another user.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_temp_file(path)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems refuse directory fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    def write(tmp: str) -> None:
        Path(tmp).write_text(text)
    atomic_write(path, write)
