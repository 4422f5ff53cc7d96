"""Bad input and faults, through the entry points (``dflash2 ...``, ``python export/to_onnx.py``).

A refusal runs in this process (:func:`refused_here`, :mod:`cli_helpers`); what needs a process of its own runs the
installed script (:func:`run`): the trainings, ``--debug``'s traceback, signals, the warnings a user sees, and
one refusal per kind of action, so the real exit status and stderr stay covered. A new interpreter costs
~5 s of imports on 2 cores, which 60 refusals paid before.

Every case asserts the exit status (2: the user's mistake), that stderr is short, carries one
``dflash2: error:`` line naming the file / field / value and no traceback, and that nothing already
written (a trained run, a feature cache) was changed. A few good cases sit beside them (target
overrides that must work, ``--ckpt_path last`` on an empty run directory, ``--debug``).

Machine faults use small tmpfs mounts (a full disk, a read-only file system); where ``mount -t tmpfs``
is not allowed (not root) those cases are skipped, saying why. Servers that fail are a local HTTP server
in the test.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_here
from llamacpp_helpers import vocab_gguf
from module_helpers import data_args
from serving_fakes import LocalServer

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
    trainer.update(
        max_steps=4, val_check_interval=2, limit_val_batches=1, log_every_n_steps=1, enable_progress_bar=False
    )
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(directory / "runs")
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    for key, value in (model or {}).items():  # an option group is merged into the config's, not replaced
        init_args = config["model"]["init_args"]
        init_args[key] = {**init_args.get(key, {}), **value} if isinstance(value, dict) else value
    config["data"]["init_args"].update(data_args(**{"max_samples": 48, **data}))
    path = directory / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def environment(cache: Path, **extra: str) -> dict[str, str]:
    """The entry points' environment: one thread, no hub, the shared cache, the tests' helpers importable."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DFLASH2_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }
    env.pop("DFLASH2_DEBUG", None)
    return env


def command(args: list[str], script: Path | None = DFLASH2) -> list[str]:
    if script is DFLASH2 and not DFLASH2.exists():
        pytest.skip(f"{DFLASH2} not found: install the package first (pip install -e .)")
    return [str(script), *args] if script is DFLASH2 else [sys.executable, str(script), *args]


def run(
    args: list[str], cwd: Path, cache: Path, script: Path | None = DFLASH2, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(args, script), cwd=cwd, env=environment(cache, **env), capture_output=True, text=True, timeout=600
    )


