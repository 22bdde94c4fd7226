"""The soak (issue 11): the node over DDS for 60 s under random events and injected faults.

`oxygen-ros soak --duration 1800` is the long run (figures in the README); this is CI's.
"""

import pytest

pytest.importorskip('rclpy')

from oxygen_ros.tools.soak import failures, run_soak, SoakOptions  # noqa: E402


def test_soak_60s_no_crash_no_leak_actions_held(tmp_path):
    report = run_soak(SoakOptions(duration_s=60.0, out=tmp_path, seed=1), progress=print)
    assert failures(report) == [], report
    assert report['events'] >= 25 and len(report['event_kinds']) >= 5
    faults = report['faults_injected']
    assert faults['decode'] > 0, 'faults were injected'
    assert report['finished'].get('error', 0) > 0          # ... and ended language only
    assert report['finished'].get('length', 0) > 0
    assert report['rss_mb_end'] < 1.1 * report['rss_mb_start'], 'RSS grows'
    assert report['shutdown_s'] < 2.0
    assert (tmp_path / 'soak.png').stat().st_size > 0 and (tmp_path / 'soak.md').exists()


def test_healthy_rate_leaves_out_the_bins_a_fault_touches():
    from oxygen_ros.tools.soak import _healthy_rate

    actions = [0.05 + 0.1 * i for i in range(100)]                  # one action per 0.1 s bin
    healthy_s, count = _healthy_rate(actions, [], 0.0, 10.0)
    assert healthy_s == pytest.approx(10.0) and count == 100
    # a fault over [2.0, 2.95): bins starting at 1.9 (its end reaches 2.0) .. 2.9 are out
    healthy_s, count = _healthy_rate(actions, [(2.0, 2.95)], 0.0, 10.0)
    assert healthy_s == pytest.approx(8.9) and count == 89
    assert _healthy_rate(actions, [(-1.0, 11.0)], 0.0, 10.0) == (0.0, 0)
