"""`dflash2 eval`: measure a drafter with real speculative decoding, beside the trainer's estimate.

For every prompt of a held-out prompts file (chat jsonl) the target decodes greedily on its own (the
reference output and the tokens/s baseline), then speculatively with the draft, once per decoding path
(DFlash2's selector walk and the backbone argmax). Every speculative output is checked token for token
against the reference. The report gives, per path, the measured acceptance length τ, the per-position
acceptance, the histogram of accepted lengths and the speed-up, and beside it two teacher-forced figures
computed from the draft's *training* forward on the target's own continuations:

``estimated``
    the trainer's estimator, computed by the trainer's own objective and metric
    (:class:`~dflash2_lightning.objective.DraftObjective`, :class:`~dflash2_lightning.metrics.BlockAcceptance`):
    an anchor at every continuation position where a whole block fits (``a <= S - bs``, the positions
    the trainer samples anchors from), the block sees the context strictly before it,
    ``accept_k`` = P(offsets 1..k all right), ``τ = 1 + Σ_k accept_k``;
``replayed``
    the same teacher-forced per-anchor acceptance, read only at the anchors where the loop starts a
    cycle (``a_0`` = first generated token, ``a_{i+1} = a_i + accepted_i + 1``). Up to floating-point
    ties it equals the measured τ exactly, which shows the draft computes the same thing in both.

At T=0 the report also gives the **top-k oracle** (``oracle``): the same replay where a slot counts when
the target's token is anywhere among the draft's top-k candidates (``k`` = the selector's ``top_k``; 8
for a DFlash draft unless ``oracle_top_k`` says otherwise). It is the τ of a selector that always
picked right among the candidates it is given: how much of the gap between the backbone argmax and
that ceiling the selector walk closes says whether the selector or the candidates limit DFlash2.

With ``replay_prompts`` the report also has the **T=0 replay** (``replay``, :func:`replay_eval`): the target
decodes more held-out prompts greedily in batches and the loop's cycles are replayed along those outputs,
which gives the loop's τ exactly on many more tokens than the sequential loop can afford (a narrow interval).

Why the estimate and the measurement differ (and the replay does not):

* anchors: the loop starts a cycle only right after a rejection (or a fully accepted block), the
  estimator averages over every position. Positions right after a draft mistake are a biased sample
  (usually harder: the tiny test drafts measure 8-12% below their estimate), and positions inside
  long easy runs are counted once per position by the estimator but skipped by the loop;
* blocks near the end: the estimator never anchors in the last ``bs - 1`` positions; the loop does,
  and drops its final cycle when a stop token or the token budget cut it;
* numerics: a full forward and the loop's cached verify passes agree up to rounding, which can flip an
  argmax at a near tie (bf16 much more than float32).

The selector is not a source of difference: the trainer's acceptance follows the same greedy walk,
seeded with the anchor, as the loop (its teacher-forced ``selector/accuracy`` is another quantity).

Temperatures (``--temperature 0 0.7 1``): every one is measured in turn and reported under
``temperatures`` (the top-level ``paths``/``tau`` are the first one's). At ``T > 0`` the target alone
and the loop sample (``--top-p``/``--top-k``, ``--samples`` generations per prompt, each seeded from
``--seed``); the estimate beside the measurement is then the trainer's expected acceptance under
sampling (:class:`~dflash2_lightning.metrics.SampledAcceptance`) on the target's sampled continuation.
Every measured figure carries a 95% bootstrap interval over prompts (:mod:`dflash2_lightning.intervals`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflash2_lightning.intervals import RESAMPLES, bootstrap_intervals
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.sampling import Sampling
from dflash2_lightning.speculative import (AcceptanceStats, DraftPath, GreedyResult, Head, SpecResult, TorchDrafter,
                                           speculative_generate, target_features, target_greedy, target_handles,
                                           target_sample)

PATHS: tuple[DraftPath, ...] = ("selector", "backbone")
ORACLE_TOP_K = 8  # the top-k oracle's candidates for a draft without a selector (the quickstart's selector_top_k)


def default_oracle_top_k(draft: DraftModel) -> int:
    """The top-k oracle's candidates for ``draft``: its selector's ``top_k``, or :data:`ORACLE_TOP_K` for DFlash."""
    return draft.config.selector_top_k if draft.candidate_selector is not None else ORACLE_TOP_K


# ----------------------------------------------------------------------------- teacher-forced estimate
@dataclass
class TeacherForced:
    """Per-anchor results of the draft's training forward on one sequence, for one decoding path.

    Anchors are every position of the continuation (``anchors [N]``, absolute); ``right``/``valid``
    ``[N, bs-1]``: the draft token at offset ``k`` equals the target's greedy token / lies inside the data.
    """

    anchors: Tensor
    right: Tensor
    valid: Tensor
    seq_len: int
    block_size: int
    alpha: Tensor | None = None  # [N, bs-1] acceptance probability of each slot under sampling

    def trainer_blocks(self) -> tuple[Tensor, Tensor]:
        """``(right, valid)`` of the anchors the trainer samples from: blocks that fit (``a <= S - bs``)."""
        fits = self.anchors <= self.seq_len - self.block_size
        return self.right[fits], self.valid[fits]

    def replay(self) -> list[int]:
        """The accepted lengths of the speculative loop's untruncated cycles, replayed from these anchors.

        The first cycle anchors on the first generated token, the next one ``accepted + 1`` later. A
        cycle counts when its bonus token lies inside the data; the replay stops at the first one that
        does not (the loop's final, truncated cycle).
        """
        right = (self.right & self.valid).long().cumprod(-1)
        lengths = right.sum(-1).tolist()
        # A length is final once a wrong token was seen inside the data or the whole block fit.
        known = ((self.valid & ~self.right).any(-1) | self.valid.all(-1)).tolist()
        out, i = [], 0
        while i < len(lengths):
            n = lengths[i]
            if not known[i] or int(self.anchors[i]) + n + 1 >= self.seq_len:
                break
            out.append(n)
            i += n + 1
        return out


@torch.no_grad()
def teacher_forced(draft: DraftModel, target: Any, prompt: Sequence[int], continuation: Sequence[int],
                   paths: Sequence[DraftPath] = PATHS, chunk: int = 32,
                   sampling: Sampling | None = None, oracle_top_k: int | None = None) -> dict[str, TeacherForced]:
    """Run the trainer's objective (:class:`~dflash2_lightning.objective.DraftObjective`) on
    ``prompt + continuation`` with an anchor at every continuation position.

    The target runs once over the whole sequence (features, and its greedy next tokens: what "right"
    means); the continuation is the supervised region, as an assistant turn is in training. The
    selector path uses the objective's greedy walk (``walk=True``). Anchors go ``chunk`` at a time.
    With a sampling ``sampling`` each slot also gets its acceptance probability under speculative
    sampling (:func:`~dflash2_lightning.metrics.sampled_alpha`, the trainer's ``val/t<T>`` metric).
    With ``oracle_top_k`` (greedy only) the result also has an ``"oracle"`` entry: a slot is right when
    the target's token is among the draft's top ``oracle_top_k`` logits.
    """
    from dflash2_lightning.metrics import sampled_alpha
    from dflash2_lightning.objective import DraftObjective, Teacher

    t = target_handles(target)
    cfg, dtype = draft.config, next(draft.parameters()).dtype
    bs, device = cfg.block_size, t.hf.device
    ids = torch.tensor([list(prompt) + list(continuation)], dtype=torch.long, device=device)
    p, s = len(prompt), ids.shape[1]
    out = t.hf(input_ids=ids, use_cache=False, output_hidden_states=True)
    features = target_features(out.hidden_states, cfg.target_layer_ids or []).to(dtype)
    sampled = sampling is not None and not sampling.greedy
    teacher = Teacher(greedy=out.logits.argmax(-1), logits=out.logits if sampled else None)
    loss_mask = torch.arange(s, device=device)[None] >= p
    embed = lambda x: t.embed(x).to(dtype)  # noqa: E731 (target and draft may differ in dtype)
    head_dtype = t.hf.get_output_embeddings().weight.dtype
    head = lambda h: t.head(h.to(head_dtype))  # noqa: E731
    objective = DraftObjective(token_loss="ce", selector_loss_alpha=0.0)
    want = [x for x in paths if x == "backbone" or draft.candidate_selector is not None]
    oracle = bool(oracle_top_k) and not sampled
    rights: dict[str, list[Tensor]] = {x: [] for x in want + (["oracle"] if oracle else [])}
    alphas: dict[str, list[Tensor]] = {x: [] for x in want}
    valids = []
    anchors = torch.arange(p, s, device=device)
    for lo in range(0, anchors.shape[0], chunk):
        a = anchors[lo:lo + chunk][None]
        res = objective(draft, embed, head, ids, loss_mask, features, teacher,
                        anchors=(a, torch.ones_like(a, dtype=torch.bool)), walk="selector" in want)
        valids.append(res.blocks.valid[0])
        for x in want:
            tokens = res.draft_tokens if x == "backbone" else res.selector_tokens
            rights[x].append((tokens == res.reference)[0])
        if oracle:
            top = res.logits.topk(min(oracle_top_k, res.logits.shape[-1]), dim=-1).indices
            rights["oracle"].append((top == res.reference[..., None]).any(-1)[0])
        if sampled:
            for x, alpha in sampled_alpha(res, sampling).items():
                if x in alphas:
                    alphas[x].append(alpha[0])
    valid = torch.cat(valids) if valids else torch.zeros(0, bs - 1, dtype=torch.bool)
    return {x: TeacherForced(anchors.cpu(), (torch.cat(r) if r else valid).cpu(), valid.cpu(), s, bs,
                             torch.cat(alphas.get(x, [])).cpu() if alphas.get(x) else None)
            for x, r in rights.items()}


@dataclass
class EstimateStats:
    """The trainer's acceptance estimate accumulated over sequences, plus the loop replay.

    ``metric`` is the trainer's own :class:`~dflash2_lightning.metrics.BlockAcceptance` (same
    ``accept_k`` and ``tau``); ``replayed`` the loop's accepted lengths recovered from the same forward.
    """

    block_size: int
    metric: Any
    replayed: list[int]
    updates: int = 0
    sampled: Any = None  # a SampledAcceptance at temperature > 0 (then the greedy figures are not reported)

    @classmethod
    def empty(cls, block_size: int, sampled: bool = False) -> "EstimateStats":
        from dflash2_lightning.metrics import BlockAcceptance, SampledAcceptance

        return cls(block_size, BlockAcceptance(block_size), [],
                   sampled=SampledAcceptance(block_size) if sampled else None)

    def add(self, tf: TeacherForced) -> None:
        right, valid = tf.trainer_blocks()
        if right.shape[0]:
            self.metric.update(right, valid)
            if self.sampled is not None and tf.alpha is not None:
                self.sampled.update(tf.alpha[tf.anchors <= tf.seq_len - tf.block_size], valid)
            self.updates += 1
        self.replayed += tf.replay()

    def summary(self) -> dict[str, Any]:
        if self.sampled is not None:  # expected acceptance under sampling, teacher-forced (no replay: random)
            if not self.updates:
                return {"tau": None, "accept": None, "alpha": None, "blocks": 0, "kind": "sampled"}
            r = self.sampled.compute()
            return {"tau": float(r["tau"]), "accept": [float(x) for x in r["accept"]],
                    "alpha": [float(x) for x in r["alpha"]], "blocks": int(r["num_blocks"]), "kind": "sampled"}
        if not self.updates:  # every continuation shorter than a block: nothing the trainer would count
            return {"tau": None, "accept": None, "acc": None, "blocks": 0,
                    "replayed_tau": None, "replayed_cycles": len(self.replayed)}
        result = self.metric.compute()
        replay_tau = 1.0 + sum(self.replayed) / len(self.replayed) if self.replayed else 0.0
        return {"tau": float(result["tau"]), "accept": [float(x) for x in result["accept"]],
                "acc": [float(x) for x in result["acc"]], "blocks": int(result["num_blocks"]),
                "replayed_tau": replay_tau, "replayed_cycles": len(self.replayed)}


# ----------------------------------------------------------------------------- the evaluation
@dataclass
class PathRun:
    """Everything measured for one decoding path over the prompts."""

    results: list[SpecResult]
    estimate: EstimateStats | None
    mismatched: list[int]
    by_prompt: list[list[SpecResult]] = field(default_factory=list)  # the bootstrap's unit


def evaluate_draft(draft: DraftModel, target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   paths: Sequence[DraftPath] = PATHS, stop_token_ids: Sequence[int] | None = None,
                   estimate: bool = True, warmup: bool = True, progress: bool = True,
                   temperatures: Sequence[float] = (0.0,), top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                   samples: int = 1, resamples: int = RESAMPLES, oracle_top_k: int | None = None,
                   draft_head: Head | None = None) -> dict[str, Any]:
    """Measure ``draft`` against ``target`` on tokenised ``prompts``; the report as a dict (see :func:`run_eval`).

    ``paths`` not available to the draft (the selector of a DFlash baseline) are skipped and noted.
    ``stop_token_ids`` default to the target's eos ids. Every temperature in ``temperatures`` is
    measured (``0`` greedy, checked token for token against the target; ``> 0`` sampled with
    ``top_p``/``top_k``, ``samples`` generations per prompt, each seeded from ``seed``, the prompt and
    the sample). The top-level ``paths``/``tau``/``target_only`` are those of the first temperature;
    ``temperatures`` holds every one. Intervals: bootstrap over prompts (:mod:`~dflash2_lightning.intervals`).
    ``oracle_top_k``: candidates of the T=0 top-k oracle (default: the selector's ``top_k``, or
    :data:`ORACLE_TOP_K` for a DFlash draft). ``draft_head``: the loop drafts through this head instead of
    the target's (e.g. a :class:`~dflash2_lightning.draft_vocab.DraftVocabHead`; the target still verifies
    with its own); the teacher-forced estimates keep the target's head.
    """
    from dflash2_lightning.config import ConfigError

    _check_inputs(prompts, max_new_tokens, oracle_top_k, "evaluate")
    if samples < 1:
        raise ConfigError(f"samples={samples} is invalid: must be >= 1 (generations per prompt)")
    temps = [float(t) for t in temperatures]
    if not temps or len(set(temps)) != len(temps):
        raise ConfigError(f"temperatures={temps} is invalid: need at least one, without repeats")
    settings = [Sampling(t, top_p, top_k) for t in temps]  # validates every setting before any work
    if hasattr(target, "check_fits"):
        target.check_fits(draft.config, "the draft")
    hf = target_handles(target).hf
    draft = draft.to(hf.device).eval()
    stop = list(stop_token_ids if stop_token_ids is not None else getattr(target, "eos_token_ids", []))
    usable = [x for x in paths if x == "backbone" or draft.candidate_selector is not None]
    notes = [f"path {x!r} skipped: a DFlash baseline draft has no candidate selector"
             for x in paths if x not in usable]
    drafters = {x: TorchDrafter(draft, x, head=draft_head) for x in usable}
    if warmup:  # first calls pay for allocation and lazy init; keep them out of the timings
        target_greedy(target, prompts[0], min(4, max_new_tokens), stop)
        for drafter in drafters.values():
            speculative_generate(target, drafter, prompts[0], min(4, max_new_tokens), stop)
            if any(not st.greedy for st in settings):
                speculative_generate(target, drafter, prompts[0], min(4, max_new_tokens), stop,
                                     temperature=1.0, seed=seed)
    if any(not st.greedy for st in settings):
        notes.append("temperature > 0: outputs are samples, so losslessness is not checked token for token "
                     "(lossless: null); the loop's output law is proven equal to the target's in "
                     "tests/test_sampling.py")

    if oracle_top_k is None:
        oracle_top_k = default_oracle_top_k(draft)
    blocks = {}
    for ti, st in enumerate(settings):
        blocks[_temperature_key(st.temperature)] = _evaluate_at(
            draft, drafters, target, prompts, max_new_tokens, stop, estimate, progress, st,
            seed, ti, samples if not st.greedy else 1, resamples, oracle_top_k)
    first = next(iter(blocks.values()))
    report: dict[str, Any] = {
        "architecture": draft.config.architecture,
        "block_size": draft.config.block_size,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "generated_tokens": first["target_only"]["tokens"],
        "stopped_at_eos": first["stopped_at_eos"],
        "target_only": first["target_only"],
        "machine": {"device": str(hf.device), "torch_threads": torch.get_num_threads(),
                    "target_dtype": str(next(hf.parameters()).dtype).replace("torch.", ""),
                    "draft_dtype": str(next(draft.parameters()).dtype).replace("torch.", "")},
        "sampling": {"temperatures": temps, "top_p": top_p, "top_k": top_k, "seed": seed,
                     "samples_per_prompt": samples, "bootstrap_resamples": resamples},
        "paths": first["paths"],
        "tau": first["tau"],
        "temperatures": blocks,
        "notes": notes,
    }
    return report


def _check_inputs(prompts: Sequence[Sequence[int]], max_new_tokens: int, oracle_top_k: int | None,
                  verb: str) -> None:
    """The checks every evaluation (the loop's, the replay's) makes before any work."""
    from dflash2_lightning.config import ConfigError

    if not prompts:
        raise ConfigError(f"prompts is empty: need at least one prompt to {verb}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    if oracle_top_k is not None and oracle_top_k < 1:
        raise ConfigError(f"oracle_top_k={oracle_top_k} is invalid: must be >= 1 (candidates per position)")


def _temperature_key(t: float) -> str:
    return f"{t:g}"


def _run_seed(seed: int, *parts: int) -> int:
    """A seed for one generation, fixed by the run's seed and (temperature, prompt, sample, stream)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0])


