"""How the Triton kernels are turned into launchable objects, shared by the launchers and the AOT path.

Each kernel file keeps its kernel as a *plain* Triton-language function. :func:`launchable`
decorates it with ``triton.jit`` at its first launch, and :mod:`dflash2_lightning.ops.triton_aot` builds
a ``JITFunction`` from the same function for ahead-of-time compilation.

``TRITON_INTERPRET=1`` (run kernels on CPU tensors with Triton's interpreter) must be set before
``triton`` is first imported in the process: Triton decorates its own library functions
(``tl.sum``, ``tl.argmax``, ...) at import, in the mode of that moment. A process is therefore either
interpreting or compiling, never both; ``tests/ops/test_triton_kernels.py`` runs its interpreter tests in a
child process for this reason.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

__all__ = ["launchable", "interpreting", "device_of", "next_power_of_2", "TRITON_DTYPES", "MAX_TOP_K"]

# torch dtype -> Triton signature name (pointer element types in the AOT signatures).
TRITON_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
}

MAX_TOP_K = 1024  # the lattice walk holds a K-wide score row of one request in registers

_DECORATED: dict[tuple[Callable, bool], object] = {}


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels then run on CPU tensors under Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def launchable(fn: Callable):
    """``triton.jit(fn)``, decorated once per interpreter setting."""
    key = (fn, interpreting())
    if key not in _DECORATED:
        import triton  # optional extra: imported only when a kernel is launched

        _DECORATED[key] = triton.jit(fn)
    return _DECORATED[key]


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (Triton block shapes must be powers of two)."""
    if n < 1:
        raise ValueError(f"n={n} is invalid: must be >= 1")
    return 1 << (n - 1).bit_length()


def device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for a launch (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
