"""Shared test fixtures: tiny draft geometries and weights moved away from their no-op init."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_record import DRY_RUN_OPTION, GpuRecord, record_path

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.model import DraftModel

# Small enough for a 2-core CI box, big enough to exercise GQA (4 heads / 2 KV heads), several
# target features (3 ids) and conv groups (hidden 32 / group 8 = 4 groups).
TINY_DRAFT: dict[str, Any] = dict(
    hidden_size=32,
    vocab_size=96,
    num_target_layers=6,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    block_size=4,
    target_layer_ids=[1, 2, 4],
    mask_token_id=95,
    rope_theta=10_000.0,
    conv_kernel_size=2,
    conv_group_size=8,
    selector_rank=6,
    selector_top_k=5,
)


@pytest.fixture
def tiny_draft_config() -> Callable[..., DraftConfig]:
    """Factory: ``tiny_draft_config(**overrides)`` -> a validated tiny :class:`DraftConfig` (DFlash2 by default)."""

    def make(**overrides: Any) -> DraftConfig:
        return DraftConfig(**{**TINY_DRAFT, **overrides})

    return make


def randomize_draft_(model: DraftModel, seed: int = 0) -> DraftModel:
    """Give every parameter random, non-trivial values in place (norm weights near 1, conv and selector
    away from their identity / zero init), so that a test cannot pass on a no-op module."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("base_kernel"):
                p.copy_(0.5 * noise)
            elif "codebook" in name:
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)
    return model


@pytest.fixture
def randomized_draft() -> Callable[..., DraftModel]:
    """Factory: ``randomized_draft(cfg, dtype=torch.float32, seed=0)`` -> a :class:`DraftModel` with random weights."""

    def make(cfg: DraftConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> DraftModel:
        return randomize_draft_(DraftModel(cfg).to(dtype), seed).eval()

    return make


@pytest.fixture(scope="session")
def trained_smollm2_draft(tmp_path_factory) -> Path:
    """A SmolLM2 draft trained briefly (the quickstart recipe, 60 online steps on the built-in corpus), shared
    by the llama.cpp tests of the session (several minutes on 2 cores; trained once, also across the
    pytest-xdist workers of ``make test``: the first one trains it under a lock, the others wait and reuse it).

    In float32 where the CPU emulates bf16 (as the quickstart chooses there): the config's bf16-mixed
    online steps take minutes each on such a CPU."""
    from llamacpp_helpers import llama_cpp_or_skip

    from dflash2_lightning.threads import fast_bf16_matmuls

    llama_cpp_or_skip()  # before the training: a skipped test should not pay for it
    base = tmp_path_factory.getbasetemp()
    run = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "trained-smollm2-draft"
    run.mkdir(exist_ok=True)
    hf = run / "runs" / "quickstart" / "train" / "hf"
    with open(run / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or its holder dies)
        if not (hf / "model.safetensors").is_file():
            cmd = [
                sys.executable,
                "-m",
                "dflash2_lightning",
                "fit",
                "--config",
                str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"),
                "--trainer.max_steps",
                "60",
                "--trainer.val_check_interval",
                "60",
                "--data.init_args.train_files",
                "null",
                "--data.init_args.mode",
                "online",
                "--data.init_args.seq_len",
                "128",
            ]
            if not fast_bf16_matmuls():
                cmd += ["--trainer.precision", "32-true"]
            done = subprocess.run(cmd, cwd=run, capture_output=True, text=True, timeout=3600)
            assert done.returncode == 0, done.stderr[-3000:]
    assert (hf / "model.safetensors").is_file()
    return hf


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread for the whole session (module-scoped fixtures included): the tests are tiny,
    and on a 2-core runner oversubscribed threads (several processes, or other jobs) slow them ~10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def no_rendezvous_left_behind():
    """Fails a test that leaves torch.distributed's rendezvous variables in the worker's environment (as a
    ``ddp_spawn`` Trainer in the test's process does): every later job of the worker would inherit them, and its
    port, free again, may belong to another socket on the machine by then. Multi-process tests use
    ``gloo_ranks.run_ranks`` or a subprocess with its own environment."""
    before = {name: os.environ.get(name) for name in RENDEZVOUS}
    yield
    changed = [name for name in RENDEZVOUS if os.environ.get(name) != before[name]]
    for name in changed:
        if before[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before[name]
    if changed:
        pytest.fail(f"the test left {', '.join(changed)} changed in the worker's environment (restored)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        DRY_RUN_OPTION,
        action="store_true",
        default=False,
        help="run the GPU check (tests marked gpu_dry_run) on the CPU at a scaled-down geometry, "
        "so that it does not rot where no GPU is (tests/test_gpu_check_dry.py runs it)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"gpu_dry_run: a gpu test that also runs on the CPU under {DRY_RUN_OPTION}")


@pytest.fixture(scope="session")
def gpu_record(request: pytest.FixtureRequest):
    """The GPU check's JSON record (tests/gpu_record.py), written after each check and at session end."""
    record = GpuRecord(record_path(Path(str(request.config.rootpath))), request.config.getoption(DRY_RUN_OPTION))
    yield record
    record.data["finished"] = True
    record.write()


def _needs(item: pytest.Item) -> str | None:
    """What a ``gpu`` / ``tensorrt`` test needs that this machine lacks, or None."""
    import importlib.util

    if item.get_closest_marker("gpu_dry_run") and item.config.getoption(DRY_RUN_OPTION):
        return None  # runs on the CPU at the dry geometry
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        return "a CUDA device"
    if item.get_closest_marker("tensorrt") and importlib.util.find_spec("tensorrt") is None:
        return "TensorRT (its libraries come from NVIDIA's package index)"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """GPU and TensorRT tests are skipped where their hardware or library is missing, but fail when they were
    asked for by marker (``pytest -m gpu``): a run meant to check the GPU half is never green by skipping it."""
    missing = _needs(item)
    if missing is None:
        return
    asked = item.config.option.markexpr or ""
    if any(mark in asked and f"not {mark}" not in asked for mark in ("gpu", "tensorrt")):
        pytest.fail(
            f"{item.nodeid} needs {missing}, and `-m {asked}` asked for it on a machine without it", pytrace=False
        )
    pytest.skip(f"needs {missing} (run with `pytest -m gpu` where it exists)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The first test file that uses ``trained_smollm2_draft`` runs first, so its minutes of training start at once,
    and the other files that use it run from the middle of the collection on, by when the draft is trained.

    Under ``make test`` (pytest-xdist, whole files per worker, handed out in collection order) they would otherwise
    start beside the training and hold a worker idle on its lock.
    """
    users = [item.path for item in items if "trained_smollm2_draft" in getattr(item, "fixturenames", ())]
    if not users:
        return
    first, later = users[0], set(users[1:]) - {users[0]}
    front = [item for item in items if item.path == first]
    waiting = [item for item in items if item.path in later]
    rest = [item for item in items if item.path != first and item.path not in later]
    middle = len(rest) // 2
    items[:] = front + rest[:middle] + waiting + rest[middle:]
