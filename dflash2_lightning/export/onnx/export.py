"""Export a draft as the two ONNX drafting graphs, with custom ``dflash`` nodes and reference bodies.

:func:`export_drafter` writes into one directory::

    context.onnx        features, positions -> k_0, v_0, ...                    (function bodies attached)
    draft_step.onnx     k_0, v_0, ..., length, anchor, start -> tokens, hidden   (function bodies attached)
    context.trt.onnx    the same graphs without function bodies, for TensorRT's plugins
    draft_step.trt.onnx
    drafter.json        config, dtype, opset, every input/output with its shape, custom node counts

Each graph goes ``torch.onnx.export(dynamo=True)`` with the ``dflash`` translation table (one custom
node per torch custom op), then gets the reference bodies as local functions, then has to pass
``onnx.checker.check_model(full_check=True)`` and ``onnx.shape_inference.infer_shapes(strict_mode=True)``.
The precision is that of the graph (fp32, fp16 or bf16): TensorRT 11 builds what the graph says.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import Tensor, nn

from dflash2_lightning.errors import check
from dflash2_lightning.export.onnx.drafter import MANIFEST, TORCH_DTYPES
from dflash2_lightning.export.onnx.graphs import (
    BATCH,
    CAPACITY,
    CONTEXT,
    ContextGraph,
    DraftStepGraph,
    context_io,
    draft_step_io,
    eval_copy,
)
from dflash2_lightning.files import atomic_write, atomic_write_text
from dflash2_lightning.model import DraftModel
from dflash2_lightning.ops import onnx_functions as ops

GRAPHS = ("context", "draft_step")
# 2: draft_step reads preallocated cache buffers with a valid ``length`` input (1: a concatenated cache).
FORMAT_VERSION = 2
DEFAULT_OPSET = 20
MIN_OPSET = 18  # the reference bodies use ReduceSum/Unsqueeze with axes inputs and CastLike


def max_opset() -> int:
    """The newest default-domain opset the graphs can be written in: the installed onnx's (torch.onnx exports at
    its own opset and converts to the one asked for with onnx's converter, which knows no later one; asked for
    more, it would keep the graphs at its own opset while drafter.json claimed the other)."""
    return int(onnx.defs.onnx_opset_version())


MAX_BATCH = 4096
# One protobuf may not exceed 2 GiB; bigger graphs keep their weights in a side file.
EXTERNAL_DATA_BYTES = 1_800_000_000
ONNX_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT64: "int64",
}


@dataclass
class GraphInfo:
    """One exported graph: files, typed inputs/outputs (``dim_param`` names for dynamic axes), custom nodes."""

    name: str
    file: str
    trt_file: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    custom_nodes: dict[str, int]
    functions: list[str]
    opset: int
    num_nodes: int
    external_data: bool = False

    def describe(self) -> str:
        def fmt(values: list[dict[str, Any]]) -> str:
            return ", ".join(f"{v['name']} {v['dtype']}[{','.join(map(str, v['shape']))}]" for v in values)

        nodes = ", ".join(f"{n} x{c}" for n, c in self.custom_nodes.items()) or "none"
        return (
            f"{self.name}: {self.file} (+ {self.trt_file} without bodies), {self.num_nodes} nodes, opset {self.opset}\n"
            f"  inputs:  {fmt(self.inputs)}\n  outputs: {fmt(self.outputs)}\n"
            f"  custom nodes: {nodes}; local functions: {', '.join(self.functions) or 'none'}"
        )


@dataclass
class ExportResult:
    """What :func:`export_drafter` wrote."""

    directory: Path
    dtype: str
    opset: int
    graphs: dict[str, GraphInfo] = field(default_factory=dict)

    @property
    def manifest(self) -> Path:
        return self.directory / MANIFEST

    def describe(self) -> str:
        lines = [f"wrote {self.directory} ({self.dtype}, opset {self.opset}): {MANIFEST}"]
        return "\n".join(lines + [g.describe() for g in self.graphs.values()])


def _value_info(values: Any) -> list[dict[str, Any]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "dtype": ONNX_TYPES.get(t.elem_type, str(t.elem_type)), "shape": shape})
    return out


def check_model(model: onnx.ModelProto | str | os.PathLike) -> None:
    """``check_model(full_check=True)`` and strict shape inference (a path for graphs over 2 GiB)."""
    if isinstance(model, (str, os.PathLike)):
        onnx.checker.check_model(str(model), full_check=True)
        onnx.shape_inference.infer_shapes_path(str(model), str(model) + ".inferred", strict_mode=True)
        os.unlink(str(model) + ".inferred")
        return
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _to_onnx(
    module: nn.Module, args: tuple[Any, ...], dynamic_shapes: Any, inputs: list[str], outputs: list[str], opset: int
) -> onnx.ModelProto:
    module.eval()
    # The exporter prints progress lines to stdout and warns when one Dim names several axes (k_0
    # and v_0 share "batch", as intended); neither helps the reader of the export's own report.
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.filterwarnings("ignore", message=".*will not be used, since it shares the same shape")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # torch-internal
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=inputs,
            output_names=outputs,
            opset_version=opset,
            custom_translation_table=ops.translation_table(),
            verbose=False,
        )
    if program is None:  # dynamo=True always returns the program
        raise RuntimeError("torch.onnx.export returned no ONNX program")
    return program.model_proto


def _save(model: onnx.ModelProto, path: Path) -> bool:
    """Write ``model`` atomically; weights go to ``<file>.data`` when the graph is too big for one protobuf."""
    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    if external:
        onnx.save_model(
            model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data"
        )
    else:
        atomic_write(path, lambda tmp: onnx.save_model(model, tmp))  # ordinary file mode (umask)
    return external


def _finish(model: onnx.ModelProto, name: str, directory: Path, metadata: dict[str, str]) -> GraphInfo:
    """Attach bodies, stamp metadata, check, write both copies; return the graph's description."""
    ops.attach_functions(model)
    for key, value in {**metadata, "dflash.graph": name}.items():
        model.metadata_props.add(key=key, value=value)
    trt = ops.strip_functions(model)
    file, trt_file = f"{name}.onnx", f"{name}.trt.onnx"
    external = model.ByteSize() > EXTERNAL_DATA_BYTES
    if not external:
        check_model(model)
    info = GraphInfo(
        name,
        file,
        trt_file,
        _value_info(model.graph.input),
        _value_info(model.graph.output),
        dict(Counter(n.op_type for n in ops.custom_nodes(model))),
        [f"{f.domain}::{f.name}" for f in model.functions],
        ops.default_opset(model),
        len(model.graph.node),
        external,
    )
    _save(model, directory / file)
    _save(trt, directory / trt_file)
    if external:
        check_model(directory / file)
    return info


