"""The demo: oxygen_node on a random-weight CPU model, fed by simulated cameras, with a live view.

    python -m oxygen_ros.tools.demo [--duration 60] [--rate auto] [--preset pi05-cpu]
    python -m oxygen_ros.tools.demo --robots arm_left,arm_right    # one node serving two arms

Two processes, as on a robot: the node runs in its own process (its model work never starves
the camera publishers or the view, and it is exactly the `oxygen_node` a robot runs), while
this process publishes the camera photos, joint states and instruction and shows what comes
back on `actions`, `language/tokens`, `language/narration` and `/diagnostics`. Ctrl-C (or the
end of --duration, counted from the node's first action) stops both cleanly. The node's log
goes to a file; its warnings and errors are shown in the view.

`--rate auto` (the default) starts the node with `control_rate_hz: 0`: it times a few frames of
its own engine at configure (act plus the least language work of a tick, runtime/capacity.py)
and runs at 90% of the rate it holds; the view prints what it found ("holds about X Hz at
preset P, asked Y Hz"). The view shows the node's inference time over that configure-time
act() p50 (the cost of running inside the node, next to the demo's publishers), deadline
misses, tokens/s per 5 s window and k; the final line sums them up after a 10 s warm-up.

`--robots a,b` runs one node serving several robots of the --robot type (parameter `robots`;
each robot's topics in its own namespace), with a stand-in robot and a view per robot. With
--rate auto the node times ticks serving every robot and all robots run at 90% of that rate.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
from pathlib import Path
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_INSTRUCTIONS = ('pick up the black bowl and place it on the plate',
                        'open the top drawer of the cabinet',
                        'put the cream cheese in the bowl')
CONFIG_DIR = Path(__file__).resolve().parents[2] / 'config'   # the source tree's
CAMERA_SIZE = 224                        # the demo cameras' image side (pixels)
WARMUP_S = 10.0                          # after the first action chunk: not in the summary
WINDOW_S = 5.0                           # tokens/s and misses are judged per window
# The node's start-up before its first action: model build, C++ kernels and compile (a first
# start on a machine: ~2 minutes on pi05-cpu; from the caches ~20 s). --duration runs after it.
STARTUP_TIMEOUT_S = 900.0


def decode_budget_value(decode_budget: str) -> int:
    """--decode-budget ('adaptive' or k) -> the node's integer parameter (0 = adaptive)."""
    return 0 if decode_budget == 'adaptive' else int(decode_budget)


def _dds_environment() -> None:
    # Discovery stays on this machine and the demo gets its own domain unless told otherwise;
    # this process (the cameras) and the node use the Fast DDS profile for raw frames.
    from oxygen_ros.runtime.dds_profile import profile_environment

    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    os.environ.setdefault('ROS_DOMAIN_ID', str(1 + os.getpid() % 100))
    os.environ.update(profile_environment())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='python -m oxygen_ros.tools.demo',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--duration', type=float, default=0.0,
                        help="seconds to run from the node's first action (0 = until Ctrl-C)")
    parser.add_argument('--startup-timeout', type=float, default=STARTUP_TIMEOUT_S,
                        help='seconds the node may take to send its first action (its '
                             'configure: the first start on a machine builds the C++ kernels '
                             'and compiles, ~2 minutes on pi05-cpu)')
    parser.add_argument('--robot', default='libero', choices=('libero', 'droid', 'aloha'))
    parser.add_argument('--robots', default='',
                        help='comma-separated robot names: one node serves them all (each a '
                             '--robot, in its own namespace)')
    parser.add_argument('--preset', default='pi05-cpu', help='random-weight model preset')
    parser.add_argument('--checkpoint', default='', help='openpi checkpoint directory instead')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--rate', default='auto',
                        help="control rate of the node in Hz, or 'auto' (the node's own: 90%% "
                             'of the rate it holds, timed at configure)')
    parser.add_argument('--threads', type=int, default=0,
                        help="the node's torch_threads (0 = its default: every core but one)")
    parser.add_argument('--camera-rate', type=float, default=10.0, help='camera frames/s')
    parser.add_argument('--jpeg', action='store_true',
                        help='cameras send CompressedImage jpeg (default: raw rgb8 Image, as '
                             'a camera driver does)')
    parser.add_argument('--decode-budget', default='adaptive', help="k or 'adaptive'")
    parser.add_argument('--tokens', type=int, default=10, help='tokens per language request')
    parser.add_argument('--instruction', action='append',
                        help='task text (repeat to cycle; default: three LIBERO tasks)')
    parser.add_argument('--instruction-period', type=float, default=30.0,
                        help='seconds between instruction changes')
    parser.add_argument('--plain', action='store_true', help='no ANSI redraw (logs-friendly)')
    parser.add_argument('--log-dir', default='', help='where the node log goes (default: tmp)')
    return parser.parse_args(argv)


