"""The `oxygen-ros bench` sub-command: parse options, run the plan, write the report."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
import sys
import time

from .plan import ALL_PARTS, PAPER_ARRIVAL_RATES, PAPER_NS, PAPER_STEPS, PARTS, SYSTEM_NAMES

BENCH_EPILOG = """\
examples:
  oxygen-ros bench --quick                      # seconds: tiny preset, every code path
  oxygen-ros bench --parts nk                   # the libero N x k sweep (S=10), CPU preset
  oxygen-ros bench                              # every sweep + memory (docs/benchmark.md)
  oxygen-ros bench --preset pi05 --device cuda --dtype bfloat16 --parts nk memory
  oxygen-ros bench --parts node                 # oxygen_node process vs the engine (~2 min)
  oxygen-ros bench --parts overload             # shipped YAML, then 2x overload: narration
  oxygen-ros bench --parts tasks                # narration + subtask + questions at once
  oxygen-ros bench --parts robots               # R = 1 2 4 8 robots: one engine vs R engines
  oxygen-ros bench --quick --parts robots       # the same in miniature (tiny preset, R = 1 2)
  oxygen-ros bench --parts rtc                  # real-time chunking off / guided / prefix
                                                # on a smooth policy (trained once, cached)
"""


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Register `bench` on the top-level sub-parsers."""
    from .node import node_robots

    bench = sub.add_parser('bench', help='side-by-side benchmark of oxygen and the baselines',
                           epilog=BENCH_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument('--quick', action='store_true',
                       help='CI smoke run: tiny preset, few frames, every sweep in miniature')
    bench.add_argument('--preset', default=None, help='model preset (default pi05-cpu; '
                       'tiny with --quick)')
    bench.add_argument('--device', default='cpu')
    bench.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16'],
                       help="model dtype (default auto: bfloat16 where a timing probe finds "
                       "it fast, as the node)")
    bench.add_argument('--compile', default='auto', choices=['auto', 'max', 'on', 'off'],
                       help='torch.compile prefill, denoise and decode (default auto, as the '
                       "node; 'max': also the whole denoise loop as one graph, minutes "
                       'to compile)')
    bench.add_argument('--build-preset', default=None,
                       help='part build: model whose build / checkpoint load peak RSS is '
                       'measured (default pi05; quick: small)')
    bench.add_argument('--threads', type=int, default=2,
                       help='torch threads of the benchmark process (default 2)')
    bench.add_argument('--floor-threads', type=int, default=0,
                       help="part floors: torch threads (default 0: the node's, every core but "
                            'one)')
    bench.add_argument('--workloads', nargs='+', default=None,
                       choices=['libero', 'droid', 'aloha'],
                       help='first one runs the N x k, S, arrivals and mixed sweeps')
    bench.add_argument('--parts', nargs='+', default=None, choices=ALL_PARTS,
                       help=f'what to run (default all: {" ".join(PARTS)}; robots and node '
                       'only when named: they start processes, node needs ROS)')
    bench.add_argument('--systems', nargs='+', default=None, choices=SYSTEM_NAMES)
    bench.add_argument('--ns', type=int, nargs='+', default=None,
                       help=f'tokens per request N (default {" ".join(map(str, PAPER_NS))})')
    bench.add_argument('--ks', type=int, nargs='+', default=None,
                       help='restrict k (always k | N; default: every divisor)')
    bench.add_argument('--steps', type=int, nargs='+', default=None,
                       help=f'S values of the steps sweep (default '
                       f'{" ".join(map(str, PAPER_STEPS))})')
    bench.add_argument('--arrival-rates', type=float, nargs='+', default=None,
                       help=f'Poisson requests per frame (default '
                       f'{" ".join(map(str, PAPER_ARRIVAL_RATES))})')
    bench.add_argument('--frames', type=int, default=None,
                       help='measured frames per N x k group (default 20; quick 3)')
    bench.add_argument('--extra-frames', type=int, default=None,
                       help='measured frames per group of the other sweeps (default 12)')
    bench.add_argument('--parallel', choices=['all', 'headline', 'none'], default=None,
                       help='N x k groups that run the 2-process baseline (default all)')
    bench.add_argument('--control-hz', type=float, default=None,
                       help='frame deadline for misses and oxygen-adaptive '
                       '(default: 1 / (1.5 (P + D)) from the fastest of a few action paths)')
    bench.add_argument('--memory-frames', type=int, default=None)
    bench.add_argument('--seed', type=int, default=0)
    bench.add_argument('--out', default='bench-results', help='output folder')
    bench.add_argument('--no-progress', action='store_true')
    bench.add_argument('--replot', metavar='DIR', default=None,
                       help='only redraw summary and plots from DIR/result.json')
    bench.add_argument('--plot-statistic', choices=['mean', 'p50'], default=None,
                       help='frame latency behind the plotted action Hz: mean (the paper, '
                       'default) or p50 (robust on a busy machine)')
    robots = bench.add_argument_group(
        'robots part', 'R robots served by one FleetEngine vs R separate engines (one process '
        'each) vs one engine serving them in turn; robots cycle through --workloads')
    robots.add_argument('--robots', type=int, nargs='+', default=None, metavar='R',
                        help='robot counts (default 1 2 4 8; quick 1 2)')
    robots.add_argument('--robot-frames', type=int, default=None,
                        help='measured ticks per (R, system) (default 12; quick 3)')
    robots.add_argument('--robot-n', type=int, default=None,
                        help='tokens per request N of every robot (default 10; quick 4)')
    robots.add_argument('--robot-k', type=int, default=None,
                        help='fixed k of every robot (default 5; quick 2)')
    robots.add_argument('--robots-config', default=None, metavar='YAML',
                        help="a node parameter YAML with `robots` (e.g. config/aloha_droid.yaml):"
                        " its robots through the node's frame loop in real time, deadline "
                        'misses and language progress per robot (the R sweep then runs only '
                        'with --robots)')
    robots.add_argument('--robot-rates', nargs='+', default=(), metavar='NAME=HZ',
                        help="rates of the --robots-config robots (default: the YAML's)")
    robots.add_argument('--robots-duration', type=float, default=None,
                        help='measured seconds of the --robots-config run (default 60; quick 10)')
    robots.add_argument('--robot-prefill-rows', type=int, default=None,
                        help='rows per prefill call of the fleet (0: all robots in one call; '
                        'default 1 on the CPU, where batching prefill rows gains nothing and '
                        'costs ~25 MB per pi05-cpu row; all on an accelerator)')
    node = bench.add_argument_group(
        'node part', 'oxygen_node in its own process with a stand-in robot, next to the engine '
        'alone (same preset, threads, N, k)')
    node.add_argument('--node-robot', default='libero', choices=node_robots(),
                      help='config/<robot>.yaml of the node and the robot (default libero)')
    node.add_argument('--node-duration', type=float, default=None,
                      help='measured seconds of the node run (default 60; quick 5)')
    node.add_argument('--node-warmup', type=float, default=None,
                      help='seconds after the first action chunk that are not measured '
                      '(default 5; quick 1)')
    node.add_argument('--node-idle', type=float, default=None,
                      help='seconds the active node runs without inputs, for its idle CPU '
                      '(default 5; quick 1)')
    node.add_argument('--node-rate', type=float, default=None,
                      help="asked control rate in Hz (default: the YAML's; 0 there = the node's "
                           'auto rate, 90%% of what it times at configure)')
    node.add_argument('--node-tokens', type=int, default=None,
                      help="N of the node (default: the YAML's tokens_per_request)")
    node.add_argument('--node-k', type=int, default=None,
                      help='a fixed decode budget k of the node and the engine run (default: '
                           "the YAML's, the adaptive budget)")
    node.add_argument('--node-threads', type=int, default=None,
                      help="torch threads of the node and its engine reference (default: the "
                           "YAML's torch_threads, 0 there = every core but one, as the node)")
    node.add_argument('--node-engine-frames', type=int, default=None,
                      help='measured frames of the engine alone (default 20; quick 5)')
    node.add_argument('--node-rtc', default='off', choices=['off', 'guided', 'prefix'],
                      help='real-time chunking of the node and of the engine run (default off)')
    node.add_argument('--camera-rate', type=float, default=15.0,
                      help='stand-in robot camera frames/s (default 15)')
    node.add_argument('--camera-size', default='640x480', metavar='WxH',
                      help='stand-in robot camera resolution (default 640x480)')
    node.add_argument('--camera-format', default='raw', choices=['raw', 'jpeg'],
                      help='raw rgb8 Image (default, as a camera driver sends; every process '
                      'uses the Fast DDS profile for large frames) or CompressedImage jpeg')
    rtc = bench.add_argument_group(
        'rtc part', 'real-time chunking off / guided / prefix on the same synthetic episode: '
        'boundary jumps, total variation, act() cost, a plot of one joint')
    rtc.add_argument('--rtc-robot', default=None, metavar='NAME|FILE',
                     help='robot of the episode: a shipped robot or a robot YAML (default '
                     'libero)')
    rtc.add_argument('--rtc-frames', type=int, default=None,
                     help='measured frames per mode (default 30; quick 8)')
    rtc.add_argument('--rtc-delay', type=int, default=None, metavar='ROWS',
                     help="d (default: from the 'off' engine's act() p95 over the warm-up)")
    rtc.add_argument('--rtc-period-rows', type=int, default=None, metavar='ROWS',
                     help='rows between frames of the episode (default: from --rtc-control-hz '
                     'and the latency)')
    rtc.add_argument('--rtc-control-hz', type=float, default=None,
                     help='asked frame rate of the episode (default 10; frames are never '
                     'closer than the latency)')
    rtc.add_argument('--rtc-policy', default=None, metavar='smooth|random|CHECKPOINT',
                     help="the episode's policy: 'smooth' (default: --preset's action expert "
                     'fine-tuned on smooth demonstrations, trained once and cached; see '
                     "`oxygen-ros smooth-policy`), 'random' (--preset's random weights: rough "
                     'chunks, nothing for RTC to smooth) or a checkpoint folder')
    rtc.add_argument('--rtc-policy-preset', default=None, metavar='PRESET',
                     help='smooth: the preset fine-tuned (default --preset; quick: small)')
    rtc.add_argument('--rtc-policy-steps', type=int, default=None, metavar='N',
                     help='smooth: optimiser steps (default 400; quick 250)')
    rtc.add_argument('--rtc-max-guidance-weight', type=float, default=None, metavar='BETA',
                     help="guided's β (default: the rtc_max_guidance_weight parameter's)")
    overload = bench.add_argument_group(
        'overload part', 'oxygen_node with config/<--node-robot>.yaml as shipped (auto rate), '
        'then asked --overload-factor x the rate it reported; the stand-in robot as in the '
        'node part (--camera-*)')
    overload.add_argument('--overload-factor', type=float, default=None,
                          help='asked rate of the second run / what the node holds (default 2)')
    overload.add_argument('--overload-duration', type=float, default=None,
                          help='measured seconds of each run (default 60; quick 10)')
    tasks = bench.add_argument_group(
        'tasks part', 'oxygen_node with config/<--node-robot>.yaml as shipped: action-only, '
        'narration, then narration + a subtask + a question every --tasks-ask-period s; the '
        'three tasks in the engine against each alone')
    tasks.add_argument('--tasks-duration', type=float, default=None,
                       help='measured seconds of each node run (default 60; quick 8)')
    tasks.add_argument('--tasks-ask-period', type=float, default=None,
                       help='seconds between questions (default 2)')
    bench.set_defaults(func=run_bench_command)
    return bench


