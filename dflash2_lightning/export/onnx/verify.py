"""Check an exported drafter against the torch draft with onnxruntime.

For each (batch, context) case: random target features and per-row position offsets go through ``context``
(K/V compared with :meth:`DraftModel.context_kv`); onnxruntime's K/V are then written into a preallocated
:class:`~dflash2_lightning.model.DraftCache` whose capacity exceeds the context and whose unused slots hold
garbage, and ``draft_step`` runs over those buffers with the valid ``length`` (hidden compared with the torch
block, tokens with :meth:`DraftModel.draft_block`): a step that read a slot past ``length`` would fail here.

Tolerances (:data:`TOLERANCES`): float32 differs only in summation order, so values agree within
``1e-4 + 1e-4 * |torch|`` and tokens exactly; float16 is judged against torch float32 (onnxruntime's worst error
at most twice torch float16's plus ``1e-2``), tokens compared up to each row's first near-tie; bfloat16 graphs are
checked for structure only (onnxruntime's CPU provider has no bf16 kernels). The reasoning: docs/internals.md
("ONNX verification").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from dflash2_lightning.export.onnx.drafter import TORCH_DTYPES, OrtDrafter, read_manifest
from dflash2_lightning.export.onnx.graphs import DraftStepGraph, eval_copy
from dflash2_lightning.model import ContextKV, DraftModel
from dflash2_lightning.ops import edge_scores


@dataclass(frozen=True)
class Tolerance:
    """How close onnxruntime must be to torch.

    Without ``error_ratio``: ``|ort - torch| <= atol + rtol * |torch|`` elementwise (same dtype).
    With it: ``max|ort - torch32| <= error_ratio * max|torch - torch32| + atol`` (low precision).
    Tokens are compared up to the first position whose top-2 gap is below ``tie_atol + tie_rtol * |best|``.
    """

    atol: float
    rtol: float = 0.0
    error_ratio: float | None = None
    tie_atol: float = 0.0
    tie_rtol: float = 0.0

    def describe(self) -> str:
        values = (
            f"max err <= {self.error_ratio:g} x torch's own err vs float32 + {self.atol:g}"
            if self.error_ratio
            else f"atol {self.atol:g} rtol {self.rtol:g}"
        )
        tokens = (
            "tokens exact"
            if not self.tie_atol
            else f"tokens up to the first near-tie (gap < {self.tie_atol:g} + {self.tie_rtol:g} |best|)"
        )
        return f"{values}; {tokens}"


TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4),
    "fp16": Tolerance(atol=1e-2, error_ratio=2.0, tie_atol=5e-2, tie_rtol=1e-2),
}


@dataclass
class CaseResult:
    """One (batch, context) case: worst errors and token agreement."""

    batch: int
    context: int
    kv_error: float
    hidden_error: float | None
    tokens_compared: int
    tokens_total: int
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass
class VerifyReport:
    """All cases of :func:`verify_export`."""

    dtype: str
    tolerance: Tolerance | None
    cases: list[CaseResult]
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cases)

    def describe(self) -> str:
        if not self.cases:
            return f"verification ({self.dtype}): {self.note}"
        if self.tolerance is None:  # verify_export compares cases only within a tolerance
            raise ValueError(f"a verification of {len(self.cases)} case(s) without its tolerance")
        lines = [f"onnxruntime vs torch ({self.dtype}; {self.tolerance.describe()}):"]
        for c in self.cases:
            hidden = "-" if c.hidden_error is None else f"{c.hidden_error:.2e}"
            lines.append(
                f"  batch {c.batch:>2} context {c.context:>4}: kv err {c.kv_error:.2e}, hidden err {hidden}, "
                f"tokens {c.tokens_compared}/{c.tokens_total} compared, "
                + ("ok" if c.ok else "MISMATCH: " + "; ".join(c.mismatches))
            )
        return "\n".join(lines + ([self.note] if self.note else []))


def _max_err(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _within(ort: Tensor, same: Tensor, fp32: Tensor | None, tol: Tolerance) -> tuple[float, bool]:
    """Max |ort - torch| (same dtype) and whether ``ort`` passes ``tol`` (see :class:`Tolerance`)."""
    err = _max_err(ort, same)
    if tol.error_ratio is None or fp32 is None:
        bound = tol.atol + tol.rtol * same.double().abs()
        return err, bool(((ort.double() - same.double()).abs() <= bound).all())
    return err, _max_err(ort, fp32) <= tol.error_ratio * _max_err(same, fp32) + tol.atol


@torch.no_grad()
def choice_margins(draft: DraftModel, hidden: Tensor, anchor: Tensor, head: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """Torch's tokens ``[B, L]`` and, per position, its best score and the gap to the second best.

    DFlash: the top-2 logit gap. DFlash2: the top-2 gap of the edge-score row the walk reads.
    """
    logits = head(hidden).float()
    if draft.candidate_selector is None:
        top = logits.topk(2, dim=-1)
        return top.indices[..., 0], top.values[..., 0], top.values[..., 0] - top.values[..., 1]
    sel = draft.candidate_selector
    unary, cand = head(hidden).topk(sel.top_k, dim=-1)
    scores = edge_scores(
        cand, unary, sel.hidden_projection(hidden), anchor, sel.predecessor_codebook, sel.successor_codebook
    )
    b, length, k, _ = scores.shape
    choice = torch.zeros(b, dtype=torch.long)
    rows = torch.arange(b)
    tokens, margins = torch.empty(b, length, dtype=torch.long), torch.full((b, length), float("inf"))
    best = torch.empty(b, length)
    for pos in range(length):
        row = scores[rows, pos, choice]
        best[:, pos] = row.max(-1).values
        if k > 1:
            top = row.topk(2, dim=-1).values
            margins[:, pos] = top[:, 0] - top[:, 1]
        choice = row.argmax(-1)
        tokens[:, pos] = cand[rows, pos, choice]
    return tokens, best, margins


def _compare_tokens(
    ort_tokens: Tensor, torch_tokens: Tensor, margins: Tensor, best: Tensor, tol: Tolerance
) -> tuple[int, list[str]]:
    compared, problems = 0, []
    for row in range(torch_tokens.shape[0]):
        for pos in range(torch_tokens.shape[1]):
            if tol.tie_atol > 0 and margins[row, pos] < tol.tie_atol + tol.tie_rtol * abs(float(best[row, pos])):
                break  # a near-tie: either choice is right, and the walk differs after it
            compared += 1
            if int(ort_tokens[row, pos]) != int(torch_tokens[row, pos]):
                problems.append(
                    f"row {row} offset {pos + 1}: onnxruntime {int(ort_tokens[row, pos])} != torch "
                    f"{int(torch_tokens[row, pos])} (torch margin {float(margins[row, pos]):.3g})"
                )
                break
    return compared, problems


class _TorchSide:
    """The torch draft, embedding and head copied into one dtype, run as the exported graphs run."""

    def __init__(self, draft: DraftModel, embed: nn.Module, head: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.draft, self.embed, self.head = eval_copy(draft, dtype), eval_copy(embed, dtype), eval_copy(head, dtype)
        self.step = DraftStepGraph(self.draft, self.embed, self.head).eval()

    def run(self, features: Tensor, positions: Tensor, anchor: Tensor, start: Tensor) -> tuple[ContextKV, Tensor]:
        cache = self.draft.context_kv(features.to(self.dtype), positions)
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        length = torch.full((features.shape[0],), cache.length, dtype=torch.long)
        return cache, self.step(kv, length, anchor, start, cache.positions)[1]


@torch.no_grad()
def verify_export(
    directory: str | os.PathLike,
    draft: DraftModel,
    embed: nn.Module,
    head: nn.Module,
    cases: tuple[tuple[int, int], ...] = ((1, 5), (3, 19)),
    seed: int = 0,
    drafter: OrtDrafter | None = None,
) -> VerifyReport:
    """Compare the exported graphs in ``directory`` with the torch ``draft`` (``embed``/``head`` = the target's).

    The torch side runs in the export's dtype. Raises nothing: read :attr:`VerifyReport.ok`.
    """
    manifest = read_manifest(directory)
    dtype = manifest["dtype"]
    if dtype not in TOLERANCES:
        return VerifyReport(
            dtype,
            None,
            [],
            note=f"{dtype}: onnxruntime's CPU provider has no {dtype} kernels "
            "(MatMul, Add, ...); checked structure only (checker + shape inference)",
        )
    tol, torch_dtype = TOLERANCES[dtype], TORCH_DTYPES[dtype]
    drafter = drafter or OrtDrafter(Path(directory), threads=1)  # small checks: no thread-pool spin
    # Copies in the export's dtype (and float32 for low precision): the caller's modules stay as they are.
    same = _TorchSide(draft, embed, head, torch_dtype)
    fp32 = _TorchSide(draft, embed, head, torch.float32) if torch_dtype != torch.float32 else None
    cfg = draft.config
    gen = torch.Generator().manual_seed(seed)
    results = []
    for batch, context in cases:
        features = torch.randn(batch, context, cfg.num_target_features * cfg.hidden_size, generator=gen)
        positions = torch.randint(0, 64, (batch, 1), generator=gen) + torch.arange(context)  # per-row offsets
        anchor = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        start = positions[:, -1] + 1
        ort_cache = drafter.context_kv(features, positions)
        buffers = drafter.new_cache(batch, context + 5)
        for buffer in buffers.keys + buffers.values:  # finite garbage past the valid length
            buffer.copy_(1e3 * torch.randn(buffer.shape, generator=gen))
        buffers.slot_positions.copy_(torch.randint(0, 64, buffers.slot_positions.shape, generator=gen))
        outputs = drafter.draft_step(anchor, buffers.append(ort_cache), start)
        ref_cache, ref_hidden = same.run(features, positions, anchor, start)
        ref32 = fp32.run(features, positions, anchor, start) if fp32 else None
        problems: list[str] = []
        kv_err, kv_ok = 0.0, True
        for i, (o, r) in enumerate(zip(ort_cache.layers, ref_cache.layers)):
            for name, a, e in (("k", o.keys, r.keys), ("v", o.values, r.values)):
                e32 = None if ref32 is None else getattr(ref32[0].layers[i], "keys" if name == "k" else "values")
                err, ok = _within(a, e, e32, tol)
                kv_err, kv_ok = max(kv_err, err), kv_ok and ok
        if not kv_ok:
            problems.append(f"context K/V beyond tolerance (max err {kv_err:.3g})")
        hidden_err = None
        if len(outputs) > 1:
            hidden_err, ok = _within(outputs[1], ref_hidden, None if ref32 is None else ref32[1], tol)
            if not ok:
                problems.append(f"hidden beyond tolerance (max err {hidden_err:.3g})")
        ref_tokens = same.draft.draft_block(anchor, ref_cache, same.embed, same.head, start)
        _, best, margins = choice_margins(same.draft, ref_hidden, anchor, same.head)
        compared, token_problems = _compare_tokens(outputs[0], ref_tokens, margins, best, tol)
        results.append(
            CaseResult(batch, context, kv_err, hidden_err, compared, ref_tokens.numel(), problems + token_problems)
        )
    return VerifyReport(dtype, tol, results)
