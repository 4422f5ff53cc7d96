"""The two drafting graphs as torch modules, in the exact form they are exported.

A server drafts in two calls over a context cache it preallocates once and owns (per layer ``k_i``, ``v_i`` of
``[B, num_kv_heads, N, head_dim]``, ``N`` = capacity): ``context`` maps the ``C`` newly verified target features
(``features [B, C, n_t*H]``, ``positions [B, C]``) to their K/V (:meth:`DraftModel.context_kv`), which the caller
writes at ``length..length+C-1`` (appending costs O(new tokens)); ``draft_step`` maps the cache buffers,
``length [B]`` (slots ``>= length`` ignored, whatever they hold), ``anchor [B]``, ``start [B]`` (and with a
sliding window ``context_positions [B, N]``) to ``tokens [B, bs-1]`` and the final-norm ``hidden [B, bs-1, H]``,
through the baked embedding, the draft layers, the baked head and argmax (DFlash) or the lattice walk (DFlash2).

Why this shape: the step reads the buffers and never writes or copies them (each layer scores the block against
the cache and against its own K/V separately and normalises both together, :class:`BufferedKV`; grouped query
heads instead of repeated K/V), so nothing is aliased and the same device memory can be bound to every call
(onnxruntime IO binding, TensorRT ``set_tensor_address``). ``B`` (``"batch"``), ``C`` (``"context"``) and ``N``
(``"capacity"``) are dynamic; the names are the exported files' public interface (docs/export.md).
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import Tensor, nn

from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.backbone import BufferedKV

BATCH, CONTEXT, CAPACITY = "batch", "context", "capacity"

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def eval_copy(module: ModuleT, dtype: torch.dtype, device: str | torch.device | None = None) -> ModuleT:
    """A deep copy of ``module`` in ``dtype`` (and on ``device``), in eval mode: the caller's module stays as is."""
    return copy.deepcopy(module).to(device=device, dtype=dtype).eval()


def kv_names(num_layers: int) -> list[str]:
    """``["k_0", "v_0", ..., "k_{L-1}", "v_{L-1}"]``: the cache tensors, output of ``context``, input of ``draft_step``."""
    return [f"{kind}_{i}" for i in range(num_layers) for kind in ("k", "v")]


def context_io(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the ``context`` graph."""
    return ["features", "positions"], kv_names(num_layers)


def draft_step_io(num_layers: int, sliding_window: bool, with_hidden: bool = True) -> tuple[list[str], list[str]]:
    """Input and output names of the ``draft_step`` graph."""
    inputs = kv_names(num_layers) + ["length", "anchor", "start"] + (["context_positions"] if sliding_window else [])
    return inputs, ["tokens"] + (["hidden"] if with_hidden else [])


class ContextGraph(nn.Module):
    """``features [B, C, n_t*H]``, ``positions [B, C]`` -> flat per-layer ``(k_0, v_0, ...)``."""

    def __init__(self, draft: DraftModel) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        cache = self.draft.context_kv(features, positions)
        return tuple(t for kv in cache.layers for t in (kv.keys, kv.values))


class DraftStepGraph(nn.Module):
    """Cache buffers + valid length + anchor + start -> ``tokens [B, bs-1]`` (+ ``hidden [B, bs-1, H]``).

    ``embed`` and ``head`` are the target's frozen embedding and lm_head as modules (their weights
    become initializers of the graph). This is :meth:`DraftModel.draft_block` over a preallocated
    cache, written without in-place writes, with the hidden states kept as a second output.
    """

    def __init__(self, draft: DraftModel, embed: nn.Module, head: nn.Module, with_hidden: bool = True) -> None:
        super().__init__()
        self.draft, self.embed, self.head, self.with_hidden = draft, embed, head, with_hidden

    def forward(
        self, kv: list[Tensor], length: Tensor, anchor: Tensor, start: Tensor, context_positions: Tensor | None = None
    ) -> tuple[Tensor, ...]:
        draft, cfg = self.draft, self.draft.config
        bs = cfg.block_size
        masks = anchor.new_full((anchor.shape[0], bs - 1), cfg.mask_token_id)
        tokens = torch.cat([anchor[:, None], masks], dim=1)  # [anchor, MASK x (bs-1)]
        offsets = torch.arange(bs, device=anchor.device)
        positions = start[:, None] + offsets
        slots = torch.arange(kv[0].shape[2], device=anchor.device)
        valid = (slots[None] < length[:, None])[:, None]  # [B, 1, N]
        block_valid = None
        if cfg.sliding_window is not None:  # both ways, as sliding_window_mask: |q - k| < window
            if context_positions is None:
                raise ValueError("a sliding-window draft's step needs context_positions (the cache's positions)")
            distance = positions[:, :, None] - context_positions[:, None, :]
            valid = valid & (distance.abs() < cfg.sliding_window)  # [B, Q, N]
            block_valid = (offsets[:, None] - offsets[None, :]).abs() < cfg.sliding_window
        embeds = self.embed(tokens)
        cos, sin = draft.rotary(positions, embeds.dtype)
        h = embeds
        for i, layer in enumerate(draft.layers):
            h = layer(h, BufferedKV(kv[2 * i], kv[2 * i + 1], valid, block_valid), cos, sin, None)
        hidden = draft.norm(h)[:, 1:]
        drafts = self._propose(hidden, anchor)
        return (drafts, hidden) if self.with_hidden else (drafts,)

    def _propose(self, hidden: Tensor, anchor: Tensor) -> Tensor:
        """:meth:`DraftModel.propose`, except that bfloat16 logits are ranked in float32.

        ONNX ``TopK`` (opset <= 23) has no bfloat16; widening bf16 to float32 is exact, so the
        candidates and their scores are the same, and the scores go back to bfloat16 exactly.
        """
        selector = self.draft.candidate_selector
        logits = self.head(hidden)
        if selector is None:
            return logits.argmax(-1)
        if logits.dtype == torch.bfloat16:
            unary, cand = logits.float().topk(selector.top_k, dim=-1)
            unary = unary.to(logits.dtype)
        else:
            unary, cand = logits.topk(selector.top_k, dim=-1)
        return selector.greedy_path(cand, unary, hidden, anchor)


def frozen_embedding_and_head(
    embed_weight: Tensor, head_weight: Tensor, dtype: torch.dtype | None = None
) -> tuple[nn.Embedding, nn.Linear]:
    """Standalone copies of the target's ``embed_tokens`` ``[V, H]`` and bias-free ``lm_head`` ``[V, H]``.

    Tied weights (one tensor) stay one parameter, so the exported graph stores them once.
    """
    if embed_weight.dim() != 2 or head_weight.shape != embed_weight.shape:
        raise ValueError(
            f"embedding {tuple(embed_weight.shape)} and head {tuple(head_weight.shape)} must both be "
            "[vocab_size, hidden_size]"
        )
    dtype = dtype or embed_weight.dtype
    tied = embed_weight.data_ptr() == head_weight.data_ptr()
    vocab, hidden = embed_weight.shape
    embed = nn.Embedding(vocab, hidden, dtype=dtype)
    head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        embed.weight.copy_(embed_weight.detach().to(dtype))
        if tied:
            head.weight = embed.weight
        else:
            head.weight.copy_(head_weight.detach().to(dtype))
    return embed.requires_grad_(False), head.requires_grad_(False)
