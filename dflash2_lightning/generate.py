"""Batched generation with the frozen target, for regenerating training data: greedy or sampled.

One batch::

    prompts (token ids) -> left-padded [B, P] + attention mask, positions from the mask
      prefill   one forward over the prompts -> K/V written to a preallocated cache [B, kv, P + new, d]
      decode    per step: logits [b, V] -> greedy argmax, or temperature / top-k / top-p
                (the speculative loop's processing, :func:`~dflash2_lightning.sampling.probabilities`),
                one draw per row from that row's own generator (:func:`~dflash2_lightning.sampling.draw_rows`)
                -> next tokens [b]
                -> one forward of [b, 1]: its K/V written in place at the step's slot, attention over
                   the filled slots; rows that emitted an eos (or hit max_new_tokens) stop, and leave
                   the batch (cache rows too) once an eighth of it has stopped
    -> responses (token ids, up to and including the first eos)

Why not ``transformers.generate``: every row samples from its own seeded generator, so a response
depends only on (prompt, seed) and not on which prompts happened to share its batch (a resumed
regeneration reproduces an uninterrupted one exactly); finished rows stop costing compute.

Why a loop of its own over the model's modules (Llama, Qwen2, Qwen3): transformers' growing cache
copies every layer's K/V at every step, and its attention with padding masks runs PyTorch's slow
reference kernel on CPU. The static loop calls the model's own norms, projections, rotary embedding
and MLPs, and replaces only the cache and the attention call. On 2 AMX cores (128 prompts x 96 tokens,
``benchmarks/bench_regen.py``) it generates 1.09x the tokens per second of the transformers-cache loop in
float32, and 763 tok/s in bfloat16: 2.5x the float32 loop, where the transformers-cache loop gets slower
in bfloat16 (251 vs 303 tok/s). Other architectures decode through transformers' cache
(:func:`_decode_transformers`), with eager attention when the target is bfloat16 on CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2_lightning.sampling import Sampling, draw_rows


def _next_tokens(logits: Tensor, sampling: Sampling, generators: Sequence[torch.Generator | None]) -> Tensor:
    if sampling.greedy:
        return logits.max(-1).indices  # argmax's first-max rule, ~2.5x faster on CPU; no float copy needed
    return draw_rows(logits, sampling, list(generators)).to(logits.device)


@contextlib.contextmanager
def _decode_attention(hf: torch.nn.Module) -> Iterator[None]:
    """Eager attention while a bfloat16 model decodes on CPU (same math, a faster kernel there)."""
    dtype, device = next(hf.parameters()).dtype, next(hf.parameters()).device
    before = getattr(hf.config, "_attn_implementation", None)
    switch = dtype == torch.bfloat16 and device.type == "cpu" and before not in (None, "eager")
    if switch:
        hf.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            hf.set_attn_implementation(before)


def _select_rows(cache: object, rows: Tensor) -> None:
    """Keep only ``rows`` of a transformers cache (every layer), in place."""
    for layer in getattr(cache, "layers"):
        layer.batch_select_indices(rows)


@torch.no_grad()
def generate(hf: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int],
             pad_id: int, sampling: Sampling = Sampling(), seeds: Sequence[int] | None = None,
             static_cache: bool | None = None) -> list[list[int]]:
    """Responses of a causal LM to a batch of tokenised prompts.

    Args:
        hf: a transformers causal LM (the target's ``hf``).
        prompts: token ids per prompt (any lengths; left-padded here).
        max_new_tokens: response budget (a response that reaches it is cut there).
        eos_ids: ids that end a response (kept as its last token).
        pad_id: id used for left padding (masked out).
        sampling: greedy (default) or sampled.
        seeds: one seed per prompt (required when sampling): row ``i`` draws only from its own generator.
        static_cache: decode with the project's static KV cache (``None``: wherever
            :func:`static_cache_supported`; ``False``: transformers' own cache, the reference loop).

    Returns one token list per prompt (both loops give the same tokens, tested).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    if not sampling.greedy and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError(f"sampling needs one seed per prompt: got {None if seeds is None else len(seeds)} seeds "
                         f"for {len(prompts)} prompts")

    device = next(hf.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    generators = [None] * n if sampling.greedy else [torch.Generator().manual_seed(int(s)) for s in seeds]
    eos = torch.as_tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long, device=device)

    if static_cache is True and not static_cache_supported(hf):
        raise ValueError(f"static_cache=True is not supported for model_type={hf.config.model_type!r}: the static "
                         f"loop decodes {list(STATIC_FAMILIES)} with full attention only")
    if static_cache is not False and static_cache_supported(hf):
        return _decode_static(hf, ids, mask, max_new_tokens, eos, sampling, generators)
    with _decode_attention(hf):
        return _decode_transformers(hf, ids, mask, max_new_tokens, eos, sampling, generators)


# ----------------------------------------------------------------------------- the static-cache loop
# Decoder families whose layers are exactly: x + o(attn(rope(q[, q_norm]), rope(k[, k_norm]), v)), then
# x + mlp(post_norm(x)), full causal attention. Anything else (sliding windows, softcapping, other
# layer shapes) decodes through the transformers cache loop below, with the same results.
STATIC_FAMILIES = ("llama", "qwen2", "qwen3")
# Finished rows are dropped from the batch (a copy of every layer's cache) once this share of it is dead;
# until then they ride along, so a batch whose rows end one by one does not copy its cache per row.
DROP_SHARE = 0.125


def static_cache_supported(hf: torch.nn.Module) -> bool:
    """Whether :func:`generate` can decode ``hf`` with its own static KV cache (else transformers' cache)."""
    cfg, body = hf.config, getattr(hf, "model", None)
    if getattr(cfg, "model_type", None) not in STATIC_FAMILIES or body is None:
        return False
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in
                                                         getattr(cfg, "layer_types", None) or ["full_attention"]):
        return False
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return all(hasattr(body, p) for p in parts) and hasattr(hf, "lm_head")


