"""The trainer's estimate of τ on the target's own continuations, and the loop's cycles replayed from it.

For a prompt and the target's continuation, the draft's *training* forward runs with an anchor at every
continuation position (:func:`teacher_forced`). Two figures come from it: ``estimated``, the trainer's own
estimator (:class:`~dflash2_lightning.train.objective.DraftObjective` and
:class:`~dflash2_lightning.train.metrics.BlockAcceptance`: an anchor wherever a whole block fits, ``accept_k`` =
P(offsets 1..k all right), ``τ = 1 + Σ_k accept_k``), and ``replayed``, the same per-anchor acceptance read only
where the loop starts a cycle (``a_0`` = first generated token, ``a_{i+1} = a_i + accepted_i + 1``), which equals
the measured τ up to floating-point ties. At T=0 the report adds the **top-k oracle** (a slot counts when the
target's token is anywhere among the draft's top-k candidates: the τ of a selector that always picked right) and,
with ``replay_prompts``, the **T=0 replay** (:func:`~dflash2_lightning.evaluate.replay.replay_eval`: the loop's τ
exactly on many more held-out prompts).

Why the estimate and the measurement differ (anchors, blocks near the end, numerics; never the selector):
docs/internals.md ("The trainer's estimate against the loop"); the report's figures: docs/measuring-tau.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash2_lightning.decode.drafter import DraftPath
from dflash2_lightning.decode.speculative import target_features, target_handles
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.model.sampling import Sampling

PATHS: tuple[DraftPath, ...] = ("selector", "backbone")
ORACLE_TOP_K = 8  # the top-k oracle's candidates for a draft without a selector (the quickstart's selector_top_k)


def default_oracle_top_k(draft: DraftModel) -> int:
    """The top-k oracle's candidates for ``draft``: its selector's ``top_k``, or :data:`ORACLE_TOP_K` for DFlash."""
    return draft.config.selector_top_k if draft.candidate_selector is not None else ORACLE_TOP_K


def target_device(target: Any) -> torch.device:
    """The device ``target`` (a project ``Target`` or a bare HF model) computes on, as HF's ``model.device`` reads
    it (its first parameter's): where the draft and the inputs go."""
    return next(target_handles(target).hf.parameters()).device


def usable_paths(paths: Sequence[DraftPath], draft: DraftModel) -> list[DraftPath]:
    """The ``paths`` the draft can run: all of them but the selector's for a DFlash baseline (no selector)."""
    return [x for x in paths if x == "backbone" or draft.candidate_selector is not None]


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
    covered: Tensor | None = None  # [N, bs-1] the target's token among the selector's top-k (selector path, T=0)

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
        return [n for _, n in self.cycles()]

    def cycles(self) -> list[tuple[int, int]]:
        """``(row, accepted length)`` of each replayed cycle (see :meth:`replay`); ``row`` indexes ``anchors``."""
        right = (self.right & self.valid).long().cumprod(-1)
        lengths = right.sum(-1).tolist()
        # A length is final once a wrong token was seen inside the data or the whole block fit.
        known = ((self.valid & ~self.right).any(-1) | self.valid.all(-1)).tolist()
        out, i = [], 0
        while i < len(lengths):
            n = lengths[i]
            if not known[i] or int(self.anchors[i]) + n + 1 >= self.seq_len:
                break
            out.append((i, n))
            i += n + 1
        return out

    def cycle_health(self, health: Any) -> None:
        """Add the replayed cycles' selector health (``covered`` needed) to a
        :class:`~dflash2_lightning.train.metrics.SelectorHealth`: the loop's cycles, counted as the trainer counts."""
        if self.covered is None:
            raise ValueError("selector health needs the selector path's covered slots")
        rows = torch.tensor([i for i, _ in self.cycles()], dtype=torch.long)
        if rows.numel():
            health.update(self.right[rows], self.covered[rows], self.valid[rows])


@torch.no_grad()
def teacher_forced(
    draft: DraftModel,
    target: Any,
    prompt: Sequence[int],
    continuation: Sequence[int],
    paths: Sequence[DraftPath] = PATHS,
    chunk: int = 32,
    sampling: Sampling | None = None,
    oracle_top_k: int | None = None,
) -> dict[str, TeacherForced]:
    """Run the trainer's objective (:class:`~dflash2_lightning.train.objective.DraftObjective`) on
    ``prompt + continuation`` with an anchor at every continuation position.

    The target runs once over the whole sequence (features, and its greedy next tokens: what "right"
    means); the continuation is the supervised region, as an assistant turn is in training. The
    selector path uses the objective's greedy walk (``walk=True``). Anchors go ``chunk`` at a time.
    With a sampling ``sampling`` each slot also gets its acceptance probability under speculative
    sampling (:func:`~dflash2_lightning.train.metrics.sampled_alpha`, the trainer's ``val/t<T>`` metric).
    With ``oracle_top_k`` (greedy only) the result also has an ``"oracle"`` entry: a slot is right when
    the target's token is among the draft's top ``oracle_top_k`` logits. Greedy, the selector path's result
    also has ``covered``: the target's token among the selector's own top-k candidates (selector health).
    """
    from transformers import PreTrainedModel

    from dflash2_lightning.train.metrics import sampled_alpha
    from dflash2_lightning.train.objective import DraftObjective, Teacher

    t = target_handles(target)
    assert isinstance(t.hf, PreTrainedModel)  # a project Target's HF causal LM, or a bare one (target_handles)
    cfg, dtype = draft.config, next(draft.parameters()).dtype
    bs, device = cfg.block_size, target_device(target)
    ids = torch.tensor([list(prompt) + list(continuation)], dtype=torch.long, device=device)
    p, s = len(prompt), ids.shape[1]
    out = t.hf(input_ids=ids, use_cache=False, output_hidden_states=True)
    features = target_features(out.hidden_states, cfg.target_layer_ids or []).to(dtype)
    sampled = sampling is not None and not sampling.greedy
    teacher = Teacher(greedy=out.logits.argmax(-1), logits=out.logits if sampled else None)
    loss_mask = torch.arange(s, device=device)[None] >= p
    embed = lambda x: t.embed(x).to(dtype)
    head_dtype = t.hf.get_output_embeddings().weight.dtype
    head = lambda h: t.head(h.to(head_dtype))
    objective = DraftObjective(token_loss="ce", selector_loss_alpha=0.0)
    want = usable_paths(paths, draft)
    oracle_k = oracle_top_k if oracle_top_k and not sampled else None
    rights: dict[str, list[Tensor]] = {x: [] for x in [*want, *(["oracle"] if oracle_k is not None else [])]}
    alphas: dict[str, list[Tensor]] = {x: [] for x in want}
    covers: list[Tensor] = []
    valids: list[Tensor] = []
    anchors = torch.arange(p, s, device=device)
    for lo in range(0, anchors.shape[0], chunk):
        a = anchors[lo : lo + chunk][None]
        res = objective(
            draft,
            embed,
            head,
            ids,
            loss_mask,
            features,
            teacher,
            anchors=(a, torch.ones_like(a, dtype=torch.bool)),
            walk="selector" in want,
            keep_logits=oracle_k is not None or sampled,
        )  # the oracle's top-k and sampled_alpha read res.logits
        valids.append(res.blocks.valid[0])
        for x in want:
            tokens = res.draft_tokens if x == "backbone" else res.selector_tokens
            assert tokens is not None  # walk=True: the selector's walk whenever the draft has a selector
            rights[x].append((tokens == res.reference)[0])
        if res.covered is not None and not sampled:
            covers.append(res.covered[0])
        if oracle_k is not None:
            assert res.logits is not None  # keep_logits=True
            top = res.logits.topk(min(oracle_k, res.logits.shape[-1]), dim=-1).indices
            rights["oracle"].append((top == res.reference[..., None]).any(-1)[0])
        if sampled:
            sampled_alphas = sampled_alpha(res, sampling)
            assert sampled_alphas is not None  # the teacher's logits are given when sampled
            for path, alpha in sampled_alphas.items():
                if path in alphas:
                    alphas[path].append(alpha[0])
    valid = torch.cat(valids) if valids else torch.zeros(0, bs - 1, dtype=torch.bool)
    return {
        x: TeacherForced(
            anchors.cpu(),
            (torch.cat(r) if r else valid).cpu(),
            valid.cpu(),
            s,
            bs,
            torch.cat(alphas.get(x, [])).cpu() if alphas.get(x) else None,
            torch.cat(covers).cpu() if x == "selector" and covers else None,
        )
        for x, r in rights.items()
    }


@dataclass
class EstimateStats:
    """The trainer's acceptance estimate accumulated over sequences, plus the loop replay.

    ``metric`` is the trainer's own :class:`~dflash2_lightning.train.metrics.BlockAcceptance` (same
    ``accept_k`` and ``tau``); ``replayed`` the loop's accepted lengths recovered from the same forward.
    """

    block_size: int
    metric: Any
    replayed: list[int]
    updates: int = 0
    sampled: Any = None  # a SampledAcceptance at temperature > 0 (then the greedy figures are not reported)

    @classmethod
    def empty(cls, block_size: int, sampled: bool = False) -> EstimateStats:
        from dflash2_lightning.train.metrics import BlockAcceptance, SampledAcceptance

        return cls(
            block_size, BlockAcceptance(block_size), [], sampled=SampledAcceptance(block_size) if sampled else None
        )

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
            return {
                "tau": float(r["tau"]),
                "accept": [float(x) for x in r["accept"]],
                "alpha": [float(x) for x in r["alpha"]],
                "blocks": int(r["num_blocks"]),
                "kind": "sampled",
            }
        if not self.updates:  # every continuation shorter than a block: nothing the trainer would count
            return {
                "tau": None,
                "accept": None,
                "acc": None,
                "blocks": 0,
                "replayed_tau": None,
                "replayed_cycles": len(self.replayed),
            }
        result = self.metric.compute()
        replay_tau = 1.0 + sum(self.replayed) / len(self.replayed) if self.replayed else 0.0
        return {
            "tau": float(result["tau"]),
            "accept": [float(x) for x in result["accept"]],
            "acc": [float(x) for x in result["acc"]],
            "blocks": int(result["num_blocks"]),
            "replayed_tau": replay_tau,
            "replayed_cycles": len(self.replayed),
        }
