"""Command-line options that set the engine's node parameters (serve, check-checkpoint, replay).

Each option's dest is the node parameter it sets (oxygen_ros.runtime.params), so a command
turns the parsed options into Settings with the node's own checks and defaults. None means
"not given": the parameter keeps its default (or the value from a --config file).
"""

from __future__ import annotations

import argparse

from oxygen_ros.runtime.params import DTYPES, RTC_MODES, RTC_SCHEDULES

# The real-time chunking options' dests (node parameters), for the commands' parameter lists.
RTC_PARAMS = ('rtc_mode', 'rtc_schedule', 'rtc_delay', 'rtc_execution_horizon',
              'rtc_max_guidance_weight')


def add_engine_options(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the model and language options every engine command shares to `group`."""
    group.add_argument('--checkpoint', help='openpi or LeRobot π0.5 checkpoint folder '
                                            '(default: random weights of --preset)')
    group.add_argument('--preset', help='model preset for random weights (e.g. pi05-cpu)')
    group.add_argument('--device')
    group.add_argument('--dtype', choices=list(DTYPES))
    group.add_argument('--tokenizer', help="SentencePiece model (default: the checkpoint's)")
    group.add_argument('--seed', type=int)
    group.add_argument('--k', dest='decode_budget', type=int,
                       help='tokens per request per frame; 0 = adaptive')
    group.add_argument('--tokens', type=int, dest='tokens_per_request', metavar='N',
                       help='tokens per language request')
    group.add_argument('--request-every', type=int, dest='request_every_n_frames',
                       metavar='FRAMES', help='start a language request every n frames')
    group.add_argument('--prompt-template', dest='language_prompt',
                       help='language prompt template ({instruction} is replaced)')
    group.add_argument('--kv-capacity', type=int)
    group.add_argument('--denoise-steps', type=int)
    group.add_argument('--rtc', dest='rtc_mode', choices=list(RTC_MODES),
                       help='real-time chunking: each chunk continues the committed one '
                            '(docs/rtc.md; default off)')
    group.add_argument('--rtc-schedule', dest='rtc_schedule', choices=list(RTC_SCHEDULES))
    group.add_argument('--rtc-delay', dest='rtc_delay', type=int, metavar='ROWS',
                       help='rows that play while a chunk is computed; -1 = auto (default)')
    group.add_argument('--rtc-execution-horizon', dest='rtc_execution_horizon', type=int,
                       metavar='ROWS', help='rows guided toward the committed chunk (0 = all)')
    group.add_argument('--rtc-max-guidance-weight', dest='rtc_max_guidance_weight', type=float,
                       metavar='BETA')