def refused_here(args: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    """``dflash2 ARGS`` in this process with :func:`run`'s environment: for the cases refused before anything runs."""
    return run_here(args, cwd, {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DFLASH2_CACHE": str(cache)})


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
    config = small_config(
        offline, model={"objective": {"token_loss": "ce"}}, mode="offline", cache_dir=str(offline / "features")
    )
    done = run(["fit", "--config", str(config)], offline, cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "root": root,
        "cache": cache,
        "run": root / "runs" / "tiny" / "default",
        "hf": root / "runs" / "tiny" / "default" / "hf",
        "features": offline / "features",
    }


@pytest.fixture
def untouched(base):
    """Fails the test if the shared run or cache changed while it ran."""
    before = snapshot(base["run"], base["features"])
    yield
    assert snapshot(base["run"], base["features"]) == before, "a failing command changed existing outputs"


# ----------------------------------------------------------------------------- fit: config and CLI
@pytest.mark.parametrize(
    "override, needles",
    [
        (
            ["--model.init_args.selector_rnak", "3"],
            ["model.init_args.selector_rnak", "did you mean draft.selector_rank"],
        ),
        (["--trainer.max_stepz", "3"], ["--trainer.max_stepz", "did you mean --trainer.max_steps"]),
        (["--data.init_args.bach_size", "3"], ["data.init_args.bach_size", "did you mean batch_size"]),
        (
            ["--model.init_args.draft.selector_rank", "sixteen"],
            ["model.init_args.draft.selector_rank='sixteen'", "int"],
        ),
        (["--model.init_args.draft.projector_type", "dflash3"], ["projector_type='dflash3'", "dflash2"]),
        (["--model.init_args.draft.conv_kernel_size", "9"], ["conv_kernel_size=9", "block_size=8"]),
        (["--data.init_args.seq_len", "60"], ["seq_len=60", "multiple of block_size=8"]),
        (["--model.init_args.target", "null"], ["model.init_args.target is missing"]),
        (["--model.init_args.target.path", "/nonexistent/model"], ["/nonexistent/model", "not a Hugging Face model"]),
        (["--model.init_args.target.tiny", "null"], ["model.init_args.target is missing"]),
        (["--data.init_args.train_files", "[missing.jsonl]"], ["train_files", "missing.jsonl", "does not exist"]),
    ],
)
def test_fit_config_errors(tmp_path, base, untouched, override, needles):
    done = refused_here(["fit", "--config", str(small_config(tmp_path)), *override], tmp_path, base["cache"])
    assert_user_error(done, *needles)
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_typo_in_a_config_file_names_the_file(tmp_path, base, untouched):
    config = small_config(tmp_path)
    config.write_text(config.read_text().replace("selector_rank:", "selector_rnak:"))
    assert_user_error(
        run(["fit", "--config", str(config)], tmp_path, base["cache"]),
        "selector_rnak",
        "did you mean draft.selector_rank",
        str(config),
    )
    assert_user_error(
        run(["fit", "--config", str(tmp_path / "nope.yaml")], tmp_path, base["cache"]), "nope.yaml", "does not exist"
    )


def test_kd_offline_without_logits_is_refused_before_the_cache_is_built(tmp_path, base, untouched):
    cache_dir = tmp_path / "features"
    config = small_config(tmp_path, mode="offline", cache_dir=str(cache_dir))  # tiny.yaml trains with kd
    assert_user_error(refused_here(["fit", "--config", str(config)], tmp_path, base["cache"]), "teacher_top_k", "kd")
    assert not cache_dir.exists()


def test_a_new_target_kind_replaces_the_configs_target(tmp_path, base):
    # tiny.yaml says `tiny: {}`: naming a gguf (or a JSON spec) replaces it instead of naming two targets.
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"\0" * 4096)
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path)), "--model.init_args.target.gguf", str(bad)],
        tmp_path,
        base["cache"],
    )
    assert_user_error(done, str(bad), "is not a GGUF file")
    assert not (base["cache"] / "hf").exists()  # refused before the conversion cache was touched
    for i, spec in enumerate(['{"tiny": {"num_hidden_layers": 2}}', "{tiny: {}, seed: 1}"]):
        work = tmp_path / f"run{i}"
        work.mkdir()
        done = run(
            ["fit", "--config", str(small_config(work)), "--model.init_args.target", spec, "--trainer.max_steps", "1"],
            work,
            base["cache"],
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((work / "runs" / "tiny" / "default" / "hf" / "config.json").read_text())


def test_corrupt_gguf_with_a_valid_magic_is_one_line_and_leaves_no_directory(tmp_path, base):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2048))
    cache = tmp_path / "cache"
    done = run(
        ["eval", "--draft", str(base["hf"]), "--target", str(bad), "--out", str(tmp_path / "e")], tmp_path, cache
    )
    assert_user_error(done, str(bad), "cannot be loaded")
    assert not list(cache.rglob("*")), f"left behind: {list(cache.rglob('*'))}"


