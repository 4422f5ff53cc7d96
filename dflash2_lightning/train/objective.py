"""The DFlash / DFlash2 training objective: anchors, block layout, attention mask, losses.

One training step, top to bottom (``B`` samples of length ``S``, ``N`` anchors, block size ``bs``,
``L = bs - 1`` draft slots per block)::

    loss_mask [B,S] --sample_anchors--> anchors a [B,N], keep [B,N]   (fresh every step, seeded)
    input_ids, a ----layout_blocks----> block tokens [anchor, MASK x L] at positions a..a+bs-1,
                                        labels input_ids[a+k], weights keep*[a+k<S]*loss_mask[a+k] (k >= 1)
    a ---------block_attention_mask---> bool [B,1,N*bs,S+N*bs]: block n sees context j < a_n, and itself
    features --draft.context_kv--> ctx;  embed(block tokens) --draft(ctx, mask)--> hidden --head--> logits
    logits, labels/teacher -----------> token loss (hard CE or soft distillation), position weights
    top-k(logits), selector ----------> selector loss over the candidates, teacher-forced predecessor

    (above LOGITS_CHUNK_ELEMENTS logits: head, token loss, argmax, top-k and the gold logit per chunk of
    slots, each chunk's logits recomputed in backward instead of kept: see "Chunked logits" below)

Slot 0 of a block (the anchor) is never supervised: it is the token the target just verified. Slot
``k >= 1`` predicts ``input_ids[a + k]``; its teacher is the target's distribution at ``a + k - 1``
(the position whose next-token prediction it is), and its teacher-forced predecessor for the selector
is ``input_ids[a + k - 1]`` (the anchor itself for ``k = 1``). The draft runs once on all blocks.

Teacher for soft distillation
    Online the target's full logits are at hand. Offline the cache keeps the target's top-k logits per
    position (``teacher_topk_values``/``teacher_topk_indices``); the teacher is then the *renormalised
    sparse* distribution ``softmax(values)`` over those k tokens (zero elsewhere). The values may be
    logits or log-probabilities: softmax is invariant to the constant between them. The cross entropy
    ``-sum_j p_j log q(idx_j)`` is exact for that truncated teacher.

Chunked logits
    At the recipe's size (256 anchors x 15 slots x 151,936 tokens) the draft's logits, their float32 copy
    and the cross entropy's saved softmax take ~7-8 GB. Above :data:`LOGITS_CHUNK_ELEMENTS` logits the
    head and everything taken from the logits (per-slot token loss, argmax, the selector's top-k and the
    gold token's logit) run chunk by chunk over the slots under activation checkpointing: only the small
    per-slot results are kept, and backward recomputes one chunk's logits at a time. Every per-slot
    result is a function of its own row, so the chunked loss equals the one-piece loss up to the head
    matmul's rounding; a problem at or below the threshold (every shipped CPU config) runs in one piece,
    exactly as before. ``ObjectiveOutput.logits`` is then None unless ``keep_logits=True`` asks for it.

Gold token outside the selector's top-k (``gold_outside_topk``)
    ``"insert_last"``: the gold token replaces the last candidate with its true draft logit as unary
    (the candidate set the loss sees then always holds the gold); ``"drop"``: the position contributes
    nothing to the selector loss. Either way the *metrics* use the unmodified top-k, i.e. what
    inference sees.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2_lightning.errors import UserError, check
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.model.selector import CandidateSelector

TokenLoss = Literal["ce", "kd"]
LabelSource = Literal["data", "target"]
PositionWeighting = Literal["none", "decay", "dpace"]
GoldOutsideTopK = Literal["insert_last", "drop"]
Fn = Callable[[Tensor], Tensor]


# Logits elements (slots x vocabulary) above which the head and its losses run in chunks of at most this many
# elements: 2**26 = 256 MiB per float32 copy of a chunk. The shipped CPU configs stay below it (tiny: 0.46 M,
# quickstart: 19 M) and so run in one piece; the 8B recipe (583 M per sample) runs in ~9 chunks of 441 slots.
LOGITS_CHUNK_ELEMENTS = 2**26


class ObjectiveError(UserError, ValueError):
    """An objective setting or a batch is outside its allowed range (the message names field and bound)."""


KD_NEEDS_TEACHER = (
    "token_loss='kd' needs the target's logits (online) or the cached "
    "teacher_topk_values/teacher_topk_indices (offline); the batch has neither"
)


# ----------------------------------------------------------------------------- anchors
def sample_anchors(
    loss_mask: Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample block anchors from the supervised positions ``p`` in ``[0, S - block_size]``.

    Per sample, without replacement, uniformly among its candidates; ``N = min(num_anchors, most
    candidates of any sample in the batch)`` (at least 1). Samples with fewer candidates than ``N`` get
    padded entries marked ``keep = False``. Anchors are returned sorted ascending.

    The random keys are drawn on the CPU from ``generator`` (one generator for the batch, or one per
    sample), so a given seed gives the same anchors on any device, and a resumed run re-creates them.

    Returns ``(anchors [B, N] long, keep [B, N] bool)``.
    """
    if loss_mask.dim() != 2:
        raise ObjectiveError(f"loss_mask has shape {tuple(loss_mask.shape)}: must be [batch, seq_len]")
    b, s = loss_mask.shape
    if s < block_size:
        raise ObjectiveError(f"seq_len={s} is invalid: must be >= block_size={block_size}")
    if num_anchors < 1:
        raise ObjectiveError(f"num_anchors={num_anchors} is invalid: must be >= 1")
    span = s - block_size + 1  # anchors p in [0, S - bs]: a whole block fits in the sequence
    candidate = loss_mask[:, :span].bool().cpu()
    if generator is None or isinstance(generator, torch.Generator):
        keys = torch.rand(b, span, generator=generator)
    else:
        if len(generator) != b:
            raise ObjectiveError(f"got {len(generator)} generators for a batch of {b}: need one per sample")
        keys = torch.stack([torch.rand(span, generator=g) for g in generator])
    keys = torch.where(candidate, keys, torch.full_like(keys, 2.0))  # non-candidates sort last
    n = max(1, min(num_anchors, int(candidate.sum(1).max())))
    chosen_keys, chosen = keys.topk(n, dim=1, largest=False)
    keep = chosen_keys < 2.0
    # Sort kept anchors ascending; padded entries go last and point at position 0.
    chosen = torch.where(keep, chosen, torch.full_like(chosen, s))
    chosen, order = chosen.sort(dim=1)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen))
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


