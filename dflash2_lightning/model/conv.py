"""`DFlashGroupedConv`: the grouped dynamic depthwise convolution DFlash2 wraps around each sublayer.

``prepare(x)`` projects the sublayer input once into both sides' kernel deltas
(``kernel_projection: H -> 2*T*G``), convolves the input with side 0 and hands side 1's delta to
``finish(y)``, which convolves the sublayer output. Each side's kernel is ``base_kernel[side] + delta``;
the arithmetic lives in the ``dflash::block_conv`` custom op. At construction ``base_kernel`` is an
identity (tap 0 = 1) and ``kernel_projection`` is zero, so the wrapper is an exact no-op.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash2_lightning.ops import block_conv


class DFlashGroupedConv(nn.Module):
    """Block-local, causal-within-block dynamic convolution over positions (``taps`` wide)."""

    def __init__(self, hidden_size: int, block_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if not 1 <= taps <= block_size:
            raise ValueError(
                f"conv_kernel_size={taps} is invalid: must satisfy 1 <= conv_kernel_size <= block_size={block_size}"
            )
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} is invalid: must divide hidden_size={hidden_size}")
        self.block_size, self.taps, self.num_groups = block_size, taps, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)  # [side (0 = input, 1 = output), tap, channel]
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Convolve the sublayer input; return it with the output side's delta ``[B, S, T, G]``."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.num_groups)
        return block_conv(x, self.base_kernel[0], delta[..., 0, :, :], self.block_size), delta[..., 1, :, :]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        """Convolve the sublayer output with the kernel :meth:`prepare` produced."""
        return block_conv(y, self.base_kernel[1], delta, self.block_size)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, taps={self.taps}, groups={self.num_groups}"
