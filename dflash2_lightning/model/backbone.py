"""The DFlash backbone, top to bottom: norm, RoPE, KV-injected attention, MLP, layer, context cache.

A draft layer attends from the *block* (anchor + mask tokens, embedded by the target's frozen
``embed_tokens``) to ``cat(context, block)`` keys/values, where the context is the target's own
hidden states fused by ``fc`` + ``hidden_norm``. Q comes from the block only; inside the block the
attention is non-causal. Each sublayer (attention, MLP) is wrapped by a *seam*: ``prepare`` before it,
``finish`` after it. DFlash leaves the seam a no-op; DFlash2 plugs its block convolution in there.

Numerics follow the Qwen3 modules of transformers (norms in float32, RoPE tables in float32), so a
checkpoint computes the same numbers here, in the z-lab reference and in the serving engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2_lightning.config import DraftConfig


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE with the target's base. ``inv_freq`` is a non-persistent buffer (never saved), float32 whatever
    the module is cast to: ``model.to(torch.bfloat16)`` would otherwise round it to 8 bits of mantissa, an angle
    error of up to ~3.5 rad at position 3000, which no engine makes (they all compute RoPE in float32)."""

    inv_freq: Tensor  # the buffer registered in __init__

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device: torch.device | None) -> Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / self.head_dim
        return 1.0 / (self.base**exponent)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":  # recomputed, not cast back (that would keep the rounding)
            self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [B, S]`` -> ``(cos, sin)`` of shape ``[B, 1, S, head_dim]`` in ``dtype``."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


@dataclass
class LayerKV:
    """Context keys/values of one draft layer: ``[B, num_kv_heads, C, head_dim]`` (k normed and roped)."""

    keys: Tensor
    values: Tensor


@dataclass
class CacheSlot:
    """One layer of a preallocated cache (:class:`~dflash2_lightning.model.cache.DraftCache`) for a draft step.

    ``keys``/``values`` are the whole buffers ``[B, num_kv_heads, capacity + block, head_dim]``; the first
    ``length`` positions are the context. The attention writes the block's K/V right after them and
    attends to the first ``length + block`` positions as a view: no copy of the context.
    """

    keys: Tensor
    values: Tensor
    length: int


@dataclass
class BufferedKV:
    """One layer's cache buffers for a graph that cannot write in place (ONNX ``draft_step``).

    ``keys``/``values`` ``[B, num_kv_heads, N, head_dim]``: only the keys where ``valid [B, 1 or Q, N]``
    is True are attended to. The attention scores the block against the buffers and against its own
    K/V separately and normalises them together, so the context is never copied or concatenated (and
    K/V are never repeated per query head: the query heads of one KV head are grouped instead).
    ``block_valid [Q, Q]`` (True = attend) restricts the block's keys (a sliding window), or is None.
    """

    keys: Tensor
    values: Tensor
    valid: Tensor
    block_valid: Tensor | None = None


@dataclass
class ContextKV:
    """The draft's context cache: per-layer K/V of verified target features and their positions ``[B, C]``.

    A server appends the newly verified tokens' K/V each cycle instead of recomputing the context.
    """

    layers: list[LayerKV]
    positions: Tensor

    @property
    def length(self) -> int:
        return int(self.positions.shape[1])

    def append(self, other: ContextKV) -> ContextKV:
        """A cache holding this context followed by ``other``."""
        return ContextKV(
            [
                LayerKV(torch.cat([a.keys, b.keys], 2), torch.cat([a.values, b.values], 2))
                for a, b in zip(self.layers, other.layers)
            ],
            torch.cat([self.positions, other.positions], 1),
        )

    def crop(self, length: int) -> ContextKV:
        """The first ``length`` context positions."""
        return ContextKV(
            [LayerKV(kv.keys[:, :, :length], kv.values[:, :, :length]) for kv in self.layers],
            self.positions[:, :length],
        )


@dataclass
class ContextStates:
    """The fused context ``hidden_norm(fc(features)) [B, C, H]`` with its RoPE tables, before any K/V projection.

    Each layer projects it to its own K/V inside its forward (training): under FSDP a layer's weights are
    gathered only while that layer's forward runs, so no layer's projection may be called from outside it.
    """

    hidden: Tensor
    cos: Tensor
    sin: Tensor
    positions: Tensor


