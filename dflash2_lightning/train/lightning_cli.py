"""``dflash2 fit`` / ``dflash2 validate``: Lightning's ``LightningCLI`` with what training a draft needs.

``fit`` / ``validate`` are ``LightningCLI`` in subclass mode (configs name classes with ``class_path`` /
``init_args``, ``--print_config`` prints a config that runs as it is, any key can be overridden on the command
line); other actions are routed by :mod:`dflash2_lightning.cli`. What this CLI adds, each checked where cheapest:

- the target is given once, under the model, and naming a target kind on the command line replaces the config's;
  the DataModule's ``block_size`` and ``target_layer_ids`` come from the model's draft config;
- before the target is loaded: settings checkable from the config alone, ``--ckpt_path`` (``best``, a missing
  file, another target or geometry: :mod:`~dflash2_lightning.train.resume_checks`) and the run's plan
  (:mod:`~dflash2_lightning.train.plan`; ``--plan.check false`` skips it);
- run directories: atomic checkpoints and ``last.ckpt`` (:mod:`~dflash2_lightning.train.run_files`), one fit per
  directory (:mod:`~dflash2_lightning.train.run_lock`), a fresh fit refusing old checkpoints, ``--ckpt_path last``
  starting fresh when there is none, stale temporaries removed at start and end;
- preemption and dead ranks (:mod:`~dflash2_lightning.train.preemption`, :mod:`~dflash2_lightning.train.launcher`);
- the end-of-fit export for configs that name none (the caller hands in a later stage's
  :data:`~dflash2_lightning.export.callback.FIT_END_CALLBACKS`); a status line at the end, a quieter progress bar.

What users see: docs/configuration.md ("``fit`` and ``validate``"), docs/training.md, docs/robustness.md.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from dflash2_lightning import files
from dflash2_lightning.data.datamodule import DraftDataModule
from dflash2_lightning.data.records import DataError
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.reporting import run_command
from dflash2_lightning.target.shard import check_shard_devices, check_shard_size
from dflash2_lightning.train.launcher import WatchedLauncher, install_launcher
from dflash2_lightning.train.module import MISSING_TARGET, DFlash2Module
from dflash2_lightning.train.plan import PlanOptions
from dflash2_lightning.train.preemption import STOP, install_preemption, resume_command
from dflash2_lightning.train.resume_checks import check_resume, peek_checkpoint, resolve_ckpt_path
from dflash2_lightning.train.run_files import AtomicCheckpointIO
from dflash2_lightning.train.run_lock import RunLock

TARGET_KEY = "model.init_args.target"
TARGET_KINDS = ("path", "gguf", "tiny")


def _draft_block_size(model: DFlash2Module) -> int:
    return model.draft_config.block_size


def _draft_layer_ids(model: DFlash2Module) -> list[int]:
    return list(model.draft_config.target_layer_ids or [])


def replace_target_overrides(args: Sequence[str]) -> list[str]:
    """Rewrite command-line target overrides so that naming a target kind replaces the config's target.

    ``--model.init_args.target.path X`` becomes ``--model.init_args.target '{"path": "X", "gguf": null,
    "tiny": null}'``, and a whole ``--model.init_args.target '{"gguf": ...}'`` gets the other kinds set
    to null; jsonargparse would otherwise merge them with the config's own ``tiny: {}`` / ``gguf: ...``.
    Other fields of the spec (``seed``, ``dtype``) keep their merged values.
    """
    import yaml

    out: list[str] = []
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        kind = key[len("--" + TARGET_KEY) + 1 :] if key.startswith(f"--{TARGET_KEY}.") else None
        if key == f"--{TARGET_KEY}" or kind in TARGET_KINDS:
            if not eq:
                if i + 1 >= len(args):
                    out.append(arg)
                    break
                value, i = args[i + 1], i + 1
            try:
                parsed = yaml.safe_load(value) if (kind == "tiny" or kind is None) else value
            except yaml.YAMLError:
                parsed = None
            spec = {kind: parsed} if kind is not None else parsed
            check_target_fields(spec, "on the command line")
            if isinstance(spec, dict) and any(spec.get(k) is not None for k in TARGET_KINDS):
                out += [f"--{TARGET_KEY}", json.dumps({**{k: None for k in TARGET_KINDS}, **spec})]
            elif kind is not None:  # `--...target.tiny null`: one whole-spec value (a nested null fails to parse)
                out += [f"--{TARGET_KEY}", json.dumps(spec)]
            else:
                out += [key, value]
        else:
            out.append(arg)
        i += 1
    return out


def check_target_fields(spec: Any, where: str) -> None:
    """Refuse a target spec (a mapping) with a key that is not a :class:`TargetSpec` field, naming the closest.

    jsonargparse silently drops an unknown key whose value is an empty mapping (``tny: {}``), which then
    reads as "target is missing", or, merged with a config's own target, trains on that one without a word.
    """
    import dataclasses
    import difflib

    from dflash2_lightning.target.spec import TargetSpec

    if not isinstance(spec, dict):
        return
    fields = [f.name for f in dataclasses.fields(TargetSpec)]
    for key in spec:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            raise ConfigError(
                f"{TARGET_KEY}.{key} is not a field of the target ({where})"
                + (f"; did you mean {close[0]}?" if close else "")
                + " A target is one of path (an HF directory), gguf (a .gguf file or 'smollm2') or "
                "tiny ({} for a tiny random target), with seed, dtype, cache_dir, cpu_linear"
            )


def read_config_file(path: str | os.PathLike, shown: str | None = None) -> dict[str, Any]:
    """The settings of a ``--config`` file, refused in one line naming the file (as ``shown``, the command line's
    spelling) when it is not a YAML mapping: a binary file, a YAML syntax error (with its line and column), an
    empty file, a list or a scalar. Read before jsonargparse, whose errors name ``<unicode string>`` or nothing."""
    import yaml

    shown = shown or str(path)
    example = "give the run's YAML config, e.g. configs/tiny.yaml"
    raw = Path(path).expanduser().read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {shown} is not a text file (byte {error.start} is not UTF-8): {example}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context = getattr(error, "context", None)
        raise ConfigError(
            f"config file {shown} is not valid YAML: {problem}{where}"
            + (f" ({context})" if context else "")
            + "; fix that line (settings are `key: value`, nested keys indented with spaces)"
        ) from None
    if data is None:
        raise ConfigError(f"config file {shown} is empty (no settings): {example}")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {shown} holds a YAML {type(data).__name__}, not a mapping of settings "
            f"(trainer:, model:, data:): {example}"
        )
    return data


def check_config_files(argv: Sequence[str]) -> None:
    """:func:`read_config_file` on every existing ``--config`` file of ``argv`` (a missing one is jsonargparse's
    to report, with the rest of the command line)."""
    for name in _config_files(argv):
        if Path(name).expanduser().is_file():
            read_config_file(name)


def check_config_file_target(path: str, shown: str | None = None) -> None:
    """:func:`check_target_fields` on the target a config file gives (``model.init_args.target``); the message
    names the file as ``shown`` (as the command line gave it)."""
    data = read_config_file(path, shown)
    model = data.get("model")
    init_args = model.get("init_args", model) if isinstance(model, dict) else None
    if isinstance(init_args, dict):
        check_target_fields(init_args.get("target"), f"in config {shown or path}")


def _config_value(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        if node is None:
            return None
    return node


def plan_options(config: Any) -> PlanOptions:
    """The parsed ``--plan.*`` options (:class:`~dflash2_lightning.train.plan.PlanOptions`)."""
    value = config.get("plan")
    if isinstance(value, PlanOptions):
        return value
    return PlanOptions(**(value.as_dict() if hasattr(value, "as_dict") else dict(value or {})))


def precheck(config: Any, data_files: bool = True) -> None:
    """Check what the parsed config alone can tell, before the target is loaded or a cache is built.

    ``data_files=False`` leaves out the data files' existence (``dflash2 plan`` runs where they are not).
    Raises :class:`DataError` / :class:`ConfigError` naming the setting.
    """
    for key in ("train_files", "val_files") if data_files else ():
        files = _config_value(config, f"data.init_args.{key}")
        for path in files or []:
            p = Path(str(path)).expanduser()
            if not p.is_file():
                what = "is a directory, not a jsonl file" if p.is_dir() else "does not exist"
                raise DataError(
                    f"data.init_args.{key}: {path} {what}; fix the path in the config or on the command line"
                )
            if not os.access(p, os.R_OK):
                raise DataError(f"data.init_args.{key}: {path} is not readable (permission denied)")
    if _config_value(config, "model.init_args.target.shard") == "fsdp":
        check_shard_devices(_config_value(config, "trainer.devices"))
        check_shard_size(
            _config_value(config, "model.init_args.target.shard_size"),
            _config_value(config, "trainer.devices"),
            _config_value(config, "trainer.num_nodes"),
        )
    token_loss = _config_value(config, "model.init_args.objective.token_loss")
    mode = _config_value(config, "data.init_args.mode")
    top_k = _config_value(config, "data.init_args.offline.teacher_top_k") or 0
    if token_loss == "kd" and mode == "offline" and not top_k:
        raise ConfigError(
            "model.init_args.objective.token_loss='kd' with data.init_args.mode='offline' needs the target's "
            "logits in the feature cache: set data.init_args.offline.teacher_top_k > 0 (e.g. 32), or use "
            "token_loss='ce' (checked before the cache is built)"
        )


class DFlash2CLI(LightningCLI):
    """``LightningCLI`` with the model -> data links, atomic checkpoints and the run-directory guard."""

    def __init__(
        self, *args: Any, resume: str | None = None, fit_end_callbacks: Sequence[type[Callback]] = (), **kwargs: Any
    ) -> None:
        # The command that resumes this fit (`... --ckpt_path last`), for the messages of an interrupted fit.
        self.resume = resume or "the same command with --ckpt_path last"
        # Callbacks every run gets when its config does not name them (the end-of-fit export: the caller, a later
        # stage, passes them; dflash2_lightning.export.callback.FIT_END_CALLBACKS).
        self.fit_end_callbacks = tuple(fit_end_callbacks)
        # Errors come back as exceptions (ArgumentError), explained in one line by the command's handler.
        kwargs["parser_kwargs"] = {"exit_on_error": False, **(kwargs.get("parser_kwargs") or {})}
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        check_config_files(sys.argv[1:] if args is None else list(args) if isinstance(args, (list, tuple)) else [])
        if args is None:  # reading sys.argv: rewrite it in place (a list here would warn "args and sys.argv")
            saved = sys.argv
            sys.argv = [saved[0], *replace_target_overrides(saved[1:])]
            try:
                super().parse_arguments(parser, None)
            finally:
                sys.argv = saved
        else:
            if isinstance(args, (list, tuple)):
                args = replace_target_overrides(args)
            super().parse_arguments(parser, args)
        self.check_ckpt_file()

    def check_ckpt_file(self) -> None:
        """A ``--ckpt_path`` file that cannot be read (truncated, not a checkpoint) is refused in one line, as
        ``--ckpt_path last`` naming the same file is, before Lightning reads its hyperparameters."""
        subcommand = self.config.get("subcommand")
        ckpt_path = (self.config.get(subcommand) or {}).get("ckpt_path") if subcommand else self.config.get("ckpt_path")
        if ckpt_path and Path(str(ckpt_path)).is_file():
            peek_checkpoint(ckpt_path)

    def add_arguments_to_parser(self, parser: Any) -> None:
        # `--plan.check false`, `--plan.device_memory 80GB`: fit's check of the plan, and `dflash2 plan`'s device
        parser.add_dataclass_arguments(PlanOptions, "plan")
        parser.link_arguments("model.init_args.target", "data.init_args.target")
        parser.link_arguments(
            "model", "data.init_args.block_size", compute_fn=_draft_block_size, apply_on="instantiate"
        )
        parser.link_arguments(
            "model", "data.init_args.target_layer_ids", compute_fn=_draft_layer_ids, apply_on="instantiate"
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        self.check_target_given(config)
        precheck(config)
        options = plan_options(config)
        if self.subcommand == "fit" and options.check:  # before the target is loaded or a cache is built
            from dflash2_lightning.train.plan import describe_plan_failure, make_plan

            plan = make_plan(config, options)
            if plan.clearly_too_big is not None:
                raise ConfigError(describe_plan_failure(plan))

    def check_target_given(self, config: Any) -> None:
        """Refuse a config without a target, or whose config files name a target field that does not exist."""
        for path in config.get("config") or []:  # keys jsonargparse drops without a word (`tny: {}`)
            check_config_file_target(str(getattr(path, "absolute", path)), str(getattr(path, "relative", path)))
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
            raise cause from None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_cfg = config.get("trainer") or {}
        given = trainer_cfg.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        defaults = [kind() for kind in self.fit_end_callbacks if not any(isinstance(c, kind) for c in given)]
        if trainer_cfg.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in given
        ):
            from dflash2_lightning.train.progress import step_progress_bar

            defaults.append(step_progress_bar())
        if defaults:
            self.trainer_defaults = {**self.trainer_defaults, "callbacks": defaults}
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (ValueError, MisconfigurationException) as error:  # Lightning refusing a combination of
            # trainer flags (e.g. FSDP on accelerator cpu): the user's settings, not a bug of this program
            if user_error(error) is not None:
                raise
            raise ConfigError(f"trainer settings refused by Lightning: {error}") from error
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # the default, non-atomic writer
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if self.subcommand == "fit":  # SIGTERM / SIGUSR1: every rank stops at a step boundary, with a checkpoint
            install_preemption(trainer)
            install_launcher(trainer, self.resume)  # a rank that dies: one line naming it
        checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        if checkpoints and not any(cb.save_last for cb in checkpoints) and checkpoints[0].save_last is None:
            checkpoints[0].save_last = True  # exactly one writer of last.ckpt, so `--ckpt_path last` works
        return trainer

    def before_fit(self) -> None:
        """Before anything is written: take the run directory's lock, check ``--ckpt_path`` and the checkpoint's
        target, refuse a fresh run over existing checkpoints, and clean up what killed runs left."""
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        resume = resolve_ckpt_path(ckpt_path, checkpoint_dirs(self.trainer))  # `best`, a missing file: refused
        if resume is not None:  # cheap (memory-mapped): the checkpoint must be of this target and draft
            check_resume(
                peek_checkpoint(resume), self.model.target_record(), self.model.draft_config.to_hf_dict(), resume
            )
        if self.trainer.is_global_zero:  # one fit at a time in a run directory (a killed one holds nothing)
            self._run_lock = RunLock(run_directory(self.trainer))
            self._run_lock.acquire()
        try:
            self._prepare_fit(ckpt_path, resume)
        except BaseException:
            self._release_run_lock()
            raise

    def fit(self, model: Any, **kwargs: Any) -> None:
        """``Trainer.fit``, holding the run directory's lock until it returns or fails; a collective that failed
        because a rank died becomes one line naming that rank, and no child rank outlives a failed fit."""
        launcher = self.trainer.strategy.launcher
        watched = launcher if isinstance(launcher, WatchedLauncher) else None
        try:
            self.trainer.fit(model, **kwargs)
        except BaseException as error:
            if watched is None:
                raise
            failure = watched.failure_of(error)
            watched.end()
            watched.stop_children()
            if failure is not None:
                raise failure from error
            raise
        finally:
            if watched is not None:
                watched.end()
            self._release_run_lock()

    def _release_run_lock(self) -> None:
        lock = getattr(self, "_run_lock", None)
        if lock is not None:
            lock.release()

    def _prepare_fit(self, ckpt_path: str | None, resume: Path | None) -> None:
        dirs = [Path(d) for d in checkpoint_dirs(self.trainer)]
        if self.trainer.is_global_zero:
            for directory in written_dirs(self.trainer, self.model):  # what killed writes left behind
                files.remove_stale(directory)  # (never a live process's file)
        if ckpt_path == "last":
            if resume is None:
                if self.trainer.is_global_zero:
                    print(
                        f"dflash2: no checkpoint to resume in {', '.join(map(str, dirs)) or 'the run directory'}: "
                        "--ckpt_path last starts a fresh run",
                        file=sys.stderr,
                        flush=True,
                    )
                self.config[self.subcommand]["ckpt_path"] = None
                self.config_init[self.subcommand]["ckpt_path"] = None
                self._forget_rows_of_unsaved_runs()
            return
        if ckpt_path is not None:
            return
        for directory in dirs:
            found = sorted(p.name for p in directory.glob("*.ckpt")) if directory.is_dir() else []
            if found:
                raise ConfigError(
                    f"run directory {directory.parent} already holds checkpoints ({', '.join(found[:3])}"
                    f"{' ...' if len(found) > 3 else ''}): resume it with --ckpt_path last, or start a new run "
                    "under another logger `version` (or delete that directory)"
                )
        self._forget_rows_of_unsaved_runs()

    def _forget_rows_of_unsaved_runs(self) -> None:
        # A fresh run in a directory without checkpoints: rows there come from a run killed before its
        # first checkpoint, and this run logs those steps again.
        for logger in self.trainer.loggers:
            if hasattr(logger, "drop_rows_from"):
                logger.drop_rows_from(0)

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        for directory in written_dirs(trainer, self.model):
            files.remove_stale(directory)
        print(fit_summary(trainer, self.model), flush=True)


def fit_summary(trainer: Trainer, model: Any) -> str:
    """One line at the end of ``fit``: the step, the last train loss and validation τ, and the outputs.

    Rank-0 code (``after_fit`` returns on the other ranks), so it must not call a collective.
    """
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    parts = [f"dflash2: fit finished at step {trainer.global_step}"]
    if "train/loss" in metrics:
        parts.append(f"train/loss {metrics['train/loss']:.4g}")
    if "val/tau" in metrics:
        paths = [
            f"{name} {metrics[f'val/{name}/tau']:.3f}"
            for name in ("selector", "backbone")
            if f"val/{name}/tau" in metrics
        ]
        parts.append(f"val/tau {metrics['val/tau']:.3f}" + (f" ({', '.join(paths)})" if paths else ""))
    else:
        parts.append("no validation ran (val/tau not measured)")
    export = getattr(getattr(model, "hparams", {}), "get", lambda *_: None)("export_dir")
    log_dir = run_directory(trainer)  # rank-0 code: not trainer.log_dir, a collective under DDP
    parts.append(f"run directory {log_dir}")
    parts.append(f"draft checkpoint {export or log_dir / 'hf'}")
    return "; ".join(parts)


def user_error(error: BaseException) -> BaseException | None:
    """The first user error (``ConfigError`` and friends, a bad path) in ``error``'s chain."""
    from dflash2_lightning.reporting import find_user_error

    return find_user_error(error)


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
            dirs.append(
                os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name), version, "checkpoints")
            )
        else:
            dirs.append(os.path.join(trainer.default_root_dir, "checkpoints"))
    return dirs


