"""Acceptance metrics: exact values on hand-built patterns, the plot, and DDP totals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash2_lightning.model.selector import CandidateSelector
from dflash2_lightning.train.metrics import (
    BlockAcceptance,
    DraftMetrics,
    SelectorHealth,
    acceptance_curves,
    plot_acceptance,
)

T, F = True, False
# Six blocks of block_size 4 (offsets 1..3): whether the draft is right, and whether the slot counts.
RIGHT = [[T, T, F], [T, F, T], [F, T, T], [T, T, T], [T, T, T], [T, T, T]]
VALID = [[T, T, T], [T, T, T], [T, T, T], [T, T, F], [F, F, F], [T, F, T]]
#          full       full       full     truncated  padded    hole at k=2


def test_block_acceptance_on_a_hand_built_pattern():
    metric = BlockAcceptance(block_size=4)
    metric.update(torch.tensor(RIGHT), torch.tensor(VALID))
    result = metric.compute()
    # acc_k over counted slots: k=1 -> 4/5, k=2 -> 3/4, k=3 -> 3/4.
    assert result["acc"].tolist() == [0.8, 0.75, 0.75]
    # accept_k over blocks whose offsets 1..k all count: k=1 -> 4/5, k=2 -> 2/4, k=3 -> 0/3.
    assert result["accept"].tolist() == [0.8, 0.5, 0.0]
    assert result["tau"].item() == pytest.approx(2.3, abs=1e-12)
    assert result["num_positions"].item() == 13 and result["num_blocks"].item() == 5


def test_updates_accumulate_and_reset():
    metric = BlockAcceptance(block_size=4)
    for right, valid in zip(RIGHT, VALID):  # one block per update, batched shape [1, 1, L]
        metric.update(torch.tensor([[right]]), torch.tensor([[valid]]))
    assert metric.compute()["accept"].tolist() == [0.8, 0.5, 0.0]
    metric.reset()
    metric.update(torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool))
    result = metric.compute()
    assert result["accept"].tolist() == [1.0, 1.0, 1.0] and result["tau"].item() == 4.0


def _fake_output(reference, draft, walk, covered, picked, valid):
    return SimpleNamespace(
        reference=reference,
        draft_tokens=draft,
        selector_tokens=walk,
        covered=covered,
        selector_correct=picked,
        blocks=SimpleNamespace(valid=valid),
    )


def test_draft_metrics_names_both_paths_and_the_selector(tmp_path):
    reference = torch.tensor([[[5, 6, 7], [1, 2, 3]]])
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    out = _fake_output(
        reference,
        draft=torch.tensor([[[5, 0, 7], [1, 2, 0]]]),  # backbone: accept 1, 2 -> 2/2, 1/2, 0/2
        walk=torch.tensor([[[5, 6, 7], [1, 2, 0]]]),  # selector: 2/2, 2/2, 1/2
        covered=torch.tensor([[[T, T, T], [T, T, F]]]),
        picked=torch.tensor([[[T, T, T], [T, T, F]]]),
        valid=valid,
    )
    metrics = DraftMetrics(block_size=4, selector=True)
    metrics.update(out)
    values = metrics.compute()
    assert values["val/backbone/accept_1"] == 1.0 and values["val/backbone/accept_2"] == 0.5
    assert values["val/backbone/accept_3"] == 0.0 and values["val/backbone/tau"] == 2.5
    assert values["val/selector/accept_3"] == 0.5 and values["val/selector/tau"] == 3.5
    assert values["val/tau"] == values["val/selector/tau"]  # DFlash2 drafts with the selector's walk
    assert values["val/selector/coverage"] == pytest.approx(5 / 6)
    assert values["val/selector/accuracy"] == pytest.approx(5 / 6)
    # Selector health: block 1 reaches offset 3 with 3 outside its candidates (recall 1/2 there, nothing passed over).
    assert [values[f"val/selector/recall_{k}"] for k in (1, 2, 3)] == [1.0, 1.0, 0.5]
    assert [values[f"val/selector/picked_{k}"] for k in (1, 2, 3)] == [1.0, 1.0, 0.5]
    assert [values[f"val/selector/passed_over_{k}"] for k in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert values["val/selector/picked_1"] == values["val/selector/accept_1"]
    assert values["val/backbone/acc_1"] == 1.0 and values["val/backbone/acc_2"] == 0.5
    assert values["val/num_positions"] == 6 and values["val/num_blocks"] == 2
    curves = acceptance_curves(values)
    assert curves["selector"]["accept"] == [1.0, 1.0, 0.5] and len(curves["backbone"]["acc"]) == 3
    path = tmp_path / "acceptance.png"
    plot_acceptance(values, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp"))  # written atomically, no temporary left behind
    metrics.reset()
    assert metrics.compute()["val/num_positions"] == 0


# Selector health on the same six blocks: whether the right token was among the candidates (RIGHT implies it).
COVERED = [[T, T, T], [T, T, T], [T, T, T], [T, T, T], [T, T, T], [T, F, T]]


def test_selector_health_counts_only_the_offsets_a_block_reached():
    metric = SelectorHealth(block_size=4)
    metric.update(torch.tensor(RIGHT), torch.tensor(COVERED), torch.tensor(VALID))
    result = metric.summary()
    # Reached k=1: the five counted blocks (not the padded one). k=2: blocks 0, 1, 3 (right at 1, counted at 2;
    # block 2 was rejected at 1, block 5 has a hole at 2). k=3: block 0 only (block 1 rejected at 2, block 3
    # truncated before 3).
    assert result["reached"] == [5, 3, 1]
    # k=1: covered in all 5, picked in 4 (block 2 passed over). k=2: all 3 covered, block 1 passed over.
    # k=3: block 0 covered, not picked.
    assert result["recall"] == [1.0, 1.0, 1.0]
    assert result["picked"] == pytest.approx([4 / 5, 2 / 3, 0.0])
    assert result["passed_over"] == pytest.approx([1 / 5, 1 / 3, 1.0])
    accept = BlockAcceptance(block_size=4)
    accept.update(torch.tensor(RIGHT), torch.tensor(VALID))
    assert result["picked"][0] == accept.compute()["accept"][0].item()  # the first offset is the acceptance


def test_selector_health_of_a_two_token_block_is_a_list_of_one():
    """Block size 2 (one draft per cycle, what a draft served at block 2 walks): one offset, still reported as lists."""
    metric = SelectorHealth(block_size=2)
    metric.update(torch.tensor([[T], [F], [F]]), torch.tensor([[T], [T], [F]]), torch.ones(3, 1, dtype=torch.bool))
    result = metric.summary()
    assert result["reached"] == [3] and result["recall"] == pytest.approx([2 / 3])
    assert result["picked"] == pytest.approx([1 / 3]) and result["passed_over"] == pytest.approx([1 / 3])


def test_selector_health_of_a_real_walk_that_passes_the_right_token_over():
    """The selector walks candidates (7, 3, 9) at each of three offsets; the transition scores make it pick 7
    first, then 9, then 3. The target wants 3 at offset 1 (among the candidates, passed over) in one block and
    7, 9, 5 in another (picked, picked, not among the candidates)."""
    selector = CandidateSelector(hidden_size=4, vocab_size=16, rank=2, top_k=3, std=0.0)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
        selector.predecessor_codebook.zero_()
        selector.successor_codebook.zero_()
        selector.predecessor_codebook[7] = torch.tensor([1.0, 0.0])  # after 7, 9 wins
        selector.successor_codebook[9] = torch.tensor([10.0, 0.0])
        selector.predecessor_codebook[9] = torch.tensor([0.0, 1.0])  # after 9, 3 wins
        selector.successor_codebook[3] = torch.tensor([0.0, 10.0])
    cand = torch.tensor([[7, 3, 9]] * 3).expand(2, 3, 3)
    unary = torch.tensor([3.0, 2.0, 1.0]).expand(2, 3, 3)  # alone, the unary picks 7 everywhere
    hidden = torch.ones(2, 3, 4)
    walk = selector.greedy_path(cand, unary, hidden, anchor=torch.tensor([1, 1]))
    assert walk.tolist() == [[7, 9, 3], [7, 9, 3]]
    reference = torch.tensor([[3, 9, 3], [7, 9, 5]])
    covered = (cand == reference[..., None]).any(-1)
    metric = SelectorHealth(block_size=4)
    metric.update(walk == reference, covered, torch.ones(2, 3, dtype=torch.bool))
    result = metric.summary()
    # Block 0 stops at offset 1 (3 among the candidates, 7 drafted); block 1 reaches offset 3 (5 not a candidate).
    assert result["reached"] == [2, 1, 1]
    assert result["recall"] == [1.0, 1.0, 0.0]
    assert result["picked"] == [0.5, 1.0, 0.0]
    assert result["passed_over"] == [0.5, 0.0, 0.0]
    for k in range(3):
        assert result["picked"][k] + result["passed_over"][k] == pytest.approx(result["recall"][k])


def test_dflash_baseline_has_no_selector_metrics():
    metrics = DraftMetrics(block_size=3, selector=False)
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    metrics.update(_fake_output(torch.tensor([[[1, 2]]]), torch.tensor([[[1, 2]]]), None, None, None, valid))
    values = metrics.compute()
    assert values["val/tau"] == values["val/backbone/tau"] == 3.0
    assert not any("selector" in key for key in values)


def validate(model: Any, tmp_path: Path, tag: str, **trainer_kwargs: Any) -> dict[str, float]:
    """The tiny target's held-out validation of ``model``; its logged metrics. Each rank writes the world size it
    ran in and the samples it saw itself to ``tmp_path/{tag}.rank{r}.json``."""
    from lightning.pytorch import Callback, Trainer

    from dflash2_lightning.data.datamodule import DraftDataModule

    class SeenSamples(Callback):
        def __init__(self) -> None:
            self.samples = 0

        def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, *args: Any) -> None:
            self.samples += batch["input_ids"].shape[0]

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            seen = {"world": trainer.world_size, "samples": self.samples}
            (tmp_path / f"{tag}.rank{trainer.global_rank}.json").write_text(json.dumps(seen))

    data = DraftDataModule(
        target=model.target_spec,
        max_samples=40,
        val_fraction=0.1,
        seq_len=32,
        block_size=4,
        batch_size=2,
        target_layer_ids=model.draft_config.target_layer_ids,
    )
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[SeenSamples()],
        **trainer_kwargs,
    )
    return trainer.validate(model, datamodule=data, verbose=False)[0]


def validate_on_rank(rank: int, model: Any, tmp_path: Path) -> None:
    """One of two DDP ranks (gloo, CPU) validating; rank 0 writes what it logged."""
    values = validate(model, tmp_path, "ddp", devices=2, strategy="ddp")
    if rank == 0:
        (tmp_path / "ddp.json").write_text(json.dumps(values))


@pytest.mark.slow
def test_ddp_two_processes_count_the_same_totals_as_one(tmp_path):
    """Validation under DDP on 2 CPU processes (gloo) == one process, over the same data and the same weights."""
    from gloo_ranks import run_ranks

    from dflash2_lightning.target.spec import TargetSpec
    from dflash2_lightning.train.module import DFlash2Module

    # selector_top_k = half the vocabulary, so coverage is far from 0 and 1 and tells totals apart.
    model = DFlash2Module(
        target=TargetSpec(tiny={}),
        draft={"block_size": 4, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 256},
        objective={"num_anchors": 6},
    )
    single = validate(model, tmp_path, "one", devices=1)
    run_ranks(validate_on_rank, model, tmp_path, directory=tmp_path)
    double = json.loads((tmp_path / "ddp.json").read_text())
    seen = [json.loads((tmp_path / f"{tag}.json").read_text()) for tag in ("one.rank0", "ddp.rank0", "ddp.rank1")]
    assert [s["world"] for s in seen] == [1, 2, 2]  # the ranks joined one group
    assert seen[1]["samples"] == seen[2]["samples"] == seen[0]["samples"] // 2 > 0  # and split the held-out data
    assert single["val/num_positions"] > 0
    keys = [k for k in single if k != "val/loss"]  # val/loss is a mean of per-rank means, not a count ratio
    counts = [k for k in keys if not k.startswith("val/t1/")]  # integer counts: exactly equal
    assert {k: single[k] for k in counts} == {k: double[k] for k in counts}
    sampled = [k for k in keys if k.startswith("val/t1/")]  # float sums: equal up to summation order
    assert sampled and {k: double[k] for k in sampled} == pytest.approx({k: single[k] for k in sampled}, rel=1e-6)
    assert 0 < single["val/selector/coverage"] < 1


# ----------------------------------------------------------------------------- under sampling
def test_sampled_acceptance_on_a_hand_built_pattern():
    from dflash2_lightning.train.metrics import SampledAcceptance

    metric = SampledAcceptance(block_size=4)
    alpha = torch.tensor([[0.5, 0.4, 1.0], [1.0, 0.5, 0.2], [0.9, 0.9, 0.9]], dtype=torch.float64)
    valid = torch.tensor([[T, T, T], [T, T, T], [T, F, T]])  # the third block stops counting at k=2
    metric.update(alpha, valid)
    r = metric.compute()
    # accept_k = mean over blocks whose 1..k count of prod_{j<=k} alpha_j
    assert r["accept"].tolist() == pytest.approx([(0.5 + 1.0 + 0.9) / 3, (0.2 + 0.5) / 2, (0.2 + 0.1) / 2])
    assert r["alpha"].tolist() == pytest.approx([2.4 / 3, 0.9 / 2, 2.1 / 3])
    assert r["tau"].item() == pytest.approx(1 + sum(r["accept"].tolist())) and r["num_blocks"].item() == 3


def _sampled_output(target_logits, draft_logits, cand=None, scores=None):
    """One sequence (S = L = 3 slots, sources 0..2) with the target's logits at hand."""
    from dflash2_lightning.train.objective import Teacher

    sources = torch.arange(3)[None, None]
    return SimpleNamespace(
        reference=torch.zeros(1, 1, 3, dtype=torch.long),
        draft_tokens=draft_logits.argmax(-1),
        selector_tokens=None,
        covered=None,
        selector_correct=None,
        logits=draft_logits,
        teacher=Teacher(logits=target_logits[:, 0]),
        selector_candidates=cand,
        selector_scores=scores,
        blocks=SimpleNamespace(valid=torch.ones(1, 1, 3, dtype=torch.bool), sources=sources),
    )


