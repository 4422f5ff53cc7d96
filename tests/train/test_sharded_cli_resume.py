"""``dflash2 fit`` with the target sharded (``target.shard: fsdp``), as a user launches it: 2 DDP processes (gloo,
CPU, Lightning's subprocess launcher), a tiny Qwen3-MoE target in a local HF directory, validation and checkpoints
every 2 steps. Three runs: the target whole, the target sharded, and the target sharded crashing at step 4 (every
rank raises after that step's checkpoint) then resumed with ``--ckpt_path last``. Every ``metrics.csv`` row
(training and validation) and the exported weights are the same bytes in all three.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hf_families import save_tiny_hf
from test_cli import small_config
from test_gpu_recipes_on_cpu import assert_ran_under_ddp, checkpoint, fit

STEPS = 6
CRASH_AT = 4


def config_for(tmp_path: Path, name: str, target: dict) -> tuple[Path, Path]:
    """configs/tiny.yaml shortened (tests/test_cli.py), against ``target``, on 2 CPU processes; and its run dir."""
    root = tmp_path / name
    root.mkdir()
    path = small_config(root, max_samples=32)
    config = yaml.safe_load(path.read_text())
    config["model"]["init_args"]["target"] = target
    config["trainer"].update(max_steps=STEPS, devices=2, strategy="ddp", accelerator="cpu")
    config["trainer"]["callbacks"].append({"class_path": "crash_helpers.CrashAtStep"})  # inert unless the env asks
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, root / "runs" / "tiny" / "default"


@pytest.mark.slow
def test_sharded_fit_and_resume_equal_the_whole_targets(tmp_path: Path) -> None:
    directory = str(save_tiny_hf("qwen3_moe", tmp_path / "qwen3_moe", seed=6))
    runs = {}
    for name, target in (("whole", {"path": directory}), ("sharded", {"path": directory, "shard": "fsdp"})):
        config, runs[name] = config_for(tmp_path, name, target)
        assert_ran_under_ddp(fit(config, config.parent))
    config, runs["resumed"] = config_for(tmp_path, "resumed", {"path": directory, "shard": "fsdp"})
    first = fit(config, config.parent, expect=1, DFLASH2_TEST_CRASH_AT=str(CRASH_AT))
    assert f"simulated crash at step {CRASH_AT}" in first.stderr, first.stderr[-3000:]
    assert checkpoint(runs["resumed"] / "checkpoints" / "last.ckpt")["global_step"] == CRASH_AT
    second = fit(config, config.parent, "--ckpt_path", "last")
    assert "no acceptance record" in second.stderr and "target.shard='fsdp'" in second.stderr

    metrics = {name: (run / "metrics.csv").read_bytes() for name, run in runs.items()}
    assert metrics["whole"].count(b"\n") > STEPS  # a row per step, and the validations'
    assert metrics["sharded"] == metrics["whole"]
    assert metrics["resumed"] == metrics["whole"]
    weights = {name: (run / "hf" / "model.safetensors").read_bytes() for name, run in runs.items()}
    assert weights["sharded"] == weights["whole"] == weights["resumed"]
