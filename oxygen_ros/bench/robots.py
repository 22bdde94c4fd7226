"""The 'robots' part: R robots served by one FleetEngine, against the two ways labs do it today.

For each R (default 1, 2, 4, 8), three systems serve the same R robots (workloads cycling
through the plan's, each robot its own frames, requests and noise; N tokens per request at a
fixed k), each in fresh worker processes so their memory peaks are their own:

    fleet       one process, one model, one FleetEngine: per tick the R frames prefilled in
                calls of `prefill_rows` rows (default 1 on the CPU, where batching prefill rows
                gains nothing and costs activations; all R on an accelerator), ONE denoise over
                the R frames, decode steps over every robot's live requests. On the CPU with
                R >= 2 the rows run side by side instead (the node's row_threads: each robot's
                prefill, denoise and token steps on its own thread, the torch threads
                divided among them),
                what R separate processes get from their cores
    separate    R processes, one single-robot oxygen engine each (its own weights), running
                side by side on the same cores (max(1, threads // R) torch threads each)
    sequential  one process, one model, R single-robot oxygen engines served one after
                another per tick (robot i's observation waits for robots 0 .. i-1)

Definitions: a robot's action Hz = H / its mean frame time (fleet, sequential: the tick; the
paper's definition); its latency = observation to actions (sequential: from the tick's start,
so the wait for the robots before it counts); aggregate Hz = every robot's measured chunks /
the wall time of the measured window (separate: from the first process's first measured frame
to the last one's last); memory = peak RSS of all the system's processes, and above the
runtime (weights + KV + activations) as in the memory part.

Component model (phases.py, sampled in this process between the runs): a fleet tick costs
P_c(R) + D(R) + k·d(R·ceil(N/k)), with P_c(R) the prefills of R rows in calls of c rows (P(R)
for c = R); one robot alone P + D + k·d(ceil(N/k)), so R engines sharing the cores (or served
in turn) give each robot at best H / (R · that). The systems of one R run in turn, the first
one rotating with R. On CUDA the workers build their models one after another (each builds
in float32 on the host first) and memory is torch's CUDA peak.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import time

import numpy as np

from ..engine.workload import get_workload
from ..runtime.allocator import keep_freed_memory
from ..runtime.procfs import reset_peak_rss, status_kb
from .cpu import OtherLoad
from .measure import compare_tokens, max_action_diff, percentile, SystemLog
from .plan import WARMUP_FRAMES

ROBOT_SYSTEMS = ('fleet', 'separate', 'sequential')
WORKER_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class RobotsJob:
    """What one worker process serves: some robots of one system, then reports."""

    system: str                  # one of ROBOT_SYSTEMS
    workloads: tuple[str, ...]   # workload of each robot this process serves
    first_robot: int             # index of its first robot among the R (names, seeds)
    preset: str
    device: str
    dtype: str
    threads: int
    seed: int
    steps: int
    n_tokens: int
    k: int
    warmup: int                  # ticks before the measured window
    frames: int                  # measured ticks
    prefill_rows: int = 0        # fleet: rows per prefill call (0: all)
    compile: str = 'auto'        # each worker's model compiled as the node's (BenchOptions)


@dataclasses.dataclass
class RobotLog:
    """One robot's measured ticks, and its requests and actions for the identity check."""

    frame_s: list[float] = dataclasses.field(default_factory=list)    # its frame (the tick)
    latency_s: list[float] = dataclasses.field(default_factory=list)  # observation -> actions
    tokens: int = 0                                                    # tokens in the window
    log: SystemLog = dataclasses.field(default_factory=SystemLog)      # requests, actions


def robot_name(index: int) -> str:
    return f'robot{index}'


def robot_observation(workload: str, index: int, frame: int, seed: int, image_size: int):
    """Robot `index`'s observation of `frame` (every robot sees its own scene)."""
    from ..engine import random_observation
    return random_observation(workload, frame, seed=seed + 1000 * index, image_size=image_size)


