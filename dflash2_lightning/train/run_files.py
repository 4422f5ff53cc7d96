"""Run files that survive crashes and resumes: atomic checkpoints and a metrics.csv that is kept.

:class:`AtomicCheckpointIO`: Lightning 2.6 saves through ``fsspec``'s transaction, whose temporary file is made by
``tempfile.mkstemp()`` in the system temp directory and ``shutil.move``d into place, a *copy into the final path*
when the run directory is on another filesystem (so a kill mid-copy leaves a truncated ``last.ckpt`` that
``--ckpt_path last`` picks), and nothing is fsynced. Here local checkpoints go to a temporary in the checkpoint's
own directory (named as :mod:`dflash2_lightning.files` names them, which Lightning's ``last*.ckpt`` discovery never
matches), fsynced and ``os.replace``d, the directory fsynced. Remote paths (``s3://`` ...) keep Lightning's writer;
an unreadable checkpoint is a :class:`CheckpointError` naming the file.

:class:`ResumableCSVLogger`: Lightning 2.6's ``CSVLogger`` *deletes* an existing ``metrics.csv`` when it opens a
run directory that is not empty, so a resume would wipe the loss curve. This one appends instead and, on resume,
drops the rows logged after the checkpoint the run restarts from (they are logged again), so the file reads as one
run; a rewrite for a new column is atomic and an append a full disk tore is cut back off.
What users see: docs/robustness.md ("Training runs").
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dflash2_lightning.files import append_durably, atomic_write, atomic_write_text
from dflash2_lightning.model.checkpoint import CheckpointError
from dflash2_lightning.train.lightning_internals import (
    batches_that_stepped,
    first_loop_iter,
    logged_metrics,
    should_accumulate,
    should_update_logs,
)


def _is_local(path: str | os.PathLike) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a nested checkpoint dict / list (a lower bound of its file's size)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a same-directory temporary file, fsync and rename; a disk without room
    for the tensors is refused before writing (the previous checkpoint stays as it was)."""
    atomic_write(Path(str(path).removeprefix("file://")), lambda tmp: torch.save(obj, tmp), size=tensor_bytes(obj))


class AtomicCheckpointIO(TorchCheckpointIO):
    """:class:`TorchCheckpointIO` whose local saves are atomic (temporary file in place + rename)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO.save_checkpoint takes no storage_options; got {storage_options!r}")
        if not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's loader, but a damaged file is a :class:`CheckpointError` naming it (not a traceback)."""
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as error:  # torch reports a truncated zip / pickle in several exception types
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:160]}): "
                "it is truncated or not a Lightning checkpoint; delete it and resume from another checkpoint "
                "(--ckpt_path <file>), or start the run again"
            ) from None


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, minus the deletion of an existing ``metrics.csv``: it appends to it."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])

    def _check_log_dir_exists(self) -> None:  # private hooks of ExperimentWriter: probed by lightning_internals
        pass  # keep what a previous (interrupted) run of this directory logged

    def save(self) -> None:
        """Write the buffered rows: appended whole (a failed append is cut back off), or, when new columns
        appear, the whole file rewritten atomically. On failure the rows stay buffered and the file as it was."""
        if not self.metrics:
            return
        keys_before = list(self.metrics_keys)
        new_keys = self._record_new_keys()
        path = self.metrics_file_path
        exists = os.path.isfile(path)
        try:
            out = io.StringIO()
            table = csv.DictWriter(out, fieldnames=self.metrics_keys)
            if exists and new_keys:
                with open(path, newline="") as f:
                    old_rows = list(csv.DictReader(f))
                table.writeheader()
                table.writerows(old_rows)
            elif not exists:
                table.writeheader()
            table.writerows(self.metrics)
            if exists and not new_keys:
                append_durably(path, out.getvalue())
            else:
                atomic_write_text(path, out.getvalue())
        except BaseException:
            self.metrics_keys = keys_before
            raise
        self.metrics = []


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a resume in the same run directory (see module doc).

    It also keeps every row a checkpoint covers: Lightning saves a step's checkpoint (``ModelCheckpoint``
    in ``on_train_batch_end``) *before* it logs that step's training metrics, so a kill between the two
    lost the row for good (the resumed run starts after that step). :func:`log_step_metrics_now`, called
    while the checkpoint is being written, logs and flushes the row first; the identical row Lightning
    logs a moment later is then skipped.
    """

    _early_row: tuple[int, dict[str, Any]] | None  # the row log_early wrote (unset until it writes one)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = (step, dict(metrics))
        if step is not None and row == getattr(self, "_early_row", None):
            self._early_row = None  # Lightning's own copy of a row already written early
            return
        super().log_metrics(metrics, step)

    @rank_zero_only
    def log_early(self, metrics: dict[str, Any], step: int) -> None:
        """Write a step's row now (before its checkpoint lands); the same row logged again is skipped (also when
        the same step is checkpointed twice: a preemption stop right after ``ModelCheckpoint``'s own save)."""
        if (step, dict(metrics)) == getattr(self, "_early_row", None):
            return
        super().log_metrics(metrics, step)
        self.save()
        self._early_row = (step, dict(metrics))

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:  # CSVLogger's own, with its private _experiment and _fs
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        writer = self._experiment
        if not isinstance(writer, ExperimentWriter):  # CSVLogger types its writer as Fabric's base class
            raise TypeError(f"the CSV logger's writer is a {type(writer).__name__}, not an ExperimentWriter")
        return writer

    @rank_zero_only
    def drop_rows_from(self, step: int, validation_at: int | None = None) -> None:
        """Forget rows logged at ``step`` or later (the resumed run logs those steps again), and the validation
        rows (any ``val/`` value) logged at ``validation_at``: a validation the resumed run runs again."""
        writer = self.experiment
        writer.save()  # anything still buffered belongs to the file first
        path = writer.metrics_file_path
        if not os.path.isfile(path):
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields = list(reader.fieldnames or [])
            rows = [
                r
                for r in reader
                if not r.get("step")
                or (
                    int(float(r["step"])) < step
                    and not (
                        int(float(r["step"])) == validation_at and any(v for k, v in r.items() if k.startswith("val/"))
                    )
                )
            ]
        out = io.StringIO()
        table = csv.DictWriter(out, fieldnames=fields)
        table.writeheader()
        table.writerows(rows)
        atomic_write_text(path, out.getvalue())


def log_step_metrics_now(trainer: Any) -> None:
    """Log (and flush) the current training step's metrics into each :class:`ResumableCSVLogger` now.

    Called from the module's ``on_save_checkpoint``: when a checkpoint is written in the middle of
    training, the row of the step it covers must be on disk before the checkpoint is. Same conditions,
    values and step number as Lightning's own ``update_train_step_metrics`` a moment later.
    """
    from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

    loggers = [lg for lg in trainer.loggers if isinstance(lg, ResumableCSVLogger)]
    if not loggers or not trainer.training or trainer.sanity_checking:
        return
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    if progress.processed <= progress.completed:  # not inside on_train_batch_end: the row is logged already
        return
    if should_accumulate(trainer) and trainer.lightning_module.automatic_optimization:
        return
    if first_loop_iter(trainer) is None or not (should_update_logs(trainer) or trainer.fast_dev_run):
        return
    metrics = logged_metrics(trainer)
    if not metrics:
        return
    scalars = convert_tensors_to_scalars(metrics)
    step = scalars.pop("step", None)
    if step is None:
        scalars.setdefault("epoch", trainer.current_epoch)
        step = batches_that_stepped(trainer)
    for logger in loggers:
        logger.log_early(scalars, int(step))
