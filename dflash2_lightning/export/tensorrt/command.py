"""``dflash2 export-trt``: TensorRT engines from the exported drafting graphs, checked against onnxruntime.

    dflash2 export-trt (or python export/to_trt.py) --onnx <export dir or .onnx file> --out <engine file or dir>
                            [--graph draft_step] [--batch 1,1,16] [--context 1,256,4096]
                            [--dim NAME=min,opt,max ...] [--timing-cache FILE] [--no-compare]

For every graph (``<name>.onnx`` in the directory; the ``<name>.trt.onnx`` copy without function
bodies is parsed when present, so the ``dflash`` nodes cannot fall back to their reference bodies)
it registers the plugins of :mod:`dflash2_lightning.ops.tensorrt_plugins` (ahead-of-time Triton kernels: the engine runs
without Python), parses the graph (with ``aot=1`` added to each ``dflash`` node, the ONNX parser's
switch to a plugin's AOT implementation), gives every dynamic dimension an optimisation-profile range
(dimensions named like ``batch`` take ``--batch``, those named like ``context``/``capacity``/``past``/
``seq``/``len``/``tokens`` take ``--context``, any other needs ``--dim``; ``draft_step``'s cache buffers
have the ``capacity`` axis: give it ``--dim capacity=...`` to size the preallocated cache a server
binds, e.g. its maximum sequence length plus the block), builds with a persistent timing
cache, writes the engine, and runs engine and onnxruntime (on the copy *with* bodies) on the same
random inputs at the profile's min and opt shapes: token outputs must agree exactly in float32
graphs, floats within a tolerance set by the output dtype.

TensorRT and an NVIDIA GPU are required. Without either the script stops at once (exit code 2) and
says which is missing and how to install it: TensorRT's libraries come from NVIDIA's package index,
not from PyPI. Exit codes: 0 ok, 2 missing requirement or bad arguments, 3 build failed, 4 engine
and onnxruntime disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from dflash2_lightning.export.tensorrt.build import (
    EXIT_BUILD,
    EXIT_MISMATCH,
    EXIT_MISSING,
    EXIT_OK,
    GraphFiles,
    build_engine,
    compare_outputs,
    find_graphs,
    missing_requirements,
    parse_range,
    profile_shapes,
    random_inputs,
    read_graph,
    run_engine,
    run_onnxruntime,
)
from dflash2_lightning.reporting import print_error


def parser() -> argparse.ArgumentParser:
    """The options of ``dflash2 export-trt``."""
    p = argparse.ArgumentParser(
        prog="dflash2 export-trt",
        description="Build TensorRT engines with the dflash plugins from an ONNX export (dflash2 export-onnx) and "
        "check them against onnxruntime on the same random inputs. Writes OUT (one engine) or "
        "OUT/<graph>.engine per graph, and a timing cache beside them. Needs TensorRT (whose "
        "libraries come from NVIDIA's package index) and an NVIDIA GPU; exit 2 says which is missing.",
    )
    p.add_argument("--onnx", required=True, type=Path, help="export directory (from dflash2 export-onnx) or one .onnx")
    p.add_argument(
        "--out", required=True, type=Path, help="engine file (one graph) or directory (one <graph>.engine per graph)"
    )
    p.add_argument("--graph", action="append", help="build only this graph (repeatable), e.g. draft_step")
    p.add_argument("--batch", default="1,1,16", help="batch min,opt,max (default 1,1,16)")
    p.add_argument("--context", default="1,256,4096", help="context length min,opt,max (default 1,256,4096)")
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=min,opt,max",
        help="range of another dynamic dimension (dim_param name or input:axis)",
    )
    p.add_argument("--timing-cache", type=Path, help="timing cache file (default: timing.cache beside the engine)")
    p.add_argument("--workspace-gib", type=float, default=0.0, help="builder workspace limit (default: TensorRT's)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 in float32 layers (faster, looser comparison)")
    p.add_argument("--no-compare", action="store_true", help="skip the onnxruntime comparison")
    p.add_argument("--int-high", type=int, default=2, help="integer inputs are drawn from [0, int-high) (default 2)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _engine_path(out: Path, graph: GraphFiles, many: bool) -> Path:
    if many or out.is_dir() or not out.suffix:
        return out / f"{graph.name}.engine"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 export-trt`` / ``python export/to_trt.py``; the exit status (see the module docstring)."""
    args = parser().parse_args(argv)
    missing = missing_requirements()
    if missing:
        print_error(
            "cannot build a TensorRT engine here: "
            + "; ".join(f"({i}) {item.rstrip('.')}" for i, item in enumerate(missing, 1))
        )
        return EXIT_MISSING
    try:
        batch, context = parse_range(args.batch, "--batch"), parse_range(args.context, "--context")
        extra = {}
        for item in args.dim:
            name, _, text = item.partition("=")
            extra[name] = parse_range(text, f"--dim {name}")
        graphs = find_graphs(args.onnx, args.graph)
    except (ValueError, FileNotFoundError) as err:
        print_error(str(err))
        return EXIT_MISSING

    from dflash2_lightning.ops.tensorrt_plugins import register_plugins

    register_plugins()

    status = EXIT_OK
    for graph in graphs:
        inputs, custom_nodes = read_graph(graph.trt_path)
        try:
            shapes = profile_shapes(inputs, batch, context, extra)
        except ValueError as err:
            print_error(f"{graph.name}: {err}")
            return EXIT_MISSING
        engine_path = _engine_path(args.out, graph, len(graphs) > 1)
        cache = args.timing_cache or engine_path.parent / "timing.cache"
        print(f"[{graph.name}] parsing {graph.trt_path}")
        for name, (lo, opt, hi) in shapes.items():
            print(f"  profile {name}: min {lo} opt {opt} max {hi}")
        try:
            plan, summary = build_engine(graph, shapes, cache, args.tf32, args.workspace_gib)
        except RuntimeError as err:
            print_error(f"{graph.name}: {err}")
            return EXIT_BUILD
        from dflash2_lightning.files import atomic_write

        atomic_write(engine_path, lambda tmp, plan=plan: Path(tmp).write_bytes(plan))
        print(
            f"  TensorRT {summary['tensorrt']}: {len(summary['plugin_layers'])} plugin layer(s) for "
            f"{custom_nodes} dflash node(s); "
            f"wrote {engine_path} ({len(plan) / 2**20:.1f} MiB), timing cache {cache}"
        )
        if args.no_compare:
            continue
        if graph.ort_path is None:
            print(f"  comparison skipped: no {graph.name}.onnx with op bodies beside the TensorRT copy")
            continue
        reduced = any(t in (10, 16) for _, t in inputs.values())
        for which, label in ((0, "min"), (1, "opt")):
            feed = random_inputs(inputs, shapes, which, args.int_high, args.seed + which)
            try:
                reference = run_onnxruntime(graph.ort_path, feed)
            except Exception as err:  # e.g. bfloat16 kernels missing on onnxruntime's CPU provider
                print(f"  comparison skipped at {label} shapes: onnxruntime cannot run {graph.ort_path.name} ({err})")
                break
            lines = compare_outputs(run_engine(plan, feed), reference, reduced)
            for line in lines:
                print(f"  [{label}] {line}")
            if any(line.startswith("MISMATCH") for line in lines):
                status = EXIT_MISMATCH
    return status
