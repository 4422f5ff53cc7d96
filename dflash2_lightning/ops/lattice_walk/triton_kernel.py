"""Triton kernel of ``dflash::lattice_walk``: edge scores and the greedy walk, one program per request.

    score[l, c] = unary[l, c] + <pred_codebook[prev_l] * proj[l], succ_codebook[cand[l, c]]>,
    prev_0 = anchor, prev_l = the candidate chosen at l - 1.

The greedy walk only ever reads the row of the predecessor it chose, so the program computes that
row and nothing else: per position it loads the ``K x r`` successor rows of its candidates (chunks of
``BLOCK_R`` along ``r``), forms the context ``pred_codebook[prev] * proj[l]`` and reduces to ``K``
scores in float32, then takes the argmax (ties -> lowest index, like ``torch.argmax``) and carries
the chosen token in a register to the next position. This is the row the eager reference picks out
of its full ``[L, K, K]`` table, in the same float32 arithmetic, so the two agree except where two
scores differ only by summation-order rounding.

Argument order is inputs, integer scalars, output (TensorRT's ahead-of-time plugin launch order).
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from dflash2_lightning.ops.triton_aot import AotKernel, compile_kernel, float_type_name
from dflash2_lightning.ops.triton_runtime import MAX_TOP_K, device_of, launchable, next_power_of_2

__all__ = [
    "compile_lattice_walk",
    "lattice_walk_kernel",
    "lattice_walk",
    "lattice_walk_tiles",
    "LATTICE_WALK_SCALARS",
    "MAX_TOP_K",
]

LATTICE_WALK_SCALARS = ("length", "top_k", "rank")


def lattice_walk_kernel(
    cand_ptr,
    unary_ptr,
    proj_ptr,
    anchor_ptr,
    pred_ptr,
    succ_ptr,
    length,
    top_k,
    rank,
    tokens_ptr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    k_idx = tl.arange(0, BLOCK_K)
    r_idx = tl.arange(0, BLOCK_R)
    k_ok = k_idx < top_k
    prev = tl.load(anchor_ptr + request)  # int64 token id carried from position to position
    for position in range(length):
        row = request * length + position
        cand = tl.load(cand_ptr + row * top_k + k_idx, mask=k_ok, other=0)
        score = tl.load(unary_ptr + row * top_k + k_idx, mask=k_ok, other=0.0).to(tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r_ok = (r0 + r_idx) < rank
            proj = tl.load(proj_ptr + row * rank + r0 + r_idx, mask=r_ok, other=0.0).to(tl.float32)
            pred = tl.load(pred_ptr + prev * rank + r0 + r_idx, mask=r_ok, other=0.0).to(tl.float32)
            succ = tl.load(
                succ_ptr + cand[:, None] * rank + r0 + r_idx[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0
            ).to(tl.float32)
            score += tl.sum(succ * (pred * proj)[None, :], axis=1)
        score = tl.where(k_ok, score, float("-inf"))
        choice = tl.argmax(score, axis=0, tie_break_left=True)
        prev = tl.sum(tl.where(k_idx == choice, cand, 0), axis=0)
        tl.store(tokens_ptr + row, prev)


def lattice_walk_tiles(top_k: int, rank: int) -> tuple[int, int, int]:
    """``(BLOCK_K, BLOCK_R, num_warps)``: the whole candidate row, ``r`` in chunks of at most 4k/BLOCK_K."""
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k={top_k} is invalid: must satisfy 1 <= top_k <= {MAX_TOP_K}")
    if rank < 1:
        raise ValueError(f"rank={rank} is invalid: must be >= 1")
    block_k = next_power_of_2(top_k)
    block_r = min(next_power_of_2(rank), max(16, 4096 // block_k))
    return block_k, block_r, 4


def lattice_walk(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    """Launch the kernel: ``cand/unary [B,L,K]``, ``proj [B,L,r]``, ``anchor [B]``, codebooks ``[V,r]``
    -> tokens ``[B,L]`` int64.

    Shapes are assumed checked by the caller (``dflash::lattice_walk`` checks them). Works on CUDA
    tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    b, length, top_k = cand.shape
    rank = proj.shape[2]
    tokens = torch.empty(b, length, dtype=torch.long, device=cand.device)
    if tokens.numel() == 0:
        return tokens
    args = [t.contiguous() for t in (cand.long(), unary, proj, anchor.long(), pred_codebook, succ_codebook)]
    block_k, block_r, num_warps = lattice_walk_tiles(top_k, rank)
    kernel = launchable(lattice_walk_kernel)
    with device_of(cand):
        kernel[(b,)](*args, length, top_k, rank, tokens, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=num_warps)
    return tokens


def compile_lattice_walk(
    dtype: torch.dtype | str = "fp32",
    top_k: int = 16,
    rank: int = 256,
    arch: int | None = None,
    *,
    proj_dtype: torch.dtype | str | None = None,
    pred_dtype: torch.dtype | str | None = None,
    succ_dtype: torch.dtype | str | None = None,
) -> AotKernel:
    """The lattice-walk kernel for ``unary`` of float ``dtype`` (``proj`` and the codebooks default to it)."""
    ty = float_type_name(dtype)
    proj_ty, pred_ty, succ_ty = (float_type_name(d or ty) for d in (proj_dtype, pred_dtype, succ_dtype))
    block_k, block_r, num_warps = lattice_walk_tiles(top_k, rank)
    signature = {
        "cand_ptr": "*i64",
        "unary_ptr": f"*{ty}",
        "proj_ptr": f"*{proj_ty}",
        "anchor_ptr": "*i64",
        "pred_ptr": f"*{pred_ty}",
        "succ_ptr": f"*{succ_ty}",
        **{name: "i32" for name in LATTICE_WALK_SCALARS},
        "tokens_ptr": "*i64",
    }
    return compile_kernel(lattice_walk_kernel, signature, {"BLOCK_K": block_k, "BLOCK_R": block_r}, num_warps, arch)
