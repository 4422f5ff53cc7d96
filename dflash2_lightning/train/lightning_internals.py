"""Every private Lightning name this package depends on, in one place, with a check that they are all still there.

Exact resume and preemption need a few of Lightning's private loop, connector and strategy attributes (read from
lightning 2.6.6, :data:`WRITTEN_FOR`). Code that reaches into a Lightning object calls the small functions here,
never the private name itself. Subclasses of Lightning classes keep their private dependencies (probed too):

- ``fsdp.DraftFSDPStrategy`` overrides ``FSDPStrategy._setup_model``; its ``accelerator`` and ``precision_plugin``
  properties keep the parent's ``_accelerator`` and ``_precision_plugin``;
- ``launcher.WatchedLauncher`` subclasses :data:`SubprocessScriptLauncher` and calls its ``_call_children_scripts``;
- ``preemption.PreemptionSignalConnector`` subclasses :data:`SignalConnector` (``register_signal_handlers``,
  ``teardown``);
- ``run_files.ResumableCSVLogger.experiment`` sets ``CSVLogger._experiment`` (through ``_fs``); its writer
  overrides ``ExperimentWriter._check_log_dir_exists`` and calls ``_record_new_keys``;
- ``plan_command.PlanCLI`` overrides ``LightningCLI._set_seed``; ``progress.StepRichProgressBar`` overrides
  ``RichProgressBar._get_train_description``.

:func:`check` looks each name up (a private import already at import time) and raises
:class:`LightningInternalsChanged` naming it, the installed version and what depends on it;
``tests/train/test_lightning_internals.py`` runs it on a real fit, so an upgrade that renames one fails there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import lightning
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import FSDPStrategy, Strategy

#: the Lightning release these names were read from
WRITTEN_FOR = "2.6.6"


class LightningInternalsChanged(RuntimeError):
    """The installed Lightning lacks a private name this package depends on (the message says which and why)."""


@dataclass(frozen=True)
class Probe:
    """One private Lightning name: how it is spelled, what kind of thing it must be, and who needs it."""

    #: as Lightning spells it, from the object it is reached on (``Trainer._logger_connector._first_loop_iter``)
    name: str
    #: ``attribute`` (present on the object), ``method`` or ``function`` (callable), ``class``, ``property``, or
    #: ``overridden method`` (a private method of a Lightning class that one of this package's subclasses overrides)
    kind: str
    #: what in this package depends on it
    needed_by: str
    #: finds it, given a trainer (raises AttributeError or ImportError when it is gone)
    find: Callable[[Any], Any]

    def verify(self, trainer: Trainer | None) -> Any:
        """What :attr:`find` finds; :class:`LightningInternalsChanged` unless it is there, as a thing of its kind."""
        try:
            found = self.find(trainer)
        except (AttributeError, ImportError) as error:
            raise self.changed(f"is missing ({type(error).__name__}: {error})") from None
        if self.kind == "class":
            ok = isinstance(found, type)
        elif self.kind == "property":
            ok = isinstance(found, property)
        elif self.kind in ("method", "function", "overridden method"):
            ok = callable(found)
        else:
            ok = True
        if not ok:
            raise self.changed(f"is no longer a {self.kind} (found {type(found).__name__})")
        return found

    def changed(self, how: str) -> LightningInternalsChanged:
        """The error saying that this name changed ``how``, in the installed Lightning."""
        return LightningInternalsChanged(
            f"lightning {lightning.__version__}: the private {self.kind} {self.name} {how}; {self.needed_by} "
            f"depends on it (read from lightning {WRITTEN_FOR}): install lightning=={WRITTEN_FOR}, or update "
            "dflash2_lightning/train/lightning_internals.py and what depends on it"
        )


def imported(module: str, name: str, kind: str, needed_by: str) -> Probe:
    """The probe of the private ``name`` that ``module`` defines."""
    return Probe(f"{module}.{name}", kind, needed_by, lambda _trainer: getattr(importlib.import_module(module), name))


SIGNAL_CONNECTOR = imported(
    "lightning.pytorch.trainer.connectors.signal_connector",
    "_SignalConnector",
    "class",
    "preemption (PreemptionSignalConnector subclasses it)",
)
SUBPROCESS_LAUNCHER = imported(
    "lightning.pytorch.strategies.launchers",
    "_SubprocessScriptLauncher",
    "class",
    "the rank watcher (WatchedLauncher subclasses it)",
)
SET_NUM_THREADS = imported(
    "lightning.fabric.utilities.distributed",
    "_set_num_threads_if_needed",
    "function",
    "the rank watcher (WatchedLauncher.launch)",
)
RICH_AVAILABLE = imported(
    "lightning.pytorch.utilities.imports", "_RICH_AVAILABLE", "attribute", "the progress bar (step_progress_bar)"
)

# Looked up through their probes: an upgrade that renames one fails here, at import, in the same words as check().
if TYPE_CHECKING:
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector as SignalConnector
else:
    #: Lightning's DDP launcher (ranks 1..n-1 as child processes); ``launcher.WatchedLauncher`` subclasses it
    SubprocessScriptLauncher = SUBPROCESS_LAUNCHER.verify(None)
    #: the trainer's signal handling; ``preemption.PreemptionSignalConnector`` subclasses it
    SignalConnector = SIGNAL_CONNECTOR.verify(None)
_lightning_set_num_threads = SET_NUM_THREADS.verify(None)


# ---------------------------------------------------------------------- the trainer's loops (exact resume)
def first_loop_iter(trainer: Trainer) -> bool | None:
    """``trainer._logger_connector._first_loop_iter``: whether the logger connector is in the first step of its loop
    (None outside one). Read to tell whether a step's metrics row is due (``run_files.log_step_metrics_now``) and
    saved around a validation that a resume runs (``due_validation.run_due_validation``). Lightning 2.6.6."""
    value: bool | None = trainer._logger_connector._first_loop_iter
    return value


def set_first_loop_iter(trainer: Trainer, value: bool | None) -> None:
    """Put back ``trainer._logger_connector._first_loop_iter`` after a validation a resume ran
    (``due_validation.run_due_validation``), as the uninterrupted run had it. Lightning 2.6.6."""
    trainer._logger_connector._first_loop_iter = value


def should_update_logs(trainer: Trainer) -> bool:
    """``trainer._logger_connector.should_update_logs``: whether this step's metrics are logged (``log_every_n_steps``).
    ``run_files.log_step_metrics_now`` logs a checkpointed step's row under Lightning's own rule. Lightning 2.6.6."""
    return bool(trainer._logger_connector.should_update_logs)


def logged_metrics(trainer: Trainer) -> dict[str, Any]:
    """``trainer._logger_connector.metrics["log"]``: the metrics Lightning logs for the step now ending, which
    ``run_files.log_step_metrics_now`` writes before the step's checkpoint. Lightning 2.6.6."""
    metrics: dict[str, Any] = trainer._logger_connector.metrics["log"]
    return metrics