# ----------------------------------------------------------------------------- block layout
@dataclass
class Blocks:
    """The block layout of one batch. ``L = block_size - 1`` supervised slots per block.

    Attributes:
        anchors: ``[B, N]`` anchor positions; ``keep`` ``[B, N]`` marks real (not padded) blocks.
        tokens: ``[B, N*bs]`` block input ids: the anchor token then ``mask_token_id`` x L.
        positions: ``[B, N*bs]`` absolute positions ``a_n + k``.
        labels: ``[B, N, L]`` data token ``input_ids[a + k]`` of slots ``k = 1..L``.
        predecessors: ``[B, N, L]`` teacher-forced previous token ``input_ids[a + k - 1]``.
        sources: ``[B, N, L]`` position ``a + k - 1`` whose next-token prediction slot ``k`` is.
        valid: ``[B, N, L]`` bool ``keep * [a + k < S] * loss_mask[a + k]``: slots that are supervised
            and counted by the metrics.
    """

    anchors: Tensor
    keep: Tensor
    tokens: Tensor
    positions: Tensor
    labels: Tensor
    predecessors: Tensor
    sources: Tensor
    valid: Tensor

    @property
    def block_size(self) -> int:
        return self.labels.shape[-1] + 1

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]


def layout_blocks(
    input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, keep: Tensor, block_size: int, mask_token_id: int
) -> Blocks:
    """Lay out ``[anchor, MASK x (bs-1)]`` blocks at ``anchors`` and gather their labels and weights."""
    b, s = input_ids.shape
    n = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors[:, :, None] + offsets  # [B, N, bs]
    in_bounds = positions < s
    clamped = positions.clamp(max=s - 1)
    flat = clamped.reshape(b, -1)
    ids_at = input_ids.gather(1, flat).reshape(b, n, block_size)
    supervised = loss_mask.bool().gather(1, flat).reshape(b, n, block_size)
    tokens = torch.full_like(ids_at, mask_token_id)
    tokens[:, :, 0] = ids_at[:, :, 0]
    valid = keep[:, :, None] & in_bounds & supervised
    return Blocks(
        anchors=anchors,
        keep=keep,
        tokens=tokens.reshape(b, -1),
        positions=positions.reshape(b, -1),
        labels=ids_at[:, :, 1:],
        predecessors=ids_at[:, :, :-1],
        sources=clamped[:, :, :-1],
        valid=valid[:, :, 1:],  # slot 0 (the anchor) is never supervised
    )


