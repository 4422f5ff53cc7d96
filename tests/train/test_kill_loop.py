"""Kill ``dflash2 fit`` with SIGKILL at random moments, in the middle of checkpoint writes and in the middle of
validations, resume each time with the same command, and check nothing is lost or left behind: no orphan
temporary files, one training row per step in ``metrics.csv``, and (kills aimed at validations) every row of
an uninterrupted run, with its values, and the same weights."""

from __future__ import annotations

import csv
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DFLASH2 = Path(sys.executable).parent / "dflash2"
STEPS = 16


def _config(tmp_path: Path) -> Path:
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(
        max_steps=STEPS,
        val_check_interval=8,
        limit_val_batches=1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        plugins=[{"class_path": "kill_helpers.StallingCheckpointIO"}],
    )
    trainer["callbacks"].append({"class_path": "kill_helpers.StallingValidation"})
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(tmp_path / "runs")
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["data"]["init_args"]["max_samples"] = 64
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.slow
def test_kills_at_random_moments_and_checkpoint_writes_lose_nothing(tmp_path):
    if not DFLASH2.exists():
        pytest.skip(f"{DFLASH2} not found: install the package first (pip install -e .)")
    config = _config(tmp_path)
    mark = tmp_path / "writing"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH2_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        "DFLASH2_TEST_MARK": str(mark),
        "DFLASH2_TEST_STALL": "1.5",
    }
    # The same command starts the run (no checkpoint yet) and resumes it after every kill.
    command = [str(DFLASH2), "fit", "--config", str(config), "--ckpt_path", "last"]
    rng = random.Random(0)
    killed_in_write = 0
    for moment in ["write", "random", "write", "random", "write"]:
        mark.unlink(missing_ok=True)
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 240
        if moment == "write":
            while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # well inside the stall: bytes written, not yet renamed
        else:
            wait_until = time.monotonic() + rng.uniform(3.0, 9.0)
            while proc.poll() is None and time.monotonic() < wait_until:
                time.sleep(0.05)
        if proc.poll() is not None:  # finished (or failed) before the kill
            err = proc.stderr.read().decode()
            assert proc.returncode == 0, err[-3000:]
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()
        killed_in_write += moment == "write"
    assert killed_in_write >= 2, "the run ended before the kills in checkpoint writes happened"

    run = tmp_path / "runs" / "tiny" / "default"
    orphans_before = list(run.rglob("*.tmp"))
    done = subprocess.run(
        command, cwd=tmp_path, env={**env, "DFLASH2_TEST_STALL": "0"}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert orphans_before, "no kill orphaned a temporary file: the test did not hit a checkpoint write"
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == [], f"temporary files left behind: {leftovers}"
    assert "save_last=True" not in done.stderr

    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train_steps = sorted(int(r["step"]) for r in rows if r.get("train/loss"))
    assert train_steps == list(range(STEPS)), f"train rows by step: {train_steps}"
    val_steps = sorted(int(r["step"]) for r in rows if r.get("val/tau"))
    assert val_steps == [7, 15], val_steps
    assert (run / "hf" / "model.safetensors").is_file()
    assert f"fit finished at step {STEPS}" in done.stdout


def _rows(run: Path) -> Counter:
    """Every row of ``metrics.csv`` (its non-empty values), as a multiset."""
    with open(run / "metrics.csv", newline="") as f:
        return Counter(frozenset((k, v) for k, v in row.items() if v) for row in csv.DictReader(f))


@pytest.mark.slow
def test_kills_during_validation_lose_no_metrics_row(tmp_path):
    """A step's checkpoint is written just before that step's validation: a kill during the validation used to
    lose its row for good. Killed in the validation after batch 7, again in that validation's rerun after the
    resume, and in the validation after batch 15, then resumed, the run ends with every row of an
    uninterrupted run (same values, once) and the same weights."""
    if not DFLASH2.exists():
        pytest.skip(f"{DFLASH2} not found: install the package first (pip install -e .)")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH2_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for work in (straight, killed):
        work.mkdir()
    done = subprocess.run(
        [str(DFLASH2), "fit", "--config", str(_config(straight))],
        cwd=straight,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    mark = tmp_path / "validating"
    command = [str(DFLASH2), "fit", "--config", str(_config(killed)), "--ckpt_path", "last"]
    steps = []
    for step in (8, 8, 16):  # global step while validating after batch 7 (twice: its rerun) and after batch 15
        mark.unlink(missing_ok=True)
        stalled = {
            **env,
            "DFLASH2_TEST_VAL_MARK": str(mark),
            "DFLASH2_TEST_VAL_STALL": "60",
            "DFLASH2_TEST_VAL_STEP": str(step),
        }
        proc = subprocess.Popen(command, cwd=killed, env=stalled, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        steps.append(int(mark.read_text()))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()
    assert steps == [8, 8, 16], steps
    done = subprocess.run(command, cwd=killed, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not resumable" not in done.stderr  # the loader is resumable in Lightning's sense

    run_straight, run_killed = (w / "runs" / "tiny" / "default" for w in (straight, killed))
    want, got = _rows(run_straight), _rows(run_killed)
    where = lambda rows: sorted((dict(r).get("step"), dict(r).get("epoch"), len(r)) for r in rows)
    assert got == want, f"missing rows (step, epoch, values): {where(want - got)}; extra rows: {where(got - want)}"
    weights = [
        hashlib.sha256((r / "hf" / "model.safetensors").read_bytes()).hexdigest() for r in (run_straight, run_killed)
    ]
    assert weights[0] == weights[1]
