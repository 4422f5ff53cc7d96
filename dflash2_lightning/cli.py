"""The ``dflash2`` command (also ``lightning`` and ``python -m dflash2_lightning``): every action of the project.

``dflash2 --help`` lists them in pipeline order; ``dflash2 <action> --help`` says what one takes and
writes. ``fit`` and ``validate`` are Lightning's ``LightningCLI``
(:mod:`dflash2_lightning.train.lightning_cli`); every other action is a function of its stage, imported
only when it runs, so ``dflash2 eval`` never loads Lightning's trainer and ``dflash2 --help`` is instant.

Every action runs under :func:`dflash2_lightning.reporting.run_command`: a user error is one
``dflash2: error: <what>, <where>, <what to do>`` line on stderr and exit status 2; a traceback only
with ``--debug`` or for a bug.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash2_lightning import __version__
from dflash2_lightning.errors import USER_EXIT
from dflash2_lightning.recipes import recipe_names, with_recipe_paths
from dflash2_lightning.reporting import print_error, run_command, split_debug


@dataclass(frozen=True)
class Action:
    """One ``dflash2`` action: where its entry function lives and what it does, in one line."""

    entry: str  # "package.module:function", called with the remaining arguments; returns the exit status
    summary: str
    #: "package.module:Class": the dataclass its options come from (:mod:`dflash2_lightning.action_options`);
    #: None for ``plan``, which reads a fit config with LightningCLI's own parser.
    options: str | None


#: Lightning's own subcommands (LightningCLI), then every other action in pipeline order.
LIGHTNING_ACTIONS: dict[str, str] = {
    "fit": "train a draft from a config (writes the run directory: checkpoints, metrics, plots, hf/)",
    "validate": "validate a draft checkpoint on the config's validation data",
}
ACTIONS: dict[str, Action] = {
    "plan": Action(
        "dflash2_lightning.train.plan_command:plan_main",
        "what a fit needs per device and on disk, from the config alone, and whether it fits",
        None,
    ),
    "quickstart": Action(
        "dflash2_lightning.quickstart.run:quickstart_main",
        "the whole job on SmolLM2-135M: regenerate, cache features, train, measure tau",
        "dflash2_lightning.quickstart.options:QuickstartOptions",
    ),
    "regen": Action(
        "dflash2_lightning.data.regen:regen_main",
        "the target's own responses to a prompts file (training data), in-process or via a server",
        "dflash2_lightning.data.regen:RegenOptions",
    ),
    "eval": Action(
        "dflash2_lightning.evaluate.command:eval_main",
        "measure tau with real speculative decoding (eval.json, acceptance.png)",
        "dflash2_lightning.evaluate.command:EvalOptions",
    ),
    "acceptance-record": Action(
        "dflash2_lightning.evaluate.record:record_main",
        "write DRAFT/acceptance.json: the tau a draft earns at T=0 on held-out prompts",
        "dflash2_lightning.evaluate.record:RecordOptions",
    ),
    "compare": Action(
        "dflash2_lightning.evaluate.compare:compare_main",
        "two drafters for one target on the same prompts: B's tau and speed over A's, paired intervals",
        "dflash2_lightning.evaluate.compare:CompareOptions",
    ),
    "check": Action(
        "dflash2_lightning.export.serving:check_main",
        "check a draft checkpoint against what vLLM, SGLang and llama.cpp expect",
        "dflash2_lightning.export.serving:CheckOptions",
    ),
    "serve-help": Action(
        "dflash2_lightning.export.serving:serve_help_main",
        "print the engines' exact commands to serve a draft checkpoint",
        "dflash2_lightning.export.serving:ServeHelpOptions",
    ),
    "check-serving": Action(
        "dflash2_lightning.engines.check_serving:check_serving_main",
        "check a running engine's outputs and tau against the draft's acceptance record",
        "dflash2_lightning.engines.check_serving:CheckServingOptions",
    ),
    "draft-vocab": Action(
        "dflash2_lightning.decode.draft_vocab:main",
        "write draft_vocab.json: the tokens the draft step's head covers",
        "dflash2_lightning.decode.draft_vocab:DraftVocabOptions",
    ),
    "export-gguf": Action(
        "dflash2_lightning.engines.draft_gguf:export_gguf_main",
        "write the draft as a GGUF for llama.cpp's DFlash2 runtime",
        "dflash2_lightning.engines.draft_gguf:ExportGGUFOptions",
    ),
    "export-onnx": Action(
        "dflash2_lightning.export.onnx.command:main",
        "write the drafting graphs as ONNX with the dflash custom ops, verified",
        "dflash2_lightning.export.onnx.command:ExportOnnxOptions",
    ),
    "export-trt": Action(
        "dflash2_lightning.export.tensorrt.command:main",
        "build TensorRT engines with the dflash plugins from an ONNX export",
        "dflash2_lightning.export.tensorrt.command:ExportTrtOptions",
    ),
    "build-llama-cpp": Action(
        "dflash2_lightning.engines.llama_cpp:main",
        "build llama-server from the pinned llama.cpp source (for eval and regen)",
        "dflash2_lightning.engines.llama_cpp:BuildLlamaCppOptions",
    ),
}


def overview() -> str:
    """The text of ``dflash2 --help``: every action with its one-line summary."""
    width = max(map(len, [*LIGHTNING_ACTIONS, *ACTIONS]))
    lines = [
        "usage: dflash2 <action> [options]   (dflash2 <action> --help for an action's options)",
        "",
        "Train DFlash2 speculative-decoding drafters for your own target, measure them and ship them.",
        "",
        "actions:",
    ]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in LIGHTNING_ACTIONS.items()]
    lines += [f"  {name:<{width}}  {action.summary}" for name, action in ACTIONS.items()]
    lines += [
        "",
        "Shipped recipes (fit, validate and plan take them by name, e.g. `dflash2 fit --config tiny`):",
        "  " + ", ".join(recipe_names()),
        "",
        "--debug (any action) shows the full traceback of an error; --version prints the version.",
    ]
    return "\n".join(lines)


def unknown_action(word: str) -> str:
    """The error for a first argument that names no action (with the closest action, when one is close)."""
    names = [*LIGHTNING_ACTIONS, *ACTIONS]
    if word.startswith("-"):
        return (
            f"{word} comes before an action: name the action first, e.g. `dflash2 fit {word} ...`; "
            "`dflash2 --help` lists the actions"
        )
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return (
        f"{word!r} is not an action"
        + (f"; did you mean {close[0]!r}?" if close else "")
        + " `dflash2 --help` lists the actions"
    )


def _entry(spec: str) -> Callable[[list[str]], Any]:
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


def main(args: Sequence[str] | None = None) -> int | None:
    """Console entry point of ``dflash2`` and ``lightning``: an action, or LightningCLI's ``fit`` / ``validate``.

    Returns the exit status (``None`` is 0).
    """
    argv = with_recipe_paths(list(sys.argv[1:] if args is None else args))
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"dflash2-lightning {__version__}")
        return 0
    if argv[0] in ACTIONS:
        entry = ACTIONS[argv[0]].entry
        return run_command(lambda rest: _entry(entry)(rest), argv[1:])
    if argv[0] not in LIGHTNING_ACTIONS:
        print_error(unknown_action(argv[0]))
        return USER_EXIT
    from dflash2_lightning.export.callback import FIT_END_CALLBACKS
    from dflash2_lightning.train.lightning_cli import lightning_main

    if args is None:
        # LightningCLI reads sys.argv itself (and DDP's launcher starts the other ranks with it)
        sys.argv[1:] = split_debug(with_recipe_paths(sys.argv[1:]))[0]
    # a config that does not name the end-of-fit export gets it (older configs export as they always did)
    return lightning_main(argv, from_sys_argv=args is None, fit_end_callbacks=FIT_END_CALLBACKS)
