"""Building TensorRT engines from the exported drafting graphs, and running them against onnxruntime.

For every graph (``<name>.onnx``; the ``<name>.trt.onnx`` copy without function bodies is parsed when
present, so the ``dflash`` nodes cannot fall back to their reference bodies) :func:`build_engine`
registers the plugins of :mod:`dflash2_lightning.ops.tensorrt_plugins` (ahead-of-time Triton kernels:
the engine runs without Python), parses the graph (with ``aot=1`` added to each ``dflash`` node, the
ONNX parser's switch to a plugin's AOT implementation), gives every dynamic dimension an
optimisation-profile range (:func:`profile_shapes`) and builds with a persistent timing cache.
:func:`run_engine` and :func:`run_onnxruntime` run both on the same inputs; :func:`compare_outputs`
says where they disagree. The command (``dflash2 export-trt``, ``python export/to_trt.py``) is
:mod:`dflash2_lightning.export.tensorrt.command`.
"""

import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2_lightning.ops.tensorrt_common import TENSORRT_REQUIREMENT, tensorrt_version_problem

TENSORRT_INSTALL = (
    "TensorRT's Python packages are on PyPI, but its libraries (tensorrt-cu13-libs) are placeholders there that "
    f"download the real wheels from NVIDIA's package index when installed. With that index reachable, "
    f"pip install -e '.[tensorrt]' installs {TENSORRT_REQUIREMENT} (torch 2.13's CUDA 13), or "
    f"`pip install --extra-index-url https://pypi.nvidia.com '{TENSORRT_REQUIREMENT}'`, "
    "or follow https://docs.nvidia.com/deeplearning/tensorrt/latest/installing-tensorrt/installing.html "
    "(TensorRT 11 needs an NVIDIA driver >= r580)."
)
EXIT_OK, EXIT_MISSING, EXIT_BUILD, EXIT_MISMATCH = 0, 2, 3, 4
BATCH_WORDS = ("batch",)
CONTEXT_WORDS = ("context", "ctx", "past", "cache", "capacity", "seq", "len", "tokens", "kv")


# ----------------------------------------------------------------------------- requirements
def missing_requirements() -> list[str]:
    """One message per missing requirement (TensorRT, a CUDA GPU), each one line; empty when the build can run."""
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append(f"TensorRT is not installed (no 'tensorrt' module). {TENSORRT_INSTALL}")
    else:
        try:
            import tensorrt  # the bindings install without the libraries they link
        except ImportError as err:
            missing.append(f"TensorRT is installed but cannot load its libraries ({err}). {TENSORRT_INSTALL}")
        else:
            problem = tensorrt_version_problem(getattr(tensorrt, "__version__", "0"))
            if problem is not None:
                missing.append(problem)
    import torch

    if not torch.cuda.is_available():
        why = (
            "this torch is a CPU-only build (torch.version.cuda is None); install the CUDA build of torch==2.13.0"
            if torch.version.cuda is None
            else "torch.cuda.is_available() is False (no GPU or no driver)"
        )
        missing.append(f"No CUDA GPU: {why}. TensorRT builds and runs engines only on an NVIDIA GPU.")
    if importlib.util.find_spec("triton") is None:
        missing.append(
            "Triton is not installed: the plugins compile their kernels with it. "
            "pip install 'dflash2-lightning[kernels]' (triton==3.7.1)."
        )
    return missing


# ----------------------------------------------------------------------------- graphs and profiles
@dataclass(frozen=True)
class GraphFiles:
    """One exported graph: the file TensorRT parses and the file onnxruntime runs (with op bodies)."""

    name: str
    trt_path: Path
    ort_path: Path | None