def block_attention_mask(
    anchors: Tensor,
    seq_len: int,
    block_size: int,
    attention_mask: Tensor | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Boolean ``[B, 1, N*bs, S + N*bs]`` mask (True = attend) for ``N`` blocks over an ``S``-long context.

    A query in block ``n`` sees context position ``j`` iff ``j < a_n`` (strictly before its anchor),
    ``attention_mask[j]`` (not padding) and, with a sliding window, ``j > a_n + k - window``; it sees
    every position of its own block (non-causal) and nothing of any other block. Every row attends to
    at least its own block, so no row is fully masked (a fully masked row would give NaN).
    """
    b, n = anchors.shape
    q = n * block_size
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    context = torch.arange(seq_len, device=device)
    sees_context = context[None, None, :] < query_anchor[:, :, None]  # [B, Q, S]
    if attention_mask is not None:
        sees_context = sees_context & attention_mask.bool()[:, None, :]
    if sliding_window is not None:
        query_pos = query_anchor + torch.arange(block_size, device=device).repeat(n)
        sees_context = sees_context & (context[None, None, :] > query_pos[:, :, None] - sliding_window)
    block_id = torch.arange(q, device=device) // block_size
    sees_block = (block_id[:, None] == block_id[None, :]).expand(b, q, q)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


# ----------------------------------------------------------------------------- losses
def gather_positions(x: Tensor, index: Tensor) -> Tensor:
    """``x [B, S, ...]`` gathered at ``index [B, N, L]`` -> ``[B, N, L, ...]``."""
    b = x.shape[0]
    rows = torch.arange(b, device=x.device)[:, None, None]
    return x[rows, index]


def hard_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-slot CE ``[...]`` of ``logits [..., V]`` against ``labels [...]`` (computed in float32)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)


def soft_cross_entropy(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Per-slot ``-sum_v softmax(teacher)_v log_softmax(logits)_v`` (= KL up to the teacher's entropy)."""
    teacher = teacher_logits.detach().float().softmax(-1)
    return -(teacher * logits.float().log_softmax(-1)).sum(-1)


def sparse_soft_cross_entropy(logits: Tensor, topk_values: Tensor, topk_indices: Tensor) -> Tensor:
    """Per-slot CE against the renormalised top-k teacher ``softmax(values)`` on ``indices``."""
    teacher = topk_values.detach().float().softmax(-1)
    log_q = logits.float().log_softmax(-1).gather(-1, topk_indices.long())
    return -(teacher * log_q).sum(-1)


def decay_weights(length: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """``exp(-(k - 1) / gamma)`` for slots ``k = 1..length`` (the DFlash paper's position decay)."""
    k = torch.arange(length, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def dpace_weights(slot_loss: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE position weights ``[..., L]`` (detached) from per-slot losses ``[..., L]``.

    ``q_i = exp(-loss_i)`` estimates P(slot i right); ``q~_i = alpha + (1 - alpha) q_i``;
    ``C_j = prod_{i <= j} q~_i`` (invalid slots multiply by 1 and have ``C = 0``);
    ``w_j = sum_{m >= j} C_m``: a slot weighs as much as the expected acceptance it can still unlock.
    """
    with torch.no_grad():
        q = torch.exp(-slot_loss.float())
        q_tilde = alpha + (1.0 - alpha) * q
        q_tilde = torch.where(valid, q_tilde, torch.ones_like(q_tilde))
        c = torch.cumprod(q_tilde, dim=-1) * valid
        return c.flip(-1).cumsum(-1).flip(-1)


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """``sum(w * v) / sum(w)``; 0 (with the graph kept) when every weight is 0."""
    weights = weights.to(values.dtype)
    return (weights * values).sum() / weights.sum().clamp(min=1e-6)


# ----------------------------------------------------------------------------- the objective
@dataclass
class Teacher:
    """What the target supplies for the loss and the metrics (all optional).

    ``logits [B, S, V]`` (online); ``topk_values``/``topk_indices [B, S, k]`` (offline cache);
    ``greedy [B, S]``: the target's greedy next token at each position (argmax of its logits); online it
    may hold it only at the positions the blocks read (-1 elsewhere: :meth:`Target.greedy_at`).
    """

    logits: Tensor | None = None
    topk_values: Tensor | None = None
    topk_indices: Tensor | None = None
    greedy: Tensor | None = None

    def topk(self) -> tuple[Tensor, Tensor]:
        """The cached ``(topk_values, topk_indices)``; an :class:`ObjectiveError` when the batch has none."""
        if self.topk_values is None or self.topk_indices is None:
            raise ObjectiveError(KD_NEEDS_TEACHER)
        return self.topk_values, self.topk_indices


@dataclass
class ObjectiveOutput:
    """Losses and everything the metrics need, from one draft forward. Slot tensors are ``[B, N, L]``."""

    loss: Tensor
    token_loss: Tensor
    selector_loss: Tensor | None
    slot_loss: Tensor  # per-slot token loss (unweighted)
    slot_weight: Tensor  # final per-slot weight of the token loss (validity x position weight)
    logits: Tensor | None  # [B, N, L, V] draft logits of the supervised slots (None when chunked)
    blocks: Blocks
    reference: Tensor  # the token a slot must produce to be accepted
    draft_tokens: Tensor  # backbone argmax
    selector_tokens: Tensor | None = None  # the selector's greedy walk (when requested)
    covered: Tensor | None = None  # reference in the draft's top-k
    selector_correct: Tensor | None = None  # teacher-forced selector pick == reference
    # For the expected acceptance under sampling (metrics.SampledAcceptance), no gradient:
    teacher: Teacher | None = None  # what the target supplied (logits or cached top-k)
    selector_candidates: Tensor | None = None  # [B, N, L, K] the top-k the selector scores
    selector_scores: Tensor | None = None  # [B, N, L, K] its scores after the teacher-forced predecessor


class DraftObjective:
    """The DFlash / DFlash2 loss, configured once and applied to a batch by :meth:`__call__`.

    Args:
        token_loss: ``"ce"`` hard cross entropy on the data tokens, or ``"kd"`` soft distillation
            from the target's logits (full online, renormalised top-k offline).
        position_weighting: ``"none"``, ``"decay"`` (``exp(-(k-1)/decay_gamma)``) or ``"dpace"``.
        decay_gamma: decay length; the DFlash recipes use 7 for block 16, 4 for block 8.
        dpace_alpha: D-PACE floor ``alpha`` in ``(0, 1]``.
        selector_loss_alpha: weight of the DFlash2 selector loss (0 disables it).
        gold_outside_topk: ``"insert_last"`` or ``"drop"`` (see the module docstring).
        num_anchors: blocks per sample (at most).
        labels: what the hard CE and the selector's gold token are: ``"data"`` (the next data token,
            ModelOpt's convention) or ``"target"`` (the target's greedy token after the same data prefix,
            when the batch carries it). They agree on the target's own greedy responses; on sampled
            responses or other text ``"target"`` trains what greedy verification accepts.
        logits_chunk_elements: above this many logits elements (slots x vocabulary) the head and its
            losses run chunked (see the module docstring); at or below it, in one piece.
    """

    def __init__(
        self,
        token_loss: TokenLoss = "ce",
        position_weighting: PositionWeighting = "none",
        decay_gamma: float = 7.0,
        dpace_alpha: float = 0.5,
        selector_loss_alpha: float = 1.0,
        gold_outside_topk: GoldOutsideTopK = "insert_last",
        num_anchors: int = 256,
        labels: LabelSource = "data",
        logits_chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
    ) -> None:
        check(token_loss in ("ce", "kd"), "token_loss", token_loss, "one of 'ce', 'kd'", error=ObjectiveError)
        check(
            position_weighting in ("none", "decay", "dpace"),
            "position_weighting",
            position_weighting,
            "one of 'none', 'decay', 'dpace'",
            error=ObjectiveError,
        )
        check(decay_gamma > 0 and math.isfinite(decay_gamma), "decay_gamma", decay_gamma, "> 0", error=ObjectiveError)
        check(0.0 < dpace_alpha <= 1.0, "dpace_alpha", dpace_alpha, "0 < dpace_alpha <= 1", error=ObjectiveError)
        check(
            selector_loss_alpha >= 0,
            "selector_loss_alpha",
            selector_loss_alpha,
            ">= 0 (0 disables it)",
            error=ObjectiveError,
        )
        check(
            gold_outside_topk in ("insert_last", "drop"),
            "gold_outside_topk",
            gold_outside_topk,
            "one of 'insert_last', 'drop'",
            error=ObjectiveError,
        )
        check(
            isinstance(num_anchors, int) and num_anchors >= 1,
            "num_anchors",
            num_anchors,
            "an integer >= 1",
            error=ObjectiveError,
        )
        check(labels in ("data", "target"), "labels", labels, "one of 'data', 'target'", error=ObjectiveError)
        self.labels = labels
        self.token_loss, self.position_weighting = token_loss, position_weighting
        self.decay_gamma, self.dpace_alpha = decay_gamma, dpace_alpha
        self.selector_loss_alpha, self.gold_outside_topk = selector_loss_alpha, gold_outside_topk
        self.num_anchors = num_anchors
        check(
            isinstance(logits_chunk_elements, int) and logits_chunk_elements >= 1,
            "logits_chunk_elements",
            logits_chunk_elements,
            "an integer >= 1",
            error=ObjectiveError,
        )
        self.logits_chunk_elements = logits_chunk_elements

    def __call__(
        self,
        draft: DraftModel,
        embed: Fn,
        head: Fn,
        input_ids: Tensor,
        loss_mask: Tensor,
        features: Tensor,
        teacher: Teacher | None = None,
        attention_mask: Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        anchors: tuple[Tensor, Tensor] | None = None,
        walk: bool = False,
        keep_logits: bool = False,
    ) -> ObjectiveOutput:
        """Sample anchors (or take ``anchors = (positions, keep)``), run the draft once, compute the loss.

        ``features [B, S, n_t*H]`` are the target's features at every position; ``walk=True`` also runs
        the selector's greedy walk over each block (for the acceptance metrics; no gradient);
        ``keep_logits=True`` computes the logits in one piece and returns them even above the chunking
        threshold (for callers that read ``out.logits``).
        """
        cfg = draft.config
        teacher = teacher or Teacher()
        b, s = input_ids.shape
        if features.shape[:2] != (b, s):
            raise ObjectiveError(
                f"features have shape {tuple(features.shape)}: must start with "
                f"[batch, seq_len] = {[b, s]} like input_ids"
            )
        if anchors is None:
            anchors = sample_anchors(loss_mask, cfg.block_size, self.num_anchors, generator)
        blocks = layout_blocks(input_ids, loss_mask, *anchors, cfg.block_size, cfg.mask_token_id)
        n, bs = blocks.num_blocks, cfg.block_size
        if self.labels == "target":
            if teacher.greedy is None:
                raise ObjectiveError(
                    "labels='target' needs the target's greedy tokens (online, or an offline "
                    "cache, which always stores them); the batch has none"
                )
            blocks = dataclasses.replace(blocks, labels=gather_positions(teacher.greedy, blocks.sources))

        # One draft pass over every block: the fused context of all S positions, then the N blocks (each layer
        # projects the context to its K/V inside its own forward: FSDP gathers a layer's weights only there).
        context = draft.context_states(features, torch.arange(s, device=input_ids.device).expand(b, s))
        mask = block_attention_mask(blocks.anchors, s, bs, attention_mask, cfg.sliding_window)
        hidden = draft(embed(blocks.tokens), blocks.positions, context, mask)
        # Slot 0 is the anchor: never predicted. Contiguous, so the head is one [B*N*L, H] x [H, V] matmul
        # (a strided 4-D input makes torch fall back to a batched matmul ~10x slower on CPU).
        hidden = hidden.view(b, n, bs, -1)[:, :, 1:].contiguous()
        selector = draft.candidate_selector
        top_k = selector.top_k if selector is not None else 0
        insert_gold = selector is not None and self.gold_outside_topk == "insert_last"
        if (
            self.token_loss == "kd"
            and teacher.logits is None
            and (teacher.topk_values is None or teacher.topk_indices is None)
        ):
            raise ObjectiveError(KD_NEEDS_TEACHER)
        rows = b * n * (bs - 1)
        if keep_logits or rows * cfg.vocab_size <= self.logits_chunk_elements:
            # In one piece, as it always was.
            logits = head(hidden.view(-1, hidden.shape[-1])).view(b, n, bs - 1, -1)  # [B, N, L, V]
            slot_loss = self._token_loss(logits, blocks.labels, teacher, blocks.sources)
            # max().indices: argmax's first-maximum rule, ~2.5x cheaper than argmax over a CPU vocabulary.
            draft_tokens = logits.max(-1).indices
            unary, cand = logits.topk(top_k, dim=-1) if top_k else (None, None)  # [B, N, L, K], descending
            gold_unary = logits.gather(-1, blocks.labels[..., None]) if insert_gold else None
        else:
            logits = None
            chunk_rows = max(1, self.logits_chunk_elements // cfg.vocab_size)
            slot_loss, draft_tokens, unary, cand, gold_unary = self._chunked_head(
                head, hidden, blocks, teacher, top_k, insert_gold, chunk_rows
            )

        valid = blocks.valid
        weight = valid.float()
        if self.position_weighting == "decay":
            weight = weight * decay_weights(bs - 1, self.decay_gamma, weight.device)
        elif self.position_weighting == "dpace":
            weight = weight * dpace_weights(slot_loss, valid, self.dpace_alpha)
        token_loss = weighted_mean(slot_loss, weight)

        # What "right" means for the metrics: the target's greedy token when known, else the data token.
        reference = (
            gather_positions(teacher.greedy, blocks.sources)
            if teacher.greedy is not None
            else (
                gather_positions(teacher.logits, blocks.sources).argmax(-1)
                if teacher.logits is not None
                else blocks.labels
            )
        )
        out = ObjectiveOutput(
            loss=token_loss,
            token_loss=token_loss,
            selector_loss=None,
            slot_loss=slot_loss,
            slot_weight=weight,
            logits=logits,
            blocks=blocks,
            reference=reference,
            draft_tokens=draft_tokens,
            teacher=teacher,
        )
        if selector is not None:
            if unary is None or cand is None:  # top_k is the selector's, >= 1
                raise RuntimeError("the draft logits' top-k candidates were not computed for the selector")
            self._selector_terms(out, selector, hidden, unary, cand, gold_unary, walk)
        return out

    def _token_loss(self, logits: Tensor, labels: Tensor, teacher: Teacher, sources: Tensor) -> Tensor:
        """Per-slot token loss of ``logits [..., V]`` (the slots at ``sources``, with ``labels``)."""
        if self.token_loss == "ce":
            return hard_cross_entropy(logits, labels)
        if teacher.logits is not None:
            return soft_cross_entropy(logits, gather_positions(teacher.logits, sources))
        values, indices = teacher.topk()
        return sparse_soft_cross_entropy(logits, gather_positions(values, sources), gather_positions(indices, sources))

    def _chunked_head(
        self, head: Fn, hidden: Tensor, blocks: Blocks, teacher: Teacher, top_k: int, insert_gold: bool, chunk_rows: int
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """The head and what is taken from its logits, ``chunk_rows`` slots at a time.

        Returns ``(slot_loss, draft_tokens, unary, candidates, gold_unary)`` shaped like the one-piece
        path's. Each chunk runs under non-reentrant activation checkpointing: its ``[chunk, V]`` logits
        are freed after the forward and recomputed in backward, so at most one chunk's logits (and their
        gradient) exist at a time.
        """
        from torch.utils.checkpoint import checkpoint

        shape = blocks.labels.shape  # [B, N, L]
        flat_hidden = hidden.view(-1, hidden.shape[-1])
        labels, sources = blocks.labels.reshape(-1), blocks.sources.reshape(-1)
        # Each slot's (sample, source position), to gather a chunk's teacher rows without the [B, N, L, V] copy.
        sample = torch.arange(shape[0], device=hidden.device).repeat_interleave(shape[1] * shape[2])

        def one_chunk(h: Tensor, lab: Tensor, smp: Tensor, src: Tensor) -> tuple[Tensor, ...]:
            logits = head(h)  # [chunk, V]
            if self.token_loss == "ce":
                loss = hard_cross_entropy(logits, lab)
            elif teacher.logits is not None:
                loss = soft_cross_entropy(logits, teacher.logits[smp, src])
            else:
                values, indices = teacher.topk()
                loss = sparse_soft_cross_entropy(logits, values[smp, src], indices[smp, src])
            outs = [loss, logits.max(-1).indices]
            if top_k:
                outs.extend(logits.topk(top_k, dim=-1))
            if insert_gold:
                outs.append(logits.gather(-1, lab[:, None]))
            return tuple(outs)

        grad = torch.is_grad_enabled() and hidden.requires_grad
        pieces = []
        for lo in range(0, flat_hidden.shape[0], chunk_rows):
            args = (
                flat_hidden[lo : lo + chunk_rows],
                labels[lo : lo + chunk_rows],
                sample[lo : lo + chunk_rows],
                sources[lo : lo + chunk_rows],
            )
            pieces.append(checkpoint(one_chunk, *args, use_reentrant=False) if grad else one_chunk(*args))
        joined = [torch.cat(parts) for parts in zip(*pieces)]
        slot_loss, draft_tokens = joined[0].view(shape), joined[1].view(shape)
        unary = cand = gold_unary = None
        if top_k:
            unary, cand = joined[2].view(*shape, top_k), joined[3].view(*shape, top_k)
        if insert_gold:
            gold_unary = joined[-1].view(*shape, 1)
        return slot_loss, draft_tokens, unary, cand, gold_unary

    def _selector_terms(
        self,
        out: ObjectiveOutput,
        selector: CandidateSelector,
        hidden: Tensor,
        unary: Tensor,
        cand: Tensor,
        gold_unary: Tensor | None,
        walk: bool,
    ) -> None:
        """The DFlash2 selector loss (teacher-forced) and the selector metrics' inputs, filled into ``out``.

        ``unary, cand [B, N, L, K]``: the draft logits' top-k values and tokens; ``gold_unary [B, N, L, 1]``:
        the gold token's draft logit (``insert_last`` only)."""
        blocks = out.blocks
        scores = selector.score_candidates(cand, unary, hidden, blocks.predecessors)
        gold = blocks.labels
        gold_in = cand == gold[..., None]
        has_gold = gold_in.any(-1)
        gold_slot = gold_in.int().argmax(-1)
        sel_weight = blocks.valid.float()
        if self.gold_outside_topk == "insert_last":
            # Score the gold token as the last candidate, with its own draft logit as unary.
            if gold_unary is None:  # computed whenever insert_last is set
                raise RuntimeError("gold_outside_topk='insert_last' needs the gold token's draft logit")
            gold_score = selector.score_candidates(gold[..., None], gold_unary, hidden, blocks.predecessors)
            last = torch.zeros_like(gold_in)
            last[..., -1] = True
            scores_loss = torch.where(last & ~has_gold[..., None], gold_score, scores)
            gold_slot = torch.where(has_gold, gold_slot, torch.full_like(gold_slot, selector.top_k - 1))
        else:
            scores_loss = scores
            sel_weight = sel_weight * has_gold
        sel_ce = hard_cross_entropy(scores_loss, gold_slot)
        out.selector_loss = weighted_mean(sel_ce, sel_weight)
        # Added even at alpha = 0 (then exactly +0): the selector stays in the graph, as DDP without
        # find_unused_parameters requires of every parameter.
        out.loss = out.loss + self.selector_loss_alpha * out.selector_loss

        # Metrics on the unmodified top-k (what inference sees), against the reference token.
        with torch.no_grad():
            ref_in = cand == out.reference[..., None]
            out.covered = ref_in.any(-1)
            out.selector_candidates, out.selector_scores = cand, scores.detach()
            picked = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
            out.selector_correct = picked == out.reference
            if walk:
                b, n, length, k = cand.shape
                path = selector.greedy_path(
                    cand.reshape(b * n, length, k),
                    unary.detach().reshape(b * n, length, k),
                    hidden.detach().reshape(b * n, length, -1),
                    blocks.tokens.view(b, n, -1)[:, :, 0].reshape(b * n),
                )
                out.selector_tokens = path.view(b, n, length)
