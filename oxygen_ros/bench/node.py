"""The node in the benchmark: oxygen_node as its own process next to the engine alone.

One run, in this order (one thing at a time on the machine):

  1. engine   the node's engine (same preset, robot, threads, N, seed) built in this
              process; act() and act() + advance_language() timed over `engine_frames`
              frames after warm-up, on observations of the cameras' resolution (the node's
              inference_time includes resizing them).
  2. idle     the node process started with the robot's YAML as it ships (its rate: with
              `control_rate_hz: 0` the node's auto rate, 90% of what it timed at configure;
              the adaptive budget), unless a rate or k is given; a monitor process
              (`python -m oxygen_ros.ros.monitor`) recording its outputs; once the node is
              active, `idle_s` seconds with no inputs: its CPU while idle.
  3. active   the stand-in robot (`python -m oxygen_ros.ros.sim_inputs`: cameras at
              `camera_width` x `camera_height`, `camera_rate_hz`, jpeg or raw rgb8, joint
              states, instruction)
              starts; after the first action chunk and `warmup_s`, `duration_s` seconds are
              measured: ticks delivered vs asked, inference_time p50/p99, deadline misses,
              tokens/s on language/tokens, and the node's CPU outside its control thread.

This module imports no ROS package: the node, robot and monitor are separate processes, talked
to through their command lines, the monitor's JSON and /proc. Every child gets
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and a ROS_DOMAIN_ID (a given one is kept).

CPU outside the control thread: the node names its control thread (where inference runs, and
torch's OpenMP workers, which inherit the name) `oxy_control`; the CPU time (utime + stime in
/proc/<pid>/task/<tid>/stat) of every other thread of the node over a window, in % of one
core. A node without such a thread gets NaN there (its whole-process CPU is still reported).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
from pathlib import Path
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from oxygen_ros.model.robot_spec import get_robot
from oxygen_ros.runtime.dds_profile import profile_environment
from oxygen_ros.runtime.inputs import LOSS_WINDOW_S
from oxygen_ros.runtime.params import (camera_param_name, load_node_params, NODE_NAME,
                                       ROBOT_IO, RtcSettings)
from oxygen_ros.runtime.procfs import process_cpu_s
from oxygen_ros.runtime.rtc import RtcPlanner

from .cpu import cpu_between, OtherLoad, ThreadCpu

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = PACKAGE_ROOT / 'config'
BENCH_INSTRUCTION = 'pick up the black bowl and place it on the plate'
TOKEN_WINDOW_S = 5.0                   # tokens/s is also reported per window of this length
ROBOT_START_S = 3.0                    # the stand-in robot's start-up before frames are timed


@dataclasses.dataclass
class NodeBenchOptions:
    """What the node part runs (the model preset, device and threads are BenchOptions')."""

    robot: str = 'libero'           # config/<robot>.yaml: cameras, joints, language prompt
    # None: the robot's YAML as it ships (its N, the adaptive budget, its rate: 0 = the node's
    # auto rate, 90% of what it timed at configure). A robot's defaults, not a tuned harness.
    tokens: int | None = None       # N, tokens per language request
    k: int | None = None            # a fixed decode budget of the node and of the engine run
    rate_hz: float | None = None    # asked control rate
    # torch threads of node and engine; None: the YAML's (0: every core but one, as the node)
    threads: int | None = None
    duration_s: float = 60.0        # measured window
    warmup_s: float = 5.0           # after the first action chunk, not measured
    idle_s: float = 5.0             # node active with no inputs, before the robot starts
    camera_rate_hz: float = 15.0
    camera_width: int = 640
    camera_height: int = 480
    # 'raw' (rgb8 sensor_msgs/Image, as a camera driver sends) or 'jpeg' (CompressedImage).
    # Raw 640x480 frames are 0.9 MB: every child runs with the Fast DDS profile for large
    # frames (config/fastdds_large_frames.xml), without which Fast DDS's 512 KB shared-memory
    # segment drops most of them (publisher at 15 Hz, received at 2-14 Hz here).
    camera_format: str = 'raw'
    engine_frames: int = 20         # measured engine frames (after ceil(N/k) + 2 warm-up)
    # then the engine again while the stand-in robot publishes (no node): the same machine
    # load the node runs under, so the node's tail can be told from the robot's interference
    engine_loaded_frames: int = 60
    rtc_mode: str = 'off'           # real-time chunking of the node and the engine run
    start_timeout_s: float = 300.0  # node start (model load) and first action, each

    @classmethod
    def quick(cls, **changes) -> NodeBenchOptions:
        """Return a smoke run's options: seconds instead of a minute."""
        return dataclasses.replace(cls(duration_s=5.0, warmup_s=1.0, idle_s=1.0,
                                       engine_frames=5, engine_loaded_frames=3), **changes)


# ---- 1. the engine alone ------------------------------------------------------------------

@dataclasses.dataclass
class EngineReference:
    """The engine's action path and whole frame, timed in this process."""

    act_s: list[float]              # act() per measured frame (what the node publishes as
    #                                 inference_time: frontend + prefill + denoise)
    frame_s: list[float]            # act() + advance_language() per measured frame
    tokens: list[int]               # tokens decoded per measured frame
    k: int                          # fixed decode budget the frames ran with
    other_load_pct: float = math.nan   # other processes' CPU meanwhile, % of all cores
    loaded_act_s: list[float] = dataclasses.field(default_factory=list)   # act() per frame
    #                                 while the stand-in robot process publishes (no node)

    @property
    def act_p50_s(self) -> float:
        return float(np.median(self.act_s))

    @property
    def frame_p50_s(self) -> float:
        return float(np.median(self.frame_s))


def node_robots() -> list[str]:
    """Shipped robots with a node configuration (config/<robot>.yaml) to benchmark."""
    return sorted(name for name in ROBOT_IO if (CONFIG_DIR / f'{name}.yaml').is_file())


def node_parameters(robot: str) -> dict:
    """Read the `ros__parameters` of oxygen_node in config/<robot>.yaml (what the node loads)."""
    return load_node_params(CONFIG_DIR / f'{robot}.yaml', NODE_NAME)


def camera_observation(robot: str, index: int, height: int, width: int, seed: int,
                       instruction: str):
    """Make an observation with camera-sized noise images (the frontend resizes them)."""
    from ..engine.types import Observation

    spec = get_robot(robot)
    rng = np.random.default_rng(np.random.SeedSequence([seed, index, 11]))
    images = {cam: rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
              for cam in spec.camera_names}
    state = rng.uniform(-0.3, 0.3, spec.state_dim).astype(np.float32)
    return Observation(images=images, state=state, instruction=instruction, stamp=0.1 * index)


def measure_engine(preset: str, robot: str = 'libero', *, device: str = 'cpu',
                   dtype: str = 'auto', threads: int = 0, tokens: int = 10, k: int = 5,
                   seed: int = 0, frames: int = 20, camera_hw: tuple[int, int] = (480, 640),
                   instruction: str = BENCH_INSTRUCTION, loaded_frames: int = 0,
                   load=None, rtc_mode: str = 'off') -> EngineReference:
    """Build the engine the node builds (random weights of `preset`) and time its frames.

    The language policy is the node's: one request per frame, N = `tokens`, EOS on, the
    robot's language prompt; `k` fixed. Warm-up: ceil(N/k) + 2 frames (the decode batch is at
    its steady size after ceil(N/k)). threads: torch threads (0 = leave as is). With `load`
    (a context manager factory) and `loaded_frames`, the same engine is then timed again
    inside `load()` (the stand-in robot running) into `loaded_act_s`.
    """
    import torch

    from ..engine import LanguagePolicy, random_observation, random_setup
    from ..engine.hardware import choose_dtype
    from ..engine.prepare import prepare_model, seal
    from ..model import get_preset
    from .systems import make_system

    if threads:
        torch.set_num_threads(threads)
    params = node_parameters(robot)
    config = get_preset(preset)
    if params.get('denoise_steps'):
        config = config.replace(num_steps=int(params['denoise_steps']))
    model_dtype = (choose_dtype(config, device)[0] if dtype == 'auto' else
                   getattr(torch, dtype))
    model, frontend = random_setup(config, robot, seed=seed, device=device, dtype=model_dtype)
    # prepared as the node's configure prepares it (its YAML's compile setting)
    plan = prepare_model(model, device, params.get('compile', 'auto'))
    policy = LanguagePolicy(max_new_tokens=tokens,
                            every_n_frames=int(params.get('request_every_n_frames', 1)),
                            seed=seed, eos_id=frontend.eos_id,
                            prompt_template=params.get('language_prompt', ''))
    system = make_system('oxygen', model, frontend, policy, k=k, seed=seed)
    started = time.perf_counter()
    system.runner.warm_up_compiled(frames=[frontend.prepare(random_observation(
        frontend.adapter.spec, 0, seed, image_size=config.vision.image_size)).tensors])
    seal(model, plan, started)
    rtc = RtcPlanner(RtcSettings(rtc_mode), get_robot(robot).step_period_s)
    try:
        reference = time_engine(system, robot, k=k, warmup=math.ceil(tokens / k) + 2,
                                frames=frames, camera_hw=camera_hw, seed=seed,
                                instruction=instruction, close=False, rtc=rtc)
        if loaded_frames and load is not None:
            with load():
                loaded = time_engine(system, robot, k=k, warmup=1, frames=loaded_frames,
                                     camera_hw=camera_hw, seed=seed + 1,
                                     instruction=instruction, close=False, rtc=rtc)
            reference.loaded_act_s = loaded.act_s
        return reference
    finally:
        system.close()
        del system, model, frontend
        gc.collect()   # the node process builds its own copy; do not hold two


def time_engine(system, robot: str, *, k: int, warmup: int, frames: int,
                camera_hw: tuple[int, int], seed: int = 0,
                instruction: str = BENCH_INSTRUCTION, close: bool = True,
                rtc: RtcPlanner | None = None) -> EngineReference:
    """Time act() and act() + advance_language() of a built engine over camera-sized frames.

    `system` is any engine System (act / advance_language); it is closed afterwards unless
    `close` is False. `warmup` frames run first, unmeasured (ceil(N/k) + 2 reach the steady
    decode batch). rtc: each chunk continues the last one, as in the node (frames 0.1 s
    apart, each out after its act()).
    """
    act_s, frame_s, decoded = [], [], []
    other = None
    try:
        for index in range(warmup + frames):
            obs = camera_observation(robot, index, *camera_hw, seed=seed,
                                     instruction=instruction)
            if index == warmup:
                other = OtherLoad()
            continuation = rtc.continuation(obs) if rtc is not None else None
            action = (system.act(obs, continuation) if continuation is not None
                      else system.act(obs))
            if rtc is not None:
                rtc.record(action, obs.stamp + action.inference_time_s)
            result = system.advance_language()
            if index >= warmup:
                act_s.append(action.inference_time_s)
                frame_s.append(result.timings.total_s)
                decoded.append(sum(len(d.token_ids) for d in result.deltas))
    finally:
        if close:
            system.close()
    return EngineReference(act_s, frame_s, decoded, k,
                           other.percent() if other is not None else math.nan)


# ---- 2./3. the processes ------------------------------------------------------------------

def child_environment() -> dict[str, str]:
    """Return the environment of ROS children: DDS on this machine, this source tree.

    The children use the Fast DDS profile for large frames unless the environment names one.
    """
    env = dict(os.environ)
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    env.setdefault('ROS_DOMAIN_ID', str(1 + os.getpid() % 100))
    env.update(profile_environment(environ=env))   # raw camera frames arrive whole
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT),
                                                      env.get('PYTHONPATH')]))
    env['PYTHONUNBUFFERED'] = '1'
    return env


