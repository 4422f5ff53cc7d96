"""How far a draft step is from its floor: torch, onnxruntime and the bf16 drafting head vs arithmetic and memory.

The floor of a step is ``max(FLOPs / peak FLOP/s, bytes / stream bandwidth)``, where the peak and the
bandwidth are *measured on this machine* at the same thread count (a 1024^3 float32 matmul, and a sum
over a weight-sized array), and the FLOPs and bytes are counted from the geometry:

- head: ``2 x rows x hidden x vocab`` FLOPs, the ``vocab x hidden`` weight read once (float32: 4 bytes);
- layers: every projection of the block (q, k, v, o, gate, up, down, the conv kernel projections) and
  attention over ``context + block`` keys; their weights read once;
- the rest (norms, RoPE, top-k, the walk) is counted as free: the floor is a lower bound.

Rows (batch 1, one block of 16 after ``--context`` tokens held in a preallocated cache, SmolLM2-135M
geometry, random weights): the head alone in float32 and in bfloat16, then the whole step with torch,
with torch + the bf16 drafting head, and with onnxruntime (opset 20, graphs exported once into
``--onnx-dir`` or a temporary directory). Medians of ``--repeats`` after ``--warmup``, timed
round-robin, wall clock and process CPU time.

    python benchmarks/bench_draft_floor.py --threads 1 [--layers 1 5] [--context 256]

Writes ``benchmarks/results/bench_draft_floor.json`` with the load average. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_export import bench_config, random_draft
from record import load_average, loaded_label, machine, write_json
from torch import nn

from dflash2_lightning.decode.drafter import low_precision_head
from dflash2_lightning.export.onnx.export import export_drafter, random_embedding_and_head
from dflash2_lightning.model import DraftCache

RESULTS = Path(__file__).resolve().parent / "results"


def measured_peaks(repeats: int = 5) -> tuple[float, float]:
    """(float32 matmul FLOP/s, streaming read bytes/s) of this machine at torch's current thread count."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    big = torch.randn(49152, 576)
    for _ in range(2):
        a @ b
        big.sum()
    flops = min(_seconds(lambda: a @ b) for _ in range(repeats))
    stream = min(_seconds(big.sum) for _ in range(repeats))
    return 2 * 1024**3 / flops, big.numel() * 4 / stream


def _seconds(fn: Callable[[], object]) -> float:
    """Process CPU time of one call (steadier than wall time on a shared machine; one thread: the same)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


class _HeadOnly(nn.Module):
    """Stands for a target whose ``lm_head`` is ``head`` (what :func:`low_precision_head` reads)."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> nn.Linear:
        return self.head


def step_cost(cfg, context: int) -> dict[str, float]:
    """FLOPs and weight bytes of one block step (float32), split into head and layers."""
    h, q, bs = cfg.hidden_size, cfg.block_size, cfg.block_size
    heads, kv, hd, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    rows = bs - 1
    per_layer_weights = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter
    if cfg.is_dflash2:
        groups = h // cfg.conv_group_size
        per_layer_weights += 2 * h * 2 * cfg.conv_kernel_size * groups
    attention = 2 * 2 * heads * q * (context + q) * hd
    layers_flops = cfg.num_hidden_layers * (2 * q * per_layer_weights + attention)
    head_flops = 2 * rows * h * cfg.vocab_size
    selector = 2 * rows * h * cfg.selector_rank if cfg.is_dflash2 else 0
    return dict(
        head_flops=head_flops,
        head_bytes=4 * h * cfg.vocab_size,
        layers_flops=layers_flops + selector,
        layers_bytes=4 * cfg.num_hidden_layers * per_layer_weights + 4 * cfg.num_hidden_layers * 2 * kv * context * hd,
    )


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return {k: dict(wall_ms=1e3 * statistics.median(wall[k]), cpu_ms=1e3 * statistics.median(cpu[k])) for k in fns}


