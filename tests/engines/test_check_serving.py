"""`dflash2 check-serving`: the engines' counters read from their real formats, and the verdicts.

The engines here are stand-ins (tests/serving_fakes.py) answering field by field as vLLM 0.33.0, SGLang 0.5.23
and llama-server 11434 do (each format's source file is cited there); the real llama-server is checked in
tests/engines/test_check_serving_llama_cpp.py. The record is synthetic (the record itself is tested in
tests/engines/test_acceptance_record.py): what is checked here is reading, comparing and naming causes.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from serving_fakes import (
    MODELS,
    Broken,
    FakeEngine,
    Served,
    behaviour_of,
    llama_cpp_completion,
    llama_cpp_metrics,
    sglang_completion,
    vllm_completion,
    vllm_metrics,
)

from dflash2_lightning import cli
from dflash2_lightning.engines.acceptance_record import RECORD_FORMAT, expected, write_record
from dflash2_lightning.engines.check_serving import check_serving, compare_output, likely_causes
from dflash2_lightning.engines.counters import (
    LLAMA_CPP,
    SGLANG,
    VLLM,
    Counts,
    EngineError,
    metrics_counts,
    parse_prometheus,
    read_completion,
    total,
)
from dflash2_lightning.engines.counters import Served as ServedOutput

BLOCK = 4


def synthetic_record(prompts: int = 6, steps: int = 20, seed: int = 0) -> dict:
    """A valid record: block 4, stop id 0, per prompt a token-id prompt, a continuation and accepted drafts
    per verify step drawn around tau ~1.8."""
    rng = random.Random(seed)
    items = []
    for i in range(prompts):
        accepted = [rng.choice([0, 0, 1, 1, 2, 3]) for _ in range(steps)]
        length = 1 + sum(a + 1 for a in accepted)
        ids = [rng.randrange(5, 500) for _ in range(length)]
        items.append(
            {
                "prompt_ids": [1, 2, 3 + i],
                "continuation_ids": ids,
                "continuation_text": " ".join(f"w{t}" for t in ids),
                "stopped": False,
                "accepted_per_step": accepted,
            }
        )
    record = {
        "format": RECORD_FORMAT,
        "draft": {
            "dir": "/drafts/mine",
            "architecture": "DFlash2DraftModel",
            "block_size": BLOCK,
            "torch_dtype": "bfloat16",
            "weights_sha256": "0" * 64,
        },
        "target": {"spec": None, "path": "/models/target", "gguf": None, "serving_dtype": "bfloat16"},
        "path": "selector",
        "temperature": 0.0,
        "max_new_tokens": max(len(p["continuation_ids"]) for p in items),
        "stop_token_ids": [0],
        "prompts_source": "test",
        "prompts": items,
        "bootstrap": {"resamples": 400, "seed": 0, "level": 0.95, "unit": "prompt"},
    }
    record["expected"] = expected(record)
    return record


@pytest.fixture
def record() -> dict:
    return synthetic_record()


def fake(engine: str, record: dict, **behaviour) -> FakeEngine:
    opts = {k: behaviour.pop(k) for k in ("per_request", "metrics") if k in behaviour}
    return FakeEngine(engine, [p["prompt_ids"] for p in record["prompts"]], behaviour_of(record, **behaviour), **opts)


def run_cli(capsys, record: dict, tmp_path, server: Served, *extra: str) -> tuple[int, str, str]:
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    write_record(record, draft)
    code = cli.main(["check-serving", "--server", server.url, "--draft", str(draft), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- readers, on the engines' text
# vLLM 0.33.0 with two data-parallel engines: the counters of SpecDecodingProm (vllm/v1/spec_decode/metrics.py),
# labels ["model_name", "engine"] (+ "position") from vllm/v1/metrics/loggers.py, as prometheus_client 0.26's
# generate_latest writes a Counter (exposition.py: "_total" sample, labels sorted, then the "_created" gauge).
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="Qwen/Qwen3-8B"} 120.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="Qwen/Qwen3-8B"} 80.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7963107e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7963107e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 840.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 560.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 200.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
""" + "".join(
    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="Qwen/Qwen3-8B",'
    f'position="{k}"}} {v}\n'
    for e in (0, 1)
    for k, v in enumerate([50.0, 30.0, 20.0, 10.0, 5.0, 3.0, 2.0])
)

