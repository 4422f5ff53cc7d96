"""Speculative sampling is lossless: sampled continuations are distributed exactly as the target's own.

The proof is layered, each layer exact or a statistical test with a stated bound:

1. :func:`probabilities` (temperature, top-k, top-p) equals a direct per-row reference, exactly;
2. the proposals report the distributions they really sample from: the selector walk's ``q`` equals
   an independent recomputation along the sampled path (exact), and batched walks follow the exactly
   enumerated path law (statistical);
3. :func:`verify` turns any proposal into the target's law (statistical, 10000 calls per case);
4. end to end, **exact**: every random choice of the loop goes through ``sampling.draw``, so
   :class:`Enumerator` runs the real loop (real tiny float64 Qwen3 target, real tiny draft) once per
   outcome of its choices and sums their exact probabilities. The loop's law of the 3 generated tokens
   (the prefill's and two cycles') must equal the target's sampling law, enumerated from one uncached
   forward over every continuation, to 1e-9: the selector path with no processing but the temperature,
   the backbone path with top-k, the selector with top-p, a DFlash draft with top-k, a drafter whose
   every draft is accepted (``q == p``, bonus tokens), and a stop token inside the block. Negative
   controls (accept every draft; draw from ``p`` instead of the residual; judge a draft by the next
   position's ``p``) fail the same comparison;
5. end to end with torch's own seeded generator (statistical), and :func:`target_sample`.

Statistical test (:func:`assert_law`): cells are the outcomes whose expected count is at least 5
(the rest lumped into one cell), fixed from the exact law before sampling. A cell fails when
``n * KL(observed || expected) > ln(2 m / ALPHA)`` for ``m`` cells. By the Chernoff-Hoeffding bound,
``P(n KL(X/n || P) >= t) <= 2 exp(-t)`` for a binomial count ``X``, and a union bound over the cells
gives a false-failure probability of at most ``ALPHA = 1e-6`` per test when the code is correct,
with no asymptotic approximation; the file's 8 statistical checks together at most 8e-6. Seeds are
fixed, so a run is reproducible; the exact layers carry the proof, the statistical ones check the
real random streams.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import randomize_draft_

import dflash2_lightning.decode.speculative as spec
import dflash2_lightning.model.sampling as sampling_mod
from dflash2_lightning.config import DraftConfig
from dflash2_lightning.decode.speculative import speculative_generate, target_sample
from dflash2_lightning.model import DraftModel
from dflash2_lightning.model.sampling import (
    Sampling,
    draw_rows,
    probabilities,
    sample_backbone,
    sample_selector_walk,
    verify,
)

ALPHA = 1e-6
V, BLOCK, PROMPT = 6, 3, [1, 2, 1]


# ----------------------------------------------------------------------------- the statistical test
def _kl(a: float, p: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(p)), with 0 log 0 = 0."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / p)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - p))
    return out


def law_failures(samples: Sequence, exact: dict, min_expected: float = 5.0, alpha: float = ALPHA) -> list[str]:
    """The cells where ``samples`` contradict the ``exact`` law (empty: consistent), see the module docstring."""
    n = len(samples)
    assert abs(sum(exact.values()) - 1) < 1e-9, "the exact law must sum to 1"
    unknown = [s for s in set(samples) if s not in exact or exact[s] == 0]
    if unknown:
        return [f"outcomes of probability 0 were sampled: {unknown[:5]}"]
    cells = [o for o, p in exact.items() if n * p >= min_expected]
    counts = Counter(samples)
    observed = {o: counts[o] for o in cells}
    rest_p = 1.0 - sum(exact[o] for o in cells)
    rest_n = n - sum(observed.values())
    threshold = math.log(2 * (len(cells) + 1) / alpha)
    bad = []
    for o, c in [*observed.items(), ("<rest>", rest_n)]:
        p = exact[o] if o != "<rest>" else rest_p
        if p <= 0:
            if c:
                bad.append(f"{o}: {c} samples of probability 0")
            continue
        if n * _kl(min(max(c / n, 0.0), 1.0), min(p, 1.0)) > threshold:
            bad.append(f"{o}: observed {c / n:.4f}, exact {p:.4f} (n={n})")
    return bad


def assert_law(samples: Sequence, exact: dict) -> None:
    bad = law_failures(samples, exact)
    assert not bad, "not distributed as the target: " + "; ".join(bad[:6])


def test_the_statistical_test_holds_its_level_and_has_power() -> None:
    """The test passes exact samples of a law and fails samples of a law 10% off in one cell."""
    gen = torch.Generator().manual_seed(0)
    law = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    exact = {i: float(p) for i, p in enumerate(law)}
    samples = torch.multinomial(law, 4000, replacement=True, generator=gen).tolist()
    assert law_failures(samples, exact) == []
    off = law.clone()
    off[0], off[1] = 0.36, 0.29
    samples = torch.multinomial(off, 4000, replacement=True, generator=gen).tolist()
    assert law_failures(samples, exact)


# ----------------------------------------------------------------------------- 1. logit processing
def naive_probabilities(row: list[float], s: Sampling) -> list[float]:
    """One row, written directly from the definitions (temperature, then top-k, then top-p)."""
    scaled = [x / s.temperature for x in row]
    order = sorted(range(len(row)), key=lambda i: (-scaled[i], i))
    keep = order[: s.top_k] if s.top_k else order
    z = sum(math.exp(scaled[i]) for i in keep)
    probs = {i: math.exp(scaled[i]) / z for i in keep}
    if s.top_p < 1:
        kept, mass = [], 0.0
        for i in keep:
            if mass < s.top_p:
                kept.append(i)
            mass += probs[i]
        z = sum(probs[i] for i in kept)
        probs = {i: probs[i] / z for i in kept}
    return [probs.get(i, 0.0) for i in range(len(row))]


@pytest.mark.parametrize(
    "settings", [(1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 0.9, 0), (0.8, 1.0, 3), (1.3, 0.6, 4), (1.0, 1.0, 100)]
)
def test_probabilities_match_the_definition(settings: tuple[float, float, int]) -> None:
    s = Sampling(*settings)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 9, generator=gen, dtype=torch.float64) * 2
    logits[0, 3] = logits[0, 5]  # a tie: the lower index ranks first
    got = probabilities(logits, s)
    want = torch.tensor([naive_probabilities(r, s) for r in logits.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert got.dtype == torch.float64 and probabilities(logits.float(), s).dtype == torch.float32


def test_sampling_settings_are_validated() -> None:
    for kwargs, field in [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            Sampling(**kwargs)
    with pytest.raises(ValueError, match="temperature=0"):
        probabilities(torch.zeros(3), Sampling())


# ----------------------------------------------------------------------------- tiny target and draft
def tiny_hf(seed: int = 0, vocab: int = V):
    """A float64 Qwen3 with a tiny vocabulary; its head is scaled so the next-token laws are uneven."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
    return hf


