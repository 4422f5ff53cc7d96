"""The private Lightning names behind exact resume and preemption are still there, and read what they should.

Every name of :data:`~dflash2_lightning.train.lightning_internals.PROBES` is looked up on a real trainer that ran
a tiny fit (one test per name: a Lightning upgrade that renames one fails that test, with a message naming it);
the accessors are read during a real fit and compared with what the loop did; a name taken away makes
``check`` (and, for a private import, importing the package) fail with one clear message. This package's
subclasses of Lightning classes override no private Lightning method other than those probed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import FSDPStrategy

import dflash2_lightning
from dflash2_lightning.train import lightning_internals as internals
from dflash2_lightning.train.launcher import WatchedLauncher, install_launcher
from dflash2_lightning.train.lightning_internals import LightningInternalsChanged

PACKAGE = Path(dflash2_lightning.__file__).parent
BATCHES = 4  # with accumulate_grad_batches=2: two optimizer steps; a validation after batches 2 and 4


class Record(Callback):
    """What the accessors read at the end of each training batch (and ``check`` run there, mid-fit)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        internals.check(trainer)
        self.seen.append(
            {
                "global_step": trainer.global_step,
                "accumulate": internals.should_accumulate(trainer),
                "validation": internals.validation_follows(trainer),
                "skip": internals.skips_next_validation(trainer),
                "stepped": internals.batches_that_stepped(trainer),
                "first_iter": internals.first_loop_iter(trainer),
                "update_logs": internals.should_update_logs(trainer),
                "logged": dict(internals.logged_metrics(trainer)),
                "attached": internals.attached_trainer(pl_module) is trainer,
            }
        )


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


def tiny_trainer(root: Path, **kwargs) -> Trainer:
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=BATCHES,
        limit_val_batches=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    settings.update(kwargs)
    return Trainer(**settings)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[Trainer, Record]:
    """A trainer that ran a tiny fit (gradient accumulation, a validation every two batches), and what it saw."""
    torch.manual_seed(0)
    record = Record()
    trainer = tiny_trainer(tmp_path_factory.mktemp("fit"), accumulate_grad_batches=2, callbacks=[record])
    trainer.fit(LoggingModel())
    return trainer, record


@pytest.mark.parametrize("probe", internals.PROBES, ids=[p.name for p in internals.PROBES])
def test_lightning_still_has(probe: internals.Probe, fitted) -> None:
    probe.verify(fitted[0])


def test_the_accessors_read_the_loop_of_a_real_fit(fitted) -> None:
    trainer, record = fitted
    seen = record.seen
    assert len(seen) == BATCHES
    assert [s["accumulate"] for s in seen] == [True, False, True, False]
    assert [s["validation"] for s in seen] == [False, True, False, True]
    assert not any(s["skip"] for s in seen)
    assert [s["global_step"] for s in seen] == [0, 1, 1, 2]
    # Lightning's logger step (the number log_step_metrics_now writes) counts the optimizer steps taken before.
    assert [s["stepped"] for s in seen] == [0, 0, 1, 1]
    assert all(isinstance(s["first_iter"], bool) and isinstance(s["update_logs"], bool) for s in seen)
    assert all("train/loss" in s["logged"] for s in seen if not s["accumulate"])
    assert all(s["attached"] for s in seen)
    assert internals.batches_that_stepped(trainer) == trainer.global_step == 2
    assert internals.attached_trainer(BoringModel()) is None
    assert isinstance(internals.cluster_environment(trainer), ClusterEnvironment)
    assert isinstance(internals.rich_available(), bool)


def test_set_first_loop_iter_is_what_first_loop_iter_reads(fitted) -> None:
    trainer = fitted[0]
    before = internals.first_loop_iter(trainer)
    try:
        for value in (True, False, None):
            internals.set_first_loop_iter(trainer, value)
            assert internals.first_loop_iter(trainer) is value
    finally:
        internals.set_first_loop_iter(trainer, before)


def test_the_replaced_signal_connector_is_the_one_the_fit_uses(tmp_path) -> None:
    calls = []

    class Recording(internals.SignalConnector):
        def register_signal_handlers(self) -> None:
            calls.append("register")

        def teardown(self) -> None:
            calls.append("teardown")

    trainer = tiny_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    internals.replace_signal_connector(trainer, Recording(trainer))
    trainer.fit(BoringModel())
    assert calls == ["register", "teardown"]


def test_the_replaced_launcher_is_the_strategys(tmp_path) -> None:
    """A DDP trainer's launcher (made when the trainer is, nothing is launched) becomes the watched one."""
    trainer = tiny_trainer(tmp_path, devices=2, strategy="ddp")
    assert type(trainer.strategy.launcher) is internals.SubprocessScriptLauncher
    install_launcher(trainer, "dflash2 fit --ckpt_path last")
    assert isinstance(trainer.strategy.launcher, WatchedLauncher)
    assert trainer.strategy.launcher.num_processes == 2


