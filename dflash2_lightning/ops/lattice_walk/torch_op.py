"""``dflash::lattice_walk``: the candidate selector's greedy walk (temperature 0), as a torch op.

All ``[L, K, K]`` edge scores of a block are computed in one batched operation, then the small table
is walked::

    score[b, l, p, c] = unary[b, l, c] + <pred_codebook[prev_l[p]] * proj[b, l], succ_codebook[cand[b, l, c]]>

with ``prev_0 = anchor`` and ``prev_l = cand[:, l - 1]``. Ties go to the lowest candidate index. The
eager implementation here is the reference of the Triton kernel, the ONNX body and the TensorRT plugin;
on CUDA tensors the Triton kernel runs when it is installed (:mod:`dflash2_lightning.ops.dispatch`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2_lightning.ops import dispatch

__all__ = ["lattice_walk", "edge_scores", "walk_edge_scores", "lattice_walk_per_position"]


def edge_scores(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    """All edge scores of a block at once: ``[B, L, K_prev, K]`` (float32 or wider).

    Row ``p`` of position ``l`` scores moving from predecessor ``prev_l[p]`` to each candidate;
    position 0 has the anchor as its only predecessor (every row is the same).
    """
    dtype = torch.promote_types(unary.dtype, torch.float32)
    b, length, k = cand.shape
    # One gather per codebook and one batched matmul for the whole block: at batch 1 the cost is
    # per-op overhead, not arithmetic, so the op count is what matters.
    prev = torch.cat([anchor.reshape(b, 1).expand(b, k), cand[:, :-1].reshape(b, (length - 1) * k)], dim=1)
    context = pred_codebook.index_select(0, prev.reshape(-1)).to(dtype).view(b * length, k, -1)
    successor = succ_codebook.index_select(0, cand.reshape(-1)).to(dtype).view(b * length, k, -1)
    context = context * proj.to(dtype).reshape(b * length, 1, -1)
    transition = torch.bmm(context, successor.transpose(1, 2))  # [B*L, K_prev, K]
    return (unary.to(dtype).reshape(b * length, 1, k) + transition).view(b, length, k, k)


def walk_edge_scores(scores: Tensor, cand: Tensor) -> Tensor:
    """Greedy walk through ``[B, L, K, K]`` edge scores; returns the chosen tokens ``[B, L]``.

    The best successor of every predecessor slot is one ``argmax`` over the table (it returns the
    first maximum, so ties go to the lowest candidate index); the walk then only follows pointers.
    """
    best = scores.argmax(-1)  # [B, L, K_prev]
    index = _follow_on_host(best) if best.device.type == "cpu" else _follow_on_device(best)
    return cand.gather(2, index[..., None]).squeeze(-1)


def _follow_on_host(best: Tensor) -> Tensor:
    """Chosen slots ``[B, L]`` from best-successor pointers ``[B, L, K]``, walked in Python.

    At batch 1 a loop over a small list beats ``L`` tiny tensor ops. Position 0 has the anchor as
    its only predecessor (all rows equal), so the walk starts from row 0.
    """
    choices = []
    for table in best.tolist():
        choice, path = 0, []
        for row in table:
            choice = row[choice]
            path.append(choice)
        choices.append(path)
    return torch.tensor(choices, dtype=torch.long, device=best.device).view(best.shape[:2])


def _follow_on_device(best: Tensor) -> Tensor:
    """As :func:`_follow_on_host`, with tensor ops only (no host sync on an accelerator)."""
    choice = best.new_zeros(best.shape[0], 1)
    path = []
    for position in range(best.shape[1]):
        choice = best[:, position].gather(1, choice)
        path.append(choice)
    return torch.cat(path, dim=1)


def _check_walk_shapes(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> None:
    if cand.dim() != 3 or unary.shape != cand.shape or proj.dim() != 3 or proj.shape[:2] != cand.shape[:2]:
        raise ValueError(
            f"lattice_walk expects cand/unary [B,L,K] and proj [B,L,r]; got "
            f"{tuple(cand.shape)}, {tuple(unary.shape)}, {tuple(proj.shape)}"
        )
    if (
        anchor.shape != cand.shape[:1]
        or pred_codebook.shape != succ_codebook.shape
        or pred_codebook.shape[1] != proj.shape[2]
    ):
        raise ValueError(
            f"lattice_walk shapes disagree: anchor {tuple(anchor.shape)}, codebooks "
            f"{tuple(pred_codebook.shape)}/{tuple(succ_codebook.shape)}, proj {tuple(proj.shape)}"
        )


def _lattice_walk_impl(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    _check_walk_shapes(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    if cand.is_cuda and dispatch.cuda_lattice_walk is not None:  # Triton, optional extra
        return dispatch.cuda_lattice_walk(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    scores = edge_scores(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    return walk_edge_scores(scores, cand)


@torch.library.custom_op("dflash::lattice_walk", mutates_args=())
def _lattice_walk_op(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    return _lattice_walk_impl(cand, unary, proj, anchor, pred_codebook, succ_codebook)


@_lattice_walk_op.register_fake
def _(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    return cand.new_empty(cand.shape[:2])


def lattice_walk(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    """Greedy selector path ``[B, L]`` through candidates ``cand [B, L, K]`` seeded with ``anchor [B]``."""
    if dispatch.eager_inference(unary, proj, pred_codebook, succ_codebook):
        return _lattice_walk_impl(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    return _lattice_walk_op(cand, unary, proj, anchor, pred_codebook, succ_codebook)


def lattice_walk_per_position(
    cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor, pred_codebook: Tensor, succ_codebook: Tensor
) -> Tensor:
    """The obvious loop (one projection per position). Kept as the benchmark's baseline."""
    prev = anchor
    path = []
    dtype = torch.promote_types(unary.dtype, torch.float32)
    for position in range(cand.shape[1]):
        context = pred_codebook[prev].to(dtype) * proj[:, position].to(dtype)
        scores = unary[:, position].to(dtype) + torch.einsum(
            "br,bkr->bk", context, succ_codebook[cand[:, position]].to(dtype)
        )
        choice = scores.argmax(-1, keepdim=True)
        prev = cand[:, position].gather(1, choice)[:, 0]
        path.append(prev)
    return torch.stack(path, dim=1)
