"""The custom ops on a GPU: the eager reference vs the Triton kernels (vs TensorRT single-op engines).

    python benchmarks/bench_gpu_ops.py [--runs 200] [--engines DIR]

At the SmolLM2-135M drafting geometry (H=576, block 16, 2 taps, 36 groups; K=16, r=256, V=49152), batch 1
and 8, bfloat16: the median of ``--runs`` CUDA-event-timed calls after a warm-up. With ``--engines``, a
directory of ``block_conv.float32.engine`` / ``lattice_walk.float32.engine`` (built by ``pytest -m
tensorrt`` helpers or ``dflash2 export-trt``), their fp32 latency is added. Writes
``benchmarks/results/bench_gpu_ops.json``. Needs a CUDA device and the ``kernels`` extra (Triton).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the GPU tests' input helpers

from gpu_helpers import BS, GROUPS, RANK, TAPS, TOP_K, H, V, conv_inputs, reference_walk, walk_inputs
from record import machine, write_json

from dflash2_lightning import ops

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_gpu_ops.json"


def time_cuda(fn: Callable[[], object], runs: int, warmup: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``runs`` CUDA-event-timed calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_engine(plan: bytes, feed: dict[str, torch.Tensor], runs: int) -> float:
    """Median milliseconds of one ``execute_async_v3`` of a serialized engine on ``feed``."""
    import tensorrt as trt

    from dflash2_lightning.ops.tensorrt_plugins import register_plugins

    register_plugins()
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError("TensorRT could not deserialize the engine (built with another TensorRT or GPU?)")
    context = engine.create_execution_context()
    device = {k: t.cuda() for k, t in feed.items()}
    for name, tensor in device.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    outputs = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            dtype = torch.float32 if engine.get_tensor_dtype(name) == trt.float32 else torch.int64
            outputs.append(torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda"))
            context.set_tensor_address(name, outputs[-1].data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    return time_cuda(lambda: context.execute_async_v3(stream), runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="timed runs per figure (default 200)")
    p.add_argument("--engines", type=Path, default=None, help="directory of single-op float32 engines")
    p.add_argument("--json", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_ops: no CUDA device", file=sys.stderr)
        return 2
    from gpu_helpers import engine_inputs

    from dflash2_lightning.ops.block_conv.triton_kernel import block_conv
    from dflash2_lightning.ops.lattice_walk.triton_kernel import lattice_walk

    rows = []
    for b in (1, 8):
        x, base, both = conv_inputs(b, BS, H, TAPS, GROUPS, torch.bfloat16)
        delta = both[:, :, 1]
        row = {
            "op": "block_conv bf16",
            "batch": b,
            "reference_ms": time_cuda(lambda: ops.block_conv_reference(x, base, delta, BS), args.runs),
            "triton_ms": time_cuda(lambda: block_conv(x, base, delta, BS), args.runs),
        }
        args_walk = walk_inputs(b, BS - 1, TOP_K, RANK, V, torch.bfloat16)
        walk_row = {
            "op": "lattice_walk bf16",
            "batch": b,
            "reference_ms": time_cuda(lambda: reference_walk(*args_walk), args.runs),
            "per_position_loop_ms": time_cuda(lambda: ops.lattice_walk_per_position(*args_walk), args.runs),
            "triton_ms": time_cuda(lambda: lattice_walk(*args_walk), args.runs),
        }
        if args.engines is not None:
            for r, name in ((row, "block_conv"), (walk_row, "lattice_walk")):
                plan = (args.engines / f"{name}.float32.engine").read_bytes()
                r["tensorrt_fp32_ms"] = time_engine(plan, engine_inputs(name, torch.float32, b), args.runs)
        rows += [row, walk_row]
    print("| op | batch | reference ms | per-position loop ms | Triton ms | TensorRT (fp32 engine) ms |")
    print("|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"
    for r in rows:
        print(
            f"| {r['op']} | {r['batch']} | {fmt(r['reference_ms'])} | {fmt(r.get('per_position_loop_ms'))} | "
            f"{fmt(r['triton_ms'])} | {fmt(r.get('tensorrt_fp32_ms'))} |"
        )
    write_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows, "machine": machine(None, None)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
