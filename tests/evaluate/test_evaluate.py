"""`dflash2 eval`: the trainer's estimate against the measured τ, the loop replay, the report and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from speculative_helpers import BLOCK_SIZE, NEW_TOKENS, TARGET_SPEC, continuations, prompts, tiny_target, trained_draft

from dflash2_lightning.decode.speculative import AcceptanceStats, speculative_generate
from dflash2_lightning.evaluate.command import eval_main
from dflash2_lightning.evaluate.loop import evaluate_draft
from dflash2_lightning.evaluate.options import LoopOptions, MeasureOptions, SamplingOptions
from dflash2_lightning.evaluate.replay import replay_eval
from dflash2_lightning.evaluate.report import summary_lines
from dflash2_lightning.evaluate.teacher_forced import EstimateStats, TeacherForced, teacher_forced
from dflash2_lightning.intervals import replay_summary
from dflash2_lightning.model.checkpoint import save_draft
from dflash2_lightning.train.metrics import SelectorHealth

# The trainer's estimate may differ from the measured τ by at most this fraction of the measured τ.
# Both apply the same per-anchor acceptance (the replay below shows it exactly); they differ only in
# which anchors they average over: the estimator every position, the loop only positions right after
# a rejection or a full block. With this draft (40 steps on half the prompts, τ ~1.3-1.8) the gap is
# 8-16% (the loop's anchors are harder on average); 25% leaves room for platform rounding in training
# while still failing for an estimator that is off by a token (e.g. one counting the anchor slot).
TAU_TOLERANCE = 0.25


@pytest.mark.parametrize("path", ["selector", "backbone"])
def test_estimate_replay_and_measurement_agree(path: str) -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    results, estimate = [], EstimateStats.empty(BLOCK_SIZE)
    for prompt, cont in zip(prompts(), continuations()):
        run = speculative_generate(target, draft, prompt, NEW_TOKENS, path=path)
        assert run.tokens == list(cont)
        tf = teacher_forced(draft, target, prompt, cont, [path])[path]
        # Exact: the draft's training forward, read at the loop's anchors, accepts what the loop accepted.
        assert tf.replay() == [a for a, cut in zip(run.accepted, run.truncated) if not cut]
        estimate.add(tf)
        results.append(run)
    measured = AcceptanceStats.from_results(results)
    summary = estimate.summary()
    assert summary["replayed_tau"] == pytest.approx(measured.tau, abs=1e-12)
    # A non-trivial draft: some cycles accept nothing, some accept a few, some the whole block.
    assert 1.1 < measured.tau < BLOCK_SIZE - 0.5
    assert sum(h > 0 for h in measured.histogram) >= 3
    assert abs(summary["tau"] - measured.tau) <= TAU_TOLERANCE * measured.tau, (summary["tau"], measured.tau)
    assert summary["tau"] == pytest.approx(1 + sum(summary["accept"]))


def test_selector_health_counts_the_replayed_cycles_only() -> None:
    """Six anchors; the loop's cycles start at rows 0 (accepts 1), 2 (accepts 0) and 3 (accepts all 3). Row 1 is
    inside cycle 0, so its passed-over token does not count."""
    t, f = True, False
    right = torch.tensor([[t, f, t], [f, f, f], [f, t, t], [t, t, t], [t, t, t], [t, t, t]])
    covered = torch.tensor([[t, t, t], [t, t, t], [f, t, t], [t, t, t], [t, t, t], [t, t, t]])
    tf = TeacherForced(torch.arange(10, 16), right, torch.ones(6, 3, dtype=torch.bool), 30, 4, covered=covered)
    assert tf.cycles() == [(0, 1), (2, 0), (3, 3)] and tf.replay() == [1, 0, 3]
    health = SelectorHealth(block_size=4)
    tf.cycle_health(health)
    result = health.summary()
    assert result["reached"] == [3, 2, 1]
    assert result["recall"] == pytest.approx([2 / 3, 1.0, 1.0])  # row 2's token was not among its candidates
    assert result["picked"] == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert result["passed_over"] == pytest.approx([0.0, 1 / 2, 0.0])  # row 0 drafted another at offset 2
    with pytest.raises(ValueError, match="covered"):
        TeacherForced(torch.arange(10, 16), right, right, 30, 4).cycle_health(health)


def check_health(health: dict, accept: list[float], histogram: list[int] | None = None) -> None:
    """A report's selector health against its path's acceptance: picked at offset 1 is the acceptance there, and
    picked + passed over = recall; with the loop's histogram, the cycles reaching offset k are those accepting k-1."""
    assert len(health["recall"]) == len(health["picked"]) == len(health["passed_over"]) == BLOCK_SIZE - 1
    assert health["picked"][0] == pytest.approx(accept[0], abs=1e-12)
    for k in range(1, BLOCK_SIZE - 1):  # accept_k = accept_(k-1) * picked_k: picked is the conditional acceptance
        assert accept[k] == pytest.approx(accept[k - 1] * health["picked"][k], abs=1e-12)
    for recall, picked, passed in zip(health["recall"], health["picked"], health["passed_over"]):
        assert picked + passed == pytest.approx(recall, abs=1e-12) and 0 <= picked <= recall <= 1
    if histogram is not None:
        assert health["reached"] == [sum(histogram[k:]) for k in range(BLOCK_SIZE - 1)]


