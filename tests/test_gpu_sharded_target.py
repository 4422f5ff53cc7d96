"""The GPU check's sharded-target entry (``target.shard: fsdp``): what only GPUs can show, NCCL and the memory.

Two processes, one GPU each (NCCL), load a Qwen3-shaped random target sharded and whole, compute the features of
their own batches and report: the features equal the whole target's bit for bit, and the GPU memory the sharded
target holds against ``dflash2 plan``'s per-device items for it (its share of the weights, the whole embedding and
head the draft calls). On a machine with fewer than two GPUs it is skipped, saying so (tests/target/test_shard.py
shards over two CPU processes everywhere). ``--gpu-dry-run`` runs it on two CPU processes (gloo) at a tiny size,
with null for the memory figures, so that it does not rot.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_record import DRY_RUN_OPTION, GpuRecord
from hf_families import save_tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_dry_run]

WORLD = 2
# A Qwen3-8B-wide target cut to 4 layers (random weights; ~3.5 GB in bf16): big enough for the shards to show.
REAL = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 4, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}  # fmt: skip
LAYERS = [0, 3]


def worker(rank: int, init: str, out: str, directory: str, dtype: str, cuda: bool) -> None:
    from dflash2_lightning.target.load import build_target
    from dflash2_lightning.target.spec import TargetSpec

    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        before = torch.cuda.memory_allocated(device) if cuda else 0
        sharded = build_target(TargetSpec(path=directory, shard="fsdp", dtype=dtype))
        held = torch.cuda.memory_allocated(device) - before if cuda else None
        g = torch.Generator().manual_seed(11 + rank)  # each process its own batch
        ids = torch.randint(0, sharded.vocab_size, (1, 64 + 16 * rank), generator=g).to(device)
        mask = torch.ones_like(ids, dtype=torch.bool)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        got = sharded.features(ids, mask, LAYERS, logits=False).features
        forward_peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
        whole = build_target(TargetSpec(path=directory, dtype=dtype))
        if cuda:
            whole.hf.to(device)
        want = whole.features(ids, mask, LAYERS, logits=False).features
        report = {"equal": torch.equal(got.cpu(), want.cpu()), "held_bytes": held, "forward_peak_bytes": forward_peak}
        torch.save(report, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_target_on_two_devices(tmp_path: Path, request: pytest.FixtureRequest, gpu_record: GpuRecord) -> None:
    dry = bool(request.config.getoption(DRY_RUN_OPTION))
    if not dry and torch.cuda.device_count() < WORLD:
        pytest.skip(f"a sharded target needs {WORLD} GPUs; this machine has {torch.cuda.device_count()}")
    from dflash2_lightning.target.spec import TargetSpec
    from dflash2_lightning.train.plan import sharded_target_items, target_size

    family = "llama"
    directory = save_tiny_hf(family, tmp_path / "target", seed=3, **({} if dry else REAL))
    dtype = "float32" if dry else "bfloat16"
    if not dry:  # the weights as a user's checkpoint stores them
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(directory).to(torch.bfloat16).save_pretrained(directory)
    mp.spawn(
        worker,
        args=(f"file://{tmp_path / 'init'}", str(tmp_path), str(directory), dtype, not dry),
        nprocs=WORLD,
        join=True,
    )
    reports: list[dict[str, Any]] = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    planned = sharded_target_items(target_size(TargetSpec(path=str(directory), shard="fsdp", dtype=dtype)), WORLD)
    resident = sum(item.bytes for item in planned if item.name != "target layers gathered")
    held = [r["held_bytes"] for r in reports]
    ratios = None if dry else [h / resident for h in held]
    equal = all(r["equal"] for r in reports)
    passed = equal and (dry or all(0.8 <= x <= 1.25 for x in ratios or []))
    gpu_record.check(
        "sharded_target",
        passed=passed,
        in_progress=False,
        processes=WORLD,
        backend="gloo" if dry else "nccl",
        bitwise_equal=equal,
        planned_resident_gib=resident / 2**30,
        held_gib=None if dry else [h / 2**30 for h in held],
        held_vs_plan=ratios,
        forward_peak_gib=None if dry else [r["forward_peak_bytes"] / 2**30 for r in reports],
    )
    assert equal, "the sharded target's features differ from the whole target's"
    assert passed, ratios