# llama-server 11434 with --metrics: server_task_result_metrics::to_metrics (tools/server/server-task.cpp), values
# printed by a C++ stream (integers without a decimal point), the per-position counter last.
LLAMA_CPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 212
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 183
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 37
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 61
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 24
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 9
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 4
"""


def test_vllm_prometheus_counters_are_summed_over_engines_and_the_width_is_the_positions():
    c = metrics_counts(VLLM, VLLM_METRICS)
    assert (c.steps, c.drafted, c.accepted, c.width) == (200.0, 1400.0, 500.0, 7)
    assert c.accepted_per_position == (100.0, 60.0, 40.0, 20.0, 10.0, 6.0, 4.0)
    assert c.tau == pytest.approx(3.5) and c.drafted_per_step == 7.0
    assert metrics_counts(LLAMA_CPP, VLLM_METRICS) is None  # another engine's names
    # the builder of the fake engine writes the same text
    assert metrics_counts(VLLM, vllm_metrics("Qwen/Qwen3-8B", 200, 1400, 500, [100, 60, 40, 20, 10, 6, 4], 2)) == c


def test_llama_cpp_metrics_and_timings():
    c = metrics_counts(LLAMA_CPP, LLAMA_CPP_METRICS)
    assert (c.steps, c.drafted, c.accepted, c.width, c.accepted_per_position) == (61, 183, 37, 3, (24, 9, 4))
    assert metrics_counts(LLAMA_CPP, llama_cpp_metrics(61, 183, 37, [24, 9, 4])) == c  # the fake engine's text
    assert metrics_counts(LLAMA_CPP, LLAMA_CPP_METRICS.split("# HELP llamacpp:spec")[0]) is None
    assert parse_prometheus(LLAMA_CPP_METRICS)[0] == ("llamacpp:prompt_tokens_total", {}, 212.0)
    served = read_completion(LLAMA_CPP, llama_cpp_completion("m", "Paris.", 33, 60, 12))
    assert served.text == "Paris." and served.token_ids is None
    # without /metrics the steps follow from the timings: 33 tokens = the first + 12 accepted + one per step
    assert (served.counts.drafted, served.counts.accepted, served.counts.steps) == (60, 12, 20)
    assert served.counts.steps_estimated
    plain = read_completion(LLAMA_CPP, llama_cpp_completion("m", "Paris.", 33, 0, 0))  # no draft_n: no drafts
    assert plain.counts.drafted == 0


def test_vllm_per_request_metrics_and_token_ids():
    body = vllm_completion("m", "a b", [7, 8, 9, 10, 11], [2, 0, 1], num_spec_tokens=3)
    served = read_completion(VLLM, json.loads(json.dumps(body)))
    assert served.token_ids == [7, 8, 9, 10, 11]
    c = served.counts
    assert (c.steps, c.accepted, c.drafted, c.width) == (3, 3, 9, 3) and c.accepted_per_position == (2, 1, 0)
    assert read_completion(VLLM, vllm_completion("m", "a", [7], None, 3)).counts is None  # metrics off


def test_sglang_spec_tokens_details():
    body = sglang_completion("m", "a b", [7, 8, 9, 10, 11, 12], [2, 0, 1], num_draft_tokens=4)
    served = read_completion(SGLANG, json.loads(json.dumps(body)))
    c = served.counts
    assert (c.steps, c.accepted, c.drafted, c.width) == (3, 3, 9, 3) and c.accepted_per_position == (2, 1, 0)
    assert served.token_ids == [7, 8, 9, 10, 11, 12]
    assert read_completion(SGLANG, sglang_completion("m", "a", [7], None, 4)).counts is None  # not speculated


def test_counts_subtract_and_add():
    a = Counts(10, 4, 5, 3, (3, 1, 0))
    b = Counts(25, 9, 10, 3, (6, 2, 1))
    assert b - a == Counts(15, 5, 5, 3, (3, 1, 1))
    assert total([a, b]) == Counts(35, 13, 15, 3, (9, 3, 1))


def test_outputs_are_compared_by_ids_when_given_else_text():
    p = {"continuation_ids": [5, 6, 7, 0], "continuation_text": "five six seven"}
    assert compare_output(ServedOutput("x", token_ids=[5, 6, 7]), p, [0]) is None  # the stop token aside
    assert compare_output(ServedOutput("x", token_ids=[5, 6, 8, 9]), p, [0]) == "token 2 of 3"
    assert compare_output(ServedOutput("x", token_ids=[5, 6]), p, [0]) == "token 2 of 3 (the engine stopped early)"
    assert compare_output(ServedOutput("five six seven"), p, [0]) is None
    assert compare_output(ServedOutput("five six sevens"), p, [0]) == "character 14 of 14 (the engine went on)"


# ----------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize(
    "engine, options",
    [
        (VLLM, {}),
        (VLLM, {"per_request": False}),
        (SGLANG, {}),
        (LLAMA_CPP, {}),
        (LLAMA_CPP, {"metrics": False}),
    ],
    ids=["vllm-per-request", "vllm-prometheus", "sglang", "llama.cpp", "llama.cpp-no-metrics"],
)
def test_a_faithful_engine_agrees(record, tmp_path, capsys, engine, options):
    with Served(fake(engine, record, **options)) as server:
        code, out, err = run_cli(capsys, record, tmp_path, server)
        requests = server.fake.requests
    assert code == 0, out + err
    e = record["expected"]
    assert f"check-serving: {engine} at {server.url}" in out
    assert f"served {e['tau']:.2f} vs expected {e['tau']:.2f} [{e['interval'][0]:.2f}, {e['interval'][1]:.2f}]" in out
    assert "6/6 equal to the target's greedy continuation" in out and "verdict: AGREE" in out
    assert len(requests) == 6 and all(r["temperature"] == 0.0 and r["top_k"] == 1 for r in requests)
    assert requests[0]["prompt"] == record["prompts"][0]["prompt_ids"]  # token ids, not text
    assert requests[0]["max_tokens"] == record["max_new_tokens"]
    if engine == SGLANG:
        assert requests[0]["return_spec_tokens_details"] is True
    if engine == LLAMA_CPP and not options:
        assert "accepted drafts per prompt: served" in out and "(equal on 6/6, max difference 0)" in out


@pytest.mark.parametrize(
    "engine, served_width, cause",
    [
        (VLLM, 2, "`num_speculative_tokens` is 2: it must be 3 = block_size - 1"),
        (SGLANG, 5, "`--speculative-num-draft-tokens` is 6: the block needs 4 (SGLang counts the anchor"),
        (LLAMA_CPP, 1, "`--spec-draft-n-max` is 1; the block needs 3 (llama.cpp's default is 3)"),
    ],
)
def test_an_engine_drafting_another_width_is_named(record, tmp_path, capsys, engine, served_width, cause):
    keep = min(served_width, BLOCK - 1)
    with Served(fake(engine, record, width=served_width, accepted=lambda a: [min(x, keep) for x in a])) as server:
        code, out, _ = run_cli(capsys, record, tmp_path, server)
    assert code == 1
    assert (
        f"verdict: DISAGREE — {engine} drafts {served_width} token{'s' if served_width > 1 else ''} per verify "
        "step; this draft's block drafts 3"
    ) in out
    assert f"likely causes ({engine}):" in out and cause in out
    assert "SERVING.md recommends:" in out


@pytest.mark.parametrize(
    "engine, cause",
    [
        (VLLM, '`"method": "dflash"` is missing'),
        (SGLANG, "`--dtype auto` serves a float32 draft as float16"),
        (LLAMA_CPP, "the GGUF is not this draft's"),
    ],
)
def test_acceptance_below_the_interval_is_caught(record, tmp_path, capsys, engine, cause):
    """Another draft (or a broken one) behind a right target: the outputs are right, the acceptance is not."""
    with Served(fake(engine, record, accepted=lambda a: [x // 2 for x in a])) as server:
        code, out, _ = run_cli(capsys, record, tmp_path, server)
    assert code == 1
    assert re.search(r"verdict: DISAGREE — served tau \d\.\d+ is below the expected", out), out
    assert cause in out and "(outside)" in out
    assert "6/6 equal" in out  # the target is right


def test_outputs_of_another_target_are_caught_first(record, tmp_path, capsys):
    def other(i: int, ids: list[int]) -> list[int]:
        return ids[:5] + [t + 1 for t in ids[5:]] if i in (1, 4) else ids

    with Served(fake(VLLM, record, output=other)) as server:
        code, out, _ = run_cli(capsys, record, tmp_path, server)
    assert code == 1
    assert (
        "verdict: DISAGREE — served outputs differ from the target's greedy continuation on 2 of 6 prompts "
        "(prompt 1 from token 5 of"
    ) in out
    assert "likely causes (vLLM):" in out and "the target runs in another dtype than the record's (bfloat16)" in out
    assert '--speculative-config \'{"method": "dflash", "model": "/drafts/mine"' not in out  # --draft given instead
    assert 'num_speculative_tokens": 3}' in out


def test_an_engine_that_does_not_speculate(record, tmp_path, capsys):
    with Served(fake(LLAMA_CPP, record, width=0, accepted=lambda a: [])) as server:
        code, out, _ = run_cli(capsys, record, tmp_path, server)
    assert code == 1
    assert "verdict: DISAGREE — llama.cpp drafted no token on 6 prompts" in out
    assert "-md draft.gguf --spec-type draft-dflash" in out


def test_fewer_prompts_get_their_own_interval(record, tmp_path, capsys):
    with Served(fake(SGLANG, record)) as server:
        code, out, _ = run_cli(
            capsys, record, tmp_path, server, "--max-prompts", "3", "--json", str(tmp_path / "v.json")
        )
        assert len(server.fake.requests) == 3
    assert code == 0
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["expected"]["prompts"] == 3 and verdict["expected"] == {
        k: v for k, v in expected(record, 3).items() if k in verdict["expected"]
    }
    assert verdict["agree"] and verdict["served"]["tau"] == pytest.approx(expected(record, 3)["tau"])


@pytest.mark.parametrize("engine", [VLLM, SGLANG, LLAMA_CPP])
def test_the_engine_is_detected_without_metrics(record, engine):
    # detected from vLLM's /version, SGLang's /server_info, llama.cpp's /props
    with Served(fake(engine, record, metrics=False)) as server:
        assert check_serving(server.url + "/v1", record).engine == engine


def test_vllm_without_any_counters_cannot_be_checked(record):
    with Served(fake(VLLM, record, metrics=False, per_request=False)) as server:
        with pytest.raises(
            EngineError,
            match="vLLM at .* reports no speculative-decoding counters.*--per-request-spec-decode-metrics summary",
        ):
            check_serving(server.url, record)


def test_could_not_check_is_one_line_and_exit_2(record, tmp_path, capsys):
    code, out, err = run_cli(capsys, record, tmp_path, type("S", (), {"url": "http://127.0.0.1:9"})())
    assert code == 2 and out == ""
    assert err.startswith("dflash2: error: nothing answers at http://127.0.0.1:9") and err.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["check-serving", "--server", "http://127.0.0.1:9", "--draft", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "no acceptance record at" in err and "dflash2 acceptance-record --draft" in err and err.count("\n") == 1
    (empty / "acceptance.json").write_text(json.dumps({"format": "something-else/9"}))
    assert cli.main(["check-serving", "--server", "http://127.0.0.1:9", "--draft", str(empty)]) == 2
    assert f"has format 'something-else/9', not '{RECORD_FORMAT}'" in capsys.readouterr().err


def test_help_says_what_it_checks_and_needs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check-serving", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needed in (
        "acceptance record",
        "--replay-prompts",
        "token ids at T=0",
        "/metrics",
        "spec_tokens_details",
        "within the expected 95% interval",
        "Exit 0: agree, 1: disagree, 2: could not check",
    ):
        assert needed in text, needed


def test_every_engine_and_check_has_causes():
    for engine in (VLLM, SGLANG, LLAMA_CPP):
        for code in ("no_drafts", "outputs", "width", "tau"):
            assert likely_causes(engine, code, 4, "bfloat16", 2), (engine, code)


# ----------------------------------------------------------------------------- could not check: bad input and servers
def one_error_line(err: str, *needles: str) -> str:
    """stderr is exactly one ``dflash2: error:`` line holding every needle, with no raw control byte."""
    assert err.startswith("dflash2: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert not any(c in err[:-1] for c in "\x00\r\t"), repr(err)
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_a_record_of_other_weights_is_refused_unless_allowed(record, tmp_path, capsys):
    """The record's weights_sha256 is not the draft's model.safetensors: refused before any request (as
    export-gguf refuses to copy it); --allow-stale-record checks anyway, with a warning and a note."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"the weights of a later run")
    with Served(fake(VLLM, record)) as server:
        code, out, err = run_cli(capsys, record, tmp_path, server)
        assert server.fake.requests == []
        assert code == 2 and out == ""
        one_error_line(
            err,
            "acceptance record was made for other weights than",
            "model.safetensors",
            f"dflash2 acceptance-record --draft {draft}",
            "--allow-stale-record",
        )
        assert cli.main(["check-serving", "--server", server.url, "--record", str(draft / "acceptance.json")]) == 2
        one_error_line(capsys.readouterr().err, "made for other weights")
        code, out, err = run_cli(capsys, record, tmp_path, server, "--allow-stale-record")
    assert code == 0 and "verdict: AGREE" in out and "note: the acceptance record was made for other weights" in out
    assert err.startswith("dflash2: warning: the acceptance record was made for other weights") and err.count("\n") == 1
    # A GGUF's copy describes the GGUF (export-gguf copies only a record of the same weights): not compared.
    write_record({**record, "gguf": {"file": "draft.gguf", "outtype": "f32"}}, draft / "draft.acceptance.json")
    with Served(fake(VLLM, record)) as server:
        assert (
            cli.main(["check-serving", "--server", server.url, "--record", str(draft / "draft.acceptance.json")]) == 0
        )