# --- the node process ---------------------------------------------------------------------------
def robot_names(args: argparse.Namespace) -> list[str]:
    """Return the robots of --robots ([] = one robot in the root namespace)."""
    return [name.strip() for name in args.robots.split(',') if name.strip()]


def control_rate_hz(rate: str) -> float:
    """Return the node's rate parameter for --rate ('auto' or Hz; 0 = auto)."""
    return 0.0 if rate == 'auto' else float(rate)


def node_overrides(args: argparse.Namespace) -> dict:
    """Parameters the demo sets on top of the robot's YAML (with --robots: every robot's)."""
    overrides = {'preset': args.preset, 'checkpoint': args.checkpoint, 'device': args.device,
                 'control_rate_hz': control_rate_hz(args.rate),
                 'decode_budget': decode_budget_value(args.decode_budget),
                 'tokens_per_request': args.tokens}
    if robot_names(args):
        overrides['robots'] = robot_names(args)   # their parameters default to these
    return overrides


def node_command(args: argparse.Namespace) -> list[str]:
    """Command line of the node: the robot's YAML plus the demo's overrides."""
    overrides = node_overrides(args)
    if args.threads:
        overrides['torch_threads'] = args.threads   # an older node ignores it
    if args.jpeg:   # the node reads <topic>/compressed (image_transport naming)
        from oxygen_ros.runtime.params import camera_param_name, ROBOT_IO

        for camera in ROBOT_IO[args.robot][0]:
            overrides[camera_param_name(camera, 'compressed')] = 'true'
    cmd = [sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args',
           '--params-file', str(CONFIG_DIR / f'{args.robot}.yaml')]
    for name, value in overrides.items():
        cmd += ['-p', f'{name}:={value}' if value != '' else f'{name}:=""']
    return cmd


