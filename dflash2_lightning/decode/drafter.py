"""The draft side of the speculative loop: the :class:`Drafter` interface and the torch draft behind it.

The loop talks to a draft through three calls, so a drafter running in another runtime (onnxruntime,
TensorRT) drops in for :class:`TorchDrafter`::

    cache = draft.context_kv(features [B, C, n_t*H], positions [B, C])
    cache = cache.append(draft.context_kv(new_features, new_positions))
    tokens = draft.draft_block(anchor [B], cache, embed, head, start)   # [B, bs-1]

A drafter may also offer ``new_cache(batch, capacity)`` (an empty preallocated cache the loop appends to
in place) and ``sample_block(...)`` (a sampled proposal with the distributions it was drawn from, for
temperature > 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from dflash2_lightning.model.backbone import ContextKV
from dflash2_lightning.model.cache import DraftCache
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.model.sampling import Proposal, Sampling, sample_backbone, sample_selector_walk

Head = Callable[[Tensor], Tensor]
DraftPath = Literal["selector", "backbone"]


class ContextCache(Protocol):
    """The draft's cache of context K/V; :class:`ContextKV` and :class:`DraftCache` are two."""

    def append(self, other: Any) -> ContextCache: ...


class Drafter(Protocol):
    """What the loop needs from a draft: geometry, context K/V of new features, one block of drafts."""

    block_size: int
    target_layer_ids: list[int]

    def context_kv(self, features: Tensor, positions: Tensor) -> ContextCache: ...

    def draft_block(self, anchor: Tensor, context: ContextCache, embed: Head, head: Head, start: int) -> Tensor: ...

    # Optional, for temperature > 0 (a drafter without it is greedy-only):
    # def sample_block(self, anchor, context, embed, head, start, sampling, generator) -> Proposal: ...


class TorchDrafter:
    """A :class:`DraftModel` behind the :class:`Drafter` interface, with a choice of decoding path.

    ``path="selector"`` proposes with the DFlash2 selector walk (``DraftModel.propose``); ``"backbone"``
    takes the argmax of the target head on the draft hidden, which is what a DFlash baseline always
    does and lets a DFlash2 draft be measured without its selector. The block is the one
    ``DraftModel.draft_block`` builds; the embedding is cast to the draft's dtype and the draft hidden
    back to the target's before the head, so a float32 draft runs beside a float64 or bf16 target.

    ``head`` replaces the loop's target head for drafting only, e.g. :func:`low_precision_head`: the
    target still verifies with its own head, so the output stays exact and only τ can change.
    """

    def __init__(self, model: DraftModel, path: DraftPath | None = None, head: Head | None = None) -> None:
        path = path or ("selector" if model.candidate_selector is not None else "backbone")
        if path not in ("selector", "backbone"):
            raise ValueError(f"path={path!r} is invalid: must be 'selector' or 'backbone'")
        if path == "selector" and model.candidate_selector is None:
            raise ValueError(
                "path='selector' is invalid for a DFlash draft (projector_type='dflash' "
                "has no candidate selector): use path='backbone'"
            )
        self.model, self.path, self.head = model.eval(), path, head
        self.block_size = model.config.block_size
        self.target_layer_ids = list(model.config.target_layer_ids or [])
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def context_kv(self, features: Tensor, positions: Tensor) -> ContextKV:
        return self.model.context_kv(features.to(self.dtype), positions)

    def new_cache(self, batch: int, capacity: int) -> DraftCache:
        """An empty preallocated cache of ``capacity`` context positions (the draft's dtype and device)."""
        return DraftCache.for_model(self.model, batch, capacity)

    def _block_hidden(
        self, anchor: Tensor, context: ContextCache, embed: Head, head: Head, start: int
    ) -> tuple[Tensor, Head]:
        """The draft hidden of the block's mask slots ``[B, bs-1, H]`` and the head to apply to it."""
        if not isinstance(context, (ContextKV, DraftCache)):
            raise TypeError(
                f"TorchDrafter drafts from the caches it makes (ContextKV or DraftCache), not {type(context).__name__}"
            )
        cfg = self.model.config
        tokens = torch.full(
            (anchor.shape[0], cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=anchor.device
        )
        tokens[:, 0] = anchor
        positions = (start + torch.arange(cfg.block_size, device=anchor.device)).expand_as(tokens)
        embeds = embed(tokens)
        hidden = self.model(embeds.to(self.dtype), positions, context)[:, 1:]  # slot 0 is the anchor
        head = self.head or head  # a drafting head of its own (low_precision_head) wins over the loop's
        return hidden, lambda h: head(h.to(embeds.dtype))

    @torch.inference_mode()
    def draft_block(self, anchor: Tensor, context: ContextCache, embed: Head, head: Head, start: int) -> Tensor:
        hidden, target_head = self._block_hidden(anchor, context, embed, head, start)
        if self.path == "selector":
            return self.model.propose(hidden, anchor, target_head)
        return target_head(hidden).argmax(-1)

    @torch.inference_mode()
    def sample_block(
        self,
        anchor: Tensor,
        context: ContextCache,
        embed: Head,
        head: Head,
        start: int,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """A sampled block and the distributions it was drawn from (see :mod:`dflash2_lightning.model.sampling`)."""
        hidden, target_head = self._block_hidden(anchor, context, embed, head, start)
        logits = target_head(hidden.contiguous())
        if self.path == "selector":
            selector = self.model.candidate_selector
            if selector is None:  # refused by __init__: only a model changed since then gets here
                raise ValueError("path='selector' needs the draft's candidate selector, which this draft has not")
            return sample_selector_walk(selector, logits, hidden, anchor, sampling, generator)
        return sample_backbone(logits, sampling, generator)


def low_precision_head(target: Any, dtype: torch.dtype = torch.bfloat16) -> Head:
    """A drafting head: the target's ``lm_head`` weight cast once to ``dtype``, applied in ``dtype``.

    On a CPU with bf16 dot-product instructions (AVX512-BF16, AMX) the 15 x vocab head of a draft step
    runs faster in bfloat16 than in float32 (docs/cpu-linears.md has the measurements) and reads half
    the bytes. Logits come back in ``dtype``; the top-k and the walk widen them to float32. Only for
    drafting: :func:`speculative_generate` verifies with the target's own head.
    """
    hf = getattr(target, "hf", target)
    lm_head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if not isinstance(lm_head, nn.Linear):
        raise ValueError(f"low_precision_head needs an nn.Linear lm_head, not {type(lm_head).__name__}")
    weight = lm_head.weight.detach().to(dtype)
    bias = None if lm_head.bias is None else lm_head.bias.detach().to(dtype)

    def head(hidden: Tensor) -> Tensor:
        # As rows: a [1, 15, H] slice of a [1, 16, H] block counts as contiguous but keeps the batch
        # stride 16*H, and oneDNN's bf16 matmul then takes a path an order of magnitude slower.
        rows = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        return torch.nn.functional.linear(rows, weight, bias).view(*hidden.shape[:-1], -1)

    return head


def as_drafter(draft: DraftModel | Drafter, path: DraftPath | None = None) -> Drafter:
    """Wrap a :class:`DraftModel` in a :class:`TorchDrafter`; pass any other drafter through unchanged."""
    if isinstance(draft, DraftModel):
        return TorchDrafter(draft, path)
    drafted = getattr(draft, "path", path)  # a drafter need not have a path (only a choice of paths has one)
    if path is not None and drafted != path:
        raise ValueError(f"path={path!r} was requested but the drafter decodes with path={drafted!r}")
    return draft