class Seam(Protocol):
    """A sublayer seam: :meth:`prepare` transforms the sublayer's input and returns it with a state, which
    :meth:`finish` takes with the sublayer's output. The state is the seam's own (None for :class:`IdentitySeam`,
    the output side's kernel for DFlash2's :class:`~dflash2_lightning.model.conv.DFlashGroupedConv`), so it is
    typed Any here."""

    def prepare(self, x: Tensor) -> tuple[Tensor, Any]: ...

    def finish(self, y: Tensor, state: Any) -> Tensor: ...


class IdentitySeam(nn.Module):
    """The no-op sublayer seam of DFlash: ``prepare(x) = (x, None)``, ``finish(y, _) = y``; no parameters."""

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return x, None

    def finish(self, y: Tensor, state: Tensor | None) -> Tensor:
        return y


class DraftAttention(nn.Module):
    """GQA attention from the block to ``cat(context, block)`` with per-head q/k RMSNorm and RoPE."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        hd = cfg.resolved("head_dim")
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        return x.view(*x.shape[:2], n, self.head_dim)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> LayerKV:
        """K/V of ``x [B, S, H]`` at the positions of ``cos``/``sin``: ``[B, num_kv_heads, S, head_dim]``."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return LayerKV(apply_rope(k, cos, sin), v)

    def _split_attention(self, q: Tensor, block: LayerKV, cache: BufferedKV) -> Tensor:
        """Softmax over ``cat(cache, block)`` keys computed as two score matrices: ``[B, heads, Q, head_dim]``."""
        b, _, q_len, hd = q.shape
        kv, repeat = self.num_kv_heads, self.num_heads // self.num_kv_heads
        # Query head h reads KV head h // repeat (as repeat_interleave would): group them per KV head.
        qg = q.reshape(b, kv, repeat * q_len, hd) * (hd**-0.5)
        ctx = (qg @ cache.keys.transpose(-1, -2)).view(b, kv, repeat, q_len, -1)
        ctx = ctx.masked_fill(~cache.valid[:, None, None], float("-inf"))
        own = (qg @ block.keys.transpose(-1, -2)).view(b, kv, repeat, q_len, q_len)
        if cache.block_valid is not None:
            own = own.masked_fill(~cache.block_valid, float("-inf"))
        n = ctx.shape[-1]
        probs = torch.softmax(torch.cat([ctx, own], dim=-1), dim=-1).view(b, kv, repeat * q_len, n + q_len)
        out = probs[..., :n] @ cache.values + probs[..., n:] @ block.values
        return out.view(b, self.num_heads, q_len, hd)

    def forward(
        self, x: Tensor, context: LayerKV | CacheSlot | BufferedKV, cos: Tensor, sin: Tensor, mask: Tensor | None
    ) -> Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        block = self.project_kv(x, cos, sin)
        if isinstance(context, BufferedKV):
            return self.o_proj(self._split_attention(q, block, context).transpose(1, 2).reshape(b, q_len, -1))
        if isinstance(context, CacheSlot):  # preallocated: the block goes into the scratch slots after the context
            end = context.length + q_len
            context.keys[:, :, context.length : end] = block.keys
            context.values[:, :, context.length : end] = block.values
            k, v = context.keys[:, :, :end], context.values[:, :, :end]
        else:
            k = torch.cat([context.keys, block.keys], dim=2)
            v = torch.cat([context.values, block.values], dim=2)
        repeat = self.num_heads // self.num_kv_heads
        # SDPA's own GQA skips copying K/V per query head (same numbers). CUDA kernels take it only
        # without a mask (else they fall back to the slow math kernel), so there the copy stays.
        gqa = repeat > 1 and (mask is None or not q.is_cuda)
        if repeat > 1 and not gqa:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    """Qwen3 SwiGLU MLP."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        inter = cfg.resolved("intermediate_size")
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm Qwen3 layer with a seam around each sublayer."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.attention_conv: Seam = IdentitySeam()
        self.mlp_conv: Seam = IdentitySeam()

    def forward(
        self,
        h: Tensor,
        context: LayerKV | CacheSlot | BufferedKV | ContextStates,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
    ) -> Tensor:
        if isinstance(context, ContextStates):  # this layer's context K/V, inside its own forward (FSDP)
            context = self.self_attn.project_kv(context.hidden, context.cos, context.sin)
        x, state = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, context, cos, sin, mask), state)
        x, state = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), state)


def sliding_window_mask(q_positions: Tensor, k_positions: Tensor, window: int) -> Tensor:
    """Boolean ``[B, 1, Q, K]`` mask (True = attend) keeping keys within ``window`` of each query, both ways."""
    distance = q_positions[:, :, None] - k_positions[:, None, :]
    return (distance.abs() < window)[:, None]