class NodeProcess:
    """oxygen_node as a child process; its log goes to a file, WARN/ERROR lines to `alerts`."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.log_path = log_path
        self.alerts: collections.deque[str] = collections.deque(maxlen=4)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors='replace', bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, 'w') as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if '[WARN]' in line or '[ERROR]' in line or 'Traceback' in line:
                    self.alerts.append(line.strip())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, interrupted: bool = False, timeout: float = 15.0) -> int:
        """SIGINT (the node's clean shutdown), then SIGTERM, then SIGKILL.

        interrupted: Ctrl-C in the terminal already reached the node (same process group), so
        give it time to finish before interrupting it a second time.
        """
        if interrupted:
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=2.0)
        return self.proc.returncode


# --- the monitor --------------------------------------------------------------------------------
def make_monitor(context=None, robot: str = ''):
    """Make a node recording what oxygen_node publishes (actions, tokens, narration, ...).

    robot: one robot of a node serving several (its namespace and diagnostics).
    """
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.node import Node
    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk, LanguageChunk
    from oxygen_ros.ros import qos

    class Monitor(Node):
        """Subscribes the node's outputs and keeps what the live view shows."""

        def __init__(self):
            super().__init__('oxygen_demo_monitor', namespace=robot, context=context)
            self.diagnostic_name = f'oxygen_node/{robot}' if robot else 'oxygen_node'
            self.lock = threading.Lock()
            self.action_times: collections.deque[float] = collections.deque(maxlen=200)
            # (receive time, inference_time s) of recent chunks; (receive time, tokens)
            self.inference: collections.deque[tuple] = collections.deque(maxlen=2000)
            self.token_times: collections.deque[tuple] = collections.deque(maxlen=20000)
            self.first_action_t: float | None = None
            self.actions = 0
            self.last_action = None
            self.tokens = 0
            self.streams: dict[int, str] = {}              # request id -> text so far
            self.narrations: collections.deque[str] = collections.deque(maxlen=6)
            self.diagnostics: dict[str, tuple[int, str, dict]] = {}
            self.create_subscription(ActionChunk, 'actions', self.on_action, qos.ACTIONS_RECORDER)
            self.create_subscription(LanguageChunk, 'language/tokens', self.on_tokens,
                                     qos.TOKENS)
            self.create_subscription(String, 'language/narration', self.on_narration,
                                     qos.NARRATION)
            self.create_subscription(DiagnosticArray, '/diagnostics', self.on_diagnostics,
                                     qos.DIAGNOSTICS)

        def on_action(self, msg):
            now = time.monotonic()
            with self.lock:
                self.actions += 1
                self.action_times.append(now)
                self.inference.append((now, msg.inference_time))
                if self.first_action_t is None:
                    self.first_action_t = now
                self.last_action = msg

        def on_tokens(self, msg):
            with self.lock:
                self.tokens += len(msg.token_ids)
                self.token_times.append((time.monotonic(), len(msg.token_ids)))
                text = self.streams.get(msg.request_id, '') + msg.text_delta
                if msg.done:
                    self.streams.pop(msg.request_id, None)
                    if msg.finish_reason not in ('eos', 'length'):
                        self.narrations.append(f'[request {msg.request_id}, frame '
                                               f'{msg.origin_frame}: {msg.finish_reason}] '
                                               f'{text}')
                else:
                    self.streams[msg.request_id] = text

        def on_narration(self, msg):
            with self.lock:
                self.narrations.append(msg.data)

        def on_diagnostics(self, msg):
            with self.lock:
                for status in msg.status:
                    record = (status.level[0] if status.level else 0, status.message,
                              {kv.key: kv.value for kv in status.values})
                    if status.name.startswith(self.diagnostic_name + ':'):
                        self.diagnostics[status.name.split(':', 1)[1].strip()] = record
                    if status.name == 'oxygen_node: model':   # the model and its timing
                        self.diagnostics['node model'] = record

        def window(self, since: float, until: float | None = None) -> tuple[float, float]:
            """Node inference p50 (s, nan if none) and tokens received, in [since, until)."""
            until = time.monotonic() if until is None else until
            with self.lock:
                inference = sorted(s for t, s in self.inference if since <= t < until)
                tokens = sum(n for t, n in self.token_times if since <= t < until)
            p50 = statistics.median(inference) if inference else math.nan
            return p50, tokens

        def action_rate(self, window: float = 5.0) -> float:
            with self.lock:
                now = time.monotonic()
                recent = [t for t in self.action_times if t > now - window]
            if len(recent) < 2:
                return 0.0
            return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-6)

    return Monitor()


# --- the view ------------------------------------------------------------------------------------
_LEVEL_COLOUR = {0: '\033[32m', 1: '\033[33m', 2: '\033[31m', 3: '\033[90m'}


