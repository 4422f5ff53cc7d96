"""TensorRT plugin ``dflash::DFlashLatticeWalk``: the selector's greedy walk on its ahead-of-time Triton kernel.

    | plugin            | inputs                                                   | output           |
    | DFlashLatticeWalk | cand [B,L,K] i64, unary [B,L,K], proj [B,L,r], anchor [B] | tokens [B,L] i64 |
                          i64, pred_codebook [V,r], succ_codebook [V,r]

Float inputs may each be FP32, FP16 or BF16; the kernel accumulates in float32. ``top_k`` (K) must be a
build-time constant. As for the block convolution, the implementation is ``aot_impl`` only (PTX of
:mod:`dflash2_lightning.ops.lattice_walk.triton_kernel`), so the engine needs no Python.

The shape and launch logic are plain functions (tested on a CPU); :func:`register` is called by
:func:`dflash2_lightning.ops.tensorrt_plugins.register_plugins`. No ``from __future__ import annotations``:
``tensorrt.plugin`` reads the registered functions' annotations as objects.
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
from dflash2_lightning.ops.triton_runtime import MAX_TOP_K  # torch only; triton is imported at engine build

__all__ = [
    "LATTICE_WALK_ID",
    "lattice_walk_output_shape",
    "lattice_walk_type_combinations",
    "lattice_walk_launch",
    "register",
]

LATTICE_WALK_OP = "DFlashLatticeWalk"
LATTICE_WALK_ID = f"{PLUGIN_NAMESPACE}::{LATTICE_WALK_OP}"


def lattice_walk_output_shape(
    cand: Shape, unary: Shape, proj: Shape, anchor: Shape, pred_codebook: Shape, succ_codebook: Shape
) -> tuple[Dim, Dim]:
    """Shape ``[B, L]`` of ``tokens`` after checking every input against the op contract."""
    check_rank("cand", cand, 3, "[B,L,K]")
    check_rank("unary", unary, 3, "[B,L,K]")
    check_rank("proj", proj, 3, "[B,L,r]")
    check_rank("anchor", anchor, 1, "[B]")
    check_rank("pred_codebook", pred_codebook, 2, "[V,r]")
    check_rank("succ_codebook", succ_codebook, 2, "[V,r]")
    for i, axis in enumerate("BLK"):
        must_equal(f"unary[{i}] ({axis}) vs cand[{i}]", unary[i], cand[i])
    must_equal("proj[0] (B) vs cand[0]", proj[0], cand[0])
    must_equal("proj[1] (L) vs cand[1]", proj[1], cand[1])
    must_equal("anchor[0] (B) vs cand[0]", anchor[0], cand[0])
    must_equal("pred_codebook[1] (r) vs proj[2]", pred_codebook[1], proj[2])
    must_equal("succ_codebook shape vs pred_codebook", succ_codebook[0], pred_codebook[0])
    must_equal("succ_codebook[1] (r) vs proj[2]", succ_codebook[1], proj[2])
    top_k = cand[2]
    if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k (cand[2]) = {top_k} is invalid: must satisfy 1 <= top_k <= {MAX_TOP_K}")
    return cand[0], cand[1]


def lattice_walk_type_combinations() -> list[str]:
    """Every supported ``cand, unary, proj, anchor, pred, succ, tokens`` type combination (ids are INT64)."""
    return [f"INT64, {u}, {p}, INT64, {a}, {b}, INT64" for u, p, a, b in itertools.product(FLOAT_TYPES, repeat=4)]


def lattice_walk_launch(cand: Sequence, proj: Sequence) -> tuple[tuple, tuple]:
    """``(scalar args, grid)`` of the lattice-walk kernel: ``(L, K, r)`` and one program per request."""
    return (cand[1], cand[2], proj[2]), (cand[0],)


def register(trt: Any, trtp: Any) -> None:
    """Register the plugin's description, tactics and ahead-of-time implementation with ``tensorrt.plugin``."""
    from dflash2_lightning.ops.lattice_walk.triton_kernel import compile_lattice_walk

    @trtp.register(LATTICE_WALK_ID)
    def lattice_walk_desc(
        cand: trtp.TensorDesc,
        unary: trtp.TensorDesc,
        proj: trtp.TensorDesc,
        anchor: trtp.TensorDesc,
        pred_codebook: trtp.TensorDesc,
        succ_codebook: trtp.TensorDesc,
    ) -> trtp.TensorDesc:
        descs = (cand, unary, proj, anchor, pred_codebook, succ_codebook)
        if not any(getattr(e, "is_fake", False) for d in descs for e in d.shape_expr):
            lattice_walk_output_shape(*(known_shape(d) for d in descs))
        return trtp.from_shape_expr((cand.shape_expr[0], cand.shape_expr[1]), dtype=trt.int64)

    @trtp.autotune(LATTICE_WALK_ID)
    def lattice_walk_autotune(
        cand: trtp.TensorDesc,
        unary: trtp.TensorDesc,
        proj: trtp.TensorDesc,
        anchor: trtp.TensorDesc,
        pred_codebook: trtp.TensorDesc,
        succ_codebook: trtp.TensorDesc,
        outputs: tuple[trtp.TensorDesc],
    ) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR") for types in lattice_walk_type_combinations()]

    @trtp.aot_impl(LATTICE_WALK_ID)
    def lattice_walk_aot(
        cand: trtp.TensorDesc,
        unary: trtp.TensorDesc,
        proj: trtp.TensorDesc,
        anchor: trtp.TensorDesc,
        pred_codebook: trtp.TensorDesc,
        succ_codebook: trtp.TensorDesc,
        outputs: tuple[trtp.TensorDesc],
        tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
        top_k = known(cand.shape_expr[2])
        if top_k is None:
            raise ValueError("top_k (cand dimension 2) must be a build-time constant for DFlashLatticeWalk")
        rank = known(proj.shape_expr[2]) or 256  # only picks the chunk width along r
        kernel = compile_lattice_walk(
            triton_type(unary),
            top_k,
            rank,
            build_arch(),
            proj_dtype=triton_type(proj),
            pred_dtype=triton_type(pred_codebook),
            succ_dtype=triton_type(succ_codebook),
        )
        scalars, grid = lattice_walk_launch(cand.shape_expr, proj.shape_expr)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = grid[0]
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared
        args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in scalars])
        return kernel.name, kernel.ptx, launch, args
