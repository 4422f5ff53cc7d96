"""Bad input and faults, through the installed entry points (``dflash2 ...``, ``python export/to_onnx.py``).

Every case asserts the exit status (2: the user's mistake), that stderr is short, carries one
``dflash2: error:`` line naming the file / field / value and no traceback, and that nothing already
written (a trained run, a feature cache) was changed. A few good cases sit beside them (target
overrides that must work, ``--ckpt_path last`` on an empty run directory, ``--debug``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from module_helpers import grouped

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
DFLASH2 = Path(sys.executable).parent / "dflash2"
TO_ONNX = REPO / "export" / "to_onnx.py"
MAX_STDERR_LINES = 8  # Lightning's few start-up lines ("Seed set to 0", "GPU available ...") + the error

pytestmark = pytest.mark.slow


def small_config(directory: Path, name: str = "fit.yaml", model: dict | None = None, **data) -> Path:
    """configs/tiny.yaml cut to 4 steps (validation and a checkpoint every 2) writing under ``directory``."""
    config = yaml.safe_load(TINY.read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=4, val_check_interval=2, limit_val_batches=1, log_every_n_steps=1,
                   enable_progress_bar=False)
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(directory / "runs")
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    for group, fields in grouped(**(model or {})).items():  # flat setting names -> the module's option groups
        config["model"]["init_args"].setdefault(group, {}).update(fields)
    config["data"]["init_args"].update({"max_samples": 48, **data})
    path = directory / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(args: list[str], cwd: Path, cache: Path, script: Path | None = DFLASH2) -> subprocess.CompletedProcess:
    if script is DFLASH2 and not DFLASH2.exists():
        pytest.skip(f"{DFLASH2} not found: install the package first (pip install -e .)")
    command = [str(script), *args] if script is DFLASH2 else [sys.executable, str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DFLASH2_CACHE": str(cache)}
    env.pop("DFLASH2_DEBUG", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (what a failing command must leave as it was)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.exists() else []:
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_user_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one short ``dflash2: error:`` message that contains every needle, no traceback."""
    err = done.stderr
    assert done.returncode == 2, f"exit {done.returncode}; stderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= MAX_STDERR_LINES, err
    errors = [line for line in lines if line.startswith("dflash2: error: ")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


# ----------------------------------------------------------------------------- shared outputs
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """One trained online run (its HF draft) and one offline feature cache, built once for the module."""
    root = tmp_path_factory.mktemp("base")
    cache = root / "dflash2-cache"
    done = run(["fit", "--config", str(small_config(root))], root, cache)
    assert done.returncode == 0, done.stderr[-3000:]
    offline = root / "offline"
    offline.mkdir()
    config = small_config(offline, model={"token_loss": "ce"}, mode="offline", cache_dir=str(offline / "features"))
    done = run(["fit", "--config", str(config)], offline, cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "cache": cache, "run": root / "runs" / "tiny" / "default",
            "hf": root / "runs" / "tiny" / "default" / "hf", "features": offline / "features"}


@pytest.fixture
def untouched(base):
    """Fails the test if the shared run or cache changed while it ran."""
    before = snapshot(base["run"], base["features"])
    yield
    assert snapshot(base["run"], base["features"]) == before, "a failing command changed existing outputs"


# ----------------------------------------------------------------------------- fit: config and CLI
@pytest.mark.parametrize("override, needles", [
    (["--model.init_args.selector_rnak", "3"], ["model.init_args.selector_rnak", "did you mean draft.selector_rank"]),
    (["--trainer.max_stepz", "3"], ["--trainer.max_stepz", "did you mean --trainer.max_steps"]),
    (["--data.init_args.bach_size", "3"], ["data.init_args.bach_size", "did you mean batch_size"]),
    (["--model.init_args.draft.selector_rank", "sixteen"], ["model.init_args.draft.selector_rank='sixteen'", "int"]),
    (["--model.init_args.draft.projector_type", "dflash3"], ["projector_type='dflash3'", "dflash2"]),
    (["--model.init_args.draft.conv_kernel_size", "9"], ["conv_kernel_size=9", "block_size=8"]),
    (["--data.init_args.seq_len", "60"], ["seq_len=60", "multiple of block_size=8"]),
    (["--model.init_args.target", "null"], ["model.init_args.target is missing"]),
    (["--model.init_args.target.path", "/nonexistent/model"], ["/nonexistent/model", "not a Hugging Face model"]),
    (["--model.init_args.target.tiny", "null"], ["model.init_args.target is missing"]),
    (["--data.init_args.train_files", "[missing.jsonl]"], ["train_files", "missing.jsonl", "does not exist"]),
])
def test_fit_config_errors(tmp_path, base, untouched, override, needles):
    done = run(["fit", "--config", str(small_config(tmp_path)), *override], tmp_path, base["cache"])
    assert_user_error(done, *needles)
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_typo_in_a_config_file_names_the_file(tmp_path, base, untouched):
    config = small_config(tmp_path)
    config.write_text(config.read_text().replace("selector_rank:", "selector_rnak:"))
    assert_user_error(run(["fit", "--config", str(config)], tmp_path, base["cache"]),
                      "selector_rnak", "did you mean draft.selector_rank", str(config))
    assert_user_error(run(["fit", "--config", str(tmp_path / "nope.yaml")], tmp_path, base["cache"]),
                      "nope.yaml", "does not exist")


def test_kd_offline_without_logits_is_refused_before_the_cache_is_built(tmp_path, base, untouched):
    cache_dir = tmp_path / "features"
    config = small_config(tmp_path, mode="offline", cache_dir=str(cache_dir))  # tiny.yaml trains with kd
    assert_user_error(run(["fit", "--config", str(config)], tmp_path, base["cache"]), "teacher_top_k", "kd")
    assert not cache_dir.exists()


def test_a_new_target_kind_replaces_the_configs_target(tmp_path, base):
    # tiny.yaml says `tiny: {}`: naming a gguf (or a JSON spec) replaces it instead of naming two targets.
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"\0" * 4096)
    done = run(["fit", "--config", str(small_config(tmp_path)), "--model.init_args.target.gguf", str(bad)],
               tmp_path, base["cache"])
    assert_user_error(done, str(bad), "is not a GGUF file")
    assert not (base["cache"] / "hf").exists()  # refused before the conversion cache was touched
    for i, spec in enumerate(['{"tiny": {"num_hidden_layers": 2}}', "{tiny: {}, seed: 1}"]):
        work = tmp_path / f"run{i}"
        work.mkdir()
        done = run(["fit", "--config", str(small_config(work)), "--model.init_args.target", spec,
                    "--trainer.max_steps", "1"], work, base["cache"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((work / "runs" / "tiny" / "default" / "hf" / "config.json").read_text())


def test_corrupt_gguf_with_a_valid_magic_is_one_line_and_leaves_no_directory(tmp_path, base):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2048))
    cache = tmp_path / "cache"
    done = run(["eval", "--draft", str(base["hf"]), "--target", str(bad), "--out", str(tmp_path / "e")],
               tmp_path, cache)
    assert_user_error(done, str(bad), "cannot be loaded")
    assert not list(cache.rglob("*")), f"left behind: {list(cache.rglob('*'))}"


