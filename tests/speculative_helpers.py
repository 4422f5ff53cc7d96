"""Shared by test_speculative.py, test_evaluate.py and test_regen.py: a tiny float64 target, its greedy
continuations of a few chat prompts, and tiny drafts trained briefly on those continuations.

float64 so that a cached verify pass and one-token-at-a-time decoding agree to ~1e-15 and no argmax
can flip between them: the lossless and replay checks can then demand exact equality.

The drafts are trained just long enough (40 full-batch steps, the trainer's own objective) to accept a
fair share of drafts on the sequences they saw and few on the others: a mix of accepted lengths
0..bs-1, so acceptance bookkeeping is exercised without the draft being an oracle. Results are cached
per process, so the test modules share one training run.
"""

from __future__ import annotations

import functools

import torch

from dflash2_lightning.data.prompts import encode_prompt
from dflash2_lightning.decode.speculative import target_features, target_greedy
from dflash2_lightning.model import DraftModel
from dflash2_lightning.target.load import load_target
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.target.target import Target
from dflash2_lightning.train.objective import DraftObjective, Teacher

TARGET_SPEC = {"tiny": {}, "dtype": "float64"}
BLOCK_SIZE = 4
NEW_TOKENS = 32
PROMPT_TEXTS = (
    "Write a poem about the sea.",
    "What is 2+3?",
    "def add(a, b):",
    "Tell me about Paris.",
    "List three colors.",
    "How do I sort a list in Python?",
    "Explain gravity.",
    "Hello!",
)
TRAINED_ON = 4  # the drafts see the first 4 prompts' continuations, not the last 4


def tiny_target() -> Target:
    return load_target(TargetSpec(**TARGET_SPEC))


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    tok = tiny_target().tokenizer
    return tuple(tuple(encode_prompt(tok, [{"role": "user", "content": t}])) for t in PROMPT_TEXTS)


@functools.cache
def continuations() -> tuple[tuple[int, ...], ...]:
    """The target's greedy continuations (no stop token: the tiny target never emits its eos here)."""
    target = tiny_target()
    return tuple(tuple(target_greedy(target, p, NEW_TOKENS).tokens) for p in prompts())


def draft_config(projector: str = "dflash2"):
    return tiny_target().draft_config(
        num_hidden_layers=1,
        block_size=BLOCK_SIZE,
        intermediate_size=128,
        projector_type=projector,
        selector_rank=8,
        selector_top_k=4,
        conv_group_size=16,
    )


@functools.cache
def trained_draft(projector: str = "dflash2", steps: int = 40) -> DraftModel:
    """A tiny draft trained (float32, then cast to float64) on the first :data:`TRAINED_ON` continuations."""
    target = tiny_target()
    cfg = draft_config(projector)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = DraftModel(cfg)
    objective = DraftObjective(token_loss="ce", selector_loss_alpha=1.0)
    embed = lambda ids: target.embed(ids).float()
    head_weight = target.hf.get_output_embeddings().weight.float()
    head = lambda h: h @ head_weight.T
    batches = []
    with torch.no_grad():
        for p, c in list(zip(prompts(), continuations()))[:TRAINED_ON]:
            ids = torch.tensor([list(p) + list(c)])
            out = target.hf(input_ids=ids, output_hidden_states=True)
            feats = target_features(out.hidden_states, cfg.target_layer_ids).float()
            loss_mask = torch.arange(ids.shape[1])[None] >= len(p)
            anchors = torch.arange(len(p), ids.shape[1] - 1)[None]
            batches.append(
                (
                    ids,
                    loss_mask,
                    feats,
                    Teacher(greedy=out.logits.argmax(-1)),
                    (anchors, torch.ones_like(anchors, dtype=torch.bool)),
                )
            )
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = sum(
            objective(draft, embed, head, ids, mask, feats, teacher, anchors=anchors).loss
            for ids, mask, feats, teacher, anchors in batches
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.double().eval()
