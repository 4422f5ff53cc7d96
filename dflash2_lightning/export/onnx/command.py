"""``dflash2 export-onnx`` (``python export/to_onnx.py``): export a trained draft as ONNX drafting graphs, verified.

    dflash2 export-onnx --draft runs/draft --target smollm2 --out exported/fp16 --dtype fp16

``--target`` names the target whose frozen embedding and head are baked into ``draft_step``: a local
Hugging Face directory, a ``.gguf`` file (or ``smollm2``), or ``tiny`` (a seeded random embedding
and head of the draft's geometry, for smoke tests). The command prints what it wrote, then runs
both graphs with onnxruntime against the torch draft; it exits 0 only if they agree (1 otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.errors import bounded
from dflash2_lightning.export.onnx.drafter import TORCH_DTYPES
from dflash2_lightning.export.onnx.export import (
    DEFAULT_OPSET,
    MIN_OPSET,
    export_drafter,
    max_opset,
    random_embedding_and_head,
    target_embedding_and_head,
)
from dflash2_lightning.export.onnx.verify import verify_export
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.checkpoint import load_draft


def resolve_target(target: str, draft: DraftModel, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The target's embedding and head for ``--target`` (HF directory, ``.gguf``/``smollm2``, or ``tiny``)."""
    cfg = draft.config
    if target == "tiny":
        return random_embedding_and_head(cfg.vocab_size, cfg.hidden_size, seed)
    from dflash2_lightning.target.arguments import target_spec_from_arg
    from dflash2_lightning.target.load import load_target
    from dflash2_lightning.target.spec import TargetError

    # The same --target values as `dflash2 eval` / `regen` (a JSON TargetSpec included); plain 'tiny' keeps
    # its meaning here: a random embedding and head of the draft's own geometry.
    spec = target_spec_from_arg(target)
    loaded = load_target(spec)
    embed, head = target_embedding_and_head(loaded)
    vocab, hidden = embed.weight.shape
    if (vocab, hidden) != (cfg.vocab_size, cfg.hidden_size):
        raise TargetError(
            f"--target {target!r} does not fit the draft: target vocab_size={vocab}, hidden_size={hidden} "
            f"but the draft has vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}"
        )
    return embed, head


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x5,3x19"`` -> ``((1, 5), (3, 19))``: batch x context cases, both >= 1."""
    try:
        cases = tuple(tuple(int(v) for v in item.split("x")) for item in text.split(","))
    except ValueError:
        cases = ()
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(
            f"--verify-cases {text!r} is invalid: must look like '1x5,3x19' (batch x context, both >= 1)"
        )
    return cases  # type: ignore[return-value]


def _cases_text(text: str) -> str:
    """``--verify-cases``: the text, once :func:`_cases` reads it (kept as text, so --print-config writes what
    --config reads)."""
    _cases(text)
    return text


@dataclass(kw_only=True)
class ExportOnnxOptions:
    """The options of ``dflash2 export-onnx`` (``python export/to_onnx.py``).

    ``--target`` is the action's own, not :class:`~dflash2_lightning.target.arguments.TargetOptions`: only the
    target's embedding and head are read, and ``tiny`` means a random embedding and head of the draft's geometry.
    """

    draft: str = option(REQUIRED, "draft checkpoint directory (config.json + model.safetensors)")
    target: str = option(
        REQUIRED,
        "HF directory, .gguf file, 'smollm2', a JSON TargetSpec (as `dflash2 eval --target`), or "
        "'tiny' (a random embedding and head of the draft's geometry)",
    )
    out: str = option(REQUIRED, "output directory")
    dtype: str = option("fp32", "graph precision (default {default})", choices=sorted(TORCH_DTYPES))
    opset: int = option(
        DEFAULT_OPSET,
        f"default-domain opset, {MIN_OPSET} to {max_opset()} (the installed onnx's newest; default {{default}})",
        parse=bounded(int, MIN_OPSET, max_opset()),
    )
    hidden: bool = option(True, "draft_step outputs tokens only", flag="--no-hidden")
    verify_cases: str = option(
        "1x5,3x19", "batch x context cases for the onnxruntime check (default {default})", parse=_cases_text
    )
    verify: bool = option(True, "skip the onnxruntime check (not recommended)", flag="--no-verify")
    seed: int = option(0, "seed of the 'tiny' target and the check's inputs (default {default})")

    @property
    def cases(self) -> tuple[tuple[int, int], ...]:
        """``verify_cases`` as (batch, context) pairs."""
        return _cases(self.verify_cases)


DESCRIPTION = (
    "Export a draft as the ONNX drafting graphs (context, draft_step) with the dflash custom ops, and check them "
    "with onnxruntime against torch. Writes OUT/context.onnx, OUT/draft_step.onnx (and their .trt.onnx copies for "
    "TensorRT) and OUT/drafter.json."
)


def quiet_export_warnings() -> None:
    """Drop torch.onnx's "torchvision is not installed. Skipping torchvision::nms" lines (eight per export):
    this project exports no torchvision op."""
    import logging

    class _NoTorchvision(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "torchvision" not in record.getMessage()

    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    if not any(type(f).__name__ == "_NoTorchvision" for f in logger.filters):
        logger.addFilter(_NoTorchvision())


def main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 export-onnx`` / ``python export/to_onnx.py``: 0 when onnxruntime agrees with torch, 1 when not."""
    quiet_export_warnings()
    opts = parse_options(ExportOnnxOptions, argv, prog="dflash2 export-onnx", description=DESCRIPTION)
    from dflash2_lightning.files import check_writable

    check_writable(opts.out, directory=True)  # before the draft and the target are loaded
    draft = load_draft(opts.draft, device="cpu").eval()
    embed, head = resolve_target(opts.target, draft, opts.seed)
    t0 = time.perf_counter()
    result = export_drafter(draft, embed, head, opts.out, dtype=opts.dtype, opset=opts.opset, with_hidden=opts.hidden)
    print(result.describe())
    print(f"exported in {time.perf_counter() - t0:.1f} s; checker (full_check) and strict shape inference passed")
    if not opts.verify:
        print("onnxruntime check skipped (--no-verify)")
        return 0
    report = verify_export(opts.out, draft, embed, head, cases=opts.cases, seed=opts.seed)
    print(report.describe())
    if not report.ok:
        print("FAILED: onnxruntime disagrees with torch", file=sys.stderr)
        return 1
    print("OK")
    return 0
