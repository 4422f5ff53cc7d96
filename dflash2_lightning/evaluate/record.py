"""Making the acceptance record: the T=0 replay of a draft on held-out prompts, written as ``acceptance.json``.

The record's file (its fields, reading, writing, the weights' hash check) is
:mod:`dflash2_lightning.engines.acceptance_record`, below the stages that make it, so export (the GGUF's copy)
and ``dflash2 check-serving`` read it; making one is a measurement, the replay of
:mod:`dflash2_lightning.evaluate.replay`. Written by ``dflash2 acceptance-record`` (any draft), ``dflash2 eval
--replay-prompts N`` (from the replay it runs anyway), the end of a fit
(:class:`~dflash2_lightning.export.callback.ExportOnFitEnd`) and the quickstart.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2_lightning.action_options import option, parse_options
from dflash2_lightning.data.prompts import PromptOverflow
from dflash2_lightning.engines.acceptance_record import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PROMPTS,
    RECORD_FORMAT,
    RECORD_NAME,
    continuation_text,
    expected,
    summary_line,
    weights_digest,
    write_record,
)
from dflash2_lightning.errors import bounded
from dflash2_lightning.evaluate.options import DraftOptions, PromptFitOptions
from dflash2_lightning.target.arguments import TargetOptions


def served_path(is_dflash2: bool) -> str:
    """The decoding path every engine serves: ``"selector"`` (DFlash2's walk) or ``"backbone"`` (DFlash)."""
    return "selector" if is_dflash2 else "backbone"


def _target_entry(target: Any) -> dict[str, Any]:
    from dflash2_lightning.engines.rules import TargetInfo

    spec = getattr(target, "spec", None)
    info = TargetInfo.from_target(target) if spec is not None else TargetInfo()
    return {
        "spec": json.loads(spec.key()) if spec is not None else None,
        "path": info.path,
        "gguf": info.gguf,
        "dtype": str(getattr(target, "dtype", "")).removeprefix("torch.") or None,
        "serving_dtype": info.serving_dtype,
        "vocab_size": getattr(target, "vocab_size", None),
    }


def record_from_replay(
    run: Any, draft_dir: str | os.PathLike, target: Any, source: str, resamples: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """The record of a finished :class:`~dflash2_lightning.evaluate.replay.ReplayRun` of the draft in ``draft_dir``.

    ``source`` says where the prompts came from (a file, and which of its prompts); ``resamples`` and
    ``seed`` are the bootstrap's (default :data:`~dflash2_lightning.intervals.RESAMPLES`, 0).
    """
    from dflash2_lightning.intervals import LEVEL, RESAMPLES
    from dflash2_lightning.model.checkpoint import load_config

    cfg = load_config(draft_dir)
    path = served_path(cfg.is_dflash2)
    lengths = run.lengths[path]
    stop = list(run.stop_token_ids)
    prompts = [
        {
            "prompt_ids": list(p),
            "continuation_ids": list(o),
            "continuation_text": continuation_text(target.tokenizer, o, stop),
            "stopped": bool(o) and o[-1] in stop,
            "accepted_per_step": list(c),
        }
        for p, o, c in zip(run.prompts, run.outputs, lengths)
    ]
    record: dict[str, Any] = {
        "format": RECORD_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "draft": {
            "dir": str(Path(draft_dir).resolve()),
            "architecture": cfg.architecture,
            "block_size": cfg.block_size,
            "torch_dtype": cfg.torch_dtype,
            "weights_sha256": weights_digest(draft_dir),
        },
        "target": _target_entry(target),
        "path": path,
        "temperature": 0.0,
        "max_new_tokens": run.max_new_tokens,
        "stop_token_ids": stop,
        "prompts_source": source,
        "bootstrap": {"resamples": resamples or RESAMPLES, "seed": seed, "level": LEVEL, "unit": "prompt"},
        "method": "the T=0 speculative loop replayed along the target's greedy continuation (teacher-forced; "
        "equals the loop's accepted counts); tau = 1 + accepted / verify steps, untruncated steps",
        "prompts": prompts,
    }
    record["expected"] = expected(record)
    return record


def make_record(
    draft_dir: str | os.PathLike,
    target: Any,
    prompts_file: str | os.PathLike | None = None,
    num_prompts: int = DEFAULT_PROMPTS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    resamples: int | None = None,
    seed: int = 0,
    progress: bool = False,
    prompt_overflow: PromptOverflow = "refuse",
    budget: str = "--max-new-tokens",
) -> dict[str, Any]:
    """Run the T=0 replay of the draft in ``draft_dir`` on the first ``num_prompts`` prompts of
    ``prompts_file`` (default: the shipped evaluation prompts) and return its record.

    ``target``: a loaded :class:`~dflash2_lightning.target.target.Target` or its spec (loaded here). Before any
    token is generated, the draft must fit the target (:meth:`~dflash2_lightning.target.target.Target.check_fits`)
    and every prompt plus ``max_new_tokens`` its context (:func:`~dflash2_lightning.data.prompts.record_prompts`;
    ``prompt_overflow`` as in
    ``dflash2 eval``), as ``dflash2 eval`` checks them.
    Cost: the target's batched greedy decoding of ``num_prompts x max_new_tokens`` tokens plus one
    teacher-forced pass per prompt.
    """
    from dflash2_lightning.data.prompts import EVAL_PROMPTS, read_prompts, record_prompts
    from dflash2_lightning.errors import check
    from dflash2_lightning.evaluate.replay import run_replay
    from dflash2_lightning.model.checkpoint import load_draft
    from dflash2_lightning.target.load import load_target

    check(num_prompts >= 1, "num_prompts", num_prompts, ">= 1")
    check(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, ">= 1")
    prompts_file = Path(prompts_file) if prompts_file is not None else EVAL_PROMPTS
    read_prompts(prompts_file, num_prompts)  # a bad file fails before the draft and the target are loaded
    draft = load_draft(draft_dir)
    target = target if hasattr(target, "hf") else load_target(target)
    target.check_fits(draft.config, f"the draft in {draft_dir}")
    fitted = record_prompts(target, prompts_file, num_prompts, max_new_tokens, prompt_overflow, budget)
    run = run_replay(draft, target, fitted.prompts, max_new_tokens, progress=progress)
    source = (
        ("the shipped evaluation prompts" if prompts_file == EVAL_PROMPTS else str(prompts_file))
        + f", first {len(fitted.prompts)}"
        + (f" ({fitted.note()})" if fitted.cut else "")
    )
    return record_from_replay(run, draft_dir, target, source, resamples, seed)


@dataclass(kw_only=True)
class RecordOptions(DraftOptions, TargetOptions, PromptFitOptions):
    """``dflash2 acceptance-record``'s options: the draft, the target and the prompts' fit shared with
    ``dflash2 eval`` (:mod:`dflash2_lightning.evaluate.options`), and these."""

    # A file only (eval's --prompts also takes a named set, whose later turns need the target's answers).
    prompts: str | None = option(None, "chat jsonl of held-out prompts (default: the shipped evaluation prompts)")
    num_prompts: int = option(
        DEFAULT_PROMPTS, "how many of them, from the first (default {default})", parse=bounded(int, 1)
    )
    max_new_tokens: int = option(
        DEFAULT_MAX_NEW_TOKENS,
        "greedy continuation length per prompt (default {default}); with the longest prompt it must fit the "
        "target's context",
        parse=bounded(int, 1),
    )
    out: str | None = option(None, "where to write it (default DRAFT/acceptance.json)")
    progress: bool = option(False, "show the replay's progress bar")


RECORD_DESCRIPTION = (
    "Write the draft's acceptance record (DRAFT/acceptance.json): held-out prompts as token ids, the target's greedy "
    "continuation, and the accepted drafted tokens per verify step the draft earns at T=0 (the speculative loop "
    "replayed along that continuation), with the expected tau and its 95% bootstrap interval over prompts. "
    "`dflash2 check-serving` compares a running engine with it; `dflash2 export-gguf` copies it beside the GGUF."
)


def record_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 acceptance-record --draft DIR --target T``: write ``DIR/acceptance.json``."""
    opts = parse_options(RecordOptions, argv, prog="dflash2 acceptance-record", description=RECORD_DESCRIPTION)
    record = make_record(
        opts.draft,
        opts.target_spec(),
        opts.prompts,
        opts.num_prompts,
        opts.max_new_tokens,
        progress=opts.progress,
        prompt_overflow=opts.prompt_overflow,
    )
    path = write_record(record, opts.out or Path(opts.draft) / RECORD_NAME)
    print(summary_line(record, path))
    return 0
