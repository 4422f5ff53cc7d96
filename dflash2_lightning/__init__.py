"""dflash2-lightning: train DFlash2 speculative-decoding drafters with Lightning, export to ONNX / TensorRT / GGUF.

The package is laid out as the data path, in stages. A stage imports only itself and the stages listed before
it, never one listed after it, function-local imports included (``tests/test_layout.py`` holds this, and that
each error type is imported from the one module that defines it):

1. core        the modules beside the stages: ``config`` (DraftConfig), ``errors``, ``reporting``, ``files``,
               ``threads``, ``recipes``, ``intervals`` (bootstrap intervals and the replayed τ summary)
2. ops         each custom op in one home: eager reference, Triton kernel, ONNX function, TensorRT plugin
3. model       backbone, convolution, candidate selector, the draft, its drafting cache, its on-disk format
               (``model.checkpoint``) and the sampling law (``model.sampling``)
4. target      the frozen target: spec, loading (HF directory, GGUF, tiny random), features, head, generation,
               and the built-in corpus the tiny target's tokenizer is trained on
5. engines     what talks to serving engines: llama.cpp (build, ``llama-server``, GGUF of targets and drafts),
               the one OpenAI-compatible client, the engines' counters, what engines need from a draft and the
               commands that serve it, the acceptance record's file, ``dflash2 check-serving``
6. data        records and chat templates, the DataModule, the offline feature cache, prompts, regeneration
7. train       the LightningModule, its objective, metrics and option groups, run files, the ``fit`` CLI
8. decode      the speculative loop (greedy and sampled), the drafter interface, the drafting vocabulary
9. evaluate    τ by the loop and by replay, reports, the llama.cpp measurement, making the acceptance record
10. export     the end-of-fit export callback, SERVING.md and ``dflash2 check``, ONNX, TensorRT
11. quickstart the whole job in one command
12. cli        ``cli`` and ``__main__``: every action as a ``dflash2`` subcommand (by entry name, loaded when run)

Why this order where it is not obvious:

- The draft's on-disk format and the sampling law sit in ``model``: train, evaluate, export and the engines all
  read checkpoints, and the target's own generation samples with the same law as the loop.
- ``engines`` sits right after ``target``, before ``data``: ``dflash2 regen --server`` (data) sends its requests
  through the engines' client, and what engines need needs only the model and the target. So the draft's GGUF
  writer is there too (llama.cpp's format: ``dflash2 eval --engine llama.cpp`` writes one before it serves it),
  and so is the acceptance record's *file* (fields, reading, writing, the weights' hash check), which
  check-serving reads and the GGUF export copies; *making* a record is a replay, in ``evaluate``.
- ``export`` comes after ``evaluate``: the end-of-fit callback writes the acceptance record by a replay. The
  fit's CLI (train) cannot name that callback, so ``cli`` and ``quickstart`` hand it in
  (:data:`~dflash2_lightning.export.callback.FIT_END_CALLBACKS`).
"""

from dflash2_lightning.config import DraftConfig

__all__ = ["DraftConfig"]
__version__ = "0.1.0"
