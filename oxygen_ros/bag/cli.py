"""`oxygen-ros replay` and `oxygen-ros record-demo`: arguments, summaries, exit codes.

Errors are one line on stderr and exit code 2 (no traceback); Ctrl-C prints the summary of
what was written and exits with 130. The record-demo handler itself lives with the rclpy
code (oxygen_ros.tools.record_demo); oxygen_ros.cli passes it in, so this module stays ROS-free.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from typing import Callable

from oxygen_ros.bag.errors import BagError
from oxygen_ros.runtime.cli_options import add_engine_options, RTC_PARAMS

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _add_param_arguments(parser: argparse.ArgumentParser) -> None:
    """Node parameters that may be given on the command line (they override --config)."""
    group = parser.add_argument_group('node parameters (override --config)')
    group.add_argument('--config', help="the node's ROS 2 parameter file (config/<robot>.yaml)")
    group.add_argument('--node-name', default='oxygen_node',
                       help='node whose ros__parameters to read (default %(default)s)')
    group.add_argument('--robot', help='a shipped robot (libero, droid, aloha, so101) or the '
                                       'path of a robot YAML; a LeRobot dataset without one: '
                                       'read from its meta/info.json')
    group.add_argument('--namespace', help='node namespace for relative topic names')
    group.add_argument('--camera-names', nargs='+', metavar='NAME')
    group.add_argument('--camera-topics', nargs='+', metavar='TOPIC',
                       help='base topic of each camera, in camera_names order')
    group.add_argument('--instruction-topic')
    group.add_argument('--joint-states-topic')
    group.add_argument('--joint-names', nargs='+', metavar='NAME')
    group.add_argument('--control-rate', type=float, dest='control_rate_hz', metavar='HZ')


def _param_overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _camera_topic_overrides(args: argparse.Namespace) -> dict:
    """--camera-topics T1 T2 -> cameras.<name>.topic for the cameras in camera_names order."""
    if not getattr(args, 'camera_topics', None):
        return {}
    names = args.camera_names
    from oxygen_ros.bag.config import node_values
    from oxygen_ros.runtime.params import camera_param_name, robot_defaults

    if names is None:
        robot = args.robot
        if robot is None and args.config:
            robot = node_values(args.config, node_name=args.node_name).get('robot')
        try:
            names = list(robot_defaults(robot or 'libero')['camera_names'])
        except ValueError as err:   # RobotSpecError: a robot YAML that cannot be read
            raise BagError(str(err)) from None
    if len(names) != len(args.camera_topics):
        raise BagError(f'--camera-topics has {len(args.camera_topics)} topics for '
                       f'{len(names)} cameras ({", ".join(names)})')
    return {camera_param_name(n, 'topic'): t for n, t in zip(names, args.camera_topics)}


# Node parameter names (oxygen_ros.runtime.params) set from the command line.
_TOPIC_PARAMS = ('robot', 'camera_names', 'joint_names', 'control_rate_hz')
_ENGINE_PARAMS = ('checkpoint', 'preset', 'device', 'dtype', 'seed', 'decode_budget',
                  'tokens_per_request', 'request_every_n_frames', 'language_prompt',
                  'kv_capacity', 'denoise_steps', 'stale_frame_timeout_s',
                  'tokenizer') + RTC_PARAMS
# ReplayParams fields (not node parameters).
_REPLAY_OPTIONS = ('namespace', 'instruction_topic', 'joint_states_topic',
                   'instruction_override', 'on_bad_input')


def add_replay_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        'replay', help='run the engine over a recorded bag; write its outputs to a new bag',
        description='Replay a rosbag2 (sqlite3 or MCAP) through the engine at the control rate '
                    'and write a new bag (MCAP) with the input topics plus actions, '
                    'language/tokens, language/narration and /diagnostics.')
    parser.add_argument('bag', help='input rosbag2 directory (or .mcap file), or a LeRobot '
                                    'dataset folder (v2.x / v3.0)')
    parser.add_argument('--out', required=True, help='output bag directory (must not exist)')
    parser.add_argument('--rate', default='recorded',
                        help="'recorded' (real time, default), 'max' (as fast as possible) or "
                             'a speed factor such as 2')
    add_engine_options(parser)
    parser.add_argument('--instruction', dest='instruction_override', metavar='TEXT',
                        help="replace the bag's instructions with this text")
    parser.add_argument('--stale-timeout', type=float, dest='stale_frame_timeout_s',
                        metavar='S')
    parser.add_argument('--on-bad-input', choices=['error', 'skip'],
                        help="undecodable or malformed input: stop with an error (default) or "
                             "skip the tick as the node does")
    parser.add_argument('--storage', default='mcap', choices=['mcap', 'sqlite3'])
    parser.add_argument('--copy', default='inputs', choices=['inputs', 'all', 'none'],
                        help='input topics to copy into the output (default %(default)s)')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --out bag')
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0 = default)')
    parser.add_argument('--quiet', action='store_true', help='no progress bar')
    parser.add_argument('--rtc-compare', action='store_true',
                        help='replay once per real-time chunking mode (off, guided, prefix) '
                             'into OUT/<mode>; compare boundary jumps, total variation and '
                             'act() time (OUT/rtc.csv, OUT/rtc_boundaries.png)')
    dataset = parser.add_argument_group('LeRobot datasets')
    dataset.add_argument('--camera', action='append', default=[], metavar='NAME=FEATURE',
                         help="robot camera <- dataset feature (default: a feature named "
                              "'observation.images.NAME' or 'NAME')")
    dataset.add_argument('--state-key', default='observation.state',
                         help='state feature (default %(default)s)')
    dataset.add_argument('--action-key', default='action',
                         help='recorded action feature (default %(default)s)')
    dataset.add_argument('--episodes', type=int, nargs='+', metavar='INDEX',
                         help='episodes to replay (default: all)')
    _add_param_arguments(parser)
    parser.set_defaults(func=replay_main)
    return parser


def add_record_demo_parser(sub, handler: Callable[[argparse.Namespace], int]
                           ) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        'record-demo', help="record the node's input topics (demo publisher) to a bag",
        description="Run the node demo's stand-in robot (scikit-image sample photos with "
                    'slight motion, joint states, an instruction) and record its topics over '
                    'DDS with an rclpy subscriber to a rosbag2, as input for `oxygen-ros '
                    'replay`. With --no-publish, record what others publish instead.')
    parser.add_argument('--duration', type=float, required=True, metavar='S')
    parser.add_argument('--out', required=True, help='output bag directory (must not exist)')
    parser.add_argument('--instruction', default='pick up the red block', metavar='TEXT')
    parser.add_argument('--no-publish', dest='publish', action='store_false',
                        help='record what others publish (a robot, the node demo) instead')
    parser.add_argument('--image-size', type=int, default=224, metavar='PIXELS',
                        help='side of the square demo images (default %(default)s)')
    parser.add_argument('--camera-hz', type=float, default=15.0)
    parser.add_argument('--state-hz', type=float, default=50.0)
    parser.add_argument('--storage', default='mcap', choices=['mcap', 'sqlite3'])
    parser.add_argument('--overwrite', action='store_true')
    _add_param_arguments(parser)
    parser.set_defaults(func=handler)
    return parser


def params_from_args(args: argparse.Namespace, engine: bool = True, robot_spec=None):
    """Build ReplayParams from --config plus the command-line overrides.

    robot_spec: the robot when it has no file (read from a dataset).
    """
    from oxygen_ros.bag.config import load_params

    names = _TOPIC_PARAMS + (_ENGINE_PARAMS if engine else ())
    overrides = {**_param_overrides(args, names), **_camera_topic_overrides(args)}
    return load_params(args.config, overrides, node_name=args.node_name, robot_spec=robot_spec,
                       **_param_overrides(args, _REPLAY_OPTIONS))


def robot_given(args: argparse.Namespace) -> bool:
    """Whether --robot or the --config file names the robot."""
    if args.robot is not None:
        return True
    if not args.config:
        return False
    from oxygen_ros.bag.config import node_values
    return 'robot' in node_values(args.config, node_name=args.node_name)


def dataset_robot(path: str):
    """Read the robot a LeRobot dataset describes; log each assumption as a warning."""
    from oxygen_ros.dataset import DatasetError, LeRobotDataset
    from oxygen_ros.runtime.robot_source import dataset_robot as read_robot, RobotSpecError

    try:
        inferred = read_robot(LeRobotDataset(path).info, path)
    except (DatasetError, RobotSpecError) as err:
        raise BagError(f'{err} (or give the robot: --robot NAME|FILE)') from None
    log = logging.getLogger('oxygen_ros.replay')
    spec = inferred.spec
    log.warning('no --robot: read robot %r from %s: %d cameras (%s), state %d, actions %d',
                spec.name, spec.source, len(spec.cameras), ', '.join(
                    f'{cam} <- {feature}' for cam, feature in inferred.features.items()),
                spec.state_dim, spec.action_dim)
    for line in inferred.assumed:   # formatted here: each distinct message is shown once
        log.warning(f'assumed {line}')
    log.warning('keep it: oxygen-ros robot-spec --from %s > robot.yaml', path)
    return inferred


def error(command: str, err: BaseException) -> int:
    print(f'oxygen-ros {command}: error: {err}', file=sys.stderr)
    return EXIT_ERROR


def replay_main(args: argparse.Namespace) -> int:
    """Run `oxygen-ros replay`; return the exit code."""
    _setup_logging()
    try:
        from oxygen_ros.dataset import is_dataset
        inferred = None
        if is_dataset(args.bag) and not robot_given(args):
            inferred = dataset_robot(args.bag)
        params = params_from_args(args, robot_spec=inferred.spec if inferred else None)
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        if is_dataset(args.bag):
            camera_map = inferred.features if inferred else {}

            def make_replay(out, params, **options):
                return _dataset_replay(args, params, out, camera_map, **options)
        else:
            from oxygen_ros.bag.replay import Replay

            def make_replay(out, params, **options):
                return Replay(args.bag, out, params, rate=args.rate, storage=args.storage,
                              overwrite=args.overwrite, copy=args.copy,
                              progress=not args.quiet, node_name=args.node_name, **options)
        if args.rtc_compare:
            from oxygen_ros.bag.rtc_compare import compare_rtc
            compare_rtc(make_replay, args.out, params, overwrite=args.overwrite)
            return 0
        replay = make_replay(args.out, params)
    except BagError as err:
        return error('replay', err)
    except KeyboardInterrupt:
        print('oxygen-ros replay: interrupted', file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        with _stop_on_sigint(replay):
            summary = replay.run()
    except BagError as err:
        _print_partial(replay.summary)
        return error('replay', err)
    except KeyboardInterrupt:
        _print_partial(replay.summary)
        print('oxygen-ros replay: interrupted', file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary.format())
    if not summary.deterministic:
        print('  note: adaptive k reads the wall clock; tokens may differ between replays')
    return 0


def _dataset_replay(args: argparse.Namespace, params, out, camera_map: dict[str, str],
                    **options):
    """Build the DatasetReplay the options describe (a LeRobot dataset is paced by its frames).

    camera_map: robot camera -> dataset feature, under --camera's.
    """
    from oxygen_ros.bag.dataset_replay import DatasetReplay

    mapping = dict(camera_map)
    for item in args.camera:
        name, sep, feature = item.partition('=')
        if not sep or not name or not feature:
            raise BagError(f'--camera {item!r}; expected NAME=FEATURE, e.g. '
                           'image=observation.images.front')
        mapping[name] = feature
    return DatasetReplay(args.bag, out, params, camera_map=mapping or None,
                         state_key=args.state_key, action_key=args.action_key,
                         episodes=args.episodes, storage=args.storage,
                         overwrite=args.overwrite, progress=not args.quiet, **options)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)   # all close the bag cleanly


@contextlib.contextmanager
def _stop_on_sigint(replay):
    """First Ctrl-C (or SIGTERM, SIGHUP): stop after the current tick; second: stop at once.

    Either way the output bag is closed and readable. Why not the default KeyboardInterrupt:
    raised inside a C extension it can make CPython (3.11) end the process with SIGINT even
    after it was handled, losing the exit code; SIGTERM's default would lose the bag.
    """
    def on_signal(signum, frame):
        if replay.stop_requested:
            raise KeyboardInterrupt
        replay.request_stop()
        print(f'oxygen-ros replay: {signal.Signals(signum).name}: stopping after this tick '
              '(again to abort)', file=sys.stderr)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _print_partial(summary) -> None:
    if summary.status != 'running' and summary.ticks:
        print(summary.format())
        print(f'  {summary.out} is closed and readable with everything written so far')


class _RepeatFilter(logging.Filter):
    """Let each distinct warning through once (per-frame warnings would bury the progress bar)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = f'{record.name}:{record.msg}'
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _setup_logging() -> None:
    """Warnings to stderr, each distinct one once (unless logging is configured already)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter('%(levelname)s %(name)s: %(message)s'))
    handler.addFilter(_RepeatFilter())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