def find_graphs(onnx: Path, names: Sequence[str] | None = None) -> list[GraphFiles]:
    """The graphs under ``onnx`` (a directory or one file), preferring each ``.trt.onnx`` copy for TensorRT."""
    if onnx.is_file():
        stem = onnx.name.removesuffix(".onnx").removesuffix(".trt")
        body = onnx.with_name(stem + ".onnx")
        trt_copy = onnx.with_name(stem + ".trt.onnx")
        return [GraphFiles(stem, trt_copy if trt_copy.exists() else onnx, body if body.exists() else None)]
    if not onnx.is_dir():
        raise FileNotFoundError(f"--onnx {onnx}: no such file or directory")
    stems = sorted({p.name.removesuffix(".onnx").removesuffix(".trt") for p in onnx.glob("*.onnx")})
    graphs = []
    for stem in stems:
        if names and stem not in names:
            continue
        body, trt_copy = onnx / f"{stem}.onnx", onnx / f"{stem}.trt.onnx"
        graphs.append(GraphFiles(stem, trt_copy if trt_copy.exists() else body, body if body.exists() else None))
    if not graphs:
        wanted = f" named {list(names)}" if names else ""
        raise FileNotFoundError(f"--onnx {onnx}: no .onnx graphs{wanted} found")
    return graphs


def parse_range(text: str, what: str) -> tuple[int, int, int]:
    """``"1,4,64"`` -> ``(1, 4, 64)``; raises unless ``1 <= min <= opt <= max``."""
    try:
        lo, opt, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{what}={text!r} is invalid: must be min,opt,max integers, e.g. 1,4,64") from None
    if not 1 <= lo <= opt <= hi:
        raise ValueError(f"{what}={text!r} is invalid: must satisfy 1 <= min <= opt <= max")
    return lo, opt, hi


def dim_role(name: str) -> str | None:
    """``"batch"``, ``"context"`` or None for a dynamic dimension's name."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    if any(w.startswith(BATCH_WORDS) for w in words):
        return "batch"
    if any(w.startswith(CONTEXT_WORDS) for w in words):
        return "context"
    return None


def read_graph(path: Path) -> tuple[dict[str, tuple[list, int]], int]:
    """``({input: ([dim value, dim_param name or None, ...], onnx elem_type)}, number of dflash nodes)``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    dims = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
        dims[value.name] = (shape, tensor.elem_type)
    return dims, sum(node.domain == "dflash" for node in model.graph.node)


