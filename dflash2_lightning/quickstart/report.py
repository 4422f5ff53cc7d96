"""What a quickstart prints: numbered step lines with their wall and CPU time, and the final summary."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from dflash2_lightning.threads import auto_threads, own_load


class Reporter:
    """Numbered one-line status messages and the wall time of every step.

    ``threads`` (a fixed count, or None for :func:`auto_threads`) is applied as each step starts, so an
    automatic choice follows the machine's load through a long run.
    """

    def __init__(self, total: int, stream: Any = None, threads: int | None = None) -> None:
        self.total, self.stream, self.threads = total, stream, threads
        self.timings: dict[str, dict[str, Any]] = {}
        self._n = 0
        self._cores: int | None = None
        # This process's share of the 1-minute load average (threads.own_load), updated as each step ends.
        self.own_load = 0.0

    def say(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def set_threads(self) -> int:
        """Apply the thread count for the next step (the cores other processes leave free, when automatic)."""
        import torch

        if self._cores is None:
            self._cores = torch.get_num_threads()  # torch's own default: the physical cores
        n = self.threads if self.threads is not None else auto_threads(self._cores, self.own_load)
        torch.set_num_threads(n)
        return n

    def step(self, name: str, text: str) -> _Step:
        self._n += 1
        threads = self.set_threads()
        self.say(f"[{self._n}/{self.total}] {name} ({threads} thread{'s' if threads > 1 else ''}): {text}")
        return _Step(self, name, threads)


class _Step:
    def __init__(self, reporter: Reporter, name: str, threads: int) -> None:
        self.reporter, self.name, self.threads = reporter, name, threads
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def done(self, text: str, reused: bool = False) -> float:
        seconds = time.perf_counter() - self.start
        # CPU seconds of all this process's threads: on a shared machine, wall time alone overstates the cost.
        cpu = time.process_time() - self.cpu_start
        self.reporter.own_load = own_load(self.reporter.own_load, self.threads, seconds)
        self.reporter.timings[self.name] = {
            "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu, 1),
            "threads": self.threads,
            "reused": reused,
        }
        self.reporter.say(f"      {self.name}: {text} ({format_seconds(seconds)}{', reused' if reused else ''})")
        return seconds


def format_seconds(seconds: float) -> str:
    """``73.2`` -> ``"1m13s"``; under a minute ``"12.3s"``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


def last_validation(metrics_csv: Path) -> dict[str, float]:
    """The last logged ``val/*`` values of a Lightning CSVLogger ``metrics.csv`` ({} if none)."""
    import csv

    if not metrics_csv.is_file():
        return {}
    values: dict[str, float] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key and key.startswith("val/") and value not in ("", None):
                    values[key] = float(value)
    return values


def serving_check_line(result: dict[str, Any]) -> str:
    """One line: the served τ beside the expected one with its interval, and the verdict."""
    if "error" in result:
        return f"check-serving could not run: {result['error']}"
    served, e = result.get("served") or {}, result["expected"]
    lo, hi = e["interval"]
    tau = f"{served['tau']:.2f}" if served.get("tau") is not None else "-"
    iv = f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
    return (
        f"check-serving ({result['engine']}, target {Path(result['target_gguf']).name}): served tau {tau} vs "
        f"expected {e['tau']:.2f}{iv} on {e['prompts']} prompts, outputs {result['outputs_equal']}/{e['prompts']} "
        f"equal: {'agree' if result['agree'] else 'DISAGREE (' + result['problems'][0]['message'] + ')'}"
    )


def summary_text(s: dict[str, Any]) -> str:
    """The human-readable summary of a finished quickstart (from the ``summary.json`` dict)."""
    r, a = s["eval"], s["artifacts"]
    lines = [
        "",
        f"DFlash2 quickstart: {s['draft']['architecture']} draft ({s['draft']['parameters'] / 1e6:.1f}M "
        f"parameters, block {s['draft']['block_size']}) for {s['target']}",
    ]
    for t, blk in (r.get("temperatures") or {"0": r}).items():
        base = blk["target_only"]["tokens_per_second"]
        for name, res in blk["paths"].items():
            m, e = res["measured"], res.get("estimated") or {}
            iv = (res.get("interval") or {}).get("tau") or [None, None]
            ci = f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv[0] is not None else ""
            est = f"trainer estimate {e['tau']:.2f}" if e.get("tau") is not None else "no estimate"
            speed = (
                f"{m['tokens_per_second']:.1f} tok/s vs target alone {base:.1f} tok/s ({res['speedup']:.2f}x)"
                if m.get("tokens_per_second") and base
                else ""
            )
            lines.append(f"  T={t:<4} tau {name:<8} measured {m['tau']:.2f}{ci}   {est:<22} {speed}")
        orc = blk.get("oracle") or {}
        if orc.get("replayed_tau"):
            lines.append(
                f"  T={t:<4} tau top-{orc['top_k']} oracle {orc['replayed_tau']:.2f} (teacher-forced: right whenever the "
                f"target's token is among the draft's top-{orc['top_k']}; the selector's ceiling)"
            )
    from dflash2_lightning.evaluate.report import replay_lines

    lines += replay_lines(r.get("replay"), indent="  ")
    if r.get("temperatures"):
        lines.append("  [lo, hi]: 95% bootstrap interval over the evaluation prompts")
    val = s.get("validation_tau")
    if val:
        lines.append("  training validation tau: " + ", ".join(f"{k} {v:.2f}" for k, v in val.items()))
    checked = [
        res["lossless"]
        for blk in (r.get("temperatures") or {"0": r}).values()
        for res in blk["paths"].values()
        if res["lossless"] is not None
    ]  # greedy runs only: sampled outputs are not compared token by token
    verdict = (
        "NO"
        if not all(checked)
        else "yes, every greedy speculative output equals the target greedy output"
        if checked
        else "not checked (no greedy run)"
    )
    lines.append(f"  lossless: {verdict} ({r['prompts']} prompts, {r['generated_tokens']} tokens)")
    if r.get("llama.cpp"):
        from dflash2_lightning.evaluate.llama_cpp import summary_line

        lines.append("  " + summary_line(r["llama.cpp"]))
    if s.get("serving_check"):
        lines.append("  " + serving_check_line(s["serving_check"]))
    timing = ", ".join(
        f"{k} {format_seconds(v['seconds'])}{'*' if v['reused'] else ''}" for k, v in s["timings"].items()
    )
    lines.append(
        f"  time: {timing}; total {format_seconds(s['total_seconds'])}"
        + ("  (* reused)" if any(v["reused"] for v in s["timings"].values()) else "")
    )
    lines += ["", "Artifacts"]
    width = max(len(k) for k in a)
    lines += [f"  {k:<{width}}  {v}" for k, v in a.items()]
    lines += [
        "",
        f"Train again: dflash2 fit --config {a['fit config']}",
        f"Evaluate again: dflash2 eval --draft {a['draft checkpoint (HF)']} --target {s['target_arg']} "
        f"--out {Path(a['eval report']).parent}",
    ]
    return "\n".join(lines)
