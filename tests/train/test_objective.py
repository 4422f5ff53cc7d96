"""The training objective: anchors, block layout, attention mask, isolation of blocks, losses."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import randomize_draft_
from torch import nn

from dflash2_lightning.model import DraftModel
from dflash2_lightning.train.objective import (
    DraftObjective,
    ObjectiveError,
    Teacher,
    block_attention_mask,
    decay_weights,
    dpace_weights,
    layout_blocks,
    sample_anchors,
    soft_cross_entropy,
    sparse_soft_cross_entropy,
)


class FrozenTarget(nn.Module):
    """A stand-in for the target's frozen embedding and head (random, no gradients)."""

    def __init__(self, vocab: int, hidden: int, seed: int = 0, scale: float = 1.0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(vocab, hidden, generator=gen))
            self.lm_head.weight.copy_(scale * torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden))
        self.requires_grad_(False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _setup(cfg, batch: int = 2, seq: int = 24, seed: int = 0):
    draft = randomize_draft_(DraftModel(cfg), seed)
    target = FrozenTarget(cfg.vocab_size, cfg.hidden_size, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size - 1, (batch, seq), generator=gen)
    features = torch.randn(batch, seq, cfg.num_target_features * cfg.hidden_size, generator=gen)
    return draft, target, ids, features


# ----------------------------------------------------------------------------- anchors
def test_anchors_come_from_supervised_positions_without_replacement():
    loss_mask = torch.zeros(3, 20, dtype=torch.bool)
    loss_mask[0, 2:18] = True  # 15 candidates in [0, 16]
    loss_mask[1, [3, 7, 16, 17]] = True  # candidates 3, 7, 16 (17 > S - bs)
    # sample 2: no candidate at all
    anchors, keep = sample_anchors(loss_mask, block_size=4, num_anchors=6, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 6)  # N = min(num_anchors, most candidates)
    assert keep.sum(1).tolist() == [6, 3, 0]
    for b in range(3):
        kept = anchors[b][keep[b]]
        assert kept.tolist() == sorted(set(kept.tolist()))  # ascending, no repeats
        assert all(0 <= a <= 16 and loss_mask[b, a] for a in kept.tolist())
    assert anchors[1][keep[1]].tolist() == [3, 7, 16]
    assert (anchors[~keep] == 0).all()


def test_anchors_are_reproducible_and_per_sample_generators_ignore_the_batch():
    loss_mask = torch.ones(2, 64, dtype=torch.bool)
    first = sample_anchors(loss_mask, 8, 5, torch.Generator().manual_seed(7))
    again = sample_anchors(loss_mask, 8, 5, torch.Generator().manual_seed(7))
    other = sample_anchors(loss_mask, 8, 5, torch.Generator().manual_seed(8))
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])
    # One generator per sample: a sample's anchors do not depend on its batch mates.
    alone = sample_anchors(loss_mask[:1], 8, 5, [torch.Generator().manual_seed(3)])
    paired = sample_anchors(loss_mask, 8, 5, [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)])
    assert torch.equal(alone[0][0], paired[0][0])


def test_anchor_sampling_rejects_bad_arguments():
    with pytest.raises(ObjectiveError, match="num_anchors=0"):
        sample_anchors(torch.ones(1, 8, dtype=torch.bool), 4, 0)
    with pytest.raises(ObjectiveError, match="seq_len=3"):
        sample_anchors(torch.ones(1, 3, dtype=torch.bool), 4, 2)


# ----------------------------------------------------------------------------- layout and mask
def test_block_layout_labels_and_weights():
    ids = torch.arange(100, 112)[None]  # S = 12
    loss_mask = torch.ones(1, 12, dtype=torch.bool)
    loss_mask[0, 6] = False
    anchors, keep = torch.tensor([[2, 8, 0]]), torch.tensor([[True, True, False]])
    blocks = layout_blocks(ids, loss_mask, anchors, keep, block_size=4, mask_token_id=7)
    assert blocks.tokens.tolist() == [[102, 7, 7, 7, 108, 7, 7, 7, 100, 7, 7, 7]]
    assert blocks.positions.tolist() == [[2, 3, 4, 5, 8, 9, 10, 11, 0, 1, 2, 3]]
    assert blocks.labels[0, 0].tolist() == [103, 104, 105]  # slot k predicts input_ids[a + k]
    assert blocks.predecessors[0, 0].tolist() == [102, 103, 104]  # teacher-forced input_ids[a + k - 1]
    assert blocks.sources[0, 1].tolist() == [8, 9, 10]  # teacher position a + k - 1
    assert blocks.valid[0, 0].tolist() == [True, True, True]
    assert blocks.valid[0, 1].tolist() == [True, True, True]
    assert not blocks.valid[0, 2].any()  # padded block
    blocks = layout_blocks(ids, loss_mask, torch.tensor([[3]]), torch.tensor([[True]]), 4, 7)
    assert blocks.valid[0, 0].tolist() == [True, True, False]  # loss_mask[6] is False


