"""The ``DFlashBlockConv`` node of the ``dflash`` ONNX domain: its schema and its reference body.

The body is a model-local ONNX function written with plain ONNX ops, generic in every dimension (no
unrolling), so onnxruntime runs an exported draft on any machine; TensorRT replaces the node with the
plugin of :mod:`dflash2_lightning.ops.block_conv.tensorrt_plugin`.
"""

from __future__ import annotations

from onnx import FunctionProto, TensorProto, helper
from onnx.defs import OpSchema

from dflash2_lightning.ops.onnx_domain import DOMAIN, FunctionBuilder, make_schema

__all__ = ["BLOCK_CONV", "schema", "block_conv_function"]

BLOCK_CONV = "DFlashBlockConv"


def schema() -> OpSchema:
    """``DFlashBlockConv``: ``x [B,S,H], base [T,H], delta [B,S,T,G] -> y [B,S,H]``, attribute ``block_size``."""
    return make_schema(
        BLOCK_CONV,
        "One side of the DFlash2 block convolution (taps stop at block starts).",
        [("x", "T"), ("base", "T"), ("delta", "T")],
        [("y", "T")],
        [OpSchema.Attribute("block_size", OpSchema.AttrType.INT, "block length", required=True)],
    )


def block_conv_function(opset: int) -> FunctionProto:
    """Reference body of ``DFlashBlockConv`` (default-domain ``opset``), generic in B, S, H, T, G.

    Gathers every tap at once: ``xs[b, i, t] = x[b, i - t]`` where ``i mod block_size >= t`` (else 0),
    then ``y = sum_t base[t] * xs + delta[t] * xs`` with the channel groups broadcast — the same
    products and tap order as the eager reference, so float32 results match it exactly.
    """
    f = FunctionBuilder("conv")
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
    base_shape = f.op(
        "Concat",
        f.op("Shape", "base", start=0, end=1),
        f.op("Shape", "delta", start=3, end=4),
        f.ints(-1),
        axis=0,
        hint="base_shape",
    )  # [T,G,-1]
    xs = f.op("Reshape", shifted, grouped, hint="xs")
    base = f.op("Reshape", "base", base_shape, hint="base")
    delta = f.op("Unsqueeze", "delta", f.ints(4), hint="delta")
    term = f.op("Add", f.op("Mul", base, xs), f.op("Mul", delta, xs), hint="term")  # [B,S,T,G,group]
    summed = f.op("ReduceSum", term, f.ints(2), keepdims=0, hint="sum")  # [B,S,G,group]
    f.nodes.append(helper.make_node("Reshape", [summed, f.op("Shape", "x")], ["y"]))
    return helper.make_function(
        DOMAIN,
        BLOCK_CONV,
        ["x", "base", "delta"],
        ["y"],
        f.nodes,
        [helper.make_opsetid("", opset)],
        attributes=["block_size"],
        doc_string=block_conv_function.__doc__,
    )
