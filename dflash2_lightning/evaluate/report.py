"""An evaluation report for people: summary lines (τ with intervals, acceptance, speed) and the plot."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def temperature_blocks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-temperature blocks (a report from before sampling has only the greedy top level)."""
    return report.get("temperatures") or {
        "0": {"temperature": 0.0, "paths": report["paths"], "target_only": report["target_only"]}
    }


def plot_eval(report: dict[str, Any], path: str | os.PathLike) -> None:
    """PNG: measured ``accept_k`` per path and temperature with its 95% band (the trainer's greedy
    estimate dashed), τ per temperature with its interval (and the T=0 replay's, when the report has
    one), the accepted-length histogram, τ per category (a named prompt set) and the selector's health per
    offset (a DFlash2 draft at T=0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from dflash2_lightning.files import atomic_write

    colors = {"selector": "tab:orange", "backbone": "tab:blue"}
    styles = ["-o", "-s", "-^", "-v", "-D", "-x"]
    blocks = list(temperature_blocks(report).values())
    by_category = any(blk.get("categories") for blk in blocks)
    healths = health_series(report)
    panels = 3 + by_category + bool(healths)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), dpi=100)
    left, middle, right = axes[:3]
    if by_category:
        plot_categories(axes[3], blocks, report.get("replay"), colors, styles)
    if healths:
        plot_health(axes[-1], healths)
    for ti, blk in enumerate(blocks):
        t = blk["temperature"]
        for name, res in blk["paths"].items():
            m, e, iv = res["measured"], res["estimated"], res.get("interval")
            ks = list(range(1, len(m["accept"]) + 1))
            label = f"{name} T={t:g} (τ {m['tau']:.2f})"
            left.plot(
                ks,
                m["accept"],
                styles[ti % len(styles)],
                ms=3,
                color=colors.get(name),
                label=label,
                alpha=1.0 if ti == 0 else 0.75,
            )
            if iv and all(b[0] is not None for b in iv["accept"]):
                left.fill_between(
                    ks, [b[0] for b in iv["accept"]], [b[1] for b in iv["accept"]], color=colors.get(name), alpha=0.12
                )
            if e and e.get("accept"):
                left.plot(
                    ks,
                    e["accept"],
                    "--",
                    color=colors.get(name),
                    alpha=0.6,
                    label=f"{name} trainer estimate (τ {e['tau']:.2f})",
                )
    names = list(blocks[0]["paths"])
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        ts: list[float] = []
        taus: list[float] = []
        err: list[list[float]] = [[], []]
        for ti, blk in enumerate(blocks):
            res = blk["paths"].get(name)
            if res is None:
                continue
            tau, iv = res["measured"]["tau"], (res.get("interval") or {}).get("tau") or [None, None]
            ts.append(ti + (j - (len(names) - 1) / 2) * width)
            taus.append(tau)
            err[0].append(tau - iv[0] if iv[0] is not None else 0.0)
            err[1].append(iv[1] - tau if iv[1] is not None else 0.0)
        middle.errorbar(ts, taus, yerr=err, fmt="o", capsize=4, color=colors.get(name), label=name)
        hist = blocks[0]["paths"][name]["measured"]["histogram"]
        total = max(sum(hist), 1)
        xs = [a + (j - (len(names) - 1) / 2) * width for a in range(len(hist))]
        right.bar(xs, [h / total for h in hist], width=width, color=colors.get(name), label=name)
    replay = report.get("replay")
    ticks = [f"T={b['temperature']:g}" for b in blocks]
    if replay:  # the T=0 replay's tau beside the loop's: the same quantity on more prompts
        ticks.append(f"T=0 replay\n{replay['prompts']} prompts")
        for j, name in enumerate(names):
            r = replay["paths"].get(name)
            if r and r["tau"] is not None and r["interval"][0] is not None:
                middle.errorbar(
                    [len(blocks) + (j - (len(names) - 1) / 2) * width],
                    [r["tau"]],
                    yerr=[[r["tau"] - r["interval"][0]], [r["interval"][1] - r["tau"]]],
                    fmt="D",
                    capsize=4,
                    color=colors.get(name),
                )
    if report.get("llama.cpp"):
        spec = report["llama.cpp"]["speculative"]
        left.plot(
            range(1, len(spec["accept"]) + 1),
            spec["accept"],
            "-s",
            ms=4,
            color="tab:green",
            label=f"llama.cpp measured (τ {spec['tau']:.2f})",
        )
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    middle.set_xticks(range(len(ticks)), ticks)
    left.set(
        xlabel="block offset k",
        ylabel="P(offsets 1..k accepted)",
        ylim=(0, 1.02),
        title="acceptance curve (band: 95% bootstrap over prompts)",
    )
    middle.set(ylabel="τ (tokens per verify step)", title="τ by temperature, 95% interval")
    right.set(
        xlabel="accepted drafts per cycle",
        ylabel="fraction of cycles",
        title=f"accepted lengths, T={blocks[0]['temperature']:g}",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{report.get('architecture', 'draft')}, block {report.get('block_size')}, {report.get('prompts')} prompts"
    )
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def health_series(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, selector_health)`` of the report's loop temperatures and T=0 replay that have one."""
    series = [
        (f"T={blk['temperature']:g} loop", health)
        for blk in temperature_blocks(report).values()
        if (health := (blk["paths"].get("selector") or {}).get("selector_health")) and health.get("cycles")
    ]
    replay = report.get("replay") or {}
    health = (replay.get("paths", {}).get("selector") or {}).get("selector_health")
    if health and health.get("cycles"):
        series.append((f"T=0 replay ({replay['prompts']} prompts)", health))
    return series


