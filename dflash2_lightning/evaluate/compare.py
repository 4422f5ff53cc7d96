"""``dflash2 compare``: two drafters for one target, on the same prompts, in one sitting; B's τ and speed over A's.

Each drafter is measured exactly as ``dflash2 eval`` measures it (:func:`~dflash2_lightning.evaluate.command.run_eval`:
the speculative loop at every temperature asked and, with ``--replay-prompts``, the T=0 replay), one after the
other, by the same process against the same loaded target, with the same prompts and seeds. Its two reports
(``OUT/a/eval.json``, ``OUT/b/eval.json``) keep every figure per prompt; the comparison pairs them by prompt::

    eval(A), eval(B) on the same prompts --per prompt--> tau B/A, speed B/A     (overall and per category)
                                           resample prompts (one draw for both drafters) -> 95% intervals

τ ratio: ``tau = 1 + accepted / cycles`` over the untruncated cycles of the drawn prompts, each drafter's, divided
(:func:`~dflash2_lightning.intervals.paired_tau_ratio_interval`); speed ratio: each drafter's tokens over its
seconds, divided (:func:`~dflash2_lightning.intervals.paired_speed_ratio_interval`; the loop only: the replay has
no timings). Pairing removes the prompts' own difficulty from the interval, so a small difference between two
drafters shows where two separate intervals would overlap. A drafter compared with itself gives a τ ratio of
exactly 1 with the interval [1, 1] (the same draft on the same prompts accepts the same drafts).

Paths: each path both drafters have (``selector``, ``backbone``) is compared with itself; when their served
paths differ (a DFlash baseline against a DFlash2 drafter), ``served`` pairs A's served path with B's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.evaluate.options import LoopOptions
from dflash2_lightning.target.arguments import TargetOptions

COMPARE_FILE = "compare.json"
FORMAT = "dflash2-compare/1"


@dataclass(kw_only=True)
class CompareOptions(TargetOptions, LoopOptions):
    """``dflash2 compare``'s options: ``dflash2 eval``'s measuring groups (:mod:`dflash2_lightning.evaluate.options`)
    and the target, two drafts and the output directory."""

    draft_a: str = option(REQUIRED, "draft A, the reference (config.json + model.safetensors): ratios are B over A")
    draft_b: str = option(REQUIRED, "draft B, the one compared (config.json + model.safetensors)")
    out: str = option(REQUIRED, "output directory for compare.json and each drafter's eval report (a/, b/)")


def served_pairs(a_paths: Sequence[str], b_paths: Sequence[str], a_served: str, b_served: str) -> dict[str, tuple]:
    """The rows of a comparison: ``{row: (A's path, B's path)}``: every path both measured, in A's order, and
    ``served`` (A's served path, B's) when the two drafters serve different paths and both were measured."""
    pairs: dict[str, tuple] = {x: (x, x) for x in a_paths if x in b_paths}
    if a_served != b_served and a_served in a_paths and b_served in b_paths:
        pairs["served"] = (a_served, b_served)
    return pairs


def paired_figures(
    a: dict[str, list[Any]],
    b: dict[str, list[Any]],
    rows: Sequence[int],
    timed: bool,
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    """B over A on the prompts ``rows``: ``tau`` (each drafter's τ, the ratio and its interval) and, when ``timed``,
    ``speed`` (each drafter's tokens/s, the ratio and its interval). ``a``/``b``: per-prompt lists with
    ``full_cycles`` and ``full_accepted`` (and ``tokens``, ``seconds`` when timed)."""
    from dflash2_lightning.intervals import paired_speed_ratio_interval, paired_tau_ratio_interval

    def pick(side: dict[str, list[Any]], key: str) -> list[float]:
        return [float(side[key][i]) for i in rows]

    def tau(side: dict[str, list[Any]]) -> float | None:
        cycles = sum(pick(side, "full_cycles"))
        return 1.0 + sum(pick(side, "full_accepted")) / cycles if cycles else None

    figures: dict[str, Any] = {
        "prompts": len(rows),
        "tau": {
            "a": tau(a),
            "b": tau(b),
            **paired_tau_ratio_interval(
                pick(b, "full_accepted"),
                pick(b, "full_cycles"),
                pick(a, "full_accepted"),
                pick(a, "full_cycles"),
                resamples=resamples,
                seed=seed,
            ),
        },
    }
    if timed:
        rate = {k: sum(pick(s, "tokens")) / sum(pick(s, "seconds")) for k, s in (("a", a), ("b", b))}
        figures["speed"] = {
            "unit": "tokens/s",
            **rate,
            **paired_speed_ratio_interval(
                pick(b, "tokens"), pick(b, "seconds"), pick(a, "tokens"), pick(a, "seconds"), resamples, seed=seed
            ),
        }
    return figures


def compare_section(
    a_paths: dict[str, dict[str, list[Any]]],
    b_paths: dict[str, dict[str, list[Any]]],
    pairs: dict[str, tuple],
    prompts: int,
    categories: Sequence[str] | None,
    timed: bool,
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    """One measurement's comparison (a temperature of the loop, or the replay): per row of ``pairs``, the figures
    over all ``prompts`` and, with ``categories`` (one per prompt), per category."""
    from dflash2_lightning.evaluate.loop import category_rows

    every = list(range(prompts))
    section: dict[str, Any] = {}
    for row, (pa, pb) in pairs.items():
        a, b = a_paths[pa], b_paths[pb]
        entry = {"paths": {"a": pa, "b": pb}, **paired_figures(a, b, every, timed, resamples, seed)}
        if categories is not None:
            entry["categories"] = {
                name: paired_figures(a, b, idx, timed, resamples, seed)
                for name, idx in category_rows(categories[:prompts]).items()
            }
        section[row] = entry
    return section


def replay_per_prompt(path_report: dict[str, Any]) -> dict[str, list[Any]]:
    """A replay path's per-prompt figures of an eval report: its cycles and accepted drafts per prompt (every
    replayed cycle is untruncated)."""
    return {"full_cycles": path_report["per_prompt_cycles"], "full_accepted": path_report["per_prompt_accepted"]}


def compare_reports(
    a: dict[str, Any], b: dict[str, Any], a_served: str, b_served: str, resamples: int, seed: int
) -> dict[str, Any]:
    """The comparison of two eval reports of the same prompts and settings (``loop`` per temperature, ``replay``)."""
    from dflash2_lightning.errors import ConfigError

    if a["prompts"] != b["prompts"] or a["temperatures"].keys() != b["temperatures"].keys():
        raise ConfigError("the two eval reports measured different prompts or temperatures: they cannot be paired")
    categories = (a.get("prompt_set") or {}).get("categories")
    loop = {}
    for key, blk_a in a["temperatures"].items():
        blk_b = b["temperatures"][key]
        pairs = served_pairs(list(blk_a["paths"]), list(blk_b["paths"]), a_served, b_served)
        loop[key] = compare_section(
            {x: r["per_prompt"] for x, r in blk_a["paths"].items()},
            {x: r["per_prompt"] for x, r in blk_b["paths"].items()},
            pairs,
            a["prompts"],
            categories,
            True,
            resamples,
            seed,
        )
    replay = None
    if a.get("replay") and b.get("replay"):
        ra, rb = a["replay"], b["replay"]
        pairs = served_pairs(list(ra["paths"]), list(rb["paths"]), a_served, b_served)
        replay = compare_section(
            {x: replay_per_prompt(r) for x, r in ra["paths"].items()},
            {x: replay_per_prompt(r) for x, r in rb["paths"].items()},
            pairs,
            ra["prompts"],
            categories,
            False,
            resamples,
            seed,
        )
    return {"loop": loop, "replay": replay}


def run_compare(
    draft_a: str | os.PathLike[str],
    draft_b: str | os.PathLike[str],
    target_spec: Any,
    out_dir: str | os.PathLike[str],
    loop: LoopOptions | None = None,
) -> dict[str, Any]:
    """``dflash2 compare``: measure draft A, then draft B, against one loaded target with ``dflash2 eval``'s
    machinery (:func:`~dflash2_lightning.evaluate.command.run_eval` with ``loop``, the same settings for both, the
    bootstrap's ``resamples`` and ``seed`` included; default: ``dflash2 compare``'s defaults; no teacher-forced
    estimate, no acceptance record written into the drafts), write ``out_dir/a/eval.json``, ``out_dir/b/eval.json``
    and ``out_dir/compare.json``; returns the comparison."""
    from dflash2_lightning.evaluate.command import run_eval
    from dflash2_lightning.evaluate.record import served_path
    from dflash2_lightning.files import atomic_write_text, check_writable
    from dflash2_lightning.model.checkpoint import load_config
    from dflash2_lightning.target.load import load_target

    loop = loop if loop is not None else LoopOptions()
    loop.validate()
    check_writable(out_dir, directory=True)
    served = [served_path(load_config(d).is_dflash2) for d in (draft_a, draft_b)]  # both checkpoints, before work
    target = target_spec if hasattr(target_spec, "hf") else load_target(target_spec)
    out = Path(out_dir)
    reports = [
        run_eval(d, target, out / side, loop, estimate=False, acceptance_record=False)
        for d, side in ((draft_a, "a"), (draft_b, "b"))
    ]
    result: dict[str, Any] = {
        "format": FORMAT,
        "ratio": "B over A, paired by prompt (one bootstrap resample of the prompts for both drafters)",
        "drafts": {"a": str(draft_a), "b": str(draft_b)},
        "served_paths": {"a": served[0], "b": served[1]},
        "target": reports[0]["target"],
        "prompts_file": reports[0]["prompts_file"],
        "prompts": reports[0]["prompts"],
        "max_new_tokens": reports[0]["max_new_tokens"],
        "sampling": reports[0]["sampling"],
        "evals": {"a": str(out / "a" / "eval.json"), "b": str(out / "b" / "eval.json")},
        **compare_reports(reports[0], reports[1], served[0], served[1], loop.resamples, loop.seed),
        "machine": {side: r["machine"] for side, r in zip("ab", reports)},
        "notes": [
            "the drafters run one after the other (A, then B) in one process against the same loaded target: "
            "the speed ratio is only as steady as the machine's load between the two runs (machine.*.load_average_*)"
        ],
    }
    untrusted = [side for side, r in zip("ab", reports) if not r["machine"].get("timing_trusted", True)]
    if untrusted:
        result["notes"].append(
            f"speed ratio NOT trustworthy: other processes loaded the machine during the run of {' and '.join(untrusted)}"
            " (see its eval.json notes); the tau ratios are unaffected"
        )
    atomic_write_text(out / COMPARE_FILE, json.dumps(result, indent=2) + "\n")
    return result


def _ratio_text(figures: dict[str, Any]) -> str:
    lo, hi = figures["interval"]
    ratio = figures["ratio"]
    if ratio is None:
        return "-"
    return f"{ratio:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{ratio:.3f}"


def _row_text(label: str, figures: dict[str, Any]) -> str:
    tau = figures["tau"]
    text = f"{label}  tau A {tau['a']:.2f}  B {tau['b']:.2f}  B/A {_ratio_text(tau)}"
    if "speed" in figures:
        speed = figures["speed"]
        text += f"  |  tok/s A {speed['a']:.1f}  B {speed['b']:.1f}  B/A {_ratio_text(speed)}"
    return text


def compare_lines(result: dict[str, Any]) -> list[str]:
    """The printed table: per measurement (each temperature of the loop, the replay) and row, τ and speed of A and
    B and B over A with its 95% interval, overall and per category."""
    lines = [f"B: {result['drafts']['b']}  over  A: {result['drafts']['a']}  ({result['prompts']} prompts)"]
    sections = [(f"loop T={key}", section) for key, section in result["loop"].items()]
    if result.get("replay"):
        sections.append(("replay T=0", result["replay"]))
    for title, section in sections:
        for row, entry in section.items():
            paths = entry["paths"]
            label = row if paths["a"] == paths["b"] else f"{row} ({paths['a']} vs {paths['b']})"
            lines.append(_row_text(f"{title} {label}: all ({entry['prompts']})", entry))
            width = max((len(f"{n} ({c['prompts']})") for n, c in (entry.get("categories") or {}).items()), default=0)
            for name, figures in (entry.get("categories") or {}).items():
                lines.append(_row_text(f"    {name + ' (' + str(figures['prompts']) + ')':>{width}}", figures))
    lines.append("B/A [lo, hi]: ratio with its 95% bootstrap interval, prompts resampled together for both drafters")
    return lines + [f"note: {note}" for note in result.get("notes", []) if note.startswith("speed ratio NOT")]


COMPARE_DESCRIPTION = (
    "Compare two drafters for one target on the same prompts in one sitting: each is measured as `dflash2 eval` "
    "measures it (the speculative loop at each --temperature and, with --replay-prompts, the T=0 replay), then "
    "B's tau and speed are divided by A's per prompt, with 95% bootstrap intervals that resample the prompts "
    "together for both (paired), per category of a named prompt set and overall. Writes OUT/compare.json and "
    "each drafter's OUT/a/eval.json, OUT/b/eval.json."
)


def compare_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 compare --draft-a A --draft-b B --target T --out DIR``: print the table, write ``compare.json``."""
    opts = parse_options(CompareOptions, argv, prog="dflash2 compare", description=COMPARE_DESCRIPTION)
    opts.set_threads()
    result = run_compare(opts.draft_a, opts.draft_b, opts.target_spec(), opts.out, opts)
    print("\n".join(compare_lines(result)))
    print(f"report: {Path(opts.out) / COMPARE_FILE}")
    return 0
