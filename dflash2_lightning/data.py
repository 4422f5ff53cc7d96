"""`DraftDataModule`: jsonl text / chat data, loss masks, and the offline target-feature cache.

Data files are jsonl, one sample per line, in any of three shapes:

- ``{"text": "..."}``: plain text, every token supervised;
- ``{"messages": [{"role": "user", "content": "..."}, ...]}``: chat, rendered with the tokenizer's
  chat template; only assistant turns (content + end-of-turn token) are supervised;
- ``{"conversations": [{"from": "human", "value": "..."}, ...]}``: ShareGPT, mapped onto ``messages``.

Each sample is cut (truncated) or right-padded to ``seq_len``. Batches are dicts:

- ``input_ids [B,S] long``, ``loss_mask [B,S] bool`` (supervised positions), ``attention_mask [B,S] bool``;
- offline mode adds ``features [B,S,n_t*H]`` (in the target's dtype; zero at padding),
  ``target_next [B,S] long`` (argmax of the target's logits at s: its greedy guess for token s+1)
  and, with ``teacher_top_k > 0``, ``teacher_topk_values [B,S,k] float32`` /
  ``teacher_topk_indices [B,S,k] long`` (the target's top-k logits).

Offline features are computed once into a directory of ``.npy`` files loaded memory-mapped. Features
are stored as ``float16`` by default (half the disk; an overflow is an error that says to use
``feature_dtype="float32"``), ``target_next`` / top-k indices as int32, top-k values as float32.
The directory holds a ``manifest.json`` recording the target fingerprint, tokenizer, layer ids,
``seq_len``, top-k, storage dtype and a hash of the data; it is written into a temporary directory and
renamed into place, so a crash never leaves a complete-looking cache, and a cache whose manifest differs
from the current run is an error naming the fields that differ.

Integrity. The manifest records, for every ``.npy`` file, its size, its sha256 and the sha256 of 64
sampled 64 KiB blocks (the first one holds the ``.npy`` header, the last one the end of the data).
Opening the cache checks every file is there with its recorded size, then (``cache_verify``):

- ``"full"``: the sha256 of every byte, once per process for a given file (size, mtime);
- ``"sampled"``: the sampled blocks only (milliseconds whatever the size);
- ``"auto"`` (default): full when the cache holds at most :data:`FULL_VERIFY_BYTES` (4 GiB), sampled above.

Why: sha256 runs at 0.5-1 GB/s on one core (``benchmarks/bench_cache_verify.py``: a 316 MB cache in
0.31-0.57 s on a loaded 2-core machine, load average 5-10; the sampled check 3-8 ms), so a cache of a
few GB is verified completely in seconds, which training on a corrupted cache is worth. A real target's cache is
terabytes (Qwen3-8B, 5 layers, 100k x 2048 tokens in float16 is ~8 TB): hashing it at every start
would take hours, so it gets the size check (truncation, a missing file) plus the sampled blocks
(a damaged header, damage that hits a sampled block); ``cache_verify: full`` forces the whole check.
A damaged file is a :class:`DataError` naming the file and saying to rebuild the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dflash2_lightning import tempfiles
from dflash2_lightning.checkpoint import dir_mode
from dflash2_lightning.config import ConfigError
from dflash2_lightning.corpus import builtin_corpus, builtin_fingerprint
from dflash2_lightning.sampler import ResumableOrder
from dflash2_lightning.target import Target, TargetSpec, default_cache_dir, load_target, tokenizer_fingerprint

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: the manifest records a checksum of every file
MANIFEST = "manifest.json"
FULL_VERIFY_BYTES = 4 << 30  # cache_verify="auto": hash every byte up to this cache size
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 64 << 10
_VERIFIED: set[tuple[str, int, int]] = set()  # (file, size, mtime_ns) fully hashed by this process
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "function": "tool", "observation": "tool"}
SPLIT_SEED = 0  # the held-out validation split is a fixed permutation of the training records' prompts
SPLIT_RULE = "by_prompt"  # recorded in the cache manifest: caches split by record before it are rebuilt


class DataError(ValueError):
    """Bad data: the message names the file and line (or the cache directory and field)."""


# ---------------------------------------------------------------------- reading records
def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", record)`` for each non-blank line; a malformed line raises :class:`DataError`.

    A missing or unreadable file, bytes that are not UTF-8 and invalid JSON are errors naming the file,
    the line and the column.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist; check the path (train_files / val_files / --prompts)") from None
    except IsADirectoryError:
        raise DataError(f"data file {path} is a directory: give jsonl files (one JSON object per line)") from None
    except PermissionError:
        raise DataError(f"data file {path} is not readable (permission denied)") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                "save the file as UTF-8") from None
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                at = "at the end of the line" if e.pos >= len(line) else f"at column {e.colno}"
                raise DataError(f"{where}: invalid JSON ({e.msg} {at}); fix or remove that line") from None
            yield where, record


def parse_record(record: Any, where: str) -> str | list[dict[str, str]]:
    """A record's text (``str``) or its chat messages (``[{"role", "content"}]``), validated."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'text', 'messages' or 'conversations', "
                        f"got {type(record).__name__}")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' must be a string, got {type(record['text']).__name__}")
        return record["text"]
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise DataError(f"{where}: expected a key 'text', 'messages' or 'conversations', got {sorted(record)}")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: '{'messages' if role_key == 'role' else 'conversations'}' must be a non-empty list")
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str) \
                or not isinstance(turn.get(content_key), str):
            raise DataError(f"{where}: turn {k} must be an object with string '{role_key}' and '{content_key}'")
        role = turn[role_key]
        if role_key == "from":
            if role.lower() not in SHAREGPT_ROLES:
                raise DataError(f"{where}: turn {k} has unknown ShareGPT role from={role!r} "
                                f"(known: {sorted(SHAREGPT_ROLES)})")
            role = SHAREGPT_ROLES[role.lower()]
        messages.append({"role": role, "content": turn[content_key]})
    return messages


