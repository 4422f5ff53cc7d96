"""Acceptance metrics of a draft, from the same forward as the loss (torchmetrics, DDP-safe).

For a drafting path (the backbone's argmax; for DFlash2 the selector's greedy walk over each block's top-k,
seeded with the anchor) and block offsets ``k = 1 .. bs-1``: ``acc_k`` = P(the draft token at offset ``k`` is
right), ``accept_k`` = P(offsets ``1..k`` are all right) and ``tau = 1 + sum_k accept_k``. "Right" is the target's
greedy token when its logits are at hand (online, or ``target_next`` offline), else the data token. A slot is
*counted* iff the loss trains on it (a real block, ``a + k < S``, ``loss_mask`` set), so a truncated block is
neither a rejection nor an acceptance; an offset no block reached reports 0. Selector ``coverage`` and
``accuracy``, and :class:`SelectorHealth` (``recall_k``, ``picked_k``, ``passed_over_k`` over the blocks that
reached offset ``k``), complete the greedy picture.

:class:`SampledAcceptance` (``val/t<T>/...``) estimates the acceptance under speculative sampling,
``accept_k = E[prod_{j <= k} alpha_j]`` with ``alpha_k = sum_v min(p_k(v), q_k(v))``.
Greedy states are integer counts with ``sum`` reduction (DDP adds them up exactly), sampled ones float sums;
ratios are formed in ``compute``. The definitions in full, and why the sampled estimate can differ from the
loop's τ: docs/internals.md ("The trainer's metrics"); what users read: docs/measuring-tau.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from dflash2_lightning.train.objective import ObjectiveOutput

if TYPE_CHECKING:
    from dflash2_lightning.model.sampling import Sampling


class BlockAcceptance(Metric):
    """Per-offset accuracy and acceptance of one drafting path over blocks of ``block_size``."""

    full_state_update = False
    higher_is_better = True
    # The states add_state registers (per offset), declared for the type checker.
    correct: Tensor
    counted: Tensor
    accepted: Tensor
    blocks: Tensor

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        length = block_size - 1
        self.length = length
        for name in ("correct", "counted", "accepted", "blocks"):
            self.add_state(name, default=torch.zeros(length, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, right: Tensor, valid: Tensor) -> None:
        """``right``, ``valid``: bool ``[..., L]`` per block (draft token right; slot counted)."""
        right = right.reshape(-1, self.length).bool()
        valid = valid.reshape(-1, self.length).bool()
        # Out of place on purpose: under ddp_spawn the initial states live in memory shared by all ranks,
        # where an in-place `+=` would add every rank's counts into one tensor.
        self.correct = self.correct + (right & valid).sum(0)
        self.counted = self.counted + valid.sum(0)
        self.accepted = self.accepted + torch.cumprod((right & valid).long(), dim=1).sum(0)
        self.blocks = self.blocks + torch.cumprod(valid.long(), dim=1).sum(0)

    def compute(self) -> dict[str, Tensor]:
        """``acc [L]``, ``accept [L]``, ``tau`` (0-d) and the counts behind them."""
        acc = self.correct.double() / self.counted.clamp(min=1)
        accept = self.accepted.double() / self.blocks.clamp(min=1)
        return {
            "acc": acc,
            "accept": accept,
            "tau": 1.0 + accept.sum(),
            "num_positions": self.counted.sum(),
            "num_blocks": self.blocks[0],
        }


class SampledAcceptance(Metric):
    """Expected per-offset acceptance ``alpha_k`` and acceptance curve under speculative sampling."""

    full_state_update = False
    higher_is_better = True
    # The states add_state registers (per offset), declared for the type checker.
    alpha: Tensor
    accepted: Tensor
    counted: Tensor
    blocks: Tensor

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.length = block_size - 1
        for name in ("alpha", "accepted"):
            self.add_state(name, default=torch.zeros(self.length, dtype=torch.float64), dist_reduce_fx="sum")
        for name in ("counted", "blocks"):
            self.add_state(name, default=torch.zeros(self.length, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, alpha: Tensor, valid: Tensor) -> None:
        """``alpha [..., L]``: acceptance probability of each slot; ``valid [..., L]``: slot counted."""
        alpha = alpha.reshape(-1, self.length).double()
        valid = valid.reshape(-1, self.length).bool()
        prefix = torch.cumprod(valid.long(), dim=1)  # blocks whose offsets 1..k are all counted
        survive = torch.cumprod(torch.where(valid, alpha, torch.ones_like(alpha)), dim=1)
        self.alpha = self.alpha + torch.where(valid, alpha, torch.zeros_like(alpha)).sum(0)  # out of place: see above
        self.counted = self.counted + valid.sum(0)
        self.accepted = self.accepted + (survive * prefix).sum(0)
        self.blocks = self.blocks + prefix.sum(0)

    def compute(self) -> dict[str, Tensor]:
        """``alpha [L]`` (mean acceptance probability per offset), ``accept [L]``, ``tau``."""
        alpha = self.alpha / self.counted.clamp(min=1)
        accept = self.accepted / self.blocks.clamp(min=1)
        return {"alpha": alpha, "accept": accept, "tau": 1.0 + accept.sum(), "num_blocks": self.blocks[0]}


def sampled_alpha(out: ObjectiveOutput, sampling: Any) -> dict[str, Tensor] | None:
    """Per-slot acceptance probabilities ``{path: [B, N, L]}`` under ``sampling``, or None when the
    target's distribution is not at hand (neither its logits nor a cached top-k)."""
    from dflash2_lightning.model.sampling import probabilities
    from dflash2_lightning.train.objective import gather_positions

    teacher, sources = out.teacher, out.blocks.sources
    if out.logits is None:
        raise ValueError(
            "the expected acceptance under sampling needs the draft's logits: run the objective "
            "with keep_logits=True (a chunked objective keeps none)"
        )
    with torch.no_grad():
        if teacher is not None and teacher.logits is not None:
            p = probabilities(gather_positions(teacher.logits, sources), sampling)
        elif teacher is not None and teacher.topk_values is not None and teacher.topk_indices is not None:
            # Offline: the cached top-k logits, processed and scattered back; the mass outside is missing.
            values = probabilities(gather_positions(teacher.topk_values, sources), sampling)
            p = torch.zeros(*values.shape[:-1], out.logits.shape[-1], dtype=values.dtype, device=values.device)
            p.scatter_(-1, gather_positions(teacher.topk_indices, sources).long(), values)
        else:
            return None
        q = probabilities(out.logits.detach(), sampling).to(p.dtype)
        alphas = {"backbone": torch.minimum(p, q).sum(-1)}
        if out.selector_scores is not None and out.selector_candidates is not None:
            q_sel = probabilities(out.selector_scores, sampling).to(p.dtype)  # zero outside the candidates
            alphas["selector"] = torch.minimum(p.gather(-1, out.selector_candidates), q_sel).sum(-1)
    return alphas


