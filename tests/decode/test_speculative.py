"""The greedy speculative loop: lossless against target-only greedy decoding, stop tokens and budgets,
the draft's incremental context cache, and the acceptance bookkeeping."""

from __future__ import annotations

import pytest
import torch
from speculative_helpers import BLOCK_SIZE, NEW_TOKENS, continuations, prompts, tiny_target, trained_draft

from dflash2_lightning.decode.drafter import TorchDrafter, low_precision_head
from dflash2_lightning.decode.speculative import (
    AcceptanceStats,
    SpecResult,
    speculative_generate,
    target_features,
    target_greedy,
)
from dflash2_lightning.model import DraftModel

CASES = [("dflash2", "selector"), ("dflash2", "backbone"), ("dflash", "backbone")]


def greedy_reference(cont: tuple[int, ...], stop: tuple[int, ...], budget: int) -> list[int]:
    """Greedy decoding with a stop set and a budget = the unstopped greedy continuation, cut after the
    first stop token and at the budget (checked against :func:`target_greedy` below)."""
    out = []
    for t in cont[:budget]:
        out.append(t)
        if t in stop:
            break
    return out


def test_target_greedy_stops_after_first_stop_token() -> None:
    target, prompt, cont = tiny_target(), prompts()[5], continuations()[5]
    stop = (cont[4],)
    got = target_greedy(target, prompt, 32, stop)
    assert got.tokens == greedy_reference(cont, stop, 32) and got.stopped
    assert len(got.tokens) <= 5 and got.tokens[-1] == cont[4]
    assert target_greedy(target, prompt, 6).tokens == list(cont[:6])


