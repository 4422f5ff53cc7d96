"""A sharded target (``TargetSpec.shard = "fsdp"``, dflash2_lightning/target/shard.py) on two CPU processes (gloo).

Each process loads the tiny dense (Llama), the tiny mixture-of-experts (Qwen3-MoE) and a tiny dense target with tied
embeddings (its head is its embedding) of tests/hf_families.py twice, sharded and whole, feeds each its OWN batch (another shape on each rank: the features are a collective, the
batches are not), and reports; the tests assert on the reports: the sharded features, logits, final hidden state,
greedy tokens, the draft's embedding and head calls and the fingerprint equal the whole target's, and each process
holds only its slice of every decoder layer.
"""

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
from dflash2_lightning.target.shard import full_tensor
from dflash2_lightning.target.spec import TargetError, TargetSpec

WORLD = 2
FAMILIES = ("llama", "qwen3_moe")
# The targets, by directory name: each family, and a dense one whose head is its embedding (tie_word_embeddings,
# as in Qwen3-0.6B to 4B, Llama-3.2-1B/3B, SmolLM2): one parameter in two places, the head's FSDP unit and the root's.
TARGETS: dict[str, tuple[str, dict[str, Any]]] = {
    **{family: (family, {}) for family in FAMILIES},
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
}
LAYER_SETS = ([0, 2], [1, 3])  # 3: the last layer (HF's normed state)


def rank_batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own batch: ``2 + rank`` rows of ``20 + 6 * rank`` tokens, the last row right-padded."""
    g = torch.Generator().manual_seed(40 + rank)
    rows, length = 2 + rank, 20 + 6 * rank
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[-1, length - 7 :] = False
    return ids, mask


def compare(directory: str, rank: int) -> dict[str, Any]:
    """What rank ``rank`` sees of the target in ``directory``, sharded against whole."""
    sharded = build_target(TargetSpec(path=directory, shard="fsdp"))
    whole = build_target(TargetSpec(path=directory))
    ids, mask = rank_batch(rank, whole.vocab_size)
    report: dict[str, Any] = {"equal": {}}
    for layer_ids in LAYER_SETS:
        for kwargs in ({}, {"logits": False, "last_hidden": True}, {"logits": False}):
            got, want = sharded.features(ids, mask, layer_ids, **kwargs), whole.features(ids, mask, layer_ids, **kwargs)
            for field in ("features", "logits", "last_hidden"):
                a, b = getattr(got, field), getattr(want, field)
                key = f"{layer_ids} {sorted(kwargs.items())} {field}"
                report["equal"][key] = (a is None and b is None) or (
                    a is not None and b is not None and torch.equal(a, b)
                )
    last = whole.features(ids, mask, [0], logits=False, last_hidden=True).last_hidden
    rows = torch.arange(0, ids.numel(), 3)
    report["equal"]["greedy_at"] = torch.equal(sharded.greedy_at(last, rows), whole.greedy_at(last, rows))
    report["equal"]["embed"] = torch.equal(sharded.embed(ids), whole.embed(ids))
    report["equal"]["head"] = torch.equal(sharded.head(last), whole.head(last))
    report["fingerprints"] = (sharded.fingerprint(), whole.fingerprint())
    _, layers = decoder_and_layers(sharded.hf)
    report["layer_shards"] = [
        (name, tuple(p.shape), tuple(p.to_local().shape) if isinstance(p, DTensor) else None)
        for name, p in layers.named_parameters()
    ]
    report["requires_grad"] = any(p.requires_grad for p in sharded.parameters())
    head, embedding = sharded.hf.get_output_embeddings().weight, sharded.hf.get_input_embeddings().weight
    report["tied"] = {
        "whole": whole.hf.get_output_embeddings().weight is whole.hf.get_input_embeddings().weight,
        "whole copies": sharded.output_embeddings().weight is sharded.input_embeddings().weight,
        "shard values": head.shape == embedding.shape and torch.equal(full_tensor(head), full_tensor(embedding)),
    }
    return report


def worker(rank: int, init: str, out: str, directories: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # transformers binds each process to its local device by it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        reports = {Path(d).name: compare(d, rank) for d in directories}
        torch.save(reports, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report, per family (two processes, gloo)."""
    directory = tmp_path_factory.mktemp("shard")
    targets = [str(save_tiny_hf(family, directory / name, seed=4, **kw)) for name, (family, kw) in TARGETS.items()]
    mp.spawn(worker, args=(f"file://{directory / 'init'}", str(directory), targets), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("family", TARGETS)
def test_sharded_features_equal_the_whole_targets(reports: list[dict[str, Any]], family: str) -> None:
    """Bit for bit: FSDP only moves the weights, each process computes with the same whole layers."""
    for rank, report in enumerate(reports):
        unequal = [key for key, same in report[family]["equal"].items() if not same]
        assert not unequal, (family, rank, unequal)
        assert len(report[family]["equal"]) == len(LAYER_SETS) * 3 * 3 + 3


@pytest.mark.parametrize("family", TARGETS)
def test_each_process_holds_only_its_slice_of_every_decoder_layer(reports: list[dict[str, Any]], family: str) -> None:
    for report in reports:
        shards = report[family]["layer_shards"]
        assert shards
        for name, shape, local in shards:
            assert local is not None, name  # every decoder parameter is sharded
            assert local[0] <= math.ceil(shape[0] / WORLD) and local[1:] == shape[1:], (name, shape, local)
        assert not report[family]["requires_grad"]


@pytest.mark.parametrize("family", TARGETS)
def test_the_fingerprint_is_the_whole_targets(reports: list[dict[str, Any]], family: str) -> None:
    """Checkpoints and caches keep matching across shard: none and shard: fsdp."""
    prints = {report[family]["fingerprints"] for report in reports}
    assert len(prints) == 1
    sharded, whole = prints.pop()
    assert sharded == whole


def test_a_sharded_target_needs_a_process_group(tmp_path: Path) -> None:
    directory = save_tiny_hf("llama", tmp_path / "llama")
    assert not dist.is_initialized()
    with pytest.raises(TargetError, match=r"shard='fsdp' needs the processes of a distributed job"):
        build_target(TargetSpec(path=str(directory), shard="fsdp"))


def test_the_tied_target_is_tied_sharded_and_whole(reports: list[dict[str, Any]]) -> None:
    """What the equalities above hold for: a target whose head is its embedding. Sharded, transformers holds the
    head's shards apart from the embedding (equal values, never trained); the whole copies the draft calls are one
    tensor, as in the whole model."""
    for report in reports:
        assert report["llama_tied"]["tied"] == dict.fromkeys(("whole", "whole copies", "shard values"), True)
        untied = report["llama"]["tied"]
        assert not (untied["whole"] or untied["whole copies"] or untied["shard values"])