class SelectorAgreement(Metric):
    """Selector coverage (right token in the top-k) and teacher-forced accuracy, over counted slots."""

    full_state_update = False
    higher_is_better = True
    # The states add_state registers (0-d counts), declared for the type checker.
    covered: Tensor
    correct: Tensor
    counted: Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("covered", "correct", "counted"):
            self.add_state(name, default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, covered: Tensor, correct: Tensor, valid: Tensor) -> None:
        valid = valid.bool()
        self.covered = self.covered + (covered.bool() & valid).sum()  # out of place: see BlockAcceptance
        self.correct = self.correct + (correct.bool() & valid).sum()
        self.counted = self.counted + valid.sum()

    def compute(self) -> dict[str, Tensor]:
        total = self.counted.clamp(min=1).double()
        return {"coverage": self.covered / total, "accuracy": self.correct / total}


class SelectorHealth(Metric):
    """Per offset: how often the right token was among the selector's candidates, picked, or passed over.

    Counted over the blocks that reached the offset (every earlier offset right and counted, this one
    counted); see the module docstring.
    """

    full_state_update = False
    higher_is_better = True
    # The states add_state registers (per offset), declared for the type checker.
    reached: Tensor
    covered: Tensor
    picked: Tensor

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.length = block_size - 1
        for name in ("reached", "covered", "picked"):
            self.add_state(name, default=torch.zeros(self.length, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, right: Tensor, covered: Tensor, valid: Tensor) -> None:
        """``right`` (the walk drafted the right token), ``covered`` (it is among the candidates), ``valid``
        (slot counted): bool ``[..., L]`` per block."""
        right = right.reshape(-1, self.length).bool()
        covered = covered.reshape(-1, self.length).bool()
        valid = valid.reshape(-1, self.length).bool()
        accepted = torch.cumprod((right & valid).long(), dim=1)
        before = torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1]], dim=1).bool()
        reached = before & valid
        # Out of place: see BlockAcceptance.
        self.reached = self.reached + reached.sum(0)
        self.covered = self.covered + (reached & covered).sum(0)
        self.picked = self.picked + (reached & right).sum(0)

    def compute(self) -> dict[str, Tensor]:
        """``recall``, ``picked``, ``passed_over`` ``[L]`` (shares of ``reached``) and the ``reached`` counts."""
        total = self.reached.clamp(min=1).double()
        return {
            "recall": self.covered / total,
            "picked": self.picked / total,
            "passed_over": (self.covered - self.picked) / total,
            "reached": self.reached,
        }

    def summary(self) -> dict[str, Any]:
        """The figures as plain lists (a report's ``selector_health``; index 0 is offset 1)."""
        # reshape: torchmetrics squeezes a one-element result (block size 2) to a 0-d tensor.
        result = {name: value.reshape(-1) for name, value in self.compute().items()}
        return {
            "reached": [int(x) for x in result["reached"]],
            **{name: [float(x) for x in result[name]] for name in ("recall", "picked", "passed_over")},
        }


