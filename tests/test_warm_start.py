"""Warm start from the target: the draft layers begin as the target layers after the feature layer, and
the draft's context keys/values are then exactly what that target layer computes from its input."""

from __future__ import annotations

import pytest
import torch
from speculative_helpers import tiny_target

from dflash2_lightning.config import ConfigError
from dflash2_lightning.model import DraftModel
from dflash2_lightning.warm_start import init_from_target


def test_context_kv_is_the_target_layer_after_the_features() -> None:
    target = tiny_target()
    hf = target.hf
    draft = DraftModel(target.draft_config(num_hidden_layers=2, target_layer_ids=[0], block_size=4)).to(target.dtype).eval()
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
