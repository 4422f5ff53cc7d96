"""Few-row matmuls on a CPU: the kernel behind the target's verify pass and the draft's head.

A speculative cycle multiplies every weight of the target by a handful of rows (the block_size tokens
of a verify pass, the block_size - 1 drafted slots through the head). With so few rows a CPU matmul
costs about what reading the weight costs, and which kernel reads it least differs between CPUs, so
:class:`FewRowLinear` picks one of three for 2..:data:`SMALL_ROWS` rows::

    stock       F.linear: BLAS packs the weight into its panel layout at every call (a second pass
                over the weight, and a written copy of it)
    rows_first  (W @ x.T).T: streams the weight once, split over the threads; where it pays is timed
                once per shape (:func:`rows_first_pays`)
    packed      MKL's GEMM on a copy of the weight packed once for exactly ``rows`` rows
                (``torch.ops.mkl._mkl_linear``): no packing per call; only for row counts a caller
                declared with :func:`pack_rows` (a packed copy costs the weight's size in memory), and
                only where it beats the other two, timed once per shape (:func:`packing_pays`)

One row (a GEMV either way) and training's hundreds always take ``F.linear``.

Measured (SmolLM2-135M float32, 2 AMX cores, a whole 4-token verify pass against a 1-token step of 37
ms): stock 57 ms, packed 47 ms; on an older 2-core host without AMX, rows-first brought the same pass
from 86-93 to 54-69 ms while it is 1.5-2.3x *slower* than stock on the AMX host. Every choice is timed on
weights streamed from memory, as a forward pass reads them (:func:`streamed_copies`): timed on one cached
weight, a 2-core AMD EPYC ranked stock first for every shape, and its 4-token verify pass took 111-114
ms; timed streamed, it picks rows-first for most shapes and the pass takes 58-100 ms, about a 1-token step.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

# Few-row kernels cover up to this many rows (a verified or drafted block, a few sequences).
SMALL_ROWS = 64
ROWS_FIRST_ENV = "DFLASH2_ROWS_FIRST"  # "1" / "0": always / never rows-first (reproducible kernels); unset: timed
PACK_ENV = "DFLASH2_PACK_WEIGHTS"  # "0": never pack; "1": always pack declared rows; unset: where timing says it pays
ROWS_FIRST_MARGIN = 1.15  # rows-first must win by this factor (a near tie keeps the stock kernel)
# Pack a weight only while the machine keeps this many times its size free afterwards.
PACK_MEMORY_HEADROOM = 2.0
# Up to 8 rows the choice is timed per row count (on a 2-core EPYC rows-first wins 1.4x at 4 rows and
# loses 1.5x at 8 on the same weight); above, per bucket of padded counts.
_ROW_BUCKETS = (16, 32, SMALL_ROWS)
# Kernels are timed on weights streamed from memory (:func:`streamed_copies`): twice the last-level cache,
# at most this many bytes and this many copies (a tiny weight stays cached: its choice matters little).
TIMING_BYTES = 256 * 2**20
MAX_TIMING_COPIES = 256
DEFAULT_CACHE_BYTES = 32 * 2**20
_rows_first_choice: dict[tuple[Any, ...], bool] = {}
_pack_choice: dict[tuple[Any, ...], bool] = {}


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def rows_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, computed as ``(weight @ x.T).T`` for 2..:data:`SMALL_ROWS` rows on CPU.

    With a few rows, some CPU BLAS builds pack the whole weight for ``x @ W.T`` and barely use a second
    thread, while ``W @ x.T`` streams the weight once, split over the threads (measured on SmolLM2-135M, 2
    cores, no AMX: its 49152 x 576 head on 4 rows 18 -> 5 ms). ``W @ x.T`` with a row count that is not a
    multiple of 8 falls off BLAS's fast kernels above 8 rows (15 rows: 50 vs 28 ms on the head), so 9..64
    rows are padded with zero rows to a multiple of 8. One row and training's hundreds take the stock
    path. The result is row-major like ``F.linear``'s (copied out of the column-major product: a tensor
    whose batch strides do not fold makes the next ``F.linear`` expand its weight per row into a ``bmm``,
    which cost a batched bf16 decode 10x its time). Differentiable.
    """
    rows = _rows(x)
    if x.device.type != "cpu" or not 1 < rows <= SMALL_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, -1)
    pad = -rows % 8 if rows > 8 else 0
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = (weight @ flat.T).T[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def rows_first_pays(weight: torch.Tensor, rows: int) -> bool:
    """Whether :func:`rows_first_linear` beats ``F.linear`` for ``rows`` rows of ``weight`` on this machine.

    Timed once per (dtype, weight shape, row count up to 8 or bucket above, torch threads) on random rows,
    over weights streamed from memory (:func:`streamed_copies`, :func:`fastest`), and remembered for the
    process; ``DFLASH2_ROWS_FIRST=1`` or ``0`` decides without timing.
    """
    forced = os.environ.get(ROWS_FIRST_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    bucket = rows if rows <= 8 else next(b for b in _ROW_BUCKETS if rows <= b)
    key = (weight.dtype, tuple(weight.shape), bucket, torch.get_num_threads())
    if key not in _rows_first_choice:
        with torch.no_grad():
            x = torch.randn(bucket, weight.shape[1], dtype=weight.dtype)
            copies = streamed_copies(weight)
            best = fastest({"stock": [lambda w=w: torch.nn.functional.linear(x, w) for w in copies],
                            "rows_first": [lambda w=w: rows_first_linear(x, w) for w in copies]})
        _rows_first_choice[key] = best["rows_first"] * ROWS_FIRST_MARGIN < best["stock"]
    return _rows_first_choice[key]


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (Linux), else :data:`DEFAULT_CACHE_BYTES`; read once."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def streamed_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``weight`` that together overflow the last-level cache (twice over, at most
    :data:`TIMING_BYTES`): a kernel timed across them reads every weight from memory, as a forward pass
    does. Timed on one weight, a kernel finds it in cache from the second call on, and that ranks the
    kernels wrongly (a 2-core AMD EPYC: stock and rows-first level on a cached 576 x 576 weight, a whole
    4-row pass over SmolLM2's streamed weights 69 vs 39 ms)."""
    size = weight.numel() * weight.element_size()
    count = max(1, min(MAX_TIMING_COPIES, min(2 * _last_level_cache_bytes(), TIMING_BYTES) // max(size, 1)))
    detached = weight.detach()
    return [detached] + [detached.clone() for _ in range(count - 1)]


def fastest(kernels: dict[str, list[Callable[[], Any]]]) -> dict[str, float]:
    """Seconds a call of each kernel takes, streamed: each kernel's calls (one per weight copy, see
    :func:`streamed_copies`) run back to back, the kernels interleaved three times so a burst of load
    hits them all; the best round counts."""
    best = {name: float("inf") for name in kernels}
    for _ in range(3):
        for name, calls in kernels.items():
            start = time.perf_counter()
            for call in calls:
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / len(calls))
    return best


def _pack_setting() -> str:
    """``DFLASH2_PACK_WEIGHTS`` ("0", "1" or unset): read at call time, so a benchmark or a user can switch
    it in-process."""
    return os.environ.get(PACK_ENV, "").strip()


def _packing_off() -> bool:
    return _pack_setting() == "0"


def packing_pays(weight: torch.Tensor, packed: torch.Tensor, rows: int) -> bool:
    """Whether MKL's GEMM on ``packed`` (``weight`` packed for ``rows`` rows) beats the unpacked kernel.

    Packing pays on an AMX Xeon (a verify pass 57 -> 47 ms) and costs on an AMD EPYC (a cycle 117 -> 171
    ms), so it is timed once per (weight shape, rows, torch threads) on random rows against the kernel
    :class:`FewRowLinear` would use instead (streamed from memory, :func:`fastest`) and remembered for the
    process; ``DFLASH2_PACK_WEIGHTS=1`` packs without timing.
    """
    if _pack_setting() == "1":
        return True
    key = (tuple(weight.shape), rows, torch.get_num_threads())
    if key not in _pack_choice:
        unpacked = rows_first_linear if rows_first_pays(weight, rows) else torch.nn.functional.linear
        with torch.no_grad():
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            copies = streamed_copies(weight)
            packs = [packed] + [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in copies[1:]]
            best = fastest({"packed": [lambda w=w, p=p: torch.ops.mkl._mkl_linear(x, p, w, None, rows)
                                       for w, p in zip(copies, packs)],
                            "unpacked": [lambda w=w: unpacked(x, w) for w in copies]})
        _pack_choice[key] = best["packed"] < best["unpacked"]
    return _pack_choice[key]


def packing_available(weight: torch.Tensor) -> bool:
    """Whether this torch build can pack ``weight`` (float32 on CPU, MKL present) and packing is not off."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and not _packing_off())


def _available_memory() -> int | None:
    """``MemAvailable`` in bytes (Linux), else None (no guard)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose 2..:data:`SMALL_ROWS`-row products on CPU take the cheapest kernel.

    Same parameters, same state dict, same results up to float rounding (the kernels sum in different
    orders). Row counts in ``packed_rows`` (set by :func:`pack_rows`) multiply a weight copy packed once
    for that count, re-packed when the weight changes; other counts take :func:`rows_first_linear` where
    :func:`rows_first_pays`, else ``F.linear``. Packed products have no autograd: a call that needs
    gradients takes the other kernels.
    """

    packed_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if x.device.type == "cpu" and 1 < rows <= SMALL_ROWS:
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
            if rows in self.packed_rows and x.dtype == torch.float32 and not needs_grad:
                packed = self._packed(rows)
                if packed is not None:
                    out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), packed, self.weight, self.bias, rows)
                    return out.view(*x.shape[:-1], self.out_features)
            if rows_first_pays(self.weight, rows):
                return rows_first_linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def _packed(self, rows: int) -> torch.Tensor | None:
        """The weight packed for ``rows`` rows (cached, keyed by the weight's storage and version), or None."""
        weight = self.weight
        if _packing_off():
            return None
        cache = self.__dict__.setdefault("_packed_cache", {})  # a plain attribute: not state, not a buffer
        key = (weight.data_ptr(), weight._version)
        hit = cache.get(rows)
        if hit is not None and hit[0] == key:  # the hot path: one env read and a dict lookup per call
            return hit[1]
        if not packing_available(weight):
            return None
        free = _available_memory()
        need = weight.numel() * weight.element_size()
        if free is not None and free < PACK_MEMORY_HEADROOM * need + need:
            if not self.__dict__.get("_pack_warned"):
                self.__dict__["_pack_warned"] = True
                print(f"dflash2: not packing a {tuple(weight.shape)} weight for {rows}-row products: "
                      f"{free / 2**20:.0f} MiB available, packing needs {need / 2**20:.0f} MiB and keeps "
                      f"{PACK_MEMORY_HEADROOM:g}x its size free", file=sys.stderr)
            return None
        with torch.no_grad():
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        if not packing_pays(weight, packed, rows):
            packed = None  # remembered: this weight keeps the unpacked kernel for these rows
        cache[rows] = (key, packed)
        return packed


def use_few_row_linears(model: nn.Module) -> nn.Module:
    """Give every plain ``nn.Linear`` of ``model`` the :class:`FewRowLinear` forward, in place.

    The target's verify pass (block_size tokens), its head on a drafted block and the last rows of a
    batched regeneration are all few-row matmuls; subclasses of ``nn.Linear`` (quantised layers) are
    left alone.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowLinear
    return model


def pack_rows(model: nn.Module, *rows: int) -> int:
    """Let every :class:`FewRowLinear` of ``model`` pack its weight for products of exactly ``rows`` rows.

    Packing happens lazily, at a layer's first such product, and costs the weight's size in memory per
    row count (skipped, with a note on stderr, where the machine would be left with less than
    :data:`PACK_MEMORY_HEADROOM` times it free). Returns how many layers can pack. Idempotent.
    """
    wanted = frozenset(r for r in rows if 1 < r <= SMALL_ROWS)
    count = 0
    for module in model.modules():
        if isinstance(module, FewRowLinear):
            if not wanted <= module.packed_rows:
                module.packed_rows = module.packed_rows | wanted
            count += 1
    return count