def bench_layers(layers: int, args: argparse.Namespace, peak: float, bandwidth: float, workdir: Path) -> list[dict]:
    from dflash2_lightning.export.onnx.drafter import OrtDrafter

    cfg = bench_config(layers)
    model = random_draft(cfg, seed=0)
    embed, head = random_embedding_and_head(cfg.vocab_size, cfg.hidden_size)
    bf16_head = low_precision_head(SimpleNamespace(hf=_HeadOnly(head)), torch.bfloat16)
    directory = workdir / f"layers{layers}"
    if not (directory / "drafter.json").is_file():
        export_drafter(model, embed, head, directory, with_hidden=False)
    ort = OrtDrafter(directory, threads=torch.get_num_threads())

    gen = torch.Generator().manual_seed(0)
    c = args.context
    features = torch.randn(1, c, cfg.num_target_features * cfg.hidden_size, generator=gen)
    positions = torch.arange(c)[None]
    anchor = torch.tensor([123])
    rows = torch.randn(1, cfg.block_size - 1, cfg.hidden_size, generator=gen)
    with torch.inference_mode():
        cache = DraftCache.for_model(model, 1, c).append(model.context_kv(features, positions))
        ort_cache = ort.new_cache(1, c).append(ort.context_kv(features, positions))
        fns = {
            "head fp32": lambda: head(rows),
            "head bf16": lambda: bf16_head(rows),
            "step torch": lambda: model.draft_block(anchor, cache, embed, head, c),
            "step torch + bf16 head": lambda: model.draft_block(anchor, cache, embed, bf16_head, c),
            "step onnxruntime": lambda: ort.draft_block(anchor, ort_cache, None, None, c),
        }
        times = interleaved(fns, args.repeats, args.warmup)
    cost = step_cost(cfg, c)
    head_floor = max(cost["head_flops"] / peak, cost["head_bytes"] / bandwidth)
    # bf16: half the bytes; the bf16 dot-product instructions do twice the float32 FLOPs per cycle.
    head_floor_bf16 = max(cost["head_flops"] / (2 * peak), cost["head_bytes"] / 2 / bandwidth)
    layers_floor = max(cost["layers_flops"] / peak, cost["layers_bytes"] / bandwidth)
    floors = {
        "head fp32": head_floor,
        "head bf16": head_floor_bf16,
        "step torch": head_floor + layers_floor,
        "step torch + bf16 head": head_floor_bf16 + layers_floor,
        "step onnxruntime": head_floor + layers_floor,
    }
    out = []
    for name, t in times.items():
        floor_ms = 1e3 * floors[name]
        out.append(
            dict(
                layers=layers,
                context=c,
                what=name,
                wall_ms=round(t["wall_ms"], 2),
                cpu_ms=round(t["cpu_ms"], 2),
                floor_ms=round(floor_ms, 2),
                x_floor_cpu=round(t["cpu_ms"] / floor_ms, 2),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 5])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--onnx-dir", default=None, help="reuse/keep the exported graphs here")
    p.add_argument("--json", default=str(RESULTS / "bench_draft_floor.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()
    peak, bandwidth = measured_peaks()
    scratch = None if args.onnx_dir else tempfile.TemporaryDirectory(prefix="dflash2-floor-")
    workdir = Path(args.onnx_dir or scratch.name)  # type: ignore[union-attr]
    rows = []
    try:
        for layers in args.layers:
            rows += bench_layers(layers, args, peak, bandwidth, workdir)
    finally:
        if scratch is not None:
            scratch.cleanup()
    info = machine(args.threads, load_before)
    lines = ["| layers | what | wall (ms) | CPU (ms) | floor (ms) | CPU / floor |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['what']} | {r['wall_ms']:.2f} | {r['cpu_ms']:.2f} | {r['floor_ms']:.2f} | "
            f"{r['x_floor_cpu']:.2f}x |"
        )
    print(
        f"batch 1, context {args.context}, {args.threads} thread(s); measured peak {peak / 1e9:.1f} GFLOP/s, "
        f"stream {bandwidth / 1e9:.1f} GB/s; load average {load_before[0]:.2f} -> "
        f"{info['load_average_after'][0]:.2f}" + loaded_label(info)
    )
    print("\n".join(lines))
    command = "python benchmarks/bench_draft_floor.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = dict(
        command=command,
        peak_gflops=round(peak / 1e9, 2),
        stream_gbps=round(bandwidth / 1e9, 2),
        rows=rows,
        machine=info,
        table="\n".join(lines),
    )
    write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
