"""Peak memory of one training step's objective at the recipe's logits size: one-piece vs chunked logits.

The 8B recipe drafts 256 anchors x 16 positions (15 supervised slots) over a 151,936-token vocabulary: the
draft's logits alone are 583 M elements per sample. This runs the objective's forward and backward once at that
size on a CPU, with a narrow stand-in draft (hidden 64, one layer, DFlash2 with its top-8 selector) so that
only the logits are large, once in one piece (``keep_logits=True``, what every step did before chunking) and
once chunked (the default above ``LOGITS_CHUNK_ELEMENTS``), each in its own process. The peak is the
process's resident high-water mark (``VmHWM``) minus its resident size just before the step.

Run: ``python benchmarks/bench_logits_memory.py [--anchors 256] [--seq-len 3072] [--json PATH]``. Prints the
figures and writes ``benchmarks/results/bench_logits_memory.json`` (``--json``). Not a test: no assertion.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from record import load_average, machine, memory_status, write_json

RESULT = Path(__file__).parent / "results" / "bench_logits_memory.json"


def one_step(mode: str, anchors: int, seq_len: int, vocab: int) -> dict[str, float]:
    """Forward and backward of the objective in this process; its peak memory and time."""
    import torch
    from torch import nn

    from dflash2_lightning.config import DraftConfig
    from dflash2_lightning.model import DraftModel
    from dflash2_lightning.train.objective import DraftObjective, Teacher

    torch.manual_seed(0)
    cfg = DraftConfig(
        hidden_size=64,
        vocab_size=vocab,
        num_target_layers=4,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        block_size=16,
        target_layer_ids=[1],
        mask_token_id=vocab - 1,
        rope_theta=1e6,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=16,
        selector_top_k=8,
    )
    draft = DraftModel(cfg)
    embed_tokens, lm_head = nn.Embedding(vocab, 64), nn.Linear(64, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.mul_(8.0)
    embed_tokens.requires_grad_(False), lm_head.requires_grad_(False)
    ids = torch.randint(0, vocab - 1, (1, seq_len))
    features = torch.randn(1, seq_len, 64)
    mask = torch.ones(1, seq_len, dtype=torch.bool)
    objective = DraftObjective(num_anchors=anchors, position_weighting="decay")
    before = memory_status("VmRSS")
    start = time.perf_counter()
    out = objective(
        draft,
        embed_tokens,
        lm_head,
        ids,
        mask,
        features,
        Teacher(),
        generator=torch.Generator().manual_seed(0),
        keep_logits=mode == "one_piece",
    )
    out.loss.backward()
    seconds = time.perf_counter() - start
    return {
        "peak_bytes": memory_status("VmHWM") - before,
        "seconds": seconds,
        "loss": float(out.loss),
        "fc_grad_norm": float(draft.fc.weight.grad.norm()),
        "logits_elements": out.blocks.valid.numel() * vocab,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--json", type=Path, default=RESULT, help=f"JSON output (default {RESULT})")
    parser.add_argument("--mode", choices=["one_piece", "chunked"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(one_step(args.mode, args.anchors, args.seq_len, args.vocab)))
        return 0
    from dflash2_lightning.train.objective import LOGITS_CHUNK_ELEMENTS

    load_before = load_average()
    rows = {}
    for mode in ("one_piece", "chunked"):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--mode",
                mode,
                "--anchors",
                str(args.anchors),
                "--seq-len",
                str(args.seq_len),
                "--vocab",
                str(args.vocab),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{mode:9s}: peak {rows[mode]['peak_bytes'] / 2**30:.2f} GiB above the step's start, "
            f"{rows[mode]['seconds']:.1f} s, loss {rows[mode]['loss']:.6f}"
        )
    same = math.isclose(rows["one_piece"]["loss"], rows["chunked"]["loss"], rel_tol=1e-6)
    write_json(
        args.json,
        {
            "what": "objective forward+backward, 1 sample, hidden-64 stand-in draft, vocab and slots of the recipe",
            "anchors": args.anchors,
            "block_size": 16,
            "seq_len": args.seq_len,
            "vocab": args.vocab,
            "logits_chunk_elements": LOGITS_CHUNK_ELEMENTS,
            "results": rows,
            "losses_close_rel_1e-6": same,
            "machine": machine(1, load_before),
        },
    )
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
