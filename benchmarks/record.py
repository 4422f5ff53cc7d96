"""What every benchmark records beside its figures: the machine, its load, and a whole-file write.

A timing taken on a shared machine means little without the load average beside it, so each result file
carries :func:`machine` (load before and after the run, and whether it counts as loaded), and is written
by :func:`write_json`: atomically (a crash never leaves half a file) and readable by other users.
Imported by the ``bench_*.py`` scripts, which run from this folder (``python benchmarks/bench_X.py``).
"""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from dflash2_lightning.threads import load_average, timing_warning

__all__ = ["load_average", "machine", "loaded_label", "memory_status", "write_json"]


def machine(
    threads: int | None, load_before: list[float] | None, load_after: list[float] | None = None
) -> dict[str, Any]:
    """The machine a figure was taken on: platform, CPUs, threads used, versions and the load around the run.

    ``load_after`` defaults to the load now. ``loaded`` is the quickstart's rule
    (:func:`dflash2_lightning.threads.timing_warning`): the benchmark's own threads plus what other processes
    kept busy exceed the cores (a 2-thread benchmark's own load of 2 is not "loaded"); None where the
    platform reports no load. ``threads`` None (a benchmark that does not set them) counts as one.
    """
    after = load_after if load_after is not None else load_average()
    cpus = os.cpu_count() or 1
    warning = timing_warning(threads or 1, cpus, load_before, after)
    return dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpus=cpus,
        threads=threads,
        python=platform.python_version(),
        torch=metadata.version("torch"),
        load_average_before=load_before,
        load_average_after=after,
        loaded=None if load_before is None and after is None else warning is not None,
    )


def loaded_label(info: dict[str, Any]) -> str:
    """The warning printed beside a header whose figures were taken on a loaded machine ('' when quiet)."""
    return " (LOADED MACHINE: re-take on a quiet one)" if info["loaded"] else ""


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` whole or not at all (temporary file + rename), mode 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def memory_status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (``VmRSS`` now, ``VmHWM`` the resident high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)
