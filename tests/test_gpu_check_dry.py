"""The GPU check in its CPU dry mode, run exactly as a lent GPU machine runs it, so that it does not rot where no GPU is.

``python tools/gpu_check.py run --dry-run`` in a subprocess (the one command documented for the GPU machine, less
the GPU: the checks marked ``gpu_dry_run`` at a tiny geometry) and the JSON record it writes: every check present,
finished, with the fields a GPU run fills and null where only a GPU can measure. ~50 s on 2 busy cores (three
short CPU fits). The tool's own parts (the marker it picks, the time cap, what it carries) are tested below.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402  (tools/ is no package: the script is imported by path, as it is run)


def test_the_gpu_check_runs_on_cpu_in_dry_mode_and_writes_its_record(tmp_path: Path) -> None:
    record = tmp_path / "gpu-check.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "gpu_check.py"),
            "run",
            "--dry-run",
            "--record",
            str(record),
            "--wheels",
            str(tmp_path / "no-wheels"),
            "--site",
            str(tmp_path / "site"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout, done.stdout[-2000:]
    versions = json.loads(re.search(r"^gpu_check: running with (\{.*\})$", done.stdout, re.MULTILINE).group(1))
    assert versions["torch"] and versions["jsonargparse"] and versions["python"]  # what it ran with, printed
    assert "-m gpu_dry_run" in done.stdout and "training_step: passed" in done.stdout

    data = json.loads(record.read_text())
    assert data["dry_run"] is True and data["finished"] is True
    assert {"torch", "triton", "cuda", "device", "python"} <= set(data)
    assert data["device"] is None  # no GPU figures pretend to come from a device
    checks = data["checks"]
    assert set(checks) == {"training_step", "feature_capture", "drafting_latency", "fit_resume", "sharded_target"}
    assert all(c["passed"] is True and c["in_progress"] is False for c in checks.values()), checks

    step = checks["training_step"]
    assert len(step["anchors"]) == 2
    for entry in step["anchors"].values():
        assert entry["grads_finite"] and entry["tokens_per_s_draft_step"] > 0 and entry["model_tflop_per_step"] > 0
        assert entry["mfu"] is None and entry["peak_memory_gib"] is None  # GPU-only figures
        assert entry["peak_memory_vs_plan"] is None and entry["plan_counts_the_drafts_weights"] is True
        assert 0.75 <= entry["tensor_peak_vs_plan"] <= 1.25 and entry["planned_step_gib"] > 0
    assert set(step["sdpa_backends"]) == {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"}
    assert step["sdpa_backends"]["MATH"]["ran"] and step["sdpa_backends"]["MATH"]["grad_rel_diff_vs_math"] == 0.0
    assert all("error" in b for b in step["sdpa_backends"].values() if not b["ran"])

    capture = checks["feature_capture"]
    assert capture["bitwise_equal"] is True and capture["tensor_peak_saved_gib"] is not None
    assert all(p["allocated_peak_gib"] is None for p in capture["peaks"].values())  # a GPU-only figure

    latency = checks["drafting_latency"]["steps"]
    assert len(latency) == 4  # 2 batches x 2 contexts
    for row in latency.values():
        assert row["eager_ms"] > 0 and row["graph_ms"] is None and row["graph_equals_eager"] is None
        assert row["tokens_shape"][1] == 15  # block 16: one anchor, fifteen drafted tokens

    fit = checks["fit_resume"]
    assert fit["single_device"]["bit_exact"] and fit["single_device"]["global_step"] == [4, 4]
    assert fit["single_device"]["export"] == {
        "loads": True,
        "tensors": fit["single_device"]["export"]["tensors"],
        "equals_last_checkpoint": True,
    }
    assert fit["fsdp"]["ran"] is False and "requires a GPU accelerator" in fit["fsdp"]["reason"]  # said, not silent

    sharded = checks["sharded_target"]  # two gloo processes in the dry run; NCCL and memory on two GPUs
    assert sharded["bitwise_equal"] is True and sharded["backend"] == "gloo" and sharded["processes"] == 2
    assert sharded["held_gib"] is None and sharded["planned_resident_gib"] > 0


@pytest.mark.parametrize(
    "dry_run, tensorrt, marker",
    [(False, False, "gpu and not tensorrt"), (False, True, "gpu"), (True, False, "gpu_dry_run")],
)
def test_the_tensorrt_checks_run_only_where_tensorrt_imports(dry_run: bool, tensorrt: bool, marker: str) -> None:
    cmd = gpu_check.pytest_command(dry_run, tensorrt, ["tests/ops/test_gpu.py"])
    assert cmd[cmd.index("-m", 2) + 1] == marker and cmd[-1] == "tests/ops/test_gpu.py"
    assert ("--gpu-dry-run" in cmd) is dry_run


def test_the_time_cap_ends_the_whole_process_group_with_124(tmp_path: Path) -> None:
    """A check that outlives the cap is stopped, with every process it started (a fit's ranks, data workers)."""
    child_pid = tmp_path / "child.pid"
    script = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(600)']); open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    code = gpu_check.run_capped([sys.executable, "-c", script], dict(os.environ), time.monotonic() + 3)
    assert code == 124
    pid = int(child_pid.read_text())
    for _ in range(100):  # the grandchild gets SIGTERM with its group; reaped by init shortly after
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the capped command's child {pid} outlived the cap")


def names(requirements: list[str]) -> set[str]:
    """Distribution names (normalised, extras dropped) of requirement strings."""
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower() for r in requirements}


def test_what_is_carried_covers_what_the_gpu_machine_lacks() -> None:
    """Every dependency of the package is on the GPU machine or carried; what is carried is pinned as CI's lock pins it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    machine = [
        line.split("#")[0].strip() for line in (REPO / "requirements" / "gpu-machine.txt").read_text().splitlines()
    ]
    carried = gpu_check.carried_requirements()
    needed = names(project["dependencies"]) | {"docstring-parser", "typeshed-client"}  # jsonargparse[signatures]
    missing = needed - names([m for m in machine if m]) - names(carried)
    assert not missing, f"neither on the GPU machine nor carried: {sorted(missing)} (requirements/gpu-carry.txt)"
    lock = dict(
        line.split("==")
        for line in (REPO / "requirements" / "lock.txt").read_text().splitlines()
        if "==" in line and not line.startswith(" ")
    )
    for requirement in carried:
        name, version = requirement.split("==")
        assert lock[name] == version, f"{requirement}: the lock pins {name}=={lock[name]}"
