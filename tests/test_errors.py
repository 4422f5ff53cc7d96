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
from dflash2_lightning.data.records import DataError
from dflash2_lightning.reporting import run_command, split_debug
from dflash2_lightning.threads import timing_warning
from dflash2_lightning.train.config_messages import explain
from dflash2_lightning.train.lightning_cli import replace_target_overrides

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
    from_file = explain(
        NOT_ACCEPTED.replace("jsonargparse._util.NestedArg", "dict").replace(
            "NestedArg(key='selector_rnak', val='3')", "{'class_path': '...', 'init_args': {'selector_rnak': 3}}"
        ),
        ["c.yaml"],
    )
    assert "(in config c.yaml)" in from_file
    assert "did you mean --trainer.max_steps?" in explain("unrecognized arguments: fit --trainer.max_stepz 3")
    wrong = NOT_ACCEPTED.replace(
        "Option 'selector_rnak' is not accepted",
        "Parser key \"draft.selector_rank\":\n          Expected a <class 'int'>. Got value: sixteen",
    )
    assert explain(wrong).startswith(
        "model.init_args.draft.selector_rank='sixteen' is invalid (on the command line): expected int"
    )
    assert (
        explain("Parser key \"config\": File does not exist: 'x.yaml'")
        == "config file 'x.yaml' does not exist: check the --config path"
    )


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


# ----------------------------------------------------------------------------- faults mapped in one place
def test_os_and_network_errors_are_one_line_user_errors(tmp_path):
    import errno
    import urllib.error

    from dflash2_lightning.reporting import describe, find_user_error

    (tmp_path / "afile").write_text("x")
    cases = [
        (OSError(errno.ENOSPC, "No space left on device"), "disk full (no space left on device)"),
        (
            OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")),
            f"disk full while writing {tmp_path / 'x'}",
        ),
        (
            OSError(errno.EROFS, "Read-only file system", str(tmp_path / ".out.gguf.vm-1.abc.tmp")),
            f"{tmp_path / 'out.gguf'} is on a read-only file system",
        ),
        (OSError(errno.EACCES, "Permission denied", "/x/y"), "/x/y cannot be accessed (permission denied)"),
        (OSError(errno.ENOTDIR, "Not a directory", str(tmp_path / "afile" / "d")), "afile is a file, not a directory"),
        (OSError(errno.EEXIST, "File exists", str(tmp_path / "afile")), "afile is a file, where a directory is needed"),
        (OSError(errno.EISDIR, "Is a directory", str(tmp_path)), f"{tmp_path} is a directory, not a file"),
        (ConnectionRefusedError(111, "Connection refused"), "cannot reach the server"),
        (urllib.error.URLError("timed out"), "cannot reach the server (timed out)"),
    ]
    for error, text in cases:
        found = find_user_error(error)
        assert found is error, error
        assert text in describe(error) and "\n" not in describe(error), describe(error)
    assert find_user_error(OSError(errno.EIO, "I/O error")) is None  # not the user's: a bug report
    # A user error in the chain wins over an OS error beside it (a failed log flush after a full disk).
    from dflash2_lightning.errors import DiskFullError

    try:
        try:
            raise DiskFullError("disk full while writing last.ckpt")
        except DiskFullError:
            raise OSError(errno.ENOSPC, "No space left on device")  # noqa: B904 - the implicit chain is what is tested
    except OSError as error:
        assert describe(find_user_error(error)) == "disk full while writing last.ckpt"


def test_bounded_argparse_values_say_the_bound(capsys):
    import argparse

    from dflash2_lightning.errors import bounded

    p = argparse.ArgumentParser(prog="dflash2 thing")
    p.add_argument("--n", type=bounded(int, 1))
    p.add_argument("--p", type=bounded(float, 0.0, 1.0, low_open=True))
    assert p.parse_args(["--n", "3", "--p", "1"]).n == 3
    for args, text in (
        (["--n", "0"], "argument --n: 0 is invalid: must be >= 1"),
        (["--p", "0"], "argument --p: 0 is invalid: must be > 0.0 and <= 1.0"),
        (["--n", "x"], "argument --n: 'x' is invalid: must be an int"),
    ):
        assert run_command(lambda a: p.parse_args(a), args) == 2
        assert text in capsys.readouterr().err


