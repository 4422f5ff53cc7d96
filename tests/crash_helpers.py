"""A callback that the *trainer* loads in the GPU-recipe rehearsal (a ``trainer.callbacks`` class path; the
tests folder is on PYTHONPATH there).

:class:`CrashAtStep` raises on every rank when a training batch starts at global step
``$DFLASH2_TEST_CRASH_AT`` (after that step's checkpoint was written), and does nothing when the variable is
unset: the same config then serves the interrupted run and the resumed one, as the recipes' "the same
command plus --ckpt_path last" says.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback


class SimulatedCrash(RuntimeError):
    pass


class CrashAtStep(Callback):
    """Raise :class:`SimulatedCrash` at global step ``$DFLASH2_TEST_CRASH_AT`` (see the module docstring)."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        at = os.environ.get("DFLASH2_TEST_CRASH_AT")
        if at and trainer.global_step == int(at):
            raise SimulatedCrash(f"simulated crash at step {at} on rank {trainer.global_rank}")
