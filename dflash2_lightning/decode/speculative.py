"""Speculative decoding: the draft proposes a block, the target verifies it in one forward pass.

One cycle, for a sequence whose last emitted token (the *anchor*) sits at position ``start``::

    draft:   [anchor, MASK x (bs-1)] at positions start..start+bs-1   -> d_1 .. d_{bs-1}
    target:  [anchor, d_1 .. d_{bs-1}] on top of its KV cache         -> greedy g_1 .. g_bs
    accept:  a = length of the longest prefix with d_k == g_k
    emit:    d_1 .. d_a, g_{a+1}                                      (a + 1 tokens)
    caches:  target KV cropped to start + a + 1; draft context += K/V of those a + 1 verified tokens

The output is exactly the target's own greedy tokens (lossless, up to floating-point ties). The draft's context
cache holds verified tokens only and is only appended to (preallocated once when the drafter offers
``new_cache``). The loop talks to the draft through the :class:`~dflash2_lightning.decode.drafter.Drafter`
protocol, so a drafter in another runtime (onnxruntime, TensorRT) drops in for the torch one. ``temperature > 0``
accepts by the speculative-sampling rule (:mod:`dflash2_lightning.model.sampling`); ``temperature == 0`` keeps
the greedy path. ``tau`` counts untruncated cycles (a property of the draft), ``tokens_per_cycle`` every cycle
(what sets the speed). Batch size 1. The accounting, the truncated last cycle and the ties: docs/internals.md
("Speculative decoding"); what users see: docs/measuring-tau.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dflash2_lightning.decode.drafter import Drafter, DraftPath, Head, as_drafter
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.model.sampling import Sampling, draw, probabilities, verify
from dflash2_lightning.target.cpu_linear import declare_rows
from dflash2_lightning.target.hf_cache import with_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# ----------------------------------------------------------------------------- the target side
@dataclass
class TargetHandles:
    """The pieces of the target the loop uses: the HF causal LM, its embedding and its head."""

    hf: PreTrainedModel
    embed: Head
    head: Head


def target_handles(target: Any) -> TargetHandles:
    """Accept a project ``Target`` (has ``.hf``, ``.embed``, ``.head``) or a bare HF causal LM."""
    hf = getattr(target, "hf", target)
    embed = getattr(target, "embed", None) if hasattr(target, "hf") else None
    head = getattr(target, "head", None) if hasattr(target, "hf") else None
    return TargetHandles(hf, embed or hf.get_input_embeddings(), head or hf.get_output_embeddings())


def prepare_verification(target: Any, block_size: int) -> None:
    """Declare the loop's row counts to the target's CPU linears (:mod:`dflash2_lightning.target.cpu_linear`):
    the ``block_size``-token verify pass, and the ``block_size - 1`` drafted slots through the head."""
    prepare = getattr(target, "prepare_verification", None)
    if callable(prepare):  # a project Target: declared once per block size, held on the target
        prepare(block_size)
    else:  # a bare HF model: only FewRowLinear modules installed on it can use the declaration
        declare_rows(target_handles(target).hf, block_size, block_size - 1)


def _new_cache(hf: PreTrainedModel) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=hf.config)


def _crop(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of an HF cache (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _forward(hf: PreTrainedModel, ids: Tensor, start: int, cache: Any, hidden: bool, last_only: bool = False) -> Any:
    """One cached target forward of ``ids`` at positions ``start..``; ``last_only`` keeps only the last logits."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return hf(
        input_ids=ids,
        position_ids=positions,
        **with_cache(hf, cache),
        use_cache=True,
        output_hidden_states=hidden,
        logits_to_keep=1 if last_only else 0,
    )


