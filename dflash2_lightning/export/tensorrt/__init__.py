"""TensorRT: engines from the exported drafting graphs, with the ``dflash`` custom ops as plugins.

:mod:`~dflash2_lightning.export.tensorrt.build` parses the ONNX graphs, profiles their dynamic axes, builds and
checks engines against onnxruntime; :mod:`~dflash2_lightning.export.tensorrt.command` is ``dflash2 export-trt``
(``python export/to_trt.py``). The plugins live with the ops (:mod:`dflash2_lightning.ops.tensorrt_plugins`).
TensorRT is imported only when an engine is built, so the package imports on a machine without it.
"""
