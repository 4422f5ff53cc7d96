"""Draft-step latency at batch 1: dflash2-lightning vs the z-lab reference (``dflash==0.1.0``), same weights.

One draft step = embed ``[anchor, MASK x 15]`` with the target's embedding, run the draft layers over the
block at positions ``C..C+15`` against a ``C = 512`` token context, apply the target head to the 15 mask
positions, then take the argmax (DFlash) or top-16 + greedy selector walk (DFlash2).

Two settings, as a server would see them:

``cached``
    The context's per-layer K/V already exists. Ours: a :class:`ContextKV` built once, passed to
    ``draft_block``. z-lab: its ``DynamicCache`` prefilled with the context once; each step calls its
    forward with no new target features (``target_hidden`` of length 0), positions ``C..C+15``, the cache
    (which appends the block's K/V), then z-lab's ``_crop_to(cache, C)`` to drop the block again (what
    ``dflash_generate`` does after every draft), then ``propose``.
``projected``
    The step also fuses the 512 context features (``fc`` + ``hidden_norm``) and projects their K/V in
    every layer. Ours: ``context_kv`` + ``draft_block``. z-lab: forward with ``target_hidden`` = the
    512 features and no cache, then ``propose``.

Geometry is SmolLM2-135M-like: hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152, RoPE base
1e5, block 16, conv 2 taps / group 16, selector rank 256 / top-16; 1 and 5 draft layers. Weights are
random and the conv and selector are moved off their no-op init, so every part really computes.

Both sides are timed round-robin in one process (median over ``--repeats`` after ``--warmup``), as wall
clock and as process CPU time; the CPU-time ratio is the steadier one on a shared machine.

Run: ``python benchmarks/bench_draft_step.py [--threads 1] [--repeats N] [--warmup N] [--context C] [--json PATH]``.
Prints a markdown table and writes ``benchmarks/results/bench_draft_step.json`` (``--json``). Not a test: no
assertion on time.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from record import load_average, loaded_label, machine, write_json
from torch import nn
from transformers import DynamicCache

from dflash2_lightning.config import DraftConfig
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.checkpoint import save_draft

RESULTS = Path(__file__).resolve().parent / "results"

GEOMETRY = dict(
    hidden_size=576,
    vocab_size=49152,
    num_target_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rope_theta=100_000.0,
    block_size=16,
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=256,
    selector_top_k=16,
    mask_token_id=0,
)


def randomize(model: DraftModel, seed: int = 0) -> DraftModel:
    """Random weights with the conv and selector away from their exact no-op init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("base_kernel") or "codebook" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.02 * noise)
    return model.eval()


def interleaved(fns: dict, repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median wall-clock and process CPU milliseconds per call, timed round-robin so machine noise hits all alike.

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
        name: dict(wall_ms=statistics.median(wall[name]) * 1e3, cpu_ms=statistics.median(cpu[name]) * 1e3)
        for name in fns
    }


