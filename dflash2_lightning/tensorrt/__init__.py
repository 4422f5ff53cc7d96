"""TensorRT: engines from the exported drafting graphs, with the ``dflash`` custom ops as plugins.

:mod:`~dflash2_lightning.tensorrt.build` parses the ONNX graphs, profiles their dynamic axes, builds and
checks engines against onnxruntime (``python export/to_trt.py``); :mod:`~dflash2_lightning.tensorrt.plugins`
registers the block convolution and the lattice walk as TensorRT plugins backed by ahead-of-time Triton
kernels. Both import TensorRT only when they build, so the package imports on a machine without it.
"""