class _StaticKV:
    """Per layer K/V buffers ``[B, kv_heads, capacity, head_dim]``, filled in place, slot = step."""

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, like: Tensor) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [like.new_zeros(shape) for _ in range(layers)]
        self.v = [like.new_zeros(shape) for _ in range(layers)]

    def keep(self, rows: Tensor) -> None:
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


def _rope_fn(attn: torch.nn.Module) -> Any:
    """The model family's own ``apply_rotary_pos_emb`` (the one its attention calls)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def _forward_static(hf: torch.nn.Module, ids: Tensor, positions: Tensor, cache: _StaticKV, start: int,
                    allowed: Tensor) -> Tensor:
    """Logits of the last of ``ids [b, s]``, written to cache slots ``start..start+s``.

    ``allowed [b, s, start+s]`` says which cache slots each query sees. Each KV head's query heads are
    stacked along the query axis, so attention reads the cache once, without repeated K/V.
    """
    body = hf.model
    x = body.embed_tokens(ids)
    cos, sin = body.rotary_emb(x, positions)
    b, s = ids.shape
    end = start + s
    first = body.layers[0].self_attn
    group = first.config.num_attention_heads // first.config.num_key_value_heads
    # An additive mask (a boolean one sends PyTorch's CPU attention down a slower path), one per step.
    bias = torch.zeros((b, 1, group, s, end), dtype=x.dtype, device=x.device)
    bias = bias.masked_fill_(~allowed[:, None, None], float("-inf")).reshape(b, 1, group * s, end)
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (b, s, -1, attn.head_dim)
        q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope_fn(attn)(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        cache.k[i][:, :, start:end] = k
        cache.v[i][:, :, start:end] = v.transpose(1, 2)
        kv_heads = cache.k[i].shape[1]  # query head j * group + r reads KV head j
        # contiguous: a few-row projection comes out column-major (rows-first linear), and a query whose last
        # dim is strided sends PyTorch's CPU attention down its slow reference path.
        grouped = q.reshape(b, kv_heads, group * s, attn.head_dim).contiguous()
        o = F.scaled_dot_product_attention(grouped, cache.k[i][:, :, :end], cache.v[i][:, :, :end], attn_mask=bias,
                                           scale=attn.scaling)
        o = o.view(b, kv_heads * group, s, attn.head_dim).transpose(1, 2).reshape(b, s, -1)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(body.norm(x[:, -1]))


def _decode_static(hf: torch.nn.Module, ids: Tensor, mask: Tensor, max_new_tokens: int, eos: Tensor,
                   sampling: Sampling, generators: Sequence[torch.Generator | None]) -> list[list[int]]:
    """:func:`_decode_transformers` with preallocated K/V: no per-step concatenation, finished rows dropped
    in groups."""
    cfg = hf.config
    n, width = ids.shape
    capacity = width + max_new_tokens
    head_dim = hf.model.layers[0].self_attn.head_dim
    cache = _StaticKV(len(hf.model.layers), n, cfg.num_key_value_heads, capacity, head_dim,
                      next(hf.parameters()))
    valid = torch.zeros((n, capacity), dtype=torch.bool, device=ids.device)  # which cache slots hold real tokens
    valid[:, :width] = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones((width, width), dtype=torch.bool, device=ids.device).tril()
    # A padding query may see only itself: an all-masked row would make NaN, and NaN times a zero weight is NaN.
    allowed = (causal & valid[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=ids.device)
    logits = _forward_static(hf, ids, positions, cache, 0, allowed)
    live = torch.arange(n)  # original row of each batch row
    running = torch.ones(n, dtype=torch.bool)  # batch rows still generating
    out: list[list[int]] = [[] for _ in range(n)]
    next_pos = positions[:, -1] + 1
    device = ids.device
    for step in range(max_new_tokens):
        rows = running.nonzero().squeeze(-1)
        every, on_device = len(rows) == len(live), rows.to(device)
        if sampling.greedy:  # argmax every row and keep the running ones (cheaper than gathering their logits)
            picked = _next_tokens(logits, sampling, generators)[on_device]
        else:
            picked = _next_tokens(logits if every else logits[on_device], sampling,
                                  [generators[int(live[r])] for r in rows]).to(device)
        nxt = picked if every else torch.zeros(len(live), dtype=torch.long, device=device).index_copy_(
            0, on_device, picked)
        for r, tok in zip(rows.tolist(), picked.tolist()):
            out[int(live[r])].append(tok)
        running &= ~torch.isin(nxt, eos).cpu()
        if step == max_new_tokens - 1 or not bool(running.any()):
            break
        if (~running).sum() >= max(1, int(DROP_SHARE * len(live))):
            keep = running.nonzero().squeeze(-1)
            kept = keep.to(device)
            cache.keep(kept)
            live, running = live[keep], running[keep]
            nxt, valid, next_pos = nxt[kept], valid[kept], next_pos[kept]
        slot = width + step
        valid[:, slot] = True
        logits = _forward_static(hf, nxt[:, None], next_pos[:, None], cache, slot, valid[:, None, :slot + 1])
        next_pos = next_pos + 1
    return out


# ----------------------------------------------------------------------------- the transformers-cache loop
def _decode_transformers(hf: torch.nn.Module, ids: Tensor, mask: Tensor, max_new_tokens: int, eos: Tensor,
                         sampling: Sampling, generators: Sequence[torch.Generator | None]) -> list[list[int]]:
    from transformers import DynamicCache

    device, n = ids.device, ids.shape[0]
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1).logits[:, -1]
    live = torch.arange(n)  # original row of each row still generating
    out: list[list[int]] = [[] for _ in range(n)]
    last_pos = positions[:, -1]
    for step in range(max_new_tokens):
        nxt = _next_tokens(logits, sampling, [generators[int(r)] for r in live]).to(device)
        for row, tok in zip(live.tolist(), nxt.tolist()):
            out[row].append(tok)
        done = torch.isin(nxt, eos)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if bool(done.any()):  # finished rows leave the batch: no more compute spent on them
            keep = (~done).nonzero().squeeze(-1)
            _select_rows(cache, keep.to(device))
            live, nxt, mask, last_pos = live[keep.cpu()], nxt[keep], mask[keep], last_pos[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        last_pos = last_pos + 1
        logits = hf(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    cache=cache, use_cache=True).logits[:, -1]
    return out
