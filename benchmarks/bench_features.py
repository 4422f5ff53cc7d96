"""Tensor memory of the target's feature forward at the 8B recipe's size: every hidden state kept vs hooks.

Before issue 40, ``Target.features`` ran the target with ``output_hidden_states=True``, which keeps all
``num_hidden_layers + 1`` hidden states to pick the few the draft reads; now forward hooks copy only the layers the
draft reads into one tensor (:mod:`dflash2_lightning.target.capture`). This runs both on a target of Qwen3-8B's
geometry (36 layers, hidden 4096, vocab 151,936, bf16) with the recipe's batch and sequence length
(``configs/qwen3_8b_online.yaml``: 1 x 3072 per GPU, 5 draft layers reading [1, 9, 17, 25, 33]), in the two calls
the project makes:

- ``online``: the online fit's call with ``token_loss: ce`` (the recipe's): features and the final hidden state,
  no logits (the greedy targets come from that state at the rows the blocks read);
- ``cache_build``: the offline cache build's call: features and the logits at every position.

The model is built and run on the **meta device**: every op runs on shapes only, so the bytes of each tensor the
forward creates are exact and need no memory or compute. They are counted by ``LiveTensorBytes``
(``tests/memory_helpers.py``: a dispatch mode counting live storage bytes, the weights and the input taken as the
baseline); the figure is the peak beyond the weights. On the meta device SDPA takes its math path, which holds the
``[B, heads, S, S]`` scores: that transient is the same in both columns (a GPU's flash kernel does not hold it), so
the difference is what the hooks save.

Run: ``python benchmarks/bench_features.py [--batch 1] [--seq-len 3072] [--json PATH]`` (geometry options default to
Qwen3-8B's). Writes ``benchmarks/results/bench_features.json`` (``--json``). Not a test: no assertion.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from record import load_average, machine, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # LiveTensorBytes, the tests' counter

RESULT = Path(__file__).parent / "results" / "bench_features.json"
# Qwen3-8B's config.json (the geometry the recipe's target has).
QWEN3_8B = dict(
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=12_288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
)
# The attention mask as transformers' prepared mapping (no mask: every sample full length): its mask builder reads a
# value (.item()), which the meta device cannot give.
PREPARED_MASK = {"full_attention": None}
CALLS = {"online": dict(logits=False, last_hidden=True), "cache_build": dict(logits=True, last_hidden=False)}


def old_features(hf: Any, ids: Any, layer_ids: list[int], logits: bool, last_hidden: bool) -> tuple:
    """``Target.features`` before issue 40: every hidden state kept, the needed ones concatenated."""
    import torch

    out = hf(
        input_ids=ids,
        attention_mask=PREPARED_MASK,
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=0 if logits else 1,
    )
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, out.logits if logits else None, out.hidden_states[-1] if last_hidden else None


def hooked_features(hf: Any, ids: Any, layer_ids: list[int], logits: bool, last_hidden: bool) -> tuple:
    """``Target.features`` now (the capture it calls)."""
    from dflash2_lightning.target.capture import capture_features

    return tuple(capture_features(hf, ids, PREPARED_MASK, layer_ids, logits=logits, last_hidden=last_hidden))


def peak_bytes(fn: Any, hf: Any, ids: Any, layer_ids: list[int], call: dict[str, bool]) -> tuple[int, int]:
    """(peak bytes of tensors alive during the call, bytes it returns) beyond the weights and the input."""
    import torch
    from memory_helpers import LiveTensorBytes

    with torch.no_grad(), LiveTensorBytes() as tensors:
        tensors.track(*hf.parameters(), *hf.buffers(), ids)
        base = tensors.live
        result = fn(hf, ids, layer_ids, **call)
        peak, kept = tensors.peak - base, tensors.live - base
        del result
    return peak, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="samples per device (the recipe's batch_size: 1)")
    parser.add_argument("--seq-len", type=int, default=3072, help="tokens per sample (the recipe's seq_len)")
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=5,
        help="draft layers: the DFlash rule picks the feature layers from them (5 of 36: [1, 9, 17, 25, 33])",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    for key, value in QWEN3_8B.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"(Qwen3-8B: {value})")
    parser.add_argument("--json", type=Path, default=RESULT, help=f"JSON output (default {RESULT})")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash2_lightning.config import default_target_layer_ids
    from dflash2_lightning.errors import format_bytes

    load_before = load_average()
    geometry = {key: getattr(args, key) for key in QWEN3_8B}
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(Qwen3Config(**geometry, tie_word_embeddings=False), dtype=dtype)
    hf.eval().requires_grad_(False)
    ids = torch.zeros(args.batch, args.seq_len, dtype=torch.long, device="meta")
    layer_ids = default_target_layer_ids(args.num_hidden_layers, args.draft_layers)
    state = args.batch * args.seq_len * args.hidden_size * dtype.itemsize
    rows = []
    start = time.perf_counter()
    for name, call in CALLS.items():
        before, before_kept = peak_bytes(old_features, hf, ids, layer_ids, call)
        after, after_kept = peak_bytes(hooked_features, hf, ids, layer_ids, call)
        rows.append(
            dict(
                call=name,
                **call,
                output_hidden_states_peak_bytes=before,
                hooks_peak_bytes=after,
                saved_bytes=before - after,
                saved_hidden_states=(before - after) / state,
                returned_bytes_before=before_kept,
                returned_bytes_after=after_kept,
            )
        )
    seconds = time.perf_counter() - start
    header = "| call | output_hidden_states: peak | hooks: peak | saved | saved, in hidden states |"
    table = [header, "|---|---|---|---|---|"]
    for r in rows:
        table.append(
            f"| {r['call']} | {format_bytes(r['output_hidden_states_peak_bytes'])} | {format_bytes(r['hooks_peak_bytes'])}"
            f" | {format_bytes(r['saved_bytes'])} | {r['saved_hidden_states']:.1f} |"
        )
    print(
        f"target: Qwen3 geometry {geometry['num_hidden_layers']} layers x hidden {geometry['hidden_size']}, vocab "
        f"{geometry['vocab_size']}, {args.dtype}; {args.batch} x {args.seq_len} tokens; feature layers {layer_ids}; "
        f"one hidden state {state / 1e6:.1f} MB; tensor bytes beyond the weights, counted on the meta device"
    )
    print("\n".join(table))
    write_json(
        args.json,
        {
            "command": " ".join(
                ["python", "benchmarks/bench_features.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "what": "peak live tensor bytes of the target's feature forward beyond its weights (LiveTensorBytes on the "
            "meta device; SDPA's math path, the same in both columns)",
            "geometry": {
                **geometry,
                "dtype": args.dtype,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "layer_ids": layer_ids,
                "hidden_state_bytes": state,
            },
            "rows": rows,
            "table": "\n".join(table),
            "seconds": seconds,
            "machine": machine(torch.get_num_threads(), load_before),
        },
    )
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
