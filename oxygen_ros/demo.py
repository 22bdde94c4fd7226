"""The demo: oxygen_node on a random-weight CPU model, fed by simulated cameras, with a live view.

    python -m oxygen_ros.demo [--duration 60] [--rate auto] [--preset pi05-cpu]

Two processes, as on a robot: the node runs in its own process (its model work never starves
the camera publishers or the view, and it is exactly the `oxygen_node` a robot runs), while
this process publishes the camera photos, joint states and instruction and shows what comes
back on `actions`, `language/tokens`, `language/narration` and `/diagnostics`. Ctrl-C (or the
end of --duration) stops both cleanly. The node's log goes to a file; its warnings and errors
are shown in the view.

`--rate auto` (the default) starts at 1 Hz, measures the node's inference time over the first
frames and then sets the node's `control_rate_hz` parameter at runtime to a rate this machine
can hold with room left for language (the same `ros2 param set` a user would do).
"""

from __future__ import annotations

import argparse
import collections
import os
from pathlib import Path
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_INSTRUCTIONS = ('pick up the black bowl and place it on the plate',
                        'open the top drawer of the cabinet',
                        'put the cream cheese in the bowl')
CONFIG_DIR = Path(__file__).resolve().parents[1] / 'config'
START_RATE_HZ = 1.0                      # --rate auto: until the inference time is known
RATE_STEPS = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0)


def choose_rate(inference_ms: float, max_hz: float) -> float:
    """Fastest rate step whose period is 1.5x the inference time (a third left for language)."""
    fits = [r for r in RATE_STEPS if r <= min(max_hz, 1000.0 / (1.5 * inference_ms))]
    return fits[-1] if fits else RATE_STEPS[0]


def _dds_environment() -> None:
    # Discovery stays on this machine and the demo gets its own domain unless told otherwise.
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    os.environ.setdefault('ROS_DOMAIN_ID', str(1 + os.getpid() % 100))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='python -m oxygen_ros.demo', description=__doc__.split(
        '\n\n')[0])
    parser.add_argument('--duration', type=float, default=0.0,
                        help='seconds to run (0 = until Ctrl-C)')
    parser.add_argument('--robot', default='libero', choices=('libero', 'droid', 'aloha'))
    parser.add_argument('--preset', default='pi05-cpu', help='random-weight model preset')
    parser.add_argument('--checkpoint', default='', help='openpi checkpoint directory instead')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--rate', default='auto',
                        help="control rate of the node in Hz, or 'auto' (from measured "
                             'inference time)')
    parser.add_argument('--camera-rate', type=float, default=10.0, help='camera frames/s')
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
def node_command(args: argparse.Namespace) -> list[str]:
    """Command line of the node: the robot's YAML plus the demo's overrides."""
    overrides = {'preset': args.preset, 'checkpoint': args.checkpoint, 'device': args.device,
                 'control_rate_hz': START_RATE_HZ if args.rate == 'auto' else float(args.rate),
                 'decode_budget': f"'{args.decode_budget}'",
                 'tokens_per_request': args.tokens}
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
def make_monitor(context=None):
    """Make a node recording what oxygen_node publishes (actions, tokens, narration, ...)."""
    from diagnostic_msgs.msg import DiagnosticArray
    from rcl_interfaces.msg import Parameter as ParameterMsg, ParameterType
    from rcl_interfaces.srv import SetParameters
    from rclpy.node import Node
    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk, LanguageChunk
    from oxygen_ros.ros import qos

    class Monitor(Node):
        """Subscribes the node's outputs and keeps what the live view shows."""

        def __init__(self):
            super().__init__('oxygen_demo_monitor', context=context)
            self.lock = threading.Lock()
            self.action_times: collections.deque[float] = collections.deque(maxlen=200)
            self.actions = 0
            self.last_action = None
            self.tokens = 0
            self.streams: dict[int, str] = {}              # request id -> text so far
            self.narrations: collections.deque[str] = collections.deque(maxlen=6)
            self.diagnostics: dict[str, tuple[int, str, dict]] = {}
            self.create_subscription(ActionChunk, 'actions', self.on_action, qos.ACTIONS)
            self.create_subscription(LanguageChunk, 'language/tokens', self.on_tokens,
                                     qos.TOKENS)
            self.create_subscription(String, 'language/narration', self.on_narration,
                                     qos.NARRATION)
            self.create_subscription(DiagnosticArray, '/diagnostics', self.on_diagnostics,
                                     qos.DIAGNOSTICS)
            self.notes: collections.deque[str] = collections.deque(maxlen=2)
            self._set_params = self.create_client(SetParameters, '/oxygen_node/set_parameters')

        def set_rate(self, rate_hz: float, why: str) -> None:
            """Set the node's control_rate_hz (as `ros2 param set` would); note the result."""
            param = ParameterMsg(name='control_rate_hz')
            param.value.type = ParameterType.PARAMETER_DOUBLE
            param.value.double_value = float(rate_hz)
            future = self._set_params.call_async(SetParameters.Request(parameters=[param]))

            def done(fut):
                result = fut.result().results[0] if fut.result() else None
                self.notes.append(f'{why} -> control_rate_hz {rate_hz:g}: ' + (
                    'set' if result and result.successful else
                    f'rejected ({result.reason if result else "no reply"})'))
            future.add_done_callback(done)

        def on_action(self, msg):
            with self.lock:
                self.actions += 1
                self.action_times.append(time.monotonic())
                self.last_action = msg

        def on_tokens(self, msg):
            with self.lock:
                self.tokens += len(msg.token_ids)
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
                    if status.name.startswith('oxygen_node:'):
                        part = status.name.split(':', 1)[1].strip()
                        self.diagnostics[part] = (status.level[0] if status.level else 0,
                                                  status.message,
                                                  {kv.key: kv.value for kv in status.values})

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


