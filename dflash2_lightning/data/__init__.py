"""Training data: records and chat templates, the DataModule, the offline feature cache, the training order,
the prompts, and regeneration of the target's own responses (in-process or via a server).

``DraftDataModule`` (what configs name as ``dflash2_lightning.data.DraftDataModule``) is imported on first use:
it needs Lightning, which the actions that only read prompts (eval, regen, the exports) need not import.
"""

from typing import Any

__all__ = ["DraftDataModule"]


def __getattr__(name: str) -> Any:
    if name == "DraftDataModule":
        from dflash2_lightning.data.datamodule import DraftDataModule

        return DraftDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