class HoldTracker:
    """Judges the held rate after warm-up, window by window: rate, misses, tokens/s, k.

    Warm-up ends WARMUP_S after the first action chunk; from then on every WINDOW_S closes a
    window with the tokens received in it, the node's deadline misses (its diagnostics
    counter) and k.
    """

    def __init__(self):
        self.start: float | None = None         # end of warm-up (monotonic)
        self.actions_at_start = 0
        self.misses_at_start = math.nan
        self.windows: list[dict] = []
        self._window_start = 0.0
        self._misses_at_window = math.nan

    @staticmethod
    def _loop_value(monitor, part: str, key: str) -> float:
        with monitor.lock:
            values = monitor.diagnostics.get(part, (0, '', {}))[2]
        try:
            return float(values[key])
        except (KeyError, ValueError):
            return math.nan

    def update(self, monitor, now: float) -> None:
        """Start after warm-up; close a window every WINDOW_S."""
        first = monitor.first_action_t
        if first is None or now < first + WARMUP_S:
            return
        misses = self._loop_value(monitor, 'control loop', 'deadline_misses_total')
        if self.start is None:
            self.start = self._window_start = now
            self.actions_at_start = monitor.actions
            self.misses_at_start = self._misses_at_window = misses
            return
        if now - self._window_start >= WINDOW_S:
            p50, tokens = monitor.window(self._window_start, now)
            self.windows.append({'tokens_per_s': tokens / (now - self._window_start),
                                 'misses': misses - self._misses_at_window,
                                 'k': self._loop_value(monitor, 'language', 'current_k'),
                                 'inference_p50_s': p50})
            self._window_start, self._misses_at_window = now, misses

    def engine_act_s(self, monitor) -> float:
        """Return the node's act() p50 timed at configure (s; nan until its diagnostics say)."""
        return 1e-3 * self._loop_value(monitor, 'node model', 'capacity_act_ms')

    def misses(self, monitor) -> float:
        """Deadline misses since warm-up (nan before it ends)."""
        return (self._loop_value(monitor, 'control loop', 'deadline_misses_total')
                - self.misses_at_start)

    def ratio(self, monitor, now: float) -> tuple[float, float]:
        """Node inference p50 over the last window (s) and its ratio to the engine's act()."""
        p50, _ = monitor.window(now - WINDOW_S, now)
        return p50, p50 / self.engine_act_s(monitor)

    def summary(self, monitor, now: float) -> str:
        """One line: what held after warm-up."""
        if self.start is None or not self.windows:
            return 'after warm-up: not enough time to judge (run longer than ' \
                f'{WARMUP_S + WINDOW_S:g} s after the first action)'
        target_hz = self._loop_value(monitor, 'control loop', 'target_rate_hz')
        engine_act_s = self.engine_act_s(monitor)
        held = (monitor.actions - self.actions_at_start) / (now - self.start)
        p50, _ = monitor.window(self.start, now)
        tokens = [w['tokens_per_s'] for w in self.windows]
        ks = [w['k'] for w in self.windows if not math.isnan(w['k'])]
        return (f'after warm-up ({now - self.start:.0f} s, {len(self.windows)} windows of '
                f'{WINDOW_S:g} s): held {held:.2f} of {target_hz:g} Hz, deadline misses '
                f'{self.misses(monitor):.0f}, tokens/s per window min {min(tokens):.1f} '
                f'(every window > 0: {"yes" if min(tokens) > 0 else "no"}), k '
                f'{min(ks, default=math.nan):.0f}..{max(ks, default=math.nan):.0f}, node/engine '
                f'inference p50 {p50 / engine_act_s:.2f}x ({1e3 * p50:.0f} / '
                f'{1e3 * engine_act_s:.0f} ms)')


