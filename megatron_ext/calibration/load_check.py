"""Load detection for CPU benchmarks on a shared machine: load average and a reference loop.

A benchmark calls `LoadLog.checkpoint(label)` before, between and after its phases. Each
checkpoint records the 1-minute load average and the time of a fixed single-process reference
loop (pure Python, so neither BLAS threads nor the benchmark's own tensors affect it): on a
time-sliced CPU the loop slows in proportion to the processes competing for a core, whatever
they are. `verdict()` compares the checkpoints: when the slowest reference loop is more than
`max_swing` times the fastest, the load changed during the run, the profile and the
measurements saw different machines, and the figures are not comparable with another run's.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

REFERENCE_ITERATIONS = 300_000
"""About 16 ms of one core on the project's CPU machine when a core is free (docs/benchmarks.md)."""


def reference_loop_s(repeats: int = 5) -> float:
    """Median time of a fixed pure-Python loop (the median ignores one lucky or unlucky slice)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(REFERENCE_ITERATIONS):
            total += i * i % 7
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    label: str
    """Where in the benchmark: 'start', 'round 1 after profile', ..."""
    wall_s: float
    """Seconds since the log began."""
    load_avg_1m: float
    """os.getloadavg()[0] at the checkpoint (includes the benchmark's own finished work)."""
    reference_s: float
    """reference_loop_s() at the checkpoint."""


@dataclass(kw_only=True, slots=True)
class LoadLog:
    max_swing: float = 1.5
    """Largest allowed ratio of the slowest to the fastest reference loop."""
    settle_s: float = 1.5
    """Pause before each checkpoint's reference loop: the benchmark's own ranks leave the machine
    for ~0.5 s after they report (their memory is returned), and a loop run at once read 24 ms
    against 16, refusing runs for their own aftermath."""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    def checkpoint(self, label: str) -> Checkpoint:
        time.sleep(self.settle_s)
        point = Checkpoint(label=label, wall_s=time.perf_counter() - self.start,
                           load_avg_1m=os.getloadavg()[0], reference_s=reference_loop_s())
        self.checkpoints.append(point)
        return point

    def swing(self) -> float:
        refs = [c.reference_s for c in self.checkpoints]
        return max(refs) / min(refs) if refs else 1.0

    def stable(self) -> bool:
        return self.swing() <= self.max_swing

    def verdict(self, consequence: str = "figures not reported") -> str:
        """One line: the spread of the reference loop and the load average, and what it means."""
        refs = [c.reference_s * 1e3 for c in self.checkpoints]
        loads = [c.load_avg_1m for c in self.checkpoints]
        spread = (f"reference loop {min(refs):.0f}-{max(refs):.0f} ms ({self.swing():.2f}x), "
                  f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
        if self.stable():
            return f"load steady: {spread}"
        return (f"load changed during the run: {spread} (allowed {self.max_swing:.2f}x); "
                f"figures taken at different loads are not comparable, {consequence}")

    def to_dict(self) -> dict:
        return {"max_swing": self.max_swing, "swing": self.swing(), "stable": self.stable(),
                "checkpoints": [asdict(c) for c in self.checkpoints]}

    def table(self) -> str:
        rows = [f"{'checkpoint':<34}{'t s':>8}{'load 1m':>9}{'ref ms':>8}"]
        rows += [f"{c.label:<34}{c.wall_s:>8.0f}{c.load_avg_1m:>9.1f}{c.reference_s * 1e3:>8.1f}"
                 for c in self.checkpoints]
        return "\n".join(rows)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def machine_facts() -> dict[str, object]:
    """What about this machine moves CPU benchmark figures: CPU model, cores, the frequency
    governor and current/max frequency where the kernel exposes them (None in most VMs), the
    load average; one line of it is printed beside the figures."""
    cpuinfo = _read("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), None)
    mhz = [float(line.split(":", 1)[1]) for line in cpuinfo.splitlines()
           if line.startswith("cpu MHz")]
    freq = "/sys/devices/system/cpu/cpu0/cpufreq/"
    max_khz = _read(freq + "cpuinfo_max_freq")
    return {"cpu_model": model, "cpus": os.cpu_count(),
            "governor": _read(freq + "scaling_governor"),
            "cpu_mhz": statistics.median(mhz) if mhz else None,
            "max_mhz": int(max_khz) / 1e3 if max_khz and max_khz.isdigit() else None,
            "load_avg": list(os.getloadavg())}


def machine_line(facts: dict[str, object]) -> str:
    """`machine_facts` in one line."""
    def shown(key: str, unit: str = "") -> str:
        value = facts.get(key)
        return "not exposed" if value is None else f"{value}{unit}"
    load = facts.get("load_avg") or []
    loads = ", ".join(f"{x:.2f}" for x in load) if isinstance(load, list) else "?"
    return (f"machine: {shown('cpu_model')}, {shown('cpus')} cores, governor "
            f"{shown('governor')}, {shown('cpu_mhz', ' MHz')} (max {shown('max_mhz', ' MHz')}),"
            f" load average {loads}")