# ----------------------------------------------------------------------------- fit: data files
@pytest.mark.parametrize("content, needles", [
    (b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n', ["train.jsonl:2", "not UTF-8", "0xe9"]),
    (b'{"text": "fine"}\n{"text": broken\n', ["train.jsonl:2", "invalid JSON", "column 10"]),
    (b'{"text": "fine"}\n{"text": "unterminated\n', ["train.jsonl:2", "invalid JSON"]),
    (b'{"text": "fine"}\n{"txt": "no key"}\n', ["train.jsonl:2", "'text', 'messages' or 'conversations'"]),
    (b'{"text": "fine"}\n{"messages": [{"role": "user"}]}\n', ["train.jsonl:2", "turn 0"]),
])
def test_bad_data_files_name_file_and_line(tmp_path, base, untouched, content, needles):
    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    done = run(["fit", "--config", str(small_config(tmp_path, train_files=[str(data)]))], tmp_path, base["cache"])
    assert_user_error(done, *needles)


# ----------------------------------------------------------------------------- fit: the feature cache
def _damage_zeros(d: Path) -> str:
    f = d / "train" / "features.npy"
    with open(f, "r+b") as h:
        h.seek(f.stat().st_size // 2)
        h.write(b"\0" * min(400_000, f.stat().st_size // 3))
    return "features.npy"


def _damage_ff(d: Path) -> str:
    f = d / "train" / "features.npy"
    with open(f, "r+b") as h:
        h.seek(4096)
        h.write(b"\xff" * 20_000)
    return "features.npy"


def _truncate(d: Path) -> str:
    f = d / "train" / "features.npy"
    os.truncate(f, f.stat().st_size - 1000)
    return "features.npy"


def _delete_mask(d: Path) -> str:
    (d / "train" / "loss_mask.npy").unlink()
    return "loss_mask.npy"


def _truncate_manifest(d: Path) -> str:
    f = d / "manifest.json"
    f.write_text(f.read_text()[:200])
    return "manifest.json"


@pytest.mark.parametrize("damage", [_damage_zeros, _damage_ff, _truncate, _delete_mask, _truncate_manifest])
def test_a_damaged_feature_cache_is_an_error_naming_the_file(tmp_path, base, untouched, damage):
    cache_dir = tmp_path / "features"
    shutil.copytree(base["features"], cache_dir)
    name = damage(cache_dir)
    damaged = snapshot(cache_dir)
    config = small_config(tmp_path, model={"token_loss": "ce"}, mode="offline", cache_dir=str(cache_dir))
    done = run(["fit", "--config", str(config)], tmp_path, base["cache"])
    assert_user_error(done, name, str(cache_dir), "rebuild")
    assert snapshot(cache_dir) == damaged  # reported, not silently rebuilt or deleted
    assert not list((tmp_path / "runs").rglob("*.ckpt"))  # no training step ran on it


# ----------------------------------------------------------------------------- fit: checkpoints and faults
def test_resume_from_a_truncated_checkpoint_names_it(tmp_path, base, untouched):
    run_dir = tmp_path / "runs" / "tiny" / "default"
    shutil.copytree(base["run"], run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    os.truncate(last, last.stat().st_size // 2)
    done = run(["fit", "--config", str(small_config(tmp_path)), "--ckpt_path", "last"], tmp_path, base["cache"])
    assert_user_error(done, "last.ckpt", "cannot be read", "delete it")


def test_ckpt_path_last_without_a_checkpoint_starts_fresh_and_says_so(tmp_path, base):
    done = run(["fit", "--config", str(small_config(tmp_path)), "--ckpt_path", "last"], tmp_path, base["cache"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no checkpoint to resume" in done.stderr and "starts a fresh run" in done.stderr
    assert "save_last=True" not in done.stderr  # Lightning's misleading hint
    summary = [line for line in done.stdout.splitlines() if line.startswith("dflash2: fit finished")]
    assert len(summary) == 1 and "val/tau" in summary[0] and "train/loss" in summary[0], done.stdout
    for noise in ("litlogger", "LeafSpec", "v_num", "smaller than the logging interval"):
        assert noise not in done.stderr + done.stdout, noise
    # A second fresh run into the same run directory is refused, and leaves the first run as it was.
    before = snapshot(tmp_path / "runs")
    done = run(["fit", "--config", str(small_config(tmp_path))], tmp_path, base["cache"])
    assert_user_error(done, "already holds checkpoints", "--ckpt_path last")
    assert snapshot(tmp_path / "runs") == before


def test_non_finite_loss_is_reported_once(tmp_path, base, untouched):
    done = run(["fit", "--config", str(small_config(tmp_path)), "--model.init_args.optimizer.lr", "1e15",
                "--trainer.gradient_clip_val", "null"], tmp_path, base["cache"])
    assert_user_error(done, "non-finite loss at global step", "lower the learning rate")


def test_debug_shows_the_traceback(tmp_path, base):
    done = run(["eval", "--draft", str(tmp_path / "none"), "--target", "tiny", "--out", str(tmp_path / "e"),
                "--debug"], tmp_path, base["cache"])
    assert done.returncode != 0 and "Traceback" in done.stderr


# ----------------------------------------------------------------------------- eval / regen / quickstart
def test_eval_and_regen_errors(tmp_path, base, untouched):
    hf, out, cache = str(base["hf"]), str(tmp_path / "eval"), base["cache"]
    broken = tmp_path / "broken"
    shutil.copytree(base["hf"], broken)
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    bad_prompts = tmp_path / "prompts.jsonl"
    bad_prompts.write_bytes(b'{"messages": [{"role": "user", "content": "\xff"}]}\n')
    cases = [
        (["eval", "--draft", hf, "--target", '{"tiny": {"hidden_size": 32, "head_dim": 8}}', "--out", out],
         ["hidden_size 64", "32"]),
        (["eval", "--draft", str(tmp_path / "none"), "--target", "tiny", "--out", out], ["none/config.json"]),
        (["eval", "--draft", str(broken), "--target", "tiny", "--out", out], ["model.safetensors", "truncated"]),
        (["eval", "--draft", hf, "--target", '{"tiny": {}', "--out", out], ["--target", "not valid JSON"]),
        (["eval", "--draft", hf, "--target", '{"tni": {}}', "--out", out], ["unknown field", "tni"]),
        (["eval", "--draft", hf, "--target", "tiny", "--out", out, "--prompts", "nope.jsonl"],
         ["nope.jsonl", "does not exist"]),
        (["eval", "--draft", hf, "--target", "tiny", "--out", out, "--max-new-tokens", "0"], ["max_new_tokens=0"]),
        (["eval", "--draft", hf, "--target", "tiny", "--out", out, "--threads", "many"], ["--threads 'many'"]),
        (["eval", "--draft", hf, "--out", out], ["dflash2 eval", "--target"]),
        (["regen", "--target", "tiny", "--prompts", str(bad_prompts), "--out", str(tmp_path / "r.jsonl")],
         ["prompts.jsonl:1", "not UTF-8"]),
        (["regen", "--target", "tiny", "--out", str(tmp_path / "r.jsonl"), "--batch-size", "0"], ["batch_size=0"]),
        (["regen", "--target", "tiny", "--out", str(tmp_path / "r.jsonl"), "--bogus"], ["unrecognized", "--bogus"]),
        (["quickstart", "--threads", "abc", "--out", str(tmp_path / "q")], ["--threads 'abc'"]),
        (["quickstart", "--num-prompts", "0", "--out", str(tmp_path / "q")], ["num_prompts=0"]),
    ]
    for args, needles in cases:
        assert_user_error(run(args, tmp_path, cache), *needles)
    assert not (tmp_path / "eval").exists() and not (tmp_path / "r.jsonl").exists()


def test_eval_records_threads_and_load(tmp_path, base):
    out = tmp_path / "eval"
    done = run(["eval", "--draft", str(base["hf"]), "--target", "tiny", "--out", str(out), "--max-prompts", "1",
                "--max-new-tokens", "8", "--no-progress", "--threads", "1"], tmp_path, base["cache"])
    assert done.returncode == 0, done.stderr[-3000:]
    machine = json.loads((out / "eval.json").read_text())["machine"]
    assert machine["torch_threads"] == 1 and machine["cpus"] == os.cpu_count()
    assert isinstance(machine["timing_trusted"], bool) and "load_average_start" in machine
    if not machine["timing_trusted"]:
        assert "timings may not be trusted" in done.stdout


# ----------------------------------------------------------------------------- export/to_onnx.py
def test_to_onnx_errors_and_the_shared_target_spec(tmp_path, base, untouched):
    hf, cache = str(base["hf"]), base["cache"]
    assert_user_error(run(["--draft", str(tmp_path / "none"), "--target", "tiny", "--out", str(tmp_path / "o")],
                          tmp_path, cache, TO_ONNX), "config.json")
    assert_user_error(run(["--draft", hf, "--target", '{"tiny": {"hidden_size": 32, "head_dim": 8}}', "--out",
                           str(tmp_path / "o")], tmp_path, cache, TO_ONNX), "does not fit the draft", "hidden_size=32")
    assert_user_error(run(["--draft", hf], tmp_path, cache, TO_ONNX), "--target", "--out")
    # A JSON TargetSpec, as `dflash2 eval` takes it, is accepted; torchvision's warnings are gone.
    done = run(["--draft", hf, "--target", '{"tiny": {}}', "--out", str(tmp_path / "o"), "--no-verify"],
               tmp_path, cache, TO_ONNX)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchvision" not in done.stderr
    assert (tmp_path / "o" / "draft_step.onnx").is_file()
