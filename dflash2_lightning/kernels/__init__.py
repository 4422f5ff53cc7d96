"""Triton kernels for the custom ops (optional ``kernels`` extra); see ``dflash2_lightning.ops``.

``cuda_block_conv`` and ``cuda_lattice_walk`` are the launchers the ``dflash::`` ops call on CUDA
tensors. They are set on import when Triton is installed and a CUDA device is present, and stay
``None`` otherwise (the ops then use their eager reference). ``DFLASH2_DISABLE_TRITON=1`` keeps them
``None`` on a GPU too (to time or debug the reference). Nothing here imports ``triton`` unless both
conditions hold, so importing the package is free on a CPU-only install.

Modules: ``block_conv`` and ``lattice_walk`` (kernels + launchers, which also run on CPU tensors
under ``TRITON_INTERPRET=1``), ``aot`` (ahead-of-time PTX for TensorRT plugins), ``runtime`` (shared
helpers).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

__all__ = ["cuda_block_conv", "cuda_lattice_walk", "triton_available", "enable_cuda_kernels"]

cuda_block_conv: Callable | None = None
cuda_lattice_walk: Callable | None = None


def triton_available() -> bool:
    """True when the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def enable_cuda_kernels() -> bool:
    """Point the ops at the Triton launchers if Triton and a CUDA device are present; return whether it did."""
    global cuda_block_conv, cuda_lattice_walk
    if os.environ.get("DFLASH2_DISABLE_TRITON", "0") == "1" or not triton_available():
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    from dflash2_lightning.kernels.block_conv import block_conv
    from dflash2_lightning.kernels.lattice_walk import lattice_walk

    cuda_block_conv, cuda_lattice_walk = block_conv, lattice_walk
    return True


enable_cuda_kernels()
