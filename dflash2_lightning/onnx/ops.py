"""The ``dflash`` ONNX domain: op contract, export translation and reference bodies.

Two custom ops, domain ``dflash`` version 1, mapped 1:1 from the torch custom ops of
:mod:`dflash2_lightning.ops`:

============================  ==============================================================  =========
op                            inputs -> outputs                                               attribute
============================  ==============================================================  =========
``DFlashBlockConv``           ``x [B,S,H], base [T,H], delta [B,S,T,G] -> y [B,S,H]``           ``block_size``
``DFlashLatticeWalk``         ``cand [B,L,K] i64, unary [B,L,K], proj [B,L,r], anchor [B] i64,``
                              ``pred_codebook [V,r], succ_codebook [V,r] -> tokens [B,L] i64``
============================  ==============================================================  =========

Every node also carries ``plugin_namespace="dflash"`` and ``plugin_version="1"``, so TensorRT's ONNX
parser (10.15+, all of 11.x) picks the registered plugin of that name; without the plugin it falls
back to the node's ONNX local function. Those functions (:func:`block_conv_function`,
:func:`lattice_walk_function`) are the reference bodies onnxruntime runs on any machine. They are
written with plain ONNX ops, generic in every dimension (no unrolling), and attached *after*
``torch.onnx.export`` because the exporter inlines local functions.

The schemas (:func:`register_schemas`) are only needed inside the exporting process (onnxscript
looks them up when it records a custom node); the checker and onnxruntime use the function bodies.
"""

from __future__ import annotations

__all__ = ["DOMAIN", "DOMAIN_VERSION", "BLOCK_CONV", "LATTICE_WALK", "PLUGIN_NAMESPACE", "PLUGIN_VERSION",
           "PLUGIN_ATTRIBUTES", "CUSTOM_OPS", "DEFAULT_CONTRACT_OPSET", "schemas", "register_schemas",
           "describe_contract", "translation_table", "block_conv_function", "lattice_walk_function",
           "REFERENCE_FUNCTIONS", "default_opset", "custom_nodes", "attach_functions", "strip_functions"]

from collections.abc import Callable
from typing import Any

import onnx
from onnx import AttributeProto, FunctionProto, ModelProto, NodeProto, TensorProto, helper
from onnx.defs import OpSchema

DOMAIN = "dflash"
DOMAIN_VERSION = 1
BLOCK_CONV = "DFlashBlockConv"
LATTICE_WALK = "DFlashLatticeWalk"
PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
#: Attributes every custom node carries (TensorRT plugin lookup key: op_type, version, namespace).
PLUGIN_ATTRIBUTES: dict[str, str] = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}
CUSTOM_OPS = (BLOCK_CONV, LATTICE_WALK)
DEFAULT_CONTRACT_OPSET = 20

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


# ----------------------------------------------------------------------------- schemas
def _schema(name: str, doc: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
            attributes: list[OpSchema.Attribute]) -> OpSchema:
    plugin = [OpSchema.Attribute(key, OpSchema.AttrType.STRING, f"TensorRT plugin lookup ({value!r})",
                                 required=False) for key, value in PLUGIN_ATTRIBUTES.items()]
    return OpSchema(name, DOMAIN, DOMAIN_VERSION, doc,
                    inputs=[OpSchema.FormalParameter(n, t) for n, t in inputs],
                    outputs=[OpSchema.FormalParameter(n, t) for n, t in outputs],
                    type_constraints=[("T", _FLOATS, "float types"), ("I", ["tensor(int64)"], "token ids")],
                    attributes=attributes + plugin)


def schemas() -> list[OpSchema]:
    """The two op schemas of the ``dflash`` domain (version 1)."""
    conv = _schema(BLOCK_CONV, "One side of the DFlash2 block convolution (taps stop at block starts).",
                   [("x", "T"), ("base", "T"), ("delta", "T")], [("y", "T")],
                   [OpSchema.Attribute("block_size", OpSchema.AttrType.INT, "block length", required=True)])
    walk = _schema(LATTICE_WALK, "Greedy walk of the DFlash2 candidate lattice (ties: lowest index).",
                   [("cand", "I"), ("unary", "T"), ("proj", "T"), ("anchor", "I"),
                    ("pred_codebook", "T"), ("succ_codebook", "T")], [("tokens", "I")], [])
    return [conv, walk]


