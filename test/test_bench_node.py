"""The benchmark's node part: its figures from synthetic records, and one short real run.

No timing thresholds: the benchmark shows performance; these tests check that it measures what
it says (tick accounting, CPU split by thread name, files and sane numbers).
"""

import csv
import ctypes
import json
import math
import os
import queue
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time

import pytest

from oxygen_ros.bench.cpu import cpu_between, ThreadCpu
from oxygen_ros.bench.node import analyze, camera_arrival, camera_rate, NodeRun, tick_records

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _run(ticks, tokens=(), diagnostics=(), window=(100.0, 110.0)):
    monitor = {'ticks': list(ticks), 'tokens': list(tokens), 'diagnostics': list(diagnostics)}
    cpu = {'wall_s': 1.0, 'total_pct': 0.0, 'control_pct': math.nan,
           'outside_control_pct': math.nan, 'control_thread_found': False, 'by_name_pct': {}}
    return NodeRun(monitor, window, window[0] - 1.0, cpu, cpu, 0.0)


def test_analyze_counts_late_and_missing_ticks():
    # 10 Hz asked over 10 s = 100 ticks; 95 arrive, 3 of them with inference past the period.
    ticks = [{'t': 100.0 + 0.1 * i, 'stamp': i, 'frame': i, 'tokens': 2,
              'inference_s': 0.15 if i in (3, 40, 77) else 0.05} for i in range(95)]
    ticks.append({'t': 99.5, 'stamp': -1, 'frame': -1, 'inference_s': 9.0})   # warm-up
    tokens = [{'t': 100.0 + 0.1 * i, 'n': 2} for i in range(95)]
    diagnostics = [{'t': 99.0, 'control loop': {'deadline_misses_total': '4',
                                                'skipped_total': '1'},
                    'language': {'current_k': '5'}},
                   {'t': 109.0, 'control loop': {'deadline_misses_total': '7',
                                                 'skipped_total': '3'},
                    'language': {'current_k': '5'}}]
    figures = analyze(_run(ticks, tokens, diagnostics), rate_hz=10.0)
    assert figures['ticks_delivered'] == 95
    assert figures['ticks_asked'] == pytest.approx(100)
    assert figures['rate_held_hz'] == pytest.approx(9.5)
    assert figures['late_ticks'] == 3 and figures['missing_ticks'] == 5
    assert figures['deadline_miss_pct'] == pytest.approx(8.0)
    assert figures['node_inference_ms_p50'] == pytest.approx(50.0)
    assert figures['tokens_per_s'] == pytest.approx(19.0)
    assert figures['node_reported_misses'] == 3 and figures['node_skipped_ticks'] == 2
    assert figures['k_min'] == figures['k_max'] == 5
    assert figures['frames_lost'] == 0


def test_analyze_sees_gaps_and_lost_frames():
    # Frames 10..19 never arrive: a 1.1 s gap at 10 Hz is 10 missed periods.
    ticks = [{'t': 100.0 + 0.1 * i, 'stamp': i, 'frame': i, 'inference_s': 0.01}
             for i in range(100) if not 10 <= i < 20]
    figures = analyze(_run(ticks), rate_hz=10.0)
    assert figures['gap_misses'] == 10 and figures['frames_lost'] == 10
    assert figures['missing_ticks'] == 10
    rows = tick_records(_run(ticks), 10.0)
    assert len(rows) == 90 and all(r['measured'] for r in rows)
    assert rows[10]['interval_ms'] == pytest.approx(1100.0)


def test_camera_rate_from_the_inputs_status():
    def inputs(t, count):
        return {'t': t, 'inputs': {"camera 'image' (/camera/image/image_raw)":
                                   f'ok, age 0.03 s, {count} msgs',
                                   'joint_states (/joint_states)': 'ok, age 0.01 s, 9999 msgs'}}
    assert camera_rate([inputs(99.0, 100), inputs(109.0, 250)], 100.0, 110.0) == 15.0
    assert math.isnan(camera_rate([], 100.0, 110.0))


def test_camera_arrival_from_the_nodes_loss_counts():
    def inputs(t, lost_a, lost_b):
        return {'t': t, 'inputs': {
            "camera 'image' (/camera/image/image_raw)":
                f'ok, age 0.03 s, 50 msgs, {lost_a} of 150 sent lost in transport',
            "camera 'wrist_image' (/camera/wrist_image/image_raw)":
                f'ok, age 0.03 s, 50 msgs, {lost_b} of 150 sent lost in transport',
            'joint_states (/joint_states)': 'ok, age 0.01 s, 9999 msgs'}}
    figures = camera_arrival([inputs(100.0, 90, 0), inputs(109.0, 6, 0)], 99.0, 110.0)
    assert figures == {'camera_arrived_hz_min': 14.4, 'camera_lost_pct_max': 4.0}
    assert math.isnan(camera_arrival([inputs(100.0, 0, 0)], 99.0, 104.0)[
        'camera_arrived_hz_min'])                       # shorter than the node's window


def test_cpu_between_splits_the_control_thread():
    start = (0.0, {1: ('python', 1.0), 2: ('oxy_control', 5.0)})
    end = (10.0, {1: ('python', 1.2), 2: ('oxy_control', 9.0), 3: ('oxy_control', 1.0),
                  4: ('dds.ev.0', 0.1)})
    cpu = cpu_between(start, end)
    assert cpu['control_thread_found']
    assert cpu['control_pct'] == pytest.approx(50.0)
    assert cpu['outside_control_pct'] == pytest.approx(3.0)
    assert cpu['total_pct'] == pytest.approx(53.0)
    without = cpu_between(start, (10.0, {1: ('python', 2.0)}))
    assert not without['control_thread_found'] and math.isnan(without['outside_control_pct'])


