"""What both TensorRT plugins share: type names, shape checks, and reading TensorRT's shape expressions.

Plain functions, callable without TensorRT (the CPU tests call them). Deliberately no
``from __future__ import annotations`` in the plugin modules that use these: ``tensorrt.plugin`` reads
the registered functions' annotations as objects.
"""

import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "FLOAT_TYPES",
    "Dim",
    "Shape",
    "check_rank",
    "must_equal",
    "triton_type_of",
    "known",
    "known_shape",
    "triton_type",
    "build_arch",
    "MIN_TENSORRT",
    "TENSORRT_REQUIREMENT",
    "tensorrt_version_problem",
]

#: The oldest TensorRT the plugins work with: before 11.2.1 creating a plugin with an integer attribute as the
#: ONNX parser passes it (INT32, length 1) fails under numpy 2.4 ("only 0-dimensional arrays can be converted
#: to Python scalars"), read from the real bindings of 10.16 and 11.0-11.1.
MIN_TENSORRT = (11, 2, 1)
#: What the ``tensorrt`` extra installs (its libraries come from NVIDIA's package index, not PyPI).
TENSORRT_REQUIREMENT = "tensorrt-cu13==11.4.0.106"

PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
FLOAT_TYPES = ("FP32", "FP16", "BF16")  # tensorrt.plugin's names; order = autotune preference
# trt.DataType enum name -> Triton pointer element type
TRITON_TYPE_OF_TRT = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT64": "i64", "INT32": "i32"}

Dim = int | None  # a known size, or None where the size is only known at run time
Shape = Sequence[Dim]


def tensorrt_version_problem(version: str) -> str | None:
    """Why TensorRT ``version`` cannot run the plugins, or None when it can (at least :data:`MIN_TENSORRT`)."""
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) >= MIN_TENSORRT:
        return None
    floor = ".".join(map(str, MIN_TENSORRT))
    return (
        f"TensorRT {version} is too old for the dflash plugins (needs >= {floor}: older versions cannot create "
        f"a plugin with an integer attribute under numpy 2); install {TENSORRT_REQUIREMENT}"
    )


def check_rank(name: str, shape: Shape, rank: int, layout: str) -> None:
    if len(shape) != rank:
        raise ValueError(f"{name} has shape {tuple(shape)}: must have rank {rank} ({layout})")


def must_equal(what: str, a: Dim, b: Dim) -> None:
    if a is not None and b is not None and a != b:
        raise ValueError(f"{what}: {a} != {b}")


def triton_type_of(trt_type_name: str) -> str:
    """TensorRT ``DataType`` enum name (``"FLOAT"``, ``"HALF"``, ``"BF16"``, ``"INT64"``) -> Triton type name."""
    try:
        return TRITON_TYPE_OF_TRT[trt_type_name]
    except KeyError:
        raise ValueError(
            f"tensor type {trt_type_name!r} is not supported: must be one of {sorted(TRITON_TYPE_OF_TRT)}"
        ) from None


def known(expr: Any) -> Dim:
    """A TensorRT shape expression's value when it is a build-time constant, else None."""
    if isinstance(expr, int):
        return expr
    if getattr(expr, "is_fake", False) or not expr.is_constant:
        return None
    return expr.constant_value()


def known_shape(desc: Any) -> tuple:
    """Every dimension of a tensor description: its value when a build-time constant, else None."""
    return tuple(known(e) for e in desc.shape_expr)


def triton_type(desc: Any) -> str:
    """The Triton pointer type of a tensor description's dtype."""
    return triton_type_of(desc.dtype.name)


def build_arch() -> int | None:
    """``DFLASH2_TRT_ARCH`` (e.g. 90) overrides the compute capability the kernels are compiled for."""
    value = os.environ.get("DFLASH2_TRT_ARCH")
    return int(value) if value else None
