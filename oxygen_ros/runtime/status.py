"""The status model: control-loop statistics, throttled problem logging, diagnostic statuses.

ROS-free: the frame loop feeds LoopStats, everyone reports problems to ProblemLog, and
`build_statuses(...)` gives the statuses that the node renders as /diagnostics
(oxygen_ros.ros.diagnostics) and the bag replay writes into its output bag.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import threading
import time
from typing import Callable

import numpy as np

OK, WARN, ERROR, STALE = 0, 1, 2, 3
MAX_MESSAGE_CHARS = 300   # longer log / diagnostic messages are cut
LEVEL_NAMES = {OK: 'OK', WARN: 'WARN', ERROR: 'ERROR', STALE: 'STALE'}


# --- loop statistics -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Tick:
    start: float            # monotonic seconds
    duration: float         # tick wall time
    latency: float | None   # tick start -> action chunk published (None: no action this tick)
    inference: float | None  # engine's observation -> actions time
    tokens: int             # tokens published this tick
    missed: bool            # tick overran its period
    cpu_share: float | None = None   # act()'s CPU time on the calling thread / its wall time


class LoopStats:
    """Rolling statistics of the control loop over the last `window_s` seconds."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()   # the tick records, the diagnostics timer reads
        self._ticks: collections.deque[_Tick] = collections.deque()
        # (time, {finish reason: count}) of language requests that ended
        self._ended: collections.deque[tuple[float, dict]] = collections.deque()
        self.ticks_total = 0
        self.actions_total = 0
        self.tokens_total = 0
        self.deadline_misses_total = 0
        self.skipped_total = 0              # ticks without an action chunk
        self.errors_total = 0               # ticks that raised inside the engine
        self.last_error = ''
        self.last_action_s: float | None = None   # monotonic time of the last action chunk

    def record(self, start: float, duration: float, period_s: float, latency: float | None,
               inference: float | None, tokens: int, cpu_share: float | None = None,
               ended: dict[str, int] | None = None, late_s: float = 0.0) -> bool:
        """Record one tick; return whether it missed its deadline.

        A tick misses when it ends later than one period after the robot's grid tick:
        late_s (how far behind that tick it started, e.g. another robot's tick ran) plus its
        duration exceed the period. cpu_share: the share of act()'s wall time its thread spent
        on a CPU (None: not measured). Near 1 the model ran the whole time; well below 1 it
        waited for a core (or the GIL), which is what a late tick's remedy depends on. ended:
        the language requests that ended this tick, by finish reason.
        """
        missed = late_s + duration > period_s
        with self._lock:
            self._ticks.append(_Tick(start, duration, latency, inference, tokens, missed,
                                     cpu_share))
            if ended:
                self._ended.append((start, dict(ended)))
            self.ticks_total += 1
            self.tokens_total += tokens
            self.deadline_misses_total += missed
            if latency is None:
                self.skipped_total += 1
            else:
                self.actions_total += 1
                self.last_action_s = start + latency
            self._trim(start)
        return missed

    def record_ended(self, now: float, ended: dict[str, int]) -> None:
        """Record language requests that ended outside one of this loop's ticks."""
        if ended:
            with self._lock:
                self._ended.append((now, dict(ended)))
                self._trim(now)

    def record_error(self, message: str) -> None:
        with self._lock:
            self.errors_total += 1
            self.last_error = message

    def reset(self) -> None:
        with self._lock:
            self._ticks.clear()
            self._ended.clear()
            self.ticks_total = self.actions_total = self.tokens_total = 0
            self.deadline_misses_total = self.skipped_total = self.errors_total = 0
            self.last_error = ''
            self.last_action_s = None

    def _trim(self, now: float) -> None:
        while self._ticks and self._ticks[0].start < now - self.window_s:
            self._ticks.popleft()
        while self._ended and self._ended[0][0] < now - self.window_s:
            self._ended.popleft()

    def snapshot(self) -> dict:
        """Rates, percentiles and counters over the window (numbers only)."""
        now = self.clock()
        with self._lock:
            self._trim(now)
            ticks = list(self._ticks)
            ended_events = list(self._ended)
        span = min(self.window_s, max(now - ticks[0].start, 1e-9)) if ticks else self.window_s
        latencies = [t.latency for t in ticks if t.latency is not None]
        inference = [t.inference for t in ticks if t.inference is not None]
        shares = [t.cpu_share for t in ticks if t.cpu_share is not None]
        late_shares = [t.cpu_share for t in ticks if t.missed and t.cpu_share is not None]

        def pct(values, q):
            return float(np.percentile(values, q)) * 1e3 if values else float('nan')
        ended = collections.Counter()
        for _, counts in ended_events:
            ended.update(counts)
        completed = ended['eos'] + ended['length']
        return {
            'tick_rate_hz': len(ticks) / span if ticks else 0.0,
            'action_rate_hz': len(latencies) / span if ticks else 0.0,
            'tokens_per_s': sum(t.tokens for t in ticks) / span if ticks else 0.0,
            # language requests that ended in the window: completed (eos or length: one
            # narration each), preempted for the action path, refused at admission, failed
            'requests_completed_window': completed,
            'requests_evicted_window': ended['evicted'],
            'requests_refused_window': ended['refused'],
            'requests_error_window': ended['error'],
            'completed_per_min': 60.0 * completed / span if ticks else 0.0,
            'deadline_misses_window': sum(t.missed for t in ticks),
            'ticks_window': len(ticks),
            'window_s': self.window_s,
            'latency_p50_ms': pct(latencies, 50),
            'latency_p99_ms': pct(latencies, 99),
            'inference_p50_ms': pct(inference, 50),
            'tick_p99_ms': pct([t.duration for t in ticks], 99),
            'act_cpu_share_p50': float(np.median(shares)) if shares else float('nan'),
            'late_act_cpu_share_p50': (float(np.median(late_shares)) if late_shares
                                       else float('nan')),
            'ticks_total': self.ticks_total,
            'actions_total': self.actions_total,
            'skipped_total': self.skipped_total,
            'tokens_total': self.tokens_total,
            'deadline_misses_total': self.deadline_misses_total,
            'errors_total': self.errors_total,
            'last_error': self.last_error,
            'since_last_action_s': (now - self.last_action_s) if self.last_action_s else None,
        }