@pytest.fixture
def small_disk(tmp_path):
    """A 64 kB tmpfs (skipped where mounting is not allowed)."""
    target = tmp_path / "disk"
    target.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root): the full-disk cases need one")
    yield target
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_writes_on_a_full_disk_keep_the_previous_file(small_disk):
    import torch

    from dflash2_lightning.errors import DiskFullError

    path = small_disk / "last.ckpt"
    files.atomic_write_text(path, "previous")
    with pytest.raises(DiskFullError, match=r"disk full while writing .*last.ckpt \(needed 400.0 kB, free"):
        files.atomic_write(path, lambda tmp: torch.save(torch.zeros(100_000), tmp), size=400_000)  # refused first
    with pytest.raises(DiskFullError, match=r"last.ckpt \(needed more than .* kB, free"):  # size not known: fails
        files.atomic_write(path, lambda tmp: torch.save(torch.zeros(100_000), tmp))
    assert path.read_text() == "previous" and sorted(p.name for p in small_disk.iterdir()) == ["last.ckpt"]
    log = small_disk / "r.jsonl.partial"
    files.append_durably(log, "line 1\n")
    with pytest.raises(DiskFullError, match=r"r.jsonl.partial \(needed 200.0 kB"):
        files.append_durably(log, "x" * 200_000 + "\n")
    assert log.read_text() == "line 1\n"  # the failed append is cut back off
    mapped = small_disk / "features.npy"
    mapped.write_bytes(b"")
    with pytest.raises(DiskFullError, match="features.npy"):
        files.preallocate(mapped, 10_000_000)  # an error, not a SIGBUS inside a memory map


def test_check_writable_refuses_before_any_work(tmp_path):
    (tmp_path / "afile").write_text("x")
    files.check_writable(tmp_path / "new" / "out.gguf")
    files.check_writable(tmp_path / "out", directory=True)
    with pytest.raises(NotADirectoryError):
        files.check_writable(tmp_path / "afile" / "d.gguf")
    with pytest.raises(IsADirectoryError):
        files.check_writable(tmp_path)
    with pytest.raises(FileExistsError):
        files.check_writable(tmp_path / "afile", directory=True)


def test_run_lock_refuses_a_second_holder_and_not_a_dead_one(tmp_path):
    from dflash2_lightning.train.run_lock import LOCK_NAME, RunLock, RunLockedError

    first = RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunLockedError, match=rf"is in use by another fit \(pid {os.getpid()} on host"):
        RunLock(tmp_path / "run").acquire()
    first.release()
    assert not (tmp_path / "run").exists()  # the lock made the directory; released, it leaves none behind
    (tmp_path / "run").mkdir()
    # A killed holder leaves its file behind; the kernel dropped its lock.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
            "os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'{\"pid\": 1}'); os._exit(0)",
            str(tmp_path / "run" / LOCK_NAME),
        ]
    )
    assert done.returncode == 0 and (tmp_path / "run" / LOCK_NAME).exists()
    with RunLock(tmp_path / "run") as lock:
        assert lock.held


def test_the_cache_build_lock_refuses_a_second_builder_until_released(tmp_path):
    from dflash2_lightning.data.cache_build import BuildLock
    from dflash2_lightning.data.records import DataError

    first, second = BuildLock(tmp_path), BuildLock(tmp_path)
    first.acquire(tmp_path / "cache")
    with pytest.raises(DataError, match=r"cache .*/cache is being built by another process \(it holds .*/lock\)"):
        second.acquire(tmp_path / "cache")
    assert second.fd is None
    first.release()
    second.acquire(tmp_path / "cache")  # released (or its holder died): the next build takes it
    assert second.fd is not None
    second.release()


def test_resume_checks_name_both_sides():
    from dflash2_lightning.errors import ConfigError
    from dflash2_lightning.model.checkpoint import CheckpointError
    from dflash2_lightning.train.resume_checks import TARGET_KEY, check_resume, resolve_ckpt_path

    ours = {"spec": {"tiny": {}, "seed": 0}, "geometry": {"hidden_size": 64, "num_layers": 4}, "fingerprint": "aa"}
    draft = {"hidden_size": 64, "dflash_config": {"selector_rank": 16}, "torch_dtype": "float32"}
    check_resume({TARGET_KEY: ours, "draft_config": {**draft, "torch_dtype": "bfloat16"}}, ours, draft)
    other = {**ours, "spec": {"tiny": {}, "seed": 7}, "fingerprint": "bb"}
    with pytest.raises(
        CheckpointError,
        match=r"last.ckpt was trained against another target: .*fingerprint bb.*"
        r"this run's target is .*fingerprint aa",
    ):
        check_resume({TARGET_KEY: other}, ours, draft, "last.ckpt")
    with pytest.raises(CheckpointError, match=r"dflash_config.selector_rank=8 \(this run: 16\)"):
        check_resume({"draft_config": {**draft, "dflash_config": {"selector_rank": 8}}}, ours, draft)
    with pytest.raises(ConfigError, match="--ckpt_path best is invalid for fit"):
        resolve_ckpt_path("best", [])
    assert resolve_ckpt_path("last", ["/nonexistent"]) is None and resolve_ckpt_path(None, []) is None