@pytest.mark.skipif(not Path('/proc/self/task').is_dir(), reason='needs Linux /proc')
def test_thread_cpu_reads_native_thread_names():
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_name = 15
    stop = threading.Event()

    def spin():
        libc.prctl(pr_set_name, b'oxy_control', 0, 0, 0)
        while not stop.is_set():
            sum(range(1000))

    sampler = ThreadCpu(os.getpid(), interval_s=0.05)
    worker = threading.Thread(target=spin, daemon=True)
    try:
        start = sampler.mark()
        worker.start()
        time.sleep(0.5)
        stop.set()
        worker.join()
        cpu = cpu_between(start, sampler.mark())
    finally:
        stop.set()
        sampler.close()
    assert cpu['control_thread_found'] and cpu['control_pct'] > 0


# ---- one real run ---------------------------------------------------------------------------

def _read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def test_bench_node_part_end_to_end(tmp_path):
    pytest.importorskip('rclpy')
    pytest.importorskip('oxygen_ros.msg')
    out = tmp_path / 'bench'
    # --quick: tiny preset, 1 s idle, 1 s warm-up, 5 engine frames; 4 s measured.
    cmd = [sys.executable, '-m', 'oxygen_ros.cli', 'bench', '--quick', '--parts', 'node',
           '--node-duration', '4', '--out', str(out), '--no-progress']
    # Its own process group: node, robot and monitor stay in it, so one killpg in the cleanup
    # stops every process of the run even if the benchmark itself hangs or fails.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2.0)
        proc.wait(10)
    assert proc.returncode == 0, output[-4000:]
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)   # the benchmark stopped node, robot and monitor itself

    rows = _read_csv(out / 'node.csv')
    assert len(rows) == 1
    row = rows[0]
    for key in ('engine_act_ms_p50', 'engine_frame_ms_p50', 'rate_asked_hz',
                'node_inference_ms_p50', 'node_inference_ms_p99', 'rate_held_hz',
                'node_over_engine_p50', 'window_s', 'engine_loaded_act_ms_p50',
                'engine_loaded_act_ms_p99'):
        value = float(row[key])
        assert math.isfinite(value) and value > 0, (key, row[key])
    for key in ('deadline_miss_pct', 'tokens_per_s', 'cpu_node_active_pct', 'cpu_node_idle_pct',
                'robot_cpu_pct', 'engine_loaded_late_pct'):
        value = float(row[key])
        assert math.isfinite(value) and value >= 0, (key, row[key])
    assert float(row['engine_frame_ms_p50']) >= float(row['engine_act_ms_p50'])
    assert int(row['engine_loaded_frames']) == 3   # the engine timed next to the robot too
    assert (out / 'node_logs' / 'robot_engine_loaded.log').is_file()
    # The shipped libero.yaml as it is: the node's own auto rate (what it reported), adaptive k.
    monitor = json.loads((out / 'node_logs' / 'node_monitor.json').read_text())
    reported = [d['model']['control_rate_hz'] for d in monitor['diagnostics']
                if 'control_rate_hz' in d.get('model', {})]
    assert reported and float(row['rate_asked_hz']) == pytest.approx(float(reported[-1]))
    assert 'auto' in row['rate_source'] and row['k'] == 'adaptive'
    assert int(row['ticks_delivered']) > 0 and 3.0 < float(row['window_s']) < 6.0
    if row['control_thread_found'] == 'True':
        assert float(row['cpu_outside_control_active_pct']) >= 0
        # Each window's CPU by thread name: which thread to look at when a figure is high.
        for key in ('cpu_threads_active', 'cpu_threads_idle'):
            assert 'oxy_control:' in row[key], (key, row[key])
    ticks = _read_csv(out / 'node_ticks.csv')
    assert any(t['measured'] == 'True' for t in ticks)
    assert (out / 'node_latency.png').read_bytes()[:8] == PNG_MAGIC
    summary = (out / 'summary.md').read_text()
    assert '## The node' in summary and 'node inference_time p50' in summary
    assert f'idle: {row["cpu_threads_idle"]}' in summary
    assert (out / 'node_logs' / 'node_monitor.json').is_file()
    assert 'Traceback' not in (out / 'node_logs' / 'oxygen_node.log').read_text()


class _FakeChild:
    name = 'oxygen_node'
    log_path = Path('oxygen_node.log')

    def alive(self):
        return True

    def tail(self):
        return 'configure failed: unknown preset'


def _events(*lines):
    events = queue.Queue()
    for line in lines:
        events.put(line)
    return events


def test_wait_event_reads_the_monitor_event_lines():
    from oxygen_ros.bench.node import _wait_event, NodeBenchError

    lines = ('[INFO] a log line\n', '{"event": "lifecycle", "state": "configuring", "t": 1}\n',
             '{"event": "lifecycle", "state": "active (5 Hz)", "level": 0, "t": 2}\n')
    event = _wait_event(_events(*lines), 'lifecycle', 5.0, [_FakeChild()], state='active')
    assert event['t'] == 2
    failed = _events('{"event": "lifecycle", "state": "configuring", "t": 1}\n',
                     '{"event": "lifecycle", "state": "unconfigured", "level": 2, "t": 2}\n')
    with pytest.raises(NodeBenchError, match='failed to configure'):
        _wait_event(failed, 'lifecycle', 5.0, [_FakeChild()], state='active')
    with pytest.raises(NodeBenchError, match='no first_action'):
        _wait_event(_events(), 'first_action', 0.3, [_FakeChild()])
