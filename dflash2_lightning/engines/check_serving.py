"""``dflash2 check-serving``: is a running engine getting the acceptance this drafter earns?

It sends the prompts of the draft's acceptance record (:mod:`dflash2_lightning.engines.acceptance_record`:
token ids, the target's greedy continuation, the accepted drafts per verify step at T=0, the expected τ and its
95% interval) greedily, one at a time, to the engine's OpenAI-compatible ``/v1/completions``, reads the engine's
own counters (:mod:`dflash2_lightning.engines.counters`) and checks, in this order: **drafts** (it speculates at
all), **outputs** (lossless: equal to a reference engine's without the draft, ``--reference-url``, or else to the
record's continuation), **width** (``block_size - 1`` drafts per verify step) and **τ** (within the expected
interval, its lower end extended by the final truncated step per prompt that engines count and the record
leaves out: ``1 + (lo - 1) * steps / (steps + prompts)``).

Exit 0 when all four agree; 1 with a verdict naming the first failed check, the likely causes for that engine and
SERVING.md's command; 2 (one ``dflash2: error:`` line) when the check cannot run. The checks, references and
verdicts in full: docs/serving-check.md.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.engines.acceptance_record import expected, read_record
from dflash2_lightning.engines.counters import (
    ENGINE_CHOICES,
    LLAMA_CPP,
    SGLANG,
    VLLM,
    Counts,
    EngineClient,
    EngineError,
    Served,
    metrics_exact,
    total,
)
from dflash2_lightning.engines.server_options import ServerOptions
from dflash2_lightning.errors import UsageError, bounded

AGREE, DISAGREE, UNCHECKED = 0, 1, 2
# Without the engine's configured width (llama.cpp without --metrics), fewer drafts per step than this
# share of the block's counts as drafting fewer tokens (the last steps of a prompt draft fewer anyway).
_ESTIMATED_WIDTH_SHARE = 0.8


@dataclass(frozen=True)
class Problem:
    """A failed check: ``code`` (``no_drafts``, ``outputs``, ``width``, ``tau``) and what was seen."""

    code: str
    message: str


@dataclass
class Verdict:
    """What ``check-serving`` found (see the module docstring); :attr:`status` is the exit status."""

    engine: str
    url: str
    record: dict[str, Any]
    expected: dict[str, Any]
    served: list[Served]
    counts: Counts | None
    # (prompt, where it first differs) from what judges losslessness: the reference's outputs, else the record's
    mismatched: list[tuple[int, str]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reference_url: str | None = None
    reference: list[Served] | None = None  # the same engine's outputs without the draft, where one was asked
    record_mismatched: list[tuple[int, str]] = field(default_factory=list)  # information beside a reference

    @property
    def judged_by(self) -> str:
        """What judged losslessness: ``"engine"`` (the same engine without the draft) or ``"record"``."""
        return "record" if self.reference is None else "engine"

    @property
    def status(self) -> int:
        return AGREE if not self.problems else DISAGREE

    @property
    def served_tau(self) -> float | None:
        return self.counts.tau if self.counts is not None else None

    @property
    def interval(self) -> list[float | None]:
        return list(self.expected["interval"])

    @property
    def allowed(self) -> tuple[float, float] | None:
        """The accepted range of the served τ: the expected interval, its lower end extended by one truncated
        verify step per prompt (see the module docstring)."""
        lo, hi = self.expected["interval"]
        if lo is None or hi is None:
            return None
        steps, n = self.expected["steps"], self.expected["prompts"]
        return 1.0 + (lo - 1.0) * steps / (steps + n) if steps else lo, hi

    @property
    def per_prompt_accepted(self) -> list[int] | None:
        """The engine's accepted drafts per prompt, where it reports them per request."""
        if not self.served or any(s.counts is None for s in self.served):
            return None
        return [int(s.counts.accepted) for s in self.served]  # type: ignore[union-attr]

    def to_json(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict (for reports)."""
        c = self.counts
        return {
            "engine": self.engine,
            "url": self.url,
            "status": self.status,
            "agree": self.status == AGREE,
            "problems": [{"code": p.code, "message": p.message} for p in self.problems],
            "served": None
            if c is None
            else {
                "tau": c.tau,
                "drafted": c.drafted,
                "accepted": c.accepted,
                "steps": c.steps,
                "width": c.width,
                "steps_estimated": c.steps_estimated,
                "accept": [a / c.steps for a in c.accepted_per_position] if c.steps else [],
                "per_prompt_accepted": self.per_prompt_accepted,
            },
            "expected": {
                k: self.expected[k]
                for k in ("prompts", "tau", "interval", "accept", "accepted", "steps", "per_prompt_accepted")
            },
            "allowed": list(self.allowed) if self.allowed is not None else None,
            "lossless_reference": self.judged_by,
            "reference_url": self.reference_url,
            "outputs_equal": len(self.served) - len(self.mismatched),
            "mismatched": [{"prompt": i, "where": w} for i, w in self.mismatched],
            "record_outputs_equal": None if self.reference is None else len(self.served) - len(self.record_mismatched),
            "record_mismatched": [{"prompt": i, "where": w} for i, w in self.record_mismatched],
            "notes": self.notes,
        }


def _strip_stop(ids: Sequence[int], stop: Sequence[int]) -> list[int]:
    ids = list(ids)
    return ids[:-1] if ids and ids[-1] in stop else ids


def _first_difference(got: Sequence[Any], want: Sequence[Any], unit: str) -> str | None:
    """Where ``got`` first differs from ``want`` (``"token 5 of 32"``), None when equal."""
    if list(got) == list(want):
        return None
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"{unit} {i} of {len(want)}" + (
        " (the engine stopped early)" if i == len(got) else " (the engine went on)" if i == len(want) else ""
    )


def compare_output(served: Served, prompt: dict[str, Any], stop: Sequence[int]) -> str | None:
    """Where ``served`` first differs from the record's greedy continuation (None: equal).

    Token ids when the engine returned them (a final stop token ignored on both sides), else the text.
    """
    if served.token_ids is not None:
        return _first_difference(
            _strip_stop(served.token_ids, stop), _strip_stop(prompt["continuation_ids"], stop), "token"
        )
    return _first_difference(served.text, prompt["continuation_text"], "character")


def compare_with_reference(served: Served, reference: Served, stop: Sequence[int]) -> str | None:
    """Where ``served`` (with the draft) first differs from ``reference`` (the same engine without it; None:
    equal): token ids when both carry them (a final stop token ignored), else the text."""
    if served.token_ids is not None and reference.token_ids is not None:
        return _first_difference(_strip_stop(served.token_ids, stop), _strip_stop(reference.token_ids, stop), "token")
    return _first_difference(served.text, reference.text, "character")


def check_serving(
    url: str,
    record: dict[str, Any],
    engine: str | None = None,
    max_prompts: int | None = None,
    timeout: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
    reference_url: str | None = None,
) -> Verdict:
    """Send the record's prompts to the engine at ``url`` and compare (see the module docstring).

    Args:
        url: the engine's address (``http://host:port``, or its OpenAI base ``.../v1``).
        record: an acceptance record (:func:`~dflash2_lightning.engines.acceptance_record.read_record`).
        engine: ``"llama.cpp"``, ``"vLLM"`` or ``"SGLang"`` (None: detected).
        max_prompts: use the record's first ``max_prompts`` prompts (None: all); the expected τ and
            interval are recomputed for them.
        timeout: seconds one request may take.
        progress: called with ``(done, total)`` after every request.
        reference_url: the same engine serving the same target without the draft; losslessness is then
            judged against its outputs (the record's continuation stays as information). None: against the
            record's greedy continuation.

    Raises :class:`~dflash2_lightning.engines.counters.EngineError` when the check cannot run.
    """
    count = len(record["prompts"]) if max_prompts is None else min(max_prompts, len(record["prompts"]))
    if count < 1:
        raise EngineError(f"max_prompts={max_prompts} is invalid: must be >= 1")
    prompts = record["prompts"][:count]
    client = EngineClient(url, engine, timeout)
    stop = list(record["stop_token_ids"])
    exp = expected(record, count)
    width = int(record["draft"]["block_size"]) - 1
    served: list[Served] = []
    per_request_metrics = client.engine == LLAMA_CPP  # llama.cpp: exact steps per request from /metrics
    before_all = client.settled_metrics() if client.engine == VLLM else None
    for i, p in enumerate(prompts):
        before = client.metrics() if per_request_metrics else None
        s = client.complete(p["prompt_ids"], int(record["max_new_tokens"]))
        if before is not None and s.counts is not None:
            after = client.metrics()
            if metrics_exact(after):
                delta = after - before  # type: ignore[operator]
                s.counts = Counts(
                    s.counts.drafted, s.counts.accepted, delta.steps, delta.width, delta.accepted_per_position
                )
        served.append(s)
        if progress is not None:
            progress(i + 1, count)
    verdict = Verdict(client.engine, client.root, record, exp, served, None)
    if reference_url is not None:
        verdict.reference_url, verdict.reference = reference_outputs(
            client, reference_url, engine, prompts, int(record["max_new_tokens"]), timeout
        )
    if all(s.counts is not None for s in served):
        verdict.counts = total(s.counts for s in served)  # type: ignore[misc]
    elif client.engine == VLLM and before_all is not None:
        after_all = client.settled_metrics()
        verdict.counts = after_all - before_all if after_all is not None else None
        verdict.notes.append(
            "vLLM counts from its Prometheus /metrics before and after all requests (other "
            "traffic counts too; --per-request-spec-decode-metrics summary gives per-request counts)"
        )
    elif client.engine == VLLM:
        raise EngineError(
            f"vLLM at {client.root} reports no speculative-decoding counters (no "
            "metrics.speculative_decoding in its responses, no vllm:spec_decode_* in /metrics): it runs "
            "without a speculative config, or with --disable-log-stats; start it with "
            "--per-request-spec-decode-metrics summary to check"
        )
    else:
        verdict.counts = total(s.counts for s in served if s.counts is not None)
    if verdict.counts is not None and verdict.counts.steps_estimated:
        verdict.notes.append(
            "verify steps estimated from the responses' timings: start llama-server with --metrics for exact counts"
        )
    _judge(verdict, stop, width)
    return verdict


def reference_outputs(
    client: EngineClient,
    url: str,
    engine: str | None,
    prompts: Sequence[dict[str, Any]],
    max_tokens: int,
    timeout: float,
) -> tuple[str, list[Served]]:
    """The outputs of the engine-alone reference at ``url`` (the same engine and model as ``client``, no draft)
    for ``prompts``, sent as ``client``'s are; returns ``(its root URL, outputs)``.

    Raises :class:`EngineError` when it is another engine, serves another model or drafts: then it is no
    reference for the outputs with the draft."""
    ref = EngineClient(url, engine, timeout)
    if ref.engine != client.engine:
        raise EngineError(
            f"the reference at {ref.root} is {ref.engine}, the engine at {client.root} {client.engine}: losslessness "
            "compares the same engine with and without the draft; start the reference with the same engine"
        )
    if ref.model != client.model:
        raise EngineError(
            f"the reference at {ref.root} serves {ref.model!r}, the engine at {client.root} {client.model!r}: start "
            "the reference with the same target and no draft"
        )
    outputs = [ref.complete(p["prompt_ids"], max_tokens) for p in prompts]
    drafted = sum(s.counts.drafted for s in outputs if s.counts is not None)
    if drafted > 0:
        raise EngineError(
            f"the reference at {ref.root} drafted {int(drafted)} tokens: it must serve the target alone (start it "
            "without the draft: llama-server without -md, vLLM without --speculative-config, SGLang without "
            "--speculative-algorithm)"
        )
    return ref.root, outputs


def _judge(v: Verdict, stop: Sequence[int], width: int) -> None:
    """Fill ``v.mismatched`` (``v.record_mismatched`` beside a reference) and ``v.problems``."""
    against_record = [(i, compare_output(s, p, stop)) for i, (s, p) in enumerate(zip(v.served, v.record["prompts"]))]
    if v.reference is None:
        v.mismatched = [(i, w) for i, w in against_record if w is not None]
    else:
        v.record_mismatched = [(i, w) for i, w in against_record if w is not None]
        v.mismatched = [
            (i, w)
            for i, w in ((i, compare_with_reference(s, r, stop)) for i, (s, r) in enumerate(zip(v.served, v.reference)))
            if w is not None
        ]
    c = v.counts
    if c is None or c.drafted <= 0:
        v.problems.append(
            Problem(
                "no_drafts",
                f"{v.engine} drafted no token on {len(v.served)} prompts: it does not speculate with this draft",
            )
        )
        return
    first = ", ".join(f"prompt {i} from {w}" for i, w in v.mismatched[:3]) + (", ..." if len(v.mismatched) > 3 else "")
    if v.mismatched and v.reference is not None:
        v.problems.append(
            Problem(
                "lossless",
                f"served outputs with the draft differ from the same engine's outputs without it on "
                f"{len(v.mismatched)} of {len(v.served)} prompts ({first}): speculative decoding in this "
                "deployment is not lossless",
            )
        )
    elif v.mismatched:
        v.problems.append(
            Problem(
                "outputs",
                f"served outputs differ from the target's greedy continuation on "
                f"{len(v.mismatched)} of {len(v.served)} prompts ({first}): the engine serves another target, "
                "tokenizer or sampling than the record's",
            )
        )
    per_step = c.drafted_per_step
    if c.width is not None and c.width != width:
        v.problems.append(
            Problem(
                "width",
                f"{v.engine} drafts {c.width} token{'s' if c.width != 1 else ''} per "
                f"verify step; this draft's block drafts {width} (block_size {width + 1} - 1)",
            )
        )
    elif c.width is None and per_step is not None and per_step < _ESTIMATED_WIDTH_SHARE * width:
        v.problems.append(
            Problem(
                "width",
                f"{v.engine} drafts {per_step:.2f} tokens per verify step on average; "
                f"this draft's block drafts {width} (block_size {width + 1} - 1)",
            )
        )
    allowed, tau = v.allowed, c.tau
    if allowed is not None and tau is not None and not allowed[0] - 1e-9 <= tau <= allowed[1] + 1e-9:
        lo, hi = v.interval
        v.problems.append(
            Problem(
                "tau",
                f"served tau {tau:.3f} is {'below' if tau < allowed[0] else 'above'} the "
                f"expected {v.expected['tau']:.3f} [{lo:.3f}, {hi:.3f}]",
            )
        )


# ----------------------------------------------------------------------------- causes
def likely_causes(engine: str, code: str, block_size: int, dtype: str | None, width: int | None) -> list[str]:
    """The likely causes of a failed check ``code`` in ``engine``, most likely first."""
    n, served = block_size - 1, dtype or "the target's dtype"
    common_outputs = [
        "another target than the draft was recorded against: another model, revision or fine-tune",
        "not greedy: the check sends temperature 0 and top_k 1; a server-side sampling default or override "
        "(generation config, sampler chain) changes the picks",
    ]
    lossless = [
        "the reference runs with other settings than the engine (another quantisation, KV-cache type, context "
        "or batch size): start both with the same flags, the draft's aside",
        "the engine's verify step computes the target's logits otherwise than its one-token decode (batched "
        "kernels) and near-tie picks flip: report it to the engine with the first differing prompt",
    ]
    table: dict[str, dict[str, list[str]]] = {
        LLAMA_CPP: {
            "lossless": lossless,
            "no_drafts": [
                "llama-server runs without the draft: start it with `-md draft.gguf --spec-type draft-dflash`"
            ],
            "outputs": [
                "the target GGUF is quantised (Q4/Q8 kernels change greedy picks) or converted from other "
                "weights: serve the target converted from the very weights the draft was trained against "
                "(`convert_hf_to_gguf.py TARGET --outtype f32`)",
                *common_outputs,
            ],
            "width": [
                f"`--spec-draft-n-max` is {width if width is not None else 'smaller'}; the block needs {n} "
                "(llama.cpp's default is 3)"
            ],
            "tau": [
                "the GGUF is not this draft's (another draft, or an earlier checkpoint of it): export it again "
                "from this directory with `dflash2 export-gguf`",
                "the draft GGUF is quantised (`--outtype q8_0`) or the target is: export f32 (or bf16)",
                "`--spec-draft-p-min` above 0 stops each step's drafts early",
                "`--spec-type` is not `draft-dflash`",
            ],
        },
        VLLM: {
            "lossless": lossless,
            "no_drafts": ['vLLM runs without `--speculative-config` (or with another method than "dflash")'],
            "outputs": [
                f"the target runs in another dtype than the record's ({served}) or quantised "
                "(`--quantization`): greedy picks flip at near ties; compare where the outputs first "
                "differ",
                *common_outputs,
            ],
            "width": [
                f"`num_speculative_tokens` is {width if width is not None else f'not {n}'}: it must be {n} "
                "= block_size - 1 (vLLM never reads block_size and sizes the block and the convolution from "
                "it)"
            ],
            "tau": [
                '`"method": "dflash"` is missing (guessed only from a path containing "dflash") or '
                '`"model"` points to another draft',
                f"the draft runs in the target's dtype ({served}), not the dtype it was recorded in: near-tie "
                "picks differ; export the draft in the target's dtype",
                "DFlash2 tensors missing from the checkpoint load as uninitialised memory (vLLM does not "
                "check): run `dflash2 check --draft DIR`",
                "Model Runner V1 (`VLLM_USE_V2_MODEL_RUNNER=0`) or a CUDA-graph mode: retry with "
                "`--enforce-eager` to rule it out",
            ],
        },
        SGLANG: {
            "lossless": lossless,
            "no_drafts": ["SGLang runs without `--speculative-algorithm DFLASH --speculative-draft-model-path DRAFT`"],
            "outputs": [
                f"the target runs in another dtype than the record's ({served}) or quantised: greedy "
                "picks flip at near ties; compare where the outputs first differ",
                *common_outputs,
            ],
            "width": [
                f"`--speculative-num-draft-tokens` is {width + 1 if width is not None else f'not {block_size}'}: "
                f"the block needs {block_size} (SGLang counts the anchor; omit the flag to read it from the "
                "checkpoint)"
            ],
            "tau": [
                f"`--dtype auto` serves a float32 draft as float16 and feeds it bf16 hidden states: pass "
                f"`--dtype {served}`",
                "unknown tensor names are skipped silently (a renamed or missing DFlash2 tensor): run "
                "`dflash2 check --draft DIR`",
                "`--speculative-draft-model-path` points to another draft",
                "a CUDA-graph mode: retry with `--disable-cuda-graph` to rule it out",
            ],
        },
    }
    return table.get(engine, {}).get(code, [])


def verdict_lines(v: Verdict, commands: dict[str, list[str]] | None = None) -> list[str]:
    """The human-readable verdict: served vs expected, then (on disagreement) one block of likely causes."""
    rec, exp, c = v.record, v.expected, v.counts
    bs = int(rec["draft"]["block_size"])
    lines = [
        f"check-serving: {v.engine} at {v.url}; {exp['prompts']} prompts of the acceptance record "
        f"({rec['draft'].get('architecture', 'draft')}, block_size {bs}, {rec['path']} path, T=0, "
        f"up to {rec['max_new_tokens']} tokens)"
    ]
    unit = " (token ids)" if all(s.token_ids is not None for s in v.served) else " (text)"
    if v.reference is None:
        lines.append(
            f"  outputs: {len(v.served) - len(v.mismatched)}/{len(v.served)} equal to the target's greedy "
            f"continuation{unit}; losslessness judged by the record's continuation (--reference-url: by the "
            "engine without the draft)"
        )
    else:
        unit = " (token ids)" if unit == " (token ids)" and all(r.token_ids is not None for r in v.reference) else unit
        lines.append(
            f"  outputs: {len(v.served) - len(v.mismatched)}/{len(v.served)} equal to the same engine's outputs "
            f"without the draft ({v.reference_url}){unit}; losslessness judged by the engine without the draft"
        )
        where = "".join(f"; prompt {i} from {w}" for i, w in v.record_mismatched[:3])
        lines.append(
            f"  record: {len(v.served) - len(v.record_mismatched)}/{len(v.served)} equal to the record's greedy "
            f"continuation{where} (the project's forward pass; information only: an engine's quantised kernels "
            "pick otherwise at near ties, while another target than the record's differs on most prompts from "
            "the first tokens)"
        )
    if c is not None and c.steps > 0:
        width = f"{c.width}" if c.width is not None else "not reported"
        lines.append(
            f"  drafting: {c.drafted_per_step:.2f} drafted tokens per verify step (configured: {width}; "
            f"the block drafts {bs - 1}), {int(c.steps)} verify steps" + (" (estimated)" if c.steps_estimated else "")
        )
    lo, hi = exp["interval"]
    iv = f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
    if v.served_tau is not None:
        where = (
            "" if v.allowed is None else (" (within)" if not any(p.code == "tau" for p in v.problems) else " (outside)")
        )
        lines.append(
            f"  tau: served {v.served_tau:.2f} vs expected {exp['tau']:.2f}{iv} (95% interval over prompts){where}"
        )
    ours = v.per_prompt_accepted
    if ours is not None:
        same = sum(a == b for a, b in zip(ours, exp["per_prompt_accepted"]))
        diff = max((abs(a - b) for a, b in zip(ours, exp["per_prompt_accepted"])), default=0)
        lines.append(
            f"  accepted drafts per prompt: served {ours} vs expected {exp['per_prompt_accepted']} "
            f"(equal on {same}/{len(ours)}, max difference {diff})"
        )
    lines += [f"  note: {n}" for n in v.notes]
    if not v.problems:
        lines.append(
            "verdict: AGREE (the engine serves the target's outputs and the acceptance this draft earns)"
            if v.reference is None
            else "verdict: AGREE (the engine's outputs with the draft equal its own without it, and it serves the "
            "acceptance this draft earns)"
        )
        return lines
    lines.append(f"verdict: DISAGREE — {v.problems[0].message}")
    lines += [f"  also: {p.message}" for p in v.problems[1:]]
    first = v.problems[0]
    causes = likely_causes(
        v.engine, first.code, bs, (rec.get("target") or {}).get("serving_dtype"), c.width if c is not None else None
    )
    if causes:
        lines.append(f"likely causes ({v.engine}):")
        lines += [f"  - {cause}" for cause in causes]
    if commands and commands.get(v.engine):
        lines.append("  SERVING.md recommends:")
        lines += [f"    {line}" for line in commands[v.engine]]
    return lines


def recommended_commands(record: dict[str, Any], draft_dir: str | os.PathLike | None) -> dict[str, list[str]]:
    """SERVING.md's command lines for the record's draft and target (numbers from the record)."""
    from dflash2_lightning.engines.rules import TargetInfo, serving_commands

    t = record.get("target") or {}
    target = TargetInfo(path=t.get("path"), gguf=t.get("gguf"), loaded_dtype=t.get("serving_dtype"))
    draft = draft_dir or record["draft"].get("dir") or "DRAFT"
    from dflash2_lightning.engines import rules

    commands = serving_commands(
        int(record["draft"]["block_size"]), record["draft"].get("torch_dtype") or "float32", draft, target
    )
    return {VLLM: commands[rules.VLLM], SGLANG: commands[rules.SGLANG], LLAMA_CPP: commands[rules.LLAMA_CPP]}


def _stale_record_note(record: dict[str, Any], draft: str | None, record_file: str | None, allow: bool) -> str | None:
    """Refuse a record of other weights than the draft directory's (the ``--draft`` given, or the directory of a
    ``--record`` that is not a GGUF's copy), before any request is sent; with ``allow``, warn and return the note."""
    from dflash2_lightning.engines.acceptance_record import check_record_weights, stale_weights

    directory = draft if draft is not None else (None if record.get("gguf") else Path(record_file or ".").parent)
    if directory is None:
        return None
    if not allow:
        check_record_weights(record, directory)
        return None
    why = stale_weights(record, directory)
    if why is not None:
        print(
            f"dflash2: warning: {why} (--allow-stale-record: checking against it anyway)", file=sys.stderr, flush=True
        )
    return why


@dataclass(kw_only=True)
class CheckServingOptions(ServerOptions):
    """``dflash2 check-serving``'s options: the engine's address (required here) and the acceptance record, by the
    draft directory that holds it or by its file."""

    server: str = option(REQUIRED, "the engine's address, e.g. http://127.0.0.1:8080 (or .../v1)", metavar="URL")
    draft: str | None = option(None, "the draft checkpoint directory holding acceptance.json (or give --record)")
    record: str | None = option(
        None, "an acceptance record file (e.g. draft.acceptance.json beside a GGUF) (or give --draft)"
    )
    engine: str | None = option(
        None,
        "the engine (default: detected from /metrics, /props, /server_info, /version)",
        choices=sorted(ENGINE_CHOICES),
    )
    max_prompts: int | None = option(
        None,
        "check only the record's first N prompts (default: all; the interval is theirs)",
        parse=bounded(int, 1),
    )
    allow_stale_record: bool = option(
        False,
        "check against a record made for other weights than the draft's model.safetensors "
        "(a warning instead of the refusal; the verdict then says little about these weights)",
    )
    reference_url: str | None = option(
        None,
        "the same engine serving the same target without the draft (e.g. a second llama-server without -md): "
        "losslessness is then judged against its outputs, and the record's continuation is reported as "
        "information (default: judged against the record's continuation; llama-server 11434 has no per-request "
        "switch that turns drafting off)",
        metavar="URL",
    )
    json: str | None = option(None, "also write the verdict as JSON to FILE", metavar="FILE")

    def __post_init__(self) -> None:
        # both name the acceptance record: exactly one of them
        if self.draft is None and self.record is None:
            raise UsageError(
                "one of the arguments --draft --record is required: give the draft directory holding "
                "acceptance.json, or the record file"
            )
        if self.draft is not None and self.record is not None:
            raise UsageError("argument --record: not allowed with argument --draft; give one of them")


DESCRIPTION = (
    "Check a running engine (llama-server, vLLM or SGLang) against the acceptance this draft earns. "
    "Needs the draft's acceptance record (DRAFT/acceptance.json, written by `dflash2 eval "
    "--replay-prompts N`, the quickstart or `dflash2 acceptance-record`; or the "
    "<name>.acceptance.json beside a GGUF) and the engine's address. Sends the record's prompts as "
    "token ids at T=0 to its /v1/completions, one at a time, reads the engine's own counters "
    "(llama-server: response timings and, with --metrics, /metrics; vLLM: "
    "--per-request-spec-decode-metrics summary, else its Prometheus /metrics; SGLang: per-request "
    "spec_tokens_details) and checks that it drafts at all, that every served output equals the "
    "target's greedy continuation (with --reference-url: the same engine's output without the draft), that it "
    "drafts block_size - 1 tokens per step, and that the "
    "served tau lies within the expected 95% interval. On a disagreement it names the failed "
    "check, the likely causes for that engine and SERVING.md's command. Exit 0: agree, 1: "
    "disagree, 2: could not check."
)


def check_serving_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 check-serving --server URL --draft DIR``: exit 0 agree, 1 disagree, 2 could not check."""
    opts = parse_options(CheckServingOptions, argv, prog="dflash2 check-serving", description=DESCRIPTION)
    source = opts.draft if opts.draft is not None else opts.record
    if source is None:  # CheckServingOptions requires one of them
        raise UsageError("one of the arguments --draft --record is required")
    record = read_record(source)
    stale = _stale_record_note(record, opts.draft, opts.record, opts.allow_stale_record)
    verdict = check_serving(
        opts.server,
        record,
        ENGINE_CHOICES[opts.engine] if opts.engine else None,
        opts.max_prompts,
        opts.timeout,
        reference_url=opts.reference_url,
    )
    if stale is not None:
        verdict.notes.append(stale)
    print("\n".join(verdict_lines(verdict, recommended_commands(record, opts.draft))))
    if opts.json:
        from dflash2_lightning.files import atomic_write_text

        atomic_write_text(Path(opts.json), json.dumps(verdict.to_json(), indent=2) + "\n")
    return verdict.status
