"""`DraftModel`: the DFlash backbone, plus DFlash2's convolutions and candidate selector when configured.

Data path of one draft step::

    target_features [B, C, n_t*H] --fc--> hidden_norm --> ctx --(per layer k/v proj, k_norm, RoPE)--> ContextKV
    block tokens [anchor, MASK...] --target embed_tokens--> x [B, Q, H]
    x --layers (attend to cat(ContextKV, block), seams around sublayers)--> norm --> hidden [B, Q, H]
    hidden[:, 1:] --target lm_head--> logits --> argmax (DFlash) or top-k + selector walk (DFlash2)

The state dict is exactly the served checkpoint: no embedding, no head, no rotary buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.model.backbone import (
    CacheSlot,
    ContextKV,
    ContextStates,
    DraftLayer,
    LayerKV,
    RMSNorm,
    RotaryEmbedding,
    sliding_window_mask,
)
from dflash2_lightning.model.cache import DraftCache
from dflash2_lightning.model.conv import DFlashGroupedConv
from dflash2_lightning.model.selector import CandidateSelector

Head = Callable[[Tensor], Tensor]


class DraftModel(nn.Module):
    """A DFlash (``projector_type="dflash"``) or DFlash2 (``"dflash2"``) draft built from a :class:`DraftConfig`."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.resolved("head_dim"), config.rope_theta)
        self.apply(self._init_linear)
        if config.is_dflash2:
            for layer in self.layers:
                layer.attention_conv = DFlashGroupedConv(
                    h, config.block_size, config.conv_kernel_size, config.conv_group_size
                )
                layer.mlp_conv = DFlashGroupedConv(
                    h, config.block_size, config.conv_kernel_size, config.conv_group_size
                )
            self.candidate_selector: CandidateSelector | None = CandidateSelector(
                h, config.vocab_size, config.selector_rank, config.selector_top_k, config.initializer_range
            )
            nn.init.normal_(self.candidate_selector.hidden_projection.weight, std=config.initializer_range)
        else:
            self.candidate_selector = None

    def _init_linear(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    # ------------------------------------------------------------------ context
    def context_states(self, target_features: Tensor, positions: Tensor) -> ContextStates:
        """The fused context of target features ``[B, C, n_t*H]`` at absolute ``positions [B, C]``, which each
        layer projects to its K/V in its own forward (what training passes to :meth:`forward`)."""
        ctx = self.hidden_norm(self.fc(target_features))
        cos, sin = self.rotary(positions, ctx.dtype)
        return ContextStates(ctx, cos, sin, positions)

    def context_kv(self, target_features: Tensor, positions: Tensor) -> ContextKV:
        """Per-layer K/V of target features ``[B, C, n_t*H]`` at absolute ``positions [B, C]``."""
        states = self.context_states(target_features, positions)
        # nn.ModuleList types its items as Module; every one is a DraftLayer (built in __init__).
        layers = cast(Iterable[DraftLayer], self.layers)
        return ContextKV(
            [layer.self_attn.project_kv(states.hidden, states.cos, states.sin) for layer in layers], positions
        )

    # ------------------------------------------------------------------ block
    def forward(
        self,
        noise_embeds: Tensor,
        positions: Tensor,
        context: ContextKV | DraftCache | ContextStates,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Final hidden states ``[B, Q, H]`` of the block embeddings ``noise_embeds [B, Q, H]``.

        ``positions [B, Q]`` are the block's absolute positions; ``context`` holds the K/V the block
        attends to (a :class:`ContextKV`, or a preallocated :class:`DraftCache`, whose scratch slots then
        take the block's K/V: inference only; or :class:`ContextStates`, which each layer projects itself);
        ``attention_mask`` (bool ``[B, 1, Q, C + Q]``, True = attend) is needed only when several blocks share
        one call (training) — a single block sees its whole context.
        """
        if isinstance(context, DraftCache) and noise_embeds.shape[1] > context.block_size:
            raise ValueError(
                f"a block of {noise_embeds.shape[1]} positions exceeds the cache's "
                f"block_size={context.block_size} scratch slots"
            )
        if attention_mask is None and self.config.sliding_window is not None:
            keys = torch.cat([context.positions, positions], dim=1)
            attention_mask = sliding_window_mask(positions, keys, self.config.sliding_window)
        cos, sin = self.rotary(positions, noise_embeds.dtype)
        h = noise_embeds
        kvs: Sequence[LayerKV | CacheSlot | ContextStates]
        if isinstance(context, ContextStates):
            kvs = [context] * len(self.layers)
        else:
            kvs = context.slots() if isinstance(context, DraftCache) else context.layers
        for layer, kv in zip(self.layers, kvs):
            h = layer(h, kv, cos, sin, attention_mask)
        return self.norm(h)

    # ------------------------------------------------------------------ proposing tokens
    def propose(self, hidden: Tensor, anchor: Tensor, head: Head) -> Tensor:
        """Draft tokens ``[B, L]`` for the mask slots' hidden ``[B, L, H]`` after ``anchor [B]``.

        DFlash takes the head's argmax per position; DFlash2 walks the selector lattice over the
        head's top-k candidates.
        """
        logits = head(hidden)
        if self.candidate_selector is None:
            return logits.argmax(-1)
        unary, cand = logits.topk(self.candidate_selector.top_k, dim=-1)
        return self.candidate_selector.greedy_path(cand, unary, hidden, anchor)

    def draft_block(
        self,
        anchor: Tensor,
        context: ContextKV | DraftCache,
        embed: Head,
        head: Head,
        start: Tensor | int | None = None,
    ) -> Tensor:
        """One drafting step: ``[anchor, MASK x (block_size-1)]`` at positions ``start..`` -> tokens ``[B, bs-1]``.

        ``start`` defaults to the first position after the context.
        """
        b, bs = anchor.shape[0], self.config.block_size
        tokens = torch.full((b, bs), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        tokens[:, 0] = anchor
        if start is None:
            start = context.positions[:, -1:] + 1 if context.length else torch.zeros(b, 1, dtype=torch.long)
        positions = torch.as_tensor(start, device=anchor.device).reshape(-1, 1) + torch.arange(bs, device=anchor.device)
        hidden = self(embed(tokens), positions.expand(b, bs), context)
        # contiguous: a sliced [B, bs-1, H] view sends the head's matmul down a slow batched path on CPU.
        return self.propose(hidden[:, 1:].contiguous(), anchor, head)

    def at_block_size(self, block_size: int) -> DraftModel:
        """This draft served at another block size: the same weights, drafting ``block_size - 1`` tokens per step.

        What an engine runs when told to serve a smaller block (vLLM's ``1 + num_speculative_tokens``, SGLang's
        draft-token count, llama.cpp's ``--spec-draft-n-max + 1``): the block is ``[anchor, MASK x
        (block_size-1)]`` and the convolution's taps stop at that block's start. No weight depends on the
        block size, so the copy holds the same tensors' values; it is a new module (in the same dtype and on
        the same device), this one is unchanged. The trained ``block_size`` returns ``self``.
        """
        if block_size == self.config.block_size:
            return self
        served = DraftModel(self.config.replace(block_size=block_size))  # validates conv_kernel_size <= block_size
        reference = next(self.parameters())
        served = served.to(device=reference.device, dtype=reference.dtype)
        served.load_state_dict(self.state_dict(), strict=True)
        return served.train(self.training)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
