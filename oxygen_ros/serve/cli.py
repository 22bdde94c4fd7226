"""`oxygen-ros serve`: openpi's policy server protocol over the OxyGen engine.

Engine settings are the node's parameters (oxygen_ros.runtime.params: same names, defaults and
checks); errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from oxygen_ros.runtime.cli_options import add_engine_options, RTC_PARAMS
from oxygen_ros.serve.server import DEFAULT_PORT

EXIT_ERROR = 2
TOKEN_ENV = 'OXYGEN_ROS_SERVE_TOKEN'

# command-line option dest -> node parameter
_ENGINE_PARAMS = ('checkpoint', 'preset', 'device', 'dtype', 'tokenizer', 'seed',
                  'decode_budget', 'tokens_per_request', 'request_every_n_frames',
                  'language_prompt', 'kv_capacity', 'denoise_steps', 'torch_threads',
                  'control_rate_hz') + RTC_PARAMS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's node parameters as options (serve and check-checkpoint)."""
    group = parser.add_argument_group('engine (node parameters; defaults as the node)')
    group.add_argument('--robot', default='libero',
                       help='a shipped robot (libero, droid, aloha, so101) or the path of a '
                            'robot YAML (docs/robots.md); default %(default)s')
    add_engine_options(group)
    group.add_argument('--threads', type=int, dest='torch_threads',
                       help='torch threads (default: every core but one)')


def settings_from_args(args: argparse.Namespace):
    """Build the node's Settings from the options (raises ValueError naming what is wrong)."""
    from oxygen_ros.runtime.params import robot_defaults, Settings

    values = robot_defaults(args.robot)   # RobotSpecError (a ValueError) names the file
    values.update({name: getattr(args, name) for name in _ENGINE_PARAMS
                   if getattr(args, name, None) is not None})
    return Settings.from_values(values)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        'serve', help="serve the engine over openpi's websocket policy protocol",
        description="Serve the OxyGen engine to openpi's robot clients "
                    '(openpi_client.websocket_client_policy.WebsocketClientPolicy) unchanged: '
                    'msgpack over a websocket, metadata on connect, infer(obs) -> '
                    '{"actions": [H, A], ...}; GET /healthz answers 200 while it runs. '
                    'Responses add "language": the narration of earlier frames.')
    parser.add_argument('--host', default='0.0.0.0',
                        help='address to listen on (default %(default)s: every interface)')
    parser.add_argument('--port', type=int, default=DEFAULT_PORT,
                        help='port (default %(default)s, as openpi; 0 = any free port)')
    parser.add_argument('--default-prompt', default='', metavar='TEXT',
                        help="task text for requests without 'prompt' (default: required)")
    parser.add_argument('--max-pending', type=int, default=4, metavar='N',
                        help='requests one client may have waiting (default %(default)s)')
    parser.add_argument('--observation-keys', metavar='FILE',
                        help="YAML map of where the robot's client puts each camera and the "
                             'state (docs/robots.md); default: openpi\'s keys for libero, droid '
                             'and aloha, observation/<camera> and observation/state otherwise')
    parser.add_argument('--max-message-mb', type=float, default=0.0, metavar='MB',
                        help='largest request read, in MB; bigger ones are refused before '
                             "they are read (default: the robot's largest valid observation, "
                             'every camera at 1920x1080 float32, + 25%%: 62 MB for libero)')
    parser.add_argument('--token', default=os.environ.get(TOKEN_ENV, ''),
                        help='shared secret every client must send as "Authorization: '
                             'Api-Key <token>" (openpi-client: api_key=...); default $'
                             f'{TOKEN_ENV}, none when unset. Use it whenever --host is not '
                             'a loopback address')
    add_engine_arguments(parser)
    parser.set_defaults(func=serve_main)
    return parser


def serve_main(args: argparse.Namespace) -> int:
    """Run `oxygen-ros serve` until Ctrl-C; return the exit code."""
    from oxygen_ros.runtime.engine_setup import build_engine, SETUP_ERRORS
    from oxygen_ros.serve.observations import load_observation_keys
    from oxygen_ros.serve.server import PolicyServer, ServerConfig

    logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
    if not 0 <= args.port <= 65535:
        return _error(f'port {args.port}; expected 0..65535')
    if args.max_pending < 1:
        return _error(f'max-pending {args.max_pending}; expected >= 1')
    if args.max_message_mb < 0:
        return _error(f'max-message-mb {args.max_message_mb:g}; expected > 0 (0 = default)')
    try:
        settings = settings_from_args(args)
        keys = (load_observation_keys(args.observation_keys, settings.spec)
                if args.observation_keys else None)
        engine = build_engine(settings)
    except SETUP_ERRORS as err:
        return _error(err)
    config = ServerConfig(robot=settings.spec, observation_keys=keys, host=args.host,
                          port=args.port, default_prompt=args.default_prompt,
                          max_pending=args.max_pending,
                          max_instruction_chars=settings.max_instruction_chars,
                          period_s=engine.settings.period_s, rtc=settings.rtc,
                          max_message_bytes=round(args.max_message_mb * 1e6), token=args.token)
    log = logging.getLogger(__name__)
    for warning in engine.warnings:
        log.warning(warning)
    if not args.token and not is_loopback(args.host):
        log.warning('listening on %s without a token: any computer that reaches port %d can '
                    'drive this policy; set %s (clients send it as api_key) or --host 127.0.0.1',
                    args.host, args.port, TOKEN_ENV)
    server = PolicyServer(engine.system, config, engine.description)
    try:
        port = server.start()
    except OSError as err:
        return _error(f'cannot listen on {args.host}:{args.port}: {err}')
    print(f'oxygen-ros serve: {settings.spec.name} on ws://{args.host}:{port} '
          f'({engine.description.get("source", "")}; requests up to '
          f'{server.max_message_bytes / 1e6:.1f} MB{"; token required" if args.token else ""}'
          '); Ctrl-C stops', flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        print('oxygen-ros serve: stopping', file=sys.stderr)
    finally:
        server.stop()
    return 0


def is_loopback(host: str) -> bool:
    """Return whether `host` (an address or name) is this machine only."""
    if host == 'localhost':
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error(err) -> int:
    print(f'oxygen-ros serve: error: {err}', file=sys.stderr)
    return EXIT_ERROR
