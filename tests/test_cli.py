"""The command line: configs run end to end, --print_config round-trips, bad input fails clearly."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from module_helpers import data_args

from dflash2_lightning import cli
from dflash2_lightning.data.records import DataError
from dflash2_lightning.train import lightning_cli

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
SCRIPTS = Path(sys.executable).parent


def small_config(tmp_path: Path, name: str = "tiny.yaml", **data) -> Path:
    """configs/tiny.yaml shortened for tests: 4 steps, validation and a checkpoint every 2, under tmp_path."""
    config = yaml.safe_load(TINY.read_text())
    trainer = config["trainer"]
    trainer.update(
        max_steps=4, val_check_interval=2, limit_val_batches=1, log_every_n_steps=1, enable_progress_bar=False
    )
    for logger in trainer["logger"]:
        logger["init_args"]["save_dir"] = str(tmp_path / "runs")
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["data"]["init_args"].update(data_args(**{"max_samples": 64, **data}))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def argv(monkeypatch):
    """Quiet the 'args and sys.argv' warning of in-process LightningCLI calls."""
    monkeypatch.setattr(sys, "argv", ["dflash2"])


def test_fit_end_to_end_in_process(tmp_path, argv, capsys):
    config = small_config(tmp_path)
    run = tmp_path / "runs" / "tiny" / "default"
    # What a killed earlier run left in every directory a fit writes atomically into (its plot and metrics in
    # the run directory, the export in hf/, checkpoints): a dead process's temporaries, removed by this fit.
    from dflash2_lightning import files

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    host = files.owner_prefix("x").split(".")[2].rsplit("-", 1)[0]
    orphans = [
        d / f".{name}.{host}-{done.pid}.abc123.tmp"
        for d, name in [
            (run, "acceptance.png"),
            (run, "metrics.csv"),
            (run / "hf", "model.safetensors"),
            (run / "checkpoints", "last.ckpt"),
        ]
    ]
    for orphan in orphans:
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"partial")
    cli.main(["fit", "--config", str(config)])
    assert not [o for o in orphans if o.exists()]
    rows = read_metrics(run)
    val = [r for r in rows if r.get("val/tau")]
    assert len(val) == 2  # a validation every 2 steps
    for key in ("val/backbone/accept_7", "val/selector/acc_1", "val/selector/coverage", "val/num_positions"):
        assert val[-1][key] != ""
    for k in range(1, 8):  # selector health beside the per-position acceptance
        recall, picked, passed = (float(val[-1][f"val/selector/{n}_{k}"]) for n in ("recall", "picked", "passed_over"))
        assert picked + passed == pytest.approx(recall) and 0 <= picked <= recall <= 1
    assert float(val[-1]["val/selector/picked_1"]) == pytest.approx(float(val[-1]["val/selector/accept_1"]))
    assert 1.0 <= float(val[-1]["val/tau"]) <= 8.0
    assert any(r.get("train/loss") for r in rows) and any(r.get("lr-AdamW/decay") for r in rows)
    assert (run / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()
    hf = json.loads((run / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["block_size"] == 8
    assert (run / "hf" / "model.safetensors").is_file()

    # A second fresh run into the same run directory is refused: resume it or pick another version.
    capsys.readouterr()
    assert cli.main(["fit", "--config", str(config)]) == 2
    assert "dflash2: error: run directory" in capsys.readouterr().err


def test_print_config_round_trips(tmp_path, argv, capsys):
    printed = []
    for source in (TINY, tmp_path / "printed.yaml"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["fit", "--config", str(source), "--model.init_args.optimizer.lr", "0.001", "--print_config"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        (tmp_path / "printed.yaml").write_text(text)
        printed.append(text)
    assert printed[0] == printed[1]
    full = yaml.safe_load(printed[0])
    assert full["model"]["init_args"]["optimizer"]["lr"] == 0.001
    assert full["model"]["init_args"]["target"]["tiny"] == {}
    assert "target" not in full["data"]["init_args"]  # linked from the model, given once


GPU = REPO / "configs" / "qwen3_8b_online.yaml"
GPU_OFFLINE = REPO / "configs" / "qwen3_8b_offline.yaml"
GPU_SHARDED = REPO / "configs" / "qwen3_235b_a22b_online.yaml"


@pytest.mark.parametrize(
    "config, override, message",
    [
        (TINY, ["--model.init_args.target", "null"], "model.init_args.target is missing"),
        (GPU, [], "model.init_args.target is missing"),  # the GPU recipes leave the target path to the user
        (GPU_OFFLINE, [], "model.init_args.target is missing"),
        (GPU_SHARDED, [], "model.init_args.target is missing"),  # shard: fsdp in the recipe, the path the user's
        # Checked from the config alone, before the target is loaded: the recipe's data file is not here.
        (
            GPU,
            ["--model.init_args.target.path", "/nonexistent/Qwen3-8B"],
            "train_files: data/train.jsonl does not exist",
        ),
        (
            GPU,
            ["--model.init_args.target.path", "/nonexistent/Qwen3-8B", "--data.init_args.train_files", f"[{TINY}]"],
            "is not a Hugging Face model directory",
        ),
        (
            GPU_SHARDED,
            [
                "--model.init_args.target.path",
                "/nonexistent/Qwen3-235B-A22B",
                "--data.init_args.train_files",
                f"[{TINY}]",
            ],
            "is not a Hugging Face model directory",
        ),
        (
            TINY,
            ["--model.init_args.draft.conv_kernel_size", "9"],
            "conv_kernel_size=9 is invalid: must satisfy 1 <= conv_kernel_size <= block_size=8",
        ),
        (TINY, ["--model.init_args.draft.block_size", "1"], "block_size=1 is invalid"),
        (
            TINY,
            ["--data.init_args.seq_len", "60"],
            "seq_len=60 is invalid: must be a positive multiple of block_size=8",
        ),
    ],
)
def test_bad_configs_fail_with_clear_messages(config, override, message, argv, capsys):
    assert cli.main(["fit", "--config", str(config), *override]) == 2  # all fail before training starts
    err = capsys.readouterr().err
    assert message in err and err.startswith("dflash2: error: ") and "Traceback" not in err


def test_bad_data_names_the_file_and_line(tmp_path, argv, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n{"text": broken\n')
    config = small_config(tmp_path, train_files=[str(data)])
    assert cli.main(["fit", "--config", str(config)]) == 2  # the exit status of the console script
    assert f"dflash2: error: {data}:2: invalid JSON" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"train.jsonl:2: invalid JSON"):  # build_cli callers get the exception
        lightning_cli.build_cli(["fit", "--config", str(config)])


def test_kd_offline_without_teacher_logits_is_refused(tmp_path, argv, capsys):
    config = small_config(tmp_path, mode="offline", cache_dir=str(tmp_path / "cache"))
    assert cli.main(["fit", "--config", str(config)]) == 2
    assert "teacher_top_k > 0" in capsys.readouterr().err


def _hello(args: list[str]) -> int:
    return len(args)


def test_actions_are_routed_before_lightning(monkeypatch):
    monkeypatch.setitem(cli.ACTIONS, "hello", cli.Action(f"{__name__}:_hello", "says hello", None))
    assert cli.main(["hello", "a", "b"]) == 2
    for name, action in cli.ACTIONS.items():  # every registered action resolves to a function
        assert callable(cli._entry(action.entry)), name


def test_help_lists_every_action_and_an_unknown_action_is_one_line(capsys):
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in [*cli.LIGHTNING_ACTIONS, *cli.ACTIONS]:
        assert f"\n  {name} " in listed
    assert cli.main(["evl"]) == 2
    assert capsys.readouterr().err == (
        "dflash2: error: 'evl' is not an action; did you mean 'eval'? `dflash2 --help` lists the actions\n"
    )


@pytest.mark.parametrize("action", sorted(cli.ACTIONS))
def test_every_action_says_what_it_writes_in_its_help(action, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([action, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ") and len(text) > 200


#: the actions that read a fit config (LightningCLI's parser, hence Lightning) or train
NEEDS_LIGHTNING = {"plan", "quickstart"}


def test_actions_that_do_not_train_start_without_lightning():
    """Their entry and options modules import neither Lightning nor jsonargparse (~3 s of every start on 2 cores:
    `dflash2 eval --help` waited for it)."""
    modules = sorted(
        {
            reference.split(":")[0]
            for name, action in cli.ACTIONS.items()
            if name not in NEEDS_LIGHTNING
            for reference in (action.entry, action.options or action.entry)
        }
    )
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'jsonargparse', 'torchmetrics') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"importing {modules} loaded {done.stdout.strip()}"


def _script(name: str) -> Path:
    path = SCRIPTS / name
    if not path.exists():
        pytest.skip(f"{path} not found: install the package first (pip install -e .)")
    return path


@pytest.mark.slow
def test_dflash2_script_runs_the_tiny_config_as_shipped(tmp_path):
    """`dflash2 fit --config configs/tiny.yaml`: the README quick start, unmodified, from a clean directory."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1"}  # one thread unless the caller says
    done = subprocess.run(
        [str(_script("dflash2")), "fit", "--config", str(TINY), "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "tiny" / "default"
    assert (run / "hf" / "config.json").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert [r for r in read_metrics(run) if r.get("val/tau")][-1]["step"] == "39"


@pytest.mark.slow
def test_lightning_script_runs_fit(tmp_path):
    """`lightning fit --config ...` is the same CLI (lightning 2.6 ships no script of that name)."""
    config = small_config(tmp_path)
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1"}  # one thread unless the caller says
    done = subprocess.run(
        [str(_script("lightning")), "fit", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "tiny" / "default" / "hf" / "model.safetensors").is_file()


def test_a_setting_outside_its_group_names_the_group(tmp_path, argv, capsys):
    """A module setting written outside its option group is refused with the grouped name to use instead."""
    config = tmp_path / "flat.yaml"
    config.write_text(
        "model:\n  class_path: dflash2_lightning.train.DFlash2Module\n  init_args:\n    target: {tiny: {}}\n"
        "    selector_rank: 16\n"
    )
    assert cli.main(["fit", "--config", str(config), "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: ") and err.count("\n") == 1, err
    assert "selector_rank" in err and "did you mean draft.selector_rank?" in err, err
    assert cli.main(["fit", "--config", str(TINY), "--model.init_args.lr", "0.1"]) == 2
    assert "did you mean optimizer.lr?" in capsys.readouterr().err
    # the data module's offline settings are a group too; a name two groups share names both
    assert cli.main(["fit", "--config", str(TINY), "--data.init_args.teacher_top_k", "8"]) == 2
    assert "did you mean offline.teacher_top_k?" in capsys.readouterr().err
    assert cli.main(["fit", "--config", str(TINY), "--data.init_args.cache_dir", "x"]) == 2
    assert "did you mean target.cache_dir or offline.cache_dir?" in capsys.readouterr().err


def test_a_truncated_checkpoint_named_explicitly_is_refused_as_last_refuses_it(tmp_path, argv, capsys):
    """`--ckpt_path trunc.ckpt` (fit and validate) gets the one line `--ckpt_path last` gets for the same file,
    before Lightning reads its hyperparameters; nothing is written."""
    import torch

    config = small_config(tmp_path)
    checkpoints = tmp_path / "runs" / "tiny" / "default" / "checkpoints"
    checkpoints.mkdir(parents=True)
    trunc = tmp_path / "trunc.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(4096)}, "global_step": 2}, trunc)
    os.truncate(trunc, trunc.stat().st_size // 2)
    (checkpoints / "last.ckpt").write_bytes(trunc.read_bytes())
    errors = {}
    for action, ckpt in (("fit", str(trunc)), ("validate", str(trunc)), ("fit", "last")):
        assert cli.main([action, "--config", str(config), "--ckpt_path", ckpt]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("dflash2")]
        assert len(lines) == 1 and "Traceback" not in err, err
        errors[(action, ckpt)] = lines[0]
    shown = {str(trunc): str(trunc), "last": str(checkpoints / "last.ckpt")}
    for (_action, ckpt), line in errors.items():
        assert line.startswith(f"dflash2: error: checkpoint {shown[ckpt]} cannot be read ("), line
        assert line.endswith(
            "it is truncated or not a Lightning checkpoint; delete it and resume from another "
            "checkpoint (--ckpt_path <file>), or start the run again"
        ), line
    assert sorted(p.name for p in checkpoints.parent.iterdir()) == ["checkpoints"]  # nothing written