def test_attention_mask_matches_its_definition():
    anchors = torch.tensor([[0, 3, 9], [2, 2, 5]])
    attn = torch.ones(2, 12, dtype=torch.bool)
    attn[1, :1] = False  # a padded context position
    bs, s = 4, 12
    for window in (None, 5):
        mask = block_attention_mask(anchors, s, bs, attn, window)
        assert mask.shape == (2, 1, 12, s + 12) and mask.dtype == torch.bool
        for b in range(2):
            for q in range(12):
                n, k = divmod(q, bs)
                a = int(anchors[b, n])
                for j in range(s):
                    want = j < a and bool(attn[b, j]) and (window is None or j > a + k - window)
                    assert bool(mask[b, 0, q, j]) == want, (b, q, j, window)
                for j in range(12):
                    assert bool(mask[b, 0, q, s + j]) == (j // bs == n)  # own block only, both ways


# ----------------------------------------------------------------------------- isolation
def _run(objective, draft, target, ids, features, anchors, loss_mask=None):
    loss_mask = torch.ones_like(ids, dtype=torch.bool) if loss_mask is None else loss_mask
    return objective(draft, target.embed, target.head, ids, loss_mask, features, Teacher(), anchors=anchors, walk=True)


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_no_cross_block_leakage(tiny_draft_config, projector):
    cfg = tiny_draft_config(projector_type=projector)
    draft, target, ids, features = _setup(cfg)
    objective = DraftObjective(num_anchors=8)
    # Overlapping blocks on purpose: 5 and 6 share positions, so only the mask keeps them apart.
    anchors = (torch.tensor([[1, 5, 6, 12], [0, 4, 9, 15]]), torch.ones(2, 4, dtype=torch.bool))
    base = _run(objective, draft, target, ids, features, anchors)

    # Changing the anchor token of block 1 (the only token of the block's input) moves block 1 only.
    changed = ids.clone()
    changed[0, 5] = (changed[0, 5] + 1) % (cfg.vocab_size - 1)
    out = _run(objective, draft, target, changed, features, anchors)
    for n in range(4):
        same = torch.equal(out.logits[0, n], base.logits[0, n])
        assert same == (n != 1), f"block {n}"
        if n not in (0, 1):  # blocks 0 and 1 also have input_ids[5] among their labels
            assert torch.equal(out.slot_loss[0, n], base.slot_loss[0, n])
    assert torch.equal(out.logits[1], base.logits[1])  # the other sample

    # Context is strictly before the anchor: features at position 6 reach block 3 (anchor 12), not 0..2.
    feats = features.clone()
    feats[0, 6] += 1.0
    out = _run(objective, draft, target, ids, feats, anchors)
    for n in range(3):
        assert torch.equal(out.logits[0, n], base.logits[0, n]), f"block {n} saw context at its anchor or later"
        assert torch.equal(out.slot_loss[0, n], base.slot_loss[0, n])
    assert not torch.equal(out.logits[0, 3], base.logits[0, 3])


def test_anchor_slot_never_contributes(tiny_draft_config):
    cfg = tiny_draft_config()
    draft, target, ids, features = _setup(cfg)
    objective = DraftObjective(num_anchors=4, selector_loss_alpha=1.0)
    captured = {}

    def keep_output(module, inputs, output):
        output.retain_grad()
        captured["hidden"] = output

    handle = draft.register_forward_hook(keep_output)
    out = objective(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        Teacher(),
        generator=torch.Generator().manual_seed(0),
    )
    handle.remove()
    out.loss.backward()
    grad = captured["hidden"].grad.view(ids.shape[0], out.blocks.num_blocks, cfg.block_size, -1)
    assert out.logits.shape[2] == cfg.block_size - 1
    assert (grad[:, :, 0] == 0).all()  # slot 0 (the anchor) gets no gradient at all
    assert (grad[:, :, 1:].abs().sum(-1) > 0).all()  # every supervised slot does


# ----------------------------------------------------------------------------- losses
def test_decay_and_dpace_weights():
    assert torch.allclose(decay_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    loss = torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])  # q = 1, 1/2, 1/4
    valid = torch.tensor([[True, True, True]])
    # alpha = 0.5: q~ = 1, 3/4, 5/8; C = 1, 3/4, 15/32; w_j = sum_{m >= j} C_m
    w = dpace_weights(loss, valid, 0.5)
    assert torch.allclose(w, torch.tensor([[1 + 0.75 + 15 / 32, 0.75 + 15 / 32, 15 / 32]]))
    # An invalid slot multiplies by 1 and contributes no C of its own.
    w = dpace_weights(loss, torch.tensor([[True, False, True]]), 0.5)
    assert torch.allclose(w, torch.tensor([[1 + 5 / 8, 5 / 8, 5 / 8]]))
    assert torch.allclose(dpace_weights(loss, valid, 1.0), torch.tensor([[3.0, 2.0, 1.0]]))


