"""A draft trained for a mixture-of-experts target: ``dflash2 fit`` against tiny random Qwen3-MoE and Mixtral targets
(local HF directories written by transformers, loaded as a user's would be), then the HF checkpoint export."""

from __future__ import annotations

import math
import sys

import pytest
import yaml
from hf_families import save_tiny_hf
from test_cli import read_metrics, small_config

from dflash2_lightning import cli
from dflash2_lightning.model.checkpoint import load_draft
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetSpec


@pytest.mark.parametrize(("family", "mode"), [("qwen3_moe", "online"), ("mixtral", "online"), ("qwen3_moe", "offline")])
def test_fit_and_export_against_a_moe_target(tmp_path, monkeypatch, family, mode):
    """Online (the target runs in every step) and offline (its features cached first by the cache build)."""
    monkeypatch.setattr(sys, "argv", ["dflash2"])
    directory = save_tiny_hf(family, tmp_path / family)
    config_path = small_config(tmp_path, max_samples=32, mode=mode, cache_dir=str(tmp_path / "cache"))
    config = yaml.safe_load(config_path.read_text())
    config["model"]["init_args"]["target"] = {"path": str(directory)}
    config["trainer"]["max_steps"] = 2
    if mode == "offline":
        config["data"]["init_args"]["offline"]["teacher_top_k"] = 8  # the distillation's teacher logits, cached
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    assert not cli.main(["fit", "--config", str(config_path), "--model.init_args.export.acceptance_prompts", "0"])

    run = tmp_path / "runs" / "tiny" / "default"
    losses = [float(row["train/loss"]) for row in read_metrics(run) if row.get("train/loss")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    draft = load_draft(run / "hf")  # the HF export: strict loading of every tensor
    target = load_target(TargetSpec(path=str(directory)))
    target.check_fits(draft.config)  # hidden size, vocabulary and feature layers of the MoE target
    assert draft.config.num_target_layers == target.num_layers == 4
    assert draft.config.intermediate_size == target.config.intermediate_size
    assert (run / "hf" / "SERVING.md").is_file()
    if mode == "offline":
        assert list((tmp_path / "cache").rglob("manifest.json")), "no feature cache was built"
