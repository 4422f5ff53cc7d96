"""`dflash2 regen`: batched greedy responses, resumable after a crash without losing or duplicating
samples, refusing to mix settings or prompt files; and the shipped prompt sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from speculative_helpers import TARGET_SPEC, tiny_target

import dflash2_lightning.data.regen as regen_mod
from dflash2_lightning.data.encode import encode_chat
from dflash2_lightning.data.prompts import EVAL_PROMPTS, SEED_PROMPTS, encode_prompt, read_prompts
from dflash2_lightning.data.records import parse_record
from dflash2_lightning.data.regen import regen, regen_main
from dflash2_lightning.data.regen_log import RegenError
from dflash2_lightning.decode.speculative import target_greedy

N_PROMPTS, BATCH, NEW = 7, 2, 6
REAL_GENERATE = regen_mod.generate_responses


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = SEED_PROMPTS.read_text().splitlines()[:N_PROMPTS]
    path.write_text("\n".join(lines) + "\n")
    return path


def crash_after(monkeypatch, responses: int) -> list[int]:
    """Make generation raise once ``responses`` responses have finished (the log takes them two at a time);
    returns the list of prompt counts each call was asked for."""
    calls: list[int] = []
    monkeypatch.setattr(regen_mod, "LOG_EVERY", 2)

    def flaky(target, prompts, max_new_tokens, *args, **kwargs):
        calls.append(len(prompts))
        for n, item in enumerate(REAL_GENERATE(target, prompts, max_new_tokens, *args, **kwargs)):
            if n == responses:
                raise KeyboardInterrupt("simulated kill")
            yield item

    monkeypatch.setattr(regen_mod, "generate_responses", flaky)
    return calls


def log_records(out: Path) -> list[dict]:
    lines = out.with_name(out.name + ".partial").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def test_responses_are_the_targets_greedy_output(prompts_file, tmp_path) -> None:
    target = tiny_target()
    out = regen(target, prompts_file, tmp_path / "out.jsonl", NEW, BATCH, progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = read_prompts(prompts_file)
    assert len(records) == N_PROMPTS
    for rec, prompt in zip(records, prompts):
        assert rec["messages"][:-1] == prompt and rec["messages"][-1]["role"] == "assistant"
        ids = encode_prompt(target.tokenizer, prompt)
        ref = target_greedy(target, ids, NEW, target.eos_token_ids).tokens
        assert rec["messages"][-1]["content"] == target.tokenizer.decode(ref, skip_special_tokens=True)
        # The DataModule reads it: assistant tokens are supervised.
        _, mask = encode_chat(target.tokenizer, parse_record(rec, "out"))
        assert any(mask)
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_resume_after_crash_neither_loses_nor_duplicates(prompts_file, tmp_path, monkeypatch) -> None:
    target = tiny_target()
    clean = regen(target, prompts_file, tmp_path / "clean.jsonl", NEW, BATCH, progress=False)

    out = tmp_path / "resumed.jsonl"
    calls = crash_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        regen(target, prompts_file, out, NEW, BATCH, progress=False)
    assert not out.exists()  # never a half-written output
    assert calls == [N_PROMPTS] and len(log_records(out)) == 4  # the 5th finished response was not logged yet
    # A kill in the middle of the next write leaves a torn line: it must be dropped, not parsed.
    with open(out.with_name(out.name + ".partial"), "a") as f:
        f.write('{"index": 6, "hash": "00')

    calls = crash_after(monkeypatch, 99)
    regen(target, prompts_file, out, NEW, BATCH, progress=False)
    assert calls == [N_PROMPTS - 4]  # only the missing prompts were generated
    assert out.read_bytes() == clean.read_bytes()
    assert not out.with_name(out.name + ".partial").exists()

    calls = crash_after(monkeypatch, 0)  # finished: a rerun generates nothing
    regen(target, prompts_file, out, NEW, BATCH, progress=False)
    assert out.read_bytes() == clean.read_bytes() and calls == []


def test_resume_refuses_other_settings_or_prompts(prompts_file, tmp_path, monkeypatch) -> None:
    target = tiny_target()
    out = tmp_path / "out.jsonl"
    crash_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        regen(target, prompts_file, out, NEW, BATCH, progress=False)
    monkeypatch.undo()
    with pytest.raises(RegenError, match="other settings"):
        regen(target, prompts_file, out, NEW + 1, BATCH, progress=False)
    done = log_records(out)[0]["index"]
    lines = prompts_file.read_text().splitlines()
    lines[done] = json.dumps({"messages": [{"role": "user", "content": "An edited prompt."}]})
    prompts_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(RegenError, match=f"prompt {done} differs"):
        regen(target, prompts_file, out, NEW, BATCH, progress=False)
    regen(target, prompts_file, out, NEW, BATCH, overwrite=True, progress=False)
    assert len(out.read_text().splitlines()) == N_PROMPTS


def test_regen_command_line(prompts_file, tmp_path, capsys) -> None:
    out = tmp_path / "cli.jsonl"
    status = regen_main(
        [
            "--target",
            json.dumps(TARGET_SPEC),
            "--prompts",
            str(prompts_file),
            "--out",
            str(out),
            "--max-new-tokens",
            "3",
            "--batch-size",
            "4",
            "--max-prompts",
            "5",
            "--no-progress",
        ]
    )
    assert status == 0 and f"5 responses in {out}" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 5
    with pytest.raises(SystemExit):
        regen_main(["--help"])
    with pytest.raises(ValueError, match="batch_size=0"):
        regen(tiny_target(), prompts_file, tmp_path / "x.jsonl", 3, 0)


def test_shipped_prompt_sets() -> None:
    seed, held_out = read_prompts(SEED_PROMPTS), read_prompts(EVAL_PROMPTS)
    assert len(seed) >= 300 and len(held_out) >= 30
    seen = {json.dumps(m, sort_keys=True) for m in seed}
    assert len(seen) == len(seed)  # no duplicates
    assert not seen & {json.dumps(m, sort_keys=True) for m in held_out}  # held out means held out
    for messages in seed + held_out:
        assert messages[-1]["role"] == "user" and messages[-1]["content"].strip()
    assert all(len(encode_prompt(tiny_target().tokenizer, m)) > 3 for m in held_out)
