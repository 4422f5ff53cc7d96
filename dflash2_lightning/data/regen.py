"""`dflash2 regen`: the target's own responses to a prompts file, resumable, written atomically.

A drafter learns the distribution it is trained on; training it on the target's own outputs makes that the
distribution it meets when serving. For every prompt (chat jsonl) the target generates (batched, chat template
applied) and ``<out>`` is a chat jsonl the DataModule reads, each response appended as the assistant turn.

Crash safety: work goes to an append-only log ``<out>.partial``. Its first line holds the settings that shape the
responses (a resume with other settings is refused rather than mixing two generations); then one
``{"index", "hash", "messages"}`` line per finished response in finishing order, every :data:`LOG_EVERY` of them
written with one ``write``, flushed and fsynced. On start a torn last line is cut off, finished prompt indices
are skipped (a changed prompt at one is an error) and the rest is generated; at the end the records are sorted
by prompt index, ``<out>`` is written atomically, and only then is the log removed. So a kill loses at most the
responses in flight and the last few finished ones, never duplicates a sample, and ``<out>`` either does not
exist or is complete (an existing ``<out>`` means done; ``--overwrite`` starts again).
What users see: docs/training.md ("Regenerating data").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.data.prompts import PROMPT_OVERFLOW_HELP, PromptOverflow
from dflash2_lightning.data.regen_log import LOG_FORMAT, append_lines, open_log, output_paths, prompt_hash
from dflash2_lightning.engines.server_options import ServerOptions
from dflash2_lightning.errors import UsageError, bounded
from dflash2_lightning.target.arguments import TargetOptions

LOG_EVERY = 16  # finished responses per write to the log: a kill loses at most these and those in flight


def generate_responses(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Any = None,
    seeds: list[int | None] | None = None,
    slots: int = 64,
) -> Iterator[tuple[int, list[int]]]:
    """``(index into prompts, response token ids)`` as each response ends, ``slots`` generated together.

    Greedy unless ``sampling`` (a :class:`~dflash2_lightning.model.sampling.Sampling`) samples; then ``seeds``
    gives each prompt its own generator, and a ``None`` seed keeps that prompt greedy. See
    :func:`dflash2_lightning.target.generate.generate_stream` (continuous batching).
    """
    from dflash2_lightning.model.sampling import Sampling
    from dflash2_lightning.target.generate import generate_stream

    eos = list(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    return generate_stream(
        target.hf,
        prompts,
        max_new_tokens,
        eos,
        eos[0] if pad is None else pad,
        sampling or Sampling(),
        seeds,
        slots=slots,
    )


def response_text(tokenizer: Any, tokens: list[int]) -> str:
    """The assistant content of a response: decoded without special tokens (the template adds the end of turn)."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _settings(target: Any, max_new_tokens: int, sampled: int, sampling: Any, seed: int) -> dict[str, Any]:
    spec = getattr(target, "spec", None)
    settings: dict[str, Any] = {
        "format": LOG_FORMAT,
        "target": json.loads(spec.key()) if spec is not None else None,
        "max_new_tokens": max_new_tokens,
    }
    if sampled:  # greedy-only logs keep their original header
        settings.update(sampled=sampled, seed=seed, sampling=dataclasses.asdict(sampling))
    return settings


