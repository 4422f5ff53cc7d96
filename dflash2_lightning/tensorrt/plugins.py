"""TensorRT plugins for the two DFlash2 custom ops, built on ahead-of-time Triton kernels.

The ONNX nodes ``DFlashBlockConv`` and ``DFlashLatticeWalk`` (domain ``dflash``, attributes
``plugin_namespace="dflash"``, ``plugin_version="1"``) are parsed by TensorRT into the plugins
registered here as ``dflash::DFlashBlockConv`` and ``dflash::DFlashLatticeWalk`` through TensorRT's
Python plugin API (``tensorrt.plugin``: register / autotune / aot_impl). The implementation is
``aot_impl`` only: at engine build it compiles the Triton kernel from
``dflash2_lightning.kernels`` to PTX for the build GPU and hands TensorRT the PTX, the launch grid
and the integer arguments as symbolic shape expressions, so the serialized engine launches the
kernel itself and needs no Python (trtexec / C++ can run it).

    | plugin            | inputs                                                   | output            | fields     |
    | DFlashBlockConv   | x [B,S,H], base [T,H], delta [B,S,T,G]                   | y [B,S,H] like x  | block_size |
    | DFlashLatticeWalk | cand [B,L,K] i64, unary [B,L,K], proj [B,L,r], anchor [B] | tokens [B,L] i64 | --         |
                          i64, pred_codebook [V,r], succ_codebook [V,r]

Float inputs may each be FP32, FP16 or BF16 (TensorRT 11 networks are strongly typed, so the ONNX
graph decides); the kernels accumulate in float32. ``top_k`` (K) must be a build-time constant.

The shape, attribute and launch logic are plain functions at the top of this file, callable without
TensorRT (the CPU tests call them); ``register_plugins()`` imports ``tensorrt`` and registers the
plugins, once per process. Import this module and call it before parsing the ONNX model.

This module deliberately has no ``from __future__ import annotations``: ``tensorrt.plugin`` reads the
registered functions' annotations as objects.
"""

import itertools
import os
from typing import Any, List, Optional, Sequence, Tuple, Union

from dflash2_lightning.kernels.runtime import MAX_TOP_K  # torch only; triton is imported at engine build

PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
BLOCK_CONV_OP = "DFlashBlockConv"
LATTICE_WALK_OP = "DFlashLatticeWalk"
BLOCK_CONV_ID = f"{PLUGIN_NAMESPACE}::{BLOCK_CONV_OP}"
LATTICE_WALK_ID = f"{PLUGIN_NAMESPACE}::{LATTICE_WALK_OP}"
FLOAT_TYPES = ("FP32", "FP16", "BF16")  # tensorrt.plugin's names; order = autotune preference
# trt.DataType enum name -> Triton pointer element type
TRITON_TYPE_OF_TRT = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT64": "i64", "INT32": "i32"}

Dim = Optional[int]  # a known size, or None where the size is only known at run time
Shape = Sequence[Dim]

__all__ = ["PLUGIN_NAMESPACE", "PLUGIN_VERSION", "BLOCK_CONV_ID", "LATTICE_WALK_ID", "check_block_size",
           "block_conv_output_shape", "lattice_walk_output_shape", "block_conv_type_combinations",
           "lattice_walk_type_combinations", "block_conv_launch", "lattice_walk_launch", "triton_type_of",
           "register_plugins"]


# ----------------------------------------------------------------------------- pure shape / attribute logic
def _check_rank(name: str, shape: Shape, rank: int, layout: str) -> None:
    if len(shape) != rank:
        raise ValueError(f"{name} has shape {tuple(shape)}: must have rank {rank} ({layout})")


def _must_equal(what: str, a: Dim, b: Dim) -> None:
    if a is not None and b is not None and a != b:
        raise ValueError(f"{what}: {a} != {b}")


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
    _check_rank("x", x, 3, "[B,S,H]")
    _check_rank("base", base, 2, "[T,H]")
    _check_rank("delta", delta, 4, "[B,S,T,G]")
    _must_equal("base hidden size (base[1]) vs x[2]", base[1], x[2])
    _must_equal("delta batch (delta[0]) vs x[0]", delta[0], x[0])
    _must_equal("delta length (delta[1]) vs x[1]", delta[1], x[1])
    _must_equal("delta taps (delta[2]) vs base[0]", delta[2], base[0])
    if base[0] is not None and base[0] < 1:
        raise ValueError(f"taps (base[0]) = {base[0]} is invalid: must be >= 1")
    groups, hidden, length = delta[3], x[2], x[1]
    if groups is not None and (groups < 1 or (hidden is not None and hidden % groups)):
        raise ValueError(f"groups (delta[3]) = {groups} is invalid: must be >= 1 and divide hidden size x[2] = {hidden}")
    if length is not None and length % block_size:
        raise ValueError(f"sequence length x[1] = {length} is invalid: must be a multiple of block_size={block_size}")
    return tuple(x)