def plot_health(ax: Any, series: list[tuple[str, dict[str, Any]]]) -> None:
    """Selector health per draft position: recall (solid), picked (dashed), passed over (dotted)."""
    from matplotlib.ticker import MaxNLocator

    markers = ["o", "D", "s", "^"]
    for j, (label, health) in enumerate(series):
        ks = list(range(1, len(health["recall"]) + 1))
        marker = markers[j % len(markers)]
        ax.plot(ks, health["recall"], f"-{marker}", ms=3, color="tab:green", label=f"recall, {label}")
        ax.plot(ks, health["picked"], f"--{marker}", ms=3, color="tab:orange", label=f"picked, {label}")
        ax.plot(ks, health["passed_over"], f":{marker}", ms=3, color="tab:red", label=f"passed over, {label}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        xlabel="block offset k",
        ylabel="share of cycles that reached k",
        ylim=(0, 1.02),
        title=f"selector health (target's token in the top-{series[0][1]['top_k']})",
    )


def plot_categories(
    ax: Any, blocks: list[dict[str, Any]], replay: dict[str, Any] | None, colors: dict[str, str], styles: list[str]
) -> None:
    """τ per category with its 95% interval: each path at each temperature (and the T=0 replay's, diamonds)."""
    names = list(blocks[0]["categories"])
    series = [
        (f"{path} T={blk['temperature']:g}", path, styles[ti % len(styles)][1:], blk["categories"])
        for ti, blk in enumerate(blocks)
        for path in blk["paths"]
    ]
    if replay and replay.get("categories"):
        series += [(f"{path} T=0 replay", path, "D", replay["categories"]) for path in replay["paths"]]
    width = 0.8 / len(series)
    for j, (label, path, marker, categories) in enumerate(series):
        xs: list[float] = []
        taus: list[float] = []
        err: list[list[float]] = [[], []]
        for i, name in enumerate(names):
            tau, iv, _, _ = category_figures(categories[name]["paths"][path]) if name in categories else (None,) * 4
            if tau is None:
                continue
            xs.append(i + (j - (len(series) - 1) / 2) * width)
            taus.append(tau)
            err[0].append(tau - iv[0] if iv and iv[0] is not None else 0.0)
            err[1].append(iv[1] - tau if iv and iv[1] is not None else 0.0)
        ax.errorbar(xs, taus, yerr=err, fmt=marker, capsize=3, color=colors.get(path), label=label)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="τ (tokens per verify step)", title="τ per category, 95% interval")


def interval_text(bounds: Sequence[float | None] | None) -> str:
    return f" [{bounds[0]:.2f}, {bounds[1]:.2f}]" if bounds and bounds[0] is not None else ""


def category_figures(res: dict[str, Any]) -> tuple[float | None, Any, float | None, Any]:
    """``(tau, its interval, speed-up, its interval)`` of one path's figures in a category: the loop's (``measured``,
    ``speedup``, ``interval``) or the replay's (``tau``, ``interval``; no speed)."""
    if "measured" in res:
        iv = res.get("interval") or {}
        return res["measured"]["tau"], iv.get("tau"), res.get("speedup"), iv.get("speedup")
    return res["tau"], res["interval"], None, None


