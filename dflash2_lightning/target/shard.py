"""The frozen target sharded across the processes of a job: ``TargetSpec.shard = "fsdp"``.

Every decoder layer is one FSDP2 unit (``fully_shard``, resharded after its forward): each process holds a
``1 / world`` slice of every layer's parameters and gathers one layer at a time as the forward runs, so a target
larger than one device fits across the job. Each process still computes the features of its own batch; every
target forward is therefore a collective, which all processes must run together.

Loading goes through transformers' distributed loading (``from_pretrained(distributed_config=...)``): the model is
built on the meta device, sharded, and each process reads only its slices from the safetensors files, with every
family's checkpoint conversion (per-expert tensors stacked into the fused experts of mixture-of-experts layers,
renamed modules) done by transformers. The final norm and the head are their own units resharded after use (not
transformers' default pair kept whole after the forward), where the installed transformers lets a plan say so.

The draft calls the target's embedding and head directly, at times no other process does: those calls must not be
collectives. :func:`whole_copy` makes a plain, unsharded copy of such a module once, at load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.target.spec import TargetError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Module names of the final norm and the head in transformers' decoder-only families (Llama, Qwen, Mistral and
# their mixture-of-experts variants): each its own unit, resharded after use.
_ENDS_PLAN = {"model.norm": "free_full_weight", "lm_head": "free_full_weight"}


def shard_world() -> int:
    """The number of processes the target is sharded over: the default process group's size. A
    :class:`TargetError` when there is none (a sharded target is loaded by every process of a job)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise TargetError(
            "TargetSpec.shard='fsdp' needs the processes of a distributed job (no process group here): "
            "launch with several devices or processes (torchrun, Lightning's devices/num_nodes), or use shard: none"
        )
    return dist.get_world_size()


def check_shard_devices(devices: Any) -> None:
    """Refuse ``trainer.devices`` naming GPUs other than ``0 .. n-1`` for a sharded target (a :class:`ConfigError`).

    transformers' distributed loading binds each process to the device of its local rank (process ``i`` of a node
    to GPU ``i``) and loads its shards there, whatever devices Lightning gives the draft: with ``devices: [2, 3]``
    the target would sit on GPUs 0 and 1 beside the draft on 2 and 3. A count (``8``, ``-1``, ``auto``) is fine;
    ``CUDA_VISIBLE_DEVICES`` picks the GPUs instead."""
    if isinstance(devices, str) and "," in devices:  # Lightning's "2,3" form
        listed: list[Any] = [d.strip() for d in devices.split(",") if d.strip()]
    elif isinstance(devices, (list, tuple)):
        listed = list(devices)
    else:
        return
    try:
        ids = [int(d) for d in listed]
    except (TypeError, ValueError):
        return  # not GPU ids: Lightning's own check reports it
    if ids != list(range(len(ids))):
        visible = ",".join(str(i) for i in ids)
        raise ConfigError(
            f"trainer.devices={devices!r} with model.init_args.target.shard='fsdp': a sharded target is loaded on "
            f"the GPU of each process's local rank (0 .. {len(ids) - 1}), not on the GPUs listed, so the target and "
            f"the draft would sit on different GPUs; give a count and pick the GPUs with the environment: "
            f"CUDA_VISIBLE_DEVICES={visible} dflash2 fit ... --trainer.devices {len(ids)}"
        )


def check_shard_size(shard_size: int | None, devices: Any, num_nodes: Any) -> None:
    """Refuse, before launch, a ``TargetSpec.shard_size`` that does not divide the job's processes
    (``trainer.devices`` per node x ``trainer.num_nodes``), where the config says how many there are."""
    if shard_size is None:
        return
    if isinstance(devices, bool):
        return
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit():
        per_node = int(devices)
    elif isinstance(devices, str) and "," in devices:
        per_node = len([d for d in devices.split(",") if d.strip()])
    else:
        return  # "auto" / -1: counted when the job starts (shard_groups refuses it there)
    shard_groups(per_node * (int(num_nodes) if isinstance(num_nodes, int) and num_nodes > 0 else 1), shard_size)


