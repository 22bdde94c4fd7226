"""Benchmark part 'robots': the quick run end to end (worker processes), the component model."""

import csv
from pathlib import Path

import pytest

from oxygen_ros.bench.phases import PhaseCosts
from oxygen_ros.bench.robots import (chunked_prefill_s, component_ideal, jobs_for,
                                     prefill_rows, robot_workloads)
from oxygen_ros.bench.run import BenchOptions
from oxygen_ros.cli import main

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def robots_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench_robots')
    assert main(['bench', '--quick', '--parts', 'robots', '--robot-frames', '2', '--out',
                 str(out), '--no-progress']) == 0
    return out


def test_quick_robots_part_writes_rows_summary_and_plot(robots_run):
    with open(robots_run / 'robots.csv') as f:
        rows = list(csv.DictReader(f))
    assert {(r['robots'], r['system']) for r in rows} == {
        (str(count), system) for count in (1, 2) for system in ('fleet', 'separate',
                                                                'sequential')}
    for row in rows:
        assert float(row['action_hz_min']) > 0 and float(row['aggregate_hz']) > 0
        assert float(row['above_runtime_mb']) > 0 and float(row['ideal_fleet_hz']) > 0
        if row['system'] != 'sequential':
            # every robot's tokens equal those of its own single-robot engine
            assert row['tokens_identical'] == 'True' and int(row['requests_compared']) > 0
    separate = {r['robots']: r for r in rows if r['system'] == 'separate'}
    assert separate['2']['processes'] == '2' and separate['1']['processes'] == '1'
    summary = (robots_run / 'summary.md').read_text()
    assert 'Several robots, one engine' in summary
    # The CPU's targets (issue 23): the component model's bound, and not losing at R = 2.
    assert "robots (CPU): aggregate ≥ 0.95 × the component model's bound" in summary
    assert 'robots (CPU): at R=2 the fleet does not lose to 2 separate engines' in summary
    assert (robots_run / 'robots_hz.png').read_bytes().startswith(PNG_MAGIC)


def test_fleet_component_model_on_known_numbers():
    costs = PhaseCosts(0.0, 0.1, 0.05, {1: 0.01, 2: 0.012, 4: 0.016}, {}, {},
                       prefill_rows_s={2: 0.18}, denoise_rows_s={2: 0.06})
    ideal = component_ideal(costs, 2, n_tokens=4, k=2, horizon=10)
    # fleet tick: P(2) + D(2) + a step of 2·2 rows and one of 2 (each robot's new request
    # has its first token from its prefix): 0.18 + 0.06 + 0.016 + 0.012
    assert ideal['ideal_fleet_hz'] == pytest.approx(10 / 0.268)
    # two robots alone in turn: 2 · (P + D + d(2) + d(1))
    assert ideal['ideal_single_hz'] == pytest.approx(10 / (2 * 0.172))
    assert costs.prefill_at(4) == pytest.approx(0.4)      # not measured: R × P
    # prefills in calls of one row: 2 · P(1) instead of P(2)
    chunked = component_ideal(costs, 2, n_tokens=4, k=2, horizon=10, prefill_rows=1)
    assert chunked['ideal_fleet_hz'] == pytest.approx(10 / 0.288)
    assert chunked_prefill_s(costs, 5, 2) == pytest.approx(2 * 0.18 + 0.1)


def test_prefill_rows_default_and_flags():
    assert prefill_rows(BenchOptions.quick_defaults()) == 1            # the CPU
    assert prefill_rows(BenchOptions.quick_defaults(device='cuda')) == 0
    with pytest.raises(SystemExit, match='--robot-prefill-rows'):
        main(['bench', '--quick', '--parts', 'robots', '--robot-prefill-rows', '-1'])
    with pytest.raises(SystemExit, match='--robots'):
        main(['bench', '--quick', '--parts', 'robots', '--robots', '0'])


def test_jobs_cycle_workloads_and_split_threads():
    opts = BenchOptions.quick_defaults(threads=2)
    assert robot_workloads(('libero', 'aloha'), 3) == ('libero', 'aloha', 'libero')
    separate = jobs_for('separate', 4, opts, steps=3)
    assert [j.first_robot for j in separate] == [0, 1, 2, 3]
    assert {j.threads for j in separate} == {1}
    (fleet,) = jobs_for('fleet', 4, opts, steps=3)
    assert fleet.threads == 2 and len(fleet.workloads) == 4


def test_robots_config_runs_a_node_yaml_fleet_in_real_time(tmp_path):
    """--robots-config: the YAML's robots through the node's frame loop at the given rates;
    per robot its ticks, misses and language progress, and the two targets each."""
    import json

    config = str(REPO / 'config' / 'aloha_droid.yaml')
    assert main(['bench', '--quick', '--parts', 'robots', '--robots-config', config,
                 '--robot-rates', 'aloha=4', 'droid=6', '--robots-duration', '2', '--out',
                 str(tmp_path), '--no-progress']) == 0
    result = json.loads((tmp_path / 'result.json').read_text())
    assert result['robots'] == []                   # the R sweep runs only with --robots
    rows = {r['robot']: r for r in result['fleet_timing']}
    assert set(rows) == {'aloha', 'droid'}
    assert rows['aloha']['rate_hz'] == pytest.approx(4) and rows['droid']['rate_hz'] == 6
    for row in rows.values():
        # Ticks of its own grid only: at most its rate x the window (+1 at the edge).
        assert 0 < row['ticks'] <= row['rate_hz'] * 2 + 1
        assert row['budget'] == 'AdaptiveBudget' and row['preset'] == 'tiny'
    summary = (tmp_path / 'summary.md').read_text()
    assert 'Fleet timing: ' in summary and 'aloha at 4 Hz, deadline misses ≤ 2%' in summary
    assert "droid's language makes progress" in summary
    with pytest.raises(SystemExit, match='not among them'):
        main(['bench', '--quick', '--parts', 'robots', '--robots-config', config,
              '--robot-rates', 'arm=4', '--out', str(tmp_path / 'bad'), '--no-progress'])
    with pytest.raises(SystemExit, match='NAME=HZ'):
        main(['bench', '--quick', '--parts', 'robots', '--robots-config', config,
              '--robot-rates', 'aloha', '--out', str(tmp_path / 'bad'), '--no-progress'])