def tiny_draft(projector: str = "dflash2", seed: int = 1, vocab: int = V) -> DraftModel:
    cfg = DraftConfig(
        hidden_size=16,
        vocab_size=vocab,
        num_target_layers=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        block_size=BLOCK,
        mask_token_id=vocab - 1,
        target_layer_ids=[0],
        selector_top_k=3,
        selector_rank=4,
        conv_group_size=8,
        max_position_embeddings=64,
        projector_type=projector,
    )
    return randomize_draft_(DraftModel(cfg).double(), seed).eval()


@torch.no_grad()
def exact_law(hf, prompt: list[int], n: int, s: Sampling, stop: Sequence[int] = ()) -> dict[tuple[int, ...], float]:
    """The target's sampling law of its continuation: every length-``n`` sequence enumerated, one full
    (uncached) forward for all of them, then each cut after its first stop token."""
    vocab = hf.config.vocab_size
    seqs = list(itertools.product(range(vocab), repeat=n))
    ids = torch.tensor([prompt + list(q[:-1]) for q in seqs])
    probs = probabilities(hf(input_ids=ids).logits[:, len(prompt) - 1 :], s)  # [N, n, V]
    law: dict[tuple[int, ...], float] = {}
    for q, pr in zip(seqs, probs):
        p = math.prod(float(pr[i, t]) for i, t in enumerate(q))
        cut = next((i + 1 for i, t in enumerate(q) if t in stop), n)
        law[q[:cut]] = law.get(q[:cut], 0.0) + p
    return {k: v for k, v in law.items() if v > 0}