def prompt_key(parsed: str | list[dict[str, str]]) -> str:
    """What a record answers: its conversation before the last assistant turn (a text record: the text).

    Records that share it (a greedy and sampled responses to one prompt) belong in the same split, so that
    validation measures prompts the draft has not seen, not other answers to prompts it trained on.
    """
    if isinstance(parsed, str):
        return parsed
    last = max((k for k, m in enumerate(parsed) if m["role"] == "assistant"), default=len(parsed))
    return json.dumps(parsed[:last], sort_keys=True, ensure_ascii=False)


def held_out_by_prompt(records: list[tuple[str, Any]], n_val: int) -> set[int]:
    """Indices of the validation records: whole prompt groups (:func:`prompt_key`), in a fixed random order,
    until at least ``n_val`` records are held out; never every group. Where all records answer one prompt
    it holds out single records instead, and says so (validation then shares that prompt)."""
    if n_val <= 0:
        return set()
    groups: dict[str, list[int]] = {}
    for i, (where, record) in enumerate(records):
        groups.setdefault(prompt_key(parse_record(record, where)), []).append(i)
    rng = np.random.default_rng(SPLIT_SEED)
    if len(groups) < 2:
        log.warning("all %d training records answer one prompt: validation holds out %d of its responses, "
                    "so it measures that prompt again", len(records), n_val)
        return set(rng.permutation(len(records))[:n_val].tolist())
    members = list(groups.values())
    held: set[int] = set()
    for g in rng.permutation(len(members))[:-1]:  # the last group always trains
        if len(held) >= n_val:
            break
        held.update(members[g])
    return held


