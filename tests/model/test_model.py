"""The draft model: DFlash2 starts as exactly its DFlash backbone, blocks never leak into each other, and the
multi-block training layout computes what one-block-at-a-time inference computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash2_lightning.model import DraftModel

BS = 4  # block size of the tiny fixture config


def training_mask(context_len: int, anchors: list[int], block_size: int, batch: int) -> torch.Tensor:
    """Bool ``[B, 1, N*bs, C + N*bs]``: block n sees context strictly before its anchor and its own block."""
    n = len(anchors)
    mask = torch.zeros(n * block_size, context_len + n * block_size, dtype=torch.bool)
    for i, a in enumerate(anchors):
        rows = slice(i * block_size, (i + 1) * block_size)
        mask[rows, :a] = True
        mask[rows, context_len + i * block_size : context_len + (i + 1) * block_size] = True
    return mask.expand(batch, 1, *mask.shape)


def block_positions(anchors: list[int], block_size: int, batch: int) -> torch.Tensor:
    pos = torch.cat([torch.arange(a, a + block_size) for a in anchors])
    return pos.expand(batch, -1)


def inputs(cfg, batch=2, context_len=12, blocks=3, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, context_len, cfg.num_target_features * cfg.hidden_size, generator=gen)
    noise = torch.randn(batch, blocks * cfg.block_size, cfg.hidden_size, generator=gen)
    return features.to(dtype), noise.to(dtype), torch.arange(context_len).expand(batch, -1)


def as_baseline(model: DraftModel) -> DraftModel:
    """A DFlash model holding ``model``'s shared weights (strict: every baseline tensor must be there)."""
    base = DraftModel(model.config.replace(projector_type="dflash")).to(next(model.parameters()).dtype)
    shared = {k: v for k, v in model.state_dict().items() if k in base.state_dict()}
    base.load_state_dict(shared, strict=True)
    return base.eval()


# ----------------------------------------------------------------------------- no-op start
def test_fresh_dflash2_is_bitwise_its_dflash_backbone(tiny_draft_config):
    torch.manual_seed(0)
    model = DraftModel(tiny_draft_config()).eval()
    with torch.no_grad():  # random norms too, so the shared weights are not all trivially equal
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    baseline = as_baseline(model)
    features, noise, ctx_pos = inputs(model.config)
    anchors = [2, 5, 9]
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    anchor_tokens = torch.tensor([3, 17])
    with torch.no_grad():
        # Single block, inference layout: all context, no mask.
        single_pos = torch.arange(12, 12 + BS).expand(2, -1)
        h2 = model(noise[:, :BS], single_pos, model.context_kv(features, ctx_pos))
        h1 = baseline(noise[:, :BS], single_pos, baseline.context_kv(features, ctx_pos))
        assert torch.equal(h2, h1)
        # Several blocks with a training-style mask.
        mask = training_mask(12, anchors, BS, 2)
        pos = block_positions(anchors, BS, 2)
        m2 = model(noise, pos, model.context_kv(features, ctx_pos), mask)
        m1 = baseline(noise, pos, baseline.context_kv(features, ctx_pos), mask)
        assert torch.equal(m2, m1)
        # The selector starts as the head's own ranking: same tokens as the argmax.
        assert torch.equal(
            model.propose(h2[:, 1:], anchor_tokens, head), baseline.propose(h1[:, 1:], anchor_tokens, head)
        )
        assert torch.equal(model.propose(m2, anchor_tokens, head), head(m1).argmax(-1))


@pytest.mark.parametrize("part", ["attention_conv", "mlp_conv", "candidate_selector"])
def test_moving_one_dflash2_part_off_its_init_changes_the_result(tiny_draft_config, part):
    """The bitwise test above is not vacuous: each added part does act once trained."""
    torch.manual_seed(0)
    model = DraftModel(tiny_draft_config()).eval()
    baseline = as_baseline(model)
    features, noise, ctx_pos = inputs(model.config, blocks=1)
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    anchor = torch.tensor([3, 17])
    with torch.no_grad():
        if part == "candidate_selector":
            model.candidate_selector.successor_codebook.normal_(std=30.0)
        else:
            getattr(model.layers[0], part).kernel_projection.weight.normal_()
        pos = torch.arange(12, 12 + BS).expand(2, -1)
        h2 = model(noise, pos, model.context_kv(features, ctx_pos))
        h1 = baseline(noise, pos, baseline.context_kv(features, ctx_pos))
        if part == "candidate_selector":
            assert torch.equal(h2, h1)
            assert not torch.equal(model.propose(h2[:, 1:], anchor, head), baseline.propose(h1[:, 1:], anchor, head))
        else:
            assert not torch.equal(h2, h1)


def test_baseline_has_no_dflash2_parts(tiny_draft_config):
    model = DraftModel(tiny_draft_config(projector_type="dflash"))
    assert model.candidate_selector is None
    assert not [k for k in model.state_dict() if "conv" in k or "selector" in k]


