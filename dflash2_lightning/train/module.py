"""`DFlash2Module`: the LightningModule that trains a DFlash / DFlash2 draft against a frozen target.

One training step::

    batch (input_ids, loss_mask, attention_mask [, features, target_next, teacher_topk_*])
      online : frozen target (no grad) -> features [B,S,n_t*H], logits [B,S,V]
      offline: features / target_next / teacher top-k straight from the batch (precomputed cache)
    DraftObjective: anchors -> blocks -> one draft forward -> token loss (+ selector loss)
    AdamW, linear warmup then cosine to ``min_lr_ratio * lr``, stepped every optimizer step

The draft's geometry comes from the target (``Target.draft_config``); the init arguments only override. The
target is *not* a registered child module: it never appears in ``state_dict``, never gets gradients and is never
wrapped by DDP/FSDP; it is loaded through the memoised :func:`~dflash2_lightning.target.load.load_target` (the
DataModule shares it). Anchors are drawn from a generator seeded by ``(anchor_seed, global_step, batch_idx,
rank)`` (no RNG state to save; a resume draws the same anchors), validation anchors by each sample's content.
Checkpoints record the target and a due validation (:mod:`~dflash2_lightning.train.resume_checks`,
:mod:`~dflash2_lightning.train.due_validation`); at the end of ``fit``
:class:`~dflash2_lightning.export.callback.ExportOnFitEnd` writes the HF checkpoint, ``SERVING.md`` and the
acceptance record (the ``export`` group holds its settings).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor

from dflash2_lightning.action_options import as_options
from dflash2_lightning.config import DraftConfig
from dflash2_lightning.data.prompts import record_prompts
from dflash2_lightning.errors import ConfigError, UserError
from dflash2_lightning.model import DraftModel
from dflash2_lightning.target.load import load_geometry, load_target
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.target.target import Target
from dflash2_lightning.train.due_validation import DUE_KEY, run_due_validation, validation_due
from dflash2_lightning.train.lightning_internals import attached_trainer
from dflash2_lightning.train.metrics import DraftMetrics, plot_acceptance
from dflash2_lightning.train.objective import DraftObjective, ObjectiveOutput, Teacher, sample_anchors
from dflash2_lightning.train.options import (
    DraftOptions,
    ExperimentalOptions,
    ExportOptions,
    ObjectiveOptions,
    OptimizerOptions,
    ValidationOptions,
    draft_settings_named,
)
from dflash2_lightning.train.resume_checks import TARGET_KEY, check_resume
from dflash2_lightning.train.run_files import log_step_metrics_now

REQUIRED_KEYS = ("input_ids", "loss_mask")
# The batch's loss mask as it left the data loader, on the CPU (see DFlash2Module.transfer_batch_to_device).
LOSS_MASK_CPU = "loss_mask_cpu"
PLOT_NAME = "acceptance.png"
MISSING_TARGET = (
    "model.init_args.target is missing: name the frozen target, e.g. "
    "--model.init_args.target.path /models/Qwen3-8B (a local HF model directory), "
    "--model.init_args.target.gguf smollm2 (a GGUF file), or target: {tiny: {}} (a tiny random "
    "target for tests)"
)


class Options(NamedTuple):
    """The module's option groups, resolved (see :mod:`dflash2_lightning.train.options`)."""

    draft: DraftOptions
    objective: ObjectiveOptions
    optimizer: OptimizerOptions
    validation: ValidationOptions
    export: ExportOptions
    experimental: ExperimentalOptions