# ----------------------------------------------------------------------------- 2. the proposals
def test_selector_walk_reports_and_follows_its_law() -> None:
    """``q`` of the sampled walk equals the selector's processed scores after the *sampled* predecessor,
    and 20000 walks (one batched call) follow the path law enumerated from the selector's formula."""
    draft = tiny_draft()
    sel = draft.candidate_selector
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, BLOCK - 1, 16, generator=gen, dtype=torch.float64)
    logits = torch.randn(1, BLOCK - 1, V, generator=gen, dtype=torch.float64) * 2
    anchor = torch.tensor([4])
    s = Sampling(0.9, top_p=0.95)

    def step_law(pred: int, i: int) -> dict[int, float]:  # written from the formula, not from score_candidates
        unary, cand = logits[0, i].topk(sel.top_k)
        ctx = sel.predecessor_codebook[pred] * sel.hidden_projection(hidden[0, i])
        scores = unary + sel.successor_codebook[cand] @ ctx
        return {int(c): float(p) for c, p in zip(cand, probabilities(scores, s))}

    with torch.no_grad():
        paths = {}
        for d1, p1 in step_law(4, 0).items():
            for d2, p2 in step_law(d1, 1).items():
                paths[(d1, d2)] = paths.get((d1, d2), 0.0) + p1 * p2
        one = sample_selector_walk(sel, logits, hidden, anchor, s, gen)
        d1, d2 = one.tokens[0].tolist()
        for i, (_pred, law) in enumerate([(4, step_law(4, 0)), (d1, step_law(d1, 1))]):
            want = torch.zeros(V, dtype=torch.float64)
            for c, p in law.items():
                want[c] = p
            torch.testing.assert_close(one.probs[0, i], want)
        n = 20000
        many = sample_selector_walk(sel, logits.expand(n, -1, -1), hidden.expand(n, -1, -1), anchor.expand(n), s, gen)
    assert_law([tuple(t) for t in many.tokens.tolist()], {k: v for k, v in paths.items() if v > 0})


def test_backbone_proposal_samples_each_position_from_its_processed_law() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 2, V, generator=gen, dtype=torch.float64)
    s = Sampling(1.2, top_k=4)
    q = probabilities(logits[0], s)
    many = sample_backbone(logits.expand(20000, -1, -1), s, gen)
    torch.testing.assert_close(many.probs[0], q)
    exact = {(a, b): float(q[0, a] * q[1, b]) for a in range(V) for b in range(V) if q[0, a] * q[1, b] > 0}
    assert_law([tuple(t) for t in many.tokens.tolist()], exact)


