"""`DraftFSDPStrategy`: Lightning's FSDP with what the draft needs, selected in YAML by its ``class_path``.

Lightning 2.6.6's own ``FSDPStrategy`` trains this draft wrongly or not at all: its precision plugin refuses norm
clipping (the recipes clip at 1.0), under ``bf16-mixed`` it gathers buffers in bf16 (the draft's RoPE
``inv_freq``, which serving never rounds) and it wraps the whole module as one unit.

This strategy wraps one FSDP unit per draft layer (:class:`~dflash2_lightning.model.backbone.DraftLayer`), the
rest of the draft (``fc``, norms, the selector) in the root unit; the frozen target is a plain attribute of the
module, so FSDP never sees it. FSDP's mixed precision keeps every dtype float32 (gathers, gradient reduction,
buffers) while Lightning's autocast computes in bf16 exactly as under DDP, so FSDP trains the numbers DDP trains.
Norm clipping goes through the root's :meth:`FullyShardedDataParallel.clip_grad_norm_` (the norm over all shards);
weight decay is decided by :meth:`DFlash2Module.parameter_groups` from shapes recorded before wrapping; the HF
export gathers full weights on rank 0 (``state_dict_type="full"``). Select it as a class config
(``--trainer.strategy '{"class_path": "dflash2_lightning.train.fsdp.DraftFSDPStrategy"}'``: Lightning takes a
plain string only for its own registered names). What users see: docs/training.md ("Several GPUs").
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
from torch.nn import Module

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.model.backbone import DraftLayer

# Precisions whose FSDP units keep float32 master weights; "*-true" halves would store the weights (and, by
# Lightning's module.to(dtype), inv_freq) in 16 bits before FSDP sees them.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def draft_mixed_precision() -> MixedPrecision:
    """FSDP's mixed precision for the draft: parameters, gradient reduction and buffers all in float32.

    The bf16 compute comes from Lightning's autocast (``bf16-mixed``), as under DDP; FSDP casting the
    parameters to bf16 instead would put the residual stream, the norms' gains and the conv kernels in bf16,
    and casting buffers would round RoPE's ``inv_freq``. Root inputs are not cast (offline teacher logits
    and features keep their dtype).
    """
    return MixedPrecision(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        buffer_dtype=torch.float32,
        cast_root_forward_inputs=False,
    )


def draft_wrap_policy() -> set[type[Module]]:
    """The auto-wrap policy (as Lightning takes it, a set of layer classes): one FSDP unit per draft layer."""
    return {DraftLayer}


class DraftFSDPPrecision(FSDPPrecision):
    """Lightning's FSDP precision plugin, with norm clipping over all shards (the root's ``clip_grad_norm_``) and
    the batch left in its own dtype."""

    def __init__(self, precision: Any, scaler: Any = None) -> None:
        super().__init__(precision)  # the scaler set after: Lightning 2.6.6 refuses one before it knows the precision
        if scaler is not None:
            self.scaler = scaler
        # Set by DraftFSDPStrategy once the model is wrapped: the FSDP root, unless the model came already wrapped.
        self.root: Module | None = None

    def convert_input(self, data: Any) -> Any:
        """The batch as the data module made it. Lightning's plugin casts every floating tensor of the batch to
        float32 under ``bf16-mixed``, on the host, before the transfer: offline bf16 features and teacher logits
        would cross to the GPU at twice their bytes, to be cast back to bf16 by autocast. DDP does not cast."""
        return data

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Scale every gradient so that their global 2-norm (all ranks' shards together) is at most ``clip_val``."""
        if self.root is None:
            raise RuntimeError("norm clipping before the model was wrapped: DraftFSDPStrategy sets the FSDP root")
        if not isinstance(self.root, FullyShardedDataParallel):
            raise RuntimeError(
                f"norm clipping needs the FSDP root unit, but the model came to DraftFSDPStrategy already wrapped "
                f"({type(self.root).__name__})"
            )
        self.root.clip_grad_norm_(clip_val)


class DraftFSDPStrategy(FSDPStrategy):
    """FSDP for a DFlash2 draft: a unit per draft layer, float32 buffers and master weights, norm clipping.

    Takes Lightning's ``FSDPStrategy`` arguments (``sharding_strategy``, ``state_dict_type``,
    ``activation_checkpointing_policy``, ``cpu_offload`` ...) except ``mixed_precision`` and
    ``auto_wrap_policy``, which it sets (see the module docstring). Precision: ``32-true``, ``bf16-mixed`` or
    ``16-mixed`` (the Trainer's ``precision``).
    """

    def __init__(self, **kwargs: Any) -> None:
        for fixed in ("mixed_precision", "auto_wrap_policy"):
            if kwargs.get(fixed) is not None:
                raise ConfigError(
                    f"trainer.strategy.init_args.{fixed} is set by DraftFSDPStrategy (one unit per "
                    "draft layer, float32 buffers and master weights): remove it"
                )
        kwargs.update(mixed_precision=draft_mixed_precision(), auto_wrap_policy=draft_wrap_policy())
        super().__init__(**kwargs)

    # accelerator and precision_plugin keep Lightning's private backing attributes (probed by lightning_internals).
    @property
    def accelerator(self) -> Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        # Lightning refuses its own FSDPStrategy on a CPU, but not a subclass. On CPU processes (gloo, the device
        # given as such) training steps run, then the first checkpoint's full-state-dict gathering with
        # offload_to_cpu, as Lightning asks for it, crashes the process (segmentation fault, torch 2.13).
        # Refused here, when the Trainer is built, in one line.
        if isinstance(accelerator, CPUAccelerator):
            raise ConfigError(
                "trainer.strategy DraftFSDPStrategy (FSDP) requires a GPU accelerator, but received "
                "accelerator='cpu': use --trainer.accelerator gpu, or the DDPStrategy on a CPU"
            )
        self._accelerator = accelerator

    @property
    def precision_plugin(self) -> DraftFSDPPrecision:
        if self._precision_plugin is None:  # kept, not rebuilt per call: the plugin holds the FSDP root
            self._precision_plugin = DraftFSDPPrecision("32-true")
        plugin = self._precision_plugin
        if not isinstance(plugin, DraftFSDPPrecision):  # the setter makes every plugin one
            raise TypeError(f"DraftFSDPStrategy's precision plugin is {plugin}, not a DraftFSDPPrecision")
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, FSDPPrecision):
            raise TypeError(f"DraftFSDPStrategy works with an FSDPPrecision plugin, found {plugin}")
        if plugin is not None and not isinstance(plugin, DraftFSDPPrecision):
            if plugin.precision not in SUPPORTED_PRECISIONS:
                raise ConfigError(
                    f"trainer.precision={plugin.precision!r} is invalid with DraftFSDPStrategy: "
                    f"must be one of {', '.join(SUPPORTED_PRECISIONS)} (float32 master weights)"
                )
            plugin = DraftFSDPPrecision(plugin.precision, plugin.scaler)
        self._precision_plugin = plugin

    def _setup_model(self, model: Module) -> Module:  # a private hook: lightning_internals.check probes it
        if getattr(model, "feature_scale", None) is not None:
            # The first step divides fc.weight's columns in place; under FSDP that weight is a 1-D shard.
            raise ConfigError(
                "model.init_args.experimental.normalize_features is not supported with "
                "DraftFSDPStrategy (it rescales fc.weight in place, which is sharded under FSDP), "
                "use DDP or leave normalize_features off"
            )
        wrapped = super()._setup_model(model)
        self.precision_plugin.root = wrapped  # the root unit: its clip_grad_norm_ sees every shard
        return wrapped
