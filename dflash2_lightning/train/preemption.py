"""Preemption: SIGTERM or SIGUSR1 stops a fit at the next step boundary, with a checkpoint of that step, on every rank.

The user sees one line (the step reached, its checkpoint, the command that resumes) and exit status ``128 +
signal`` (143 SIGTERM, 138 SIGUSR1): a scheduler tells a preemption from bad input (2) or a bug (1). Whichever
rank gets the signal, the handler (:class:`StopRequest`) only records it; at every optimizer-step boundary
(:class:`StopAtStepBoundary`) the ranks agree with one all-reduce of it, so all stop at the same step and none
waits in a collective for a peer that left. Every rank then takes part in ``trainer.save_checkpoint`` of that step
(atomic, to the ``last.ckpt`` that ``--ckpt_path last`` resumes, where ``ModelCheckpoint`` takes its step
checkpoints: the resume is exact) and raises :class:`FitInterrupted` (rank 0) or a quiet
:class:`~dflash2_lightning.errors.ReportedByAnotherRank`, which :func:`~dflash2_lightning.reporting.run_command`
turns into the line. Why not Lightning 2.6's handling: it runs a ``broadcast`` inside the signal handler, a
collective no other rank is in; :class:`PreemptionSignalConnector` replaces its signal connector for ``fit``.

Phases: before training starts a signal stops the process at once (nothing to save); from Lightning's
``register_signal_handlers`` on it is only recorded, and the ranks agree when training starts and at every step
boundary (a signal during a validation takes effect at the end of the next step); after the last step the fit
finishes normally. A second signal ends the process at once; SIGINT keeps its meaning. Under SLURM the requeue
signal also requeues the job, as Lightning's handler does. Each case for users: docs/robustness.md ("Preemption").
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dflash2_lightning.errors import ReportedByAnotherRank, UserError
from dflash2_lightning.reporting import print_error, split_debug
from dflash2_lightning.train.lightning_internals import SignalConnector, cluster_environment, replace_signal_connector

#: the signals that stop a fit at a step boundary (SLURM's requeue signal is added when it is another one)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def without_ckpt_path(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--ckpt_path X`` / ``--ckpt_path=X``."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return kept


def resume_command(argv: Sequence[str], prog: str = "dflash2") -> str:
    """The command that resumes the fit ``argv`` (``["fit", "--config", ...]``) ran: the same arguments, with
    ``--ckpt_path last`` in place of any ``--ckpt_path`` (and without ``--debug``), quoted for a POSIX shell."""
    return shlex.join([prog, *without_ckpt_path(split_debug(argv)[0]), "--ckpt_path", "last"])


def stop_point(
    step: int | None, max_steps: int | None = None, checkpoint: str | None = None, saved: bool = False
) -> str:
    """Where a fit stopped, in words: the step, and what became of its checkpoint."""
    if step is None:
        return "before training started (no checkpoint written by this run)"
    of = f" of {max_steps}" if max_steps is not None and max_steps > 0 else ""
    if saved:
        return f"at step {step}{of}: checkpoint of step {step} saved to {checkpoint}"
    if checkpoint is not None:
        return f"at step {step}{of}, before training went on: checkpoint {checkpoint} is unchanged"
    if step == 0:
        return "before its first training step (nothing to resume)"
    return f"at step {step}{of}, and the fit has no checkpoint callback: nothing was saved"


class FitInterrupted(UserError):
    """A fit stopped by a signal (rank 0's report): the step it reached, where its checkpoint went (or ``where``,
    in the caller's words), and the command that resumes it. Exit status ``128 + signal``."""

    def __init__(
        self,
        signum: int,
        command: str,
        step: int | None = None,
        max_steps: int | None = None,
        checkpoint: str | None = None,
        saved: bool = False,
        note: str = "",
        where: str | None = None,
    ) -> None:
        where = where if where is not None else stop_point(step, max_steps, checkpoint, saved)
        super().__init__(
            f"fit interrupted by {signal_name(signum)} {where}{'; ' + note if note else ''}; resume with: {command}"
        )
        self.exit_status = 128 + signum
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 (Lightning's record, from the environment before the trainer sets up)."""
    return getattr(rank_zero_only, "rank", 0) == 0


class StopRequest:
    """This process's stop signals: what arrived, and what the fit is doing (module docstring, "Phases").

    One per process (:data:`STOP`): signal handlers are process-wide. :meth:`watching` installs the handlers for
    the length of one ``dflash2 fit``.
    """

    SETUP, TRAINING, FINISHING = "setup", "training", "finishing"

    def __init__(self) -> None:
        self.signum = 0  # the first stop signal received here (0: none)
        self.phase = self.SETUP
        self.agreed = False  # every rank agreed to stop: the processes are on their way out
        self.command = "the same command with --ckpt_path last"
        self.signals: tuple[int, ...] = STOP_SIGNALS
        self.requeue_signal: int | None = None  # SLURM's, when Lightning's auto-requeue is on
        #: called before a second signal ends the process (the launcher ends its child ranks)
        self.abort_hooks: list[Callable[[], None]] = []
        self._installed: dict[int, Any] = {}

    def reset(self, command: str | None = None) -> None:
        """Forget an earlier fit's signal (a process may run several fits: tests, notebooks)."""
        self.signum, self.phase, self.agreed = 0, self.SETUP, False
        self.abort_hooks = []
        if command is not None:
            self.command = command

    def install(self, signals: Sequence[int] = STOP_SIGNALS) -> dict[int, Any]:
        """Handle ``signals`` here; returns the handlers they had (for :meth:`restore`). Main thread only."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous
        for signum in signals:
            if signal.getsignal(signum) != self.handle:
                previous[signum] = signal.signal(signum, self.handle)
        self.signals = tuple(dict.fromkeys([*self.signals, *signals]))
        return previous

    @staticmethod
    def restore(previous: dict[int, Any]) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    @contextmanager
    def watching(self, command: str) -> Iterator[None]:
        """Handle the stop signals during one fit (``command``: how to resume it)."""
        self.reset(command)
        previous = self.install()
        try:
            yield
        finally:
            self.restore(previous)
            self.phase = self.SETUP

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: record the signal; before training, stop at once; a second one ends the process."""
        if self.signum:
            self.abort(signum)
        self.signum = signum
        if self.phase == self.SETUP:
            self.agreed = True
            raise interruption(signum, self.command)

    def abort(self, signum: int) -> None:
        """A second stop signal: end this process now, by the signal's own default action."""
        if is_rank_zero():
            print_error(
                f"a second signal ({signal_name(signum)}) arrived while the fit was stopping: stopped at once, "
                f"without a checkpoint of this step (the last complete checkpoint is kept); resume with: "
                f"{self.command}"
            )
        for hook in self.abort_hooks:
            hook()
        sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


#: the stop signals of this process
STOP = StopRequest()


def interruption(signum: int, command: str, **details: Any) -> UserError:
    """What a stopping rank raises: :class:`FitInterrupted` on rank 0, which prints it; a quiet
    :class:`ReportedByAnotherRank` with the same exit status elsewhere."""
    report = FitInterrupted(signum, command, **details)
    if is_rank_zero():
        return report
    return ReportedByAnotherRank(str(report), exit_status=report.exit_status)


class PreemptionSignalConnector(SignalConnector):
    """Lightning's signal connector for ``fit``, replaced: its handlers record the signal (:data:`STOP`) instead
    of running a collective inside the handler; the ranks act on it together at step boundaries.

    ``trainer.received_sigterm`` stays False: Lightning's loops would otherwise stop each rank on its own.
    """

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        environment = cluster_environment(self.trainer)  # where Lightning's own reads it
        signals = list(STOP_SIGNALS)
        STOP.requeue_signal = None
        if (
            isinstance(environment, SLURMEnvironment)
            and environment.auto_requeue
            and environment.requeue_signal is not None
        ):
            STOP.requeue_signal = int(environment.requeue_signal)
            signals.append(environment.requeue_signal)
        self._replaced = STOP.install(signals)  # already ours under `dflash2 fit`; a bare trainer.fit gets them here
        STOP.phase = STOP.TRAINING

    def teardown(self) -> None:
        STOP.phase = STOP.FINISHING  # the fit is ending either way: a signal now only waits for it
        StopRequest.restore(getattr(self, "_replaced", {}))
        self._replaced = {}


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this SLURM job (as Lightning's auto-requeue does); returns what happened, in words."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not job:
        return "no SLURM job id in the environment, so the job was not requeued: submit it again"
    try:
        done = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return f"requeueing SLURM job {job} failed ({error}): submit it again"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        return (
            f"requeueing SLURM job {job} failed (scontrol exit {done.returncode}"
            f"{': ' + reason[0] if reason else ''}): submit it again"
        )
    return f"SLURM job {job} requeued: it resumes by itself when its command has --ckpt_path last"


def last_checkpoint_path(trainer: Any) -> str | None:
    """The file ``--ckpt_path last`` resumes: the ``last`` checkpoint of the first ``ModelCheckpoint`` keeping one
    (its current ``last_model_path``, else its ``last`` name for this step); None without a ``ModelCheckpoint``."""
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if not callbacks:
        return None
    keeper = next((cb for cb in callbacks if cb.save_last), callbacks[0])
    if keeper.last_model_path:
        return str(keeper.last_model_path)
    metrics = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
    return keeper.format_checkpoint_name(metrics, keeper.CHECKPOINT_NAME_LAST)


def is_last_step(trainer: Any) -> bool:
    """Whether the optimizer step just taken is the fit's last (``max_steps``, or the last batch of ``max_epochs``)."""
    max_steps = trainer.max_steps
    if max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps:
        return True
    max_epochs = trainer.max_epochs
    return bool(
        max_epochs is not None
        and max_epochs >= 0
        and trainer.current_epoch + 1 >= max_epochs
        and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    )


class StopAtStepBoundary(Callback):
    """Stops every rank at the same step boundary once any rank has received a stop signal (module docstring).

    One all-reduce of a single integer per optimizer step (none on a single process).
    """

    def __init__(self) -> None:
        self._step_seen = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._step_seen = trainer.global_step
        signum = self._agree(trainer)
        if signum:  # a signal during setup's last moments or the sanity check: nothing new to save
            resumed = trainer.ckpt_path
            raise interruption(
                signum,
                STOP.command,
                step=trainer.global_step,
                max_steps=trainer.max_steps,
                checkpoint=str(resumed) if resumed else None,
            )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step_seen:  # accumulating gradients: not a step boundary
            return
        self._step_seen = trainer.global_step
        if is_last_step(trainer):  # the fit ends here anyway: its validation and export run, it exits normally
            return
        signum = self._agree(trainer)
        if not signum:
            return
        path = last_checkpoint_path(trainer)
        if path is not None:
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, ModelCheckpoint) and callback.save_last and not callback.last_model_path:
                    callback.last_model_path = path  # part of the saved state: the resumed run keeps this name
                    break
            trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank 0 writes it, atomically
        note = ""
        if STOP.requeue_signal == signum and trainer.is_global_zero:
            note = requeue_slurm_job()
        raise interruption(
            signum,
            STOP.command,
            step=trainer.global_step,
            max_steps=trainer.max_steps,
            checkpoint=path,
            saved=path is not None,
            note=note,
        )

    @staticmethod
    def _agree(trainer: Any) -> int:
        """The stop signal any rank received (0: none); every rank calls this at the same point."""
        signum = STOP.signum
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            flag = torch.tensor([signum], dtype=torch.int64, device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
        if signum:
            STOP.agreed = True
        return signum


def install_preemption(trainer: Any) -> None:
    """Give ``trainer`` (a fit's) this module's signal handling: the connector and the step-boundary callback.

    The callback goes last, after the ``ModelCheckpoint`` callbacks (which Lightning moved to the end when the
    trainer was made): a step's own checkpoints are written before the stop is decided.
    """
    replace_signal_connector(trainer, PreemptionSignalConnector(trainer))  # Lightning's own: made in Trainer.__init__
    if not any(isinstance(cb, StopAtStepBoundary) for cb in trainer.callbacks):
        trainer.callbacks.append(StopAtStepBoundary())


__all__ = [
    "STOP",
    "FitInterrupted",
    "PreemptionSignalConnector",
    "StopAtStepBoundary",
    "install_preemption",
    "requeue_slurm_job",
    "resume_command",
    "without_ckpt_path",
]