# ---------------------------------------------------------------------- tokenising
def encode_text(tokenizer: Any, text: str) -> tuple[list[int], list[bool]]:
    """Token ids of plain text (with the tokenizer's own special tokens), every token supervised."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return ids, [True] * len(ids)


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], where: str = "<chat>") -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation; supervised = assistant content + its end-of-turn token.

    The assistant spans come from, in order of preference:

    1. the template's ``{% generation %}`` markers, when it has them (the author's own statement);
    2. rendering prefixes: the text between ``render(msgs[:i], generation prompt)`` and
       ``render(msgs[:i+1])`` (trailing whitespace dropped) is turn ``i``; needs a template that renders
       prefixes consistently (ChatML: SmolLM2, the tiny target);
    3. searching each message's content, in order, in the rendered text (Qwen3-style templates that
       render the last turn differently), plus the end-of-turn token right after it.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError(f"{where}: chat sample but the target's tokenizer has no chat template")
    if "{% generation %}" in str(template).replace("{%-", "{%").replace("-%}", "%}"):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]
    full = _render(tokenizer, messages, False)
    spans = _prefix_spans(tokenizer, messages, full)
    if spans is None:
        spans = _content_spans(tokenizer, messages, full, where)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _prefix_spans(tokenizer: Any, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]] | None:
    """Assistant spans by rendering prefixes, or None when the template renders them inconsistently."""
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(upto) and upto.startswith(prefix)):
            return None
        spans.append((len(prefix), len(upto.rstrip())))
    return spans


def _content_spans(tokenizer: Any, messages: list[dict[str, str]], full: str, where: str) -> list[tuple[int, int]]:
    """Assistant spans found by searching each message's content, in order, in the rendered text.

    For templates that render a turn differently once later turns follow (Qwen3 drops earlier
    ``<think>`` blocks). The span is the content plus an end-of-turn token right after it, if any.
    """
    enders = [t for t in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>") if t]
    spans, cursor = [], 0
    for k, msg in enumerate(messages):
        content = msg["content"]
        pos = full.find(content, cursor)
        if pos < 0 and content.strip():
            content = content.strip()
            pos = full.find(content, cursor)
        if pos < 0:
            raise DataError(f"{where}: cannot locate assistant tokens: turn {k}'s content is not rendered "
                            "verbatim by the chat template and it has no {% generation %} markers")
        end = pos + len(content)
        if msg["role"] == "assistant":
            closer = next((t for t in enders if full.startswith(t, end)), "")
            spans.append((pos, end + len(closer)))
        cursor = end
    return spans


def encode_records(tokenizer: Any, records: list[tuple[str, Any]], seq_len: int) -> tuple[dict[str, np.ndarray], int]:
    """Tokenise, cut/pad to ``seq_len``; returns the arrays and the number of skipped samples.

    A sample with no supervised token left after cutting is skipped (and counted).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows_ids, rows_mask, rows_len, skipped = [], [], [], 0
    for where, record in records:
        parsed = parse_record(record, where)
        ids, mask = encode_text(tokenizer, parsed) if isinstance(parsed, str) else encode_chat(tokenizer, parsed, where)
        ids, mask = ids[:seq_len], mask[:seq_len]
        if not any(mask):
            skipped += 1
            continue
        rows_ids.append(ids)
        rows_mask.append(mask)
        rows_len.append(len(ids))
    n = len(rows_ids)
    arrays = {"input_ids": np.full((n, seq_len), pad, dtype=np.int32),
              "loss_mask": np.zeros((n, seq_len), dtype=bool),
              "attention_mask": np.zeros((n, seq_len), dtype=bool)}
    for r, (ids, mask, length) in enumerate(zip(rows_ids, rows_mask, rows_len)):
        arrays["input_ids"][r, :length] = ids
        arrays["loss_mask"][r, :length] = mask
        arrays["attention_mask"][r, :length] = True
    return arrays, skipped


# ---------------------------------------------------------------------- datasets
class ArrayDataset(Dataset):
    """Rows of named arrays (in memory or ``.npy`` files opened memory-mapped, lazily per process)."""

    LONG = ("input_ids", "target_next", "teacher_topk_indices")
    BOOL = ("loss_mask", "attention_mask")

    def __init__(self, arrays: dict[str, np.ndarray | Path], feature_dtype: torch.dtype = torch.float32) -> None:
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


