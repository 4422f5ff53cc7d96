"""The shipped recipes (``configs/*.yaml``, package data of the wheel), reachable by name from any directory.

``dflash2 fit --config qwen3_8b_online`` reads the recipe that came with the installed package; a path that
exists is always taken as the path it is. In a source checkout ``configs/`` is a link to the same folder.
"""

from __future__ import annotations

from pathlib import Path

#: The folder of the shipped recipes, inside the package (so the wheel carries it).
RECIPES = Path(__file__).resolve().parent / "configs"


def recipe_names() -> list[str]:
    """The names ``--config`` takes for the shipped recipes, e.g. ``tiny``, ``qwen3_8b_online``."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def recipe_path(value: str) -> str:
    """``value`` itself when it names an existing file (or is not a recipe's name), else the shipped recipe's path:
    ``tiny``, ``tiny.yaml`` and ``configs/tiny.yaml`` (run from another directory) all name ``tiny``."""
    if Path(value).expanduser().exists():
        return value
    name = Path(value).name.removesuffix(".yaml")
    if Path(value).parent not in (Path("."), Path("configs")) or name not in recipe_names():
        return value
    return str(RECIPES / f"{name}.yaml")


def with_recipe_paths(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config NAME`` / ``--config=NAME`` that names a shipped recipe given as its path."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = recipe_path(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + recipe_path(arg.removeprefix("--config="))
    return out
