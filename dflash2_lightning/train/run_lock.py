"""One fit at a time in a run directory: ``<run dir>/.fit.lock``.

Two ``dflash2 fit`` processes in one run directory would both append to ``metrics.csv`` (every row
twice), race for ``last.ckpt`` (Lightning then writes ``last-v1.ckpt``) and each write a TensorBoard
file. The first fit takes the lock; a second one is refused in one line naming the holder (host, pid,
when it started) before it writes anything.

The lock is an ``flock`` on the file, which the kernel drops when its holder dies, however it dies
(``kill -9``, a crash, a lost node): a killed run never leaves a lock behind that blocks the next one.
The file records its holder (``host``, ``pid``, ``started``) for the message. Where the file system has no
``flock`` (some network mounts), the recorded holder is checked instead: a process of this host that no
longer exists (:func:`dflash2_lightning.files.process_alive`) holds nothing; a holder on another host cannot
be checked, so the message says to delete the file if no run is active there.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from dflash2_lightning.errors import UserError
from dflash2_lightning.files import Lock, host_name, lock_nowait, process_alive

LOCK_NAME = ".fit.lock"


class RunLockedError(UserError):
    """Another fit holds the run directory (the message names it and what to do)."""


class RunLock:
    """The lock of one run directory, held from :meth:`acquire` to :meth:`release` (or the process's death)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunLockedError` if a live fit holds it (never waits)."""
        if self._fd is not None:
            return
        missing = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._created = missing  # removed again on release while empty: a refused run leaves no directory
        while True:
            fd, state = lock_nowait(self.path)
            if state is Lock.BUSY:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockedError(self._message(holder))
            if state is Lock.UNSUPPORTED:
                self._check_recorded_holder(fd)  # no flock here: the recorded holder decides
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)  # the holder released and deleted it between our open and our lock: take the new one
        holder = {"host": host_name(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (the file is deleted while still held, so no one locks a stale file)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(fd)
        for directory in self._created:  # deepest first; only the ones this lock made, only while empty
            try:
                directory.rmdir()
            except OSError:
                break
        self._created = []

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _check_recorded_holder(self, fd: int) -> None:
        holder = _read_holder(fd)
        if not holder or (holder.get("host"), holder.get("pid")) == (host_name(), os.getpid()):
            return
        if holder.get("host") == host_name() and not process_alive(int(holder.get("pid", 0))):
            return  # a killed run's lock
        os.close(fd)
        raise RunLockedError(self._message(holder, checked=holder.get("host") == host_name()))

    def _message(self, holder: dict[str, Any] | None, checked: bool = True) -> str:
        who = (
            f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
            if holder
            else "another process"
        )
        text = (
            f"run directory {self.run_dir} is in use by another fit ({who}): wait for it to finish, or give "
            "this run another logger version or save_dir (in the config's trainer.logger)"
        )
        if not checked:
            text += f"; if no run is active on that host, delete {self.path}"
        return text


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        holder = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None
