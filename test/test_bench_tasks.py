"""The benchmark's tasks part: figures and targets from synthetic records, its node parameters,
and its engine half on the tiny model (each task's tokens against the task alone).

The node runs themselves start oxygen_node three times with pi05-cpu (minutes); `oxygen-ros
bench --parts tasks` runs them.
"""

import math

import pytest
import yaml

from oxygen_ros.bench.cli import tasks_options_from_args
from oxygen_ros.bench.node import NodeBenchOptions, yaml_node_command
from oxygen_ros.bench.tasks import (engine_rows, node_figures, run_overrides, tasks_section,
                                    tasks_targets, TasksBenchOptions)
from oxygen_ros.engine import random_setup
from oxygen_ros.model.config import get_preset
from oxygen_ros.runtime.params import load_node_params, Settings


def _data(inference_s=0.1, misses=(0, 0), waits=(0.5, 0.8), rss_mb=900.0):
    diagnostics = [{'t': 95.0, 'model': {'control_rate_hz': '2.5'},
                    'control loop': {'deadline_misses_total': str(misses[0])}},
                   {'t': 129.0, 'control loop': {'deadline_misses_total': str(misses[1])}}]
    asks = [{'sent': 101.0 + 2 * i, 'replied': 102.0 + 2 * i, 'ok': True, 'wait_s': w}
            for i, w in enumerate(waits)]
    asks.append({'sent': 140.0, 'replied': None})   # after the window: not counted
    return {'measured': (100.0, 130.0), 'rss_mb': rss_mb, 'diagnostics': diagnostics,
            'ticks': [{'t': 100.0 + 0.4 * i, 'inference_s': inference_s} for i in range(75)],
            'asks': asks}


def test_node_figures_from_the_records():
    row = node_figures(_data(misses=(3, 5)))
    assert row['rate_asked_hz'] == 2.5 and row['rate_held_hz'] == pytest.approx(2.5)
    assert row['obs_to_action_ms_p50'] == pytest.approx(100.0)
    assert row['deadline_misses'] == 2 and row['rss_mb'] == 900.0
    assert (row['questions'], row['answered'], row['no_answer']) == (2, 2, [])
    assert row['ask_periods_max'] == pytest.approx(0.8 * 2.5)   # wait x rate
    assert row['ask_wait_ms_p50'] == pytest.approx(650.0)
    data = _data()
    data['asks'][0] = {'sent': 101.0, 'replied': 101.1, 'ok': False, 'reason': 'busy',
                       'wait_s': 0.0}
    assert node_figures(data)['no_answer'] == ['busy']


def test_targets_and_section():
    rows = [{'run': 'action-only', **node_figures(_data(rss_mb=1000.0, waits=()))},
            {'run': 'narration', **node_figures(_data(waits=()))},
            {'run': 'tasks', **node_figures(_data(inference_s=0.104, rss_mb=1100.0))}]
    engine = [{'task': 'narration', 'requests': 6, 'identical_to_alone': True},
              {'task': 'ask', 'requests': 2, 'identical_to_alone': True}]
    targets = tasks_targets(rows, engine)
    assert [t['met'] for t in targets] == [True, True, True, True, True]
    assert 'within 3 frame periods' in targets[2]['target']
    slow = dict(rows[2], obs_to_action_ms_p50=120.0, ask_periods_max=4.0, rss_mb=1300.0)
    engine[1]['identical_to_alone'] = False
    assert [t['met'] for t in tasks_targets(rows[:2] + [slow], engine)] == [
        True, False, False, False, False]
    lines = tasks_section(rows, [dict(e, completed=1, tokens=3, identical_isolated=True,
                                      frame_ms_p50_together=1.0, frame_ms_p50_isolated=2.0)
                                 for e in engine])
    assert any(line.startswith('| tasks | 2.5 | 2.5 | 104.0 |') for line in lines)
    assert any(line.startswith('| ask | 2 | 1 | 3 | False |') for line in lines)


def test_each_run_is_the_shipped_yaml_with_valid_overrides():
    opts = TasksBenchOptions()
    for run in ('action-only', 'narration', 'tasks'):
        cmd = yaml_node_command(NodeBenchOptions(), run_overrides(run, opts))
        assert cmd[cmd.index('--params-file') + 1].endswith('config/libero.yaml')
        # -p values are YAML, as rcl reads them; the node accepts what they make
        values = load_node_params(cmd[cmd.index('--params-file') + 1])
        for arg in cmd[cmd.index('--params-file') + 2:]:
            if arg != '-p':
                name, _, text = arg.partition(':=')
                values[name] = yaml.safe_load(text)
        settings = Settings.from_values(values)
        assert not any('control_rate_hz' in arg for arg in cmd)   # the YAML's: auto
        pinned = yaml_node_command(NodeBenchOptions(), run_overrides(run, opts, 5.5))
        assert 'control_rate_hz:=5.500000' in pinned   # the narration run's, for the others
        if run == 'tasks':
            assert [t.name for t in settings.tasks] == ['narration', 'subtask']
            subtask = settings.task('subtask')
            assert (subtask.tokens, subtask.every_n_frames) == (16, 5)
            assert subtask.prompt == 'Subtask of {instruction}:' and settings.ask_tokens == 10
        elif run == 'action-only':
            assert settings.request_every_n_frames == 0 and settings.ask_tokens == 0


def test_engine_half_each_task_equals_the_task_alone(tmp_path):
    model, frontend = random_setup(get_preset('tiny'), 'libero', seed=1,
                                   tokenizer_dir=tmp_path)
    rows = engine_rows(TasksBenchOptions.quick(), model, frontend, 'libero')
    assert [r['task'] for r in rows] == ['narration', 'subtask', 'ask']
    assert [r['requests'] for r in rows] == [6, 2, 2]   # 6 frames; every 5; every 3
    assert all(r['identical_to_alone'] and r['identical_isolated'] for r in rows)
    assert all(r['completed'] == r['requests'] and r['tokens'] for r in rows)
    assert not math.isnan(rows[0]['frame_ms_p50_isolated'])


def test_tasks_options_from_the_command_line():
    class Args:
        quick, tasks_duration, tasks_ask_period = False, 30.0, None
    assert tasks_options_from_args(Args) == TasksBenchOptions(duration_s=30.0)
    Args.quick, Args.tasks_duration = True, None
    assert tasks_options_from_args(Args) == TasksBenchOptions.quick()
    Args.tasks_ask_period = 0.0
    with pytest.raises(SystemExit):
        tasks_options_from_args(Args)
