"""Every script in ``benchmarks/`` runs as documented (issue 36).

Each ``benchmarks/bench_*.py`` (found by glob, so a new script is covered without editing this file) is run
as a subprocess from the repository root, as ``docs/benchmarks.md`` runs it:

- with ``--help``: it must print its usage and options and exit 0 (a script that lost its
  ``if __name__ == "__main__":`` exits 0 printing nothing, and fails here);
- once at a tiny configuration that runs on a CPU in seconds, writing its record into ``tmp_path`` (never over
  the committed records in ``benchmarks/results/``): exit 0, a table (or the script's result lines) printed,
  and the record written as JSON with the fields the docs read.

A script that cannot run here at any size is listed in :data:`EXCLUDED` with the reason; a test checks that
every script is either in :data:`TINY_RUNS` or there. Nothing is asserted about the timings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("bench_*.py"))
MARKDOWN_TABLE = r"^\|.*\|\n\|[-:| ]+\|$"  # a markdown header row and its separator

# Scripts with no tiny run, and why (each keeps its --help case).
EXCLUDED: dict[str, str] = {
    "bench_gpu_ops.py": "times the Triton kernels against the eager ops with CUDA events: needs a CUDA device and "
    "the kernels extra; without a GPU it refuses with exit 2 (test_gpu_ops_refuses_without_cuda)",
}


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "Agg",
        **extra,
    }


def run_script(
    name: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python benchmarks/<name> ARGS`` from the repository root, as the docs run it."""
    return subprocess.run(
        [sys.executable, str(Path("benchmarks") / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _env(),
    )


# ----------------------------------------------------------------------------- --help
@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script: str) -> None:
    done = run_script(script, ["--help"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith(f"usage: {script} "), f"{script} --help printed no usage of its own:\n{out[:500]}"
    assert re.search(r"--[a-z][a-z-]+", out), f"{script} --help names no option:\n{out[:500]}"
    # Every script can be pointed away from the committed records in benchmarks/results/.
    assert re.search(r"--(json|out|results)\b", out), f"{script} has no output option (--json/--out/--results)"


# ----------------------------------------------------------------------------- inputs of the tiny runs
@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    """Randomly initialised 1-layer drafts of the tiny target (DFlash2 and a DFlash baseline), as checkpoints.

    Random weights are what the latency and loop benchmarks need: every loop checks its output against the
    target's greedy decoding whatever the draft proposes, and τ is near 1.
    """
    from conftest import randomize_draft_

    from dflash2_lightning.model import DraftModel
    from dflash2_lightning.model.checkpoint import save_draft
    from dflash2_lightning.target.load import load_target
    from dflash2_lightning.target.spec import TargetSpec

    target = load_target(TargetSpec(tiny={}))
    root = tmp_path_factory.mktemp("bench-drafts")
    out = {}
    for projector in ("dflash2", "dflash"):
        cfg = target.draft_config(
            num_hidden_layers=1,
            block_size=4,
            intermediate_size=128,
            projector_type=projector,
            selector_rank=8,
            selector_top_k=4,
            conv_group_size=16,
        )
        out[projector] = save_draft(randomize_draft_(DraftModel(cfg), seed=1).eval(), root / projector)
    return out


def smollm2_draft(tmp_path: Path) -> Path:
    """A random SmolLM2-135M-shaped draft checkpoint (the quickstart's geometry: one layer, block 4)."""
    from conftest import randomize_draft_
    from llamacpp_helpers import smollm2_draft_config

    from dflash2_lightning.model import DraftModel
    from dflash2_lightning.model.checkpoint import save_draft

    return save_draft(randomize_draft_(DraftModel(smollm2_draft_config()), seed=5).eval(), tmp_path / "smollm2-draft")


def variants_with_drafts(tmp_path: Path, drafts: dict[str, Path]) -> Path:
    """bench_recipe's output layout (OUT/<variant>/train/hf) holding the tiny drafts, for a --skip-train run."""
    out = tmp_path / "recipe"
    for variant, projector in (
        ("shipped", "dflash2"),
        ("shipped_insert_last", "dflash2"),
        ("shipped_dflash", "dflash"),
    ):
        shutil.copytree(drafts[projector], out / variant / "train" / "hf")
    return out


def needs_dflash() -> None:
    if importlib.util.find_spec("dflash") is None:
        pytest.skip("compares against the z-lab reference: pip install --no-deps dflash==0.1.0 (make install does)")


def needs_llama_cpp() -> None:
    from llamacpp_helpers import llama_cpp_or_skip

    llama_cpp_or_skip()


# ----------------------------------------------------------------------------- the tiny runs
@dataclass
class Tiny:
    """One tiny configuration: the arguments (``{json}``, ``{tmp}`` and the draft names are filled in), what the
    output must show, the record's top-level keys, and a check of its rows."""

    args: list[str]
    printed: str  # a regex the stdout must match (multi-line)
    keys: set[str]
    check: Callable[[dict[str, Any]], None] = lambda record: None
    slow: bool = False
    needs: Callable[[], None] | None = None
    setup: Callable[[Path, dict[str, Path]], dict[str, Any]] | None = None  # more placeholders
    env: dict[str, str] = field(default_factory=dict)  # {tmp} filled in
    also: tuple[str, ...] = ()  # other files the run writes (placeholders filled in)


def _rows(n: int, key: str = "rows") -> Callable[[dict[str, Any]], None]:
    """The record's ``key`` holds ``n`` rows."""

    def check(record: dict[str, Any]) -> None:
        assert len(record[key]) == n, record[key]

    return check


def _named(key: str, *names: str) -> Callable[[dict[str, Any]], None]:
    """The record's ``key`` is a mapping of exactly ``names``."""

    def check(record: dict[str, Any]) -> None:
        assert set(record[key]) == set(names), record[key]

    return check


def _check_loop(record: dict[str, Any]) -> None:
    assert record["identical_outputs"] is True
    assert [r["loop"] for r in record["rows"]] == ["target", "torch", "onnxruntime", "zlab"]
    assert all(r["seconds"] > 0 for r in record["rows"])


def _check_recipe(record: dict[str, Any]) -> None:
    row = record["shipped"]
    assert row["returncode"] == 0, row
    assert set(row["tau"]) == {"selector", "backbone"} and row["paths"], row


def _check_ceiling(record: dict[str, Any]) -> None:
    rows = record["rows"]
    assert len(rows) == 2
    dflash2, dflash = (next(r for d, r in rows.items() if d.endswith(name)) for name in ("/dflash2", "/dflash"))
    assert {"backbone", "selector", "oracle"} <= set(dflash2) and "vs_base" in dflash2
    assert {"backbone", "oracle"} <= set(dflash) and "selector" not in dflash


def _check_dflash_vs_dflash2(record: dict[str, Any]) -> None:
    assert {r["variant"] for r in record["rows"]} == {"shipped", "shipped_insert_last", "shipped_dflash"}
    assert all(r["lossless"] for r in record["rows"])
    assert {"selector", "backbone"} <= set(record["dflash2_over_dflash"])
    assert all("--target tiny" in c for c in record["eval_commands"])


def _check_features(record: dict[str, Any]) -> None:
    assert [r["call"] for r in record["rows"]] == ["online", "cache_build"]
    assert all(r["hooks_peak_bytes"] < r["output_hidden_states_peak_bytes"] for r in record["rows"])


TINY_RUNS: dict[str, Tiny] = {
    "bench_attention_mask.py": Tiny(
        ["--anchors", "2", "--seq-len", "64", "--json", "{json}"],
        r"^dense_mask: peak .*\n^no_mask   : peak",
        {"counted", "measured", "machine"},
        _named("measured", "dense_mask", "no_mask"),
        slow=True,
    ),
    "bench_cache_verify.py": Tiny(
        ["--megabytes", "1", "--repeats", "1", "--json", "{json}"],
        r"^cache of .* full sha256 .* sampled blocks",
        {"bytes", "read_s", "full_sha256_s", "sampled_s", "machine"},
    ),
    "bench_dflash_vs_dflash2.py": Tiny(
        [
            "--out",
            "{variants}",
            "--skip-train",
            "--target",
            "tiny",
            "--eval-prompts",
            "1",
            "--eval-tokens",
            "4",
            "--threads",
            "1",
            "--json",
            "{json}",
        ],
        r"^DFlash2 +selector +tau .*\n(.*\n)*^DFlash +backbone +tau .*\n(.*\n)*^DFlash2 selector / DFlash: tau",
        {"rows", "dflash2_over_dflash", "eval_commands"},
        _check_dflash_vs_dflash2,
        slow=True,
        setup=lambda tmp, drafts: {"variants": variants_with_drafts(tmp, drafts)},
        also=("{tmp}/record.png",),
    ),
    "bench_draft_floor.py": Tiny(
        ["--threads", "1", "--layers", "1", "--context", "16", "--repeats", "2", "--warmup", "1", "--json", "{json}"],
        MARKDOWN_TABLE,
        {"command", "rows", "machine", "table"},
        _rows(5),
        slow=True,
    ),
    "bench_draft_step.py": Tiny(
        [
            "--threads",
            "1",
            "--models",
            "dflash2",
            "--layers",
            "1",
            "--context",
            "16",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
            "{json}",
        ],
        MARKDOWN_TABLE,
        {"meta", "rows"},
        _rows(2),
        needs=needs_dflash,
    ),
    "bench_export.py": Tiny(
        [
            "--threads",
            "1",
            "--batches",
            "1",
            "--contexts",
            "16",
            "--layers",
            "1",
            "--runs",
            "2",
            "--warmup",
            "1",
            "--json",
            "{json}",
        ],
        MARKDOWN_TABLE,
        {"command", "geometry", "rows", "machine", "table"},
        _rows(2),
        slow=True,
    ),
    "bench_features.py": Tiny(
        [
            "--num-hidden-layers",
            "4",
            "--hidden-size",
            "64",
            "--intermediate-size",
            "128",
            "--num-attention-heads",
            "4",
            "--num-key-value-heads",
            "2",
            "--head-dim",
            "16",
            "--vocab-size",
            "512",
            "--seq-len",
            "64",
            "--draft-layers",
            "2",
            "--json",
            "{json}",
        ],
        MARKDOWN_TABLE,
        {"command", "geometry", "rows", "machine", "table"},
        _check_features,
    ),
    "bench_llama_cpp.py": Tiny(
        [
            "--draft",
            "{smollm2}",
            "--outtypes",
            "q8_0",
            "--n-max",
            "1",
            "--prompts",
            "1",
            "--max-new-tokens",
            "4",
            "--threads",
            "1",
            "--out",
            "{json}",
        ],
        MARKDOWN_TABLE,
        {"draft", "rows", "machine"},
        _rows(1),
        slow=True,
        needs=needs_llama_cpp,
        setup=lambda tmp, drafts: {"smollm2": smollm2_draft(tmp)},
    ),
    "bench_logits_memory.py": Tiny(
        ["--anchors", "2", "--seq-len", "64", "--vocab", "1024", "--json", "{json}"],
        r"^one_piece: peak .*\n^chunked  : peak",
        {"results", "machine", "losses_close_rel_1e-6"},
        _named("results", "one_piece", "chunked"),
        slow=True,
    ),
    "bench_loop.py": Tiny(
        [
            "--draft",
            "{dflash2}",
            "--target",
            "tiny",
            "--threads",
            "1",
            "--prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--loops",
            "target,torch,onnxruntime,zlab",
            "--json",
            "{json}",
        ],
        MARKDOWN_TABLE,
        {"command", "rows", "machine", "table", "identical_outputs"},
        _check_loop,
        slow=True,
        needs=needs_dflash,
    ),
    "bench_recipe.py": Tiny(
        [
            "--out",
            "{tmp}/recipe",
            "--variants",
            "shipped",
            "--results",
            "{json}",
            "--",
            "--target",
            "tiny",
            "--num-prompts",
            "4",
            "--max-new-tokens",
            "8",
            "--max-steps",
            "2",
            "--eval-prompts",
            "1",
            "--eval-max-new-tokens",
            "4",
            "--no-check-serving",
            "--threads",
            "1",
            "--data.init_args.seq_len=64",
        ],
        MARKDOWN_TABLE,
        {"shipped"},
        _check_recipe,
        slow=True,
        env={"DFLASH2_CACHE": "{tmp}/cache"},
        also=("{tmp}/recipe/shipped/summary.json", "{tmp}/recipe/shipped.log"),
    ),
    "bench_regen.py": Tiny(
        [
            "--target",
            "tiny",
            "--prompts",
            "2",
            "--new",
            "4",
            "--threads",
            "1",
            "--configs",
            "hf-generate:float32,static:bfloat16",
            "--json",
            "{json}",
        ],
        MARKDOWN_TABLE,
        {"command", "machine", "matmul_gflop_per_s", "results"},
        _rows(2, "results"),
        slow=True,
    ),
    "bench_selector_ceiling.py": Tiny(
        [
            "--drafts",
            "{dflash2}",
            "--base",
            "{dflash}",
            "--target",
            "tiny",
            "--prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--results",
            "{json}",
        ],
        r"/dflash2: .*oracle .*\n(.*\n)*.*/dflash2 vs .*/dflash: .*tau ratio",
        {"rows", "prompts", "target", "generated_tokens"},
        _check_ceiling,
    ),
    "bench_selector_walk.py": Tiny(
        ["--threads", "1", "--repeats", "2", "--warmup", "1", "--batch", "1", "--json", "{json}"],
        MARKDOWN_TABLE,
        {"meta", "rows"},
        _rows(2 if importlib.util.find_spec("dflash") else 1),
    ),  # z-lab's row
    "bench_training.py": Tiny(
        ["--only", "tiny", "--modes", "online", "--steps", "1", "--warmup", "1", "--threads", "1", "--json", "{json}"],
        MARKDOWN_TABLE,
        {"command", "machine", "results"},
        _rows(1, "results"),
        slow=True,
    ),
}


def test_every_script_is_run_or_excluded_with_a_reason() -> None:
    assert SCRIPTS, "no benchmarks/bench_*.py found"
    assert not set(TINY_RUNS) & set(EXCLUDED), "a script is both run and excluded"
    assert set(TINY_RUNS) | set(EXCLUDED) == set(SCRIPTS), (
        f"give each new benchmark a tiny run in TINY_RUNS or a reason in EXCLUDED: "
        f"{sorted(set(SCRIPTS) - set(TINY_RUNS) - set(EXCLUDED))}; gone: "
        f"{sorted((set(TINY_RUNS) | set(EXCLUDED)) - set(SCRIPTS))}"
    )
    assert all(reason.strip() for reason in EXCLUDED.values())


@pytest.mark.parametrize(
    "script", [pytest.param(name, marks=[pytest.mark.slow] if tiny.slow else []) for name, tiny in TINY_RUNS.items()]
)
def test_tiny_run(script: str, tmp_path: Path, drafts: dict[str, Path]) -> None:
    tiny = TINY_RUNS[script]
    if tiny.needs is not None:
        tiny.needs()
    record_path = tmp_path / "record.json"
    values: dict[str, Any] = dict(json=record_path, tmp=tmp_path, **drafts)
    if tiny.setup is not None:
        values.update(tiny.setup(tmp_path, drafts))
    args = [a.format(**values) for a in tiny.args]
    committed = {p: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").iterdir()}

    done = run_script(script, args, env=_env(**{k: v.format(**values) for k, v in tiny.env.items()}))

    assert done.returncode == 0, f"rc {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert re.search(tiny.printed, done.stdout, re.MULTILINE), f"no table / result lines in:\n{done.stdout[-3000:]}"
    assert record_path.is_file(), f"{script} wrote no record at {record_path}:\n{done.stdout[-2000:]}"
    record = json.loads(record_path.read_text())
    assert tiny.keys <= set(record), f"record lacks {sorted(tiny.keys - set(record))}: has {sorted(record)}"
    tiny.check(record)
    for name in tiny.also:
        assert Path(name.format(**values)).is_file(), f"{script} did not write {name.format(**values)}"
    assert {p: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").iterdir()} == committed, (
        "the tiny run touched benchmarks/results/"
    )


def test_gpu_ops_refuses_without_cuda() -> None:
    """bench_gpu_ops.py needs a CUDA device; without one it says so and exits 2 (it does not pass silently)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: bench_gpu_ops.py would run (it is a GPU benchmark, not run here)")
    done = run_script("bench_gpu_ops.py", ["--runs", "1", "--json", os.devnull], timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "no CUDA device" in done.stderr
