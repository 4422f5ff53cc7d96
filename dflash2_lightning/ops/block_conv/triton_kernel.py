"""Triton forward kernel of ``dflash::block_conv`` (one side of DFlash2's grouped block convolution).

    y[b, i, c] = sum_t [i mod block_size >= t] * (base[t, c] + delta[b, i, t, c // (H / G)]) * x[b, i - t, c]

One program owns a tile of ``BLOCK_ROWS`` flattened ``(b, i)`` rows by ``BLOCK_H`` channels. The
kernel coefficient ``base + delta`` is formed in registers per tap and never written out (the eager
reference would materialise a ``[B, S, T, H]`` tensor to do this in one op), accumulation is float32
whatever the storage dtype, and ``delta`` is read through its row and tap strides so the model's
``delta[..., side, :, :]`` slice of the ``[B, S, 2, T, G]`` projection is used in place, without a copy.
Because ``S`` is a multiple of ``block_size``, the flattened row index ``b * S + i`` has the same
position inside its block as ``i``, and a tap never reaches into the previous batch row.

Argument order is inputs, integer scalars, output: the order TensorRT's ahead-of-time plugin launcher
uses (:mod:`dflash2_lightning.ops.block_conv.tensorrt_plugin` launches this same kernel from PTX).
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from dflash2_lightning.ops.triton_aot import AotKernel, compile_kernel, float_type_name
from dflash2_lightning.ops.triton_runtime import device_of, launchable, next_power_of_2

__all__ = [
    "compile_block_conv",
    "block_conv_kernel",
    "block_conv",
    "block_conv_tiles",
    "block_conv_grid",
    "BLOCK_CONV_SCALARS",
]

# The kernel's integer scalar arguments, in order (the AOT path passes them as SymInt32 expressions).
BLOCK_CONV_SCALARS = ("rows", "hidden", "taps", "groups", "block_size", "delta_row_stride", "delta_tap_stride")


def block_conv_kernel(
    x_ptr,
    base_ptr,
    delta_ptr,
    rows,
    hidden,
    taps,
    groups,
    block_size,
    delta_row_stride,
    delta_tap_stride,
    y_ptr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    chan = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = row < rows
    chan_ok = chan < hidden
    in_block = row % block_size
    group = chan // (hidden // groups)
    row64 = row.to(tl.int64)  # B*S*H can pass 2**31 at long contexts
    acc = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
    for tap in range(taps):
        ok = (row_ok & (in_block >= tap))[:, None] & chan_ok[None, :]
        x = tl.load(x_ptr + (row64 - tap)[:, None] * hidden + chan[None, :], mask=ok, other=0.0)
        base = tl.load(base_ptr + tap * hidden + chan, mask=chan_ok, other=0.0)
        delta = tl.load(
            delta_ptr + row64[:, None] * delta_row_stride + tap * delta_tap_stride + group[None, :], mask=ok, other=0.0
        )
        acc += (base.to(tl.float32)[None, :] + delta.to(tl.float32)) * x.to(tl.float32)
    out_ok = row_ok[:, None] & chan_ok[None, :]
    tl.store(y_ptr + row64[:, None] * hidden + chan[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)


def block_conv_tiles(hidden: int) -> tuple[int, int, int]:
    """``(BLOCK_ROWS, BLOCK_H, num_warps)`` for a hidden size: 2-4k elements per program, memory bound."""
    if hidden < 1:
        raise ValueError(f"hidden={hidden} is invalid: must be >= 1")
    block_h = min(next_power_of_2(hidden), 256)
    block_rows = max(1, 2048 // block_h)
    return block_rows, block_h, 4


def block_conv_grid(rows: int, hidden: int) -> tuple[int, int]:
    """Launch grid for ``rows = B * S`` flattened positions."""
    block_rows, block_h, _ = block_conv_tiles(hidden)
    return (rows + block_rows - 1) // block_rows, (hidden + block_h - 1) // block_h


def _delta_strides(delta: Tensor) -> tuple[Tensor, int, int]:
    """``delta`` (a copy only if its rows cannot be addressed with one stride) and its row/tap strides."""
    b, s, _, _ = delta.shape
    flat_rows = b == 1 or delta.stride(0) == s * delta.stride(1)
    if delta.stride(3) != 1 or not flat_rows:
        delta = delta.contiguous()
    return delta, delta.stride(1), delta.stride(2)


def block_conv(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    """Launch the kernel: ``x [B,S,H]``, ``base [T,H]``, ``delta [B,S,T,G]`` -> ``y [B,S,H]`` (dtype of ``x``).

    Shapes are assumed checked by the caller (``dflash::block_conv`` checks them). Works on CUDA
    tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    b, s, h = x.shape
    taps, groups = delta.shape[2], delta.shape[3]
    x = x.contiguous()
    base = base.contiguous()
    delta, row_stride, tap_stride = _delta_strides(delta)
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    block_rows, block_h, num_warps = block_conv_tiles(h)
    grid = block_conv_grid(b * s, h)
    kernel = launchable(block_conv_kernel)
    with device_of(x):
        kernel[grid](
            x,
            base,
            delta,
            b * s,
            h,
            taps,
            groups,
            int(block_size),
            row_stride,
            tap_stride,
            y,
            BLOCK_ROWS=block_rows,
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    return y


def compile_block_conv(
    dtype: torch.dtype | str = "fp32",
    hidden: int = 1024,
    arch: int | None = None,
    *,
    base_dtype: torch.dtype | str | None = None,
    delta_dtype: torch.dtype | str | None = None,
) -> AotKernel:
    """The block-conv kernel for ``x``/``y`` of float ``dtype`` (``base``/``delta`` default to it) and ``hidden``."""
    ty = float_type_name(dtype)
    base_ty = float_type_name(base_dtype or ty)
    delta_ty = float_type_name(delta_dtype or ty)
    block_rows, block_h, num_warps = block_conv_tiles(hidden)
    signature = {
        "x_ptr": f"*{ty}",
        "base_ptr": f"*{base_ty}",
        "delta_ptr": f"*{delta_ty}",
        **{name: "i32" for name in BLOCK_CONV_SCALARS},
        "y_ptr": f"*{ty}",
    }
    return compile_kernel(block_conv_kernel, signature, {"BLOCK_ROWS": block_rows, "BLOCK_H": block_h}, num_warps, arch)
