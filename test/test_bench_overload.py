"""The benchmark's overload part: its figures and targets from synthetic monitor records.

The part itself starts the node twice with pi05-cpu (minutes); `oxygen-ros bench --parts
overload` runs it. These tests check that it measures what it says.
"""

import math

import pytest

from oxygen_ros.bench.cli import overload_options_from_args
from oxygen_ros.bench.node import NodeBenchOptions
from oxygen_ros.bench.overload import (figures, node_command, overload_section,
                                       overload_targets, OverloadBenchOptions)


def _data(narrations, instruction_t=99.0, measured=(100.0, 130.0)):
    diagnostics = [{'t': 95.0, 'state': 'active', 'model': {'capacity_hz': '5.0',
                                                            'control_rate_hz': '10.0'}},
                   {'t': 129.0, 'language': {'finished_length': '40', 'finished_eos': '2',
                                             'finished_refused': '1'}}]
    return {'measured': measured, 'instructions': [{'t': instruction_t, 'chars': 20}],
            'narrations': [{'t': t, 'chars': 30} for t in narrations],
            'ticks': [{'t': 100.0 + 0.2 * i} for i in range(150)],
            'diagnostics': diagnostics}


def test_figures_count_narrations_per_window_from_the_instruction():
    data = _data([97.0, 104.0, 108.0, 115.0, 126.0, 131.0])   # 97: before the instruction
    row = figures(data, window_s=10.0)
    assert row['first_narration_s'] == pytest.approx(5.0)       # 104 - 99
    assert row['narration_windows'] == 3 and row['narrations'] == 4
    assert row['narrations_min_per_window'] == 1
    assert row['narrations_per_min'] == pytest.approx(8.0)
    assert row['capacity_hz'] == 5.0 and row['rate_asked_hz'] == 10.0
    assert row['rate_held_hz'] == pytest.approx(5.0)
    assert (row['requests_completed'], row['requests_refused'], row['requests_evicted']) == (
        42, 1, 0)
    quiet = figures(_data([104.0, 126.0]), window_s=10.0)       # nothing in 110..120
    assert quiet['narrations_min_per_window'] == 0
    assert math.isnan(figures(_data([]), window_s=10.0)['first_narration_s'])


def test_targets_and_section():
    defaults = {'run': 'defaults', 'robot': 'libero', **figures(_data([104.0, 115.0, 126.0]),
                                                                10.0)}
    overload = {'run': '2x capacity', 'robot': 'libero', **figures(_data([104.0, 126.0]),
                                                                   10.0)}
    targets = overload_targets([defaults, overload])
    assert [t['met'] for t in targets] == [True, False]
    assert 'first narration ≤ 60 s' in targets[0]['target']
    assert '2x capacity' in targets[1]['target']
    lines = overload_section([defaults, overload])
    assert any(line.startswith('| 2x capacity | 5 | 10 |') for line in lines)


def test_the_node_runs_with_the_shipped_yaml():
    jpeg = NodeBenchOptions(camera_format='jpeg')
    cmd = node_command(jpeg, None)
    assert cmd[cmd.index('--params-file') + 1].endswith('config/libero.yaml')
    assert not any('control_rate_hz' in arg for arg in cmd)       # the YAML's: auto
    assert 'cameras.image.compressed:=true' in cmd                 # what the robot publishes
    raw = node_command(NodeBenchOptions(camera_format='raw'), 7.25)
    assert raw[-2:] == ['-p', 'control_rate_hz:=7.250000']
    assert not any('compressed' in arg for arg in raw)


def test_overload_options_from_the_command_line():
    class Args:
        quick, overload_factor, overload_duration = False, 3.0, None
    assert overload_options_from_args(Args) == OverloadBenchOptions(factor=3.0)
    Args.quick, Args.overload_factor = True, None
    assert overload_options_from_args(Args) == OverloadBenchOptions.quick()
    Args.overload_duration = -1.0
    with pytest.raises(SystemExit):
        overload_options_from_args(Args)