def test_sparse_teacher_is_the_renormalised_dense_teacher():
    gen = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(3, 10, generator=gen), torch.randn(3, 10, generator=gen)
    values, indices = teacher.topk(10, dim=-1)
    assert torch.allclose(sparse_soft_cross_entropy(logits, values, indices), soft_cross_entropy(logits, teacher))
    # Top-2 teacher: softmax over the two kept logits, zero elsewhere.
    values, indices = teacher.topk(2, dim=-1)
    sparse = torch.full_like(teacher, -float("inf")).scatter(-1, indices, values)
    manual = -(sparse.softmax(-1) * logits.log_softmax(-1)).nan_to_num().sum(-1)
    assert torch.allclose(sparse_soft_cross_entropy(logits, values, indices), manual)


@pytest.mark.parametrize("token_loss", ["ce", "kd"])
@pytest.mark.parametrize("weighting", ["none", "decay", "dpace"])
def test_objective_variants_are_finite_and_differentiable(tiny_draft_config, token_loss, weighting):
    cfg = tiny_draft_config()
    draft, target, ids, features = _setup(cfg)
    teacher_logits = torch.randn(*ids.shape, cfg.vocab_size)
    objective = DraftObjective(token_loss=token_loss, position_weighting=weighting, num_anchors=4)
    out = objective(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        Teacher(logits=teacher_logits),
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert draft.fc.weight.grad is not None and torch.isfinite(draft.fc.weight.grad).all()
    # The metrics compare with the target's greedy token when its logits are at hand.
    assert torch.equal(out.reference, teacher_logits.argmax(-1)[torch.arange(2)[:, None, None], out.blocks.sources])


def test_gold_outside_topk_options(tiny_draft_config):
    cfg = tiny_draft_config(selector_top_k=48)  # about half the vocabulary: some golds in, some out
    draft, target, ids, features = _setup(cfg)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors = (torch.tensor([[0, 8], [4, 12]]), torch.ones(2, 2, dtype=torch.bool))
    outs = {}
    for option in ("insert_last", "drop"):
        objective = DraftObjective(gold_outside_topk=option, selector_loss_alpha=1.0)
        outs[option] = objective(draft, target.embed, target.head, ids, loss_mask, features, Teacher(), anchors=anchors)
    covered = outs["drop"].covered  # reference = data token here: covered == gold in the original top-k
    assert covered.any() and not covered.all(), "the test needs gold tokens both inside and outside the top-k"
    for out in outs.values():
        assert torch.isfinite(out.selector_loss)
    # Dropping the uncovered positions changes the loss; inserting the gold keeps every position.
    assert not torch.isclose(outs["drop"].selector_loss, outs["insert_last"].selector_loss)
    # With every gold covered (top_k = vocab) the two options agree exactly.
    cfg = tiny_draft_config(selector_top_k=cfg.vocab_size)
    draft, target, ids, features = _setup(cfg)
    losses = [
        DraftObjective(gold_outside_topk=o)(
            draft, target.embed, target.head, ids, loss_mask, features, Teacher(), anchors=anchors
        ).selector_loss
        for o in ("insert_last", "drop")
    ]
    assert torch.equal(losses[0], losses[1])


def test_selector_loss_alpha_zero_disables_it(tiny_draft_config):
    cfg = tiny_draft_config()
    draft, target, ids, features = _setup(cfg)
    out = DraftObjective(selector_loss_alpha=0.0, num_anchors=3)(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        Teacher(),
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(out.loss, out.token_loss) and out.selector_loss is not None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"token_loss": "mse"}, "token_loss"),
        ({"position_weighting": "linear"}, "position_weighting"),
        ({"dpace_alpha": 0.0}, "dpace_alpha"),
        ({"dpace_alpha": 1.5}, "dpace_alpha"),
        ({"decay_gamma": 0.0}, "decay_gamma"),
        ({"selector_loss_alpha": -1.0}, "selector_loss_alpha"),
        ({"gold_outside_topk": "ignore"}, "gold_outside_topk"),
        ({"num_anchors": 0}, "num_anchors"),
        ({"labels": "teacher"}, "labels"),
    ],
)
def test_bad_objective_settings_name_the_field(kwargs, field):
    with pytest.raises(ObjectiveError, match=field):
        DraftObjective(**kwargs)


