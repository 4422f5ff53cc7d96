"""Building the offline feature cache on every rank: sharded, batched, written while the next batch computes, resumable.

Contract: a build on any number of ranks, or one resumed after a kill, writes the same bytes as one uninterrupted
process (each batch is computed exactly as a one-process build computes it), and a cache is complete only once
rank 0 has hashed its files, written ``manifest.json`` (last, in the format
:mod:`~dflash2_lightning.data.feature_cache` reads) and renamed the build directory into place.

The build lives in ``.<name>.build`` beside the cache: ``build.json`` (the settings it is for; other settings
start afresh), ``<split>/*.npy`` (created at full size by rank 0, blocks reserved, so a full disk is an error and
never a ``SIGBUS``), ``done/<split>.<start>-<stop>`` (one marker per finished, synced batch) and ``lock`` (rank
0's ``flock``: a second job refuses). Batches are fixed row ranges of the cache batch size; batch ``j`` of those
left goes to rank ``j % world``. Each rank ``os.pwrite``s its rows at their offsets (no memory map to fault on)
from one writer thread fed by a bounded queue, while the main thread computes the next batch (on CUDA:
``non_blocking`` copies into pinned memory on a stream of their own). After every batch the ranks exchange
whether any failed (:class:`~dflash2_lightning.data.ranks.Ranks`): one rank's error stops them all.
What users see: docs/training.md ("Building the cache") and docs/robustness.md ("Files and disks").
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash2_lightning import files
from dflash2_lightning.data.feature_cache import MANIFEST, file_checksums
from dflash2_lightning.data.ranks import Ranks
from dflash2_lightning.data.records import DataError
from dflash2_lightning.errors import DiskFullError, UserError, disk_full_message
from dflash2_lightning.target.target import Target

log = logging.getLogger(__name__)

STATE, DONE, LOCK = "build.json", "done", "lock"
QUEUE_BATCHES = 2  # batches computed but not yet written: bounds the host memory the overlap takes


@dataclass(frozen=True)
class FeatureSpec:
    """What the cache stores per position and how it is computed."""

    layer_ids: list[int]
    teacher_top_k: int
    feature_dtype: str
    batch_size: int
    device: str | None = None
    autocast: str = "none"


@dataclass(frozen=True)
class Batch:
    """Rows ``[start, stop)`` of one split."""

    split: str
    start: int
    stop: int

    @property
    def marker(self) -> str:
        return f"{self.split}.{self.start}-{self.stop}"


def build_dir_of(path: Path) -> Path:
    """Where the cache at ``path`` is built (kept across a kill, so the next build resumes it)."""
    return path.with_name(f".{path.name}.build")


def computed_arrays(n: int, s: int, width: int, spec: FeatureSpec) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arrays the target fills for a split of ``n`` samples of ``s`` tokens: name -> (dtype, shape)."""
    out = {"features": (np.dtype(spec.feature_dtype), (n, s, width)), "target_next": (np.dtype(np.int32), (n, s))}
    if spec.teacher_top_k:
        out["teacher_topk_values"] = (np.dtype(np.float32), (n, s, spec.teacher_top_k))
        out["teacher_topk_indices"] = (np.dtype(np.int32), (n, s, spec.teacher_top_k))
    return out