# ----------------------------------------------------------------------------- 3. the rejection rule
def _verify_samples(draft_kind: str, rule: Callable, n: int = 10000) -> tuple[list, dict, list[int]]:
    """Draft from ``q``, apply ``rule`` against ``p``, then continue with ``p`` as the loop's next cycle
    would: returns the completed sequences, their exact law ``prod_i p_i`` and the accepted counts."""
    gen = torch.Generator().manual_seed(4)
    vocab, length = 4, 2
    p = torch.softmax(torch.randn(length + 1, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(length, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    if draft_kind == "sparse":
        q[:, 0] = 0
        q = q / q.sum(-1, keepdim=True)
    if draft_kind == "equal":
        q = p[:-1].clone()
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(length)], 1)
    fills = torch.stack([torch.multinomial(p[i], n, replacement=True, generator=gen) for i in range(length + 1)], 1)
    samples, accepted = [], []
    for d, f in zip(drafts, fills.tolist()):
        a, token = rule(d, q, p, gen)
        accepted.append(a)
        samples.append(tuple(d[:a].tolist()) + (token,) + tuple(f[a + 1 :]))
    exact = {
        seq: math.prod(float(p[i, t]) for i, t in enumerate(seq))
        for seq in itertools.product(range(vocab), repeat=length + 1)
    }
    return samples, exact, accepted


@pytest.mark.parametrize("draft_kind", ["dense", "sparse", "equal"])
def test_verify_turns_any_proposal_into_the_target_law(draft_kind: str) -> None:
    """``sparse``: ``q`` misses a token ``p`` has (as the selector's top-k does); ``equal``: ``q == p``,
    every draft is accepted and the bonus comes from ``p``."""
    samples, exact, accepted = _verify_samples(draft_kind, verify)
    assert_law(samples, exact)
    assert set(accepted) == ({2} if draft_kind == "equal" else {0, 1, 2})


def test_verify_checks_shapes() -> None:
    with pytest.raises(ValueError, match="inconsistent"):
        verify(torch.tensor([1, 2]), torch.ones(2, 4) / 4, torch.ones(2, 4) / 4)


# ----------------------------------------------------------------------------- 4. end to end
class TargetDrafter:
    """A drafter that proposes from the target's own processed law (a full forward per drafted token):
    ``q == p``, so every draft is accepted and every cycle ends with the bonus token.

    It rebuilds the verified sequence from what the loop tells it: the anchor and start of each cycle
    (the accepted drafts are its own previous proposal, ``start - previous start - 1`` of them).
    """

    def __init__(self, hf, prompt: list[int]) -> None:
        self.hf, self.block_size, self.target_layer_ids = hf, BLOCK, [0]
        self.prompt, self.sequence, self.last = prompt, [], (0, [])

    def context_kv(self, features, positions):
        return self

    def append(self, other):
        return self

    @torch.no_grad()
    def sample_block(self, anchor, context, embed, head, start, sampling, generator):
        if start == len(self.prompt):  # a new generation
            self.sequence = list(self.prompt)
        else:
            last_start, last_tokens = self.last
            self.sequence = self.sequence[: last_start + 1] + last_tokens[: start - last_start - 1]
        assert len(self.sequence) == start
        self.sequence.append(int(anchor))
        seq, tokens, qs = list(self.sequence), [], []
        for _ in range(BLOCK - 1):
            q = probabilities(self.hf(input_ids=torch.tensor([seq])).logits[0, -1], sampling)
            seq.append(int(sampling_mod.draw(q, generator)))
            tokens.append(seq[-1])
            qs.append(q)
        self.last = (start, tokens)
        return sampling_mod.Proposal(torch.tensor([tokens]), torch.stack(qs)[None])


def run_loop(
    hf, draft, n_samples: int, new: int, s: Sampling, stop: Sequence[int] = (), seed: int = 0, path: str | None = None
) -> tuple[list[tuple[int, ...]], list[int]]:
    """``n_samples`` seeded speculative generations: their token tuples and the untruncated cycles' accepted counts."""
    gen = torch.Generator().manual_seed(seed)
    samples, accepted = [], []
    for _ in range(n_samples):
        r = speculative_generate(
            hf,
            draft,
            PROMPT,
            new,
            stop,
            path=path,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            generator=gen,
        )
        samples.append(tuple(r.tokens))
        accepted += r.accepted
    return samples, accepted


N_LOOP = 400


def test_sampled_loop_follows_the_target_law_with_real_randomness() -> None:
    """The seeded generator path (torch's own multinomial), vocabulary 6 at T=1: 400 samples."""
    hf, draft, s = tiny_hf(), tiny_draft(), Sampling(1.0)
    samples, accepted = run_loop(hf, draft, N_LOOP, 3, s, path="selector")
    assert_law(samples, exact_law(hf, PROMPT, 3, s))
    assert set(accepted) == {0, 1, 2}


def test_target_sample_follows_the_target_law() -> None:
    hf, s = tiny_hf(), Sampling(0.9, top_k=4)
    gen = torch.Generator().manual_seed(5)
    samples = [
        tuple(target_sample(hf, PROMPT, 3, temperature=0.9, top_k=4, generator=gen).tokens) for _ in range(N_LOOP)
    ]
    assert_law(samples, exact_law(hf, PROMPT, 3, s))


def _accept_all(drafts, q, p, generator=None):
    return drafts.shape[0], int(sampling_mod.draw(p[-1], generator))


def _resample_from_p(drafts, q, p, generator=None):
    """A classic bug: on rejection draw from ``p`` instead of the residual ``max(p - q, 0)``."""
    a, token = verify(drafts, q, p, generator)
    return (a, int(sampling_mod.draw(p[a], generator))) if a < drafts.shape[0] else (a, token)


def _shifted(drafts, q, p, generator=None):
    """An off-by-one wiring bug: each draft judged against the next position's target law."""
    return verify(drafts, q, torch.cat([p[1:], p[-1:]]), generator)


def test_greedy_is_unchanged_and_sampling_is_seeded() -> None:
    hf, draft = tiny_hf(), tiny_draft()
    greedy = speculative_generate(hf, draft, PROMPT, 12)
    assert greedy.tokens == spec.target_greedy(hf, PROMPT, 12).tokens
    assert speculative_generate(hf, draft, PROMPT, 12, temperature=0.0, seed=3).tokens == greedy.tokens
    a = speculative_generate(hf, draft, PROMPT, 12, temperature=1.0, seed=3)
    b = speculative_generate(hf, draft, PROMPT, 12, temperature=1.0, seed=3)
    assert a.tokens == b.tokens and a.accepted == b.accepted
    with pytest.raises(ValueError, match="seed=3 and a generator"):
        speculative_generate(hf, draft, PROMPT, 4, temperature=1.0, seed=3, generator=torch.Generator())
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(hf, draft, PROMPT, 4, temperature=1.0, top_p=0)


def test_a_greedy_only_drafter_refuses_to_sample() -> None:
    class Greedy:
        block_size, target_layer_ids = BLOCK, [0]

        def context_kv(self, features, positions):
            return self

        def draft_block(self, anchor, context, embed, head, start):
            return torch.zeros(1, BLOCK - 1, dtype=torch.long)

    with pytest.raises(ValueError, match="temperature=1.0 is invalid for Greedy: it drafts greedily only"):
        speculative_generate(tiny_hf(), Greedy(), PROMPT, 4, temperature=1.0)


# ----------------------------------------------------------------------------- exact enumeration of the loop
class Enumerator:
    """Runs a function once per outcome of its random choices, with each outcome's exact probability.

    Installed in place of :func:`~dflash2_lightning.model.sampling.draw` (every random choice of the loop goes
    through it): each row of ``probs`` is one choice point. A depth-first search replays a script of
    choices and branches at every new point over the options of nonzero probability. Options below
    ``floor`` are not followed; :meth:`law` reports the mass they carry (``missing``).
    """

    def __init__(self, floor: float = 1e-12) -> None:
        self.floor, self.script, self.made, self.options, self.prob = floor, [], [], [], 1.0

    def draw(self, probs: torch.Tensor, generator=None) -> torch.Tensor:
        out = []
        for row in probs.reshape(-1, probs.shape[-1]).tolist():
            opts = [(i, p) for i, p in enumerate(row) if p > self.floor]
            depth = len(self.made)
            choice = self.script[depth] if depth < len(self.script) else 0
            self.made.append(choice)
            self.options.append(len(opts))
            self.prob *= opts[choice][1]
            out.append(opts[choice][0])
        return torch.tensor(out, dtype=torch.long).reshape(probs.shape[:-1])

    def law(self, fn: Callable[[], tuple]) -> tuple[dict, float, int]:
        """``({outcome: probability}, missing mass, number of runs)`` of ``fn()``."""
        law: dict = {}
        stack, runs = [[]], 0
        while stack:
            self.script, self.made, self.options, self.prob = stack.pop(), [], [], 1.0
            outcome = fn()
            runs += 1
            law[outcome] = law.get(outcome, 0.0) + self.prob
            for depth in range(len(self.script), len(self.made)):
                stack += [self.made[:depth] + [alt] for alt in range(1, self.options[depth])]
        return law, 1.0 - sum(law.values()), runs


def loop_law(
    monkeypatch, hf, draft, new: int, s: Sampling, stop: Sequence[int] = (), path: str | None = None
) -> tuple[dict, int]:
    """The exact law of the speculative loop's output (every run enumerated), and how many runs it took."""
    enum = Enumerator()
    monkeypatch.setattr(sampling_mod, "draw", enum.draw)
    monkeypatch.setattr(spec, "draw", enum.draw)
    law, missing, runs = enum.law(
        lambda: tuple(
            speculative_generate(
                hf, draft, PROMPT, new, stop, path=path, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k
            ).tokens
        )
    )
    assert missing < 1e-9
    return law, runs


def assert_same_law(got: dict, want: dict, tol: float = 1e-9) -> None:
    keys = set(got) | set(want)
    worst = max(keys, key=lambda k: abs(got.get(k, 0.0) - want.get(k, 0.0)))
    gap = abs(got.get(worst, 0.0) - want.get(worst, 0.0))
    assert gap < tol, f"{worst}: loop {got.get(worst, 0.0):.12f}, target {want.get(worst, 0.0):.12f}"


EXACT = {  # name: (vocab, projector, path, sampling); 3 new tokens = the prefill's and two cycles'
    "selector": (3, "dflash2", "selector", Sampling(1.0)),
    "backbone-top_k": (4, "dflash2", "backbone", Sampling(1.0, top_k=2)),
    "selector-top_p": (5, "dflash2", "selector", Sampling(0.7, top_p=0.6)),
    "dflash-top_k": (6, "dflash", "backbone", Sampling(1.5, top_k=2)),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_loop_law_equals_target_law_exactly(case: str, monkeypatch) -> None:
    """Every outcome of the real loop enumerated: its law equals the target's to 1e-9."""
    vocab, projector, path, s = EXACT[case]
    hf, draft = tiny_hf(vocab=vocab), tiny_draft(projector, vocab=vocab)
    want = exact_law(hf, PROMPT, 3, s)
    got, runs = loop_law(monkeypatch, hf, draft, 3, s, path=path)
    assert_same_law(got, want)
    assert runs > len(want)  # several runs per outcome: acceptance and rejection paths both reached it


def test_loop_law_exact_when_every_draft_is_accepted(monkeypatch) -> None:
    """``q == p``: every cycle accepts its whole block and emits the bonus token; the law is still exact."""
    hf, s = tiny_hf(vocab=4), Sampling(1.0, top_k=2)
    drafter = TargetDrafter(hf, PROMPT)
    cycles = []
    original = spec.verify

    def record(drafts, q, p, generator=None):
        out = original(drafts, q, p, generator)
        cycles.append(out[0])
        return out

    monkeypatch.setattr(spec, "verify", record)
    got, _ = loop_law(monkeypatch, hf, drafter, 4, s)
    assert set(cycles) == {BLOCK - 1}
    assert_same_law(got, exact_law(hf, PROMPT, 4, s))


def test_loop_law_exact_with_a_stop_token_inside_the_block(monkeypatch) -> None:
    vocab, s = 4, Sampling(1.0, top_k=2)
    hf, draft = tiny_hf(vocab=vocab), tiny_draft("dflash2", vocab=vocab)
    plain = exact_law(hf, PROMPT, 4, s)
    second = Counter()
    for seq, p in plain.items():
        second[seq[1]] += p
    stop = second.most_common(1)[0][0]  # the likeliest second token: often inside a drafted block
    want = exact_law(hf, PROMPT, 4, s, stop=[stop])
    got, _ = loop_law(monkeypatch, hf, draft, 4, s, stop=[stop], path="selector")
    assert sum(p for seq, p in want.items() if len(seq) < 4) > 0.2  # stopping early is common
    assert_same_law(got, want)


@pytest.mark.parametrize(
    "broken", [_accept_all, _resample_from_p, _shifted], ids=["accept-all", "residual-is-p", "off-by-one"]
)
def test_enumeration_catches_a_broken_rule(broken: Callable, monkeypatch) -> None:
    """Negative controls: the same exact comparison fails for each broken acceptance rule."""
    vocab, projector, path, s = EXACT["backbone-top_k"]
    hf, draft = tiny_hf(vocab=vocab), tiny_draft(projector, vocab=vocab)
    monkeypatch.setattr(spec, "verify", broken)
    got, _ = loop_law(monkeypatch, hf, draft, 3, s, path=path)
    with pytest.raises(AssertionError):
        assert_same_law(got, exact_law(hf, PROMPT, 3, s), tol=1e-3)


def test_verify_test_catches_the_residual_bug() -> None:
    """Negative control for the statistical test of :func:`verify` (same sizes as that test)."""
    samples, exact, _ = _verify_samples("dense", _resample_from_p)
    assert law_failures(samples, exact)


def _grid_law(scores: torch.Tensor, settings: Sampling, points: int = 20000, chunk: int = 500) -> torch.Tensor:
    """The law ``draw_rows`` gives each row under ``points`` evenly spread uniforms: [rows, V] frequencies."""
    rows, vocab = scores.shape
    counts = torch.zeros(rows, vocab, dtype=torch.float64)
    grid = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    for u in grid.split(chunk):  # every row under every uniform of the chunk, in one call
        picks = draw_rows(
            scores.repeat(len(u), 1), settings, [None] * (rows * len(u)), uniforms=u.repeat_interleave(rows)
        )
        counts.index_put_(
            (torch.arange(rows).repeat(len(u)), picks), torch.ones(len(picks), dtype=torch.float64), accumulate=True
        )
    return counts / points


@pytest.mark.parametrize(
    "settings",
    [Sampling(0.8, 0.95), Sampling(1.0, 0.5), Sampling(0.7, 1.0, 20), Sampling(1.0, 0.9, 300), Sampling(1.3)],
)
def test_batched_row_draws_follow_the_processed_law(settings, monkeypatch) -> None:
    """draw_rows keeps exactly probabilities()' tokens and draws them with its probabilities (to 1 / grid)."""
    monkeypatch.setattr(sampling_mod, "ROW_CANDIDATES", 32)  # small enough that the flat rows overflow it
    torch.manual_seed(0)
    peaked = torch.randn(3, 1000) * 4  # nucleus inside the 32 candidates
    flat = torch.randn(2, 1000) * 0.1  # nucleus far past them: the full-sort path
    tied = torch.randn(2, 1000).to(torch.bfloat16).float() * 3  # bf16 logits: ties, some at the cut
    tied[:, :40] = tied[:, :40].max()  # a tie group straddling the top-k and top-p cuts
    scores = torch.cat([peaked, flat, tied])
    want = probabilities(scores, settings)
    got = _grid_law(scores, settings)
    assert ((got > 0) <= (want > 0)).all()  # never a token probabilities() cuts
    assert (got - want).abs().max() < 2e-4  # 1 / 20000 per grid step, a few steps of rounding
    # With real generators: one draw per row, seeded per row, independent of the batch it shares.
    gens = [torch.Generator().manual_seed(i) for i in range(len(scores))]
    first = draw_rows(scores, settings, gens)
    alone = torch.stack(
        [draw_rows(scores[i : i + 1], settings, [torch.Generator().manual_seed(i)])[0] for i in range(len(scores))]
    )
    assert torch.equal(first, alone)
    assert (want.gather(1, first[:, None]) > 0).all()
