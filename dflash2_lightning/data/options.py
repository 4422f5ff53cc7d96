"""The data module's settings group for offline training: the feature cache and how it is built.

``DraftDataModule(offline=OfflineOptions(...))``; in a config, ``data.init_args.offline.cache_dir: ...``. Each
value is checked when the group is made (``__post_init__``), before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash2_lightning.errors import check


@dataclass(frozen=True)
class OfflineOptions:
    """Where the offline feature cache lives, what it stores and how it is built and checked (``mode: offline``).

    Args:
        cache_dir: the cache directory, on a file system every rank sees, with room for the cache (refused up
            front otherwise; a real target's cache is terabytes). ``None``: a directory named by a hash of the
            manifest under ``$DFLASH2_CACHE`` or ``~/.cache/dflash2-lightning/features``. A killed build resumes
            from ``.<name>.build`` beside it.
        cache_batch_size: samples per target forward while the cache is built, on each rank (every rank computes
            its share of the batches; the target's logits for a batch take ``cache_batch_size * seq_len * vocab``
            elements). A build on any number of ranks writes the same bytes as a one-process build with the same
            ``cache_batch_size``.
        cache_verify: how a cache is checked when opened: ``"auto"``, ``"full"`` or ``"sampled"`` (every byte up
            to 4 GiB, sampled blocks above: :mod:`dflash2_lightning.data.feature_cache`).
        feature_dtype: on-disk dtype of the features, ``float16`` (default) or ``float32``.
        feature_device: device that computes the features (default: ``cuda`` when available, else ``cpu``).
        feature_autocast: ``"bf16"`` computes the features and target logits under bfloat16 autocast (faster on a
            CPU with AMX, the target's matmuls rounded to bf16 as ``bf16-mixed`` training rounds the draft's);
            ``"none"`` (default) in the target's own dtype.
        teacher_top_k: store the target's top-k logits per position for distillation (0: don't).
    """

    cache_dir: str | None = None
    cache_batch_size: int = 8
    cache_verify: Literal["auto", "full", "sampled"] = "auto"
    feature_dtype: Literal["float16", "float32"] = "float16"
    feature_device: str | None = None
    feature_autocast: Literal["none", "bf16"] = "none"
    teacher_top_k: int = 0

    def __post_init__(self) -> None:
        check(
            isinstance(self.cache_batch_size, int) and self.cache_batch_size >= 1,
            "offline.cache_batch_size",
            self.cache_batch_size,
            ">= 1",
        )
        check(
            self.cache_verify in ("auto", "full", "sampled"),
            "offline.cache_verify",
            self.cache_verify,
            "'auto', 'full' or 'sampled'",
        )
        check(
            self.feature_dtype in ("float16", "float32"),
            "offline.feature_dtype",
            self.feature_dtype,
            "'float16' or 'float32'",
        )
        check(
            self.feature_autocast in ("none", "bf16"),
            "offline.feature_autocast",
            self.feature_autocast,
            "'none' or 'bf16'",
        )
        check(self.teacher_top_k >= 0, "offline.teacher_top_k", self.teacher_top_k, ">= 0")
