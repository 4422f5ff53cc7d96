"""GGUF export for llama.cpp's dflash architecture: names, keys, tensors, errors, and equality with llama.cpp's converter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import randomize_draft_
from llamacpp_helpers import PROVENANCE_KEYS, gguf_contents, llama_source_or_skip, smollm2_draft_config, vocab_gguf

from dflash2_lightning import cli
from dflash2_lightning.engines.draft_gguf import GGUFExportError, export_gguf, export_gguf_main, gguf_tensor_name
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.checkpoint import expected_tensors, save_draft

gguf = pytest.importorskip("gguf")


def _draft_dir(tmp_path: Path, cfg, name: str = "draft") -> Path:
    model = randomize_draft_(DraftModel(cfg), seed=1)
    return save_draft(model, tmp_path / name)


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_every_contract_tensor_has_a_distinct_llama_cpp_name(tiny_draft_config, projector):
    cfg = tiny_draft_config(projector_type=projector)
    names = {gguf_tensor_name(n) for n in expected_tensors(cfg)}
    assert len(names) == len(expected_tensors(cfg))
    assert {
        "fc.weight",
        "enc.output_norm.weight",
        "output_norm.weight",
        "blk.1.attn_q.weight",
        "blk.1.ffn_down.weight",
    } <= names
    conv = {
        "blk.0.attn_conv_base",
        "blk.0.ffn_conv_proj.weight",
        "selector_predecessor.weight",
        "selector_hidden.weight",
    }
    assert (conv <= names) == (projector == "dflash2")
    with pytest.raises(GGUFExportError, match="embed_tokens"):
        gguf_tensor_name("embed_tokens.weight")


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_keys_and_tensors_round_trip(tmp_path, tiny_draft_config, projector):
    cfg = tiny_draft_config(projector_type=projector)
    draft = _draft_dir(tmp_path, cfg)
    out = export_gguf(draft, vocab_gguf(tmp_path / "target.gguf", cfg.vocab_size), tmp_path / "d.gguf")
    fields, tensors = gguf_contents(out)
    value = {k: v for k, (_, v) in fields.items()}
    assert value["general.architecture"] == "dflash"
    assert value["dflash.block_size"] == cfg.block_size
    assert value["dflash.target_layers"] == [i + 1 for i in cfg.target_layer_ids]
    assert value["dflash.attention.causal"] is False
    assert value["dflash.embedding_length"] == cfg.hidden_size
    assert value["dflash.attention.head_count_kv"] == cfg.num_key_value_heads
    assert value["tokenizer.ggml.mask_token_id"] == cfg.mask_token_id
    assert value["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(cfg.vocab_size)]
    assert value["tokenizer.ggml.merges"] == ["t 1", "t 2"]
    conv_keys = {"dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank", "dflash.selector_top_k"}
    if projector == "dflash2":
        assert [value[k] for k in sorted(conv_keys)] == [
            cfg.conv_group_size,
            cfg.conv_kernel_size,
            cfg.selector_rank,
            cfg.selector_top_k,
        ]
    else:
        assert not conv_keys & set(value)
    from safetensors.torch import load_file

    state = load_file(str(draft / "model.safetensors"))
    assert set(tensors) == {gguf_tensor_name(n) for n in state}
    for name, t in state.items():
        kind, shape, raw = tensors[gguf_tensor_name(name)]
        assert kind == gguf.GGMLQuantizationType.F32
        assert shape == list(reversed(t.shape))  # GGML lists the fastest dimension first
        assert raw == t.numpy().tobytes()


def test_q8_0_and_f16_storage_types_and_values(tmp_path, tiny_draft_config):
    cfg = tiny_draft_config()
    draft = _draft_dir(tmp_path, cfg)
    target = vocab_gguf(tmp_path / "target.gguf", cfg.vocab_size)
    from safetensors.torch import load_file

    state = load_file(str(draft / "model.safetensors"))
    q = gguf.GGMLQuantizationType
    for outtype, matrix_type in (("f16", q.F16), ("q8_0", q.Q8_0)):
        _, tensors = gguf_contents(export_gguf(draft, target, tmp_path / f"{outtype}.gguf", outtype))
        assert tensors["blk.0.attn_norm.weight"][0] == q.F32  # norms stay F32
        assert tensors["blk.0.attn_conv_base"][0] == q.F32  # no .weight suffix: F32, as llama.cpp's converter
        assert tensors["fc.weight"][0] == matrix_type  # 96 columns: whole Q8_0 blocks of 32
        # hidden 32 columns: q_proj rows are one Q8_0 block; the selector codebooks (rank 6) fall back to F16
        assert tensors["selector_predecessor.weight"][0] == (q.F16 if outtype == "q8_0" else matrix_type)
        kind, shape, raw = tensors["fc.weight"]
        data = gguf.quants.dequantize(np.frombuffer(raw, np.uint8), kind).reshape(state["fc.weight"].shape)
        err = np.abs(data - state["fc.weight"].numpy()).max()
        assert err < (2e-3 if outtype == "f16" else 0.02) * float(state["fc.weight"].abs().max())


def test_bad_inputs_are_named(tmp_path, tiny_draft_config):
    cfg = tiny_draft_config()
    draft = _draft_dir(tmp_path, cfg)
    target = vocab_gguf(tmp_path / "target.gguf", cfg.vocab_size)
    with pytest.raises(GGUFExportError, match="outtype='q4_k'"):
        export_gguf(draft, target, tmp_path / "x.gguf", "q4_k")
    with pytest.raises(GGUFExportError, match="vocab_size=96 .* 90 tokens"):
        export_gguf(draft, vocab_gguf(tmp_path / "other.gguf", 90), tmp_path / "x.gguf")
    wide = _draft_dir(tmp_path, tiny_draft_config(selector_top_k=6), "wide")  # 6 * 7 = 42 > hidden 32
    with pytest.raises(GGUFExportError, match=r"selector_top_k=6 .* hidden_size >= .* = 42"):
        export_gguf(wide, target, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_cli_needs_the_target_gguf_for_an_hf_target(tmp_path, tiny_draft_config, capsys):
    cfg = tiny_draft_config()
    draft = _draft_dir(tmp_path, cfg)
    assert (
        cli.main(["export-gguf", "--draft", str(draft), "--target", str(tmp_path), "--out", str(tmp_path / "d.gguf")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: ") and "--target-gguf" in err and len(err.splitlines()) == 1
    target = vocab_gguf(tmp_path / "target.gguf", cfg.vocab_size)
    assert (
        export_gguf_main(
            [
                "--draft",
                str(draft),
                "--target",
                str(tmp_path),
                "--target-gguf",
                str(target),
                "--out",
                str(tmp_path / "d.gguf"),
                "--outtype",
                "bf16",
            ]
        )
        == 0
    )
    fields, _ = gguf_contents(tmp_path / "d.gguf")
    assert fields["general.file_type"][1] == int(gguf.LlamaFileType.MOSTLY_BF16)


@pytest.mark.slow
@pytest.mark.parametrize(
    "projector,outtype,dtype",
    [  # every outtype, both projectors, a bf16 checkpoint
        ("dflash2", "f32", torch.float32),
        ("dflash2", "q8_0", torch.float32),
        ("dflash2", "bf16", torch.bfloat16),
        ("dflash", "f16", torch.float32),
    ],
)
def test_equal_to_llama_cpp_converter(tmp_path, projector, outtype, dtype):
    """Field by field and tensor by tensor (bytes) equal to what llama.cpp's convert_hf_to_gguf.py writes."""
    from dflash2_lightning.engines.llama_cpp import LlamaCpp
    from dflash2_lightning.engines.target_gguf import convert_hf_to_gguf
    from dflash2_lightning.target.gguf import resolve_gguf
    from dflash2_lightning.target.load import hf_dir_of
    from dflash2_lightning.target.spec import TargetSpec

    root = llama_source_or_skip()
    target_hf = hf_dir_of(TargetSpec(gguf="smollm2"))
    cfg = smollm2_draft_config(projector_type=projector)
    draft = save_draft(randomize_draft_(DraftModel(cfg), seed=2).to(dtype), tmp_path / "draft", dtype=dtype)
    ref = convert_hf_to_gguf(draft, tmp_path / "ref.gguf", outtype, target_model_dir=target_hf, llama=LlamaCpp(root))
    mine = export_gguf(draft, resolve_gguf("smollm2"), tmp_path / "mine.gguf", outtype)
    ref_fields, ref_tensors = gguf_contents(ref)
    fields, tensors = gguf_contents(mine)
    # The shipped SmolLM2 GGUF (our vocabulary source) was written by an older converter that also
    # stored add_space_prefix=false (llama.cpp's default for a gpt2 vocabulary): the only extra key.
    assert set(fields) - set(ref_fields) == {"tokenizer.ggml.add_space_prefix"}
    assert fields["tokenizer.ggml.add_space_prefix"][1] is False
    assert set(ref_fields) - set(fields) - PROVENANCE_KEYS == set()
    for key in sorted(set(ref_fields) - PROVENANCE_KEYS):
        assert fields[key] == ref_fields[key], key
    assert set(tensors) == set(ref_tensors)
    for name in sorted(ref_tensors):
        assert tensors[name][:2] == ref_tensors[name][:2], name
        assert tensors[name][2] == ref_tensors[name][2], name