def category_lines(categories: dict[str, dict[str, Any]] | None, indent: str = "") -> list[str]:
    """Per category (a named prompt set's): its prompts and each path's τ (and speed-up) with its interval."""
    if not categories:
        return []
    figures = {
        name: {path: category_figures(res) for path, res in c["paths"].items()} for name, c in categories.items()
    }
    timed = any(f[2] for paths in figures.values() for f in paths.values())
    lines = [f"{indent}per category: tau [95%]" + (" (speed-up [95%])" if timed else "")]
    labels = {name: f"{name} ({c['prompts']})" for name, c in categories.items()}
    width = max(len(label) for label in labels.values())
    for name, paths in figures.items():
        parts = []
        for path, (tau, tau_iv, speedup, speedup_iv) in paths.items():
            speed = f" ({speedup:.2f}x{interval_text(speedup_iv)})" if speedup else ""
            parts.append(f"{path} {tau:.2f}{interval_text(tau_iv)}{speed}" if tau is not None else f"{path} -")
        lines.append(f"{indent}  {labels[name]:>{width}}: " + "; ".join(parts))
    return lines


def health_lines(health: dict[str, Any] | None, indent: str = "") -> list[str]:
    """The selector health's lines of a summary: per draft position, recall, picked and passed over (none
    without one)."""
    if not health or not health.get("cycles"):
        return []
    return [
        f"{indent}selector health of the {health['cycles']} cycles: per offset k, of those reaching k, the "
        f"target's token among the top-{health['top_k']} (recall), drafted (picked), passed over (passed)",
        *(
            f"{indent}{label} " + "  ".join(f"{x:.2f}" for x in health[name])
            for name, label in (("recall", "recall_k"), ("picked", "picked_k"), ("passed_over", "passed_k"))
        ),
    ]


def replay_lines(replay: dict[str, Any] | None, indent: str = "") -> list[str]:
    """The wide replay's lines of a summary (none without a replay)."""
    if not replay:
        return []
    lines = [
        f"{indent}replay at T=0 on {replay['prompts']} prompts, {replay['generated_tokens']} tokens "
        "(teacher-forced along the target's greedy outputs; equals the measured tau at T=0):"
    ]
    for name, r in [*replay["paths"].items(), (f"top-{replay['oracle']['top_k']} oracle", replay["oracle"])]:
        if r["tau"] is not None:
            lines.append(
                f"{indent}{name:>14}: tau {r['tau']:.2f}{interval_text(r['interval'])}  accept_k "
                + "  ".join(f"{a:.2f}" for a in r["accept"])
            )
            lines += health_lines(r.get("selector_health"), indent + " " * 16)
    return lines + category_lines(replay.get("categories"), indent)


