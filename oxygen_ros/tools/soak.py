"""`oxygen-ros soak`: oxygen_node over DDS for a while, under random load and injected faults.

    oxygen-ros soak --duration 60 --out soak-results [--preset tiny] [--fault-rate 0.02]

Two processes, as on a robot: the node (its own process, with faults injected into its engine:
decode steps that raise, frame-slot allocations that find the pool "full" and must evict
language) and this process, a chaotic robot: cameras at `camera_hz`, joint states, the task;
every `event_s` one random event: a camera drops for a while, a camera publisher restarts, the
instruction changes, decode_budget or request_every_n_frames are set, a corrupt image arrives.

Measured: the node's RSS over time (flat?), the action rate in healthy windows (every input
fresh) against the asked rate (actions never missed because of language or faults), tokens,
how requests ended, and at the end the slot accounting (language stopped, every request ended:
0 KV slots may remain in use) and a clean Ctrl-C. Writes soak.json, soak.md and soak.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from oxygen_ros.runtime.procfs import status_kb

FAULT_ENV = 'OXYGEN_ROS_SOAK_FAULTS'   # "rate,seed" for the node process
EVENTS = ('drop_camera', 'restart_cameras', 'instruction', 'decode_budget', 'request_rate',
          'corrupt_image', 'nothing')
INSTRUCTIONS = ('pick up the black bowl', 'open the top drawer', 'put the cheese in the bowl',
                'stack the red block on the blue one', '')


@dataclasses.dataclass
class SoakOptions:
    """What one soak run does."""

    duration_s: float = 60.0
    out: Path = Path('soak-results')
    preset: str = 'tiny'
    robot: str = 'libero'
    rate_hz: float = 10.0
    tokens: int = 6
    camera_hz: float = 15.0
    image_size: int = 96
    fault_rate: float = 0.02        # per decode step and per frame-slot allocation
    event_s: float = 2.0            # one random event this often
    stale_s: float = 0.5            # the node's stale_frame_timeout_s
    seed: int = 0
    start_timeout_s: float = 300.0


# --- the node, with faults injected into its engine -----------------------------------------
def _inject_faults(engine, rate: float, rng: random.Random, counts: dict) -> None:
    """Make the engine's decode steps raise and its frame allocations meet a full pool."""
    system = engine.system
    decode, pool = system.runner.decode, system.pool
    allocate = pool.allocate

    def faulty_decode(*args, **kwargs):
        if rng.random() < rate:
            counts['decode'] += 1
            raise RuntimeError('injected decode failure (soak)')
        return decode(*args, **kwargs)

    def faulty_allocate(holder):
        # A "full pool" the scheduler must answer by preempting language, never by dropping
        # the frame: only injected while there is a live request to evict.
        if holder.startswith('frame') and system.num_live_requests and rng.random() < rate:
            counts['allocation'] += 1
            pool.num_refusals += 1
            return None
        return allocate(holder)
    system.runner.decode = faulty_decode
    pool.allocate = faulty_allocate


def node_with_faults(argv: list[str]) -> int:
    """Run oxygen_node with the faults that FAULT_ENV describes (the soak's node process)."""
    from oxygen_ros.ros import node
    from oxygen_ros.runtime.engine_setup import build_engine

    rate, seed = (float(x) for x in os.environ.get(FAULT_ENV, '0,0').split(','))
    rng, counts = random.Random(int(seed)), {'decode': 0, 'allocation': 0}

    def build_with_faults(settings):
        engine = build_engine(settings)   # the soak's node serves one robot
        _inject_faults(engine, rate, rng, counts)
        return engine

    def report():
        print(f'SOAK_FAULTS {json.dumps(counts)}', flush=True)
    import atexit
    atexit.register(report)
    signal.signal(signal.SIGUSR1, lambda *_: report())
    return node.main(['oxygen_node'] + argv, fast_exit=False, engine_builder=build_with_faults)


