"""Ahead-of-time compilation of the Triton kernels to PTX, for TensorRT plugins and offline checks.

``triton.compile`` runs the whole compiler (Triton IR -> LLVM -> PTX -> cubin with the ``ptxas``
bundled in the triton wheel) for an explicit :class:`GPUTarget`, so PTX for sm_80 / sm_90 is produced
on a machine without a GPU. The kernel is compiled from the plain function in its kernel file, in a
process where ``TRITON_INTERPRET`` is not set (see ``kernels.runtime``).

TensorRT's AOT plugin launch passes exactly ``inputs, scalar args, outputs``. Triton >= 3.3 appends
two pointer parameters (``global_scratch``, ``profile_scratch``) to every kernel entry; our kernels
use neither, so :func:`compile_kernel` removes them from the PTX entry after checking they are never
read. A launcher that passes them anyway is unaffected: the driver reads as many parameters as the
entry declares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash2_lightning.kernels.runtime import TRITON_DTYPES

__all__ = ["AotKernel", "compile_kernel", "compile_block_conv", "compile_lattice_walk", "cuda_target",
           "float_type_name", "ptx_entry_params"]

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
            dtype, dtype)
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
    kept = ",\n".join("\t" + p for p in params[:keep])
    return ptx[: match.start(2)] + "\n" + kept + "\n" + ptx[match.end(2):]


def compile_kernel(fn: Callable, signature: dict[str, str], constants: dict[str, int], num_warps: int,
                   arch: int | None = None) -> AotKernel:
    """Compile plain Triton function ``fn`` for ``arch``; ``signature`` maps every argument to its type."""
    import triton
    from triton.compiler import ASTSource

    from dflash2_lightning.kernels.runtime import interpreting

    if interpreting():
        raise RuntimeError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1 "
                           "(Triton's library is interpreted in this one)")
    source = ASTSource(triton.JITFunction(fn), signature={**signature, **{k: "constexpr" for k in constants}},
                       constexprs=dict(constants))
    target = cuda_target(arch)
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps})
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{meta.name} needs Triton scratch memory, which TensorRT's AOT launch cannot give")
    ptx = _drop_unused_params(compiled.asm["ptx"], meta.name, keep=len(signature))
    return AotKernel(name=meta.name, ptx=ptx, cubin=compiled.asm["cubin"], arch=target.arch,
                     num_warps=meta.num_warps, shared=meta.shared, params=tuple(signature),
                     constants=dict(constants))


def compile_block_conv(dtype: torch.dtype | str = "fp32", hidden: int = 1024, arch: int | None = None, *,
                       base_dtype: torch.dtype | str | None = None,
                       delta_dtype: torch.dtype | str | None = None) -> AotKernel:
    """The block-conv kernel for ``x``/``y`` of float ``dtype`` (``base``/``delta`` default to it) and ``hidden``."""
    from dflash2_lightning.kernels.block_conv import BLOCK_CONV_SCALARS, block_conv_kernel, block_conv_tiles

    ty = float_type_name(dtype)
    base_ty = float_type_name(base_dtype or ty)
    delta_ty = float_type_name(delta_dtype or ty)
    block_rows, block_h, num_warps = block_conv_tiles(hidden)
    signature = {"x_ptr": f"*{ty}", "base_ptr": f"*{base_ty}", "delta_ptr": f"*{delta_ty}",
                 **{name: "i32" for name in BLOCK_CONV_SCALARS}, "y_ptr": f"*{ty}"}
    return compile_kernel(block_conv_kernel, signature, {"BLOCK_ROWS": block_rows, "BLOCK_H": block_h},
                          num_warps, arch)


def compile_lattice_walk(dtype: torch.dtype | str = "fp32", top_k: int = 16, rank: int = 256,
                         arch: int | None = None, *, proj_dtype: torch.dtype | str | None = None,
                         pred_dtype: torch.dtype | str | None = None,
                         succ_dtype: torch.dtype | str | None = None) -> AotKernel:
    """The lattice-walk kernel for ``unary`` of float ``dtype`` (``proj`` and the codebooks default to it)."""
    from dflash2_lightning.kernels.lattice_walk import LATTICE_WALK_SCALARS, lattice_walk_kernel, lattice_walk_tiles

    ty = float_type_name(dtype)
    proj_ty, pred_ty, succ_ty = (float_type_name(d or ty) for d in (proj_dtype, pred_dtype, succ_dtype))
    block_k, block_r, num_warps = lattice_walk_tiles(top_k, rank)
    signature = {"cand_ptr": "*i64", "unary_ptr": f"*{ty}", "proj_ptr": f"*{proj_ty}", "anchor_ptr": "*i64",
                 "pred_ptr": f"*{pred_ty}", "succ_ptr": f"*{succ_ty}",
                 **{name: "i32" for name in LATTICE_WALK_SCALARS}, "tokens_ptr": "*i64"}
    return compile_kernel(lattice_walk_kernel, signature, {"BLOCK_K": block_k, "BLOCK_R": block_r}, num_warps, arch)