def should_accumulate(trainer: Trainer) -> bool:
    """``trainer.fit_loop._should_accumulate()``: whether the batch now ending only accumulates gradients (no
    optimizer step, no metrics row): ``run_files.log_step_metrics_now``. Lightning 2.6.6."""
    return bool(trainer.fit_loop._should_accumulate())


def batches_that_stepped(trainer: Trainer) -> int:
    """``trainer.fit_loop.epoch_loop._batches_that_stepped``: the step number Lightning's loggers write when the
    metrics carry no ``step``; ``run_files.log_step_metrics_now`` writes the same number. Lightning 2.6.6."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def skips_next_validation(trainer: Trainer) -> bool:
    """``trainer.fit_loop.epoch_loop._skip_next_val``: set by Lightning when a resumed run must not repeat the
    validation of the batch it resumed after; ``due_validation.validation_due`` records none then. Lightning 2.6.6."""
    return bool(trainer.fit_loop.epoch_loop._skip_next_val)


def validation_follows(trainer: Trainer) -> bool:
    """``epoch_loop._should_check_val_fx(fit_loop._data_fetcher)``: Lightning's own rule (``val_check_interval``,
    the last batch, ``check_val_every_n_epoch``) for whether a validation runs after the batch now ending.
    ``due_validation.validation_due`` records it in a checkpoint, so that a resume runs it. Lightning 2.6.6."""
    fit_loop = trainer.fit_loop
    # Set while a fit trains, which is the only time this is asked.
    return bool(fit_loop.epoch_loop._should_check_val_fx(cast(Any, fit_loop._data_fetcher)))


def attached_trainer(module: LightningModule) -> Trainer | None:
    """``module._trainer``: the trainer the module is attached to, or None (``module.trainer`` raises then). The
    module's checkpoint hooks use it: they also run outside a fit. Lightning 2.6.6."""
    trainer: Trainer | None = module._trainer
    return trainer


