"""runtime/procfs.py, the one reader of /proc, and the benchmark's OtherLoad built on it."""

import math
import os
from pathlib import Path
import subprocess
import sys
import threading

import pytest

from oxygen_ros.bench.cpu import OtherLoad
from oxygen_ros.runtime import procfs

pytestmark = pytest.mark.skipif(not Path('/proc/self/task').is_dir(), reason='needs Linux /proc')


@pytest.fixture(scope='module')
def gone_pid():
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, '-c', 'pass'])
    child.wait()
    return child.pid


def test_cpu_time_of_this_process_and_its_threads_grows_with_work():
    before = procfs.process_cpu_s()
    threads = procfs.thread_cpu()
    assert threading.get_native_id() in threads
    name, seconds = threads[threading.get_native_id()]
    assert name and seconds >= 0
    work_until = before + 0.05
    while procfs.process_cpu_s() < work_until:   # busy until the clock ticks past 50 ms
        sum(range(10_000))
    assert procfs.process_cpu_s() > before
    assert procfs.thread_cpu()[threading.get_native_id()][1] > seconds
    assert procfs.machine_busy_s() > 0


def test_memory_figures():
    rss_kb = procfs.status_kb('VmRSS')
    assert rss_kb > 1024 and procfs.status_kb('VmHWM') >= rss_kb
    assert 0 < procfs.meminfo_kb('MemAvailable') <= procfs.meminfo_kb('MemTotal')
    assert procfs.status_kb('NoSuchField') == 0 and procfs.meminfo_kb('NoSuchField') is None
    procfs.reset_peak_rss()   # never raises; on Linux 4.0+ VmHWM drops to about VmRSS
    assert procfs.status_kb('VmHWM') > 0


def test_a_gone_process_reads_as_unknown_not_an_error(gone_pid):
    assert math.isnan(procfs.process_cpu_s(gone_pid))
    assert procfs.thread_cpu(gone_pid) is None
    assert procfs.status_kb('VmRSS', gone_pid) == 0
    procfs.reset_peak_rss(gone_pid)


def test_other_load_leaves_our_own_work_out_and_is_unknown_when_a_child_is_gone(gone_pid):
    load, with_gone = OtherLoad(), OtherLoad([os.getpid(), gone_pid])
    work_until = procfs.process_cpu_s() + 0.2
    while procfs.process_cpu_s() < work_until:   # 0.2 s of our own CPU: a window of ticks
        sum(range(10_000))
    cores = os.cpu_count() or 1
    # Our own 0.2 s is subtracted; what is left (other processes) fits on the cores, within
    # the clock ticks' resolution of /proc/stat.
    assert 0.0 <= load.percent() <= 100.0 * cores + 10.0
    assert math.isnan(with_gone.percent())
