"""The training progress bar: the epoch without Lightning's ``/-2`` (``max_steps`` runs) and without ``v_num``.

With ``max_steps`` set and ``max_epochs`` unset Lightning shows ``Epoch 0/-2``, and it shows the logger
version as ``v_num`` (``ault`` for ``version: default``, cut to fit). This bar shows the epoch alone
and the optimizer step out of ``max_steps``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from dflash2_lightning.train.lightning_internals import rich_available


def _metrics(trainer: Any, items: dict[str, Any]) -> dict[str, Any]:
    items.pop("v_num", None)
    if trainer.max_steps and trainer.max_steps > 0:
        items = {"step": f"{trainer.global_step}/{trainer.max_steps}", **items}
    return items


class StepRichProgressBar(RichProgressBar):
    """:class:`RichProgressBar` with ``Epoch N`` and ``step S/max_steps`` (no ``v_num``)."""

    def _get_train_description(self, current_epoch: int) -> str:  # private: probed by lightning_internals
        text = f"Epoch {current_epoch}"
        epochs = self.trainer.max_epochs
        if epochs is not None and epochs > 0:
            text += f"/{epochs - 1}"
        if len(self.validation_description) > len(text):
            text = f"{text:{len(self.validation_description)}}"
        return text

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return _metrics(trainer, super().get_metrics(trainer, pl_module))


class StepTQDMProgressBar(TQDMProgressBar):
    """:class:`TQDMProgressBar` with ``step S/max_steps`` and no ``v_num``."""

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return _metrics(trainer, super().get_metrics(trainer, pl_module))


def step_progress_bar() -> RichProgressBar | TQDMProgressBar:
    """The bar Lightning would pick (rich when installed, else tqdm), with the changes above."""
    return StepRichProgressBar() if rich_available() else StepTQDMProgressBar()
