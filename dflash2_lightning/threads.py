"""How many torch CPU threads to run, and whether a timing taken on this machine can be trusted.

Shared by ``dflash2 quickstart`` (before every step) and ``dflash2 eval`` (whose speed-up figures are
only as good as the machine was quiet).
"""

from __future__ import annotations

import math
import os
import time


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (rounded), or None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on every platform
        return None


def fast_bf16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): then bf16 matmuls run several
    times faster than float32 ones; elsewhere they are emulated and slower.
    Read from ``/proc/cpuinfo``; False where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def own_load(previous: float, threads: int, seconds: float) -> float:
    """This process's share of the 1-minute load average after running ``threads`` busy threads for ``seconds``.

    The kernel's 1-minute average is an exponential moving average with a 60 s time constant, so
    what this process has put into it decays by ``exp(-seconds / 60)`` and the threads it ran fill the rest.
    A 1-second step (a reused result) adds almost nothing; 5 minutes of two threads add ~2.
    """
    decay = math.exp(-max(0.0, seconds) / 60.0)
    return previous * decay + threads * (1.0 - decay)


def _cpu_times() -> tuple[float, float] | None:
    """``(all, idle)`` jiffies of all CPUs from ``/proc/stat`` (idle includes iowait), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:9]]  # user..steal; guest is inside user
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    return sum(fields), fields[3] + fields[4]


def busy_cores(window: float = 1.0) -> float | None:
    """How many cores were busy over the next ``window`` seconds (all processes), or None off Linux.

    The load average lags: a job that ended a minute ago still counts ~1/e of its threads in it, so
    a step started right after ``pip install`` or another run would give up a core it could use.
    """
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(window)
    after = _cpu_times()
    if after is None or after[0] <= before[0]:
        return None
    share = 1.0 - (after[1] - before[1]) / (after[0] - before[0])
    return max(0.0, share) * (os.cpu_count() or 1)


def auto_threads(available: int, own: float = 0.0, window: float = 1.0) -> int:
    """Torch threads for the next step: ``available`` cores minus those other processes keep busy (>= 1).

    Other processes' load is the 1-minute load average less ``own`` (this process's own share of it,
    :func:`own_load`), or what a ``window``-second sample of the CPUs shows busy now (:func:`busy_cores`;
    this process is idle between steps) where that is less: the average still remembers jobs that have
    ended. Why not simply all cores: torch's CPU threads wait on each other at every operation, so one
    thread sharing its core with a busy process stalls them all; on a 2-core machine with one other busy
    process, two threads run several times slower than one.
    """
    load = load_average()
    others = max(0.0, load[0] - own) if load else 0.0
    if others >= 0.75 and window > 0:  # only sample when the average would take a core away
        now = busy_cores(window)
        if now is not None:
            others = min(others, now)
    return max(1, available - int(others + 0.25))


def timing_warning(
    threads: int, cores: int, load_start: list[float] | None, load_end: list[float] | None, own_start: float = 0.0
) -> str | None:
    """Why timings taken with ``threads`` torch threads on ``cores`` cores may not hold, or None.

    ``load_start`` is the load average before the timed work (``own_start`` of it this process's own,
    e.g. the quickstart's training step just before), ``load_end`` after it (this process's ``threads``
    included). Other processes' load is the larger of the start and
    the end less our threads; the timing is suspect when our threads and theirs exceed the cores.
    """
    if load_start is None and load_end is None:
        return None
    others = max((load_start[0] - own_start) if load_start else 0.0, (load_end[0] - threads) if load_end else 0.0, 0.0)
    if threads + others <= cores + 0.5:
        return None
    return (
        f"timings may not be trusted: {threads} torch thread(s) on {cores} core(s) while other processes kept "
        f"about {others:.1f} core(s) busy (load average {load_start} -> {load_end}); speed-ups measured on a "
        "busy machine can be far off either way, rerun on an idle machine"
        + (" (or with --threads 1)" if threads > 1 else "")
    )
