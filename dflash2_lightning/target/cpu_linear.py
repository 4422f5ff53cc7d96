"""Few-row matmuls on a CPU: which kernel the target's linears use for the verify pass and the draft's head.

A speculative cycle multiplies every weight of the target by a handful of rows (the ``block_size`` tokens of a
verify pass, the ``block_size - 1`` drafted slots through the head). With so few rows a CPU matmul costs about
what reading the weight costs, and which kernel reads it least differs between CPUs, so for 2..:data:`SMALL_ROWS`
rows a target's linears choose among ``stock`` (``F.linear``: BLAS repacks the weight at every call),
``rows_first`` (``(W @ x.T).T``: streams the weight once) and ``packed`` (MKL's GEMM on a copy packed once for
exactly the row counts the verify pass declares, :meth:`CpuLinears.declare_rows`). One row and training's
hundreds always take ``F.linear``.

The choice is one typed setting, :data:`CpuLinear` (``cpu_linear`` in the target spec, ``--cpu-linear``):
``auto`` (default) times each kernel once per weight shape and row count on weights streamed from memory
(:func:`streamed_copies`) and keeps the fastest (rows-first must win by :data:`ROWS_FIRST_MARGIN`, packing must
beat the unpacked choice); ``stock`` and ``rows_first`` take that kernel for every few-row product (reproducible);
``packed`` packs for the declared row counts and takes ``F.linear`` for the others.
:func:`install_cpu_linears` replaces a model's plain ``nn.Linear`` modules by :class:`FewRowLinear` modules that
share their parameters and one :class:`CpuLinears` object, where the setting and every decision taken under it
live. How ``auto`` decides, and what each kernel measured per CPU kind: docs/cpu-linears.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

CpuLinear = Literal["auto", "stock", "rows_first", "packed"]
CPU_LINEAR_CHOICES: tuple[str, ...] = get_args(CpuLinear)

# Few-row kernels cover up to this many rows (a verified or drafted block, a few sequences).
SMALL_ROWS = 64
ROWS_FIRST_MARGIN = 1.15  # rows-first must win by this factor (a near tie keeps the stock kernel)
# Pack a weight only while the machine keeps this many times its size free afterwards.
PACK_MEMORY_HEADROOM = 2.0
# Up to 8 rows the choice is timed per row count (rows-first can win at 4 rows and lose at 8 on the same
# weight); above, per bucket of padded counts.
_ROW_BUCKETS = (16, 32, SMALL_ROWS)
# Kernels are timed on weights streamed from memory (:func:`streamed_copies`): twice the last-level cache,
# at most this many bytes and this many copies (a tiny weight stays cached: its choice matters little).
TIMING_BYTES = 256 * 2**20
MAX_TIMING_COPIES = 256
DEFAULT_CACHE_BYTES = 32 * 2**20


def few_rows(x: torch.Tensor) -> int:
    """The number of rows ``x`` holds (every dimension but the last)."""
    return x.numel() // max(x.shape[-1], 1)


def rows_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, computed as ``(weight @ x.T).T`` for 2..:data:`SMALL_ROWS` rows on CPU.

    With a few rows, some CPU BLAS builds pack the whole weight for ``x @ W.T`` and barely use a second
    thread, while ``W @ x.T`` streams the weight once, split over the threads. ``W @ x.T`` with a row
    count that is not a multiple of 8 falls off BLAS's fast kernels above 8 rows, so 9..64 rows are
    padded with zero rows to a multiple of 8. One row and training's hundreds take the stock path. The
    result is row-major like ``F.linear``'s (copied out of the column-major product: a tensor whose batch
    strides do not fold makes the next ``F.linear`` expand its weight per row into a ``bmm``).
    Differentiable.
    """
    rows = few_rows(x)
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


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (Linux), else :data:`DEFAULT_CACHE_BYTES`."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def streamed_copies(weight: torch.Tensor, cache_bytes: int) -> list[torch.Tensor]:
    """Copies of ``weight`` that together overflow a last-level cache of ``cache_bytes`` (twice over, at most
    :data:`TIMING_BYTES`): a kernel timed across them reads every weight from memory, as a forward pass
    does. Timed on one weight, a kernel finds it in cache from the second call on, and that ranks the
    kernels wrongly."""
    size = weight.numel() * weight.element_size()
    count = max(1, min(MAX_TIMING_COPIES, min(2 * cache_bytes, TIMING_BYTES) // max(size, 1)))
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


def packing_available(weight: torch.Tensor) -> bool:
    """Whether this torch build can pack ``weight`` (float32 on CPU, MKL present)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def available_memory() -> int | None:
    """``MemAvailable`` in bytes (Linux), else None (no guard)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuLinears:
    """One target's few-row kernel setting and every decision taken under it.

    Shared by all :class:`FewRowLinear` modules of a model (:func:`install_cpu_linears`). Under ``auto``
    a kernel is timed once per (dtype, weight shape, row count up to 8 or bucket above, torch threads)
    and the answer is kept here; the other settings decide without timing.

    Args:
        setting: ``auto``, ``stock``, ``rows_first`` or ``packed`` (see the module docstring).
        cache_bytes: the last-level cache the timing overflows (default: read from sysfs).
    """

    def __init__(self, setting: CpuLinear = "auto", cache_bytes: int | None = None) -> None:
        if setting not in CPU_LINEAR_CHOICES:
            from dflash2_lightning.errors import ConfigError

            raise ConfigError(f"cpu_linear={setting!r} is invalid: must be one of {', '.join(CPU_LINEAR_CHOICES)}")
        self.setting: CpuLinear = setting
        self.cache_bytes = cache_bytes if cache_bytes is not None else last_level_cache_bytes()
        self.rows_first_choices: dict[tuple[Any, ...], bool] = {}
        self.packing_choices: dict[tuple[Any, ...], bool] = {}
        self.declared_rows: frozenset[int] = frozenset()
        self.declared_head_rows: frozenset[int] = frozenset()

    @property
    def packs(self) -> bool:
        """Whether declared row counts may multiply packed weights under this setting."""
        return self.setting in ("auto", "packed")

    def rows_first(self, weight: torch.Tensor, rows: int) -> bool:
        """Whether an unpacked ``rows``-row product of ``weight`` takes :func:`rows_first_linear` (else ``F.linear``)."""
        if self.setting != "auto":
            return self.setting == "rows_first"
        bucket = rows if rows <= 8 else next(b for b in _ROW_BUCKETS if rows <= b)
        key = (weight.dtype, tuple(weight.shape), bucket, torch.get_num_threads())
        if key not in self.rows_first_choices:
            with torch.no_grad():
                x = torch.randn(bucket, weight.shape[1], dtype=weight.dtype)
                copies = streamed_copies(weight, self.cache_bytes)
                best = fastest(
                    {
                        "stock": [partial(torch.nn.functional.linear, x, w) for w in copies],
                        "rows_first": [partial(rows_first_linear, x, w) for w in copies],
                    }
                )
            self.rows_first_choices[key] = best["rows_first"] * ROWS_FIRST_MARGIN < best["stock"]
        return self.rows_first_choices[key]

    def packing_pays(self, weight: torch.Tensor, packed: torch.Tensor, rows: int) -> bool:
        """Whether MKL's GEMM on ``packed`` (``weight`` packed for ``rows`` rows) beats the unpacked kernel."""
        if self.setting != "auto":
            return self.setting == "packed"
        key = (tuple(weight.shape), rows, torch.get_num_threads())
        if key not in self.packing_choices:
            unpacked = rows_first_linear if self.rows_first(weight, rows) else torch.nn.functional.linear
            with torch.no_grad():
                x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
                copies = streamed_copies(weight, self.cache_bytes)
                packs = [packed] + [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in copies[1:]]
                best = fastest(
                    {
                        "packed": [
                            partial(torch.ops.mkl._mkl_linear, x, p, w, None, rows) for w, p in zip(copies, packs)
                        ],
                        "unpacked": [partial(unpacked, x, w) for w in copies],
                    }
                )
            self.packing_choices[key] = best["packed"] < best["unpacked"]
        return self.packing_choices[key]

    def describe(self) -> dict[str, Any]:
        """The setting and the decisions taken so far (for reports and benchmarks)."""
        return {
            "setting": self.setting,
            "rows_first": sum(self.rows_first_choices.values()),
            "timed_rows_first": len(self.rows_first_choices),
            "packed": sum(self.packing_choices.values()),
            "timed_packing": len(self.packing_choices),
            "declared_rows": sorted(self.declared_rows),
            "declared_head_rows": sorted(self.declared_head_rows),
        }


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose 2..:data:`SMALL_ROWS`-row products on CPU take the kernel its :class:`CpuLinears` picks.

    Built from an existing ``nn.Linear`` (:meth:`from_linear`), sharing its parameters: same state dict,
    same results up to float rounding (the kernels sum in different orders). Row counts in
    ``packed_rows`` multiply a weight copy packed once for that count (kept in ``packed``, re-packed when
    the weight changes) where packing pays; products that need gradients never take the packed kernel
    (it has no backward).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        kernels: CpuLinears | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.kernels = kernels if kernels is not None else CpuLinears()
        self.packed_rows: frozenset[int] = frozenset()
        self.packed: dict[int, tuple[tuple[int, int], torch.Tensor | None]] = {}  # rows -> (weight key, copy)
        self.pack_warned = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: CpuLinears) -> FewRowLinear:
        """A :class:`FewRowLinear` holding ``linear``'s own parameters (nothing copied)."""
        module = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, kernels=kernels, device="meta"
        )
        module.weight = linear.weight
        module.bias = linear.bias
        module.train(linear.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = few_rows(x)
        if x.device.type == "cpu" and 1 < rows <= SMALL_ROWS:
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
            if rows in self.packed_rows and x.dtype == torch.float32 and not needs_grad:
                packed = self.packed_weight(rows)
                if packed is not None:
                    out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), packed, self.weight, self.bias, rows)
                    return out.view(*x.shape[:-1], self.out_features)
            if self.kernels.rows_first(self.weight, rows):
                return rows_first_linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def packed_weight(self, rows: int) -> torch.Tensor | None:
        """The weight packed for ``rows`` rows (kept, keyed by the weight's storage and version), or None
        where packing is unavailable, short of memory or slower."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        hit = self.packed.get(rows)
        if hit is not None and hit[0] == key:  # the hot path: one dict lookup per call
            return hit[1]
        if not (self.kernels.packs and packing_available(weight)):
            return None
        free = available_memory()
        need = weight.numel() * weight.element_size()
        if free is not None and free < PACK_MEMORY_HEADROOM * need + need:
            if not self.pack_warned:
                self.pack_warned = True
                print(
                    f"dflash2: not packing a {tuple(weight.shape)} weight for {rows}-row products: "
                    f"{free / 2**20:.0f} MiB available, packing needs {need / 2**20:.0f} MiB and keeps "
                    f"{PACK_MEMORY_HEADROOM:g}x its size free",
                    file=sys.stderr,
                )
            return None
        with torch.no_grad():
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        if not self.kernels.packing_pays(weight, packed, rows):
            packed = None  # remembered: this weight keeps the unpacked kernel for these rows
        self.packed[rows] = (key, packed)
        return packed

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cpu_linear={self.kernels.setting}"


def install_cpu_linears(model: nn.Module, setting: CpuLinear = "auto") -> CpuLinears:
    """Replace every plain ``nn.Linear`` of ``model`` by a :class:`FewRowLinear` sharing its parameters.

    All of them hold one :class:`CpuLinears` with ``setting``, which is returned. Subclasses of
    ``nn.Linear`` (quantised layers) are left alone; tied weights stay tied (the same ``Parameter``).
    """
    kernels = CpuLinears(setting)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, FewRowLinear.from_linear(child, kernels))
    return kernels


def declare_rows(model: nn.Module, rows: int, head_rows: int | None = None) -> int:
    """Let every :class:`FewRowLinear` of ``model`` pack its weight for ``rows``-row products, and the output
    head (``model.get_output_embeddings()``) also for ``head_rows``.

    Packing happens lazily, at a layer's first such product, where its :class:`CpuLinears` allows it and
    it pays; it costs the weight's size in memory per row count (skipped, with a note on stderr, where the
    machine would be left with less than :data:`PACK_MEMORY_HEADROOM` times it free). 1 row and more
    than :data:`SMALL_ROWS` are never packed. Returns how many layers can pack. Idempotent.
    """
    wanted = frozenset(r for r in (rows,) if 1 < r <= SMALL_ROWS)
    count = 0
    for module in model.modules():
        if isinstance(module, FewRowLinear):
            module.packed_rows = module.packed_rows | wanted
            module.kernels.declared_rows = module.kernels.declared_rows | wanted
            count += 1
    output_embeddings = getattr(model, "get_output_embeddings", None)  # an HF model's; a bare module has no head
    head = output_embeddings() if callable(output_embeddings) else None
    if isinstance(head, FewRowLinear) and head_rows is not None and 1 < head_rows <= SMALL_ROWS:
        head.packed_rows = head.packed_rows | {head_rows}
        head.kernels.declared_head_rows = head.kernels.declared_head_rows | {head_rows}
    return count
