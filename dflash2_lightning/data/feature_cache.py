"""The offline feature cache: the target's features, greedy tokens and top-k logits, computed once, checked on open.

A directory of ``.npy`` files read memory-mapped (features ``float16`` by default, an overflow being an error that
names ``feature_dtype="float32"``; ``target_next`` and top-k indices int32, top-k values float32) and a
``manifest.json`` naming what they were computed for (target fingerprint, tokenizer, layer ids, ``seq_len``,
top-k, storage dtype, a hash of the data). A cache whose manifest differs from the run is an error naming the
fields that differ; a directory without a manifest is never a complete cache.

Integrity: the manifest records each file's size, sha256, and the sha256 of 64 sampled 64 KiB blocks (the first
holds the ``.npy`` header, the last the end of the data). Opening checks every file's size, then
(``cache_verify``) every byte (``"full"``, once per process per file), the sampled blocks (``"sampled"``), or,
by default (``"auto"``), every byte up to :data:`FULL_VERIFY_BYTES` and the samples above: a small cache is
hashed whole in seconds, while a real target's cache is terabytes and hashing it at every start would take
hours. A damaged file is a :class:`DataError` naming it and saying to rebuild the cache.
Space: :func:`cache_bytes` sizes the cache once the data is tokenised, so the build
(:mod:`~dflash2_lightning.data.cache_build`) refuses a disk without room before it writes anything.
What users see: docs/training.md ("Online or offline").
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from dflash2_lightning.data.records import DataError

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: the manifest records a checksum of every file
MANIFEST = "manifest.json"
FULL_VERIFY_BYTES = 4 << 30  # cache_verify="auto": hash every byte up to this cache size
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 64 << 10
_VERIFIED: set[tuple[str, int, int]] = set()  # (file, size, mtime_ns) fully hashed by this process


def cache_bytes(arrays: dict[str, np.ndarray], num_features: int, teacher_top_k: int, feature_dtype: str) -> int:
    """The bytes one split of the cache takes on disk: its token arrays plus features, greedy tokens and top-k."""
    n, s = arrays["input_ids"].shape
    header = 128  # a .npy header
    total = sum(a.nbytes + header for a in arrays.values())
    total += n * s * num_features * np.dtype(feature_dtype).itemsize + header
    total += n * s * 4 + header  # target_next, int32
    if teacher_top_k:
        total += 2 * (n * s * teacher_top_k * 4 + header)  # top-k values (float32) and indices (int32)
    return int(total)


def read_manifest(path: Path) -> dict[str, Any]:
    """The cache's ``manifest.json``; unreadable or damaged is a :class:`DataError` naming it."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"offline feature cache manifest {file} is damaged ({e}); delete {path} to rebuild the cache"
        ) from None
    if not isinstance(manifest, dict):
        raise DataError(f"offline feature cache manifest {file} is not a JSON object; delete {path} to rebuild it")
    return manifest


def _sample_offsets(size: int) -> list[int]:
    if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        return list(range(0, size, SAMPLE_BLOCK_BYTES))
    last = size - SAMPLE_BLOCK_BYTES
    return [round(i * last / (SAMPLE_BLOCKS - 1)) for i in range(SAMPLE_BLOCKS)]


def _sampled_digest(file: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for offset in _sample_offsets(size):
            f.seek(offset)
            h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def _full_digest(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_checksums(file: Path) -> dict[str, Any]:
    """What the manifest records of a cache file: ``bytes``, ``sha256`` and ``sampled_sha256``."""
    size = file.stat().st_size
    return {"bytes": size, "sha256": _full_digest(file), "sampled_sha256": _sampled_digest(file, size)}


def verify_cache(path: Path, manifest: dict[str, Any], mode: str = "auto") -> str:
    """Check the cache's files against the manifest's checksums (see the module docstring); the mode used.

    Raises :class:`DataError` naming the first missing or damaged file.
    """
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise DataError(
            f"offline feature cache {path}: {MANIFEST} records no file checksums (damaged, or written "
            "by another version); delete the directory to rebuild it"
        )
    total = 0
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            raise DataError(f"offline feature cache file {file} is missing; delete {path} to rebuild the cache")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise DataError(
                f"offline feature cache file {file} is damaged: {size} bytes, the manifest recorded "
                f"{want.get('bytes')} (truncated or overwritten); delete {path} to rebuild the cache"
            )
        total += size
    full = mode == "full" or (mode == "auto" and total <= FULL_VERIFY_BYTES)
    if not full:
        log.info(
            "offline feature cache %s: %.1f GB, checked by size and sampled blocks (cache_verify='full' "
            "hashes every byte)",
            path,
            total / 1e9,
        )
    for name, want in files.items():
        file = path / name
        st = file.stat()
        if full:
            key = (str(file.resolve()), st.st_size, st.st_mtime_ns)
            if key in _VERIFIED:
                continue
            ok = _full_digest(file) == want.get("sha256")
        else:
            ok = _sampled_digest(file, st.st_size) == want.get("sampled_sha256")
        if not ok:
            raise DataError(
                f"offline feature cache file {file} is damaged: its checksum differs from the one "
                f"recorded when the cache was built; delete {path} to rebuild the cache"
            )
        if full:
            _VERIFIED.add(key)
    return "full" if full else "sampled"
