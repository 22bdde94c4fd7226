"""The one reader of /proc (Linux): CPU time of processes and threads, memory figures.

Used by the node's CPU split (runtime/control.py), the engine setup's free-memory check, the
benchmark and the soak. It lives in runtime/, not bench/, because the runtime needs it and may
not import the benchmark (bench/ sits above runtime/). Nothing here raises where /proc is
missing (not Linux) or a process is gone: each function says what it returns then.

CPU times are utime + stime, fields 14 and 15 of /proc/<pid>/stat (man 5 proc), in clock ticks.
The fields are counted after the ')' that closes the command name, which may hold spaces.
"""

from __future__ import annotations

import math
import os


def _stat_cpu_s(path: str) -> float:
    """Return utime + stime of a /proc/.../stat file in seconds (OSError when it is gone)."""
    with open(path) as stat:
        fields = stat.read().rpartition(')')[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def process_cpu_s(pid: int | str = 'self') -> float:
    """Return the CPU seconds a process used so far (NaN when it is gone or /proc is missing)."""
    try:
        return _stat_cpu_s(f'/proc/{pid}/stat')
    except (OSError, IndexError, ValueError):
        return math.nan


def thread_cpu(pid: int | str = 'self') -> dict[int, tuple[str, float]] | None:
    """Return {thread id: (native name, CPU seconds)} of a process's threads.

    None when the process (or /proc) is gone; threads that end while being read are skipped.
    """
    task_dir = f'/proc/{pid}/task'
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f'{task_dir}/{tid}/comm') as comm:
                name = comm.read().strip()
            out[int(tid)] = (name, _stat_cpu_s(f'{task_dir}/{tid}/stat'))
        except (OSError, IndexError, ValueError):
            continue
    return out


def machine_busy_s() -> float:
    """Return the CPU seconds all cores were busy since boot: not idle, not iowait (NaN: none)."""
    try:
        with open('/proc/stat') as stat:
            fields = [float(v) for v in stat.readline().split()[1:]]
    except OSError:
        return math.nan
    idle = fields[3] + fields[4]   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf('SC_CLK_TCK')


def status_kb(field: str, pid: int | str = 'self') -> int:
    """Return a `Vm*` field of /proc/<pid>/status (VmRSS, VmHWM, ...) in KiB (0: not there)."""
    try:
        with open(f'/proc/{pid}/status') as status:
            for line in status:
                if line.startswith(field + ':'):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss(pid: int | str = 'self') -> None:
    """Reset the resident high-water mark VmHWM to the current RSS (Linux 4.0+; else nothing)."""
    try:
        with open(f'/proc/{pid}/clear_refs', 'w') as refs:
            refs.write('5')
    except OSError:
        pass


def meminfo_kb(field: str) -> int | None:
    """Return a field of /proc/meminfo (MemAvailable, MemTotal, ...) in KiB (None: not there)."""
    try:
        with open('/proc/meminfo') as meminfo:
            for line in meminfo:
                if line.startswith(field + ':'):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_model() -> str | None:
    """Return the first CPU's model name from /proc/cpuinfo (None when not available)."""
    try:
        with open('/proc/cpuinfo') as info:
            return next(line.split(':', 1)[1].strip() for line in info
                        if line.startswith('model name'))
    except (OSError, StopIteration):
        return None