def options_from_args(args: argparse.Namespace):
    """Build BenchOptions from the command line (quick or full defaults, then overrides)."""
    from .plan import full_options, quick_options
    from .run import BenchOptions

    plan_changes = {name: tuple(value) for name, value in (
        ('workloads', args.workloads), ('parts', args.parts), ('systems', args.systems),
        ('ns', args.ns), ('ks', args.ks), ('steps', args.steps),
        ('arrival_rates', args.arrival_rates)) if value}
    if args.frames:
        plan_changes['frames'] = args.frames
    if args.extra_frames:
        plan_changes['extra_frames'] = args.extra_frames
    if args.parallel:
        plan_changes['parallel'] = args.parallel
    for flag, name, value, lowest in (
            ('--robots', 'robot_counts', args.robots, 1),
            ('--robot-frames', 'robot_frames', args.robot_frames, 1),
            ('--robot-n', 'robot_n', args.robot_n, 1), ('--robot-k', 'robot_k', args.robot_k, 1),
            ('--robot-prefill-rows', 'robot_prefill_rows', args.robot_prefill_rows, 0)):
        if value is None:
            continue
        if min(value if isinstance(value, list) else [value]) < lowest:
            raise SystemExit(f'{flag}: expected values >= {lowest}, got {value}')
        plan_changes[name] = tuple(value) if isinstance(value, list) else value
    if args.robots_config and args.robots is None:
        plan_changes['robot_counts'] = ()   # the YAML's fleet only
    if args.ns and 'headline_n' not in plan_changes:
        plan_changes['headline_n'] = max(args.ns)
    plan = (quick_options if args.quick else full_options)(**plan_changes)
    if plan.headline_n % plan.headline_k:
        plan = dataclasses.replace(plan, headline_k=1)
    if args.floor_threads < 0:
        raise SystemExit(f'--floor-threads: expected 0 (the node\'s) or more, got '
                         f'{args.floor_threads}')
    base = BenchOptions.quick_defaults() if args.quick else BenchOptions()
    changes = dict(plan=plan, device=args.device, dtype=args.dtype, compile=args.compile,
                   threads=args.threads, floor_threads=args.floor_threads,
                   seed=args.seed, control_hz=args.control_hz, progress=not args.no_progress)
    if args.preset:
        changes['preset'] = args.preset
    if args.memory_frames:
        changes['memory_frames'] = args.memory_frames
    if args.build_preset:
        changes['build_preset'] = args.build_preset
    if args.plot_statistic:
        changes['plot_statistic'] = args.plot_statistic
    changes['node'] = node_options_from_args(args)
    rtc_changes = {name: value for name, value in (
        ('robot', args.rtc_robot), ('frames', args.rtc_frames), ('delay', args.rtc_delay),
        ('control_hz', args.rtc_control_hz), ('period_rows', args.rtc_period_rows),
        ('policy', args.rtc_policy), ('policy_preset', args.rtc_policy_preset),
        ('policy_steps', args.rtc_policy_steps),
        ('max_guidance_weight', args.rtc_max_guidance_weight)) if value is not None}
    if (rtc_changes.get('frames', 2) < 2 or rtc_changes.get('delay', 0) < 0
            or rtc_changes.get('period_rows', 1) < 1 or rtc_changes.get('policy_steps', 1) < 1):
        raise SystemExit('--rtc-frames must be >= 2, --rtc-delay >= 0, --rtc-period-rows >= 1, '
                         '--rtc-policy-steps >= 1')
    policy_problem = _rtc_policy_problem(rtc_changes)
    if policy_problem:
        raise SystemExit(policy_problem)
    if 'robot' in rtc_changes:
        from oxygen_ros.model.robot_spec import get_robot
        try:
            get_robot(rtc_changes['robot'])
        except ValueError as err:   # RobotSpecError: unknown name, unreadable file
            raise SystemExit(f'--rtc-robot: {err}') from None
    changes['rtc'] = dataclasses.replace(base.rtc, **rtc_changes)
    changes['overload'] = overload_options_from_args(args)
    changes['tasks'] = tasks_options_from_args(args)
    if args.robots_config:
        from .fleet_timing import FleetTimingOptions, node_values

        duration = args.robots_duration or (10.0 if args.quick else 60.0)
        if duration <= 0:
            raise SystemExit('--robots-duration must be > 0')
        changes['fleet_timing'] = FleetTimingOptions(
            args.robots_config, tuple(args.robot_rates), duration,
            warmup_s=2.0 if args.quick else 5.0,
            preset=args.preset or ('tiny' if args.quick else None))   # None: the YAML's
        node_values(changes['fleet_timing'])   # a bad YAML or rate is a one-line error now
    changes['out_dir'] = args.out
    return dataclasses.replace(base, **changes)


