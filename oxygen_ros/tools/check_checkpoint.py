"""`oxygen-ros check-checkpoint DIR`: load a checkpoint, run one frame, say what was found.

Prints the layout (openpi or LeRobot), the files it read (weights, config, norm stats,
tokenizer and where each came from), the model's sizes, then one frame's action shape and
timings. Exit code 0 when the frame ran; 2 with one line naming what is wrong otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
import sys
import time

EXIT_ERROR = 2


def add_parser(sub) -> argparse.ArgumentParser:
    from oxygen_ros.serve.cli import add_engine_arguments

    parser = sub.add_parser(
        'check-checkpoint', help='load a π0.5 checkpoint, run one frame, print what it found',
        description='Load an openpi or LeRobot π0.5 checkpoint folder as the node would, run '
                    'one frame on a synthetic observation and print shapes, timings and the '
                    'files found (weights, config, norm stats, tokenizer).')
    parser.add_argument('dir', help='checkpoint folder')
    add_engine_arguments(parser)
    parser.set_defaults(func=main, checkpoint=None)
    return parser


def _size(path: Path) -> str:
    return f'{path.stat().st_size / 2**20:.1f} MiB'


def main(args: argparse.Namespace) -> int:
    """Run the check; return the exit code."""
    from oxygen_ros.engine import random_observation
    from oxygen_ros.model.checkpoint import checkpoint_config, WEIGHTS_FILE
    from oxygen_ros.runtime.engine_setup import build_engine, SETUP_ERRORS
    from oxygen_ros.serve.cli import settings_from_args

    path = Path(args.dir).expanduser()
    args.checkpoint = str(path)
    try:
        if not (path / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f'{path}: no {WEIGHTS_FILE} (expected a checkpoint folder '
                                    'with model.safetensors and config.json)')
        checkpoint_config(path)                  # config.json first: the cheap check
        # compile off: the check loads and runs one frame; compiling would take minutes
        settings = dataclasses.replace(settings_from_args(args), compile='off')
        start = time.perf_counter()
        engine = build_engine(settings, warmup=False)
        load_s = time.perf_counter() - start
    except SETUP_ERRORS as err:
        print(f'oxygen-ros check-checkpoint: error: {err}', file=sys.stderr)
        return EXIT_ERROR
    model = engine.system.runner.model
    config = model.config
    print(engine.description['source'])
    print(f'  weights    {path / WEIGHTS_FILE} ({_size(path / WEIGHTS_FILE)}); '
          f'{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; engine built '
          f'in {load_s:.2f} s')
    b, e = config.backbone, config.expert
    print(f'  model      backbone width {b.width} depth {b.depth}, expert width {e.width}; '
          f'horizon {config.action_horizon}, action dim {config.action_dim}, '
          f'{config.num_steps} denoise steps, {config.max_token_len} prompt tokens')
    print(f'  norm stats {engine.description.get("norm_stats")} (state and actions, quantile '
          'normalisation)')
    print(f'  tokenizer  {engine.description.get("tokenizer")}')

    system, size = engine.system, config.vision.image_size
    times = []
    for i in range(2):   # the first frame pays one-time costs; the second is the figure
        obs = random_observation(settings.spec, i, seed=settings.seed, image_size=size)
        result = system.step(obs)
        times.append(result.timings)
    t = times[-1]
    print(f'one frame ({settings.spec.name}, synthetic observation, {settings.device} '
          f'{settings.dtype}):')
    print(f'  actions    {list(result.action.actions.shape)} (robot units), model output '
          f'{list(result.action.normalized.shape)}')
    print(f'  act        {t.act_s * 1e3:.1f} ms (prefill {t.prefill_s * 1e3:.1f} ms, denoise '
          f'{t.action_s * 1e3:.1f} ms); first frame {times[0].act_s * 1e3:.1f} ms')
    tokens = sum(len(d.token_ids) for d in result.deltas)
    print(f'  language   {tokens} tokens in {t.decode_s * 1e3:.1f} ms (k={result.k}); frame '
          f'total {t.total_s * 1e3:.1f} ms')
    return 0
