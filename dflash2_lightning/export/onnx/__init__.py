"""ONNX export of the drafter and an onnxruntime drafter.

- :mod:`.graphs` — the ``context`` and ``draft_step`` graphs as torch modules.
- :mod:`.export` — :func:`~.export.export_drafter`: both graphs, checked, with and without function bodies.
- :mod:`.verify` — onnxruntime vs torch.
- :mod:`.drafter` — :class:`OrtDrafter`, a drop-in drafter for the speculative loop.
- :mod:`.command` — ``dflash2 export-onnx`` / ``python export/to_onnx.py``.

The ``dflash`` ONNX domain itself (schemas, reference bodies) lives with the ops:
:mod:`dflash2_lightning.ops.onnx_functions`. Inside this package ``import onnx`` still means the library.
"""

from dflash2_lightning.export.onnx.drafter import OrtDrafter

__all__ = ["OrtDrafter"]
