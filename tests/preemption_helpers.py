"""Callbacks loaded by the *trainer* in tests/train/test_preemption.py (``trainer.callbacks`` class paths; the tests
folder is on PYTHONPATH there). Each does nothing unless its environment variables are set, so one config serves
the interrupted runs and the resumes.

:class:`PauseAtStep`: when a training batch starts at global step ``$DFLASH2_TEST_PAUSE_AT``, write
``$DFLASH2_TEST_PAUSE_MARK.<rank>`` and wait until the file ``$DFLASH2_TEST_PAUSE_RELEASE`` exists (at most
``$DFLASH2_TEST_PAUSE_MAX`` seconds, default 120): the test signals a process while every rank is held inside that
step, then releases them, so the stop lands at the end of that very step.

:class:`PauseInSetup`: in the ``setup`` hook (before training starts and before the fit's signal handlers are
Lightning's), write ``$DFLASH2_TEST_SETUP_MARK`` and sleep up to 120 s: a signal there stops the fit at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


def _wait_for(path: str | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (path and Path(path).exists()):
        time.sleep(0.02)


class PauseAtStep(Callback):
    """Hold every rank at the start of one training step until the test releases it (module docstring)."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        at = os.environ.get("DFLASH2_TEST_PAUSE_AT")
        if not at or trainer.global_step != int(at):
            return
        Path(f"{os.environ['DFLASH2_TEST_PAUSE_MARK']}.{trainer.global_rank}").write_text(str(os.getpid()))
        _wait_for(os.environ.get("DFLASH2_TEST_PAUSE_RELEASE"), float(os.environ.get("DFLASH2_TEST_PAUSE_MAX", "120")))


class PauseInSetup(Callback):
    """Announce the fit's setup and wait there (module docstring)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        mark = os.environ.get("DFLASH2_TEST_SETUP_MARK")
        if mark:
            Path(mark).write_text(str(os.getpid()))
            _wait_for(None, 120)