def render(monitor, args, elapsed: float, instruction: str, alerts, colour: bool,
           width: int, tracker: HoldTracker | None = None, robot: str = '') -> list[str]:
    """Render the live view as lines of text."""
    def level(name):
        lvl, message, values = monitor.diagnostics.get(name, (3, 'waiting', {}))
        tag = ('OK', 'WARN', 'ERROR', '...')[min(lvl, 3)]
        if colour:
            tag = f'{_LEVEL_COLOUR[min(lvl, 3)]}{tag:5}\033[0m'
        return tag, message, values

    def clip(text):
        return text if len(text) <= width else text[:width - 1] + '…'

    with monitor.lock:
        streams = list(monitor.streams.items())[-3:]
        narrations = list(monitor.narrations)
        actions, tokens = monitor.actions, monitor.tokens
        last = monitor.last_action

    def number(values, key, fmt='.0f'):
        try:
            return format(float(values[key]), fmt)
        except (KeyError, ValueError):
            return '-'

    now = time.monotonic()
    total = f' / {args.duration:.0f} s' if args.duration else ' (Ctrl-C to stop)'
    first = monitor.first_action_t
    clock = (f'{now - first:.0f} s{total}' if first is not None else
             f'starting {elapsed:.0f} s: the node configures (first start: kernels '
             'and compile, ~2 min)')
    source = args.checkpoint or f'random {args.preset}'
    tag, message, loop = level('control loop')
    label = f'{robot} ({args.robot})' if robot else args.robot
    lines = [f'oxygen_ros demo · {source} · robot {label} · target '
             f"{number(loop, 'target_rate_hz', 'g')} Hz · {clock}"]
    tag_model, message, values = level('model')
    if 'control loop' not in monitor.diagnostics:
        lines.append(f'{tag_model} node: {message}')
    capacity = level('node model')[2].get('capacity')
    if capacity:
        lines.append(f'         this machine {capacity}')
    since = ('warming up' if tracker is None or tracker.start is None else
             f'{tracker.misses(monitor):.0f} since warm-up')
    lines.append(f'{tag} actions  {monitor.action_rate():.2f} Hz received, {actions} chunks, '
                 f"deadline misses {loop.get('deadline_misses_window', '-')} in the last "
                 f'{WINDOW_S:g} s ({since}), latency p50 '
                 f"{number(loop, 'latency_p50_ms')} ms p99 {number(loop, 'latency_p99_ms')} ms")
    if tracker is not None:
        p50, ratio = tracker.ratio(monitor, now)
        shown = '-' if math.isnan(ratio) else f'{ratio:.2f}x'
        lines.append(f'         node/engine inference p50 {shown} (node '
                     f"{'-' if math.isnan(p50) else f'{1e3 * p50:.0f}'} ms over the last "
                     f'{WINDOW_S:g} s / engine act() '
                     f'{1e3 * tracker.engine_act_s(monitor):.0f} ms, timed at configure)')
    if last is not None:
        first_row = ', '.join(f'{v:+.2f}' for v in list(last.actions)[:last.action_dim])
        lines.append(f'         frame {last.frame_index}: {last.horizon}x{last.action_dim} '
                     f'actions, row 0 [{first_row}]')
    tag, message, lang = level('language')
    _, window_tokens = monitor.window(now - WINDOW_S, now)
    lines.append(f'{tag} language {window_tokens / WINDOW_S:.1f} tok/s over the last '
                 f'{WINDOW_S:g} s, {tokens} tokens, {lang.get("active_requests", "-")} active, '
                 f'k={lang.get("current_k", "-")}, requests in the node\'s last window: '
                 f'{lang.get("requests_completed_window", "-")} completed, '
                 f'{lang.get("requests_refused_window", "-")} refused, '
                 f'{lang.get("requests_evicted_window", "-")} evicted')
    tag, message, kv = level('kv cache')
    lines.append(f'{tag} kv cache {message}')
    tag, message, _ = level('inputs')
    lines.append(f'{tag} inputs   {message}')
    lines.append(f'instruction: {instruction}')
    lines.append('narration (finished requests):')
    lines += [f'  {n!r}' for n in narrations[-4:]] or ['  (none yet)']
    for rid, text in streams:
        lines.append(f'  request {rid} ▸ {text!r}')
    for alert in list(alerts)[-2:]:
        lines.append(f'node log: {alert}')
    return [clip(line) for line in lines]


