#!/usr/bin/env python3
"""The GPU check in one command, for a GPU machine whose Python and packages are its own (nothing installed).

Two steps, on two machines (standard library only, so it runs with whatever Python the GPU machine has)::

    python tools/gpu_check.py wheels        # here, with network: the wheels that machine lacks -> .gpu-wheels/
    python3 tools/gpu_check.py run          # there, from the source tree, with .gpu-wheels/ carried beside it

``run`` installs the carried wheels with ``pip --no-index --no-deps`` into a folder it puts on ``PYTHONPATH``
(the machine's own packages are never touched), prints the versions it runs with, then runs
``pytest -m "gpu and not tensorrt"`` (``-m gpu`` where ``tensorrt`` imports) under a hard time cap. Each check
writes its figures into the JSON record (``--record``, tests/gpu_record.py) as soon as it finishes, so a failure or
the cap loses nothing measured before it. Exit status: pytest's, or 124 when the cap stopped it.

``--dry-run`` runs the same on a CPU (the checks marked ``gpu_dry_run``, at a tiny geometry): ``make gpu-env`` does
that in a Python 3.12 environment with the GPU machine's packages (requirements/gpu-machine.txt).
What to carry and the exact command: docs/benchmarks.md#the-gpu-check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / "requirements" / "gpu-carry.txt"
WHEELS = REPO / ".gpu-wheels"
SITE = REPO / ".gpu-site"
#: The GPU machine's Python and platform, for `pip download` (pure-Python wheels match any).
PYTHON_VERSION, PLATFORMS = "3.12", ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "any")
#: What one command may send along the source tree, and what the wheels may take of it.
CARRY_LIMIT = 8 * 2**20
#: The device machine allows 10 minutes a command: the checks stop at 9, leaving a minute to hand back the record.
DEFAULT_CAP_S = 540
#: Distributions whose versions are printed (and recorded by the checks themselves).
SHOWN = (
    "torch",
    "triton",
    "transformers",
    "lightning",
    "torchmetrics",
    "jsonargparse",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "numpy",
    "tensorrt",
    "pytest",
)


def carried_requirements() -> list[str]:
    """The pinned wheels the GPU machine lacks (requirements/gpu-carry.txt, without comments)."""
    lines = (line.split("#", 1)[0].strip() for line in CARRY.read_text().splitlines())
    return [line for line in lines if line]


def download_wheels(dest: Path) -> list[Path]:
    """``pip download`` the carried wheels for the GPU machine's Python into ``dest`` (emptied first)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--dest",
        str(dest),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *carried_requirements()], check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size > CARRY_LIMIT:
        raise SystemExit(
            f"gpu_check: error: the carried wheels take {size / 2**20:.1f} MiB, over the "
            f"{CARRY_LIMIT / 2**20:.0f} MiB this check allows them, in {dest}; carry fewer"
        )
    return wheels


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """The carried wheels installed into ``site`` (``--no-index --no-deps``): what the GPU machine does with them."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return []
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--disable-pip-version-check",
            "--target",
            str(site),
            *map(str, found),
        ],
        check=True,
    )
    return [w.name for w in found]


def check_environment(site: Path, record: Path) -> dict[str, str]:
    """The environment the checks run in: the source tree and the carried wheels first on the path, no hub."""
    path = [str(REPO), str(site), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "DFLASH2_GPU_RECORD": str(record),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


VERSIONS_SCRIPT = """
import importlib.metadata as m, importlib.util, json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable}
for name in NAMES:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
try:
    import torch
    out["cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception as err:
    out["torch_error"] = repr(err)
out["tensorrt_imports"] = importlib.util.find_spec("tensorrt") is not None
print(json.dumps(out))
"""


def versions(env: dict[str, str]) -> dict[str, object]:
    """What the checks will run with, read in a child with the checks' own environment."""
    script = VERSIONS_SCRIPT.replace("NAMES", repr(SHOWN))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def pytest_command(dry_run: bool, tensorrt: bool, extra: list[str]) -> list[str]:
    """``python -m pytest`` with the GPU checks' marker: never the TensorRT tests where TensorRT is missing."""
    marker = "gpu_dry_run" if dry_run else ("gpu" if tensorrt else "gpu and not tensorrt")
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-rfE", "-p", "no:cacheprovider"]
    return cmd + (["--gpu-dry-run"] if dry_run else []) + extra


def run_capped(cmd: list[str], env: dict[str, str], deadline: float) -> int:
    """``cmd`` in its own process group until it ends or ``deadline`` (monotonic): then SIGTERM, SIGKILL, 124."""
    process = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(
            "gpu_check: the time cap is reached: stopping the checks (the record keeps every finished one)", flush=True
        )
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        return 124


def summary(record: Path) -> str:
    """One line per check of the record: its name and verdict."""
    if not record.is_file():
        return f"no record at {record}: no check finished"
    data = json.loads(record.read_text())
    lines = [
        f"record {record}: dry_run={data.get('dry_run')} device={data.get('device')} "
        f"finished={data.get('finished', False)}"
    ]
    lines += [f"  {name}: {'passed' if c.get('passed') else 'FAILED'}" for name, c in data.get("checks", {}).items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.cap
    site = args.site.resolve()
    installed = install_wheels(args.wheels, site)
    print(f"gpu_check: carried wheels installed into {site}: {', '.join(installed) or 'none found'}", flush=True)
    record = args.record.resolve()
    env = check_environment(site, record)
    found = versions(env)
    print("gpu_check: running with " + json.dumps(found), flush=True)
    cmd = pytest_command(args.dry_run, bool(found.get("tensorrt_imports")), args.pytest_args)
    print("gpu_check: " + " ".join(cmd[1:]) + f"  (cap {args.cap:.0f} s)", flush=True)
    code = run_capped(cmd, env, deadline)
    print(summary(record), flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    fetch = sub.add_parser("wheels", help="download the wheels the GPU machine lacks (here, with network)")
    fetch.add_argument("--dest", type=Path, default=WHEELS, help="where (default .gpu-wheels/, ignored by git)")
    go = sub.add_parser("run", help="install the carried wheels into a folder and run the GPU checks (there)")
    go.add_argument("--wheels", type=Path, default=WHEELS, help="the carried wheels (default .gpu-wheels/)")
    go.add_argument(
        "--site",
        type=Path,
        default=SITE,
        help="where the wheels are installed and put on PYTHONPATH (default .gpu-site/, ignored by git)",
    )
    go.add_argument(
        "--record",
        type=Path,
        default=REPO / "gpu-check.json",
        help="the JSON record, rewritten after every check (default gpu-check.json here)",
    )
    go.add_argument(
        "--cap",
        type=float,
        default=DEFAULT_CAP_S,
        help=f"seconds for the whole run, wheels included (default {DEFAULT_CAP_S}: a minute spare of 10)",
    )
    go.add_argument("--dry-run", action="store_true", help="the CPU dry mode: the gpu_dry_run checks at a tiny size")
    go.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -- tests/ops/test_gpu.py")
    args = parser.parse_args(argv)
    if args.step == "wheels":
        wheels = download_wheels(args.dest)
        total = sum(w.stat().st_size for w in wheels)
        print(f"{len(wheels)} wheels, {total / 2**20:.2f} MiB, in {args.dest}: " + ", ".join(w.name for w in wheels))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
