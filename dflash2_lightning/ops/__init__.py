"""The two DFlash2 custom ops, each in one home with every implementation of it side by side.

==================  ===========================================================================
``ops/<op>/``       what it holds
==================  ===========================================================================
``torch_op.py``     the eager reference and the ``torch.library`` op (``dflash::block_conv``,
                    ``dflash::lattice_walk``): what the model calls, traced as one node on export
``triton_kernel.py`` the Triton kernel, its launcher (CUDA, or CPU under ``TRITON_INTERPRET=1``)
                    and its ahead-of-time PTX compilation (``kernels`` extra)
``onnx_function.py`` the ONNX schema and reference body of the ``dflash`` domain node
``tensorrt_plugin.py`` the TensorRT plugin: shapes, types, launch grid, registration
==================  ===========================================================================

Shared by both: :mod:`~dflash2_lightning.ops.dispatch` (which implementation runs),
:mod:`~dflash2_lightning.ops.triton_runtime` / :mod:`~dflash2_lightning.ops.triton_aot` (Triton),
:mod:`~dflash2_lightning.ops.onnx_domain` / :mod:`~dflash2_lightning.ops.onnx_functions` (the ONNX domain),
:mod:`~dflash2_lightning.ops.tensorrt_common` / :mod:`~dflash2_lightning.ops.tensorrt_plugins` (TensorRT).
"""

from dflash2_lightning.ops.block_conv.torch_op import block_conv, block_conv_reference
from dflash2_lightning.ops.lattice_walk.torch_op import (
    edge_scores,
    lattice_walk,
    lattice_walk_per_position,
    walk_edge_scores,
)

__all__ = [
    "block_conv",
    "lattice_walk",
    "block_conv_reference",
    "edge_scores",
    "walk_edge_scores",
    "lattice_walk_per_position",
]
