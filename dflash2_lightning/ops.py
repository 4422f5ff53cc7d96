"""The two DFlash2 custom ops, as ``torch.library`` ops so export traces each as one node.

``dflash::block_conv``
    One side of the grouped dynamic depthwise convolution::

        y[b, i, c] = sum_t [i mod block_size >= t] * (base[t, c] + delta[b, i, t, c // group]) * x[b, i - t, c]

    Taps never cross a block start; inside a block position ``i`` reads only ``i`` and earlier
    positions. ``group = H / G`` comes from the shapes. Differentiable (explicit backward below).

``dflash::lattice_walk``
    The candidate selector's greedy walk (temperature 0). All ``[L, K, K]`` edge scores of a block
    are computed in one batched operation, then the small table is walked::

        score[b, l, p, c] = unary[b, l, c] + <pred_codebook[prev_l[p]] * proj[b, l], succ_codebook[cand[b, l, c]]>

    with ``prev_0 = anchor`` and ``prev_l = cand[:, l - 1]``. Ties go to the lowest candidate index.

A CUDA implementation from ``dflash2_lightning.kernels`` is used on CUDA tensors when Triton is
installed; the eager implementations here are the reference every other implementation is tested
against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["block_conv", "lattice_walk", "block_conv_reference", "edge_scores", "walk_edge_scores",
           "lattice_walk_per_position"]


# ----------------------------------------------------------------------------- block conv
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
        raise ValueError(f"block_conv expects x [B,S,H], base [T,H], delta [B,S,T,G]; got "
                         f"{tuple(x.shape)}, {tuple(base.shape)}, {tuple(delta.shape)}")
    b, s, h = x.shape
    t, g = delta.shape[2], delta.shape[3]
    if s % block_size:
        raise ValueError(f"sequence length {s} is invalid: must be a multiple of block_size={block_size}")
    if base.shape != (t, h) or delta.shape[:2] != (b, s) or h % g:
        raise ValueError(f"block_conv shapes disagree: x {tuple(x.shape)}, base {tuple(base.shape)}, "
                         f"delta {tuple(delta.shape)} (need base [T,H], delta [B,S,T,G], G divides H)")


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
    return out.reshape(b, s, h)


def _eager_inference(*tensors: Tensor) -> bool:
    """True when an op may skip the ``torch.library`` dispatcher and run its implementation directly.

    That is: plain eager code (not traced by ``torch.export`` / ``torch.compile`` / the ONNX exporter,
    which must see the op as one node) and no autograd (nothing to record a backward for). The
    dispatcher's own cost (autograd wrapper, dynamo guard, redispatch) is ~0.1 ms per call, which at
    batch 1 is as much as a small draft layer's whole block convolution.
    """
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _block_conv_impl(x: Tensor, base: Tensor, delta: Tensor, block_size: int) -> Tensor:
    _check_conv_shapes(x, base, delta, block_size)
    if x.is_cuda:
        from dflash2_lightning.kernels import cuda_block_conv  # Triton, optional extra

        if cuda_block_conv is not None:
            return cuda_block_conv(x, base, delta, block_size)
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
    if _eager_inference(x, base, delta):
        return _block_conv_impl(x, base, delta, int(block_size))
    return _block_conv_op(x, base, delta, int(block_size))


# ----------------------------------------------------------------------------- lattice walk
def edge_scores(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
                pred_codebook: Tensor, succ_codebook: Tensor) -> Tensor:
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


def _check_walk_shapes(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
                       pred_codebook: Tensor, succ_codebook: Tensor) -> None:
    if cand.dim() != 3 or unary.shape != cand.shape or proj.dim() != 3 or proj.shape[:2] != cand.shape[:2]:
        raise ValueError(f"lattice_walk expects cand/unary [B,L,K] and proj [B,L,r]; got "
                         f"{tuple(cand.shape)}, {tuple(unary.shape)}, {tuple(proj.shape)}")
    if anchor.shape != cand.shape[:1] or pred_codebook.shape != succ_codebook.shape \
            or pred_codebook.shape[1] != proj.shape[2]:
        raise ValueError(f"lattice_walk shapes disagree: anchor {tuple(anchor.shape)}, codebooks "
                         f"{tuple(pred_codebook.shape)}/{tuple(succ_codebook.shape)}, proj {tuple(proj.shape)}")


def _lattice_walk_impl(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
                       pred_codebook: Tensor, succ_codebook: Tensor) -> Tensor:
    _check_walk_shapes(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    if cand.is_cuda:
        from dflash2_lightning.kernels import cuda_lattice_walk  # Triton, optional extra

        if cuda_lattice_walk is not None:
            return cuda_lattice_walk(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    scores = edge_scores(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    return walk_edge_scores(scores, cand)


@torch.library.custom_op("dflash::lattice_walk", mutates_args=())
def _lattice_walk_op(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
                     pred_codebook: Tensor, succ_codebook: Tensor) -> Tensor:
    return _lattice_walk_impl(cand, unary, proj, anchor, pred_codebook, succ_codebook)


@_lattice_walk_op.register_fake
def _(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
      pred_codebook: Tensor, succ_codebook: Tensor) -> Tensor:
    return cand.new_empty(cand.shape[:2])


def lattice_walk(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
                 pred_codebook: Tensor, succ_codebook: Tensor) -> Tensor:
    """Greedy selector path ``[B, L]`` through candidates ``cand [B, L, K]`` seeded with ``anchor [B]``."""
    if _eager_inference(unary, proj, pred_codebook, succ_codebook):
        return _lattice_walk_impl(cand, unary, proj, anchor, pred_codebook, succ_codebook)
    return _lattice_walk_op(cand, unary, proj, anchor, pred_codebook, succ_codebook)


def lattice_walk_per_position(cand: Tensor, unary: Tensor, proj: Tensor, anchor: Tensor,
                              pred_codebook: Tensor, succ_codebook: Tensor) -> Tensor:
    """The obvious loop (one projection per position). Kept as the benchmark's baseline."""
    prev = anchor
    path = []
    dtype = torch.promote_types(unary.dtype, torch.float32)
    for position in range(cand.shape[1]):
        context = pred_codebook[prev].to(dtype) * proj[:, position].to(dtype)
        scores = unary[:, position].to(dtype) + torch.einsum(
            "br,bkr->bk", context, succ_codebook[cand[:, position]].to(dtype))
        choice = scores.argmax(-1, keepdim=True)
        prev = cand[:, position].gather(1, choice)[:, 0]
        path.append(prev)
    return torch.stack(path, dim=1)