def _rtc_policy_problem(rtc_changes: dict) -> str | None:
    """Say what is wrong with --rtc-policy(-preset) or --rtc-max-guidance-weight (or None)."""
    from pathlib import Path

    from oxygen_ros.model.config import PRESETS

    from .rtc import RANDOM, SMOOTH

    from oxygen_ros.runtime.params import check_value

    if 'max_guidance_weight' in rtc_changes:
        why = check_value('rtc_max_guidance_weight', rtc_changes['max_guidance_weight'])
        if why:
            return f'--rtc-max-guidance-weight: {why}'
    policy = rtc_changes.get('policy', SMOOTH)
    if policy not in (SMOOTH, RANDOM) and not (Path(policy) / 'config.json').is_file():
        return (f'--rtc-policy {policy!r}: expected smooth, random or a checkpoint folder '
                '(with config.json)')
    preset = rtc_changes.get('policy_preset')
    if preset is not None and preset not in PRESETS:
        return f'--rtc-policy-preset {preset!r}: expected one of {sorted(PRESETS)}'
    return None


def node_options_from_args(args: argparse.Namespace):
    """Build the NodeBenchOptions of the node part's flags."""
    from .node import NodeBenchOptions

    try:
        width, height = (int(v) for v in args.camera_size.lower().split('x'))
    except ValueError:
        raise SystemExit(f'--camera-size {args.camera_size!r}: expected WxH, e.g. 640x480')
    changes = {name: value for name, value in (
        ('duration_s', args.node_duration), ('warmup_s', args.node_warmup),
        ('idle_s', args.node_idle), ('engine_frames', args.node_engine_frames))
        if value is not None}
    base = NodeBenchOptions.quick() if args.quick else NodeBenchOptions()
    return dataclasses.replace(base, robot=args.node_robot, tokens=args.node_tokens,
                               k=args.node_k, rate_hz=args.node_rate,
                               threads=args.node_threads,
                               camera_rate_hz=args.camera_rate, camera_width=width,
                               camera_height=height, camera_format=args.camera_format,
                               rtc_mode=args.node_rtc, **changes)


