"""Run files that survive crashes and resumes: atomic checkpoints and a metrics.csv that is kept.

Checkpoints
    Lightning 2.6 saves through ``fsspec``'s transaction (``_atomic_save``): the bytes go to a temporary
    file from ``tempfile.mkstemp()`` — in the system temp directory, not beside the checkpoint — and
    the commit ``shutil.move``s it into place. When the temp directory and the run directory are on
    different filesystems (a tmpfs ``/tmp``, a network or bucket-mounted run directory) that move is a
    *copy into the final path*, so a run killed mid-copy leaves a truncated ``last.ckpt`` that
    ``--ckpt_path last`` then picks. Nothing is fsynced either.

    :class:`AtomicCheckpointIO` writes local checkpoints to a temporary file *in the checkpoint's own
    directory*, fsyncs it, ``os.replace``s it onto the final name (atomic on POSIX) and fsyncs the
    directory. A kill at any moment leaves either the previous complete file or the new complete one.
    Temporary files are named ``.<name>.<random>.tmp``, which Lightning's ``last*.ckpt`` discovery never
    matches. Remote paths (``s3://`` ...) keep Lightning's own writer.

Metrics
    Lightning 2.6's ``CSVLogger`` *deletes* an existing ``metrics.csv`` when it opens a run directory
    that is not empty, so resuming a run (same directory, ``--ckpt_path last``) wipes the loss curve
    so far. :class:`ResumableCSVLogger` appends to it instead, and on resume drops the rows logged
    after the checkpoint the run restarts from (they are logged again), so the file reads as one run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import csv
import io

import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dflash2_lightning.checkpoint import atomic_write_text


def _is_local(path: str | os.PathLike) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a same-directory temporary file, fsync and rename."""
    path = Path(str(path).removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; a checkpoint gets the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """:class:`TorchCheckpointIO` whose local saves are atomic (temporary file in place + rename)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options; "
                            f"got {storage_options!r}")
        if not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)



class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, minus the deletion of an existing ``metrics.csv``: it appends to it."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])

    def _check_log_dir_exists(self) -> None:
        pass  # keep what a previous (interrupted) run of this directory logged


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a resume in the same run directory (see module doc)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def drop_rows_from(self, step: int) -> None:
        """Forget rows logged at ``step`` or later (the resumed run logs those steps again)."""
        writer = self.experiment
        writer.save()  # anything still buffered belongs to the file first
        path = writer.metrics_file_path
        if not os.path.isfile(path):
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields = list(reader.fieldnames or [])
            rows = [r for r in reader if not r.get("step") or int(float(r["step"])) < step]
        out = io.StringIO()
        table = csv.DictWriter(out, fieldnames=fields)
        table.writeheader()
        table.writerows(rows)
        atomic_write_text(path, out.getvalue())
