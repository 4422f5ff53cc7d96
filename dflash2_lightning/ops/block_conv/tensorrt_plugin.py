"""TensorRT plugin ``dflash::DFlashBlockConv``: the block convolution on its ahead-of-time Triton kernel.

    | plugin          | inputs                                 | output           | field      |
    | DFlashBlockConv | x [B,S,H], base [T,H], delta [B,S,T,G] | y [B,S,H] like x | block_size |

Float inputs may each be FP32, FP16 or BF16 (TensorRT 11 networks are strongly typed, so the ONNX graph
decides); the kernel accumulates in float32. The implementation is ``aot_impl`` only: at engine build
the Triton kernel of :mod:`dflash2_lightning.ops.block_conv.triton_kernel` is compiled to PTX for the
build GPU and TensorRT gets the PTX, the launch grid and the integer arguments as symbolic shape
expressions, so the serialized engine launches the kernel itself and needs no Python.

The shape, attribute and launch logic are plain functions (tested on a CPU); :func:`register` is called
by :func:`dflash2_lightning.ops.tensorrt_plugins.register_plugins`. No ``from __future__ import
annotations``: ``tensorrt.plugin`` reads the registered functions' annotations as objects.
"""

import itertools
from collections.abc import Sequence
from typing import Any

from dflash2_lightning.ops.tensorrt_common import (
    FLOAT_TYPES,
    PLUGIN_NAMESPACE,
    Dim,
    Shape,
    build_arch,
    check_rank,
    known,
    known_shape,
    must_equal,
    triton_type,
)

__all__ = [
    "BLOCK_CONV_ID",
    "check_block_size",
    "block_conv_output_shape",
    "block_conv_type_combinations",
    "block_conv_launch",
    "register",
]

BLOCK_CONV_OP = "DFlashBlockConv"
BLOCK_CONV_ID = f"{PLUGIN_NAMESPACE}::{BLOCK_CONV_OP}"


def check_block_size(block_size: Any) -> int:
    """The ``block_size`` plugin field as an int; raises if it is not an integer >= 1."""
    try:
        value = int(block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size={block_size!r} is invalid: must be an integer >= 1") from None
    if value != block_size or value < 1:
        raise ValueError(f"block_size={block_size!r} is invalid: must be an integer >= 1")
    return value


def block_conv_output_shape(x: Shape, base: Shape, delta: Shape, block_size: Any) -> tuple[Dim, ...]:
    """Shape of ``y`` (= ``x``) after checking ``x [B,S,H]``, ``base [T,H]``, ``delta [B,S,T,G]``, ``block_size``.

    Sizes may be ``None`` (dynamic); only known sizes are checked.
    """
    block_size = check_block_size(block_size)
    check_rank("x", x, 3, "[B,S,H]")
    check_rank("base", base, 2, "[T,H]")
    check_rank("delta", delta, 4, "[B,S,T,G]")
    must_equal("base hidden size (base[1]) vs x[2]", base[1], x[2])
    must_equal("delta batch (delta[0]) vs x[0]", delta[0], x[0])
    must_equal("delta length (delta[1]) vs x[1]", delta[1], x[1])
    must_equal("delta taps (delta[2]) vs base[0]", delta[2], base[0])
    if base[0] is not None and base[0] < 1:
        raise ValueError(f"taps (base[0]) = {base[0]} is invalid: must be >= 1")
    groups, hidden, length = delta[3], x[2], x[1]
    if groups is not None and (groups < 1 or (hidden is not None and hidden % groups)):
        raise ValueError(
            f"groups (delta[3]) = {groups} is invalid: must be >= 1 and divide hidden size x[2] = {hidden}"
        )
    if length is not None and length % block_size:
        raise ValueError(f"sequence length x[1] = {length} is invalid: must be a multiple of block_size={block_size}")
    return tuple(x)


def block_conv_type_combinations() -> list[str]:
    """Every supported ``x, base, delta, y`` type combination (``y`` has the type of ``x``)."""
    return [f"{x}, {b}, {d}, {x}" for x, b, d in itertools.product(FLOAT_TYPES, repeat=3)]


def block_conv_launch(
    x: Sequence, base: Sequence, delta: Sequence, block_size: int, block_rows: int, block_h: int
) -> tuple[tuple, tuple]:
    """``(scalar args, grid)`` of the block-conv kernel for contiguous inputs.

    Works on ints and on TensorRT shape expressions alike (only ``+ - * //`` are used), so the
    plugin builds symbolic launch arguments with the same code the tests check with numbers.
    """
    rows = x[0] * x[1]
    hidden, taps, groups = x[2], base[0], delta[3]
    scalars = (rows, hidden, taps, groups, block_size, delta[2] * delta[3], delta[3])
    grid = ((rows + (block_rows - 1)) // block_rows, (hidden + (block_h - 1)) // block_h)
    return scalars, grid


def register(trt: Any, trtp: Any) -> None:
    """Register the plugin's description, tactics and ahead-of-time implementation with ``tensorrt.plugin``."""
    from dflash2_lightning.ops.block_conv.triton_kernel import compile_block_conv

    @trtp.register(BLOCK_CONV_ID)
    def block_conv_desc(
        x: trtp.TensorDesc, base: trtp.TensorDesc, delta: trtp.TensorDesc, block_size: int
    ) -> trtp.TensorDesc:
        if not any(getattr(e, "is_fake", False) for e in x.shape_expr):
            block_conv_output_shape(known_shape(x), known_shape(base), known_shape(delta), block_size)
        return x.like()

    @trtp.autotune(BLOCK_CONV_ID)
    def block_conv_autotune(
        x: trtp.TensorDesc, base: trtp.TensorDesc, delta: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc]
    ) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR") for types in block_conv_type_combinations()]

    @trtp.aot_impl(BLOCK_CONV_ID)
    def block_conv_aot(
        x: trtp.TensorDesc,
        base: trtp.TensorDesc,
        delta: trtp.TensorDesc,
        block_size: int,
        outputs: tuple[trtp.TensorDesc],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        hidden = known(x.shape_expr[2]) or 1024  # only picks the tile width; any H is handled
        kernel = compile_block_conv(
            triton_type(x), hidden, build_arch(), base_dtype=triton_type(base), delta_dtype=triton_type(delta)
        )
        scalars, grid = block_conv_launch(
            x.shape_expr,
            base.shape_expr,
            delta.shape_expr,
            check_block_size(block_size),
            kernel.constants["BLOCK_ROWS"],
            kernel.constants["BLOCK_H"],
        )
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y = grid
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared
        args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in scalars])
        return kernel.name, kernel.ptx, launch, args