def _build(job: RobotsJob):
    """Build the model and the job's system; return (model, serve(frame) -> per-robot dicts)."""
    import torch

    from ..engine import (FixedBudget, FleetRobot, Frontend, identity_norm_stats,
                          LanguagePolicy, make_fleet, random_setup)
    from ..engine.prepare import prepare_model, runner_options, seal, warm_up
    from ..model import get_preset
    from ..runtime.engine_setup import action_rows
    from .systems import make_system

    torch.set_num_threads(job.threads)
    cfg = get_preset(job.preset).replace(num_steps=job.steps)
    model, libero = random_setup(cfg, 'libero', seed=job.seed, device=job.device,
                                 dtype=getattr(torch, job.dtype))
    indices = range(job.first_robot, job.first_robot + len(job.workloads))
    frontends = {}
    for workload in job.workloads:
        robot = get_workload(workload).robot
        if robot not in frontends:
            frontends[robot] = libero if robot == 'libero' else Frontend.from_config(
                cfg, robot, libero.tokenizer, identity_norm_stats(robot), job.device)
    robots = [FleetRobot(robot_name(i), frontends[get_workload(w).robot],
                         LanguagePolicy(max_new_tokens=job.n_tokens, eos_id=None,
                                        seed=job.seed + i), FixedBudget(job.k), seed=job.seed + i)
              for i, w in zip(indices, job.workloads)]
    size = cfg.vision.image_size
    clock = time.perf_counter
    # As the node: the passes compiled (compile auto), warmed up for this system's shapes and
    # sealed before any tick, so the systems compare what a robot would run.
    if job.system == 'fleet':
        from ..runtime.engine_setup import row_threads   # the node's rule

        rows = row_threads(job.device, len(robots), job.threads)
    else:
        rows = 1
    plan = prepare_model(model, job.device, job.compile, row_threads=rows)
    options = runner_options(plan, job.device)
    frames = [f.prepare(robot_observation(w, i, 0, job.seed, size)).tensors
              for f, i, w in zip((r.frontend for r in robots), indices, job.workloads)]

    def observations(frame):
        return {r.name: robot_observation(w, i, frame, job.seed, size)
                for r, i, w in zip(robots, indices, job.workloads)}

    if job.system == 'fleet':
        torch.set_num_threads(max(1, job.threads // rows))
        fleet = make_fleet(model, robots, max_prefill_rows=job.prefill_rows or None,
                           row_threads=rows, **options)
        warm_up(fleet.runner, plan, frames, action_rows(len(robots)))
        seal(model, plan)

        def serve(frame):
            result = fleet.step(observations(frame))
            return {name: (r, result.timings.total_s, result.timings.act_s)
                    for name, r in result.robots.items()}

        def drain():
            while fleet.num_live_requests:
                yield fleet.advance_language().robots
        return fleet, serve, drain
    engines = {r.name: make_system('oxygen', model, r.frontend, r.policy, k=job.k, seed=r.seed,
                                   runner_options=options) for r in robots}
    for engine in engines.values():
        warm_up(engine.runner, plan, frames)
    seal(model, plan)

    def serve(frame):
        start = clock()
        out = {}
        obs = observations(frame)
        for name, engine in engines.items():
            result = engine.step(obs[name])
            # Served in turn: this robot's actions came after the robots before it.
            out[name] = (result, 0.0, clock() - start - (result.timings.total_s
                                                         - result.timings.act_s))
        tick_s = clock() - start
        return {name: (r, tick_s, latency) for name, (r, _, latency) in out.items()}

    def drain():
        for name, engine in engines.items():
            while engine.num_live_requests:
                yield {name: engine.advance_language()}
    return engines, serve, drain


def worker_main(job: RobotsJob, inbox, outbox) -> None:
    """Worker process: build, report ready, wait for 'go', serve the ticks, report the logs."""
    keep_freed_memory()   # as the node's process (runtime/allocator.py), for every system
    runtime_kb = status_kb('VmRSS')
    try:
        system, serve, drain = _build(job)
    except Exception as err:   # reported to the parent, which raises
        outbox.put(('error', repr(err)))
        return
    outbox.put(('ready', None))
    if inbox.get() is None:
        return
    import torch
    cuda = job.device.startswith('cuda')
    try:
        reset_peak_rss()   # weights' init transients do not count, the weights do
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        logs = {robot_name(job.first_robot + i): RobotLog() for i in range(len(job.workloads))}
        window = [math.inf, -math.inf]
        for frame in range(job.warmup + job.frames):
            measured = frame >= job.warmup
            start = time.perf_counter()
            served = serve(frame)
            if measured:
                window = [min(window[0], start), time.perf_counter()]
            for name, (result, frame_s, latency_s) in served.items():
                entry = logs[name]
                entry.log.record(frame, result, math.nan, measured=False)
                if measured:
                    entry.frame_s.append(frame_s)
                    entry.latency_s.append(latency_s)
                    entry.tokens += sum(len(d.token_ids) for d in result.deltas)
        for results in drain():
            for name, result in results.items():
                logs[name].log.record_finished(result.finished, -1)
        pools = system.values() if isinstance(system, dict) else [system]
        kv_bytes = sum(p.pool.total_bytes for p in pools)
        cuda_bytes = torch.cuda.max_memory_allocated() if cuda else math.nan
        outbox.put(('ok', {'logs': logs, 'window': window, 'runtime_kb': runtime_kb,
                           'peak_kb': status_kb('VmHWM'), 'kv_bytes': kv_bytes,
                           'cuda_bytes': cuda_bytes}))
    except Exception as err:   # reported to the parent, which raises
        outbox.put(('error', repr(err)))


def run_workers(jobs: list[RobotsJob], timeout_s: float = WORKER_TIMEOUT_S) -> list[dict]:
    """Start one process per job, start them together once all are built, gather reports.

    On CUDA each worker is built before the next starts: a model is built in float32 on the
    host first (13 GB for pi05), so eight at once could exhaust the host memory.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context('spawn')
    procs, inboxes, outboxes = [], [], []
    # Why: MKL's fast memory manager caches a GEMM buffer per row count (see probe_memory).
    saved = os.environ.get('MKL_DISABLE_FAST_MM')
    os.environ.setdefault('MKL_DISABLE_FAST_MM', '1')
    try:
        for job in jobs:
            inbox, outbox = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=worker_main, args=(job, inbox, outbox), daemon=True,
                               name=f'oxygen-robots-{job.system}-{job.first_robot}')
            proc.start()
            procs.append(proc)
            inboxes.append(inbox)
            outboxes.append(outbox)
            if job.device.startswith('cuda'):
                _receive(job, outbox, 'ready', timeout_s)
        for job, outbox in zip(jobs, outboxes):
            if not job.device.startswith('cuda'):
                _receive(job, outbox, 'ready', timeout_s)
        for inbox in inboxes:
            inbox.put('go')
        return [_receive(job, outbox, 'ok', timeout_s) for job, outbox in zip(jobs, outboxes)]
    finally:
        if saved is None:
            os.environ.pop('MKL_DISABLE_FAST_MM', None)
        for inbox, proc in zip(inboxes, procs):
            if proc.is_alive():
                inbox.put(None)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _receive(job: RobotsJob, outbox, expect: str, timeout_s: float):
    try:
        kind, payload = outbox.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f'robots worker {job.system}/{job.first_robot} did not answer in '
                           f'{timeout_s:.0f} s') from None
    if kind == 'error':
        raise RuntimeError(f'robots worker {job.system}/{job.first_robot} failed: {payload}')
    assert kind == expect, (kind, expect)
    return payload


def robot_workloads(workloads: tuple[str, ...], count: int) -> tuple[str, ...]:
    """R robots' workloads: the plan's, in turn (libero, droid, aloha, libero, ...)."""
    return tuple(workloads[i % len(workloads)] for i in range(count))


def prefill_rows(opts) -> int:
    """Rows per fleet prefill call (0: all): the plan's, else 1 on the CPU, all elsewhere."""
    rows = opts.plan.robot_prefill_rows
    if rows is None:
        return 1 if opts.device == 'cpu' else 0
    return rows


def jobs_for(system: str, count: int, opts, steps: int) -> list[RobotsJob]:
    """Return the worker jobs of (system, R): one process, or one per robot (separate)."""
    plan = opts.plan
    workloads = robot_workloads(plan.workloads, count)
    base = dict(system=system, preset=opts.preset, device=opts.device, dtype=opts.dtype,
                seed=opts.seed, steps=steps, n_tokens=plan.robot_n, k=plan.robot_k,
                compile=opts.compile,
                warmup=math.ceil(plan.robot_n / plan.robot_k) + WARMUP_FRAMES,
                frames=plan.robot_frames, prefill_rows=prefill_rows(opts))
    if system == 'separate':
        return [RobotsJob(workloads=(w,), first_robot=i, threads=max(1, opts.threads // count),
                          **base) for i, w in enumerate(workloads)]
    return [RobotsJob(workloads=workloads, first_robot=0, threads=opts.threads, **base)]


def system_row(system: str, count: int, reports: list[dict], horizon: int) -> dict:
    """Per-robot and aggregate metrics of one (system, R) from its workers' reports."""
    logs = {name: log for report in reports for name, log in report['logs'].items()}
    hz = {name: horizon / float(np.mean(log.frame_s)) for name, log in logs.items()}
    p99 = {name: percentile(log.latency_s, 99) for name, log in logs.items()}
    start = min(r['window'][0] for r in reports)
    wall = max(r['window'][1] for r in reports) - start
    chunks = sum(len(log.frame_s) for log in logs.values())
    return {
        'robots': count, 'system': system, 'processes': len(reports),
        'action_hz_min': min(hz.values()), 'action_hz_mean': float(np.mean(list(hz.values()))),
        'latency_ms_p50': 1e3 * percentile([x for log in logs.values() for x in log.latency_s],
                                           50),
        'latency_ms_p99_max': 1e3 * max(p99.values()),
        'aggregate_hz': chunks * horizon / wall,
        'tokens_per_s': sum(log.tokens for log in logs.values()) / wall,
        'peak_rss_mb': sum(r['peak_kb'] for r in reports) / 1024,
        'cuda_peak_mb': sum(r['cuda_bytes'] for r in reports) / 2**20,
        'above_runtime_mb': sum(r['peak_kb'] - r['runtime_kb'] for r in reports) / 1024,
        'kv_pool_mb': sum(r['kv_bytes'] for r in reports) / 2**20,
        'per_robot_hz': ' '.join(f'{hz[n]:.2f}' for n in sorted(hz)),
    }


def compare_robots(reference: list[dict], candidate: list[dict]) -> dict:
    """Tokens and actions of every robot against the same robot in the reference system."""
    ref = {name: log.log for report in reference for name, log in report['logs'].items()}
    compared, mismatched, diff = 0, [], 0.0
    for report in candidate:
        for name, log in report['logs'].items():
            check = compare_tokens(ref[name].requests, log.log.requests)
            compared += check.compared
            mismatched += [f'{name}@{frame}' for frame in check.mismatched]
            diff = max(diff, max_action_diff(ref[name].actions, log.log.actions))
    return {'tokens_identical': '' if compared == 0 else not mismatched,
            'requests_compared': compared, 'token_mismatches': ' '.join(mismatched),
            'action_max_diff': diff}


def chunked_prefill_s(costs, count: int, rows: int) -> float:
    """P_c(R): prefills of `count` rows in calls of at most `rows` rows (0: one call)."""
    rows = rows or count
    full, rest = divmod(count, rows)
    return full * costs.prefill_at(rows) + (costs.prefill_at(rest) if rest else 0.0)


def component_ideal(costs, count: int, n_tokens: int, k: int, horizon: int,
                    prefill_rows: int = 0) -> dict:
    """Per-robot Hz the component model allows: one fleet tick, or R single engines in turn."""
    batch = -(-n_tokens // k)
    prefill_s = chunked_prefill_s(costs, count, prefill_rows)
    fleet_s = (count * costs.frontend_s + prefill_s + costs.denoise_at(count)
               + costs.language_s(count * batch, k, new=count))
    single_s = costs.frame_s(batch, k)
    return {'prefill_rows_per_call': prefill_rows or count,
            'comp_prefill_ms': 1e3 * prefill_s, 'comp_prefill_one_call_ms':
            1e3 * costs.prefill_at(count),
            'comp_denoise_ms': 1e3 * costs.denoise_at(count),
            'comp_decode_ms': 1e3 * costs.decode_at(count * batch),
            'comp_fleet_tick_ms': 1e3 * fleet_s, 'comp_single_frame_ms': 1e3 * single_s,
            'ideal_fleet_hz': horizon / fleet_s, 'ideal_single_hz': horizon / (count * single_s)}


def run_robots_part(opts, models, bar=None) -> list[dict]:
    """Run every (R, system) of the plan; return one row per pair, component model included.

    models: the benchmark's ModelCache (the component model's probe uses its model, whose
    weights the workers rebuild from the same seed).
    """
    from .phases import PhaseProbe

    plan = opts.plan
    steps = plan.default_steps
    horizon = get_workload(plan.workloads[0]).horizon
    batch = -(-plan.robot_n // plan.robot_k)
    counts = tuple(sorted(set(plan.robot_counts)))
    chunk = prefill_rows(opts)
    decode_batches = sorted({1, batch} | {count * batch for count in counts})
    row_sizes = set(counts) | ({chunk} | {count % chunk for count in counts} if chunk else set())
    model = models.model(steps)
    # The probe's prefills run on the robots' own frames, one per workload in the plan's order
    # (P(R) cycles through them as the robots do): prefill costs what a frame's cameras and
    # prompt hold.
    observed = [(models.frontend(steps, get_workload(w).robot),
                 robot_observation(w, i, 0, opts.seed, model.config.vision.image_size))
                for i, w in enumerate(plan.workloads)]
    probe = PhaseProbe(model, batches=decode_batches, rows=row_sizes - {0}, seed=opts.seed,
                       frames=[frontend.prepare(obs).tensors for frontend, obs in observed],
                       frontend=lambda: [frontend.prepare(obs) for frontend, obs in observed])
    rows = []
    for turn, count in enumerate(counts):
        reports, loads = {}, {}
        # Systems in turn, the first one rotating: a slow phase of the machine hits all.
        order = ROBOT_SYSTEMS[turn % 3:] + ROBOT_SYSTEMS[:turn % 3]
        for system in order:
            probe.sample()
            load = OtherLoad()
            reports[system] = run_workers(jobs_for(system, count, opts, steps))
            loads[system] = load.percent()
            if bar is not None:
                bar.update(1)
        probe.sample()
        costs = probe.costs()
        ideal = component_ideal(costs, count, plan.robot_n, plan.robot_k, horizon, chunk)
        for system in ROBOT_SYSTEMS:
            row = {'preset': opts.preset, 'device': opts.device, 'dtype': opts.dtype,
                   'threads': opts.threads, 'steps': steps, 'n_tokens': plan.robot_n,
                   'k': plan.robot_k, 'frames': plan.robot_frames,
                   'workloads': '/'.join(robot_workloads(plan.workloads, count))}
            row.update(system_row(system, count, reports[system], horizon))
            row.update(ideal)
            expected = ideal['ideal_fleet_hz' if system == 'fleet' else 'ideal_single_hz']
            row['hz_min_over_ideal'] = row['action_hz_min'] / expected
            row.update(compare_robots(reports['sequential'], reports[system])
                       if system != 'sequential' else
                       {'tokens_identical': '', 'requests_compared': 0, 'token_mismatches': '',
                        'action_max_diff': math.nan})
            row['other_load_pct'] = loads[system]
            row['probe_samples'] = len(probe.samples['prefill'])
            rows.append(row)
    return rows
