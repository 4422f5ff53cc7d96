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

from torch import nn

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
    try:
        cases = tuple(tuple(int(v) for v in item.split("x")) for item in text.split(","))
    except ValueError:
        cases = ()
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(
            f"--verify-cases {text!r} is invalid: must look like '1x5,3x19' (batch x context, both >= 1)"
        )
    return cases  # type: ignore[return-value]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash2 export-onnx",
        description="Export a draft as the ONNX drafting "
        "graphs (context, draft_step) with the dflash custom ops, and check them with "
        "onnxruntime against torch. Writes OUT/context.onnx, OUT/draft_step.onnx (and their "
        ".trt.onnx copies for TensorRT) and OUT/drafter.json.",
    )
    p.add_argument("--draft", required=True, help="draft checkpoint directory (config.json + model.safetensors)")
    p.add_argument(
        "--target",
        required=True,
        help="HF directory, .gguf file, 'smollm2', a JSON TargetSpec (as `dflash2 eval --target`), or "
        "'tiny' (a random embedding and head of the draft's geometry)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="fp32", choices=sorted(TORCH_DTYPES), help="graph precision (default fp32)")
    p.add_argument(
        "--opset",
        type=bounded(int, MIN_OPSET, max_opset()),
        default=DEFAULT_OPSET,
        help=f"default-domain opset, {MIN_OPSET} to {max_opset()} (the installed onnx's newest; default "
        f"{DEFAULT_OPSET})",
    )
    p.add_argument("--no-hidden", action="store_true", help="draft_step outputs tokens only")
    p.add_argument(
        "--verify-cases",
        type=_cases,
        default=((1, 5), (3, 19)),
        help="batch x context cases for the onnxruntime check (default 1x5,3x19)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the onnxruntime check (not recommended)")
    p.add_argument("--seed", type=int, default=0, help="seed of the 'tiny' target and the check's inputs")
    return p


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


def main(argv: list[str] | None = None) -> int:
    """``dflash2 export-onnx`` / ``python export/to_onnx.py``: 0 when onnxruntime agrees with torch, 1 when not."""
    quiet_export_warnings()
    args = parser().parse_args(argv)
    from dflash2_lightning.files import check_writable

    check_writable(args.out, directory=True)  # before the draft and the target are loaded
    draft = load_draft(args.draft, device="cpu").eval()
    embed, head = resolve_target(args.target, draft, args.seed)
    t0 = time.perf_counter()
    result = export_drafter(
        draft, embed, head, args.out, dtype=args.dtype, opset=args.opset, with_hidden=not args.no_hidden
    )
    print(result.describe())
    print(f"exported in {time.perf_counter() - t0:.1f} s; checker (full_check) and strict shape inference passed")
    if args.no_verify:
        print("onnxruntime check skipped (--no-verify)")
        return 0
    report = verify_export(args.out, draft, embed, head, cases=args.verify_cases, seed=args.seed)
    print(report.describe())
    if not report.ok:
        print("FAILED: onnxruntime disagrees with torch", file=sys.stderr)
        return 1
    print("OK")
    return 0
