"""What checking an offline feature cache costs when it is opened: full sha256 vs sampled blocks.

Writes a cache-shaped directory of ``.npy`` files (``--megabytes`` of float16 features plus the small
int/bool arrays, as :class:`~dflash2_lightning.data.datamodule.DraftDataModule` writes them) into a temporary
directory, records their checksums as the cache manifest does (:func:`~dflash2_lightning.data.datamodule.file_checksums`),
then times :func:`~dflash2_lightning.data.datamodule.verify_cache` in both modes, and a plain read of the same bytes
for scale. The file is freshly written, so it is read from the page cache: a cold read from disk adds the
disk's own time to both the read and the full hash.

Run: ``python benchmarks/bench_cache_verify.py [--megabytes 300] [--repeats 3] [--json PATH]``. Prints the
figures and writes ``benchmarks/results/bench_cache_verify.json`` (``--json``) with the load average beside them.
Not a test.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from record import load_average, loaded_label, machine, write_json

from dflash2_lightning.data import feature_cache as data

RESULT = Path(__file__).resolve().parent / "results" / "bench_cache_verify.json"


def build(root: Path, megabytes: int, seq_len: int = 512, width: int = 1024) -> dict:
    rows = max(1, megabytes * (1 << 20) // (seq_len * width * 2))
    split = root / "train"
    split.mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.save(split / "features.npy", rng.standard_normal((rows, seq_len, width), dtype=np.float32).astype(np.float16))
    np.save(split / "input_ids.npy", rng.integers(0, 50000, (rows, seq_len), dtype=np.int32))
    np.save(split / "target_next.npy", rng.integers(0, 50000, (rows, seq_len), dtype=np.int32))
    np.save(split / "loss_mask.npy", np.ones((rows, seq_len), dtype=bool))
    files = {str(f.relative_to(root)): data.file_checksums(f) for f in sorted(root.glob("*/*.npy"))}
    return {"files": files}


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULT, help=f"JSON output (default {RESULT})")
    args = parser.parse_args(argv)
    load_before = load_average()
    root = Path(tempfile.mkdtemp(prefix="cache-verify-"))
    try:
        manifest = build(root, args.megabytes)
        size = sum(v["bytes"] for v in manifest["files"].values())

        def read() -> None:
            for name in manifest["files"]:
                with open(root / name, "rb") as f:
                    while f.read(8 << 20):
                        pass

        def full() -> None:
            data._VERIFIED.clear()  # once per process in real use: time the first (only) check
            data.verify_cache(root, manifest, "full")

        results = {
            "bytes": size,
            "read_s": timed(read, args.repeats),
            "full_sha256_s": timed(full, args.repeats),
            "sampled_s": timed(lambda: data.verify_cache(root, manifest, "sampled"), args.repeats),
            "machine": machine(None, load_before),
        }
    finally:
        shutil.rmtree(root)
    gb = size / 1e9
    print(
        f"cache of {gb:.2f} GB: read {results['read_s']:.3f} s, full sha256 {results['full_sha256_s']:.3f} s "
        f"({gb / results['full_sha256_s']:.2f} GB/s), sampled blocks {results['sampled_s'] * 1e3:.1f} ms "
        f"(load average {load_before[0]:.2f} -> "
        f"{results['machine']['load_average_after'][0]:.2f}{loaded_label(results['machine'])})"
    )
    write_json(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
