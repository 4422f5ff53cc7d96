"""The GPU recipes (``configs/qwen3_8b_*.yaml`` and ``configs/qwen3_235b_a22b_online.yaml``) rehearsed on a CPU.

Each recipe runs end to end through the installed ``dflash2`` entry point with only what a CPU forces
overridden: the target (a tiny random Qwen3 instead of Qwen3-8B; for the 235B recipe, whose target is sharded,
a tiny Qwen3-MoE model directory, sharded over the 2 processes as the recipe says), the data (small jsonl files), the
accelerator (``cpu``), the device count (2 processes under Lightning's DDP with the gloo backend), and the
sample geometry, step counts and intervals scaled down. Everything else is the recipe's own: the
objective, the optimizer and its schedule, the loggers and checkpoint callbacks, gradient clipping,
validation and sanity steps, the data workers (none on Python < 3.11.8, where a forked worker can hang:
dflash2_lightning/data/workers.py), the offline feature cache. Each run then resumes with
``--ckpt_path last`` and writes the HF checkpoint, which the strict loader must read back.

What this proves: the recipes parse, two DDP processes build (offline) and share the feature cache,
train, validate, checkpoint, resume and export. What it does not: anything about GPUs (CUDA kernels,
NCCL, bf16 on a GPU, memory at the real geometry) or a fit under FSDP, which cannot finish on a CPU
(:func:`test_fsdp_cannot_be_rehearsed_on_cpu` pins the refusal; FSDP fits run only in ``pytest -m gpu``,
its pieces are tested on CPU by tests/train/test_fsdp.py).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hf_families import save_tiny_hf

from dflash2_lightning.data.workers import fork_deadlock_risk
from dflash2_lightning.model.checkpoint import load_draft

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").glob("qwen3_8b_*.yaml"))
# The large-target recipe shards its target (target.shard: fsdp): rehearsed as the others, on a tiny Qwen3-MoE
# saved as a model directory (a sharded target loads from one; a tiny target is built whole).
SHARDED = REPO / "configs" / "qwen3_235b_a22b_online.yaml"
REHEARSED = [*RECIPES, SHARDED]
DFLASH2 = Path(sys.executable).parent / "dflash2"

pytestmark = pytest.mark.slow

# A tiny random Qwen3 target (hidden 64, vocab 512), 8 layers deep so that the recipe's 5 draft layers
# keep 5 distinct feature layers under the DFlash rule ([1, 2, 3, 4, 5]; Qwen3-8B: [1, 9, 17, 25, 33]).
# bfloat16 as in the recipe: the offline cache then stores bf16 features as float16, as it will on GPUs.
TARGET: dict[str, Any] = {"tiny": {"num_hidden_layers": 8}, "seed": 0, "dtype": "bfloat16"}
MASK_TOKEN_ID = 4  # the tiny tokenizer's <|mask|> (the recipe's 151669 is Qwen3's, outside a 512 vocab)
# Geometry: the draft keeps the recipe's 5 layers, block 16, conv 2/16 and selector 256 / top-16; only the
# sample (3072 tokens, 256 anchors) is cut to what 2 CPU processes train in seconds.
NUM_ANCHORS = 8
SEQ_LEN = 64
STEPS = 6  # max_steps (the recipe counts 6 epochs): what the learning-rate schedule spans
CRASH_AT = 4  # the first run dies at this step, after its checkpoint; the resume trains the rest
EVERY = 2  # validation and last.ckpt every EVERY steps (recipe: 2000 and 500)
FIT_TIMEOUT = 600  # seconds; one fit takes ~40 s on 2 busy cores


def write_data(directory: Path, n: int = 48) -> list[str]:
    """A chat jsonl (the recipe's documented input format) of ``n`` short conversations."""
    path = directory / "train.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} plus {a + 3}?"},
                {"role": "assistant", "content": f"{a} plus {a + 3} is {2 * a + 3}. Good."},
            ]
        }
        for a in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [str(path)]


