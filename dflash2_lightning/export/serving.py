"""How to serve a draft: ``SERVING.md`` beside the checkpoint, ``dflash2 serve-help`` and ``dflash2 check``.

``SERVING.md`` holds the exact command lines for vLLM, SGLang and llama.cpp filled in with this
checkpoint's numbers (``num_speculative_tokens = block_size - 1`` for vLLM, the draft-token count
``block_size`` for SGLang, ``--spec-draft-n-max block_size - 1`` for llama.cpp), its paths and dtype,
and every engine finding (:mod:`dflash2_lightning.engines.rules`), and says how to check a running deployment
against the draft's acceptance record (``acceptance.json``, ``dflash2 check-serving``; the command lines are
:func:`~dflash2_lightning.engines.rules.serving_commands`, also the ones that check recommends). ``fit`` writes
it at the end; ``serve-help`` writes it for any checkpoint; ``check`` runs the loader's checks plus the engine
checks and writes nothing.

Exit status of both commands: 0 fine, 1 the checkpoint has an error an engine would hit, 2 bad input
(the checkpoint cannot be read or is refused by the loader; one ``dflash2: error:`` line on stderr).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.config import DraftConfig
from dflash2_lightning.engines.rules import (
    LLAMA_CPP,
    SGLANG,
    VLLM,
    Finding,
    TargetInfo,
    engine_findings,
    served_block_flags,
    served_block_sizes,
    serving_commands,
)
from dflash2_lightning.files import atomic_write_text
from dflash2_lightning.model.checkpoint import CONFIG_NAME, CheckpointError, read_config_json, verify_checkpoint

SERVING_NAME = "SERVING.md"
RECORD_NAME = "acceptance.json"  # the acceptance record (dflash2_lightning.engines.acceptance_record)


def _q(path: str) -> str:
    return shlex.quote(path)


def serving_markdown(
    cfg: DraftConfig,
    draft_dir: str | Path,
    target: TargetInfo | None = None,
    findings: Sequence[Finding] = (),
    dtype_reason: str | None = None,
) -> str:
    """The text of ``SERVING.md`` for the checkpoint ``cfg`` at ``draft_dir``."""
    draft = str(Path(draft_dir).resolve())
    n, bs, dtype = cfg.block_size - 1, cfg.block_size, cfg.torch_dtype
    target = target or TargetInfo()
    hf_target = target.path or "TARGET"
    kind = (
        f"DFlash2 (convolution {cfg.conv_kernel_size} taps, selector rank {cfg.selector_rank}, "
        f"top-k {cfg.selector_top_k})"
        if cfg.is_dflash2
        else "DFlash baseline (no convolution, no selector)"
    )
    lines = [
        "# Serving this draft",
        "",
        f"- draft: `{draft}` — `{cfg.architecture}`, {kind}",
        f"- block_size {bs}: one step drafts {n} tokens after the anchor; "
        f"target_layer_ids {cfg.target_layer_ids} of {cfg.num_target_layers} target layers",
        f"- dtype {dtype}" + (f": {dtype_reason}" if dtype_reason else ""),
    ]
    if target.tiny:
        lines.append(
            "- target: a tiny random test target. No engine serves it; the commands show the shape "
            "for a real target (replace TARGET with its local model directory)."
        )
    elif target.path or target.gguf:
        lines.append(f"- target: `{target.described}`" + (f" ({target.serving_dtype})" if target.serving_dtype else ""))
    else:
        lines.append(
            "- target: not recorded — replace TARGET below with the local directory of the target this "
            f"draft was trained for ({cfg.num_target_layers} layers, hidden size {cfg.hidden_size}, "
            f"vocabulary {cfg.vocab_size}); `dflash2 serve-help --draft DIR --target DIR` fills it in."
        )
    if target.gguf and not target.path:
        lines.append(
            "- vLLM and SGLang serve a Hugging Face directory, not the GGUF this draft was trained "
            "against: use the target's original model directory as TARGET."
        )
    commands = serving_commands(cfg.block_size, cfg.torch_dtype, draft_dir, target)
    lines += [
        "",
        "## vLLM (GPU; method `dflash`, Model Runner V2)",
        "",
        "```bash",
        *commands[VLLM],
        "```",
        "",
        f"`num_speculative_tokens` must be {n} (= block_size - 1): vLLM never reads the checkpoint's "
        "block_size and sizes the query block and the convolution from 1 + num_speculative_tokens. "
        '`"method": "dflash"` is required (only guessed when the path contains "dflash"); '
        "do not set `VLLM_USE_V2_MODEL_RUNNER=0` (DFlash2 drafts only run on Model Runner V2). "
        "vLLM does not check that every draft tensor loaded: run `dflash2 check --draft` on a copied "
        "checkpoint first.",
        "",
        "## SGLang (GPU)",
        "",
        "```bash",
        *commands[SGLANG],
        "```",
        "",
        f"SGLang counts the anchor: its draft-token count is block_size = {bs} (read from "
        "dflash_config.block_size when the flag is omitted; another value re-sizes the convolution with "
        "only a warning). `--dtype` is explicit because `auto` serves a float32 draft as float16 "
        "beside a bf16 target. SGLang skips unknown tensor names silently.",
        "",
        "## llama.cpp (CPU / edge)",
        "",
        "Convert the draft to a GGUF next to the target's GGUF, then serve or try it:",
        "",
        "```bash",
        *commands[LLAMA_CPP],
        f"llama-speculative-simple -m {_q(target.gguf or 'target.gguf')} -md draft.gguf "
        f'--spec-type draft-dflash --spec-draft-n-max {n} -p "Write a haiku about speculative decoding."',
        "```",
        "",
    ]
    if not target.gguf:
        lines += [
            "`target.gguf` is the target converted by llama.cpp's `convert_hf_to_gguf.py "
            f"{_q(hf_target)} --outfile target.gguf`.",
            "",
        ]
    lines += [
        f"`--spec-draft-n-max {n}` = block_size - 1; "
        + (
            "llama.cpp walks the candidate selector (selector_top_k > 0)."
            if cfg.is_dflash2
            else "llama.cpp drafts it as DFlash (argmax per position)."
        ),
        "",
    ]
    lines += served_block_section(cfg, draft, target.path or target.gguf or "TARGET")
    lines += [
        "## Checking a running deployment",
        "",
        f"`{RECORD_NAME}` beside this checkpoint (and `draft.acceptance.json` beside a GGUF "
        "`dflash2 export-gguf` writes) is the acceptance record: held-out prompts as token ids, the target's greedy continuation, and "
        "the accepted drafts per verify step this draft earns at T=0, with the expected tau and its 95% "
        "interval. `dflash2 fit` writes it with the export (export.acceptance_prompts), `dflash2 eval "
        "--replay-prompts N` and the quickstart rewrite it; `dflash2 acceptance-record "
        f"--draft {_q(draft)} --target TARGET` writes it for any draft.",
        "",
        f"`dflash2 check-serving --server http://HOST:PORT --draft {_q(draft)}` sends those prompts at T=0 to "
        "the running engine, reads the engine's own acceptance counters (llama-server: per-response "
        "`timings` and, with `--metrics`, `/metrics`; vLLM: `--per-request-spec-decode-metrics summary` or "
        "its Prometheus `/metrics`; SGLang: per-request `spec_tokens_details`) and says whether the served "
        "outputs are lossless and the served tau lies in the expected interval; if not, which and the "
        "likely causes (exit 0 agree, 1 disagree, 2 could not check; docs/serving-check.md). Losslessness is "
        "judged against the same engine without the draft when you give one: start a second server of the same "
        "target without the draft (llama-server without `-md`) and add `--reference-url http://HOST:PORT2`; "
        "do so for a quantised target (such as a Q4 GGUF), whose kernels pick otherwise than the record's "
        "greedy continuation at near ties. Without it the record's continuation judges.",
        "",
    ]
    lines += ["## Checks", ""]
    problems = [f for f in findings if f.level != "note"]  # the notes are the prose above
    lines += [f"- **{f.level}** [{f.engine}] {f.message}" + (f" Fix: {f.fix}" if f.fix else "") for f in problems]
    if not problems:
        lines.append(
            "- no engine problem found"
            + ("" if target.num_layers is not None else " (not checked against a target: pass --target)")
        )
    lines += ["", "Re-run with `dflash2 check --draft <this directory> --target <target dir>`.", ""]
    return "\n".join(lines)


def served_block_section(cfg: DraftConfig, draft: str, target: str) -> list[str]:
    """SERVING.md's lines on serving the draft at a block smaller than the trained one: the sizes it can be served
    at (:func:`~dflash2_lightning.engines.rules.served_block_sizes`), how to measure them, and each engine's flag
    per size (:func:`~dflash2_lightning.engines.rules.served_block_flags`)."""
    sizes = served_block_sizes(cfg)
    bs = cfg.block_size
    lines = [
        "## Serving at a smaller block",
        "",
        f"The engines can serve this draft at any block from {sizes[0]} to {bs} tokens (anchor included). At block "
        "b it drafts b - 1 tokens per step from `[anchor, MASK x (b-1)]`"
        + (", its convolution reset at that block's start" if cfg.is_dflash2 else "")
        + "; a smaller block verifies fewer tokens per step and drafts fewer that can be rejected, so on CPUs and "
        "quantized targets it is often faster even though tau is lower. Measure tau and tokens/s at each size on "
        "your machine first (docs/measuring-tau.md, section Served block sizes):",
        "",
        "```bash",
        f"dflash2 eval --draft {_q(draft)} --target {_q(target)} --out eval-blocks \\",
        f"  --served-block-sizes {' '.join(str(b) for b in sizes)} --replay-prompts 64",
        "```",
        "",
        "`eval.json`'s `served_block_sizes.fastest` names the fastest size and the flag that serves it in each "
        "engine. To serve at block b, change only that flag in the commands above:",
        "",
        "| served block | vLLM | SGLang | llama.cpp |",
        "|---|---|---|---|",
    ]
    for b in sizes:
        flags = served_block_flags(b)
        label = f"{b} (trained)" if b == bs else str(b)
        lines.append(f"| {label} | `{flags[VLLM]}` | `{flags[SGLANG]}` | `{flags[LLAMA_CPP]}` |")
    return lines + [
        "",
        f"Not larger than {bs}: the draft never saw a wider block (llama.cpp clamps it to {bs - 1} drafts; vLLM and "
        "SGLang run it off its training layout). `dflash2 check-serving` expects the trained block's tau: check a "
        "deployment at the trained block, then change the flag.",
        "",
    ]


def write_serving(
    directory: str | Path,
    cfg: DraftConfig,
    target: TargetInfo | None = None,
    dtype_reason: str | None = None,
    out: str | Path | None = None,
) -> tuple[Path, list[Finding]]:
    """Write ``SERVING.md`` (into the checkpoint ``directory`` unless ``out`` is given); return it and the findings."""
    raw = read_config_json(directory)
    findings = engine_findings(cfg, target, raw)
    path = Path(out) if out is not None else Path(directory) / SERVING_NAME
    atomic_write_text(path, serving_markdown(cfg, directory, target, findings, dtype_reason))
    return path, findings


# ---------------------------------------------------------------------- commands
@dataclass(kw_only=True)
class CheckOptions:
    """The options of ``dflash2 check``: the checkpoint and, optionally, the target it is checked against (the
    group ``serve-help`` shares)."""

    draft: str = option(REQUIRED, "checkpoint directory (config.json + model.safetensors)")
    target: str | None = option(
        None,
        "the target's local HF model directory (only config.json and tokenizer.json are read): checks the draft "
        "fits it and fills its path into the commands",
    )


@dataclass(kw_only=True)
class ServeHelpOptions(CheckOptions):
    """The options of ``dflash2 serve-help``: :class:`CheckOptions` and where to write ``SERVING.md``."""

    out: str | None = option(None, "where to write it (default: DRAFT/SERVING.md)")


def _load(draft_dir: str, target_dir: str | None) -> tuple[DraftConfig, TargetInfo | None]:
    """The verified config and the target info, or a user error (raised as ConfigError / CheckpointError)."""
    draft = Path(draft_dir).expanduser()
    if not (draft / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"--draft {draft}: no {CONFIG_NAME} there (a draft checkpoint directory holds "
            "config.json and model.safetensors)"
        )
    cfg = verify_checkpoint(draft)
    target = None
    if target_dir is not None:
        try:
            target = TargetInfo.from_dir(target_dir)
        except FileNotFoundError as error:
            raise CheckpointError(str(error)) from None
    return cfg, target


def check_main(argv: Sequence[str]) -> int:
    """``dflash2 check --draft DIR [--target DIR]``: the loader's checks plus every engine check."""
    opts = parse_options(
        CheckOptions,
        list(argv),
        prog="dflash2 check",
        description="Check a DFlash / DFlash2 checkpoint the way the project's loader does "
        "(config, truncation, tensor names and shapes, finite weights) and against what vLLM, "
        "SGLang and llama.cpp need. Writes nothing. Exit 0: fine, 1: an engine error, 2: refused.",
    )
    cfg, target = _load(opts.draft, opts.target)  # a user error is one line from the command's handler
    findings = engine_findings(cfg, target, read_config_json(opts.draft))
    print(
        f"{opts.draft}: {cfg.architecture}, block_size {cfg.block_size}, dtype {cfg.torch_dtype}, "
        f"target_layer_ids {cfg.target_layer_ids}: loads (config, tensors, values checked)"
    )
    for finding in findings:
        print(finding)
    return 1 if any(f.level == "error" for f in findings) else 0


def serve_help_main(argv: Sequence[str]) -> int:
    """``dflash2 serve-help --draft DIR [--target DIR] [--out FILE]``: write SERVING.md and say where."""
    opts = parse_options(
        ServeHelpOptions,
        list(argv),
        prog="dflash2 serve-help",
        description="Write SERVING.md with the exact vLLM, SGLang and llama.cpp command "
        "lines for a checkpoint (checked first, as dflash2 check does).",
    )
    from dflash2_lightning.files import check_writable

    check_writable(opts.out if opts.out is not None else Path(opts.draft) / SERVING_NAME)
    cfg, target = _load(opts.draft, opts.target)  # a user error is one line from the command's handler
    path, findings = write_serving(opts.draft, cfg, target, out=opts.out)
    for finding in findings:
        if finding.level != "note":
            print(finding)
    print(f"serving instructions written to {path}")
    return 1 if any(f.level == "error" for f in findings) else 0