class DraftMetrics(nn.Module):
    """The backbone path, the selector path (DFlash2) and the selector's agreement, logged together.

    ``update(out)`` takes an :class:`~dflash2_lightning.train.objective.ObjectiveOutput`; ``compute()``
    returns a flat ``{name: float}`` dict under ``prefix`` (``val/backbone/acc_1``, ``val/tau`` ...);
    ``val/tau`` is the path a server drafts with (the selector's for DFlash2, else the backbone's).
    Call ``reset()`` after logging.
    """

    def __init__(self, block_size: int, selector: bool, prefix: str = "val", sampling: Sampling | None = None) -> None:
        super().__init__()
        self.prefix = prefix
        self.backbone = BlockAcceptance(block_size)
        self.selector = BlockAcceptance(block_size) if selector else None
        self.agreement = SelectorAgreement() if selector else None
        self.health = SelectorHealth(block_size) if selector else None
        # The expected acceptance under sampling, per path.
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.sampled = (
            nn.ModuleDict(
                {x: SampledAcceptance(block_size) for x in (["backbone", "selector"] if selector else ["backbone"])}
            )
            if self.sampling is not None
            else None
        )

    def update(self, out: ObjectiveOutput) -> None:
        valid = out.blocks.valid
        self.backbone.update(out.draft_tokens == out.reference, valid)
        if self.selector is not None and out.selector_tokens is not None:
            self.selector.update(out.selector_tokens == out.reference, valid)
            if self.health is not None and out.covered is not None:
                self.health.update(out.selector_tokens == out.reference, out.covered, valid)
        if self.agreement is not None and out.covered is not None and out.selector_correct is not None:
            self.agreement.update(out.covered, out.selector_correct, valid)
        if self.sampled is not None:
            alphas = sampled_alpha(out, self.sampling) or {}
            sampled = self.sampled_metrics()
            for path, alpha in alphas.items():
                if path in sampled:
                    sampled[path].update(alpha, valid)

    def compute(self) -> dict[str, float]:
        """Flat metric values (synchronised across DDP ranks)."""
        p = self.prefix
        values: dict[str, float] = {}
        paths = {"backbone": self.backbone.compute()}
        if self.selector is not None:
            paths["selector"] = self.selector.compute()
        for path, result in paths.items():
            for k, (acc, accept) in enumerate(zip(result["acc"].tolist(), result["accept"].tolist()), start=1):
                values[f"{p}/{path}/acc_{k}"] = acc
                values[f"{p}/{path}/accept_{k}"] = accept
            values[f"{p}/{path}/tau"] = float(result["tau"])
        values[f"{p}/num_positions"] = float(paths["backbone"]["num_positions"])
        values[f"{p}/num_blocks"] = float(paths["backbone"]["num_blocks"])
        if self.agreement is not None:
            agreement = self.agreement.compute()
            values[f"{p}/selector/coverage"] = float(agreement["coverage"])
            values[f"{p}/selector/accuracy"] = float(agreement["accuracy"])
        if self.health is not None:
            health = self.health.compute()
            for name in ("recall", "picked", "passed_over"):
                for k, share in enumerate(health[name].tolist(), start=1):
                    values[f"{p}/selector/{name}_{k}"] = share
        values[f"{p}/tau"] = values[f"{p}/selector/tau" if self.selector is not None else f"{p}/backbone/tau"]
        sampled = self.sampled_metrics()
        if self.sampling is not None and sampled and int(sampled["backbone"].blocks[0]) > 0:
            t = f"{p}/t{self.sampling.temperature:g}"
            for path, metric in sampled.items():
                result = metric.compute()
                for k, (alpha, accept) in enumerate(zip(result["alpha"].tolist(), result["accept"].tolist()), 1):
                    values[f"{t}/{path}/alpha_{k}"] = alpha
                    values[f"{t}/{path}/accept_{k}"] = accept
                values[f"{t}/{path}/tau"] = float(result["tau"])
            values[f"{t}/tau"] = values[f"{t}/selector/tau" if "selector" in sampled else f"{t}/backbone/tau"]
        return values

    def sampled_metrics(self) -> dict[str, SampledAcceptance]:
        """The expected acceptance under sampling per path (``{}`` at greedy sampling)."""
        # The ModuleDict holds only SampledAcceptance metrics; its items are typed as plain modules.
        return {path: cast(SampledAcceptance, metric) for path, metric in (self.sampled or {}).items()}

    def reset(self) -> None:
        for metric in (self.backbone, self.selector, self.agreement, self.health, *self.sampled_metrics().values()):
            if metric is not None:
                metric.reset()