@pytest.mark.parametrize(
    "value, needle",
    [
        ("nan", "nan is invalid: must be a finite number"),
        ("inf", "inf is invalid: must be a finite number"),
        ("0", "0 is invalid: must be > 0"),
        ("-5", "-5 is invalid: must be > 0"),
    ],
)
def test_a_timeout_that_is_no_duration_is_refused_when_parsed(record, tmp_path, capsys, value, needle):
    with Served(fake(VLLM, record)) as server:
        code, out, err = run_cli(capsys, record, tmp_path, server, "--timeout", value)
        assert server.fake.requests == []
    assert code == 2 and out == ""
    one_error_line(err, "argument --timeout", needle)


def test_the_record_is_named_by_exactly_one_of_draft_and_record(record, tmp_path, capsys):
    """--draft and --record both name the acceptance record: neither, or both, is refused before any request,
    from the command line or a --config file; a --config file gives the options as the command line does."""
    draft = tmp_path / "draft"
    draft.mkdir()
    write_record(record, draft)
    both = ["--draft", str(draft), "--record", str(draft / "acceptance.json")]
    with Served(fake(VLLM, record)) as server:
        for where in ([], both):
            assert cli.main(["check-serving", "--server", server.url, *where]) == 2
            one_error_line(capsys.readouterr().err, "--draft", "--record")
        config = tmp_path / "check.yaml"
        config.write_text(f"server: {server.url}\ndraft: {draft}\nrecord: {draft / 'acceptance.json'}\n")
        assert cli.main(["check-serving", "--config", str(config)]) == 2
        one_error_line(capsys.readouterr().err, "argument --record: not allowed with argument --draft")
        assert server.fake.requests == []
        config.write_text(f"server: {server.url}\ndraft: {draft}\n")
        assert cli.main(["check-serving", "--config", str(config)]) == 0
    assert "verdict: AGREE" in capsys.readouterr().out