def render(monitor, args, elapsed: float, instruction: str, alerts, colour: bool,
           width: int) -> list[str]:
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

    total = f' / {args.duration:.0f} s' if args.duration else ' (Ctrl-C to stop)'
    source = args.checkpoint or f'random {args.preset}'
    tag, message, loop = level('control loop')
    lines = [f'oxygen_ros demo · {source} · robot {args.robot} · target '
             f"{number(loop, 'target_rate_hz', 'g')} Hz · {elapsed:.0f} s{total}"]
    tag_model, message, values = level('model')
    if 'control loop' not in monitor.diagnostics:
        lines.append(f'{tag_model} node: {message}')
    lines.append(f'{tag} actions  {monitor.action_rate():.2f} Hz received, {actions} chunks, '
                 f"deadline misses {loop.get('deadline_misses_total', '-')}, latency p50 "
                 f"{number(loop, 'latency_p50_ms')} ms p99 {number(loop, 'latency_p99_ms')} ms "
                 f"(inference p50 {number(loop, 'inference_p50_ms')} ms)")
    if last is not None:
        first_row = ', '.join(f'{v:+.2f}' for v in list(last.actions)[:last.action_dim])
        lines.append(f'         frame {last.frame_index}: {last.horizon}x{last.action_dim} '
                     f'actions, row 0 [{first_row}]')
    tag, message, lang = level('language')
    lines.append(f'{tag} language {number(lang, "tokens_per_s", ".1f")} tok/s, {tokens} tokens, '
                 f'{lang.get("active_requests", "-")} active, k={lang.get("current_k", "-")}')
    tag, message, kv = level('kv cache')
    lines.append(f'{tag} kv cache {message}')
    tag, message, _ = level('inputs')
    lines.append(f'{tag} inputs   {message}')
    lines.append(f'instruction: {instruction}')
    lines.append('narration (finished requests):')
    lines += [f'  {n!r}' for n in narrations[-4:]] or ['  (none yet)']
    for rid, text in streams:
        lines.append(f'  request {rid} ▸ {text!r}')
    for note in list(monitor.notes):
        lines.append(f'demo: {note}')
    for alert in list(alerts)[-2:]:
        lines.append(f'node log: {alert}')
    return [clip(line) for line in lines]


def _auto_rate(monitor, max_hz: float) -> bool:
    """Once 3 frames are measured, set the node's rate from its inference time."""
    with monitor.lock:
        _, _, loop = monitor.diagnostics.get('control loop', (0, '', {}))
        actions = monitor.actions
    try:
        inference_ms = float(loop['inference_p50_ms'])
    except (KeyError, ValueError):
        return False
    if actions < 3 or inference_ms != inference_ms:
        return False
    rate = choose_rate(inference_ms, max_hz)
    monitor.set_rate(rate, f'auto rate: inference p50 {inference_ms:.0f} ms')
    return True


def main(argv=None) -> int:
    """Run the demo; return the exit status."""
    args = parse_args(argv)
    _dds_environment()
    import rclpy
    from rclpy.executors import MultiThreadedExecutor

    from oxygen_ros.runtime.params import ROBOT_IO
    from oxygen_ros.ros.sim_inputs import (CameraPublisher, InstructionPublisher,
                                           JointStatePublisher, robot_cameras)

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix='oxygen_demo_'))
    log_dir.mkdir(parents=True, exist_ok=True)
    node = NodeProcess(node_command(args), log_dir / 'oxygen_node.log')
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
    instructions = args.instruction or list(DEFAULT_INSTRUCTIONS)
    nodes = [CameraPublisher(robot_cameras(args.robot), args.camera_rate, context=context),
             JointStatePublisher(list(ROBOT_IO[args.robot][1]), context=context),
             InstructionPublisher(instructions, args.instruction_period, context=context)]
    monitor = make_monitor(context)
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    for n in nodes + [monitor]:
        executor.add_node(n)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()

    colour = sys.stdout.isatty() and not args.plain
    start = time.monotonic()
    drawn = 0
    status = 0
    next_print = 0.0
    tuned = args.rate != 'auto'
    interrupted = False
    try:
        while True:
            elapsed = time.monotonic() - start
            if args.duration and elapsed >= args.duration:
                break
            if not node.alive():
                print(f'\noxygen_node exited with status {node.proc.returncode}; last lines '
                      f'of {node.log_path}:', file=sys.stderr)
                print('\n'.join(node.log_path.read_text().splitlines()[-15:]), file=sys.stderr)
                status = 1
                break
            if not tuned:
                tuned = _auto_rate(monitor, args.camera_rate)
            current = instructions[(nodes[2].index - 1) % len(instructions)]
            width = shutil.get_terminal_size((120, 40)).columns
            lines = render(monitor, args, elapsed, current, node.alerts, colour, width)
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
        code = node.stop(interrupted)
        executor.shutdown()
        for n in nodes + [monitor]:
            n.destroy_node()
        if context.ok():
            rclpy.shutdown(context=context)
        spinner.join(timeout=5.0)
    print(f'done: {monitor.actions} action chunks, {monitor.tokens} tokens received; node exit '
          f'status {code}; node log {node.log_path}')
    return status or (0 if code in (0, -signal.SIGINT) else 1)


if __name__ == '__main__':
    sys.exit(main())