def overload_options_from_args(args: argparse.Namespace):
    """Build the OverloadBenchOptions of the overload part's flags."""
    from .overload import OverloadBenchOptions

    base = OverloadBenchOptions.quick() if args.quick else OverloadBenchOptions()
    changes = {name: value for name, value in (('factor', args.overload_factor),
                                               ('duration_s', args.overload_duration))
               if value is not None}
    if changes.get('factor', 1.0) <= 0 or changes.get('duration_s', 1.0) <= 0:
        raise SystemExit('--overload-factor and --overload-duration must be > 0')
    return dataclasses.replace(base, **changes)


def tasks_options_from_args(args: argparse.Namespace):
    """Build the TasksBenchOptions of the tasks part's flags."""
    from .tasks import TasksBenchOptions

    base = TasksBenchOptions.quick() if args.quick else TasksBenchOptions()
    changes = {name: value for name, value in (('duration_s', args.tasks_duration),
                                               ('ask_period_s', args.tasks_ask_period))
               if value is not None}
    if any(value <= 0 for value in changes.values()):
        raise SystemExit('--tasks-duration and --tasks-ask-period must be > 0')
    return dataclasses.replace(base, **changes)


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_bench_command(args: argparse.Namespace) -> int:
    from .report import write_report

    if args.replot:
        from pathlib import Path

        from .run import load_result

        result = load_result(Path(args.replot) / 'result.json')
        if args.plot_statistic:
            result.options.plot_statistic = args.plot_statistic
        paths = write_report(result, args.replot)
        print(f'redrew {", ".join(str(p) for p in paths.values())}')
        return 0
    # A plain SIGTERM (timeout, kill) would skip the `finally` blocks that stop the parallel
    # baseline's worker processes, leaving them orphaned; turn it into an exception instead.
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        return _run_and_report(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_and_report(args: argparse.Namespace) -> int:
    from .report import write_report
    from .run import run_benchmark
    from .targets import evaluate_targets

    opts = options_from_args(args)
    command = ('oxygen-ros ' + ' '.join(shlex.quote(a) for a in sys.argv[1:])
               if sys.argv[1:2] == ['bench'] else 'oxygen-ros bench (called from Python)')
    start = time.perf_counter()

    def checkpoint(partial):
        partial.environment['command'] = command
        write_report(partial, args.out)

    result = run_benchmark(opts, checkpoint)
    result.environment['command'] = command
    paths = write_report(result, args.out)
    print(paths['summary'].read_text())
    for target in evaluate_targets(result):
        verdict = 'n/a' if target['met'] is None else 'met' if target['met'] else 'MISSED'
        print(f'[{verdict}] {target["target"]}: {target["measured"]}')
    print(f'wrote {", ".join(str(p) for p in paths.values())} '
          f'in {time.perf_counter() - start:.0f} s')
    return 0


def add_smooth_policy_parser(sub) -> argparse.ArgumentParser:
    """Register `smooth-policy`: write the RTC benchmark's smooth policy as a checkpoint."""
    from .smooth_policy import CACHE_DIR, SmoothPolicyOptions

    defaults = SmoothPolicyOptions()
    parser = sub.add_parser(
        'smooth-policy', help='a checkpoint that behaves like a trained policy (smooth, '
        'multi-modal chunks) for real-time chunking benchmarks',
        description='Fine-tune the action expert of a random-weight preset with openpi\'s '
        'flow-matching loss on synthetic smooth demonstrations (one per noise: the chunks are '
        'smooth and multi-modal, as a trained policy\'s are), save it as an openpi checkpoint '
        f'(cached in {CACHE_DIR}) and print its folder: for `oxygen-ros replay --checkpoint`, '
        'the node\'s checkpoint parameter, or `bench --rtc-policy`. Synthetic data only: its '
        'chunks do not depend on what the cameras see.',
        epilog='example:\n  oxygen-ros smooth-policy --preset small --out /tmp/smooth\n'
               '  oxygen-ros replay BAG --out OUT --rtc-compare --checkpoint /tmp/smooth',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--preset', default=defaults.preset,
                        help=f'random-weight preset to start from (default {defaults.preset})')
    parser.add_argument('--robot', default=defaults.robot,
                        help='robot (a shipped name or a robot YAML) whose action columns move '
                        f'and whose norm-stats id the checkpoint uses (default {defaults.robot})')
    parser.add_argument('--steps', type=int, default=defaults.steps,
                        help=f'optimiser steps (default {defaults.steps})')
    parser.add_argument('--seed', type=int, default=defaults.seed)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, default=1, help='torch threads (default 1)')
    parser.add_argument('--out', default=None,
                        help='copy the checkpoint folder here (must not exist; default: print '
                        'the cached folder)')
    parser.add_argument('--cache-dir', default=None,
                        help=f'where trained policies are kept (default {CACHE_DIR})')
    parser.set_defaults(func=run_smooth_policy_command)
    return parser


