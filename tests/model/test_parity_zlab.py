"""Parity with the independent z-lab reference implementation (``dflash==0.1.0`` on PyPI, MIT).

Our exporter writes the checkpoint, z-lab's ``from_pretrained`` loads it, and both compute one block
after a context in float64 (the single-block inference layout: z-lab's convolution does not reset at
block starts, so multi-block layouts are checked against our own reference in test_model/test_ops).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash2_lightning.model.checkpoint import save_draft

zlab = pytest.importorskip("dflash.model", reason="z-lab reference not installed (pip install --no-deps dflash==0.1.0)")

CONTEXT = 9


def load_reference(model, directory):
    cls = zlab.DFlash2DraftModel if model.config.is_dflash2 else zlab.DFlashDraftModel
    save_draft(model, directory)
    ref, info = cls.from_pretrained(str(directory), dtype=torch.float64, output_loading_info=True)
    # Every tensor of ours must land in a z-lab parameter, and vice versa (nothing left at random init).
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return ref.eval()


def layout(cfg, batch=2, seed=0):
    """Context features at positions 0..C-1 and one block at C..C+bs-1 (as a server drafts)."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(
        batch, CONTEXT, cfg.num_target_features * cfg.hidden_size, generator=gen, dtype=torch.float64
    )
    noise = torch.randn(batch, cfg.block_size, cfg.hidden_size, generator=gen, dtype=torch.float64)
    positions = torch.arange(CONTEXT + cfg.block_size).expand(batch, -1)
    return features, noise, positions


CASES = {
    "dflash2": dict(),
    "dflash2-wide-conv": dict(conv_kernel_size=4, conv_group_size=4, selector_top_k=12, rope_theta=5e5),
    "dflash2-mha-1layer": dict(num_key_value_heads=4, num_hidden_layers=1, target_layer_ids=[3]),
    "dflash2-swa": dict(sliding_window=6),
    "dflash": dict(projector_type="dflash"),
    "dflash-swa": dict(projector_type="dflash", sliding_window=5),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_hidden_states_and_tokens_match_zlab(tiny_draft_config, randomized_draft, tmp_path, overrides):
    torch.manual_seed(0)
    model = randomized_draft(tiny_draft_config(**overrides), dtype=torch.float64)
    cfg = model.config
    ref = load_reference(model, tmp_path)
    features, noise, positions = layout(cfg)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double()
    anchor = torch.tensor([5, 60])
    with torch.no_grad():
        ours = model(noise, positions[:, CONTEXT:], model.context_kv(features, positions[:, :CONTEXT]))
        theirs = ref(position_ids=positions, noise_embedding=noise, target_hidden=features)
        assert ours.dtype == theirs.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)

        tokens = model.propose(ours[:, 1:], anchor, head)
        if cfg.is_dflash2:
            expected = ref.propose(ours[:, 1:], anchor, head, 0.0)[0]
            # The walk must matter here, or the comparison would only re-check the argmax.
            assert not torch.equal(expected, head(ours[:, 1:]).argmax(-1))
        else:
            expected = ref.compute_logits(theirs[:, 1:], head).argmax(-1)
        assert torch.equal(tokens, expected)


def test_zlab_sees_the_rope_base_we_export(tiny_draft_config, randomized_draft, tmp_path):
    """A wrong RoPE base in config.json would still match at position 0 but not further on."""
    model = randomized_draft(tiny_draft_config(rope_theta=123.0), dtype=torch.float64)
    ref = load_reference(model, tmp_path)
    assert float(ref.config.rope_parameters["rope_theta"]) == 123.0
    features, noise, positions = layout(model.config)
    with torch.no_grad():
        model.rotary = type(model.rotary)(model.config.head_dim, 1e6)  # our side deliberately wrong
        wrong = model(noise, positions[:, CONTEXT:], model.context_kv(features, positions[:, :CONTEXT]))
        theirs = ref(position_ids=positions, noise_embedding=noise, target_hidden=features)
    assert (wrong - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("served", [2, 3, 5])
def test_served_at_a_smaller_block_matches_zlab_on_that_block(tiny_draft_config, randomized_draft, tmp_path, served):
    """A draft trained at block 8 served at ``served`` (as vLLM's ``1 + num_speculative_tokens`` or llama.cpp's
    ``--spec-draft-n-max + 1`` serve it) computes what z-lab's reference computes on the shorter block
    ``[anchor, MASK x (served-1)]``: same weights, the convolution over that block only."""
    model = randomized_draft(tiny_draft_config(block_size=8, conv_kernel_size=2), dtype=torch.float64)
    ref = load_reference(model, tmp_path)
    small = model.at_block_size(served)
    assert small.config.block_size == served and model.config.block_size == 8  # the trained draft is unchanged
    assert small.layers[0].attention_conv.block_size == served
    features, trained_noise, trained_positions = layout(model.config)
    noise, positions = trained_noise[:, :served], trained_positions[:, : CONTEXT + served]
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False).double()
    anchor = torch.tensor([5, 60])
    with torch.no_grad():
        ours = small(noise, positions[:, CONTEXT:], small.context_kv(features, positions[:, :CONTEXT]))
        theirs = ref(position_ids=positions, noise_embedding=noise, target_hidden=features)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
        tokens = small.propose(ours[:, 1:], anchor, head)
        assert tokens.shape == (2, served - 1)
        assert torch.equal(tokens, ref.propose(ours[:, 1:], anchor, head, 0.0)[0])
        # Not the first served-1 drafts of the trained block: the masks after them change what the block computes.
        trained = model(
            trained_noise, trained_positions[:, CONTEXT:], model.context_kv(features, positions[:, :CONTEXT])
        )
        assert (trained[:, :served] - ours).abs().max() > 1e-6
    assert small.at_block_size(served) is small and model.at_block_size(8) is model
