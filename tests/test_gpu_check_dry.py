"""The GPU check (tests/test_gpu_recipe.py) in its CPU dry mode, so that it does not rot where no GPU is.

Runs ``pytest -m gpu --gpu-dry-run tests/test_gpu_recipe.py`` in a subprocess (the way a lent GPU machine runs
``pytest -m gpu``, less the GPU) and checks the JSON record it writes: every check present, with the fields
a GPU run fills and null where only a GPU can measure. ~50 s on 2 busy cores (three short CPU fits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_on_cpu_in_dry_mode_and_writes_its_record(tmp_path: Path) -> None:
    record = tmp_path / "gpu-check.json"
    env = {**os.environ, "DFLASH2_GPU_RECORD": str(record), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--gpu-dry-run", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu_recipe.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout, done.stdout[-2000:]

    data = json.loads(record.read_text())
    assert data["dry_run"] is True and data["finished"] is True
    assert {"torch", "triton", "cuda", "device", "python"} <= set(data)
    assert data["device"] is None  # no GPU figures pretend to come from a device
    checks = data["checks"]
    assert set(checks) == {"training_step", "drafting_latency", "fit_resume"}
    assert all(c["passed"] is True for c in checks.values()), checks

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

    latency = checks["drafting_latency"]["steps"]
    assert len(latency) == 4  # 2 batches x 2 contexts
    for row in latency.values():
        assert row["eager_ms"] > 0 and row["graph_ms"] is None and row["graph_equals_eager"] is None
        assert row["tokens_shape"][1] == 15  # block 16: one anchor, fifteen drafted tokens

    fit = checks["fit_resume"]
    assert fit["single_device"]["bit_exact"] and fit["single_device"]["global_step"] == [4, 4]
    assert fit["single_device"]["export"] == {"loads": True, "tensors": fit["single_device"]["export"]["tensors"],
                                              "equals_last_checkpoint": True}
    assert fit["fsdp"]["ran"] is False and "requires a GPU accelerator" in fit["fsdp"]["reason"]  # said, not silent
