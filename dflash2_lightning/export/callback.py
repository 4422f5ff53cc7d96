"""The end of a fit as a Lightning callback: the trained draft written where the engines load it.

:class:`ExportOnFitEnd`, at the end of ``fit`` of a :class:`~dflash2_lightning.train.module.DFlash2Module`
(rank 0), writes the draft as an HF checkpoint (``config.json`` + ``model.safetensors``, served as-is by vLLM /
SGLang) in the target's dtype, ``SERVING.md`` beside it (the engines' exact command lines and what the engine
checks found) and the acceptance record (``acceptance.json``: the τ the exported draft earns at T=0, what
``dflash2 check-serving`` compares an engine with).

Its settings are the module's ``export`` group (``--model.init_args.export.dir``, ``.dtype``,
``.acceptance_prompts``, ``.acceptance_tokens``: :class:`~dflash2_lightning.train.options.ExportOptions`), so a
command line or config sets them as before. Every shipped config names it under ``trainer.callbacks``; a fit whose
config does not (an older one) gets it all the same: ``dflash2 fit`` and the quickstart add the
:data:`FIT_END_CALLBACKS` a config leaves out.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from dflash2_lightning.engines.acceptance_record import remove_stale_record, summary_line, write_record
from dflash2_lightning.engines.rules import TargetInfo, choose_export_dtype
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.export.serving import write_serving
from dflash2_lightning.model.checkpoint import load_config, save_draft
from dflash2_lightning.train.module import ACCEPTANCE_TOKENS_OPTION, DFlash2Module


class ExportOnFitEnd(pl.Callback):
    """At the end of ``fit``: the HF checkpoint, ``SERVING.md`` and the acceptance record of the trained draft,
    into the module's ``export.dir`` (default ``<run dir>/hf``). See the module docstring."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(pl_module, DFlash2Module):
            raise ConfigError(
                f"trainer.callbacks: ExportOnFitEnd exports the draft of a DFlash2Module, and the model is a "
                f"{type(pl_module).__name__}: remove the callback from the config"
            )
        # A resume from the last step's checkpoint trains nothing (no on_train_start): its validation runs first.
        pl_module.run_due_validation()
        state = trainer.strategy.lightning_module_state_dict()  # full weights also under FSDP
        log_dir = trainer.log_dir  # a collective under DDP: every rank asks
        if not trainer.is_global_zero:
            return
        export = pl_module.options.export
        directory = Path(export.dir or Path(log_dir or trainer.default_root_dir) / "hf")
        draft = pl_module.draft_from_state(state)
        target = TargetInfo.from_target(pl_module.target)
        dtype, why = choose_export_dtype(export.dtype, target)
        save_draft(draft, directory, dtype=dtype)
        serving, findings = write_serving(directory, load_config(directory), target, why)
        rank_zero_info(f"draft checkpoint written to {directory} in {dtype}: {why}")
        for finding in findings:
            if finding.level != "note":  # notes are in SERVING.md; warnings must be seen now
                rank_zero_warn(str(finding))
        removed = remove_stale_record(directory)  # a previous run's record never stays beside new weights
        if export.acceptance_prompts > 0 and pl_module.target.sharded:
            # The record runs the target on this process alone; a sharded one runs only with every process.
            rank_zero_warn(
                f"warning: [export] no acceptance record beside {directory}: the target is sharded across the "
                "job's processes (target.shard='fsdp'); write it with "
                f"`dflash2 acceptance-record --draft {directory} --target TARGET` where the target fits"
            )
        elif export.acceptance_prompts > 0:
            write_acceptance_record(pl_module, directory)
        elif removed is not None:
            rank_zero_info(
                f"removed {removed}: it described the previous weights (export.acceptance_prompts 0 writes "
                "none; `dflash2 acceptance-record` writes one)"
            )
        rank_zero_info(f"how to serve it: {serving}")


def write_acceptance_record(pl_module: DFlash2Module, directory: Path) -> None:
    """``directory/acceptance.json``: the tau the exported draft earns at T=0 on held-out prompts, with the
    target the module already loaded (what ``dflash2 check-serving`` compares an engine with). The export is
    complete before it: a record that cannot be made is a warning, never a lost checkpoint."""
    from dflash2_lightning.evaluate.record import make_record
    from dflash2_lightning.reporting import describe

    export = pl_module.options.export
    try:
        record = make_record(
            directory,
            pl_module.target,
            num_prompts=export.acceptance_prompts,
            max_new_tokens=export.acceptance_tokens,
            budget=ACCEPTANCE_TOKENS_OPTION,
        )
        path = write_record(record, directory)
    except Exception as error:
        rank_zero_warn(
            f"warning: [export] no acceptance record beside {directory} "
            f"({describe(error).splitlines()[0]}); write it with "
            f"`dflash2 acceptance-record --draft {directory} --target TARGET`"
        )
        return
    rank_zero_info(summary_line(record, path))


#: the callbacks every fit gets when its config does not name them (``dflash2 fit`` and the quickstart pass them
#: to :class:`~dflash2_lightning.train.lightning_cli.DFlash2CLI`)
FIT_END_CALLBACKS: tuple[type[pl.Callback], ...] = (ExportOnFitEnd,)
