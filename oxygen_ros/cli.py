"""`oxygen-ros` command line: one entry point, a sub-command per job."""

from __future__ import annotations

import argparse
import sys


def _phases(args: argparse.Namespace) -> int:
    import time

    import torch

    from .bench.phases import format_phases, PhaseProbe
    from .engine.hardware import choose_dtype, measure_machine
    from .engine.prepare import prepare_model, seal
    from .model import get_preset, Pi05Model

    torch.set_num_threads(args.threads) if args.threads else None
    cfg = get_preset(args.preset)
    if args.dtype == 'auto':
        dtype, why = choose_dtype(cfg, args.device)
    else:
        dtype, why = getattr(torch, args.dtype), 'set by --dtype'
    frames = None
    if args.robot:   # prefill costs what a frame holds: time a frame of this robot
        from .engine import random_observation, random_setup
        from .model.robot_spec import get_robot, RobotSpecError
        try:
            robot = get_robot(args.robot)
        except RobotSpecError as err:
            print(f'oxygen-ros phases: error: {err}', file=sys.stderr)
            return 2
        model, frontend = random_setup(cfg, robot, seed=args.seed, device=args.device,
                                       dtype=dtype)
        frames = [frontend.prepare(random_observation(
            robot, 0, seed=args.seed, image_size=cfg.vision.image_size)).tensors]
        shown = int(frames[0]['image_masks'].sum()) * cfg.tokens_per_image
        what = (f'one {robot.name} frame: {shown + int(frames[0]["token_masks"].sum())} of '
                f'{cfg.prefix_len} prefix positions valid')
    else:
        model = Pi05Model.build(cfg, dtype, args.device).init_random(args.seed).eval()
        what = (f'every camera and a {cfg.max_token_len // 4}-token prompt of '
                f'{cfg.prefix_len} prefix positions')
    plan = prepare_model(model, args.device, args.compile)
    machine = measure_machine(args.device)
    started = time.perf_counter()
    probe = PhaseProbe(model, batches=tuple(args.batches), frames=frames, machine=machine,
                       compare_eager=not args.no_eager)
    seal(model, plan, started)
    for _ in range(args.repeats):
        probe.sample()
    costs = probe.costs()
    name = str(dtype).removeprefix('torch.')
    print(f'preset {args.preset} on {args.device} ({name}: {why}), prefill on {what}, '
          f'{cfg.num_steps} denoise steps, horizon {cfg.action_horizon}')
    print(f'passes {plan.describe()}; warm-up and compile {plan.seconds:.1f} s')
    print(f'machine: {machine.describe()}')
    print(format_phases(costs, probe.eager_seconds()))
    print(f'(median of {args.repeats}; work counts the positions computed; floor = max(GFLOP / '
          f'{name} matmul peak, MB / copy bandwidth))')
    for n, k in ((30, 5), (30, 1), (10, 5)):
        print(f'ideal oxygen/isolated speedup N={n} k={k}: {costs.ideal_speedup(n, k):.2f}x')
    return 0


def _record_demo(args: argparse.Namespace) -> int:
    # rclpy is imported only by this sub-command (the rest of the CLI runs without ROS).
    from .tools.record_demo import record_demo_main

    return record_demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='oxygen-ros', description=__doc__)
    sub = parser.add_subparsers(dest='command', required=True)

    phases = sub.add_parser('phases', help='time vision / prefill / denoise / decode steps')
    phases.add_argument('--preset', default='pi05-cpu')
    phases.add_argument('--device', default='cpu')
    phases.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16'],
                        help="'auto' (default): bfloat16 where a timing probe finds it fast")
    phases.add_argument('--compile', default='auto', choices=['auto', 'max', 'on', 'off'],
                        help='torch.compile prefill, denoise and decode (default auto, as the '
                        "node; 'max': also the whole denoise loop as one graph, minutes "
                        'to compile)')
    phases.add_argument('--no-eager', action='store_true',
                        help='do not also time the compiled passes eager, side by side')
    phases.add_argument('--batches', type=int, nargs='+', default=[1, 4, 8])
    phases.add_argument('--repeats', type=int, default=5)
    phases.add_argument('--threads', type=int, default=0, help='torch threads (0 = default)')
    phases.add_argument('--seed', type=int, default=0)
    phases.add_argument('--robot', default=None,
                        help="time prefill on a synthetic frame of this robot (a shipped name "
                             "or a robot YAML: its cameras and prompt); default: every camera "
                             "slot and a quarter-length prompt")
    phases.set_defaults(func=_phases)

    from .bench.cli import add_bench_parser, add_smooth_policy_parser
    add_bench_parser(sub)
    add_smooth_policy_parser(sub)

    from .bag.cli import add_record_demo_parser, add_replay_parser
    add_replay_parser(sub)
    add_record_demo_parser(sub, _record_demo)

    from .tools.soak import add_parser as add_soak_parser   # rclpy only when it runs
    add_soak_parser(sub)

    from .serve.cli import add_serve_parser
    add_serve_parser(sub)

    from .tools.check_checkpoint import add_parser as add_check_parser
    add_check_parser(sub)

    from .tools.robot_spec import add_parser as add_robot_spec_parser
    add_robot_spec_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .runtime.allocator import keep_freed_memory
    keep_freed_memory()   # every command's process, as the node's (runtime/allocator.py)
    return args.func(args)


if __name__ == '__main__':
    sys.exit(main())
