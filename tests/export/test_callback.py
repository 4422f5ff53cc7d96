"""The end-of-fit export is a Lightning callback: every shipped config names it, and a config that does not (an
older one) gets it all the same, once, and exports as it always did."""

from __future__ import annotations

import sys

import pytest
import yaml
from test_cli import small_config

from dflash2_lightning import cli
from dflash2_lightning.export.callback import FIT_END_CALLBACKS, ExportOnFitEnd
from dflash2_lightning.recipes import RECIPES
from dflash2_lightning.train import lightning_cli

CALLBACK = "dflash2_lightning.export.callback.ExportOnFitEnd"


def _without_callback(path):
    config = yaml.safe_load(path.read_text())
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if c["class_path"] != CALLBACK]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_shipped_config_names_the_export_callback(recipe):
    callbacks = yaml.safe_load((RECIPES / recipe).read_text())["trainer"]["callbacks"]
    assert [c["class_path"] for c in callbacks].count(CALLBACK) == 1


@pytest.mark.parametrize("named", [True, False], ids=["named", "not-named"])
def test_a_run_gets_one_export_callback_whether_its_config_names_it_or_not(tmp_path, monkeypatch, named):
    monkeypatch.setattr(sys, "argv", ["dflash2"])
    config = small_config(tmp_path)
    if not named:
        _without_callback(config)
    built = lightning_cli.build_cli(["--config", str(config)], run=False, fit_end_callbacks=FIT_END_CALLBACKS)
    assert sum(isinstance(c, ExportOnFitEnd) for c in built.trainer.callbacks) == 1


def test_a_config_that_does_not_name_it_still_exports(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dflash2"])
    config = _without_callback(small_config(tmp_path))
    assert CALLBACK not in config.read_text()
    assert not cli.main(["fit", "--config", str(config), "--model.init_args.export.acceptance_prompts", "0"])
    hf = tmp_path / "runs" / "tiny" / "default" / "hf"
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file() and (hf / "SERVING.md").is_file()