def _evaluate_at(draft: DraftModel, drafters: dict[DraftPath, TorchDrafter], target: Any,
                 prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: list[int], estimate: bool,
                 progress: bool, st: Sampling, seed: int, ti: int, samples: int, resamples: int,
                 oracle_top_k: int) -> dict[str, Any]:
    """One temperature: target-only and speculative runs of every prompt, the per-path figures and intervals."""
    from tqdm.auto import tqdm

    usable = list(drafters)
    kw = {} if st.greedy else {"temperature": st.temperature, "top_p": st.top_p, "top_k": st.top_k}
    references: list[list[GreedyResult]] = []
    runs = {x: PathRun([], EstimateStats.empty(draft.config.block_size, not st.greedy) if estimate else None, [])
            for x in usable}
    oracle = EstimateStats.empty(draft.config.block_size) if estimate and st.greedy else None
    desc = "eval" if st.greedy else f"eval T={st.temperature:g}"
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt", disable=not progress)):
        refs = []
        for x in usable:
            runs[x].by_prompt.append([])
        for j in range(samples):
            ref = (target_greedy(target, prompt, max_new_tokens, stop) if st.greedy else
                   target_sample(target, prompt, max_new_tokens, stop, seed=_run_seed(seed, ti, i, j, 0), **kw))
            refs.append(ref)
            for xi, x in enumerate(usable):
                r = speculative_generate(target, drafters[x], prompt, max_new_tokens, stop,
                                         **({} if st.greedy else {"seed": _run_seed(seed, ti, i, j, 1 + xi), **kw}))
                r.context = None  # drop the cache: the report keeps only numbers
                runs[x].results.append(r)
                runs[x].by_prompt[-1].append(r)
                if st.greedy and r.tokens != ref.tokens:
                    runs[x].mismatched.append(i)
        references.append(refs)
        if estimate:
            # At temperature > 0 on the target's first sampled continuation, with the sampled estimate.
            for x, tf in teacher_forced(draft, target, prompt, refs[0].tokens, usable, sampling=st,
                                        oracle_top_k=oracle_top_k).items():
                (oracle if x == "oracle" else runs[x].estimate).add(tf)

    flat = [r for refs in references for r in refs]
    base_tokens = sum(len(r.tokens) for r in flat)
    base_seconds = sum(r.seconds for r in flat)
    base_tps = base_tokens / base_seconds if base_seconds > 0 else None
    block: dict[str, Any] = {
        "temperature": st.temperature, "top_p": st.top_p, "top_k": st.top_k, "samples_per_prompt": samples,
        "stopped_at_eos": sum(r.stopped for r in flat),
        "target_only": {"tokens": base_tokens, "seconds": base_seconds, "tokens_per_second": base_tps},
        "paths": {},
    }
    for x, run in runs.items():
        measured = AcceptanceStats.from_results(run.results).summary()
        tps = measured["tokens_per_second"]
        per_prompt = [AcceptanceStats.from_results(rs) for rs in run.by_prompt]
        block["paths"][x] = {
            "measured": measured,
            "estimated": run.estimate.summary() if run.estimate is not None else None,
            "lossless": not run.mismatched if st.greedy else None,
            "mismatched_prompts": run.mismatched,
            "speedup": tps / base_tps if tps and base_tps else None,
            "interval": bootstrap_intervals(
                [s.histogram for s in per_prompt], [s.tokens for s in per_prompt], [s.seconds for s in per_prompt],
                [sum(len(r.tokens) for r in refs) for refs in references],
                [sum(r.seconds for r in refs) for refs in references], resamples=resamples, seed=seed),
            "per_prompt_accepted": [int(sum(sum(r.accepted) for r in rs)) for rs in run.by_prompt],
        }
    block["tau"] = {x: v["measured"]["tau"] for x, v in block["paths"].items()}
    if oracle is not None:
        block["oracle"] = {"top_k": oracle_top_k, **oracle.summary()}
    return block