# ----------------------------------------------------------------------------- the build directory (rank 0)
class BuildLock:
    """``flock`` on ``<build dir>/lock``: one job builds a cache at a time (dropped by the kernel if it dies)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self.fd: int | None = None

    def acquire(self, cache: Path) -> None:
        fd, state = files.lock_nowait(self.path)
        if state is files.Lock.HELD:
            self.fd = fd
            return
        os.close(fd)
        if state is files.Lock.BUSY:
            raise DataError(
                f"the offline feature cache {cache} is being built by another process (it holds "
                f"{self.path}): wait for it to finish, or set data cache_dir to another directory"
            )
        log.warning("%s: this file system has no flock; nothing stops a second job building the same cache", self.path)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def prepare_build(
    path: Path,
    state: dict[str, Any],
    encoded: dict[str, dict[str, np.ndarray]],
    width: int,
    spec: FeatureSpec,
    needed: int,
    lock: BuildLock,
) -> list[Batch] | None:
    """Rank 0: make the build directory ready (fresh, or resumed when it was for these settings and tokens)
    and return the batches still to compute, in order (None: another job completed the cache meanwhile)."""
    build = build_dir_of(path)
    if not build.exists():
        files.check_free_space(path.parent, needed, f"the offline feature cache {path}")  # before any byte
    build.mkdir(exist_ok=True)
    lock.acquire(path)
    if (path / MANIFEST).is_file():  # another job finished it while this one looked
        return None
    if not _resumable(build, state, encoded, width, spec):
        for entry in build.iterdir():
            if entry.name != LOCK:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        files.check_free_space(path.parent, needed, f"the offline feature cache {path}")
        for split, arrays in encoded.items():
            (build / split).mkdir()
            for name, arr in arrays.items():
                np.save(build / split / f"{name}.npy", arr)
            n, s = arrays["input_ids"].shape
            for name, (dtype, shape) in computed_arrays(n, s, width, spec).items():
                _create(build / split / f"{name}.npy", dtype, shape)
        (build / DONE).mkdir()
        files.atomic_write_text(build / STATE, json.dumps(state, indent=2, sort_keys=True) + "\n")  # last: usable
    done = {p.name for p in (build / DONE).iterdir()}
    batches = []
    for split, arrays in encoded.items():
        n = int(arrays["input_ids"].shape[0])
        covered = np.zeros(n, dtype=bool)
        for name in done:
            marked_split, _, rows = name.rpartition(".")
            if marked_split == split:
                start, stop = (int(x) for x in rows.split("-"))
                covered[start:stop] = True
        for start in range(0, n, spec.batch_size):
            stop = min(start + spec.batch_size, n)
            if not covered[start:stop].all():
                batches.append(Batch(split, start, stop))
    total = sum(-(-int(a["input_ids"].shape[0]) // spec.batch_size) for a in encoded.values())
    if batches and len(batches) < total:
        log.info(
            "offline feature cache %s: resuming a killed build, %d of %d batches already done",
            path,
            total - len(batches),
            total,
        )
    return batches


def _resumable(
    build: Path, state: dict[str, Any], encoded: dict[str, dict[str, np.ndarray]], width: int, spec: FeatureSpec
) -> bool:
    """Whether ``build`` holds a build of exactly these settings and token arrays, every file at its size."""
    try:
        if json.loads((build / STATE).read_text()) != json.loads(json.dumps(state)):
            return False
        for split, arrays in encoded.items():
            for name, arr in arrays.items():
                if not np.array_equal(np.load(build / split / f"{name}.npy", mmap_mode="r"), arr):
                    return False
            n, s = arrays["input_ids"].shape
            for name, (dtype, shape) in computed_arrays(n, s, width, spec).items():
                have = np.load(build / split / f"{name}.npy", mmap_mode="r")
                if have.dtype != dtype or have.shape != shape:
                    return False
        return (build / DONE).is_dir()
    except (OSError, ValueError):
        return False


def _create(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """A new ``.npy`` file of ``shape`` (zeros), its blocks reserved (no SIGBUS on a full disk)."""
    from numpy.lib.format import open_memmap

    array = open_memmap(path, "w+", dtype, shape)
    del array
    files.preallocate(path, path.stat().st_size)


def finish_build(path: Path, manifest: dict[str, Any], lock: BuildLock) -> None:
    """Rank 0, every batch done: hash the files, write the manifest (last) and rename the build into place."""
    build = build_dir_of(path)
    manifest = {
        **manifest,
        "files": {str(f.relative_to(build)): file_checksums(f) for f in sorted(build.glob("*/*.npy"))},
    }
    shutil.rmtree(build / DONE)
    (build / STATE).unlink()
    (build / LOCK).unlink(missing_ok=True)  # still held through the open descriptor until the rename
    (build / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks the cache complete
    os.chmod(build, files.dir_mode())
    try:
        os.rename(build, path)
    except OSError:
        if not (path / MANIFEST).is_file():  # not another process finishing first: a real error
            raise
        shutil.rmtree(build, ignore_errors=True)
    finally:
        lock.release()


# ----------------------------------------------------------------------------- writing rows
class RowWriter:
    """One thread that waits for a batch's device-to-host copy, writes its rows into the split's files at their
    offsets, syncs them and marks the batch done; fed by a bounded queue so the next batch computes meanwhile.

    An error in the thread is kept and raised by :meth:`check` (the main thread calls it every batch).
    """

    def __init__(self, build: Path, feature_dtype: str) -> None:
        self.build, self.feature_dtype = build, feature_dtype
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
        self.error: BaseException | None = None
        self._fds: dict[tuple[str, str], tuple[int, int, int]] = {}  # (split, name) -> (fd, data offset, row bytes)
        self.thread = threading.Thread(target=self._run, name="feature-cache-writer", daemon=True)
        self.thread.start()

    def put(self, batch: Batch, length: int, host: dict[str, torch.Tensor], ready: Any) -> None:
        """Queue a computed batch (``host``: arrays on the CPU once ``ready``, a CUDA event or None)."""
        self.check()
        self.queue.put((batch, length, host, ready))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Write what is queued, stop the thread, close the files; raise the thread's error if it had one."""
        self.queue.put(None)
        self.thread.join()
        for fd, _, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.check()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain: the main thread raises the error
            try:
                self._write(*item)
            except BaseException as error:  # kept for the main thread; the thread itself must not die silently
                self.error = error

    def _file(self, split: str, name: str) -> tuple[int, int, int]:
        key = (split, name)
        if key not in self._fds:
            path = self.build / split / f"{name}.npy"
            array = np.load(path, mmap_mode="r")  # only to read the header: where the data starts, its row size
            offset, row = int(array.offset), int(array[0].nbytes) if array.shape[0] else 0
            del array
            self._fds[key] = (os.open(path, os.O_RDWR | os.O_CLOEXEC), offset, row)
        return self._fds[key]

    def _write(self, batch: Batch, length: int, host: dict[str, torch.Tensor], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()
        finite, amax = bool(host.pop("finite")), float(host.pop("amax"))
        if not finite:
            raise DataError(
                f"target features overflow {self.feature_dtype} (max |x| = {amax:.3g}); set feature_dtype='float32'"
            )
        touched = []
        for name, tensor in host.items():
            fd, offset, row = self._file(batch.split, name)
            values = tensor.numpy()
            valid = values[0].nbytes if len(values) else 0
            zeros = bytes(row - valid)  # positions past the batch's longest sample are zero
            for i, r in enumerate(range(batch.start, batch.stop)):
                _pwrite_all(fd, np.ascontiguousarray(values[i]).data.cast("B"), offset + r * row)
                if zeros:
                    _pwrite_all(fd, zeros, offset + r * row + valid)
            touched.append(fd)
        for fd in touched:
            os.fdatasync(fd)
        (self.build / DONE / batch.marker).touch()  # after the rows are on disk: a marker never lies


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# ----------------------------------------------------------------------------- computing a shard
def compute_shard(tgt: Target, build: Path, batches: list[Batch], spec: FeatureSpec, ranks: Ranks) -> None:
    """Compute this rank's batches (every ``world``-th of ``batches``) and write them; collective.

    Every rank takes the same number of steps (a rank out of batches just exchanges), so a failure anywhere is
    seen by all at the next exchange. A sharded target's forward is itself a collective (every layer gathered
    from every rank): there a rank out of batches runs a one-token forward whose result is dropped.
    """
    from tqdm.auto import tqdm

    mine = batches[ranks.rank :: ranks.world]
    steps = -(-len(batches) // ranks.world)
    device = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokens: dict[str, dict[str, np.ndarray]] = {}
    writer: RowWriter | None = None
    home = tgt.device
    copier = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start() -> None:
        nonlocal writer
        writer = RowWriter(build, spec.feature_dtype)
        if not tgt.sharded:  # a sharded one was loaded on the rank's device
            tgt.to(device)
        for split in {b.split for b in mine}:
            tokens[split] = {
                name: np.load(build / split / f"{name}.npy", mmap_mode="r") for name in ("input_ids", "attention_mask")
            }

    def step(i: int) -> None:
        assert writer is not None
        writer.check()
        if i < len(mine):
            batch = mine[i]
            length, host, ready = _compute(tgt, tokens[batch.split], batch, spec, device, copier)
            writer.put(batch, length, host, ready)
        elif tgt.sharded:
            _idle_forward(tgt, spec, device)

    def stop() -> None:
        if writer is not None:
            writer.close()

    try:
        ranks.agree(start)
        progress = tqdm(range(steps), desc=f"target features (rank {ranks.rank} of {ranks.world})", unit="batch")
        for i in progress:
            ranks.agree(partial(step, i))
        ranks.agree(stop)
    finally:
        if writer is not None and writer.thread.is_alive():
            _close_quietly(writer)
        if not tgt.sharded:
            tgt.to(home)


def _close_quietly(writer: RowWriter) -> None:
    """On the way out of a failed build: let the writer finish what is queued (finished batches keep their
    markers for the resume) without raising over the error being reported."""
    try:
        writer.close()
    except BaseException:  # the build's own error is the one to report
        pass


@torch.no_grad()
def _idle_forward(tgt: Target, spec: FeatureSpec, device: torch.device) -> None:
    """The forward of a rank with no batch left, while the others compute theirs: one token, the same call (and
    so the same collectives) as :func:`_compute`'s, the result dropped."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with _target_autocast(spec, device):
        tgt.features(ids, torch.ones_like(ids), spec.layer_ids)


def _target_autocast(spec: FeatureSpec, device: torch.device) -> torch.autocast:
    """The autocast the target's forward runs under: bf16 with ``feature_autocast: bf16``, else none."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.autocast == "bf16")


@torch.no_grad()
def _compute(
    tgt: Target, tokens: dict[str, np.ndarray], batch: Batch, spec: FeatureSpec, device: torch.device, copier: Any
) -> tuple[int, dict[str, torch.Tensor], Any]:
    """One batch through the target: its longest sample's length, the arrays to write, a copy-done event."""
    attn = np.asarray(tokens["attention_mask"][batch.start : batch.stop])
    length = max(int(attn.sum(1).max()), 1)  # right padding: positions past it never matter
    ids = torch.from_numpy(np.array(tokens["input_ids"][batch.start : batch.stop, :length])).long()
    am = torch.from_numpy(np.array(attn[:, :length])).to(device)
    with _target_autocast(spec, device):
        res = tgt.features(ids.to(device), am, spec.layer_ids)
    logits = res.logits
    if logits is None:  # features() returns them unless asked not to
        raise RuntimeError("the target's features came without logits: the feature cache needs them")
    # Converted on the device, so the host only copies and writes. Multiplying by the mask (not masked_fill)
    # keeps the one-process build's bytes, signed zeros included.
    out = {
        "features": (res.features * am.unsqueeze(-1)).to(getattr(torch, spec.feature_dtype)),
        "target_next": (logits.max(-1).indices * am).to(torch.int32),
    }  # = argmax (first max), faster on CPU
    if spec.teacher_top_k:
        values, indices = logits.float().topk(spec.teacher_top_k, dim=-1)
        out["teacher_topk_values"], out["teacher_topk_indices"] = values, indices.to(torch.int32)
    out["finite"] = torch.isfinite(out["features"]).all()
    low, high = torch.aminmax(res.features)  # for the overflow message; no |x| copy of the features
    out["amax"] = torch.maximum(low.abs(), high.abs()).float()
    if copier is None:
        return length, out, None
    copier.wait_stream(torch.cuda.current_stream(device))
    host = {}
    with torch.cuda.stream(copier):
        for name, tensor in out.items():
            host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host[name].copy_(tensor, non_blocking=True)
            tensor.record_stream(copier)  # the compute stream may reuse its memory only after the copy
        ready = torch.cuda.Event()
        ready.record(copier)
    return length, host, ready


# ----------------------------------------------------------------------------- the whole build
def build_feature_cache(
    path: Path,
    manifest: dict[str, Any],
    tgt: Target,
    spec: FeatureSpec,
    encode: Callable[[], dict[str, dict[str, np.ndarray]]],
    needed: Callable[[dict[str, dict[str, np.ndarray]]], int],
    stats: Callable[[dict[str, dict[str, np.ndarray]]], dict[str, Any]],
    ranks: Ranks | None = None,
) -> bool:
    """Build the cache at ``path`` on every rank of the job (collective); True once it is complete.

    Rank 0 tokenises (``encode``), checks the disk has ``needed(encoded)`` bytes, prepares the build directory and
    records ``stats(encoded)`` in the manifest's ``info``; every rank computes its shard; rank 0 finishes.
    Returns False (building nothing) when rank 0 finds the cache already complete.
    """
    ranks = ranks or Ranks()
    lock = BuildLock(build_dir_of(path))
    width = len(spec.layer_ids) * tgt.hidden_size
    checked = {k: v for k, v in manifest.items() if k not in ("info", "files")}
    state = {"manifest": checked, "width": width}

    def prepare() -> dict[str, Any]:
        if (path / MANIFEST).is_file():
            return {"complete": True}
        if path.exists() and any(path.iterdir()):
            raise DataError(
                f"cache_dir={str(path)!r} exists, is not empty and has no {MANIFEST}: "
                "not a feature cache (a complete cache always has one); choose another directory"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        files.remove_stale(path.parent, path.name)  # what an older version's killed build left behind
        encoded = encode()
        size = needed(encoded)
        free = files.free_bytes(path.parent)
        try:
            batches = prepare_build(path, state, encoded, width, spec, size, lock)
        except Exception as error:  # numpy reports a full disk in its own words: say it in ours
            if not isinstance(error, UserError) and files.is_disk_full(error, path.parent):
                raise DiskFullError(disk_full_message(f"the offline feature cache {path}", size, free)) from error
            raise
        if batches is None:
            return {"complete": True}
        manifest["info"]["stats"] = stats(encoded)
        return {"complete": False, "batches": batches, "state": state}

    try:
        plan = ranks.agree(lambda: prepare() if ranks.rank == 0 else None, share=True)
        if plan is None:  # share=True: every rank gets rank 0's plan, and prepare() always makes one
            raise RuntimeError("the feature cache build got no plan from rank 0")
        if plan["complete"]:
            return False
        build = build_dir_of(path)

        def visible() -> None:  # every rank writes into the same files: they must see the same directory
            if json.loads((build / STATE).read_text()) != json.loads(json.dumps(plan["state"])):
                raise FileNotFoundError

        ranks.agree(_named(visible, build))
        compute_shard(tgt, build, plan["batches"], spec, ranks)
        ranks.agree(lambda: finish_build(path, manifest, lock) if ranks.rank == 0 else None)
        return True
    finally:
        lock.release()
        ranks.close()


def _named(check: Callable[[], None], build: Path) -> Callable[[], None]:
    """``check``, with a missing build directory reported as a shared-file-system problem."""

    def run() -> None:
        try:
            check()
        except (OSError, ValueError):
            raise DataError(
                f"this rank cannot see {build}, which rank 0 created: the offline feature cache must "
                "be on a file system every rank sees (set data cache_dir to a shared disk)"
            ) from None

    return run