def lattice_walk_output_shape(cand: Shape, unary: Shape, proj: Shape, anchor: Shape,
                              pred_codebook: Shape, succ_codebook: Shape) -> tuple[Dim, Dim]:
    """Shape ``[B, L]`` of ``tokens`` after checking every input against the op contract."""
    _check_rank("cand", cand, 3, "[B,L,K]")
    _check_rank("unary", unary, 3, "[B,L,K]")
    _check_rank("proj", proj, 3, "[B,L,r]")
    _check_rank("anchor", anchor, 1, "[B]")
    _check_rank("pred_codebook", pred_codebook, 2, "[V,r]")
    _check_rank("succ_codebook", succ_codebook, 2, "[V,r]")
    for i, axis in enumerate("BLK"):
        _must_equal(f"unary[{i}] ({axis}) vs cand[{i}]", unary[i], cand[i])
    _must_equal("proj[0] (B) vs cand[0]", proj[0], cand[0])
    _must_equal("proj[1] (L) vs cand[1]", proj[1], cand[1])
    _must_equal("anchor[0] (B) vs cand[0]", anchor[0], cand[0])
    _must_equal("pred_codebook[1] (r) vs proj[2]", pred_codebook[1], proj[2])
    _must_equal("succ_codebook shape vs pred_codebook", succ_codebook[0], pred_codebook[0])
    _must_equal("succ_codebook[1] (r) vs proj[2]", succ_codebook[1], proj[2])
    top_k = cand[2]
    if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k (cand[2]) = {top_k} is invalid: must satisfy 1 <= top_k <= {MAX_TOP_K}")
    return cand[0], cand[1]


def block_conv_type_combinations() -> list[str]:
    """Every supported ``x, base, delta, y`` type combination (``y`` has the type of ``x``)."""
    return [f"{x}, {b}, {d}, {x}" for x, b, d in itertools.product(FLOAT_TYPES, repeat=3)]


def lattice_walk_type_combinations() -> list[str]:
    """Every supported ``cand, unary, proj, anchor, pred, succ, tokens`` type combination (ids are INT64)."""
    return [f"INT64, {u}, {p}, INT64, {a}, {b}, INT64"
            for u, p, a, b in itertools.product(FLOAT_TYPES, repeat=4)]


def triton_type_of(trt_type_name: str) -> str:
    """TensorRT ``DataType`` enum name (``"FLOAT"``, ``"HALF"``, ``"BF16"``, ``"INT64"``) -> Triton type name."""
    try:
        return TRITON_TYPE_OF_TRT[trt_type_name]
    except KeyError:
        raise ValueError(f"tensor type {trt_type_name!r} is not supported: must be one of "
                         f"{sorted(TRITON_TYPE_OF_TRT)}") from None