def test_selector_health_is_reported_at_t0_with_the_estimate_only() -> None:
    """At T>0 the target's token is a sample: no selector health there; without the estimate none at all."""
    target, draft = tiny_target(), trained_draft("dflash2")
    kw = dict(sampling=SamplingOptions(temperatures=[0.0, 1.0]), measure=MeasureOptions(progress=False), warmup=False)
    report = evaluate_draft(draft, target, prompts()[:2], NEW_TOKENS, **kw)
    greedy = report["temperatures"]["0"]["paths"]["selector"]
    check_health(greedy["selector_health"], greedy["measured"]["accept"], greedy["measured"]["histogram"])
    assert report["temperatures"]["1"]["paths"]["selector"]["selector_health"] is None
    bare = evaluate_draft(draft, target, prompts()[:1], 4, estimate=False, **kw)
    assert all(blk["paths"]["selector"]["selector_health"] is None for blk in bare["temperatures"].values())


def test_selector_and_backbone_paths_differ() -> None:
    """The trained selector changes the drafts (so measuring both paths means something)."""
    target, draft = tiny_target(), trained_draft("dflash2")
    sel = [speculative_generate(target, draft, p, NEW_TOKENS, path="selector").accepted for p in prompts()[:2]]
    bb = [speculative_generate(target, draft, p, NEW_TOKENS, path="backbone").accepted for p in prompts()[:2]]
    assert sel != bb


