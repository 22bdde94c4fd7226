"""Peak memory of one system, measured in a fresh process so systems never share a peak.

Run as `python -m oxygen_ros.bench.memory --system oxygen --n 30 --k 5 ...`; prints one JSON
line. What it reports:
  runtime_mb        resident memory after importing torch and the engine, before the model
  peak_rss_mb       peak resident memory while serving frames (the high-water mark is reset
                    after the model is built and prepared, so weight-init and compile
                    transients do not count)
  above_runtime_mb  peak_rss_mb - runtime_mb: weights (and their packed copies) + compiled
                    passes + KV cache + activations + allocator
  cuda_peak_mb      torch.cuda.max_memory_allocated while serving (CUDA only)
For 'parallel' the two worker processes are what is measured (the parent only drives them):
peak_rss_mb is their sum and above_runtime_mb subtracts one runtime per worker.
The model is prepared as the node prepares its own (`--compile`, default auto: fused
projections, packed weights, compiled passes warmed up on the system's own runner and sealed),
so the figures are the product's; `--compile off` measures the eager model.
The benchmark starts probes with MKL_DISABLE_FAST_MM=1 (see run.probe_memory) unless its own
environment has MKL_DISABLE_FAST_MM=0; the JSON line says which (`mkl_fast_mm`).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
from pathlib import Path
import sys

from ..runtime.procfs import reset_peak_rss, status_kb


def probe(args: argparse.Namespace) -> dict:
    """Build the model and the system, serve frames, return the peaks (MiB)."""
    import numpy.random  # noqa: F401 - numpy loads it at the first frame: runtime, not system
    import torch

    from ..engine import LanguagePolicy, random_observation, random_setup
    from ..engine.prepare import prepare_model, seal, warm_up
    from ..model import get_preset
    from .plan import SystemSpec
    from .systems import make_bench_system

    torch.set_num_threads(args.threads)
    runtime_kb = status_kb('VmRSS')
    cfg = get_preset(args.preset).replace(num_steps=args.steps)
    dtype = getattr(torch, args.dtype)
    robot = args.workload
    model, frontend = random_setup(cfg, robot, seed=args.seed, device=args.device, dtype=dtype)
    plan = prepare_model(model, args.device, args.compile)
    warm_frames = [frontend.prepare(random_observation(
        robot, 0, seed=args.seed, image_size=cfg.vision.image_size)).tensors]
    spec = SystemSpec(args.system, args.k if args.system in ('oxygen', 'oxygen-adaptive')
                      else None)
    policy = LanguagePolicy(max_new_tokens=args.n, eos_id=None, seed=args.seed)
    runner_options = {'kv_dtype': getattr(torch, args.kv_dtype)} if args.kv_dtype else None
    system = make_bench_system(spec, model, frontend, policy, args.period, args.seed,
                               runner_options, parallel={'compile_setting': args.compile,
                                                         'warm_frames': warm_frames})
    if spec.name != 'parallel':   # the parallel baseline's workers prepare their own
        warm_up(system.runner, plan, warm_frames)
        seal(model, plan)
    workers = multiprocessing.active_children() if args.system == 'parallel' else []
    cuda = args.device.startswith('cuda')
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for pid in ['self'] + [w.pid for w in workers]:
        reset_peak_rss(pid)
    try:
        for frame in range(args.frames):
            system.step(random_observation(robot, frame, seed=args.seed,
                                           image_size=cfg.vision.image_size))
        if workers:
            worker_kb = [status_kb('VmHWM', w.pid) for w in workers]
            peak_kb = sum(worker_kb)
            above_kb = sum(kb - runtime_kb for kb in worker_kb)
        else:
            peak_kb = status_kb('VmHWM')
            above_kb = peak_kb - runtime_kb
    finally:
        system.close()
    cuda_mb = math.nan
    if cuda and not workers:
        cuda_mb = torch.cuda.max_memory_allocated() / 2**20
    return {'system': args.system, 'k': spec.k, 'n_tokens': args.n, 'processes': len(workers) or 1,
            'runtime_mb': runtime_kb / 1024, 'peak_rss_mb': peak_kb / 1024,
            'above_runtime_mb': above_kb / 1024, 'cuda_peak_mb': cuda_mb,
            'kv_pool_mb': getattr(getattr(system, 'pool', None), 'total_bytes', math.nan) / 2**20,
            'threads': args.threads, 'kv_dtype': args.kv_dtype or args.dtype,
            'mkl_fast_mm': 'MKL_DISABLE_FAST_MM' not in os.environ}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--system', required=True)
    parser.add_argument('--preset', default='pi05-cpu')
    parser.add_argument('--workload', default='libero')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--compile', default='auto', choices=['auto', 'max', 'on', 'off'],
                        help="torch.compile as the node's (prepare_model); off: eager")
    parser.add_argument('--kv-dtype', default='', help="KV store dtype ('' = --dtype)")
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--n', type=int, default=30)
    parser.add_argument('--k', type=int, default=5)
    parser.add_argument('--period', type=float, default=0.5, help='oxygen-adaptive deadline (s)')
    parser.add_argument('--frames', type=int, default=10)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--seed', type=int, default=0)
    return parser


def probe_main(run, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Run a probe on parsed args; print its result as one JSON line (what the parent reads)."""
    result = run(parser.parse_args(argv))
    sys.stdout.write(json.dumps(result) + '\n')
    sys.stdout.flush()
    return 0


def package_env() -> dict:
    """Return the environment of a probe process: this one's, the package importable."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [package_root, env.get('PYTHONPATH')]))
    return env


def main(argv: list[str] | None = None) -> int:
    return probe_main(probe, build_parser(), argv)


if __name__ == '__main__':
    sys.exit(main())
