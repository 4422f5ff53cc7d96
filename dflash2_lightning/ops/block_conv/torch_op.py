"""``dflash::block_conv``: one side of DFlash2's grouped dynamic depthwise convolution, as a torch op.

    y[b, i, c] = sum_t [i mod block_size >= t] * (base[t, c] + delta[b, i, t, c // group]) * x[b, i - t, c]

Taps never cross a block start; inside a block position ``i`` reads only ``i`` and earlier positions.
``group = H / G`` comes from the shapes. A ``torch.library`` op, so export traces it as one node, with
an explicit backward. The eager implementation here is the reference every other implementation (the
Triton kernel, the ONNX body, the TensorRT plugin) is tested against; on CUDA tensors the Triton kernel
runs when it is installed (:mod:`dflash2_lightning.ops.dispatch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2_lightning.ops import dispatch

__all__ = ["block_conv", "block_conv_reference"]


def _shift_within_blocks(x: Tensor, tap: int, block_size: int) -> Tensor:
    """``out[:, i] = x[:, i - tap]`` when ``i`` and ``i - tap`` are in the same block, else 0."""
    if tap == 0:
        return x
    b, s = x.shape[:2]
    blocks = x.reshape(b, s // block_size, block_size, *x.shape[2:])
    pad = [0, 0] * (x.dim() - 2) + [tap, 0]
    shifted = F.pad(blocks[:, :, : block_size - tap], pad)
    return shifted.reshape(x.shape)


def _unshift_within_blocks(x: Tensor, tap: int, block_size: int) -> Tensor:
    """The adjoint of :func:`_shift_within_blocks`: ``out[:, j] = x[:, j + tap]`` inside a block."""
    if tap == 0:
        return x
    b, s = x.shape[:2]
    blocks = x.reshape(b, s // block_size, block_size, *x.shape[2:])
    pad = [0, 0] * (x.dim() - 2) + [0, tap]
    shifted = F.pad(blocks[:, :, tap:], pad)
    return shifted.reshape(x.shape)


def _check_conv_shapes(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> None:
    if x.dim() != 3 or base.dim() != 2 or delta.dim() != 4:
        raise ValueError(
            f"block_conv expects x [B,S,H], base [T,H], delta [B,S,T,G]; got "
            f"{tuple(x.shape)}, {tuple(base.shape)}, {tuple(delta.shape)}"
        )
    b, s, h = x.shape
    t, g = delta.shape[2], delta.shape[3]
    if s % block_size:
        raise ValueError(f"sequence length {s} is invalid: must be a multiple of block_size={block_size}")
    if base.shape != (t, h) or delta.shape[:2] != (b, s) or h % g:
        raise ValueError(
            f"block_conv shapes disagree: x {tuple(x.shape)}, base {tuple(base.shape)}, "
            f"delta {tuple(delta.shape)} (need base [T,H], delta [B,S,T,G], G divides H)"
        )


def block_conv_reference(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    """Eager, differentiable block convolution (the math of the module docstring)."""
    b, s, h = x.shape
    taps, groups = delta.shape[2], delta.shape[3]
    group = h // groups
    # The output has x's dtype (as the fake and the kernels say), also when fp32 parameters meet
    # bf16 activations under autocast.
    base, delta = base.to(x.dtype), delta.to(x.dtype)
    out = None
    for tap in range(taps):
        shifted = _shift_within_blocks(x, tap, block_size).reshape(b, s, groups, group)
        # base * x + delta * x, never a dense [.., T, H] coefficient tensor held for backward.
        term = base[tap].reshape(groups, group) * shifted + delta[:, :, tap, :, None] * shifted
        out = term if out is None else out + term
    if out is None:
        raise ValueError(f"block_conv needs at least one tap: delta {tuple(delta.shape)} has none (delta [B,S,T,G])")
    return out.reshape(b, s, h)


def _block_conv_impl(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    _check_conv_shapes(x, base, delta, block_size)
    if x.is_cuda and dispatch.cuda_block_conv is not None:  # Triton, optional extra
        return dispatch.cuda_block_conv(x, base, delta, block_size)
    return block_conv_reference(x, base, delta, block_size)


@torch.library.custom_op("dflash::block_conv", mutates_args=())
def _block_conv_op(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    return _block_conv_impl(x, base, delta, block_size)


@_block_conv_op.register_fake
def _(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    return torch.empty_like(x)


def _block_conv_setup(ctx, inputs, output) -> None:
    x, base, delta, block_size = inputs
    ctx.save_for_backward(x, base, delta)
    ctx.block_size = block_size


def _block_conv_backward(ctx, grad_y: Tensor):
    x, base, delta = ctx.saved_tensors
    bs = ctx.block_size
    b, s, h = x.shape
    taps, groups = delta.shape[2], delta.shape[3]
    group = h // groups
    gy = grad_y.reshape(b, s, groups, group)
    grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
    grad_base = torch.empty_like(base) if ctx.needs_input_grad[1] else None
    grad_delta = torch.empty_like(delta) if ctx.needs_input_grad[2] else None
    for tap in range(taps):
        if grad_base is not None or grad_delta is not None:
            prod = gy * _shift_within_blocks(x, tap, bs).reshape(b, s, groups, group)
            if grad_base is not None:
                grad_base[tap] = prod.sum(dim=(0, 1)).reshape(h)
            if grad_delta is not None:
                grad_delta[:, :, tap] = prod.sum(-1)
        if grad_x is not None:
            coef = base[tap].reshape(groups, group) + delta[:, :, tap, :, None]
            grad_x += _unshift_within_blocks((coef * gy).reshape(b, s, h), tap, bs)
    return grad_x, grad_base, grad_delta, None


_block_conv_op.register_autograd(_block_conv_backward, setup_context=_block_conv_setup)


def block_conv(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    """One side of the block convolution: ``x [B,S,H]``, ``base [T,H]``, ``delta [B,S,T,G]`` -> ``[B,S,H]``."""
    if dispatch.eager_inference(x, base, delta):
        return _block_conv_impl(x, base, delta, int(block_size))
    return _block_conv_op(x, base, delta, int(block_size))