def test_target_labels_train_on_the_targets_greedy_tokens(tiny_draft_config):
    cfg = tiny_draft_config()
    draft, target, ids, features = _setup(cfg)
    mask = torch.ones_like(ids, dtype=torch.bool)
    anchors = (torch.tensor([[0, 8], [4, 12]]), torch.ones(2, 2, dtype=torch.bool))
    greedy = torch.roll(ids, -1, dims=1)  # "the target predicts the data": labels="target" == labels="data"
    same = [
        DraftObjective(labels=src)(
            draft, target.embed, target.head, ids, mask, features, Teacher(greedy=greedy), anchors=anchors
        ).loss
        for src in ("data", "target")
    ]
    assert torch.equal(same[0], same[1])
    other = (ids * 7 + 3) % (cfg.vocab_size - 1)  # a target that disagrees with the data everywhere
    out = DraftObjective(labels="target")(
        draft, target.embed, target.head, ids, mask, features, Teacher(greedy=other), anchors=anchors
    )
    want = other.gather(1, out.blocks.sources.flatten(1)).view_as(out.blocks.labels)
    assert torch.equal(out.blocks.labels, want) and not torch.isclose(out.loss, same[0])
    with pytest.raises(ObjectiveError, match="greedy"):
        DraftObjective(labels="target")(
            draft, target.embed, target.head, ids, mask, features, Teacher(), anchors=anchors
        )


def test_kd_without_teacher_is_a_clear_error(tiny_draft_config):
    cfg = tiny_draft_config()
    draft, target, ids, features = _setup(cfg)
    with pytest.raises(ObjectiveError, match="teacher_topk_values"):
        DraftObjective(token_loss="kd")(
            draft, target.embed, target.head, ids, torch.ones_like(ids, dtype=torch.bool), features, Teacher()
        )


# ----------------------------------------------------------------------------- overfitting
def test_single_batch_overfits(tiny_draft_config):
    """One fixed batch, anchors re-sampled every step: loss falls, backbone and selector exceed 90%."""
    torch.manual_seed(0)
    cfg = tiny_draft_config(num_hidden_layers=1, block_size=4, selector_top_k=4)
    draft = DraftModel(cfg)
    target = FrozenTarget(cfg.vocab_size, cfg.hidden_size, seed=0, scale=4.0)  # a head with usable logit range
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, 16), generator=gen)
    features = torch.randn(2, 16, cfg.num_target_features * cfg.hidden_size, generator=gen)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    objective = DraftObjective(num_anchors=13)  # every anchor of the 16-token samples
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    losses = []
    for step in range(150):
        out = objective(
            draft,
            target.embed,
            target.head,
            ids,
            loss_mask,
            features,
            Teacher(),
            generator=torch.Generator().manual_seed(step),
        )
        assert torch.isfinite(out.loss)
        losses.append(out.loss.item())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    with torch.no_grad():
        out = objective(
            draft,
            target.embed,
            target.head,
            ids,
            loss_mask,
            features,
            Teacher(),
            generator=torch.Generator().manual_seed(999),
            walk=True,
        )
    valid = out.blocks.valid
    backbone = ((out.draft_tokens == out.reference) & valid).sum() / valid.sum()
    selector = ((out.selector_correct) & valid).sum() / valid.sum()
    walk = ((out.selector_tokens == out.reference) & valid).sum() / valid.sum()
    assert losses[-1] < 0.2 * losses[0]
    assert sum(losses[-10:]) < sum(losses[:10])
    assert backbone > 0.9 and selector > 0.9 and walk > 0.9, (backbone, selector, walk)


