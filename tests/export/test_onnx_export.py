"""ONNX export of the drafting graphs: custom nodes, reference bodies, checker, onnxruntime == torch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import TINY_DRAFT, randomize_draft_
from onnx import TensorProto, helper

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.export.onnx import command as cli
from dflash2_lightning.export.onnx.export import export_drafter, random_embedding_and_head
from dflash2_lightning.export.onnx.graphs import DraftStepGraph
from dflash2_lightning.export.onnx.verify import choice_margins, verify_export
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.checkpoint import save_draft
from dflash2_lightning.ops import block_conv, lattice_walk
from dflash2_lightning.ops import onnx_functions as ops

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CFG = DraftConfig(**TINY_DRAFT)  # 2 layers, block 4, hidden 32, 4 conv groups, top-5 of 96


def _load(directory: Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(directory / name))


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.fixture(scope="module")
def dflash2(tmp_path_factory) -> SimpleNamespace:
    """A randomized DFlash2 draft exported in float32 (traced at batch 2, context 7)."""
    draft = randomize_draft_(DraftModel(CFG), seed=0).eval()
    embed, head = random_embedding_and_head(CFG.vocab_size, CFG.hidden_size, seed=1, std=0.5)
    out = tmp_path_factory.mktemp("dflash2_fp32")
    result = export_drafter(draft, embed, head, out)
    return SimpleNamespace(draft=draft, embed=embed, head=head, dir=out, result=result)


# ----------------------------------------------------------------------------- structure
def test_draft_step_has_exactly_the_custom_nodes(dflash2):
    model = _load(dflash2.dir, "draft_step.onnx")
    nodes = ops.custom_nodes(model)
    convs = [n for n in nodes if n.op_type == ops.BLOCK_CONV]
    walks = [n for n in nodes if n.op_type == ops.LATTICE_WALK]
    # 2 sides x (attention conv + MLP conv) per layer, one walk per block.
    assert len(convs) == 4 * CFG.num_hidden_layers and len(walks) == 1 and len(nodes) == len(convs) + 1
    for node in convs:
        assert _attrs(node) == {"block_size": CFG.block_size, "plugin_namespace": b"dflash", "plugin_version": b"1"}
        assert len(node.input) == 3 and len(node.output) == 1
    assert _attrs(walks[0]) == {"plugin_namespace": b"dflash", "plugin_version": b"1"}
    assert len(walks[0].input) == 6 and len(walks[0].output) == 1
    assert {(o.domain, o.version) for o in model.opset_import} >= {("", 20), ("dflash", 1)}
    assert dflash2.result.graphs["draft_step"].custom_nodes == {ops.BLOCK_CONV: 8, ops.LATTICE_WALK: 1}
    # The context graph is plain ONNX (fc, norm, k/v projections, RoPE).
    assert ops.custom_nodes(_load(dflash2.dir, "context.onnx")) == []


def test_functions_attached_at_model_opset_and_checker_passes(dflash2):
    for name in ("context.onnx", "draft_step.onnx"):
        model = _load(dflash2.dir, name)
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    model = _load(dflash2.dir, "draft_step.onnx")
    functions = {(f.domain, f.name): f for f in model.functions}
    assert set(functions) == {("dflash", ops.BLOCK_CONV), ("dflash", ops.LATTICE_WALK)}
    for f in functions.values():
        assert {(o.domain, o.version) for o in f.opset_import} == {("", ops.default_opset(model))}
    assert list(functions[("dflash", ops.BLOCK_CONV)].attribute) == ["block_size"]


def test_trt_copy_has_no_function_bodies(dflash2):
    full, trt = _load(dflash2.dir, "draft_step.onnx"), _load(dflash2.dir, "draft_step.trt.onnx")
    assert len(full.functions) == 2 and len(trt.functions) == 0
    assert [n.op_type for n in trt.graph.node] == [n.op_type for n in full.graph.node]
    assert [_attrs(n) for n in ops.custom_nodes(trt)] == [_attrs(n) for n in ops.custom_nodes(full)]
    onnx.checker.check_model(trt, full_check=True)  # custom-domain nodes without bodies are legal ONNX
    with pytest.raises(Exception, match="DFlash"):  # ...but onnxruntime needs the bodies
        ort.InferenceSession(str(dflash2.dir / "draft_step.trt.onnx"), providers=["CPUExecutionProvider"])


def test_inputs_outputs_are_named_and_dynamic(dflash2):
    step = _load(dflash2.dir, "draft_step.onnx")
    names = [f"{kind}_{i}" for i in range(CFG.num_hidden_layers) for kind in "kv"]
    assert [i.name for i in step.graph.input] == names + ["length", "anchor", "start"]
    kv_shape = ["batch", CFG.num_key_value_heads, "capacity", CFG.head_dim]
    assert all(_dims(i) == kv_shape for i in step.graph.input[: len(names)])
    assert [(o.name, _dims(o)) for o in step.graph.output] == [
        ("tokens", ["batch", CFG.block_size - 1]),
        ("hidden", ["batch", CFG.block_size - 1, CFG.hidden_size]),
    ]
    context = _load(dflash2.dir, "context.onnx")
    assert [(i.name, _dims(i)) for i in context.graph.input] == [
        ("features", ["batch", "context", CFG.num_target_features * CFG.hidden_size]),
        ("positions", ["batch", "context"]),
    ]
    assert [o.name for o in context.graph.output] == names
    assert all(_dims(o) == ["batch", CFG.num_key_value_heads, "context", CFG.head_dim] for o in context.graph.output)
    manifest = json.loads((dflash2.dir / "drafter.json").read_text())
    assert manifest["dtype"] == "fp32" and manifest["config"] == CFG.to_hf_dict()
    assert manifest["graphs"]["draft_step"]["trt_file"] == "draft_step.trt.onnx"
    umask = os.umask(0)
    os.umask(umask)
    for name in ("draft_step.onnx", "draft_step.trt.onnx", "drafter.json"):  # deployable, not 0600 temp files
        assert (dflash2.dir / name).stat().st_mode & 0o777 == 0o666 & ~umask


def test_draft_step_never_copies_the_cache(dflash2):
    """The cache buffers feed only the score and value matmuls (through a transpose ORT folds into the
    MatMul): no Concat, Expand or Tile of the context, so a step does not copy the cache."""
    step = _load(dflash2.dir, "draft_step.onnx")
    cache = {i.name for i in step.graph.input if re.fullmatch(r"[kv]_\d+", i.name)}
    consumers = {n.op_type for n in step.graph.node if cache & set(n.input)}
    assert consumers and consumers <= {"MatMul", "Transpose", "Shape"}, consumers
    transposed = {o for n in step.graph.node if n.op_type == "Transpose" and cache & set(n.input) for o in n.output}
    assert {n.op_type for n in step.graph.node if transposed & set(n.input)} <= {"MatMul"}


# ----------------------------------------------------------------------------- numerics
def test_onnxruntime_equals_torch_fp32_at_unseen_shapes(dflash2):
    # Traced at batch 2 / context 7; run at other batch sizes and context lengths (1 included).
    cases = ((1, 1), (1, 5), (3, 19), (6, 33))
    report = verify_export(dflash2.dir, dflash2.draft, dflash2.embed, dflash2.head, cases=cases, seed=3)
    assert report.ok, report.describe()
    for case in report.cases:
        assert case.tokens_compared == case.tokens_total  # fp32: every token, exactly
        assert case.kv_error < 1e-5 and case.hidden_error < 1e-4


def test_selector_walk_matters_in_the_checked_tokens(dflash2):
    """The fp32 check would be weak if the walk always took the top unary candidate: make sure it does not."""
    draft, embed, head = dflash2.draft, dflash2.embed, dflash2.head
    cache = draft.context_kv(torch.randn(6, 9, CFG.num_target_features * CFG.hidden_size), torch.arange(9).expand(6, 9))
    anchor = torch.arange(6)
    with torch.no_grad():
        tokens, hidden = DraftStepGraph(draft, embed, head)(
            [t for kv in cache.layers for t in (kv.keys, kv.values)], torch.full((6,), 9), anchor, torch.full((6,), 9)
        )
        assert torch.equal(tokens, draft.draft_block(anchor, cache, embed, head, 9))  # the graph module == torch draft
        assert not torch.equal(tokens, head(hidden).argmax(-1))
        assert torch.equal(choice_margins(draft, hidden, anchor, head)[0], tokens)


# The IR version torch.onnx writes (10). onnx's own default is its newest (14 with onnx 1.23), which onnxruntime 1.30
# (on the GPU machine this project is checked on) refuses: "Unsupported model IR version: 14, max supported 13".
EXPORTED_IR_VERSION = 10


@pytest.mark.parametrize("opset", [18, 20, 23])
def test_reference_bodies_equal_the_torch_ops_on_their_own(opset):
    """Each op's function body, alone in a model, against the eager op: odd shapes, several taps, ties."""
    value = helper.make_tensor_value_info
    conv = helper.make_node(
        ops.BLOCK_CONV, ["x", "base", "delta"], ["y"], domain="dflash", block_size=3, **ops.PLUGIN_ATTRIBUTES
    )
    graph = helper.make_graph(
        [conv],
        "conv",
        [
            value("x", TensorProto.FLOAT, ["B", "S", 12]),
            value("base", TensorProto.FLOAT, ["T", 12]),
            value("delta", TensorProto.FLOAT, ["B", "S", "T", "G"]),
        ],
        [value("y", TensorProto.FLOAT, ["B", "S", 12])],
    )
    model = ops.attach_functions(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=EXPORTED_IR_VERSION)
    )
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(0)
    for b, s, t, g in ((1, 3, 1, 1), (2, 9, 3, 4), (3, 6, 2, 12)):
        x, base, delta = (torch.randn(*shape, generator=gen) for shape in ((b, s, 12), (t, 12), (b, s, t, g)))
        got = session.run(None, {"x": x.numpy(), "base": base.numpy(), "delta": delta.numpy()})[0]
        assert np.array_equal(got, block_conv(x, base, delta, 3).numpy())  # same products, same order: exact

    walk = helper.make_node(
        ops.LATTICE_WALK,
        ["cand", "unary", "proj", "anchor", "pred", "succ"],
        ["tokens"],
        domain="dflash",
        **ops.PLUGIN_ATTRIBUTES,
    )
    graph = helper.make_graph(
        [walk],
        "walk",
        [
            value("cand", TensorProto.INT64, ["B", "L", "K"]),
            value("unary", TensorProto.FLOAT, ["B", "L", "K"]),
            value("proj", TensorProto.FLOAT, ["B", "L", "r"]),
            value("anchor", TensorProto.INT64, ["B"]),
            value("pred", TensorProto.FLOAT, ["V", "r"]),
            value("succ", TensorProto.FLOAT, ["V", "r"]),
        ],
        [value("tokens", TensorProto.INT64, ["B", "L"])],
    )
    model = ops.attach_functions(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=EXPORTED_IR_VERSION)
    )
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, length, k, r, v, tied in ((1, 1, 1, 2, 5, False), (4, 7, 5, 3, 40, False), (3, 6, 4, 2, 9, True)):
        cand = torch.randint(0, v, (b, length, k), generator=gen)
        unary, proj = torch.randn(b, length, k, generator=gen), torch.randn(b, length, r, generator=gen)
        pred, succ = torch.randn(v, r, generator=gen), torch.randn(v, r, generator=gen)
        if tied:  # every score equal: ties must go to the lowest index, as in torch
            unary, succ = torch.zeros_like(unary), torch.zeros_like(succ)
        anchor = torch.randint(0, v, (b,), generator=gen)
        feeds = dict(cand=cand, unary=unary, proj=proj, anchor=anchor, pred=pred, succ=succ)
        got = session.run(None, {n: t.numpy() for n, t in feeds.items()})[0]
        expected = lattice_walk(cand, unary, proj, anchor, pred, succ)
        assert np.array_equal(got, expected.numpy())
        if tied:
            assert np.array_equal(got, cand[:, :, 0].numpy())


