"""The onnxruntime drafter: the exported ``context`` / ``draft_step`` graphs behind the torch draft's interface.

    python export/ort_drafter.py <export dir> [--batch 1] [--context 64] [--cycles 5]

drafts a few cycles from random target features and prints the tokens and the time per step. In
code, use ``dflash2_lightning.onnx.OrtDrafter`` (where the implementation lives), e.g. with the
speculative loop: ``speculative_generate(target, OrtDrafter(dir), prompt, max_new_tokens)``.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

import torch  # noqa: E402

from dflash2_lightning.onnx.drafter import OrtDrafter  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Draft a few cycles with an exported drafter (random features).")
    p.add_argument("directory")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    drafter = OrtDrafter(args.directory, threads=args.threads or None)
    cfg, gen = drafter.config, torch.Generator().manual_seed(0)
    width = cfg.num_target_features * cfg.hidden_size
    b, c = args.batch, args.context
    cache = drafter.new_cache(b, c + 4 * args.cycles)  # preallocated: each cycle appends in place
    cache.append(drafter.context_kv(torch.randn(b, c, width, generator=gen), torch.arange(c).expand(b, c)))
    anchor = torch.randint(0, cfg.vocab_size, (b,), generator=gen)
    for cycle in range(args.cycles):
        t0 = time.perf_counter()
        tokens = drafter.draft_block(anchor, cache)
        new = cache.length
        cache.append(drafter.context_kv(torch.randn(b, 4, width, generator=gen), (new + torch.arange(4)).expand(b, 4)))
        print(f"cycle {cycle}: context {new:>5} -> tokens {tokens[0].tolist()} ({1e3 * (time.perf_counter() - t0):.1f} ms)")
        anchor = tokens[:, -1]
    return 0


if __name__ == "__main__":
    sys.exit(main())
