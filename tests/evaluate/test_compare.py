"""`dflash2 compare`: two drafters on the same prompts, B's τ and speed over A's, paired by prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from speculative_helpers import TARGET_SPEC, trained_draft
from test_prompt_turns import mt_bench_installed

from dflash2_lightning.cli import main
from dflash2_lightning.evaluate.command import EvalOptions
from dflash2_lightning.evaluate.compare import CompareOptions
from dflash2_lightning.model.checkpoint import save_draft

# mt-bench's first 4 turns are 2 writing + 2 roleplay: per-category rows; else the shipped prompts (no categories)
PROMPTS = ["--prompts", "mt-bench"] if mt_bench_installed() else []
SETTINGS = [
    *("--target", json.dumps(TARGET_SPEC), *PROMPTS, "--max-prompts", "4", "--max-new-tokens", "8"),
    *("--temperature", "0", "1", "--replay-prompts", "4", "--resamples", "300", "--no-progress", "--threads", "1"),
]


def compare(tmp_path, a, b, capsys) -> tuple[dict, str]:
    out = tmp_path / "compare"
    status = main(["compare", "--draft-a", str(a), "--draft-b", str(b), "--out", str(out), *SETTINGS])
    printed = capsys.readouterr().out
    assert status == 0, printed
    return json.loads((out / "compare.json").read_text()), printed


def sections(result: dict) -> list[tuple[str, dict]]:
    """Every (measurement, row) entry of a comparison, the categories' included."""
    entries = []
    for name, section in [*((f"loop T={t}", s) for t, s in result["loop"].items()), ("replay", result["replay"])]:
        for row, entry in section.items():
            entries.append((f"{name} {row}", entry))
            entries += [(f"{name} {row} {c}", figures) for c, figures in (entry.get("categories") or {}).items()]
    return entries


def test_compare_options_are_evals_groups_never_redeclared():
    """Every option of compare but its own (two drafts, its output) is the very field eval has (inherited from the
    same groups: one declaration)."""
    own = set(CompareOptions.__annotations__)
    assert own == {"draft_a", "draft_b", "out"}
    evals = {f.name: f for f in dataclasses.fields(EvalOptions)}
    inherited = [f for f in dataclasses.fields(CompareOptions) if f.name not in own]
    assert {"target", "prompts", "max_new_tokens", "temperatures", "seed", "resamples", "replay_prompts"} <= {
        f.name for f in inherited
    }
    assert all(f is evals[f.name] for f in inherited)


@pytest.mark.slow
def test_a_drafter_against_itself_is_exactly_one(tmp_path, capsys):
    """Same draft, same prompts, same seeds: the same drafts accepted on every prompt at T=0 and T=1, so the τ ratio
    is 1 in every resample: [1, 1], overall and per category, in the loop and the replay."""
    draft = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    result, printed = compare(tmp_path, draft, draft, capsys)
    assert set(result["loop"]) == {"0", "1"} and set(result["replay"]) == {"selector", "backbone"}
    if PROMPTS:
        assert list(result["loop"]["0"]["selector"]["categories"]) == ["writing", "roleplay"]
    for name, figures in sections(result):
        tau = figures["tau"]
        assert tau["a"] == tau["b"] and tau["ratio"] == 1.0 and tau["interval"] == [1.0, 1.0], name
        if "speed" in figures:  # timings differ between the two runs: a ratio near 1 with an interval around it
            speed = figures["speed"]
            assert speed["ratio"] > 0 and speed["interval"][0] <= speed["ratio"] <= speed["interval"][1], name
    assert "B/A 1.000 [1.000, 1.000]" in printed
    assert (tmp_path / "compare" / "a" / "eval.json").is_file() and (tmp_path / "compare" / "b" / "eval.json").is_file()
    assert not (draft / "acceptance.json").exists()  # compare writes nothing into the drafts


@pytest.mark.slow
def test_two_drafters_ratio_is_the_ratio_of_their_separately_measured_tau(tmp_path, capsys):
    """A DFlash baseline (A) against a DFlash2 drafter (B): B/A equals the τ each earns when measured alone by
    `dflash2 eval` on the same prompts, and its interval contains it; `served` pairs A's backbone with B's
    selector."""
    a = save_draft(trained_draft("dflash"), tmp_path / "dflash", dtype=torch.float64)
    b = save_draft(trained_draft("dflash2"), tmp_path / "dflash2", dtype=torch.float64)
    result, printed = compare(tmp_path, a, b, capsys)
    alone = {}
    for side, draft in (("a", a), ("b", b)):
        out = tmp_path / f"alone-{side}"
        assert main(["eval", "--draft", str(draft), "--out", str(out), "--no-estimate", *SETTINGS]) == 0
        alone[side] = json.loads((out / "eval.json").read_text())
    assert result["served_paths"] == {"a": "backbone", "b": "selector"}
    for t, section in result["loop"].items():
        assert set(section) == {"backbone", "served"}
        for entry in section.values():
            pa, pb = entry["paths"]["a"], entry["paths"]["b"]
            tau_a = alone["a"]["temperatures"][t]["paths"][pa]["measured"]["tau"]
            tau_b = alone["b"]["temperatures"][t]["paths"][pb]["measured"]["tau"]
            tau = entry["tau"]
            assert tau["a"] == pytest.approx(tau_a, abs=1e-12) and tau["b"] == pytest.approx(tau_b, abs=1e-12)
            assert tau["ratio"] == pytest.approx(tau_b / tau_a, rel=1e-12)
            assert tau["interval"][0] <= tau["ratio"] <= tau["interval"][1]
            # the speed ratio is of the compare run's own timings (its a/ and b/ reports)
            own = [json.loads((tmp_path / "compare" / s / "eval.json").read_text()) for s in "ab"]
            tps = [r["temperatures"][t]["paths"][p]["measured"]["tokens_per_second"] for r, p in zip(own, (pa, pb))]
            assert entry["speed"]["ratio"] == pytest.approx(tps[1] / tps[0], rel=1e-9)
            lo, hi = entry["speed"]["interval"]
            assert lo <= entry["speed"]["ratio"] <= hi
    for entry in result["replay"].values():
        pa, pb = entry["paths"]["a"], entry["paths"]["b"]
        tau_a, tau_b = alone["a"]["replay"]["paths"][pa]["tau"], alone["b"]["replay"]["paths"][pb]["tau"]
        assert entry["tau"]["ratio"] == pytest.approx(tau_b / tau_a, rel=1e-12)
        assert entry["tau"]["interval"][0] <= entry["tau"]["ratio"] <= entry["tau"]["interval"][1]
        assert "speed" not in entry  # the replay has no timings
    served = result["replay"]["served"]["tau"]
    assert served["ratio"] != 1.0  # two different drafters
    assert f"B/A {served['ratio']:.3f}" in printed


def test_a_bad_draft_is_refused_before_any_decoding(tmp_path, capsys):
    draft = save_draft(trained_draft("dflash2"), tmp_path / "draft", dtype=torch.float64)
    out = tmp_path / "compare"
    argv = ["compare", "--draft-a", str(draft), "--draft-b", str(tmp_path / "none"), "--out", str(out), *SETTINGS]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: ") and "none" in err and err.count("\n") == 1, err
    assert not out.exists()
