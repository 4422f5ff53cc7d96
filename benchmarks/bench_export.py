"""Drafting latency per step: torch eager vs onnxruntime (CPU), plus CUDA / TensorRT rows on a GPU.

One *step* is what a server does per speculative cycle, in three parts timed separately:

``context``  the context graph on the newly verified tokens (``--new-tokens``, default 4);
``append``   writing their K/V into the preallocated cache (:class:`~dflash2_lightning.model.DraftCache`,
             in place at the valid length: O(new tokens)); ``--reference-cache`` adds rows with the
             concatenating :class:`~dflash2_lightning.model.ContextKV` (O(context) per append);
``draft``    one ``draft_step`` over the cache (its cost depends on the context only through attention).

Each row is the median over ``--runs`` steps after ``--warmup`` steps, at a fixed context length (the
cache is cropped back to the same length after every step). Geometry: SmolLM2-135M (hidden 576, 9/3
heads, head_dim 64, intermediate 1536, vocab 49152, 30 target layers) with a DFlash2 draft (block 16,
conv 2 taps / group 16, selector rank 256 / top-16); random weights (latency does not depend on the values).

    python benchmarks/bench_export.py                 # CPU: batch 1, 8 x context 256, 1024, 4096; 5 draft layers; fp32
    python benchmarks/bench_export.py --full          # more runs, fp16 rows too
    python benchmarks/bench_export.py --trt-dir engines/     # + TensorRT rows (GPU; engines from dflash2 export-trt)

Prints a markdown table (with the load average) and writes JSON (default ``benchmarks/results/export_bench.json``).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from record import write_json
from torch import Tensor, nn

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.export.onnx.drafter import TORCH_DTYPES, OrtDrafter
from dflash2_lightning.model import ContextKV, DraftCache, DraftModel

SMOLLM2 = dict(
    hidden_size=576,
    vocab_size=49152,
    num_target_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    block_size=16,
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=256,
    selector_top_k=16,
    mask_token_id=0,
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "export_bench.json"


@dataclass
class Row:
    """Median milliseconds of one backend at one (batch, context)."""

    backend: str
    dtype: str
    batch: int
    context: int
    new_tokens: int
    runs: int
    context_ms: float
    append_ms: float
    draft_step_ms: float
    step_ms: float


def bench_config(layers: int, projector: str = "dflash2") -> DraftConfig:
    """The SmolLM2-135M-geometry draft the benchmark times."""
    return DraftConfig(**SMOLLM2, num_hidden_layers=layers, projector_type=projector)  # type: ignore[arg-type]


def random_draft(cfg: DraftConfig, seed: int = 0) -> DraftModel:
    """A draft with small random weights everywhere (conv and selector active, not at their no-op init)."""
    gen = torch.Generator().manual_seed(seed)
    model = DraftModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    return model


# ----------------------------------------------------------------------------- one backend
class Stepper:
    """One backend's drafting step split in its parts (each returns what the next needs).

    ``new_cache(batch, capacity)`` gives an empty preallocated cache; ``None`` means the backend keeps
    the concatenating reference :class:`ContextKV`.
    """

    def __init__(
        self,
        context_kv: Callable[[Tensor, Tensor], ContextKV],
        draft_block: Callable[[Tensor, Any, Tensor], Tensor],
        new_cache: Callable[[int, int], DraftCache] | None = None,
        sync: Callable[[], None] = lambda: None,
    ) -> None:
        self.context_kv, self.draft_block, self.new_cache, self.sync = context_kv, draft_block, new_cache, sync


def time_steps(
    stepper: Stepper,
    cfg: DraftConfig,
    batch: int,
    context: int,
    new_tokens: int,
    runs: int,
    warmup: int,
    max_seconds: float,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[int, list[float], list[float], list[float], list[float]]:
    """Time ``runs`` steps (after ``warmup``); stops early after ``max_seconds`` (at least 3 runs)."""
    gen = torch.Generator().manual_seed(seed)
    width = cfg.num_target_features * cfg.hidden_size
    base_features = torch.randn(batch, context, width, generator=gen).to(device, dtype)
    base = stepper.context_kv(base_features, torch.arange(context, device=device).expand(batch, context))
    if stepper.new_cache is not None:  # capacity for the context and this step's tokens
        base = stepper.new_cache(batch, context + new_tokens).append(base)
    features = torch.randn(batch, new_tokens, width, generator=gen).to(device, dtype)
    positions = (context + torch.arange(new_tokens, device=device)).expand(batch, new_tokens)
    anchor = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device)
    start = torch.full((batch,), context + new_tokens, dtype=torch.long, device=device)
    parts: tuple[list[float], ...] = ([], [], [], [])
    began = time.perf_counter()
    for i in range(warmup + runs):
        stepper.sync()
        t0 = time.perf_counter()
        new = stepper.context_kv(features, positions)
        stepper.sync()
        t1 = time.perf_counter()
        cache = base.append(new)  # in place for a DraftCache, a new concatenation for a ContextKV
        stepper.sync()
        t2 = time.perf_counter()
        stepper.draft_block(anchor, cache, start)
        stepper.sync()
        t3 = time.perf_counter()
        if isinstance(cache, DraftCache):
            cache.crop(context)  # back to the fixed context length for the next step
        if i >= warmup:
            for part, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                part.append(1e3 * value)
            if len(parts[0]) >= 3 and time.perf_counter() - began > max_seconds:
                break
    return len(parts[0]), *parts  # type: ignore[return-value]


def torch_stepper(
    model: DraftModel, embed: nn.Module, head: nn.Module, device: str, preallocated: bool = True
) -> Stepper:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    new_cache = (lambda b, n: DraftCache.for_model(model, b, n)) if preallocated else None
    return Stepper(
        lambda f, p: model.context_kv(f, p), lambda a, c, s: model.draft_block(a, c, embed, head, s), new_cache, sync
    )


def ort_stepper(drafter: OrtDrafter) -> Stepper:
    return Stepper(drafter.context_kv, lambda a, c, s: drafter.draft_block(a, c, None, None, s), drafter.new_cache)


def trt_stepper(engines: Path) -> tuple[Stepper, torch.dtype]:
    """TensorRT engines ``context.engine`` / ``draft_step.engine`` (``export/to_trt.py --out <dir>``) on CUDA.

    The cache is a :class:`DraftCache` on the GPU: ``draft_step`` is bound to its buffers' addresses
    (no copy), the new K/V are written into them in place.
    """
    from dflash2_lightning.model import LayerKV

    _register_trt_plugins()
    ctx, step = TrtGraph(engines / "context.engine"), TrtGraph(engines / "draft_step.engine")
    dtype = ctx.dtype("features")

    def context_kv(features: Tensor, positions: Tensor) -> ContextKV:
        out = ctx({"features": features, "positions": positions})
        kv = [out[name] for name in ctx.outputs]
        return ContextKV([LayerKV(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)], positions)

    def new_cache(batch: int, capacity: int) -> DraftCache:
        cfg = ctx_config(engines)
        return DraftCache(
            cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, capacity, cfg.block_size, dtype, "cuda"
        )

    def draft_block(anchor: Tensor, cache: DraftCache, start: Tensor) -> Tensor:
        b = anchor.shape[0]
        feeds = {
            "anchor": anchor,
            "start": start,
            "context_positions": cache.slot_positions,
            "length": torch.full((b,), cache.length, dtype=torch.long, device=anchor.device),
        }
        for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
            feeds[f"k_{i}"], feeds[f"v_{i}"] = k, v
        return step(feeds)["tokens"]

    return Stepper(context_kv, draft_block, new_cache, torch.cuda.synchronize), dtype


def ctx_config(engines: Path) -> DraftConfig:
    """The draft config of an engine directory (``drafter.json`` copied or next to it)."""
    from dflash2_lightning.export.onnx.drafter import read_manifest

    for directory in (engines, engines.parent):
        if (directory / "drafter.json").is_file():
            return DraftConfig.from_hf_dict(read_manifest(directory)["config"])
    raise FileNotFoundError(f"no drafter.json in {engines} or its parent: copy the export's drafter.json there")


def _register_trt_plugins() -> None:
    """Register the ``dflash::`` TensorRT plugins (:mod:`dflash2_lightning.ops.tensorrt_plugins`) before deserializing."""
    from dflash2_lightning.ops import tensorrt_plugins as plugins

    plugins.register_plugins()


class TrtGraph:
    """A deserialized TensorRT engine called with named CUDA tensors (outputs allocated per call)."""

    def __init__(self, path: Path) -> None:
        import tensorrt as trt

        self._trt = trt
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{path}: TensorRT could not deserialize the engine (plugins not registered?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype of the engine's tensor ``name`` (by name: ``trt.nptype`` has no bfloat16)."""
        names = {
            "FLOAT": torch.float32,
            "HALF": torch.float16,
            "BF16": torch.bfloat16,
            "INT64": torch.int64,
            "INT32": torch.int32,
            "BOOL": torch.bool,
            "INT8": torch.int8,
        }
        return names[self.engine.get_tensor_dtype(name).name]

    def __call__(self, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        for name in self.inputs:
            t = feeds[name].to(self.dtype(name)).contiguous()  # the cache buffers are: bound as they are
            feeds[name] = t
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        out = {}
        for name in self.outputs:
            out[name] = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=self.dtype(name), device="cuda")
            self.context.set_tensor_address(name, out[name].data_ptr())
        self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
        return out


