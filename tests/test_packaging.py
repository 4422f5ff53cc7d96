"""The package as users install it: a wheel built from the tree, installed into a new environment, used from elsewhere.

The wheel must carry what a user reaches without the source tree: the shipped prompts, the recipes (by name:
``dflash2 fit --config tiny``) and the license. The new environment holds only the wheel (installed by its own pip
with ``--no-deps --no-index``); its dependencies are the test process's, seen through a ``.pth`` listing the folders
of its path that do not hold this checkout's source (their own ``.pth`` files, among them the checkout's editable
install, are not run), so the code that runs is the wheel's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from dflash2_lightning import __version__
from dflash2_lightning.recipes import RECIPES, recipe_names, recipe_path, with_recipe_paths

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (built,) = out.glob("dflash2_lightning-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with the wheel installed; returns its ``bin/``."""
    env_dir = tmp_path_factory.mktemp("fresh-env")
    venv.create(env_dir, with_pip=True)  # its own pip installs the console scripts into its own bin/
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Without PYTHONPATH: a checkout on it (its .egg-info) would look like the package already installed.
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": ""},
    )
    # The dependencies: every folder on this test's path that does not hold the package's source.
    deps = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / "dflash2_lightning").exists()]
    Path(site, "test-dependencies.pth").write_text("\n".join(deps) + "\n")
    return env_dir / "bin"


def run(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    return subprocess.run(
        [str(bin_dir / "dflash2"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def test_the_wheel_carries_prompts_recipes_and_license(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    recipes = {Path(n).name for n in names if n.startswith("dflash2_lightning/configs/") and n.endswith(".yaml")}
    assert recipes == {p.name for p in RECIPES.glob("*.yaml")} and "qwen3_8b_online.yaml" in recipes
    assert any(n.startswith("dflash2_lightning/data/prompts/") and n.endswith(".jsonl") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Python: >=3.11" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert requires and not any("==" in line for line in requires), requires  # ranges, never exact pins


def test_the_installed_wheel_runs_help_version_and_a_tiny_fit_from_its_own_recipe(
    installed: Path, tmp_path: Path
) -> None:
    done = run(installed, tmp_path, "--help")
    assert done.returncode == 0 and "actions:" in done.stdout and "qwen3_8b_online" in done.stdout, done.stderr
    done = run(installed, tmp_path, "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"dflash2-lightning {__version__}"
    where = subprocess.run(
        [str(installed / "python"), "-c", "import dflash2_lightning; print(dflash2_lightning.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert str(REPO) not in where.stdout  # the wheel's code, not this checkout's
    done = run(
        installed,
        tmp_path,
        "fit",
        "--config",
        "tiny",
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--model.init_args.export.acceptance_prompts",
        "1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hf = tmp_path / "runs" / "tiny" / "default" / "hf"
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file() and (hf / "SERVING.md").is_file()


def test_lightning_entry_point_is_the_same_command(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [str(installed / "lightning"), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0 and done.stdout.strip() == f"dflash2-lightning {__version__}"


def test_recipes_are_reached_by_name_and_paths_stay_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"tiny", "quickstart", "qwen3_8b_online", "qwen3_8b_offline"} <= set(recipe_names())
    monkeypatch.chdir(tmp_path)  # no configs/ here
    for name in ("tiny", "tiny.yaml", "configs/tiny.yaml"):
        assert recipe_path(name) == str(RECIPES / "tiny.yaml")
    own = tmp_path / "tiny.yaml"
    own.write_text("trainer: {}\n")
    assert recipe_path("tiny.yaml") == "tiny.yaml"  # an existing file is taken as given
    assert recipe_path("elsewhere/tiny.yaml") == "elsewhere/tiny.yaml"  # a path that names no recipe stays
    assert recipe_path("nope") == "nope"  # and so does an unknown name (the parser then says it is missing)
    assert with_recipe_paths(["fit", "--config", "qwen3_8b_online", "--config=tiny"]) == [
        "fit",
        "--config",
        str(RECIPES / "qwen3_8b_online.yaml"),
        f"--config={RECIPES / 'tiny.yaml'}",
    ]


def test_the_metadata_admits_the_pythons_it_is_tested_on() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    tested = {
        c.rsplit(":: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    }
    assert tested == {"3.11", "3.12", "3.13"}
    assert not [d for d in project["dependencies"] if "==" in d]


def test_every_lower_bound_is_a_version_the_tests_ran_with() -> None:
    """A lower bound names a version that ran: CI's lock (Python 3.11) or the GPU machine's set (Python 3.12,
    `make gpu-env`). Raising a bound means testing it; a bound below both would be a claim nobody checked."""
    import re

    def pins(path: Path) -> dict[str, str]:
        found = {}
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==")
                found[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
        return found

    lock, machine = pins(REPO / "requirements" / "lock.txt"), pins(REPO / "requirements" / "gpu-machine.txt")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for requirement in requirements:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()
        lower = re.search(r">=\s*([0-9][0-9a-z.]*)", requirement)
        assert lower, f"{requirement}: no lower bound"
        if name == "tensorrt-cu13":  # TensorRT cannot be installed on these machines: its floor is a run-time check
            continue
        tested = {v for v in (lock.get(name), machine.get(name)) if v}
        assert lower.group(1) in tested, f"{requirement}: its lower bound ran nowhere (lock / GPU machine: {tested})"