# ---------------------------------------------------------------------- the DataModule
class DraftDataModule(pl.LightningDataModule):
    """Training data for a draft: tokenised samples and, offline, the target's features and logits.

    Args:
        target: the frozen target (its tokenizer renders and tokenises; offline, it computes features).
        train_files: jsonl files; ``None`` uses the built-in corpus (:mod:`dflash2_lightning.corpus`).
        val_files: jsonl files; ``None`` holds out ``val_fraction`` of the training records, whole prompts
            at a time (every response to a held-out prompt; a fixed permutation, so the split is the same
            every run): validation then measures prompts the draft has not trained on.
        val_fraction: share of training records held out when ``val_files`` is None (0 disables validation;
            rounded up to whole prompts).
        seq_len: tokens per sample (cut or padded); a multiple of ``block_size``.
        block_size: the draft's block size (linked from the model by the trainer).
        batch_size: samples per batch (also used to compute offline features).
        mode: ``online`` (the LightningModule runs the target) or ``offline`` (features from the cache).
        cache_dir: the offline feature cache directory. ``None``: a directory named by a hash of the
            manifest under ``$DFLASH2_CACHE`` or ``~/.cache/dflash2-lightning/features``.
        target_layer_ids: target layers whose outputs are the draft's features; ``None``: the DFlash
            rule for ``num_draft_layers``.
        num_draft_layers: draft depth, used only to default ``target_layer_ids``.
        teacher_top_k: offline: store the target's top-k logits per position for distillation (0: don't).
        num_workers: DataLoader worker processes.
        max_samples: read at most this many records from the training files (and from ``val_files``).
        feature_dtype: on-disk dtype of offline features, ``float16`` (default) or ``float32``.
        feature_device: device that computes offline features (default: ``cuda`` when available, else ``cpu``).
        feature_autocast: ``"bf16"`` computes offline features and target logits under bfloat16 autocast
            (~2.5x faster on a CPU with AMX, the target's matmuls rounded to bf16 as ``bf16-mixed``
            training rounds the draft's); ``"none"`` (default) in the target's own dtype.
        cache_verify: how an offline cache is checked when opened: ``"auto"``, ``"full"`` or ``"sampled"``
            (see the module docstring: every byte up to 4 GiB, sampled blocks above).
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
        cache_dir: str | None = None,
        target_layer_ids: list[int] | None = None,
        num_draft_layers: int = 1,
        teacher_top_k: int = 0,
        num_workers: int = 0,
        max_samples: int | None = None,
        feature_dtype: Literal["float16", "float32"] = "float16",
        feature_device: str | None = None,
        feature_autocast: Literal["none", "bf16"] = "none",
        shuffle_seed: int = 0,
        cache_verify: Literal["auto", "full", "sampled"] = "auto",
    ) -> None:
        super().__init__()
        if hasattr(target, "as_dict"):  # a jsonargparse Namespace, e.g. through a linked argument
            target = target.as_dict()
        _check(isinstance(target, (TargetSpec, dict)), "target", target,
               "a TargetSpec (path, gguf or tiny); the data needs the target's tokenizer")
        self.target = target if isinstance(target, TargetSpec) else TargetSpec(**target)
        _check(block_size >= 1, "block_size", block_size, ">= 1")
        _check(seq_len >= 1 and seq_len % block_size == 0, "seq_len", seq_len,
               f"a positive multiple of block_size={block_size}")
        _check(0.0 <= val_fraction < 1.0, "val_fraction", val_fraction, "0 <= val_fraction < 1")
        _check(batch_size >= 1, "batch_size", batch_size, ">= 1")
        _check(mode in ("online", "offline"), "mode", mode, "'online' or 'offline'")
        _check(num_draft_layers >= 1, "num_draft_layers", num_draft_layers, ">= 1")
        _check(teacher_top_k >= 0, "teacher_top_k", teacher_top_k, ">= 0")
        _check(num_workers >= 0, "num_workers", num_workers, ">= 0")
        _check(max_samples is None or max_samples >= 1, "max_samples", max_samples, "None or >= 1")
        _check(feature_dtype in ("float16", "float32"), "feature_dtype", feature_dtype, "'float16' or 'float32'")
        _check(feature_autocast in ("none", "bf16"), "feature_autocast", feature_autocast, "'none' or 'bf16'")
        self.feature_autocast = feature_autocast
        for name, files in (("train_files", train_files), ("val_files", val_files)):
            _check(files is None or (isinstance(files, list) and len(files) > 0), name, files,
                   "None or a non-empty list of jsonl paths")
        self.train_files, self.val_files = train_files, val_files
        self.val_fraction, self.seq_len, self.block_size, self.batch_size = val_fraction, seq_len, block_size, batch_size
        self.mode, self.cache_dir, self.target_layer_ids = mode, cache_dir, target_layer_ids
        self.num_draft_layers, self.teacher_top_k, self.num_workers = num_draft_layers, teacher_top_k, num_workers
        self.max_samples, self.feature_dtype, self.feature_device = max_samples, feature_dtype, feature_device
        self.shuffle_seed = shuffle_seed
        _check(cache_verify in ("auto", "full", "sampled"), "cache_verify", cache_verify, "'auto', 'full' or 'sampled'")
        self.cache_verify = cache_verify
        self._resume_position: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint
        self.save_hyperparameters(ignore=["target"])
        self.hparams["target"] = dataclasses.asdict(self.target)  # a plain dict keeps hparams.yaml readable
        self.skipped_samples = 0
        self.total_records = 0
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
        ids = self.target_layer_ids if self.target_layer_ids is not None else tgt.default_layer_ids(self.num_draft_layers)
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
            return {"train": train, "val": read(self.val_files)}
        n_val = int(round(len(train) * self.val_fraction)) if len(train) > 1 else 0
        n_val = max(n_val, 1) if self.val_fraction > 0 and len(train) > 1 else 0
        held = held_out_by_prompt(train, n_val)
        return {"train": [r for i, r in enumerate(train) if i not in held],
                "val": [r for i, r in enumerate(train) if i in held]}

    def _encode(self) -> dict[str, dict[str, np.ndarray]]:
        tok = self.target_model.tokenizer
        max_pos = getattr(self.target_model.config, "max_position_embeddings", None)
        _check(max_pos is None or self.seq_len <= max_pos, "seq_len", self.seq_len,
               f"<= the target's max_position_embeddings={max_pos}")
        out, skipped, total = {}, 0, 0
        for split, records in self._records().items():
            out[split], s = encode_records(tok, records, self.seq_len)
            skipped += s
            total += len(records)
        self.total_records = total
        self._set_skipped(skipped, total)
        return out

    def _set_skipped(self, skipped: int, total: int) -> None:
        self.skipped_samples = skipped
        if skipped:
            log.warning("skipped %d of %d samples with no supervised token (no assistant tokens within "
                        "seq_len=%d, or empty)", skipped, total, self.seq_len)

    # ------------------------------------------------------------------ offline cache
    def _data_fingerprint(self) -> dict[str, Any]:
        def files(paths: list[str] | None) -> list[str] | str | None:
            if paths is None:
                return None
            return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]

        return {"train": files(self.train_files) if self.train_files is not None else f"builtin:{builtin_fingerprint()}",
                "val": files(self.val_files), "val_fraction": self.val_fraction if self.val_files is None else None,
                **({"split": SPLIT_RULE} if self.val_files is None and self.val_fraction > 0 else {}),
                "max_samples": self.max_samples}

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
            "info": {"target": dataclasses.asdict(self.target), "train_files": self.train_files,
                     "val_files": self.val_files},
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
        diffs = [f"{k}: cache has {have.get(k)!r}, this run has {v!r}"
                 for k, v in want.items() if k not in ("info", "files") and have.get(k) != v]
        if diffs:
            raise DataError(f"offline feature cache {path} was built for different settings — "
                            + "; ".join(diffs)
                            + f". Delete {path} to rebuild it, or set data cache_dir to another directory.")
        return have

    def build_cache(self) -> Path:
        """Make sure a matching offline cache exists (compute it if missing); return its directory."""
        want = self.manifest()
        path = self.cache_path(want)
        if (path / MANIFEST).is_file():
            self._check_manifest(path, want)
            return path
        if path.exists() and any(path.iterdir()):
            raise DataError(f"cache_dir={str(path)!r} exists, is not empty and has no {MANIFEST}: "
                            "not a feature cache (a complete cache always has one); choose another directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfiles.remove_stale(path.parent, path.name)  # what a killed build of this cache left behind
        tmp = tempfiles.make_dir(path)
        try:
            encoded = self._encode()
            stats = {}
            for split, arrays in encoded.items():
                self._compute_split(arrays, tmp / split)
                stats[f"{split}_samples"] = int(arrays["input_ids"].shape[0])
            want["info"]["stats"] = {**stats, "skipped_samples": self.skipped_samples,
                                     "total_records": self.total_records}
            want["files"] = {str(f.relative_to(tmp)): file_checksums(f) for f in sorted(tmp.glob("*/*.npy"))}
            (tmp / MANIFEST).write_text(json.dumps(want, indent=2) + "\n")  # last: marks the cache complete
            os.chmod(tmp, dir_mode())  # mkdtemp makes 0700: other users (a server) must read the cache
            try:
                os.rename(tmp, path)
            except OSError:
                if not (path / MANIFEST).is_file():  # not another process finishing first: a real error
                    raise
                self._check_manifest(path, want)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return path

    def _compute_split(self, arrays: dict[str, np.ndarray], out: Path) -> None:
        from numpy.lib.format import open_memmap
        from tqdm.auto import tqdm

        out.mkdir(parents=True)
        for name, arr in arrays.items():
            np.save(out / f"{name}.npy", arr)
        tgt, layer_ids, k = self.target_model, self.layer_ids, self.teacher_top_k
        n, s = arrays["input_ids"].shape
        width = len(layer_ids) * tgt.hidden_size
        store = {"features": open_memmap(out / "features.npy", "w+", np.dtype(self.feature_dtype), (n, s, width)),
                 "target_next": open_memmap(out / "target_next.npy", "w+", np.int32, (n, s))}
        if k:
            store["teacher_topk_values"] = open_memmap(out / "teacher_topk_values.npy", "w+", np.float32, (n, s, k))
            store["teacher_topk_indices"] = open_memmap(out / "teacher_topk_indices.npy", "w+", np.int32, (n, s, k))
        device = torch.device(self.feature_device or ("cuda" if torch.cuda.is_available() else "cpu"))
        home = tgt.device
        tgt.to(device)
        try:
            for start in tqdm(range(0, n, self.batch_size), desc=f"target features ({out.name})", unit="batch"):
                rows = slice(start, start + self.batch_size)
                attn = arrays["attention_mask"][rows]
                length = max(int(attn.sum(1).max()), 1)  # right padding: positions past it never matter
                ids = torch.from_numpy(arrays["input_ids"][rows, :length]).long().to(device)
                am = torch.from_numpy(attn[:, :length]).to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.feature_autocast == "bf16"):
                    res = tgt.features(ids, am, layer_ids)
                valid = am.unsqueeze(-1)
                feats = (res.features.float() * valid).cpu().numpy().astype(self.feature_dtype)
                if not np.isfinite(feats).all():
                    raise DataError(f"target features overflow {self.feature_dtype} (max |x| = "
                                    f"{res.features.float().abs().max().item():.3g}); set feature_dtype='float32'")
                logits = res.logits.float()
                block = np.zeros((attn.shape[0], s, width), dtype=self.feature_dtype)
                block[:, :length] = feats
                store["features"][rows] = block
                nxt = np.zeros((attn.shape[0], s), dtype=np.int32)
                nxt[:, :length] = (logits.max(-1).indices * am).cpu().numpy()  # = argmax (first max), faster on CPU
                store["target_next"][rows] = nxt
                if k:
                    vals, idx = logits.topk(k, dim=-1)
                    v = np.zeros((attn.shape[0], s, k), dtype=np.float32)
                    v[:, :length] = vals.cpu().numpy()
                    i = np.zeros((attn.shape[0], s, k), dtype=np.int32)
                    i[:, :length] = idx.cpu().numpy()
                    store["teacher_topk_values"][rows] = v
                    store["teacher_topk_indices"][rows] = i
        finally:
            tgt.to(home)
        for arr in store.values():
            arr.flush()

    def _load_cache(self, path: Path) -> dict[str, ArrayDataset]:
        manifest = read_manifest(path)
        verify_cache(path, manifest, self.cache_verify)
        stats = manifest.get("info", {}).get("stats", {})
        self._set_skipped(int(stats.get("skipped_samples", 0)), int(stats.get("total_records", 0)))
        dtype = self.target_model.dtype
        return {split: ArrayDataset({f.stem: f for f in sorted((path / split).glob("*.npy"))}, dtype)
                for split in ("train", "val")}

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Offline mode: compute the feature cache once (rank 0 of each node), or check the existing one."""
        if self.mode == "offline":
            self.build_cache()

    def setup(self, stage: str | None = None) -> None:
        """Tokenise (online) or open the memory-mapped cache (offline, building it if still missing)."""
        if self.train_dataset is not None:
            return
        if self.mode == "offline":
            datasets = self._load_cache(self.build_cache())
        else:
            datasets = {split: ArrayDataset(arrays) for split, arrays in self._encode().items()}
        self.train_dataset, self.val_dataset = datasets["train"], datasets["val"]
        if len(self.train_dataset) == 0:
            raise DataError("no training samples left (all skipped, or the files are empty)")

    def _loader(self, dataset: ArrayDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("DraftDataModule.setup() has not run")
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        """Training batches in a seeded per-epoch order that a resumed run continues exactly."""
        if self.train_dataset is None:
            raise RuntimeError("DraftDataModule.setup() has not run")
        trainer = self.trainer
        order = ResumableOrder(len(self.train_dataset), self.shuffle_seed,
                               num_replicas=trainer.world_size if trainer else 1,
                               rank=trainer.global_rank if trainer else 0)
        if self._resume_position is not None:
            order.resume(*self._resume_position, batch_size=self.batch_size)
            self._resume_position = None
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=order,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def state_dict(self) -> dict[str, int]:
        """Where training stands in the data (saved in every Lightning checkpoint)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        loop = trainer.fit_loop
        return {"epoch": loop.epoch_progress.current.processed,
                "batches": loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the training order after the batches a checkpoint already trained on."""
        if state:
            self._resume_position = (int(state["epoch"]), int(state["batches"]))

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)


