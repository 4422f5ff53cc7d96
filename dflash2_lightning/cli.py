"""Command line: ``dflash2 fit --config configs/tiny.yaml`` (or ``lightning fit``, ``python -m dflash2_lightning``).

``fit`` / ``validate`` are Lightning's ``LightningCLI`` in subclass mode: configs name classes with
``class_path`` / ``init_args``, ``--print_config`` prints a complete config that runs as it is, and
any key can be overridden on the command line (``--model.init_args.lr 3e-4``).

What this CLI adds to plain ``LightningCLI``:

- the target is given once, under the model, and linked to the data (``model.init_args.target``);
  the DataModule's ``block_size`` and ``target_layer_ids`` are taken from the instantiated model's
  draft config, so an offline feature cache is always built for the layers the draft reads;
- checkpoints are written atomically (:class:`~dflash2_lightning.callbacks.AtomicCheckpointIO`) and,
  unless a config decides ``save_last`` itself, the first ``ModelCheckpoint`` keeps ``last.ckpt``, so
  ``--ckpt_path last`` resumes from the newest *complete* checkpoint of the run directory;
- a fresh ``fit`` refuses a run directory that already holds checkpoints (resume it with
  ``--ckpt_path last``, or pick another logger ``version``) instead of silently mixing two runs.

Other subcommands (``quickstart``, ``eval``, ``regen`` ...) are routed by :data:`EXTRA_COMMANDS` before
LightningCLI parses anything: ``main(["eval", *rest])`` calls the registered function with ``rest``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dflash2_lightning.callbacks import AtomicCheckpointIO
from dflash2_lightning.checkpoint import CheckpointError
from dflash2_lightning.config import ConfigError
from dflash2_lightning.data import DataError, DraftDataModule
from dflash2_lightning.module import MISSING_TARGET, DFlash2Module
from dflash2_lightning.objective import ObjectiveError
from dflash2_lightning.target import TargetError

#: Errors that mean "the config or the data is wrong": reported as one ``error:`` line, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, TargetError, DataError, ObjectiveError, CheckpointError)

#: Subcommands handled outside LightningCLI: name -> ``"package.module:function"`` (imported lazily,
#: called with the remaining arguments, its return value is the exit status).
EXTRA_COMMANDS: dict[str, str] = {
    "quickstart": "dflash2_lightning.quickstart:quickstart_main",
    "eval": "dflash2_lightning.evaluate:eval_main",
    "regen": "dflash2_lightning.regen:regen_main",
    "check": "dflash2_lightning.serving:check_main",
    "serve-help": "dflash2_lightning.serving:serve_help_main",
}


def _draft_block_size(model: DFlash2Module) -> int:
    return model.draft_config.block_size


def _draft_layer_ids(model: DFlash2Module) -> list[int]:
    return list(model.draft_config.target_layer_ids or [])


class DFlash2CLI(LightningCLI):
    """``LightningCLI`` with the model -> data links, atomic checkpoints and the run-directory guard."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("model.init_args.target", "data.init_args.target")
        parser.link_arguments("model", "data.init_args.block_size", compute_fn=_draft_block_size,
                              apply_on="instantiate")
        parser.link_arguments("model", "data.init_args.target_layer_ids", compute_fn=_draft_layer_ids,
                              apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        target = getattr(getattr(config.get("model"), "init_args", None), "target", None)
        if target is None or all(getattr(target, key, None) is None for key in ("path", "gguf", "tiny")):
            self.parser.error(MISSING_TARGET)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as error:  # jsonargparse buries the cause inside a long "Union subtypes" message
            cause = user_error(error)
            if cause is None:
                raise
            self.parser.error(f"{type(cause).__name__}: {cause}")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # the default, non-atomic writer
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        if checkpoints and not any(cb.save_last for cb in checkpoints) and checkpoints[0].save_last is None:
            checkpoints[0].save_last = True  # exactly one writer of last.ckpt, so `--ckpt_path last` works
        return trainer

    def before_fit(self) -> None:
        if self.config[self.subcommand].get("ckpt_path") is not None:
            return
        for directory in checkpoint_dirs(self.trainer):
            found = sorted(p.name for p in Path(directory).glob("*.ckpt")) if Path(directory).is_dir() else []
            if found:
                self.parser.error(
                    f"run directory {Path(directory).parent} already holds checkpoints ({', '.join(found[:3])}"
                    f"{' ...' if len(found) > 3 else ''}): resume it with --ckpt_path last, or start a new run "
                    "under another logger `version` (or delete that directory)")


def user_error(error: BaseException) -> BaseException | None:
    """The first configuration / data error (ours: ``ConfigError`` and friends) in ``error``'s chain."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, USER_ERRORS):
            return current
        stack += [current.__cause__, current.__context__]
    return None


def checkpoint_dirs(trainer: Trainer) -> list[str]:
    """Where each ``ModelCheckpoint`` of ``trainer`` will write (Lightning's own resolution rule)."""
    dirs = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.dirpath is not None:
            dirs.append(str(callback.dirpath))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
            dirs.append(os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name), version,
                                     "checkpoints"))
        else:
            dirs.append(os.path.join(trainer.default_root_dir, "checkpoints"))
    return dirs


def build_cli(args: Sequence[str] | None = None, run: bool = True) -> DFlash2CLI:
    """The configured CLI (``run=False`` only parses and instantiates: ``cli.model``, ``cli.trainer``)."""
    return DFlash2CLI(
        model_class=DFlash2Module, subclass_mode_model=True,
        datamodule_class=DraftDataModule, subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},  # a resumed run rewrites config.yaml in its own directory
        auto_configure_optimizers=False,  # the module's AdamW + warmup/cosine is the optimizer
        args=None if args is None else list(args), run=run,
    )


def _resolve(spec: str) -> Callable[[list[str]], Any]:
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


def main(args: Sequence[str] | None = None) -> int | None:
    """Console entry point of ``dflash2`` and ``lightning``: LightningCLI, or an extra subcommand."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in EXTRA_COMMANDS:
        return _resolve(EXTRA_COMMANDS[argv[0]])(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(f"other subcommands: {', '.join(sorted(EXTRA_COMMANDS))} (each takes --help)\n")
    try:
        build_cli(args)  # None: LightningCLI reads sys.argv itself (no "args and sys.argv" warning)
    except USER_ERRORS as error:  # bad data or settings found while running: one line, exit status 2
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return None
