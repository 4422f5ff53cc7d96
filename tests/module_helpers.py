"""Build a :class:`DFlash2Module` from flat settings in tests: ``grouped(lr=1e-2, block_size=4)`` ->
``{"optimizer": {"lr": 0.01}, "draft": {"block_size": 4}}``, the module's option groups (``data_args`` does the
same for the data module's offline group); and the small draft, random batches and the quiet trainer the module's
tests fit with."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch import Trainer

from dflash2_lightning.data.options import OfflineOptions
from dflash2_lightning.export.callback import ExportOnFitEnd
from dflash2_lightning.train.options import (
    DraftOptions,
    ExperimentalOptions,
    ExportOptions,
    ObjectiveOptions,
    OptimizerOptions,
)

#: the tests' flat names -> ``group.field`` (``export_dir`` -> ``export.dir``)
FLAT_NAMES: dict[str, str] = {
    **{
        f.name: f"{group}.{f.name}"
        for group, cls in [
            ("draft", DraftOptions),
            ("objective", ObjectiveOptions),
            ("optimizer", OptimizerOptions),
            ("experimental", ExperimentalOptions),
        ]
        for f in dataclasses.fields(cls)
    },
    **{f"export_{f.name}": f"export.{f.name}" for f in dataclasses.fields(ExportOptions)},
}

#: a small draft for the tiny target (flat settings: see :func:`grouped`)
SMALL = dict(block_size=4, conv_group_size=16, selector_rank=8, selector_top_k=8, num_anchors=4)


def grouped(**flat: Any) -> dict[str, dict[str, Any]]:
    """Flat setting names (:data:`FLAT_NAMES`) -> option groups."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        group, _, field = FLAT_NAMES[key].partition(".")
        groups.setdefault(group, {})[field] = value
    return groups


#: the data module's offline settings, one group (``data.init_args.offline``)
OFFLINE_NAMES = {f.name for f in dataclasses.fields(OfflineOptions)}


def data_args(**flat: Any) -> dict[str, Any]:
    """The data module's arguments from flat names: the offline settings (``cache_dir=...``) go into their group."""
    offline = {k: flat.pop(k) for k in list(flat) if k in OFFLINE_NAMES}
    return {**flat, **({"offline": offline} if offline else {})}


def random_batch(seq: int = 16, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of random token ids of the tiny target's vocabulary, every position trained on."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (batch, seq), generator=gen)
    return {
        "input_ids": ids,
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool),
        "attention_mask": torch.ones(batch, seq, dtype=torch.bool),
    }


class Batches(torch.utils.data.Dataset):
    """A list of samples as a dataset."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def quiet_trainer(tmp_path, **kwargs) -> Trainer:
    """A quiet CPU trainer that exports at the end of fit, as `dflash2 fit` does."""
    return Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[ExportOnFitEnd()],
        **kwargs,
    )
