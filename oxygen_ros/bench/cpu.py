"""CPU over a measured window: other processes' load, and a process's CPU split by thread.

OtherLoad says whether a measurement shared the cores with other work; ThreadCpu and
cpu_between measure the node's CPU outside its control thread. Every figure comes from
runtime/procfs.py, the package's one reader of /proc.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import threading
import time

from oxygen_ros.runtime.control import THREAD_NAME
from oxygen_ros.runtime.procfs import machine_busy_s, process_cpu_s, thread_cpu

CONTROL_THREAD_NAME = THREAD_NAME      # native name of the node's control thread


class OtherLoad:
    """CPU used by other processes while a block of work ran, in % of all cores.

    Machine busy time (/proc/stat) minus this benchmark's own CPU: this process and its reaped
    children (rusage), its live multiprocessing children (parallel baseline and robots workers)
    and `pids`, the children started as commands (node, stand-in robot, monitor), which are not
    reaped while measured, so rusage does not count them yet; a gone one makes the figure NaN.
    A few % is background; tens of % mean the measured frames competed for the cores.
    """

    def __init__(self, pids: tuple[int, ...] | list[int] = ()):
        self.pids = tuple(pids)
        self._start = self._snapshot()

    def _own_cpu_s(self) -> float:
        own = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            own += usage.ru_utime + usage.ru_stime
        for child in multiprocessing.active_children():   # not reaped yet: not in rusage
            cpu_s = process_cpu_s(child.pid)
            own += 0.0 if math.isnan(cpu_s) else cpu_s    # ended just now: in rusage soon
        return own + sum(process_cpu_s(pid) for pid in self.pids)

    def _snapshot(self) -> tuple[float, float, float]:
        return machine_busy_s(), self._own_cpu_s(), time.monotonic()

    def percent(self) -> float:
        busy, own, now = self._snapshot()
        busy0, own0, start = self._start
        cores = os.cpu_count() or 1
        share = 100 * ((busy - busy0) - (own - own0)) / ((now - start) * cores)
        return share if math.isnan(share) else max(0.0, share)   # NaN: unknown, not 0


class ThreadCpu:
    """CPU seconds of each thread of a process, by native thread name, sampled from /proc.

    A background thread re-reads /proc/<pid>/task every `interval_s`, so threads that end
    between two marks still count with their last sample.
    """

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.pid = pid
        self.interval_s = interval_s
        self._seen: dict[int, tuple[str, float]] = {}   # tid -> (name, CPU seconds)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='bench_cpu_sampler',
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        threads = thread_cpu(self.pid)
        if threads is None:
            return   # the process is gone: keep the last samples
        with self._lock:
            self._seen.update(threads)

    def mark(self) -> tuple[float, dict[int, tuple[str, float]]]:
        """(monotonic time, per-thread CPU) now: one end of a window."""
        self.poll()
        with self._lock:
            return time.monotonic(), dict(self._seen)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


def cpu_between(start, end, control_name: str = CONTROL_THREAD_NAME) -> dict:
    """CPU of a window between two ThreadCpu marks, in % of one core, split by thread name.

    A thread is classed by its name at the end of the window (the control thread may be
    renamed after it started).
    """
    (t0, before), (t1, after) = start, end
    wall = max(t1 - t0, 1e-9)
    by_name: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        used = seconds - (before[tid][1] if tid in before else 0.0)
        by_name[name] = by_name.get(name, 0.0) + max(used, 0.0)
    total = sum(by_name.values())
    control = by_name.get(control_name)
    return {
        'wall_s': wall,
        'total_pct': 100 * total / wall,
        'control_pct': math.nan if control is None else 100 * control / wall,
        'outside_control_pct': math.nan if control is None else 100 * (total - control) / wall,
        'control_thread_found': control is not None,
        'by_name_pct': {name: 100 * s / wall for name, s in sorted(
            by_name.items(), key=lambda item: -item[1])},
    }
