"""The processes of a multi-process fit: a rank that dies is one line naming it, and no process is left behind.

Lightning 2.6's DDP launcher (``_SubprocessScriptLauncher``) starts ranks 1..n-1 of a node as children of rank 0
and, when a child exits with an error, SIGKILLs every process, rank 0 included, without a word; before it notices,
rank 0's next collective fails (gloo) or waits for its timeout (NCCL) and the command reports a bug.
:class:`WatchedLauncher` replaces it for the fits of this CLI (same children, same command line):

- on rank 0, a thread polls the children; a collective error after a peer died (:func:`is_peer_failure`) becomes
  :class:`RankDiedError`, one line naming the rank and how it died, exit 2 (a machine fault); if rank 0 is not in a
  collective, the thread reports the same line itself after :data:`DEATH_GRACE_S` and ends the others;
- on a child, a thread watches the launcher and stops the child after :data:`DEATH_GRACE_S` if it dies; a
  collective error while the launcher lives is left to it, so the user reads one line, not one per rank;
- when the fit fails or is interrupted, rank 0 waits :data:`EXIT_GRACE_S` for its children and kills the rest.

Ranks started by an external launcher (``torchrun``, ``srun``) each report a lost peer in their own line and the
launcher ends the job. A child that exits after an agreed stop (:mod:`~dflash2_lightning.train.preemption`) is not a
death. What users see: docs/robustness.md ("Preemption: SIGTERM, SIGUSR1 and dead ranks").
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash2_lightning.errors import ReportedByAnotherRank, UserError
from dflash2_lightning.reporting import exception_chain, print_error
from dflash2_lightning.train.lightning_internals import (
    SubprocessScriptLauncher,
    replace_launcher,
    set_num_threads_if_needed,
)
from dflash2_lightning.train.preemption import STOP, FitInterrupted

#: seconds a dead peer is given to surface as an error in the main thread before the watcher reports it itself
DEATH_GRACE_S = 5.0
#: seconds rank 0 waits for its child ranks to end after a failure before it kills them
EXIT_GRACE_S = 10.0
#: how often the watchers look (seconds)
POLL_S = 0.25
#: how a child rank knows which process launched it (set by the launcher for its children)
LAUNCHER_PID_ENV = "DFLASH2_LAUNCHER_PID"

#: what torch.distributed's backends say when the process at the other end of a collective is gone
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "gloo/transport/tcp",
    "NCCL communicator was aborted",
    "remote process exited",
    "Socket closed",
)


class RankDiedError(UserError):
    """A rank of a multi-process fit died (or lost its peers): one line naming it and the cause, exit status 2."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or its cause/context) is a collective failing because another rank is gone."""
    network_error = getattr(torch.distributed, "DistNetworkError", ())
    for e in exception_chain(error):
        if network_error and isinstance(e, network_error):
            return True
        if isinstance(e, RuntimeError) and any(text in str(e) for text in PEER_GONE):
            return True
    return False


def peer_failure_words(error: BaseException) -> str:
    """The backend's words for the lost peer (``gloo: Connection closed by peer``), for the message."""
    for e in exception_chain(error):
        text = str(e)
        for words in PEER_GONE:
            if words in text and words != "gloo/transport/tcp":
                return f"{'gloo' if 'gloo' in text else 'NCCL' if 'NCCL' in text else 'torch.distributed'}: {words}"
    return type(error).__name__


def describe_exit(returncode: int) -> str:
    """How a process ended, from its exit status (``killed by SIGKILL``, ``stopped by SIGTERM (exit status 143)``)."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode > 128:
        try:
            return f"was stopped by {signal.Signals(returncode - 128).name} (exit status {returncode})"
        except ValueError:
            pass
    return f"exited with status {returncode}"


def stop_signal_of(returncode: int) -> int | None:
    """The stop signal (SIGTERM, SIGUSR1) a process's exit status says ended it (``-15`` or ``143``), if any."""
    for signum in STOP.signals:
        if returncode in (-signum, 128 + signum):
            return int(signum)
    return None