def block_size_lines(section: dict[str, Any] | None) -> list[str]:
    """The served block sizes' lines of a summary (none without them): per temperature a line per size with each
    path's τ, tokens/s and speed-up (95% intervals) and the fastest size; the replay's τ per size; the fastest
    size overall with each engine's flag that serves it."""
    if not section:
        return []
    lines = [
        f"served block sizes {section['block_sizes']} (trained {section['trained_block_size']}), "
        f"{section['prompts']} prompts:"
    ]
    for blk in section["temperatures"].values():
        base = blk["target_only"]["tokens_per_second"]
        lines.append(f"  T={blk['temperature']:g}" + (f"; target alone {base:.1f} tok/s" if base else ""))
        for size, figures in blk["sizes"].items():
            parts = []
            for path, res in figures["paths"].items():
                m, iv = res["measured"], res.get("interval") or {}
                speed = (
                    f", {m['tokens_per_second']:.1f}{interval_text(iv.get('tokens_per_second'))} tok/s "
                    f"({res['speedup']:.2f}x{interval_text(iv.get('speedup'))})"
                    if res["speedup"]
                    else ""
                )
                lossy = ", NOT LOSSLESS" if res["lossless"] is False else ""
                parts.append(f"{path} tau {m['tau']:.2f}{interval_text(iv.get('tau'))}{speed}{lossy}")
            lines.append(f"    block {size:>2}: " + "; ".join(parts))
        for path, best in blk["fastest"].items():
            if best is None:
                continue
            runner = best["runner_up"]
            over = (
                f" ({runner['speed_ratio']['ratio']:.2f}x{interval_text(runner['speed_ratio']['interval'])} "
                f"the tok/s of block {runner['block_size']})"
                if runner and runner["speed_ratio"]["ratio"]
                else ""
            )
            lines.append(f"    fastest {path}: block {best['block_size']}, {best['tokens_per_second']:.1f} tok/s{over}")
    replay = section.get("replay")
    if replay:
        lines.append(f"  replay at T=0 on {replay['prompts']} prompts:")
        for size, figures in replay["sizes"].items():
            parts = [
                f"{name} tau {r['tau']:.2f}{interval_text(r['interval'])}"
                for name, r in [
                    *figures["paths"].items(),
                    (f"top-{figures['oracle']['top_k']} oracle", figures["oracle"]),
                ]
                if r["tau"] is not None
            ]
            lines.append(f"    block {size:>2}: " + "; ".join(parts))
    best = section.get("fastest")
    if best:
        flags = "; ".join(f"{engine} {flag}" for engine, flag in best["serve_with"].items())
        lines.append(
            f"  fastest: block {best['block_size']} ({best['path']}, T={best['temperature']:g}, "
            f"{best['tokens_per_second']:.1f} tok/s); serve it with {flags}"
        )
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    """Human-readable lines per temperature and path: τ with its 95% interval, per-position acceptance
    with intervals, the trainer's estimate, speed, losslessness."""
    blocks = temperature_blocks(report)
    base = report["target_only"]["tokens_per_second"]
    lines = [
        f"{report['prompts']} prompts, {report['generated_tokens']} tokens; target alone {base:.1f} tok/s"
        if base
        else f"{report['prompts']} prompts"
    ]
    for blk in blocks.values():
        t = blk["temperature"]
        if len(blocks) > 1 or t != 0:
            extra = (
                ""
                if t == 0
                else (f", top_p {blk['top_p']:g}, top_k {blk['top_k']}, {blk['samples_per_prompt']} samples per prompt")
            )
            tps = blk["target_only"]["tokens_per_second"]
            lines.append(
                f"T={t:g}{' (greedy)' if t == 0 else ''}{extra}" + (f"; target alone {tps:.1f} tok/s" if tps else "")
            )
        for name, res in blk["paths"].items():
            m, e, iv = res["measured"], res["estimated"] or {}, res.get("interval") or {}
            replay = f" (replayed {e['replayed_tau']:.2f})" if e.get("replayed_tau") is not None else ""
            est = f", trainer estimate {e['tau']:.2f}{replay}" if e.get("tau") else ""
            speed = (
                f", {m['tokens_per_second']:.1f} tok/s ({res['speedup']:.2f}x{interval_text(iv.get('speedup'))})"
                if res["speedup"]
                else ""
            )
            lossy = res["lossless"] is False
            lines.append(
                f"{name:>8}: tau {m['tau']:.2f}{interval_text(iv.get('tau'))} measured{est}{speed}"
                f"{', NOT LOSSLESS on prompts ' + str(res['mismatched_prompts']) if lossy else ''}"
            )
            if iv.get("accept"):
                lines.append(
                    " " * 10
                    + "accept_k "
                    + "  ".join(f"{a:.2f}{interval_text(b)}" for a, b in zip(m["accept"], iv["accept"]))
                )
            lines += health_lines(res.get("selector_health"), " " * 10)
        lines += category_lines(blk.get("categories"), " " * 2)
        orc = blk.get("oracle") or {}
        if orc.get("replayed_tau"):
            lines.append(
                f"{'oracle':>8}: tau {orc['replayed_tau']:.2f} if every pick were right whenever the "
                f"target's token is in the draft's top-{orc['top_k']} (teacher-forced replay; the "
                "selector's ceiling)"
            )
    if report.get("draft_vocab"):
        dv = report["draft_vocab"]
        lines.append(
            f"drafting vocabulary: {dv['size']} of {dv['vocab_size']} tokens ({dv['file']}; the target "
            "verifies with its full head)"
        )
    lines += replay_lines(report.get("replay"))
    lines += block_size_lines(report.get("served_block_sizes"))
    if any("interval" in r for blk in blocks.values() for r in blk["paths"].values()):
        lines.append("[lo, hi]: 95% bootstrap interval over prompts")
    if report.get("llama.cpp"):
        from dflash2_lightning.evaluate.llama_cpp import summary_line

        lines.append(summary_line(report["llama.cpp"]))
    return lines + list(report.get("notes", []))