def test_a_slow_server_is_said_to_be_slow_and_detection_honours_the_timeout(record, tmp_path, capsys):
    """A server that answers later than --timeout: 'did not answer within', never 'is the engine running';
    the engine's detection probes wait --timeout too (not a fixed 30 s each)."""
    with Broken({"GET /v1/models": MODELS}, delay=2.0) as slow:
        code, _, err = run_cli(capsys, record, tmp_path, slow, "--timeout", "0.2")
    assert code == 2
    one_error_line(err, f"{slow.url}/v1/models did not answer within 0.2 s (--timeout)", "larger --timeout")
    assert "running" not in err
    with Broken({"GET /v1/models": MODELS}, delay={"GET /metrics": 5.0}) as hung:
        code, _, err = run_cli(capsys, record, tmp_path, hung, "--timeout", "0.5")
    assert code == 2  # /v1/models answers at once, /metrics hangs: the detection's probe gives up after --timeout
    one_error_line(err, f"{hung.url}/metrics", "0.5 s (--timeout)")


def test_a_server_given_up_on_leaves_nothing_behind_its_block(capsys):
    """The fake's handler of a request the client gave up on ends with the ``with`` block: its late answer used
    to hit the closed socket after the test and print BrokenPipeError into a later test's stderr."""
    import threading
    import urllib.request

    with Broken({"GET /v1/models": MODELS}, delay=30.0) as hung:
        with pytest.raises(OSError):  # TimeoutError, or URLError wrapping it
            urllib.request.urlopen(f"{hung.url}/v1/models", timeout=0.2)
        handlers = [t for t in threading.enumerate() if "process_request_thread" in t.name]
    assert handlers and not [t.name for t in handlers if t.is_alive()]
    assert capsys.readouterr().err == ""