def profile_shapes(
    inputs: dict[str, tuple[list, int]],
    batch: tuple[int, int, int],
    context: tuple[int, int, int],
    extra: dict[str, tuple[int, int, int]],
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``{input: (min shape, opt shape, max shape)}``; every dynamic dimension must get a range.

    ``extra`` keys are dimension names or ``"input:axis"`` (for unnamed dynamic dimensions) and win
    over the batch/context naming rule.
    """
    shapes, unknown = {}, []
    for name, (dims, _) in inputs.items():
        per_dim = []
        for axis, dim in enumerate(dims):
            if isinstance(dim, int) and dim > 0:
                per_dim.append((dim, dim, dim))
                continue
            key = dim if isinstance(dim, str) else f"{name}:{axis}"
            role = dim_role(dim) if isinstance(dim, str) else None
            if key in extra:
                per_dim.append(extra[key])
            elif role == "batch":
                per_dim.append(batch)
            elif role == "context":
                per_dim.append(context)
            else:
                unknown.append(key)
                per_dim.append((1, 1, 1))
        lo, opt, hi = (tuple(r[i] for r in per_dim) for i in range(3))
        shapes[name] = (lo, opt, hi)
    if unknown:
        raise ValueError(
            f"no profile range for dynamic dimension(s) {sorted(set(unknown))}: pass --dim NAME=min,opt,max for each"
        )
    return shapes


# ----------------------------------------------------------------------------- build
def with_aot_attribute(path: Path) -> bytes:
    """The graph with ``aot=1`` on every ``dflash`` node: the ONNX parser's switch to the plugins' AOT kernels.

    External weights stay where they are (the parser is given ``path`` to find them).
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.domain == "dflash" and not any(a.name == "aot" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("aot", 1))
    return model.SerializeToString()


def build_engine(
    graph: GraphFiles, shapes: dict, timing_cache: Path, tf32: bool, workspace_gib: float
) -> tuple[bytes, dict[str, Any]]:
    """Parse ``graph.trt_path`` with the plugins loaded and build a serialized engine; returns (plan, summary)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:  # TensorRT 11 networks are always strongly typed
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    if hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(with_aot_attribute(graph.trt_path), str(graph.trt_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"parsing {graph.trt_path} failed:\n{errors}")
    plugin_layers = [
        network.get_layer(i).name
        for i in range(network.num_layers)
        if network.get_layer(i).type == trt.LayerType.PLUGIN_V3
    ]

    config = builder.create_builder_config()
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # compare float32 graphs in float32
    if workspace_gib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build {graph.trt_path} (see the log above)")
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return bytes(plan), {"plugin_layers": plugin_layers, "tensorrt": trt.__version__}


# ----------------------------------------------------------------------------- compare
_ONNX_TO_TORCH = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 9: "bool"}


def random_inputs(inputs: dict[str, tuple[list, int]], shapes: dict, which: int, int_high: int, seed: int) -> dict:
    """Random CPU tensors at profile point ``which`` (0 = min, 1 = opt): floats ~ N(0, 1), ids in [0, int_high)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (_, elem_type) in inputs.items():
        shape = shapes[name][which]
        dtype = getattr(torch, _ONNX_TO_TORCH.get(elem_type, "float32"))
        if dtype.is_floating_point:
            tensors[name] = torch.randn(shape, generator=generator).to(dtype)
        elif dtype == torch.bool:
            tensors[name] = torch.ones(shape, dtype=torch.bool)
        else:
            tensors[name] = torch.randint(0, int_high, shape, generator=generator).to(dtype)
    return tensors


def run_engine(plan: bytes, inputs: dict) -> dict:
    """Run a serialized engine on CPU tensors ``inputs``; returns CPU outputs by name."""
    import tensorrt as trt
    import torch

    to_torch = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.bool: torch.bool,
        trt.int8: torch.int8,
    }
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError(
            "TensorRT could not deserialize the engine (built by another TensorRT version or for "
            "another GPU, or the dflash plugins are not registered in this process)"
        )
    context = engine.create_execution_context()
    device = {name: t.cuda().contiguous() for name, t in inputs.items()}
    for name, tensor in device.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    outputs = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            shape = tuple(context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=to_torch[engine.get_tensor_dtype(name)], device="cuda")
            context.set_tensor_address(name, outputs[name].data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("TensorRT execution failed")
    stream.synchronize()
    return {name: t.cpu() for name, t in outputs.items()}


def run_onnxruntime(path: Path, inputs: dict) -> dict:
    """Run the graph with its reference op bodies on onnxruntime's CPU provider."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, {name: t.numpy() for name, t in inputs.items()})
    return {name: torch.from_numpy(v) for name, v in zip(names, values)}


def tolerance(dtype) -> float:
    """Absolute = relative tolerance for a float output dtype."""
    import torch

    return {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 8e-2}.get(dtype, 1e-3)


def compare_outputs(engine_out: dict, reference: dict, reduced_precision: bool) -> list[str]:
    """Lines describing each output; a line starting with ``MISMATCH`` fails the check."""
    lines = []
    for name, ref in reference.items():
        got = engine_out[name]
        if ref.dtype.is_floating_point:
            tol = tolerance(got.dtype)
            err = (got.float() - ref.float()).abs()
            ok = bool((err <= tol + tol * ref.float().abs()).all())
            lines.append(f"{'ok' if ok else 'MISMATCH'} {name}: max |diff| {err.max().item():.3g} (tol {tol:g})")
        else:
            agree = (got.to(ref.dtype) == ref).float().mean().item() if ref.numel() else 1.0
            ok = agree == 1.0 or (reduced_precision and agree >= 0.9)
            lines.append(f"{'ok' if ok else 'MISMATCH'} {name}: {agree:.1%} of {ref.numel()} values equal")
    return lines
