"""Runs a benchmark plan: side-by-side groups with their component model, memory probes.

Per group, every system is built over the same model and steps through the same frames; per
frame the systems take turns (plan.round_order: the parallel baseline's processes first, then
the in-process systems with the first one rotating), so slow moments of a shared machine and
the caches the other processes evict hit every system alike. Between rounds the component
model (P, D, d(B)) is sampled, so the ideal speedup is computed from the machine as the frames
saw it. Warm-up frames are run but not measured. After the measured frames, requests still
running are decoded to the end (untimed) so every request's tokens can be compared with the
isolated baseline's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
from pathlib import Path
import platform
import subprocess
import sys
import time
from typing import Callable

import torch
from tqdm import tqdm

from ..engine import (Engine, Frontend, identity_norm_stats, random_observation, random_setup,
                      System)
from ..engine.hardware import choose_dtype, DTYPE_NAMES, measure_machine
from ..engine.prepare import CompilePlan, prepare_model, runner_options, seal
from ..engine.runner import ModelRunner
from ..engine.workload import get_workload
from ..model import get_preset, Pi05Model
from ..runtime.engine_setup import inference_threads
from ..runtime.procfs import cpu_model
from .cpu import OtherLoad
from .fleet_timing import FleetTimingOptions, run_fleet_timing
from .measure import compare_tokens, max_action_diff, summarize, SystemLog
from .memory import package_env
from .node import NodeBenchOptions, run_node_part
from .overload import OverloadBenchOptions, run_overload_part
from .tasks import run_tasks_part, TasksBenchOptions
from .phases import floor_rows, measure_phases, PhaseCosts, PhaseProbe
from .plan import build_groups, Group, PlanOptions, quick_options, round_order, SystemSpec
from .robots import run_robots_part
from .rtc import rtc_policy, RtcBenchOptions, run_rtc_part
from .systems import make_bench_system

# Deadline of oxygen-adaptive and of the deadline-miss count when no control rate is given:
# the action path (P + D) plus this share of it for language (about k = 5 decode steps of the
# CPU preset at N = 30, so adaptive has a real budget to plan).
DEFAULT_LANGUAGE_SLACK = 0.5
PROBE_EVERY_ROUNDS = 2    # component-model sample after every 2nd round of the group's frames
MIN_PROBE_SAMPLES = 5


@dataclasses.dataclass
class BenchOptions:
    """Everything that decides what is measured and where it goes."""

    plan: PlanOptions = dataclasses.field(default_factory=PlanOptions)
    preset: str = 'pi05-cpu'
    device: str = 'cpu'
    dtype: str = 'auto'              # 'auto' is resolved (hardware.choose_dtype) when it runs
    compile: str = 'auto'            # torch.compile of the shared model, as the node's
    build_preset: str = 'pi05'       # part 'build': model size of the peak-RSS probes
    threads: int = 2                 # torch threads of this process (parallel workers: 1 each)
    floor_threads: int = 0           # part 'floors': torch threads (0: the node's default,
    #                                  every core but one: the threads a robot's frame runs on)
    seed: int = 0
    control_hz: float | None = None  # frame deadline; None: (P + D) · (1 + slack)
    phase_repeats: int = 7           # action-path repeats behind the default deadline
    memory_frames: int = 4           # measured frames of a memory probe (after its warm-up)
    progress: bool = True
    quick: bool = False
    plot_statistic: str = 'mean'     # frame-time statistic of the plots' Hz: mean (paper) / p50
    node: NodeBenchOptions = dataclasses.field(default_factory=NodeBenchOptions)   # part 'node'
    rtc: RtcBenchOptions = dataclasses.field(default_factory=RtcBenchOptions)      # part 'rtc'
    overload: OverloadBenchOptions = dataclasses.field(   # part 'overload'
        default_factory=OverloadBenchOptions)
    tasks: TasksBenchOptions = dataclasses.field(default_factory=TasksBenchOptions)  # 'tasks'
    fleet_timing: FleetTimingOptions | None = None   # part 'robots': a node YAML's fleet
    out_dir: str = 'bench-results'   # where the node part leaves its processes' logs

    @classmethod
    def quick_defaults(cls, **changes) -> BenchOptions:
        return dataclasses.replace(cls(plan=quick_options(), preset='tiny', quick=True,
                                       phase_repeats=3, memory_frames=2, build_preset='small',
                                       node=NodeBenchOptions.quick(),
                                       rtc=RtcBenchOptions(frames=8, warmup=3, delay=1,
                                                           period_rows=2,
                                                           policy_preset='small',
                                                           policy_steps=250),
                                       overload=OverloadBenchOptions.quick(),
                                       tasks=TasksBenchOptions.quick()), **changes)


@dataclasses.dataclass
class BenchResult:
    """Rows of every run, memory probes, the component model of every group, timings."""

    rows: list[dict]                 # one per (group, system)
    memory: list[dict]               # one per system of the memory probe
    components: list[dict]           # one per (group, decode batch): P, D, d(B) of the group
    periods: dict[int, float]        # S -> frame deadline used (s)
    part_seconds: dict[str, float]
    environment: dict
    options: BenchOptions
    node: list[dict] = dataclasses.field(default_factory=list)        # part 'node': one row
    robots: list[dict] = dataclasses.field(default_factory=list)      # part 'robots': (R, system)
    node_ticks: list[dict] = dataclasses.field(default_factory=list)  # its per-tick records
    serve: list[dict] = dataclasses.field(default_factory=list)       # part 'serve': one row
    floors: list[dict] = dataclasses.field(default_factory=list)      # part 'floors': phases
    builds: list[dict] = dataclasses.field(default_factory=list)      # part 'build': peak RSS
    rtc: list[dict] = dataclasses.field(default_factory=list)         # part 'rtc': per mode
    rtc_paths: list[dict] = dataclasses.field(default_factory=list)   # its plotted paths
    overload: list[dict] = dataclasses.field(default_factory=list)    # part 'overload': 2 rows
    tasks: list[dict] = dataclasses.field(default_factory=list)       # part 'tasks': node runs
    task_tokens: list[dict] = dataclasses.field(default_factory=list)  # its engine half
    fleet_timing: list[dict] = dataclasses.field(default_factory=list)   # part 'robots': per
    #                                                                    robot of the YAML


def environment(opts: BenchOptions) -> dict:
    """Describe what the numbers depend on: versions, threads, CPU, device, machine load."""
    cpu = cpu_model() or platform.processor() or platform.machine()
    env = {'torch': torch.__version__, 'python': platform.python_version(), 'cpu': cpu,
           'cores': os.cpu_count(), 'torch_threads': torch.get_num_threads(),
           'device': opts.device, 'dtype': opts.dtype, 'preset': opts.preset,
           'loadavg_start': os.getloadavg()[0] if hasattr(os, 'getloadavg') else math.nan}
    if opts.device.startswith('cuda'):
        env['gpu'] = torch.cuda.get_device_name(torch.device(opts.device))
    return env


def drain(system: System, log: SystemLog) -> None:
    """Decode requests still running after the measured frames to the end (untimed).

    An adaptive budget may choose k = 0 for a few calls in a row (it then forces k = 1), so the
    bound is generous; running into it means language stopped progressing.
    """
    if not isinstance(system, Engine):
        return
    for _ in range(64 * (system.scheduler.max_gen_len + 2)):
        if not system.num_live_requests:
            return
        log.record_finished(system.advance_language().finished, -1)
    raise RuntimeError(f'{system.system}: requests still running after draining:\n{system}')


class ModelCache:
    """One random-weight model per S (same seed: same weights) and a frontend per robot.

    Each model is prepared as the node prepares its own (fused projections, compiled passes
    per opts.compile, warmed up on a small runner, sealed); `prepared` says how, per S.
    """

    def __init__(self, opts: BenchOptions):
        self.opts = opts
        self.dtype = (getattr(torch, opts.dtype) if opts.dtype != 'auto' else
                      choose_dtype(get_preset(opts.preset), opts.device)[0])
        self._models: dict[int, Pi05Model] = {}
        self._frontends: dict[str, Frontend] = {}
        self.prepared: dict[int, CompilePlan] = {}
        self.warm_frames: dict[int, list[dict]] = {}   # the frames each model warmed up on

    def model(self, steps: int) -> Pi05Model:
        if steps not in self._models:
            cfg = get_preset(self.opts.preset).replace(num_steps=steps)
            model, frontend = random_setup(cfg, 'libero', seed=self.opts.seed,
                                           device=self.opts.device, dtype=self.dtype)
            plan = prepare_model(model, self.opts.device, self.opts.compile)
            started = time.perf_counter()
            frames = [self.frontend_for(model, frontend, robot).prepare(random_observation(
                robot, 0, seed=self.opts.seed, image_size=cfg.vision.image_size)).tensors
                for robot in sorted({get_workload(w).robot for w in self.opts.plan.workloads})]
            if plan.any:   # compile every shape the systems will use, before any timing
                runner = ModelRunner(model, 2, 16, **runner_options(plan, self.opts.device))
                runner.warm_up_compiled(action_rows=(1, 2), frames=frames)
            seal(model, plan, started)
            self.prepared[steps] = plan
            self.warm_frames[steps] = frames
            self._models[steps] = model
            self._frontends.setdefault('libero', frontend)
        return self._models[steps]

    def frontend(self, steps: int, robot: str) -> Frontend:
        model = self.model(steps)
        return self.frontend_for(model, self._frontends['libero'], robot)

    def frontend_for(self, model: Pi05Model, libero: Frontend, robot: str) -> Frontend:
        if robot == 'libero':
            return self._frontends.setdefault('libero', libero)
        if robot not in self._frontends:
            self._frontends[robot] = Frontend.from_config(
                model.config, robot, libero.tokenizer, identity_norm_stats(robot),
                self.opts.device)
        return self._frontends[robot]


def group_batches(group: Group) -> tuple[int, ...]:
    """Decode batch sizes the group's component model needs: 1 and ceil(N/k) per fixed k."""
    sizes = {1} | {-(-group.n_tokens // s.k) for s in group.systems if s.name == 'oxygen'}
    return tuple(sorted(sizes))


def component_rows(group: Group, costs: PhaseCosts, samples: int) -> list[dict]:
    """Return the group's component model as CSV rows, one per decode batch size."""
    base = {'group': group.title, 'sweep': group.sweep, 'workload': group.workload,
            'steps': group.steps, 'n_tokens': group.n_tokens, 'samples': samples,
            'vision_ms': 1e3 * costs.vision_s, 'prefill_ms': 1e3 * costs.prefill_s,
            'denoise_ms': 1e3 * costs.denoise_s, 'first_token_ms': 1e3 * costs.first_token_s,
            'frontend_ms': 1e3 * costs.frontend_s}
    return [dict(base, batch=batch, decode_step_ms=1e3 * seconds,
                 prefill_after_ms=1e3 * costs.prefill_after_s.get(batch, math.nan),
                 decode_next_steps_ms='/'.join(f'{1e3 * x:.3f}'
                                               for x in costs.decode_next_s.get(batch, ())))
            for batch, seconds in sorted(costs.decode_s.items())]


def ideal_speedup(costs: PhaseCosts, group: Group, spec: SystemSpec) -> float:
    """Component-model speedup of `spec` over isolated (nan where the model does not apply)."""
    if group.arrival_rate is not None or group.lengths:
        return math.nan
    n = group.n_tokens
    if spec.name == 'isolated':
        return 1.0
    if spec.name == 'oxygen':
        return costs.ideal_speedup(n, spec.k)
    if spec.name == 'shared':
        return costs.ideal_speedup(n, n)     # one prefill, N steps at batch 1
    if spec.name == 'action-only':
        return costs.frame_s(1, n, prefills=2) / costs.frame_s(1, 0)
    return math.nan


def apply_component_model(row: dict, costs: PhaseCosts, group: Group, spec: SystemSpec) -> None:
    """Set the ideal speedup of a row and the measured / ideal ratios (mean and p50 based)."""
    ideal = ideal_speedup(costs, group, spec)
    row['ideal_speedup'] = ideal
    row['speedup_over_ideal'] = row['speedup'] / ideal
    row['speedup_p50_over_ideal'] = row['speedup_p50'] / ideal


def run_group(group: Group, models: ModelCache, period_s: float, opts: BenchOptions,
              bar: tqdm) -> tuple[list[dict], list[dict]]:
    """Run one group side by side; return one row per system and the component-model rows.

    The component model (P, D, d(B)) is sampled between the rounds of the group's frames, so
    it sees the machine as the frames did: this VM's speed drifts by ~10% over minutes, which
    would otherwise show up as a gap between measured and ideal.
    """
    model = models.model(group.steps)
    frontend = models.frontend(group.steps, get_workload(group.workload).robot)
    horizon = get_workload(group.workload).horizon
    policy = group.policy(opts.seed)
    # The probe's prefill runs on a frame of this workload (its cameras and prompt length).
    sample = random_observation(group.workload, 0, seed=opts.seed,
                                image_size=model.config.vision.image_size)
    probe = PhaseProbe(model, group_batches(group), seed=opts.seed,
                       frames=[frontend.prepare(sample).tensors],
                       frontend=lambda: frontend.prepare(sample))
    options = runner_options(models.prepared[group.steps], opts.device)   # GPU: buckets
    parallel = {'compile_setting': opts.compile, 'warm_frames': models.warm_frames[group.steps]}
    systems = {spec: make_bench_system(spec, model, frontend, policy, period_s, opts.seed,
                                       options, parallel)
               for spec in group.systems}
    logs = {spec: SystemLog() for spec in group.systems}
    first_frame = {spec: group.max_warmup - group.warmup(spec) for spec in group.systems}
    load = OtherLoad()
    try:
        for frame in range(group.total_frames):
            obs = random_observation(group.workload, frame, seed=opts.seed,
                                     image_size=model.config.vision.image_size)
            measured = frame >= group.max_warmup
            for spec in round_order(group.systems, frame):
                if frame < first_frame[spec]:
                    continue
                cpu_start = time.process_time()
                result = systems[spec].step(obs)
                cpu_s = time.process_time() - cpu_start
                if spec.name == 'parallel':
                    cpu_s = math.nan   # the work happens in the worker processes
                logs[spec].record(frame, result, cpu_s, measured)
                bar.update(1)
            if frame % PROBE_EVERY_ROUNDS == 0:
                probe.sample()
        other_load_pct = load.percent()   # warm-up + measured frames, before draining
        for spec, system in systems.items():
            drain(system, logs[spec])
    finally:
        for system in systems.values():
            system.close()
    while len(probe.samples['prefill']) < MIN_PROBE_SAMPLES:
        probe.sample()
    costs = probe.costs()
    rows = group_rows(group, logs, horizon, costs, period_s, opts)
    for row in rows:
        row['other_load_pct'] = other_load_pct
    return rows, component_rows(group, costs, len(probe.samples['prefill']))


def group_rows(group: Group, logs: dict[SystemSpec, SystemLog], horizon: int,
               costs: PhaseCosts, period_s: float, opts: BenchOptions) -> list[dict]:
    """Metrics of every system plus the comparisons with isolated and action-only."""
    metrics = {spec: summarize(log, horizon, period_s) for spec, log in logs.items()}
    isolated = next(s for s in logs if s.name == 'isolated')
    action_only = next((s for s in logs if s.name == 'action-only'), None)
    rows = []
    for spec, log in logs.items():
        m = metrics[spec]
        row = {'sweep': group.sweep, 'workload': group.workload, 'preset': opts.preset,
               'device': opts.device, 'dtype': opts.dtype, 'threads': opts.threads,
               'steps': group.steps, 'n_tokens': group.n_tokens,
               'k': spec.k if spec.name == 'oxygen' else '',
               'arrival_rate': '' if group.arrival_rate is None else group.arrival_rate,
               'lengths': '/'.join(map(str, group.lengths)), 'system': spec.name,
               'label': spec.label, 'frames': group.frames, 'warmup': group.warmup(spec)}
        row.update(m)
        iso = metrics[isolated]
        row['speedup'] = m['action_hz'] / iso['action_hz']
        row['speedup_p50'] = m['action_hz_p50'] / iso['action_hz_p50']
        apply_component_model(row, costs, group, spec)
        row['comp_prefill_ms'] = 1e3 * costs.prefill_s
        row['comp_denoise_ms'] = 1e3 * costs.denoise_s
        row['comp_decode1_ms'] = 1e3 * costs.decode_at(1)
        row['comp_decodeB_ms'] = (1e3 * costs.decode_at(-(-group.n_tokens // spec.k))
                                  if spec.name == 'oxygen' else '')
        if action_only is not None:
            ref = metrics[action_only]
            row['act_p50_over_action_only'] = m['act_ms_p50'] / ref['act_ms_p50']
            row['act_p99_over_action_only'] = m['act_ms_p99'] / ref['act_ms_p99']
            row['hz_over_action_only'] = m['action_hz'] / ref['action_hz']
        else:
            row.update(act_p50_over_action_only=math.nan, act_p99_over_action_only=math.nan,
                       hz_over_action_only=math.nan)
        check = compare_tokens(logs[isolated].requests, log.requests)
        row['tokens_identical'] = '' if check.identical is None else check.identical
        row['requests_compared'] = check.compared
        row['token_mismatches'] = ' '.join(map(str, check.mismatched))
        row['action_max_diff'] = max_action_diff(logs[isolated].actions, log.actions)
        rows.append(row)
    return rows


def probe_memory(opts: BenchOptions, group: Group, period_s: float) -> list[dict]:
    """Peak memory of each system of `group` in fresh processes (1 torch thread each)."""
    env = package_env()
    # Why: MKL's fast memory manager keeps a packing buffer per GEMM row count (3.2 MB each
    # for rows 4..8 of the pi05-cpu LM head), so decode batches of 4..8 rows would leave
    # ~16 MB cached that no request uses. Off for every probe alike (MKL reads it at load;
    # any value disables it, so MKL_DISABLE_FAST_MM=0 here means: leave MKL's default).
    if env.get('MKL_DISABLE_FAST_MM') == '0':
        del env['MKL_DISABLE_FAST_MM']
    else:
        env['MKL_DISABLE_FAST_MM'] = '1'
    frames = group.max_warmup + opts.memory_frames

    def one(spec: SystemSpec, kv_dtype: str = '') -> dict:
        cmd = [sys.executable, '-m', 'oxygen_ros.bench.memory', '--system', spec.name,
               '--kv-dtype', kv_dtype,
               '--preset', opts.preset, '--workload', group.workload, '--device', opts.device,
               '--dtype', opts.dtype, '--compile', opts.compile,
               '--steps', str(group.steps), '--n', str(group.n_tokens),
               '--k', str(spec.k or group.n_tokens), '--period', f'{period_s:.6f}',
               '--frames', str(frames), '--threads', '1', '--seed', str(opts.seed)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f'memory probe {spec.label} failed:\n{done.stderr[-3000:]}')
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result.update(label=spec.label + (f' ({kv_dtype} KV)' if kv_dtype else ''),
                      workload=group.workload, preset=opts.preset,
                      device=opts.device, dtype=opts.dtype, steps=group.steps)
        return result

    # Probes measure memory, not time, so they may overlap. On CUDA each one builds its model
    # (bf16 pi05: 6.6 GB, built in place on the GPU): at most 3 at once.
    workers = max(1, os.cpu_count() or 1)
    if opts.device.startswith('cuda'):
        workers = min(workers, 3)
    probes = [(spec, '') for spec in group.systems]
    if opts.dtype == 'float32':
        # the optional bf16 KV store of a float32 model (ModelRunner kv_dtype), for oxygen
        probes += [(spec, 'bfloat16') for spec in group.systems if spec.name == 'oxygen']
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda probe: one(*probe), probes))
    ref = next((r for r in rows if r['system'] == 'action-only'), None)
    for row in rows:
        for key in ('peak_rss_mb', 'above_runtime_mb', 'cuda_peak_mb'):
            row[key.replace('_mb', '_vs_action_only')] = (
                row[key] / ref[key] if ref and ref[key] else math.nan)
    return rows


def memory_group(opts: BenchOptions) -> Group:
    """Return the headline setting with every allowed system: what the memory bars show."""
    plan = opts.plan
    n, k = plan.headline_n, plan.headline_k
    specs = [SystemSpec('action-only'), SystemSpec('isolated'), SystemSpec('parallel'),
             SystemSpec('shared'), SystemSpec('oxygen', k), SystemSpec('oxygen-adaptive', n)]
    specs = tuple(s for s in specs if s.name in plan.systems)
    return Group('memory', plan.workloads[0], plan.default_steps, n, specs, opts.memory_frames)


def period_for(costs: PhaseCosts, opts: BenchOptions) -> float:
    if opts.control_hz:
        return 1.0 / opts.control_hz
    return (costs.prefill_s + costs.denoise_s) * (1 + DEFAULT_LANGUAGE_SLACK)


def run_benchmark(opts: BenchOptions,
                  checkpoint: Callable[[BenchResult], None] | None = None) -> BenchResult:
    """Run every part of the plan; nothing is written here (see report.write_report).

    `checkpoint` gets the result after the sweeps, before the memory probes (so a run cut
    short by a time limit still leaves its sweep results behind).
    """
    torch.set_num_threads(opts.threads)
    reason = 'set by --dtype'
    if opts.dtype == 'auto':
        dtype, reason = choose_dtype(get_preset(opts.preset), opts.device)
        opts = dataclasses.replace(opts, dtype=DTYPE_NAMES[dtype])
    with quiet_loggers(QUIET_LOGGERS):
        return _run_benchmark(opts, checkpoint, reason)


# The synthetic prompt (task + 256-bin state) is longer than small presets' prompt slots, so
# its truncation is expected; refusals and evictions under Poisson arrivals are expected and
# counted in the CSV (columns refused, evicted). One log line each would bury the progress bar.
QUIET_LOGGERS = ('oxygen_ros.model.tokenizer', 'oxygen_ros.engine')


@contextlib.contextmanager
def quiet_loggers(names, level=logging.ERROR):
    """Raise the level of the named loggers for the duration of the block."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved):
            logger.setLevel(old)


def _run_benchmark(opts: BenchOptions, checkpoint, dtype_reason: str) -> BenchResult:
    env = environment(opts)
    env['dtype_reason'] = dtype_reason
    groups = build_groups(opts.plan)
    part_seconds: dict[str, float] = {}
    models = ModelCache(opts)
    periods: dict[int, float] = {}
    floors: list[dict] = []
    if 'floors' in opts.plan.parts:
        start = time.perf_counter()
        floors = run_floors_part(opts, models, env)
        part_seconds['floors'] = time.perf_counter() - start
    step_values = sorted({g.steps for g in groups} | {opts.plan.default_steps})
    if not groups and 'memory' not in opts.plan.parts:
        step_values = []   # the node part alone needs no frame deadline
    start = time.perf_counter()
    for steps in step_values:
        # The deadline must be known before the runs (oxygen-adaptive plans with it), so it
        # comes from the fastest of a few action paths, which a burst of other work cannot
        # inflate the way it can inflate a median.
        fastest = measure_phases(models.model(steps), batches=(1,), repeats=opts.phase_repeats,
                                 statistic=min)
        periods[steps] = period_for(fastest, opts)
    if step_values:
        part_seconds['deadline'] = time.perf_counter() - start
    rows: list[dict] = []
    components: list[dict] = []
    total = sum(g.system_frames() for g in groups)
    with tqdm(total=total, unit='frame', disable=not opts.progress or not total,
              dynamic_ncols=True, file=sys.stderr) as bar:
        for group in groups:
            bar.set_description(group.title)
            start = time.perf_counter()
            group_rows_, group_components = run_group(group, models, periods[group.steps],
                                                      opts, bar)
            rows += group_rows_
            components += group_components
            part_seconds[group.sweep] = part_seconds.get(group.sweep, 0.0) + (
                time.perf_counter() - start)
    memory: list[dict] = []
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if opts.progress else (
        lambda line: None)   # the process parts' progress lines
    result = BenchResult(rows, memory, components, periods, part_seconds, env, opts,
                         floors=floors)
    if checkpoint is not None and groups and {'memory', 'robots', 'node'} & set(opts.plan.parts):
        checkpoint(result)
    if 'build' in opts.plan.parts:
        from .build import run_build_part

        start = time.perf_counter()
        result.builds.extend(run_build_part(opts.build_preset, opts.dtype, opts.progress))
        part_seconds['build'] = time.perf_counter() - start
    if 'memory' in opts.plan.parts:
        start = time.perf_counter()
        group = memory_group(opts)
        memory += probe_memory(opts, group, periods[group.steps])
        part_seconds['memory'] = time.perf_counter() - start
    if 'robots' in opts.plan.parts:
        if checkpoint is not None and memory:
            checkpoint(result)
        start = time.perf_counter()
        if opts.fleet_timing is not None:
            result.fleet_timing.extend(run_fleet_timing(opts.fleet_timing, say))
        if opts.plan.robot_counts:
            result.robots.extend(run_robots_part(opts, models))
        part_seconds['robots'] = time.perf_counter() - start
    if 'node' in opts.plan.parts:
        if checkpoint is not None and (memory or result.robots):
            checkpoint(result)
        start = time.perf_counter()
        # the node's own torch threads (NodeBenchOptions.threads), not this process's
        row, ticks, _ = run_node_part(opts.node, opts.preset, opts.device, opts.dtype,
                                      opts.seed, Path(opts.out_dir) / 'node_logs', say)
        result.node.append(row)
        result.node_ticks.extend(ticks)
        part_seconds['node'] = time.perf_counter() - start
    if 'serve' in opts.plan.parts:
        from .serve import run_serve_part, ServeBenchOptions

        start = time.perf_counter()
        quick = ServeBenchOptions(requests=8, warmup=2, tokens=4, k=2)
        result.serve.append(run_serve_part(quick if opts.quick else ServeBenchOptions(),
                                           opts.preset, opts.device, opts.dtype, opts.threads,
                                           opts.seed))
        part_seconds['serve'] = time.perf_counter() - start
    if 'rtc' in opts.plan.parts:
        start = time.perf_counter()
        steps = opts.plan.default_steps
        model, frontend, policy = rtc_policy(
            opts.rtc, opts.preset, opts.device, opts.dtype, opts.threads, opts.seed,
            lambda: (models.model(steps), models.frontend(steps, opts.rtc.robot)), say)
        rows, paths = run_rtc_part(opts.rtc, model, frontend, opts.seed, say, policy)
        result.rtc.extend(rows)
        result.rtc_paths.extend(paths)
        part_seconds['rtc'] = time.perf_counter() - start
    if 'overload' in opts.plan.parts:
        start = time.perf_counter()
        result.overload.extend(run_overload_part(opts.node, opts.overload,
                                                 Path(opts.out_dir) / 'overload_logs', say))
        part_seconds['overload'] = time.perf_counter() - start
    if 'tasks' in opts.plan.parts:
        start = time.perf_counter()
        steps = opts.plan.default_steps
        rows, engine = run_tasks_part(
            opts.node, opts.tasks, Path(opts.out_dir) / 'tasks_logs',
            lambda: (models.model(steps), models.frontend(steps, opts.node.robot)), say)
        result.tasks.extend(rows)
        result.task_tokens.extend(engine)
        part_seconds['tasks'] = time.perf_counter() - start
    env['loadavg_end'] = os.getloadavg()[0] if hasattr(os, 'getloadavg') else math.nan
    env['compile'] = {steps: {'passes': plan.describe(), 'warm_up_s': round(plan.seconds, 1)}
                      for steps, plan in models.prepared.items()}
    return result


def run_floors_part(opts: BenchOptions, models: ModelCache, env: dict) -> list[dict]:
    """Each phase of the first workload's frame against its floor on this machine.

    At the node's torch threads (opts.floor_threads; 0: every core but one, the node's
    default), not the benchmark's: a robot's frame runs on those, and a pass of few rows
    (the denoise's) gains little from a second thread while its floor halves. Inductor writes
    the thread count into its C++ kernels (dynamo does not guard on it), so at other threads
    than the benchmark's the part prepares a model of its own, compiled at these, and drops
    it after. The machine's peaks (matmul per dtype at those threads, copy bandwidth) are
    measured here, in the same run; compiled passes are also timed eager, side by side.
    """
    threads = inference_threads(opts.floor_threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        machine = measure_machine(opts.device)
        env['machine'] = dataclasses.asdict(machine)
        steps = opts.plan.default_steps
        if threads != opts.threads:
            models = ModelCache(opts)
        model = models.model(steps)
        plan = models.prepared[steps]
        env['floor_compile'] = {'passes': plan.describe(), 'warm_up_s': round(plan.seconds, 1)}
        workload = opts.plan.workloads[0]
        frontend = models.frontend(steps, get_workload(workload).robot)
        frame = frontend.prepare(random_observation(workload, 0, seed=opts.seed,
                                                    image_size=model.config.vision.image_size))
        probe = PhaseProbe(model, batches=(1, 4), seed=opts.seed, frames=[frame.tensors],
                           machine=machine, compare_eager=True)
        for _ in range(opts.phase_repeats):
            probe.sample()
        return floor_rows(probe.costs(), probe.eager_seconds())
    finally:
        torch.set_num_threads(saved)


def save_result(result: BenchResult, path: str | Path) -> None:
    """Everything needed to redraw the report, as JSON (no pickles)."""
    payload = dataclasses.asdict(result)
    payload['periods'] = {str(steps): p for steps, p in result.periods.items()}
    Path(path).write_text(json.dumps(payload, indent=1))


def load_result(path: str | Path) -> BenchResult:
    """Inverse of save_result."""
    data = json.loads(Path(path).read_text())
    opts = data['options']
    opts['plan'] = PlanOptions(**{key: tuple(v) if isinstance(v, list) else v
                                  for key, v in opts['plan'].items()})
    if isinstance(opts.get('node'), dict):
        opts['node'] = NodeBenchOptions(**opts['node'])
    if isinstance(opts.get('rtc'), dict):
        opts['rtc'] = RtcBenchOptions(**{key: tuple(v) if isinstance(v, list) else v
                                         for key, v in opts['rtc'].items()})
    if isinstance(opts.get('overload'), dict):
        opts['overload'] = OverloadBenchOptions(**opts['overload'])
    if isinstance(opts.get('tasks'), dict):
        opts['tasks'] = TasksBenchOptions(**opts['tasks'])
    if isinstance(opts.get('fleet_timing'), dict):
        opts['fleet_timing'] = FleetTimingOptions(**{
            key: tuple(v) if isinstance(v, list) else v
            for key, v in opts['fleet_timing'].items()})
    data['options'] = BenchOptions(**opts)
    data['periods'] = {int(steps): p for steps, p in data['periods'].items()}
    return BenchResult(**data)