def shard_groups(world: int, shard_size: int | None) -> tuple[int, int]:
    """``(processes a copy is sharded over, copies)`` for ``world`` processes and ``TargetSpec.shard_size``; a
    :class:`TargetError` when ``shard_size`` does not divide ``world``."""
    size = world if shard_size is None else shard_size
    if size > world or world % size:
        raise TargetError(
            f"TargetSpec.shard_size={shard_size} does not divide the job's {world} processes: give the processes of "
            f"one node (trainer.devices), a divisor of {world}, or null for one group of all {world}"
        )
    return size, world // size


def load_sharded_hf(directory: Path, config: Any, dtype: torch.dtype, shard_size: int | None = None) -> PreTrainedModel:
    """The causal LM of ``directory``, each decoder layer sharded over ``shard_size`` processes (FSDP2; every
    process of the job when None) and replicated across the groups of them (HSDP), each process reading only its
    own slices; frozen. A collective: every process of the job calls it."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    size, copies = shard_groups(shard_world(), shard_size)
    fields = {f.name for f in dataclasses.fields(DistributedConfig)}
    groups: dict[str, Any] = {"fsdp_size": size}  # dp_replicate_size only where there are copies (HSDP)
    if copies > 1:
        if "dp_replicate_size" not in fields:
            import transformers

            raise TargetError(
                f"TargetSpec.shard_size={shard_size} (a copy of the target per group of {size} processes) needs "
                f"transformers' HSDP loading (DistributedConfig.dp_replicate_size), which transformers "
                f"{transformers.__version__} lacks: upgrade transformers, or drop shard_size (one group of all)"
            )
        groups["dp_replicate_size"] = copies
    if "fsdp_plan" in fields:
        distributed = DistributedConfig(**groups, fsdp_plan=dict(_ENDS_PLAN))
    else:  # older transformers (5.17) take no plan: their default one keeps the norm and head whole after use
        distributed = DistributedConfig(**groups)
    hf = AutoModelForCausalLM.from_pretrained(
        str(directory), config=config, dtype=dtype, local_files_only=True, distributed_config=distributed
    )
    return hf.requires_grad_(False)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter or buffer: a sharded one (a DTensor) gathered from every process (a
    collective), any other as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_copy(module: nn.Module, tied_to: torch.Tensor | None = None) -> nn.Module:
    """A plain frozen ``nn.Embedding`` or ``nn.Linear`` holding the whole weights of the (sharded) ``module`` of
    that kind. A collective. A :class:`TargetError` for another kind (an embedding that scales its output, a
    quantised head): their computation is more than the weights. ``tied_to``: the whole weight a tied head shares
    (the embedding's), used as the linear's weight instead of a gathered copy (only its bias is gathered)."""
    with torch.no_grad():
        kind = _unsharded_class(module)
        if kind is nn.Embedding:
            assert isinstance(module, nn.Embedding)
            weight = full_tensor(module.weight).detach().clone()
            return nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=module.padding_idx)
        if kind is nn.Linear:
            assert isinstance(module, nn.Linear)
            copy = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            if tied_to is not None and tuple(tied_to.shape) == (module.out_features, module.in_features):
                copy.weight = tied_to if isinstance(tied_to, nn.Parameter) else nn.Parameter(tied_to, False)
            else:
                copy.weight = nn.Parameter(full_tensor(module.weight).detach().clone(), requires_grad=False)
            if module.bias is not None:
                copy.bias = nn.Parameter(full_tensor(module.bias).detach().clone(), requires_grad=False)
            return copy
    raise TargetError(
        f"TargetSpec.shard='fsdp' cannot take this target: its {type(module).__name__} is not a plain embedding or "
        "linear head, which the draft calls whole; use shard: none"
    )


def _unsharded_class(module: nn.Module) -> type:
    """The module's own class: ``fully_shard`` swaps a module's class for a subclass of ``(FSDPModule, cls)``."""
    from torch.distributed.fsdp import FSDPModule

    kind = type(module)
    return kind.__bases__[1] if isinstance(module, FSDPModule) else kind