# ---------------------------------------------------------------------- signals and processes (preemption)
def cluster_environment(trainer: Trainer) -> Any:
    """``trainer._accelerator_connector.cluster_environment``: where Lightning's own signal connector reads SLURM's
    auto-requeue settings; ``preemption.PreemptionSignalConnector`` reads them there too. Lightning 2.6.6."""
    return trainer._accelerator_connector.cluster_environment


def replace_signal_connector(trainer: Trainer, connector: SignalConnector) -> None:
    """Set ``trainer._signal_connector`` (made in ``Trainer.__init__``), whose ``register_signal_handlers`` and
    ``teardown`` the fit calls: ``preemption.install_preemption`` puts its own there. Lightning 2.6.6."""
    trainer._signal_connector = connector


def replace_launcher(strategy: Strategy, launcher: Any) -> None:
    """Set ``strategy._launcher`` (what ``strategy.launcher`` returns; set by the strategy's
    ``_configure_launcher``): ``launcher.install_launcher`` puts its watched launcher there. Lightning 2.6.6."""
    strategy._launcher = launcher


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's ``_set_num_threads_if_needed``: the CPU threads of each of ``num_processes`` ranks, as its own
    launcher sets them; ``launcher.WatchedLauncher.launch`` calls it as Lightning's ``launch`` does. Lightning 2.6.6."""
    _lightning_set_num_threads(num_processes=num_processes)


def rich_available() -> bool:
    """Lightning's ``_RICH_AVAILABLE``: whether it would pick the rich progress bar (``progress.step_progress_bar``
    picks the same). Lightning 2.6.6."""
    return bool(RICH_AVAILABLE.verify(None))


# ---------------------------------------------------------------------- the check
def _defined_by(cls: type, name: str) -> Any:
    """``name`` as ``cls`` itself defines it (not inherited: an override of it must still replace ``cls``'s own)."""
    if name not in vars(cls):
        raise AttributeError(f"{cls.__name__} no longer defines {name} itself")
    return vars(cls)[name]


def _on_class(obj: Any, name: str) -> Any:
    """``name`` looked up on ``obj``'s class (a property is not run, a method not bound)."""
    return getattr(type(obj), name)


def _connector(trainer: Trainer) -> Any:
    return trainer._logger_connector


RESUME = "exact resume (due_validation, run_files.log_step_metrics_now)"

