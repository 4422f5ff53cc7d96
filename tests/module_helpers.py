"""Build a :class:`DFlash2Module` from flat settings in tests: ``grouped(lr=1e-2, block_size=4)`` ->
``{"optimizer": {"lr": 0.01}, "draft": {"block_size": 4}}``, the module's option groups."""

from __future__ import annotations

from typing import Any

from dflash2_lightning.train.options import MOVED_KEYS


def grouped(**flat: Any) -> dict[str, dict[str, Any]]:
    """Flat setting names (as :data:`~dflash2_lightning.train.options.MOVED_KEYS` knows them) -> option groups."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        group, _, field = MOVED_KEYS[key].partition(".")
        groups.setdefault(group, {})[field] = value
    return groups
