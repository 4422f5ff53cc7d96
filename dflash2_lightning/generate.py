"""Batched generation with the frozen target, for regenerating training data: greedy or sampled.

One batch::

    prompts (token ids) -> left-padded [B, P] + attention mask, positions from the mask
      prefill   one forward over the prompts -> KV cache, last logits
      decode    per step: logits [b, V] -> greedy argmax, or temperature / top-k / top-p
                (:func:`~dflash2_lightning.sampling.probabilities`, the speculative loop's processing)
                then one draw per row from that row's own generator -> next tokens [b]
                rows that emitted an eos (or hit max_new_tokens) leave the batch, cache rows too
    -> responses (token ids, up to and including the first eos)

Why not ``transformers.generate``: every row samples from its own seeded generator, so a response
depends only on (prompt, seed) and not on which prompts happened to share its batch (a resumed
regeneration reproduces an uninterrupted one exactly); finished rows stop costing compute; and the
loop runs the target's attention in ``eager`` mode when the target is bfloat16 (PyTorch's CPU flash
attention kernel is several times slower than the matmuls around it in bf16 for one query token).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
import torch
from torch import Tensor

from dflash2_lightning.sampling import Sampling, probabilities


def _next_tokens(logits: Tensor, sampling: Sampling, generators: Sequence[torch.Generator | None]) -> Tensor:
    if sampling.greedy:
        return logits.float().argmax(-1)
    probs = probabilities(logits, sampling)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g).squeeze(0) for i, g in enumerate(generators)])


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
             pad_id: int, sampling: Sampling = Sampling(), seeds: Sequence[int] | None = None) -> list[list[int]]:
    """Responses of a causal LM to a batch of tokenised prompts.

    Args:
        hf: a transformers causal LM (the target's ``hf``).
        prompts: token ids per prompt (any lengths; left-padded here).
        max_new_tokens: response budget (a response that reaches it is cut there).
        eos_ids: ids that end a response (kept as its last token).
        pad_id: id used for left padding (masked out).
        sampling: greedy (default) or sampled.
        seeds: one seed per prompt (required when sampling): row ``i`` draws only from its own generator.

    Returns one token list per prompt.
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

    with _decode_attention(hf):
        return _decode(hf, ids, mask, max_new_tokens, eos, sampling, generators)


def _decode(hf: torch.nn.Module, ids: Tensor, mask: Tensor, max_new_tokens: int, eos: Tensor, sampling: Sampling,
            generators: Sequence[torch.Generator | None]) -> list[list[int]]:
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
