"""`OrtDrafter`: the exported ``context`` / ``draft_step`` graphs behind the torch draft's interface.

It duck-types what the speculative loop uses of a draft (``dflash2_lightning.speculative.Drafter``)::

    drafter = OrtDrafter("exported/")                        # reads drafter.json + the two graphs
    cache = drafter.context_kv(features [B,C,n_t*H], positions [B,C])   # -> ContextKV (torch tensors)
    cache = cache.append(drafter.context_kv(new_features, new_positions))
    cache = cache.crop(n)
    tokens = drafter.draft_block(anchor [B], cache, embed, head, start)  # -> [B, bs-1] int64

The cache is the torch :class:`~dflash2_lightning.model.ContextKV` itself (tensors share memory with
onnxruntime's outputs), so ``append``/``crop`` behave exactly as with the torch draft. ``embed`` and
``head`` are accepted for interface compatibility and ignored: the target's embedding and head are
baked into ``draft_step``.

Greedy only: ``draft_step`` returns the walked tokens, not the candidates, scores and distributions
a sampled proposal needs, so the loop refuses ``temperature > 0`` with this drafter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.model import ContextKV, LayerKV

MANIFEST = "drafter.json"
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``drafter.json`` written by the exporter next to the graphs."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: export the drafter first (python export/to_onnx.py ...)")
    return json.loads(path.read_text())


def _numpy(t: Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    t = t.detach().to("cpu", dtype) if dtype is not None else t.detach().cpu()
    return np.ascontiguousarray(t.numpy())


class OrtDrafter:
    """Drafts with onnxruntime sessions of an exported drafter directory.

    Args:
        directory: what ``export/to_onnx.py`` wrote (``drafter.json``, ``context.onnx``, ``draft_step.onnx``).
        providers: onnxruntime execution providers (default: CPU).
        threads: intra-op threads per session (default: onnxruntime's choice).
        session_options: a prepared ``onnxruntime.SessionOptions`` (overrides ``threads``).
    """

    def __init__(self, directory: str | os.PathLike, providers: list[str] | None = None,
                 threads: int | None = None, session_options: Any = None) -> None:
        import onnxruntime as ort

        self.directory = Path(directory)
        self.manifest = read_manifest(directory)
        self.config = DraftConfig.from_hf_dict(self.manifest["config"])
        self.dtype = TORCH_DTYPES[self.manifest["dtype"]]
        if self.dtype == torch.bfloat16:
            raise ValueError(f"dtype={self.manifest['dtype']!r} in {self.directory}: onnxruntime's CPU provider has no "
                             "bfloat16 kernels; run bf16 graphs with TensorRT, or export fp16/fp32 for onnxruntime")
        options = session_options
        if options is None:
            options = ort.SessionOptions()
            if threads:
                options.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]
        graphs = self.manifest["graphs"]
        missing = [name for name in ("context", "draft_step") if name not in graphs]
        if missing:
            raise ValueError(f"{self.directory} lacks the graphs {missing}: export both context and draft_step")
        self._context = ort.InferenceSession(str(self.directory / graphs["context"]["file"]), options,
                                             providers=providers)
        self._step = ort.InferenceSession(str(self.directory / graphs["draft_step"]["file"]), options,
                                          providers=providers)
        self._kv_names = [o.name for o in self._context.get_outputs()]
        self._step_inputs = {i.name for i in self._step.get_inputs()}
        # The Drafter protocol of the speculative loop.
        self.block_size = self.config.block_size
        self.target_layer_ids = list(self.config.target_layer_ids or [])
        self.path = "selector" if self.config.is_dflash2 else "backbone"

    # ------------------------------------------------------------------ context
    def context_kv(self, features: Tensor, positions: Tensor) -> ContextKV:
        """K/V of target ``features [B, C, n_t*H]`` at ``positions [B, C]`` (cast to the graph's dtype)."""
        if features.dim() != 3 or positions.shape != features.shape[:2]:
            raise ValueError(f"features {tuple(features.shape)} and positions {tuple(positions.shape)} must be "
                             "[B, C, n_t*H] and [B, C]")
        positions = positions.to(torch.long)
        out = self._context.run(self._kv_names, {"features": _numpy(features, self.dtype),
                                                 "positions": _numpy(positions)})
        kv = [torch.from_numpy(a) for a in out]
        return ContextKV([LayerKV(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)], positions.cpu())

    # ------------------------------------------------------------------ block
    def draft_step(self, anchor: Tensor, context: ContextKV, start: Tensor | int | None = None) -> tuple[Tensor, ...]:
        """Run ``draft_step``: ``(tokens [B, bs-1], hidden [B, bs-1, H])`` (hidden only if exported)."""
        b = anchor.shape[0]
        if start is None:
            start = context.positions[:, -1] + 1 if context.length else torch.zeros(b, dtype=torch.long)
        start = torch.as_tensor(start, dtype=torch.long).reshape(-1).expand(b)
        feeds: dict[str, np.ndarray] = {"anchor": _numpy(anchor.to(torch.long)), "start": _numpy(start)}
        for i, layer in enumerate(context.layers):
            feeds[f"k_{i}"] = _numpy(layer.keys, self.dtype)
            feeds[f"v_{i}"] = _numpy(layer.values, self.dtype)
        if "context_positions" in self._step_inputs:
            feeds["context_positions"] = _numpy(context.positions.to(torch.long))
        return tuple(torch.from_numpy(a) for a in self._step.run(None, feeds))

    def draft_block(self, anchor: Tensor, context: ContextKV, embed: Any = None, head: Any = None,
                    start: Tensor | int | None = None) -> Tensor:
        """Draft tokens ``[B, bs-1]`` after ``anchor [B]`` at ``start`` (default: after the context).

        Same signature as :meth:`DraftModel.draft_block`; ``embed`` and ``head`` are baked into the
        graph and ignored here.
        """
        return self.draft_step(anchor, context, start)[0].to(anchor.device)

    def eval(self) -> "OrtDrafter":
        """No-op, for code that calls ``.eval()`` on any draft."""
        return self
