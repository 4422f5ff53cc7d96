"""`DraftDataModule`: jsonl text / chat data, loss masks, and the offline target-feature cache.

Data files are jsonl records of text, chat or ShareGPT samples (:mod:`dflash2_lightning.data.records`),
tokenised with the target's chat template (:mod:`dflash2_lightning.data.encode`).
Each sample is cut (truncated) or right-padded to ``seq_len``. Batches are dicts:

- ``input_ids [B,S] long``, ``loss_mask [B,S] bool`` (supervised positions), ``attention_mask [B,S] bool``;
- offline mode adds ``features [B,S,n_t*H]`` (in the target's dtype; zero at padding),
  ``target_next [B,S] long`` (argmax of the target's logits at s: its greedy guess for token s+1)
  and, with ``teacher_top_k > 0``, ``teacher_topk_values [B,S,k] float32`` /
  ``teacher_topk_indices [B,S,k] long`` (the target's top-k logits).

Offline, the features come from :mod:`dflash2_lightning.data.feature_cache` (computed once, memory-mapped,
checked against a manifest when opened).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from dflash2_lightning.action_options import as_options
from dflash2_lightning.data.cache_build import FeatureSpec, build_feature_cache
from dflash2_lightning.data.encode import encode_split
from dflash2_lightning.data.feature_cache import CACHE_FORMAT, cache_bytes, read_manifest, verify_cache
from dflash2_lightning.data.options import OfflineOptions
from dflash2_lightning.data.order import ResumableLoader, ResumableOrder
from dflash2_lightning.data.records import SPLIT_RULE, DataError, Split, read_jsonl, validation_split
from dflash2_lightning.data.workers import fork_deadlock_risk
from dflash2_lightning.errors import check
from dflash2_lightning.target.corpus import builtin_corpus, builtin_fingerprint
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetSpec, default_cache_dir
from dflash2_lightning.target.target import Target, tokenizer_fingerprint

log = logging.getLogger(__name__)


class ArrayDataset(Dataset):
    """Rows of named arrays (in memory or ``.npy`` files opened memory-mapped, lazily per process)."""

    LONG = ("input_ids", "target_next", "teacher_topk_indices")
    BOOL = ("loss_mask", "attention_mask")

    def __init__(self, arrays: Mapping[str, np.ndarray | Path], feature_dtype: torch.dtype = torch.float32) -> None:
        self.sources = arrays
        self.feature_dtype = feature_dtype
        self._open: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the memmaps themselves
        return {**self.__dict__, "_open": {}}

    def array(self, name: str) -> np.ndarray:
        if name not in self._open:
            src = self.sources[name]
            self._open[name] = np.load(src, mmap_mode="r") if isinstance(src, Path) else src
        return self._open[name]

    def __len__(self) -> int:
        return int(self.array("input_ids").shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.sources:
            t = torch.from_numpy(np.array(self.array(name)[i]))
            if name in self.LONG:
                t = t.long()
            elif name in self.BOOL:
                t = t.bool()
            elif name == "features":
                t = t.to(self.feature_dtype)
            else:
                t = t.float()
            out[name] = t
        return out


class DraftDataModule(pl.LightningDataModule):
    """Training data for a draft: tokenised samples and, offline, the target's features and logits.

    Args:
        target: the frozen target (its tokenizer renders and tokenises; offline, it computes features).
        train_files: jsonl files; ``None`` uses the built-in corpus (:mod:`dflash2_lightning.target.corpus`).
        val_files: jsonl files; ``None`` holds out ``val_fraction`` of the training records, whole prompts
            at a time (every response to a held-out prompt; a fixed permutation, so the split is the same
            every run): validation then measures prompts the draft has not trained on.
        val_fraction: share of training records held out when ``val_files`` is None (0 disables validation;
            rounded up to whole prompts).
        seq_len: tokens per sample (cut or padded); a multiple of ``block_size``.
        block_size: the draft's block size (linked from the model by the trainer).
        batch_size: samples per training and validation batch.
        mode: ``online`` (the LightningModule runs the target) or ``offline`` (features from the cache).
        target_layer_ids: target layers whose outputs are the draft's features; ``None``: the DFlash
            rule for ``num_draft_layers``.
        num_draft_layers: draft depth, used only to default ``target_layer_ids``.
        num_workers: DataLoader worker processes.
        max_samples: read at most this many records from the training files (and from ``val_files``).
        offline: the feature cache's settings (``mode: offline``): :class:`~dflash2_lightning.data.options.OfflineOptions`.
    """

    def __init__(
        self,
        target: TargetSpec,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        val_fraction: float = 0.05,
        seq_len: int = 256,
        block_size: int = 16,
        batch_size: int = 8,
        mode: Literal["online", "offline"] = "online",
        target_layer_ids: list[int] | None = None,
        num_draft_layers: int = 1,
        num_workers: int = 0,
        max_samples: int | None = None,
        shuffle_seed: int = 0,
        offline: OfflineOptions = OfflineOptions(),
    ) -> None:
        super().__init__()
        if hasattr(target, "as_dict"):  # a jsonargparse Namespace, e.g. through a linked argument
            target = target.as_dict()
        check(
            isinstance(target, (TargetSpec, dict)),
            "target",
            target,
            "a TargetSpec (path, gguf or tiny); the data needs the target's tokenizer",
        )
        self.target = target if isinstance(target, TargetSpec) else TargetSpec(**target)
        check(block_size >= 1, "block_size", block_size, ">= 1")
        check(
            seq_len >= 1 and seq_len % block_size == 0,
            "seq_len",
            seq_len,
            f"a positive multiple of block_size={block_size}",
        )
        check(0.0 <= val_fraction < 1.0, "val_fraction", val_fraction, "0 <= val_fraction < 1")
        check(batch_size >= 1, "batch_size", batch_size, ">= 1")
        check(mode in ("online", "offline"), "mode", mode, "'online' or 'offline'")
        check(num_draft_layers >= 1, "num_draft_layers", num_draft_layers, ">= 1")
        check(num_workers >= 0, "num_workers", num_workers, ">= 0")
        check(max_samples is None or max_samples >= 1, "max_samples", max_samples, "None or >= 1")
        offline = as_options(offline, OfflineOptions)  # the group checked its own ranges when it was made
        self.offline = offline
        for name, paths in (("train_files", train_files), ("val_files", val_files)):
            check(
                paths is None or (isinstance(paths, list) and len(paths) > 0),
                name,
                paths,
                "None or a non-empty list of jsonl paths",
            )
        self.train_files, self.val_files = train_files, val_files
        self.val_fraction, self.seq_len, self.block_size, self.batch_size = (
            val_fraction,
            seq_len,
            block_size,
            batch_size,
        )
        self.mode, self.target_layer_ids = mode, target_layer_ids
        self.num_draft_layers, self.num_workers = num_draft_layers, num_workers
        self.max_samples, self.shuffle_seed = max_samples, shuffle_seed
        # the group's settings, read where the cache is built and opened
        self.cache_dir, self.cache_batch_size, self.cache_verify = (
            offline.cache_dir,
            offline.cache_batch_size,
            offline.cache_verify,
        )
        self.feature_dtype, self.feature_device, self.feature_autocast = (
            offline.feature_dtype,
            offline.feature_device,
            offline.feature_autocast,
        )
        self.teacher_top_k = offline.teacher_top_k
        self._resume_position: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint
        self.save_hyperparameters(ignore=["target"])
        self.hparams["target"] = dataclasses.asdict(self.target)  # a plain dict keeps hparams.yaml readable
        self.hparams["offline"] = dataclasses.asdict(offline)
        self.skipped_samples = 0
        self.cut_samples = 0
        self.total_records = 0
        self.split: Split | None = (
            None  # the validation split of the last read (records.Split), when it holds out by prompt
        )
        self.split_records: dict[str, tuple[int, int]] = {}  # split -> (records, skipped) of the last encode
        self.train_dataset: ArrayDataset | None = None
        self.val_dataset: ArrayDataset | None = None

    # ------------------------------------------------------------------ target-derived
    @property
    def target_model(self) -> Target:
        """The shared (memoised) :class:`Target` instance."""
        return load_target(self.target)

    @property
    def layer_ids(self) -> list[int]:
        """The feature layer ids in use: ``target_layer_ids`` or the DFlash default for ``num_draft_layers``."""
        tgt = self.target_model
        ids = (
            self.target_layer_ids if self.target_layer_ids is not None else tgt.default_layer_ids(self.num_draft_layers)
        )
        return tgt.check_layer_ids(ids)

    # ------------------------------------------------------------------ records
    def _records(self) -> dict[str, list[tuple[str, Any]]]:
        def read(files: list[str]) -> list[tuple[str, Any]]:
            out: list[tuple[str, Any]] = []
            for path in files:
                for item in read_jsonl(path):
                    if self.max_samples is not None and len(out) >= self.max_samples:
                        return out
                    out.append(item)
            return out

        if self.train_files is None:
            train = [(f"<builtin>:{i + 1}", r) for i, r in enumerate(builtin_corpus())]
            train = train[: self.max_samples] if self.max_samples else train
        else:
            train = read(self.train_files)
        if self.val_files is not None:
            self.split = None
            return {"train": train, "val": read(self.val_files)}
        self.split = validation_split(train, self.val_fraction)
        held = self.split.held
        return {
            "train": [r for i, r in enumerate(train) if i not in held],
            "val": [r for i, r in enumerate(train) if i in held],
        }

    def _encode(self) -> dict[str, dict[str, np.ndarray]]:
        tok = self.target_model.tokenizer
        max_pos = getattr(self.target_model.config, "max_position_embeddings", None)
        check(
            max_pos is None or self.seq_len <= max_pos,
            "seq_len",
            self.seq_len,
            f"<= the target's max_position_embeddings={max_pos}",
        )
        out, skipped, total, cut = {}, [], 0, 0
        self.split_records = {}
        for split, records in self._records().items():
            encoded = encode_split(tok, records, self.seq_len)
            out[split] = encoded.arrays
            skipped += encoded.skipped
            cut += encoded.cut
            total += len(records)
            self.split_records[split] = (len(records), len(encoded.skipped))
        self.total_records = total
        self._set_skipped(len(skipped), total, skipped, cut)
        rank_zero_info(self.describe_data(out))
        return out

    def describe_data(self, encoded: dict[str, dict[str, np.ndarray]]) -> str:
        """The one line saying what the data came to: samples per split, the split, samples cut to ``seq_len``."""
        sizes = {split: int(arrays["input_ids"].shape[0]) for split, arrays in encoded.items()}
        text = (
            f"data: {sizes.get('train', 0)} training and {sizes.get('val', 0)} validation samples from "
            f"{self.total_records} records"
        )
        if self.split is not None and self.split.requested:
            text += (
                f"; validation split by prompt: {len(self.split.held)} of {self.split.records} records held out "
                f"({self.split.held_prompts} of {self.split.prompts} prompts)"
            )
        if self.cut_samples:
            text += f"; {self.cut_samples} samples longer than seq_len={self.seq_len} tokens were cut to it"
        return text

    def _set_skipped(self, skipped: int, total: int, where: list[str] | None = None, cut: int = 0) -> None:
        self.skipped_samples = skipped
        self.cut_samples = cut
        if skipped:
            first = f": {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}" if where else ""
            log.warning(
                "skipped %d of %d samples with no supervised token (no assistant tokens within seq_len=%d, or empty)%s",
                skipped,
                total,
                self.seq_len,
                first,
            )

    # ------------------------------------------------------------------ offline cache
    def _data_fingerprint(self) -> dict[str, Any]:
        def digests(paths: list[str] | None) -> list[str] | str | None:
            if paths is None:
                return None
            return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]

        return {
            "train": digests(self.train_files) if self.train_files is not None else f"builtin:{builtin_fingerprint()}",
            "val": digests(self.val_files),
            "val_fraction": self.val_fraction if self.val_files is None else None,
            **({"split": SPLIT_RULE} if self.val_files is None and self.val_fraction > 0 else {}),
            "max_samples": self.max_samples,
        }

    def manifest(self) -> dict[str, Any]:
        """The fields an offline cache must match (plus ``info``, which is recorded but not compared)."""
        tgt = self.target_model
        return {
            "format": CACHE_FORMAT,
            "target_fingerprint": tgt.fingerprint(),
            "tokenizer_fingerprint": tokenizer_fingerprint(tgt.tokenizer),
            "target_layer_ids": self.layer_ids,
            "seq_len": self.seq_len,
            "teacher_top_k": self.teacher_top_k,
            "feature_dtype": self.feature_dtype,
            # only when set: caches built before the option keep their names
            **({"feature_autocast": self.feature_autocast} if self.feature_autocast != "none" else {}),
            "data": self._data_fingerprint(),
            "info": {
                "target": dataclasses.asdict(self.target),
                "train_files": self.train_files,
                "val_files": self.val_files,
            },
        }

    def cache_path(self, manifest: dict[str, Any] | None = None) -> Path:
        """The offline cache directory (``cache_dir``, or a manifest-hash-named one in the default cache)."""
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        manifest = manifest or self.manifest()
        checked = {k: v for k, v in manifest.items() if k not in ("info", "files")}
        digest = hashlib.sha256(json.dumps(checked, sort_keys=True).encode()).hexdigest()[:16]
        return default_cache_dir() / "features" / digest

    def _check_manifest(self, path: Path, want: dict[str, Any]) -> dict[str, Any]:
        have = read_manifest(path)
        diffs = [
            f"{k}: cache has {have.get(k)!r}, this run has {v!r}"
            for k, v in want.items()
            if k not in ("info", "files") and have.get(k) != v
        ]
        if diffs:
            raise DataError(
                f"offline feature cache {path} was built for different settings — "
                + "; ".join(diffs)
                + f". Delete {path} to rebuild it, or set data cache_dir to another directory."
            )
        return have

    def build_cache(self) -> Path:
        """Make sure a matching offline cache exists (compute it if missing); return its directory.

        Collective under ``torch.distributed``: every rank calls it, computes its share of the batches and
        returns once the cache is complete (:mod:`dflash2_lightning.data.cache_build`); a failure on any rank
        raises on every rank with that rank's message.
        """
        want = self.manifest()
        path = self.cache_path(want)
        spec = FeatureSpec(
            self.layer_ids,
            self.teacher_top_k,
            self.feature_dtype,
            self.cache_batch_size,
            self.feature_device,
            self.feature_autocast,
        )
        width = len(spec.layer_ids) * self.target_model.hidden_size

        def needed(encoded: dict[str, dict[str, np.ndarray]]) -> int:
            return sum(cache_bytes(a, width, self.teacher_top_k, self.feature_dtype) for a in encoded.values())

        def stats(encoded: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
            return {
                **{f"{split}_samples": int(a["input_ids"].shape[0]) for split, a in encoded.items()},
                "skipped_samples": self.skipped_samples,
                "cut_samples": self.cut_samples,
                "total_records": self.total_records,
            }

        build_feature_cache(path, want, self.target_model, spec, self._encode, needed, stats)
        self._check_manifest(path, want)
        return path

    def _load_cache(self, path: Path) -> dict[str, ArrayDataset]:
        manifest = read_manifest(path)
        verify_cache(path, manifest, self.cache_verify)
        stats = manifest.get("info", {}).get("stats", {})
        self._set_skipped(
            int(stats.get("skipped_samples", 0)),
            int(stats.get("total_records", 0)),
            cut=int(stats.get("cut_samples", 0)),
        )
        dtype = self.target_model.dtype
        return {
            split: ArrayDataset({f.stem: f for f in sorted((path / split).glob("*.npy"))}, dtype)
            for split in ("train", "val")
        }

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Offline mode, one process: compute the feature cache, or check the existing one.

        Under ``torch.distributed`` Lightning calls this on one rank per node while the others wait; the cache
        is built in :meth:`setup` instead, where every rank takes its share.
        """
        if self.mode == "offline" and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            self.build_cache()

    def setup(self, stage: str | None = None) -> None:
        """Tokenise (online) or open the memory-mapped cache (offline, building it on every rank if missing)."""
        if self.train_dataset is not None:
            return
        risk = fork_deadlock_risk() if self.num_workers > 0 else None
        if risk is not None:
            rank_zero_warn(f"warning: [data] num_workers={self.num_workers}: {risk}")
        if self.mode == "offline":
            datasets = self._load_cache(self.build_cache())
        else:
            datasets = {split: ArrayDataset(arrays) for split, arrays in self._encode().items()}
        self.train_dataset, self.val_dataset = datasets["train"], datasets["val"]
        if len(self.train_dataset) == 0:
            raise DataError(self._no_training_samples())

    def _no_training_samples(self) -> str:
        """Why no training sample is left: what was read, held out and skipped, and what to do."""
        where = ", ".join(map(str, self.train_files)) if self.train_files is not None else "the built-in corpus"
        if not self.split_records:  # opened from an offline cache: only its recorded counts are known
            return (
                f"no training samples in the offline feature cache ({self.total_records} records when it was "
                f"built, {self.skipped_samples} skipped); rebuild it from data with usable training records"
            )
        records, skipped = self.split_records.get("train", (0, 0))
        held = len(self.split.held) if self.split is not None else 0
        if records + held == 0:
            return f"no training samples: {where} holds no records; give data files with one JSON record per line"
        parts = [f"{records + held} records read from {where}"]
        if held:
            parts.append(f"{held} held out for validation")
        if skipped:
            parts.append(
                f"{skipped} of the remaining {records} skipped: no supervised token within "
                f"seq_len={self.seq_len} (no assistant turn, or it starts after seq_len tokens)"
            )
        return (
            "no training samples left: " + ", ".join(parts) + "; give more data, raise seq_len, or set "
            "val_fraction=0 / val_files"
        )

    def _loader(self, dataset: ArrayDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("DraftDataModule.setup() has not run")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Training batches in a seeded per-epoch order that a resumed run continues exactly."""
        if self.train_dataset is None:
            raise RuntimeError("DraftDataModule.setup() has not run")
        trainer = self.trainer
        order = ResumableOrder(
            len(self.train_dataset),
            self.shuffle_seed,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )
        if self._resume_position is not None:
            order.resume(*self._resume_position, batch_size=self.batch_size)
            self._resume_position = None
        return ResumableLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=order,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def state_dict(self) -> dict[str, int]:
        """Where training stands in the data (saved in every Lightning checkpoint)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        loop = trainer.fit_loop
        # Lightning's typing: _Progress.current is declared a _ReadyCompletedTracker, but these progresses hold
        # the _ProcessedTracker subclass (Lightning's own loops read .processed from them too).
        return {
            "epoch": loop.epoch_progress.current.processed,  # type: ignore[attr-defined]
            "batches": loop.epoch_loop.batch_progress.current.processed,  # type: ignore[attr-defined]
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the training order after the batches a checkpoint already trained on."""
        if state:
            self._resume_position = (int(state["epoch"]), int(state["batches"]))

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)
