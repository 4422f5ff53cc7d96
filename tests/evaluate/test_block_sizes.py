"""`dflash2 eval --served-block-sizes`: τ and tokens/s of a draft served at blocks smaller than the trained one.

The tiny float64 target and a draft trained at block 4 (speculative_helpers): served at 2, 3 and 4 it must stay
lossless, draft ``b - 1`` tokens per cycle, and the replay at each size must give the loop's τ exactly.
"""

from __future__ import annotations

import pytest
from speculative_helpers import BLOCK_SIZE, NEW_TOKENS, prompts, tiny_target, trained_draft

from dflash2_lightning.decode.speculative import speculative_generate
from dflash2_lightning.engines.rules import served_block_flags
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.evaluate.loop import check_block_sizes, evaluate_block_sizes, evaluate_draft
from dflash2_lightning.evaluate.options import MeasureOptions, SamplingOptions
from dflash2_lightning.evaluate.replay import replay_block_sizes, run_replay
from dflash2_lightning.evaluate.report import block_size_lines

SIZES = [2, 3, 4]
QUIET = MeasureOptions(progress=False)


@pytest.fixture(scope="module")
def sweep() -> dict:
    target, draft = tiny_target(), trained_draft("dflash2")
    return evaluate_block_sizes(draft, target, prompts()[:4], NEW_TOKENS, [4, 2, 3], measure=QUIET, warmup=False)


def test_a_draft_served_at_block_b_drafts_b_minus_1_tokens_per_cycle() -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    for b in SIZES:
        run = speculative_generate(target, draft.at_block_size(b), prompts()[0], NEW_TOKENS)
        assert run.block_size == b and max(run.accepted) <= b - 1
        assert run.tokens == speculative_generate(target, draft, prompts()[0], NEW_TOKENS).tokens  # lossless
    # Every cycle emits at most b tokens, so the cycles it takes grow as the block shrinks.
    cycles = {
        b: len(speculative_generate(target, draft.at_block_size(b), prompts()[0], NEW_TOKENS).accepted) for b in SIZES
    }
    assert cycles[2] >= NEW_TOKENS // 2 and cycles[2] > cycles[4]


def test_every_size_is_lossless_with_its_own_tau_and_speed(sweep: dict) -> None:
    assert sweep["block_sizes"] == SIZES and sweep["trained_block_size"] == BLOCK_SIZE  # ascending
    greedy = sweep["temperatures"]["0"]
    assert list(greedy["sizes"]) == ["2", "3", "4"]
    taus = {}
    for size, figures in greedy["sizes"].items():
        b = int(size)
        assert list(figures["paths"]) == ["selector", "backbone"]
        for res in figures["paths"].values():
            m = res["measured"]
            assert res["lossless"] is True and res["mismatched_prompts"] == []
            assert len(m["histogram"]) == b and len(m["accept"]) == b - 1  # b - 1 drafts per cycle
            assert 1.0 <= m["tau"] <= b
            assert m["tokens_per_second"] > 0 and res["speedup"] > 0
            iv = res["interval"]
            assert iv["tau"][0] <= m["tau"] <= iv["tau"][1]
            assert iv["tokens_per_second"][0] <= m["tokens_per_second"] <= iv["tokens_per_second"][1]
        taus[b] = figures["paths"]["selector"]["measured"]["tau"]
    # Allowed more drafts per cycle, the trained draft accepts more: block 4 beats block 2 (which caps τ at 2).
    assert taus[2] < taus[4]


def test_the_trained_size_measures_what_the_plain_evaluation_measures(sweep: dict) -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    plain = evaluate_draft(draft, target, prompts()[:4], NEW_TOKENS, measure=QUIET, estimate=False, warmup=False)
    for path, res in sweep["temperatures"]["0"]["sizes"][str(BLOCK_SIZE)]["paths"].items():
        assert res["measured"]["histogram"] == plain["paths"][path]["measured"]["histogram"]
        assert res["measured"]["tau"] == plain["paths"][path]["measured"]["tau"]


def test_the_fastest_size_is_the_one_with_the_most_tokens_per_second(sweep: dict) -> None:
    greedy = sweep["temperatures"]["0"]
    speeds = {
        path: {int(b): f["paths"][path]["measured"]["tokens_per_second"] for b, f in greedy["sizes"].items()}
        for path in ("selector", "backbone")
    }
    for path, best in greedy["fastest"].items():
        ranked = sorted(speeds[path], key=lambda b: -speeds[path][b])
        assert best["block_size"] == ranked[0] and best["tokens_per_second"] == speeds[path][ranked[0]]
        runner = best["runner_up"]
        assert runner["block_size"] == ranked[1]
        ratio = runner["speed_ratio"]
        assert ratio["ratio"] == pytest.approx(speeds[path][ranked[0]] / speeds[path][ranked[1]])
        assert ratio["ratio"] >= 1.0 and ratio["interval"][0] <= ratio["ratio"] <= ratio["interval"][1]
    overall = sweep["fastest"]
    winner = max(greedy["fastest"], key=lambda p: greedy["fastest"][p]["tokens_per_second"])
    assert overall["path"] == winner and overall["block_size"] == greedy["fastest"][winner]["block_size"]
    assert overall["temperature"] == 0.0
    assert overall["serve_with"] == served_block_flags(overall["block_size"])
    lines = block_size_lines(sweep)
    assert sum(line.lstrip().startswith("block ") for line in lines) == len(SIZES)
    assert f"fastest: block {overall['block_size']} ({winner}, T=0" in lines[-1]
    assert f"--spec-draft-n-max {overall['block_size'] - 1}" in lines[-1]


