"""Language under overload: oxygen_node with the shipped YAML, then asked 2x what it holds.

Two runs of the node as its own process, each next to a monitor and a stand-in robot (the
node part's processes and camera options, bench/node.py):

  1. defaults   config/<robot>.yaml as it is: control_rate_hz 0 (auto: 90% of what the node
                timed at configure) and the adaptive decode budget. Figures: the capacity the
                node reports (its model status), the time from the instruction reaching the
                monitor to the first narration, narrations per window.
  2. overload   the same YAML with control_rate_hz = `factor` x the capacity run 1 reported:
                the action path alone overruns every tick, the adaptive budget gives k = 0 and
                language progresses by the scheduler's minimum only. Figures: the first
                narration, the narrations in every `window_s` window (target: at least one in
                each), the requests the node counted completed, refused and evicted.

Times are the monitor's receive times (CLOCK_MONOTONIC); the measured span starts at the
node's first action chunk plus `warmup_s`, and its windows from there.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
import queue

from .node import (_sleep_until, _wait_event, Child, child_environment, monitor_command,
                   NodeBenchError, NodeBenchOptions, robot_command, yaml_node_command)
from ..runtime.params import NODE_NAME

FIRST_NARRATION_TARGET_S = 60.0   # defaults: the first narration within this of the instruction
NARRATION_WINDOW_S = 10.0         # overload: at least one narration in every such window
OVERLOAD_FACTOR = 2.0             # overload: asked rate / what the machine holds


@dataclasses.dataclass
class OverloadBenchOptions:
    """What the overload part runs (robot, cameras and start timeout are the node part's)."""

    factor: float = OVERLOAD_FACTOR   # asked rate of run 2 / the capacity run 1 reported
    duration_s: float = 60.0          # measured seconds of each run
    warmup_s: float = 0.0             # after the first action chunk, before the measured span
    window_s: float = NARRATION_WINDOW_S

    @classmethod
    def quick(cls, **changes) -> OverloadBenchOptions:
        """Return a smoke run's options: seconds instead of minutes."""
        return dataclasses.replace(cls(duration_s=10.0, window_s=5.0), **changes)


def node_command(node: NodeBenchOptions, rate_hz: float | None) -> list[str]:
    """oxygen_node with config/<robot>.yaml as it is (only the rate of an overload run set)."""
    # A decimal point: '-p control_rate_hz:=7' would reach the node as an integer.
    return yaml_node_command(node, {} if rate_hz is None else {
        'control_rate_hz': f'{rate_hz:.6f}'})


def run_once(node: NodeBenchOptions, opts: OverloadBenchOptions, rate_hz: float | None,
             log_dir: Path, say=lambda line: None) -> dict:
    """One node run: start monitor, node and robot; record `duration_s`; return the JSON."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = child_environment()
    out = log_dir / 'monitor.json'
    events: queue.Queue = queue.Queue()
    children: list[Child] = []
    try:
        monitor = Child('monitor', monitor_command(out), env, log_dir / 'monitor.log', events)
        children.append(monitor)
        children.append(Child(NODE_NAME, node_command(node, rate_hz), env,
                              log_dir / 'oxygen_node.log'))
        _wait_event(events, 'lifecycle', node.start_timeout_s, children, state='active')
        robot = Child('robot', robot_command(node), env, log_dir / 'robot.log')
        children.append(robot)
        first = _wait_event(events, 'first_action', node.start_timeout_s, children)
        say(f'  first action chunk; recording {opts.warmup_s + opts.duration_s:g} s')
        _sleep_until(first['t'] + opts.warmup_s + opts.duration_s, children)
        robot.stop()
        monitor.stop()   # writes its JSON on SIGINT
        if not out.exists():
            raise NodeBenchError(f'the monitor wrote no {out}; its log:\n{monitor.tail()}')
        data = json.loads(out.read_text())
        data['measured'] = (first['t'] + opts.warmup_s, first['t'] + opts.warmup_s
                            + opts.duration_s)
        return data
    finally:
        for child in reversed(children):
            child.stop()


def _model_value(data: dict, key: str) -> float:
    for record in reversed(data['diagnostics']):
        try:
            return float(record.get('model', {})[key])
        except (KeyError, ValueError):
            continue
    return math.nan


def _language_counter(data: dict, key: str, before: float) -> float:
    known = [d['language'][key] for d in data['diagnostics']
             if d['t'] < before and key in d.get('language', {})]
    return float(known[-1]) if known else 0.0


def figures(data: dict, window_s: float) -> dict:
    """Return the run's language figures from the monitor's records (seconds, counts, Hz)."""
    t0, t1 = data['measured']
    instructions = [r['t'] for r in data['instructions']]
    narrations = [r['t'] for r in data['narrations']]
    first_instruction = min(instructions) if instructions else math.nan
    after = [t for t in narrations if t >= first_instruction]
    windows = max(1, int((t1 - t0) // window_s))
    counts = [0] * windows
    for t in narrations:
        if t0 <= t < t0 + windows * window_s:
            counts[int((t - t0) // window_s)] += 1
    ticks = [t for t in data['ticks'] if t0 <= t['t'] < t1]
    return {
        'capacity_hz': _model_value(data, 'capacity_hz'),
        'rate_asked_hz': _model_value(data, 'control_rate_hz'),
        'rate_held_hz': len(ticks) / (t1 - t0),
        'first_narration_s': (min(after) - first_instruction) if after else math.nan,
        'narrations': sum(counts),
        'narration_windows': windows,
        'narrations_min_per_window': min(counts),
        'narrations_per_min': 60.0 * sum(counts) / (windows * window_s),
        # the node's own counters over the run (its language status)
        'requests_completed': sum(_language_counter(data, f'finished_{r}', t1)
                                  for r in ('eos', 'length')),
        'requests_refused': _language_counter(data, 'finished_refused', t1),
        'requests_evicted': _language_counter(data, 'finished_evicted', t1),
        'window_s': window_s,
    }


def run_overload_part(node: NodeBenchOptions, opts: OverloadBenchOptions, log_dir: Path,
                      say=lambda line: None) -> list[dict]:
    """Run 1 (defaults) and run 2 (factor x capacity); return one row per run."""
    rows = []
    say(f'overload part: oxygen_node with config/{node.robot}.yaml as it is (auto rate)')
    data = run_once(node, opts, None, log_dir / 'defaults', say)
    row = {'run': 'defaults', 'robot': node.robot, **figures(data, opts.window_s)}
    rows.append(row)
    capacity = row['capacity_hz']
    if not capacity > 0:
        raise NodeBenchError('the node reported no capacity_hz (model status); logs in '
                             f'{log_dir / "defaults"}')
    rate = opts.factor * capacity
    say(f'  it holds about {capacity:.3g} Hz; now asked {rate:.3g} Hz ({opts.factor:g}x)')
    data = run_once(node, opts, rate, log_dir / 'overload', say)
    rows.append({'run': f'{opts.factor:g}x capacity', 'robot': node.robot,
                 **figures(data, opts.window_s)})
    for row in rows:
        say(f'  {row["run"]}: asked {row["rate_asked_hz"]:.3g} Hz, held '
            f'{row["rate_held_hz"]:.3g} Hz; first narration {row["first_narration_s"]:.1f} s '
            f'after the instruction; narrations per {row["window_s"]:g} s window: min '
            f'{row["narrations_min_per_window"]} ({row["narrations_per_min"]:.1f}/min); '
            f'requests completed {row["requests_completed"]:.0f}, refused '
            f'{row["requests_refused"]:.0f}, evicted {row["requests_evicted"]:.0f}')
    return rows


# ---- report ------------------------------------------------------------------------------

def overload_targets(rows: list[dict]) -> list[dict]:
    """Return the overload part's targets (issue 20) from its two rows."""
    by_run = {row['run'].split()[0]: row for row in rows}
    targets = []
    if 'defaults' in by_run:
        row = by_run['defaults']
        targets.append({
            'target': f'first narration ≤ {FIRST_NARRATION_TARGET_S:g} s after the instruction '
                      f'(config/{row["robot"]}.yaml as shipped)',
            'measured': f'{row["first_narration_s"]:.1f} s (at {row["rate_asked_hz"]:.3g} Hz '
                        f'auto, the node holds about {row["capacity_hz"]:.3g} Hz)',
            'met': row['first_narration_s'] <= FIRST_NARRATION_TARGET_S})
    overloaded = [row for run, row in by_run.items() if run != 'defaults']
    for row in overloaded:
        targets.append({
            'target': f'≥ 1 narration per {NARRATION_WINDOW_S:g} s while asked {row["run"]}',
            'measured': f'min {row["narrations_min_per_window"]} per {row["window_s"]:g} s '
                        f'window over {row["narration_windows"]} windows '
                        f'({row["narrations_per_min"]:.1f}/min; asked '
                        f'{row["rate_asked_hz"]:.3g} Hz, held {row["rate_held_hz"]:.3g}); '
                        f'requests refused {row["requests_refused"]:.0f}, evicted '
                        f'{row["requests_evicted"]:.0f}',
            'met': (row['narrations_min_per_window'] >= 1
                    and row['window_s'] <= NARRATION_WINDOW_S)})
    return targets


def overload_section(rows: list[dict]) -> list[str]:
    """Markdown of the overload part: one line per run."""
    if not rows:
        return []
    lines = ['## Language under overload (the node with the shipped YAML)', '',
             '| run | capacity Hz | asked Hz | held Hz | first narration s | narrations / '
             'min | min per window | completed | refused | evicted |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        lines.append(f'| {r["run"]} | {r["capacity_hz"]:.3g} | {r["rate_asked_hz"]:.3g} | '
                     f'{r["rate_held_hz"]:.3g} | {r["first_narration_s"]:.1f} | '
                     f'{r["narrations_per_min"]:.1f} | {r["narrations_min_per_window"]} '
                     f'(of {r["window_s"]:g} s) | {r["requests_completed"]:.0f} | '
                     f'{r["requests_refused"]:.0f} | {r["requests_evicted"]:.0f} |')
    return lines + ['', 'capacity = what the node timed at configure (act p50 + the least '
                        'language work of a tick); first narration = from the instruction '
                        'reaching the monitor; completed / refused / evicted = the node\'s '
                        'counters over the run.', '']
