"""``dflash2 export-trt``: TensorRT engines from the exported drafting graphs, checked against onnxruntime.

    dflash2 export-trt (or python export/to_trt.py) --onnx <export dir or .onnx file> --out <engine file or dir>
                            [--graph draft_step] [--batch 1,1,16] [--context 1,256,4096]
                            [--dim NAME=min,opt,max ...] [--timing-cache FILE] [--no-compare]

For every graph it registers the plugins of :mod:`dflash2_lightning.ops.tensorrt_plugins` (ahead-of-time Triton
kernels: the engine runs without Python), parses the ``<name>.trt.onnx`` copy without function bodies when
present (so ``dflash`` nodes cannot fall back to their reference bodies; ``aot=1`` is added to each), gives every
dynamic dimension an optimisation-profile range (``batch``-like names take ``--batch``; ``context``,
``capacity``, ``past``, ``seq``, ``len``, ``tokens``-like names ``--context``; others need ``--dim``), builds with
a persistent timing cache, and runs engine and onnxruntime on the same random inputs at the profile's min and opt
shapes (tokens exact in float32 graphs, floats within a tolerance set by the output dtype).

TensorRT and an NVIDIA GPU are required; without either it stops at once and says which is missing and how to
install it. Exit codes: 0 ok, 2 missing requirement or bad arguments, 3 build failed, 4 engine and onnxruntime
disagree. Serving a preallocated cache (``--dim capacity=...``): docs/export.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.errors import bounded
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


@dataclass(kw_only=True)
class ExportTrtOptions:
    """The options of ``dflash2 export-trt`` (``python export/to_trt.py``). The ranges (``--batch``,
    ``--context``, ``--dim``) are read once TensorRT and a GPU are known to be there (see :func:`main`)."""

    onnx: Path = option(REQUIRED, "export directory (from dflash2 export-onnx) or one .onnx")
    out: Path = option(REQUIRED, "engine file (one graph) or directory (one <graph>.engine per graph)")
    graph: list[str] | None = option(None, "build only this graph (repeatable), e.g. draft_step")
    batch: str = option("1,1,16", "batch min,opt,max (default {default})")
    context: str = option("1,256,4096", "context length min,opt,max (default {default})")
    dim: list[str] = option(
        [], "range of another dynamic dimension (dim_param name or input:axis)", metavar="NAME=min,opt,max"
    )
    timing_cache: Path | None = option(None, "timing cache file (default: timing.cache beside the engine)")
    workspace_gib: float = option(
        0.0, "builder workspace limit in GiB (default: 0, TensorRT's)", parse=bounded(float, 0.0)
    )
    tf32: bool = option(False, "allow TF32 in float32 layers (faster, looser comparison)")
    compare: bool = option(True, "skip the onnxruntime comparison", flag="--no-compare")
    int_high: int = option(2, "integer inputs are drawn from [0, int-high) (default {default})", parse=bounded(int, 1))
    seed: int = option(0, "seed of the comparison's random inputs (default {default})")


DESCRIPTION = (
    "Build TensorRT engines with the dflash plugins from an ONNX export (dflash2 export-onnx) and check them against "
    "onnxruntime on the same random inputs. Writes OUT (one engine) or OUT/<graph>.engine per graph, and a timing "
    "cache beside them. Needs TensorRT (whose libraries come from NVIDIA's package index) and an NVIDIA GPU; exit 2 "
    "says which is missing."
)


def _engine_path(out: Path, graph: GraphFiles, many: bool) -> Path:
    if many or out.is_dir() or not out.suffix:
        return out / f"{graph.name}.engine"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 export-trt`` / ``python export/to_trt.py``; the exit status (see the module docstring)."""
    opts = parse_options(ExportTrtOptions, argv, prog="dflash2 export-trt", description=DESCRIPTION)
    missing = missing_requirements()
    if missing:
        print_error(
            "cannot build a TensorRT engine here: "
            + "; ".join(f"({i}) {item.rstrip('.')}" for i, item in enumerate(missing, 1))
        )
        return EXIT_MISSING
    try:
        batch, context = parse_range(opts.batch, "--batch"), parse_range(opts.context, "--context")
        extra = {}
        for item in opts.dim:
            name, _, text = item.partition("=")
            extra[name] = parse_range(text, f"--dim {name}")
        graphs = find_graphs(opts.onnx, opts.graph)
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
        engine_path = _engine_path(opts.out, graph, len(graphs) > 1)
        cache = opts.timing_cache or engine_path.parent / "timing.cache"
        print(f"[{graph.name}] parsing {graph.trt_path}")
        for name, (lo, opt, hi) in shapes.items():
            print(f"  profile {name}: min {lo} opt {opt} max {hi}")
        try:
            plan, summary = build_engine(graph, shapes, cache, opts.tf32, opts.workspace_gib)
        except RuntimeError as err:
            print_error(f"{graph.name}: {err}")
            return EXIT_BUILD
        from dflash2_lightning.files import atomic_write

        def write_plan(tmp: str, plan: bytes = plan) -> None:  # bound now, not when the loop has moved on
            Path(tmp).write_bytes(plan)

        atomic_write(engine_path, write_plan)
        print(
            f"  TensorRT {summary['tensorrt']}: {len(summary['plugin_layers'])} plugin layer(s) for "
            f"{custom_nodes} dflash node(s); "
            f"wrote {engine_path} ({len(plan) / 2**20:.1f} MiB), timing cache {cache}"
        )
        if not opts.compare:
            continue
        if graph.ort_path is None:
            print(f"  comparison skipped: no {graph.name}.onnx with op bodies beside the TensorRT copy")
            continue
        reduced = any(t in (10, 16) for _, t in inputs.values())
        for which, label in ((0, "min"), (1, "opt")):
            feed = random_inputs(inputs, shapes, which, opts.int_high, opts.seed + which)
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
