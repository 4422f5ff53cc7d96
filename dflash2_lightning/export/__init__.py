"""Getting a draft out: the end-of-fit export (:class:`~dflash2_lightning.export.callback.ExportOnFitEnd`: the HF
checkpoint, SERVING.md and the acceptance record), SERVING.md with the engines' checks, ONNX graphs with the dflash
custom ops, TensorRT engines. The HF checkpoint's format is :mod:`dflash2_lightning.model.checkpoint`; the GGUF
for llama.cpp is :mod:`dflash2_lightning.engines.draft_gguf`."""
