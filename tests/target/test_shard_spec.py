"""``TargetSpec.shard``: the one setting that shards the frozen target, validated when the spec is made."""

from __future__ import annotations

import pytest

from dflash2_lightning.target.spec import TargetError, TargetSpec


def test_shard_defaults_to_none_and_keeps_old_keys() -> None:
    spec = TargetSpec(path="/models/x")
    assert spec.shard == "none"
    assert "shard" not in spec.key()  # keys recorded before the field existed still match
    assert '"shard": "fsdp"' in TargetSpec(path="/models/x", shard="fsdp").key()


def test_shard_refuses_an_unknown_value_in_one_line() -> None:
    with pytest.raises(
        TargetError, match=r"TargetSpec.shard='tensor' is invalid for a path target: must be one of none, fsdp"
    ) as info:
        TargetSpec(path="/models/x", shard="tensor")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_shard_refuses_a_tiny_target() -> None:
    """A tiny target is built whole in every process: there is nothing to read per rank."""
    with pytest.raises(TargetError, match=r"fsdp needs a path or gguf target"):
        TargetSpec(tiny={}, shard="fsdp")