MALFORMED = [
    ({"GET /v1/models": "[]"}, "/v1/models", "the answer is a list ([]), not an object"),
    ({"GET /v1/models": '{"data": [1]}'}, "/v1/models", "data[0] is a number (1), not a model object"),
    ({"GET /v1/models": '{"data": "m"}'}, "/v1/models", 'data is a string ("m"), not a list of models'),
    ({"POST /v1/completions": "[]"}, "/v1/completions", "the answer is a list ([]), not an object"),
    (
        {"POST /v1/completions": '{"choices": [{"text": "a"}], "timings": "garbage"}'},
        "/v1/completions",
        'timings is a string ("garbage"), not an object',
    ),
    (
        {"POST /v1/completions": '{"choices": [{"text": "a"}], "timings": {"draft_n": "x"}}'},
        "/v1/completions",
        'timings.draft_n is a string ("x"), not a number',
    ),
    (
        {"POST /v1/completions": '{"choices": [{"text": "a", "token_ids": "1 2 3"}]}'},
        "/v1/completions",
        'choices[0].token_ids is a string ("1 2 3"), not a list of token ids',
    ),
    ({"POST /v1/completions": '{"choices": [{"text": 7}]}'}, "/v1/completions", "choices[0].text is a number (7)"),
]


@pytest.mark.parametrize("answers, endpoint, needle", MALFORMED)
def test_json_of_another_shape_names_the_endpoint_and_the_field(record, tmp_path, capsys, answers, endpoint, needle):
    with Broken({"GET /v1/models": MODELS, **answers}) as server:
        code, out, err = run_cli(capsys, record, tmp_path, server, "--engine", "llama.cpp", "--timeout", "30")
    assert code == 2 and out == ""
    one_error_line(err, f"{server.url}{endpoint} answered JSON of another shape: {needle}", "OpenAI-compatible server")


