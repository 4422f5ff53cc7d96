"""What talks to serving engines (llama.cpp, vLLM, SGLang): building llama.cpp and running ``llama-server``,
converting targets and writing drafts as GGUF, the one OpenAI-compatible HTTP client, the engines' own counters,
what the engines need from a draft (and the commands that serve it), the acceptance record's file and
``dflash2 check-serving``."""