def _die_with_parent() -> None:
    """In a child, before exec: get SIGTERM when the benchmark dies, even by SIGKILL (Linux)."""
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass   # no prctl: the benchmark's own cleanup still stops the child


class Child:
    """A child process, stopped by this process (SIGINT first: the clean shutdown).

    It stays in this process's group, so whoever stops the benchmark's group (Ctrl-C in the
    terminal, a test's cleanup) reaches it too. Output goes to `log_path`; `lines` (optional)
    receives each stdout line as it arrives.
    """

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: Path,
                 lines: queue.Queue | None = None):
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, 'w')
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors='replace',
                                     bufsize=1, preexec_fn=(
                                         _die_with_parent if sys.platform == 'linux' else None))
        self._lines = lines
        self._reader = threading.Thread(target=self._read, name=f'bench_{name}_log',
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if self._lines is not None:
                self._lines.put(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return '\n'.join(self.log_path.read_text(errors='replace').splitlines()[-lines:])
        except OSError:
            return ''

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGINT (clean shutdown), then SIGTERM, then SIGKILL; return the exit status."""
        for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 5.0),
                            (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=2.0)
        self._log.close()
        return self.proc.returncode


def node_command(opts: NodeBenchOptions, preset: str, device: str, dtype: str, threads: int,
                 rate_hz: float | None, seed: int) -> list[str]:
    """oxygen_node with the robot's YAML and the benchmark's overrides (None: the YAML's)."""
    overrides = {'preset': preset, 'device': device, 'dtype': dtype, 'seed': seed,
                 # Declared by nodes that pin torch's threads; an older node ignores it.
                 'torch_threads': threads}
    for name, value in (('control_rate_hz', rate_hz and f'{rate_hz:.6g}'),
                        ('decode_budget', opts.k), ('tokens_per_request', opts.tokens)):
        if value is not None:
            overrides[name] = value
    if opts.rtc_mode != 'off':
        overrides['rtc_mode'] = opts.rtc_mode
    return yaml_node_command(opts, overrides)


def yaml_node_command(opts: NodeBenchOptions, overrides: dict) -> list[str]:
    """oxygen_node with config/<robot>.yaml, `overrides` and the robot's camera format."""
    overrides = dict(overrides)
    if opts.camera_format == 'jpeg':
        # The node subscribes <base>/compressed (image_transport naming), as the stand-in
        # robot publishes with --compressed.
        for camera in node_parameters(opts.robot)['camera_names']:
            overrides[camera_param_name(camera, 'compressed')] = 'true'
    cmd = [sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args',
           '--params-file', str(CONFIG_DIR / f'{opts.robot}.yaml')]
    for name, value in overrides.items():
        cmd += ['-p', f'{name}:={value}']
    return cmd


def robot_command(opts: NodeBenchOptions) -> list[str]:
    """Return the stand-in robot's command: cameras, joint states and one instruction."""
    cmd = [sys.executable, '-m', 'oxygen_ros.ros.sim_inputs', '--robot', opts.robot,
           '--rate', f'{opts.camera_rate_hz:g}', '--width', str(opts.camera_width),
           '--height', str(opts.camera_height), '--instruction', BENCH_INSTRUCTION]
    return cmd + (['--compressed'] if opts.camera_format == 'jpeg' else [])


def monitor_command(out: Path) -> list[str]:
    return [sys.executable, '-m', 'oxygen_ros.ros.monitor', '--out', str(out),
            '--node-name', NODE_NAME]


class NodeBenchError(RuntimeError):
    """The node run could not be measured; the message says why and where the logs are."""


def _wait_event(events: queue.Queue, name: str, timeout_s: float, children: list[Child],
                state: str | None = None) -> dict:
    """Wait for a monitor event line ({"event": name, ...}); fail early if a child died.

    A node that goes back to 'unconfigured' after 'configuring' failed to configure (it stays
    alive, waiting for a fix): that fails at once too.
    """
    deadline = time.monotonic() + timeout_s
    configuring = False
    while time.monotonic() < deadline:
        for child in children:
            if not child.alive():
                raise NodeBenchError(f'{child.name} exited with status '
                                     f'{child.proc.returncode} while waiting for {name}; last '
                                     f'lines of {child.log_path}:\n{child.tail()}')
        try:
            line = events.get(timeout=0.2)
        except queue.Empty:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue   # a log line of the monitor, not an event
        # The model status's message is the lifecycle state; match its first word only, so
        # a node that adds detail after it ('active (12.5 Hz)') is still understood.
        words = str(event.get('state', '')).split()
        current = words[0] if words else ''
        if event.get('event') == name and (state is None or current == state):
            return event
        if event.get('event') == 'lifecycle':
            failed = current == 'unconfigured' and (
                configuring or (event.get('level') or 0) >= 2)
            if failed:
                node = next((c for c in children if c.name == NODE_NAME), children[-1])
                raise NodeBenchError(f'{NODE_NAME} failed to configure; last lines of '
                                     f'{node.log_path}:\n{node.tail()}')
            configuring = current == 'configuring'
    raise NodeBenchError(f'no {name} {state or ""} within {timeout_s:.0f} s; logs: '
                         + ', '.join(str(c.log_path) for c in children))


def _sleep_until(t: float, children: list[Child]) -> None:
    while (left := t - time.monotonic()) > 0:
        for child in children:
            if not child.alive():
                raise NodeBenchError(f'{child.name} exited with status '
                                     f'{child.proc.returncode}; last lines of '
                                     f'{child.log_path}:\n{child.tail()}')
        time.sleep(min(left, 0.2))


@dataclasses.dataclass
class NodeRun:
    """What the processes produced: the monitor's records and the windows' CPU figures."""

    monitor: dict                   # the monitor's JSON (ticks, tokens, diagnostics)
    window: tuple[float, float]     # measured window, monotonic seconds
    first_action_t: float           # monotonic time of the first action chunk
    cpu_idle: dict                  # cpu_between over the idle window
    cpu_active: dict                # cpu_between over the measured window
    robot_cpu_pct: float            # the stand-in robot's CPU in the window, % of a core
    other_load_pct: float = math.nan   # other processes' CPU in the window, % of all cores


def _silent(message: str) -> None:
    pass


def run_node(opts: NodeBenchOptions, preset: str, device: str, dtype: str, threads: int,
             rate_hz: float | None, seed: int, log_dir: Path, say=_silent) -> NodeRun:
    """Start node, monitor and robot; measure idle, then the active window; stop them all.

    say: gets one line per stage (progress for a person waiting).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    env = child_environment()
    monitor_json = log_dir / 'node_monitor.json'
    events: queue.Queue = queue.Queue()
    children: list[Child] = []
    sampler = None
    try:
        monitor = Child('monitor', monitor_command(monitor_json), env,
                        log_dir / 'monitor.log', events)
        children.append(monitor)
        node = Child('oxygen_node', node_command(opts, preset, device, dtype, threads, rate_hz,
                                                 seed), env, log_dir / 'oxygen_node.log')
        children.append(node)
        say(f'oxygen_node started (pid {node.pid}, '
            f'{f"{rate_hz:.3g} Hz" if rate_hz else "its own rate"}, ROS_DOMAIN_ID='
            f'{env["ROS_DOMAIN_ID"]}); logs in {log_dir}')
        _wait_event(events, 'lifecycle', opts.start_timeout_s, children, state='active')
        say(f'node active: {opts.idle_s:g} s without inputs (idle CPU)')
        sampler = ThreadCpu(node.pid)
        idle_start = sampler.mark()
        _sleep_until(idle_start[0] + opts.idle_s, children)
        cpu_idle = cpu_between(idle_start, sampler.mark())
        robot = Child('robot', robot_command(opts), env, log_dir / 'robot.log')
        children.append(robot)
        first = _wait_event(events, 'first_action', opts.start_timeout_s, children)
        say(f'robot started, first action chunk: {opts.warmup_s:g} s warm-up, then '
            f'{opts.duration_s:g} s measured')
        _sleep_until(first['t'] + opts.warmup_s, children)
        robot_cpu_start = process_cpu_s(robot.pid)
        other = OtherLoad([child.pid for child in children])
        active_start = sampler.mark()
        _sleep_until(active_start[0] + opts.duration_s, children)
        active_end = sampler.mark()
        robot_cpu = process_cpu_s(robot.pid) - robot_cpu_start
        other_load_pct = other.percent()
        cpu_active = cpu_between(active_start, active_end)
        robot.stop()
        monitor.stop()   # it writes its JSON on SIGINT
        if not monitor_json.exists():
            raise NodeBenchError(f'the monitor wrote no {monitor_json}; its log:\n'
                                 f'{monitor.tail()}')
        data = json.loads(monitor_json.read_text())
        return NodeRun(data, (active_start[0], active_end[0]), first['t'], cpu_idle,
                       cpu_active, 100 * robot_cpu / cpu_active['wall_s'], other_load_pct)
    finally:
        if sampler is not None:
            sampler.close()
        for child in reversed(children):   # robot, node, monitor: inputs stop first
            child.stop()


# ---- analysis -----------------------------------------------------------------------------

def node_rate(diagnostics: list[dict]) -> float:
    """Return the control rate the node resolved (its model status), or raise NodeBenchError."""
    rates = [float(d['model']['control_rate_hz']) for d in diagnostics
             if 'control_rate_hz' in d.get('model', {})]
    if not rates or rates[-1] <= 0:
        raise NodeBenchError('the node published no control_rate_hz in its model status')
    return rates[-1]


def analyze(run: NodeRun, rate_hz: float) -> dict:
    """Figures of the measured window from the monitor's records (times in ms, % of ticks).

    asked ticks = rate x window; a deadline miss is a tick whose inference_time exceeded the
    period (late) or an asked tick that never delivered an action chunk (missing). On the
    strict side: an overrun that also pushed a later tick out counts twice, and the window's
    edges can make one tick of difference.
    """
    t0, t1 = run.window
    window = t1 - t0
    period = 1.0 / rate_hz
    ticks = [t for t in run.monitor['ticks'] if t0 <= t['t'] < t1]
    tokens = [c for c in run.monitor['tokens'] if t0 <= c['t'] < t1]
    inference = np.array([t['inference_s'] for t in ticks]) if ticks else np.array([])
    asked = rate_hz * window
    late = int(np.sum(inference > period))
    missing = max(0, int(round(asked)) - len(ticks))
    times = [t['t'] for t in ticks]
    gaps = [b - a for a, b in zip(times, times[1:])]
    gap_misses = sum(max(0, round(g / period) - 1) for g in gaps)
    frames = [t['frame'] for t in ticks]
    frames_lost = (max(frames) - min(frames) + 1 - len(set(frames))) if frames else 0
    windows = max(1, int(window // TOKEN_WINDOW_S))
    per_window = [0] * windows
    for chunk in tokens:
        per_window[min(windows - 1, int((chunk['t'] - t0) // TOKEN_WINDOW_S))] += chunk['n']
    diags = [d for d in run.monitor['diagnostics'] if t0 <= d['t'] < t1]
    ks = [int(d['language']['current_k']) for d in diags
          if str(d.get('language', {}).get('current_k', '')).isdigit()]

    def loop_counter(key: str, before: float) -> float:
        """Return the node's counter `key` (control loop status) last reported before a time."""
        known = [d for d in run.monitor['diagnostics'] if d['t'] < before
                 and key in d.get('control loop', {})]
        return float(known[-1]['control loop'][key]) if known else math.nan

    def counted(key: str) -> float:
        return loop_counter(key, t1) - loop_counter(key, t0)

    def pct(q):
        return 1e3 * float(np.percentile(inference, q)) if len(inference) else math.nan

    return {
        'window_s': window,
        'ticks_asked': asked,
        'ticks_delivered': len(ticks),
        'rate_held_hz': len(ticks) / window,
        'node_inference_ms_p50': pct(50),
        'node_inference_ms_p99': pct(99),
        'late_ticks': late,
        'missing_ticks': missing,
        'deadline_misses': late + missing,
        'deadline_miss_pct': 100 * (late + missing) / max(asked, 1e-9),
        'gap_misses': gap_misses,
        'node_reported_misses': counted('deadline_misses_total'),
        # Ticks the node ran without publishing an action chunk (inputs stale or missing): a
        # missing tick with this count up means the camera frames did not arrive in time.
        'node_skipped_ticks': counted('skipped_total'),
        'camera_msgs_per_s': camera_rate(run.monitor['diagnostics'], t0, t1),
        **camera_arrival(run.monitor['diagnostics'], t0, t1),
        'frames_lost': frames_lost,
        'tick_interval_ms_p99': 1e3 * float(np.percentile(gaps, 99)) if gaps else math.nan,
        'tokens_per_s': sum(c['n'] for c in tokens) / window,
        'tokens_per_s_min_window': min(per_window) / TOKEN_WINDOW_S,
        'k_min': min(ks) if ks else math.nan,
        'k_max': max(ks) if ks else math.nan,
    }


def camera_rate(diagnostics: list[dict], t0: float, t1: float) -> float:
    """Frames/s of the slowest camera as the node counted them (its inputs status), or nan.

    The inputs status has one value per camera, '<state>, age <s> s, <count> msgs'.
    """
    def counts(before: float) -> dict[str, int]:
        known = [d['inputs'] for d in diagnostics if d['t'] < before and 'inputs' in d]
        found = {}
        for key, value in (known[-1] if known else {}).items():
            match = re.search(r'(\d+) msgs', value)
            if key.startswith('camera') and match:
                found[key] = int(match.group(1))
        return found

    start, end = counts(t0), counts(t1)
    rates = [(end[key] - start[key]) / (t1 - t0) for key in end if key in start]
    return min(rates) if rates else math.nan


def camera_arrival(diagnostics: list[dict], t0: float, t1: float) -> dict:
    """Return the slowest camera's frames/s that arrived whole and the largest share lost.

    From the node's inputs status at the end of the window: '..., <lost> of <sent> sent lost
    in transport' per camera over the node's loss window (publication sequence numbers and
    the middleware's lost count; runtime.inputs.TransportLoss). Needs a window at least as
    long as that one.
    """
    known = [d['inputs'] for d in diagnostics if t0 <= d['t'] < t1 and 'inputs' in d]
    found = []
    for key, value in (known[-1] if known and t1 - t0 >= LOSS_WINDOW_S else {}).items():
        match = re.search(r'(\d+) of (\d+) sent lost', value)
        if key.startswith('camera') and match and int(match.group(2)):
            lost, sent = int(match.group(1)), int(match.group(2))
            found.append(((sent - lost) / LOSS_WINDOW_S, 100 * lost / sent))
    return {'camera_arrived_hz_min': min((hz for hz, _ in found), default=math.nan),
            'camera_lost_pct_max': max((pct for _, pct in found), default=math.nan)}


def tick_records(run: NodeRun, rate_hz: float) -> list[dict]:
    """Per-tick rows for the latency plot: time from the measured window's start (s)."""
    t0, t1 = run.window
    rows, last = [], None
    for tick in run.monitor['ticks']:
        rows.append({'t_s': tick['t'] - t0, 'frame': tick['frame'],
                     'inference_ms': 1e3 * tick['inference_s'],
                     'interval_ms': math.nan if last is None else 1e3 * (tick['t'] - last),
                     'tokens': tick.get('tokens', 0), 'measured': t0 <= tick['t'] < t1})
        last = tick['t']
    return rows


def _ms_percentile(seconds: list[float], q: float) -> float:
    return 1e3 * float(np.percentile(seconds, q)) if seconds else math.nan


def node_row(opts: NodeBenchOptions, engine: EngineReference, run: NodeRun, rate_hz: float,
             rate_source: str, preset: str, device: str, dtype: str, threads: int) -> dict:
    """Return the node part's CSV row: node figures next to the engine's, and their ratios."""
    figures = analyze(run, rate_hz)
    act = np.array(engine.act_s)
    row = {'preset': preset, 'robot': opts.robot, 'device': device, 'dtype': dtype,
           'threads': threads,
           'n_tokens': opts.tokens,
           'k': 'adaptive' if opts.k is None else opts.k, 'engine_k': engine.k,
           'rtc_mode': opts.rtc_mode,
           'cameras': f'{opts.camera_width}x{opts.camera_height} {opts.camera_format} '
                      f'@{opts.camera_rate_hz:g}Hz',
           'camera_rate_hz': opts.camera_rate_hz,
           'engine_frames': len(engine.act_s),
           'engine_act_ms_p50': 1e3 * float(np.median(act)),
           'engine_act_ms_p99': 1e3 * float(np.percentile(act, 99)),
           'engine_frame_ms_p50': 1e3 * engine.frame_p50_s,
           'engine_tokens_per_frame': float(np.mean(engine.tokens)),
           'engine_loaded_frames': len(engine.loaded_act_s),
           'engine_loaded_act_ms_p50': _ms_percentile(engine.loaded_act_s, 50),
           'engine_loaded_act_ms_p99': _ms_percentile(engine.loaded_act_s, 99),
           # the share of the engine's own act() times past the asked period, next to the
           # robot process: what the machine alone makes late, before any node runs
           'engine_loaded_late_pct': (100 * float(np.mean(np.array(engine.loaded_act_s)
                                                          > 1.0 / rate_hz))
                                      if engine.loaded_act_s else math.nan),
           'rate_asked_hz': rate_hz, 'rate_source': rate_source,
           'period_ms': 1e3 / rate_hz}
    row.update(figures)
    row['rate_held_over_asked'] = figures['rate_held_hz'] / rate_hz
    row['node_over_engine_p50'] = figures['node_inference_ms_p50'] / row['engine_act_ms_p50']
    row['node_over_engine_p99'] = figures['node_inference_ms_p99'] / row['engine_act_ms_p99']
    row.update({
        'cpu_outside_control_active_pct': run.cpu_active['outside_control_pct'],
        'cpu_outside_control_idle_pct': run.cpu_idle['outside_control_pct'],
        'cpu_control_active_pct': run.cpu_active['control_pct'],
        'cpu_node_active_pct': run.cpu_active['total_pct'],
        'cpu_node_idle_pct': run.cpu_idle['total_pct'],
        'control_thread_found': run.cpu_active['control_thread_found'],
        'cpu_threads_active': _thread_split(run.cpu_active),
        'cpu_threads_idle': _thread_split(run.cpu_idle),
        'robot_cpu_pct': run.robot_cpu_pct,
        'other_load_engine_pct': engine.other_load_pct,
        'other_load_node_pct': run.other_load_pct,
        'idle_s': run.cpu_idle['wall_s'], 'warmup_s': opts.warmup_s,
    })
    return row


def _thread_split(cpu: dict) -> str:
    """'name:pct ...' of a window's CPU by thread name (cpu_between), busiest first."""
    return ' '.join(f'{name}:{pct:.1f}' for name, pct in cpu['by_name_pct'].items())


def run_node_part(opts: NodeBenchOptions, preset: str, device: str, dtype: str, seed: int,
                  log_dir: Path, say=_silent) -> tuple[dict, list[dict], EngineReference]:
    """Engine first, then the node at the asked rate; return (row, per-tick rows, engine)."""
    from oxygen_ros.runtime.engine_setup import inference_threads   # torch: lazily

    yaml = node_parameters(opts.robot)
    # The node's threads, not the benchmark process's: two torch threads on two cores next to
    # the camera process made configure's timing 40x slow (an OpenMP team losing barriers).
    threads = opts.threads or inference_threads(int(yaml.get('torch_threads') or 0))
    tokens = opts.tokens or int(yaml.get('tokens_per_request', 10))
    # The engine alone times act() (what the node's inference_time is); its language part
    # needs a fixed k: the node's, or with the adaptive budget its minimum per frame, 1.
    engine_k = opts.k or int(yaml.get('decode_budget') or 1)
    say(f'node part: timing the engine ({preset}, {opts.robot}, N={tokens}, k={engine_k}, '
        f'{opts.camera_width}x{opts.camera_height} frames)')
    log_dir.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def robot_running():
        say(f'engine again, {opts.engine_loaded_frames} frames, next to the stand-in robot '
            '(no node)')
        robot = Child('robot', robot_command(opts), child_environment(),
                      log_dir / 'robot_engine_loaded.log')
        try:
            time.sleep(ROBOT_START_S)   # its imports and first frames, as in the node run
            if not robot.alive():
                raise NodeBenchError(f'the stand-in robot exited: {robot.tail()}')
            yield
        finally:
            robot.stop()

    engine = measure_engine(preset, opts.robot, device=device, dtype=dtype, threads=threads,
                            tokens=tokens, k=engine_k, seed=seed, frames=opts.engine_frames,
                            camera_hw=(opts.camera_height, opts.camera_width),
                            loaded_frames=opts.engine_loaded_frames, load=robot_running,
                            rtc_mode=opts.rtc_mode)
    say(f'engine: act() p50 {1e3 * engine.act_p50_s:.1f} ms, frame p50 '
        f'{1e3 * engine.frame_p50_s:.1f} ms')
    given = min(max(opts.rate_hz, 0.1), 1000.0) if opts.rate_hz else None   # the param's range
    run = run_node(opts, preset, device, dtype, threads, given, seed, log_dir, say)
    if given:
        rate_hz, source = given, 'given'
    else:
        rate_hz = node_rate(run.monitor['diagnostics'])
        source = f'the node\'s ({opts.robot}.yaml: {yaml.get("control_rate_hz", 0) or "auto"})'
    say(f'node ran at {rate_hz:.3g} Hz ({source})')
    # the N the node ran (the YAML's unless given), as the row's
    row = node_row(dataclasses.replace(opts, tokens=tokens), engine, run, rate_hz, source,
                   preset, device, dtype, threads)
    return row, tick_records(run, rate_hz), engine
