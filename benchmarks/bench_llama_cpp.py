"""Does a drafter pay off in llama.cpp? Speed-up over the target alone by draft storage type and drafted tokens.

llama.cpp's quantised SmolLM2 (the shipped Q4_1 GGUF) decodes several times faster than the project's
float32 torch target, so a draft step must be cheap there to pay. This sweeps what a user can change
without retraining: the draft GGUF's storage type (``--outtypes``, e.g. f32 and q8_0) and the tokens
drafted per step (``--n-max``, 1..block_size-1: the late offsets accept rarely, and each drafted token
widens the verify batch), and the confidence below which llama.cpp stops a step's drafts (``--p-min``).
Every configuration runs the target alone and then with the draft on the same held-out prompts (greedy),
so its speed-up is a ratio taken within one stretch of time.

Run (needs ``make llama-cpp``)::

    python benchmarks/bench_llama_cpp.py --draft runs/quickstart/train/hf [--prompts 12 --max-new-tokens 48]

Writes ``benchmarks/results/bench_llama_cpp.json`` (``--out``; machine and load beside the figures) and prints
a table. Not a test.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from record import load_average, loaded_label, machine, write_json

from dflash2_lightning.evaluate.llama_cpp import evaluate_llama_cpp
from dflash2_lightning.model.checkpoint import load_config

RESULTS = Path(__file__).resolve().parent / "results" / "bench_llama_cpp.json"


def held_out_prompts(count: int) -> tuple[list[list[int]], list[int]]:
    """The evaluation's held-out prompts as the target tokenizer's token ids, and its stop ids."""
    from transformers import AutoTokenizer

    from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.target.load import hf_dir_of
    from dflash2_lightning.target.spec import TargetSpec

    tok = AutoTokenizer.from_pretrained(str(hf_dir_of(TargetSpec(gguf="smollm2"))))
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return [encode_prompt(tok, m) for m in read_prompts(EVAL_PROMPTS, count)], stop


def row(section: dict[str, Any]) -> dict[str, Any]:
    """The figures of one configuration (the token lists of the section are left out)."""
    s = section["speculative"]
    return {
        "draft_outtype": section["draft_outtype"],
        "draft_n_max": section["draft_n_max"],
        "draft_p_min": section["draft_p_min"],
        "drafted": s["drafted"],
        "tau": round(s["tau"], 4),
        "accept": [round(a, 4) for a in s["accept"]],
        "target_tokens_per_second": round(section["target_only"]["tokens_per_second"], 2),
        "speculative_tokens_per_second": round(s["tokens_per_second"], 2),
        "speedup": round(s["speedup"], 3),
        "lossless": s["lossless"],
        "mismatched_prompts": s["mismatched_prompts"],
        "verify_steps": s["verify_steps"],
        "tokens": s["tokens"],
        "loadavg": section["loadavg"],
        "wall_seconds": section["wall_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="draft checkpoint directory (HF, as the trainer writes it)")
    p.add_argument("--target-gguf", default="shipped", help="'shipped' (SmolLM2 Q4_1), 'f32' or a .gguf path")
    p.add_argument("--outtypes", default="f32,q8_0", help="draft GGUF storage types, comma-separated")
    p.add_argument("--n-max", default=None, help="drafted tokens per step, comma-separated (default: 1..block_size-1)")
    p.add_argument("--p-min", default="0", help="draft confidence floors, comma-separated (default 0: none)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS), help=f"JSON output file (default {RESULTS})")
    args = p.parse_args(argv)
    load_before = load_average()  # before this script's own setup (tokenizer, imports) adds to it
    width = load_config(args.draft).block_size - 1
    n_maxes = [int(n) for n in args.n_max.split(",")] if args.n_max else list(range(1, width + 1))
    prompts, stop = held_out_prompts(args.prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-llama-cpp-") as work:
        for outtype in args.outtypes.split(","):
            for n_max, p_min in [(n, float(q)) for n in n_maxes for q in args.p_min.split(",")]:
                section = evaluate_llama_cpp(
                    args.draft,
                    {"gguf": "smollm2"},
                    prompts,
                    args.max_new_tokens,
                    target_gguf=args.target_gguf,
                    threads=args.threads,
                    stop_token_ids=stop,
                    work_dir=Path(work) / f"{outtype}-{n_max}-{p_min}",
                    draft_outtype=outtype,
                    draft_n_max=n_max,
                    draft_p_min=p_min,
                )
                rows.append(row(section))
                r = rows[-1]
                print(
                    f"{outtype:5s} n_max {n_max} p_min {p_min}: tau {r['tau']:.2f}, "
                    f"{r['speculative_tokens_per_second']:.1f} vs {r['target_tokens_per_second']:.1f} tok/s alone "
                    f"({r['speedup']:.2f}x), lossless {r['lossless']}",
                    flush=True,
                )
    info = machine(args.threads, load_before)
    result = {
        "draft": str(args.draft),
        "target_gguf": args.target_gguf,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "machine": info,
        "rows": rows,
    }
    write_json(Path(args.out), result)
    before, after = info["load_average_before"], info["load_average_after"]
    print(
        f"\n{args.prompts} prompts x {args.max_new_tokens} tokens, {args.threads} llama.cpp threads, load average "
        + (f"{before[0]:.2f} -> {after[0]:.2f}" if before and after else "unknown")
        + loaded_label(info)
    )
    print("| draft type | drafted per step | p_min | drafted | τ | tok/s with draft | target alone | speed-up |")
    print("|---|---:|---:|---:|---|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['draft_outtype']} | {r['draft_n_max']} | {r['draft_p_min']} | {r['drafted']} | {r['tau']:.2f} "
            f"| {r['speculative_tokens_per_second']:.1f} | {r['target_tokens_per_second']:.1f} "
            f"| {r['speedup']:.2f}x |"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
