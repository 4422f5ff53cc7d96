"""Training: the LightningModule and its option groups, the objective, metrics, run files, and the ``fit`` CLI."""

from dflash2_lightning.train.module import DFlash2Module
from dflash2_lightning.train.run_files import AtomicCheckpointIO, ResumableCSVLogger

__all__ = ["DFlash2Module", "ResumableCSVLogger", "AtomicCheckpointIO"]
