"""The offline feature cache built by two processes with the target sharded (``target.shard: fsdp``) holds the same
bytes as one process's build with the whole target.

7 batches over 2 ranks: rank 1 runs out of batches one step before rank 0, and must still take part in rank 0's
last forward (every layer is gathered from both): it runs a one-token forward whose result is dropped.
"""

from __future__ import annotations

import json

from hf_families import save_tiny_hf
from test_cache_build import contents, one_process_build, run_two_ranks, write_data

from dflash2_lightning.data.feature_cache import MANIFEST
from dflash2_lightning.target.spec import TargetSpec


def test_a_sharded_build_is_the_whole_targets_bytes(tmp_path):
    data = write_data(tmp_path)
    directory = str(save_tiny_hf("qwen3_moe", tmp_path / "qwen3_moe", seed=1))
    one_process_build(data, tmp_path / "one", TargetSpec(path=directory))
    outcome = run_two_ranks(tmp_path, data, tmp_path / "two", target=TargetSpec(path=directory, shard="fsdp"))
    assert all(o["ok"] for o in outcome), outcome
    assert [(o["train"], o["val"]) for o in outcome] == [(10, 3), (10, 3)]
    assert [o["calls"] for o in outcome] == [4, 4]  # rank 1: its 3 batches and one idle forward, in lockstep
    mine, theirs = contents(tmp_path / "two"), contents(tmp_path / "one")
    assert sorted(mine) == sorted(theirs)
    assert [name for name in theirs if name != MANIFEST and mine[name] != theirs[name]] == []
    sharded, whole = json.loads(mine[MANIFEST]), json.loads(theirs[MANIFEST])
    assert sharded["info"]["target"].pop("shard") == "fsdp"  # what the manifest records of how it was built
    assert whole["info"]["target"].pop("shard") == "none"
    assert sharded == whole  # fingerprints, checksums, stats: the same cache