def test_a_server_that_is_not_http_or_cuts_its_answer_off_is_said_so(record, tmp_path, capsys):
    with Broken(raw=b"\x00\x01SSH-2.0-OpenSSH_9.6\r\n\x00\x1b[2J more\r\n") as other:
        code, _, err = run_cli(capsys, record, tmp_path, other, "--timeout", "30")
    assert code == 2
    one_error_line(
        err,
        f"{other.url}/v1/models did not answer in HTTP",
        "\\x00\\x01SSH-2.0-OpenSSH_9.6",
        "the server's HTTP address",
    )
    with Broken({"GET /v1/models": (200, '{"data": [{"id": "m"', 500)}) as cut:
        code, _, err = run_cli(capsys, record, tmp_path, cut, "--timeout", "30")
    assert code == 2
    one_error_line(err, f"{cut.url}/v1/models cut its answer off (20 of 500 bytes received)")
    assert "cannot reach" not in err and "running" not in err


# ----------------------------------------------------------------------------- the engine alone as the reference
def near_ties(i: int, ids: list[int]) -> list[int]:
    """What a quantised target's kernels serve: the record's continuation, another pick from token 7 on two prompts."""
    return ids[:7] + [t + 1 for t in ids[7:]] if i in (1, 4) else ids


def near_tie_text(i: int, text: str) -> str:
    return text[:9] + text[9:].upper() if i in (1, 4) else text


def alone(engine: str, record: dict, **behaviour) -> FakeEngine:
    """The same engine serving the same target without the draft: it drafts nothing."""
    return fake(engine, record, width=0, accepted=lambda a: [], **behaviour)


