"""A target sharded within groups of processes and replicated across them (``TargetSpec.shard_size``, HSDP): four
CPU processes (gloo) in two groups of two, as two nodes of two GPUs would be. Each process's features equal the
whole target's bit for bit, each holds half of every decoder layer (not a quarter), and its DTensors live on a
two-dimensional mesh (replicas x shards)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hf_families import save_tiny_hf
from torch.distributed.tensor import DTensor

from dflash2_lightning.target.capture import decoder_and_layers
from dflash2_lightning.target.load import build_target
from dflash2_lightning.target.shard import check_shard_size, shard_groups
from dflash2_lightning.target.spec import TargetError, TargetSpec

WORLD, SHARD_SIZE = 4, 2


def worker(rank: int, init: str, out: str, directory: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank % SHARD_SIZE)  # two "nodes" of two processes
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        sharded = build_target(TargetSpec(path=directory, shard="fsdp", shard_size=SHARD_SIZE))
        whole = build_target(TargetSpec(path=directory))
        g = torch.Generator().manual_seed(7 + rank)  # each process its own batch
        ids = torch.randint(0, whole.vocab_size, (2, 16 + 4 * rank), generator=g)
        mask = torch.ones_like(ids, dtype=torch.bool)
        got, want = sharded.features(ids, mask, [0, 3]), whole.features(ids, mask, [0, 3])
        _, layers = decoder_and_layers(sharded.hf)
        params = [(n, p) for n, p in layers.named_parameters()]
        report: dict[str, Any] = {
            "features": torch.equal(got.features, want.features),
            "logits": torch.equal(got.logits, want.logits),
            "fingerprint": sharded.fingerprint() == whole.fingerprint(),
            "shards": [
                (n, tuple(p.shape), tuple(p.to_local().shape), p.device_mesh.ndim)
                for n, p in params
                if isinstance(p, DTensor)
            ],
            "parameters": len(params),
        }
        torch.save(report, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import transformers.distributed

    fields = transformers.distributed.DistributedConfig.__dataclass_fields__
    if "dp_replicate_size" not in fields:
        pytest.skip(
            f"transformers {transformers.__version__} has no HSDP loading: load_sharded_hf refuses shard_size there in one line"
        )
    directory = tmp_path_factory.mktemp("hsdp")
    target = str(save_tiny_hf("llama", directory / "llama", seed=5))
    mp.spawn(worker, args=(f"file://{directory / 'init'}", str(directory), target), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_hsdp_features_equal_the_whole_targets(reports: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(reports):
        assert report["features"] and report["logits"] and report["fingerprint"], rank


def test_each_process_holds_its_groups_share_of_every_layer(reports: list[dict[str, Any]]) -> None:
    """Half of every decoder parameter (a copy per group of 2), on a 2-D mesh: replicas x shards."""
    for report in reports:
        assert len(report["shards"]) == report["parameters"] > 0
        for name, shape, local, mesh_dims in report["shards"]:
            assert mesh_dims == 2, name
            assert local[0] == math.ceil(shape[0] / SHARD_SIZE) or local[0] == shape[0] // SHARD_SIZE, (name, local)
            assert local[1:] == shape[1:]


def test_shard_size_must_divide_the_job_and_needs_fsdp() -> None:
    assert shard_groups(16, 8) == (8, 2) and shard_groups(8, None) == (8, 1) and shard_groups(4, 4) == (4, 1)
    for world, size in ((4, 3), (4, 8)):
        with pytest.raises(TargetError, match=f"shard_size={size} does not divide the job's {world} processes"):
            shard_groups(world, size)
    check_shard_size(8, 8, 2)  # two nodes of 8: a copy per node
    check_shard_size(3, "auto", 1)  # counted when the job starts
    with pytest.raises(TargetError, match="does not divide the job's 16 processes"):
        check_shard_size(6, [0, 1, 2, 3, 4, 5, 6, 7], 2)
    with pytest.raises(TargetError, match="shard_size=2 is invalid: must be an integer >= 1 with shard: fsdp"):
        TargetSpec(path="x", shard_size=2)
    with pytest.raises(TargetError, match="shard_size=0 is invalid"):
        TargetSpec(path="x", shard="fsdp", shard_size=0)
    assert '"shard_size": 8' in TargetSpec(path="x", shard="fsdp", shard_size=8).key()
    assert "shard_size" not in TargetSpec(path="x", shard="fsdp").key()  # keys written before it stay valid