#: the option that sets the end-of-fit acceptance record's tokens per prompt, as messages name it
ACCEPTANCE_TOKENS_OPTION = "--model.init_args.export.acceptance_tokens"


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss became NaN or infinite; the message names the global step and the batch index."""


class DFlash2Module(pl.LightningModule):
    """Train a DFlash2 (or DFlash baseline) draft for a frozen target.

    Args:
        target: which frozen target to load (local HF dir, GGUF, or tiny random). Required.
        draft: the draft's geometry (:class:`~dflash2_lightning.train.options.DraftOptions`).
        objective: the losses and anchors (:class:`~dflash2_lightning.train.options.ObjectiveOptions`).
        optimizer: AdamW and its schedule (:class:`~dflash2_lightning.train.options.OptimizerOptions`).
        validation: the sampling validation also measures (:class:`~dflash2_lightning.train.options.ValidationOptions`).
        export: where and in which dtype the served checkpoint is written
            (:class:`~dflash2_lightning.train.options.ExportOptions`).
        experimental: knobs kept for ablations (:class:`~dflash2_lightning.train.options.ExperimentalOptions`).

    Each group also accepts a mapping of its fields (``draft={"block_size": 8}``).
    """

    # Buffers registered only under experimental.normalize_features (hasattr tells), declared for the type checker.
    feature_scale: Tensor
    feature_scale_ready: Tensor

    def __init__(
        self,
        target: TargetSpec,
        draft: DraftOptions = DraftOptions(),
        objective: ObjectiveOptions = ObjectiveOptions(),
        optimizer: OptimizerOptions = OptimizerOptions(),
        validation: ValidationOptions = ValidationOptions(),
        export: ExportOptions = ExportOptions(),
        experimental: ExperimentalOptions = ExperimentalOptions(),
    ) -> None:
        super().__init__()
        if target is None:
            raise ConfigError(MISSING_TARGET)
        self.target_spec = target if isinstance(target, TargetSpec) else TargetSpec(**target)
        draft, objective = as_options(draft, DraftOptions), as_options(objective, ObjectiveOptions)
        optimizer, validation = as_options(optimizer, OptimizerOptions), as_options(validation, ValidationOptions)
        export, experimental = as_options(export, ExportOptions), as_options(experimental, ExperimentalOptions)
        # each group checked its own ranges when it was made (options.py)

        overrides = {k: v for k, v in dataclasses.asdict(draft).items() if v is not None}
        # The geometry only: a sharded target's weights are loaded by the job's processes together, later.
        geometry = load_geometry(self.target_spec)
        with draft_settings_named(draft):
            self.draft_config: DraftConfig = geometry.draft_config(**overrides)
        geometry.check_layer_ids(self.draft_config.target_layer_ids or [])
        # The end-of-fit acceptance record's prompts must fit the target's context: refused now, not after the
        # training (without a chat template no record can be made: the export warns then, as it always did).
        if export.acceptance_prompts > 0 and getattr(geometry.tokenizer, "chat_template", None):
            record_prompts(
                geometry, None, export.acceptance_prompts, export.acceptance_tokens, budget=ACCEPTANCE_TOKENS_OPTION
            )
        # The checkpoint's hparams hold plain values (a checkpoint loads without this package's classes): the
        # target as a dict and the *resolved* feature layers.
        self.save_hyperparameters(
            ignore=["target", "draft", "objective", "optimizer", "validation", "export", "experimental"]
        )
        self.hparams["target"] = dataclasses.asdict(self.target_spec)
        for name, options in (
            ("draft", draft),
            ("objective", objective),
            ("optimizer", optimizer),
            ("validation", validation),
            ("export", export),
            ("experimental", experimental),
        ):
            self.hparams[name] = dataclasses.asdict(options)
        self.hparams["draft"]["target_layer_ids"] = list(self.draft_config.target_layer_ids or [])
        self.options = Options(draft, objective, optimizer, validation, export, experimental)
        self.draft = DraftModel(self.draft_config)
        # Each parameter's dimensions before any wrapping (FSDP flattens them): what the weight-decay rule reads.
        self._param_dims = {name: p.dim() for name, p in self.draft.named_parameters()}
        if experimental.selector_init == "target_embedding" and self.draft.candidate_selector is None:
            raise ConfigError(
                "experimental.selector_init='target_embedding' needs draft.projector_type='dflash2' "
                "(the DFlash baseline has no candidate selector)"
            )
        # A resumed run then loads its own weights over these. A sharded target's weights exist only once the job's
        # processes have loaded it together: its warm start runs in setup(), before DDP copies rank 0's draft.
        self._warm_started = False
        if self.target_spec.shard == "none":
            self.warm_start()
        if experimental.normalize_features:  # buffers, so a resumed run keeps the scale it trained with
            width = self.draft_config.num_target_features * self.draft_config.hidden_size
            self.register_buffer("feature_scale", torch.ones(width))
            self.register_buffer("feature_scale_ready", torch.zeros((), dtype=torch.bool))
        self.objective = DraftObjective(
            token_loss=objective.token_loss,
            position_weighting=objective.position_weighting,
            decay_gamma=objective.decay_gamma,
            dpace_alpha=objective.dpace_alpha,
            selector_loss_alpha=objective.selector_loss_alpha,
            gold_outside_topk=objective.gold_outside_topk,
            num_anchors=objective.num_anchors,
            labels=objective.labels,
        )
        self.val_metrics = DraftMetrics(
            self.draft_config.block_size,
            selector=self.draft_config.is_dflash2,
            prefix="val",
            sampling=validation.sampling(),
        )
        self._due_validation: dict[str, int] | None = None  # a resumed checkpoint's validation still to run

    def warm_start(self) -> None:
        """The draft's warm start from the target's weights, as ``experimental`` asks (init_from_target,
        selector_init='target_embedding'); once. Deterministic: the same draft whether the target is whole or
        sharded (a sharded one's weights are gathered whole, and the selector's eigendecomposition runs on the CPU
        as it does for a target loaded there). With a sharded target, a collective."""
        if self._warm_started:
            return
        self._warm_started = True
        experimental = self.options.experimental
        if experimental.init_from_target:
            from dflash2_lightning.train.warm_start import init_from_target as warm_start

            layers = warm_start(self.draft, self.target.hf)
            rank_zero_info(f"draft layers initialised from target layers {layers}")
        if experimental.selector_init == "target_embedding":
            from dflash2_lightning.train.warm_start import init_selector_from_embedding

            assert self.draft.candidate_selector is not None  # checked when the module was made
            share = init_selector_from_embedding(
                self.draft.candidate_selector,
                self.target.embedding_weight().cpu(),
                self.draft_config.initializer_range,
            )
            rank_zero_info(
                f"selector codebooks initialised from the target embedding's top "
                f"{self.draft_config.selector_rank} principal directions ({share:.0%} of its variance)"
            )

    def setup(self, stage: str) -> None:
        """A sharded target's warm start (:meth:`warm_start`): Lightning calls this on every process after the
        DataModule's setup has loaded the target and before the strategy wraps the draft and restores a checkpoint."""
        if self.target_spec.shard != "none":
            self.warm_start()

    # ------------------------------------------------------------------ the frozen target
    @property
    def target(self) -> Target:
        """The shared frozen target (held outside the module tree: never saved, never trained)."""
        tgt = self.__dict__.get("_target")
        if tgt is None:
            tgt = load_target(self.target_spec)
            object.__setattr__(self, "_target", tgt)  # plain attribute, not a registered child
        return tgt

    def target_record(self) -> dict[str, Any]:
        """The target as the checks before a fit's launch see it (:meth:`Target.describe`): a sharded target's
        weights load only in the running job, so before it only its geometry is compared; the fingerprint is
        checked again in :meth:`on_load_checkpoint`, on every rank."""
        if self.target_spec.shard == "none":
            return self.target.describe()
        return load_geometry(self.target_spec).describe(fingerprint=False)

    def __getstate__(self) -> dict[str, Any]:
        # Spawned DDP workers rebuild the target from its spec instead of pickling it.
        state = dict(super().__getstate__())
        state.pop("_target", None)
        state.pop("_head_cast", None)
        return state

    def _target_ready(self, whole: bool) -> Target:
        """The target on this module's device: all of it (online) or just its embedding and head (offline). A
        sharded target was loaded on the process's device (transformers binds each process to its local one)."""
        tgt = self.target
        if tgt.sharded:
            return tgt
        device = self.device
        parts = [tgt.hf] if whole else [tgt.input_embeddings(), tgt.output_embeddings()]  # not sharded: the hf ones
        for part in parts:
            if next(part.parameters()).device != device:
                # Never under inference mode (a validation hook): inference-tensor weights could not be
                # used by the training step's autograd afterwards.
                with torch.inference_mode(False):
                    part.to(device)
        return tgt

    def _embed_head(self, tgt: Target) -> tuple[Any, Any]:
        dtype = self.draft.fc.weight.dtype

        def embed(ids: Tensor) -> Tensor:
            return tgt.embed(ids).to(dtype)

        def head(hidden: Tensor) -> Tensor:
            device = hidden.device.type
            if not torch.is_autocast_enabled(device):
                return tgt.head(hidden.to(tgt.dtype))
            weight = self._autocast_head_weight(tgt, torch.get_autocast_dtype(device))
            bias = tgt.head_bias()
            cast_bias = None if bias is None else bias.to(weight.dtype)
            return F.linear(hidden.contiguous().to(weight.dtype), weight, cast_bias)

        return embed, head

    def _autocast_head_weight(self, tgt: Target, dtype: torch.dtype) -> Tensor:
        """The frozen head's weight in the autocast dtype, cast once rather than at every step.

        What autocast would compute (it caches casts only of weights that require grad, so it re-casts the
        frozen 49152 x 576 head at every forward: ~6% of a CPU step); re-cast when the weight moves or changes.
        """
        weight = tgt.head_weight()
        if weight.dtype == dtype:
            return weight
        key = (weight.data_ptr(), weight.device, weight._version, dtype)
        cached = getattr(self, "_head_cast", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                self._head_cast = (key, weight.detach().to(dtype))
        return self._head_cast[1]

    def on_fit_start(self) -> None:
        # Outside inference mode, before any validation. Offline, only the embedding and head are needed
        # on the device: the rest of the target stays where it was loaded.
        data = getattr(self.trainer, "datamodule", None)
        offline = getattr(data, "mode", "online") == "offline"
        if offline and self.objective.token_loss == "kd" and not getattr(data, "teacher_top_k", 1):
            raise ConfigError(
                "token_loss='kd' with offline data needs the target's logits in the cache: set "
                "data.init_args.offline.teacher_top_k > 0 (e.g. 32), or use token_loss='ce'"
            )
        self.target.fingerprint()  # where it was loaded (the CPU), before it moves: checkpoints record it
        self._target_ready(whole=not offline)

    def on_train_start(self) -> None:
        # A resumed checkpoint taken just before a validation: run that validation now (nothing is lost).
        self.run_due_validation()

    def run_due_validation(self) -> None:
        """Run the validation a resumed checkpoint still had due (once; nothing when none is due)."""
        due, self._due_validation = self._due_validation, None
        if due is not None:
            run_due_validation(self.trainer, due)

    # ------------------------------------------------------------------ one forward
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's transfer, keeping the CPU loss mask beside the moved one (``LOSS_MASK_CPU``): anchors
        are drawn from it on the CPU without waiting for the device."""
        moved = super().transfer_batch_to_device(batch, device, dataloader_idx)
        mask = batch.get("loss_mask") if isinstance(batch, dict) else None
        if isinstance(moved, dict) and isinstance(mask, Tensor) and mask.device.type == "cpu" and device.type != "cpu":
            moved = {**moved, LOSS_MASK_CPU: mask}
        return moved

    def _check_batch(self, batch: dict[str, Tensor]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in batch]
        if missing:
            raise KeyError(
                f"batch is missing {missing}: a batch needs input_ids [B,S] and loss_mask [B,S] "
                f"(got keys {sorted(batch)})"
            )
        b, s = batch["input_ids"].shape
        self.draft_config.check_sequence_length(s, "seq_len (batch input_ids.shape[1])")
        if "features" in batch:
            width = self.draft_config.num_target_features * self.draft_config.hidden_size
            if tuple(batch["features"].shape) != (b, s, width):
                raise ValueError(
                    f"batch features have shape {tuple(batch['features'].shape)}: expected "
                    f"[{b}, {s}, {width}] = [batch, seq_len, len(target_layer_ids) * hidden_size]; "
                    "was the offline cache built for other target_layer_ids?"
                )

    def forward_batch(self, batch: dict[str, Tensor], generator: Any, walk: bool = False) -> ObjectiveOutput:
        """Features (from the batch, or the target online), then the objective on one draft forward."""
        self._check_batch(batch)
        attention_mask = batch.get("attention_mask")
        offline = "features" in batch
        # Anchors drawn on the CPU from the batch's CPU loss mask (kept by transfer_batch_to_device): no
        # device-to-host copy, so no host sync; the same anchors the objective would draw itself.
        mask_cpu = batch.get(LOSS_MASK_CPU, batch["loss_mask"]).cpu()
        anchors_cpu = sample_anchors(mask_cpu, self.draft_config.block_size, self.objective.num_anchors, generator)
        anchor_positions, anchor_keep = anchors_cpu
        anchors = (anchor_positions.to(self.device, non_blocking=True), anchor_keep.to(self.device, non_blocking=True))
        tgt = self._target_ready(whole=not offline)
        if offline:
            features = batch["features"]
            teacher = Teacher(
                topk_values=batch.get("teacher_topk_values"),
                topk_indices=batch.get("teacher_topk_indices"),
                greedy=batch.get("target_next"),
            )
        else:
            # The full logits only where they are read (distillation, validation's sampled acceptance); else
            # the greedy token only at the positions the blocks read, the head never over all S positions.
            keep = self.objective.token_loss == "kd" or (walk and self.val_metrics.sampled is not None)
            full = keep or not tgt.greedy_from_hidden
            layer_ids = self.draft_config.target_layer_ids
            if layer_ids is None:
                raise RuntimeError("the draft's target_layer_ids are unset (DraftConfig resolves them when made)")
            with torch.no_grad():
                out = tgt.features(batch["input_ids"], attention_mask, layer_ids, logits=full, last_hidden=not full)
            features = out.features
            if full:
                if out.logits is None:
                    raise RuntimeError("the target returned no logits, though asked for them")
                teacher = Teacher(logits=out.logits if keep else None, greedy=out.logits.max(-1).indices)
            else:
                if out.last_hidden is None:
                    raise RuntimeError("the target returned no last hidden state, though asked for it")
                rows = source_rows(*anchors_cpu, batch["input_ids"].shape[1], self.draft_config.block_size)
                teacher = Teacher(greedy=tgt.greedy_at(out.last_hidden, rows.to(self.device, non_blocking=True)))
        features = features.to(self.draft.fc.weight.dtype)
        if hasattr(self, "feature_scale"):
            if self.training and not bool(self.feature_scale_ready):
                self._measure_feature_scale(features, attention_mask)
            features = features * self.feature_scale.to(features.dtype)
        embed, head = self._embed_head(tgt)
        # Validation's expected acceptance under sampling reads the draft's logits: keep them in one piece there.
        return self.objective(
            self.draft,
            embed,
            head,
            batch["input_ids"],
            batch["loss_mask"],
            features,
            teacher,
            attention_mask,
            anchors=anchors,
            walk=walk,
            keep_logits=walk and self.val_metrics.sampled is not None,
        )

    @torch.no_grad()
    def _measure_feature_scale(self, features: Tensor, attention_mask: Tensor | None) -> None:
        """Set ``feature_scale`` to 1 / RMS per feature dimension over this batch (all ranks' batches).

        The first position of each sequence is left out: it is the attention sink, whose hidden state is
        hundreds of times larger than the rest. Under warm start ``fc`` is divided by the scale, so the
        function the draft computes is unchanged; a random ``fc`` is kept (it is random either way).
        """
        valid = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)
        if attention_mask is not None:
            valid &= attention_mask.bool()
        valid[:, 0] = False
        x = features.float()[valid]
        sums = torch.stack([x.pow(2).sum(0), torch.full_like(x[0], float(x.shape[0]))])
        trainer = attached_trainer(self)
        if trainer is not None and trainer.world_size > 1:
            sums = trainer.strategy.reduce(sums, reduce_op="sum")
        rms = (sums[0] / sums[1].clamp(min=1)).sqrt()
        scale = 1.0 / rms.clamp(min=1e-6)
        self.feature_scale.copy_(scale.to(self.feature_scale.dtype))
        if self.options.experimental.init_from_target:
            self.draft.fc.weight.div_(scale.to(self.draft.fc.weight.dtype))
        self.feature_scale_ready.fill_(True)

    # ------------------------------------------------------------------ anchor seeds
    def _train_generator(self, batch_idx: int) -> torch.Generator:
        key = f"{self.options.objective.anchor_seed}:{self.global_step}:{batch_idx}:{self.global_rank}"
        return torch.Generator().manual_seed(_seed_of(key.encode()))

    def _sample_generators(self, input_ids: Tensor) -> list[torch.Generator]:
        rows = input_ids.detach().to("cpu", torch.int64).numpy()
        seed = str(self.options.objective.anchor_seed).encode()
        return [torch.Generator().manual_seed(_seed_of(seed + b":" + row.tobytes())) for row in rows]

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.forward_batch(batch, self._train_generator(batch_idx))
        # Ranks whose loss is not finite, summed on the device: one host sync per step (reduce_boolean_decision
        # would take two, its bool() and the reduced result's).
        nonfinite = (~torch.isfinite(out.loss.detach())).to(torch.float32)
        if self.trainer.strategy.reduce(nonfinite, reduce_op="sum").item() > 0:
            raise NonFiniteLossError(
                f"non-finite loss at global step {self.global_step}, batch index {batch_idx} "
                f"(this rank's loss: {out.loss.item()}, token loss: {out.token_loss.item()}"
                + (f", selector loss: {out.selector_loss.item()}" if out.selector_loss is not None else "")
                + "); lower the learning rate, check the data, or use a wider precision"
            )
        b = batch["input_ids"].shape[0]
        logs = {
            "train/loss": out.loss,
            "train/token_loss": out.token_loss,
            "train/acc": _rate(out.draft_tokens == out.reference, out.blocks.valid),
        }
        if out.selector_loss is not None:
            logs["train/selector_loss"] = out.selector_loss
            logs["train/selector_accuracy"] = _rate(out.selector_correct, out.blocks.valid)
            logs["train/selector_coverage"] = _rate(out.covered, out.blocks.valid)
        self.log_dict({k: v.detach() for k, v in logs.items()}, batch_size=b)
        self.log("train/supervised_positions", out.blocks.valid.sum().float(), batch_size=b, reduce_fx="sum")
        return out.loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self.forward_batch(batch, self._sample_generators(batch["input_ids"]), walk=True)
        self.val_metrics.update(out)
        self.log("val/loss", out.loss, batch_size=batch["input_ids"].shape[0], sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        values = self.val_metrics.compute()  # synchronised across ranks (sum-reduced counts)
        self.val_metrics.reset()
        if self.trainer.sanity_checking:
            return
        # Identical on every rank already; sync_dist only averages equal values (and keeps Lightning quiet).
        self.log_dict(values, sync_dist=True)
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank asks
        if self.trainer.is_global_zero and log_dir is not None:
            self._plot(values, Path(log_dir) / PLOT_NAME)

    def _plot(self, values: dict[str, float], path: Path) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        step = self.global_step
        title = f"{self.draft_config.architecture}, step {step}: tau {values['val/tau']:.3f}"
        fig = plot_acceptance(values, path, title=title, close=False)
        board = [lg for lg in self.loggers if isinstance(lg, TensorBoardLogger)]
        if board:
            board[0].experiment.add_figure("val/acceptance", fig, global_step=step, close=True)
        else:
            import matplotlib.pyplot as plt

            plt.close(fig)

    # ------------------------------------------------------------------ optimisation
    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW's parameter groups: ``decay``, ``no_decay`` (norm gains, biases, the conv base kernels) and,
        when ``selector_lr_scale != 1``, ``selector``.

        Decided by each parameter's name and the shape it had on the unwrapped draft (recorded at
        construction), not by the shape it has now: FSDP with ``use_orig_params`` turns every parameter into
        a 1-D shard, and a ``p.dim() < 2`` rule on the shards would exempt all of them from weight decay.
        """
        hp = self.options.optimizer
        selector_scale = self.options.experimental.selector_lr_scale
        decay, no_decay, selector = [], [], []
        for name, p in self.draft.named_parameters():
            if not p.requires_grad:
                continue
            name = unwrapped_name(name)
            if selector_scale != 1.0 and name.startswith("candidate_selector."):
                selector.append(p)
            elif not decays(name, self._param_dims):
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
        if selector:  # a third group only when scaled, so checkpoints of two-group runs still resume
            groups.append(
                {"params": selector, "weight_decay": hp.weight_decay, "lr": hp.lr * selector_scale, "name": "selector"}
            )
        return groups

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        hp = self.options.optimizer
        # Fused AdamW (one kernel for all parameters) on CUDA. Not on the CPU, where torch 2.13 also has a
        # fused kernel: it rounds differently from the for-each one, and the shipped CPU runs (tiny,
        # quickstart) must stay bit-for-bit what they were.
        fused = self.device.type == "cuda"
        beta1, beta2 = hp.betas  # a list when read from YAML; two values (checked by OptimizerOptions)
        optimizer = torch.optim.AdamW(
            self.parameter_groups(), lr=hp.lr, betas=(beta1, beta2), **({"fused": True} if fused else {})
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = hp.warmup_steps if hp.warmup_steps is not None else int(round(hp.warmup_ratio * total))
        schedule = WarmupCosine(warmup, total, hp.min_lr_ratio)
        # Passed as a plain function: LambdaLR saves a callable object's attributes in the checkpoint and
        # restores them over the new ones, so a resume with a larger max_steps would keep the old total and
        # train on at the final rate. The schedule follows the run that resumes.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    # ------------------------------------------------------------------ checkpoints and export
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The draft's config and the target it was trained against: a resume is checked against both.
        checkpoint["draft_config"] = self.draft_config.to_hf_dict()
        checkpoint[TARGET_KEY] = self.target.describe()
        trainer = attached_trainer(self)
        # Whether the validation after the step this checkpoint covers had still to run (it runs after a resume).
        checkpoint[DUE_KEY] = validation_due(trainer)
        # The metrics row of the step this checkpoint covers goes to disk before the checkpoint does.
        if trainer is not None:
            log_step_metrics_now(trainer)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before any weight is loaded: the checkpoint must be of this target and this draft geometry.
        trainer = attached_trainer(self)
        check_resume(
            checkpoint, self.target.describe(), self.draft_config.to_hf_dict(), getattr(trainer, "ckpt_path", None)
        )
        # Resuming a fit: rows a logger wrote after this checkpoint are logged again, so drop the old copies
        # (not when a checkpoint is only validated); so is a validation that was due when it was taken.
        if trainer is not None and trainer.state.fn == "fit":
            step = int(checkpoint.get("global_step", 0))
            due = checkpoint.get(DUE_KEY)
            for logger in trainer.loggers:
                if hasattr(logger, "drop_rows_from"):
                    logger.drop_rows_from(step, validation_at=step - 1 if due else None)
            self._due_validation = due if isinstance(due, dict) else None

    def on_fit_end(self) -> None:
        """A validation still due after a resume runs here (the end-of-fit export callback runs it first)."""
        self.run_due_validation()

    def draft_from_state(self, state: dict[str, Tensor]) -> DraftModel:
        """The trained draft as a standalone :class:`DraftModel` on the CPU, from this module's full ``state``
        (``trainer.strategy.lightning_module_state_dict()``: gathered under FSDP), with the feature scale (when
        trained with ``normalize_features``) folded into ``fc``: what the export writes."""
        draft = DraftModel(self.draft_config)
        draft.load_state_dict(
            {k[len("draft.") :]: v.detach().cpu() for k, v in state.items() if k.startswith("draft.")}
        )
        if "feature_scale" in state:  # fc was trained on scaled features: fold the scale into its columns
            with torch.no_grad():
                draft.fc.weight.mul_(state["feature_scale"].detach().cpu().to(draft.fc.weight.dtype))
        return draft


class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# Prefixes that wrappers (FSDP, activation checkpointing, torch.compile) insert into parameter names.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A parameter's name on the unwrapped module: the wrappers' inserted name parts removed."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def decays(name: str, dims: dict[str, int]) -> bool:
    """Whether the draft parameter ``name`` (unwrapped) takes weight decay, from its recorded dimensions.

    Norm gains and biases (fewer than 2 dimensions) and the conv base kernels are scales around 1 / the
    identity: they are not pulled to 0.
    """
    if name not in dims:
        raise KeyError(f"parameter {name!r} is not one of the draft's own: cannot decide its weight decay")
    return dims[name] >= 2 and not name.endswith("base_kernel")


def source_rows(anchors: Tensor, keep: Tensor, seq_len: int, block_size: int) -> Tensor:
    """The flat positions (``b * seq_len + p``, sorted, unique) whose next-token prediction some block slot
    reads (``p = min(a + k - 1, seq_len - 1)``, ``k = 1..block_size-1``, padded blocks included), from CPU anchors."""
    sources = (anchors[:, :, None] + torch.arange(block_size - 1)).clamp(max=seq_len - 1)
    flat = sources + seq_len * torch.arange(anchors.shape[0])[:, None, None]
    return torch.unique(flat.reshape(-1))


def _rate(hit: Tensor | None, valid: Tensor) -> Tensor:
    if hit is None:
        return torch.zeros((), device=valid.device)
    return (hit & valid).sum().float() / valid.sum().clamp(min=1).float()


def _seed_of(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 63) - 1)
