"""A validation that was due when a checkpoint was taken runs after the resume: no metrics row is lost to a kill.

Lightning writes a step's checkpoint from ``ModelCheckpoint.on_train_batch_end``, *before* the validation
that ``val_check_interval`` schedules after that same batch. A run killed during that validation resumes
from the checkpoint, and Lightning's loop then fast-forwards past the validation (it assumes one that was
due had run before the checkpoint was written): the validation's ``val/*`` row never comes, although the
weights match an uninterrupted run bit for bit.

:func:`validation_due` (called while a checkpoint is written) records whether a validation was due after the
batch the checkpoint covers; :func:`run_due_validation` (called when the resumed fit starts training) runs
it, at the same global step and logger step as the uninterrupted run, and leaves Lightning's own loop
bookkeeping as it would have been. A row of that validation written before the kill is dropped on resume
(:meth:`~dflash2_lightning.train.run_files.ResumableCSVLogger.drop_rows_from`), so it is logged once.

These read Lightning's loop state: the same private attributes its own validation scheduling uses, reached
through :mod:`~dflash2_lightning.train.lightning_internals`.
"""

from __future__ import annotations

from typing import Any

from dflash2_lightning.train.lightning_internals import (
    first_loop_iter,
    set_first_loop_iter,
    skips_next_validation,
    validation_follows,
)

#: the checkpoint key recording that a validation was due after the batch the checkpoint covers
DUE_KEY = "dflash2_validation_due"


def validation_due(trainer: Any) -> dict[str, int] | None:
    """The validation the training loop will run right after the batch now ending (checkpoint-time only):
    ``{"epoch": E}`` (the epoch it belongs to), or None when none is due.

    Due only inside ``on_train_batch_end`` of a fit (where ``ModelCheckpoint`` writes step checkpoints), when
    Lightning's own rule (``val_check_interval``, the last batch, ``check_val_every_n_epoch``) says a
    validation follows.
    """
    if trainer is None or not trainer.training or trainer.sanity_checking:
        return None
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress.current
    if progress.processed <= progress.completed:  # not inside on_train_batch_end
        return None
    if skips_next_validation(trainer):
        return None
    if not validation_follows(trainer):
        return None
    return {"epoch": int(trainer.current_epoch)}


def run_due_validation(trainer: Any, due: dict[str, int]) -> None:
    """Run the validation a resumed checkpoint recorded as due (``due``: :func:`validation_due`'s record), as
    the training loop itself would have.

    Called at the start of the resumed fit's training (``on_train_start``; ``on_fit_end`` when the checkpoint was
    the last step's, so there is nothing left to train): the validation loop runs from
    scratch, in the epoch it belonged to (a checkpoint of an epoch's last batch resumes in the next epoch);
    afterwards the epoch, the validation loop's progress counters and its restart flag are put back, so
    Lightning's own resume logic (which counts that validation as done) leaves them as in the uninterrupted run.
    """
    fit_loop = trainer.fit_loop
    val_loop = fit_loop.epoch_loop.val_loop
    progress = val_loop.batch_progress.state_dict()
    restarting = val_loop.restarting
    epoch = fit_loop.epoch_progress.current.completed
    first_iter = first_loop_iter(trainer)
    val_loop.restarting = False
    fit_loop.epoch_progress.current.completed = int(due.get("epoch", epoch))  # trainer.current_epoch
    trainer.validating = True
    try:
        val_loop.run()
    finally:
        trainer.training = True
        fit_loop.epoch_progress.current.completed = epoch
        set_first_loop_iter(trainer, first_iter)
        val_loop.batch_progress.load_state_dict(progress)
        val_loop.restarting = restarting
