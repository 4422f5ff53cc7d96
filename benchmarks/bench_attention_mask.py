"""What the draft attention's dense block mask costs at the 8B recipe's size, in memory and arithmetic.

Training attends ``N x block_size`` block queries to ``seq_len`` context keys plus the blocks' own keys through
one ``scaled_dot_product_attention`` call with a dense boolean mask ``[B, 1, Q, S + Q]``
(:func:`dflash2_lightning.train.objective.block_attention_mask`): a query sees the context before its anchor
and its own block only. This script answers, at the recipe's geometry (hidden 4096, 32 query / 8 KV heads of
128, block 16, 3072-token samples, 256 anchors), how much of that matrix is used and what the mask costs:

- counted from real anchors on a fully supervised sample: the fraction of (query, key) pairs attended, hence
  the attention arithmetic a block-sparse kernel would skip;
- the bytes of the mask, of the additive bias a CUDA memory-efficient kernel reads in its place, and of the
  probabilities the math kernel would hold (per layer, per sample, bf16);
- measured on this CPU, each in its own process: one recipe-size draft attention layer (fp32) forward and
  backward with the dense mask and without any mask (the same dense arithmetic, no mask read: what the mask
  itself adds), the peak resident memory above the step's start and the time.

Run: ``python benchmarks/bench_attention_mask.py [--anchors 256] [--json PATH]``. Writes
``benchmarks/results/bench_attention_mask.json`` (``--json``). Not a test: no assertion. Timings mean something only
on a quiet machine (the record carries the load).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from record import load_average, machine, memory_status, write_json

RESULT = Path(__file__).parent / "results" / "bench_attention_mask.json"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 32, 8, 128, 16


def _anchors(anchors: int, seq_len: int):
    """Anchors as training draws them on a fully supervised sample, and the mask they give."""
    import torch

    from dflash2_lightning.train.objective import block_attention_mask, sample_anchors

    loss_mask = torch.ones(1, seq_len, dtype=torch.bool)
    chosen, _ = sample_anchors(loss_mask, BLOCK, anchors, generator=torch.Generator().manual_seed(0))
    return chosen, block_attention_mask(chosen, seq_len, BLOCK)


def counted(anchors: int, seq_len: int) -> dict[str, float]:
    """Pairs attended, mask and probability bytes, attention FLOPs: from the real mask, no timing."""
    _, mask = _anchors(anchors, seq_len)
    q, k = mask.shape[-2:]
    pairs, attended = q * k, int(mask.sum())
    # QK^T and PV, forward: 2 GEMMs x 2 FLOPs per multiply-add; backward about twice the forward.
    dense_flops = 3 * 2 * 2 * HEADS * q * k * HEAD_DIM
    return {
        "queries": q,
        "keys": k,
        "attended_fraction": attended / pairs,
        "mask_bool_bytes": pairs,
        "bias_bf16_bytes": 2 * pairs,
        "math_kernel_probabilities_bf16_bytes": 2 * HEADS * pairs,
        "attention_flops_dense_fwd_bwd": dense_flops,
        "attention_flops_block_sparse_fwd_bwd": dense_flops * attended / pairs,
    }


def one_layer(mode: str, anchors: int, seq_len: int) -> dict[str, float]:
    """One recipe-size attention layer forward + backward in this process: peak memory and seconds."""
    import torch

    from dflash2_lightning.config import DraftConfig
    from dflash2_lightning.model.backbone import DraftAttention, RotaryEmbedding

    torch.manual_seed(0)
    cfg = DraftConfig(
        hidden_size=HIDDEN,
        vocab_size=1024,
        num_target_layers=8,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=4 * HIDDEN,
        block_size=BLOCK,
        target_layer_ids=[1],
        mask_token_id=1023,
    )
    attention = DraftAttention(cfg)
    chosen, mask = _anchors(anchors, seq_len)
    rotary = RotaryEmbedding(HEAD_DIM, cfg.rope_theta)
    context_pos = torch.arange(seq_len)[None]
    block_pos = (chosen[:, :, None] + torch.arange(BLOCK)).reshape(1, -1)
    context_hidden = torch.randn(1, seq_len, HIDDEN)
    block_hidden = torch.randn(1, block_pos.shape[1], HIDDEN, requires_grad=True)
    before = memory_status("VmRSS")
    start = time.perf_counter()
    context = attention.project_kv(context_hidden, *rotary(context_pos, torch.float32))
    out = attention(block_hidden, context, *rotary(block_pos, torch.float32), mask if mode == "dense_mask" else None)
    out.square().mean().backward()
    seconds = time.perf_counter() - start
    return {"peak_bytes": memory_status("VmHWM") - before, "seconds": seconds, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--json", type=Path, default=RESULT, help=f"JSON output (default {RESULT})")
    parser.add_argument("--mode", choices=["dense_mask", "no_mask"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(one_layer(args.mode, args.anchors, args.seq_len)))
        return 0
    load_before = load_average()
    figures = counted(args.anchors, args.seq_len)
    print(
        f"Q {figures['queries']} x K {figures['keys']}: {100 * figures['attended_fraction']:.1f}% of pairs "
        f"attended; mask {figures['mask_bool_bytes'] / 2**20:.0f} MiB bool, "
        f"{figures['bias_bf16_bytes'] / 2**20:.0f} MiB as a bf16 bias; math-kernel probabilities "
        f"{figures['math_kernel_probabilities_bf16_bytes'] / 2**30:.2f} GiB per layer (bf16)"
    )
    rows = {}
    for mode in ("dense_mask", "no_mask"):
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--anchors", str(args.anchors), "--seq-len", str(args.seq_len)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{mode:10s}: peak {rows[mode]['peak_bytes'] / 2**30:.2f} GiB above the step's start, "
            f"{rows[mode]['seconds']:.1f} s"
        )
    write_json(
        args.json,
        {
            "what": "one recipe-size draft attention layer (fp32, CPU) forward+backward, dense block mask vs none",
            "anchors": args.anchors,
            "block_size": BLOCK,
            "seq_len": args.seq_len,
            "counted": figures,
            "measured": rows,
            "machine": machine(rows["dense_mask"]["threads"], load_before),
        },
    )
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
