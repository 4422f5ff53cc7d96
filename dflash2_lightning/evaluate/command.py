"""``dflash2 eval``: load a draft checkpoint and its target, measure τ, write ``eval.json`` and the plot.

Measures with real speculative decoding (:mod:`dflash2_lightning.evaluate.loop`), optionally the T=0
replay on more prompts (:mod:`dflash2_lightning.evaluate.replay`) and llama.cpp
(:mod:`dflash2_lightning.evaluate.llama_cpp`); reports with :mod:`dflash2_lightning.evaluate.report`. The
replay is also written as the draft's acceptance record (:mod:`dflash2_lightning.evaluate.record`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.data.prompts.standard import PROMPT_SETS
from dflash2_lightning.errors import bounded
from dflash2_lightning.evaluate.llama_cpp import EngineOptions
from dflash2_lightning.evaluate.loop import check_block_sizes, evaluate_block_sizes, evaluate_draft
from dflash2_lightning.evaluate.options import DraftOptions, LoopOptions
from dflash2_lightning.evaluate.replay import replay_block_sizes, replay_report, run_replay
from dflash2_lightning.evaluate.report import plot_eval, summary_lines
from dflash2_lightning.evaluate.teacher_forced import ORACLE_TOP_K
from dflash2_lightning.target.arguments import TargetOptions


def run_eval(
    draft_dir: str | os.PathLike[str],
    target_spec: Any,
    out_dir: str | os.PathLike[str],
    loop: LoopOptions | None = None,
    *,
    estimate: bool = True,
    oracle_top_k: int | None = None,
    acceptance_record: bool = True,
    served_block_sizes: Sequence[int] | None = None,
    llama_cpp: dict[str, Any] | None = None,
    own_load: float = 0.0,
) -> dict[str, Any]:
    """``dflash2 eval``: load the draft checkpoint and the target, evaluate, write the report and the plot.

    Args:
        draft_dir: a draft checkpoint directory (``config.json`` + ``model.safetensors``).
        target_spec: a :class:`~dflash2_lightning.target.target.TargetSpec`, its dict, or a loaded ``Target``.
        out_dir: where ``eval.json`` and ``acceptance.png`` are written (atomically).
        loop: what is measured and how (:class:`~dflash2_lightning.evaluate.options.LoopOptions`, ``dflash2 eval``'s
            flags of the same names; default: their defaults), handed down whole to the loop
            (:func:`~dflash2_lightning.evaluate.loop.evaluate_draft`):

            - the prompts: ``prompts``, a chat jsonl of held-out prompts (``None``: the shipped evaluation prompts)
              or the name of a standard set (:data:`~dflash2_lightning.data.prompts.standard.PROMPT_SETS`; an
              existing path wins): its turns are measured (:mod:`~dflash2_lightning.evaluate.prompt_turns`), and the
              report gains ``prompt_set`` and, per temperature and in the replay, ``categories``; ``max_prompts``:
              use only the first ones; ``max_new_tokens``: the generation budget per prompt; ``prompt_overflow``: a
              prompt that does not fit the target's context with ``max_new_tokens`` is refused (``"refuse"``,
              before anything is decoded) or cut to its last tokens (``"truncate"``; the report's ``prompts_cut``
              counts them; :func:`~dflash2_lightning.data.prompts.fit_to_context`);
            - the sampling: ``temperatures`` (0 = greedy), ``top_p``, ``top_k``; ``samples`` generations per prompt
              at temperature > 0; ``seed`` seeds every sampled generation and the bootstrap;
            - the measuring: the decoding ``paths``; ``resamples``: bootstrap draws for the intervals;
              ``progress`` bars; ``replay_prompts``: also replay the loop at T=0 on the first ``replay_prompts``
              prompts (:func:`~dflash2_lightning.evaluate.replay.replay_eval`: τ with a narrow interval at a
              fraction of the loop's cost), up to ``replay_max_new_tokens`` tokens each (default
              ``max_new_tokens``); the report gains ``replay``; ``draft_vocab``: the loop drafts through a
              :class:`~dflash2_lightning.decode.draft_vocab.DraftVocabHead`: ``"auto"`` with
              ``draft_dir/draft_vocab.json`` when it exists, a path for that file, ``"off"`` never; the report's
              ``draft_vocab`` names the file and its size. (``threads`` is the command line's: set before the call.)
        estimate: also compute the trainer's teacher-forced estimate on the target's continuations.
        oracle_top_k: candidates of the T=0 top-k oracle (see :func:`~dflash2_lightning.evaluate.loop.evaluate_draft`).
        acceptance_record: with a replay, also write the draft's acceptance record from it into
            ``draft_dir/acceptance.json`` (:mod:`~dflash2_lightning.engines.acceptance_record`; what
            ``dflash2 check-serving`` compares an engine with); the report's ``acceptance_record`` names it.
        served_block_sizes: also measure the draft served at these block sizes (each from 2 up to the trained
            ``block_size``; checked once the draft's config is read, before the target is loaded): τ and tokens/s
            per size, path and temperature in the loop
            (:func:`~dflash2_lightning.evaluate.loop.evaluate_block_sizes`) and, with a replay, τ per size in the
            replay (:func:`~dflash2_lightning.evaluate.replay.replay_block_sizes`); the report gains
            ``served_block_sizes`` with the ``fastest`` size and each engine's flag that serves it.
        llama_cpp: also measure in llama.cpp (keyword arguments of
            :func:`~dflash2_lightning.evaluate.llama_cpp.evaluate_llama_cpp`, e.g. ``{"target_gguf": "f32"}``);
            the report gains a ``"llama.cpp"`` section.
        own_load: how much of the load average at the start is this process's own earlier work (the
            quickstart's training step; :func:`~dflash2_lightning.threads.own_load`), not other processes'.

    Returns the report dict (also written to ``out_dir/eval.json``). Its ``machine`` entry records the
    torch threads, the cores and the load average before and after; when other processes' load and
    these threads exceed the cores, a note says the timings cannot be trusted
    (:func:`~dflash2_lightning.threads.timing_warning`).
    """
    from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, fit_to_context, read_prompts
    from dflash2_lightning.data.prompts.standard import load_prompt_set, named_set
    from dflash2_lightning.data.records import DataError
    from dflash2_lightning.decode.draft_vocab import draft_vocab_head, find_draft_vocab
    from dflash2_lightning.errors import ConfigError, check
    from dflash2_lightning.evaluate.prompt_turns import turn_chats, turns_of
    from dflash2_lightning.files import atomic_write_text, check_writable
    from dflash2_lightning.model.checkpoint import load_draft
    from dflash2_lightning.target.load import load_target
    from dflash2_lightning.threads import load_average, timing_warning

    loop = loop if loop is not None else LoopOptions()
    # Every setting that can be checked alone is checked before the draft, the target or a prompt is loaded.
    loop.validate()
    check(oracle_top_k is None or oracle_top_k >= 1, "oracle_top_k", oracle_top_k, "None or >= 1")
    check_writable(out_dir, directory=True)
    max_new_tokens, replay_prompts, replay_tokens = loop.max_new_tokens, loop.replay_prompts, loop.replay_max_tokens
    prompts_file: str | os.PathLike[str] = loop.prompts or EVAL_PROMPTS
    # Before the draft and the target: a bad file, or a named set whose package is missing, fails at once.
    prompt_set = named_set(prompts_file)
    if prompt_set is not None:
        turns = turns_of(load_prompt_set(prompt_set.name))
        available = len(turns)
    else:
        if not Path(prompts_file).exists():
            raise DataError(
                f"--prompts {prompts_file}: the file does not exist, and no prompt set has that name: give a chat jsonl "
                f"file "
                f"or a set's name ({', '.join(PROMPT_SETS)})"
            )
        all_chats = read_prompts(prompts_file)
        available = len(all_chats)
    if replay_prompts > available:
        raise ConfigError(f"replay_prompts={replay_prompts} is invalid: {prompts_file} holds only {available} prompts")
    draft = load_draft(draft_dir)  # before the target: a bad checkpoint path fails in a second
    if served_block_sizes is not None:
        check_block_sizes(served_block_sizes, draft.config)
    target = target_spec if hasattr(target_spec, "hf") else load_target(target_spec)
    measured = min(available, loop.max_prompts or available)
    categories: list[str] | None = None
    if prompt_set is not None:  # the turns measured or replayed, later turns after the target's own answers
        turns = turns[: max(measured, replay_prompts)]
        all_chats = turn_chats(turns, target, max_new_tokens, loop.prompt_overflow, prompt_set.name)
        categories = [t.record.category for t in turns]
    chats = all_chats[:measured]
    context = getattr(target, "context_length", None)
    fitted = fit_to_context(
        [encode_prompt(target.tokenizer, m) for m in chats], context, max_new_tokens, loop.prompt_overflow, prompts_file
    )
    prompts = fitted.prompts
    vocab_file = (
        find_draft_vocab(draft_dir)
        if loop.draft_vocab == "auto"
        else None
        if loop.draft_vocab == "off"
        else Path(loop.draft_vocab)
    )
    draft_head = draft_vocab_head(target, vocab_file) if vocab_file is not None else None
    load_start = load_average()
    report = evaluate_draft(
        draft,
        target,
        prompts,
        max_new_tokens,
        sampling=loop,  # a LoopOptions is both groups: the one settings object, handed down
        measure=loop,
        estimate=estimate,
        oracle_top_k=oracle_top_k,
        draft_head=draft_head,
        categories=categories[:measured] if categories is not None else None,
    )
    report["draft_vocab"] = (
        {"file": str(vocab_file), "size": draft_head.size, "vocab_size": draft_head.vocab_size}
        if draft_head is not None
        else None
    )
    cores = os.cpu_count() or 1
    report["machine"].update(cpus=cores, load_average_start=load_start, load_average_end=load_average())
    warning = timing_warning(
        torch.get_num_threads(), cores, load_start, report["machine"]["load_average_end"], own_start=own_load
    )
    report["machine"]["timing_trusted"] = warning is None
    if warning is not None:
        report.setdefault("notes", []).append(warning)
    report["prompts_cut"] = fitted.cut
    if fitted.cut:
        report.setdefault("notes", []).append(fitted.note())
    if replay_prompts:
        replayed = fit_to_context(
            [encode_prompt(target.tokenizer, m) for m in all_chats[:replay_prompts]],
            context,
            replay_tokens,
            loop.prompt_overflow,
            prompts_file,
        )
        run = run_replay(
            draft, target, replayed.prompts, replay_tokens, oracle_top_k=oracle_top_k, progress=loop.progress
        )
        report["replay"] = replay_report(
            run,
            draft.config.block_size,
            loop.resamples,
            loop.seed,
            categories[:replay_prompts] if categories is not None else None,
        )
        if acceptance_record:
            report["acceptance_record"] = _write_record(
                run, draft_dir, target, prompts_file, loop.resamples, loop.seed, report
            )
    if served_block_sizes is not None:
        sweep = evaluate_block_sizes(
            draft,
            target,
            prompts,
            max_new_tokens,
            served_block_sizes,
            sampling=loop,
            measure=loop,
            draft_head=draft_head,
        )
        if replay_prompts:
            sweep["replay"] = replay_block_sizes(
                draft, target, run, served_block_sizes, loop.resamples, loop.seed, loop.progress
            )
        report["served_block_sizes"] = sweep
    report = {"draft": str(draft_dir), "target": _describe(target), "prompts_file": str(prompts_file), **report}
    if prompt_set is not None:
        report["prompt_set"] = {
            **prompt_set.describe(),
            "questions": prompt_set.records,
            "turns": available,
            "measured_per_category": dict(Counter(categories[:measured])) if categories is not None else {},
            # one per turn measured or replayed, in order (the loop's are the first `prompts`, the replay's the
            # first `replay.prompts`): what a per-category comparison of two reports slices by
            "categories": categories,
        }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if llama_cpp is not None:
        from dflash2_lightning.evaluate.llama_cpp import attach_llama_cpp

        attach_llama_cpp(report, draft_dir, target, prompts, max_new_tokens, out / "llama.cpp", **llama_cpp)
    atomic_write_text(out / "eval.json", json.dumps(report, indent=2) + "\n")
    plot_eval(report, out / "acceptance.png")
    return report


def _write_record(
    run: Any,
    draft_dir: str | os.PathLike,
    target: Any,
    prompts_file: str | os.PathLike,
    resamples: int,
    seed: int,
    report: dict[str, Any],
) -> str | None:
    """Write the acceptance record of the replay ``run`` into the draft directory; its path, or None (with a
    note in the report) when the directory is not writable."""
    from dflash2_lightning.data.prompts import EVAL_PROMPTS
    from dflash2_lightning.engines.acceptance_record import RECORD_NAME, write_record
    from dflash2_lightning.evaluate.record import record_from_replay

    source = (
        "the shipped evaluation prompts" if Path(prompts_file) == EVAL_PROMPTS else str(prompts_file)
    ) + f", first {len(run.prompts)}"
    record = record_from_replay(run, draft_dir, target, source, resamples, seed)
    try:
        return str(write_record(record, Path(draft_dir) / RECORD_NAME))
    except OSError as error:
        report.setdefault("notes", []).append(f"acceptance record not written into {draft_dir}: {error}")
        return None


def _describe(target: Any) -> Any:
    spec = getattr(target, "spec", None)
    return json.loads(spec.key()) if spec is not None else type(target).__name__


@dataclass(kw_only=True)
class EvalOptions(DraftOptions, TargetOptions, LoopOptions, EngineOptions):
    """``dflash2 eval``'s options: the shared measuring groups (:mod:`dflash2_lightning.evaluate.options`), the
    target, llama.cpp's, and these."""

    out: str = option(REQUIRED, "output directory for eval.json and acceptance.png")
    estimate: bool = option(
        True, "skip the trainer's teacher-forced estimate (and the top-k oracle)", flag="--no-estimate"
    )
    acceptance_record: bool = option(
        True,
        "do not write the replay as the draft's acceptance record (default: with --replay-prompts, "
        "DRAFT/acceptance.json is written for `dflash2 check-serving`)",
        flag="--no-acceptance-record",
    )
    oracle_top_k: int | None = option(
        None,
        "candidates per position of the T=0 top-k oracle (default: the selector's top_k; "
        f"{ORACLE_TOP_K} for a DFlash draft)",
        parse=bounded(int, 1),
    )
    served_block_sizes: list[int] = option(
        [],
        "also measure the draft served at these block sizes, e.g. --served-block-sizes 2 3 4 (each from 2, or the "
        "convolution's taps, up to the trained block_size; checked before the target is loaded): tau and tokens/s "
        "per size, path and temperature in the loop, tau per size in the replay, and the fastest size with each "
        "engine's flag that serves it (default: none; docs/measuring-tau.md)",
        parse=bounded(int, 2),
        metavar="B",
    )


EVAL_DESCRIPTION = (
    "Measure a draft checkpoint with real speculative decoding against its target, greedy and sampled "
    "(--temperature): acceptance length (tau) per decoding path and temperature with a 95% bootstrap interval over "
    "prompts, per-position acceptance, histogram of accepted lengths, tokens/s against target-only decoding, and "
    "the trainer's estimated tau on the same continuations. Writes OUT/eval.json and OUT/acceptance.png; with "
    "--replay-prompts also the draft's acceptance record DRAFT/acceptance.json (for dflash2 check-serving)."
)


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 eval``: measure τ with real speculative decoding. Exit status 1 if a greedy path was not lossless."""
    opts = parse_options(EvalOptions, argv, prog="dflash2 eval", description=EVAL_DESCRIPTION)
    opts.set_threads()
    report = run_eval(
        opts.draft,
        opts.target_spec(),
        opts.out,
        opts,
        estimate=opts.estimate,
        oracle_top_k=opts.oracle_top_k,
        acceptance_record=opts.acceptance_record,
        served_block_sizes=opts.served_block_sizes or None,
        llama_cpp=opts.llama_cpp_options(),
    )
    print("\n".join(summary_lines(report)))
    if report.get("acceptance_record"):
        print(f"acceptance record (for dflash2 check-serving): {report['acceptance_record']}")
    print(f"report: {Path(opts.out) / 'eval.json'}  plot: {Path(opts.out) / 'acceptance.png'}")
    lossy = [r for blk in report["temperatures"].values() for r in blk["paths"].values() if r["lossless"] is False]
    return 1 if lossy else 0
