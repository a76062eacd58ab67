"""What every benchmark records about the machine it ran on (they are shared and noisy)."""
from __future__ import annotations

import statistics
import time


def median_call_seconds(call, reps: int) -> float:
    """The median wall time of `reps` calls of `call`, after one call not counted (warm-up)."""
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, e.g. "1.23 0.98 0.76" ("?" where unknown)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def cpu_model() -> str:
    """/proc/cpuinfo's model name ("?" where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"