# ---------------------------------------------------------------------- cache integrity
def read_manifest(path: Path) -> dict[str, Any]:
    """The cache's ``manifest.json``; unreadable or damaged is a :class:`DataError` naming it."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"offline feature cache manifest {file} is damaged ({e}); delete {path} to rebuild "
                        "the cache") from None
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
        raise DataError(f"offline feature cache {path}: {MANIFEST} records no file checksums (damaged, or written "
                        "by another version); delete the directory to rebuild it")
    total = 0
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            raise DataError(f"offline feature cache file {file} is missing; delete {path} to rebuild the cache")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise DataError(f"offline feature cache file {file} is damaged: {size} bytes, the manifest recorded "
                            f"{want.get('bytes')} (truncated or overwritten); delete {path} to rebuild the cache")
        total += size
    full = mode == "full" or (mode == "auto" and total <= FULL_VERIFY_BYTES)
    if not full:
        log.info("offline feature cache %s: %.1f GB, checked by size and sampled blocks (cache_verify='full' "
                 "hashes every byte)", path, total / 1e9)
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
            raise DataError(f"offline feature cache file {file} is damaged: its checksum differs from the one "
                            f"recorded when the cache was built; delete {path} to rebuild the cache")
        if full:
            _VERIFIED.add(key)
    return "full" if full else "sampled"


def _check(ok: bool, name: str, value: Any, bound: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: must be {bound}")
