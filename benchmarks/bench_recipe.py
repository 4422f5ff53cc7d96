"""The recipe ablation: which settings give the highest *measured* τ for the quickstart's budget.

Every variant is one ``dflash2 quickstart`` run (the command recorded beside its result reproduces it
alone), all on the same regenerated responses: the responses of the first variant are copied into the
others' output directories with their settings stamp, so only the training and the evaluation differ
(the offline feature cache is content-keyed and shared between variants with the same features).

    python benchmarks/bench_recipe.py --out runs/recipe [--variants shipped,kd32,...] [-- --eval-prompts 16]

Flags after ``--`` go to every variant's quickstart.

Each row: measured τ (selector walk and backbone argmax, real speculative decoding on the held-out
prompts, with the report's interval where it has one), the trainer's validation τ, speed-up vs the
target alone, and the wall/CPU time of training. Results go to ``benchmarks/results/bench_recipe.json``
(``--results``; merged by variant name, so a partial re-run keeps the other rows) and a markdown table is
printed; a variant whose quickstart fails keeps its row (return code, log) and makes the script exit 1.
Not a test: a full run takes an hour or more on 2 cores.

The rows in ``bench_recipe.json`` ran on the 1x recipe shipped before the 3x-text one (greedy responses only,
540 steps, float32 features, data labels, float32 regeneration). To reproduce one with today's quickstart,
add ``--sampled 0 --regen-dtype float32 --max-steps 540 --model.init_args.objective.labels=data
--data.init_args.offline.feature_autocast=none`` to its command. The 3x-text rows are in ``recipe_budget.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from record import write_json

RESULTS = Path(__file__).resolve().parent / "results" / "bench_recipe.json"

# name -> (extra quickstart flags, what it tests). Every variant starts from configs/quickstart.yaml (as shipped:
# all seed prompts x 160 tokens, 16-position context window, lr 1e-3, 540 steps, bf16 autocast).
PREVIOUS = [
    "--max-steps",
    "360",
    "--trainer.precision=32",
    "--model.init_args.draft.sliding_window=null",
    "--model.init_args.optimizer.lr=3.0e-3",
    "--eval-prompts",
    "8",
    "--eval-temperature",
    "0",
]
BUDGET_EVAL = ["--eval-prompts", "32", "--eval-max-new-tokens", "96", "--eval-temperature", "0"]
VARIANTS: dict[str, tuple[list[str], str]] = {
    "shipped": (["--eval-temperature", "0"], "configs/quickstart.yaml as shipped"),
    "shipped_insert_last": (
        ["--model.init_args.objective.gold_outside_topk=insert_last", "--eval-temperature", "0"],
        "the shipped recipe with ModelOpt's insert_last selector loss (shipped until the selector_drop row)",
    ),
    "shipped_dflash": (
        ["--model.init_args.draft.projector_type=dflash", "--eval-temperature", "0"],
        "the DFlash baseline (no conv, no selector) with the shipped recipe",
    ),
    "lr3e-3": (["--model.init_args.optimizer.lr=3.0e-3"], "learning rate 3e-3 instead of 1e-3"),
    "lr3e-3_dflash": (
        ["--model.init_args.draft.projector_type=dflash", "--model.init_args.optimizer.lr=3.0e-3"],
        "the DFlash baseline at learning rate 3e-3",
    ),
    "previous": (PREVIOUS, "the previous quickstart recipe (full attention, lr 3e-3, 360 fp32 steps) on the same data"),
    "previous_norm": (
        PREVIOUS + ["--model.init_args.experimental.normalize_features=true"],
        "previous recipe + fc trained on unit-RMS features (scale folded into fc at export)",
    ),
    "previous_swa16": (
        PREVIOUS + ["--model.init_args.draft.sliding_window=16"],
        "previous recipe + 16-position context window",
    ),
    "previous_init29": (
        PREVIOUS
        + [
            "--model.init_args.experimental.init_from_target=true",
            "--model.init_args.draft.target_layer_ids=[28]",
            "--model.init_args.optimizer.lr=1.0e-3",
        ],
        "previous recipe + draft layer starting as target layer 29 (features of layer 28), lr 1e-3",
    ),
    "selector_drop": (
        ["--model.init_args.objective.gold_outside_topk=drop", *BUDGET_EVAL],
        "selector loss only where the target's token is in the top-k (no inserted gold)",
    ),
    "selector_lr0.25": (
        ["--model.init_args.experimental.selector_lr_scale=0.25", *BUDGET_EVAL],
        "the selector's codebooks and projection at 0.25 x the learning rate",
    ),
    "selector_top16": (
        ["--model.init_args.draft.selector_top_k=16", *BUDGET_EVAL],
        "16 selector candidates per position instead of 8 (the trainer's default)",
    ),
    "kd32": (
        ["--model.init_args.objective.token_loss=kd", "--data.init_args.offline.teacher_top_k=32", *BUDGET_EVAL],
        "soft distillation from the target's cached top-32 logits",
    ),
    "kd32_dflash": (
        [
            "--model.init_args.objective.token_loss=kd",
            "--data.init_args.offline.teacher_top_k=32",
            "--model.init_args.draft.projector_type=dflash",
            *BUDGET_EVAL,
        ],
        "the DFlash baseline with soft distillation from the cached top-32 logits",
    ),
    "selector_embed": (
        ["--model.init_args.experimental.selector_init=target_embedding", *BUDGET_EVAL],
        "selector codebooks start at the target embedding's top-32 principal coordinates",
    ),
    "conv_k4": (
        ["--model.init_args.draft.conv_kernel_size=4", *BUDGET_EVAL],
        "block convolution with 4 taps (the whole 4-token block) instead of 2",
    ),
    "weight_decay0.1": (
        ["--model.init_args.optimizer.weight_decay=0.1", *BUDGET_EVAL],
        "AdamW weight decay 0.1 instead of 0 (norms and conv base kernels excepted)",
    ),
    "selector_lr3": (
        ["--model.init_args.experimental.selector_lr_scale=3.0", *BUDGET_EVAL],
        "the selector's codebooks and projection at 3 x the learning rate",
    ),
    "selector_alpha3": (
        ["--model.init_args.objective.selector_loss_alpha=3.0", *BUDGET_EVAL],
        "selector loss weight 3 instead of 1 (it reaches the backbone through unary and hidden)",
    ),
    "selector_rank128": (
        ["--model.init_args.draft.selector_rank=128", *BUDGET_EVAL],
        "selector rank 128 instead of 32",
    ),
    "decay_gamma1": (
        ["--model.init_args.objective.decay_gamma=1.0", *BUDGET_EVAL],
        "position decay gamma 1 instead of 2 (offset weights 1 / 0.37 / 0.14: offset 1 first)",
    ),
    "anchors32_270": (
        ["--model.init_args.objective.num_anchors=32", "--max-steps", "270", *BUDGET_EVAL],
        "32 blocks per sequence per step and half the steps (the same draft positions in all)",
    ),
    "dpace": (
        ["--model.init_args.objective.position_weighting=dpace", *BUDGET_EVAL],
        "D-PACE position weights (alpha 0.5)",
    ),
    "two_layers": (
        [
            "--model.init_args.draft.num_hidden_layers=2",
            "--model.init_args.draft.target_layer_ids=[15]",
            *BUDGET_EVAL,
        ],
        "two draft layers (same feature layer)",
    ),
    # The ceiling (tau against budget): the shipped recipe with N x the data (N-1 sampled responses per prompt
    # beside the greedy one, T=0.8, hard CE on the target's own greedy token) and N x the steps, measured on
    # 32 x 96 tokens at T=0 like the DFlash/DFlash2 comparison. They regenerate their own responses.
    **{
        f"budget_{n}x": (
            [
                *BUDGET_EVAL,
                "--sampled",
                str(n - 1),
                "--max-steps",
                str(540 * n),
                "--model.init_args.objective.labels=target",
            ],
            f"{n}x the data ({n - 1} sampled responses per prompt beside the greedy one) and {n}x the steps",
        )
        for n in (2, 4, 16)
    },
    # The 2x and 4x rows first ran with ModelOpt's insert_last selector loss (shipped then).
    **{
        f"budget_{n}x_insert_last": (
            [
                *BUDGET_EVAL,
                "--sampled",
                str(n - 1),
                "--max-steps",
                str(540 * n),
                "--model.init_args.objective.labels=target",
                "--model.init_args.objective.gold_outside_topk=insert_last",
            ],
            f"{n}x the data and steps with the insert_last selector loss",
        )
        for n in (2, 4)
    },
    # The DFlash baseline at the same N x budget (run with --responses-from runs/recipe/budget_Nx): does
    # DFlash2's lead grow with the budget?
    **{
        f"budget_{n}x_dflash": (
            [
                *BUDGET_EVAL,
                "--sampled",
                str(n - 1),
                "--max-steps",
                str(540 * n),
                "--model.init_args.objective.labels=target",
                "--model.init_args.draft.projector_type=dflash",
            ],
            f"the DFlash baseline at {n}x the data and steps",
        )
        for n in (2, 4, 16)
    },
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_row(path: Path, name: str, row: dict[str, Any]) -> dict[str, Any]:
    """Merge ``row`` into the results file under ``name`` (atomically) and return the file's rows.

    The file is re-read just before the write, so two benchmark runs going at once keep each other's rows.
    """
    results = _load(path)
    results[name] = {**results.get(name, {}), **row}
    write_json(path, results)
    return results


def share_responses(source: Path, dest: Path) -> None:
    """Give ``dest`` the responses of ``source`` and its regen stamp, so its quickstart reuses them."""
    for rel in ("data/responses.jsonl", ".quickstart/regen.json"):
        if (source / rel).is_file() and not (dest / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, dest / rel)


def run_variant(
    name: str, flags: list[str], common: list[str], out: Path, first: Path | None, collect: bool = False
) -> dict[str, Any]:
    """Run one variant's quickstart (reusing the shared responses); return its result row.

    ``collect``: do not run, only read the result of an earlier run from its directory.
    """
    target = out / name
    cmd = ["dflash2", "quickstart", "--out", str(target), "--no-progress", *common, *flags]
    row: dict[str, Any] = {"command": shlex.join(cmd)}
    if not collect:
        if first is not None and first != target:
            share_responses(first, target)
        started, cpu0 = time.perf_counter(), os.times()
        load = os.getloadavg()
        log = target.parent / f"{name}.log"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            done = subprocess.run(
                [str(Path(sys.executable).parent / "dflash2"), *cmd[1:]], stdout=f, stderr=subprocess.STDOUT
            )
        cpu1 = os.times()
        row.update(
            {
                "returncode": done.returncode,
                "log": str(log),
                "wall_seconds": round(time.perf_counter() - started, 1),
                "cpu_seconds": round(
                    cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system, 1
                ),
                "load_average_start": [round(x, 2) for x in load],
                "load_average_end": [round(x, 2) for x in os.getloadavg()],
            }
        )
    summary = _load(target / "summary.json")
    if not summary and (target / "eval" / "eval.json").is_file():
        # Trained by the quickstart, measured by a separate, larger `dflash2 eval` (its command is recorded).
        report = _load(target / "eval" / "eval.json")
        row["eval_command"] = (
            f"dflash2 eval --draft {target / 'train' / 'hf'} --target smollm2 --max-prompts "
            f"{report['prompts']} --max-new-tokens {report['max_new_tokens']} --temperature 0"
        )
        summary = {
            "tau": report["tau"],
            "timings": {},
            "draft": {"architecture": report.get("architecture")},
            "validation_tau": None,
            "estimated_tau": {p: (v.get("estimated") or {}).get("tau") for p, v in report["paths"].items()},
            "eval": {
                "prompts": report["prompts"],
                "generated_tokens": report["generated_tokens"],
                "paths": report["paths"],
            },
            "machine": report.get("machine"),
        }
    if summary:
        row["machine"] = summary.get("machine")
        row["tau"] = summary["tau"]
        row["validation_tau"] = summary.get("validation_tau")
        row["estimated_tau"] = summary.get("estimated_tau")
        row["timings"] = summary["timings"]
        row["eval"] = {k: summary["eval"][k] for k in ("prompts", "generated_tokens")}
        row["paths"] = {
            p: {
                "measured": {k: v for k, v in r["measured"].items() if k != "per_prompt"},
                "interval": r.get("interval"),
                "speedup": r.get("speedup"),
                "lossless": r.get("lossless"),
            }
            for p, r in summary["eval"]["paths"].items()
        }
        row["draft"] = summary["draft"]
    from dflash2_lightning.quickstart.report import last_validation

    row["validation"] = last_validation(target / "train" / "metrics.csv")  # incl. selector coverage/accuracy
    return row


def plot_acceptance(results: dict[str, Any], names: list[str], path: Path) -> None:
    """Measured per-position acceptance of ``names`` (every decoding path of each) in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        for dpath, res in (results[name].get("paths") or {}).items():
            accept = res["measured"].get("accept") or []
            tau = res["measured"].get("tau")
            ax.plot(
                range(1, len(accept) + 1),
                accept,
                marker="o",
                label=f"{name} {dpath} (tau {tau:.2f})" if tau else f"{name} {dpath}",
            )
    ax.set_xlabel("block offset k")
    ax.set_ylabel("P(offsets 1..k accepted), measured")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    lines = [
        "| variant | what | τ selector | τ backbone | val τ sel / bb | speed-up sel | train s | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        tau = row.get("tau") or {}
        val = row.get("validation_tau") or {
            k.split("/")[1]: v
            for k, v in (row.get("validation") or {}).items()
            if k.endswith("/tau") and k.count("/") == 2
        }
        sp = ((row.get("paths") or {}).get("selector") or {}).get("speedup")
        train = ((row.get("timings") or {}).get("train") or {}).get("seconds")
        fmt = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-"
        lines.append(
            f"| {name} | {row.get('what', '')} | {fmt(tau.get('selector'))} | {fmt(tau.get('backbone'))} | "
            f"{fmt(val.get('selector'))} / {fmt(val.get('backbone'))} | {fmt(sp)} | {fmt(train)} | "
            f"`{row.get('command', '')}` |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/recipe", help="root of the variants' quickstart directories")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (default: all)")
    p.add_argument("--results", default=str(RESULTS), help="JSON results file (merged by variant name)")
    p.add_argument(
        "--responses-from",
        default=None,
        help="a quickstart output directory whose responses every variant reuses (default: the first variant's own)",
    )
    p.add_argument(
        "--collect",
        action="store_true",
        help="run nothing: rebuild the rows of the named variants from their directories",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also plot the measured acceptance curves of the run's variants into PNG",
    )
    p.add_argument(
        "common",
        nargs=argparse.REMAINDER,
        help="flags passed to every quickstart after '--' (e.g. -- --num-prompts 338 --max-steps 600)",
    )
    args = p.parse_args(argv)
    common = [a for a in args.common if a != "--"]
    out = Path(args.out)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    results_path = Path(args.results)
    results: dict[str, Any] = {}
    first: Path | None = Path(args.responses_from) if args.responses_from else None
    failed = []
    for name in names:
        flags, what = VARIANTS[name]
        print(f"== {name}: {what}", flush=True)
        row = run_variant(name, flags, common, out, first, args.collect)
        row["what"] = what
        first = first or out / name
        results = save_row(results_path, name, row)
        if row.get("returncode"):
            failed.append(f"{name} (rc {row['returncode']}, log {row['log']})")
        print(
            f"   tau {row.get('tau')} val {row.get('validation_tau')} ({row.get('wall_seconds')} s, "
            f"rc {row.get('returncode')})",
            flush=True,
        )
    print(table({n: results[n] for n in names}))
    if args.plot:
        plot_acceptance(results, names, Path(args.plot))
        print(f"plot: {args.plot}")
    print(f"wrote {results_path}")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
