"""The pieces of the error pass, in-process (fast): message explanations, target overrides, temporaries,
cache checksums, the timing warning. The end-to-end cases run through the entry points in test_bad_input.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dflash2_lightning import files
from dflash2_lightning.data import feature_cache as data
from dflash2_lightning.train.lightning_cli import replace_target_overrides
from dflash2_lightning.train.config_messages import explain
from dflash2_lightning.data.records import DataError
from dflash2_lightning.errors import run_command, split_debug
from dflash2_lightning.threads import timing_warning

NOT_ACCEPTED = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'dflash2_lightning.train.module.DFlash2Module'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'dflash2_lightning.train.module.DFlash2Module':
        Option 'selector_rnak' is not accepted
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='selector_rnak', val='3')"""


def test_explain_names_the_key_and_the_closest_valid_one():
    text = explain(NOT_ACCEPTED, ["c.yaml"])
    assert text.startswith("model.init_args.selector_rnak is not a setting of DFlash2Module (on the command line)")
    assert "did you mean draft.selector_rank?" in text and "\n" not in text
    from_file = explain(NOT_ACCEPTED.replace("jsonargparse._util.NestedArg", "dict").replace(
        "NestedArg(key='selector_rnak', val='3')", "{'class_path': '...', 'init_args': {'selector_rnak': 3}}"), ["c.yaml"])
    assert "(in config c.yaml)" in from_file
    assert "did you mean --trainer.max_steps?" in explain("unrecognized arguments: fit --trainer.max_stepz 3")
    wrong = NOT_ACCEPTED.replace("Option 'selector_rnak' is not accepted",
                                 'Parser key "draft.selector_rank":\n          Expected a <class \'int\'>. Got value: sixteen')
    assert explain(wrong).startswith("model.init_args.draft.selector_rank='sixteen' is invalid (on the command line): "
                                     "expected int")
    assert explain('Parser key "config": File does not exist: \'x.yaml\'') == \
        "config file 'x.yaml' does not exist: check the --config path"


def test_naming_a_target_kind_replaces_the_configs_target():
    kinds = {"path": None, "gguf": None, "tiny": None}
    out = replace_target_overrides(["--config", "c.yaml", "--model.init_args.target.path", "/m", "--x", "1"])
    assert out[:2] == ["--config", "c.yaml"] and out[-2:] == ["--x", "1"]
    assert out[2] == "--model.init_args.target" and json.loads(out[3]) == {**kinds, "path": "/m"}
    out = replace_target_overrides(["--model.init_args.target.tiny={num_hidden_layers: 2}"])
    assert json.loads(out[1]) == {**kinds, "tiny": {"num_hidden_layers": 2}}
    out = replace_target_overrides(["--model.init_args.target", '{"gguf": "m.gguf", "seed": 3}'])
    assert json.loads(out[1]) == {**kinds, "gguf": "m.gguf", "seed": 3}
    # No kind named: left to jsonargparse's merge (`--...target null` is "target is missing").
    assert replace_target_overrides(["--model.init_args.target", "null"]) == ["--model.init_args.target", "null"]
    assert replace_target_overrides(["--model.init_args.target.seed", "2"]) == ["--model.init_args.target.seed", "2"]


def test_run_command_styles_user_errors_and_bugs(capsys):
    def bad_config(args):
        raise DataError("train.jsonl:3: invalid JSON")

    def bug(args):
        raise ZeroDivisionError("boom")

    assert run_command(bad_config, []) == 2
    err = capsys.readouterr().err
    assert err == "dflash2: error: train.jsonl:3: invalid JSON\n"
    assert run_command(bug, []) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: boom" in err and "this is a bug" in err
    with pytest.raises(DataError):
        run_command(bad_config, ["--debug"])
    assert split_debug(["fit", "--debug", "--", "--debug"]) == (["fit", "--", "--debug"], True)

    def missing(args):
        open(os.path.join(args[0], "nope.txt"))

    assert run_command(missing, ["/nonexistent"]) == 2
    assert "/nonexistent/nope.txt does not exist" in capsys.readouterr().err

    def usage(args):
        import argparse

        p = argparse.ArgumentParser(prog="dflash2 thing")
        p.add_argument("--n", type=int, required=True)
        p.parse_args(args)

    assert run_command(usage, ["--n", "x"]) == 2  # any subcommand's argparse errors get the style for free
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: dflash2 thing: argument --n: invalid int value: 'x'") and "usage" not in err