def test_eval_report_and_plot(tmp_path) -> None:
    draft_dir = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    out = tmp_path / "eval"
    status = eval_main(
        [
            "--draft",
            str(draft_dir),
            "--target",
            json.dumps(TARGET_SPEC),
            "--out",
            str(out),
            "--max-new-tokens",
            "12",
            "--max-prompts",
            "3",
            "--replay-prompts",
            "5",
            "--no-progress",
        ]
    )
    assert status == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["prompts"] == 3 and report["block_size"] == BLOCK_SIZE
    assert set(report["paths"]) == {"selector", "backbone"}
    for res in report["paths"].values():
        assert res["lossless"] and res["mismatched_prompts"] == []
        m = res["measured"]
        assert len(m["accept"]) == BLOCK_SIZE - 1 and len(m["histogram"]) == BLOCK_SIZE
        assert m["tau"] == pytest.approx(1 + sum(m["accept"]))
        assert res["estimated"]["tau"] >= 1.0 and res["speedup"] > 0
    assert report["target_only"]["tokens"] == report["generated_tokens"] > 0
    png = (out / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("tau" in line for line in summary_lines(report))
    replay = report["replay"]  # the T=0 replay on more prompts than the loop ran, at the same budget
    assert replay["prompts"] == 5 and replay["max_new_tokens"] == 12 and set(replay["paths"]) == set(report["paths"])
    assert all(r["tau"] >= 1.0 and len(r["accept"]) == BLOCK_SIZE - 1 for r in replay["paths"].values())
    # Selector health: the loop's at T=0 (its cycles replayed) and the wide replay's, the selector path only.
    loop = report["temperatures"]["0"]["paths"]["selector"]
    health = loop["selector_health"]
    assert health["top_k"] == trained_draft("dflash2").config.selector_top_k and health["cycles"] > 0
    check_health(health, loop["measured"]["accept"], loop["measured"]["histogram"])
    check_health(replay["paths"]["selector"]["selector_health"], replay["paths"]["selector"]["accept"])
    assert "selector_health" not in report["paths"]["backbone"]
    assert "selector_health" not in replay["paths"]["backbone"]
    assert sum(line.strip().startswith("selector health of the") for line in summary_lines(report)) == 2


def test_top_k_oracle_bounds_both_paths() -> None:
    """The oracle counts a slot when the target's token is among the draft's top-k: with k = 1 it is the
    backbone argmax, with the selector's k it is right wherever the walk is (the walk picks among those)."""
    target, draft = tiny_target(), trained_draft("dflash2")
    k = draft.config.selector_top_k
    for prompt, cont in list(zip(prompts(), continuations()))[:3]:
        one = teacher_forced(draft, target, prompt, cont, oracle_top_k=1)
        assert torch.equal(one["oracle"].right, one["backbone"].right)
        tf = teacher_forced(draft, target, prompt, cont, oracle_top_k=k)
        assert not (tf["selector"].right & ~tf["oracle"].right).any()
        assert not (tf["backbone"].right & ~tf["oracle"].right).any()
    report = evaluate_draft(draft, target, prompts()[:3], NEW_TOKENS, measure=MeasureOptions(progress=False))
    orc = report["temperatures"]["0"]["oracle"]
    assert orc["top_k"] == k
    # Per block (the estimate over every position) the oracle's accepted prefix is at least each path's, so its τ
    # bounds theirs. Its replay is no bound: accepting more in one cycle moves where the next one starts (torch 2.11
    # measured the walk's replay 2.12 here, the oracle's 2.07).
    paths = report["temperatures"]["0"]["paths"]
    assert orc["tau"] >= max(r["estimated"]["tau"] for r in paths.values()) - 1e-12
    assert orc["blocks"] == paths["selector"]["estimated"]["blocks"] and orc["replayed_tau"] >= 1.0
    assert any(line.strip().startswith("oracle: tau") for line in summary_lines(report))
    with pytest.raises(Exception, match="oracle_top_k=0 is invalid"):
        evaluate_draft(draft, target, prompts()[:1], 4, measure=MeasureOptions(progress=False), oracle_top_k=0)


@pytest.mark.parametrize("projector", ["dflash2", "dflash"])
def test_wide_replay_equals_the_measured_tau(projector: str) -> None:
    """The replay decodes the prompts in batches (left-padded, several lengths) and replays the loop along
    them: on the same prompts and budget its τ and per-offset acceptance are the loop's, exactly."""
    target, draft = tiny_target(), trained_draft(projector)
    quiet = MeasureOptions(progress=False)
    measured = evaluate_draft(draft, target, prompts(), NEW_TOKENS, measure=quiet, estimate=False, warmup=False)
    replay = replay_eval(draft, target, prompts(), NEW_TOKENS, batch_size=3, progress=False)
    assert replay["prompts"] == len(prompts()) and replay["generated_tokens"] == measured["generated_tokens"]
    assert set(replay["paths"]) == set(measured["paths"])
    for name, r in replay["paths"].items():
        m = measured["paths"][name]["measured"]
        assert r["tau"] == pytest.approx(m["tau"], abs=1e-12), name
        assert r["accept"] == pytest.approx(m["accept"], abs=1e-12), name
        assert r["interval"][0] <= r["tau"] <= r["interval"][1] and r["interval"][0] < r["interval"][1]
        # The same untruncated cycles (the loop's last, cut cycle is in neither τ).
        assert r["cycles"] == sum(m["histogram"]) and r["accepted"] == sum(a * n for a, n in enumerate(m["histogram"]))
        assert replay["oracle"]["tau"] >= r["tau"] - 1e-12  # a perfect pick among the top-k never does worse
    assert any("replay at T=0" in line for line in summary_lines({**measured, "replay": replay}))


def test_replay_summary_counts_cycles_and_offsets() -> None:
    # Two prompts: cycles accepting 0, 3, 1 drafts and 2, 0 (block 4: 3 drafted positions).
    r = replay_summary([[0, 3, 1], [2, 0]], block_size=4, resamples=200)
    assert r["cycles"] == 5 and r["accepted"] == 6 and r["tau"] == pytest.approx(1 + 6 / 5)
    assert r["accept"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])  # P(>= 1), P(>= 2), P(3) per cycle
    assert r["per_prompt_accepted"] == [4, 2] and r["per_prompt_cycles"] == [3, 2]
    assert len(r["accept_interval"]) == 3 and r["interval"][0] <= r["tau"] <= r["interval"][1]
    assert replay_summary([[]], block_size=4, resamples=10)["tau"] is None  # no full cycle: nothing to report


