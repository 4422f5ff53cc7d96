"""`dflash2 regen --server URL`: the target's responses from an OpenAI-compatible server (vLLM, SGLang, llama-server).

At scale the target is served by an inference engine, not run in the training process. Every prompt goes to the
server's **completions** endpoint (``POST {URL}/completions``) as **token ids** rendered here with the target
tokenizer's chat template (:func:`~dflash2_lightning.data.prompts.encode_prompt`, as in-process regen and training
render it), so the server generates from the very tokens the trainer will see, whatever its own chat handling.
Greedy (``temperature=0``) or sampled (``top_p``; prompt ``index`` gets the seed ``seed + index``, so a resumed run
asks for the same sample); ``concurrency`` requests are in flight at once and the server batches them.

Resumable and atomic like in-process regen (the same ``<out>.partial`` log and final write): each response is
appended and fsynced as it arrives, so a crash or a dead server loses only the requests in flight. The log header
records the settings that shape the responses (target, budget, sampling, the served model's id), so a resume
against another model or with other settings is refused. A server that stops answering, or answers with an HTTP
error, raises :class:`ServerError` saying how many responses are kept.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from dflash2_lightning.data.prompts import PromptOverflow
from dflash2_lightning.data.regen_log import LOG_FORMAT, append_lines, open_log, output_paths, prompt_hash
from dflash2_lightning.engines.openai_client import ServerError, complete, served_model
from dflash2_lightning.errors import check


def _tokenizer(target_spec: Any) -> tuple[Any, Any]:
    """``(tokenizer, spec)`` of a target without loading its weights where that can be avoided."""
    from dflash2_lightning.target.load import hf_dir_of
    from dflash2_lightning.target.spec import TargetSpec
    from dflash2_lightning.target.tiny import tiny_tokenizer

    if hasattr(target_spec, "tokenizer"):
        return target_spec.tokenizer, getattr(target_spec, "spec", None)
    spec = target_spec if isinstance(target_spec, TargetSpec) else TargetSpec(**target_spec)
    if spec.tiny is not None:
        from dflash2_lightning.target.tiny import TINY_DEFAULTS

        return tiny_tokenizer(int({**TINY_DEFAULTS, **spec.tiny}["vocab_size"])), spec
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir_of(spec)), local_files_only=True), spec


def regen_server(
    server_url: str,
    target_spec: Any,
    prompts_file: str | os.PathLike | None,
    out_file: str | os.PathLike,
    max_new_tokens: int = 256,
    concurrency: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompts: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    timeout: float = 600.0,
    prompt_overflow: PromptOverflow = "refuse",
) -> Path:
    """Generate every prompt's response through an OpenAI-compatible server; chat jsonl to ``out_file``.

    Args:
        server_url: the server's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1``.
        target_spec: the target the server serves (its tokenizer renders the prompts): a
            :class:`~dflash2_lightning.target.target.TargetSpec`, its dict, or a loaded ``Target``.
        prompts_file: chat jsonl prompts (``None``: the shipped seed prompts).
        out_file: the output chat jsonl; ``<out_file>.partial`` is the resumable work log.
        max_new_tokens: response budget; concurrency: requests in flight at once.
        temperature: 0 for greedy; above 0 samples with ``top_p`` and the per-prompt seed ``seed + index``.
        timeout: seconds one request may take before the server counts as dead.
        prompt_overflow: prompts that do not fit the target's context with ``max_new_tokens`` are refused or cut
            (:func:`~dflash2_lightning.data.prompts.fit_to_context`), before any request is sent.

    Returns ``out_file``; raises :class:`ServerError` (what was finished stays in the log) if the server dies.
    """
    from tqdm.auto import tqdm

    from dflash2_lightning.data.prompts import SEED_PROMPTS, encode_prompt, fit_to_context, read_prompts
    from dflash2_lightning.files import atomic_write_text

    check(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, ">= 1")
    check(concurrency >= 1, "concurrency", concurrency, ">= 1")
    check(temperature >= 0, "temperature", temperature, ">= 0")
    check(0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
    check(0 < timeout < float("inf"), "timeout", timeout, "a finite number of seconds > 0")
    out, log, finished = output_paths(Path(out_file), overwrite)
    if finished:
        return out

    tokenizer, spec = _tokenizer(target_spec)
    chats = read_prompts(prompts_file or SEED_PROMPTS, max_prompts)  # a bad file fails before the server is asked
    fitted = fit_to_context(
        [encode_prompt(tokenizer, m) for m in chats],
        _context_length(target_spec, spec),
        max_new_tokens,
        prompt_overflow,
        prompts_file or SEED_PROMPTS,
    )
    model = served_model(server_url, timeout)
    hashes = [prompt_hash(m) for m in chats]
    settings = {
        "format": LOG_FORMAT,
        "target": json.loads(spec.key()) if spec is not None else None,
        "max_new_tokens": max_new_tokens,
        "engine": "openai-completions",
        "served_model": model,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
    }
    if prompt_overflow != "refuse":
        settings["prompt_overflow"] = prompt_overflow
    done = open_log(log, settings, hashes)

    todo = [i for i in range(len(chats)) if i not in done]
    bar = tqdm(total=len(chats), initial=len(done), desc="regen (server)", unit="prompt", disable=not progress)

    def one(i: int) -> tuple[int, str]:
        choice = complete(
            server_url,
            model,
            fitted.prompts[i],
            max_new_tokens,
            temperature,
            top_p,
            None if temperature == 0.0 else seed + i,
            timeout,
        )
        return i, choice["text"]

    def keep(futures: set[Future]) -> BaseException | None:
        """Log every finished response of ``futures`` (durable at once); the first failure, if any."""
        lines, error = [], None
        for f in futures:
            if f.cancelled():
                continue
            if f.exception() is not None:
                error = error or f.exception()
                continue
            i, text = f.result()
            done[i] = {"index": i, "hash": hashes[i], "messages": chats[i] + [{"role": "assistant", "content": text}]}
            lines.append(json.dumps(done[i], ensure_ascii=False))
        if lines:
            append_lines(log, lines)
            bar.update(len(lines))
        return error

    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        pending: set[Future] = {pool.submit(one, i) for i in todo}
        while pending:
            # As each response arrives (not when all have): every finished one is durable at once.
            ready, pending = wait(pending, return_when=FIRST_COMPLETED)
            error = keep(ready)
            if error is not None:
                for f in pending:
                    f.cancel()  # not started yet: never sent
                ready, _ = wait(pending)  # already sent: their answers are kept too
                keep(ready)
                raise ServerError(
                    f"{error}; {len(done)} of {len(chats)} responses are kept in {log}: rerun the "
                    "same command once the server is back to resume"
                ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()

    text = "".join(json.dumps({"messages": done[i]["messages"]}, ensure_ascii=False) + "\n" for i in range(len(chats)))
    atomic_write_text(out, text)
    log.unlink(missing_ok=True)
    note = fitted.note()
    if note is not None:
        print(f"dflash2: {note}", file=sys.stderr, flush=True)
    return out


def _context_length(target_spec: Any, spec: Any) -> int | None:
    """The target's context (``max_position_embeddings``) without loading its weights."""
    from dflash2_lightning.target.target import context_length_of_config

    if hasattr(target_spec, "context_length"):  # a loaded Target
        return target_spec.context_length
    if spec is None:
        return None
    if spec.tiny is not None:
        from dflash2_lightning.target.tiny import TINY_DEFAULTS

        return context_length_of_config({**TINY_DEFAULTS, **spec.tiny})
    from dflash2_lightning.target.hf_config import read_config_json
    from dflash2_lightning.target.load import hf_dir_of

    return context_length_of_config(read_config_json(hf_dir_of(spec)))