def clear_message(name: str, needed_by: str) -> str:
    """What the error must say: the name, the installed version, the one it was read from, what needs it."""
    return (
        rf"lightning {lightning.__version__}: the private \w[\w ]* {name} .*; {needed_by}.* depends on it "
        rf"\(read from lightning {internals.WRITTEN_FOR}\)"
    )


def test_a_missing_attribute_fails_with_a_clear_message(fitted, monkeypatch) -> None:
    trainer = fitted[0]
    monkeypatch.delattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped")
    with pytest.raises(
        LightningInternalsChanged, match=clear_message(r"TrainingEpochLoop\._batches_that_stepped", "exact resume")
    ):
        internals.check(trainer)


def test_a_missing_method_fails_with_a_clear_message(fitted, monkeypatch) -> None:
    monkeypatch.delattr(type(fitted[0].fit_loop.epoch_loop), "_should_check_val_fx")
    with pytest.raises(
        LightningInternalsChanged, match=clear_message(r"TrainingEpochLoop\._should_check_val_fx", "exact resume")
    ):
        internals.check(fitted[0])


def test_a_method_that_is_no_longer_one_fails_with_a_clear_message(fitted, monkeypatch) -> None:
    monkeypatch.setattr(type(fitted[0].fit_loop.epoch_loop), "_should_check_val_fx", 3)
    with pytest.raises(LightningInternalsChanged, match="is no longer a method"):
        internals.check(fitted[0])


def test_an_overridden_hook_moved_to_a_base_class_fails(fitted, monkeypatch) -> None:
    """FSDPStrategy's own _setup_model gone (Strategy's would still be found): DraftFSDPStrategy's override is named."""
    monkeypatch.delattr(FSDPStrategy, "_setup_model")
    with pytest.raises(
        LightningInternalsChanged, match=clear_message(r"FSDPStrategy\._setup_model", "DraftFSDPStrategy")
    ):
        internals.check(fitted[0])


def test_a_missing_private_import_fails_at_import_with_the_clear_message() -> None:
    """Lightning without ``_SubprocessScriptLauncher``: importing the package's training modules says so in one line."""
    code = (
        "import lightning.pytorch.strategies.launchers as launchers\n"
        "del launchers._SubprocessScriptLauncher\n"
        "import dflash2_lightning.train.launcher\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("dflash2_lightning.train.lightning_internals.LightningInternalsChanged: "), done.stderr
    assert "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher is missing" in last
    assert f"read from lightning {internals.WRITTEN_FOR}" in last and "WatchedLauncher" in last


def lightning_subclasses() -> list[type]:
    """This package's classes with a Lightning class among their bases (from every module that imports Lightning)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "lightning." not in path.read_text(encoding="utf-8"):
            continue
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = importlib.import_module(name.removesuffix(".__init__"))
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                if any(base.__module__.startswith("lightning.") for base in cls.__mro__[1:]):
                    found.append(cls)
    return found


def test_subclasses_override_no_private_lightning_method_but_the_probed_ones() -> None:
    """A private method of this package's own that a Lightning class also defines replaces Lightning's silently; the
    overrides that are meant are probed (``overridden method``), every other one is a name clash."""
    probed = {p.name for p in internals.PROBES if p.kind == "overridden method"}
    classes = lightning_subclasses()
    assert {"DraftFSDPStrategy", "WatchedLauncher", "PreemptionSignalConnector", "ResumableCSVLogger", "PlanCLI"} <= {
        cls.__name__ for cls in classes
    }
    overrides, clashes = set(), []
    for cls in classes:
        for name in vars(cls):
            if not name.startswith("_") or name.startswith("__") or name == "_abc_impl":  # ABC's own bookkeeping
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("lightning.")]
            owner = next((b for b in bases if name in vars(b)), None)
            if owner is None:
                continue
            meant = [f"{b.__name__}.{name}" for b in bases if f"{b.__name__}.{name}" in probed]
            if meant:
                overrides.update(meant)
            else:
                clashes.append(f"{cls.__module__}.{cls.__name__}.{name} overrides {owner.__module__}.{owner.__name__}")
    assert not clashes, "private Lightning methods overridden without a probe:\n" + "\n".join(clashes)
    assert {
        "FSDPStrategy._setup_model",
        "LightningCLI._set_seed",
        "ExperimentWriter._check_log_dir_exists",
        "RichProgressBar._get_train_description",
    } <= overrides
