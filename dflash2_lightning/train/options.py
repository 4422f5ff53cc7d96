"""The option groups of :class:`~dflash2_lightning.train.module.DFlash2Module`, as a config writes them.

Each group is a typed dataclass that LightningCLI resolves natively, so a config reads::

    model:
      class_path: dflash2_lightning.train.DFlash2Module
      init_args:
        target: {gguf: smollm2}
        draft: {num_hidden_layers: 1, block_size: 4, selector_rank: 32, selector_top_k: 8}
        objective: {position_weighting: decay, decay_gamma: 2.0, num_anchors: 16}
        optimizer: {lr: 1.0e-3, warmup_ratio: 0.05}

and the command line ``--model.init_args.optimizer.lr 3e-4``. Each group checks its own ranges when it is made
(``__post_init__``); the draft's geometry is checked against the target when the module is built
(:class:`~dflash2_lightning.config.DraftConfig`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from dflash2_lightning.errors import ConfigError, check
from dflash2_lightning.model.sampling import Sampling
from dflash2_lightning.train.objective import GoldOutsideTopK, LabelSource, PositionWeighting, TokenLoss


@dataclass(frozen=True)
class DraftOptions:
    """The draft's geometry. Hidden size, vocabulary, heads and RoPE base come from the target; these override.

    Args:
        num_hidden_layers: draft layers.
        block_size: tokens per drafted block (the anchor + ``block_size - 1`` drafts).
        projector_type: ``"dflash2"`` (block convolution + candidate selector) or ``"dflash"`` (the baseline).
        conv_kernel_size, conv_group_size: the block convolution's taps and channels per group (DFlash2).
        selector_rank, selector_top_k: the candidate selector's rank and candidates per position (DFlash2).
        target_layer_ids: target layers feeding the draft (default: the DFlash rule for ``num_hidden_layers``).
        mask_token_id: token id of the mask slots (default: the tokenizer's reserved mask/pad token).
        sliding_window: optional attention window over the context (non-causal SWA).
        num_attention_heads, num_key_value_heads, head_dim, intermediate_size: overrides of the target's.
    """

    num_hidden_layers: int = 1
    block_size: int = 16
    projector_type: Literal["dflash2", "dflash"] = "dflash2"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    sliding_window: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None


@dataclass(frozen=True)
class ObjectiveOptions:
    """What the draft is trained to do (see :class:`~dflash2_lightning.train.objective.DraftObjective`).

    Args:
        token_loss: ``"ce"`` (hard labels) or ``"kd"`` (soft distillation from the target's logits).
        position_weighting: ``"none"``, ``"decay"`` (``exp(-(k-1)/decay_gamma)``) or ``"dpace"`` (``dpace_alpha``).
        selector_loss_alpha: weight of the selector loss (0 disables it).
        gold_outside_topk: when the gold token is not among the selector's candidates: ``"insert_last"``
            (put it in the last slot) or ``"drop"`` (no selector loss at that position).
        num_anchors: blocks per sample per step (at most).
        labels: the hard-CE and selector gold: ``"data"`` (the next data token) or ``"target"`` (the target's
            greedy token after the data prefix).
        anchor_seed: seed of the anchor sampling (a resumed run draws the same anchors).
    """

    token_loss: TokenLoss = "ce"
    position_weighting: PositionWeighting = "none"
    decay_gamma: float = 7.0
    dpace_alpha: float = 0.5
    selector_loss_alpha: float = 1.0
    gold_outside_topk: GoldOutsideTopK = "insert_last"
    num_anchors: int = 256
    labels: LabelSource = "data"
    anchor_seed: int = 0


@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW with a linear warmup, then a cosine decay to ``min_lr_ratio * lr``, stepped every optimizer step.

    Args:
        lr, weight_decay, betas: AdamW. Norm weights and the conv base kernels are not decayed.
        warmup_ratio: linear warmup as a share of all optimizer steps (``warmup_steps`` wins if set).
        min_lr_ratio: the cosine schedule ends at ``min_lr_ratio * lr``.
    """

    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check(self.lr > 0, "optimizer.lr", self.lr, "> 0")
        check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        betas = tuple(self.betas)
        check(len(betas) == 2 and all(0 <= b < 1 for b in betas), "optimizer.betas", self.betas, "two values in [0, 1)")
        check(0 <= self.warmup_ratio < 1, "optimizer.warmup_ratio", self.warmup_ratio, "in [0, 1)")
        check(
            self.warmup_steps is None or self.warmup_steps >= 0,
            "optimizer.warmup_steps",
            self.warmup_steps,
            "None or >= 0",
        )
        check(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")


@dataclass(frozen=True)
class ValidationOptions:
    """Validation also logs the expected acceptance under speculative sampling at these settings.

    Args:
        temperature, top_p, top_k: the sampling measured (``val/t<T>/...``, see
            :class:`~dflash2_lightning.train.metrics.SampledAcceptance`); ``None`` or 0 turns it off.
    """

    temperature: float | None = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def sampling(self) -> Sampling:
        """The sampling law validation measures (temperature 0: greedy only)."""
        return Sampling(self.temperature or 0.0, self.top_p, self.top_k)

    def __post_init__(self) -> None:
        try:
            self.sampling()
        except ValueError as err:
            raise ConfigError(f"validation.{err}") from None  # the message names the field: temperature=...


@dataclass(frozen=True)
class ExportOptions:
    """Where the served checkpoint goes at the end of ``fit`` (written by
    :class:`~dflash2_lightning.export.callback.ExportOnFitEnd`).

    Args:
        dir: the HF checkpoint directory (default ``<run dir>/hf``).
        dtype: dtype of the exported weights (default: the target's dtype as its checkpoint declares it,
            because the engines run the draft beside the target; not the training dtype).
        acceptance_prompts: the acceptance record (``acceptance.json``, what ``dflash2 check-serving`` compares
            an engine with) is written beside the export from the T=0 replay of the exported draft on this many
            of the shipped held-out evaluation prompts, ``acceptance_tokens`` tokens each (0: no record; write
            it later with ``dflash2 acceptance-record``).
        acceptance_tokens: tokens the target generates per prompt for the record.
    """

    dir: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    acceptance_prompts: int = 8
    acceptance_tokens: int = 64

    def __post_init__(self) -> None:
        check(self.acceptance_prompts >= 0, "export.acceptance_prompts", self.acceptance_prompts, ">= 0")
        check(self.acceptance_tokens >= 1, "export.acceptance_tokens", self.acceptance_tokens, ">= 1")


@dataclass(frozen=True)
class ExperimentalOptions:
    """Knobs that measured no better than the defaults on the quickstart's budget and that no shipped config
    uses; kept for ablations (``benchmarks/bench_recipe.py``), not recommended.

    Args:
        init_from_target: start the draft layers as copies of the target layers that follow the last feature
            layer (:mod:`dflash2_lightning.train.warm_start`) instead of random weights.
        selector_init: ``"random"`` (ModelOpt's) or ``"target_embedding"``: both codebooks start at the tokens'
            principal coordinates in the target's token embedding (DFlash2 only).
        normalize_features: train ``fc`` on target features scaled to unit RMS per dimension (measured on the
            first batch and folded into ``fc.weight`` at export, so the checkpoint computes exactly
            ``hidden_norm(fc(features))`` on raw features).
        selector_lr_scale: the candidate selector's parameters train at ``selector_lr_scale * lr``.
    """

    init_from_target: bool = False
    selector_init: Literal["random", "target_embedding"] = "random"
    normalize_features: bool = False
    selector_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        check(self.selector_lr_scale > 0, "experimental.selector_lr_scale", self.selector_lr_scale, "> 0")
        check(
            self.selector_init in ("random", "target_embedding"),
            "experimental.selector_init",
            self.selector_init,
            "'random' or 'target_embedding'",
        )


#: how a config and the command line spell a draft setting (``--model.init_args.draft.mask_token_id``)
DRAFT_SETTING = "model.init_args.draft."
_MASK_HINT = (
    "the Qwen3 recipes reserve that id in Qwen3's vocabulary: for this target delete mask_token_id from the "
    "config's draft settings (or pass --model.init_args.draft '{\"mask_token_id\": null}') to use its "
    "tokenizer's own mask or pad token, or give an id below vocab_size that it never generates"
)


@contextlib.contextmanager
def draft_settings_named(options: DraftOptions) -> Iterator[None]:
    """Within the block, a :class:`~dflash2_lightning.config.ConfigError` of the draft's geometry about a setting of
    ``options`` names it as a config writes it (``--model.init_args.draft.mask_token_id=151669 is invalid ...``)
    and says what to do (an out-of-vocabulary mask token: the recipe's id belongs to another tokenizer)."""
    from dflash2_lightning.errors import ConfigError

    try:
        yield
    except ConfigError as error:
        text = str(error)
        key = text.split("=", 1)[0]
        if key not in {f.name for f in dataclasses.fields(options)} or getattr(options, key) is None:
            raise
        hint = _MASK_HINT if key == "mask_token_id" else f"change --{DRAFT_SETTING}{key}"
        raise ConfigError(f"--{DRAFT_SETTING}{text}; {hint}") from None
