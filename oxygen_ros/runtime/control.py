"""The control thread: runs the frame loop's tick on a thread of its own, woken from outside.

Why a thread of its own: inference is Python between torch ops, and an executor that spins
next to it (rclpy's MultiThreadedExecutor does while a callback group is busy) takes the GIL
from it; measured 2.2x slower inference inside the node. Here the executor only serves I/O and
a timer whose callback is `trigger()` (one Event.set), so the model never shares the GIL with
a busy loop, and pacing stays with the node clock (sim time included: with a paused /clock the
timer does not fire and the loop pauses).

Hard rate, never a queue: triggers that arrive while a tick runs collapse into one wake-up, so
an overrun is followed by at most one immediate (late) tick; the others are counted as dropped.
Nothing here polls: while no trigger comes the thread sleeps on the Event.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Callable

from oxygen_ros.runtime.procfs import thread_cpu

logger = logging.getLogger(__name__)

THREAD_NAME = 'oxy_control'   # native thread name (top -H, /proc/<pid>/task/*/comm)
_PR_SET_NAME = 15


def set_native_thread_name(name: str) -> None:
    """Name the calling OS thread (Linux; a no-op elsewhere). Threads it starts inherit it.

    torch's OpenMP workers are started by the thread that first runs a parallel region, so
    naming the control thread before its first model call names inference's threads too.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):   # not Linux
        pass


def set_thread_nice(nice: int) -> str:
    """Set the calling thread's nice value (Linux: per thread); return '' or why it failed.

    A control loop that shares the cores with camera drivers and the executor must not be
    the one that waits: a lower nice value gives it the CPU first. Threads it starts later
    (torch's workers) inherit the value. Lowering below 0 needs root or CAP_SYS_NICE.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as err:
        return (f'control thread priority (nice {nice}) not set: {err}; run with '
                'CAP_SYS_NICE (or as root) to give the control loop the CPU first')
    return ''


def set_thread_realtime(priority: int) -> str:
    """Put the calling thread under SCHED_FIFO at `priority` (1-99); return '' or why not.

    Stronger than a nice value: a runnable FIFO thread takes its core from every normal thread
    at once (camera drivers, DDS, other processes), as ros2_control's controller_manager does
    for its loop. The kernel's RT throttling (sched_rt_runtime_us, 95% by default) still
    leaves the other threads of that core a share. Needs CAP_SYS_NICE or an rtprio limit.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as err:
        return (f'control thread real-time priority (SCHED_FIFO {priority}) not set: {err}; '
                'grant CAP_SYS_NICE or an rtprio limit (limits.conf), or set '
                'control_priority 0')
    return ''


class ControlThread:
    """Runs `tick()` once per `trigger()`, on a dedicated thread, until `stop()`.

    tick must not raise (it is the adapter's job to catch and report); an exception that
    escapes anyway is logged and the thread keeps serving triggers.
    """

    def __init__(self, tick: Callable[[], None], name: str = THREAD_NAME, nice: int = 0,
                 realtime_priority: int = 0):
        self._tick = tick
        self._name = name
        self._nice = nice
        self._realtime_priority = realtime_priority   # SCHED_FIFO priority; 0 = normal
        self.priority_note = ''   # why the asked priority could not be set ('' when it was)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.ticks = 0          # ticks run
        self.late = 0           # triggers that came while a tick ran: their tick started late
        self.dropped = 0        # triggers that came while a wake-up was pending: no tick of own

    @property
    def stopping(self) -> bool:
        """True from the moment stop() was called (a running tick may check it)."""
        return self._stopping.is_set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        assert self._thread is None, 'control thread already started'
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def trigger(self) -> None:
        """Ask for one tick now (cheap, never blocks; safe from any thread)."""
        if self._wake.is_set():
            self.dropped += 1
        elif self._busy:
            self.late += 1
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the running tick (if any); return whether the thread has ended."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            logger.error('control thread still running %.1f s after stop (a tick is stuck)',
                         timeout_s)
            return False
        return True

    def _run(self) -> None:
        set_native_thread_name(self._name)
        notes = []
        if self._nice:   # also under FIFO: it is what the thread falls back to if refused
            notes.append(set_thread_nice(self._nice))
        if self._realtime_priority:
            notes.append(set_thread_realtime(self._realtime_priority))
        self.priority_note = '; '.join(n for n in notes if n)
        while True:
            self._wake.wait()
            if self._stopping.is_set():
                return
            self._wake.clear()
            self._busy = True
            try:
                self._tick()
            except Exception:   # noqa: BLE001 - the loop must survive a bad tick
                logger.exception('control tick raised')
            finally:
                self._busy = False
                self.ticks += 1


class CpuSplit:
    """CPU use of this process split into the control thread (and its torch workers) vs the rest.

    Reads /proc/self/task/*/{comm,stat}; threads named THREAD_NAME are the control side (the
    torch OpenMP workers the control thread starts inherit its name). `sample()` returns the
    percent of one core each side used since the previous call (None on systems without /proc).
    """

    def __init__(self, name: str = THREAD_NAME):
        self.name = name
        self._last: tuple[float, float, float] | None = None

    def totals(self) -> tuple[float, float] | None:
        """Cumulative CPU seconds (control side, everything else) of the live threads."""
        threads = thread_cpu()
        if threads is None:
            return None
        control = sum(s for name, s in threads.values() if name == self.name)
        other = sum(s for name, s in threads.values() if name != self.name)
        return control, other

    def sample(self) -> tuple[float, float] | None:
        """Return (control %, other %) of one core since the last call (None: first / no /proc)."""
        totals = self.totals()
        if totals is None:
            return None
        now = time.monotonic()
        last, self._last = self._last, (now, *totals)
        if last is None or now - last[0] <= 0:
            return None
        span = now - last[0]
        # A thread that ended took its CPU with it: clamp at 0 instead of going negative.
        return tuple(max(100.0 * (new - old) / span, 0.0) for new, old in zip(totals, last[1:]))
