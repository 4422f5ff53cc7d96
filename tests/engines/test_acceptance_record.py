"""The acceptance record: what it holds (the loop's own accepted counts at T=0), where it is written, how it is read.

The tiny float64 target and the briefly trained tiny draft of speculative_helpers (accepted lengths 0..3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llamacpp_helpers import vocab_gguf
from speculative_helpers import TARGET_SPEC, tiny_target, trained_draft

from dflash2_lightning import cli
from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
from dflash2_lightning.decode.speculative import speculative_generate
from dflash2_lightning.engines.acceptance_record import (
    RECORD_FORMAT,
    RECORD_NAME,
    RecordError,
    check_record_weights,
    expected,
    gguf_record_path,
    read_record,
    remove_stale_record,
    stale_weights,
    weights_digest,
    write_record,
)
from dflash2_lightning.errors import ConfigError
from dflash2_lightning.evaluate.record import make_record
from dflash2_lightning.intervals import replay_summary
from dflash2_lightning.model.checkpoint import save_draft

TOKENS = 12


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return save_draft(trained_draft("dflash2"), tmp_path_factory.mktemp("record") / "draft", dtype=torch.float64)


@pytest.fixture(scope="module")
def record(draft_dir) -> dict:
    return make_record(draft_dir, tiny_target(), num_prompts=4, max_new_tokens=TOKENS)


def test_the_record_holds_the_loops_accepted_counts_at_t0(record, draft_dir):
    """Per prompt: the chat-rendered prompt ids, the target's greedy continuation, and exactly the accepted
    drafts of the speculative loop's untruncated verify steps (selector walk: what engines serve)."""
    target, draft = tiny_target(), trained_draft("dflash2")
    chats = read_prompts(EVAL_PROMPTS, 4)
    assert record["format"] == RECORD_FORMAT and record["path"] == "selector" and record["temperature"] == 0.0
    assert record["draft"]["block_size"] == 4 and record["draft"]["weights_sha256"] == weights_digest(draft_dir)
    assert record["max_new_tokens"] == TOKENS and record["stop_token_ids"] == target.eos_token_ids
    assert len(record["prompts"]) == 4
    for p, chat in zip(record["prompts"], chats):
        assert p["prompt_ids"] == encode_prompt(target.tokenizer, chat)
        run = speculative_generate(target, draft, p["prompt_ids"], TOKENS, path="selector")
        assert p["continuation_ids"] == list(run.tokens)
        assert p["accepted_per_step"] == [a for a, cut in zip(run.accepted, run.truncated) if not cut]
        assert p["continuation_text"] == target.tokenizer.decode(
            p["continuation_ids"][:-1] if p["stopped"] else p["continuation_ids"],
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
    summary = replay_summary([p["accepted_per_step"] for p in record["prompts"]], 4)
    e = record["expected"]
    assert e["tau"] == summary["tau"] and e["interval"] == summary["interval"] and e["prompts"] == 4
    assert e["per_prompt_accepted"] == [sum(p["accepted_per_step"]) for p in record["prompts"]]
    assert 1.0 < e["tau"] < 4.0 and e["interval"][0] <= e["tau"] <= e["interval"][1]


def test_fewer_prompts_get_their_own_expectation(record):
    two = expected(record, 2)
    summary = replay_summary([p["accepted_per_step"] for p in record["prompts"][:2]], 4)
    assert two["prompts"] == 2 and two["tau"] == summary["tau"] and two["interval"] == summary["interval"]


def test_written_atomically_and_read_back(record, tmp_path):
    path = write_record(record, tmp_path)
    assert path == tmp_path / RECORD_NAME and read_record(tmp_path) == json.loads(json.dumps(record))
    assert path.stat().st_size < 20_000  # small
    assert not [p for p in tmp_path.iterdir() if p.name != RECORD_NAME]  # no temporary left behind


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no acceptance record at .* `dflash2 acceptance-record --draft"),
        ("{trunc", "is not valid JSON"),
        (json.dumps({"format": "dflash2-acceptance-record/0"}), "has format 'dflash2-acceptance-record/0', not"),
        (
            json.dumps(
                {
                    "format": RECORD_FORMAT,
                    "draft": {},
                    "prompts": [],
                    "max_new_tokens": 8,
                    "stop_token_ids": [],
                    "path": "selector",
                }
            ),
            "holds no prompts",
        ),
    ],
)
def test_a_bad_record_is_refused_with_what_to_do(tmp_path, content, message):
    if content is not None:
        (tmp_path / RECORD_NAME).write_text(content)
    with pytest.raises(RecordError, match=message):
        read_record(tmp_path)


def test_the_action_writes_it(draft_dir, tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert (
        cli.main(
            [
                "acceptance-record",
                "--draft",
                str(draft_dir),
                "--target",
                json.dumps(TARGET_SPEC),
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "6",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = read_record(out)
    assert len(record["prompts"]) == 2 and record["max_new_tokens"] == 6
    assert f"acceptance record: expected tau {record['expected']['tau']:.2f}" in capsys.readouterr().out
    assert cli.main(["acceptance-record", "--draft", str(draft_dir), "--target", "tiny", "--num-prompts", "0"]) == 2
    assert "argument --num-prompts: 0 is invalid: must be >= 1" in capsys.readouterr().err  # when parsed


@pytest.fixture
def no_generation(monkeypatch):
    """Any call of the replay (the target's greedy decoding) fails the test: the refusals come before it."""
    from dflash2_lightning.evaluate import replay

    def refuse(*args, **kwargs):
        raise AssertionError("the replay ran: the check came after the expensive step")

    monkeypatch.setattr(replay, "run_replay", refuse)


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--max-new-tokens", "3000"],
            [
                "max_new_tokens=3000 is invalid: must be < the target's context of 2048 positions",
                "lower --max-new-tokens",
            ],
        ),
        (
            ["--max-new-tokens", "2040"],
            ["1 of 1 prompts do not fit the target's context", "prompt 1 of", "--prompt-overflow truncate"],
        ),
        (
            ["--max-new-tokens", "4", "--target", '{"tiny": {"hidden_size": 128, "head_dim": 32}}'],
            [
                "was not trained for this target: hidden_size 64 vs the target's 128",
                "pass the target the draft was trained",
            ],
        ),
    ],
)
def test_a_budget_past_the_context_or_a_target_of_another_geometry_is_refused_before_generating(
    draft_dir, tmp_path, capsys, no_generation, args, needles
):
    """As `dflash2 eval` refuses them (the same checks: fit_to_context, Target.check_fits): one line, nothing
    written."""
    out = tmp_path / "rec.json"
    target = ["--target", json.dumps(TARGET_SPEC)] if "--target" not in args else []
    assert (
        cli.main(
            ["acceptance-record", "--draft", str(draft_dir), *target, "--num-prompts", "1", "--out", str(out), *args]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: ") and err.count("\n") == 1, err
    assert all(needle in err for needle in needles), err
    assert not out.exists()


def test_fits_record_budget_is_checked_before_training():
    """fit's end-of-fit export makes the record with export.acceptance_tokens: checked when the module is built
    (before any step), naming the setting as the command line writes it."""
    from dflash2_lightning.train.module import DFlash2Module

    with pytest.raises(
        ConfigError,
        match=r"model.init_args.export.acceptance_tokens=3000 is invalid: must be < the "
        r"target's context of 2048 positions .*lower "
        r"--model.init_args.export.acceptance_tokens$",
    ):
        DFlash2Module(
            target={"tiny": {}},
            draft={"block_size": 4, "selector_rank": 8, "selector_top_k": 4},
            export={"acceptance_tokens": 3000},
        )
    DFlash2Module(
        target={"tiny": {}},
        draft={"block_size": 4, "selector_rank": 8, "selector_top_k": 4},
        export={"acceptance_tokens": 3000, "acceptance_prompts": 0},
    )  # no record: nothing to check


def test_a_record_of_other_weights_is_found_and_removed(draft_dir, record, tmp_path):
    """What check-serving refuses and a fit removes: a record whose weights_sha256 is not model.safetensors'."""
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in draft_dir.iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    write_record(record, draft)
    assert stale_weights(record, draft) is None and remove_stale_record(draft) is None
    assert (draft / RECORD_NAME).exists()
    (draft / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    assert "was made for other weights than" in stale_weights(record, draft)
    with pytest.raises(RecordError, match="made for other weights .*--allow-stale-record"):
        check_record_weights(record, draft)
    assert remove_stale_record(draft) == draft / RECORD_NAME and not (draft / RECORD_NAME).exists()
    assert stale_weights(record, tmp_path) is None  # no weights there: nothing to compare with


def test_eval_with_a_replay_writes_it_into_the_draft(draft_dir, tmp_path):
    from dflash2_lightning.evaluate.command import eval_main

    draft = tmp_path / "draft"
    draft.mkdir()
    for f in draft_dir.iterdir():
        if f.name != RECORD_NAME:
            (draft / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "eval"
    args = [
        "--draft",
        str(draft),
        "--target",
        json.dumps(TARGET_SPEC),
        "--out",
        str(out),
        "--max-new-tokens",
        "8",
        "--max-prompts",
        "1",
        "--no-estimate",
        "--paths",
        "selector",
        "--replay-prompts",
        "3",
        "--no-progress",
    ]
    assert eval_main([*args, "--no-acceptance-record"]) == 0 and not (draft / RECORD_NAME).exists()
    assert eval_main(args) == 0
    report = json.loads((out / "eval.json").read_text())
    record = read_record(draft)
    assert report["acceptance_record"] == str(draft / RECORD_NAME)
    assert record["expected"]["tau"] == report["replay"]["paths"]["selector"]["tau"]
    assert len(record["prompts"]) == 3 and record["max_new_tokens"] == 8


def test_the_gguf_export_puts_the_record_beside_the_gguf(draft_dir, record, tmp_path):
    pytest.importorskip("gguf")
    from dflash2_lightning.engines.draft_gguf import export_gguf

    draft = tmp_path / "draft"
    draft.mkdir()
    for f in draft_dir.iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    write_record(record, draft)
    vocab = vocab_gguf(tmp_path / "target.gguf", trained_draft("dflash2").config.vocab_size)
    gguf = export_gguf(draft, vocab, tmp_path / "out" / "draft.gguf", "f16")
    beside = read_record(gguf_record_path(gguf))
    assert gguf_record_path(gguf) == tmp_path / "out" / "draft.acceptance.json"
    assert beside["gguf"] == {"file": "draft.gguf", "outtype": "f16"} and beside["prompts"] == record["prompts"]
    # weights changed since the record was made: it no longer describes them, and the old copy goes away
    (draft / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    export_gguf(draft, vocab, gguf, "f16")
    assert not gguf_record_path(gguf).exists()


def test_serving_md_describes_the_record_and_the_check(draft_dir, tmp_path):
    from dflash2_lightning.export.serving import write_serving
    from dflash2_lightning.model.checkpoint import load_config

    path, _ = write_serving(draft_dir, load_config(draft_dir), out=tmp_path / "SERVING.md")
    text = path.read_text()
    assert f"`{RECORD_NAME}` beside this checkpoint" in text and "`dflash2 acceptance-record --draft" in text
    assert "`dflash2 check-serving --server http://HOST:PORT --draft" in text
    assert "--spec-draft-n-max 3 --metrics" in text  # llama-server's counters for the check
    # a quantised target is checked against the same engine without the draft, not the record's continuation
    assert "llama-server without `-md`) and add `--reference-url http://HOST:PORT2`" in text