def main(argv=None) -> int:
    """Run the demo; return the exit status."""
    args = parse_args(argv)
    _dds_environment()
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from oxygen_ros.runtime.params import ROBOT_IO
    from oxygen_ros.ros.sim_inputs import (CameraPublisher, InstructionPublisher,
                                           JointStatePublisher, robot_cameras)

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix='oxygen_demo_'))
    log_dir.mkdir(parents=True, exist_ok=True)
    instructions = args.instruction or list(DEFAULT_INSTRUCTIONS)
    robots = robot_names(args) or ['']
    trackers = {robot: HoldTracker() for robot in robots}
    node = NodeProcess(node_command(args), log_dir / 'oxygen_node.log')
    print(f'control rate: {args.rate}' + (' (the node times its frames at configure and runs '
                                          'at 90% of the rate it holds)'
                                          if args.rate == 'auto' else ' Hz (given)'))
    print(f'oxygen_node started (pid {node.proc.pid}, ROS_DOMAIN_ID='
          f'{os.environ["ROS_DOMAIN_ID"]}); its log: {node.log_path}')

    context = rclpy.Context()
    try:
        # Ctrl-C should reach this thread as KeyboardInterrupt, not shut the context down
        # under the executor: the demo then stops the node first and tears down in order.
        from rclpy.signals import SignalHandlerOptions
        rclpy.init(context=context, signal_handler_options=SignalHandlerOptions.NO)
    except ImportError:   # pragma: no cover - rclpy without signal handler options
        rclpy.init(context=context)
    # One stand-in robot per robot, in its namespace (the root one for a single robot).
    nodes, tasks = [], []
    for robot in robots:
        tasks.append(InstructionPublisher(instructions, args.instruction_period,
                                          namespace=robot, context=context))
        nodes += [CameraPublisher(robot_cameras(args.robot, args.jpeg), args.camera_rate,
                                  CAMERA_SIZE, namespace=robot, context=context),
                  JointStatePublisher(list(ROBOT_IO[args.robot][1]), namespace=robot,
                                      context=context), tasks[-1]]
    monitors = {robot: make_monitor(context, robot) for robot in robots}
    # Single-threaded: every callback here is short, and a MultiThreadedExecutor would spin
    # against the camera encoding for the GIL and the node's cores.
    executor = SingleThreadedExecutor(context=context)
    for n in nodes + list(monitors.values()):
        executor.add_node(n)
    stopping = threading.Event()

    def spin() -> None:
        try:
            executor.spin()
        except Exception:   # noqa: BLE001 - shutdown races are expected, nothing else
            # Ctrl-C: rclpy's signal handler shuts the context down under a running spin
            # (ExternalShutdownException), or shutdown() meets a callback in flight.
            if not stopping.is_set() and context.ok():
                raise

    spinner = threading.Thread(target=spin, name='demo_spin', daemon=True)
    spinner.start()

    colour = sys.stdout.isatty() and not args.plain
    start = time.monotonic()
    drawn = 0
    status = 0
    next_print = 0.0
    interrupted = False
    try:
        while True:
            now = time.monotonic()
            elapsed = now - start
            firsts = [m.first_action_t for m in monitors.values() if m.first_action_t]
            running = now - min(firsts) if firsts else None   # since the first action
            if args.duration and running is not None and running >= args.duration:
                break
            if running is None and elapsed >= args.startup_timeout:
                print(f'\noxygen_node sent no action in {elapsed:.0f} s (--startup-timeout); '
                      f'last lines of {node.log_path}:', file=sys.stderr)
                print('\n'.join(node.log_path.read_text().splitlines()[-15:]), file=sys.stderr)
                status = 1
                break
            if not node.alive():
                print(f'\noxygen_node exited with status {node.proc.returncode}; last lines '
                      f'of {node.log_path}:', file=sys.stderr)
                print('\n'.join(node.log_path.read_text().splitlines()[-15:]), file=sys.stderr)
                status = 1
                break
            width = shutil.get_terminal_size((120, 40)).columns
            lines = []
            for robot, task in zip(robots, tasks):
                trackers[robot].update(monitors[robot], time.monotonic())
                current = instructions[(task.index - 1) % len(instructions)]
                lines += render(monitors[robot], args, elapsed, current, node.alerts, colour,
                                width, trackers[robot], robot)
            if colour:
                sys.stdout.write(f'\033[{drawn}F\033[J' if drawn else '')
                sys.stdout.write('\n'.join(lines) + '\n')
                drawn = len(lines)
            elif elapsed >= next_print:
                print('\n'.join(lines) + '\n')
                next_print = elapsed + 5.0
            sys.stdout.flush()
            time.sleep(0.5 if colour else 1.0)
    except KeyboardInterrupt:
        interrupted = True
        print('\nstopping...')
    finally:
        ended = time.monotonic()
        stopping.set()
        code = node.stop(interrupted)
        executor.shutdown()
        for n in nodes + list(monitors.values()):
            n.destroy_node()
        if context.ok():
            rclpy.shutdown(context=context)
        spinner.join(timeout=5.0)
    actions = sum(m.actions for m in monitors.values())
    tokens = sum(m.tokens for m in monitors.values())
    print(f'done: {actions} action chunks, {tokens} tokens received; node exit '
          f'status {code}; node log {node.log_path}')
    for robot, monitor in monitors.items():
        counts = (f'{robot}: {monitor.actions} action chunks, {monitor.tokens} tokens; '
                  if robot else '')
        print(counts + trackers[robot].summary(monitor, ended))
    return status or (0 if code in (0, -signal.SIGINT) else 1)


if __name__ == '__main__':
    sys.exit(main())
