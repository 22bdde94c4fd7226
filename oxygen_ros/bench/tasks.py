"""Several language tasks at once: narration, a subtask and questions from one prefill a frame.

Two halves, reported and checked together:

  node     oxygen_node as its own process with config/<robot>.yaml as shipped (auto rate, the
           adaptive budget), a stand-in robot sending raw frames and a monitor (the node
           part's processes), three runs of `duration_s` each:
             narration    the YAML as it is: narration N = 10 every frame, the node's auto
                          rate (90% of what it timed at configure)
             tasks        + a subtask task (N = 16 every 5 frames) + one question every
                          `ask_period_s` (an asker process calling the `ask` service), asked
                          the rate the narration run resolved (like with like: a second
                          auto timing would differ by the machine's noise)
             action-only  request_every_n_frames 0, ask_tokens 0: no language (memory
                          base), at that rate too
           Figures: the rate held and the chunk's observation-to-action time (its
           inference_time) against the narration run, the node's resident memory at the end of
           the window against action-only, each question's wait in frame periods and the
           deadline misses the node counted.
  engine   the same three tasks on the same frames in this process with a fixed k (greedy,
           deterministic): every task's tokens against that task alone, and the frame time
           against the isolated system (each request prefilled on its own).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
import queue
import statistics
import sys
import time
from typing import Callable

import numpy as np

from .node import (_sleep_until, _wait_event, Child, child_environment, monitor_command,
                   NodeBenchError, NodeBenchOptions, node_rate, robot_command,
                   yaml_node_command)
from ..runtime.params import ASK_PROMPT, NODE_NAME
from ..runtime.procfs import status_kb

SUBTASK_PROMPT = 'Subtask of {instruction}:'
QUESTIONS = ('what is in the gripper?', 'where is the black bowl?', 'is the plate empty?',
             'what should the robot do next?')   # asked in turn (node and engine halves)
RATE_TARGET = 1.05          # action rate and obs-to-action time within this of narration's
MEMORY_TARGET = 1.2         # resident memory <= this x action-only's
ASK_PERIODS_TARGET = 3.0    # a question answered within this many frame periods


@dataclasses.dataclass
class TasksBenchOptions:
    """What the tasks part runs (robot, cameras and start timeout are the node part's)."""

    duration_s: float = 60.0         # measured seconds of each node run
    warmup_s: float = 5.0            # after the first action chunk, not measured
    ask_period_s: float = 2.0        # one question per this many seconds (tasks run)
    narration_tokens: int = 10       # N of narration, every frame
    subtask_tokens: int = 16         # N of the subtask task
    subtask_every: int = 5           # its requests every n frames
    ask_tokens: int = 10             # N of an answer
    engine_frames: int = 20          # frames of the engine half
    engine_k: int = 2                # its fixed decode budget
    engine_ask_every: int = 6        # a question every n frames in the engine half

    @classmethod
    def quick(cls, **changes) -> TasksBenchOptions:
        """Return a smoke run's options: seconds instead of minutes."""
        return dataclasses.replace(cls(duration_s=8.0, warmup_s=1.0, engine_frames=6,
                                       engine_ask_every=3), **changes)


def run_overrides(run: str, opts: TasksBenchOptions, rate_hz: float | None = None) -> dict:
    """Node parameters of one run on top of the shipped YAML (ROS -p values).

    rate_hz: the control rate asked (None: the YAML's, auto).
    """
    # A decimal point: '-p control_rate_hz:=7' would reach the node as an integer.
    rate = {} if rate_hz is None else {'control_rate_hz': f'{rate_hz:.6f}'}
    if run == 'action-only':
        return {'request_every_n_frames': 0, 'ask_tokens': 0, **rate}
    if run == 'narration':
        return rate
    return {**rate, 'language_tasks': '[narration, subtask]',
            'tasks.subtask.prompt': f"'{SUBTASK_PROMPT}'",
            'tasks.subtask.tokens': opts.subtask_tokens,
            'tasks.subtask.every_n_frames': opts.subtask_every,
            'tasks.subtask.priority': 2, 'ask_tokens': opts.ask_tokens}


def asker_command(out: Path, period_s: float) -> list[str]:
    return [sys.executable, '-m', 'oxygen_ros.ros.asker', '--out', str(out),
            '--period', f'{period_s:g}', '--questions', *QUESTIONS]


def run_node_once(node: NodeBenchOptions, opts: TasksBenchOptions, run: str, log_dir: Path,
                  rate_hz: float | None = None, say=lambda line: None) -> dict:
    """One node run: monitor, node, robot (and the asker); return the monitor's JSON + more."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = child_environment()
    out, asks = log_dir / 'monitor.json', log_dir / 'asks.json'
    events: queue.Queue = queue.Queue()
    children: list[Child] = []
    try:
        monitor = Child('monitor', monitor_command(out), env, log_dir / 'monitor.log', events)
        children.append(monitor)
        command = yaml_node_command(node, run_overrides(run, opts, rate_hz))
        node_proc = Child(NODE_NAME, command, env, log_dir / 'oxygen_node.log')
        children.append(node_proc)
        _wait_event(events, 'lifecycle', node.start_timeout_s, children, state='active')
        children.append(Child('robot', robot_command(node), env, log_dir / 'robot.log'))
        asker = None
        if run == 'tasks':   # asks from its start; only questions of the window count
            asker = Child('asker', asker_command(asks, opts.ask_period_s), env,
                          log_dir / 'asker.log')
            children.append(asker)
        first = _wait_event(events, 'first_action', node.start_timeout_s, children)
        t0 = first['t'] + opts.warmup_s
        say(f'  {run}: first action chunk; recording {opts.warmup_s + opts.duration_s:g} s')
        _sleep_until(t0 + opts.duration_s, children)
        rss_mb = status_kb('VmRSS', node_proc.pid) / 1024
        if asker is not None:
            asker.stop()
        for child in children[2:]:
            child.stop()
        monitor.stop()   # writes its JSON on SIGINT
        if not out.exists():
            raise NodeBenchError(f'the monitor wrote no {out}; its log:\n{monitor.tail()}')
        data = json.loads(out.read_text())
        data['asks'] = json.loads(asks.read_text())['asks'] if asks.exists() else []
        data.update(measured=(t0, t0 + opts.duration_s), rss_mb=rss_mb)
        return data
    finally:
        for child in reversed(children):
            child.stop()


def node_figures(data: dict) -> dict:
    """Return one run's figures from the monitor's (and asker's) records."""
    t0, t1 = data['measured']
    ticks = [t for t in data['ticks'] if t0 <= t['t'] < t1]
    inference = [t['inference_s'] for t in ticks]
    rate = node_rate(data['diagnostics'])

    def misses(before: float) -> float:
        known = [d['control loop']['deadline_misses_total'] for d in data['diagnostics']
                 if d['t'] < before and 'deadline_misses_total' in d.get('control loop', {})]
        return float(known[-1]) if known else math.nan

    asks = [a for a in data.get('asks', []) if t0 <= a['sent'] < t1]
    answered = [a for a in asks if a.get('ok')]
    periods = [a['wait_s'] * rate for a in answered]
    return {
        'rate_asked_hz': rate,
        'rate_held_hz': len(ticks) / (t1 - t0),
        'obs_to_action_ms_p50': 1e3 * statistics.median(inference) if inference else math.nan,
        'obs_to_action_ms_p99': (1e3 * float(np.percentile(inference, 99)) if inference
                                 else math.nan),
        'deadline_misses': misses(t1) - misses(t0),
        'rss_mb': data['rss_mb'],
        'questions': len(asks),
        'answered': len(answered),
        'no_answer': sorted({a.get('reason') or 'no reply by the end of the run'
                             for a in asks if not a.get('ok')}),
        'ask_periods_p50': statistics.median(periods) if periods else math.nan,
        'ask_periods_max': max(periods) if periods else math.nan,
        'ask_wait_ms_p50': (1e3 * statistics.median(a['wait_s'] for a in answered)
                            if answered else math.nan),
    }


# ---- the engine half -------------------------------------------------------------------------

def engine_tasks(opts: TasksBenchOptions, eos_id: int) -> tuple:
    """Return the part's three tasks as the engine takes them (narration, subtask, ask)."""
    from ..engine import LanguagePolicy, LanguageTask
    from ..runtime.questions import ASK, MAX_OPEN_QUESTIONS

    return (LanguageTask('narration', LanguagePolicy(max_new_tokens=opts.narration_tokens,
                                                     eos_id=eos_id)),
            LanguageTask('subtask', LanguagePolicy(
                max_new_tokens=opts.subtask_tokens, every_n_frames=opts.subtask_every,
                eos_id=eos_id, prompt_template=SUBTASK_PROMPT), priority=2),
            LanguageTask(ASK, LanguagePolicy(
                max_new_tokens=opts.ask_tokens, every_n_frames=0, eos_id=eos_id,
                prompt_template=ASK_PROMPT, max_queue=MAX_OPEN_QUESTIONS),
                priority=10, on_demand=True))


def _engine_run(model, frontend, tasks, opts: TasksBenchOptions, robot: str, *,
                share_prefix: bool = True) -> tuple[dict, list[float]]:
    """Run the frames; return ({(task, frame): token ids}, frame seconds)."""
    from ..engine import FixedBudget, make_engine, synthetic_frame
    from ..runtime.questions import ASK

    tasks = tuple(tasks)
    # Room for every request (forced template tokens lengthen them past the default sizing).
    engine = make_engine('oxygen' if share_prefix else 'isolated', model, frontend, tasks,
                         FixedBudget(opts.engine_k), share_prefix=share_prefix,
                         num_slots=4 * opts.engine_frames, num_blocks=8 * opts.engine_frames)
    size = model.config.vision.image_size
    asking = any(t.name == ASK for t in tasks)
    tokens, seconds = {}, []

    def keep(result):
        for done in result.finished:
            tokens[(done.task, done.origin_frame)] = (list(done.token_ids),
                                                      str(done.finish_reason))
    for frame in range(opts.engine_frames):
        if asking and frame % opts.engine_ask_every == 0:
            question = QUESTIONS[(frame // opts.engine_ask_every) % len(QUESTIONS)]
            forced = frontend.encode_text(ASK_PROMPT.replace('{question}', question))
            why = engine.scheduler.ask(ASK, forced, frame)
            assert not why, why
        obs = synthetic_frame(robot, frame, frame * 0.1, seed=0, image_size=size)
        start = time.perf_counter()
        keep(engine.step(obs))
        seconds.append(time.perf_counter() - start)
    while engine.num_live_requests:
        keep(engine.advance_language())
    return tokens, seconds


def engine_rows(opts: TasksBenchOptions, model, frontend, robot: str,
                say=lambda line: None) -> list[dict]:
    """Run the engine half: each task together vs alone (tokens), vs isolated (frame time)."""
    tasks = engine_tasks(opts, frontend.eos_id)
    say(f'  engine: {opts.engine_frames} frames, k={opts.engine_k}, the three tasks '
        'together, isolated and each alone')
    together, shared_s = _engine_run(model, frontend, tasks, opts, robot)
    isolated, isolated_s = _engine_run(model, frontend, tasks, opts, robot, share_prefix=False)
    rows = []
    for task in tasks:
        alone, _ = _engine_run(model, frontend, (task,), opts, robot)
        mine = {key: value for key, value in together.items() if key[0] == task.name}
        iso = {key: value for key, value in isolated.items() if key[0] == task.name}
        rows.append({
            'task': task.name, 'requests': len(alone),
            'completed': sum(reason in ('eos', 'length') for _, reason in alone.values()),
            'tokens': sum(len(ids) for ids, _ in alone.values()),
            'identical_to_alone': mine == alone, 'identical_isolated': iso == alone,
            'frame_ms_p50_together': 1e3 * statistics.median(shared_s),
            'frame_ms_p50_isolated': 1e3 * statistics.median(isolated_s)})
    return rows


def run_tasks_part(node: NodeBenchOptions, opts: TasksBenchOptions, log_dir: Path,
                   model_and_frontend: Callable[[], tuple], say=lambda line: None
                   ) -> tuple[list[dict], list[dict]]:
    """Run the node's three runs and the engine half; return (node rows, engine rows).

    model_and_frontend() -> the benchmark's model and a frontend of the node's robot.
    """
    say(f'tasks part: oxygen_node with config/{node.robot}.yaml as it is, then narration + '
        f'subtask + a question every {opts.ask_period_s:g} s')
    rows, rate_hz = [], None
    for run in ('narration', 'tasks', 'action-only'):
        data = run_node_once(node, opts, run, log_dir / run, rate_hz, say)
        rows.append({'run': run, 'robot': node.robot, **node_figures(data)})
        rate_hz = rows[0]['rate_asked_hz']   # the narration run's auto rate, for the others
        row = rows[-1]
        say(f'  {run}: held {row["rate_held_hz"]:.3g} Hz (asked {row["rate_asked_hz"]:.3g}), '
            f'obs->action p50 {row["obs_to_action_ms_p50"]:.1f} ms, RSS {row["rss_mb"]:.0f} '
            f'MB, misses {row["deadline_misses"]:.0f}'
            + (f', {row["answered"]}/{row["questions"]} questions answered, max '
               f'{row["ask_periods_max"]:.2f} periods' if run == 'tasks' else ''))
    model, frontend = model_and_frontend()
    return rows, engine_rows(opts, model, frontend, node.robot, say)


# ---- report ------------------------------------------------------------------------------

def _asks_met(tasks: dict, base: dict) -> bool:
    """Every question answered within the target's periods, no more misses than narration."""
    return (tasks['questions'] > 0 and tasks['answered'] == tasks['questions']
            and tasks['ask_periods_max'] <= ASK_PERIODS_TARGET
            and tasks['deadline_misses'] <= base['deadline_misses'])


def tasks_targets(rows: list[dict], engine: list[dict]) -> list[dict]:
    """Return the tasks part's targets (issue 24) from its node rows and engine rows."""
    by_run = {row['run']: row for row in rows}
    targets = []
    if {'narration', 'tasks'} <= set(by_run):
        base, tasks = by_run['narration'], by_run['tasks']
        targets.append({
            'target': f'action rate with three tasks ≥ narration-only / {RATE_TARGET:g}',
            'measured': f'{tasks["rate_held_hz"]:.3g} Hz vs {base["rate_held_hz"]:.3g} Hz',
            'met': tasks['rate_held_hz'] * RATE_TARGET >= base['rate_held_hz']})
        targets.append({
            'target': f'obs-to-action p50 with three tasks ≤ {RATE_TARGET:g} x narration-only',
            'measured': f'{tasks["obs_to_action_ms_p50"]:.1f} ms vs '
                        f'{base["obs_to_action_ms_p50"]:.1f} ms',
            'met': tasks['obs_to_action_ms_p50'] <= RATE_TARGET * base['obs_to_action_ms_p50']})
        targets.append({
            'target': f'ask answered within {ASK_PERIODS_TARGET:g} frame periods, no deadline '
                      'miss caused',
            'measured': f'{tasks["answered"]}/{tasks["questions"]} answered, max '
                        f'{tasks["ask_periods_max"]:.2f} periods (p50 '
                        f'{tasks["ask_periods_p50"]:.2f}); deadline misses '
                        f'{tasks["deadline_misses"]:.0f} (narration-only '
                        f'{base["deadline_misses"]:.0f})'
                        + (f'; no answer: {", ".join(tasks["no_answer"])}'
                           if tasks['no_answer'] else ''),
            'met': _asks_met(tasks, base)})
    if {'action-only', 'tasks'} <= set(by_run):
        ratio = by_run['tasks']['rss_mb'] / by_run['action-only']['rss_mb']
        targets.append({
            'target': f'memory with three tasks ≤ {MEMORY_TARGET:g} x action-only',
            'measured': f'{ratio:.2f}x ({by_run["tasks"]["rss_mb"]:.0f} MB vs '
                        f'{by_run["action-only"]["rss_mb"]:.0f} MB resident)',
            'met': ratio <= MEMORY_TARGET})
    if engine:
        targets.append({
            'target': 'tokens of every task identical to that task alone on the same frames',
            'measured': ', '.join(f'{r["task"]}: {r["requests"]} requests '
                                  f'{"identical" if r["identical_to_alone"] else "DIFFER"}'
                                  for r in engine),
            'met': all(r['identical_to_alone'] and r['requests'] for r in engine)})
    return targets


def tasks_section(rows: list[dict], engine: list[dict]) -> list[str]:
    """Markdown of the tasks part."""
    if not rows and not engine:
        return []
    lines = ['## Language tasks at once (narration, subtask, questions)', '']
    if rows:
        lines += ['| run | asked Hz | held Hz | obs->action p50 ms | p99 ms | RSS MB | '
                  'deadline misses | questions answered | ask periods p50 / max |',
                  '|---|---|---|---|---|---|---|---|---|']
        for r in rows:
            lines.append(f'| {r["run"]} | {r["rate_asked_hz"]:.3g} | {r["rate_held_hz"]:.3g} '
                         f'| {r["obs_to_action_ms_p50"]:.1f} | {r["obs_to_action_ms_p99"]:.1f} '
                         f'| {r["rss_mb"]:.0f} | {r["deadline_misses"]:.0f} | '
                         f'{r["answered"]}/{r["questions"]} | {r["ask_periods_p50"]:.2f} / '
                         f'{r["ask_periods_max"]:.2f} |')
        lines += ['', 'obs->action = the chunk\'s inference_time; ask periods = the node\'s '
                      'request-to-answer time x the control rate.', '']
    if engine:
        lines += ['| task | requests | completed | tokens | = alone | isolated = alone | '
                  'frame p50 ms together | isolated |', '|---|---|---|---|---|---|---|---|']
        for r in engine:
            lines.append(f'| {r["task"]} | {r["requests"]} | {r["completed"]} | {r["tokens"]} '
                         f'| {r["identical_to_alone"]} | {r["identical_isolated"]} | '
                         f'{r["frame_ms_p50_together"]:.1f} | '
                         f'{r["frame_ms_p50_isolated"]:.1f} |')
        lines.append('')
    return lines