def where_in_fit(trainer: Any) -> str:
    """``at step 17`` (``before the first training step`` at step 0)."""
    step = getattr(trainer, "global_step", 0) if trainer is not None else 0
    return f"at step {step}" if step else "before the first training step"


@dataclass(frozen=True)
class Death:
    """A child rank that ended with an error: its global rank, pid and exit status."""

    rank: int
    pid: int
    returncode: int


class WatchedLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher with watchers that report a dead rank in one line (module docstring).

    ``command``: how to resume the fit (for the message).
    """

    def __init__(self, launcher: SubprocessScriptLauncher, command: str) -> None:
        super().__init__(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
        self.command = command
        self.trainer: Any = None
        self.parent_pid: int | None = None  # the launcher's pid, on a child rank it launched
        self._lock = threading.Lock()
        self._reported = False
        self._ended = threading.Event()
        self._exit = os._exit  # how a watcher ends the process (a test may replace it)

    # ------------------------------------------------------------------ launching
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Start the child ranks (on rank 0 of a node) and the watcher threads, then run ``function``."""
        self.trainer = trainer
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the children inherit it
            self._call_children_scripts()  # Lightning's private starter (probed by lightning_internals)
            STOP.abort_hooks.append(self.kill_children)
            self._start(self._watch_children, "dflash2-rank-watch")
        elif os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid()):
            self.parent_pid = os.getppid()
            self._start(self._watch_launcher, "dflash2-launcher-watch")
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _start(self, target: Callable[[], None], name: str) -> None:
        threading.Thread(target=target, name=name, daemon=True).start()

    def child_rank(self, index: int) -> int:
        """The global rank of the ``index``-th child process (local rank ``index + 1`` of this node)."""
        return self.cluster_environment.node_rank() * self.num_processes + index + 1

    # ------------------------------------------------------------------ what the watchers see
    def dead_child(self) -> Death | None:
        """The first child rank that has ended with an error, if any."""
        for index, proc in enumerate(self.procs):
            code = proc.poll()
            if code not in (None, 0):
                return Death(self.child_rank(index), proc.pid, code)
        return None

    def launcher_gone(self) -> bool:
        """On a child rank: whether the process that launched it has died."""
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def claim_report(self) -> bool:
        """True once per process: the caller prints the failure (the main thread or a watcher, never both)."""
        with self._lock:
            if self._reported:
                return False
            self._reported = True
            return True

    def _quiet(self) -> bool:
        """A death is expected (the fit ended, or every rank agreed to stop): nothing to report."""
        return self._ended.is_set() or STOP.agreed

    def _watch_children(self) -> None:
        first_seen: float | None = None
        while not self._ended.wait(POLL_S):
            death = self.dead_child()
            if death is None or self._quiet():
                first_seen = None
                continue
            first_seen = first_seen if first_seen is not None else time.monotonic()
            if time.monotonic() - first_seen >= DEATH_GRACE_S and self.claim_report():
                # The main thread did not fail by itself (computing, or blocked where no error comes): report here.
                self._report_and_exit(self.death_error(death))

    def _watch_launcher(self) -> None:
        first_seen: float | None = None
        while not self._ended.wait(POLL_S):
            if not self.launcher_gone() or self._quiet():
                continue
            first_seen = first_seen if first_seen is not None else time.monotonic()
            if time.monotonic() - first_seen >= DEATH_GRACE_S and self.claim_report():
                self._report_and_exit(
                    RankDiedError(self.launcher_death_message()) if self._reports_for_node() else None
                )

    def _report_and_exit(self, error: UserError | None) -> None:
        if error is not None:
            print_error(str(error))
        self.kill_children()
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(error.exit_status if error is not None else RankDiedError.exit_status)

    def _reports_for_node(self) -> bool:
        # One line per node, not one per child: the first child (local rank 1) reports the launcher's death.
        return self.cluster_environment.local_rank() == 1

    # ------------------------------------------------------------------ messages
    def death_error(self, death: Death) -> UserError:
        """What a dead child means: the fit interrupted by a stop signal that child got (and ended by: it came
        before training, when a signal stops a process at once, or it was a second one), else a dead rank."""
        signum = stop_signal_of(death.returncode)
        if signum is not None:
            return FitInterrupted(
                signum,
                self.command,
                where=f"(received by rank {death.rank}, pid {death.pid}) "
                f"{where_in_fit(self.trainer)}: the last complete checkpoint is kept",
            )
        return RankDiedError(self.death_message(death))

    def death_message(self, death: Death) -> str:
        return (
            f"rank {death.rank} (pid {death.pid}) {describe_exit(death.returncode)} {where_in_fit(self.trainer)}: "
            "the fit stopped on every rank (the last complete checkpoint is kept); find out why that process "
            "ended (out of memory? the system log, `dmesg`, says), then resume with: " + self.command
        )

    def launcher_death_message(self) -> str:
        rank = self.cluster_environment.node_rank() * self.num_processes  # local rank 0 of this node
        return (
            f"rank {rank} (pid {self.parent_pid}), the process that launched this node's ranks, "
            f"died {where_in_fit(self.trainer)}: the fit stopped (the last complete checkpoint is kept); find out "
            "why that process ended (out of memory? the system log, `dmesg`, says), then resume with: " + self.command
        )

    def lost_peer_message(self, error: BaseException) -> str:
        rank = getattr(self.trainer, "global_rank", self.cluster_environment.global_rank())
        return (
            f"rank {rank} lost its connection to another rank of the fit ({peer_failure_words(error)}) "
            f"{where_in_fit(self.trainer)}: another process of the job died or was killed (its own log or the "
            "scheduler's says why); the fit stopped (the last complete checkpoint is kept); resume with: "
            + self.command
        )

    # ------------------------------------------------------------------ the main thread's side
    def failure_of(self, error: BaseException) -> UserError | None:
        """The one-line error a collective failure ``error`` means here (None: not a lost peer).

        Rank 0 names the child that died (waiting up to :data:`DEATH_GRACE_S` for it to be seen); a child rank
        leaves the report to a living launcher; any other rank says it lost a peer.
        """
        if not is_peer_failure(error):
            return None
        if self.procs:
            deadline = time.monotonic() + DEATH_GRACE_S
            death = self.dead_child()
            while death is None and time.monotonic() < deadline:
                time.sleep(POLL_S)
                death = self.dead_child()
            if not self.claim_report():
                return ReportedByAnotherRank("reported by the rank watcher")
            return self.death_error(death) if death is not None else RankDiedError(self.lost_peer_message(error))
        if self.parent_pid is not None:
            deadline = time.monotonic() + 1.0  # a dying launcher's sockets close a moment before it is gone
            while not self.launcher_gone() and time.monotonic() < deadline:
                time.sleep(POLL_S / 5)
            if not self.launcher_gone() or not self._reports_for_node() or not self.claim_report():
                return ReportedByAnotherRank("reported by the launching rank")
            return RankDiedError(self.launcher_death_message())
        return RankDiedError(self.lost_peer_message(error))

    def end(self) -> None:
        """The fit has returned or failed on this rank: the watchers stop (what follows is expected)."""
        self._ended.set()

    def stop_children(self, grace: float = EXIT_GRACE_S) -> None:
        """Wait up to ``grace`` seconds for the child ranks to end, then kill those still running."""
        deadline = time.monotonic() + grace
        while any(proc.poll() is None for proc in self.procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.kill_children()

    def kill_children(self) -> None:
        """SIGKILL the child ranks still running, and reap them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # one that survives SIGKILL is the kernel's business
                proc.wait(timeout=EXIT_GRACE_S)


def install_launcher(trainer: Any, command: str) -> None:
    """Give ``trainer``'s strategy a :class:`WatchedLauncher` in place of Lightning's subprocess launcher (the
    DDP / FSDP strategies' default); other launchers (spawn, external) are left as they are."""
    strategy = trainer.strategy
    if type(strategy.launcher) is SubprocessScriptLauncher:
        replace_launcher(strategy, WatchedLauncher(strategy.launcher, command))


__all__ = ["RankDiedError", "WatchedLauncher", "describe_exit", "install_launcher", "is_peer_failure"]