# ----------------------------------------------------------------------------- the wide replay
def replay_lengths(draft: DraftModel, target: Any, prompts: Sequence[Sequence[int]],
                   outputs: Sequence[Sequence[int]], oracle_top_k: int | None = None,
                   progress: bool = False) -> dict[str, list[list[int]]]:
    """Per path (``selector``/``backbone`` where the draft has them, and ``oracle``): the accepted lengths
    of the loop's cycles replayed along each prompt's greedy ``outputs`` (one list per prompt)."""
    from tqdm.auto import tqdm

    k = oracle_top_k or default_oracle_top_k(draft)
    lengths: dict[str, list[list[int]]] = {}
    for prompt, output in tqdm(list(zip(prompts, outputs)), desc="replay", unit="prompt", disable=not progress):
        for path, tf in teacher_forced(draft, target, prompt, output, oracle_top_k=k).items():
            lengths.setdefault(path, []).append(tf.replay())
    return lengths


def replay_summary(lengths: Sequence[Sequence[int]], block_size: int, resamples: int = RESAMPLES,
                   seed: int = 0) -> dict[str, Any]:
    """τ, per-offset acceptance and their 95% bootstrap intervals (prompts resampled) of replayed cycles.

    ``lengths``: per prompt, the accepted drafted tokens of each cycle (``0 .. block_size - 1``).
    """
    hist = [np.bincount(np.asarray(x, dtype=np.int64), minlength=block_size)[:block_size] for x in lengths]
    pooled = np.sum(hist, axis=0)
    cycles = int(pooled.sum())
    accept = [float(pooled[k:].sum() / cycles) if cycles else None for k in range(1, block_size)]
    iv = bootstrap_intervals(hist, resamples=resamples, seed=seed)
    return {"tau": 1.0 + sum(accept) if cycles else None, "interval": iv["tau"],
            "accept": accept, "accept_interval": iv["accept"],
            "accepted": int(sum(sum(x) for x in lengths)), "cycles": cycles,
            "per_prompt_accepted": [int(sum(x)) for x in lengths], "per_prompt_cycles": [len(x) for x in lengths]}


