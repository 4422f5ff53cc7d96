"""DraftConfig: validation messages, the default target-layer rule, the RoPE base and the config.json contract."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import Qwen3Config

from dflash2_lightning.config import DraftConfig, default_target_layer_ids, rope_theta_of
from dflash2_lightning.errors import ConfigError

# The tiny fixture geometry: hidden 32, vocab 96, 6 target layers, 4 heads / 2 KV heads, block 4.
# (overrides, field, value as written in the message, the bound the message must state)
LAYER_BOUND = "strictly increasing unique ints in 0 .. num_target_layers - 2 = 4"
INVALID = [
    (dict(conv_kernel_size=0), "conv_kernel_size", "0", "1 <= conv_kernel_size <= block_size=4"),
    (dict(conv_kernel_size=5), "conv_kernel_size", "5", "1 <= conv_kernel_size <= block_size=4"),
    (dict(conv_group_size=5), "conv_group_size", "5", "divide hidden_size=32"),
    (dict(conv_group_size=0), "conv_group_size", "0", "divide hidden_size=32"),
    (dict(selector_top_k=0), "selector_top_k", "0", "1 <= selector_top_k <= vocab_size=96"),
    (dict(selector_top_k=97), "selector_top_k", "97", "1 <= selector_top_k <= vocab_size=96"),
    (dict(selector_rank=0), "selector_rank", "0", "selector_rank >= 1"),
    (dict(target_layer_ids=[1, 6]), "target_layer_ids", "[1, 6]", LAYER_BOUND),
    (dict(target_layer_ids=[-1]), "target_layer_ids", "[-1]", LAYER_BOUND),
    (dict(target_layer_ids=[]), "target_layer_ids", "[]", "non-empty"),
    # the last target layer: SGLang never captures it, vLLM hands over its pre-norm residual
    (dict(target_layer_ids=[1, 5]), "target_layer_ids", "[1, 5]", "last layer"),
    # engines concatenate in ascending order: unsorted ids would permute fc's input columns
    (dict(target_layer_ids=[4, 1, 2]), "target_layer_ids", "[4, 1, 2]", "use [1, 2, 4]"),
    (dict(target_layer_ids=[1, 2, 2]), "target_layer_ids", "[1, 2, 2]", "duplicate ids [2]"),
    (dict(target_layer_ids=[1, 2.5]), "target_layer_ids", "[1, 2.5]", "must be an int"),
    (dict(mask_token_id=96), "mask_token_id", "96", "0 <= mask_token_id < vocab_size=96"),
    (dict(mask_token_id=-1), "mask_token_id", "-1", "0 <= mask_token_id < vocab_size=96"),
    (dict(sliding_window=3), "sliding_window", "3", "sliding_window >= block_size=4"),
    (dict(num_key_value_heads=3), "num_key_value_heads", "3", "divide num_attention_heads=4"),
    (dict(block_size=1, conv_kernel_size=1), "block_size", "1", "block_size >= 2"),
    (dict(projector_type="eagle"), "projector_type", "'eagle'", "one of ['dflash', 'dflash2']"),
]


@pytest.mark.parametrize("overrides, name, value, bound", INVALID, ids=[f"{c[1]}={c[2]}" for c in INVALID])
def test_validation_error_names_field_value_and_bound(tiny_draft_config, overrides, name, value, bound):
    with pytest.raises(ConfigError) as err:
        tiny_draft_config(**overrides)
    message = str(err.value)
    assert message.startswith(f"{name}={value} "), message
    assert bound in message, message


def test_replace_revalidates(tiny_draft_config):
    with pytest.raises(ConfigError, match=r"conv_kernel_size=9 .*block_size=4"):
        tiny_draft_config().replace(conv_kernel_size=9)


def test_resolved_reads_the_derived_sizes_and_refuses_a_cleared_one(tiny_draft_config):
    cfg = tiny_draft_config(head_dim=None, intermediate_size=None)  # derived: hidden 32 / 4 heads, 3 x hidden
    assert (cfg.resolved("head_dim"), cfg.resolved("intermediate_size")) == (8, 96)
    cfg.intermediate_size = None  # cleared after the config was built: no module can be sized from it
    with pytest.raises(ConfigError, match=r"intermediate_size=None is invalid"):
        cfg.resolved("intermediate_size")


def test_baseline_ignores_dflash2_fields(tiny_draft_config):
    # The conv/selector bounds only apply to DFlash2; the baseline has neither part.
    cfg = tiny_draft_config(projector_type="dflash", conv_kernel_size=0, selector_top_k=0)
    assert not cfg.is_dflash2 and cfg.architecture == "DFlashDraftModel"


@pytest.mark.parametrize("seq_len", [6, 0, -4])
def test_check_sequence_length_rejects_partial_blocks(tiny_draft_config, seq_len):
    cfg = tiny_draft_config()
    with pytest.raises(ConfigError) as err:
        cfg.check_sequence_length(seq_len)
    assert str(err.value).startswith(f"seq_len={seq_len} ")
    assert "multiple of block_size=4" in str(err.value)


def test_check_sequence_length_accepts_whole_blocks_and_names_the_caller_field(tiny_draft_config):
    cfg = tiny_draft_config()
    cfg.check_sequence_length(12)
    with pytest.raises(ConfigError, match=r"^max_length=10 "):
        cfg.check_sequence_length(10, name="max_length")


@pytest.mark.parametrize(
    "num_target, num_draft, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (28, 1, [14]),
        (37, 1, [18]),
        (24, 1, [12]),
    ],
)
def test_default_target_layer_ids(num_target, num_draft, expected):
    assert default_target_layer_ids(num_target, num_draft) == expected


def test_target_layer_ids_default_and_override(tiny_draft_config):
    assert tiny_draft_config(target_layer_ids=None, num_target_layers=36, num_hidden_layers=5).target_layer_ids == [
        1,
        9,
        17,
        25,
        33,
    ]
    assert tiny_draft_config(target_layer_ids=[0, 4]).target_layer_ids == [0, 4]


@pytest.mark.parametrize("num_target, num_draft", [(2, 1), (3, 1), (4, 3), (5, 5), (6, 2), (36, 5)])
def test_default_target_layer_ids_are_always_valid(num_target, num_draft):
    # Shallow targets: the DFlash rule would pick the last layer (2 layers, 1 draft) or repeat ids (4 / 3).
    ids = default_target_layer_ids(num_target, num_draft)
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] <= num_target - 2, ids


def test_rope_theta_of_reads_rope_parameters_first():
    hf = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    assert rope_theta_of(hf) == 500_000.0
    # transformers 5 can show a class-default rope_theta beside the real base in rope_parameters.
    stale = SimpleNamespace(rope_theta=10_000.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_theta_of(stale) == 1e6
    assert rope_theta_of(SimpleNamespace(rope_theta=2_500.0)) == 2_500.0


# Every key DESIGN §5 / the spec's config.json contract names, at the top level and in dflash_config.
TOP_LEVEL_KEYS = {
    "architectures",
    "model_type",
    "block_size",
    "dflash_config",
    "is_causal",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "torch_dtype",
    "num_target_layers",
    "layer_types",
}
DFLASH2_KEYS = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}


def test_hf_dict_has_every_contract_key(tiny_draft_config):
    cfg = tiny_draft_config(rope_theta=500_000.0, num_hidden_layers=3)
    d = json.loads(json.dumps(cfg.to_hf_dict()))  # and it is plain JSON
    assert TOP_LEVEL_KEYS <= d.keys(), TOP_LEVEL_KEYS - d.keys()
    assert d["architectures"] == ["DFlash2DraftModel"]
    assert d["model_type"] == "qwen3"
    assert d["is_causal"] is False
    assert d["tie_word_embeddings"] is False
    assert d["attention_bias"] is False
    assert d["block_size"] == 4
    assert d["rope_theta"] == 500_000.0
    assert d["rope_parameters"]["rope_theta"] == 500_000.0
    assert d["num_target_layers"] == 6
    assert d["layer_types"] == ["full_attention"] * 3
    geometry = dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        hidden_act="silu",
        vocab_size=96,
    )
    assert {k: d[k] for k in geometry} == geometry
    assert d["dflash_config"] == dict(
        mask_token_id=95,
        target_layer_ids=[1, 2, 4],
        projector_type="dflash2",
        conv_kernel_size=2,
        conv_group_size=8,
        selector_rank=6,
        selector_top_k=5,
        block_size=4,
    )


def test_hf_dict_baseline_has_no_dflash2_keys(tiny_draft_config):
    d = tiny_draft_config(projector_type="dflash").to_hf_dict()
    assert d["architectures"] == ["DFlashDraftModel"]
    assert not (DFLASH2_KEYS | {"projector_type"}) & d["dflash_config"].keys()
    assert d["dflash_config"] == dict(mask_token_id=95, target_layer_ids=[1, 2, 4], block_size=4)


def test_hf_dict_sliding_window_stays_non_causal(tiny_draft_config):
    d = tiny_draft_config(sliding_window=8).to_hf_dict()
    # A server treats sliding_attention layers as causal unless is_causal says otherwise.
    assert d["is_causal"] is False and d["dflash_config"]["causal"] is False
    assert d["layer_types"] == ["sliding_attention"] * 2
    assert d["sliding_window"] == 8 and d["use_sliding_window"] is True
    assert d["dflash_config"]["use_swa"] is True and d["dflash_config"]["swa_window_size"] == 8


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        # The baseline does not export the DFlash2 fields, so they come back as the class defaults.
        dict(projector_type="dflash", conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16),
        dict(sliding_window=8, rope_theta=1e6, torch_dtype="bfloat16"),
        dict(num_hidden_layers=5, target_layer_ids=None, num_target_layers=36, rms_norm_eps=1e-5),
    ],
    ids=["dflash2", "dflash", "swa-bf16", "default-ids"],
)
def test_hf_dict_round_trip(tiny_draft_config, overrides):
    cfg = tiny_draft_config(**overrides)
    d = cfg.to_hf_dict()
    back = DraftConfig.from_hf_dict(json.loads(json.dumps(d)))
    assert back == cfg
    assert back.to_hf_dict() == d


def test_from_hf_dict_reads_zlab_style_config(tiny_draft_config):
    # The published z-lab form: rope base only inside rope_parameters, `dtype`, SWA layer types.
    d = tiny_draft_config(sliding_window=8).to_hf_dict()
    del d["rope_theta"], d["torch_dtype"], d["dflash_config"]["use_swa"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5_000_000.0}
    d["dtype"] = "bfloat16"
    cfg = DraftConfig.from_hf_dict(d)
    assert cfg.rope_theta == 5_000_000.0
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.sliding_window == 8


@pytest.mark.parametrize("drop", sorted(DFLASH2_KEYS))
def test_from_hf_dict_names_a_missing_dflash2_key(tiny_draft_config, drop):
    d = tiny_draft_config().to_hf_dict()
    del d["dflash_config"][drop]
    with pytest.raises(ConfigError, match=f"dflash_config.{drop} is missing"):
        DraftConfig.from_hf_dict(d)


def test_from_hf_dict_rejects_unknown_architecture(tiny_draft_config):
    d = tiny_draft_config(projector_type="dflash").to_hf_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ConfigError, match="architectures=.*LlamaForCausalLM"):
        DraftConfig.from_hf_dict(d)
