"""Ahead-of-time compilation of the Triton kernels to PTX, for TensorRT plugins and offline checks.

``triton.compile`` runs the whole compiler (Triton IR -> LLVM -> PTX -> cubin with the ``ptxas``
bundled in the triton wheel) for an explicit :class:`GPUTarget`, so PTX for sm_80 / sm_90 is produced
on a machine without a GPU. The kernel is compiled from the plain function in its kernel file, in a
process where ``TRITON_INTERPRET`` is not set (see :mod:`dflash2_lightning.ops.triton_runtime`). Each
op's ``triton_kernel`` module holds its own ``compile_*`` function built on :func:`compile_kernel`.

TensorRT's AOT plugin launch passes exactly ``inputs, scalar args, outputs``. Triton >= 3.3 appends
two pointer parameters (``global_scratch``, ``profile_scratch``) to every kernel entry; our kernels
use neither, so :func:`compile_kernel` removes them from the PTX entry after checking they are never
read. A launcher that passes them anyway is unaffected: the driver reads as many parameters as the
entry declares.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash2_lightning.ops.triton_runtime import TRITON_DTYPES

__all__ = ["AotKernel", "compile_kernel", "cuda_target", "float_type_name", "ptx_entry_params"]

FLOAT_TYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class AotKernel:
    """One compiled kernel: what a launcher (TensorRT, the CUDA driver) needs."""

    name: str  # PTX entry name
    ptx: str  # PTX text, trailing unused scratch parameters removed
    cubin: bytes  # cubin for ``arch`` (compiled before the parameter removal; keeps Triton's entry)
    arch: int  # compute capability, e.g. 80, 90
    num_warps: int
    shared: int  # dynamic shared memory in bytes
    params: tuple[str, ...]  # argument names in launch order (inputs, scalars, outputs)
    constants: dict[str, int] = field(default_factory=dict)

    @property
    def block_x(self) -> int:
        """Threads per block."""
        return self.num_warps * 32


def float_type_name(dtype: torch.dtype | str) -> str:
    """``torch.float16`` / ``"float16"`` / ``"fp16"`` -> Triton's ``"fp16"``; raises on anything else."""
    if isinstance(dtype, torch.dtype):
        name = TRITON_DTYPES.get(dtype)
    else:
        name = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}.get(
            dtype, dtype
        )
    if name not in FLOAT_TYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: must be one of float32, float16, bfloat16")
    return name


def cuda_target(arch: int | None = None):
    """A ``GPUTarget`` for compute capability ``arch`` (e.g. 80, 90); ``None`` = the current CUDA device."""
    from triton.backends.compiler import GPUTarget

    if arch is None:
        if not torch.cuda.is_available():
            raise RuntimeError("arch=None needs a CUDA device to compile for; pass arch (e.g. 80 or 90) instead")
        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor
    if arch < 75:
        raise ValueError(f"arch={arch} is invalid: Triton needs compute capability >= 75")
    return GPUTarget("cuda", arch, 32)


def ptx_entry_params(ptx: str, name: str) -> list[str]:
    """The parameter declarations of entry ``name`` in ``ptx``, in order."""
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError(f"kernel entry {name!r} not found in the PTX")
    return [p.strip() for p in match.group(1).split(",") if p.strip()]


def _drop_unused_params(ptx: str, name: str, keep: int) -> str:
    """Remove entry parameters after the first ``keep`` if the kernel body never reads them."""
    params = ptx_entry_params(ptx, name)
    for index in range(keep, len(params)):
        symbol = f"{name}_param_{index}"
        if len(re.findall(re.escape(symbol) + r"\b", ptx)) != 1:
            raise RuntimeError(f"{name}: parameter {index} ({symbol}) is used by the kernel; cannot drop it")
    if len(params) == keep:
        return ptx
    match = re.search(r"(\.entry\s+" + re.escape(name) + r"\s*\()(.*?)(\))", ptx, re.S)
    if match is None:  # ptx_entry_params found it with the same pattern
        raise ValueError(f"kernel entry {name!r} not found in the PTX")
    kept = ",\n".join("\t" + p for p in params[:keep])
    return ptx[: match.start(2)] + "\n" + kept + "\n" + ptx[match.end(2) :]


def compile_kernel(
    fn: Callable, signature: dict[str, str], constants: dict[str, int], num_warps: int, arch: int | None = None
) -> AotKernel:
    """Compile plain Triton function ``fn`` for ``arch``; ``signature`` maps every argument to its type."""
    import triton
    from triton.compiler import ASTSource

    from dflash2_lightning.ops.triton_runtime import interpreting

    if interpreting():
        raise RuntimeError(
            "ahead-of-time compilation needs a process without TRITON_INTERPRET=1 "
            "(Triton's library is interpreted in this one)"
        )
    source = ASTSource(
        triton.JITFunction(fn),
        signature={**signature, **{k: "constexpr" for k in constants}},
        constexprs=dict(constants),
    )
    target = cuda_target(arch)
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps})
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{meta.name} needs Triton scratch memory, which TensorRT's AOT launch cannot give")
    ptx = _drop_unused_params(compiled.asm["ptx"], meta.name, keep=len(signature))
    return AotKernel(
        name=meta.name,
        ptx=ptx,
        cubin=compiled.asm["cubin"],
        arch=target.arch,
        num_warps=meta.num_warps,
        shared=meta.shared,
        params=tuple(signature),
        constants=dict(constants),
    )