def run_directory(trainer: Trainer) -> Path:
    """The run directory a fit writes (the first logger's ``log_dir``, else its checkpoint directory's parent,
    else ``default_root_dir``): what :class:`~dflash2_lightning.train.run_lock.RunLock` locks.

    Rank-0 code: it reads the loggers' own ``log_dir``, not ``trainer.log_dir`` (a collective under DDP).
    """
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            return Path(log_dir)
    dirs = checkpoint_dirs(trainer)
    return Path(dirs[0]).parent if dirs else Path(trainer.default_root_dir)


def written_dirs(trainer: Trainer, model: Any) -> list[Path]:
    """Every directory a fit writes atomically into: the checkpoint directories, each logger's run directory
    (metrics.csv, the acceptance plot) and the draft's export directory (default ``<run dir>/hf``).

    Rank-0 code: it reads the loggers' own ``log_dir``, not ``trainer.log_dir`` (a collective under DDP).
    """
    dirs = [Path(d) for d in checkpoint_dirs(trainer)]
    run_dirs = [Path(d) for d in (getattr(logger, "log_dir", None) for logger in trainer.loggers) if d]
    dirs += run_dirs
    export_dir = getattr(getattr(model, "hparams", None), "export_dir", None)
    if export_dir:
        dirs.append(Path(export_dir))
    elif run_dirs:
        dirs.append(run_dirs[0] / "hf")
    return list(dict.fromkeys(dirs))


