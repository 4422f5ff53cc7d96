"""Warm start from the target: the draft layers begin as the target layers after the feature layer, and
the draft's context keys/values are then exactly what that target layer computes from its input."""

from __future__ import annotations

import pytest
import torch
from speculative_helpers import tiny_target

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.model import DraftModel
from dflash2_lightning.train.warm_start import init_from_target, init_selector_from_embedding


def test_context_kv_is_the_target_layer_after_the_features() -> None:
    target = tiny_target()
    hf = target.hf
    draft = (
        DraftModel(target.draft_config(num_hidden_layers=2, target_layer_ids=[0], block_size=4)).to(target.dtype).eval()
    )
    assert init_from_target(draft, hf) == [1, 2]
    for i, source in enumerate([1, 2]):
        ours, theirs = dict(draft.layers[i].named_parameters()), dict(hf.model.layers[source].named_parameters())
        assert set(theirs) <= set(ours)
        for name, p in theirs.items():
            assert torch.equal(ours[name], p), name
    assert torch.equal(draft.norm.weight, hf.model.norm.weight)

    ids = torch.randint(5, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        kv = draft.context_kv(out.hidden_states[1], positions).layers[0]
        layer = hf.model.layers[1]
        x = layer.input_layernorm(out.hidden_states[1])
        attn = layer.self_attn
        k = attn.k_norm(attn.k_proj(x).view(2, 9, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(2, 9, -1, attn.head_dim).transpose(1, 2)
        cos, sin = hf.model.rotary_emb(x, positions)
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        k_rope, _ = apply_rotary_pos_emb(k, k, cos, sin)
    # float32 rounding: the target's linears compute few-row matmuls as W @ x.T (rows_first_linear), the draft's
    # as x @ W.T, so the same math rounds differently in the last bit.
    torch.testing.assert_close(kv.values, v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kv.keys, k_rope, rtol=1e-5, atol=1e-6)


def test_too_few_target_layers_is_a_clear_error() -> None:
    target = tiny_target()  # 4 layers
    draft = DraftModel(target.draft_config(num_hidden_layers=2, target_layer_ids=[2], block_size=4))
    with pytest.raises(ConfigError, match=r"target layers \[3, 4\].*has 4"):
        init_from_target(draft, target.hf)


def test_selector_from_embedding_keeps_the_backbone_ranking_and_the_embedding_geometry() -> None:
    target = tiny_target()
    draft = DraftModel(target.draft_config(block_size=4, selector_rank=8, selector_top_k=4))
    selector = draft.candidate_selector
    embedding = target.hf.get_input_embeddings().weight
    share = init_selector_from_embedding(selector, embedding, std=0.02)
    assert 0 < share <= 1
    # Entries at the random init's scale; both codebooks the same principal coordinates.
    assert torch.equal(selector.predecessor_codebook, selector.successor_codebook)
    torch.testing.assert_close(selector.successor_codebook.pow(2).mean().sqrt(), torch.tensor(0.02))
    # The coordinates' Gram matrix is the centred embedding's projected on the top directions: the
    # closest pair of tokens in the embedding stays close in the codebook.
    centred = embedding.double() - embedding.double().mean(0)
    code = selector.successor_codebook.double()
    top = torch.linalg.eigh(centred.T @ centred).eigenvectors[:, -8:]
    projected = centred @ top
    scale = code.norm() / projected.norm()
    torch.testing.assert_close(code @ code.T, (projected @ projected.T) * scale**2, rtol=1e-4, atol=1e-9)
    # A fresh selector still walks the backbone's argmax: the transition term is exactly zero.
    hidden = torch.randn(2, 3, target.hidden_size)
    unary, cand = torch.randn(2, 3, 4).sort(-1, descending=True)[0], torch.randint(0, target.vocab_size, (2, 3, 4))
    path = selector.greedy_path(cand, unary, hidden, torch.tensor([1, 2]))
    assert torch.equal(path, cand[..., 0])
    # ... and one step of the selector loss reaches the projection (the codebooks follow a step later).
    score = selector.score_candidates(cand, unary, hidden, torch.randint(0, target.vocab_size, (2, 3)))
    torch.nn.functional.cross_entropy(score.flatten(0, 1), torch.tensor([1, 2, 3, 0, 1, 2])).backward()
    assert selector.hidden_projection.weight.grad.abs().sum() > 0


def test_selector_from_embedding_rank_above_the_width_is_a_clear_error() -> None:
    target = tiny_target()
    width = target.hidden_size
    draft = DraftModel(target.draft_config(block_size=4, selector_rank=width + 1, selector_top_k=4))
    with pytest.raises(ConfigError, match=rf"selector_rank={width + 1} must be <= the embedding width {width}"):
        init_selector_from_embedding(draft.candidate_selector, target.hf.get_input_embeddings().weight, std=0.02)
