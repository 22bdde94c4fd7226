"""The demo (`make demo` = `python -m oxygen_ros.tools.demo`) on the tiny preset: it runs the real
node process and publishers, shows actions and narration, and stops cleanly on --duration and
on Ctrl-C (SIGINT to the whole process group, as a terminal sends it)."""

import os
from pathlib import Path
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip('rclpy')

REPO = Path(__file__).resolve().parents[1]
ARGS = ['--preset', 'tiny', '--rate', '5', '--plain', '--decode-budget', '2']


def _terminal_signals():
    """In the demo's process, before exec: Ctrl-C as a terminal delivers it.

    A test run started in the background (`make test &`, nohup, a CI step) has SIGINT
    ignored, and a child inherits that: its Python then never raises KeyboardInterrupt.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _demo(tmp_path, *extra):
    return subprocess.Popen(
        [sys.executable, '-m', 'oxygen_ros.tools.demo', *ARGS, '--log-dir', str(tmp_path), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED='1'), start_new_session=True,
        preexec_fn=_terminal_signals)


def _run_demo(tmp_path, *extra, timeout=120):
    """Run the demo to its end; return (exit code, output). Killed (group) if it overruns."""
    proc = _demo(tmp_path, *extra)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


def _summary(output):
    match = re.search(r'done: (\d+) action chunks, (\d+) tokens received; node exit status '
                      r'(-?\d+)', output)
    assert match, output[-3000:]
    return [int(g) for g in match.groups()]


def test_demo_runs_for_its_duration(tmp_path):
    # 12 s from the node's first action (its start-up, up to ~10 s here, comes before)
    returncode, output = _run_demo(tmp_path, '--duration', '12')
    assert returncode == 0, output[-3000:]
    actions, tokens, node_status = _summary(output)
    assert actions > 0 and tokens > 0 and node_status == 0, output[-3000:]
    assert 'narration (finished requests):' in output
    assert re.search(r'(OK|WARN)\s+actions .* Hz received', output), output[-3000:]
    # The node timed its frames at configure and says what this machine holds.
    assert re.search(r'this machine holds about [\d.]+ Hz at preset tiny, asked 5 Hz',
                     output), output[-3000:]
    assert re.search(r'node/engine inference p50 (\d+\.\d\dx|-)', output), output[-3000:]
    assert re.search(r'after warm-up .*deadline misses \d+, tokens/s per window min', output) or (
        'not enough time to judge' in output), output[-3000:]
    log = (tmp_path / 'oxygen_node.log').read_text()
    assert 'configured in' in log and 'Traceback' not in log, log[-3000:]


def test_demo_drives_a_node_serving_two_robots(tmp_path):
    returncode, output = _run_demo(tmp_path, '--duration', '12', '--robots', 'arm_a,arm_b')
    assert returncode == 0, output[-3000:]
    _, _, node_status = _summary(output)
    assert node_status == 0
    for robot in ('arm_a', 'arm_b'):
        assert f'robot {robot} (libero)' in output, output[-3000:]
        match = re.search(rf'^{robot}: (\d+) action chunks, (\d+) tokens', output, re.M)
        assert match and int(match.group(1)) > 0 and int(match.group(2)) > 0, output[-3000:]
    log = (tmp_path / 'oxygen_node.log').read_text()
    assert 'arm_a (libero' in log and 'arm_b (libero' in log, log[-3000:]
    assert 'Traceback' not in log, log[-3000:]


def test_demo_fails_clearly_when_the_node_sends_no_action_in_its_startup_time(tmp_path):
    """--duration counts from the first action; a node that never sends one (here: far too
    little start-up time) ends the demo with status 1 and says so, the node stopped."""
    returncode, output = _run_demo(tmp_path, '--duration', '5', '--startup-timeout', '1')
    assert returncode == 1, output[-3000:]
    assert re.search(r'oxygen_node sent no action in \d+ s \(--startup-timeout\)', output), \
        output[-3000:]
    assert 'starting ' in output and 'the node configures' in output, output[-3000:]
    actions, _, _ = _summary(output)
    assert actions == 0


def test_demo_stops_cleanly_on_ctrl_c(tmp_path):
    proc = _demo(tmp_path, '--duration', '90')
    lines = []
    deadline = time.monotonic() + 90
    try:
        for line in proc.stdout:   # wait for the first action chunks
            lines.append(line)
            if re.search(r'actions .*?[1-9]\d* chunks', line) or time.monotonic() > deadline:
                break
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = ''.join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    actions, _, node_status = _summary(output)
    assert actions > 0 and node_status == 0
    assert 'Traceback' not in output and 'Traceback' not in (
        tmp_path / 'oxygen_node.log').read_text()


def test_rate_auto_is_the_nodes_own():
    from oxygen_ros.tools.demo import node_overrides, parse_args

    assert node_overrides(parse_args([]))['control_rate_hz'] == 0.0      # auto: the node's
    assert node_overrides(parse_args(['--rate', '4']))['control_rate_hz'] == 4.0


def test_cameras_send_raw_frames_unless_jpeg_is_asked():
    from oxygen_ros.tools.demo import node_command, parse_args

    raw, jpeg = (' '.join(node_command(parse_args(argv))) for argv in ([], ['--jpeg']))
    assert 'compressed' not in raw
    assert 'cameras.image.compressed:=true' in jpeg
    assert 'cameras.wrist_image.compressed:=true' in jpeg
