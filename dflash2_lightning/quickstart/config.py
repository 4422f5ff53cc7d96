"""The LightningCLI config a quickstart trains with: ``configs/quickstart.yaml`` pointed at the run's directory.

:func:`fit_config` takes the shipped config (a plain LightningCLI file), points its data, loggers and
(optionally) target at ``OUT``, caps the validation and checkpoint intervals to ``--max-steps`` and
applies the command line's config entries (``--trainer.max_steps 200``) last; :func:`write_yaml` writes the result to ``OUT/fit.yaml``,
which ``dflash2 fit --config`` then runs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash2_lightning.errors import UserError

CONFIG_NAME = "quickstart.yaml"
RUN_VERSION = "train"  # the training run directory is OUT/train


class QuickstartError(UserError, RuntimeError):
    """The quickstart cannot proceed (the message says what to change)."""


def find_config(path: str | None) -> Path:
    """``path``, else ``configs/quickstart.yaml`` in the working directory, else the one in the repository."""
    candidates = (
        [Path(path)]
        if path
        else [Path("configs") / CONFIG_NAME, Path(__file__).resolve().parents[1] / "configs" / CONFIG_NAME]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise QuickstartError(
        f"config not found: tried {', '.join(str(c) for c in candidates)}; pass --fit-config path/to/quickstart.yaml"
    )


def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """``config[a][b][c] = value`` for ``key = "a.b.c"``; integer parts index lists; missing dicts are made."""
    parts = key.split(".")
    node: Any = config
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise QuickstartError(f"--{key}: {'.'.join(parts[: i + 1])} is a value, not a section")
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


# ----------------------------------------------------------------------------- the fit config
def fit_config(
    base: dict[str, Any],
    out: Path,
    target: dict[str, Any] | None,
    max_steps: int | None,
    overrides: Mapping[str, Any],
    bf16_hardware: bool = True,
) -> dict[str, Any]:
    """The LightningCLI config the quickstart trains with: ``base`` pointed at ``out``.

    The target (when given) replaces ``model.init_args.target`` and drops the config's explicit
    ``draft.target_layer_ids`` (they number that target's layers); the training data is
    ``out/data/responses.jsonl``; every logger writes to ``out/train`` (``save_dir = out.parent``,
    ``name = out.name``, ``version = train``); ``max_steps`` also caps the validation interval so the
    run validates (and plots) at least once. Without ``bf16_hardware`` (a CPU that emulates bfloat16
    matmuls, see :func:`~dflash2_lightning.threads.fast_bf16_matmuls`) the config's bf16 training precision
    and bf16 feature pass become float32 (:func:`float32_on_this_cpu`). ``overrides`` (dotted keys) come last and win.
    """
    cfg = copy.deepcopy(base)
    model_args = cfg.setdefault("model", {}).setdefault("init_args", {})
    data_args = cfg.setdefault("data", {}).setdefault("init_args", {})
    trainer = cfg.setdefault("trainer", {})
    if target is not None and target != model_args.get("target"):
        model_args["target"] = target
        # Layer ids count the config's own target's layers; another target gets the default rule.
        if isinstance(model_args.get("draft"), dict):
            model_args["draft"].pop("target_layer_ids", None)
    data_args["train_files"] = [str(out / "data" / "responses.jsonl")]
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers] if isinstance(loggers, dict) else []:
        args = logger.setdefault("init_args", {})
        args.update(save_dir=str(out.parent), name=out.name, version=RUN_VERSION)
    if max_steps is not None:
        trainer["max_steps"] = max_steps
        interval = trainer.get("val_check_interval")
        if isinstance(interval, int) and interval > max_steps:
            trainer["val_check_interval"] = max_steps
        for callback in trainer.get("callbacks") or []:
            args = callback.get("init_args") or {}
            if isinstance(args.get("every_n_train_steps"), int) and args["every_n_train_steps"] > max_steps:
                args["every_n_train_steps"] = max_steps
    if not bf16_hardware:
        float32_on_this_cpu(cfg)
    for key, value in overrides.items():
        set_dotted(cfg, key, value)
    return cfg


def uses_bf16(cfg: dict[str, Any]) -> bool:
    """Whether the config trains in bf16 (``bf16*`` precision) or computes features under bf16 autocast."""
    trainer = cfg.get("trainer") or {}
    offline = ((cfg.get("data") or {}).get("init_args") or {}).get("offline") or {}
    return str(trainer.get("precision", "")).startswith("bf16") or offline.get("feature_autocast") == "bf16"


def float32_on_this_cpu(cfg: dict[str, Any]) -> None:
    """Turn the config's bfloat16 training and feature pass into float32, in place.

    The shipped config trains under ``bf16-mixed`` and computes features under bf16 autocast because a CPU
    with AVX512-BF16/AMX multiplies bf16 several times faster than float32. A CPU without them emulates
    bf16 and is slower: measured on a 2-core AVX-512 host without bf16, the quickstart's feature pass took
    6.8 s a batch under bf16 autocast and 2.0 s in float32.
    """
    trainer = cfg.get("trainer") or {}
    if str(trainer.get("precision", "")).startswith("bf16"):
        trainer["precision"] = "32-true"
    offline = ((cfg.get("data") or {}).get("init_args") or {}).get("offline") or {}
    if offline.get("feature_autocast") == "bf16":
        offline["feature_autocast"] = "none"


def write_yaml(path: Path, config: dict[str, Any], header: str) -> None:
    """Write ``config`` as YAML (atomically) with a comment header."""
    import yaml

    from dflash2_lightning.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, header + yaml.safe_dump(config, sort_keys=False, default_flow_style=None))
