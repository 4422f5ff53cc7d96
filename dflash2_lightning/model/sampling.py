"""Speculative *sampling*: the math that makes a sampled speculative loop lossless.

At ``temperature > 0`` the target's next token is drawn from ``p = process(target logits)`` and the draft's
proposal from ``q = process(draft scores)``, both processed by the same :class:`Sampling` settings (temperature,
then top-k, then top-p, the order Hugging Face and vLLM apply them). A proposal ``d_1 .. d_L`` is verified with the
standard rule (Leviathan et al. 2023, Chen et al. 2023): accept ``d_i`` with probability
``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection emit a token from ``norm(max(p_i - q_i, 0))`` and stop;
after a fully accepted block emit a bonus token from ``p_{L+1}``. Every emitted token is then distributed exactly
as the target's own sample, whatever ``q`` is, provided ``q_i`` is the distribution ``d_i`` was *actually* drawn
from: independent per position for the backbone (DFlash), conditional on the sampled predecessor for the
selector's walk over the top-k lattice (DFlash2). A proposal carries ``q`` over the whole vocabulary
(``[L, V]``), so one rejection rule serves both paths.

Every random choice is one call of :func:`draw` on explicit probabilities, so a test can replace it and enumerate
every outcome of the loop with its exact probability. ``temperature == 0`` never reaches this module. A rejection
whose residual has no mass (``p == q`` up to rounding) falls back to ``p``. What ``q`` is per path, and where it
departs from the z-lab reference: docs/internals.md ("Speculative sampling").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dflash2_lightning.model.selector import CandidateSelector


@dataclass(frozen=True)
class Sampling:
    """Sampling settings shared by the target and the draft.

    Args:
        temperature: ``0`` = greedy (argmax); ``> 0`` divides the logits before the softmax.
        top_p: nucleus mass in ``(0, 1]``; keeps the smallest set of most likely tokens whose mass
            reaches ``top_p`` (``1`` keeps all).
        top_k: keep the ``top_k`` most likely tokens (``0`` keeps all).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        from dflash2_lightning.errors import ConfigError  # a ValueError: the user's setting, a one-line error

        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ConfigError(f"temperature={self.temperature!r} is invalid: must be a finite number >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p={self.top_p!r} is invalid: must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} is invalid: must be an integer >= 0 (0 = no top-k)")

    @property
    def greedy(self) -> bool:
        """True at temperature 0: argmax decoding, no randomness."""
        return self.temperature == 0


def probabilities(scores: Tensor, sampling: Sampling) -> Tensor:
    """Processed probabilities over the last dim of ``scores`` (temperature, top-k, top-p).

    Computed in at least float32 (float64 scores stay float64). Tokens cut by top-k/top-p get exactly
    0. Ties at the top-k boundary keep the lower index (``topk`` on a stable order); top-p keeps a token
    while the mass of the tokens ranked before it is below ``top_p``, so the most likely token always
    stays.
    """
    if sampling.greedy:
        raise ValueError("temperature=0 is greedy decoding: there is no sampling distribution to process")
    dtype = torch.promote_types(scores.dtype, torch.float32)
    x = scores.to(dtype) / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab or sampling.top_p < 1:
        order = torch.sort(x, dim=-1, descending=True, stable=True)
        ranked = order.values
        if 0 < sampling.top_k < vocab:
            ranked = ranked.clone()
            ranked[..., sampling.top_k :] = -math.inf
        probs_ranked = torch.softmax(ranked, dim=-1)
        if sampling.top_p < 1:
            before = probs_ranked.cumsum(-1) - probs_ranked
            probs_ranked = torch.where(before < sampling.top_p, probs_ranked, torch.zeros_like(probs_ranked))
            probs_ranked = probs_ranked / probs_ranked.sum(-1, keepdim=True)
        return torch.zeros_like(probs_ranked).scatter(-1, order.indices, probs_ranked)
    return torch.softmax(x, dim=-1)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One sample per row of ``probs [..., V]`` -> int64 ``[...]``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass
class Proposal:
    """A sampled draft block: ``tokens [B, L]`` and the distributions ``probs [B, L, V]`` they came from."""

    tokens: Tensor
    probs: Tensor


