"""What the engines need, decided at export: the dtype rule, layer ids at config time, export warnings."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from module_helpers import SMALL, Batches, grouped, quiet_trainer, random_batch
from safetensors.torch import load_file
from test_cli import small_config
from torch.utils.data import DataLoader

from dflash2_lightning import cli
from dflash2_lightning.engines.rules import TargetInfo, choose_export_dtype, engine_findings
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.train.module import DFlash2Module


# ----------------------------------------------------------------------------- the dtype rule
def test_export_dtype_is_the_targets_declared_dtype_not_the_training_dtype():
    dtype, why = choose_export_dtype(None, TargetInfo(dtype="bfloat16", loaded_dtype="float32"))
    assert dtype == "bfloat16" and "the target's dtype (its config.json declares it)" in why
    dtype, why = choose_export_dtype(None, TargetInfo(loaded_dtype="float16"))  # declares none: as loaded
    assert dtype == "float16" and "the dtype it was loaded in" in why
    assert choose_export_dtype(None, None) == ("float32", "the target's dtype is unknown")


def test_a_requested_export_dtype_wins_and_says_what_it_costs():
    dtype, why = choose_export_dtype("float32", TargetInfo(dtype="bfloat16"))
    assert dtype == "float32" and "as requested" in why and "the target is bfloat16" in why
    assert choose_export_dtype("bfloat16", TargetInfo(dtype="bfloat16")) == ("bfloat16", "as requested (export_dtype)")


def _fit(tmp_path, target: TargetSpec, **kwargs) -> DFlash2Module:
    model = DFlash2Module(target=target, **grouped(export_dir=str(tmp_path / "hf"), **{**SMALL, **kwargs}))
    loader = DataLoader(Batches([{k: v[0] for k, v in random_batch(seed=i).items()} for i in range(2)]), batch_size=2)
    quiet_trainer(tmp_path, max_steps=1).fit(model, train_dataloaders=loader)
    return model


def test_fit_exports_a_float32_trained_draft_in_a_bf16_targets_dtype(tmp_path):
    model = _fit(tmp_path, TargetSpec(tiny={}, dtype="bfloat16"))
    assert model.draft.fc.weight.dtype == torch.float32  # trained in float32
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(tmp_path / "hf" / "model.safetensors")).values()} == {torch.bfloat16}
    serving = (tmp_path / "hf" / "SERVING.md").read_text()
    assert "- dtype bfloat16: the target's dtype" in serving and "--dtype bfloat16" in serving


def test_fit_exports_float32_when_asked_and_warns_about_the_bf16_target(tmp_path):
    with pytest.warns(UserWarning, match="the draft is float32 but the target is bfloat16"):
        _fit(tmp_path, TargetSpec(tiny={}, dtype="bfloat16"), export_dtype="float32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
    assert "as requested (export_dtype); the target is bfloat16" in (tmp_path / "hf" / "SERVING.md").read_text()


# ----------------------------------------------------------------------------- warnings at export
def test_fit_warns_at_export_about_a_top_k_sglang_cannot_serve(tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"\[SGLang 0.5.23\] selector_top_k=6 is not a power of two.*"
        r"Fix: retrain with selector_top_k=8 or 4",
    ):
        _fit(tmp_path, TargetSpec(tiny={}), selector_top_k=6)
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # a warning, not a failure


@pytest.mark.parametrize("top_k, warned", [(1, False), (2, False), (8, False), (16, False), (3, True), (12, True)])
def test_power_of_two_top_k_rule(tiny_draft_config, top_k, warned):
    findings = engine_findings(tiny_draft_config(selector_top_k=top_k))
    assert any("not a power of two" in f.message and f.level == "warning" for f in findings) == warned
    # the DFlash baseline has no selector: nothing to warn about
    assert not any(
        "power of two" in f.message
        for f in engine_findings(tiny_draft_config(projector_type="dflash", selector_top_k=top_k))
    )


def test_every_export_states_the_vllm_block_size_rule(tiny_draft_config):
    notes = [f for f in engine_findings(tiny_draft_config(block_size=16, conv_kernel_size=2)) if f.level == "note"]
    vllm = next(f for f in notes if f.engine.startswith("vLLM"))
    assert "never reads block_size=16" in vllm.message and "Model Runner V2" in vllm.message
    assert '"num_speculative_tokens": 15' in vllm.fix and '"method": "dflash"' in vllm.fix
    sglang = next(f for f in notes if f.engine.startswith("SGLang"))
    assert "pass 16" in sglang.fix


@pytest.mark.parametrize(
    "dtype, target_dtype, expected",
    [
        ("float32", None, "SGLang's --dtype auto serves it as float16"),
        ("float32", "bfloat16", "the draft is float32 but the target is bfloat16"),
        ("bfloat16", "float16", "the draft is bfloat16 but the target is float16"),
        ("float64", None, "serve bfloat16, float16 or float32 drafts only"),
        ("bfloat16", "bfloat16", None),
        ("bfloat16", None, None),
    ],
)
def test_dtype_warnings(tiny_draft_config, dtype, target_dtype, expected):
    target = TargetInfo(dtype=target_dtype) if target_dtype else None
    warnings = [
        f.message
        for f in engine_findings(tiny_draft_config(torch_dtype=dtype, selector_top_k=4), target)
        if f.level == "warning"
    ]
    assert (warnings == []) if expected is None else any(expected in w for w in warnings), warnings


# ----------------------------------------------------------------------------- layer ids, before any training
@pytest.mark.parametrize(
    "ids, message",
    [
        ([2, 1], r"target_layer_ids=\[2, 1\] is invalid: not in increasing order.*use \[1, 2\]"),
        ([1, 1], r"target_layer_ids=\[1, 1\] is invalid: duplicate ids \[1\]"),
        ([3], r"target_layer_ids=\[3\] is invalid: ids \[3\] are out of range.*layer 3 is the target's last layer"),
        ([0, 7], r"target_layer_ids=\[0, 7\] is invalid: ids \[7\] are out of range.*0 \.\. num_target_layers - 2 = 2"),
    ],
)
def test_layer_ids_are_refused_when_the_module_is_built(ids, message):
    with pytest.raises(ConfigError, match=message):  # the tiny target has 4 layers
        DFlash2Module(target=TargetSpec(tiny={}), **grouped(target_layer_ids=ids, **SMALL))


def test_fit_with_bad_layer_ids_stops_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dflash2"])
    config = small_config(tmp_path)
    assert cli.main(["fit", "--config", str(config), "--model.init_args.draft.target_layer_ids", "[2, 1]"]) == 2
    assert "target_layer_ids=[2, 1] is invalid: not in increasing order" in capsys.readouterr().err
    assert not list(tmp_path.glob("runs/**/*.ckpt"))


# ----------------------------------------------------------------------------- what fit knows about its target
def _stub_target(spec: TargetSpec, dtype=torch.float32):
    tokenizer = SimpleNamespace(get_vocab=lambda: {"<|MASK|>": 9})
    return SimpleNamespace(
        spec=spec, dtype=dtype, tokenizer=tokenizer, num_layers=6, hidden_size=32, vocab_size=96, rope_theta=1e4
    )


def test_target_info_of_an_hf_directory_target_reads_its_declared_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    info = TargetInfo.from_target(_stub_target(TargetSpec(path=str(tmp_path))))
    assert info.path == str(tmp_path.resolve()) and info.dtype == "bfloat16" and info.loaded_dtype == "float32"
    assert info.serving_dtype == "bfloat16" and info.mask_token_vocab_id == 9 and info.num_layers == 6


def test_target_info_of_a_gguf_target_points_llama_cpp_at_the_file(tmp_path):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    info = TargetInfo.from_target(_stub_target(TargetSpec(gguf=str(gguf)), dtype=torch.float16))
    assert info.gguf == str(gguf.resolve()) and info.path is None and info.serving_dtype == "float16"