def test_the_replay_at_each_size_equals_the_loops_tau(sweep: dict) -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    run = run_replay(draft, target, prompts()[:4], NEW_TOKENS, progress=False)
    replay = replay_block_sizes(draft, target, run, SIZES, progress=False)
    assert replay["prompts"] == 4 and list(replay["sizes"]) == ["2", "3", "4"]
    for size, figures in replay["sizes"].items():
        loop = sweep["temperatures"]["0"]["sizes"][size]["paths"]
        for path, r in figures["paths"].items():
            # The same cycles, teacher-forced along the target's outputs: the loop's τ exactly (float64).
            assert r["tau"] == pytest.approx(loop[path]["measured"]["tau"], abs=1e-12)
            assert len(r["accept"]) == int(size) - 1
        oracle = figures["oracle"]
        assert oracle["tau"] >= max(r["tau"] for r in figures["paths"].values()) - 1e-12  # the candidates' ceiling
    section = {**sweep, "replay": replay}
    assert any(line.strip() == "replay at T=0 on 4 prompts:" for line in block_size_lines(section))


def test_sampled_sizes_are_measured_without_a_token_check() -> None:
    target, draft = tiny_target(), trained_draft("dflash2")
    sampled = evaluate_block_sizes(
        draft,
        target,
        prompts()[:2],
        12,
        [2, 4],
        SamplingOptions(temperatures=[1.0], seed=3),
        MeasureOptions(paths=["backbone"], progress=False),
        warmup=False,
    )
    blk = sampled["temperatures"]["1"]
    assert blk["temperature"] == 1.0 and list(blk["sizes"]) == ["2", "4"]
    for size, figures in blk["sizes"].items():
        res = figures["paths"]["backbone"]
        assert res["lossless"] is None and len(res["measured"]["histogram"]) == int(size)
    assert sampled["fastest"]["temperature"] == 1.0 and sampled["notes"]


def test_a_dflash_baseline_is_swept_on_its_backbone() -> None:
    target, draft = tiny_target(), trained_draft("dflash")
    section = evaluate_block_sizes(draft, target, prompts()[:2], 12, [2, 4], measure=QUIET, warmup=False)
    for figures in section["temperatures"]["0"]["sizes"].values():
        assert list(figures["paths"]) == ["backbone"] and figures["paths"]["backbone"]["lossless"] is True


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([5], r"\[5\] outside 2\.\.4; each must be at least 2 .* at most the trained block_size=4"),
        ([1, 3], r"\[1\] outside 2\.\.4"),
        ([], "give at least one size"),
        ([3, 3], "without repeats"),
    ],
)
def test_sizes_outside_the_servable_range_are_refused(sizes: list[int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_block_sizes(sizes, trained_draft("dflash2").config)


def test_a_wide_convolution_sets_the_smallest_size(tiny_draft_config) -> None:
    cfg = tiny_draft_config(block_size=6, conv_kernel_size=3)
    assert check_block_sizes([6, 3], cfg) == [3, 6]
    with pytest.raises(ConfigError, match=r"\[2\] outside 3\.\.6; each must be at least conv_kernel_size=3"):
        check_block_sizes([2, 3], cfg)
    with pytest.raises(ConfigError, match="served_block_sizes"):  # before any decoding
        evaluate_block_sizes(trained_draft("dflash2"), tiny_target(), prompts()[:1], 4, [5], measure=QUIET)


def test_eval_cli_reports_every_served_size_and_the_fastest(tmp_path, capsys) -> None:
    import json

    import torch
    from speculative_helpers import TARGET_SPEC

    from dflash2_lightning.evaluate.command import eval_main
    from dflash2_lightning.model.checkpoint import save_draft

    draft_dir = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    out = tmp_path / "eval"
    argv = ["--draft", str(draft_dir), "--target", json.dumps(TARGET_SPEC), "--out", str(out), "--max-new-tokens", "12"]
    argv += ["--max-prompts", "2", "--replay-prompts", "3", "--no-estimate", "--no-progress", "--threads", "1"]
    assert eval_main([*argv, "--served-block-sizes", "4", "2"]) == 0
    printed = capsys.readouterr().out
    section = json.loads((out / "eval.json").read_text())["served_block_sizes"]
    assert section["block_sizes"] == [2, 4] and section["prompts"] == 2 and section["replay"]["prompts"] == 3
    for size in ("2", "4"):
        assert all(r["lossless"] for r in section["temperatures"]["0"]["sizes"][size]["paths"].values())
        assert set(section["replay"]["sizes"][size]["paths"]) == {"selector", "backbone"}
    best = section["fastest"]
    assert "served block sizes [2, 4] (trained 4), 2 prompts:" in printed
    assert printed.count("    block  2: ") == 2 and printed.count("    block  4: ") == 2  # the loop's and the replay's
    assert f"  fastest: block {best['block_size']} ({best['path']}, T=0" in printed


def test_eval_cli_refuses_a_size_beyond_the_trained_block_before_the_target(tmp_path, capsys) -> None:
    import torch

    from dflash2_lightning import cli
    from dflash2_lightning.model.checkpoint import save_draft

    draft_dir = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    # A target that cannot load: the sizes are refused first, in one line.
    argv = ["eval", "--draft", str(draft_dir), "--target", str(tmp_path / "no-target"), "--out", str(tmp_path / "o")]
    assert cli.main([*argv, "--served-block-sizes", "2", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash2: error: served_block_sizes=[2, 5] is invalid: [5] outside 2..4")
    assert cli.main([*argv, "--served-block-sizes", "1"]) == 2  # the flag's own bound: 2 at least
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--served-block-sizes" in err[0] and ">= 2" in err[0]
    assert not (tmp_path / "o" / "eval.json").exists()