@pytest.mark.parametrize("engine", [LLAMA_CPP, VLLM])
def test_the_engine_alone_judges_losslessness_and_the_record_is_information(record, tmp_path, capsys, engine):
    """A quantised target picks otherwise than the record at near ties, with and without the draft alike: lossless,
    so the verdict agrees; the record's comparison is reported, and the JSON says which reference judged."""
    ties = {"output": near_ties, "text": near_tie_text}
    with Served(fake(engine, record, **ties)) as server, Served(alone(engine, record, **ties)) as ref:
        code, out, err = run_cli(
            capsys, record, tmp_path, server, "--reference-url", ref.url, "--json", str(tmp_path / "v.json")
        )
        assert [r["prompt"] for r in ref.fake.requests] == [p["prompt_ids"] for p in record["prompts"]]
        assert all(r["temperature"] == 0.0 and r["top_k"] == 1 for r in ref.fake.requests)
    assert code == 0, out + err
    unit = "token ids" if engine == VLLM else "text"
    assert f"6/6 equal to the same engine's outputs without the draft ({ref.url}) ({unit})" in out
    assert "losslessness judged by the engine without the draft" in out
    assert "record: 4/6 equal to the record's greedy continuation" in out and "information only" in out
    assert "verdict: AGREE (the engine's outputs with the draft equal its own without it" in out
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["lossless_reference"] == "engine" and verdict["reference_url"] == ref.url
    assert verdict["outputs_equal"] == 6 and verdict["record_outputs_equal"] == 4
    assert [m["prompt"] for m in verdict["record_mismatched"]] == [1, 4]
    with Served(fake(engine, record, **ties)) as server:  # without a reference the record judges, as before
        code, out, _ = run_cli(capsys, record, tmp_path, server)
    assert code == 1 and "verdict: DISAGREE — served outputs differ from the target's greedy continuation" in out
    assert "losslessness judged by the record's continuation (--reference-url" in out


def test_outputs_with_the_draft_that_differ_from_the_engine_alone_are_not_lossless(record, tmp_path, capsys):
    with Served(fake(VLLM, record, output=near_ties)) as server, Served(alone(VLLM, record)) as ref:
        code, out, _ = run_cli(capsys, record, tmp_path, server, "--reference-url", ref.url)
    assert code == 1
    assert (
        "verdict: DISAGREE — served outputs with the draft differ from the same engine's outputs without it on 2 of "
        "6 prompts (prompt 1 from token 7 of"
    ) in out
    assert "speculative decoding in this deployment is not lossless" in out
    assert "likely causes (vLLM):" in out and "the reference runs with other settings than the engine" in out


@pytest.mark.parametrize(
    "engine, broken, first",
    [
        (LLAMA_CPP, {"width": 1}, "verdict: DISAGREE — llama.cpp drafts 1 token per verify step"),
        (SGLANG, {"accepted": lambda a: [0] * len(a)}, "verdict: DISAGREE — served tau"),
        (LLAMA_CPP, {"width": 0, "accepted": lambda a: []}, "verdict: DISAGREE — llama.cpp drafted no token"),
    ],
    ids=["width", "tau", "no-drafts"],
)
def test_broken_deployments_still_disagree_beside_a_reference(record, tmp_path, capsys, engine, broken, first):
    with Served(fake(engine, record, **broken)) as server, Served(alone(engine, record)) as ref:
        code, out, _ = run_cli(capsys, record, tmp_path, server, "--reference-url", ref.url)
    assert code == 1 and first in out, out


def test_a_reference_that_is_no_engine_alone_cannot_judge(record, tmp_path, capsys):
    """A reference that drafts, serves another model or is another engine: exit 2, one line, before any verdict."""
    cases = [
        (fake(LLAMA_CPP, record), "drafted", "it must serve the target alone"),
        (FakeEngine(LLAMA_CPP, [], behaviour_of(record, width=0), model="/models/other"), "serves '/models/other'"),
        (alone(VLLM, record), "is vLLM, the engine at", "start the reference with the same engine"),
    ]
    for reference, *needles in cases:
        with Served(fake(LLAMA_CPP, record)) as server, Served(reference) as ref:
            code, out, err = run_cli(capsys, record, tmp_path, server, "--reference-url", ref.url)
        assert code == 2 and out == ""
        one_error_line(err, f"the reference at {ref.url}", *needles)
    with Served(fake(LLAMA_CPP, record)) as server:
        code, out, err = run_cli(capsys, record, tmp_path, server, "--reference-url", "http://127.0.0.1:9")
    assert code == 2 and out == ""
    one_error_line(err, "nothing answers at http://127.0.0.1:9")
