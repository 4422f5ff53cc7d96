"""DFlash vs DFlash2 at the same budget: train both with the shipped recipe, measure both by real decoding.

    python benchmarks/bench_dflash_vs_dflash2.py --out runs/recipe [--eval-prompts 32] [--eval-tokens 96]
    python benchmarks/bench_dflash_vs_dflash2.py --out runs/recipe --skip-train --skip-eval   # re-summarise
    # drafts already in DIR/<variant>/train/hf, another target, the record elsewhere:
    python benchmarks/bench_dflash_vs_dflash2.py --out DIR --skip-train --target tiny --json out.json

1. trains the ``shipped`` (DFlash2), ``shipped_insert_last`` (DFlash2 with ModelOpt's selector loss, the
   recipe shipped before) and ``shipped_dflash`` (DFlash: no convolution, no selector) variants of
   ``benchmarks/bench_recipe.py``: the same regenerated responses, steps, seed and recipe;
2. measures both with ``dflash2 eval`` at T=0 on the same held-out prompts (DFlash2 with the selector
   walk and the backbone argmax), every output checked against the target's greedy decoding;
3. writes ``benchmarks/results/dflash_vs_dflash2.json``: τ with its 95% interval, per-position acceptance,
   tokens/s, and a *paired* bootstrap over prompts of DFlash2's accepted drafted tokens over DFlash's
   (the same prompts and the same target outputs on both sides, so the pairing removes prompt
   difficulty), plus the plot ``dflash_vs_dflash2.png`` (τ with intervals, acceptance per offset) beside it
   (``--json PATH`` writes PATH and PATH with the suffix ``.png``).

Not a test: training and evaluating both takes ~30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from record import write_json

from dflash2_lightning.intervals import paired_ratio_interval

RESULTS = Path(__file__).resolve().parent / "results"


def _f(value: float | None) -> str:
    """A ratio or bound to 3 decimals; '-' where there is none (a baseline that accepted no draft)."""
    return "-" if value is None else f"{value:.3f}"


# bench_recipe variant -> label; the first DFlash2 row is the shipped recipe.
VARIANTS = {"shipped": "DFlash2", "shipped_insert_last": "DFlash2 (insert_last)", "shipped_dflash": "DFlash"}


def summarise(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rows per (draft, path) and DFlash2's paired ratios over the DFlash baseline."""
    rows = []
    for variant, report in reports.items():
        for path, res in report["paths"].items():
            m = res["measured"]
            rows.append(
                dict(
                    draft=VARIANTS[variant],
                    variant=variant,
                    path=path,
                    tau=round(m["tau"], 4),
                    tau_interval=[round(x, 4) for x in res["interval"]["tau"]],
                    accept=[round(x, 4) for x in m["accept"]],
                    accept_interval=[[round(x, 4) for x in iv] for iv in res["interval"]["accept"]],
                    cycles=m["cycles"],
                    tokens=m["tokens"],
                    accepted_drafts=sum(res["per_prompt_accepted"]),
                    per_prompt_accepted=res["per_prompt_accepted"],
                    tokens_per_second=round(m["tokens_per_second"], 2),
                    speedup=round(res["speedup"], 3),
                    lossless=res["lossless"],
                    torch_threads=report["machine"]["torch_threads"],
                    load_average_start=report["machine"]["load_average_start"],
                )
            )
    base = next(r for r in rows if r["draft"] == "DFlash")
    paired = {}
    for r in rows:
        if r["draft"] != "DFlash":
            key = r["path"] if r["draft"] == "DFlash2" else f"{r['draft']} {r['path']}"
            paired[key] = {
                "draft": r["draft"],
                "path": r["path"],
                "tau_ratio": round(r["tau"] / base["tau"], 3),
                "accepted_drafts": paired_ratio_interval(r["per_prompt_accepted"], base["per_prompt_accepted"]),
            }
    return {"rows": rows, "dflash2_over_dflash": paired}


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    labels = [f"{r['draft']}\n{r['path']}".replace(" (", "\n(") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    taus = [r["tau"] for r in rows]
    errs = [[r["tau"] - r["tau_interval"][0] for r in rows], [r["tau_interval"][1] - r["tau"] for r in rows]]
    colours = [{"DFlash": "C1", "DFlash2": "C0"}.get(r["draft"], "C2") for r in rows]
    left.bar(labels, taus, yerr=errs, capsize=4, color=colours)
    left.set_ylim(1.0, max(r["tau_interval"][1] for r in rows) + 0.05)
    left.set_ylabel("measured τ (95% interval over prompts)")
    for r in rows:
        offsets = range(1, len(r["accept"]) + 1)
        right.plot(offsets, r["accept"], marker="o", label=f"{r['draft']} {r['path']}")
    right.set_xticks(list(range(1, len(rows[0]["accept"]) + 1)))
    right.set_xlabel("draft offset k")
    right.set_ylabel("P(offsets 1..k accepted)")
    right.legend()
    fig.suptitle("DFlash vs DFlash2, same data / steps / seed (T=0, real speculative decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/recipe", help="bench_recipe output directory (default runs/recipe)")
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--threads", default="auto", help="torch threads of the evaluation (default auto)")
    p.add_argument(
        "--target",
        default="smollm2",
        help="the target, as `dflash2 eval --target` takes it (default smollm2; the training, "
        "bench_recipe's quickstarts, is given it too)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=RESULTS / "dflash_vs_dflash2.json",
        help="JSON output; the plot goes beside it with the suffix .png and the training's "
        "bench_recipe.json in the same folder (default benchmarks/results/dflash_vs_dflash2.json)",
    )
    p.add_argument("--skip-train", action="store_true", help="reuse the trained variants under --out")
    p.add_argument("--skip-eval", action="store_true", help="reuse OUT/<variant>/cmp_eval/eval.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    here = Path(__file__).resolve().parent
    if not args.skip_train:
        common = [] if args.target == "smollm2" else ["--", "--target", args.target]
        subprocess.run(
            [
                sys.executable,
                str(here / "bench_recipe.py"),
                "--out",
                str(out),
                "--variants",
                ",".join(VARIANTS),
                "--results",
                str(args.json.with_name("bench_recipe.json")),
                *common,
            ],
            check=True,
        )
    reports, commands = {}, []
    for variant in VARIANTS:
        eval_dir = out / variant / "cmp_eval"
        cmd = [
            "dflash2",
            "eval",
            "--draft",
            str(out / variant / "train" / "hf"),
            "--target",
            args.target,
            "--out",
            str(eval_dir),
            "--max-prompts",
            str(args.eval_prompts),
            "--max-new-tokens",
            str(args.eval_tokens),
            "--temperature",
            "0",
            "--threads",
            args.threads,
            "--no-progress",
        ]
        commands.append(" ".join(cmd))
        if not args.skip_eval:  # the dflash2 beside this interpreter (its venv's), as bench_recipe runs it
            subprocess.run([str(Path(sys.executable).parent / "dflash2"), *cmd[1:]], check=True)
        reports[variant] = json.loads((eval_dir / "eval.json").read_text())
    summary = summarise(reports)
    summary.update(eval_commands=commands, prompts=args.eval_prompts, max_new_tokens=args.eval_tokens)
    write_json(args.json, summary)
    plot(summary, args.json.with_suffix(".png"))
    for r in summary["rows"]:
        lo, hi = r["tau_interval"]
        print(
            f"{r['draft']:8} {r['path']:9} tau {r['tau']:.3f} [{lo:.3f}, {hi:.3f}]  accept "
            + " / ".join(f"{a:.3f}" for a in r["accept"])
            + f"  {r['tokens_per_second']:.1f} tok/s"
        )
    for v in summary["dflash2_over_dflash"].values():
        a = v["accepted_drafts"]
        print(
            f"{v['draft']} {v['path']} / DFlash: tau {v['tau_ratio']:.3f}x, accepted drafts {_f(a['ratio'])}x "
            f"[{_f(a['interval'][0])}, {_f(a['interval'][1])}] (paired; better on {a['prompts_better']} prompts, "
            f"worse on {a['prompts_worse']})"
        )
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