# ----------------------------------------------------------------------------- chunked logits
def _loss_and_grads(objective, draft, target, ids, features, teacher, anchors):
    draft.zero_grad()
    out = objective(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        teacher,
        anchors=anchors,
    )
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "token_loss, teacher_kind, weighting, gold",
    [
        ("ce", "none", "dpace", "insert_last"),
        ("ce", "none", "decay", "drop"),
        ("kd", "logits", "decay", "insert_last"),
        ("kd", "topk", "none", "drop"),
    ],
)
def test_chunked_logits_equal_the_one_piece_loss_and_gradients(
    tiny_draft_config, token_loss, teacher_kind, weighting, gold
):
    """Chunks of 7 slots (not a divisor of the 2 x 3 x 7 = 42 slots, so the last chunk is short) against one
    piece: the same argmax, top-k and coverage; slot losses, selector scores and loss to float32 rounding;
    gradients to float32 rounding, per parameter as ||g_chunked - g_whole|| <= 1e-5 ||g_whole|| (the recomputed
    chunk's head backward sums in other groupings: with 2 threads about 4e-7, a few float32 ulps; an element-wise
    tolerance fails on the gradients' near-zero entries, a lost or doubled chunk is off by order 1)."""
    cfg = tiny_draft_config(block_size=8, selector_top_k=8)
    draft, target, ids, features = _setup(cfg, seq=32)
    gen = torch.Generator().manual_seed(5)
    teacher_logits = torch.randn(*ids.shape, cfg.vocab_size, generator=gen)
    values, indices = teacher_logits.topk(6, dim=-1)
    teacher = {
        "none": Teacher(),
        "logits": Teacher(logits=teacher_logits),
        "topk": Teacher(topk_values=values, topk_indices=indices),
    }[teacher_kind]
    anchors = (torch.tensor([[0, 9, 20], [3, 11, 24]]), torch.tensor([[True, True, True], [True, True, False]]))
    kw = dict(token_loss=token_loss, position_weighting=weighting, gold_outside_topk=gold)
    whole, g_whole = _loss_and_grads(DraftObjective(**kw), draft, target, ids, features, teacher, anchors)
    chunked, g_chunked = _loss_and_grads(
        DraftObjective(**kw, logits_chunk_elements=7 * cfg.vocab_size), draft, target, ids, features, teacher, anchors
    )
    assert whole.logits is not None and chunked.logits is None  # chunked: no [B, N, L, V] tensor kept
    for name in ("draft_tokens", "selector_candidates", "covered", "selector_correct"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    # Values to float32 rounding, not bit for bit: a GEMM over 7 rows may block its sums otherwise than one
    # over all 42 (bitwise alone, but not after other tests have warmed other BLAS paths in the same process).
    for name in ("slot_loss", "selector_scores"):
        assert torch.allclose(getattr(chunked, name), getattr(whole, name), rtol=1e-6, atol=1e-6), name
    assert torch.allclose(chunked.loss, whole.loss, rtol=1e-6, atol=0)
    assert g_whole.keys() == g_chunked.keys() and len(g_whole) > 10
    for name, grad in g_whole.items():
        assert (g_chunked[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_small_problems_run_in_one_piece_bitwise(tiny_draft_config):
    """At or below the threshold nothing changes: the default objective gives bitwise the loss and gradients of
    one explicitly unchunked (keep_logits) pass, and a problem one element over the threshold is chunked."""
    from dflash2_lightning.train.objective import LOGITS_CHUNK_ELEMENTS

    cfg = tiny_draft_config(block_size=8)
    draft, target, ids, features = _setup(cfg)
    anchors = (torch.tensor([[0, 8], [4, 12]]), torch.ones(2, 2, dtype=torch.bool))
    # The shipped CPU runs: tiny (8 x 16 anchors x 7 slots x 512) and quickstart (8 x 16 x 3 x 49152) logits.
    assert 8 * 16 * 7 * 512 <= LOGITS_CHUNK_ELEMENTS and 8 * 16 * 3 * 49152 <= LOGITS_CHUNK_ELEMENTS
    a, ga = _loss_and_grads(DraftObjective(), draft, target, ids, features, Teacher(), anchors)
    draft.zero_grad()
    c = DraftObjective()(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        Teacher(),
        anchors=anchors,
        keep_logits=True,
    )
    c.loss.backward()
    assert a.logits is not None and torch.equal(a.loss, c.loss) and torch.equal(a.logits, c.logits)
    assert all(torch.equal(ga[n], p.grad) for n, p in draft.named_parameters() if p.grad is not None)
    rows = 2 * 2 * 7
    at = DraftObjective(logits_chunk_elements=rows * cfg.vocab_size)(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        Teacher(),
        anchors=anchors,
    )
    over = DraftObjective(logits_chunk_elements=rows * cfg.vocab_size - 1)(
        draft,
        target.embed,
        target.head,
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        features,
        Teacher(),
        anchors=anchors,
    )
    assert at.logits is not None and over.logits is None and torch.equal(at.loss, a.loss)
