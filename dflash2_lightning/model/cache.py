"""`DraftCache`: the draft's context K/V in preallocated buffers, appended to in place.

:class:`~dflash2_lightning.model.ContextKV` concatenates, so every append and every draft step copies the whole
context. A :class:`DraftCache` allocates per layer ``keys``/``values`` of ``[B, num_kv_heads, capacity +
block_size, head_dim]`` once and keeps a valid ``length``::

    buffer:  [ context 0 .. length-1 | scratch: the block's K/V during a step | unused ]

:meth:`append` writes ``k`` new positions at ``length`` (O(k)); :meth:`crop` only lowers ``length``; a draft step
writes the block's K/V into the scratch slots and attends to the first ``length + block`` slots as a view
(:class:`CacheSlot`), so its cost depends on the context only through attention. The valid part reads like a
``ContextKV`` (:attr:`layers`, :attr:`positions`, :attr:`length`), so code written against the reference keeps
working. ``ContextKV`` stays the reference and the training path (autograd through a concatenation); this class
is for inference only. The same layout in the exported graphs: docs/export.md ("The context cache").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflash2_lightning.model.backbone import CacheSlot, ContextKV, LayerKV

if TYPE_CHECKING:  # draft.py imports this module
    from dflash2_lightning.model.draft import DraftModel


class DraftCache:
    """Preallocated per-layer context K/V of capacity ``capacity`` (+ ``block_size`` scratch slots).

    Args:
        num_layers, batch, num_kv_heads, head_dim: the draft's cache geometry.
        capacity: most context positions the cache holds (>= 1).
        block_size: scratch slots after the context for the block's own K/V during a step.
        dtype, device: of the buffers (the draft's).
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value, low in (
            ("num_layers", num_layers, 1),
            ("batch", batch, 1),
            ("capacity", capacity, 1),
            ("block_size", block_size, 1),
        ):
            if value < low:
                raise ValueError(f"{name}={value} is invalid: must be >= {low}")
        shape = (batch, num_kv_heads, capacity + block_size, head_dim)
        # Zeros, not empty: a graph that masks slots >= length still multiplies them by a zero weight,
        # and 0 * NaN (an uninitialised bit pattern) would be NaN. Allocated once per generation.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._positions = torch.zeros(batch, capacity + block_size, dtype=torch.long, device=device)
        self.capacity, self.block_size, self.length = capacity, block_size, 0

    @classmethod
    def for_model(cls, model: DraftModel, batch: int, capacity: int) -> DraftCache:
        """An empty cache for a :class:`~dflash2_lightning.model.DraftModel` (its dtype and device)."""
        cfg = model.config
        p = next(model.parameters())
        return cls(
            cfg.num_hidden_layers,
            batch,
            cfg.num_key_value_heads,
            cfg.resolved("head_dim"),
            capacity,
            cfg.block_size,
            p.dtype,
            p.device,
        )

    # ------------------------------------------------------------------ the ContextKV view
    @property
    def layers(self) -> list[LayerKV]:
        """The valid context K/V per layer as views ``[B, num_kv_heads, length, head_dim]``."""
        n = self.length
        return [LayerKV(k[:, :, :n], v[:, :, :n]) for k, v in zip(self.keys, self.values)]

    @property
    def positions(self) -> Tensor:
        """Absolute positions ``[B, length]`` of the valid context."""
        return self._positions[:, : self.length]

    @property
    def slot_positions(self) -> Tensor:
        """Positions of every slot ``[B, capacity + block_size]`` (what a graph reading whole buffers takes)."""
        return self._positions

    def slots(self) -> list[CacheSlot]:
        """What a draft step's attention uses: buffers plus the valid length (it writes the block after it)."""
        return [CacheSlot(k, v, self.length) for k, v in zip(self.keys, self.values)]

    # ------------------------------------------------------------------ updates
    def append(self, other: ContextKV) -> DraftCache:
        """Write ``other``'s K/V and positions at ``length..`` in place; returns ``self`` (O(new positions))."""
        k = other.length
        if self.length + k > self.capacity:
            raise ValueError(
                f"appending {k} positions to a cache of length {self.length} exceeds capacity="
                f"{self.capacity}: allocate the cache with capacity >= {self.length + k}"
            )
        if len(other.layers) != len(self.keys):
            raise ValueError(f"other has {len(other.layers)} layers, the cache {len(self.keys)}")
        end = self.length + k
        for kb, vb, layer in zip(self.keys, self.values, other.layers):
            kb[:, :, self.length : end] = layer.keys
            vb[:, :, self.length : end] = layer.values
        self._positions[:, self.length : end] = other.positions
        self.length = end
        return self

    def crop(self, length: int) -> DraftCache:
        """Keep the first ``length`` positions (in place; returns ``self``)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length={length} is invalid: must be in [0, {self.length}]")
        self.length = length
        return self

    def to_context_kv(self) -> ContextKV:
        """A standalone copy of the valid context as the reference :class:`ContextKV`."""
        return ContextKV([LayerKV(kv.keys.clone(), kv.values.clone()) for kv in self.layers], self.positions.clone())
