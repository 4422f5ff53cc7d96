"""Batched generation with the frozen target, for regenerating training data: greedy or sampled.

Continuous batching over a static K/V cache of ``slots`` rows, one response per row at a time: the next prompts
are prefilled (left-padded) into free rows, each row with its own pointer and rotary position; every decode step
picks each row's next token (greedy, or drawn from the row's own generator after the speculative loop's
processing, :func:`~dflash2_lightning.model.sampling.draw_rows`) and runs one forward of ``[slots, 1]``; a row
that emits an eos or hits ``max_new_tokens`` yields ``(prompt index, response ids)``, and once an eighth of the
rows has ended the next prompts take their places. So the batch stays full while prompts remain, instead of a
fixed batch decoding until its longest response ends.

Why not ``transformers.generate``: every row samples from its own seeded generator, so a response depends only on
(prompt, seed), never on its batch neighbours (a resumed regeneration reproduces an uninterrupted one), and
finished rows stop costing compute. Why a loop of its own over the model's modules (Llama, Qwen2, Qwen3):
transformers' growing cache copies every layer's K/V at every step and its padded attention takes a slow
reference kernel on CPU; this loop calls the model's own norms, projections, rotary embedding and MLPs and
replaces only the cache and the attention call. Other architectures decode through transformers' cache
(:func:`_decode_transformers`). The step in detail: docs/internals.md ("Generation"); speeds: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2_lightning.model.sampling import Sampling, draw_rows
from dflash2_lightning.target.hf_cache import with_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _next_tokens(logits: Tensor, sampling: Sampling, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row of ``logits [b, V]``: drawn from the row's generator, or its argmax where that is None."""
    tokens = logits.max(-1).indices  # argmax's first-max rule, ~2.5x faster on CPU; no float copy needed
    drawn = [] if sampling.greedy else [k for k, g in enumerate(generators) if g is not None]
    if drawn:
        tokens[drawn] = draw_rows(logits[drawn], sampling, [generators[k] for k in drawn]).to(tokens.device)
    return tokens


@contextlib.contextmanager
def _decode_attention(hf: PreTrainedModel) -> Iterator[None]:
    """Eager attention while a bfloat16 model decodes on CPU (same math, a faster kernel there)."""
    dtype, device = next(hf.parameters()).dtype, next(hf.parameters()).device
    before = getattr(hf.config, "_attn_implementation", None)
    switch = dtype == torch.bfloat16 and device.type == "cpu" and before not in (None, "eager")
    restore = before if switch else None  # the implementation to put back; None: nothing switched
    if restore is not None:
        hf.set_attn_implementation("eager")
    try:
        yield
    finally:
        if restore is not None:
            hf.set_attn_implementation(restore)


def generate(
    hf: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    seeds: Sequence[int | None] | None = None,
    static_cache: bool | None = None,
) -> list[list[int]]:
    """Responses of a causal LM to a batch of tokenised prompts, in prompt order (all of them in one batch).

    Args:
        hf: a transformers causal LM (the target's ``hf``).
        prompts: token ids per prompt (any lengths; left-padded here).
        max_new_tokens: response budget (a response that reaches it is cut there).
        eos_ids: ids that end a response (kept as its last token).
        pad_id: id used for left padding (masked out).
        sampling: greedy (default) or sampled.
        seeds: one seed per prompt (required when sampling): row ``i`` draws only from its own generator;
            a ``None`` seed makes that prompt's response greedy.
        static_cache: decode with the project's static KV cache (``None``: wherever
            :func:`static_cache_supported`; ``False``: transformers' own cache, the reference loop).

    Returns one token list per prompt (both loops give the same tokens, tested).
    """
    done = dict(
        generate_stream(
            hf,
            prompts,
            max_new_tokens,
            eos_ids,
            pad_id,
            sampling,
            seeds,
            slots=max(1, len(prompts)),
            static_cache=static_cache,
        )
    )
    return [done[i] for i in range(len(prompts))]