def build_cli(
    args: Sequence[str] | None = None,
    run: bool = True,
    resume: str | None = None,
    fit_end_callbacks: Sequence[type[Callback]] = (),
) -> DFlash2CLI:
    """The configured CLI (``run=False`` only parses and instantiates: ``cli.model``, ``cli.trainer``).

    ``resume``: the command that resumes the fit (:func:`~dflash2_lightning.train.preemption.resume_command`).
    ``fit_end_callbacks``: callback classes the trainer gets when the config names none of that class.
    """
    quiet_lightning()
    return DFlash2CLI(
        resume=resume,
        fit_end_callbacks=fit_end_callbacks,
        model_class=DFlash2Module,
        subclass_mode_model=True,
        datamodule_class=DraftDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},  # a resumed run rewrites config.yaml in its own directory
        auto_configure_optimizers=False,  # the module's AdamW + warmup/cosine is the optimizer
        args=None if args is None else list(args),
        run=run,
    )


class _DropMessages(logging.Filter):
    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(n in text for n in self.needles)


def quiet_lightning() -> None:
    """Silence what says nothing about this run: Lightning's litlogger tip, a torch-internal deprecation
    warning, the logging-interval warning (``log_every_n_steps`` counts steps across epochs here), and the
    notice that the module's ``transfer_batch_to_device`` wins over the DataModule's (it is meant to: it keeps
    the loss mask's CPU copy; the DataModule defines none)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages("litlogger"))
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", message=r"The number of training batches .* is smaller than the logging interval")
    warnings.filterwarnings("ignore", message=r"You have overridden `transfer_batch_to_device` in `LightningModule`")


def _config_files(argv: Sequence[str]) -> list[str]:
    files = []
    for i, a in enumerate(argv):
        if a in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif a.startswith("--config="):
            files.append(a.split("=", 1)[1])
    return files


def argument_errors(argv: Sequence[str], prog: str) -> Callable[[BaseException], str | None]:
    """A :func:`~dflash2_lightning.reporting.run_command` formatter of jsonargparse's errors (an unknown or
    misspelt setting, a missing value, a missing config file) as one line with the closest valid key
    (:func:`~dflash2_lightning.train.config_messages.explain`); ``prog`` names the command (``dflash2 fit``)."""
    from argparse import ArgumentError

    def explain(error: BaseException) -> str | None:
        if not isinstance(error, ArgumentError):
            return None
        from dflash2_lightning.train.config_messages import explain as explain_message

        return explain_message(str(error), _config_files(argv), prog=prog)

    return explain


def lightning_main(
    argv: list[str], from_sys_argv: bool, fit_end_callbacks: Sequence[type[Callback]] = ()
) -> int | None:
    """Run LightningCLI on ``argv`` under the project's error style; jsonargparse's errors become one line.

    ``from_sys_argv``: LightningCLI reads ``sys.argv`` itself (the console script), which avoids its
    "args and sys.argv" warning; tests pass ``argv`` explicitly. ``fit_end_callbacks``: see :func:`build_cli`.
    """
    subcommand = argv[0] if argv and not argv[0].startswith("-") else "fit"
    explain = argument_errors(argv, f"dflash2 {subcommand}")
    resume = resume_command(argv)

    def run(rest: list[str]) -> None:
        build_cli(None if from_sys_argv else rest, resume=resume, fit_end_callbacks=fit_end_callbacks)

    if subcommand != "fit":
        return run_command(run, argv, formatters=[explain])
    with STOP.watching(resume):  # SIGTERM / SIGUSR1 from here on: preemption.py
        return run_command(run, argv, formatters=[explain])
