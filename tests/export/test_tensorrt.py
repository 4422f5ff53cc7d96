"""With TensorRT and a CUDA device: the dflash plugins register, single-op engines built with them equal the
reference in every float type, and a serialized engine runs in a process that never imports the plugin code
(ahead-of-time kernels: no Python needed). ``pytest -m gpu`` (or ``-m tensorrt``) runs these."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from gpu_helpers import TOL, engine_inputs, engine_reference, single_op_graphs

pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu]


def test_plugins_register_with_tensorrt():
    import tensorrt as trt

    from dflash2_lightning.ops.tensorrt_plugins import PLUGIN_NAMESPACE, PLUGIN_VERSION, register_plugins

    register_plugins()
    register_plugins()  # idempotent
    registry = trt.get_plugin_registry()
    for op in ("DFlashBlockConv", "DFlashLatticeWalk"):
        assert registry.get_creator(op, PLUGIN_VERSION, PLUGIN_NAMESPACE) is not None


@pytest.mark.parametrize(
    "dtype_name,dtype", [("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)]
)
def test_single_op_engines_equal_the_reference(tmp_path, dtype_name, dtype):
    from dflash2_lightning.export.tensorrt import build
    from dflash2_lightning.ops.tensorrt_plugins import register_plugins

    register_plugins()
    for name, path in single_op_graphs(tmp_path / "graphs", dtype_name).items():
        inputs, _ = build.read_graph(path)
        shapes = build.profile_shapes(inputs, (1, 8, 64), (1, 1, 1), {})
        plan, summary = build.build_engine(
            build.GraphFiles(name, path, None), shapes, tmp_path / "timing.cache", tf32=False, workspace_gib=0
        )
        assert len(summary["plugin_layers"]) == 1
        feed = engine_inputs(name, dtype, 8)
        got = next(iter(build.run_engine(plan, feed).values()))
        want = engine_reference(name, feed)
        if got.dtype.is_floating_point:
            assert (got.float() - want).abs().max().item() <= TOL[dtype] * 10
        else:
            mismatch = 1.0 - (got == want).float().mean().item()
            assert mismatch == 0.0 if dtype == torch.float32 else mismatch < 0.03
        if dtype == torch.float32:
            _run_without_plugin_code(plan, feed, want, tmp_path / f"{name}.engine")


def _run_without_plugin_code(plan: bytes, feed: dict, want: torch.Tensor, engine_path) -> None:
    """Run the serialized engine in a new process that never imports the plugin module."""
    engine_path.write_bytes(plan)
    feed_path = engine_path.with_suffix(".inputs.pt")
    torch.save(feed, feed_path)
    code = (
        "import sys, torch; from dflash2_lightning.export.tensorrt import build; "
        "out = build.run_engine(open(sys.argv[1], 'rb').read(), torch.load(sys.argv[2])); "
        "assert 'dflash2_lightning.ops.tensorrt_plugins' not in sys.modules; torch.save(out, sys.argv[2] + '.out')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(engine_path), str(feed_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = next(iter(torch.load(str(feed_path) + ".out").values()))
    if got.dtype.is_floating_point:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-3)
    else:
        assert torch.equal(got, want)
