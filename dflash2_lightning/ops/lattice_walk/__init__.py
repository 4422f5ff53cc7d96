"""``dflash::lattice_walk``: the torch op and reference (``torch_op``), Triton kernel (``triton_kernel``),
ONNX node (``onnx_function``) and TensorRT plugin (``tensorrt_plugin``)."""

from dflash2_lightning.ops.lattice_walk.torch_op import edge_scores, lattice_walk, walk_edge_scores

__all__ = ["lattice_walk", "edge_scores", "walk_edge_scores"]
