"""Training data: records and chat templates, the DataModule, the offline feature cache, the training order,
the prompts, and regeneration of the target's own responses (in-process or via a server)."""

from dflash2_lightning.data.datamodule import DraftDataModule

__all__ = ["DraftDataModule"]