def block_conv_launch(x: Sequence, base: Sequence, delta: Sequence, block_size: int,
                      block_rows: int, block_h: int) -> tuple[tuple, tuple]:
    """``(scalar args, grid)`` of the block-conv kernel for contiguous inputs.

    Works on ints and on TensorRT shape expressions alike (only ``+ - * //`` are used), so the
    plugin builds symbolic launch arguments with the same code the tests check with numbers.
    """
    rows = x[0] * x[1]
    hidden, taps, groups = x[2], base[0], delta[3]
    scalars = (rows, hidden, taps, groups, block_size, delta[2] * delta[3], delta[3])
    grid = ((rows + (block_rows - 1)) // block_rows, (hidden + (block_h - 1)) // block_h)
    return scalars, grid


def lattice_walk_launch(cand: Sequence, proj: Sequence) -> tuple[tuple, tuple]:
    """``(scalar args, grid)`` of the lattice-walk kernel: ``(L, K, r)`` and one program per request."""
    return (cand[1], cand[2], proj[2]), (cand[0],)


# ----------------------------------------------------------------------------- TensorRT registration
_REGISTERED = False


def _known(expr: Any) -> Dim:
    """A TensorRT shape expression's value when it is a build-time constant, else None."""
    if isinstance(expr, int):
        return expr
    if getattr(expr, "is_fake", False) or not expr.is_constant:
        return None
    return expr.constant_value()


def _known_shape(desc: Any) -> tuple[Dim, ...]:
    return tuple(_known(e) for e in desc.shape_expr)


def _triton_type(desc: Any) -> str:
    return triton_type_of(desc.dtype.name)


def _build_arch() -> Optional[int]:
    """``DFLASH2_TRT_ARCH`` (e.g. 90) overrides the compute capability the kernels are compiled for."""
    value = os.environ.get("DFLASH2_TRT_ARCH")
    return int(value) if value else None


def register_plugins() -> None:
    """Register both plugins with TensorRT's plugin registry (idempotent). Needs ``tensorrt`` >= 10.9."""
    global _REGISTERED
    if _REGISTERED:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dflash2_lightning.kernels.aot import compile_block_conv, compile_lattice_walk

    @trtp.register(BLOCK_CONV_ID)
    def block_conv_desc(x: trtp.TensorDesc, base: trtp.TensorDesc, delta: trtp.TensorDesc,
                        block_size: int) -> trtp.TensorDesc:
        if not any(getattr(e, "is_fake", False) for e in x.shape_expr):
            block_conv_output_shape(_known_shape(x), _known_shape(base), _known_shape(delta), block_size)
        return x.like()

    @trtp.autotune(BLOCK_CONV_ID)
    def block_conv_autotune(x: trtp.TensorDesc, base: trtp.TensorDesc, delta: trtp.TensorDesc,
                            outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR") for types in block_conv_type_combinations()]

    @trtp.aot_impl(BLOCK_CONV_ID)
    def block_conv_aot(x: trtp.TensorDesc, base: trtp.TensorDesc, delta: trtp.TensorDesc, block_size: int,
                       outputs: Tuple[trtp.TensorDesc], tactic: int
                       ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        hidden = _known(x.shape_expr[2]) or 1024  # only picks the tile width; any H is handled
        kernel = compile_block_conv(_triton_type(x), hidden, _build_arch(),
                                    base_dtype=_triton_type(base), delta_dtype=_triton_type(delta))
        scalars, grid = block_conv_launch(x.shape_expr, base.shape_expr, delta.shape_expr,
                                          check_block_size(block_size), kernel.constants["BLOCK_ROWS"],
                                          kernel.constants["BLOCK_H"])
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y = grid
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared
        args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in scalars])
        return kernel.name, kernel.ptx, launch, args

    @trtp.register(LATTICE_WALK_ID)
    def lattice_walk_desc(cand: trtp.TensorDesc, unary: trtp.TensorDesc, proj: trtp.TensorDesc,
                          anchor: trtp.TensorDesc, pred_codebook: trtp.TensorDesc,
                          succ_codebook: trtp.TensorDesc) -> trtp.TensorDesc:
        descs = (cand, unary, proj, anchor, pred_codebook, succ_codebook)
        if not any(getattr(e, "is_fake", False) for d in descs for e in d.shape_expr):
            lattice_walk_output_shape(*(_known_shape(d) for d in descs))
        return trtp.from_shape_expr((cand.shape_expr[0], cand.shape_expr[1]), dtype=trt.int64)

    @trtp.autotune(LATTICE_WALK_ID)
    def lattice_walk_autotune(cand: trtp.TensorDesc, unary: trtp.TensorDesc, proj: trtp.TensorDesc,
                              anchor: trtp.TensorDesc, pred_codebook: trtp.TensorDesc,
                              succ_codebook: trtp.TensorDesc,
                              outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR") for types in lattice_walk_type_combinations()]

    @trtp.aot_impl(LATTICE_WALK_ID)
    def lattice_walk_aot(cand: trtp.TensorDesc, unary: trtp.TensorDesc, proj: trtp.TensorDesc,
                         anchor: trtp.TensorDesc, pred_codebook: trtp.TensorDesc, succ_codebook: trtp.TensorDesc,
                         outputs: Tuple[trtp.TensorDesc], tactic: int
                         ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        top_k = _known(cand.shape_expr[2])
        if top_k is None:
            raise ValueError("top_k (cand dimension 2) must be a build-time constant for DFlashLatticeWalk")
        rank = _known(proj.shape_expr[2]) or 256  # only picks the chunk width along r
        kernel = compile_lattice_walk(_triton_type(unary), top_k, rank, _build_arch(),
                                      proj_dtype=_triton_type(proj), pred_dtype=_triton_type(pred_codebook),
                                      succ_dtype=_triton_type(succ_codebook))
        scalars, grid = lattice_walk_launch(cand.shape_expr, proj.shape_expr)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = grid[0]
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared
        args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in scalars])
        return kernel.name, kernel.ptx, launch, args

    _REGISTERED = True