def target_features(hidden_states: Sequence[Tensor], layer_ids: Iterable[int]) -> Tensor:
    """``cat([hidden_states[l + 1] for l in layer_ids], -1)`` (HF index 0 is the embedding output)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _stop_index(tokens: list[int], stop_ids: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop_ids), None)


def _prompt_tensor(input_ids: Tensor | Sequence[int], device: torch.device) -> Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"input_ids shape {tuple(ids.shape)} is invalid: must be [1, P] with P >= 1 (batch 1)")
    return ids


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")


# ----------------------------------------------------------------------------- results
@dataclass
class GreedyResult:
    """Target-only greedy decoding: the generated tokens and the wall time it took."""

    tokens: list[int]
    prompt_length: int
    stopped: bool
    seconds: float


@dataclass
class SpecResult:
    """One speculative generation: tokens plus per-cycle acceptance.

    ``accepted[i]`` drafts accepted in cycle ``i`` (0..bs-1), ``emitted[i]`` tokens it emitted (after a stop
    token or the budget cut it), ``anchors[i]`` the anchor's absolute position. ``context`` is the draft's
    context cache at the end (verified tokens only); it is left out of :meth:`summary`.
    """

    tokens: list[int]
    prompt_length: int
    block_size: int
    accepted: list[int]
    emitted: list[int]
    anchors: list[int]
    stopped: bool
    seconds: float
    context: Any = field(default=None, repr=False)

    @property
    def truncated(self) -> list[bool]:
        return [e < a + 1 for a, e in zip(self.accepted, self.emitted)]

    def stats(self) -> AcceptanceStats:
        return AcceptanceStats.from_results([self])


@dataclass
class AcceptanceStats:
    """Acceptance over many cycles (one or many sequences).

    ``histogram[a]`` counts untruncated cycles that accepted ``a`` drafts; ``accept[k-1]`` is the fraction of
    them whose offsets ``1..k`` were all accepted; ``tau = 1 + sum(accept) = mean(a + 1)``. ``tokens``
    counts every generated token (the prefill token too), ``cycle_tokens`` only those cycles emitted.
    """

    block_size: int
    histogram: list[int]
    cycles: int
    truncated_cycles: int
    cycle_tokens: int
    tokens: int
    seconds: float

    @classmethod
    def from_results(cls, results: Sequence[SpecResult]) -> AcceptanceStats:
        if not results:
            raise ValueError("results is empty: need at least one SpecResult")
        bs = results[0].block_size
        hist = [0] * bs
        truncated = 0
        for r in results:
            for a, cut in zip(r.accepted, r.truncated):
                truncated += cut
                if not cut:
                    hist[a] += 1
        return cls(
            bs,
            hist,
            sum(len(r.accepted) for r in results),
            truncated,
            sum(sum(r.emitted) for r in results),
            sum(len(r.tokens) for r in results),
            sum(r.seconds for r in results),
        )

    @property
    def full_cycles(self) -> int:
        return sum(self.histogram)

    @property
    def accept(self) -> list[float]:
        """``accept[k-1]`` = P(offsets 1..k all accepted), k = 1..bs-1, over untruncated cycles."""
        n = max(self.full_cycles, 1)
        return [sum(self.histogram[k:]) / n for k in range(1, self.block_size)]

    @property
    def tau(self) -> float:
        """Mean tokens emitted per untruncated cycle (accepted + 1); 0.0 when there was no full cycle."""
        return 1.0 + sum(self.accept) if self.full_cycles else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """Tokens emitted by cycles / cycles, truncated cycles included (the prefill token is not a cycle)."""
        return self.cycle_tokens / self.cycles if self.cycles else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "tokens_per_cycle": self.tokens_per_cycle,
            "accept": self.accept,
            "histogram": self.histogram,
            "cycles": self.cycles,
            "truncated_cycles": self.truncated_cycles,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens / self.seconds if self.seconds > 0 else None,
        }


# ----------------------------------------------------------------------------- decoding
@torch.inference_mode()
def target_greedy(
    target: Any, input_ids: Tensor | Sequence[int], max_new_tokens: int, stop_token_ids: Iterable[int] = ()
) -> GreedyResult:
    """Plain greedy decoding with the target's KV cache: one token per forward pass.

    Emits up to and including the first stop token, at most ``max_new_tokens`` tokens. This is the
    reference the speculative loop must reproduce and the tokens/s baseline.
    """
    _check_budget(max_new_tokens)
    hf = target_handles(target).hf
    ids = _prompt_tensor(input_ids, hf.device)
    stop, tokens, cache = set(stop_token_ids), [], _new_cache(hf)
    t0 = time.perf_counter()
    logits = _forward(hf, ids, 0, cache, hidden=False, last_only=True).logits
    while True:
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token in stop or len(tokens) >= max_new_tokens:
            break
        step = torch.tensor([[token]], device=ids.device)
        logits = _forward(hf, step, ids.shape[1] + len(tokens) - 1, cache, hidden=False).logits
    return GreedyResult(tokens, ids.shape[1], tokens[-1] in stop, time.perf_counter() - t0)


@torch.inference_mode()
def target_sample(
    target: Any,
    input_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> GreedyResult:
    """Plain decoding with the target, sampled at ``temperature`` (with ``top_p``/``top_k``).

    What sampled speculative decoding must be distributed as, and its tokens/s baseline.
    ``temperature == 0`` is :func:`target_greedy`. Randomness as in :func:`speculative_generate`.
    """
    sampling = Sampling(temperature, top_p, top_k)
    if sampling.greedy:
        return target_greedy(target, input_ids, max_new_tokens, stop_token_ids)
    _check_budget(max_new_tokens)
    hf = target_handles(target).hf
    ids = _prompt_tensor(input_ids, hf.device)
    gen = _generator(seed, generator, ids.device)
    stop, tokens, cache = set(stop_token_ids), [], _new_cache(hf)
    t0 = time.perf_counter()
    logits = _forward(hf, ids, 0, cache, hidden=False, last_only=True).logits
    while True:
        token = _next_token(logits[0, -1], sampling, gen)
        tokens.append(token)
        if token in stop or len(tokens) >= max_new_tokens:
            break
        step = torch.tensor([[token]], device=ids.device)
        logits = _forward(hf, step, ids.shape[1] + len(tokens) - 1, cache, hidden=False).logits
    return GreedyResult(tokens, ids.shape[1], tokens[-1] in stop, time.perf_counter() - t0)


def _generator(seed: int | None, generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """``generator`` as given, else a new one on ``device`` seeded with ``seed``, else None (torch's global one)."""
    if generator is not None and seed is not None:
        raise ValueError(f"seed={seed} and a generator were both given: pass one of them")
    if generator is not None or seed is None:
        return generator
    return torch.Generator(device=device).manual_seed(int(seed))


def _next_token(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The target's next token from its last logits ``[V]``: the argmax, or a processed sample."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(draw(probabilities(logits, sampling), generator))


@torch.inference_mode()
def speculative_generate(
    target: Any,
    draft: DraftModel | Drafter,
    input_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    path: DraftPath | None = None,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt, greedy or sampled, always lossless.

    ``target`` is a project ``Target`` or an HF causal LM; ``draft`` a :class:`DraftModel` (decoded with
    ``path``, default: the selector walk for DFlash2, argmax for DFlash) or any :class:`Drafter`.

    ``temperature == 0`` (default) is greedy: the tokens equal :func:`target_greedy`'s. ``temperature > 0``
    samples (with ``top_p``/``top_k``): the draft samples its proposal and the target accepts it by
    rejection sampling (:mod:`dflash2_lightning.model.sampling`), so the output is distributed exactly as
    :func:`target_sample`'s. Randomness comes from ``generator``, else a fresh one seeded with ``seed``,
    else torch's global generator. Sampling needs a drafter with ``sample_block`` (the torch draft).
    """
    _check_budget(max_new_tokens)
    sampling = Sampling(temperature, top_p, top_k)
    drafter = as_drafter(draft, path)
    t = target_handles(target)
    ids = _prompt_tensor(input_ids, t.hf.device)
    bs, layer_ids, stop = drafter.block_size, drafter.target_layer_ids, set(stop_token_ids)
    prompt_len = ids.shape[1]
    positions = torch.arange(prompt_len + max_new_tokens + bs, device=ids.device)[None]  # sliced, never rebuilt
    prepare_verification(target, bs)

    gen = None
    # The drafter's sampled proposal (optional in the Drafter protocol); None: greedy drafting.
    sample_block = None if sampling.greedy else getattr(drafter, "sample_block", None)
    if not sampling.greedy:
        if not callable(sample_block):
            raise ValueError(
                f"temperature={temperature} is invalid for {type(drafter).__name__}: it drafts "
                "greedily only (no sample_block: it returns tokens, not the distributions a lossless "
                "sampled proposal needs); use temperature=0, or the torch draft to sample"
            )
        gen = _generator(seed, generator, ids.device)

    t0 = time.perf_counter()
    cache = _new_cache(t.hf)
    out = _forward(t.hf, ids, 0, cache, hidden=True, last_only=True)
    context = drafter.context_kv(target_features(out.hidden_states, layer_ids), positions[:, :prompt_len])
    new_cache = getattr(drafter, "new_cache", None)
    if new_cache is not None:  # preallocated for the whole generation: cycles append in place
        context = new_cache(1, prompt_len + max_new_tokens).append(context)
    anchor = _next_token(out.logits[0, -1], sampling, gen)
    tokens = [anchor]
    accepted, emitted, anchors = [], [], []
    done = anchor in stop or max_new_tokens == 1
    block = torch.empty(1, bs, dtype=torch.long, device=ids.device)
    while not done:
        start = prompt_len + len(tokens) - 1  # the anchor's position; everything before it is in both caches
        block[0, 0] = anchor
        if sample_block is None:
            drafts = drafter.draft_block(block[:, 0], context, t.embed, t.head, start)
        else:
            proposal = sample_block(block[:, 0], context, t.embed, t.head, start, sampling, gen)
            drafts = proposal.tokens
        block[:, 1:] = drafts
        out = _forward(t.hf, block, start, cache, hidden=True)
        if sampling.greedy:
            greedy = out.logits[0].argmax(-1)
            a = int((block[0, 1:] == greedy[:-1]).cumprod(0).sum())
            bonus = int(greedy[a])
        else:  # accept by rejection sampling against the target's processed distributions
            a, bonus = verify(block[0, 1:], proposal.probs[0], probabilities(out.logits[0], sampling), gen)
        new = block[0, 1 : a + 1].tolist() + [bonus]
        # Cut exactly where greedy decoding would: after the first stop token or at the budget.
        cut = _stop_index(new, stop)
        keep = min(len(new) if cut is None else cut + 1, max_new_tokens - len(tokens))
        tokens += new[:keep]
        accepted.append(a)
        emitted.append(keep)
        anchors.append(start)
        done = keep < len(new) or tokens[-1] in stop or len(tokens) >= max_new_tokens
        if not done:
            # The anchor and the accepted drafts are verified: their features join the draft's context.
            verified = torch.cat([out.hidden_states[i + 1][:, : a + 1] for i in layer_ids], dim=-1)
            context = context.append(drafter.context_kv(verified, positions[:, start : start + a + 1]))
            _crop(cache, start + a + 1)
            anchor = new[-1]
    return SpecResult(
        tokens, prompt_len, bs, accepted, emitted, anchors, tokens[-1] in stop, time.perf_counter() - t0, context
    )
