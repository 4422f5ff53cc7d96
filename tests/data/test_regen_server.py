"""`dflash2 regen --server`: through a real llama-server on 127.0.0.1 (started and stopped by the tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llamacpp_helpers import llama_cpp_or_skip
from serving_fakes import MODELS, Broken

from dflash2_lightning import cli
from dflash2_lightning.data.regen import regen, regen_main
from dflash2_lightning.data.regen_server import regen_server
from dflash2_lightning.engines.llama_server import free_port
from dflash2_lightning.engines.openai_client import ServerError

SMOLLM2 = {"gguf": "smollm2"}
PROMPTS = [
    "Name three primary colours.",
    "What is the capital of Italy?",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Give a synonym for 'happy'.",
    "What is 12 times 12?",
]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_dead_server_is_a_clear_error_and_writes_nothing(prompts_file, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerError, match=f"{url}/models did not answer"):
        regen_server(url, {"tiny": {}}, prompts_file, tmp_path / "out.jsonl", max_new_tokens=4, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_settings_are_named(prompts_file, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ValueError, match="concurrency=0 is invalid"):
        regen_server(url, {"tiny": {}}, prompts_file, tmp_path / "o.jsonl", concurrency=0)
    with pytest.raises(ValueError, match="top_p=0"):
        regen_server(url, {"tiny": {}}, prompts_file, tmp_path / "o.jsonl", temperature=1.0, top_p=0.0)


@pytest.mark.parametrize(
    "answers, raw, needles",
    [
        ({"GET /v1/models": "[]"}, None, ["/v1/models answered JSON of another shape: the answer is a list ([])"]),
        (
            {"GET /v1/models": '{"data": [1]}'},
            None,
            ["/v1/models answered JSON of another shape: data[0] is a number (1)"],
        ),
        (
            {"GET /v1/models": MODELS, "POST /v1/completions": '{"choices": [{"text": ["a"]}]}'},
            None,
            [
                "/v1/completions answered JSON of another shape: choices[0].text is a list",
                "0 of 2 responses are kept in",
            ],
        ),
        (
            {"GET /v1/models": MODELS, "POST /v1/completions": '{"choices": "none"}'},
            None,
            ["/v1/completions answered JSON of another shape: choices is a string"],
        ),
        (
            {"GET /v1/models": (200, '{"data": [{"id": "m"', 300)},
            None,
            ["/v1/models cut its answer off (20 of 300 bytes"],
        ),
        ({}, b"\x00\x01SSH-2.0-OpenSSH_9.6\r\n", ["/v1/models did not answer in HTTP (it sent '\\x00\\x01SSH-2.0"]),
    ],
    ids=["models-list", "models-data-number", "text-list", "choices-string", "cut-off", "not-http"],
)
def test_a_server_answering_wrongly_is_one_line_naming_the_endpoint(
    prompts_file, tmp_path, capsys, answers, raw, needles
):
    """JSON of another shape, a cut-off answer, a server that is not HTTP: one line naming the endpoint (and the
    field), exit 2, nothing written but the resumable log."""
    with Broken(answers, raw=raw) as server:
        code = cli.main(
            [
                "regen",
                "--server",
                server.url + "/v1",
                "--target",
                "tiny",
                "--prompts",
                str(prompts_file),
                "--max-prompts",
                "2",
                "--max-new-tokens",
                "4",
                "--out",
                str(tmp_path / "out.jsonl"),
                "--no-progress",
                "--concurrency",
                "1",
            ]
        )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"dflash2: error: {server.url}/v1/") and err.count("\n") == 1, err
    assert not any(c in err[:-1] for c in "\x00\r"), repr(err)
    assert all(needle in err for needle in needles), err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_timeout_that_is_no_duration_is_refused_when_parsed(prompts_file, tmp_path, capsys):
    for value in ("nan", "0", "-1"):
        assert (
            cli.main(
                [
                    "regen",
                    "--server",
                    "http://127.0.0.1:9/v1",
                    "--target",
                    "tiny",
                    "--out",
                    str(tmp_path / "o.jsonl"),
                    "--timeout",
                    value,
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert f"argument --timeout: {value} is invalid" in err and err.count("\n") == 1


def test_sampled_with_a_server_is_refused_before_any_request(prompts_file, tmp_path, capsys):
    """--sampled is in-process regen's; a server samples with --server-temperature. The refusal comes before the
    server is asked anything (nothing answers at the URL) and before anything is written."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "o.jsonl"
    config = tmp_path / "regen.yaml"
    config.write_text(f"server: {url}\nsampled: 2\n")
    for options in (["--server", url, "--sampled", "2"], ["--config", str(config)]):
        assert cli.main(["regen", "--target", "tiny", "--prompts", str(prompts_file), "--out", str(out), *options]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dflash2: error: --sampled is not supported with --server") and err.count("\n") == 1
        assert "--server-temperature" in err
    assert not out.exists() and not (tmp_path / "o.jsonl.partial").exists()


@pytest.fixture(scope="module")
def served_target():
    """The f32 SmolLM2 GGUF (the same weights the project runs) and the built llama.cpp."""
    from dflash2_lightning.engines.target_gguf import target_gguf

    llama = llama_cpp_or_skip()
    return llama, target_gguf(SMOLLM2, "f32")


@pytest.mark.slow
def test_greedy_records_match_in_process_regen(served_target, prompts_file, tmp_path, capsys):
    from dflash2_lightning.engines.llama_server import serve

    llama, model = served_target
    budget = 24
    with serve(model, threads=2, parallel=2, ctx_size=1024, llama=llama, log_dir=tmp_path) as server:
        assert (
            regen_main(
                [
                    "--server",
                    server.openai_url,
                    "--target",
                    "smollm2",
                    "--prompts",
                    str(prompts_file),
                    "--out",
                    str(tmp_path / "server.jsonl"),
                    "--max-new-tokens",
                    str(budget),
                    "--concurrency",
                    "3",
                    "--no-progress",
                ]
            )
            == 0
        )
    assert f"{len(PROMPTS)} responses in" in capsys.readouterr().out
    local = regen(SMOLLM2, prompts_file, tmp_path / "local.jsonl", max_new_tokens=budget, batch_size=1, progress=False)
    ours, theirs = _records(local), _records(tmp_path / "server.jsonl")
    assert [r["messages"][:-1] for r in theirs] == [r["messages"][:-1] for r in ours]  # same prompts, in order
    texts = [(a["messages"][-1]["content"], b["messages"][-1]["content"]) for a, b in zip(ours, theirs)]
    # Greedy on the same f32 weights: two engines' float sums differ in the last bits, so a near tie
    # can flip one argmax and the texts part from there. Tolerance: all but one response identical,
    # and every response agrees on its first 8 characters.
    identical = sum(a == b for a, b in texts)
    assert identical >= len(PROMPTS) - 1, texts
    assert all(a[:8] == b[:8] for a, b in texts), texts


@pytest.mark.slow
def test_dead_server_keeps_what_was_written_and_a_rerun_resumes(served_target, prompts_file, tmp_path, monkeypatch):
    import dflash2_lightning.data.regen_server as server_regen_mod
    from dflash2_lightning.engines.llama_server import serve, stop

    llama, model = served_target
    out = tmp_path / "out.jsonl"
    log = out.with_name(out.name + ".partial")
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    real_append = server_regen_mod.append_lines
    with serve(model, threads=2, parallel=1, ctx_size=1024, port=port, llama=llama, log_dir=tmp_path) as server:

        def append_then_kill(path, lines):
            # Kill the server right after the header and two records are durable: mid-run on any machine
            # (polling the log from another thread raced a fast server, which finished first).
            real_append(path, lines)
            if len(Path(path).read_text().splitlines()) >= 3:
                stop(server.process)

        monkeypatch.setattr(server_regen_mod, "append_lines", append_then_kill)
        with pytest.raises(ServerError) as err:
            regen_server(url, SMOLLM2, prompts_file, out, max_new_tokens=16, concurrency=1, progress=False, timeout=120)
        monkeypatch.setattr(server_regen_mod, "append_lines", real_append)
    assert "responses are kept in" in str(err.value) and "rerun the same command" in str(err.value)
    kept = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert 2 <= len(kept) < len(PROMPTS) and not out.exists()
    with serve(model, threads=2, parallel=2, ctx_size=1024, port=port, llama=llama, log_dir=tmp_path):
        regen_server(url, SMOLLM2, prompts_file, out, max_new_tokens=16, concurrency=2, progress=False)
    assert not log.exists()
    records = _records(out)
    assert [r["messages"][0]["content"] for r in records] == PROMPTS  # no gap, no duplicate, in prompt order
    by_prompt = {r["messages"][0]["content"]: r["messages"][-1]["content"] for r in records}
    for rec in kept:  # what was written before the crash is kept as it was
        assert by_prompt[rec["messages"][0]["content"]] == rec["messages"][-1]["content"]
