"""Mixture-of-experts targets: routed experts counted on the models transformers builds, against a hand count; the
draft's geometry derived from their configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_families import EXPERTS, MOE, hand_count, tiny_hf

from dflash2_lightning.config import default_target_layer_ids
from dflash2_lightning.model import DraftModel
from dflash2_lightning.target.experts import routed_experts
from dflash2_lightning.target.spec import TargetError
from dflash2_lightning.target.target import Target
from dflash2_lightning.target.tiny import tiny_tokenizer


@pytest.mark.parametrize("family", MOE)
def test_routed_experts_counted_on_the_built_model(family: str) -> None:
    model = tiny_hf(family)
    total, active = hand_count(family)
    assert sum(p.numel() for p in model.parameters()) == total
    experts = routed_experts(model, model.config)
    assert experts is not None and (experts.experts, experts.per_token) == EXPERTS[family]
    assert experts.active(total) == active


def test_a_dense_model_has_no_routed_experts() -> None:
    model = tiny_hf("llama")
    assert routed_experts(model, model.config) is None


def test_a_config_without_the_expert_counts_is_refused() -> None:
    model = tiny_hf("mixtral")
    config = SimpleNamespace(num_local_experts=4)  # a config.json that lost num_experts_per_tok
    with pytest.raises(TargetError, match="num_experts_per_tok=None"):
        routed_experts(model, config)


@pytest.mark.parametrize("family", MOE)
def test_the_draft_geometry_comes_from_the_moe_config(family: str) -> None:
    """What the draft reads of the target (hidden size, vocabulary, depth and feature layers, heads, head size, MLP
    width, RoPE base, norm eps, positions, mask token) is the MoE config's, and the draft runs on its features."""
    target = Target(tiny_hf(family), tiny_tokenizer(512))
    cfg, hf = target.draft_config(num_hidden_layers=2, block_size=4), target.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (64, 512, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.intermediate_size == hf.intermediate_size and cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.mask_token_id == tiny_tokenizer(512).mask_token_id
    assert list(cfg.target_layer_ids) == default_target_layer_ids(4, 2)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    feats = target.features(ids, None, cfg.target_layer_ids, logits=False).features
    assert feats.shape == (2, 16, len(cfg.target_layer_ids) * 64)
    target.check_fits(cfg)
    draft = DraftModel(cfg)
    assert draft.fc.in_features == feats.shape[-1]