# --- the chaotic robot ----------------------------------------------------------------------
class ChaosRobot:
    """Publishes the robot's inputs, applies random events, records what comes back."""

    def __init__(self, opts: SoakOptions, context):
        import numpy as np
        from rcl_interfaces.srv import SetParameters
        from rclpy.node import Node
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import String

        from oxygen_ros.msg import ActionChunk, LanguageChunk
        from oxygen_ros.ros import qos
        from oxygen_ros.ros.sim_inputs import camera_frame, image_msg, PHOTOS
        from oxygen_ros.runtime.params import ROBOT_IO

        self.np, self.opts = np, opts
        self.node = Node('oxygen_soak_robot', context=context)
        self.Image, self.JointState, self.String = Image, JointState, String
        self.camera_frame, self.image_msg, self.photos = camera_frame, image_msg, PHOTOS
        self.qos = qos
        self.cameras = list(ROBOT_IO[opts.robot][0])
        self.joints = list(ROBOT_IO[opts.robot][1])
        self.rng = random.Random(opts.seed)
        self.lock = threading.Lock()
        self.index = 0
        self.dropped: dict[str, float] = {}          # camera -> monotonic time it returns
        self.corrupt_until = 0.0
        self.unhealthy: list[tuple[float, float]] = []   # (from, to) monotonic
        self.events: list[tuple[float, str]] = []
        self.actions: list[float] = []               # receipt times
        self.tokens = 0
        self.finished: dict[str, int] = {}
        self.diagnostics: dict[str, dict[str, str]] = {}   # status part -> values
        self._make_camera_publishers()
        self.joint_pub = self.node.create_publisher(JointState, 'joint_states', qos.SENSOR)
        self.task_pub = self.node.create_publisher(String, 'instruction', qos.INSTRUCTION)
        self.task_pub.publish(String(data=INSTRUCTIONS[0]))
        self.params = self.node.create_client(SetParameters, '/oxygen_node/set_parameters')
        self.node.create_subscription(ActionChunk, 'actions', self._on_action,
                                      qos.ACTIONS_RECORDER)
        self.node.create_subscription(LanguageChunk, 'language/tokens', self._on_tokens,
                                      qos.TOKENS)
        from diagnostic_msgs.msg import DiagnosticArray
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics,
                                      qos.DIAGNOSTICS)
        self.node.create_timer(1.0 / opts.camera_hz, self._publish)
        self.chaos_timer = None

    def _make_camera_publishers(self) -> None:
        from oxygen_ros.runtime.params import default_camera_topic

        self.camera_pubs = {c: self.node.create_publisher(self.Image, default_camera_topic(c),
                                                          self.qos.SENSOR)
                            for c in self.cameras}

    def start_chaos(self) -> None:
        self.chaos_timer = self.node.create_timer(self.opts.event_s, self._event)

    # -- outputs
    def _on_action(self, msg) -> None:
        with self.lock:
            self.actions.append(time.monotonic())

    def _on_tokens(self, msg) -> None:
        with self.lock:
            self.tokens += len(msg.token_ids)
            if msg.done:
                self.finished[msg.finish_reason] = self.finished.get(msg.finish_reason, 0) + 1

    def _on_diagnostics(self, msg) -> None:
        with self.lock:
            for status in msg.status:
                if status.name.startswith('oxygen_node: '):
                    part = status.name.split(': ', 1)[-1]
                    self.diagnostics[part] = {kv.key: kv.value for kv in status.values}
                    self.diagnostics[part]['_message'] = status.message

    # -- inputs
    def _publish(self) -> None:
        now = time.monotonic()
        stamp = self.node.get_clock().now().to_msg()
        i, self.index = self.index, self.index + 1
        for n, camera in enumerate(self.cameras):
            if self.dropped.get(camera, 0.0) > now:
                continue
            rgb = self.camera_frame(self.photos[n % len(self.photos)], self.opts.image_size, i)
            msg = self.image_msg(rgb, stamp, camera)
            if now < self.corrupt_until and n == 0:
                msg.encoding = 'yuv422_garbage'
            self.camera_pubs[camera].publish(msg)
        joint = self.JointState(name=self.joints, position=[
            0.1 * math.sin(0.05 * i + j) for j in range(len(self.joints))])
        joint.header.stamp = stamp
        self.joint_pub.publish(joint)

    def _set(self, name: str, value) -> None:
        from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
        from rcl_interfaces.srv import SetParameters

        if isinstance(value, str):
            pv = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
        else:
            pv = ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
        self.params.call_async(SetParameters.Request(parameters=[Parameter(name=name,
                                                                           value=pv)]))

    def _event(self) -> None:
        now = time.monotonic()
        kind = self.rng.choice(EVENTS)
        gap = self.opts.stale_s + 1.0            # inputs are back to fresh after this
        if kind == 'drop_camera':
            camera = self.rng.choice(self.cameras)
            back = now + self.rng.uniform(0.5, 3.0)
            self.dropped[camera] = back
            self.unhealthy.append((now, back + gap))
            kind += f' {camera}'
        elif kind == 'restart_cameras':
            for pub in self.camera_pubs.values():
                self.node.destroy_publisher(pub)
            self._make_camera_publishers()
            self.unhealthy.append((now, now + gap))
        elif kind == 'instruction':
            text = self.rng.choice(INSTRUCTIONS)
            self.task_pub.publish(self.String(data=text))
            if not text:    # no task: no actions until the next instruction (as it should)
                self.task_pub.publish(self.String(data=INSTRUCTIONS[1]))
            self.unhealthy.append((now, now + gap))
            kind += f' {text!r}'
        elif kind == 'decode_budget':
            value = self.rng.choice(range(0, self.opts.tokens + 1))   # 0 = adaptive
            self._set('decode_budget', value)
            kind += f' {value}'
        elif kind == 'request_rate':
            value = self.rng.choice([1, 1, 2, 3])
            self._set('request_every_n_frames', value)
            kind += f' {value}'
        elif kind == 'corrupt_image':
            self.corrupt_until = now + 1.0
            self.unhealthy.append((now, now + 1.0 + gap))
        with self.lock:
            self.events.append((now, kind))