def greedy_outputs(target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[int],
                   batch_size: int = 96) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (up to and including a stop token), decoded in
    batches of ``batch_size`` prompts of similar length (little padding)."""
    from dflash2_lightning.generate import generate

    hf = target_handles(target).hf
    pad = getattr(getattr(target, "tokenizer", None), "pad_token_id", None)
    pad = pad if pad is not None else (stop[0] if stop else 0)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, len(order), batch_size):
        rows = order[lo:lo + batch_size]
        for i, out in zip(rows, generate(hf, [prompts[i] for i in rows], max_new_tokens, list(stop), pad)):
            outputs[i] = out
    return outputs


def replay_eval(draft: DraftModel, target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                stop_token_ids: Sequence[int] | None = None, batch_size: int = 96, resamples: int = RESAMPLES,
                seed: int = 0, oracle_top_k: int | None = None, progress: bool = True) -> dict[str, Any]:
    """τ at T=0 on many more prompts than the loop can afford: the loop's cycles replayed, teacher-forced.

    The target decodes every prompt greedily in batches of ``batch_size``
    (:func:`~dflash2_lightning.generate.generate`; SmolLM2-135M on 2 cores: 176 tok/s at 96, 141 at 32,
    ~15 for one stream), then :func:`teacher_forced` replays the loop along each output:
    at T=0 the replay is the loop's τ exactly (same cycle starts, same per-anchor acceptance; tested,
    and every report checks it on the loop's own prompts: ``estimated.replayed_tau``), at a
    fraction of its cost, so the interval can be narrow. No timings: the loop's figures give the speed.
    """
    import time

    from dflash2_lightning.config import ConfigError

    _check_inputs(prompts, max_new_tokens, oracle_top_k, "replay")
    if batch_size < 1:
        raise ConfigError(f"replay batch_size={batch_size} is invalid: must be >= 1")
    draft = draft.to(target_handles(target).hf.device).eval()
    stop = list(stop_token_ids if stop_token_ids is not None else getattr(target, "eos_token_ids", []))
    start = time.perf_counter()
    outputs = greedy_outputs(target, prompts, max_new_tokens, stop, batch_size)
    generated = time.perf_counter() - start
    k = oracle_top_k or default_oracle_top_k(draft)
    lengths = replay_lengths(draft, target, prompts, outputs, k, progress)
    bs = draft.config.block_size
    return {"temperature": 0.0, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "generated_tokens": sum(len(o) for o in outputs),
            "stopped_at_eos": sum(bool(o) and o[-1] in stop for o in outputs),
            "seconds": {"generate": generated, "replay": time.perf_counter() - start - generated},
            "paths": {x: replay_summary(v, bs, resamples, seed) for x, v in lengths.items() if x != "oracle"},
            "oracle": {"top_k": k, **replay_summary(lengths["oracle"], bs, resamples, seed)},
            "method": "teacher-forced replay of the loop's cycles along the target's greedy outputs "
                      "(equals the measured tau at T=0)"}


def run_eval(draft_dir: str | os.PathLike, target_spec: Any, prompts_file: str | os.PathLike | None,
             out_dir: str | os.PathLike, max_new_tokens: int = 128, paths: Sequence[DraftPath] = PATHS,
             max_prompts: int | None = None, estimate: bool = True, progress: bool = True,
             temperatures: Sequence[float] = (0.0,), top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             samples: int = 1, resamples: int = RESAMPLES,
             llama_cpp: dict[str, Any] | None = None, own_load: float = 0.0,
             oracle_top_k: int | None = None, replay_prompts: int = 0,
             replay_max_new_tokens: int | None = None, draft_vocab: str | os.PathLike | None = "auto") -> dict[str, Any]:
    """``dflash2 eval``: load the draft checkpoint and the target, evaluate, write the report and the plot.

    Args:
        draft_dir: a draft checkpoint directory (``config.json`` + ``model.safetensors``).
        target_spec: a :class:`~dflash2_lightning.target.TargetSpec`, its dict, or a loaded ``Target``.
        prompts_file: chat jsonl of held-out prompts (``None``: the shipped evaluation prompts).
        out_dir: where ``eval.json`` and ``acceptance.png`` are written (atomically).
        max_new_tokens: generation budget per prompt; paths: decoding paths to measure.
        max_prompts: use only the first ``max_prompts`` prompts; estimate: also compute the
            trainer's teacher-forced estimate on the target's continuations.
        temperatures, top_p, top_k: the sampling settings measured (0 = greedy); seed: seeds every
            sampled generation and the bootstrap; samples: generations per prompt at temperature > 0;
            resamples: bootstrap draws for the intervals.
        llama_cpp: also measure in llama.cpp (keyword arguments of
            :func:`~dflash2_lightning.llamacpp_eval.evaluate_llama_cpp`, e.g. ``{"target_gguf": "f32"}``);
            the report gains a ``"llama.cpp"`` section.
        own_load: how much of the load average at the start is this process's own earlier work (the
            quickstart's training step; :func:`~dflash2_lightning.threads.own_load`), not other processes'.
        oracle_top_k: candidates of the T=0 top-k oracle (see :func:`evaluate_draft`).
        replay_prompts: also replay the loop at T=0 on the first ``replay_prompts`` prompts of the file
            (:func:`replay_eval`: τ with a narrow interval at a fraction of the loop's cost), up to
            ``replay_max_new_tokens`` tokens each (default ``max_new_tokens``); the report gains ``replay``.
        draft_vocab: the loop drafts through a :class:`~dflash2_lightning.draft_vocab.DraftVocabHead`:
            ``"auto"`` (default) with ``draft_dir/draft_vocab.json`` when it exists, a path for that file,
            ``None`` or ``"off"`` never. The report's ``draft_vocab`` names the file and its size.

    Returns the report dict (also written to ``out_dir/eval.json``). Its ``machine`` entry records the
    torch threads, the cores and the load average before and after; when other processes' load and
    these threads exceed the cores, a note says the timings cannot be trusted
    (:func:`~dflash2_lightning.threads.timing_warning`).
    """
    from dflash2_lightning.checkpoint import atomic_write_text, load_draft
    from dflash2_lightning.draft_vocab import draft_vocab_head, find_draft_vocab
    from dflash2_lightning.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
    from dflash2_lightning.target import load_target
    from dflash2_lightning.threads import load_average, timing_warning

    from dflash2_lightning.config import ConfigError

    if replay_prompts < 0:
        raise ConfigError(f"replay_prompts={replay_prompts} is invalid: must be >= 0 (0 = no replay)")
    replay_tokens = max_new_tokens if replay_max_new_tokens is None else replay_max_new_tokens
    if replay_prompts and replay_tokens < 1:
        raise ConfigError(f"replay_max_new_tokens={replay_tokens} is invalid: must be >= 1")
    prompts_file = prompts_file or EVAL_PROMPTS
    all_chats = read_prompts(prompts_file)  # before the draft and the target: a bad file fails at once
    if replay_prompts > len(all_chats):
        raise ConfigError(f"replay_prompts={replay_prompts} is invalid: {prompts_file} holds only "
                          f"{len(all_chats)} prompts")
    if max_prompts is not None and max_prompts < 1:
        raise ConfigError(f"max_prompts={max_prompts} is invalid: must be >= 1 (or None for all prompts)")
    draft = load_draft(draft_dir)  # before the target: a bad checkpoint path fails in a second
    target = target_spec if hasattr(target_spec, "hf") else load_target(target_spec)
    chats = all_chats[:max_prompts] if max_prompts is not None else all_chats
    prompts = [encode_prompt(target.tokenizer, m) for m in chats]
    vocab_file = (find_draft_vocab(draft_dir) if draft_vocab == "auto" else
                  None if draft_vocab in (None, "off") else Path(draft_vocab))
    draft_head = draft_vocab_head(target, vocab_file) if vocab_file is not None else None
    load_start = load_average()
    report = evaluate_draft(draft, target, prompts, max_new_tokens, paths, estimate=estimate, progress=progress,
                            temperatures=temperatures, top_p=top_p, top_k=top_k, seed=seed, samples=samples,
                            resamples=resamples, oracle_top_k=oracle_top_k, draft_head=draft_head)
    report["draft_vocab"] = ({"file": str(vocab_file), "size": draft_head.size, "vocab_size": draft_head.vocab_size}
                             if draft_head is not None else None)
    cores = os.cpu_count() or 1
    report["machine"].update(cpus=cores, load_average_start=load_start, load_average_end=load_average())
    warning = timing_warning(torch.get_num_threads(), cores, load_start, report["machine"]["load_average_end"],
                             own_start=own_load)
    report["machine"]["timing_trusted"] = warning is None
    if warning is not None:
        report.setdefault("notes", []).append(warning)
    if replay_prompts:
        report["replay"] = replay_eval(draft, target, [encode_prompt(target.tokenizer, m)
                                                       for m in all_chats[:replay_prompts]],
                                       replay_tokens, resamples=resamples, seed=seed, oracle_top_k=oracle_top_k,
                                       progress=progress)
    report = {"draft": str(draft_dir), "target": _describe(target), "prompts_file": str(prompts_file), **report}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if llama_cpp is not None:
        from dflash2_lightning.llamacpp_eval import attach_llama_cpp

        attach_llama_cpp(report, draft_dir, target, prompts, max_new_tokens, out / "llama.cpp", **llama_cpp)
    atomic_write_text(out / "eval.json", json.dumps(report, indent=2) + "\n")
    plot_eval(report, out / "acceptance.png")
    return report


def _describe(target: Any) -> Any:
    spec = getattr(target, "spec", None)
    return json.loads(spec.key()) if spec is not None else type(target).__name__


# ----------------------------------------------------------------------------- report rendering
def _blocks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-temperature blocks (a report from before sampling has only the greedy top level)."""
    return report.get("temperatures") or {"0": {"temperature": 0.0, "paths": report["paths"],
                                                 "target_only": report["target_only"]}}


def plot_eval(report: dict[str, Any], path: str | os.PathLike) -> None:
    """PNG: measured ``accept_k`` per path and temperature with its 95% band (the trainer's greedy
    estimate dashed), τ per temperature with its interval (and the T=0 replay's, when the report has
    one), and the accepted-length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from dflash2_lightning.checkpoint import atomic_write

    colors = {"selector": "tab:orange", "backbone": "tab:blue"}
    styles = ["-o", "-s", "-^", "-v", "-D", "-x"]
    blocks = list(_blocks(report).values())
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
    for ti, blk in enumerate(blocks):
        t = blk["temperature"]
        for name, res in blk["paths"].items():
            m, e, iv = res["measured"], res["estimated"], res.get("interval")
            ks = list(range(1, len(m["accept"]) + 1))
            label = f"{name} T={t:g} (τ {m['tau']:.2f})"
            left.plot(ks, m["accept"], styles[ti % len(styles)], ms=3, color=colors.get(name), label=label,
                      alpha=1.0 if ti == 0 else 0.75)
            if iv and all(b[0] is not None for b in iv["accept"]):
                left.fill_between(ks, [b[0] for b in iv["accept"]], [b[1] for b in iv["accept"]],
                                  color=colors.get(name), alpha=0.12)
            if e and e.get("accept"):
                left.plot(ks, e["accept"], "--", color=colors.get(name), alpha=0.6,
                          label=f"{name} trainer estimate (τ {e['tau']:.2f})")
    names = list(blocks[0]["paths"])
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        ts, taus, err = [], [], [[], []]
        for ti, blk in enumerate(blocks):
            res = blk["paths"].get(name)
            if res is None:
                continue
            tau, iv = res["measured"]["tau"], (res.get("interval") or {}).get("tau") or [None, None]
            ts.append(ti + (j - (len(names) - 1) / 2) * width)
            taus.append(tau)
            err[0].append(tau - iv[0] if iv[0] is not None else 0.0)
            err[1].append(iv[1] - tau if iv[1] is not None else 0.0)
        middle.errorbar(ts, taus, yerr=err, fmt="o", capsize=4, color=colors.get(name), label=name)
        hist = blocks[0]["paths"][name]["measured"]["histogram"]
        total = max(sum(hist), 1)
        xs = [a + (j - (len(names) - 1) / 2) * width for a in range(len(hist))]
        right.bar(xs, [h / total for h in hist], width=width, color=colors.get(name), label=name)
    replay = report.get("replay")
    ticks = [f"T={b['temperature']:g}" for b in blocks]
    if replay:  # the T=0 replay's tau beside the loop's: the same quantity on more prompts
        ticks.append(f"T=0 replay\n{replay['prompts']} prompts")
        for j, name in enumerate(names):
            r = replay["paths"].get(name)
            if r and r["tau"] is not None and r["interval"][0] is not None:
                middle.errorbar([len(blocks) + (j - (len(names) - 1) / 2) * width], [r["tau"]],
                                yerr=[[r["tau"] - r["interval"][0]], [r["interval"][1] - r["tau"]]],
                                fmt="D", capsize=4, color=colors.get(name))
    if report.get("llama.cpp"):
        spec = report["llama.cpp"]["speculative"]
        left.plot(range(1, len(spec["accept"]) + 1), spec["accept"], "-s", ms=4, color="tab:green",
                  label=f"llama.cpp measured (τ {spec['tau']:.2f})")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    middle.set_xticks(range(len(ticks)), ticks)
    left.set(xlabel="block offset k", ylabel="P(offsets 1..k accepted)", ylim=(0, 1.02),
             title="acceptance curve (band: 95% bootstrap over prompts)")
    middle.set(ylabel="τ (tokens per verify step)", title="τ by temperature, 95% interval")
    right.set(xlabel="accepted drafts per cycle", ylabel="fraction of cycles",
              title=f"accepted lengths, T={blocks[0]['temperature']:g}")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report.get('architecture', 'draft')}, block {report.get('block_size')}, "
                 f"{report.get('prompts')} prompts")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def _iv(bounds: Sequence[float | None] | None) -> str:
    return f" [{bounds[0]:.2f}, {bounds[1]:.2f}]" if bounds and bounds[0] is not None else ""


def replay_lines(replay: dict[str, Any] | None, indent: str = "") -> list[str]:
    """The wide replay's lines of a summary (none without a replay)."""
    if not replay:
        return []
    lines = [f"{indent}replay at T=0 on {replay['prompts']} prompts, {replay['generated_tokens']} tokens "
             "(teacher-forced along the target's greedy outputs; equals the measured tau at T=0):"]
    for name, r in [*replay["paths"].items(), (f"top-{replay['oracle']['top_k']} oracle", replay["oracle"])]:
        if r["tau"] is not None:
            lines.append(f"{indent}{name:>14}: tau {r['tau']:.2f}{_iv(r['interval'])}  accept_k "
                         + "  ".join(f"{a:.2f}" for a in r["accept"]))
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    """Human-readable lines per temperature and path: τ with its 95% interval, per-position acceptance
    with intervals, the trainer's estimate, speed, losslessness."""
    blocks = _blocks(report)
    base = report["target_only"]["tokens_per_second"]
    lines = [f"{report['prompts']} prompts, {report['generated_tokens']} tokens; target alone "
             f"{base:.1f} tok/s" if base else f"{report['prompts']} prompts"]
    for blk in blocks.values():
        t = blk["temperature"]
        if len(blocks) > 1 or t != 0:
            extra = "" if t == 0 else (f", top_p {blk['top_p']:g}, top_k {blk['top_k']}, "
                                       f"{blk['samples_per_prompt']} samples per prompt")
            tps = blk["target_only"]["tokens_per_second"]
            lines.append(f"T={t:g}{' (greedy)' if t == 0 else ''}{extra}"
                         + (f"; target alone {tps:.1f} tok/s" if tps else ""))
        for name, res in blk["paths"].items():
            m, e, iv = res["measured"], res["estimated"] or {}, res.get("interval") or {}
            replay = f" (replayed {e['replayed_tau']:.2f})" if e.get("replayed_tau") is not None else ""
            est = f", trainer estimate {e['tau']:.2f}{replay}" if e.get("tau") else ""
            speed = (f", {m['tokens_per_second']:.1f} tok/s ({res['speedup']:.2f}x{_iv(iv.get('speedup'))})"
                     if res["speedup"] else "")
            lossy = res["lossless"] is False
            lines.append(f"{name:>8}: tau {m['tau']:.2f}{_iv(iv.get('tau'))} measured{est}{speed}"
                         f"{', NOT LOSSLESS on prompts ' + str(res['mismatched_prompts']) if lossy else ''}")
            if iv.get("accept"):
                lines.append(" " * 10 + "accept_k " + "  ".join(
                    f"{a:.2f}{_iv(b)}" for a, b in zip(m["accept"], iv["accept"])))
        orc = blk.get("oracle") or {}
        if orc.get("replayed_tau"):
            lines.append(f"{'oracle':>8}: tau {orc['replayed_tau']:.2f} if every pick were right whenever the "
                         f"target's token is in the draft's top-{orc['top_k']} (teacher-forced replay; the "
                         "selector's ceiling)")
    if report.get("draft_vocab"):
        dv = report["draft_vocab"]
        lines.append(f"drafting vocabulary: {dv['size']} of {dv['vocab_size']} tokens ({dv['file']}; the target "
                     "verifies with its full head)")
    lines += replay_lines(report.get("replay"))
    if any("interval" in r for blk in blocks.values() for r in blk["paths"].values()):
        lines.append("[lo, hi]: 95% bootstrap interval over prompts")
    if report.get("llama.cpp"):
        from dflash2_lightning.llamacpp_eval import summary_line

        lines.append(summary_line(report["llama.cpp"]))
    return lines + list(report.get("notes", []))


# ----------------------------------------------------------------------------- command line
def eval_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 eval``: measure τ with real speculative decoding. Exit status 1 if a greedy path was not lossless."""
    from dflash2_lightning.regen import add_target_arguments, target_spec_from_args

    parser = argparse.ArgumentParser(
        prog="dflash2 eval",
        description="Measure a draft checkpoint with real speculative decoding against its target, greedy and "
                    "sampled (--temperature): acceptance length (tau) per decoding path and temperature with a 95% "
                    "bootstrap interval over prompts, per-position acceptance, histogram of accepted lengths, "
                    "tokens/s against target-only decoding, and the trainer's estimated tau on the same "
                    "continuations. Writes OUT/eval.json and OUT/acceptance.png.")
    parser.add_argument("--draft", required=True, help="draft checkpoint directory (config.json + model.safetensors)")
    add_target_arguments(parser)
    parser.add_argument("--prompts", default=None,
                        help="held-out prompts, chat jsonl {'messages': [...]} (default: the shipped eval prompts)")
    parser.add_argument("--out", required=True, help="output directory for eval.json and acceptance.png")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per prompt (default 128)")
    parser.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="decoding paths to measure (default: selector backbone)")
    parser.add_argument("--temperature", type=float, nargs="+", action="extend", default=None, metavar="T",
                        help="sampling temperatures to measure, e.g. --temperature 0 0.7 1.0 (repeatable; "
                             "default 0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the top k tokens (default 0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled runs and the bootstrap (default 0)")
    parser.add_argument("--samples", type=int, default=1,
                        help="generations per prompt at temperature > 0 (default 1; T=0 is deterministic: one)")
    parser.add_argument("--resamples", type=int, default=RESAMPLES,
                        help=f"bootstrap resamples over prompts for the 95%% intervals (default {RESAMPLES})")
    parser.add_argument("--no-estimate", action="store_true",
                        help="skip the trainer's teacher-forced estimate (and the top-k oracle)")
    parser.add_argument("--replay-prompts", type=int, default=0,
                        help="also replay the loop at T=0 (teacher-forced along the target's batched greedy "
                             "outputs, equal to the measured tau) on the first N prompts: a narrow tau interval "
                             "at a fraction of the loop's cost (default 0 = off)")
    parser.add_argument("--replay-max-new-tokens", type=int, default=None,
                        help="tokens per replayed prompt (default: --max-new-tokens)")
    parser.add_argument("--oracle-top-k", type=int, default=None,
                        help="candidates per position of the T=0 top-k oracle (default: the selector's top_k; "
                             f"{ORACLE_TOP_K} for a DFlash draft)")
    parser.add_argument("--threads", default="auto",
                        help="torch CPU threads: a number, or 'auto' (default: the cores other processes leave free "
                             "by the 1-minute load average, as the quickstart chooses; the report records it)")
    parser.add_argument("--draft-vocab", default="auto", metavar="auto|off|FILE",
                        help="draft through the target head's rows of a drafting vocabulary only (lossless: the "
                             "target verifies with its full head): 'auto' (default) uses DRAFT/draft_vocab.json "
                             "when it exists, 'off' never, or a file (python -m dflash2_lightning.draft_vocab)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    from dflash2_lightning.llamacpp_eval import add_engine_arguments, llama_cpp_options

    add_engine_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) >= 1):
        parser.error(f"--threads {args.threads!r} is invalid: must be 'auto' or an integer >= 1")
    from dflash2_lightning.threads import auto_threads

    torch.set_num_threads(auto_threads(torch.get_num_threads()) if args.threads == "auto" else int(args.threads))
    report = run_eval(args.draft, target_spec_from_args(args), args.prompts, args.out, args.max_new_tokens,
                      args.paths, args.max_prompts, not args.no_estimate, not args.no_progress,
                      temperatures=args.temperature or [0.0], top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                      samples=args.samples, resamples=args.resamples, llama_cpp=llama_cpp_options(args),
                      oracle_top_k=args.oracle_top_k, replay_prompts=args.replay_prompts,
                      replay_max_new_tokens=args.replay_max_new_tokens, draft_vocab=args.draft_vocab)
    print("\n".join(summary_lines(report)))
    print(f"report: {Path(args.out) / 'eval.json'}  plot: {Path(args.out) / 'acceptance.png'}")
    lossy = [r for blk in report["temperatures"].values() for r in blk["paths"].values() if r["lossless"] is False]
    return 1 if lossy else 0