# ----------------------------------------------------------------------------- blocks stay apart
@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_multi_block_layout_equals_one_block_at_a_time(tiny_draft_config, randomized_draft, projector):
    """Training layout (several blocks, masked) == inference layout (each block alone, context before its anchor)."""
    model = randomized_draft(tiny_draft_config(projector_type=projector), dtype=torch.float64)
    features, noise, ctx_pos = inputs(model.config, dtype=torch.float64)
    anchors = [1, 6, 10]
    with torch.no_grad():
        together = model(
            noise,
            block_positions(anchors, BS, 2),
            model.context_kv(features, ctx_pos),
            training_mask(12, anchors, BS, 2),
        )
        for i, a in enumerate(anchors):
            context = model.context_kv(features[:, :a], ctx_pos[:, :a])
            alone = model(noise[:, i * BS : (i + 1) * BS], torch.arange(a, a + BS).expand(2, -1), context)
            torch.testing.assert_close(together[:, i * BS : (i + 1) * BS], alone, rtol=0, atol=1e-10)


def test_perturbing_one_block_position_moves_only_that_block(tiny_draft_config, randomized_draft):
    """Conv taps and attention never cross a block start: other blocks stay bitwise unchanged."""
    model = randomized_draft(tiny_draft_config(conv_kernel_size=BS))
    features, noise, ctx_pos = inputs(model.config)
    anchors = [2, 5, 9]
    mask, pos = training_mask(12, anchors, BS, 2), block_positions(anchors, BS, 2)
    with torch.no_grad():
        context = model.context_kv(features, ctx_pos)
        ref = model(noise, pos, context, mask)
        for j in (0, 1, 3, 4, 7, 8, 10, 11):  # first, second and last slot of the blocks
            bumped = noise.clone()
            bumped[0, j] += 1.0
            out = model(bumped, pos, context, mask)
            moved = (out != ref).any(-1)
            own = torch.zeros_like(moved)
            own[0, (j // BS) * BS : (j // BS + 1) * BS] = True
            # Inside its block everything moves (non-causal attention); nothing outside, nor the other row.
            assert torch.equal(moved, own), f"position {j}"


def test_context_feature_moves_only_blocks_anchored_after_it(tiny_draft_config, randomized_draft):
    model = randomized_draft(tiny_draft_config())
    features, noise, ctx_pos = inputs(model.config)
    anchors = [2, 5, 9]
    mask, pos = training_mask(12, anchors, BS, 2), block_positions(anchors, BS, 2)
    with torch.no_grad():
        ref = model(noise, pos, model.context_kv(features, ctx_pos), mask)
        for j in (0, 1, 2, 4, 5, 8, 9, 11):  # both sides of every anchor
            bumped = features.clone()
            bumped[1, j] += 1.0
            moved = (model(noise, pos, model.context_kv(bumped, ctx_pos), mask) != ref).any(-1)
            expected = torch.zeros_like(moved)
            for i, a in enumerate(anchors):
                expected[1, i * BS : (i + 1) * BS] = j < a
            assert torch.equal(moved, expected), f"context position {j}"


# ----------------------------------------------------------------------------- context cache, drafting
def test_context_cache_append_and_crop(tiny_draft_config, randomized_draft):
    model = randomized_draft(tiny_draft_config(), dtype=torch.float64)
    features, _, ctx_pos = inputs(model.config, dtype=torch.float64)
    with torch.no_grad():
        full = model.context_kv(features, ctx_pos)
        joined = model.context_kv(features[:, :7], ctx_pos[:, :7]).append(
            model.context_kv(features[:, 7:], ctx_pos[:, 7:])
        )
        cropped = full.crop(5)
        first5 = model.context_kv(features[:, :5], ctx_pos[:, :5])
    assert full.length == joined.length == 12 and cropped.length == 5
    assert len(full.layers) == model.config.num_hidden_layers
    assert full.layers[0].keys.shape == (2, model.config.num_key_value_heads, 12, model.config.head_dim)
    for a, b in [(full, joined), (cropped, first5)]:
        assert torch.equal(a.positions, b.positions)
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=1e-12)
            torch.testing.assert_close(la.values, lb.values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_draft_block_is_embed_forward_propose(tiny_draft_config, randomized_draft, projector):
    model = randomized_draft(tiny_draft_config(projector_type=projector))
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    features, _, ctx_pos = inputs(cfg)
    anchor = torch.randint(0, cfg.vocab_size, (2,), generator=gen)
    with torch.no_grad():
        context = model.context_kv(features, ctx_pos)
        drafted = model.draft_block(anchor, context, embed, head)
        tokens = torch.full((2, BS), cfg.mask_token_id)
        tokens[:, 0] = anchor
        hidden = model(embed(tokens), torch.arange(12, 12 + BS).expand(2, -1), context)
        expected = model.propose(hidden[:, 1:], anchor, head)
    assert drafted.shape == (2, BS - 1) and drafted.dtype == torch.long
    assert torch.equal(drafted, expected)


def test_propose_dflash2_walks_the_lattice(tiny_draft_config, randomized_draft):
    """With a trained-looking selector, propose() is the greedy lattice path, not the plain argmax."""
    model = randomized_draft(tiny_draft_config(selector_top_k=8))
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    with torch.no_grad():
        model.candidate_selector.successor_codebook.mul_(5.0)
        hidden = torch.randn(3, BS - 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        anchor = torch.tensor([1, 2, 3])
        unary, cand = head(hidden).topk(8, dim=-1)
        sel = model.candidate_selector
        expected = []
        prev = anchor
        for pos in range(BS - 1):
            scores = sel.score_candidates(cand[:, pos], unary[:, pos], hidden[:, pos], prev)
            prev = cand[:, pos].gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            expected.append(prev)
        assert torch.equal(model.propose(hidden, anchor, head), torch.stack(expected, 1))
        assert not torch.equal(model.propose(hidden, anchor, head), head(hidden).argmax(-1))


def test_every_parameter_gets_a_gradient(tiny_draft_config, randomized_draft):
    model = randomized_draft(tiny_draft_config()).train()
    features, noise, ctx_pos = inputs(model.config)
    anchors = [2, 5, 9]
    hidden = model(
        noise, block_positions(anchors, BS, 2), model.context_kv(features, ctx_pos), training_mask(12, anchors, BS, 2)
    )
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    unary, cand = head(hidden).topk(model.config.selector_top_k, dim=-1)
    predecessor = torch.randint(0, model.config.vocab_size, cand.shape[:-1])
    scores = model.candidate_selector.score_candidates(cand, unary, hidden, predecessor)
    (hidden.square().mean() + scores.logsumexp(-1).mean()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_sliding_window_limits_context(tiny_draft_config, randomized_draft):
    """With a window, a block ignores context further back than the window (both directions, non-causal)."""
    model = randomized_draft(tiny_draft_config(sliding_window=BS + 2))
    features, noise, ctx_pos = inputs(model.config, blocks=1)
    pos = torch.arange(12, 12 + BS).expand(2, -1)
    with torch.no_grad():
        ref = model(noise, pos, model.context_kv(features, ctx_pos))
        far = features.clone()
        far[:, :6] += 1.0  # positions 0..5 are >= window away from every block position (12..15)
        assert torch.equal(model(noise, pos, model.context_kv(far, ctx_pos)), ref)
        near = features.clone()
        near[:, 11] += 1.0
        assert not torch.equal(model(noise, pos, model.context_kv(near, ctx_pos)), ref)


def test_selector_gradients_are_the_same_on_every_run():
    """Training on 2 CPU threads is reproducible only if a codebook row's gradients are summed in a fixed
    order; indexing's backward adds them atomically from several threads and varied from run to run."""
    from dflash2_lightning.model.selector import CandidateSelector

    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=32, vocab_size=4096, rank=32, top_k=8, std=0.02)
    nn.init.normal_(selector.successor_codebook, std=0.02)
    cand = torch.randint(0, 64, (8, 16, 3, 8))  # few distinct tokens: every row gathers many gradients
    predecessor = torch.randint(0, 64, (8, 16, 3))
    hidden, unary = torch.randn(8, 16, 3, 32), torch.randn(8, 16, 3, 8)
    upstream = torch.randn(8, 16, 3, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(6):
            selector.zero_grad(set_to_none=True)
            selector.score_candidates(cand, unary, hidden, predecessor).backward(upstream)
            grads.append([p.grad.clone() for p in selector.parameters()])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, h) for run in grads[1:] for g, h in zip(grads[0], run))


# ----------------------------------------------------------------------------- context projected per layer
def test_layers_projecting_the_context_themselves_compute_what_a_precomputed_cache_does(tiny_draft_config):
    """Training passes :class:`ContextStates` (each layer projects the context inside its own forward, where
    FSDP has gathered its weights); the result and the gradients are those of the precomputed ContextKV."""
    torch.manual_seed(0)
    model = DraftModel(tiny_draft_config())
    features, noise, ctx_pos = inputs(model.config)
    anchors = [2, 5, 9]
    mask, pos = training_mask(12, anchors, BS, 2), block_positions(anchors, BS, 2)
    outs, grads = [], []
    for context in (model.context_kv, model.context_states):
        model.zero_grad(set_to_none=True)
        out = model(noise, pos, context(features, ctx_pos), mask)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(outs[0], outs[1])
    assert grads[0].keys() == grads[1].keys() and any(k.startswith("layers.0.self_attn.k_proj") for k in grads[0])
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