def rehearsal_config(recipe: Path, directory: Path) -> tuple[Path, dict[str, Any]]:
    """The recipe with only the target, data, accelerator, devices, geometry and step counts overridden."""
    config = yaml.safe_load(recipe.read_text())
    trainer = config["trainer"]
    trainer.update(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        val_check_interval=EVERY,
        limit_val_batches=2,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    # precision stays the recipe's bf16-mixed (CPU autocast): measured on 2 cores, a 6-step fit took 39 s
    # against 42 s in 32-true (start-up dominates), so nothing is gained by leaving the recipe.
    assert trainer["precision"] == "bf16-mixed"
    assert trainer["strategy"]["class_path"] == "lightning.pytorch.strategies.DDPStrategy"
    trainer["strategy"]["init_args"]["process_group_backend"] = "gloo"  # NCCL needs GPUs
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(directory / "runs")
        if "flush_logs_every_n_steps" in logger["init_args"]:
            logger["init_args"]["flush_logs_every_n_steps"] = 1
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = EVERY
    # Inert unless $DFLASH2_TEST_CRASH_AT is set: how the first run is interrupted (tests/crash_helpers.py).
    trainer["callbacks"].append({"class_path": "crash_helpers.CrashAtStep"})
    model = config["model"]["init_args"]
    if model["target"].get("shard", "none") == "none":
        model["target"] = TARGET
    else:  # the recipe's own target settings (dtype, shard), a tiny Qwen3-MoE of TARGET's depth as its path
        moe = save_tiny_hf("qwen3_moe", directory / "target", num_hidden_layers=TARGET["tiny"]["num_hidden_layers"])
        model["target"] = {**model["target"], "path": str(moe)}
    model["draft"]["mask_token_id"] = MASK_TOKEN_ID
    model["objective"]["num_anchors"] = NUM_ANCHORS
    data = config["data"]["init_args"]
    # val_fraction 0.1 (recipe 0.01): 1% of 48 records is a single validation sample for two ranks.
    data.update(train_files=write_data(directory), seq_len=SEQ_LEN, val_fraction=0.1)
    # The recipe's data workers, except where a forked worker can deadlock (CPython < 3.11.8, gh-112275; seen once
    # here as a resumed fit hung at its first validation, dflash2_lightning/data/workers.py): there, none.
    if fork_deadlock_risk() is not None:
        data["num_workers"] = 0
    if data["mode"] == "offline":
        data["offline"]["cache_dir"] = str(directory / "features")
    path = directory / recipe.name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, config


def environment(directory: Path, **extra: str) -> dict[str, str]:
    """One thread per process, no hub, a private cache, the tests' helpers importable by the trainer."""
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH2_DEBUG", "DFLASH2_TEST_CRASH_AT")}
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH2_CACHE": str(directory / "cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def fit(config: Path, directory: Path, *extra: str, expect: int = 0, **env: str) -> subprocess.CompletedProcess:
    if not DFLASH2.exists():
        pytest.fail(f"{DFLASH2} not found: install the package first (pip install -e .)")
    # Its own session, with faulthandler on: a fit that hangs is sent SIGABRT with its ranks and data workers, and
    # every thread's Python stack is in the failure's stderr (a hang is a bug to be found, not a slow run).
    process = subprocess.Popen(
        [str(DFLASH2), "fit", "--config", str(config), *extra],
        cwd=directory,
        env={**environment(directory, **env), "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=FIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGABRT)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"dflash2 fit {' '.join(extra)} hung for {FIT_TIMEOUT} s; the stacks of its processes at SIGABRT:\n"
            f"{stderr[-40000:]}\nstdout:\n{stdout[-2000:]}"
        )
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert done.returncode == expect, (
        f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    )
    return done


def train_losses(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def validation_steps(run: Path) -> list[int]:
    with open(run / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("val/tau")]


def checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_ran_under_ddp(done: subprocess.CompletedProcess) -> None:
    """Lightning's own start-up lines: both processes joined one gloo process group."""
    out = done.stdout + done.stderr
    assert "distributed_backend=gloo" in out, out[-3000:]
    assert "All distributed processes registered. Starting with 2 processes" in out, out[-3000:]


@pytest.mark.parametrize("recipe", REHEARSED, ids=[p.stem for p in REHEARSED])
def test_recipe_runs_under_ddp_on_cpu(recipe: Path, tmp_path: Path) -> None:
    """Fit, checkpoint, resume with ``--ckpt_path last``, export: the recipe's whole life, on 2 CPU processes."""
    config, settings = rehearsal_config(recipe, tmp_path)
    logger = settings["trainer"]["logger"][0]["init_args"]
    run = tmp_path / "runs" / logger["name"] / logger["version"]
    offline = settings["data"]["init_args"]["mode"] == "offline"

    # The first run dies at step CRASH_AT (every rank raises), right after that step's last.ckpt.
    first = fit(config, tmp_path, expect=1, DFLASH2_TEST_CRASH_AT=str(CRASH_AT))
    assert_ran_under_ddp(first)
    assert f"simulated crash at step {CRASH_AT}" in first.stderr, first.stderr[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    assert checkpoint(last)["global_step"] == CRASH_AT
    assert sorted(train_losses(run)) == list(range(CRASH_AT))
    assert not (run / "hf").exists()  # the export is written when a fit ends, not by a crashed one
    if offline:  # both ranks built the cache, each its own batches, before both trained from it
        manifest = tmp_path / "features" / "manifest.json"
        built = manifest.stat().st_mtime_ns
        assert "target features (rank 0 of 2)" in first.stderr and "target features (rank 1 of 2)" in first.stderr
    weights_before = checkpoint(last)["state_dict"]

    resumed = fit(config, tmp_path, "--ckpt_path", "last")  # the recipe's own resume command
    assert_ran_under_ddp(resumed)
    # The closing summary (rank 0 alone): it once asked trainer.log_dir, a collective the other rank had left.
    summary = [line for line in resumed.stdout.splitlines() if line.startswith("dflash2: fit finished")]
    assert len(summary) == 1 and f"step {STEPS};" in summary[0], resumed.stdout[-2000:]
    assert f"run directory {run};" in summary[0] and f"draft checkpoint {run / 'hf'}" in summary[0], summary
    state = checkpoint(last)
    assert state["global_step"] == STEPS
    losses = train_losses(run)
    assert sorted(losses) == list(range(STEPS))  # continued from CRASH_AT, no step logged twice
    assert all(math.isfinite(v) for v in losses.values())
    assert validation_steps(run) == list(range(EVERY - 1, STEPS, EVERY))
    # The recipe's second ModelCheckpoint (best two by val/tau) saw val/tau under DDP. Its files are not
    # counted: the crashed run's step-CRASH_AT one was written after last.ckpt, and the resume's due
    # validation writes that step again as "-v1" beside it.
    best = {int(p.name[len("step") :].split("-")[0]) for p in (run / "checkpoints").glob("step*-tau*.ckpt")}
    assert best and best <= set(range(EVERY, STEPS + 1, EVERY)), best
    trained = [k for k in state["state_dict"] if k.startswith("draft.")]
    assert any(not torch.equal(state["state_dict"][k], weights_before[k]) for k in trained)  # it trained on
    if recipe == SHARDED:  # the target was sharded: the end-of-fit acceptance record, a target forward on rank 0
        assert "target.shard='fsdp'" in resumed.stderr, resumed.stderr[-3000:]  # alone, is skipped, saying why
    if offline:  # the resume checked the cache against its manifest and reused it, not rebuilt it
        assert manifest.stat().st_mtime_ns == built
        assert "target features (rank" not in resumed.stderr

    # The HF export of the resumed run: the strict loader reads it, with the recipe's geometry and the
    # weights of the last checkpoint (bf16, the recipe's export dtype).
    draft = load_draft(run / "hf")
    recipe_draft = settings["model"]["init_args"]["draft"]
    cfg = draft.config
    assert cfg.architecture == "DFlash2DraftModel"
    for key in (
        "num_hidden_layers",
        "block_size",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "mask_token_id",
    ):
        assert getattr(cfg, key) == recipe_draft[key], key
    assert cfg.target_layer_ids == [1, 2, 3, 4, 5]
    assert cfg.torch_dtype == "bfloat16"
    exported = draft.state_dict()
    for name, value in state["state_dict"].items():
        if name.startswith("draft.") and not name.startswith("draft.fc."):  # fc has the feature scale folded in
            assert torch.equal(exported[name[len("draft.") :]], value.to(torch.bfloat16)), name


FSDP_ON_CPU = "requires a GPU accelerator"  # DraftFSDPStrategy refusing accelerator='cpu'
FSDP_STRATEGY = "DraftFSDPStrategy"


def fsdp_override(recipe: Path) -> list[str]:
    """The FSDP override the recipe's header documents (``--trainer.strategy ...``), as the shell splits it."""
    found = re.findall(r"^#\s+(--trainer\.strategy\s+.+?)\s*$", recipe.read_text(), flags=re.M)
    assert len(found) == 1, f"{recipe.name}: its header should document one FSDP override, found {found}"
    return shlex.split(found[0])


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_fsdp_cannot_be_rehearsed_on_cpu(recipe: Path, tmp_path: Path) -> None:
    """The recipe's documented FSDP override selects :class:`DraftFSDPStrategy`, which refuses a CPU accelerator.

    Not a skip: a Lightning fit under FSDP is not rehearsed on a CPU because it cannot finish there (Lightning
    refuses its own FSDPStrategy on a CPU; under this subclass, torch's full-state-dict gathering for the
    first checkpoint crashes CPU processes); it runs only in the GPU check (``pytest -m gpu``), its pieces in
    tests/train/test_fsdp.py. This pins the refusal (a one-line error, exit 2) and that the override parses.
    """
    config, _ = rehearsal_config(recipe, tmp_path)
    done = subprocess.run(
        [str(DFLASH2), "fit", "--config", str(config), *fsdp_override(recipe)],
        cwd=tmp_path,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, f"exit {done.returncode}; stderr:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("dflash2: error: ")]
    assert len(errors) == 1 and FSDP_ON_CPU in errors[0] and FSDP_STRATEGY in errors[0], done.stderr[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))
