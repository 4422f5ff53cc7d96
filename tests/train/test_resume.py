"""Resume: an interrupted run continues exactly; a run killed mid-write keeps its last complete checkpoint."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from dflash2_lightning import cli
from dflash2_lightning.data.order import ResumableOrder
from dflash2_lightning.train import lightning_cli

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
STEPS = 8  # 46 training samples / batch 8 = 6 batches per epoch: crosses an epoch boundary
INTERRUPT = 4  # mid-epoch


class SimulatedCrash(RuntimeError):
    pass


class Interrupt(Callback):
    """Simulate a crash right after the checkpoint of step ``at`` was written."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            raise SimulatedCrash(f"crash at step {self.at}")


def config(tmp_path: Path, every: int) -> Path:
    cfg = yaml.safe_load(TINY.read_text())
    trainer = cfg["trainer"]
    trainer.update(max_steps=STEPS, limit_val_batches=0, log_every_n_steps=1, enable_progress_bar=False)
    trainer.pop("val_check_interval")
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(tmp_path / "runs")
    trainer["logger"][0]["init_args"]["flush_logs_every_n_steps"] = 1  # metrics.csv survives the crash
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = every
    cfg["data"]["init_args"].update(max_samples=48)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def losses(run: Path) -> dict[int, str]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): r["train/loss"] for r in csv.DictReader(f) if r.get("train/loss")}


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.fixture
def argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dflash2"])


@pytest.mark.slow
def test_resume_is_exact(tmp_path, argv):
    """N steps straight == N/2, crash, ``--ckpt_path last``, N/2: identical losses and weights (tolerance 0).

    Exact because nothing random is left to chance: anchors come from generators seeded by the step,
    the data order from (seed, epoch) plus the consumed-batch count, and the optimizer, scheduler and
    step counters are restored bit for bit. The tiny config sets ``deterministic: true``: without it,
    multi-threaded CPU backward kernels make even two uninterrupted runs differ (~1e-7).
    """
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight_dir.mkdir(), resumed_dir.mkdir()
    cli.main(["fit", "--config", str(config(straight_dir, every=INTERRUPT))])

    interrupted = lightning_cli.build_cli(["--config", str(config(resumed_dir, every=INTERRUPT))], run=False)
    interrupted.trainer.callbacks.append(Interrupt(INTERRUPT))
    with pytest.raises(SimulatedCrash):
        interrupted.trainer.fit(interrupted.model, datamodule=interrupted.datamodule)
    assert interrupted.trainer.global_step == INTERRUPT
    cli.main(["fit", "--config", str(config(resumed_dir, every=INTERRUPT)), "--ckpt_path", "last"])

    run = Path("runs") / "tiny" / "default"
    straight, resumed = losses(straight_dir / run), losses(resumed_dir / run)
    assert sorted(straight) == list(range(STEPS)) and sorted(resumed) == list(range(STEPS))
    assert straight == resumed
    a, b = final_weights(straight_dir / run), final_weights(resumed_dir / run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


KILLER = """
import io, os, sys, torch
real_save, calls = torch.save, [0]

def dying_save(obj, f, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint: write half of it, then die like a SIGKILL would
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        out = f if hasattr(f, "write") else open(f, "wb")  # the writer gets a file object or a path
        out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        out.flush()
        os._exit(137)
    return real_save(obj, f, *args, **kwargs)

torch.save = dying_save
sys.path.insert(0, sys.argv[1])
from dflash2_lightning.cli import main
sys.argv = ["dflash2", *sys.argv[2:]]
main()
"""


@pytest.mark.slow
def test_kill_while_writing_keeps_the_previous_checkpoint(tmp_path, argv):
    cfg = config(tmp_path, every=2)
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1"}  # one thread unless the caller says
    done = subprocess.run(
        [sys.executable, "-c", KILLER, str(Path(__file__).parents[1]), "fit", "--config", str(cfg)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 137, done.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "tiny" / "default" / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir() if p.name != "last.ckpt"]
    assert leftovers and all(name.startswith(".last.ckpt.") and name.endswith(".tmp") for name in leftovers)
    complete = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert complete["global_step"] == 2  # the step-4 write died; `last` is still the step-2 checkpoint

    cli.main(["fit", "--config", str(cfg), "--ckpt_path", "last"])  # resumes from step 2, ignoring the debris
    final = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == STEPS
    # metrics.csv reads as one run: the killed run's rows up to its checkpoint, then the resumed rows,
    # each step once (the rows logged between the checkpoint and the kill were dropped and re-logged).
    with open(checkpoints.parent / "metrics.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert steps == list(range(STEPS))


def test_resumable_order_skips_exactly_what_was_consumed_on_every_rank():
    """Per rank, a resumed epoch yields the tail of the uninterrupted one; ranks never overlap."""
    size, batch, world = 23, 3, 2
    for rank in range(world):
        full = list(ResumableOrder(size, seed=7, num_replicas=world, rank=rank))
        resumed = ResumableOrder(size, seed=7, num_replicas=world, rank=rank)
        resumed.resume(epoch=0, batches=2, batch_size=batch)
        assert list(resumed) == full[2 * batch :]  # the skip applies once ...
        assert list(resumed) == full  # ... then the epoch repeats whole
    ranks = [set(ResumableOrder(size, seed=7, num_replicas=world, rank=r)) for r in range(world)]
    assert ranks[0] | ranks[1] == set(range(size))
    boundary = ResumableOrder(size, seed=7)
    boundary.resume(epoch=0, batches=8, batch_size=batch)  # 24 >= 23: the epoch was finished
    assert boundary.epoch == 1 and list(boundary) == list(ResumableOrder(size, seed=8))
