"""Files the project writes: atomically, readable by other users, with temporaries a crash can clean up.

Atomic writes (:func:`atomic_write`, :func:`atomic_write_text`): the bytes go to a temporary in the final path's
own directory, are fsynced and renamed into place, and the directory is fsynced, so a kill at any moment leaves
the previous complete file or the new one. Modes follow the umask (:func:`file_mode`, :func:`dir_mode`), not
``mkstemp``'s private ``0600``: engines and servers often run as another user.

Temporaries are named ``.<final name>.<host>-<pid>.<random>.tmp``, so :func:`remove_stale` deletes exactly the
leftovers of *dead* processes of this host (at scale, gigabytes) and never a file a live process is still
writing; names without an owner are left alone. Errors name the final path (:func:`final_path`), never the
temporary. Full disks: :func:`check_free_space` refuses a write of known size up front; one that runs out anyway
is a :class:`~dflash2_lightning.errors.DiskFullError` naming the final path, the previous file untouched;
:func:`preallocate` reserves a memory-mapped file's blocks first, so a full disk is an error, never a ``SIGBUS``.
Locks: :func:`lock_nowait` takes an exclusive ``flock`` without waiting (the run directory's lock and the cache
build's), which the kernel drops when its holder dies, however it dies. What users see: docs/robustness.md.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from dflash2_lightning.errors import FULL_ERRNOS, DiskFullError, UserError, disk_full_message

log = logging.getLogger(__name__)

SUFFIX = ".tmp"
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)\.[^.]+" + re.escape(SUFFIX) + "$")
#: a write that fails with less than this free on its file system failed for want of space
NEARLY_FULL_BYTES = 1 << 20


def host_name() -> str:
    """This host's name as temporaries and locks record it (letters, digits and ``_`` only)."""
    # Dots and dashes would blur the name's fields; a host name is only compared, never parsed further.
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def owner_prefix(name: str) -> str:
    """The temporary-name prefix for final name ``name`` owned by this process: ``.<name>.<host>-<pid>.``."""
    return f".{name}.{host_name()}-{os.getpid()}."


def make_temp_file(final: str | os.PathLike) -> tuple[int, str]:
    """``mkstemp`` beside ``final`` with an owner-stamped name; returns ``(fd, path)`` like ``mkstemp``."""
    final = Path(final)
    return tempfile.mkstemp(prefix=owner_prefix(final.name), suffix=SUFFIX, dir=final.parent)


def make_temp_dir(final: str | os.PathLike) -> Path:
    """``mkdtemp`` beside ``final`` with an owner-stamped name."""
    final = Path(final)
    return Path(tempfile.mkdtemp(prefix=owner_prefix(final.name), suffix=SUFFIX, dir=final.parent))