def test_replay_options_are_checked_before_any_work(tmp_path) -> None:
    from dflash2_lightning.data.prompts import EVAL_PROMPTS, read_prompts
    from dflash2_lightning.errors import ConfigError
    from dflash2_lightning.evaluate.command import run_eval

    held_out = len(read_prompts(EVAL_PROMPTS))
    missing = tmp_path / "no-draft"  # never loaded: the options fail first
    with pytest.raises(ConfigError, match=f"replay_prompts={held_out + 1} is invalid: .* holds only {held_out}"):
        run_eval(missing, TARGET_SPEC, tmp_path / "out", LoopOptions(replay_prompts=held_out + 1))
    # The settings check themselves when made, and run_eval checks them again (a field changed since) first.
    for fields, message in [
        ({"replay_prompts": -1}, "replay_prompts=-1 is invalid: must be >= 0"),
        ({"replay_prompts": 2, "replay_max_new_tokens": 0}, "replay_max_new_tokens=0 is invalid"),
        ({"max_prompts": 0}, "max_prompts=0 is invalid"),
        ({"resamples": 0}, "resamples=0 is invalid"),
        ({"samples": 0}, "samples=0 is invalid"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LoopOptions(**fields)
        changed = LoopOptions()
        for name, value in fields.items():
            setattr(changed, name, value)
        with pytest.raises(ConfigError, match=message):
            run_eval(missing, TARGET_SPEC, tmp_path / "out", changed)
    with pytest.raises(ConfigError, match="replay batch_size=0 is invalid"):
        replay_eval(trained_draft("dflash2"), tiny_target(), prompts()[:1], 4, batch_size=0)
    assert not (tmp_path / "out").exists()


def test_dflash_baseline_skips_the_selector_path() -> None:
    target = tiny_target()
    quiet = MeasureOptions(progress=False)
    report = evaluate_draft(trained_draft("dflash"), target, prompts()[:2], 8, measure=quiet, estimate=False)
    assert list(report["paths"]) == ["backbone"]
    assert any("selector" in note for note in report["notes"])
    assert report["paths"]["backbone"]["lossless"] and report["paths"]["backbone"]["estimated"] is None


# ----------------------------------------------------------------------------- sampling and intervals
def _normalised(messages: list[dict[str, str]]) -> str:
    """A prompt's user text with case, punctuation and spacing dropped: near-copies compare equal."""
    text = " ".join(m["content"] for m in messages if m["role"] == "user").lower()
    return "".join(c for c in text if c.isalnum())


def test_held_out_prompts_share_none_with_the_seed_prompts() -> None:
    from dflash2_lightning.data.prompts import EVAL_PROMPTS, SEED_PROMPTS, read_prompts

    seed = {_normalised(m) for m in read_prompts(SEED_PROMPTS)}
    held_out = [_normalised(m) for m in read_prompts(EVAL_PROMPTS)]
    assert len(set(held_out)) == len(held_out), "the eval prompts repeat themselves"
    shared = [h for h in held_out if h in seed]
    assert not shared, f"eval prompts also in the training seed prompts: {shared}"


def test_eval_at_temperature_reports_every_setting_with_intervals() -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    sampling = SamplingOptions(temperatures=[0.0, 1.0], top_p=0.9, samples=2, seed=7)
    measure = MeasureOptions(resamples=300, progress=False)
    kw = dict(sampling=sampling, measure=measure, estimate=False, stop_token_ids=[])  # no stop: the whole budget
    report = evaluate_draft(draft, target, prompts()[:3], 10, **kw)
    assert list(report["temperatures"]) == ["0", "1"]
    assert report["sampling"] == {
        "temperatures": [0.0, 1.0],
        "top_p": 0.9,
        "top_k": 0,
        "seed": 7,
        "samples_per_prompt": 2,
        "bootstrap_resamples": 300,
    }
    greedy, sampled = report["temperatures"]["0"], report["temperatures"]["1"]
    assert report["paths"] == greedy["paths"] and report["tau"] == greedy["tau"]
    assert greedy["samples_per_prompt"] == 1 and sampled["samples_per_prompt"] == 2
    for name in ("selector", "backbone"):
        assert greedy["paths"][name]["lossless"] is True
        res = sampled["paths"][name]
        assert res["lossless"] is None  # samples: the law is what is lossless (tests/model/test_sampling.py)
        assert len(res["measured"]["accept"]) == BLOCK_SIZE - 1
        # 3 prompts x 2 samples of 10 tokens each, for the target alone and for every path
        assert res["measured"]["tokens"] == sampled["target_only"]["tokens"] == 3 * 2 * 10
        for blk in (greedy, sampled):
            m, iv = blk["paths"][name]["measured"], blk["paths"][name]["interval"]
            assert iv["level"] == 0.95 and iv["resamples"] == 300 and iv["unit"] == "prompt"
            assert iv["tau"][0] <= m["tau"] <= iv["tau"][1]
            assert all(lo <= a <= hi for a, (lo, hi) in zip(m["accept"], iv["accept"]))
            assert iv["speedup"][0] <= blk["paths"][name]["speedup"] <= iv["speedup"][1]
    # seeded: the same settings measure the same cycles, another seed other ones
    again = evaluate_draft(draft, target, prompts()[:3], 10, **kw)
    other = evaluate_draft(
        draft, target, prompts()[:3], 10, **{**kw, "sampling": dataclasses.replace(sampling, seed=8)}
    )
    hist = lambda r: {n: v["measured"]["histogram"] for n, v in r["temperatures"]["1"]["paths"].items()}
    assert hist(again) == hist(report) and hist(other) != hist(report)
    lines = summary_lines(report)
    assert any(line.startswith("T=1, top_p 0.9") for line in lines)
    assert any("tau" in line and "[" in line for line in lines) and any("accept_k" in line for line in lines)


def test_eval_cli_samples_and_bad_settings(tmp_path) -> None:
    draft_dir = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    out = tmp_path / "eval"
    status = eval_main(
        [
            "--draft",
            str(draft_dir),
            "--target",
            json.dumps(TARGET_SPEC),
            "--out",
            str(out),
            "--max-new-tokens",
            "8",
            "--max-prompts",
            "2",
            "--no-progress",
            "--no-estimate",
            "--paths",
            "backbone",
            "--temperature",
            "0",
            "--temperature",
            "0.7",
            "--top-k",
            "50",
            "--samples",
            "2",
            "--seed",
            "3",
            "--resamples",
            "100",
        ]
    )
    assert status == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["sampling"]["top_k"] == 50 and list(report["temperatures"]) == ["0", "0.7"]
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for kwargs, field in [
        ({"temperatures": [1.0, 1.0]}, "temperatures"),
        ({"temperatures": []}, "temperatures"),
        ({"samples": 0}, "samples"),
        ({"temperatures": [-1.0]}, "temperature"),
        ({"top_p": 0.0, "temperatures": [1.0]}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingOptions(**kwargs)
    # Changed after it was made, the loop refuses it before any decoding.
    target, draft = tiny_target(), trained_draft("dflash2")
    changed = SamplingOptions()
    changed.temperatures = [1.0, 1.0]
    with pytest.raises(ValueError, match="temperatures=\\[1.0, 1.0\\] is invalid: need at least one, without repeats"):
        evaluate_draft(draft, target, prompts()[:1], 4, changed, MeasureOptions(progress=False), estimate=False)


# The trainer's expected acceptance under sampling against the τ measured by sampled speculative
# decoding at the same settings. Beside the anchors (as for greedy), the estimate conditions every
# offset on the target's continuation instead of the accepted drafts. On this tiny target it is within
# 4% of the measurement (8 prompts x 3 samples, ~190 cycles: sampling noise ~2.5% of τ); 10% leaves
# room for that noise and still fails an estimator off by a factor (e.g. sum(p*q) or min over the argmax).
SAMPLED_TAU_TOLERANCE = 0.10


def test_sampled_estimate_agrees_with_the_measured_tau_at_temperature() -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    report = evaluate_draft(
        draft,
        target,
        prompts(),
        24,
        SamplingOptions(temperatures=[0.7], top_p=0.9, samples=3, seed=1),
        MeasureOptions(resamples=200, progress=False),
        stop_token_ids=[],
    )
    for name, res in report["paths"].items():
        measured, estimated = res["measured"]["tau"], res["estimated"]
        assert estimated["kind"] == "sampled" and len(estimated["alpha"]) == BLOCK_SIZE - 1
        assert abs(estimated["tau"] - measured) <= SAMPLED_TAU_TOLERANCE * measured, (name, estimated, measured)
    # the backbone drafts well under sampling here, the selector (top-4 of a flat target) hardly at all
    assert report["paths"]["backbone"]["measured"]["tau"] > 2 > report["paths"]["selector"]["measured"]["tau"]