def export_drafter(
    draft: DraftModel,
    embed: nn.Module,
    head: nn.Module,
    out: str | os.PathLike,
    *,
    dtype: str = "fp32",
    opset: int = DEFAULT_OPSET,
    with_hidden: bool = True,
    graphs: tuple[str, ...] = GRAPHS,
    example_batch: int = 2,
    example_context: int = 7,
) -> ExportResult:
    """Export ``draft`` (with the target's frozen ``embed`` / ``head`` baked in) as ``context`` + ``draft_step``.

    Args:
        draft: the draft model (any dtype; copied and cast to ``dtype``, the caller's model is untouched).
        embed: the target's ``embed_tokens`` as a module (``[B, S]`` ids -> ``[B, S, H]``).
        head: the target's ``lm_head`` as a module (``[..., H]`` -> ``[..., V]``).
        out: output directory (created).
        dtype: ``fp32``, ``fp16`` or ``bf16``: the precision of the whole graph.
        opset: default-domain opset of the graphs (:data:`MIN_OPSET` to :func:`max_opset`).
        with_hidden: also output ``hidden [B, bs-1, H]`` from ``draft_step``.
        graphs: which graphs to write (both by default; :class:`OrtDrafter` needs both).
        example_batch, example_context: trace sizes (any values >= 2; the graphs stay dynamic).
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: must be one of {sorted(TORCH_DTYPES)}")
    check(
        isinstance(opset, int) and MIN_OPSET <= opset <= max_opset(),
        "opset",
        opset,
        f"from {MIN_OPSET} to {max_opset()} (the opsets the installed onnx converts the graphs to)",
    )
    if not graphs or set(graphs) - set(GRAPHS):
        raise ValueError(f"graphs={graphs!r} is invalid: must be a non-empty subset of {GRAPHS}")
    if example_batch < 2 or example_context < 2:
        raise ValueError(
            f"example_batch={example_batch}, example_context={example_context} are invalid: both must "
            "be >= 2 (torch.export specialises sizes 0 and 1)"
        )
    cfg = draft.config
    torch_dtype = TORCH_DTYPES[dtype]
    draft = eval_copy(draft, torch_dtype, "cpu")
    embed = eval_copy(embed, torch_dtype, "cpu")
    head = eval_copy(head, torch_dtype, "cpu")
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {
        "dflash.architecture": cfg.architecture,
        "dflash.dtype": dtype,
        "dflash.config": json.dumps(cfg.to_hf_dict(), sort_keys=True),
    }
    result = ExportResult(directory, dtype, opset)

    # Example inputs for tracing; "batch" and "context" stay symbolic.
    gen = torch.Generator().manual_seed(0)
    b, c, layers, sliding = example_batch, example_context, cfg.num_hidden_layers, cfg.sliding_window is not None
    batch = torch.export.Dim(BATCH, min=1, max=MAX_BATCH)
    longest = max(cfg.max_position_embeddings, c + 1)
    context = torch.export.Dim(CONTEXT, min=1, max=longest)
    capacity = torch.export.Dim(CAPACITY, min=1, max=longest + cfg.block_size)
    positions = torch.arange(c).expand(b, c).contiguous()

    if "context" in graphs:  # features [B, C, n_t*H], positions [B, C] -> k_i, v_i [B, nkv, C, hd]
        features = torch.randn(b, c, cfg.num_target_features * cfg.hidden_size, generator=gen).to(torch_dtype)
        names_in, names_out = context_io(layers)
        model = _to_onnx(
            ContextGraph(draft), (features, positions), ({0: batch, 1: context},) * 2, names_in, names_out, opset
        )
        result.graphs["context"] = _finish(model, "context", directory, metadata)

    if "draft_step" in graphs:  # k_i, v_i [B, nkv, N, hd], length, anchor, start (+ context_positions) -> tokens
        if cfg.head_dim is None:
            raise RuntimeError("the draft's head_dim is unset (DraftConfig derives it when made)")
        kv = [
            torch.randn(b, cfg.num_key_value_heads, c, cfg.head_dim, generator=gen).to(torch_dtype)
            for _ in range(2 * layers)
        ]
        length = torch.arange(c - b + 1, c + 1)  # rows of different lengths <= capacity
        args: tuple[Any, ...] = (kv, length, torch.randint(0, cfg.vocab_size, (b,), generator=gen), length.clone())
        shapes: tuple[Any, ...] = ([{0: batch, 2: capacity}] * (2 * layers), {0: batch}, {0: batch}, {0: batch})
        if sliding:  # only then does the block need the context's positions (its attention mask)
            args, shapes = args + (positions,), shapes + ({0: batch, 1: capacity},)
        names_in, names_out = draft_step_io(layers, sliding, with_hidden)
        model = _to_onnx(DraftStepGraph(draft, embed, head, with_hidden), args, shapes, names_in, names_out, opset)
        result.graphs["draft_step"] = _finish(model, "draft_step", directory, metadata)

    manifest = {
        "format": "dflash2-onnx-drafter",
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "opset": opset,
        "architecture": cfg.architecture,
        "config": cfg.to_hf_dict(),
        "dynamic_axes": [BATCH, CONTEXT, CAPACITY],
        "sliding_window": sliding,
        "with_hidden": with_hidden,
        "custom_domain": {"domain": ops.DOMAIN, "version": ops.DOMAIN_VERSION, **ops.PLUGIN_ATTRIBUTES},
        "graphs": {name: {k: v for k, v in vars(g).items() if k != "name"} for name, g in result.graphs.items()},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": _version("onnxscript")},
    }
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return result


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def target_embedding_and_head(target: Any, dtype: torch.dtype | None = None) -> tuple[nn.Embedding, nn.Linear]:
    """The frozen ``embed_tokens`` / ``lm_head`` of a project ``Target`` or HF causal LM, as exportable modules."""
    from dflash2_lightning.export.onnx.graphs import frozen_embedding_and_head

    hf = getattr(target, "hf", target)
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(
            f"target embedding {type(embed).__name__} / head {type(head).__name__} are not a plain "
            "nn.Embedding and bias-free nn.Linear: only such targets (Llama, Qwen, SmolLM) are exportable"
        )
    return frozen_embedding_and_head(embed.weight, head.weight, dtype)


def random_embedding_and_head(
    vocab_size: int, hidden_size: int, seed: int = 0, std: float = 0.02
) -> tuple[nn.Embedding, nn.Linear]:
    """A seeded random embedding and head of the draft's geometry (``--target tiny``: no target needed)."""
    from dflash2_lightning.export.onnx.graphs import frozen_embedding_and_head

    gen = torch.Generator().manual_seed(seed)
    weight: Tensor = torch.randn(vocab_size, hidden_size, generator=gen) * std
    head = torch.randn(vocab_size, hidden_size, generator=gen) * std
    return frozen_embedding_and_head(weight, head)