# --- problem logging -----------------------------------------------------------------------------
def _shape(message: str) -> str:
    """Drop the numbers: 'stale, 0.61 s ago' and 'stale, 0.72 s ago' are one problem."""
    return re.sub(r'\d+(\.\d+)?', '#', message)


class ProblemLog:
    """Log each problem when it appears, repeat it at most every `repeat_s`, log its end.

    A tick sees the same stale camera ten times a second; the log shows it once, then a
    reminder with a count, then 'resolved'. `history` keeps what was logged (for tests).
    """

    def __init__(self, log: Callable[[int, str], None], repeat_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, history: int = 200,
                 min_change_s: float = 1.0):
        self.log = log
        self.repeat_s = repeat_s
        # A problem whose text keeps changing (a sender cycling through bad strings) is logged
        # at most once per min_change_s per input, not once per distinct text.
        self.min_change_s = min_change_s
        self.clock = clock
        # key -> [newest message, last logged, repeats since, last logged as new, last logged text]
        self._open: dict[str, list] = {}
        self._lock = threading.Lock()       # the tick, input callbacks and the engine all log
        self.history: collections.deque[tuple[int, str]] = collections.deque(maxlen=history)

    def _emit(self, level: int, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:   # a 1 MB field must not make a 1 MB log line
            message = message[:MAX_MESSAGE_CHARS - 25] + f'... ({len(message)} chars)'
        self.history.append((level, message))
        self.log(level, message)

    def update(self, group: str, problems: dict[str, str], level: int = WARN) -> None:
        """Set the current problems of `group` (key -> message); others of the group end."""
        with self._lock:
            self._update(group, problems, level)

    def _update(self, group: str, problems: dict[str, str], level: int) -> None:
        now = self.clock()
        for key, message in problems.items():
            full = f'{group}/{key}'
            state = self._open.get(full)
            changed = state is not None and (_shape(state[4]) != _shape(message))
            if state is None or (changed and now - state[3] >= self.min_change_s):
                self._emit(level, message)
                self._open[full] = [message, now, 0, now, message]
            elif changed:
                # A new kind of problem within min_change_s of the last one: logged once that
                # time is up (the newest text), so a cycling sender gets one line a second.
                state[0] = message
                state[2] += 1
            elif now - state[1] >= self.repeat_s:
                self._emit(level, f'{message} (still; {state[2] + 1} times in '
                                  f'{now - state[1]:.0f} s)')
                state[0], state[1], state[2] = message, now, 0
            else:
                state[0] = message   # keep the newest numbers for the 'resolved' line
                state[2] += 1
        for full in [k for k in self._open if k.startswith(group + '/')]:
            if full.split('/', 1)[1] not in problems:
                self._emit(OK, f'resolved: {self._open.pop(full)[0]}')

    def note(self, level: int, message: str) -> None:
        """Log a message now, unthrottled (user-triggered events such as a failed configure)."""
        with self._lock:
            self._emit(level, message)

    def event(self, key: str, level: int, message: str) -> None:
        """Log a one-off problem (e.g. an exception) at most once per repeat_s per key."""
        with self._lock:
            self._event(key, level, message)

    def _event(self, key: str, level: int, message: str) -> None:
        now = self.clock()
        state = self._open.get('event/' + key)
        if state is None or now - state[1] >= self.repeat_s:
            suffix = f' ({state[2]} more since)' if state and state[2] else ''
            self._emit(level, message + suffix)
            self._open['event/' + key] = [message, now, 0, now, message]
        else:
            state[2] += 1

    def active(self, group: str) -> dict[str, str]:
        """Open problems of `group` (key -> message)."""
        with self._lock:
            return {k.split('/', 1)[1]: v[0] for k, v in self._open.items()
                    if k.startswith(group + '/')}


# --- statuses ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Status:
    """One DiagnosticStatus, without message types."""

    level: int
    name: str
    message: str
    values: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _fmt(value) -> str:
    if isinstance(value, float):
        return 'nan' if value != value else f'{value:.3f}'
    return str(value)


def _mib(n: int) -> str:
    return f'{n / (1 << 20):.2f} MiB'


def _loss_text(status) -> str:
    """', 3 of 150 sent lost in transport' (what was measured of it; '' when nothing)."""
    if status.lost is None:
        return f', {status.sent} sent' if status.sent is not None else ''
    sent = f' of {status.sent} sent' if status.sent is not None else ''
    return f', {status.lost}{sent} lost in transport'


WAITED_SHARE = 0.8   # act() on a CPU for less of its wall time than this: it waited for one


def late_tick_hint(share: float | None) -> str:
    """Say why late ticks were late, from act()'s CPU share on them ('' when not measured)."""
    if share is None or math.isnan(share):
        return ''
    if share < WAITED_SHARE:
        return (f'; on late ticks act() ran on a CPU only {share:.0%} of its time: the '
                'control thread waited for a core (raise control_nice / control_priority, '
                'or lower torch_threads)')
    return (f'; on late ticks act() ran on a CPU {share:.0%} of its time: the model itself '
            'is too slow for this rate here (lower control_rate_hz, or a faster device)')


def build_statuses(node: str, lifecycle: str, model: dict, loop: dict | None,
                   target_rate_hz: float, engine: dict | None, inputs: list,
                   input_problems: dict[str, str], instruction, config_error: str = ''
                   ) -> list[Status]:
    """Build the node's diagnostic statuses.

    model: what was loaded (preset/checkpoint/robot/device/...); loop: LoopStats.snapshot();
    engine: {'k', 'active_requests', 'kv_usage', 'finished': {reason: count}, 'budget'} and,
    with a task that drives the actions, 'subtask' (SubtaskLoop.status);
    inputs: InputStatus list; instruction: inputs.Instruction or None.
    """
    statuses = []
    # 1. lifecycle / model
    if config_error:
        statuses.append(Status(ERROR, f'{node}: model', f'{lifecycle}: {config_error}'))
    else:
        level = OK if lifecycle in ('active', 'inactive', 'configuring') else WARN
        statuses.append(Status(level, f'{node}: model', lifecycle,
                               [(k, _fmt(v)) for k, v in model.items()]))
    if lifecycle != 'active' or loop is None:
        return statuses

    # 2. control loop
    values = [('target_rate_hz', _fmt(target_rate_hz))]
    values += [(k, _fmt(v)) for k, v in loop.items()]
    rate = loop['action_rate_hz']
    misses, ticks = loop['deadline_misses_window'], loop['ticks_window']
    since = loop['since_last_action_s']
    if input_problems:
        level, message = ERROR, 'no actions: ' + '; '.join(sorted(input_problems.values()))
    elif since is not None and since > max(2.0, 3.0 / target_rate_hz):
        level, message = ERROR, f'no action chunk for {since:.1f} s: {loop["last_error"]}'
    elif ticks and (misses > 0.1 * ticks or rate < 0.8 * target_rate_hz):
        level = WARN
        message = (f'{rate:.1f} Hz of {target_rate_hz:g} Hz, {misses}/{ticks} ticks over '
                   'deadline' + late_tick_hint(loop.get('late_act_cpu_share_p50')))
    else:
        level, message = OK, f'{rate:.1f} Hz, latency p50 {loop["latency_p50_ms"]:.1f} ms'
    statuses.append(Status(level, f'{node}: control loop', message, values))

    # 3. language and KV cache
    if engine is not None:
        kv = engine['kv_usage']
        finished = engine['finished']
        window = {r: loop.get(f'requests_{r}_window', 0)
                  for r in ('completed', 'evicted', 'refused', 'error')}
        lost = {r: n for r, n in window.items() if r != 'completed' and n}
        lang_level = WARN if lost else OK
        lang_msg = (f"{loop['tokens_per_s']:.1f} tok/s, {engine['active_requests']} active, "
                    f"k={engine['k']}, {window['completed']} requests completed")
        if lost:
            lang_msg += ', ' + ', '.join(f'{n} {r}' for r, n in lost.items())
        if ticks:
            lang_msg += f' in the last {loop.get("window_s", 5.0):g} s'
        statuses.append(Status(lang_level, f'{node}: language', lang_msg, [
            ('tokens_per_s', _fmt(loop['tokens_per_s'])),
            ('active_requests', str(engine['active_requests'])),
            ('current_k', str(engine['k'])), ('decode_budget', str(engine['budget']))]
            + [(f'requests_{r}_window', str(n)) for r, n in window.items()]
            + [('completed_per_min', _fmt(loop.get('completed_per_min', 0.0)))]
            + [(f'finished_{r}', str(n)) for r, n in sorted(finished.items())]
            # requests whose first step did not fit a tick beside higher priorities' work
            + [(f'deferred_{task}', str(n))
               for task, n in sorted(engine.get('deferred', {}).items())]))
        if engine.get('subtask') is not None:
            statuses.append(subtask_status(node, engine['subtask']))
        statuses.append(Status(
            OK if kv['slots_in_use'] < kv['slots_total'] else WARN, f'{node}: kv cache',
            f"{kv['slots_in_use']}/{kv['slots_total']} slots, {_mib(kv['bytes_in_use'])} of "
            f"{_mib(kv['bytes_total'])}", [
                ('slots_used', str(kv['slots_in_use'])), ('slots_total', str(kv['slots_total'])),
                ('bytes_used', str(kv['bytes_in_use'])), ('bytes_total', str(kv['bytes_total'])),
                ('peak_slots', str(kv['peak_slots_in_use']))]
            # generation blocks (one per live request; engine.fleet.kv_usage)
            + [(name, str(kv[key])) for name, key in (
                ('blocks_used', 'blocks_in_use'), ('blocks_total', 'blocks_total'),
                ('block_bytes_used', 'block_bytes_in_use')) if key in kv]))

    # 4. inputs
    bad = [s for s in inputs if s.state != 'ok']
    values = [(s.label, s.state + (f', age {s.age_s:.2f} s' if s.age_s is not None else '')
               + f', {s.count} msgs' + _loss_text(s)) for s in inputs]
    stale = [s.label for s in bad if s.state in ('stale', 'never received')]
    values.append(('stale_or_missing', ', '.join(stale) or 'none'))
    values.append(('lost_in_transport', ', '.join(
        f'{s.label}: {s.lost}' for s in inputs if s.lost) or 'none'))
    if instruction is not None:
        values.append(('instruction', instruction.text[:200]))
    notes = instruction.notes if instruction is not None else []
    warnings = [s.warning for s in inputs if s.warning]
    if input_problems:
        level, message = ERROR, '; '.join(sorted(input_problems.values()) + warnings)
    elif notes or warnings:
        level = WARN
        message = '; '.join(warnings + (['instruction ' + ', '.join(notes)] if notes else []))
    else:
        level, message = OK, 'all inputs fresh'
    statuses.append(Status(level, f'{node}: inputs', message, values))
    return statuses


def subtask_status(node: str, subtask: dict) -> Status:
    """Describe the subtask driving the actions (SubtaskLoop.status); WARN when stale."""
    keys = ('source', 'frame', 'age_s', 'max_age_s', 'adopted', 'empty')
    values = [(key, _fmt(subtask[key])) for key in keys if key in subtask]
    values.insert(1, ('text', subtask.get('text', '')[:200]))
    why = subtask.get('why', '')
    if subtask['source'] == 'subtask':
        age = subtask['age_s']
        message = (f"{subtask['text'][:200]!r} from frame {subtask['frame']}"
                   + (f', {age:.2f} s old' if age is not None else ''))
        return Status(OK, f'{node}: subtask', message, values)
    if why == 'stale':
        return Status(WARN, f'{node}: subtask', (
            f"instruction: the subtask of frame {subtask['frame']} is "
            f"{subtask['age_s']:.2f} s old (> subtask_max_age_s {subtask['max_age_s']:g})"),
            values)
    return Status(OK, f'{node}: subtask', f'instruction: {why}', values)
