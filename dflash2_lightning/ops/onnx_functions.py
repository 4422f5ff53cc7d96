"""The ``dflash`` ONNX domain on a model: the op contract, export translation and reference bodies.

Two custom ops, domain ``dflash`` version 1, mapped 1:1 from the torch custom ops of
:mod:`dflash2_lightning.ops`; each op's schema and body live beside it (``ops/<op>/onnx_function.py``):

============================  ==============================================================  =========
op                            inputs -> outputs                                               attribute
============================  ==============================================================  =========
``DFlashBlockConv``           ``x [B,S,H], base [T,H], delta [B,S,T,G] -> y [B,S,H]``           ``block_size``
``DFlashLatticeWalk``         ``cand [B,L,K] i64, unary [B,L,K], proj [B,L,r], anchor [B] i64,``
                              ``pred_codebook [V,r], succ_codebook [V,r] -> tokens [B,L] i64``
============================  ==============================================================  =========

Every node also carries ``plugin_namespace="dflash"`` and ``plugin_version="1"`` (TensorRT's plugin
lookup). The reference bodies are attached as model-local functions *after* ``torch.onnx.export``,
because the exporter inlines local functions. The schemas (:func:`register_schemas`) are only needed
inside the exporting process (onnxscript looks them up when it records a custom node); the checker and
onnxruntime use the function bodies.
"""

from __future__ import annotations

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "BLOCK_CONV",
    "LATTICE_WALK",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "PLUGIN_ATTRIBUTES",
    "CUSTOM_OPS",
    "DEFAULT_CONTRACT_OPSET",
    "schemas",
    "register_schemas",
    "describe_contract",
    "translation_table",
    "block_conv_function",
    "lattice_walk_function",
    "REFERENCE_FUNCTIONS",
    "default_opset",
    "custom_nodes",
    "attach_functions",
    "strip_functions",
]

from collections.abc import Callable
from typing import Any

import onnx
from onnx import FunctionProto, ModelProto, NodeProto, helper
from onnx.defs import OpSchema

from dflash2_lightning.ops.block_conv import onnx_function as block_conv_onnx
from dflash2_lightning.ops.block_conv.onnx_function import BLOCK_CONV, block_conv_function
from dflash2_lightning.ops.lattice_walk import onnx_function as lattice_walk_onnx
from dflash2_lightning.ops.lattice_walk.onnx_function import LATTICE_WALK, lattice_walk_function
from dflash2_lightning.ops.onnx_domain import (
    DOMAIN,
    DOMAIN_VERSION,
    PLUGIN_ATTRIBUTES,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
)

CUSTOM_OPS = (BLOCK_CONV, LATTICE_WALK)
DEFAULT_CONTRACT_OPSET = 20


def schemas() -> list[OpSchema]:
    """The two op schemas of the ``dflash`` domain (version 1)."""
    return [block_conv_onnx.schema(), lattice_walk_onnx.schema()]


def register_schemas() -> None:
    """Register the schemas with ``onnx.defs`` once per process (needed only while exporting)."""
    for schema in schemas():
        if not onnx.defs.has(schema.name, DOMAIN):
            onnx.defs.register_schema(schema)


def describe_contract(opset: int = DEFAULT_CONTRACT_OPSET) -> str:
    """A readable summary of the domain: each op's inputs, outputs, attributes and reference body."""
    lines = [
        f"domain {DOMAIN!r} version {DOMAIN_VERSION}; every node carries "
        + ", ".join(f"{k}={v!r}" for k, v in PLUGIN_ATTRIBUTES.items())
    ]
    for schema in schemas():
        body = REFERENCE_FUNCTIONS[schema.name](opset)
        attrs = [a for a in schema.attributes if a not in PLUGIN_ATTRIBUTES]
        lines.append(
            f"  {schema.name}({', '.join(i.name for i in schema.inputs)}) -> "
            f"{', '.join(o.name for o in schema.outputs)}; attributes: {', '.join(attrs) or 'none'}; "
            f"reference body: {len(body.node)} nodes at opset {opset}"
        )
    return "\n".join(lines)


def translation_table() -> dict[Any, Callable[..., Any]]:
    """``custom_translation_table`` for ``torch.onnx.export``: torch custom op -> one ``dflash`` node."""
    import onnxscript
    import torch

    import dflash2_lightning.ops  # noqa: F401  (registers torch.ops.dflash.*)

    register_schemas()
    dflash = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def block_conv(x, base, delta, block_size: int):
        return dflash.DFlashBlockConv(x, base, delta, block_size=block_size, **PLUGIN_ATTRIBUTES)

    def lattice_walk(cand, unary, proj, anchor, pred_codebook, succ_codebook):
        return dflash.DFlashLatticeWalk(cand, unary, proj, anchor, pred_codebook, succ_codebook, **PLUGIN_ATTRIBUTES)

    return {torch.ops.dflash.block_conv.default: block_conv, torch.ops.dflash.lattice_walk.default: lattice_walk}


REFERENCE_FUNCTIONS: dict[str, Callable[[int], FunctionProto]] = {
    BLOCK_CONV: block_conv_function,
    LATTICE_WALK: lattice_walk_function,
}


# ----------------------------------------------------------------------------- model surgery
def default_opset(model: ModelProto) -> int:
    """The model's default-domain (``""`` / ``ai.onnx``) opset version."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise ValueError("model imports no default-domain opset")


def custom_nodes(model: ModelProto) -> list[NodeProto]:
    """The ``dflash`` nodes of the main graph, in graph order."""
    return [node for node in model.graph.node if node.domain == DOMAIN]


def attach_functions(model: ModelProto) -> ModelProto:
    """Add the reference body of every ``dflash`` op the graph uses as a model-local function.

    The bodies import the model's own default opset (the checker rejects a mismatch). Functions
    already present are replaced, so calling this twice is harmless.
    """
    opset = default_opset(model)
    used = sorted({node.op_type for node in custom_nodes(model)})
    unknown = [name for name in used if name not in REFERENCE_FUNCTIONS]
    if unknown:
        raise ValueError(f"dflash ops without a reference body: {unknown} (known: {sorted(REFERENCE_FUNCTIONS)})")
    kept = [fn for fn in model.functions if not (fn.domain == DOMAIN and fn.name in used)]
    del model.functions[:]
    model.functions.extend(kept + [REFERENCE_FUNCTIONS[name](opset) for name in used])
    if used and not any(entry.domain == DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model


def strip_functions(model: ModelProto) -> ModelProto:
    """A copy of ``model`` without the ``dflash`` function bodies (the ``*.trt.onnx`` variant).

    TensorRT then has only its registered plugins to map the custom nodes to, whatever its version's
    preference between a plugin and a same-named local function.
    """
    stripped = ModelProto()
    stripped.CopyFrom(model)
    kept = [fn for fn in stripped.functions if fn.domain != DOMAIN]
    del stripped.functions[:]
    stripped.functions.extend(kept)
    return stripped