# ----------------------------------------------------------------------------- the command line, fp16, bf16, DFlash
def test_cli_exports_fp16_opset23_sliding_window_and_verifies(tmp_path, capsys):
    """``to_onnx.py`` end to end: float16 DFlash2 graphs at opset 23 (fused Attention/RMSNormalization)
    with a sliding-window mask, checked by onnxruntime."""
    cfg = DraftConfig(**{**TINY_DRAFT, "num_hidden_layers": 1, "target_layer_ids": [2], "sliding_window": 8})
    save_draft(randomize_draft_(DraftModel(cfg), seed=4), tmp_path / "draft")
    out = tmp_path / "onnx"
    code = cli.main(
        [
            "--draft",
            str(tmp_path / "draft"),
            "--target",
            "tiny",
            "--out",
            str(out),
            "--dtype",
            "fp16",
            "--opset",
            "23",
            "--verify-cases",
            "1x6,4x21,2x40",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "draft_step.trt.onnx" in printed and "DFlashBlockConv x4, DFlashLatticeWalk x1" in printed
    # Near-ties aside, the fp16 tokens are compared; the report says how many (at least half here).
    compared = [tuple(map(int, m.split("/"))) for m in re.findall(r"tokens (\d+/\d+) compared", printed)]
    assert len(compared) == 3 and sum(c for c, _ in compared) >= 0.5 * sum(t for _, t in compared), printed
    assert printed.rstrip().endswith("OK")
    step = _load(out, "draft_step.onnx")
    inputs = {i.name: i for i in step.graph.input}
    assert _dims(inputs["context_positions"]) == ["batch", "capacity"]  # the window needs the cache's positions
    assert inputs["k_0"].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert step.graph.output[1].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert {_attrs(n).get("block_size") for n in ops.custom_nodes(step)} == {CFG.block_size, None}
    assert ops.default_opset(step) == 23 and {f.opset_import[0].version for f in step.functions} == {23}
    assert "RMSNormalization" in {n.op_type for n in step.graph.node}


@torch.no_grad()
def test_dflash_baseline_exports_argmax_without_custom_nodes(tmp_path):
    """The DFlash baseline's draft_step: plain ONNX (argmax, no conv, no walk), equal to torch."""
    cfg = DraftConfig(**{**TINY_DRAFT, "num_hidden_layers": 1, "target_layer_ids": [2], "projector_type": "dflash"})
    draft = randomize_draft_(DraftModel(cfg), seed=5).eval()
    embed, head = random_embedding_and_head(cfg.vocab_size, cfg.hidden_size, seed=2, std=0.5)
    result = export_drafter(draft, embed, head, tmp_path, graphs=("draft_step",))
    step = _load(tmp_path, "draft_step.onnx")
    assert ops.custom_nodes(step) == [] and len(step.functions) == 0 and result.graphs["draft_step"].custom_nodes == {}
    op_types = {n.op_type for n in step.graph.node}
    assert "ArgMax" in op_types and "TopK" not in op_types
    assert "dflash" not in {o.domain for o in step.opset_import}
    session = ort.InferenceSession(str(tmp_path / "draft_step.onnx"), providers=["CPUExecutionProvider"])
    for batch, context in ((1, 3), (5, 12)):  # torch's own cache in, tokens must be identical
        cache = draft.context_kv(
            torch.randn(batch, context, cfg.num_target_features * cfg.hidden_size),
            torch.arange(context).expand(batch, context),
        )
        anchor, start = torch.randint(0, cfg.vocab_size, (batch,)), torch.full((batch,), context)
        feeds = {
            "k_0": cache.layers[0].keys.numpy(),
            "v_0": cache.layers[0].values.numpy(),
            "length": start.numpy(),
            "anchor": anchor.numpy(),
            "start": start.numpy(),
        }
        tokens, hidden = session.run(None, feeds)
        expected = draft.draft_block(anchor, cache, embed, head, start)
        assert np.array_equal(tokens, expected.numpy())
        assert np.array_equal(tokens, head(torch.from_numpy(hidden)).argmax(-1).numpy())


@pytest.mark.slow
def test_bf16_graph_structure(dflash2, tmp_path):
    """onnxruntime's CPU provider has no bfloat16 kernels: bf16 graphs are checked for structure only."""
    result = export_drafter(dflash2.draft, dflash2.embed, dflash2.head, tmp_path, dtype="bf16", graphs=("draft_step",))
    step = _load(tmp_path, "draft_step.onnx")
    onnx.checker.check_model(step, full_check=True)
    onnx.shape_inference.infer_shapes(step, strict_mode=True)
    assert result.graphs["draft_step"].custom_nodes == {ops.BLOCK_CONV: 8, ops.LATTICE_WALK: 1}
    assert {i.type.tensor_type.elem_type for i in step.graph.input[:4]} == {TensorProto.BFLOAT16}
    walk = next(n for n in step.graph.node if n.op_type == ops.LATTICE_WALK)
    types = {v.name: v.type.tensor_type.elem_type for v in step.graph.value_info}
    assert types[walk.input[1]] == TensorProto.BFLOAT16  # unary back in bf16 after the float32 TopK
    report = verify_export(tmp_path, dflash2.draft, dflash2.embed, dflash2.head)
    assert report.cases == [] and "structure only" in report.note


def test_cli_fails_when_onnxruntime_disagrees(tmp_path, monkeypatch, capsys):
    save_draft(DraftModel(CFG), tmp_path / "draft")
    monkeypatch.setattr(cli, "export_drafter", lambda *a, **k: SimpleNamespace(describe=lambda: "exported"))
    failing = SimpleNamespace(ok=False, describe=lambda: "MISMATCH")
    monkeypatch.setattr(cli, "verify_export", lambda *a, **k: failing)
    assert cli.main(["--draft", str(tmp_path / "draft"), "--target", "tiny", "--out", str(tmp_path / "o")]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_bad_arguments_name_the_field(tmp_path):
    draft = DraftModel(CFG)
    embed, head = random_embedding_and_head(CFG.vocab_size, CFG.hidden_size)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        export_drafter(draft, embed, head, tmp_path, dtype="fp8")
    with pytest.raises(ValueError, match="opset=17"):
        export_drafter(draft, embed, head, tmp_path, opset=17)
    with pytest.raises(ValueError, match="graphs="):
        export_drafter(draft, embed, head, tmp_path, graphs=("head",))
    with pytest.raises(SystemExit):  # refused when parsed, before the draft is loaded
        cli.main(["--draft", "d", "--target", "tiny", "--out", str(tmp_path / "o"), "--verify-cases", "2x"])
    assert not (tmp_path / "o").exists()
    from dflash2_lightning.target.spec import TargetError

    with pytest.raises(TargetError, match="path='nowhere' is not a Hugging Face model directory"):
        cli.resolve_target("nowhere", draft)


@pytest.mark.parametrize("opset", ["99", "29", "17", "5", "0", "-1"])
def test_an_opset_outside_the_supported_range_is_refused_when_parsed(tmp_path, capsys, opset):
    """Checked with the command line, before the draft is loaded: above the installed onnx's newest opset the graphs
    would stay at torch's own while drafter.json claimed the other; below 18 the reference bodies do not exist."""
    from dflash2_lightning import cli as dflash2
    from dflash2_lightning.export.onnx.export import MIN_OPSET, max_opset

    assert max_opset() == onnx.defs.onnx_opset_version() < 29
    code = dflash2.main(
        [
            "export-onnx",
            "--draft",
            str(tmp_path / "no-draft"),
            "--target",
            "tiny",
            "--out",
            str(tmp_path / "onnx"),
            f"--opset={opset}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (
        f"dflash2: error: dflash2 export-onnx: argument --opset: {opset} is invalid: must be >= {MIN_OPSET} and "
        f"<= {max_opset()}"
    ) in err
    assert not (tmp_path / "onnx").exists()
    with pytest.raises(ValueError, match=rf"opset={opset} is invalid: must be from 18 to {max_opset()}"):
        export_drafter(
            DraftModel(CFG),
            *random_embedding_and_head(CFG.vocab_size, CFG.hidden_size),
            tmp_path / "o",
            opset=int(opset),
        )


def test_the_export_script_refuses_an_opset_in_one_line(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "export" / "to_onnx.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--draft",
            str(tmp_path),
            "--target",
            "tiny",
            "--out",
            str(tmp_path / "onnx"),
            "--opset",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "argument --opset: 3 is invalid: must be >= 18" in done.stderr and not (tmp_path / "onnx").exists()
