"""Selector walk latency: the ``dflash::lattice_walk`` op vs the per-position loop, and vs z-lab's selector.

Two measurements on the same random inputs (15 draft positions, top-16 candidates, rank 256,
vocab 49152, the DFlash2 defaults on a SmolLM2-sized vocabulary):

``walk``
    From candidates/unary/projected hidden to the greedy path. Ours: ``ops.lattice_walk`` (all
    ``[L, K, K]`` edge scores in one batched matmul, then a pointer walk). Baseline:
    ``ops.lattice_walk_per_position`` (one projection and argmax per position, the obvious loop).
``selector``
    From the head's logits ``[B, 15, V]`` and draft hidden ``[B, 15, 576]`` to the path: top-k,
    ``hidden_projection`` and the walk. Ours: ``topk`` + ``CandidateSelector.greedy_path``. z-lab
    (``dflash==0.1.0``, if installed): ``CandidateSelector.select(..., temperature=0)``, same weights.

All functions are timed round-robin in one process (median over ``--repeats`` after ``--warmup``), as
wall clock and as process CPU time; the CPU-time ratio is the steadier one on a shared machine.

Run: ``python benchmarks/bench_selector_walk.py [--threads 1] [--repeats N] [--batch 1 4] [--json PATH]``. Prints
a markdown table and writes ``benchmarks/results/bench_selector_walk.json`` (``--json``). Not a test: no assertion
on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from record import load_average, loaded_label, machine, write_json

from dflash2_lightning.model import CandidateSelector
from dflash2_lightning.ops import lattice_walk, lattice_walk_per_position

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, VOCAB, RANK, TOP_K, LENGTH = 576, 49152, 256, 16, 15


def interleaved(fns: dict, repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median wall-clock and process CPU microseconds per call, timed round-robin so machine noise hits all alike.

    CPU time is the steadier figure on a shared machine (time spent descheduled does not count).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {
        name: dict(wall_us=statistics.median(wall[name]) * 1e6, cpu_us=statistics.median(cpu[name]) * 1e6)
        for name in fns
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own choice); 1 is steadier on a busy machine",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS / "bench_selector_walk.json",
        help="JSON output (default benchmarks/results/bench_selector_walk.json)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()

    gen = torch.Generator().manual_seed(0)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK, TOP_K, std=0.02).eval()
    with torch.no_grad():  # off the no-op init: the walk must really choose
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 2 and p.shape[0] == VOCAB else 0.05))
    try:
        from dflash.model import CandidateSelector as ZlabSelector
        from transformers import Qwen3Config
    except ImportError:
        zlab = None
    else:
        cfg = Qwen3Config(
            hidden_size=HIDDEN, vocab_size=VOCAB, dflash_config=dict(selector_rank=RANK, selector_top_k=TOP_K)
        )
        zlab = ZlabSelector(cfg).eval()
        with torch.no_grad():
            zlab.predecessor_codebook.weight.copy_(selector.predecessor_codebook)
            zlab.successor_codebook.weight.copy_(selector.successor_codebook)
            zlab.hidden_projection.weight.copy_(selector.hidden_projection.weight)

    rows = []
    with torch.inference_mode():
        for batch in args.batch:
            hidden = torch.randn(batch, LENGTH, HIDDEN, generator=gen)
            logits = torch.randn(batch, LENGTH, VOCAB, generator=gen) * 3
            anchor = torch.randint(0, VOCAB, (batch,), generator=gen)
            unary, cand = logits.topk(TOP_K, dim=-1)
            proj = selector.hidden_projection(hidden)
            walk_args = (cand, unary, proj, anchor, selector.predecessor_codebook, selector.successor_codebook)

            def selector_ours():
                values, indices = logits.topk(TOP_K, dim=-1)
                return selector.greedy_path(indices, values, hidden, anchor)

            fns = {
                "walk_ours": lambda: lattice_walk(*walk_args),
                "walk_per_position": lambda: lattice_walk_per_position(*walk_args),
                "selector_ours": selector_ours,
            }
            same = torch.equal(lattice_walk(*walk_args), lattice_walk_per_position(*walk_args))
            pairs = [("walk", "walk_ours", "walk_per_position", "lattice_walk_per_position")]
            if zlab is not None:
                fns["selector_zlab"] = lambda: zlab.select(hidden, logits, anchor, 0.0)[0]
                same = same and torch.equal(selector_ours(), fns["selector_zlab"]())
                pairs.append(
                    ("top-k + projection + walk", "selector_ours", "selector_zlab", "z-lab CandidateSelector.select")
                )
            t = interleaved(fns, args.repeats, args.warmup)
            for what, mine, theirs, baseline in pairs:
                rows.append(
                    dict(
                        batch=batch,
                        what=what,
                        baseline=baseline,
                        ours_us=round(t[mine]["wall_us"], 1),
                        baseline_us=round(t[theirs]["wall_us"], 1),
                        speedup=round(t[theirs]["wall_us"] / t[mine]["wall_us"], 2),
                        speedup_cpu=round(t[theirs]["cpu_us"] / t[mine]["cpu_us"], 2),
                        same_tokens=same,
                    )
                )

    info = machine(torch.get_num_threads(), load_before)
    print(
        f"selector walk, L={LENGTH}, K={TOP_K}, r={RANK}, V={VOCAB}, float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after {args.warmup} warm-up, "
        f"{info['cpus']} CPUs, load average {load_before[0]:.1f} -> {info['load_average_after'][0]:.1f}"
        + loaded_label(info)
    )
    print(
        "| batch | measured | ours (us) | baseline | baseline (us) | baseline / ours | baseline / ours (CPU time) "
        "| same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['what']} | {r['ours_us']:.0f} | {r['baseline']} | {r['baseline_us']:.0f} "
            f"| {r['speedup']:.2f}x | {r['speedup_cpu']:.2f}x | {'yes' if r['same_tokens'] else 'no'} |"
        )

    meta = dict(
        **info,
        repeats=args.repeats,
        warmup=args.warmup,
        length=LENGTH,
        top_k=TOP_K,
        rank=RANK,
        vocab=VOCAB,
        hidden=HIDDEN,
        dtype="float32",
    )
    write_json(args.json, dict(meta=meta, rows=rows))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
