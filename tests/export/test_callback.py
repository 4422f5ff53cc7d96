"""The end-of-fit export is a Lightning callback: every shipped config names it, and a config that does not (an
older one) gets it all the same, once, and exports as it always did."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import pytest
import torch
import yaml
from test_cli import small_config

from dflash2_lightning import cli
from dflash2_lightning.errors import ConfigError
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


class _NotADraft(pl.LightningModule):
    """The smallest model Lightning trains: one linear layer, a mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_export_callback_on_another_model_says_so_in_one_line(tmp_path):
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[ExportOnFitEnd()],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    with pytest.raises(ConfigError, match=r"ExportOnFitEnd exports the draft of a DFlash2Module.* a _NotADraft"):
        trainer.fit(_NotADraft(), data)
    assert not (tmp_path / "hf").exists()
