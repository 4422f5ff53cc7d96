"""Which implementation of a custom op runs: the eager reference, the dispatcher, or a Triton kernel.

Two rules, shared by both ops:

- :func:`eager_inference`: plain eager code without autograd calls an op's implementation directly,
  skipping the ``torch.library`` dispatcher (whose own cost, ~0.1 ms a call, is as much as a small
  draft layer's whole block convolution at batch 1); tracing, compiling, exporting and autograd go
  through the registered op, so each op stays one node with its own backward.
- :data:`cuda_block_conv` / :data:`cuda_lattice_walk`: the Triton launchers the ops call on CUDA
  tensors. They are set on import when Triton is installed (the ``kernels`` extra) and a CUDA device
  is present, and stay ``None`` otherwise (the ops then use their eager reference).
  ``DFLASH2_DISABLE_TRITON=1`` keeps them ``None`` on a GPU too (to time or debug the reference).
  Nothing here imports ``triton`` unless both conditions hold, so importing the ops is free on a
  CPU-only install.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["cuda_block_conv", "cuda_lattice_walk", "triton_available", "enable_cuda_kernels", "eager_inference"]

cuda_block_conv: Callable | None = None
cuda_lattice_walk: Callable | None = None


def eager_inference(*tensors: Tensor) -> bool:
    """True when an op may skip the ``torch.library`` dispatcher and run its implementation directly.

    That is: plain eager code (not traced by ``torch.export`` / ``torch.compile`` / the ONNX exporter,
    which must see the op as one node) and no autograd (nothing to record a backward for).
    """
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def triton_available() -> bool:
    """True when the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def enable_cuda_kernels() -> bool:
    """Point the ops at the Triton launchers if Triton and a CUDA device are present; return whether it did."""
    global cuda_block_conv, cuda_lattice_walk
    if os.environ.get("DFLASH2_DISABLE_TRITON", "0") == "1" or not triton_available():
        return False
    if not torch.cuda.is_available():
        return False
    from dflash2_lightning.ops.block_conv.triton_kernel import block_conv
    from dflash2_lightning.ops.lattice_walk.triton_kernel import lattice_walk

    cuda_block_conv, cuda_lattice_walk = block_conv, lattice_walk
    return True


enable_cuda_kernels()
