"""The preallocated draft cache: same drafts as the concatenating reference, in place, bounded, exact."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_DRAFT, randomize_draft_

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.export.onnx.graphs import DraftStepGraph, frozen_embedding_and_head
from dflash2_lightning.model import ContextKV, DraftCache, DraftModel


def _draft(**overrides) -> DraftModel:
    return randomize_draft_(DraftModel(DraftConfig(**{**TINY_DRAFT, **overrides})), seed=0).eval()


def _features(cfg: DraftConfig, batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, n, cfg.num_target_features * cfg.hidden_size, generator=gen)


@pytest.mark.parametrize("overrides", [{}, {"projector_type": "dflash"}, {"sliding_window": 6}])
@torch.no_grad()
def test_cycles_on_the_preallocated_cache_equal_the_reference_bit_for_bit(overrides):
    """Append, draft, roll back, for several cycles: hidden states and tokens identical to ContextKV's."""
    draft = _draft(**overrides)
    cfg, gen = draft.config, torch.Generator().manual_seed(0)
    embed, head = frozen_embedding_and_head(
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
    )
    batch, length = 2, 7
    first = draft.context_kv(_features(cfg, batch, length, gen), torch.arange(length).expand(batch, length))
    ref, cache = first, DraftCache.for_model(draft, batch, 64).append(first)
    pointers = [t.data_ptr() for t in cache.keys + cache.values]
    for cycle in range(6):
        anchor = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        block = torch.cat([anchor[:, None], torch.full((batch, cfg.block_size - 1), cfg.mask_token_id)], 1)
        positions = (length + torch.arange(cfg.block_size)).expand(batch, -1)
        assert torch.equal(draft(embed(block), positions, cache), draft(embed(block), positions, ref)), cycle
        assert torch.equal(draft.draft_block(anchor, cache, embed, head), draft.draft_block(anchor, ref, embed, head))
        if cycle == 2:  # a rollback: the reference slices, the cache only lowers its length
            ref, length = ref.crop(length - 3), length - 3
            assert cache.crop(length) is cache
        new = int(torch.randint(1, cfg.block_size + 1, (), generator=gen))
        kv = draft.context_kv(_features(cfg, batch, new, gen), (length + torch.arange(new)).expand(batch, new))
        ref, length = ref.append(kv), length + new
        assert cache.append(kv) is cache and cache.length == ref.length == length
        assert torch.equal(cache.positions, ref.positions)
        for mine, theirs in zip(cache.layers, ref.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    # Appending wrote into the same buffers every time: no reallocation, no copy of the old context.
    assert [t.data_ptr() for t in cache.keys + cache.values] == pointers
    copy = cache.to_context_kv()
    assert isinstance(copy, ContextKV) and copy.layers[0].keys.data_ptr() != cache.keys[0].data_ptr()


@torch.no_grad()
def test_the_exported_step_ignores_whatever_lies_past_the_valid_length():
    """DraftStepGraph (the ONNX draft_step) over whole buffers + length == the torch draft over the context."""
    draft = _draft()
    cfg, gen = draft.config, torch.Generator().manual_seed(1)
    embed, head = frozen_embedding_and_head(
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
        torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
    )
    lengths = [5, 11]
    step = DraftStepGraph(draft, embed, head)
    anchor = torch.randint(0, cfg.vocab_size, (2,), generator=gen)
    buffers = [
        1e3 * torch.randn(2, cfg.num_key_value_heads, 20, cfg.head_dim, generator=gen)
        for _ in range(2 * cfg.num_hidden_layers)
    ]  # large garbage everywhere
    expected = []
    for row, n in enumerate(lengths):
        ctx = draft.context_kv(_features(cfg, 1, n, gen), torch.arange(n)[None])
        for i, layer in enumerate(ctx.layers):
            buffers[2 * i][row, :, :n], buffers[2 * i + 1][row, :, :n] = layer.keys[0], layer.values[0]
        expected.append(
            (
                draft.draft_block(anchor[row : row + 1], ctx, embed, head, n),
                draft(
                    embed(
                        torch.cat(
                            [anchor[row : row + 1, None], torch.full((1, cfg.block_size - 1), cfg.mask_token_id)], 1
                        )
                    ),
                    (n + torch.arange(cfg.block_size))[None],
                    ctx,
                )[:, 1:],
            )
        )
    length = torch.tensor(lengths)
    tokens, hidden = step(buffers, length, anchor, length.clone())
    for row, (want_tokens, want_hidden) in enumerate(expected):
        torch.testing.assert_close(hidden[row : row + 1], want_hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens[row : row + 1], want_tokens)


def test_bounds_are_named():
    draft = _draft()
    with pytest.raises(ValueError, match="capacity=0"):
        DraftCache.for_model(draft, 1, 0)
    cache = DraftCache.for_model(draft, 1, 4)
    kv = draft.context_kv(
        torch.randn(1, 5, draft.config.num_target_features * draft.config.hidden_size), torch.arange(5)[None]
    )
    with pytest.raises(ValueError, match="exceeds capacity=4"):
        cache.append(kv)
    with pytest.raises(ValueError, match=r"length=2 is invalid: must be in \[0, 0\]"):
        cache.crop(2)
    too_long = torch.zeros(1, draft.config.block_size + 1, draft.config.hidden_size)
    with pytest.raises(ValueError, match="block_size"):
        draft(too_long, torch.arange(too_long.shape[1])[None], cache)