@torch.no_grad()
def generate_stream(
    hf: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    seeds: Sequence[int | None] | None = None,
    slots: int = 64,
    static_cache: bool | None = None,
) -> Iterator[tuple[int, list[int]]]:
    """``(prompt index, response)`` for every prompt, as each response ends: continuous batching.

    Up to ``slots`` responses are generated together; as they end, the next prompts take their place in
    the batch (the static-cache loop), so a batch does not shrink to its longest response's few rows. The
    transformers-cache loop (other architectures) goes through the prompts ``slots`` at a time instead.
    A response depends only on its prompt and seed, not on its neighbours (up to float rounding in greedy
    ties). The other arguments are :func:`generate`'s.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    if slots < 1:
        raise ValueError(f"slots={slots} is invalid: must be >= 1")
    if not sampling.greedy and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError(
            f"sampling needs one seed per prompt: got {None if seeds is None else len(seeds)} seeds "
            f"for {len(prompts)} prompts"
        )
    if not prompts:
        return
    generators = [
        None if sampling.greedy or s is None else torch.Generator().manual_seed(int(s))
        for s in (seeds or [None] * len(prompts))
    ]
    device = next(hf.parameters()).device
    eos = torch.as_tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long, device=device)

    if static_cache is True and not static_cache_supported(hf):
        raise ValueError(
            f"static_cache=True is not supported for model_type={hf.config.model_type!r}: the static "
            f"loop decodes {list(STATIC_FAMILIES)} with full attention only"
        )
    if static_cache is not False and static_cache_supported(hf):
        yield from _decode_static(hf, prompts, max_new_tokens, eos, pad_id, sampling, generators, slots)
        return
    with _decode_attention(hf):
        for lo in range(0, len(prompts), slots):
            ids, mask = _left_padded(prompts[lo : lo + slots], pad_id, device)
            chunk = _decode_transformers(hf, ids, mask, max_new_tokens, eos, sampling, generators[lo : lo + slots])
            yield from enumerate(chunk, lo)


# ----------------------------------------------------------------------------- the static-cache loop
# Decoder families whose layers are exactly: x + o(attn(rope(q[, q_norm]), rope(k[, k_norm]), v)), then
# x + mlp(post_norm(x)), full causal attention. Anything else (sliding windows, softcapping, other
# layer shapes) decodes through the transformers cache loop below, with the same results.
STATIC_FAMILIES = ("llama", "qwen2", "qwen3")
# Finished rows are dropped from the batch (a copy of every layer's cache) once this share of it is dead;
# until then they ride along, so a batch whose rows end one by one does not copy its cache per row.
DROP_SHARE = 0.125


def static_cache_supported(hf: PreTrainedModel) -> bool:
    """Whether :func:`generate` can decode ``hf`` with its own static KV cache (else transformers' cache)."""
    cfg, body = hf.config, getattr(hf, "model", None)
    if getattr(cfg, "model_type", None) not in STATIC_FAMILIES or body is None:
        return False
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]
    ):
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