def acceptance_curves(values: dict[str, float], prefix: str = "val") -> dict[str, dict[str, list[float]]]:
    """``{path: {"acc": [...], "accept": [...]}}`` read back from :meth:`DraftMetrics.compute` output."""
    curves: dict[str, dict[str, list[float]]] = {}
    for path in ("backbone", "selector"):
        for kind in ("acc", "accept"):
            series = []
            k = 1
            while f"{prefix}/{path}/{kind}_{k}" in values:
                series.append(values[f"{prefix}/{path}/{kind}_{k}"])
                k += 1
            if series:
                curves.setdefault(path, {})[kind] = series
    return curves


def plot_acceptance(
    values: dict[str, float], path: str | os.PathLike, title: str = "", prefix: str = "val", close: bool = True
):
    """Write a PNG of ``accept_k`` (solid) and ``acc_k`` (dashed) for each path; returns the figure.

    Written to a temporary file and renamed, so a reader never sees half a PNG. With ``close=False``
    the figure stays open for the caller (e.g. TensorBoard's ``add_figure``, which closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash2_lightning.files import atomic_write

    curves = acceptance_curves(values, prefix)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    colors = {"backbone": "tab:blue", "selector": "tab:orange"}
    for name, curve in curves.items():
        ks = list(range(1, len(curve["accept"]) + 1))
        tau = values.get(f"{prefix}/{name}/tau", float("nan"))
        ax.plot(ks, curve["accept"], "-o", color=colors[name], ms=3, label=f"{name} accept_k (tau {tau:.2f})")
        ax.plot(ks, curve["acc"], "--", color=colors[name], alpha=0.6, label=f"{name} acc_k")
    ax.set_xlabel("block offset k")
    ax.set_ylabel("probability")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "draft acceptance")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    if close:
        plt.close(fig)
    return fig
