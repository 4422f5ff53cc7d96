"""Getting a draft out: the HF checkpoint the engines load, the engines' checks and SERVING.md, GGUF for
llama.cpp (and llama.cpp itself), ONNX graphs with the dflash custom ops, TensorRT engines."""
