"""Training throughput (supervised tokens/s) and peak memory (RSS) of the trainer on CPU.

Two target geometries, random weights (nothing is downloaded):

``tiny``
    The tiny random Qwen3 target of ``configs/tiny.yaml`` (hidden 64, 4 layers, vocab 512) and its
    draft: 1 layer, block 8, conv 2/16, selector rank 16 / top-8, 16 anchors, 8 x 64 tokens per step.
``smollm2``
    A random Qwen3 target of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads of 64,
    MLP 1536, vocab 49152) and the quickstart-sized draft: 1 layer, block 8, conv 2/16, selector
    rank 32 / top-8, 16 anchors, 8 x 192 tokens per step.

Each in two modes: ``online`` (the frozen target runs inside every training step) and ``offline``
(target features and greedy tokens read from the memory-mapped cache the DataModule builds first;
building it is not timed). A configuration runs in its own process (so its peak RSS is its own) through
the real stack: ``DFlash2Module`` + ``DraftDataModule`` + Lightning ``Trainer``, AdamW, gradient clipping.

"Supervised tokens" are the draft slots the loss trains on in a step (``train/supervised_positions``:
valid slots of all anchored blocks). Throughput = their sum over the timed steps / the timed steps'
wall time (from ``on_train_batch_start`` to ``on_train_batch_end``, after ``--warmup`` steps).
Peak RSS is the process maximum (``ru_maxrss``), target and data included.

Run: ``python benchmarks/bench_training.py [--steps N] [--warmup N] [--threads T] [--only tiny|smollm2]
[--json PATH]``. Prints a markdown table and writes ``benchmarks/results/bench_training.json`` (``--json``).
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import load_average, machine, write_json

RESULTS = Path(__file__).resolve().parent / "results"

TARGETS = {
    "tiny": {},
    "smollm2": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
}
DRAFTS = {
    "tiny": dict(
        num_hidden_layers=1, block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8
    ),
    "smollm2": dict(
        num_hidden_layers=1, block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8
    ),
}
ANCHORS = {"tiny": 16, "smollm2": 16}
DATA = {"tiny": dict(seq_len=64, batch_size=8), "smollm2": dict(seq_len=192, batch_size=8)}


def run_one(name: str, mode: str, steps: int, warmup: int, cache_root: str, precision: str = "32") -> dict:
    """One configuration in this process: train ``warmup + steps`` steps, time the last ``steps``."""
    import torch
    from lightning.pytorch import Callback, Trainer

    from dflash2_lightning.data.datamodule import DraftDataModule
    from dflash2_lightning.data.options import OfflineOptions
    from dflash2_lightning.target.spec import TargetSpec
    from dflash2_lightning.train.module import DFlash2Module

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.tokens: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.cpu.append(time.process_time() - self.cpu_start)
            self.tokens.append(float(trainer.callback_metrics["train/supervised_positions"]))

    spec = TargetSpec(tiny=TARGETS[name])
    model = DFlash2Module(
        target=spec,
        draft=DRAFTS[name],
        optimizer={"lr": 3e-3},
        objective={"token_loss": "ce", "position_weighting": "decay", "decay_gamma": 4.0, "num_anchors": ANCHORS[name]},
    )
    cfg = model.draft_config
    data = DraftDataModule(
        target=spec,
        mode=mode,
        block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids,
        max_samples=(warmup + steps) * DATA[name]["batch_size"] + 8,
        val_fraction=0.0,
        offline=OfflineOptions(
            cache_dir=os.path.join(cache_root, f"{name}-{mode}") if mode == "offline" else None, feature_device="cpu"
        ),
        **DATA[name],
    )
    start = time.perf_counter()
    data.prepare_data()  # offline: build the feature cache (not timed as training)
    data.setup("fit")
    prepare = time.perf_counter() - start
    timer = Timer()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=os.path.join(cache_root, f"run-{name}-{mode}"),  # the HF export lands here
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        callbacks=[timer],
        precision=precision,
    )
    trainer.fit(model, datamodule=data)
    timed, tokens, cpu = timer.times[warmup:], timer.tokens[warmup:], timer.cpu[warmup:]
    return {
        "target": name,
        "mode": mode,
        "precision": precision,
        "step_cpu_s": sum(cpu) / len(cpu),
        "steps_timed": len(timed),
        "batch": DATA[name]["batch_size"],
        "seq_len": DATA[name]["seq_len"],
        "draft_params": model.draft.num_parameters(),
        "target_params": sum(p.numel() for p in model.target.parameters()),
        "supervised_tokens_per_step": sum(tokens) / len(tokens),
        "step_s": sum(timed) / len(timed),
        "supervised_tokens_per_s": sum(tokens) / sum(timed),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "data_prepare_s": prepare,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--only", choices=sorted(TARGETS), default=None)
    parser.add_argument("--modes", default="online,offline", help="comma-separated data modes (default both)")
    parser.add_argument(
        "--precisions", default="32", help="comma-separated Lightning precisions, e.g. 32,bf16-mixed (default 32)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS / "bench_training.json",
        help="JSON output (default benchmarks/results/bench_training.json)",
    )
    parser.add_argument("--one", nargs=3, metavar=("TARGET", "MODE", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.one:  # child process: one configuration, one JSON line
        name, mode, precision = args.one
        print("RESULT " + json.dumps(run_one(name, mode, args.steps, args.warmup, args.cache, precision)), flush=True)
        return 0

    load_before = load_average()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-training-") as cache:
        for name in [args.only] if args.only else list(TARGETS):
            for mode, precision in [(m, p) for m in args.modes.split(",") for p in args.precisions.split(",")]:
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    name,
                    mode,
                    precision,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--cache",
                    cache,
                ]
                if args.threads:
                    command += ["--threads", str(args.threads)]
                done = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH2_CACHE": cache},
                )
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    raise SystemExit(f"{name}/{mode} failed:\n{done.stderr[-4000:]}")
                rows.append(json.loads(lines[-1][len("RESULT ") :]))

    print(
        "| target | mode | precision | batch x seq | supervised tokens/step | step (s) | step CPU (s) | "
        "supervised tokens/s | peak RSS (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['target']} | {r['mode']} | {r['precision']} | {r['batch']} x {r['seq_len']} | "
            f"{r['supervised_tokens_per_step']:.0f} | {r['step_s']:.3f} | {r['step_cpu_s']:.3f} | "
            f"{r['supervised_tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} |"
        )
    out = {
        "command": "python benchmarks/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(args.threads, load_before),
        "note": "CPU; step CPU (s) is the process's CPU time per step, less sensitive to other load",
        "results": rows,
    }
    write_json(args.json, out)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