def _rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MiB (None when it is gone)."""
    kb = status_kb('VmRSS', pid)
    return kb / 1024 if kb else None


def _healthy_rate(actions: list[float], unhealthy: list[tuple[float, float]], start: float,
                  end: float, step: float = 0.1) -> tuple[float, float]:
    """(healthy seconds, actions received in them) over [start, end).

    The window is cut into `step`-second bins; a bin is healthy when neither of its ends falls
    inside an unhealthy interval [a, b) (a fault and the recovery after it). Vectorised: a
    30-minute soak has 18,000 bins and ~900 intervals.
    """
    n = max(0, math.ceil((end - start) / step - 1e-9))
    if n == 0:
        return 0.0, 0
    left = start + step * np.arange(n)                                      # bin starts
    ok = np.ones(n, dtype=bool)
    for a, b in unhealthy:
        ok &= ~(((a <= left) & (left < b)) | ((a <= left + step) & (left + step < b)))
    times = np.asarray(actions, dtype=float)
    times = times[(times >= start) & (times < start + n * step)]
    bins = np.minimum(((times - start) // step).astype(int), n - 1)
    per_bin = np.bincount(bins, minlength=n)
    return float(step * ok.sum()), int(per_bin[ok].sum())


def run_soak(opts: SoakOptions, progress=print) -> dict:
    """Run one soak; return (and write) its report."""
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor

    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    os.environ.setdefault('ROS_DOMAIN_ID', str(1 + os.getpid() % 100))
    opts.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{FAULT_ENV: f'{opts.fault_rate},{opts.seed}'})
    params = {'preset': opts.preset, 'robot': opts.robot, 'control_rate_hz': opts.rate_hz,
              'tokens_per_request': opts.tokens, 'decode_budget': 0,
              'stale_frame_timeout_s': opts.stale_s, 'seed': opts.seed, 'torch_threads': 1}
    ros_args = ['--ros-args'] + [a for k, v in params.items()
                                 for a in ('-p', f'{k}:={v}')]
    log = open(opts.out / 'node.log', 'w')
    node = subprocess.Popen([sys.executable, '-m', 'oxygen_ros.tools.soak', '--node', '--']
                            + ros_args, env=env, stdout=log, stderr=subprocess.STDOUT)
    context = Context()
    rclpy.init(context=context)
    executor = SingleThreadedExecutor(context=context)
    robot = ChaosRobot(opts, context)
    executor.add_node(robot.node)
    spin = threading.Thread(target=executor.spin, daemon=True)
    spin.start()
    report: dict = {'options': {k: str(v) for k, v in dataclasses.asdict(opts).items()}}
    try:
        deadline = time.monotonic() + opts.start_timeout_s
        while not robot.actions:
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'the node did not start acting (see {opts.out}/node.log)')
            time.sleep(0.2)
        progress(f'soak: node acting; {opts.duration_s:g} s of chaos')
        start = time.monotonic()
        robot.start_chaos()
        rss = []
        while time.monotonic() - start < opts.duration_s:
            if node.poll() is not None:
                raise RuntimeError(f'the node died (exit {node.returncode}); see node.log')
            rss.append((time.monotonic() - start, _rss_mb(node.pid)))
            time.sleep(1.0)
        end = time.monotonic()
        robot.chaos_timer.cancel()
        # Stop language and wait until every request has ended: then no slot may be held.
        robot._set('request_every_n_frames', 0)
        leak_deadline = time.monotonic() + 30
        kv = {}
        while time.monotonic() < leak_deadline:
            time.sleep(1.2)
            with robot.lock:
                lang = robot.diagnostics.get('language', {})
                kv = robot.diagnostics.get('kv cache', {})
            if lang.get('active_requests') == '0' and kv:
                break
        with robot.lock:
            loop = dict(robot.diagnostics.get('control loop', {}))
        node.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        stop = time.monotonic()
        node.send_signal(signal.SIGINT)
        code = node.wait(timeout=30)
        report['shutdown_s'] = round(time.monotonic() - stop, 3)
        report['exit_code'] = code
        healthy_s, healthy_actions = _healthy_rate(robot.actions, robot.unhealthy, start, end)
        samples = [m for _, m in rss if m is not None]
        head = samples[:max(len(samples) // 5, 1)]
        tail = samples[-max(len(samples) // 5, 1):]
        report.update({
            'duration_s': round(end - start, 1), 'asked_hz': opts.rate_hz,
            'healthy_s': round(healthy_s, 1),
            'healthy_rate_hz': round(healthy_actions / healthy_s, 2) if healthy_s else None,
            'healthy_rate_vs_asked': (round(healthy_actions / healthy_s / opts.rate_hz, 3)
                                      if healthy_s else None),
            'actions': len(robot.actions), 'tokens': robot.tokens,
            'finished': robot.finished, 'events': len(robot.events),
            'event_kinds': sorted({k.split()[0] for _, k in robot.events}),
            'rss_mb_start': round(sum(head) / len(head), 1) if head else None,
            'rss_mb_end': round(sum(tail) / len(tail), 1) if tail else None,
            'rss_mb_max': round(max(samples), 1) if samples else None,
            'slots_in_use_at_end': int(kv.get('slots_used', -1)),
            'tick_errors': int(float(loop.get('errors_total', '0') or 0)),
            'deadline_misses': int(float(loop.get('deadline_misses_total', '0') or 0)),
            'ticks': int(float(loop.get('ticks_total', '0') or 0)),
        })
        log.flush()
        faults = [line for line in (opts.out / 'node.log').read_text().splitlines()
                  if line.startswith('SOAK_FAULTS')]
        report['faults_injected'] = json.loads(faults[-1].split(' ', 1)[1]) if faults else {}
        report['rss'] = rss
        report['event_log'] = [(round(t - start, 2), k) for t, k in robot.events]
        report['action_times'] = [round(t - start, 3) for t in robot.actions]
    finally:
        if node.poll() is None:
            node.kill()
        executor.shutdown(timeout_sec=2)
        robot.node.destroy_node()
        rclpy.shutdown(context=context)
        log.close()
    _write(opts, report, robot.actions, start)
    return report


def _write(opts: SoakOptions, report: dict, actions: list[float], start: float) -> None:
    (opts.out / 'soak.json').write_text(json.dumps(report, indent=1))
    rows = [(k, report[k]) for k in (
        'duration_s', 'asked_hz', 'healthy_s', 'healthy_rate_hz', 'healthy_rate_vs_asked',
        'actions', 'tokens', 'finished', 'events', 'faults_injected', 'rss_mb_start',
        'rss_mb_end', 'rss_mb_max', 'slots_in_use_at_end', 'tick_errors', 'deadline_misses',
        'ticks', 'exit_code', 'shutdown_s')]
    (opts.out / 'soak.md').write_text('| figure | value |\n|---|---|\n' + ''.join(
        f'| {k} | {v} |\n' for k, v in rows))
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    t, mb = zip(*[(a, b) for a, b in report['rss'] if b is not None]) or ((), ())
    top.plot(t, mb)
    top.set_ylabel('node RSS (MB)')
    top.set_ylim(bottom=0)
    top.set_title(f'soak: {opts.preset}, {opts.duration_s:g} s, fault rate {opts.fault_rate}')
    seconds = [a - start for a in actions if a >= start]
    if seconds:
        bins = range(0, int(max(seconds)) + 2)
        bottom.hist(seconds, bins=list(bins), histtype='step')
    bottom.axhline(opts.rate_hz, color='grey', linestyle='--', label='asked')
    events = [when for when, _ in report['event_log']]
    bottom.plot(events, [opts.rate_hz * 1.12] * len(events), '|', color='tab:red',
                markersize=6, label='chaos event')
    bottom.set_ylabel('actions per second')
    bottom.set_xlabel('seconds')
    bottom.legend(loc='lower right')
    fig.tight_layout()
    fig.savefig(opts.out / 'soak.png', dpi=100)
    plt.close(fig)


def add_parser(sub) -> None:
    """Add `oxygen-ros soak` to the command line."""
    p = sub.add_parser('soak', help='run the node over DDS under random load and faults',
                       description=__doc__.split('\n\n')[0])
    d = SoakOptions()
    p.add_argument('--duration', type=float, default=d.duration_s, metavar='S')
    p.add_argument('--out', default=str(d.out))
    p.add_argument('--preset', default=d.preset)
    p.add_argument('--robot', default=d.robot, choices=['libero', 'droid', 'aloha'])
    p.add_argument('--rate', type=float, default=d.rate_hz, metavar='HZ')
    p.add_argument('--tokens', type=int, default=d.tokens, metavar='N')
    p.add_argument('--fault-rate', type=float, default=d.fault_rate)
    p.add_argument('--image-size', type=int, default=d.image_size)
    p.add_argument('--seed', type=int, default=d.seed)
    p.set_defaults(func=soak_main)


def soak_main(args: argparse.Namespace) -> int:
    """Run `oxygen-ros soak`; exit 1 when a soak target failed."""
    opts = SoakOptions(duration_s=args.duration, out=Path(args.out), preset=args.preset,
                       robot=args.robot, rate_hz=args.rate, tokens=args.tokens,
                       fault_rate=args.fault_rate, image_size=args.image_size, seed=args.seed)
    report = run_soak(opts)
    print((opts.out / 'soak.md').read_text())
    failed = failures(report)
    for why in failed:
        print(f'soak: FAILED: {why}')
    return 1 if failed else 0


def failures(report: dict, min_rate_share: float = 0.9) -> list[str]:
    """Return the soak targets a report misses (empty: all met)."""
    out = []
    if report.get('exit_code') != 0:
        out.append(f"node exit code {report.get('exit_code')}")
    if report.get('slots_in_use_at_end') != 0:
        out.append(f"{report.get('slots_in_use_at_end')} KV slots in use after every request "
                   'ended (a leak)')
    if report.get('tick_errors'):
        out.append(f"{report['tick_errors']} control ticks raised")
    share = report.get('healthy_rate_vs_asked')
    if share is None or share < min_rate_share:
        out.append(f'action rate in healthy windows {share} of the asked rate')
    return out


if __name__ == '__main__':
    if sys.argv[1:2] == ['--node']:
        rest = sys.argv[2:]
        raise SystemExit(node_with_faults(rest[1:] if rest[:1] == ['--'] else rest))
    raise SystemExit('usage: oxygen-ros soak ... '
                     '(python -m oxygen_ros.tools.soak --node is internal)')
