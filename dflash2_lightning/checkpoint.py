"""HF checkpoint export/import: ``config.json`` + ``model.safetensors``, served as-is by vLLM and SGLang.

The tensor names are the 21-pattern contract (6 global + 15 per layer for DFlash2; the baseline
drops the conv and selector tensors). Loading validates names and shapes and says exactly what is
missing, extra or misshapen. Every file is written to a temporary name in the target directory,
fsynced and renamed, so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.model import DraftModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint does not match the tensor contract of its config."""


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the contract with its shape, for ``cfg``."""
    h, v, hd, inter = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_target_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    if cfg.is_dflash2:
        r = cfg.selector_rank
        shapes.update({"candidate_selector.predecessor_codebook": (v, r),
                       "candidate_selector.successor_codebook": (v, r),
                       "candidate_selector.hidden_projection.weight": (r, h)})
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg.is_dflash2:
            t, g = cfg.conv_kernel_size, cfg.conv_num_groups
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = (2, t, h)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * t * g, h)
    return shapes


def check_tensors(cfg: DraftConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`CheckpointError` listing missing, unexpected and misshapen tensors."""
    expected = expected_tensors(cfg)
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = [f"{k}: {tuple(shapes[k])} (expected {expected[k]})" for k in sorted(set(expected) & set(shapes))
             if tuple(shapes[k]) != expected[k]]
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing)}")
        if extra:
            parts.append(f"unexpected {len(extra)}: {', '.join(extra)}")
        if wrong:
            parts.append(f"wrong shape {len(wrong)}: {'; '.join(wrong)}")
        raise CheckpointError(f"checkpoint does not match {cfg.architecture} contract — " + " | ".join(parts))


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then atomically rename ``tmp_path`` to ``path`` (same directory, fsynced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the final file gets ordinary permissions
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    def write(tmp: str) -> None:
        Path(tmp).write_text(text)
    atomic_write(path, write)


def save_draft(model: DraftModel, directory: str | os.PathLike, dtype: torch.dtype | str | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``model`` into ``directory``.

    ``dtype`` (default: the model's parameter dtype) is recorded in ``config.json``. The weights are
    written before the config, so a directory with a config always has complete weights beside it.
    """
    directory = Path(directory)
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    dtype = dtype or next(model.parameters()).dtype
    name = {v: k for k, v in DTYPES.items()}[dtype]
    cfg = model.config.replace(torch_dtype=name)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    check_tensors(cfg, {k: tuple(v.shape) for k, v in state.items()})
    atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_text(directory / CONFIG_NAME, json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return directory


def load_config(directory: str | os.PathLike) -> DraftConfig:
    """The :class:`DraftConfig` of a checkpoint directory."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a draft checkpoint needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    return DraftConfig.from_hf_dict(json.loads(path.read_text()))


def load_draft(directory: str | os.PathLike, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> DraftModel:
    """Load a checkpoint written by :func:`save_draft` (or any DFlash/DFlash2 HF checkpoint)."""
    cfg = load_config(directory)
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    state = load_file(str(path), device=str(device))
    check_tensors(cfg, {k: tuple(v.shape) for k, v in state.items()})
    dtype = dtype or DTYPES[cfg.torch_dtype]
    model = DraftModel(cfg).to(device=device, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model
