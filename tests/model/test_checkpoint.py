"""The served checkpoint: the 21-name tensor contract, bit-exact save/load, precise load errors, atomic writes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash2_lightning import files
from dflash2_lightning.model import DraftModel, checkpoint
from dflash2_lightning.model.checkpoint import CheckpointError, load_config, load_draft, save_draft


def contract(num_layers, h, v, n_t, nh, nkv, hd, inter, taps, group, rank, dflash2=True):
    """The spec's table (6 global + 15 per layer), written out independently of the library."""
    names = {"fc.weight": [h, n_t * h], "hidden_norm.weight": [h], "norm.weight": [h]}
    if dflash2:
        names |= {
            "candidate_selector.predecessor_codebook": [v, rank],
            "candidate_selector.successor_codebook": [v, rank],
            "candidate_selector.hidden_projection.weight": [rank, h],
        }
    g = h // group
    for i in range(num_layers):
        names |= {
            f"layers.{i}.input_layernorm.weight": [h],
            f"layers.{i}.post_attention_layernorm.weight": [h],
            f"layers.{i}.self_attn.q_proj.weight": [nh * hd, h],
            f"layers.{i}.self_attn.k_proj.weight": [nkv * hd, h],
            f"layers.{i}.self_attn.v_proj.weight": [nkv * hd, h],
            f"layers.{i}.self_attn.o_proj.weight": [h, nh * hd],
            f"layers.{i}.self_attn.q_norm.weight": [hd],
            f"layers.{i}.self_attn.k_norm.weight": [hd],
            f"layers.{i}.mlp.gate_proj.weight": [inter, h],
            f"layers.{i}.mlp.up_proj.weight": [inter, h],
            f"layers.{i}.mlp.down_proj.weight": [h, inter],
        }
        if dflash2:
            names |= {
                f"layers.{i}.attention_conv.base_kernel": [2, taps, h],
                f"layers.{i}.attention_conv.kernel_projection.weight": [2 * taps * g, h],
                f"layers.{i}.mlp_conv.base_kernel": [2, taps, h],
                f"layers.{i}.mlp_conv.kernel_projection.weight": [2 * taps * g, h],
            }
    return names


def header_shapes(path) -> dict[str, list[int]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("num_layers", [1, 2, 5])
@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_saved_tensors_are_exactly_the_contract(tiny_draft_config, tmp_path, num_layers, projector):
    # hidden 32, vocab 96, 3 target features, 4 heads / 2 KV heads of 8, MLP 48, conv 3 taps / group 8, rank 6.
    cfg = tiny_draft_config(num_hidden_layers=num_layers, projector_type=projector, conv_kernel_size=3)
    save_draft(DraftModel(cfg), tmp_path)
    shapes = header_shapes(tmp_path / "model.safetensors")
    expected = contract(
        num_layers,
        h=32,
        v=96,
        n_t=3,
        nh=4,
        nkv=2,
        hd=8,
        inter=48,
        taps=3,
        group=8,
        rank=6,
        dflash2=projector == "dflash2",
    )
    assert shapes == expected
    assert len(shapes) == (6 + 15 * num_layers if projector == "dflash2" else 3 + 11 * num_layers)
    assert not [k for k in shapes if "embed" in k or "lm_head" in k or "rotary" in k or "inv_freq" in k]
    assert {k: list(v) for k, v in checkpoint.expected_tensors(cfg).items()} == expected


def test_five_layer_draft_has_81_tensors_with_non_square_geometry(tiny_draft_config, tmp_path):
    # head_dim * heads != hidden and a non-default group, so swapped dimensions cannot hide.
    cfg = tiny_draft_config(
        num_hidden_layers=5, head_dim=12, conv_group_size=4, intermediate_size=40, target_layer_ids=[0, 3]
    )
    save_draft(DraftModel(cfg), tmp_path)
    shapes = header_shapes(tmp_path / "model.safetensors")
    assert len(shapes) == 81
    assert shapes == contract(5, h=32, v=96, n_t=2, nh=4, nkv=2, hd=12, inter=40, taps=2, group=4, rank=6)


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_save_load_is_bit_exact(tiny_draft_config, randomized_draft, tmp_path, projector):
    model = randomized_draft(tiny_draft_config(projector_type=projector, rope_theta=123_456.0))
    save_draft(model, tmp_path)
    loaded = load_draft(tmp_path)
    # Compared through config.json: the baseline does not carry the (unused) DFlash2 fields.
    assert loaded.config.to_hf_dict() == model.config.to_hf_dict()
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == tensor.dtype
        assert torch.equal(loaded.state_dict()[name], tensor), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [model.config.architecture]
    assert config["rope_theta"] == 123_456.0
    assert load_config(tmp_path).to_hf_dict() == model.config.to_hf_dict()


def test_save_in_another_dtype_records_it(tiny_draft_config, randomized_draft, tmp_path):
    model = randomized_draft(tiny_draft_config())
    save_draft(model, tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "model.safetensors")).values())
    loaded = load_draft(tmp_path)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert next(load_draft(tmp_path, dtype=torch.float32).parameters()).dtype == torch.float32


