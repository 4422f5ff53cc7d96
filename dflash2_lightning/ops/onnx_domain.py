"""The ``dflash`` ONNX domain: its name, version and plugin attributes, and the builder of op bodies.

Every custom node carries ``plugin_namespace="dflash"`` and ``plugin_version="1"``, so TensorRT's ONNX
parser (10.15+, all of 11.x) picks the registered plugin of that name; without the plugin it falls back
to the node's ONNX local function. Each op's schema and reference body live beside the op
(``ops/<op>/onnx_function.py``); :mod:`dflash2_lightning.ops.onnx_functions` attaches them to a model.
"""

from __future__ import annotations

from typing import Any

from onnx import AttributeProto, NodeProto, TensorProto, helper
from onnx.defs import OpSchema

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "PLUGIN_ATTRIBUTES",
    "FunctionBuilder",
    "make_schema",
]

DOMAIN = "dflash"
DOMAIN_VERSION = 1
PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
#: Attributes every custom node carries (TensorRT plugin lookup key: op_type, version, namespace).
PLUGIN_ATTRIBUTES: dict[str, str] = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def make_schema(
    name: str,
    doc: str,
    inputs: list[tuple[str, str]],
    outputs: list[tuple[str, str]],
    attributes: list[OpSchema.Attribute],
) -> OpSchema:
    """An op schema of the domain: float inputs ``T``, token ids ``I``, and the plugin attributes."""
    plugin = [
        OpSchema.Attribute(key, OpSchema.AttrType.STRING, f"TensorRT plugin lookup ({value!r})", required=False)
        for key, value in PLUGIN_ATTRIBUTES.items()
    ]
    return OpSchema(
        name,
        DOMAIN,
        DOMAIN_VERSION,
        doc,
        inputs=[OpSchema.FormalParameter(n, t) for n, t in inputs],
        outputs=[OpSchema.FormalParameter(n, t) for n, t in outputs],
        type_constraints=[("T", _FLOATS, "float types"), ("I", ["tensor(int64)"], "token ids")],
        attributes=attributes + plugin,
    )


class FunctionBuilder:
    """A tiny builder for function bodies: ``op(...)`` appends a node and returns its output name(s)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self._count = prefix, 0
        self.nodes: list[NodeProto] = []

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}_{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, hint: str = "", **attrs: Any) -> Any:
        names = [self._name(hint or op_type.lower()) for _ in range(outputs)]
        node = helper.make_node(op_type, list(inputs), names, **attrs)
        self.nodes.append(node)
        return names[0] if outputs == 1 else names

    def ints(self, *values: int, hint: str = "const") -> str:
        """A 1-D int64 constant (axes, shapes)."""
        return self.op("Constant", hint=hint, value=helper.make_tensor("v", TensorProto.INT64, [len(values)], values))

    def scalar(self, value: int, hint: str = "const") -> str:
        """A scalar int64 constant."""
        return self.op("Constant", hint=hint, value=helper.make_tensor("v", TensorProto.INT64, [], [value]))

    def attribute_int(self, name: str) -> str:
        """A scalar int64 constant holding the calling node's attribute ``name``."""
        out = self._name(name)
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(helper.make_attribute_ref("value_int", AttributeProto.INT, ref_attr_name=name))
        self.nodes.append(node)
        return out

    def dim(self, tensor: str, axis: int, hint: str) -> str:
        """Scalar int64 size of ``tensor`` along ``axis``."""
        return self.op("Squeeze", self.op("Shape", tensor, start=axis, end=axis + 1), self.ints(0), hint=hint)