def run_smooth_policy_command(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path
    import shutil

    import torch

    from oxygen_ros.model.config import PRESETS
    from oxygen_ros.model.robot_spec import get_robot

    from .smooth_policy import INFO_FILE, smooth_policy, SmoothPolicyOptions

    if args.preset not in PRESETS:
        raise SystemExit(f'--preset {args.preset!r}: expected one of {sorted(PRESETS)}')
    if args.steps < 1:
        raise SystemExit(f'--steps must be >= 1, got {args.steps}')
    try:
        get_robot(args.robot)
    except ValueError as err:   # RobotSpecError: unknown name, unreadable file
        raise SystemExit(f'--robot: {err}') from None
    if args.out and Path(args.out).exists():
        raise SystemExit(f'--out {args.out}: exists (give a new folder)')
    torch.set_num_threads(args.threads)
    opts = SmoothPolicyOptions(preset=args.preset, robot=args.robot, steps=args.steps,
                               seed=args.seed)
    path = smooth_policy(opts, args.device, args.cache_dir,
                         progress=lambda line: print(line, flush=True))
    if args.out:
        path = Path(shutil.copytree(path, args.out))
    info = json.loads((path / INFO_FILE).read_text())
    smooth = info['smoothness']
    print(f'loss {info["loss_first"]:.4f} -> {info["loss_last"]:.4f} over {args.steps} steps; '
          f'chunks without RTC: row step {smooth["row_step"]:.3f}, '
          f'{smooth["across_chunks"]:.3f} between two chunks ({smooth["ratio"]:.2f}x)')
    print(path)
    return 0