def final_path(path: str | os.PathLike) -> Path:
    """The final path an owner-stamped temporary was written for (``path`` itself for any other name)."""
    path = Path(path)
    m = _TEMP_NAME.match(path.name)
    return path.with_name(m["name"]) if m else path


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (another user's process counts as alive)."""
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
    host, me = host_name(), os.getpid()
    found = []
    for entry in directory.iterdir():
        m = _TEMP_NAME.match(entry.name)
        if m is None or m["host"] != host or (name is not None and m["name"] != name):
            continue
        pid = int(m["pid"])
        if pid != me and not process_alive(pid):
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


# ----------------------------------------------------------------------------- locks
class Lock(enum.Enum):
    """What :func:`lock_nowait` got."""

    HELD = "held"  # this process holds the lock
    BUSY = "busy"  # another process holds it
    UNSUPPORTED = "unsupported"  # this file system has no flock (some network mounts): nothing was locked


#: flock's errors on file systems that do not support it.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def lock_nowait(path: str | os.PathLike) -> tuple[int, Lock]:
    """Open ``path`` (created ``0o644``, close-on-exec) and take an exclusive ``flock`` on it without waiting.

    Returns the open descriptor (the caller closes it; closing releases the lock) and what it got. Other
    errors than a busy lock or a file system without flock are raised, with the descriptor closed.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return fd, Lock.BUSY
        if error.errno in _NO_FLOCK:
            return fd, Lock.UNSUPPORTED
        os.close(fd)
        raise
    return fd, Lock.HELD


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


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the file system of ``path`` (or of its nearest existing ancestor)."""
    here = Path(path)
    for candidate in (here, *here.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def check_writable(path: str | os.PathLike, directory: bool = False) -> None:
    """Refuse, before any work, an output path that cannot be written: a directory where a file is wanted
    (or a file where a directory is), a file among its parents, a read-only file system, no permission.

    Raises the ``OSError`` the write would raise, naming ``path``; the command's error handler
    (:func:`dflash2_lightning.reporting.describe_os_error`) turns it into one line saying what to do.
    """
    path = Path(path).expanduser()
    if path.exists():
        if path.is_dir() and not directory:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if directory and not path.is_dir():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
    existing = next(
        (p for p in (path if directory and path.is_dir() else path.parent, *path.parents) if p.exists()), None
    )
    if existing is None:
        return
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        code = errno.EROFS if read_only else errno.EACCES
        raise OSError(code, os.strerror(code), str(path))


def check_free_space(directory: str | os.PathLike, needed: int, what: str | os.PathLike) -> None:
    """Refuse a write of ``needed`` bytes into ``directory`` that cannot fit, before any byte is written.

    Raises :class:`~dflash2_lightning.errors.DiskFullError` ``disk full while writing <what> (needed N, free M)``.
    """
    free = free_bytes(directory)
    if free is not None and needed > free:
        raise DiskFullError(disk_full_message(what, needed, free))


def is_disk_full(error: BaseException, directory: str | os.PathLike) -> bool:
    """Whether ``error``, raised while writing into ``directory``, means the disk is full.

    Writers report a full disk in many ways (``OSError`` ENOSPC, numpy's ``8192 requested and 3104
    written``, torch's ``unexpected pos``, safetensors' ``I/O error``); any error raised while the file
    system has under :data:`NEARLY_FULL_BYTES` free counts, as does ENOSPC anywhere in the chain.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "errno", None) in FULL_ERRNOS or "No space left on device" in str(current):
            return True
        current = current.__cause__ or current.__context__
    free = free_bytes(directory)
    return free is not None and free < NEARLY_FULL_BYTES


def _renamed(error: OSError, path: Path) -> OSError:
    """``error`` (same errno, same type) naming ``path`` instead of a temporary file."""
    if error.errno is None:
        return error
    renamed = OSError(error.errno, error.strerror or os.strerror(error.errno), str(path))
    renamed.__cause__ = error
    return renamed


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], size: int | None = None) -> None:
    """Call ``write(tmp_path)`` then atomically rename ``tmp_path`` to ``path`` (same directory, fsynced).

    The file ends up with the ordinary mode the umask gives (``0o644`` under umask 022), whatever
    ``write`` did: ``mkstemp`` creates ``0o600`` and some writers (``safetensors``) replace the temporary
    file with a fresh one, so the mode is set *after* writing. Engines often run as another user.

    ``size``: the bytes the file will take (or a lower bound), when known: a disk without that much free
    space is refused before anything is written. Whatever happens, an existing ``path`` is either left as it was or
    replaced whole; errors name ``path``, never the temporary file (a full disk is a
    :class:`~dflash2_lightning.errors.DiskFullError`).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if size is not None:
            check_free_space(path.parent, size, path)
        fd, tmp = make_temp_file(path)
    except FileExistsError as error:  # a parent is a file
        raise _renamed(error, Path(error.filename or path)) from None
    except OSError as error:
        if error.errno in FULL_ERRNOS:
            raise DiskFullError(disk_full_message(path, size, free_bytes(path.parent))) from error
        raise _renamed(
            error, path if error.filename is None or final_path(error.filename) == path else Path(error.filename)
        ) from None
    os.close(fd)
    free = free_bytes(path.parent)  # before: what a full disk's message reports as free
    try:
        try:
            write(tmp)
            os.chmod(tmp, file_mode())
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as error:
            if not isinstance(error, UserError) and is_disk_full(error, path.parent):
                written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
                needed, at_least = (size, False) if size is not None and size > written else (written, True)
                raise DiskFullError(disk_full_message(path, needed, free, at_least)) from error
            if isinstance(error, OSError) and error.filename is not None and final_path(error.filename) == path:
                raise _renamed(error, path) from None
            raise
        _fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def append_durably(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to ``path`` in one write, flush and fsync it: durable once this returns.

    A failed write (a full disk) is cut back off, so the file keeps exactly what it held before, and
    the error names ``path`` (a full disk is a :class:`~dflash2_lightning.errors.DiskFullError`).
    """
    path = Path(path)
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode())
    try:
        before = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # unbuffered: a failed write leaves nothing queued to flush later
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as error:
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            if is_disk_full(error, path.parent):
                raise DiskFullError(disk_full_message(path, len(data), free_bytes(path.parent))) from error
            raise _renamed(error, path) from None
    finally:
        os.close(fd)


def preallocate(path: str | os.PathLike, size: int) -> None:
    """Reserve the blocks of the first ``size`` bytes of ``path`` (an existing file, e.g. a new memory map).

    Writing into a sparse memory-mapped file on a full disk kills the process with ``SIGBUS``; once the
    blocks are allocated the writes cannot fail, and a full disk is a
    :class:`~dflash2_lightning.errors.DiskFullError` here instead.
    """
    path = Path(path)
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in FULL_ERRNOS:
            raise DiskFullError(disk_full_message(path, size, free_bytes(path.parent))) from None
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise _renamed(error, path) from None
    finally:
        os.close(fd)


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