def register_schemas() -> None:
    """Register the schemas with ``onnx.defs`` once per process (needed only while exporting)."""
    for schema in schemas():
        if not onnx.defs.has(schema.name, DOMAIN):
            onnx.defs.register_schema(schema)


def describe_contract(opset: int = DEFAULT_CONTRACT_OPSET) -> str:
    """A readable summary of the domain: each op's inputs, outputs, attributes and reference body."""
    lines = [f"domain {DOMAIN!r} version {DOMAIN_VERSION}; every node carries "
             + ", ".join(f"{k}={v!r}" for k, v in PLUGIN_ATTRIBUTES.items())]
    for schema in schemas():
        body = REFERENCE_FUNCTIONS[schema.name](opset)
        attrs = [a for a in schema.attributes if a not in PLUGIN_ATTRIBUTES]
        lines.append(f"  {schema.name}({', '.join(i.name for i in schema.inputs)}) -> "
                     f"{', '.join(o.name for o in schema.outputs)}; attributes: {', '.join(attrs) or 'none'}; "
                     f"reference body: {len(body.node)} nodes at opset {opset}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- export translation
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
        return dflash.DFlashLatticeWalk(cand, unary, proj, anchor, pred_codebook, succ_codebook,
                                        **PLUGIN_ATTRIBUTES)

    return {torch.ops.dflash.block_conv.default: block_conv,
            torch.ops.dflash.lattice_walk.default: lattice_walk}


# ----------------------------------------------------------------------------- reference bodies
class _Body:
    """A tiny builder for function bodies: ``op(...)`` appends a node and returns its output name(s)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.nodes, self._count = prefix, [], 0

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


def block_conv_function(opset: int) -> FunctionProto:
    """Reference body of ``DFlashBlockConv`` (default-domain ``opset``), generic in B, S, H, T, G.

    Gathers every tap at once: ``xs[b, i, t] = x[b, i - t]`` where ``i mod block_size >= t`` (else 0),
    then ``y = sum_t base[t] * xs + delta[t] * xs`` with the channel groups broadcast — the same
    products and tap order as the eager reference, so float32 results match it exactly.
    """
    f = _Body("conv")
    seq, taps = f.dim("x", 1, "S"), f.dim("base", 0, "T")
    zero, one = f.scalar(0), f.scalar(1)
    block = f.attribute_int("block_size")
    i = f.op("Range", zero, seq, one, hint="i")  # [S]
    t = f.op("Range", zero, taps, one, hint="t")  # [T]
    offset = f.op("Unsqueeze", f.op("Mod", i, block), f.ints(1), hint="offset")  # [S,1]
    t_row = f.op("Unsqueeze", t, f.ints(0), hint="t_row")  # [1,T]
    valid = f.op("GreaterOrEqual", offset, t_row, hint="valid")  # [S,T]: tap stays inside the block
    source = f.op("Sub", f.op("Unsqueeze", i, f.ints(1)), t_row, hint="source")  # [S,T] = i - t
    source = f.op("Where", valid, source, zero, hint="source")  # never a negative (wrapping) index
    shifted = f.op("Gather", "x", source, axis=1, hint="shifted")  # [B,S,T,H]
    zero_x = f.op("CastLike", f.op("Constant", value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])), "x")
    shifted = f.op("Where", f.op("Unsqueeze", valid, f.ints(0, 3)), shifted, zero_x, hint="shifted")
    # Channel groups: H = G * group; delta [B,S,T,G] broadcasts over each group's channels.
    grouped = f.op("Concat", f.op("Shape", "delta"), f.ints(-1), axis=0, hint="grouped_shape")  # [B,S,T,G,-1]
    base_shape = f.op("Concat", f.op("Shape", "base", start=0, end=1), f.op("Shape", "delta", start=3, end=4),
                      f.ints(-1), axis=0, hint="base_shape")  # [T,G,-1]
    xs = f.op("Reshape", shifted, grouped, hint="xs")
    base = f.op("Reshape", "base", base_shape, hint="base")
    delta = f.op("Unsqueeze", "delta", f.ints(4), hint="delta")
    term = f.op("Add", f.op("Mul", base, xs), f.op("Mul", delta, xs), hint="term")  # [B,S,T,G,group]
    summed = f.op("ReduceSum", term, f.ints(2), keepdims=0, hint="sum")  # [B,S,G,group]
    f.nodes.append(helper.make_node("Reshape", [summed, f.op("Shape", "x")], ["y"]))
    return helper.make_function(DOMAIN, BLOCK_CONV, ["x", "base", "delta"], ["y"], f.nodes,
                                [helper.make_opsetid("", opset)], attributes=["block_size"],
                                doc_string=block_conv_function.__doc__)


def lattice_walk_function(opset: int) -> FunctionProto:
    """Reference body of ``DFlashLatticeWalk`` (default-domain ``opset``), generic in B, L, K, r, V.

    First all edge scores ``[B, L, K_prev, K]`` in float32, as :func:`dflash2_lightning.ops.edge_scores`
    computes them; then a ``Loop`` over the L positions carries the chosen candidate index ``[B]``
    (a fixed-shape state) and emits one token per step. ``ArgMax`` with ``select_last_index=0``
    sends ties to the lowest index, like ``torch.argmax``.
    """
    f = _Body("walk")
    as_float = {"to": TensorProto.FLOAT}
    unary = f.op("Cast", "unary", hint="unary", **as_float)
    proj = f.op("Cast", "proj", hint="proj", **as_float)
    pred = f.op("Cast", "pred_codebook", hint="pred", **as_float)
    succ = f.op("Cast", "succ_codebook", hint="succ", **as_float)
    # Predecessors of position l: the anchor for l = 0, else the candidates of position l - 1.
    first_shape = f.op("Concat", f.op("Shape", "cand", start=0, end=1), f.ints(1),
                       f.op("Shape", "cand", start=2, end=3), axis=0, hint="first_shape")  # [B,1,K]
    first = f.op("Expand", f.op("Unsqueeze", "anchor", f.ints(1, 2)), first_shape, hint="first")
    earlier = f.op("Slice", "cand", f.ints(0), f.ints(-1), f.ints(1), hint="earlier")  # [B,L-1,K]
    prev = f.op("Concat", first, earlier, axis=1, hint="prev")  # [B,L,K]
    context = f.op("Mul", f.op("Gather", pred, prev, axis=0), f.op("Unsqueeze", proj, f.ints(2)),
                   hint="context")  # [B,L,K,r]
    successor = f.op("Transpose", f.op("Gather", succ, "cand", axis=0), perm=[0, 1, 3, 2], hint="successor")
    scores = f.op("Add", f.op("Unsqueeze", unary, f.ints(2)), f.op("MatMul", context, successor),
                  hint="scores")  # [B,L,K_prev,K]

    # Loop body: (step, cond, choice [B]) -> (cond, next choice [B], token [B]).
    g = _Body("step")
    row_index = g.op("Expand", g.op("Unsqueeze", "choice_in", g.ints(1, 2)),
                     g.op("Concat", g.op("Shape", "choice_in"), g.ints(1), g.op("Shape", "cand", start=2, end=3),
                          axis=0), hint="row_index")  # [B,1,K]
    table = g.op("Gather", scores, "step", axis=1, hint="table")  # [B,K_prev,K]
    row = g.op("Squeeze", g.op("GatherElements", table, row_index, axis=1), g.ints(1), hint="row")  # [B,K]
    g.nodes.append(helper.make_node("ArgMax", [row], ["choice_out"], axis=-1, keepdims=0, select_last_index=0))
    options = g.op("Gather", "cand", "step", axis=1, hint="options")  # [B,K]
    token = g.op("GatherElements", options, g.op("Unsqueeze", "choice_out", g.ints(1)), axis=1, hint="token")
    g.nodes.append(helper.make_node("Squeeze", [token, g.ints(1)], ["token_out"]))
    g.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body = helper.make_graph(
        g.nodes, "walk_step",
        [helper.make_tensor_value_info("step", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("choice_in", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("choice_out", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("token_out", TensorProto.INT64, ["batch"])])

    length = f.dim("cand", 1, "L")
    start = f.op("ConstantOfShape", f.op("Shape", "anchor"),
                 value=helper.make_tensor("v", TensorProto.INT64, [1], [0]), hint="choice0")  # [B] zeros
    _, steps = f.op("Loop", length, "", start, outputs=2, hint="loop", body=body)  # steps [L,B]
    f.nodes.append(helper.make_node("Transpose", [steps], ["tokens"], perm=[1, 0]))
    return helper.make_function(DOMAIN, LATTICE_WALK,
                                ["cand", "unary", "proj", "anchor", "pred_codebook", "succ_codebook"],
                                ["tokens"], f.nodes, [helper.make_opsetid("", opset)],
                                doc_string=lattice_walk_function.__doc__)


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