#: every private Lightning name this package depends on
PROBES: tuple[Probe, ...] = (
    Probe("Trainer._logger_connector", "attribute", RESUME, _connector),
    Probe("Trainer._logger_connector._first_loop_iter", "attribute", RESUME, lambda t: _connector(t)._first_loop_iter),
    Probe(
        "Trainer._logger_connector.should_update_logs",
        "property",
        RESUME,
        lambda t: _on_class(_connector(t), "should_update_logs"),
    ),
    Probe("Trainer._logger_connector.metrics", "property", RESUME, lambda t: _on_class(_connector(t), "metrics")),
    Probe("FitLoop._should_accumulate", "method", RESUME, lambda t: t.fit_loop._should_accumulate),
    Probe("FitLoop._data_fetcher", "attribute", RESUME, lambda t: t.fit_loop._data_fetcher),
    Probe(
        "TrainingEpochLoop._batches_that_stepped",
        "attribute",
        RESUME,
        lambda t: t.fit_loop.epoch_loop._batches_that_stepped,
    ),
    Probe("TrainingEpochLoop._skip_next_val", "attribute", RESUME, lambda t: t.fit_loop.epoch_loop._skip_next_val),
    Probe(
        "TrainingEpochLoop._should_check_val_fx",
        "method",
        RESUME,
        lambda t: t.fit_loop.epoch_loop._should_check_val_fx,
    ),
    Probe(
        "LightningModule._trainer",
        "attribute",
        "DFlash2Module's checkpoint hooks (exact resume)",
        lambda t: LightningModule()._trainer,
    ),
    Probe(
        "Trainer._accelerator_connector.cluster_environment",
        "attribute",
        "preemption (SLURM requeue)",
        lambda t: t._accelerator_connector.cluster_environment,
    ),
    Probe("Trainer._signal_connector", "attribute", "preemption (install_preemption)", lambda t: t._signal_connector),
    SIGNAL_CONNECTOR,
    Probe(
        "_SignalConnector.register_signal_handlers",
        "overridden method",
        "preemption (PreemptionSignalConnector overrides it)",
        lambda t: SignalConnector.register_signal_handlers,
    ),
    Probe(
        "_SignalConnector.teardown",
        "overridden method",
        "preemption (PreemptionSignalConnector overrides it)",
        lambda t: SignalConnector.teardown,
    ),
    Probe("Strategy._launcher", "attribute", "the rank watcher (install_launcher)", lambda t: t.strategy._launcher),
    SUBPROCESS_LAUNCHER,
    Probe(
        "_SubprocessScriptLauncher._call_children_scripts",
        "method",
        "the rank watcher (WatchedLauncher.launch starts the child ranks with it)",
        lambda t: SubprocessScriptLauncher._call_children_scripts,
    ),
    SET_NUM_THREADS,
    Probe(
        "FSDPStrategy._setup_model",
        "overridden method",
        "DraftFSDPStrategy (it keeps the FSDP root for norm clipping)",
        lambda t: _defined_by(FSDPStrategy, "_setup_model"),
    ),
    Probe(
        "Strategy._accelerator",
        "attribute",
        "DraftFSDPStrategy's accelerator property",
        lambda t: t.strategy._accelerator,
    ),
    Probe(
        "Strategy._precision_plugin",
        "attribute",
        "DraftFSDPStrategy's precision_plugin property",
        lambda t: t.strategy._precision_plugin,
    ),
    Probe(
        "CSVLogger._experiment",
        "attribute",
        "ResumableCSVLogger.experiment (metrics.csv kept across a resume)",
        lambda t: CSVLogger(save_dir=".")._experiment,
    ),
    Probe(
        "CSVLogger._fs",
        "attribute",
        "ResumableCSVLogger.experiment (metrics.csv kept across a resume)",
        lambda t: CSVLogger(save_dir=".")._fs,
    ),
    Probe(
        "ExperimentWriter._check_log_dir_exists",
        "overridden method",
        "ResumableCSVLogger's writer (it keeps an existing metrics.csv)",
        lambda t: ExperimentWriter._check_log_dir_exists,
    ),
    Probe(
        "ExperimentWriter._record_new_keys",
        "method",
        "ResumableCSVLogger's writer (appending rows to metrics.csv)",
        lambda t: ExperimentWriter._record_new_keys,
    ),
    Probe("LightningCLI._set_seed", "overridden method", "dflash2 plan (PlanCLI)", lambda t: LightningCLI._set_seed),
    RICH_AVAILABLE,
    Probe(
        "RichProgressBar._get_train_description",
        "overridden method",
        "the progress bar (StepRichProgressBar's Epoch N/M)",
        lambda t: _defined_by(RichProgressBar, "_get_train_description"),
    ),
)


def check(trainer: Trainer | None = None) -> None:
    """Raise :class:`LightningInternalsChanged` naming the first private name of :data:`PROBES` the installed
    Lightning lacks. ``trainer``: where to look for the trainer's own attributes (a bare CPU one when None)."""
    if trainer is None:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    for probe in PROBES:
        probe.verify(trainer)


__all__ = [
    "PROBES",
    "WRITTEN_FOR",
    "LightningInternalsChanged",
    "Probe",
    "SignalConnector",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "batches_that_stepped",
    "check",
    "cluster_environment",
    "first_loop_iter",
    "logged_metrics",
    "replace_launcher",
    "replace_signal_connector",
    "rich_available",
    "set_first_loop_iter",
    "set_num_threads_if_needed",
    "should_accumulate",
    "should_update_logs",
    "skips_next_validation",
    "validation_follows",
]
