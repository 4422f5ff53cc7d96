"""The GPU check's JSON record (``pytest -m gpu``): one file a lent GPU machine hands back.

Path: ``$DFLASH2_GPU_RECORD``, else ``gpu-check.json`` in the pytest rootdir. Rewritten atomically after every
check (a run cut short by its time limit still leaves what it measured) and once more at session end.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

RECORD_ENV = "DFLASH2_GPU_RECORD"
DRY_RUN_OPTION = "--gpu-dry-run"


def record_path(rootdir: Path) -> Path:
    return Path(os.environ.get(RECORD_ENV) or rootdir / "gpu-check.json")


def _versions() -> dict[str, Any]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:  # the dry mode runs where triton is missing too
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "device_capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
    }


class GpuRecord:
    """``record.check(name, passed=..., **figures)``: one entry per check; written to :attr:`path`."""

    def __init__(self, path: Path, dry_run: bool) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **_versions(),
            "checks": {},
        }

    def check(self, name: str, passed: bool, **figures: Any) -> None:
        self.data["checks"][name] = {"passed": bool(passed), **figures}
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)  # atomic: a reader never sees half a record