def bench_config(projector: str, layers: int, context: int, repeats: int, warmup: int) -> list[dict]:
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, _crop_to  # z-lab reference (checked in main)

    cfg = DraftConfig(**GEOMETRY, num_hidden_layers=layers, projector_type=projector)
    ours = randomize(DraftModel(cfg))
    with tempfile.TemporaryDirectory() as tmp:
        save_draft(ours, tmp)
        ref_cls = DFlash2DraftModel if cfg.is_dflash2 else DFlashDraftModel
        ref = ref_cls.from_pretrained(tmp, dtype=torch.float32).eval()

    gen = torch.Generator().manual_seed(1)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # stands for the target's embed_tokens
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # and its lm_head
    features = torch.randn(1, context, cfg.num_target_features * cfg.hidden_size, generator=gen)
    ctx_pos = torch.arange(context)[None]
    anchor = torch.tensor([123])
    bs = cfg.block_size
    block = torch.full((1, bs), cfg.mask_token_id)
    block[:, 0] = anchor
    all_pos = torch.arange(context + bs)[None]
    no_features = features[:, :0]

    def ref_tokens(hidden):
        if cfg.is_dflash2:
            return ref.propose(hidden[:, 1:], anchor, head, 0.0)[0]
        return ref.compute_logits(hidden[:, 1:], head).argmax(-1)

    with torch.inference_mode():
        cached = ours.context_kv(features, ctx_pos)
        cache = DynamicCache(config=ref.config)
        ref(
            position_ids=all_pos,
            noise_embedding=embed(block),
            target_hidden=features,
            past_key_values=cache,
            use_cache=True,
        )
        _crop_to(cache, context)  # now holds exactly the context's K/V

        def ours_cached():
            return ours.draft_block(anchor, cached, embed, head)

        def ref_cached():
            hidden = ref(
                position_ids=all_pos[:, context:],
                noise_embedding=embed(block),
                target_hidden=no_features,
                past_key_values=cache,
                use_cache=True,
            )
            _crop_to(cache, context)
            return ref_tokens(hidden)

        def ours_projected():
            return ours.draft_block(anchor, ours.context_kv(features, ctx_pos), embed, head)

        def ref_projected():
            hidden = ref(position_ids=all_pos, noise_embedding=embed(block), target_hidden=features)
            return ref_tokens(hidden)

        rows = []
        for setting, mine, theirs in [
            ("cached", ours_cached, ref_cached),
            ("projected", ours_projected, ref_projected),
        ]:
            same = torch.equal(mine(), theirs())
            t = interleaved({"ours": mine, "zlab": theirs}, repeats, warmup)
            rows.append(
                dict(
                    model=projector,
                    layers=layers,
                    context=context,
                    setting=setting,
                    ours_ms=round(t["ours"]["wall_ms"], 2),
                    zlab_ms=round(t["zlab"]["wall_ms"], 2),
                    speedup=round(t["zlab"]["wall_ms"] / t["ours"]["wall_ms"], 3),
                    ours_cpu_ms=round(t["ours"]["cpu_ms"], 2),
                    zlab_cpu_ms=round(t["zlab"]["cpu_ms"], 2),
                    speedup_cpu=round(t["zlab"]["cpu_ms"] / t["ours"]["cpu_ms"], 3),
                    same_tokens=same,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--models", nargs="+", default=["dflash2", "dflash"], choices=["dflash2", "dflash"])
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 5])
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own choice); 1 is steadier on a busy machine",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS / "bench_draft_step.json",
        help="JSON output (default benchmarks/results/bench_draft_step.json)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    if importlib.util.find_spec("dflash") is None:
        raise SystemExit("bench_draft_step compares against the z-lab reference: pip install --no-deps dflash==0.1.0")
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()

    rows = []
    for projector in args.models:
        for layers in args.layers:
            rows += bench_config(projector, layers, args.context, args.repeats, args.warmup)

    lines = [
        "| draft | layers | context K/V | ours (ms) | z-lab (ms) | z-lab / ours | z-lab / ours (CPU time) "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['setting']} | {r['ours_ms']:.2f} | {r['zlab_ms']:.2f} "
            f"| {r['speedup']:.2f}x | {r['speedup_cpu']:.2f}x | {'yes' if r['same_tokens'] else 'no'} |"
        )
    info = machine(torch.get_num_threads(), load_before)
    print(
        f"draft step, batch 1, block 16, context {args.context}, float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after {args.warmup} warm-up, "
        f"{info['cpus']} CPUs, load average {load_before[0]:.1f} -> {info['load_average_after'][0]:.1f}"
        + loaded_label(info)
    )
    print("\n".join(lines))

    meta = dict(**info, repeats=args.repeats, warmup=args.warmup, dtype="float32", batch=1, geometry=GEOMETRY)
    write_json(args.json, dict(meta=meta, rows=rows))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
