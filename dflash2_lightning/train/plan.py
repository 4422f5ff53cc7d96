"""The plan of a fit: memory per device and disk, estimated from the config alone, and whether they fit.

``dflash2 plan --config CFG [the overrides of fit]`` prints it; ``dflash2 fit`` checks it before it loads the
target or builds a feature cache and refuses a run that clearly cannot fit (``--plan.check false`` skips it).
Nothing is loaded: the target's geometry comes from its ``config.json`` (a GGUF's metadata, a tiny target's
settings) and its parameters are counted on the meta device; the draft is built on the meta device too.

Peak per device = the persistent part (draft weights, gradients, AdamW state, the frozen target) plus the largest
of the target's forward, the draft's step (activations saved for backward, logits and loss, autocast weight
copies, FSDP's gathered unit) and the optimiser step. A mixture-of-experts target holds every expert's weights but
a token's forward reads only ``num_experts_per_tok`` routed experts (:mod:`dflash2_lightning.target.experts`).
It is an estimate of what is saved for backward, not a trace: ``tests/train/test_plan.py`` checks it against the
measured peak of CPU fits and the offline cache against the bytes a real build writes. Each term, with its
formula: docs/internals.md ("The plan's memory model"); what users see: docs/training.md ("Will it fit?").
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash2_lightning.action_options import as_options
from dflash2_lightning.config import DraftConfig, rope_theta_of
from dflash2_lightning.errors import ConfigError, format_bytes
from dflash2_lightning.target.capture import decoder_and_layers
from dflash2_lightning.target.experts import RoutedExperts, routed_experts
from dflash2_lightning.target.spec import DTYPES, TargetSpec
from dflash2_lightning.train.objective import LOGITS_CHUNK_ELEMENTS
from dflash2_lightning.train.options import DraftOptions, ObjectiveOptions, draft_settings_named

#: A run "clearly" does not fit when its estimate exceeds the device by this factor (fit refuses it): above the
#: estimate's error measured on CPU fits (tests/train/test_plan.py).
CLEAR_MARGIN = 1.25
#: The share of the device the plan leaves to what it does not count (allocator fragmentation, CUDA context,
#: kernels' workspaces): below this share the verdict is "fits".
USABLE_SHARE = 0.92
SAMPLES_UNIT = 1000  # the cache's size is given per this many samples when the data's size is not known


@dataclass(frozen=True)
class PlanOptions:
    """What ``dflash2 plan`` and ``fit``'s check compare against (``--plan.check``, ``--plan.device_memory``).

    Args:
        check: ``fit`` refuses a run whose plan clearly does not fit (False: train anyway).
        device_memory: memory of one device, e.g. ``80GB`` or ``141e9`` (default: measured on this machine:
            free CUDA memory of the first GPU, or the host's available RAM on a CPU).
    """

    check: bool = True
    device_memory: str | None = None

    def __post_init__(self) -> None:
        if self.device_memory is not None:
            parse_bytes(self.device_memory)  # a size that is not one (0, 1e400, "lots") is refused as it is given


@dataclass(frozen=True)
class Item:
    """One line of the plan: what, how many bytes, and how it was counted."""

    name: str
    bytes: int
    note: str = ""


@dataclass
class Plan:
    """The plan of one fit: memory per device by item, the cache on disk, and the verdicts."""

    heading: str
    memory: list[Item]
    peak: int
    device: str
    capacity: int | None
    cache_bytes: int | None = None
    cache_note: str = ""
    cache_samples_known: bool = False  # False: cache_bytes is per SAMPLES_UNIT samples, not checked against the disk
    cache_sample_bytes: float = 0.0
    cache_dir: Path | None = None
    free_disk: int | None = None
    advice: list[str] = field(default_factory=list)
    target_flops: float = 0.0  # the target forward's FLOPs (online: per step; offline: per sample, once)
    target_flops_note: str = ""
    build_memory: list[Item] = field(default_factory=list)  # offline: the cache build, a phase before the fit
    build_peak: int = 0

    @property
    def device_peak(self) -> int:
        """The larger of the fit's peak and the offline cache build's (each device runs both, one after the other)."""
        return max(self.peak, self.build_peak)

    @property
    def memory_fits(self) -> bool | None:
        """Whether the peak fits the device (None: the device's memory is not known here)."""
        return None if self.capacity is None else self.device_peak <= USABLE_SHARE * self.capacity

    @property
    def disk_fits(self) -> bool | None:
        """Whether the offline cache fits the cache directory's free space (None: no cache, or unknown)."""
        if self.cache_bytes is None or self.free_disk is None or not self.cache_samples_known:
            return None
        return self.cache_bytes <= self.free_disk

    @property
    def fits(self) -> bool:
        return self.memory_fits is not False and self.disk_fits is not False

    @property
    def clearly_too_big(self) -> str | None:
        """Why the run cannot fit whatever the estimate's error (fit's refusal), or None."""
        if self.capacity is not None and self.device_peak > CLEAR_MARGIN * self.capacity:
            phase = " (building the offline cache)" if self.build_peak > self.peak else ""
            return (
                f"needs ~{format_bytes(self.device_peak)} per device{phase}, {self.device} has "
                f"{format_bytes(self.capacity)}"
            )
        if self.disk_fits is False:
            return (
                f"the offline cache needs {format_bytes(self.cache_bytes)}, {self.cache_dir} has "
                f"{format_bytes(self.free_disk)} free"
            )
        return None

    def render(self) -> str:
        """The plan as ``dflash2 plan`` prints it."""
        width = max(len(i.name) for i in [*self.memory, *self.build_memory])
        lines = [self.heading, ""]
        phases = [(f"memory per device ({self.device}):", self.memory, self.peak)]
        if self.build_memory:
            phases.append(
                ("building the offline cache, per device (once, before the fit):", self.build_memory, self.build_peak)
            )
        for title, items, peak in phases:
            lines.append(title)
            for item in items:
                note = f"  {item.note}" if item.note else ""
                lines.append(f"  {item.name:<{width}}  {format_bytes(item.bytes):>9}{note}")
            lines.append(f"  {'peak (estimate)':<{width}}  {format_bytes(peak):>9}")
            if self.capacity is None:
                lines.append(
                    "  device memory: unknown here (no such device visible): pass --plan.device_memory, e.g. 80GB"
                )
            else:
                verdict = "fits" if peak <= USABLE_SHARE * self.capacity else "DOES NOT FIT"
                lines.append(
                    f"  device memory {format_bytes(self.capacity)}: {verdict} "
                    f"({peak / self.capacity:.0%} of it; up to {USABLE_SHARE:.0%} counts as fitting)"
                )
            lines.append("")
        if self.target_flops:
            lines.append(f"compute: target forward {self.target_flops / 1e12:.2f} TFLOP {self.target_flops_note}")
            lines.append("")
        if self.cache_bytes is None:
            lines.append("disk: online mode, no feature cache")
        else:
            lines.append(f"disk: offline feature cache {format_bytes(self.cache_bytes)} ({self.cache_note})")
            free = "unknown" if self.free_disk is None else format_bytes(self.free_disk)
            verdict = {True: "fits", False: "DOES NOT FIT", None: "not checked"}[self.disk_fits]
            if self.free_disk is not None and self.cache_sample_bytes:
                verdict += f" (room for ~{int(self.free_disk // self.cache_sample_bytes)} samples)"
            lines.append(f"  in {self.cache_dir}: {free} free: {verdict}")
        lines.append("")
        if not self.fits:
            lines.append("verdict: does not fit")
        elif self.memory_fits is None:
            lines.append(
                "verdict: memory not checked (the device is not visible here: --plan.device_memory checks "
                "against its size)" + ("; the disk fits" if self.disk_fits else "")
            )
        else:
            lines.append("verdict: fits")
        lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- the target, without weights
def target_hf_config(spec: TargetSpec) -> Any:
    """The target's transformers config, read without any weight (``config.json``, GGUF metadata, tiny settings)."""
    from transformers import AutoConfig

    from dflash2_lightning.target.hf_config import check_config_sizes, target_config

    if spec.tiny is not None:
        from transformers import Qwen3Config

        from dflash2_lightning.target.tiny import TINY_DEFAULTS

        settings = {**TINY_DEFAULTS, **spec.tiny}
        check_config_sizes(settings, "model.init_args.target.tiny", "change that setting")
        return Qwen3Config(**settings)
    if spec.path is not None:
        from dflash2_lightning.target.load import hf_dir_of

        return target_config(hf_dir_of(spec))  # checked before the target is built on the meta device
    from dflash2_lightning.target.gguf import resolve_gguf

    path = resolve_gguf(spec.gguf or "")
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    check_config_sizes(config.to_dict(), str(path))
    return config


@dataclass(frozen=True)
class TargetSize:
    """The frozen target's geometry and parameter counts (from its config, counted on the meta device)."""

    config: Any
    parameters: int
    embedding: int  # parameters of the input embedding
    head: int  # parameters of the output head (0 when tied to the embedding)
    vocab_size: int
    dtype_bytes: int
    experts: RoutedExperts | None = None  # a mixture-of-experts target's routed experts (None: dense)
    largest_layer: int = 0  # parameters of its largest decoder layer (all experts of a MoE layer)
    shard: str = "none"  # TargetSpec.shard: "fsdp" divides its weights over the job's devices
    shard_size: int | None = None  # TargetSpec.shard_size: the devices one copy is divided over (None: all)

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward reads: all of a dense target; a MoE target's routed experts counted for
        the ``num_experts_per_tok`` of them a token uses (memory holds all of them: :attr:`parameters`)."""
        return self.parameters if self.experts is None else self.experts.active(self.parameters)

    def describe_parameters(self) -> str:
        """``8.19 B parameters``, or for a MoE target ``235.09 B parameters (all 128 experts; 22.19 B active: 8 a
        token)``."""
        text = f"{self.parameters / 1e9:.2f} B parameters"
        if self.experts is not None:
            e = self.experts
            text += f" (all {e.experts} experts; {self.active_parameters / 1e9:.2f} B active: {e.per_token} a token)"
        return text


def target_size(spec: TargetSpec) -> TargetSize:
    """Count the target's parameters on the meta device: no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    config = target_hf_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return TargetSize(
        config=config,
        parameters=sum(p.numel() for p in model.parameters()),
        embedding=embed.numel(),
        head=0 if head is embed else head.numel(),
        vocab_size=int(embed.shape[0]),
        dtype_bytes=DTYPES[spec.dtype].itemsize,
        experts=routed_experts(model, config),
        largest_layer=max(sum(p.numel() for p in layer.parameters()) for layer in decoder_and_layers(model)[1]),
        shard=spec.shard,
        shard_size=spec.shard_size,
    )


def draft_config_for(target: TargetSize, options: DraftOptions) -> DraftConfig:
    """The draft's config as :meth:`Target.draft_config` makes it, from the target's config alone.

    The mask token (from the tokenizer in a fit) does not change any size: the last embedding row stands in.
    """
    cfg = target.config
    heads = int(cfg.num_attention_heads)
    geometry: dict[str, Any] = dict(
        hidden_size=int(cfg.hidden_size),
        vocab_size=target.vocab_size,
        num_target_layers=int(cfg.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads),
        intermediate_size=int(cfg.intermediate_size),
        rope_theta=rope_theta_of(cfg),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
        mask_token_id=target.vocab_size - 1,
    )
    geometry.update({k: v for k, v in dataclasses.asdict(options).items() if v is not None})
    with draft_settings_named(options):
        return DraftConfig(**geometry)


# ----------------------------------------------------------------------------- the run's settings
@dataclass(frozen=True)
class RunSetup:
    """What the estimate reads from a parsed ``fit`` config."""

    draft: DraftConfig
    objective: ObjectiveOptions
    target: TargetSize
    mode: str
    batch_size: int
    seq_len: int
    accelerator: str  # "cpu" or "cuda"
    world_size: int
    sharded: bool  # FSDP / DeepSpeed: weights, gradients and optimiser state divided across devices
    gather_bytes: int  # bytes of a parameter as FSDP gathers it (DraftFSDPStrategy: float32 master weights)
    bucket_view: bool  # DDP's gradient_as_bucket_view (no second copy of the gradients)
    forks: bool  # the strategy forks this process: the GPU's free memory is not asked here
    device_index: int  # the CUDA device of this process's rank (asked for its free memory)
    param_bytes: int
    compute_bytes: int
    feature_dtype: str
    teacher_top_k: int
    cache_dir: Path | None
    samples: int | None  # samples the offline cache will hold (None: not known from the config)
    cache_batch_size: int = 8  # samples per target forward while the offline cache is built


def _get(node: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def precision_bytes(precision: Any) -> tuple[int, int]:
    """``(parameter bytes, compute bytes)`` of a Lightning ``precision`` setting."""
    text = str(precision if precision is not None else "32").lower()
    if text.startswith("64"):
        return 8, 8
    half = text.startswith(("16", "bf16")) or text in ("half", "bf16")
    if not half:
        return 4, 4
    return (2, 2) if text.endswith("-true") else (4, 2)


def strategy_kind(strategy: Any) -> tuple[bool, bool, bool, bool]:
    """``(sharded, gradient_as_bucket_view, forks, float32_gather)`` of a Lightning ``strategy`` setting (a name or a
    class config); ``forks``: its launcher forks this process (CUDA must not be initialised before);
    ``float32_gather``: FSDP gathers float32 weights (DraftFSDPStrategy), not the compute dtype."""
    name = str(_get(strategy, "class_path", strategy) or "").lower()
    sharded = "fsdp" in name or "deepspeed" in name
    forks = "fork" in name or "notebook" in name or str(_get(strategy, "init_args.start_method", "")) == "fork"
    return (
        sharded,
        bool(_get(strategy, "init_args.gradient_as_bucket_view", False)),
        forks,
        name.endswith("draftfsdpstrategy"),
    )


def world_size(trainer: Any, accelerator: str) -> int:
    """Devices per node times nodes (``auto`` / ``-1``: every GPU visible here, one CPU process)."""
    devices = _get(trainer, "devices", "auto")
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif str(devices).strip().lstrip("-").isdigit() and int(devices) > 0:
        count = int(devices)
    else:
        count = torch.cuda.device_count() if accelerator == "cuda" else 1
    return max(1, count) * int(_get(trainer, "num_nodes", 1))


def count_samples(data: Any) -> int | None:
    """Samples the offline cache holds at most: records in the data files (``max_samples`` per split), or None
    when a file is missing (the size is then given per :data:`SAMPLES_UNIT` samples)."""
    cap = _get(data, "max_samples")

    def records(paths: Any) -> int | None:
        total = 0
        for path in paths:
            p = Path(str(path)).expanduser()
            if not p.is_file():
                return None
            with open(p, "rb") as f:
                total += sum(1 for line in f if line.strip())
        return min(total, cap) if cap else total

    train = _get(data, "train_files")
    if train is None:
        from dflash2_lightning.target.corpus import builtin_corpus

        n: int | None = len(builtin_corpus())
        n = min(n, cap) if cap else n
    else:
        n = records(train)
    val = _get(data, "val_files")
    if val is not None and n is not None:
        more = records(val)
        n = None if more is None else n + more
    return n


def setup_from_config(config: Any) -> RunSetup:
    """The :class:`RunSetup` of a parsed ``fit`` config (a jsonargparse namespace)."""
    model = _get(config, "model.init_args")
    spec = _get(model, "target")
    spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
    spec = spec if isinstance(spec, TargetSpec) else TargetSpec(**{k: v for k, v in dict(spec).items()})
    draft_options = as_options(_get(model, "draft"), DraftOptions)
    objective = as_options(_get(model, "objective"), ObjectiveOptions)
    target = target_size(spec)
    draft = draft_config_for(target, draft_options)
    trainer = _get(config, "trainer")
    accelerator = str(_get(trainer, "accelerator", "auto")).lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        accelerator = "cuda"
    elif accelerator != "cpu":
        raise ConfigError(
            f"trainer.accelerator={accelerator!r}: the plan knows cpu and gpu/cuda; pass "
            "--plan.check false to train without it"
        )
    param_bytes, compute_bytes = precision_bytes(_get(trainer, "precision"))
    sharded, bucket_view, forks, float32_gather = strategy_kind(_get(trainer, "strategy"))
    data = _get(config, "data.init_args")
    mode = str(_get(data, "mode", "online"))
    seq_len = int(_get(data, "seq_len", 256))
    draft.check_sequence_length(seq_len, "data.init_args.seq_len")
    offline = _get(data, "offline") or {}
    cache_dir = _get(offline, "cache_dir")
    return RunSetup(
        draft=draft,
        objective=objective,
        target=target,
        mode=mode,
        batch_size=int(_get(data, "batch_size", 8)),
        seq_len=seq_len,
        accelerator=accelerator,
        world_size=world_size(trainer, accelerator),
        sharded=sharded,
        gather_bytes=param_bytes if float32_gather else compute_bytes,
        bucket_view=bucket_view,
        forks=forks,
        device_index=local_device_index(_get(trainer, "devices")),
        param_bytes=param_bytes,
        compute_bytes=compute_bytes,
        feature_dtype=str(_get(offline, "feature_dtype", "float16")),
        teacher_top_k=int(_get(offline, "teacher_top_k", 0)),
        cache_batch_size=int(_get(offline, "cache_batch_size", 8)),
        cache_dir=Path(str(cache_dir)).expanduser() if cache_dir else None,
        samples=count_samples(data) if mode == "offline" else None,
    )


# ----------------------------------------------------------------------------- the estimate
def draft_sizes(draft: DraftConfig) -> tuple[int, int]:
    """``(parameters, parameters of the largest FSDP unit)`` of the draft, built on the meta device."""
    from dflash2_lightning.model import DraftModel

    with torch.device("meta"):
        model = DraftModel(draft)
    total = sum(p.numel() for p in model.parameters())
    layer = max((sum(p.numel() for p in layer.parameters()) for layer in model.layers), default=0)
    return total, max(layer, total - layer * len(model.layers))


def draft_activations(run: RunSetup, anchors: int) -> tuple[int, int]:
    """``(bytes saved for backward by the draft's forward, its largest single activation)``, logits excluded.

    The tensors each part saves were counted once with autograd's saved-tensor hooks on this code (a float32 and a
    bf16-autocast step): per layer and block row, ~9.5 hidden-wide tensors in float32, or under autocast ~5.5 in
    float32 (norms, residual stream, convolution outputs) and ~8.5 in the compute dtype (each linear's input cast);
    per query head dimension the SDPA query and output and the q-norm's input; four MLP-wide tensors.
    """
    d = run.draft
    s, a = run.param_bytes, run.compute_bytes
    mixed = a != s
    b, c, r = run.batch_size, run.batch_size * run.seq_len, run.batch_size * anchors * d.block_size
    slots = run.batch_size * anchors * (d.block_size - 1)
    h, i, nt, head_dim = d.hidden_size, d.intermediate_size, d.num_target_features, d.head_dim
    if i is None or head_dim is None:
        raise RuntimeError("the draft's intermediate_size / head_dim are unset (DraftConfig derives them when made)")
    q_width, kv_width = d.num_attention_heads * head_dim, d.num_key_value_heads * head_dim
    gqa_copy = d.num_attention_heads // d.num_key_value_heads if run.accelerator == "cuda" else 1  # see backbone
    hidden_rows = (5.5 * 4 + 8.5 * a) if mixed else 9.5 * s
    kv_full = 2 * (c + r) * kv_width * gqa_copy * a  # K and V over context + block, as SDPA saves them
    mask_bias = b * anchors * d.block_size * (run.seq_len + anchors * d.block_size) * a  # the bool mask as a bias
    conv = 2 * r * d.conv_kernel_size * d.conv_num_groups * a if d.is_dflash2 else 0
    layer = (
        r * h * hidden_rows
        + r * q_width * (4 + 3 * a)
        + r * kv_width * (4 + a)
        + kv_full
        + mask_bias
        + 4 * r * i * a
        + conv
    )
    context = c * nt * h * a + c * h * (4 + 2 * a) + d.num_hidden_layers * c * kv_width * (4 + a)
    final = r * h * (4 + s) + slots * h * (s + (a if mixed else 0))  # final norm, the head's input
    selector = slots * d.selector_rank * (d.selector_top_k * a + 2 * 4) if d.is_dflash2 else 0
    largest = max(kv_full, mask_bias, r * i * a, c * nt * h * s)
    return int(context + d.num_hidden_layers * layer + final + selector), int(largest)


def logits_peak(run: RunSetup, anchors: int) -> tuple[int, str]:
    """Bytes of the head's logits and loss at their peak, and how they are computed (in one piece or chunked)."""
    d, a, t = run.draft, run.compute_bytes, run.target.dtype_bytes
    slots = run.batch_size * anchors * (d.block_size - 1)
    rows, note = slots, "in one piece"
    if slots * d.vocab_size > LOGITS_CHUNK_ELEMENTS:
        rows = max(1, LOGITS_CHUNK_ELEMENTS // d.vocab_size)
        note = f"in chunks of {rows} slots (recomputed in backward)"
    kd = run.objective.token_loss == "kd"
    # Forward: the logits, their float32 copy, log-softmax; distillation adds the teacher's rows, their float32
    # copy, softmax and the product. Backward: the saved logits, log-softmax (and teacher softmax) plus the
    # gradient into and out of log-softmax.
    upcast = 4 if a != 4 else 0
    forward = a + upcast + 4 + ((t + (4 if t != 4 else 0) + 4 + 4) if kd else 0)
    backward = a + 4 + (4 if kd else 0) + 2 * 4
    return rows * d.vocab_size * max(forward, backward), note


def target_forward(run: RunSetup, samples: int | None = None, keep_logits: bool | None = None) -> tuple[int, int]:
    """``(peak of the target's forward over samples x seq_len tokens, what it leaves: features, logits)`` in bytes;
    by default the online step's (the batch; the logits kept for ``token_loss: kd``)."""
    cfg, t, d = run.target.config, run.target.dtype_bytes, run.draft
    c, h, v = (samples or run.batch_size) * run.seq_len, int(cfg.hidden_size), run.target.vocab_size
    keep_logits = run.objective.token_loss == "kd" if keep_logits is None else keep_logits
    # Hooks capture the feature layers (target/capture.py): beside the features, a layer's input and output and
    # the final hidden state are alive, not every layer's.
    states = 3 * c * h * t
    layer = c * (3 * mlp_width(run.target) + 4 * h) * t  # one layer's MLP and attention, transient
    logits = c * v * t if keep_logits else 0
    features = c * d.num_target_features * h * t
    return states + layer + logits + features, features + logits


def mlp_width(target: TargetSize) -> int:
    """The MLP width one token's forward goes through in a layer: ``intermediate_size``, or for a MoE target its
    ``num_experts_per_tok`` experts' (``moe_intermediate_size`` each where the family has it)."""
    cfg = target.config
    if target.experts is None:
        return int(cfg.intermediate_size)
    return target.experts.per_token * int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def target_flops(run: RunSetup, anchors: int) -> tuple[float, str]:
    """Multiply-add FLOPs of the target's forward with the weights (attention scores not counted): per step online
    (``B*S`` tokens; the head over every position where the full logits are read, else over the rows the blocks
    read), per sample in the offline cache build (the head over every position). A MoE target counts the experts a
    token uses, not all of them."""
    tgt, d = run.target, run.draft
    body = tgt.active_parameters - tgt.embedding - tgt.head  # the embedding is a lookup; the head is counted below
    head = tgt.head or tgt.embedding
    tokens = run.seq_len if run.mode == "offline" else run.batch_size * run.seq_len
    full = run.mode == "offline" or run.objective.token_loss == "kd"
    head_rows = tokens if full else min(tokens, run.batch_size * anchors * d.block_size)
    per = "a sample, once (offline cache build)" if run.mode == "offline" else "a step"
    return 2.0 * (body * tokens + head * head_rows), (
        f"{per}: 2 x {body / 1e9:.2f} B active parameters x {tokens} tokens + the head over {head_rows} rows"
    )


def local_device_index(devices: Any) -> int:
    """The CUDA device this process's rank trains on: its local rank (``LOCAL_RANK``, set by Lightning's launcher for
    the ranks it starts and by torchrun) indexing ``trainer.devices`` when that lists device ids."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if isinstance(devices, (list, tuple)) and local_rank < len(devices):
        return int(devices[local_rank])
    return local_rank


def device_memory(run: RunSetup, option: str | None) -> tuple[str, int | None]:
    """``(the device in words, its memory in bytes or None)``: the option, else what this machine has.

    On a GPU, the free memory of this rank's own device: every rank of a fit runs the plan before Lightning sets
    its device, and a query of the current device would open a CUDA context on GPU 0 from every rank."""
    if run.accelerator == "cuda":
        words = f"one of {run.world_size} GPU{'s' if run.world_size > 1 else ''}"
        if option is not None:
            return f"{words}, --plan.device_memory", parse_bytes(option)
        if torch.cuda.is_available() and not run.forks:  # initialising CUDA before a fork would break the ranks
            index = run.device_index
            free, total = torch.cuda.mem_get_info(index)
            return (
                f"{words}: {torch.cuda.get_device_name(index)} (cuda:{index}, {format_bytes(total)}, free now)",
                int(free),
            )
        return f"{words} (none visible here)", None
    words = "CPU" + (f", {run.world_size} processes sharing the host's RAM" if run.world_size > 1 else "")
    if option is not None:
        return f"{words}, --plan.device_memory", parse_bytes(option) // run.world_size
    from dflash2_lightning.target.cpu_linear import available_memory

    available = available_memory()
    return f"{words}: available RAM", None if available is None else available // run.world_size


def parse_bytes(text: str) -> int:
    """``80GB``, ``80GiB``, ``141e9`` -> bytes; anything else, and a size that is not positive and finite (``0``,
    ``1e400``), is a :class:`ConfigError` naming ``--plan.device_memory``."""
    invalid = (
        f"plan.device_memory={text!r} is invalid: must be a positive, finite size such as 80GB, 80GiB or "
        "8e10 (--plan.device_memory)"
    )
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKMGTP]?)(i?)[bB]?\s*", str(text))
    if not match:
        raise ConfigError(invalid)
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    power = " kMGTP".index(unit.replace("K", "k")) if unit else 0
    try:
        size = float(number) * base**power
    except (ValueError, OverflowError):
        raise ConfigError(invalid) from None
    if not (math.isfinite(size) and size >= 1):
        raise ConfigError(invalid)
    return int(size)


def cache_size(run: RunSetup) -> tuple[int, str]:
    """The offline cache's bytes on disk (:func:`~dflash2_lightning.data.feature_cache.cache_bytes`), and for how many
    samples: the configured data's (an upper bound: skipped samples are not stored), else per 1000 samples."""
    import numpy as np

    from dflash2_lightning.data.feature_cache import cache_bytes

    n = run.samples if run.samples is not None else SAMPLES_UNIT
    shape = (n, run.seq_len)
    arrays = {
        "input_ids": np.broadcast_to(np.int32(0), shape),
        "loss_mask": np.broadcast_to(np.bool_(0), shape),
        "attention_mask": np.broadcast_to(np.bool_(0), shape),
    }  # views: nbytes without allocating
    width = run.draft.num_target_features * run.draft.hidden_size
    total = cache_bytes(arrays, width, run.teacher_top_k, run.feature_dtype)
    per = total / max(n, 1)
    if run.samples is None:
        return total, f"per {SAMPLES_UNIT} samples ({format_bytes(per)} a sample; the data files are not readable here)"
    return total, f"{n} samples, at most ({format_bytes(per)} a sample)"


def make_plan(config: Any, options: PlanOptions | None = None) -> Plan:
    """The :class:`Plan` of a parsed ``fit`` config."""
    options = options or PlanOptions()
    run = setup_from_config(config)
    d = run.draft
    anchors = max(1, min(run.objective.num_anchors, run.seq_len - d.block_size + 1))
    params, unit = draft_sizes(d)
    share = run.world_size if run.sharded else 1
    s = run.param_bytes
    how = f"/ {share} devices (FSDP)" if share > 1 else ("replicated (DDP)" if run.world_size > 1 else "")
    items = [
        Item("draft weights", params * s // share, f"{params / 1e6:.1f} M parameters x {s} B {how}".strip()),
        Item("gradients", params * s // share, how),
        Item("AdamW m, v", 2 * params * s // share, how),
    ]
    if run.world_size > 1 and not run.sharded and not run.bucket_view:
        items.append(Item("DDP gradient buckets", params * s, "a second copy (gradient_as_bucket_view: false)"))
    if run.sharded and share > 1:
        items.append(
            Item(
                "FSDP gathered unit",
                2 * unit * run.gather_bytes,
                f"the largest layer, unsharded, x2, {run.gather_bytes} B a parameter",
            )
        )
    tgt, t = run.target, run.target.dtype_bytes
    if tgt.shard == "fsdp":
        items += sharded_target_items(tgt, run.world_size)
    elif run.mode == "online":
        items.append(Item("frozen target", tgt.parameters * t, f"{tgt.describe_parameters()} x {t} B, every device"))
    else:
        resident = tgt.embedding + tgt.head
        items.append(Item("target embedding + head", resident * t, "offline: the rest stays on the host"))
    if run.compute_bytes != t and run.param_bytes != run.compute_bytes:
        items.append(
            Item(
                "head in the compute dtype",
                (tgt.head or tgt.embedding) * run.compute_bytes,
                "autocast copy of the frozen head",
            )
        )
    persistent = sum(i.bytes for i in items)
    acts, largest = draft_activations(run, anchors)
    logits, chunking = logits_peak(run, anchors)
    target_peak, carried = target_forward(run) if run.mode == "online" else (0, 0)
    if run.mode == "offline":
        carried = run.batch_size * run.seq_len * d.num_target_features * d.hidden_size * t  # the batch's features
    # Mixed precision: autocast casts each weight to the compute dtype as a layer runs and the matmul saves the
    # copy for backward, so a copy of every draft weight lives through the step.
    weight_copies = params * run.compute_bytes if run.compute_bytes != run.param_bytes else 0
    step = carried + acts + logits + 2 * largest + weight_copies  # + the largest activation's gradient in and out
    items.append(Item("features for the step", carried, "the target's features (and logits for kd) the step reads"))
    items.append(
        Item(
            "draft activations",
            acts + 2 * largest,
            f"{anchors} anchors x block {d.block_size}, seq {run.seq_len}, batch {run.batch_size}",
        )
    )
    items.append(Item("logits and loss", logits, chunking))
    if weight_copies:
        items.append(
            Item(
                "draft weights, autocast copies",
                weight_copies,
                f"{run.compute_bytes} B a parameter, saved for backward",
            )
        )
    if run.mode == "online":
        items.append(
            Item(
                "target forward (no_grad)",
                target_peak,
                "the feature layers (hooks); before the step (the peak takes the larger)",
            )
        )
    # The for-each AdamW of a CPU run keeps temporaries of two parameter-sized lists; CUDA runs the fused AdamW
    # (DFlash2Module.configure_optimizers), which updates in place.
    optimizer_step = 2 * params * 4 // share if run.accelerator == "cpu" else 0
    peak = persistent + max(step, target_peak, optimizer_step)
    device, capacity = device_memory(run, options.device_memory)
    strategy = "FSDP" if run.sharded else "DDP" if run.world_size > 1 else "one device"
    heading = (
        f"dflash2 plan: {d.architecture}, {d.num_hidden_layers} layers, hidden {d.hidden_size}, vocab "
        f"{d.vocab_size}; target {tgt.describe_parameters()} ({run.mode})\n"
        f"{run.world_size} x {run.accelerator}, {strategy}, "
        f"{'mixed' if run.param_bytes != run.compute_bytes else 'uniform'} precision "
        f"({run.param_bytes} B weights, {run.compute_bytes} B compute)"
    )
    plan = Plan(heading=heading, memory=items, peak=peak, device=device, capacity=capacity)
    if run.mode == "offline":
        plan.build_memory = cache_build_items(run)
        plan.build_peak = sum(item.bytes for item in plan.build_memory)
    plan.target_flops, plan.target_flops_note = target_flops(run, anchors)
    if run.mode == "offline":
        from dflash2_lightning import files
        from dflash2_lightning.target.spec import default_cache_dir

        plan.cache_bytes, plan.cache_note = cache_size(run)
        plan.cache_samples_known = run.samples is not None
        plan.cache_sample_bytes = plan.cache_bytes / (run.samples or SAMPLES_UNIT)
        plan.cache_dir = run.cache_dir or default_cache_dir() / "features"
        plan.free_disk = files.free_bytes(plan.cache_dir)
    plan.advice = advice(plan, run, anchors)
    return plan


def cache_build_items(run: RunSetup) -> list[Item]:
    """Memory per device while the offline cache is built (data/cache_build.py): the whole target (or its shard),
    and its forward over ``cache_batch_size`` samples with the full logits (greedy next tokens; with
    ``teacher_top_k`` a float32 copy for the top-k)."""
    tgt, t = run.target, run.target.dtype_bytes
    if tgt.shard == "fsdp":
        items = sharded_target_items(tgt, run.world_size)
    else:
        items = [Item("frozen target", tgt.parameters * t, f"{tgt.describe_parameters()} x {t} B, every device")]
    forward, _ = target_forward(run, samples=run.cache_batch_size, keep_logits=True)
    items.append(
        Item(
            "target forward (no_grad)",
            forward,
            f"{run.cache_batch_size} samples (offline.cache_batch_size) x seq {run.seq_len}, with the logits",
        )
    )
    if run.teacher_top_k:
        rows = run.cache_batch_size * run.seq_len
        items.append(Item("logits in float32 for top-k", rows * tgt.vocab_size * 4, "offline.teacher_top_k > 0"))
    return items


def sharded_target_items(tgt: TargetSize, world: int) -> list[Item]:
    """A target sharded over the job's ``world`` devices (``target.shard: fsdp``), or over groups of
    ``target.shard_size`` of them (HSDP): each holds its share of every weight, whole copies of the embedding and
    head (the draft calls them on its own), and while the target runs the decoder layer being computed and the
    next one gathered whole."""
    t = tgt.dtype_bytes
    group = min(world, tgt.shard_size or world)
    over = f"{group} devices" + (f" (a copy per {group} of the {world})" if group < world else "")
    return [
        Item(
            "frozen target, sharded",
            -(-tgt.parameters // group) * t,
            f"{tgt.describe_parameters()} x {t} B / {over} (target.shard fsdp)",
        ),
        Item("target embedding + head, whole", (tgt.embedding + tgt.head) * t, "copies the draft calls"),
        Item("target layers gathered", 2 * tgt.largest_layer * t, "the running decoder layer and the next, whole"),
    ]


def advice(plan: Plan, run: RunSetup, anchors: int) -> list[str]:
    """What to change when the plan does not fit."""
    out = []
    if plan.memory_fits is False and run.target.shard == "none" and run.world_size > 1:
        sharded = sum(item.bytes for item in sharded_target_items(run.target, run.world_size))
        whole = run.target.parameters * run.target.dtype_bytes
        out.append(
            f"shard the frozen target over the {run.world_size} devices: --model.init_args.target.shard fsdp "
            f"({sharded / 1e9:.1f} GB a device for it instead of {whole / 1e9:.1f} GB)"
        )
    build_too_big = plan.capacity is not None and plan.build_peak > USABLE_SHARE * plan.capacity
    if build_too_big and run.cache_batch_size > 1:
        out.append(
            "fewer samples per target forward while the cache is built: --data.init_args.offline.cache_batch_size "
            f"{max(1, run.cache_batch_size // 2)} (the same cache, written in smaller batches)"
        )
    if plan.memory_fits is False and plan.peak > USABLE_SHARE * (plan.capacity or 0):
        if anchors > 32:
            out.append(
                f"fewer anchors: --model.init_args.objective.num_anchors {anchors // 2} (activations and "
                "logits scale with it)"
            )
        if run.batch_size > 1:
            out.append(
                f"a smaller batch: --data.init_args.batch_size {max(1, run.batch_size // 2)} (with "
                f"--trainer.accumulate_grad_batches {2} to keep the samples per step)"
            )
        if not run.sharded and run.world_size > 1 and run.accelerator == "cuda":
            out.append(
                "shard the draft's weights, gradients and optimiser state with this project's FSDP: "
                '--trainer.strategy \'{"class_path": "dflash2_lightning.train.fsdp.DraftFSDPStrategy"}\''
            )
        if run.mode == "online":
            out.append(
                "offline mode (the target's features cached on disk, only its embedding and head on the "
                "device): --data.init_args.mode offline"
            )
        if run.param_bytes == run.compute_bytes == 4:
            out.append("mixed precision: --trainer.precision bf16-mixed")
    if plan.disk_fits is False:
        out.append(
            "another disk for the cache: --data.init_args.offline.cache_dir /a/larger/disk/features, or fewer "
            "samples (--data.init_args.max_samples)"
            + (
                ", or float16 features (--data.init_args.offline.feature_dtype float16)"
                if run.feature_dtype == "float32"
                else ""
            )
        )
    return out


def describe_plan_failure(plan: Plan) -> str:
    """fit's one-line refusal when the plan clearly does not fit."""
    return (
        f"this run does not fit: {plan.clearly_too_big} (the plan: `dflash2 plan` with the same arguments); "
        + "; ".join(plan.advice[:2] or ["change the settings"])
        + "; or train anyway with --plan.check false"
    )
