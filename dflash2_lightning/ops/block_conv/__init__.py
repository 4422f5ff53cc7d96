"""``dflash::block_conv``: the torch op and reference (``torch_op``), Triton kernel (``triton_kernel``),
ONNX node (``onnx_function``) and TensorRT plugin (``tensorrt_plugin``)."""

from dflash2_lightning.ops.block_conv.torch_op import block_conv, block_conv_reference

__all__ = ["block_conv", "block_conv_reference"]
