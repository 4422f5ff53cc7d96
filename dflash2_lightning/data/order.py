"""`ResumableOrder`: the training order as a function of (seed, epoch), sliced per rank, resumable mid-epoch.

A resumed run must see exactly the batches the interrupted run would have seen next. The order of an
epoch is a seeded permutation, so it can be rebuilt; the DataModule records how many batches of the
epoch were consumed and the first epoch after a resume skips them. Subclassing ``DistributedSampler``
tells Lightning not to wrap it: it does the per-rank slicing itself (rank ``r`` takes every
``world``-th sample), so the same skip arithmetic holds on one process and on many.

:class:`ResumableLoader` is the training ``DataLoader`` over that order. It has Lightning's
``state_dict`` / ``load_state_dict`` interface, so Lightning counts it as resumable (and no longer warns,
at every resume, that the loader is not): the position itself is saved by the DataModule's own state
(``DraftDataModule.state_dict``), which builds the loader already positioned, so the loader's share of the
state is empty.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


class ResumableOrder(DistributedSampler):
    """Seeded per-epoch permutation of ``size`` samples for ``rank`` of ``num_replicas``."""

    def __init__(self, size: int, seed: int = 0, num_replicas: int = 1, rank: int = 0) -> None:
        # DistributedSampler.__init__ wants a dataset and a process group; neither is needed here.
        self.size, self.seed, self.num_replicas, self.rank = size, seed, num_replicas, rank
        self.epoch, self.shuffle, self.drop_last = 0, True, False
        self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._skip = 0  # global samples of the current epoch to skip once (resume)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start."""
        self.epoch = epoch

    def resume(self, epoch: int, batches: int, batch_size: int) -> None:
        """Continue after ``batches`` batches (per rank) of ``epoch`` were trained on."""
        consumed = batches * batch_size * self.num_replicas
        self.epoch, self._skip = (epoch + 1, 0) if consumed >= self.total_size else (epoch, consumed)

    def __len__(self) -> int:
        # The whole epoch's count, also right after a resume: Lightning fast-forwards its own batch
        # counter by the batches already trained and ends the epoch when that counter reaches len.
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        order += order[: self.total_size - len(order)]  # pad so every rank gets the same count
        skip, self._skip = self._skip, 0
        return iter(order[skip:][self.rank :: self.num_replicas])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that Lightning recognises as resumable (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Empty: the position in the order is the DataModule's state, restored before this loader is built."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here (the loader was built at the resumed position)."""
