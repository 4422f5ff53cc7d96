"""The draft's own on-disk format: the HF checkpoint, ``config.json`` + ``model.safetensors``, served as-is by
vLLM and SGLang.

The tensor names are the 21-pattern contract (6 global + 15 per layer for DFlash2; the baseline
drops the conv and selector tensors). Loading validates names and shapes and says exactly what is
missing, extra or misshapen. Every file is written to a temporary name in the target directory,
fsynced and renamed, so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.errors import UserError
from dflash2_lightning.files import atomic_write, atomic_write_text
from dflash2_lightning.model import DraftModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class CheckpointError(UserError, ValueError):
    """A checkpoint does not match the tensor contract of its config."""


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the contract with its shape, for ``cfg``."""
    h, v, hd, inter = cfg.hidden_size, cfg.vocab_size, cfg.resolved("head_dim"), cfg.resolved("intermediate_size")
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_target_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    if cfg.is_dflash2:
        r = cfg.selector_rank
        shapes.update(
            {
                "candidate_selector.predecessor_codebook": (v, r),
                "candidate_selector.successor_codebook": (v, r),
                "candidate_selector.hidden_projection.weight": (r, h),
            }
        )
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
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
    wrong = [
        f"{k}: {tuple(shapes[k])} (expected {expected[k]})"
        for k in sorted(set(expected) & set(shapes))
        if tuple(shapes[k]) != expected[k]
    ]
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing)}")
        if extra:
            parts.append(f"unexpected {len(extra)}: {', '.join(extra)}")
        if wrong:
            parts.append(f"wrong shape {len(wrong)}: {'; '.join(wrong)}")
        raise CheckpointError(f"checkpoint does not match {cfg.architecture} contract — " + " | ".join(parts))


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
    check_finite(state, f"the draft being saved to {directory}")
    size = sum(v.numel() * v.element_size() for v in state.values())  # a full disk is refused before writing
    atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}), size=size)
    atomic_write_text(directory / CONFIG_NAME, json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return directory


def load_config(directory: str | os.PathLike) -> DraftConfig:
    """The validated :class:`DraftConfig` of a checkpoint directory (raises :class:`ConfigError` if it is wrong)."""
    return DraftConfig.from_hf_dict(read_config_json(directory))


def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint directory, with a clear error when it is absent or not JSON."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a draft checkpoint needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): truncated or not a config.json") from None


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from a safetensors header, without reading the tensors.

    Refuses a truncated or foreign file with a message saying so: the header's 8-byte length prefix,
    its JSON and the data size it announces must all fit the file's real size.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, not even a safetensors header")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise CheckpointError(
                f"{path} is truncated or not a safetensors file: its header announces "
                f"{length} header bytes but the file has {size} bytes in all"
            )
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + length + end != size:
        state = "truncated" if 8 + length + end > size else "longer than its header says"
        raise CheckpointError(
            f"{path} is {state}: the header describes {8 + length + end} bytes, the file "
            f"has {size} (an interrupted copy or download?); copy it again"
        )
    return {name: (str(v["dtype"]), tuple(int(d) for d in v["shape"])) for name, v in header.items()}


def check_architecture_vs_tensors(cfg: DraftConfig, names: Any) -> None:
    """Refuse a DFlash config over DFlash2 weights (engines would drop the conv and selector silently)."""
    if not cfg.is_dflash2:
        extra = sorted(n for n in names if "candidate_selector." in n or "_conv." in n)
        if extra:
            raise CheckpointError(
                f"architectures=['DFlashDraftModel'] but {WEIGHTS_NAME} holds {len(extra)} DFlash2 tensors "
                f"({extra[0]}, ...): served as DFlash the convolution and selector would be dropped silently. "
                "This is a DFlash2 checkpoint whose config.json lost its DFlash2 fields: restore "
                'architectures=["DFlash2DraftModel"] and dflash_config\'s projector_type, conv_kernel_size, '
                "conv_group_size, selector_rank, selector_top_k"
            )


def check_finite(state: dict[str, torch.Tensor], where: str | os.PathLike = WEIGHTS_NAME) -> None:
    """Raise :class:`CheckpointError` naming every tensor that holds NaN or infinite values."""
    bad = []
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            t = tensor.float()
            bad.append(f"{name} ({int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf)")
    if bad:
        raise CheckpointError(
            f"{where} holds non-finite weights in {len(bad)} tensors: {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; the run that wrote it diverged: use an earlier "
            "checkpoint, or retrain with a lower lr"
        )


def verify_checkpoint(directory: str | os.PathLike) -> DraftConfig:
    """Check a checkpoint directory exactly as :func:`load_draft` does, tensor by tensor; return its config.

    Config (architecture, fields, bounds), file integrity (truncation), the tensor contract (names and
    shapes) and finite values. Reads one tensor at a time, so it works on drafts larger than memory.
    """
    directory = Path(directory)
    cfg = load_config(directory)
    path = directory / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    header = read_safetensors_header(path)
    check_architecture_vs_tensors(cfg, header)
    check_tensors(cfg, {k: shape for k, (_, shape) in header.items()})
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            check_finite({name: f.get_tensor(name)}, path)
    return cfg


def load_draft(
    directory: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> DraftModel:
    """Load a checkpoint written by :func:`save_draft` (or any DFlash/DFlash2 HF checkpoint).

    Neither vLLM nor SGLang checks that every draft parameter was loaded, so this loader is strict: a
    config that is not exactly a DFlash/DFlash2 draft, a truncated file, a tensor missing, extra or
    misshapen, and NaN/inf weights each raise a :class:`CheckpointError` / ``ConfigError`` naming it.
    """
    cfg = load_config(directory)
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    header = read_safetensors_header(path)
    check_architecture_vs_tensors(cfg, header)
    check_tensors(cfg, {k: shape for k, (_, shape) in header.items()})
    state = load_file(str(path), device=str(device))
    check_finite(state, path)
    dtype = dtype or DTYPES[cfg.torch_dtype]
    model = DraftModel(cfg).to(device=device, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model