def sample_backbone(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> Proposal:
    """DFlash proposal: each position of ``logits [B, L, V]`` sampled independently from its processed distribution."""
    q = probabilities(logits, sampling)
    return Proposal(draw(q, generator), q)


def sample_selector_walk(
    selector: CandidateSelector,
    logits: Tensor,
    hidden: Tensor,
    anchor: Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> Proposal:
    """DFlash2 proposal: a sampled walk through the top-k lattice of ``logits [B, L, V]``.

    Step ``i`` scores position ``i``'s candidates after the sampled predecessor (the anchor ``[B]`` at
    step 1) with :meth:`CandidateSelector.score_candidates` and draws one from the processed softmax of
    those scores. The returned ``probs`` hold each step's candidate probabilities at the candidates' ids.
    """
    unary, cand = logits.topk(selector.top_k, dim=-1)  # the same candidates (and order) as the greedy walk
    b, length, _ = cand.shape
    predecessor = anchor.reshape(b)
    q = torch.zeros(logits.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    tokens = []
    for i in range(length):
        scores = selector.score_candidates(cand[:, i], unary[:, i], hidden[:, i], predecessor)
        q_cand = probabilities(scores, sampling)  # [B, K]
        pick = draw(q_cand, generator)  # [B]
        q[:, i].scatter_(-1, cand[:, i], q_cand.to(q.dtype))
        predecessor = cand[:, i].gather(-1, pick[:, None])[:, 0]
        tokens.append(predecessor)
    return Proposal(torch.stack(tokens, dim=1), q)


def verify(drafts: Tensor, q: Tensor, p: Tensor, generator: torch.Generator | None = None) -> tuple[int, int]:
    """The rejection rule for one block of one sequence.

    Args:
        drafts: the proposed tokens ``[L]``.
        q: the distributions they were drawn from ``[L, V]``.
        p: the target's processed distributions ``[L + 1, V]`` at the anchor and the drafts
            (``p[i]`` predicts the token after ``drafts[:i]``).

    Returns ``(accepted, token)``: how many drafts were accepted, and the token emitted after them
    (from the residual at the first rejection, else the bonus from ``p[L]``).
    """
    length = drafts.shape[0]
    if q.shape[0] != length or p.shape[0] != length + 1:
        raise ValueError(
            f"shapes drafts {tuple(drafts.shape)}, q {tuple(q.shape)}, p {tuple(p.shape)} are "
            "inconsistent: need q [L, V] and p [L + 1, V] for L drafts"
        )
    idx = drafts[:, None].to(p.device)
    p_d = p[:-1].gather(-1, idx)[:, 0].tolist()
    q_d = q.to(p.dtype).gather(-1, idx)[:, 0].tolist()
    for i in range(length):
        # Accept with probability min(1, p/q) (q > 0 for a token drawn from q); every draw goes through
        # draw(), so the loop's randomness is one sequence of categorical choices.
        ratio = p_d[i] / q_d[i] if q_d[i] > 0 else 0.0
        if ratio >= 1 or int(draw(torch.tensor([1.0 - ratio, ratio], dtype=p.dtype, device=p.device), generator)) == 1:
            continue
        residual = (p[i] - q[i].to(p.dtype)).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else p[i]
        return i, int(draw(residual, generator))
    return length, int(draw(p[length], generator))


# Candidates per row that :func:`draw_rows` sorts: a top-p nucleus of a trained LM at T <= 1 almost always lies
# inside them; rows whose nucleus does not fall back to the full sort.
ROW_CANDIDATES = 256


def draw_rows(
    scores: Tensor, sampling: Sampling, generators: list[torch.Generator | None], uniforms: Tensor | None = None
) -> Tensor:
    """One token per row of ``scores [B, V]`` from ``probabilities(scores, sampling)``, row ``i`` by ``generators[i]``.

    A batched inverse-CDF draw (one uniform per row from its own generator), for generation's large batches,
    where a full-vocabulary sort and a ``multinomial`` per row cost more than the model's forward. A top-k /
    top-p cut is computed from each row's :data:`ROW_CANDIDATES` most likely tokens; a row whose nucleus
    (or a tie at the cut) reaches past them takes the full :func:`probabilities`. The kept tokens and their
    probabilities are those of :func:`probabilities` (up to rounding); the draws are not ``multinomial``'s.
    ``uniforms [B]`` in ``[0, 1)`` replaces the generators' draws (tests).
    """
    if sampling.greedy:
        raise ValueError("temperature=0 is greedy decoding: there is no sampling distribution to draw from")
    rows, vocab = scores.shape
    if uniforms is None:
        uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    uniforms = uniforms.to(torch.float64)
    out = torch.empty(rows, dtype=torch.long)
    limit = sampling.top_k if 0 < sampling.top_k < vocab else vocab  # tokens top-k leaves
    width = min(limit, ROW_CANDIDATES)
    full = torch.ones(rows, dtype=torch.bool)
    if (sampling.top_p < 1 or limit == width) and width < vocab:  # a cut the candidates may hold
        x = scores.to(torch.promote_types(scores.dtype, torch.float32)) / sampling.temperature
        values, index = torch.topk(x, width + 1, dim=-1)  # one more: to see a tie at the cut
        probs = torch.exp(values[:, :width] - torch.logsumexp(x, dim=-1, keepdim=True)).double()
        if limit == width:  # top-k inside the candidates: renormalise over them, as probabilities() does
            probs = probs / probs.sum(-1, keepdim=True)
        keep = probs.cumsum(-1) - probs < sampling.top_p  # the mass ranked before a token is below top_p
        kept = keep.sum(-1)  # >= 1: nothing is ranked before the first token
        # The cut lies inside the candidates (or is the top-k itself), and the first cut token is strictly
        # less likely than the last kept one (a tie there is the full stable sort's to break).
        inside = (kept < width) | (limit == width)
        untied = values.gather(-1, kept[:, None]) < values.gather(-1, (kept - 1)[:, None])
        ok = inside & untied.squeeze(-1)
        cdf = torch.where(keep, probs, torch.zeros_like(probs)).cumsum(-1)
        pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
        pick = torch.minimum(pick, kept - 1)  # a uniform lost in rounding past the last kept token
        out[ok] = index.gather(-1, pick[:, None]).squeeze(-1)[ok]
        full = ~ok
    if bool(full.any()):
        probs = probabilities(scores[full], sampling).double()
        cdf = probs.cumsum(-1)
        pick = torch.searchsorted(cdf, (uniforms[full] * cdf[:, -1])[:, None], right=True).squeeze(-1)
        last_kept = vocab - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
        out[full] = torch.minimum(pick, last_kept)
    return out
