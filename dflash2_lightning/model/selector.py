"""`CandidateSelector`: DFlash2's low-rank scorer of transitions between adjacent block positions.

Each block position keeps the target head's top-k candidates. An edge from predecessor ``p`` to
candidate ``c`` at a position with draft hidden ``h`` scores::

    score(p -> c | h) = unary[c] + <predecessor_codebook[p] * hidden_projection(h), successor_codebook[c]>

Training scores one candidate set per position with the teacher-forced predecessor
(:meth:`score_candidates`); drafting walks the lattice greedily from the anchor token
(:meth:`greedy_path`, the ``dflash::lattice_walk`` op). ``successor_codebook`` starts at zero, so a
fresh selector reproduces the backbone's own ranking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2_lightning.ops import lattice_walk


class CandidateSelector(nn.Module):
    """Codebooks ``[V, r]`` for predecessors and successors, and a context projection ``H -> r``."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int, std: float) -> None:
        super().__init__()
        self.top_k, self.rank = top_k, rank
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank).normal_(std=std))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def score_candidates(self, cand: Tensor, unary: Tensor, hidden: Tensor, predecessor: Tensor) -> Tensor:
        """Selector logits ``[..., K]`` for candidates ``cand [..., K]`` after a known ``predecessor [...]``."""
        # F.embedding, not codebook[ids]: the same rows forward, but its backward sums a row's gradients in a
        # fixed order, where indexing's backward adds them atomically from several CPU threads (run-to-run noise).
        context = F.embedding(predecessor, self.predecessor_codebook) * self.hidden_projection(hidden)
        successor = F.embedding(cand, self.successor_codebook)
        transition = torch.einsum("...r,...kr->...k", context.to(successor.dtype), successor)
        return unary + transition

    @torch.no_grad()
    def greedy_path(self, cand: Tensor, unary: Tensor, hidden: Tensor, anchor: Tensor) -> Tensor:
        """Walk candidates ``[B, L, K]`` for block offsets ``1..L``, seeded with the anchor ``[B]``."""
        return lattice_walk(
            cand, unary, self.hidden_projection(hidden), anchor, self.predecessor_codebook, self.successor_codebook
        )
