"""What a training checkpoint records of its run, and the checks a resume makes against it, before any weight loads.

Every checkpoint records the target it was trained against (:data:`TARGET_KEY`: the target spec, its
geometry and a fingerprint of its weights, :meth:`~dflash2_lightning.target.target.Target.describe`) and the
draft's config (``draft_config``). A resume (``--ckpt_path``) against another target or with another draft
geometry is refused in one line naming both sides, instead of Lightning's size-mismatch traceback (other
geometry) or, worse, a silent resume that trains on another target's features and overwrites ``hf/``
(same geometry, other weights). A target named differently but with the same weights (a moved directory,
another ``cpu_linear``) resumes. Checkpoints written before the record existed are checked by the draft
geometry they do record.

:func:`peek_checkpoint` reads a checkpoint memory-mapped (cheap whatever its size), so the CLI checks it
before Lightning's setup rewrites anything in the run directory (``config.yaml``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash2_lightning.model.checkpoint import CheckpointError

#: the checkpoint key of the target record
TARGET_KEY = "dflash2_target"
#: draft config fields that do not change what the weights mean
_NOT_COMPARED = {"torch_dtype", "dtype", "initializer_range", "architectures"}


def peek_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A Lightning checkpoint's contents, memory-mapped (tensors are not read); unreadable: :class:`CheckpointError`."""
    import torch

    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except RuntimeError as error:
            if "mmap" not in str(error):  # a legacy (non-zip) file cannot be mapped: read it whole
                raise
            return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:160]}): it "
            "is truncated or not a Lightning checkpoint; delete it and resume from another checkpoint "
            "(--ckpt_path <file>), or start the run again"
        ) from None


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _target_words(record: dict[str, Any]) -> str:
    import json

    spec = record.get("spec")
    spec = json.dumps({k: v for k, v in spec.items() if v is not None}) if isinstance(spec, dict) else str(spec)
    geometry = record.get("geometry") or {}
    shape = ", ".join(f"{k} {v}" for k, v in geometry.items() if v is not None)
    return f"{spec} (fingerprint {record.get('fingerprint')}{', ' + shape if shape else ''})"


def check_resume(
    checkpoint: dict[str, Any],
    target_record: dict[str, Any],
    draft_config: dict[str, Any],
    where: str | os.PathLike | None = None,
) -> None:
    """Refuse a checkpoint trained against another target, or holding a draft of another geometry.

    ``target_record``: this run's :meth:`Target.describe` (without a fingerprint, only the geometry is compared);
    ``draft_config``: this run's ``DraftConfig.to_hf_dict()``.
    Raises :class:`CheckpointError` naming both sides and what to do.
    """
    name = f"checkpoint {where}" if where is not None else "the checkpoint"
    start_new = (
        "resume with the target and draft settings it was trained with, or start a new run (another "
        "logger version or save_dir)"
    )
    recorded = checkpoint.get(TARGET_KEY)
    if isinstance(recorded, dict):
        other_weights = "fingerprint" in target_record and recorded.get("fingerprint") != target_record["fingerprint"]
        if recorded.get("geometry") != target_record.get("geometry") or other_weights:
            raise CheckpointError(
                f"{name} was trained against another target: it recorded {_target_words(recorded)}, "
                f"this run's target is {_target_words(target_record)}; {start_new}"
            )
    saved = checkpoint.get("draft_config")
    if isinstance(saved, dict):
        have, want = _flat(saved), _flat(draft_config)
        # Fields both sides have (a checkpoint of an older version lacks fields added since: not a difference).
        diffs = [
            f"{k}={have[k]!r} (this run: {want[k]!r})"
            for k in sorted(set(have) & set(want))
            if k.rsplit(".", 1)[-1] not in _NOT_COMPARED and have[k] != want[k]
        ]
        if diffs:
            shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
            raise CheckpointError(f"{name} holds a draft of another geometry or target: {shown}; {start_new}")


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dirs: Sequence[str | os.PathLike]) -> Path | None:
    """The file ``--ckpt_path`` names for a fit: ``last`` -> the newest ``last*.ckpt``, a path -> itself.

    ``None`` (a fresh run, or ``last`` with nothing to resume) and Lightning's special values ``hpc`` /
    ``registry`` give None. ``best`` and a path that is not a file are refused here, in one line, before
    anything is set up.
    """
    from dflash2_lightning.errors import ConfigError

    if ckpt_path is None or ckpt_path in ("hpc", "registry") or str(ckpt_path).startswith("registry:"):
        return None
    if ckpt_path == "best":
        raise ConfigError(
            "--ckpt_path best is invalid for fit: 'best' means the best checkpoint of the run in this "
            "process, and a fit has none before it trains; resume with --ckpt_path last, or give a "
            "checkpoint file (--ckpt_path runs/<name>/<version>/checkpoints/<file>.ckpt)"
        )
    if ckpt_path == "last":
        found = [p for d in checkpoint_dirs if Path(d).is_dir() for p in Path(d).glob("last*.ckpt")]
        return max(found, key=lambda p: p.stat().st_mtime) if found else None
    if "://" in str(ckpt_path):
        return None  # remote: Lightning's own loader reads it
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--ckpt_path {ckpt_path} does not exist: give a checkpoint file, or 'last' to resume "
            "the newest checkpoint of the run directory"
        )
    if path.is_dir():
        raise ConfigError(f"--ckpt_path {ckpt_path} is a directory: give a checkpoint file (.ckpt) in it, or 'last'")
    return path