def _forward_static(
    hf: PreTrainedModel,
    ids: Tensor,
    positions: Tensor,
    cache: _StaticKV,
    slots: Tensor,
    allowed: Tensor,
    rows: Tensor | None = None,
) -> Tensor:
    """Logits of the last of ``ids [b, s]``; their K/V are written to cache slots ``slots [b, s]``.

    ``rows`` (a prefill) names the cache rows the ``b`` prompts go to, and attention reads only the new
    tokens: ``allowed [b, s, s]``. Without it (a decode step over every cache row) attention reads the
    cache's first ``allowed.shape[-1]`` slots: ``allowed [b, s, L]``. Each KV head's query heads are stacked
    along the query axis, so attention reads the cache once, without repeated K/V.
    """
    body = hf.model
    x = body.embed_tokens(ids)
    cos, sin = body.rotary_emb(x, positions)
    b, s = ids.shape
    read = allowed.shape[-1]
    where = (torch.arange(b, device=ids.device) if rows is None else rows)[:, None]
    first = body.layers[0].self_attn
    group = first.config.num_attention_heads // first.config.num_key_value_heads
    # An additive mask (a boolean one sends PyTorch's CPU attention down a slower path), one per step.
    bias = torch.zeros((b, 1, group, s, read), dtype=x.dtype, device=x.device)
    bias = bias.masked_fill_(~allowed[:, None, None], float("-inf")).reshape(b, 1, group * s, read)
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (b, s, -1, attn.head_dim)
        q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope_fn(attn)(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        cache.k[i][where, :, slots] = k.transpose(1, 2)  # [b, s, kv, d] into row where[r], slot slots[r, t]
        cache.v[i][where, :, slots] = v
        keys, values = (cache.k[i][:, :, :read], cache.v[i][:, :, :read]) if rows is None else (k, v.transpose(1, 2))
        kv_heads = keys.shape[1]  # query head j * group + r reads KV head j
        # contiguous: a query whose last dim is strided sends PyTorch's CPU attention down its slow reference path.
        grouped = q.reshape(b, kv_heads, group * s, attn.head_dim).contiguous()
        o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias, scale=attn.scaling)
        o = o.view(b, kv_heads * group, s, attn.head_dim).transpose(1, 2).reshape(b, s, -1)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(body.norm(x[:, -1]))


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``ids [n, width]`` and ``mask [n, width]`` of prompts left-padded to the longest."""
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _decode_static(
    hf: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos: Tensor,
    pad_id: int,
    sampling: Sampling,
    generators: Sequence[torch.Generator | None],
    slots: int,
) -> Iterator[tuple[int, list[int]]]:
    """Continuous batching over a static K/V cache of ``slots`` rows: ``(prompt index, response)`` as each ends.

    Every cache row holds one response at a time, with its own write pointer and rotary position. A row
    that finishes rides along (masked, its pointer frozen) until :data:`DROP_SHARE` of the rows have; then
    the next prompts are prefilled into those rows together, or, once no prompt is left, the finished rows
    leave the cache. So the batch stays full while there is work, whatever the responses' lengths.
    """
    cfg, device = hf.config, next(hf.parameters()).device
    queue = list(range(len(prompts)))[::-1]  # popped from the end: prompt order
    rows = min(slots, len(prompts))
    capacity = max(len(p) for p in prompts) + max_new_tokens
    cache = _StaticKV(
        len(hf.model.layers),
        rows,
        cfg.num_key_value_heads,
        capacity,
        hf.model.layers[0].self_attn.head_dim,
        next(hf.parameters()),
    )
    valid = torch.zeros((rows, capacity), dtype=torch.bool, device=device)  # which cache slots hold real tokens
    pointer = torch.zeros(rows, dtype=torch.long, device=device)  # each row's next cache slot
    position = torch.zeros(rows, dtype=torch.long, device=device)  # each row's next rotary position
    job = [-1] * rows  # prompt index of each cache row, -1 when the row is free
    out: dict[int, list[int]] = {}
    nxt = torch.full((rows,), pad_id, dtype=torch.long, device=device)

    def pick(batch_rows: list[int], logits: Tensor) -> list[int]:
        """Next token of each of ``batch_rows`` (greedy where its generator is None); the ones that end."""
        tokens = _next_tokens(logits, sampling, [generators[job[r]] for r in batch_rows])
        ended = []
        for r, tok in zip(batch_rows, tokens.tolist()):
            out[job[r]].append(tok)
            nxt[r] = tok
            if tok in eos_set or len(out[job[r]]) == max_new_tokens:
                ended.append(r)
        return ended

    def prefill(free: list[int]) -> list[int]:
        """Start the next prompts in the cache rows ``free``; returns the rows that already ended."""
        take = [queue.pop() for _ in range(min(len(free), len(queue)))]
        into = free[: len(take)]
        ids, mask = _left_padded([prompts[j] for j in take], pad_id, device)
        width = ids.shape[1]
        index = torch.as_tensor(into, dtype=torch.long, device=device)
        valid[index] = False
        valid[index, :width] = mask.bool()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        # A padding query may see only itself: an all-masked row would make NaN, and NaN times a zero weight is NaN.
        allowed = (causal & mask.bool()[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
        slot_ids = torch.arange(width, device=device).expand(len(take), width)
        logits = _forward_static(hf, ids, pos, cache, slot_ids, allowed, rows=index)
        pointer[index], position[index] = width, pos[:, -1] + 1
        for r, j in zip(into, take):
            job[r], out[j] = j, []
        return pick(into, logits)

    eos_set = set(eos.tolist())
    ended = prefill(list(range(rows)))
    while True:
        for r in ended:
            yield job[r], out.pop(job[r])
            job[r] = -1
        free = [r for r in range(len(job)) if job[r] < 0]
        if len(free) == len(job) and not queue:
            return
        if free and len(free) >= max(1, int(DROP_SHARE * len(job))):
            if queue:
                ended = prefill(free)
                if ended:
                    continue
            else:  # nothing left to start: the finished rows leave the cache (a copy of every layer's K/V)
                keep = [r for r in range(len(job)) if job[r] >= 0]
                kept = torch.as_tensor(keep, dtype=torch.long, device=device)
                cache.keep(kept)
                valid, pointer, position, nxt = valid[kept], pointer[kept], position[kept], nxt[kept]
                job = [job[r] for r in keep]
        live_rows = [r for r in range(len(job)) if job[r] >= 0]
        live = torch.as_tensor([j >= 0 for j in job], device=device)
        valid[live, pointer[live]] = True
        logits = _forward_static(
            hf, nxt[:, None], position[:, None], cache, pointer[:, None], valid[:, None, : int(pointer.max()) + 1]
        )
        pointer, position = pointer + live, position + live  # a finished row's pointer stays put
        ended = pick(live_rows, logits[live])


# ----------------------------------------------------------------------------- the transformers-cache loop
def _decode_transformers(
    hf: PreTrainedModel,
    ids: Tensor,
    mask: Tensor,
    max_new_tokens: int,
    eos: Tensor,
    sampling: Sampling,
    generators: Sequence[torch.Generator | None],
) -> list[list[int]]:
    from transformers import DynamicCache

    device, n = ids.device, ids.shape[0]
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = hf(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **with_cache(hf, cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
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
            cache.batch_select_indices(keep.to(device))  # every layer keeps only these rows, in place
            live, nxt, mask, last_pos = live[keep.cpu()], nxt[keep], mask[keep], last_pos[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        last_pos = last_pos + 1
        logits = hf(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=last_pos[:, None],
            **with_cache(hf, cache),
            use_cache=True,
        ).logits[:, -1]
    return out