# ----------------------------------------------------------------------------- the grid
def record_cuda(
    args: argparse.Namespace,
    model: DraftModel,
    embed: nn.Module,
    head: nn.Module,
    record: Callable[..., None],
    notes: list[str],
) -> None:
    """torch eager on the GPU: the ops' reference implementations, then the Triton kernels (if installed)."""
    from dflash2_lightning.ops import dispatch as kernels

    triton = kernels.enable_cuda_kernels()
    launchers = (kernels.cuda_block_conv, kernels.cuda_lattice_walk)
    variants = [("torch eager cuda", (None, None))] + ([("torch eager cuda +triton", launchers)] if triton else [])
    if not triton:
        notes.append("Triton kernels unavailable (pip install 'dflash2-lightning[kernels]'): no +triton rows")
    try:
        with torch.no_grad():
            for dtype in args.gpu_dtypes:
                torch_dtype = TORCH_DTYPES[dtype]
                typed = [copy.deepcopy(m).to("cuda", torch_dtype) for m in (model, embed, head)]
                for name, (conv, walk) in variants:
                    kernels.cuda_block_conv, kernels.cuda_lattice_walk = conv, walk  # what the ops dispatch to
                    record(name, dtype, torch_stepper(*typed, "cuda"), "cuda", torch_dtype)
    finally:
        kernels.cuda_block_conv, kernels.cuda_lattice_walk = launchers


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dflash2_lightning.export.onnx.export import export_drafter, random_embedding_and_head

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    cfg = bench_config(args.layers, args.projector)
    model = random_draft(cfg, args.seed)
    embed, head = random_embedding_and_head(cfg.vocab_size, cfg.hidden_size, args.seed)
    notes: list[str] = []
    rows: list[Row] = []

    def record(backend: str, dtype: str, stepper: Stepper, device: str, torch_dtype: torch.dtype) -> None:
        for batch in args.batches:
            for context in args.contexts:
                n, ctx, app, step, total = time_steps(
                    stepper,
                    cfg,
                    batch,
                    context,
                    args.new_tokens,
                    args.runs,
                    args.warmup,
                    args.max_seconds,
                    device,
                    torch_dtype,
                    args.seed,
                )
                row = Row(
                    backend,
                    dtype,
                    batch,
                    context,
                    args.new_tokens,
                    n,
                    _median(ctx),
                    _median(app),
                    _median(step),
                    _median(total),
                )
                rows.append(row)
                print(
                    f"  {backend:<22} {dtype} batch {batch:>2} context {context:>5}: {row.step_ms:9.2f} ms/step "
                    f"({n} runs)",
                    flush=True,
                )

    scratch = None if args.onnx_dir else tempfile.TemporaryDirectory(prefix="dflash2-bench-")
    workdir = Path(args.onnx_dir or scratch.name)  # type: ignore[union-attr]
    try:
        for dtype in args.dtypes:
            torch_dtype = TORCH_DTYPES[dtype]
            if "torch" in args.backends:
                with torch.no_grad():
                    typed = [copy.deepcopy(m).to(torch_dtype) for m in (model, embed, head)]
                    record("torch eager cpu", dtype, torch_stepper(*typed, "cpu"), "cpu", torch_dtype)
                    if args.reference_cache:
                        record(
                            "torch eager cpu, ContextKV",
                            dtype,
                            torch_stepper(*typed, "cpu", preallocated=False),
                            "cpu",
                            torch_dtype,
                        )
                    del typed
            if "ort" not in args.backends:
                continue
            for opset in args.opsets:
                directory = workdir / f"{dtype}-opset{opset}"
                if not (directory / "drafter.json").is_file():
                    t0 = time.perf_counter()
                    export_drafter(model, embed, head, directory, dtype=dtype, opset=opset, with_hidden=False)
                    print(
                        f"  exported {dtype} opset {opset} graphs to {directory} in {time.perf_counter() - t0:.0f} s",
                        flush=True,
                    )
                drafter = OrtDrafter(directory, threads=threads)
                record(f"onnxruntime cpu opset {opset}", dtype, ort_stepper(drafter), "cpu", torch_dtype)
    finally:
        if scratch is not None:
            scratch.cleanup()

    if torch.cuda.is_available():
        record_cuda(args, model, embed, head, record, notes)
    else:
        notes.append("no CUDA device: GPU rows (torch eager with and without the Triton kernels, TensorRT) skipped")
    if args.trt_dir:
        try:
            import tensorrt  # noqa: F401 - only whether it imports
        except ImportError as err:
            notes.append(f"tensorrt not importable ({err}): TensorRT rows skipped")
        else:
            if torch.cuda.is_available():
                stepper, trt_dtype = trt_stepper(Path(args.trt_dir))
                name = {v: k for k, v in TORCH_DTYPES.items()}.get(trt_dtype, str(trt_dtype))
                record("tensorrt", name, stepper, "cuda", trt_dtype)
    else:
        notes.append("TensorRT rows need --trt-dir (engines from dflash2 export-trt, built on a GPU)")

    import onnxruntime

    return {
        "command": args.command,
        "geometry": {
            **SMOLLM2,
            "num_hidden_layers": args.layers,
            "projector_type": args.projector,
            "num_parameters": model.num_parameters(),
        },
        "step": f"context graph on {args.new_tokens} new tokens + ContextKV.append + draft_step",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "threads": threads,
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "runs": args.runs,
        "warmup": args.warmup,
        "opsets": args.opsets,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "rows": [asdict(r) for r in rows],
        "notes": notes,
    }


