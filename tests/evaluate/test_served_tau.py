"""Served τ while training (:class:`~dflash2_lightning.evaluate.served_tau.ServedTau`): a tiny GGUF fit whose
validations serve the draft in a real ``llama-server``, and what is refused before the fit trains."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from llamacpp_helpers import llama_cpp_or_skip, vocab_gguf
from test_bad_input import assert_user_error
from test_bad_input import small_config as tiny_config

from dflash2_lightning.errors import ConfigError
from dflash2_lightning.evaluate.served_tau import CLASS_PATH, FIGURES_NAME, SERVED_DIR, ServedTau

REPO = Path(__file__).resolve().parents[2]
BLOCK = 4  # the quickstart draft's block
PROMPTS, TOKENS = 2, 16
# llama-server's own line per request (tools/server/server-context.cpp, print_timing)
ACCEPTANCE_LINE = re.compile(r"draft acceptance = \S+ \(\s*(\d+) accepted /\s*(\d+) generated\)")


def fit(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dflash2_lightning", "fit", "--config", str(config)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)


def with_served_tau(config: Path, **init_args) -> Path:
    data = yaml.safe_load(config.read_text())
    data["trainer"]["callbacks"].append({"class_path": CLASS_PATH, "init_args": init_args})
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config


def gguf_fit_config(tmp_path: Path) -> Path:
    """The quickstart's SmolLM2 GGUF recipe cut to 4 online steps on the built-in corpus, validating at steps 2 and
    4, no checkpoints, served τ at every validation."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        precision="32-true",
    )
    trainer["callbacks"] = [c for c in trainer["callbacks"] if not c["class_path"].endswith("ModelCheckpoint")]
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(tmp_path / "runs")
    config["model"]["init_args"]["export"] = {"acceptance_prompts": 0}
    data = config["data"]["init_args"]
    data.update(train_files=None, mode="online", seq_len=64, batch_size=2, max_samples=32)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return with_served_tau(path, every_n_validations=1, prompts=PROMPTS, max_new_tokens=TOKENS)


@pytest.mark.slow
def test_a_gguf_fit_logs_llama_servers_tau_at_every_validation(tmp_path):
    """metrics.csv and TensorBoard hold val/served_tau at both validations, beside val/tau and the replay's τ on
    the same prompts; each equals 1 + accepted / verify steps of the engine's counters, and the accepted and
    drafted tokens are what llama-server's own log says for those requests."""
    llama_cpp_or_skip()
    done = fit(gguf_fit_config(tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart" / "train"
    with open(run / "metrics.csv", newline="") as f:
        validations = [r for r in csv.DictReader(f) if r.get("val/tau")]
    assert len(validations) == 2, validations
    figures = sorted((run / SERVED_DIR).glob(f"step-*/{FIGURES_NAME}"))
    assert [p.parent.name for p in figures] == ["step-000002", "step-000004"]
    for row, path in zip(validations, figures):
        served = {k: float(v) for k, v in row.items() if k.startswith("val/served_") and v}
        tau, accepted, drafted, steps = (served[f"val/served_{k}"] for k in ("tau", "accepted", "drafted", "steps"))
        assert 1.0 <= tau <= BLOCK, row
        assert steps > 0 and drafted > 0 and 0 <= accepted <= drafted, row
        assert tau == pytest.approx(1 + accepted / steps, rel=1e-6)  # metrics.csv holds float32
        assert 1.0 <= served["val/served_replay_tau"] <= BLOCK, row
        # The engine's own per-request lines in the server log of this validation.
        logs = list(path.parent.glob("llama-server-*.log"))
        assert len(logs) == 1, logs
        per_request = [tuple(map(int, m)) for m in ACCEPTANCE_LINE.findall(logs[0].read_text())]
        assert len(per_request) == PROMPTS, logs[0].read_text()[-3000:]
        assert accepted == sum(a for a, _ in per_request) and drafted == sum(d for _, d in per_request)
        kept = json.loads(path.read_text())
        assert kept["metrics"]["val/served_tau"] == pytest.approx(tau, rel=1e-6)
        assert kept["server"]["served_block_size"] == BLOCK and kept["server"]["args"][-1] == str(BLOCK - 1)
        assert kept["check_serving"]["served"]["steps"] == steps
    assert "served tau at step 4: llama.cpp" in done.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    logged = [e.value for e in board.Scalars("val/served_tau")]
    assert logged == pytest.approx([float(r["val/served_tau"]) for r in validations])
    assert len(board.Scalars("val/served_replay_tau")) == 2


def test_no_llama_server_is_refused_before_the_fit_trains(tmp_path):
    config = with_served_tau(tiny_config(tmp_path), llama_cpp_cache=str(tmp_path / "empty-cache"))
    done = fit(config, tmp_path)
    assert_user_error(done, "served tau", "needs llama-server", "make llama-cpp")
    run = tmp_path / "runs" / "tiny" / "default"
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()


def test_a_target_that_is_not_a_gguf_is_refused_before_the_fit_trains(tmp_path):
    llama_cpp_or_skip()
    done = fit(with_served_tau(tiny_config(tmp_path)), tmp_path)
    assert_user_error(done, "served tau", "is not a GGUF", "target_gguf")
    run = tmp_path / "runs" / "tiny" / "default"
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()


def test_without_the_gguf_package_the_callback_is_refused_before_the_fit_trains(tmp_path):
    """Where gguf is not installed (the GPU machine's packages), one line naming the extra, not an internal error."""
    llama_cpp_or_skip()
    shadow = tmp_path / "no-gguf"
    shadow.mkdir()
    (shadow / "gguf.py").write_text("raise ModuleNotFoundError(\"No module named 'gguf'\", name='gguf')\n")
    config = with_served_tau(tiny_config(tmp_path), target_gguf=str(tmp_path / "target.gguf"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "dflash2_lightning", "fit", "--config", str(config)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    assert_user_error(done, "served tau", "needs the gguf package", "dflash2-lightning[gguf]")
    assert not (tmp_path / "runs" / "tiny" / "default" / "checkpoints").exists()


@pytest.mark.parametrize("kind", ["garbage", "another-vocabulary"])
def test_a_target_gguf_path_that_is_not_the_targets_is_refused_before_the_fit_trains(tmp_path, kind):
    llama_cpp_or_skip()
    pytest.importorskip("gguf", reason="reading a GGUF needs the gguf package (the callback refuses without it)")
    path = tmp_path / f"{kind}.gguf"
    if kind == "garbage":
        path.write_bytes(b"not a gguf file at all")
    else:
        vocab_gguf(path, 100)  # the tiny target's vocabulary is larger
    done = fit(with_served_tau(tiny_config(tmp_path), target_gguf=str(path)), tmp_path)
    assert_user_error(done, "target_gguf", str(path), "is not a GGUF" if kind == "garbage" else "another target")
    assert not (tmp_path / "runs" / "tiny" / "default" / "metrics.csv").exists()


@pytest.mark.parametrize(
    "option, value",
    [("every_n_validations", 0), ("prompts", 0), ("max_new_tokens", 0), ("served_block_size", 1), ("port", 70000)],
)
def test_options_out_of_range_are_refused_by_name(option, value):
    with pytest.raises(ConfigError, match=rf"{option}={value} is invalid"):
        ServedTau(**{option: value})
