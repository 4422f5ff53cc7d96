"""`OrtDrafter`: the exported ``context`` / ``draft_step`` graphs behind the torch draft's interface.

It duck-types what the speculative loop uses of a draft (``dflash2_lightning.decode.speculative.Drafter``)::

    drafter = OrtDrafter("exported/")                        # reads drafter.json + the two graphs
    cache = drafter.new_cache(batch, capacity)               # preallocated DraftCache (torch buffers)
    cache.append(drafter.context_kv(features [B,C,n_t*H], positions [B,C]))   # O(C) copy into the buffers
    cache.crop(n)                                            # a rollback: only the valid length moves
    tokens = drafter.draft_block(anchor [B], cache, embed, head, start)      # -> [B, bs-1] int64

The cache is the torch :class:`~dflash2_lightning.model.DraftCache` (a reference
:class:`~dflash2_lightning.model.ContextKV` works too); its buffers go to ``draft_step`` as numpy views of the
same memory with the valid ``length``, no copy per step. ``embed`` and ``head`` are ignored: the target's are
baked into ``draft_step``. Greedy only (``draft_step`` returns walked tokens, not the distributions a sampled
proposal needs). Sessions do not spin their thread pools between calls by default: in the loop the target's
torch forward runs right after every draft step and needs the cores. More: docs/export.md.
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
from dflash2_lightning.model import ContextKV, DraftCache, LayerKV

MANIFEST = "drafter.json"
FORMAT_VERSION = 2  # what this drafter reads (see dflash2_lightning.export.onnx.export)
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
        spinning: let idle intra-op workers spin between calls (default False: they would compete
            with the target's torch threads in the speculative loop).
        session_options: a prepared ``onnxruntime.SessionOptions`` (overrides ``threads``, ``spinning``).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        providers: list[str] | None = None,
        threads: int | None = None,
        session_options: Any = None,
        spinning: bool = False,
    ) -> None:
        import onnxruntime as ort

        self.directory = Path(directory)
        self.manifest = read_manifest(directory)
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{self.directory / MANIFEST}: format_version={version!r} is not the supported "
                f"{FORMAT_VERSION} (draft_step over preallocated buffers with a length input): re-export "
                "the drafter with this version (python export/to_onnx.py ...)"
            )
        self.config = DraftConfig.from_hf_dict(self.manifest["config"])
        self.dtype = TORCH_DTYPES[self.manifest["dtype"]]
        if self.dtype == torch.bfloat16:
            raise ValueError(
                f"dtype={self.manifest['dtype']!r} in {self.directory}: onnxruntime's CPU provider has no "
                "bfloat16 kernels; run bf16 graphs with TensorRT, or export fp16/fp32 for onnxruntime"
            )
        options = session_options
        if options is None:
            options = ort.SessionOptions()
            if threads:
                options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1  # one graph at a time: the loop is sequential
            options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        providers = providers or ["CPUExecutionProvider"]
        graphs = self.manifest["graphs"]
        missing = [name for name in ("context", "draft_step") if name not in graphs]
        if missing:
            raise ValueError(f"{self.directory} lacks the graphs {missing}: export both context and draft_step")
        self._context = ort.InferenceSession(
            str(self.directory / graphs["context"]["file"]), options, providers=providers
        )
        self._step = ort.InferenceSession(
            str(self.directory / graphs["draft_step"]["file"]), options, providers=providers
        )
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
            raise ValueError(
                f"features {tuple(features.shape)} and positions {tuple(positions.shape)} must be "
                "[B, C, n_t*H] and [B, C]"
            )
        positions = positions.to(torch.long)
        out = self._context.run(
            self._kv_names, {"features": _numpy(features, self.dtype), "positions": _numpy(positions)}
        )
        kv = [torch.from_numpy(a) for a in out]
        return ContextKV([LayerKV(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)], positions.cpu())

    def new_cache(self, batch: int, capacity: int) -> DraftCache:
        """An empty preallocated cache of ``capacity`` context positions in the graphs' dtype (CPU)."""
        cfg = self.config
        if cfg.head_dim is None:
            raise RuntimeError("the draft's head_dim is unset (DraftConfig derives it when made)")
        return DraftCache(
            cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, capacity, cfg.block_size, self.dtype
        )

    # ------------------------------------------------------------------ block
    def draft_step(
        self, anchor: Tensor, context: ContextKV | DraftCache, start: Tensor | int | None = None
    ) -> tuple[Tensor, ...]:
        """Run ``draft_step``: ``(tokens [B, bs-1], hidden [B, bs-1, H])`` (hidden only if exported)."""
        b = anchor.shape[0]
        if start is None:
            start = context.positions[:, -1] + 1 if context.length else torch.zeros(b, dtype=torch.long)
        start = torch.as_tensor(start, dtype=torch.long).reshape(-1).expand(b)
        if isinstance(context, DraftCache):  # the whole buffers (views, no copy); slots >= length are ignored
            keys, values, positions = context.keys, context.values, context.slot_positions
        else:
            keys = [layer.keys for layer in context.layers]
            values = [layer.values for layer in context.layers]
            positions = context.positions
        length = np.full((b,), context.length, dtype=np.int64)
        feeds: dict[str, np.ndarray] = {
            "anchor": _numpy(anchor.to(torch.long)),
            "start": _numpy(start),
            "length": length,
        }
        for i, (k, v) in enumerate(zip(keys, values)):
            feeds[f"k_{i}"] = _numpy(k, self.dtype)
            feeds[f"v_{i}"] = _numpy(v, self.dtype)
        if "context_positions" in self._step_inputs:
            feeds["context_positions"] = _numpy(positions.to(torch.long))
        return tuple(torch.from_numpy(a) for a in self._step.run(None, feeds))

    def draft_block(
        self,
        anchor: Tensor,
        context: ContextKV | DraftCache,
        embed: Any = None,
        head: Any = None,
        start: Tensor | int | None = None,
    ) -> Tensor:
        """Draft tokens ``[B, bs-1]`` after ``anchor [B]`` at ``start`` (default: after the context).

        Same signature as :meth:`DraftModel.draft_block`; ``embed`` and ``head`` are baked into the
        graph and ignored here.
        """
        return self.draft_step(anchor, context, start)[0].to(anchor.device)

    def eval(self) -> OrtDrafter:
        """No-op, for code that calls ``.eval()`` on any draft."""
        return self
