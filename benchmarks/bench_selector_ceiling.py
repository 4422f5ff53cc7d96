"""The selector's ceiling: how much of the top-k oracle's lead over the backbone argmax the walk takes.

    python benchmarks/bench_selector_ceiling.py --drafts runs/recipe/selector_drop/train/hf,runs/recipe/shipped_dflash/train/hf
        [--base runs/recipe/shipped_dflash/train/hf] [--prompts 32] [--max-new-tokens 96] [--batched]
        [--results benchmarks/results/selector_ceiling.json] [--threads 2]

For every trained draft, on the same held-out prompts and the target's own greedy outputs (decoded once
for all drafts), the teacher-forced replay of :func:`dflash2_lightning.evaluate.teacher_forced` at the
cycle starts of the speculative loop, for three ways to pick the drafted tokens:

- ``backbone``: the draft's argmax; ``selector``: DFlash2's greedy walk (the two paths the loop runs; at
  T=0 the replay equals the measured τ exactly, ``tests/evaluate/test_evaluate.py``);
- ``oracle``: a slot counts whenever the target's token is among the draft's top-k (k = the selector's
  ``top_k``, 8 for a DFlash draft): the τ a perfect selector over these candidates would reach.

Each τ has a 95% bootstrap interval over prompts; ``gap_closed`` is (selector - backbone) / (oracle -
backbone); with ``--base``, every path's accepted drafts and its τ are paired per prompt against the base
draft's best path (``vs_base``: the ratio of accepted drafts, and ``tau_ratio``, the τ ratio, each with its
interval, prompts resampled together). A draft costs one target-and-draft forward per prompt, about a minute
on 2 cores, against ~10
for the measured evaluation of both paths. Results merge by draft into
``benchmarks/results/selector_ceiling.json``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from record import load_average, machine, write_json

from dflash2_lightning.intervals import paired_ratio_interval, paired_tau_ratio_interval

RESULTS = Path(__file__).resolve().parent / "results" / "selector_ceiling.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafts", required=True, help="comma-separated draft checkpoint directories")
    p.add_argument("--base", default=None, help="a draft to pair every path against (e.g. the DFlash baseline)")
    p.add_argument("--target", default="smollm2", help="the target, as `dflash2 eval --target` takes it")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="target tokens per prompt (default 96)")
    p.add_argument(
        "--batched",
        action="store_true",
        help="decode the target's outputs in batches (~10x faster than one stream; what `dflash2 eval "
        "--replay-prompts` does) instead of one prompt at a time (the loop's own reference)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="JSON results file, merged by draft (default benchmarks/results/selector_ceiling.json)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.decode.speculative import target_greedy
    from dflash2_lightning.evaluate.replay import greedy_outputs, replay_cycles
    from dflash2_lightning.intervals import replay_summary
    from dflash2_lightning.model.checkpoint import load_draft
    from dflash2_lightning.target.arguments import target_spec_from_arg
    from dflash2_lightning.target.load import load_target

    load_before = load_average()
    target = load_target(target_spec_from_arg(args.target))
    prompts = [encode_prompt(target.tokenizer, m) for m in read_prompts(EVAL_PROMPTS, args.prompts)]
    stop = list(getattr(target, "eos_token_ids", []))
    outputs = (
        greedy_outputs(target, prompts, args.max_new_tokens, stop)
        if args.batched
        else [target_greedy(target, q, args.max_new_tokens, stop).tokens for q in prompts]
    )
    drafts = [d for d in args.drafts.split(",") if d]
    if args.base and args.base not in drafts:
        drafts.append(args.base)
    replays: dict[str, dict[str, dict[str, Any]]] = {}
    rows: dict[str, Any] = {}
    for d in drafts:
        t0 = time.perf_counter()
        draft = load_draft(d)
        replays[d] = {
            path: replay_summary(lengths, draft.config.block_size)
            for path, lengths in replay_cycles(draft, target, prompts, outputs)[0].items()
        }
        row = dict(replays[d])
        bb, orc = row["backbone"]["tau"], row["oracle"]["tau"]
        if "selector" in row and orc > bb:
            row["gap_closed"] = (row["selector"]["tau"] - bb) / (orc - bb)
        row["seconds"] = time.perf_counter() - t0
        rows[d] = row
        summary = ", ".join(
            f"{k} {v['tau']:.3f} [{v['interval'][0]:.2f}, {v['interval'][1]:.2f}]"
            for k, v in row.items()
            if isinstance(v, dict)
        )
        print(f"{d}: {summary}" + (f"; gap closed {row['gap_closed']:.0%}" if "gap_closed" in row else ""), flush=True)
    if args.base:
        base = replays[args.base]
        best = "selector" if "selector" in base else "backbone"
        for d in drafts:
            if d != args.base:
                rows[d]["vs_base"] = {
                    path: {
                        "base": f"{args.base} ({best})",
                        **paired_ratio_interval(r["per_prompt_accepted"], base[best]["per_prompt_accepted"]),
                        "tau_ratio": paired_tau_ratio_interval(
                            r["per_prompt_accepted"],
                            r["per_prompt_cycles"],
                            base[best]["per_prompt_accepted"],
                            base[best]["per_prompt_cycles"],
                        ),
                    }
                    for path, r in replays[d].items()
                }
                print(
                    f"{d} vs {args.base}: "
                    + ", ".join(
                        f"{path} tau ratio {v['tau_ratio']['ratio']:.3f} [{v['tau_ratio']['interval'][0]:.3f}, "
                        f"{v['tau_ratio']['interval'][1]:.3f}], accepted drafts "
                        + ("-" if v["ratio"] is None else f"{v['ratio']:.2f}x")  # None: the base accepted no draft
                        for path, v in rows[d]["vs_base"].items()
                    ),
                    flush=True,
                )
    run = {
        "command": f"python benchmarks/bench_selector_ceiling.py --drafts {args.drafts}"
        + (f" --base {args.base}" if args.base else "")
        + (f" --prompts {args.prompts}" if args.prompts != 32 else "")
        + (" --batched" if args.batched else "")
        + (f" --results {args.results}" if args.results != RESULTS else "")
        + f" --threads {args.threads}",
        "machine": machine(args.threads, load_before),
    }
    for row in rows.values():
        row["run"] = run  # rows from several runs merge into one file: each keeps its own command and load
    old = json.loads(args.results.read_text()) if args.results.is_file() else {}
    old.setdefault("rows", {}).update(rows)
    old.update(
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        target=args.target,
        generated_tokens=sum(len(o) for o in outputs),
        outputs="batched greedy" if args.batched else "greedy, one prompt at a time",
    )
    write_json(args.results, old)
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