def sample_seed(seed: int, prompt_digest: str, sample: int) -> int:
    """The generator seed of one sampled response: from the run seed and the prompt's content, not its batch."""
    digest = hashlib.sha256(f"{seed}:{prompt_digest}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def regen(
    target_spec: Any,
    prompts_file: str | os.PathLike | None,
    out_file: str | os.PathLike,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    max_prompts: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    sampled: int = 0,
    sampling: Any = None,
    seed: int = 0,
    prompt_overflow: PromptOverflow = "refuse",
) -> Path:
    """Generate the target's responses to every prompt and write them as chat jsonl to ``out_file``.

    Every prompt gets its greedy response, then ``sampled`` sampled ones (several answers per prompt:
    more, and more varied, training text from the same prompts).

    Args:
        target_spec: a :class:`~dflash2_lightning.target.target.TargetSpec`, its dict, or a loaded ``Target``.
        prompts_file: chat jsonl prompts (``None``: the shipped seed prompts).
        out_file: the output chat jsonl; ``<out_file>.partial`` is the resumable work log.
        max_new_tokens: response budget (a response that hits it is kept, cut there).
        batch_size: responses generated together; as one ends the next prompt takes its place
            (prompts start in order of length, left-padded with the others that start with them).
        max_prompts: only the first ``max_prompts`` prompts of the file.
        overwrite: regenerate even if ``out_file`` exists (and forget any partial log).
        sampled: sampled responses per prompt besides the greedy one.
        sampling: how they are sampled (:class:`~dflash2_lightning.target.generate.Sampling`; default temperature
            0.8, top-p 0.95).
        seed: seeds the sampled responses; each draws from its own generator seeded by (seed, prompt
            content, sample number), so the output does not depend on batching or interruptions.
        prompt_overflow: a prompt that does not fit the target's context with ``max_new_tokens`` is refused
            (``"refuse"``, before anything is generated) or cut to its last tokens (``"truncate"``; a line on
            stderr says how many); see :func:`~dflash2_lightning.data.prompts.fit_to_context`.

    Returns ``out_file``: one record per response, prompt by prompt (greedy first). Interrupted runs
    resume where they stopped (see the module docstring).
    """
    from tqdm.auto import tqdm

    from dflash2_lightning.data.prompts import SEED_PROMPTS, encode_prompt, fit_to_context, read_prompts
    from dflash2_lightning.errors import ConfigError
    from dflash2_lightning.files import atomic_write_text
    from dflash2_lightning.model.sampling import Sampling
    from dflash2_lightning.target.load import load_target

    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} is invalid: must be >= 1")
    if sampled < 0:
        raise ConfigError(f"sampled={sampled} is invalid: must be >= 0 (sampled responses per prompt)")
    sampling = sampling or Sampling(temperature=0.8, top_p=0.95)
    if sampled and sampling.greedy:
        raise ConfigError("sampled responses need a temperature > 0 (temperature=0 would repeat the greedy one)")
    per_prompt = 1 + sampled
    out, log, finished = output_paths(Path(out_file), overwrite)
    if finished:
        return out

    target = target_spec if hasattr(target_spec, "hf") else load_target(target_spec)
    chats = read_prompts(prompts_file or SEED_PROMPTS, max_prompts)
    hashes = [prompt_hash(m) for m in chats]
    jobs = len(chats) * per_prompt  # job j: prompt j // per_prompt, response j % per_prompt (0 = greedy)
    settings = _settings(target, max_new_tokens, sampled, sampling, seed)
    if prompt_overflow != "refuse":  # refused prompts never reach a log: older logs keep their header
        settings["prompt_overflow"] = prompt_overflow
    # Tokenised (and checked against the target's context) before the log is opened or anything generated.
    encoded = [encode_prompt(target.tokenizer, m) for m in chats]
    fitted = fit_to_context(
        encoded, target.context_length, max_new_tokens, prompt_overflow, prompts_file or SEED_PROMPTS
    )
    done = open_log(log, settings, hashes, per_prompt)

    tokenised = {
        i: fitted.prompts[i]
        for i in range(len(chats))
        if any(i * per_prompt + s not in done for s in range(per_prompt))
    }
    todo = [j for j in range(jobs) if j not in done and j // per_prompt in tokenised]
    # Similar prompt lengths start together, so a refill of the batch pads little. Greedy and sampled
    # responses share the batch (a None seed is greedy).
    todo.sort(key=lambda j: (len(tokenised[j // per_prompt]), j))
    seeds = [sample_seed(seed, hashes[j // per_prompt], j % per_prompt) if j % per_prompt else None for j in todo]
    bar = tqdm(total=jobs, initial=len(done), desc="regen", unit="response", disable=not progress)
    lines: list[str] = []
    for k, tokens in generate_responses(
        target, [tokenised[j // per_prompt] for j in todo], max_new_tokens, sampling, seeds, slots=batch_size
    ):
        j = todo[k]
        i = j // per_prompt
        messages = chats[i] + [{"role": "assistant", "content": response_text(target.tokenizer, tokens)}]
        record = {"index": j, "hash": hashes[i], "messages": messages}
        done[j] = record
        lines.append(json.dumps(record, ensure_ascii=False))
        if len(lines) >= LOG_EVERY:
            append_lines(log, lines)
            bar.update(len(lines))
            lines = []
    append_lines(log, lines)
    bar.update(len(lines))
    bar.close()

    text = "".join(json.dumps({"messages": done[j]["messages"]}, ensure_ascii=False) + "\n" for j in range(jobs))
    atomic_write_text(out, text)
    log.unlink(missing_ok=True)
    note = fitted.note()
    if note is not None:
        print(f"dflash2: {note}", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------- command line
@dataclass(kw_only=True)
class RegenOptions(TargetOptions, ServerOptions):
    """``dflash2 regen``'s options: in-process generation, or through ``--server`` (the server's own options are
    ``--concurrency`` and ``--server-temperature``; see :mod:`dflash2_lightning.data.regen_server`)."""

    prompts: str | None = option(None, "prompts, chat jsonl {'messages': [...]} (default: the shipped seed prompts)")
    out: str = option(REQUIRED, "output chat jsonl (responses appended as assistant turns)")
    max_new_tokens: int = option(256, "response budget in tokens (default {default})", parse=bounded(int, 1))
    batch_size: int = option(
        8,
        "responses generated together; a finished one makes room for the next prompt (default {default})",
        parse=bounded(int, 1),
    )
    max_prompts: int | None = option(None, "use only the first N prompts", parse=bounded(int, 1))
    prompt_overflow: PromptOverflow = option("refuse", PROMPT_OVERFLOW_HELP)
    overwrite: bool = option(False, "start over even if OUT or OUT.partial exists")
    sampled: int = option(
        0, "sampled responses per prompt besides the greedy one (default {default})", parse=bounded(int, 0)
    )
    temperature: float = option(0.8, "temperature of sampled responses (default {default})", parse=bounded(float, 0.0))
    top_p: float = option(
        0.95,
        "top-p of sampled responses, in (0, 1] (default {default})",
        parse=bounded(float, 0.0, 1.0, low_open=True),
    )
    top_k: int = option(0, "top-k of sampled responses (default 0: off)", parse=bounded(int, 0))
    seed: int = option(0, "seed of the sampled responses (default {default})")
    threads: int | None = option(None, "torch CPU threads (default: torch's choice)", parse=bounded(int, 1))
    progress: bool = option(True, "no progress bar", flag="--no-progress")
    concurrency: int = option(8, "with --server: requests in flight (default {default})", parse=bounded(int, 1))
    server_temperature: float = option(
        0.0,
        "with --server: 0 = greedy (default); > 0 samples on the server with --top-p, prompt i with seed + i",
        parse=bounded(float, 0.0),
    )

    def __post_init__(self) -> None:
        if self.server and self.sampled:
            raise UsageError(
                "--sampled is not supported with --server: give --server-temperature for sampled "
                "responses from the server (with --top-p and --seed)"
            )


DESCRIPTION = (
    "Generate the target's own responses to a prompts file (chat jsonl): the greedy one and optionally --sampled "
    "more per prompt, batched with left padding and the chat template. With --server URL they come from that "
    "OpenAI-compatible server's completions endpoint instead (prompts rendered with the target's chat template "
    "here, sent as token ids). Resumable: rerun the same command after an interruption and it continues from "
    "OUT.partial. OUT is written atomically at the end."
)


def regen_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 regen``: generate the target's own responses for a prompts file (resumable)."""
    opts = parse_options(RegenOptions, argv, prog="dflash2 regen", description=DESCRIPTION)
    from dflash2_lightning.files import check_writable

    check_writable(opts.out)  # before the target is loaded: an output that cannot be written fails at once
    if opts.threads:
        torch.set_num_threads(opts.threads)
    from dflash2_lightning.model.sampling import Sampling

    if opts.server:
        from dflash2_lightning.data.regen_server import regen_server

        path = regen_server(
            opts.server,
            opts.target_spec(),
            opts.prompts,
            opts.out,
            opts.max_new_tokens,
            opts.concurrency,
            opts.server_temperature,
            opts.top_p if opts.server_temperature else 1.0,
            opts.seed,
            opts.max_prompts,
            opts.overwrite,
            opts.progress,
            timeout=opts.timeout,
            prompt_overflow=opts.prompt_overflow,
        )
    else:
        sampling = Sampling(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k)
        path = regen(
            opts.target_spec(),
            opts.prompts,
            opts.out,
            opts.max_new_tokens,
            opts.batch_size,
            opts.max_prompts,
            opts.overwrite,
            opts.progress,
            sampled=opts.sampled,
            sampling=sampling,
            seed=opts.seed,
            prompt_overflow=opts.prompt_overflow,
        )
    with open(path, encoding="utf-8") as f:
        count = sum(1 for line in f if line.strip())
    print(f"{count} responses in {path}")
    return 0
