"""TensorRT plugins for the two DFlash2 custom ops: :func:`register_plugins` registers both.

The ONNX nodes ``DFlashBlockConv`` and ``DFlashLatticeWalk`` (domain ``dflash``, attributes
``plugin_namespace="dflash"``, ``plugin_version="1"``) are parsed by TensorRT into the plugins
registered as ``dflash::DFlashBlockConv`` and ``dflash::DFlashLatticeWalk`` through TensorRT's Python
plugin API (``tensorrt.plugin``: register / autotune / aot_impl). Each plugin lives beside its op
(``ops/<op>/tensorrt_plugin.py``) with its shape, type and launch logic; both run ahead-of-time Triton
kernels, so a serialized engine needs no Python (trtexec / C++ can run it).

Call :func:`register_plugins` before parsing the ONNX model.
"""

from __future__ import annotations

from dflash2_lightning.ops.block_conv import tensorrt_plugin as block_conv_plugin
from dflash2_lightning.ops.lattice_walk import tensorrt_plugin as lattice_walk_plugin
from dflash2_lightning.ops.tensorrt_common import PLUGIN_NAMESPACE, PLUGIN_VERSION, tensorrt_version_problem

__all__ = ["PLUGIN_NAMESPACE", "PLUGIN_VERSION", "BLOCK_CONV_ID", "LATTICE_WALK_ID", "register_plugins"]

BLOCK_CONV_ID = block_conv_plugin.BLOCK_CONV_ID
LATTICE_WALK_ID = lattice_walk_plugin.LATTICE_WALK_ID
_REGISTERED = False


def register_plugins() -> None:
    """Register both plugins with TensorRT's plugin registry (idempotent). Needs TensorRT >= 11.2.1
    (:data:`~dflash2_lightning.ops.tensorrt_common.MIN_TENSORRT`); an older one is refused with the reason."""
    global _REGISTERED
    if _REGISTERED:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    problem = tensorrt_version_problem(trt.__version__)
    if problem is not None:
        raise RuntimeError(problem)

    block_conv_plugin.register(trt, trtp)
    lattice_walk_plugin.register(trt, trtp)
    _REGISTERED = True