def test_draft_metrics_log_the_expected_acceptance_at_a_temperature():
    from dflash2_lightning.model.sampling import Sampling, probabilities
    from dflash2_lightning.train.metrics import sampled_alpha

    gen = torch.Generator().manual_seed(0)
    target = torch.randn(1, 1, 3, 7, generator=gen, dtype=torch.float64)
    draft = torch.randn(1, 1, 3, 7, generator=gen, dtype=torch.float64)
    s = Sampling(0.8, top_p=0.9)
    p, q = probabilities(target, s), probabilities(draft, s)
    cand = draft.topk(3, dim=-1).indices
    scores = torch.randn(1, 1, 3, 3, generator=gen, dtype=torch.float64)
    alphas = sampled_alpha(_sampled_output(target, draft, cand, scores), s)
    torch.testing.assert_close(alphas["backbone"], torch.minimum(p, q).sum(-1))
    q_sel = torch.zeros_like(p).scatter(-1, cand, probabilities(scores, s))
    torch.testing.assert_close(alphas["selector"], torch.minimum(p, q_sel).sum(-1))
    # a draft whose distribution is the target's is always accepted: tau = block size
    metrics = DraftMetrics(block_size=4, selector=False, sampling=s)
    metrics.update(_sampled_output(target, target.clone()))
    values = metrics.compute()
    assert (
        values["val/t0.8/backbone/tau"] == pytest.approx(4.0)
        and values["val/t0.8/tau"] == values["val/t0.8/backbone/tau"]
    )
    assert values["val/t0.8/backbone/alpha_1"] == pytest.approx(1.0)
    assert not any(k.startswith("val/t0") for k in DraftMetrics(block_size=4, selector=False).compute())