def test_prompts_past_the_context_are_refused_or_cut():
    from dflash2_lightning.data.prompts import fit_to_context
    from dflash2_lightning.errors import ConfigError

    prompts = [[1] * 10, [2] * 100, [3] * 5]
    assert fit_to_context(prompts, None, 8).prompts == prompts
    with pytest.raises(
        ConfigError,
        match=r"1 of 3 prompts do not fit the target's context: prompt 2 of p.jsonl has "
        r"100 tokens, .* 64 positions leave room for 56",
    ):
        fit_to_context(prompts, 64, 8, "refuse", "p.jsonl")
    fitted = fit_to_context(prompts, 64, 8, "truncate")
    assert fitted.cut == 1 and fitted.prompts[1] == [2] * 56 and fitted.prompts[0] == prompts[0]
    assert "1 of 3 prompts were longer" in fitted.note()
    with pytest.raises(ConfigError, match="max_new_tokens=64 is invalid"):
        fit_to_context(prompts, 64, 64)


def test_the_validation_split_says_what_it_did_and_refuses_to_starve_training():
    from dflash2_lightning.data.records import validation_split

    chat = lambda q, a: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    even = [(f"f:{i}", chat(f"q{i // 2}", f"a{i}")) for i in range(40)]
    split = validation_split(even, 0.1)
    assert len(split.held) == 4 and split.describe() == (
        "validation split by prompt: 4 of 40 records held out (2 of 20 prompts, about 4 asked), 36 train"
    )
    # Two prompts, 30 answers and 1: the fixed order holds out the first prompt seen.
    small_first = [("f:0", chat("other", "b"))] + [(f"f:{i + 1}", chat("same", f"a{i}")) for i in range(30)]
    assert validation_split(small_first, 0.05).held == {0}
    with pytest.raises(
        DataError,
        match=r"hold out 30 of 31 records and train on 1: val_fraction=0.05 asks for about "
        r"2, .* 30 responses; give validation files",
    ):
        validation_split(small_first[1:] + small_first[:1], 0.05)


def test_yaml_typos_of_trainer_and_top_level_keys_name_the_file():
    text = explain("Subcommand 'fit' does not accept option 'trainer.max_stepz'", ["small.yaml"])
    assert text.startswith("trainer.max_stepz is not a setting (in config small.yaml); did you mean trainer.max_steps?")
    assert "did you mean trainer.accelerator?" in explain(
        "Subcommand 'fit' does not accept option 'trainr.accelerator'"
    )


def test_a_target_with_an_unknown_field_is_refused_on_the_command_line():
    from dflash2_lightning.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"model.init_args.target.tny is not a field of the target \(on the command "
        r"line\); did you mean tiny\?",
    ):
        replace_target_overrides(["--model.init_args.target", '{"tny": {}}'])


def test_an_error_is_printed_on_one_line_whatever_it_echoes(capsys):
    """What a message echoes from outside (a server's bytes, a file's content) cannot break the one-line form."""
    from dflash2_lightning.reporting import print_error, printable

    assert printable("a\x00\x01SSH-2.0\r\nb\tc\x1b[2J") == "a\\x00\\x01SSH-2.0  b c\\x1b[2J"
    assert printable("x" * 50, 10) == "x" * 10 + " ..."
    print_error("got '\x00\r\nend'")
    assert capsys.readouterr().err == "dflash2: error: got '\\x00  end'\n"


def test_a_float_option_refuses_what_is_not_a_finite_number():
    import argparse

    from dflash2_lightning.errors import bounded

    parse = bounded(float, 0.0, low_open=True)
    assert parse("2.5") == 2.5
    for text, message in (
        ("nan", "nan is invalid: must be a finite number"),
        ("inf", "inf is invalid: must be a finite number"),
        ("0", "0 is invalid: must be > 0.0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_explain_plans_group_typos_missing_values_and_a_missing_config():
    assert explain("Group 'trainer' does not accept option 'max_stepz'", ["c.yaml"], prog="dflash2 plan") == (
        "trainer.max_stepz is not a setting (in config c.yaml); did you mean trainer.max_steps? `dflash2 plan --help` "
        "lists every setting"
    )
    assert explain("the following arguments are required: fit.data, fit.model").startswith(
        "data, model not given (no config?): pass the run's config, `dflash2 fit --config CONFIG.yaml`"
    )
    assert explain("argument --trainer.max_steps: expected one argument", prog="dflash2 plan").startswith(
        "--trainer.max_steps needs a value (on the command line): `--trainer.max_steps VALUE`;"
    )