@pytest.mark.parametrize(("projector", "path"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_lossless_against_target_greedy(projector: str, path: str) -> None:
    """Token for token equal to greedy decoding, without a stop token, and stopping early at one."""
    target, draft = tiny_target(), trained_draft(projector)
    accepted, stopped_early = 0, 0
    for i, (prompt, cont) in enumerate(zip(prompts(), continuations())):
        # A stop token the target emits a few steps in: generation must end right after its first occurrence.
        for stop in ((), (cont[3 + i % 4],)):
            got = speculative_generate(target, draft, prompt, 32, stop, path=path)
            assert got.tokens == greedy_reference(cont, stop, 32), (i, stop)
            assert got.stopped == bool(stop)
            accepted += sum(got.accepted)
            stopped_early += len(got.tokens) < 32
    assert accepted > 0  # the drafts were really used, not only rejected
    assert stopped_early >= 4


class OracleDrafter:
    """A scripted drafter (no torch draft): proposes the true continuation and corrupts one offset.

    ``accept[i]`` drafts are right in cycle ``i`` (``bs-1`` = all). Its cache is a list of positions, so the
    test also checks the loop only uses the interface and gives a context of exactly the verified prefix.
    """

    class Cache:
        def __init__(self, positions: list[int]) -> None:
            self.positions = positions

        def append(self, other: OracleDrafter.Cache) -> OracleDrafter.Cache:
            return OracleDrafter.Cache(self.positions + other.positions)

    def __init__(self, sequence: list[int], accept: list[int], vocab: int) -> None:
        self.block_size, self.target_layer_ids = BLOCK_SIZE, [1]
        self.sequence, self.accept, self.vocab, self.cycle = sequence, accept, vocab, 0

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> OracleDrafter.Cache:
        assert features.shape[1] == positions.shape[1]
        return self.Cache(positions[0].tolist())

    def draft_block(self, anchor, context, embed, head, start: int) -> torch.Tensor:
        assert context.positions == list(range(start)), "context must be exactly the tokens before the anchor"
        assert int(anchor) == self.sequence[start]
        truth = [self.sequence[j] if j < len(self.sequence) else 0 for j in range(start + 1, start + BLOCK_SIZE)]
        n = self.accept[self.cycle % len(self.accept)]
        self.cycle += 1
        if n < BLOCK_SIZE - 1:
            truth[n] = (truth[n] + 1) % self.vocab
        return torch.tensor([truth])


def test_scripted_drafter_accepts_exactly_and_cuts_like_greedy() -> None:
    target = tiny_target()
    prompt = list(prompts()[0])
    full = prompt + list(target_greedy(target, prompt, 60).tokens)
    pattern = [3, 0, 2, 1, 3, 3, 0, 1]

    got = speculative_generate(target, OracleDrafter(full, pattern, target.vocab_size), prompt, 40)
    assert got.tokens == full[len(prompt) : len(prompt) + 40]
    n = len(got.accepted)
    assert got.accepted == [pattern[i % len(pattern)] for i in range(n)]
    assert got.anchors[0] == len(prompt) and all(
        b - a == acc + 1 for a, b, acc in zip(got.anchors, got.anchors[1:], got.accepted)
    )
    assert sum(got.emitted) + 1 == len(got.tokens)  # the prefill token is not a cycle's

    # A stop token inside an accepted run: emission stops right after it and that cycle is truncated.
    P = len(prompt)
    pos = next(
        a + k
        for a, acc in zip(got.anchors, got.accepted)
        if acc == 3
        for k in (1, 2)
        if full[a + k] not in full[P : a + k]
    )  # its first occurrence is an accepted draft
    stop_token = full[pos]
    ref = target_greedy(target, prompt, 40, [stop_token])
    cut = speculative_generate(target, OracleDrafter(full, pattern, target.vocab_size), prompt, 40, [stop_token])
    assert cut.tokens == ref.tokens == full[P : pos + 1]
    assert cut.stopped and cut.truncated == [False] * (len(cut.accepted) - 1) + [True]
    assert cut.emitted[-1] == pos - cut.anchors[-1] < cut.accepted[-1] + 1

    # The budget cuts inside a cycle: same tokens as greedy with that budget; only the last cycle truncated.
    for budget in (2, 3, 5, 8, 13):
        short = speculative_generate(target, OracleDrafter(full, pattern, target.vocab_size), prompt, budget)
        assert short.tokens == full[len(prompt) : len(prompt) + budget]
        assert not any(short.truncated[:-1])


def test_one_token_budget_needs_no_cycle() -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    got = speculative_generate(target, draft, prompts()[1], 1)
    assert got.tokens == [continuations()[1][0]] and got.accepted == []


class RecordingDrafter(TorchDrafter):
    """Records the length of every feature chunk the loop hands to ``context_kv``."""

    def __init__(self, model: DraftModel) -> None:
        super().__init__(model)
        self.chunks: list[int] = []

    def context_kv(self, features, positions):
        self.chunks.append(features.shape[1])
        return super().context_kv(features, positions)


@pytest.mark.parametrize("budget", [5, 17, 32])
def test_context_cache_is_incremental_and_equals_from_scratch(budget: int) -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    prompt = list(prompts()[2])
    drafter = RecordingDrafter(draft)
    got = speculative_generate(target, drafter, prompt, budget)
    ctx = got.context
    verified = got.anchors[-1]  # everything before the last cycle's anchor has been verified
    # Only new tokens were ever encoded: the prompt once, then anchor + accepted drafts of each cycle.
    assert drafter.chunks == [len(prompt)] + [a + 1 for a in got.accepted[:-1]]
    assert ctx.length == verified == sum(drafter.chunks)
    assert torch.equal(ctx.positions, torch.arange(verified)[None])

    tokens = torch.tensor([(prompt + got.tokens)[:verified]])
    out = target.hf(input_ids=tokens, output_hidden_states=True)
    fresh = draft.context_kv(
        target_features(out.hidden_states, draft.config.target_layer_ids), torch.arange(verified)[None]
    )
    for mine, ref in zip(ctx.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, ref.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(mine.values, ref.values, rtol=0, atol=1e-12)


def _result(accepted: list[int], emitted: list[int]) -> SpecResult:
    tokens = [7] * (1 + sum(emitted))
    return SpecResult(tokens, 5, 4, accepted, emitted, list(range(len(accepted))), False, 2.0)


def test_acceptance_statistics() -> None:
    stats = AcceptanceStats.from_results([_result([3, 0, 1, 2], [4, 1, 2, 1]), _result([1], [2])])
    # Untruncated cycles accepted 3, 0, 1, 1; the last cycle of the first sequence was cut (1 < 2 + 1).
    assert stats.histogram == [1, 2, 0, 1]
    assert stats.truncated_cycles == 1 and stats.cycles == 5
    assert stats.accept == pytest.approx([3 / 4, 1 / 4, 1 / 4])
    assert stats.tau == pytest.approx((4 + 1 + 2 + 2) / 4) == 1 + sum(stats.accept)
    assert stats.tokens_per_cycle == pytest.approx((4 + 1 + 2 + 1 + 2) / 5)
    assert stats.tokens == 9 + 3
    summary = stats.summary()
    assert summary["tokens_per_second"] == pytest.approx(12 / 4.0)


def test_bad_arguments_are_named() -> None:
    target, baseline = tiny_target(), trained_draft("dflash")
    with pytest.raises(ValueError, match="path='selector'"):
        speculative_generate(target, baseline, prompts()[0], 4, path="selector")
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        speculative_generate(target, baseline, prompts()[0], 0)
    with pytest.raises(ValueError, match="input_ids shape"):
        target_greedy(target, torch.zeros(2, 3, dtype=torch.long), 4)


def test_a_low_precision_drafting_head_keeps_the_output_exact() -> None:
    """The bf16 drafting head only changes the drafts; the target's verification keeps greedy's tokens."""
    target, draft = tiny_target(), trained_draft("dflash2")
    drafter = TorchDrafter(draft, head=low_precision_head(target, torch.bfloat16))
    for prompt, expected in list(zip(prompts(), continuations()))[:3]:
        got = speculative_generate(target, drafter, prompt, NEW_TOKENS)
        assert got.tokens == list(expected)
    logits = low_precision_head(target)(torch.randn(2, 3, target.hidden_size, dtype=torch.float64))
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 3, target.vocab_size)
    with pytest.raises(ValueError, match="nn.Linear lm_head"):
        low_precision_head(torch.nn.Module())
