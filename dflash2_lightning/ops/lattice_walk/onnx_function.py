"""The ``DFlashLatticeWalk`` node of the ``dflash`` ONNX domain: its schema and its reference body.

The body is a model-local ONNX function written with plain ONNX ops, generic in every dimension (no
unrolling), so onnxruntime runs an exported draft on any machine; TensorRT replaces the node with the
plugin of :mod:`dflash2_lightning.ops.lattice_walk.tensorrt_plugin`.
"""

from __future__ import annotations

from onnx import FunctionProto, TensorProto, helper
from onnx.defs import OpSchema

from dflash2_lightning.ops.onnx_domain import DOMAIN, FunctionBuilder, make_schema

__all__ = ["LATTICE_WALK", "schema", "lattice_walk_function"]

LATTICE_WALK = "DFlashLatticeWalk"


def schema() -> OpSchema:
    """``DFlashLatticeWalk``: ``cand [B,L,K] i64, unary [B,L,K], proj [B,L,r], anchor [B] i64, pred_codebook [V,r],
    succ_codebook [V,r] -> tokens [B,L] i64``, no attribute."""
    return make_schema(
        LATTICE_WALK,
        "Greedy walk of the DFlash2 candidate lattice (ties: lowest index).",
        [("cand", "I"), ("unary", "T"), ("proj", "T"), ("anchor", "I"), ("pred_codebook", "T"), ("succ_codebook", "T")],
        [("tokens", "I")],
        [],
    )


def lattice_walk_function(opset: int) -> FunctionProto:
    """Reference body of ``DFlashLatticeWalk`` (default-domain ``opset``), generic in B, L, K, r, V.

    First all edge scores ``[B, L, K_prev, K]`` in float32, as :func:`~dflash2_lightning.ops.lattice_walk.torch_op.edge_scores`
    computes them; then a ``Loop`` over the L positions carries the chosen candidate index ``[B]``
    (a fixed-shape state) and emits one token per step. ``ArgMax`` with ``select_last_index=0``
    sends ties to the lowest index, like ``torch.argmax``.
    """
    f = FunctionBuilder("walk")
    as_float = {"to": TensorProto.FLOAT}
    unary = f.op("Cast", "unary", hint="unary", **as_float)
    proj = f.op("Cast", "proj", hint="proj", **as_float)
    pred = f.op("Cast", "pred_codebook", hint="pred", **as_float)
    succ = f.op("Cast", "succ_codebook", hint="succ", **as_float)
    # Predecessors of position l: the anchor for l = 0, else the candidates of position l - 1.
    first_shape = f.op(
        "Concat",
        f.op("Shape", "cand", start=0, end=1),
        f.ints(1),
        f.op("Shape", "cand", start=2, end=3),
        axis=0,
        hint="first_shape",
    )  # [B,1,K]
    first = f.op("Expand", f.op("Unsqueeze", "anchor", f.ints(1, 2)), first_shape, hint="first")
    earlier = f.op("Slice", "cand", f.ints(0), f.ints(-1), f.ints(1), hint="earlier")  # [B,L-1,K]
    prev = f.op("Concat", first, earlier, axis=1, hint="prev")  # [B,L,K]
    context = f.op(
        "Mul", f.op("Gather", pred, prev, axis=0), f.op("Unsqueeze", proj, f.ints(2)), hint="context"
    )  # [B,L,K,r]
    successor = f.op("Transpose", f.op("Gather", succ, "cand", axis=0), perm=[0, 1, 3, 2], hint="successor")
    scores = f.op(
        "Add", f.op("Unsqueeze", unary, f.ints(2)), f.op("MatMul", context, successor), hint="scores"
    )  # [B,L,K_prev,K]

    # Loop body: (step, cond, choice [B]) -> (cond, next choice [B], token [B]).
    g = FunctionBuilder("step")
    row_index = g.op(
        "Expand",
        g.op("Unsqueeze", "choice_in", g.ints(1, 2)),
        g.op("Concat", g.op("Shape", "choice_in"), g.ints(1), g.op("Shape", "cand", start=2, end=3), axis=0),
        hint="row_index",
    )  # [B,1,K]
    table = g.op("Gather", scores, "step", axis=1, hint="table")  # [B,K_prev,K]
    row = g.op("Squeeze", g.op("GatherElements", table, row_index, axis=1), g.ints(1), hint="row")  # [B,K]
    g.nodes.append(helper.make_node("ArgMax", [row], ["choice_out"], axis=-1, keepdims=0, select_last_index=0))
    options = g.op("Gather", "cand", "step", axis=1, hint="options")  # [B,K]
    token = g.op("GatherElements", options, g.op("Unsqueeze", "choice_out", g.ints(1)), axis=1, hint="token")
    g.nodes.append(helper.make_node("Squeeze", [token, g.ints(1)], ["token_out"]))
    g.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body = helper.make_graph(
        g.nodes,
        "walk_step",
        [
            helper.make_tensor_value_info("step", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("choice_in", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("choice_out", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("token_out", TensorProto.INT64, ["batch"]),
        ],
    )

    length = f.dim("cand", 1, "L")
    start = f.op(
        "ConstantOfShape",
        f.op("Shape", "anchor"),
        value=helper.make_tensor("v", TensorProto.INT64, [1], [0]),
        hint="choice0",
    )  # [B] zeros
    _, steps = f.op("Loop", length, "", start, outputs=2, hint="loop", body=body)  # steps [L,B]
    f.nodes.append(helper.make_node("Transpose", [steps], ["tokens"], perm=[1, 0]))
    return helper.make_function(
        DOMAIN,
        LATTICE_WALK,
        ["cand", "unary", "proj", "anchor", "pred_codebook", "succ_codebook"],
        ["tokens"],
        f.nodes,
        [helper.make_opsetid("", opset)],
        doc_string=lattice_walk_function.__doc__,
    )