# ----------------------------------------------------------------------------- fit: data files
@pytest.mark.parametrize(
    "content, needles",
    [
        (b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n', ["train.jsonl:2", "not UTF-8", "0xe9"]),
        (b'{"text": "fine"}\n{"text": broken\n', ["train.jsonl:2", "invalid JSON", "column 10"]),
        (b'{"text": "fine"}\n{"text": "unterminated\n', ["train.jsonl:2", "invalid JSON"]),
        (b'{"text": "fine"}\n{"txt": "no key"}\n', ["train.jsonl:2", "'text', 'messages' or 'conversations'"]),
        (b'{"text": "fine"}\n{"messages": [{"role": "user"}]}\n', ["train.jsonl:2", "turn 0"]),
        (
            b'{"text": "fine"}\n{"messages": [{"role": "user", "content": "q"}, {"role": "asistant", "content": "a"}]}\n',
            ["train.jsonl:2", "turn 1", "unknown role 'asistant'", "assistant"],
        ),
    ],
)
def test_bad_data_files_name_file_and_line(tmp_path, base, untouched, content, needles):
    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path, train_files=[str(data)]))], tmp_path, base["cache"]
    )
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
    config = small_config(tmp_path, model={"objective": {"token_loss": "ce"}}, mode="offline", cache_dir=str(cache_dir))
    done = refused_here(["fit", "--config", str(config)], tmp_path, base["cache"])
    assert_user_error(done, name, str(cache_dir), "rebuild")
    assert snapshot(cache_dir) == damaged  # reported, not silently rebuilt or deleted
    assert not list((tmp_path / "runs").rglob("*.ckpt"))  # no training step ran on it


# ----------------------------------------------------------------------------- fit: checkpoints and faults
def test_resume_from_a_truncated_checkpoint_names_it(tmp_path, base, untouched):
    run_dir = tmp_path / "runs" / "tiny" / "default"
    shutil.copytree(base["run"], run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    os.truncate(last, last.stat().st_size // 2)
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path)), "--ckpt_path", "last"], tmp_path, base["cache"]
    )
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
    done = refused_here(["fit", "--config", str(small_config(tmp_path))], tmp_path, base["cache"])
    assert_user_error(done, "already holds checkpoints", "--ckpt_path last")
    assert snapshot(tmp_path / "runs") == before


def test_non_finite_loss_is_reported_once(tmp_path, base, untouched):
    done = run(
        [
            "fit",
            "--config",
            str(small_config(tmp_path)),
            "--model.init_args.optimizer.lr",
            "1e15",
            "--trainer.gradient_clip_val",
            "null",
        ],
        tmp_path,
        base["cache"],
    )
    assert_user_error(done, "non-finite loss at global step", "lower the learning rate")


def test_debug_shows_the_traceback(tmp_path, base):
    done = run(
        ["eval", "--draft", str(tmp_path / "none"), "--target", "tiny", "--out", str(tmp_path / "e"), "--debug"],
        tmp_path,
        base["cache"],
    )
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
        (
            ["eval", "--draft", hf, "--target", '{"tiny": {"hidden_size": 32, "head_dim": 8}}', "--out", out],
            ["hidden_size 64", "32"],
        ),
        (["eval", "--draft", str(tmp_path / "none"), "--target", "tiny", "--out", out], ["none/config.json"]),
        (["eval", "--draft", str(broken), "--target", "tiny", "--out", out], ["model.safetensors", "truncated"]),
        (["eval", "--draft", hf, "--target", '{"tiny": {}', "--out", out], ["--target", "not valid JSON"]),
        (["eval", "--draft", hf, "--target", '{"tni": {}}', "--out", out], ["unknown field", "tni"]),
        (
            ["eval", "--draft", hf, "--target", "tiny", "--out", out, "--prompts", "nope.jsonl"],
            ["nope.jsonl", "does not exist"],
        ),
        (
            ["eval", "--draft", hf, "--target", "tiny", "--out", out, "--max-new-tokens", "0"],
            ["--max-new-tokens", "0 is invalid: must be >= 1"],
        ),
        (
            ["eval", "--draft", hf, "--target", "tiny", "--out", out, "--resamples", "0"],  # at parse time, not after
            ["--resamples", "0 is invalid: must be >= 1"],
        ),  # the whole decoding loop
        (["eval", "--draft", hf, "--target", "tiny", "--out", out, "--threads", "many"], ["--threads 'many'"]),
        (["eval", "--draft", hf, "--out", out], ["dflash2 eval", "--target"]),
        (
            ["regen", "--target", "tiny", "--prompts", str(bad_prompts), "--out", str(tmp_path / "r.jsonl")],
            ["prompts.jsonl:1", "not UTF-8"],
        ),
        (
            ["regen", "--target", "tiny", "--out", str(tmp_path / "r.jsonl"), "--batch-size", "0"],
            ["--batch-size", "0 is invalid: must be >= 1"],
        ),
        (
            [
                "regen",
                "--target",
                "tiny",
                "--out",
                str(tmp_path / "r.jsonl"),
                "--server",
                "http://127.0.0.1:9/v1",
                "--concurrency",
                "0",
            ],
            ["--concurrency", "0 is invalid: must be >= 1"],
        ),
        (["regen", "--target", "tiny", "--out", str(tmp_path / "r.jsonl"), "--bogus"], ["unrecognized", "--bogus"]),
        (["quickstart", "--num-prompts", "0", "--out", str(tmp_path / "q")], ["num_prompts=0"]),
    ]
    for args, needles in cases:
        assert_user_error(refused_here(args, tmp_path, cache), *needles)
    # the installed script's own exit status and stderr (the refusals above ran in this process)
    quickstart = ["quickstart", "--threads", "abc", "--out", str(tmp_path / "q")]
    assert_user_error(run(quickstart, tmp_path, cache), "--threads: 'abc' is invalid")
    assert not (tmp_path / "eval").exists() and not (tmp_path / "r.jsonl").exists()


