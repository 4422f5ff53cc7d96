"""``dflash2 plan --config CFG [the overrides of fit]``: what a fit needs per device and on disk, before it runs.

The config is parsed exactly as ``dflash2 fit`` parses it (the same LightningCLI class, links and checks), but
nothing is instantiated: no target weights, no feature cache, no trainer. The estimate is
:func:`dflash2_lightning.train.plan.make_plan`.
"""

from __future__ import annotations

import sys
from argparse import ArgumentError
from typing import TYPE_CHECKING, Any

from dflash2_lightning.errors import UsageError
from dflash2_lightning.train.lightning_cli import DFlash2CLI, argument_errors, plan_options, precheck, quiet_lightning
from dflash2_lightning.train.preemption import without_ckpt_path

if TYPE_CHECKING:
    from dflash2_lightning.train.plan import Plan

DESCRIPTION = """\
The plan of `dflash2 fit` with the same arguments: per device, the draft's weights, gradients and AdamW state
(divided across devices under FSDP, replicated under DDP), the frozen target's weights (online), activation and
logits memory per step at the configured anchors, block size, sequence length and batch size; the offline
feature cache's size on disk; and a verdict against the device's memory (free CUDA memory of this rank's GPU, or
the host's available RAM on a CPU; --plan.device_memory 80GB to check against another) and the cache
directory's free space, with what to change when it does not fit. Nothing is loaded: the target is read from
its config.json alone and the draft is built on the meta device.

Exit status: 0 when the run fits, 1 when it does not, 2 for bad input (one `dflash2: error: ...` line).
`dflash2 fit` checks the same plan before it loads the target and refuses a run that clearly cannot fit
(--plan.check false trains anyway)."""


PROG = "dflash2 plan"


class PlanCLI(DFlash2CLI):
    """``fit``'s parser and checks, then the plan instead of instantiating anything."""

    plan: Any = None

    def before_instantiate_classes(self) -> None:
        from dflash2_lightning.train.plan import make_plan

        config = self.config
        self.check_target_given(config)
        precheck(config, data_files=False)  # the plan runs where the data may not be (a login node)
        self.plan = make_plan(config, plan_options(config))

    def instantiate_classes(self) -> None:
        """Nothing: the plan is made from the config alone."""

    def _set_seed(self) -> None:  # a private LightningCLI hook (probed by lightning_internals)
        """Nothing to seed (and no "Seed set" line in the plan's output)."""


def plan_of(argv: list[str]) -> Plan:
    """The :class:`~dflash2_lightning.train.plan.Plan` of ``dflash2 fit ARGV`` (``fit``'s arguments, parsed as
    ``fit`` parses them); bad input raises :class:`~dflash2_lightning.errors.ConfigError` or exits 2 as ``fit``."""
    from dflash2_lightning.data.datamodule import DraftDataModule
    from dflash2_lightning.train.module import DFlash2Module

    quiet_lightning()
    saved = sys.argv  # LightningCLI reads sys.argv (given args beside a different sys.argv, it warns)
    # `fit`'s --ckpt_path changes nothing in the plan: accepted so that the fit command line can be reused.
    sys.argv = [saved[0], *without_ckpt_path(argv)]
    try:
        cli = PlanCLI(
            model_class=DFlash2Module,
            subclass_mode_model=True,
            datamodule_class=DraftDataModule,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            run=False,
            parser_kwargs={"description": DESCRIPTION, "prog": PROG},
        )
    except ArgumentError as error:  # fit's one-line wording of jsonargparse's errors, with the closest key
        raise UsageError(argument_errors(argv, PROG)(error) or str(error)) from error
    finally:
        sys.argv = saved
    return cli.plan


def plan_main(argv: list[str]) -> int:
    """Entry of ``dflash2 plan``: print the plan; 0 when it fits, 1 when it does not."""
    plan = plan_of(argv)
    print(plan.render(), flush=True)
    return 0 if plan.fits else 1
