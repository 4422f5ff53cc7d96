"""Helpers loaded by the *trainer* in the kill-loop test (``trainer.plugins`` class path; on PYTHONPATH there).

:class:`StallingCheckpointIO` is the product's :class:`AtomicCheckpointIO` whose temporary file, once its
bytes are written and before it is renamed into place, stays for ``$DFLASH2_TEST_STALL`` seconds, after
touching ``$DFLASH2_TEST_MARK``: the test waits for the mark and ``kill -9``s the run in the middle of the
checkpoint write, exactly where a real kill would orphan the temporary file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from dflash2_lightning.train.run_files import AtomicCheckpointIO


class StallingCheckpointIO(AtomicCheckpointIO):
    """Atomic checkpoint writes that pause between the write and the rename (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        real = torch.save
        mark = os.environ.get("DFLASH2_TEST_MARK")
        stall = float(os.environ.get("DFLASH2_TEST_STALL", "0"))

        def stalling_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            real(obj, f, *args, **kwargs)
            f.flush()
            if mark:
                Path(mark).write_text(str(path))
            time.sleep(stall)

        torch.save = stalling_save
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        finally:
            torch.save = real