def test_only_dead_processes_temporaries_are_removed(tmp_path):
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    host = files.owner_prefix("x").split(".")[2].rsplit("-", 1)[0]
    dead = tmp_path / f".last.ckpt.{host}-{done.pid}.abc123.tmp"
    live = tmp_path / f".last.ckpt.{host}-{os.getppid()}.def456.tmp"
    other_host = tmp_path / f".last.ckpt.elsewhere-{done.pid}.ghi789.tmp"
    unowned = tmp_path / ".last.ckpt.abc.tmp"
    cache_dir = tmp_path / f".feat.{host}-{done.pid}.xyz.tmp"
    for p in (dead, live, other_host, unowned):
        p.write_bytes(b"partial")
    cache_dir.mkdir()
    (cache_dir / "features.npy").write_bytes(b"x")
    fd, mine = files.make_temp_file(tmp_path / "last.ckpt")
    os.close(fd)
    assert files.remove_stale(tmp_path, "last.ckpt") == [dead]
    assert files.remove_stale(tmp_path) == [cache_dir]
    assert live.exists() and other_host.exists() and unowned.exists() and os.path.exists(mine)


def _cache(tmp_path):
    root = tmp_path / "cache"
    (root / "train").mkdir(parents=True)
    np.save(root / "train" / "features.npy", np.arange(200_000, dtype=np.float16).reshape(100, 2000))
    np.save(root / "train" / "loss_mask.npy", np.ones((100, 8), dtype=bool))
    files = {str(f.relative_to(root)): data.file_checksums(f) for f in sorted(root.glob("*/*.npy"))}
    return root, {"files": files}


@pytest.mark.parametrize("mode", ["full", "sampled", "auto"])
def test_cache_checksums_catch_damage(tmp_path, mode):
    root, manifest = _cache(tmp_path)
    assert data.verify_cache(root, manifest, mode) == ("sampled" if mode == "sampled" else "full")
    features = root / "train" / "features.npy"
    with open(features, "r+b") as f:  # zeros over the header and the first rows: hit by full and sampled checks
        f.write(b"\0" * 1000)
    data._VERIFIED.clear()
    with pytest.raises(DataError, match="features.npy is damaged: its checksum differs"):
        data.verify_cache(root, manifest, mode)
    os.truncate(features, 100)
    with pytest.raises(DataError, match="features.npy is damaged: 100 bytes"):
        data.verify_cache(root, manifest, mode)
    root, manifest = _cache(tmp_path / "again")
    (root / "train" / "loss_mask.npy").unlink()
    with pytest.raises(DataError, match="loss_mask.npy is missing"):
        data.verify_cache(root, manifest, mode)
    with pytest.raises(DataError, match="records no file checksums"):
        data.verify_cache(root, {}, mode)


def test_timing_warning_when_threads_and_other_load_exceed_the_cores():
    assert timing_warning(1, 2, [0.1, 0.1, 0.1], [1.0, 0.5, 0.2]) is None
    assert timing_warning(2, 2, [0.2, 0.2, 0.2], [2.1, 1.0, 0.5]) is None  # our own two threads
    text = timing_warning(2, 2, [1.0, 1.0, 1.0], [3.0, 2.0, 1.0])
    assert text is not None and "2 torch thread(s) on 2 core(s)" in text and "--threads 1" in text
    assert timing_warning(1, 2, None, None) is None
    # The start load is this process's own training step just before (the quickstart's eval): quiet.
    assert timing_warning(2, 2, [1.98, 2.0, 2.0], [2.01, 2.0, 2.0], own_start=1.95) is None
    assert timing_warning(2, 2, [1.98, 2.0, 2.0], [2.01, 2.0, 2.0]) is not None