def test_a_bf16_checkpoint_keeps_ropes_frequencies_in_float32(tiny_draft_config, randomized_draft, tmp_path):
    """A bf16 draft (loaded for evaluation, drafting or export) rotates by the float32 frequencies every engine uses:
    cast with the weights, ``inv_freq`` would be rounded to 8 bits of mantissa (radians off at position 3000)."""
    model = randomized_draft(tiny_draft_config(rope_theta=1_000_000.0, head_dim=16))
    save_draft(model, tmp_path, dtype="bfloat16")
    loaded = load_draft(tmp_path)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    reference = model.rotary.inv_freq
    assert loaded.rotary.inv_freq.dtype == torch.float32 and torch.equal(loaded.rotary.inv_freq, reference)
    positions = torch.tensor([[0, 1, 2999, 3000]])
    cos, sin = loaded.rotary(positions, torch.float32)
    cos_ref, sin_ref = model.rotary(positions, torch.float32)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    rounded = reference.to(torch.bfloat16).to(torch.float32)  # what the cast used to leave
    assert (3000 * (reference - rounded)).abs().max() > 0.1  # radians: what the checks above would catch


@pytest.fixture
def saved(tiny_draft_config, tmp_path):
    save_draft(DraftModel(tiny_draft_config()), tmp_path)
    return tmp_path, load_file(str(tmp_path / "model.safetensors"))


def rewrite(directory, state):
    save_file(state, str(directory / "model.safetensors"))


def test_load_names_a_missing_tensor(saved):
    directory, state = saved
    del state["layers.1.mlp_conv.kernel_projection.weight"]
    rewrite(directory, state)
    with pytest.raises(CheckpointError, match=r"missing 1: layers\.1\.mlp_conv\.kernel_projection\.weight"):
        load_draft(directory)


def test_load_names_an_extra_tensor(saved):
    directory, state = saved
    state["lm_head.weight"] = torch.zeros(96, 32)
    rewrite(directory, state)
    with pytest.raises(CheckpointError, match=r"unexpected 1: lm_head\.weight"):
        load_draft(directory)


def test_load_names_a_misshapen_tensor(saved):
    directory, state = saved
    state["layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    rewrite(directory, state)
    with pytest.raises(
        CheckpointError,
        match=r"wrong shape 1: layers\.0\.self_attn\.k_proj\.weight: "
        r"\(32, 32\) \(expected \(16, 32\)\)",
    ):
        load_draft(directory)


def test_load_of_baseline_weights_under_dflash2_config_lists_the_missing_parts(tiny_draft_config, tmp_path):
    save_draft(DraftModel(tiny_draft_config(projector_type="dflash")), tmp_path / "base")
    save_draft(DraftModel(tiny_draft_config()), tmp_path / "two")
    os.replace(tmp_path / "base" / "model.safetensors", tmp_path / "two" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 11: candidate_selector\.hidden_projection\.weight"):
        load_draft(tmp_path / "two")


def test_load_without_files_says_which(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_draft(tmp_path)


def test_failed_write_leaves_previous_checkpoint_intact(tiny_draft_config, randomized_draft, tmp_path, monkeypatch):
    save_draft(randomized_draft(tiny_draft_config(), seed=0), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def half_written(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_draft(randomized_draft(tiny_draft_config(), seed=1), tmp_path)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before  # same files, same bytes, and no temporary file left behind
    assert sorted(after) == ["config.json", "model.safetensors"]


def test_atomic_write_text_failure_leaves_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "notes.txt"
    files.atomic_write_text(target, "old")

    def boom(tmp):
        with open(tmp, "w") as f:
            f.write("new but incomplete")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        files.atomic_write(target, boom)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