def test_eval_records_threads_and_load(tmp_path, base):
    out = tmp_path / "eval"
    done = run(
        [
            "eval",
            "--draft",
            str(base["hf"]),
            "--target",
            "tiny",
            "--out",
            str(out),
            "--max-prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--no-progress",
            "--threads",
            "1",
        ],
        tmp_path,
        base["cache"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    machine = json.loads((out / "eval.json").read_text())["machine"]
    assert machine["torch_threads"] == 1 and machine["cpus"] == os.cpu_count()
    assert isinstance(machine["timing_trusted"], bool) and "load_average_start" in machine
    if not machine["timing_trusted"]:
        assert "timings may not be trusted" in done.stdout


# ----------------------------------------------------------------------------- export/to_onnx.py
def test_to_onnx_errors_and_the_shared_target_spec(tmp_path, base, untouched):
    hf, cache = str(base["hf"]), base["cache"]
    # the script is `dflash2 export-onnx`: its refusals run here, one through the script itself
    assert_user_error(
        refused_here(
            ["export-onnx", "--draft", str(tmp_path / "none"), "--target", "tiny", "--out", str(tmp_path / "o")],
            tmp_path,
            cache,
        ),
        "config.json",
    )
    assert_user_error(
        refused_here(
            [
                "export-onnx",
                "--draft",
                hf,
                "--target",
                '{"tiny": {"hidden_size": 32, "head_dim": 8}}',
                "--out",
                str(tmp_path / "o"),
            ],
            tmp_path,
            cache,
        ),
        "does not fit the draft",
        "hidden_size=32",
    )
    assert_user_error(run(["--draft", hf], tmp_path, cache, TO_ONNX), "--target", "--out")
    # A JSON TargetSpec, as `dflash2 eval` takes it, is accepted; torchvision's warnings are gone.
    done = run(
        ["--draft", hf, "--target", '{"tiny": {}}', "--out", str(tmp_path / "o"), "--no-verify"],
        tmp_path,
        cache,
        TO_ONNX,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchvision" not in done.stderr
    assert (tmp_path / "o" / "draft_step.onnx").is_file()


# ============================================================================= faults (issue 31)
@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, size, read_only=False)``: a small tmpfs mounted at ``tmp_path / name`` (unmounted after).

    Skips the test, saying why, where mounting is not allowed (not root, no ``mount``).
    """
    mounts: list[Path] = []

    def mount(name: str, size: str = "1m", read_only: bool = False) -> Path:
        target = tmp_path / name
        target.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no `mount` command: the full-disk and read-only cases need a small tmpfs")
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}): the full-disk and "
                "read-only cases need one (run the tests as root)"
            )
        mounts.append(target)
        return target

    yield mount
    for target in reversed(mounts):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def fill(directory: Path, leave: int) -> None:
    """Fill the file system of ``directory`` until only about ``leave`` bytes are free."""
    free = shutil.disk_usage(directory).free
    if free > leave:
        with open(directory / "filler", "wb") as f:
            f.write(b"\0" * (free - leave))


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------- full disks, read-only paths
def test_a_full_disk_during_fit_keeps_the_checkpoint_and_the_metrics(tmp_path, base, tmpfs):
    """The disk fills up while a resumed run trains: one line naming last.ckpt, the size needed and free; the
    previous checkpoint, the draft and every metrics row written before are as they were."""
    disk = tmpfs("disk", "4m")
    config = small_config(tmp_path)
    config.write_text(config.read_text().replace(str(tmp_path / "runs"), str(disk / "runs")))
    done = run(["fit", "--config", str(config)], tmp_path, base["cache"])
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = disk / "runs" / "tiny" / "default"
    kept = {p: p.read_bytes() for p in [run_dir / "checkpoints" / "last.ckpt", *sorted((run_dir / "hf").iterdir())]}
    metrics = csv_rows(run_dir / "metrics.csv")
    fill(disk, 200_000)  # room for the logs, not for the next checkpoint (~750 kB)
    done = run(
        ["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "6"], tmp_path, base["cache"]
    )
    assert_user_error(done, "disk full while writing", "checkpoints/last.ckpt", "needed", "free")
    assert {p: p.read_bytes() for p in kept} == kept
    after = csv_rows(run_dir / "metrics.csv")  # every row written before is there (some logged again, same values)
    assert all(any(row.items() <= other.items() for other in after) for row in metrics), "a metrics row was lost"
    assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp")]


def test_offline_cache_on_a_full_disk_is_refused_before_it_is_built(tmp_path, base, untouched, tmpfs):
    disk = tmpfs("disk", "256k")  # the cache needs about 420 kB
    config = small_config(
        tmp_path, model={"objective": {"token_loss": "ce"}}, mode="offline", cache_dir=str(disk / "cache")
    )
    # fit's plan refuses first, before the target is loaded; without the plan the build's own check does.
    done = run(["fit", "--config", str(config)], tmp_path, base["cache"])
    assert_user_error(
        done, "this run does not fit: the offline cache needs", str(disk / "cache"), "free", "--plan.check false"
    )
    assert list(disk.iterdir()) == []
    done = run(["fit", "--config", str(config), "--plan.check", "false"], tmp_path, base["cache"])
    assert_user_error(done, "disk full while writing the offline feature cache", str(disk / "cache"), "needed", "free")
    assert list(disk.iterdir()) == []  # no temporary directory, no Bus error


def test_export_and_regen_on_a_full_disk(tmp_path, base, untouched, tmpfs):
    disk = tmpfs("disk", "64k")
    target = vocab_gguf(tmp_path / "target.gguf", 512)
    done = run(
        ["export-gguf", "--draft", str(base["hf"]), "--target", str(target), "--out", str(disk / "d.gguf")],
        tmp_path,
        base["cache"],
    )
    assert_user_error(done, f"disk full while writing {disk / 'd.gguf'}", "needed", "free")
    assert list(disk.iterdir()) == []
    fill(disk, 8192)  # room for the log's header and a batch of responses, not for all of them
    # regen: the log of finished responses keeps whole lines; the output is never half written.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"tell me about {i}"}]}) + "\n" for i in range(40))
    )
    done = run(
        [
            "regen",
            "--target",
            "tiny",
            "--prompts",
            str(prompts),
            "--out",
            str(disk / "r.jsonl"),
            "--max-new-tokens",
            "48",
            "--no-progress",
        ],
        tmp_path,
        base["cache"],
    )
    assert_user_error(done, "disk full while writing", "r.jsonl", "needed", "free")
    assert not (disk / "r.jsonl").exists()
    log = disk / "r.jsonl.partial"
    assert all(json.loads(line) for line in log.read_text().splitlines())  # only whole lines


def test_read_only_and_blocked_paths_name_the_users_path(tmp_path, base, untouched, tmpfs):
    ro = tmpfs("ro", "64k", read_only=True)
    hf, cache = str(base["hf"]), base["cache"]
    target = vocab_gguf(tmp_path / "target.gguf", 512)
    (tmp_path / "afile").write_text("a file, not a directory")
    (tmp_path / "existing_dir").mkdir()
    gguf_out = ["export-gguf", "--draft", hf, "--target", str(target), "--out"]
    cases = [
        (gguf_out + [str(ro / "d.gguf")], DFLASH2, [f"{ro / 'd.gguf'} is on a read-only file system"]),
        (gguf_out + [str(tmp_path / "afile" / "d.gguf")], DFLASH2, ["afile is a file, not a directory"]),
        (gguf_out + [str(tmp_path / "existing_dir")], DFLASH2, ["existing_dir is a directory, not a file"]),
        (
            ["serve-help", "--draft", hf, "--out", str(ro / "SERVING.md")],
            DFLASH2,
            [f"{ro / 'SERVING.md'} is on a read-only file system"],
        ),
        (["--draft", hf, "--target", "tiny", "--out", str(ro / "onnx")], TO_ONNX, ["ro/onnx", "read-only"]),
    ]
    for args, script, needles in cases:
        done = run(args, tmp_path, cache, script) if script is TO_ONNX else refused_here(args, tmp_path, cache)
        line = assert_user_error(done, *needles)
        assert ".tmp" not in line, line  # the user's path, never an internal temporary file
    # fit from a read-only working directory (the run directory is relative to it)
    done = refused_here(["fit", "--config", str(TINY)], ro, cache)
    assert_user_error(done, "runs", "read-only file system")


# ----------------------------------------------------------------------------- concurrent runs, resumes
def test_a_second_fit_in_a_run_directory_is_refused_and_a_killed_ones_lock_is_not_stale(tmp_path, base):
    config = small_config(tmp_path)
    text = yaml.safe_load(config.read_text())
    text["trainer"]["callbacks"].append({"class_path": "kill_helpers.StallingValidation"})
    config.write_text(yaml.safe_dump(text, sort_keys=False))
    mark, release = tmp_path / "validating", tmp_path / "release"

    def start(step: int, *extra: str) -> subprocess.Popen:
        """A fit held inside its validation at global step ``step`` (until ``release`` exists)."""
        mark.unlink(missing_ok=True)
        env = environment(
            base["cache"],
            DFLASH2_TEST_VAL_MARK=str(mark),
            DFLASH2_TEST_VAL_RELEASE=str(release),
            DFLASH2_TEST_VAL_STALL="300",
            DFLASH2_TEST_VAL_STEP=str(step),
        )
        proc = subprocess.Popen(
            command(["fit", "--config", str(config), *extra]),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and mark.exists(), proc.stderr.read()[-3000:]
        return proc  # inside its first validation, holding the run directory

    first = start(2)
    done = run(["fit", "--config", str(config)], tmp_path, base["cache"])
    assert_user_error(done, "runs/tiny/default is in use by another fit", f"pid {first.pid}", "another logger version")
    release.write_text("go")
    assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    first.stderr.close()
    run_dir = tmp_path / "runs" / "tiny" / "default"
    steps = [int(r["step"]) for r in csv_rows(run_dir / "metrics.csv") if r.get("train/loss")]
    assert steps == [0, 1, 2, 3]  # every row once
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 1
    assert not (run_dir / ".fit.lock").exists()

    # A fit killed while it holds the lock leaves the file, not the lock: the resume takes it.
    release.unlink()
    killed = start(4, "--ckpt_path", "last", "--trainer.max_steps", "6")  # in the rerun of the step-4 validation
    assert (run_dir / ".fit.lock").exists()
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    killed.stderr.close()
    done = run(
        ["fit", "--config", str(small_config(tmp_path)), "--ckpt_path", "last", "--trainer.max_steps", "6"],
        tmp_path,
        base["cache"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not resumable" not in done.stderr
    steps = [int(r["step"]) for r in csv_rows(run_dir / "metrics.csv") if r.get("train/loss")]
    assert steps == list(range(6))


@pytest.mark.parametrize(
    "override, needles",
    [
        (
            ["--model.init_args.target", '{"tiny": {"num_hidden_layers": 3}}'],
            ["trained against another target", "num_layers 4", "num_layers 3", "fingerprint"],
        ),
        (["--model.init_args.target", '{"tiny": {}, "seed": 7}'], ["trained against another target", '"seed": 7']),
        (["--model.init_args.draft.selector_rank", "8"], ["another geometry", "selector_rank=16 (this run: 8)"]),
    ],
)
def test_resuming_against_another_target_or_draft_is_refused(tmp_path, base, untouched, override, needles):
    run_dir = tmp_path / "runs" / "tiny" / "default"
    shutil.copytree(base["run"], run_dir)
    before = snapshot(run_dir)
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path)), "--ckpt_path", "last", *override], tmp_path, base["cache"]
    )
    assert_user_error(done, "last.ckpt", *needles, "start a new run")
    assert snapshot(run_dir) == before  # hf/, config.yaml, metrics.csv: nothing rewritten


@pytest.mark.parametrize(
    "ckpt, needles",
    [
        ("best", ["--ckpt_path best is invalid for fit", "--ckpt_path last"]),
        ("missing.ckpt", ["--ckpt_path missing.ckpt does not exist"]),
    ],
)
def test_ckpt_path_values_that_cannot_resume(tmp_path, base, untouched, ckpt, needles):
    assert_user_error(
        refused_here(["fit", "--config", str(small_config(tmp_path)), "--ckpt_path", ckpt], tmp_path, base["cache"]),
        *needles,
    )
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- data, prompts, configs
def test_a_split_by_prompt_that_leaves_training_nothing_is_refused(tmp_path, base, untouched):
    chat = lambda q, a: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps(chat("What is two plus two?", f"Four ({i}).")) + "\n" for i in range(30))
        + json.dumps(chat("Another question?", "Yes."))
        + "\n"
    )
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path, train_files=[str(data)]))], tmp_path, base["cache"]
    )
    assert_user_error(
        done, "hold out 30 of 31 records and train on 1", "val_fraction=0.05", "30 responses", "val_files"
    )
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before any training step


def test_prompts_past_the_targets_context(tmp_path, base, untouched):
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": " ".join(["word"] * 3000)}]})
        + "\n"
    )
    out = tmp_path / "r.jsonl"
    for args in (
        ["regen", "--target", "tiny", "--out", str(out)],
        ["eval", "--draft", str(base["hf"]), "--target", "tiny", "--out", str(tmp_path / "e")],
    ):
        assert_user_error(
            refused_here([*args, "--prompts", str(long)], tmp_path, base["cache"]),
            "1 of 2 prompts do not fit the target's context",
            "prompt 2",
            "2048 positions",
            "--prompt-overflow truncate",
        )
    assert not out.exists() and not (tmp_path / "e").exists()
    done = run(
        [
            "regen",
            "--target",
            "tiny",
            "--out",
            str(out),
            "--prompts",
            str(long),
            "--prompt-overflow",
            "truncate",
            "--max-new-tokens",
            "4",
            "--no-progress",
        ],
        tmp_path,
        base["cache"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "1 of 2 prompts were longer than the target's context allows and were cut to their last 2044 tokens"
        in done.stderr
    )
    assert len(out.read_text().splitlines()) == 2
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path)), "--data.init_args.seq_len", "4096"], tmp_path, base["cache"]
    )
    assert_user_error(done, "seq_len=4096", "max_position_embeddings=2048")


@pytest.mark.parametrize(
    "edit, needles",
    [
        (("max_steps:", "max_stepz:"), ["trainer.max_stepz is not a setting", "did you mean trainer.max_steps"]),
        (
            ("gradient_clip_val:", "gradient_clip_vall:"),
            ["trainer.gradient_clip_vall", "did you mean trainer.gradient_clip_val"],
        ),
        (("\ntrainer:", "\ntrainr:"), ["trainr.", "did you mean trainer."]),
        (("tiny: {}", "tny: {}"), ["model.init_args.target.tny is not a field of the target", "did you mean tiny"]),
        (("tiny: {}", "pth: /models/x"), ["model.init_args.target.pth", "did you mean", "path?"]),
    ],
)
def test_typos_in_a_config_file_name_the_file_and_the_closest_key(tmp_path, base, untouched, edit, needles):
    config = small_config(tmp_path)
    text = config.read_text()
    assert edit[0] in text
    config.write_text(text.replace(edit[0], edit[1], 1))
    assert_user_error(
        refused_here(["fit", "--config", str(config)], tmp_path, base["cache"]), *needles, str(config.name)
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "spec, needles",
    [
        ('{"tny": {}}', ["model.init_args.target.tny is not a field of the target", "did you mean tiny"]),
        ('{"pth": "/models/x"}', ["model.init_args.target.pth", "did you mean path"]),
    ],
)
def test_typos_in_a_target_on_the_command_line(tmp_path, base, untouched, spec, needles):
    done = refused_here(
        ["fit", "--config", str(small_config(tmp_path)), "--model.init_args.target", spec], tmp_path, base["cache"]
    )
    assert_user_error(done, *needles, "on the command line")
    assert not (tmp_path / "runs").exists()


def test_the_tiny_configs_draft_exports_to_gguf_and_a_wider_selector_says_how_to_fix_it(tmp_path, base, untouched):
    target = vocab_gguf(tmp_path / "target.gguf", 512)
    done = run(
        ["export-gguf", "--draft", str(base["hf"]), "--target", str(target), "--out", str(tmp_path / "d.gguf")],
        tmp_path,
        base["cache"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wide = tmp_path / "wide"
    shutil.copytree(base["hf"], wide)
    config = json.loads((wide / "config.json").read_text())
    config["dflash_config"]["selector_top_k"] = 8  # the codebooks' shapes do not depend on top_k
    (wide / "config.json").write_text(json.dumps(config))
    done = refused_here(
        ["export-gguf", "--draft", str(wide), "--target", str(target), "--out", str(tmp_path / "w.gguf")],
        tmp_path,
        base["cache"],
    )
    assert_user_error(done, "selector_top_k=8 is too large for llama.cpp", "selector_top_k <= 7")
    assert not (tmp_path / "w.gguf").exists()


# ----------------------------------------------------------------------------- servers that fail
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FlakyServer(LocalServer):
    """An OpenAI-style server whose first ``ok`` completions answer (slowly), then every one fails with HTTP 500."""

    def __init__(self, ok: int) -> None:
        super().__init__(_FlakyHandler)
        self.ok, self.calls, self.answered, self.lock = ok, 0, 0, threading.Lock()


class _FlakyHandler(BaseHTTPRequestHandler):
    server: FlakyServer

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, json.dumps({"data": [{"id": "fake"}]}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            n, self.server.calls = self.server.calls, self.server.calls + 1
        if n >= self.server.ok:
            return self._send(500, b"internal error\nwith a second line", "text/plain")
        time.sleep(0.3)  # still running when a later request fails: its answer must be kept too
        with self.server.lock:
            self.server.answered += 1
        self._send(200, json.dumps({"choices": [{"text": f"answer {n}", "finish_reason": "stop"}]}).encode())


def test_regen_server_failures(tmp_path, base):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(60))
    )
    out = tmp_path / "r.jsonl"
    args = [
        "regen",
        "--target",
        "tiny",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--no-progress",
        "--max-new-tokens",
        "8",
        "--concurrency",
        "4",
    ]
    port = free_port()
    assert_user_error(
        run([*args, "--server", f"http://127.0.0.1:{port}/v1"], tmp_path, base["cache"]),
        f"http://127.0.0.1:{port}/v1/models did not answer",
        "Connection refused",
        "server running",
    )
    server = FlakyServer(ok=19)
    server.start()
    try:
        done = run([*args, "--server", f"{server.url}/v1"], tmp_path, base["cache"])
    finally:
        server.stop()
    line = assert_user_error(done, "answered HTTP 500", f"{server.answered} of 60 responses are kept", "rerun")
    assert server.answered == 19, line
    records = [json.loads(x) for x in (tmp_path / "r.jsonl.partial").read_text().splitlines()[1:]]
    assert len(records) == server.answered  # every answer that completed is kept, none dropped
    assert not out.exists()