def markdown(result: dict[str, Any]) -> str:
    """The rows as a markdown table (milliseconds, medians)."""
    lines = [
        "| backend | dtype | batch | context | context graph (ms) | append (ms) | draft step (ms) | "
        "**step (ms)** | runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['backend']} | {r['dtype']} | {r['batch']} | {r['context']} | {r['context_ms']:.2f} | "
            f"{r['append_ms']:.2f} | {r['draft_step_ms']:.2f} | **{r['step_ms']:.2f}** | {r['runs']} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Drafting latency per step: torch eager vs "
        "onnxruntime on CPU (and TensorRT / CUDA on a GPU), SmolLM2-135M geometry."
    )
    p.add_argument("--batches", type=_ints, default=[1, 8])
    p.add_argument("--contexts", type=_ints, default=[256, 1024, 4096])
    p.add_argument("--layers", type=int, default=5, help="draft layers (default 5)")
    p.add_argument("--projector", default="dflash2", choices=["dflash2", "dflash"])
    p.add_argument("--new-tokens", type=int, default=4, help="verified tokens appended per step (default 4)")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32"], help="CPU dtypes: fp32,fp16")
    p.add_argument("--gpu-dtypes", type=lambda s: s.split(","), default=["fp16", "bf16"])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=4.0, help="time cap per row (>= 3 runs are kept)")
    p.add_argument("--threads", type=int, default=0, help="threads for torch and onnxruntime (default: torch's)")
    p.add_argument("--full", action="store_true", help="50 runs after 5 warm-up, no time cap, fp32 and fp16")
    p.add_argument(
        "--backends",
        type=lambda s: s.split(","),
        default=["torch", "ort"],
        help="CPU backends: torch,ort (GPU rows are added when a GPU is present)",
    )
    p.add_argument(
        "--opsets",
        type=_ints,
        default=[20],
        help="opsets of the onnxruntime graphs, e.g. 20,23 (23 fuses Attention/RMSNormalization/RoPE)",
    )
    p.add_argument("--onnx-dir", help="reuse (or keep) exported graphs here: <dir>/<dtype>-opset<N>/")
    p.add_argument("--trt-dir", help="directory with context.engine and draft_step.engine (export/to_trt.py --out)")
    p.add_argument(
        "--reference-cache",
        action="store_true",
        help="also time torch with the concatenating ContextKV (appending copies the whole cache)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(DEFAULT_OUT), help=f"JSON output (default {DEFAULT_OUT})")
    return p


def main(argv: list[str] | None = None) -> int:
    import sys

    args = parser().parse_args(argv)
    args.command = "python benchmarks/bench_export.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.full:
        args.runs, args.warmup, args.max_seconds, args.dtypes = 50, 5, float("inf"), ["fp32", "fp16"]
    for name in ("dtypes", "gpu_dtypes"):
        bad = [d for d in getattr(args, name) if d not in TORCH_DTYPES]
        if bad:
            raise SystemExit(f"--{name.replace('_', '-')} {bad} is invalid: choose from {sorted(TORCH_DTYPES)}")
    t0 = time.perf_counter()
    result = run(args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    table = markdown(result)
    load = max(result["load_average"]["before"][0], result["load_average"]["after"][0])
    print(
        f"\nload average {result['load_average']['before'][0]:.2f} -> {result['load_average']['after'][0]:.2f}"
        + (" (LOADED MACHINE: re-take on a quiet one)" if load >= 1.0 else "")
    )
    print(table + "\n")
    for note in result["notes"]:
        print(f"note: {note}")
    out = Path(args.json)
    write_json(out, {**result, "table": table})
    print(f"wrote {out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
