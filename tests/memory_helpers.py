"""Peak memory of tensors on any device, counted by the tensors themselves (the plan's unit, not the allocator's)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """While active, the bytes of every storage an op returns are counted until the storage is freed.

    ``peak`` is the most bytes alive at once, ``live`` those alive now. A storage that existed before the mode was
    entered is counted from the first op that returns it (a view of a weight counts the weight); :meth:`track`
    counts the ones that should be there from the start (weights, inputs). It is what ``dflash2 plan`` estimates,
    without the allocator's rounding, caching and the libraries' own buffers, so it reads the same on every
    machine where RSS does not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def track(self, *tensors: torch.Tensor) -> None:
        """Count these tensors' storages from now until they are freed (once each, however many views)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself: views and in-place results share it
            if key not in self.sizes:
                weakref.finalize(storage, self._forget, key)
            self.live += storage.nbytes() - self.sizes.get(key, 0)  # a resized storage counts its new size
            self.sizes[key] = storage.nbytes()
        self.peak = max(self.peak, self.live)

    def _forget(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.track(*tree_leaves(out))
        return out
