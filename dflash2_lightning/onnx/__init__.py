"""ONNX export of the drafter and an onnxruntime drafter.

- :mod:`.ops` — the ``dflash`` ONNX domain: op schemas, the export translation table, reference bodies.
- :mod:`.graphs` — the ``context`` and ``draft_step`` graphs as torch modules.
- :mod:`.export` — :func:`export_drafter`: both graphs, checked, with and without function bodies.
- :mod:`.verify` — onnxruntime vs torch.
- :mod:`.drafter` — :class:`OrtDrafter`, a drop-in drafter for the speculative loop.
- :mod:`.bench` — drafting latency: torch eager vs onnxruntime (vs TensorRT on a GPU).
- :mod:`.cli` — ``python export/to_onnx.py``.

Named like ``torch.onnx``; inside the package ``import onnx`` still means the ``onnx`` library.
"""

from dflash2_lightning.onnx.drafter import OrtDrafter

__all__ = ["OrtDrafter"]
