"""``TargetSpec.shard``: the one setting that shards the frozen target, validated when the spec is made."""

from __future__ import annotations

import sys

import pytest

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.target.shard import check_shard_devices
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


@pytest.mark.parametrize("devices", [8, -1, "auto", "4", [0, 1], (0, 1, 2), "0,1", "0,"])
def test_a_count_or_the_first_gpus_in_order_are_accepted_for_a_sharded_target(devices) -> None:
    check_shard_devices(devices)  # no error: ranks 0 .. n-1 sit on GPUs 0 .. n-1, where transformers loads shards


@pytest.mark.parametrize("devices", [[2, 3], [1, 0], [0, 2], "1,", "2,3"])
def test_other_gpu_ids_are_refused_for_a_sharded_target(devices) -> None:
    with pytest.raises(ConfigError, match=r"trainer.devices=.* with model.init_args.target.shard='fsdp'") as info:
        check_shard_devices(devices)
    assert "CUDA_VISIBLE_DEVICES=" in str(info.value) and "\n" not in str(info.value)


def test_fit_refuses_gpu_ids_with_a_sharded_target_in_one_line_before_loading_it(tmp_path, monkeypatch, capsys):
    """The shipped sharded recipe with --trainer.devices [2,3]: one line naming the fix, before the target (a path
    that is not there) is looked at and before anything is written."""
    from dflash2_lightning import cli

    monkeypatch.setattr(sys, "argv", ["dflash2"])
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["fit", "--config", "qwen3_235b_a22b_online", "--model.init_args.target.path", str(tmp_path / "absent")]
    assert cli.main([*args, "--data.init_args.train_files", f"[{data}]", "--trainer.devices", "[2,3]"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash2: error: ")]
    assert len(errors) == 1 and errors[0].startswith("dflash2: error: trainer.devices=[2, 3] with "), err
    assert "Traceback" not in err
    assert "CUDA_VISIBLE_DEVICES=2,3 dflash2 fit ... --trainer.devices 2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]  # no run directory
