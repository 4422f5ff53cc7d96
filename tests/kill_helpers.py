"""Helpers loaded by the *trainer* in the kill-loop test (``trainer.plugins`` / ``callbacks`` class paths; on
PYTHONPATH there).

:class:`StallingCheckpointIO` is the product's :class:`AtomicCheckpointIO` whose temporary file, once its
bytes are written and before it is renamed into place, stays for ``$DFLASH2_TEST_STALL`` seconds, after
touching ``$DFLASH2_TEST_MARK``: the test waits for the mark and ``kill -9``s the run in the middle of the
checkpoint write, exactly where a real kill would orphan the temporary file.

:class:`StallingValidation` touches ``$DFLASH2_TEST_VAL_MARK`` when a validation starts (outside the sanity
check) and then waits ``$DFLASH2_TEST_VAL_STALL`` seconds, or until the file ``$DFLASH2_TEST_VAL_RELEASE``
exists when that is set (only at global step ``$DFLASH2_TEST_VAL_STEP`` when that is set): the test
``kill -9``s the run in the middle of that validation, after the step's
checkpoint was written and before the validation's metrics row was (or holds a run there while it starts
another one).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from dflash2_lightning.train.run_files import AtomicCheckpointIO


class StallingCheckpointIO(AtomicCheckpointIO):
    """Atomic checkpoint writes that pause between the write and the rename (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        real = torch.save
        mark = os.environ.get("DFLASH2_TEST_MARK")
        stall = float(os.environ.get("DFLASH2_TEST_STALL", "0"))

        def stalling_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            real(obj, f, *args, **kwargs)
            if hasattr(f, "flush"):  # a file object; a path is closed (its bytes written) when save returns
                f.flush()
            if mark:
                Path(mark).write_text(str(path))
            time.sleep(stall)

        torch.save = stalling_save
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        finally:
            torch.save = real


class StallingValidation(Callback):
    """A validation that announces itself and pauses (see the module docstring)."""

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        mark = os.environ.get("DFLASH2_TEST_VAL_MARK")
        at = os.environ.get("DFLASH2_TEST_VAL_STEP")
        if trainer.sanity_checking or not mark or (at and int(at) != trainer.global_step):
            return
        Path(mark).write_text(str(trainer.global_step))
        stall = float(os.environ.get("DFLASH2_TEST_VAL_STALL", "0"))
        release = os.environ.get("DFLASH2_TEST_VAL_RELEASE")
        deadline = time.monotonic() + stall
        while time.monotonic() < deadline and not (release and Path(release).exists()):
            time.sleep(0.05)
