"""Targets as GGUF for llama.cpp: llama.cpp's own converter (``convert_hf_to_gguf.py`` from the pinned sdist,
with its own ``gguf-py``) on a target's HF weights, once, cached beside the build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dflash2_lightning.engines.llama_cpp import LlamaCpp, LlamaCppError, build_root, llama_cpp_source


def convert_hf_to_gguf(
    model_dir: str | os.PathLike,
    out: str | os.PathLike,
    outtype: str = "f32",
    target_model_dir: str | os.PathLike | None = None,
    llama: LlamaCpp | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Run llama.cpp's own ``convert_hf_to_gguf.py`` from the pinned sdist (with its own ``gguf-py``).

    Used to turn a target's HF directory into the GGUF llama.cpp serves, and by the tests as the
    reference for :mod:`dflash2_lightning.engines.draft_gguf`. Needs only the unpacked source, not the build.
    A DFlash draft needs ``target_model_dir`` (its vocabulary). Llama vocabularies need ``sentencepiece``.
    """
    if llama is None:
        llama = llama_cpp_source(cache_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    cmd = [
        sys.executable,
        str(llama.source / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(tmp),
    ]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(llama.source / "gguf-py"), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(
            f"convert_hf_to_gguf.py failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}"
        )
    os.replace(tmp, out)
    return out


def target_gguf(target_spec: Any, outtype: str = "f32", cache_dir: str | os.PathLike | None = None) -> Path:
    """The target as a GGUF for llama.cpp: its HF weights converted once by llama.cpp's converter.

    ``outtype="shipped"`` returns the target's own GGUF file (e.g. the quantised SmolLM2 GGUF) as it
    is, for a GGUF target. Otherwise the target's HF directory (for a GGUF target: the cached
    conversion the project trains against) goes through ``convert_hf_to_gguf.py --outtype`` into
    ``<cache>/llama.cpp/<version>/targets/<dir name>-<outtype>.gguf``, reused afterwards.
    """
    from dflash2_lightning.target.gguf import resolve_gguf
    from dflash2_lightning.target.load import hf_dir_of
    from dflash2_lightning.target.spec import TargetSpec

    spec = target_spec if isinstance(target_spec, TargetSpec) else TargetSpec(**target_spec)
    if outtype == "shipped":
        if spec.gguf is None:
            raise LlamaCppError(f"target {spec.key()} is not a GGUF: there is no shipped GGUF, use outtype f32")
        return resolve_gguf(spec.gguf)
    if spec.tiny is not None:
        raise LlamaCppError(
            "the tiny random target has no llama.cpp vocabulary (its BPE pre-tokenizer is not one "
            "llama.cpp knows); use a real target such as smollm2"
        )
    hf_dir = hf_dir_of(spec)
    out = build_root(cache_dir) / "targets" / f"{hf_dir.name}-{outtype}.gguf"
    if not out.is_file():
        convert_hf_to_gguf(hf_dir, out, outtype, cache_dir=cache_dir)
    return out
