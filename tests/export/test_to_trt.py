"""``dflash2 export-trt`` / ``export/to_trt.py``: refuses cleanly without TensorRT or a GPU; graph discovery and
profiles. Engines themselves are built in test_tensorrt.py (``pytest -m gpu``)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2_lightning.export.tensorrt import build as to_trt

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "export" / "to_trt.py"
HAS_TRT_AND_GPU = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


def test_stops_at_once_without_tensorrt_or_gpu(tmp_path):
    if HAS_TRT_AND_GPU:
        pytest.skip("TensorRT and a GPU are present")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--onnx", str(tmp_path), "--out", str(tmp_path / "e.engine")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == to_trt.EXIT_MISSING == 2
    assert (
        out.stderr.startswith("dflash2: error: cannot build a TensorRT engine here: (1) ")
        and out.stderr.count("\n") == 1
    ), out.stderr  # one line, every missing requirement numbered in it
    if importlib.util.find_spec("tensorrt") is None:
        assert "TensorRT is not installed" in out.stderr
        assert "--extra-index-url https://pypi.nvidia.com" in out.stderr and "tensorrt-cu13" in out.stderr
    if not torch.cuda.is_available():
        assert "No CUDA GPU" in out.stderr
    assert not (tmp_path / "e.engine").exists()


def test_parse_range():
    assert to_trt.parse_range("1,4,64", "--batch") == (1, 4, 64)
    for bad in ("1,4", "4,1,64", "0,1,2", "a,b,c"):
        with pytest.raises(ValueError, match=f"--batch={bad!r} is invalid"):
            to_trt.parse_range(bad, "--batch")


def test_dim_role():
    assert [
        to_trt.dim_role(n) for n in ("batch", "batch_size", "context", "ctx_len", "past_len", "num_tokens", "capacity")
    ] == ["batch", "batch", "context", "context", "context", "context", "context"]
    assert to_trt.dim_role("nblocks") is None


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def test_find_graphs_prefers_the_tensorrt_copy(tmp_path):
    for name in ("context.onnx", "context.trt.onnx", "draft_step.onnx"):
        _touch(tmp_path / name)
    graphs = to_trt.find_graphs(tmp_path)
    assert [(g.name, g.trt_path.name, g.ort_path.name) for g in graphs] == [
        ("context", "context.trt.onnx", "context.onnx"),
        ("draft_step", "draft_step.onnx", "draft_step.onnx"),
    ]
    assert [g.name for g in to_trt.find_graphs(tmp_path, ["draft_step"])] == ["draft_step"]
    one = to_trt.find_graphs(tmp_path / "context.onnx")[0]
    assert (one.trt_path.name, one.ort_path.name) == ("context.trt.onnx", "context.onnx")
    with pytest.raises(FileNotFoundError, match="no .onnx graphs named"):
        to_trt.find_graphs(tmp_path, ["nope"])
    with pytest.raises(FileNotFoundError, match="no such file"):
        to_trt.find_graphs(tmp_path / "missing")


def test_profile_shapes():
    inputs = {"ids": (["batch", 16], 7), "kv": (["batch", 2, "context", 64], 1), "w": ([2, None], 1)}
    shapes = to_trt.profile_shapes(inputs, (1, 2, 8), (1, 256, 4096), {"w:1": (3, 3, 3)})
    assert shapes["ids"] == ((1, 16), (2, 16), (8, 16))
    assert shapes["kv"] == ((1, 2, 1, 64), (2, 2, 256, 64), (8, 2, 4096, 64))
    assert shapes["w"] == ((2, 3), (2, 3), (2, 3))
    with pytest.raises(ValueError, match=r"\['nblocks', 'w:1'\]: pass --dim"):
        to_trt.profile_shapes({"a": (["nblocks"], 1), "w": ([2, None], 1)}, (1, 1, 1), (1, 1, 1), {})


def test_read_graph_on_the_single_op_graphs(tmp_path):
    import gpu_helpers as gpu_check

    paths = gpu_check.single_op_graphs(tmp_path, "float16")
    inputs, custom = to_trt.read_graph(paths["block_conv"])
    assert custom == 1
    assert inputs["x"] == (["batch", gpu_check.BS, gpu_check.H], 10)  # FLOAT16
    inputs, custom = to_trt.read_graph(paths["lattice_walk"])
    assert custom == 1 and inputs["cand"][1] == 7 and inputs["anchor"][0] == ["batch"]
    shapes = to_trt.profile_shapes(inputs, (1, 4, 8), (1, 1, 1), {})
    assert shapes["anchor"] == ((1,), (4,), (8,))


def test_dflash_nodes_get_the_aot_switch(tmp_path):
    import gpu_helpers as gpu_check
    import onnx

    path = gpu_check.single_op_graphs(tmp_path, "float32")["block_conv"]
    model = onnx.load_from_string(to_trt.with_aot_attribute(path))
    (node,) = model.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["aot"] == 1 and attrs["plugin_namespace"] == b"dflash" and attrs["block_size"] == gpu_check.BS
    onnx.save(model, str(path))
    again = onnx.load_from_string(to_trt.with_aot_attribute(path))
    assert [a.name for a in again.graph.node[0].attribute].count("aot") == 1


def test_compare_outputs():
    ref = {"y": torch.ones(4), "tokens": torch.arange(4)}
    good = {"y": torch.ones(4) + 1e-5, "tokens": torch.arange(4)}
    assert all(line.startswith("ok") for line in to_trt.compare_outputs(good, ref, reduced_precision=False))
    bad = {"y": torch.ones(4) + 1.0, "tokens": torch.tensor([0, 1, 2, 0])}
    lines = to_trt.compare_outputs(bad, ref, reduced_precision=False)
    assert [line.split()[0] for line in lines] == ["MISMATCH", "MISMATCH"]
    assert "75.0% of 4 values equal" in lines[1]


def test_repeatable_options_collect_every_value(tmp_path):
    """--graph and --dim are repeatable (and take several values at once); --config gives them as lists."""
    from dflash2_lightning.action_options import parse_options
    from dflash2_lightning.export.tensorrt.command import ExportTrtOptions

    def parse(*argv: str) -> ExportTrtOptions:
        return parse_options(ExportTrtOptions, ["--onnx", "o", "--out", "e", *argv], "dflash2 export-trt", "")

    opts = parse("--graph", "context", "--graph", "draft_step", "--dim", "capacity=1,8,64", "--dim", "w:1=3,3,3")
    assert opts.graph == ["context", "draft_step"] and opts.dim == ["capacity=1,8,64", "w:1=3,3,3"]
    assert parse("--graph", "context", "draft_step").graph == ["context", "draft_step"]
    defaults = parse()
    assert (defaults.graph, defaults.dim, defaults.compare, defaults.onnx) == (None, [], True, Path("o"))
    config = tmp_path / "trt.yaml"
    config.write_text("graph: [draft_step]\ndim: ['capacity=1,8,64']\ncompare: false\n")
    from_file = parse("--config", str(config))
    assert (from_file.graph, from_file.dim, from_file.compare) == (["draft_step"], ["capacity=1,8,64"], False)


def test_bad_ranges_are_one_error_line_once_the_requirements_are_met(tmp_path, monkeypatch, capsys):
    """The ranges are read after the TensorRT/GPU check (exit 2, one line), before any graph is parsed."""
    from dflash2_lightning.export.tensorrt import command

    monkeypatch.setattr(command, "missing_requirements", list)
    _touch(tmp_path / "context.onnx")
    for argv, message in [
        (["--batch", "4,1,2"], "--batch='4,1,2' is invalid"),
        (["--dim", "capacity=1,2"], "--dim capacity='1,2' is invalid"),
        (["--graph", "nope"], "no .onnx graphs named ['nope']"),
    ]:
        code = command.main(["--onnx", str(tmp_path), "--out", str(tmp_path / "e"), *argv])
        err = capsys.readouterr().err
        assert code == to_trt.EXIT_MISSING and err.startswith("dflash2: error: ") and err.count("\n") == 1, err
        assert message in err
    assert not (tmp_path / "e").exists()
