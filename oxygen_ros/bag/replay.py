"""Replay a recording through the engine: bag in, bag out with the node's output topics.

Time axis: ticks at control_rate_hz from the bag's first message to its last, in bag log time
(the time of receipt, the clock `ros2 bag play` publishes). Each tick is the node's own tick
(oxygen_ros.runtime.frame_loop.FrameLoop: latest message per input, staleness judged on time
of receipt, first camera's header stamp, act, emit, language, emit) over the messages with log
time <= tick; a tick the node would skip (input missing or stale, no instruction) is skipped
and counted. Outputs are written at the tick's time, so a replayed bag lines up with its
inputs.

Determinism: flow-matching noise and language arrivals depend only on (seed, frame index) and
decoding is greedy, so the same bag, parameters and seed give the same actions and tokens,
whatever the pacing (`rate`), except with an adaptive decode budget (it reads the wall clock:
actions stay identical, the tokens' split over frames may not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from pathlib import Path
import time
from typing import Callable

from oxygen_ros.bag import messages
from oxygen_ros.bag.config import ReplayParams
from oxygen_ros.bag.errors import BagError
from oxygen_ros.bag.reader import InputBag, TopicSpec
from oxygen_ros.bag.typestore import (ACTION_CHUNK, COMPRESSED_IMAGE, DIAGNOSTIC_ARRAY, IMAGE,
                                      JOINT_STATE, LANGUAGE_CHUNK, make_typestore, STRING)
from oxygen_ros.bag.writer import OutputBag
from oxygen_ros.engine.types import FrameResult, Observation
from oxygen_ros.runtime import conversions, inputs, status
from oxygen_ros.runtime.actions import action_layout
from oxygen_ros.runtime.engine_setup import build_engine as build_node_engine
from oxygen_ros.runtime.params import NARRATION
from oxygen_ros.runtime.frame_loop import FrameLoop
from oxygen_ros.runtime.rtc import planner_for
from oxygen_ros.runtime.subtask import SUBTASK_TOPIC

logger = logging.getLogger(__name__)

CAMERA_TYPES = (IMAGE, COMPRESSED_IMAGE)
COPY_MODES = ('inputs', 'all', 'none')
DEFAULT_MAX_TICKS = 5_000_000            # ~5.8 days at 10 Hz; idle gaps do not count
MAX_SKIP_REASONS = 20                    # distinct skip reasons kept in the summary
MAX_DRAIN_TICKS = 100_000                # after the last frame; a request ends far sooner
DIAGNOSTICS_TOPIC = '/diagnostics'


def parse_rate(rate: str | float | None) -> float | None:
    """'max' -> None (no pacing); 'recorded' -> 1.0; a number -> that multiple of real time."""
    if rate in ('max', None):
        return None
    if rate == 'recorded':
        return 1.0
    try:
        factor = float(rate)
    except (TypeError, ValueError):
        factor = float('nan')
    if not factor > 0 or math.isinf(factor):
        raise BagError(f"rate {rate!r}; expected 'recorded', 'max' or a speed factor > 0")
    return factor


class ObservationBuilder:
    """The node's latest-message buffer and observation assembly, fed from a bag.

    decode(raw, conn) deserializes one message (InputBag.deserialize).
    """

    def __init__(self, params: ReplayParams, decode: Callable, start_ns: int):
        self.params = params
        self.decode = decode
        self.started_s = start_ns * 1e-9
        settings = params.settings
        self.first_size: dict[str, tuple[int, int]] = {}      # camera -> (H, W) of 1st frame
        self.keys: dict[str, str] = {}                        # topic -> buffer key
        self.topics: dict[str, str] = {}                      # buffer key -> topic
        self.cameras = []                                     # (name, InputSource)
        for name, topic, _ in params.cameras():
            key = f'camera:{name}'
            self.keys[topic] = key
            self.cameras.append((name, inputs.InputSource(
                key, f'camera {name!r} ({topic})', self._image_converter(name))))
        joints_topic = params.resolve(params.joint_states_topic)
        self.keys[joints_topic] = 'joint_states'
        self.topics = {key: topic for topic, key in self.keys.items()}
        names = list(settings.joint_names)
        self.joints = inputs.InputSource(
            'joint_states', f'joint states ({joints_topic})',
            lambda msg: conversions.joint_state_to_vector(msg.name, msg.position, names))
        self.instruction_topic = params.resolve(params.instruction_topic)
        self.inputs = inputs.InputSet(self.cameras, self.joints, settings.stale_frame_timeout_s,
                                      self.instruction_topic, joint_names=names)
        self.inputs.started_s = self.started_s
        if params.instruction_override:
            self.inputs.set_instruction(inputs.sanitize_instruction(
                params.instruction_override, settings.max_instruction_chars))

    def _image_converter(self, camera: str):
        def convert(msg):
            if hasattr(msg, 'format'):    # sensor_msgs/CompressedImage
                image = conversions.compressed_to_rgb(msg.format, msg.data)
            else:
                image = conversions.image_to_rgb(msg.encoding, msg.height, msg.width, msg.step,
                                                 msg.data, msg.is_bigendian)
            size = image.shape[:2]
            first = self.first_size.setdefault(camera, size)
            if size != first:
                raise conversions.InputError(
                    f'image size {size[1]}x{size[0]} (WxH); expected {first[1]}x{first[0]} '
                    'like the first frame of this camera')
            return image
        return convert

    def update(self, conn, time_ns: int, raw: bytes) -> None:
        """Take a message of an input topic (raises BagError when it cannot be decoded)."""
        msg = self.decode(raw, conn)
        if conn.topic == self.instruction_topic:
            if not self.params.instruction_override:
                instruction = inputs.sanitize_instruction(
                    str(msg.data), self.params.settings.max_instruction_chars)
                self.inputs.set_instruction(instruction)
                if instruction.notes:
                    logger.warning('%s: instruction %s', conn.topic,
                                   ', '.join(instruction.notes))
            return
        self.inputs.put(self.keys[conn.topic], msg, time_ns * 1e-9)


@dataclasses.dataclass
class ReplaySummary:
    """What a replay did; `status` is 'running', 'complete', 'interrupted' or 'error'."""

    bag: str
    out: str
    status: str = 'running'
    error: str = ''
    ticks: int = 0                       # ticks run (frames + skipped)
    frames: int = 0                      # engine frames (one action chunk each)
    skipped_ticks: int = 0               # ticks without an observation (as the node skips)
    idle_ticks: int = 0                  # ticks jumped over in idle gaps (nothing to do)
    drain_ticks: int = 0                 # ticks after the last frame finishing its requests
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)   # reason -> ticks
    actions: int = 0
    tokens: int = 0
    token_messages: int = 0
    narrations: int = 0
    subtasks: int = 0                    # changes of the subtask driving the actions
    finished: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> requests
    diagnostics: int = 0
    input_messages: int = 0              # messages read from the bag
    copied_messages: int = 0             # of them, copied to the output
    bad_messages: int = 0                # skipped as undecodable (on_bad_input='skip')
    bag_time_s: float = 0.0              # bag time covered by the ticks run
    wall_s: float = 0.0
    deterministic: bool = True

    @property
    def speed(self) -> float:
        """Bag time per wall time (2.0 = twice as fast as real time)."""
        return self.bag_time_s / self.wall_s if self.wall_s > 0 else float('inf')

    def format(self) -> str:
        reasons = '; '.join(f'{n}x {why}' for why, n in sorted(self.skipped.items()))
        finished = ', '.join(f'{r} {n}' for r, n in sorted(self.finished.items()))
        lines = [
            f'replay {self.status}: {self.bag} -> {self.out}',
            f'  frames {self.frames} of {self.ticks} ticks'
            + (f' ({self.skipped_ticks} skipped: {reasons})' if self.skipped_ticks else '')
            + (f'; {self.idle_ticks} idle ticks jumped over' if self.idle_ticks else '')
            + (f'; then {self.drain_ticks} ticks finishing the last requests'
               if self.drain_ticks else ''),
            f'  action chunks {self.actions}; tokens {self.tokens} in {self.token_messages} '
            f'messages; narrations {self.narrations}'
            + (f'; subtask changes {self.subtasks}' if self.subtasks else '')
            + (f' (finished: {finished})' if finished else '')
            + f'; diagnostics {self.diagnostics}',
            f'  input messages {self.input_messages} ({self.copied_messages} copied'
            + (f', {self.bad_messages} undecodable skipped' if self.bad_messages else '') + ')',
            f'  bag time {self.bag_time_s:.2f} s in {self.wall_s:.2f} s wall: '
            f'{self.speed:.2f}x real time',
        ]
        if self.error:
            lines.append(f'  error: {self.error}')
        return '\n'.join(lines)


class _Diagnostics:
    """The node's /diagnostics statuses, computed on the bag's clock."""

    def __init__(self, params: ReplayParams, node_name: str, description: dict):
        self.params = params
        self.node_name = node_name
        self.now_s = 0.0
        self.stats = status.LoopStats(clock=lambda: self.now_s)
        self.next_ns: int | None = None
        self.model = {'mode': f'replay of {params.settings.robot} bag', **description}

    def due(self, tick_ns: int) -> bool:
        period_ns = int(self.params.diagnostics_period_s * 1e9)
        if self.next_ns is None:
            self.next_ns = tick_ns + period_ns
        if tick_ns < self.next_ns:
            return False
        self.next_ns = tick_ns + period_ns
        return True

    def statuses(self, loop: FrameLoop) -> list:
        robot = loop.only
        built = robot.last_inputs
        # As the node names them: unique per namespace, the compute device as hardware_id.
        return status.build_statuses(
            self.params.resolve(self.node_name).lstrip('/'), 'active', self.model,
            self.stats.snapshot(),
            self.params.settings.control_rate_hz, loop.engine_summary(robot.name), built.inputs,
            built.problems, robot.inputs.instruction)


class _BagOutputs:
    """The frame loop's OutputSink for a replay: the node's output topics, at the tick time."""

    def __init__(self, replay: Replay, out: OutputBag):
        self.replay = replay
        self.out = out
        self.tick_ns = 0

    def action(self, action, stamp_ns: int) -> None:
        p, summary = self.replay.params, self.replay.summary
        self.out.write(p.resolve('actions'), ACTION_CHUNK, self.tick_ns, messages.action_chunk(
            self.replay.store, action, stamp_ns, p.settings.frame_id,
            action_layout(p.settings.spec or p.settings.robot)))
        summary.frames += 1
        summary.actions += 1

    def tokens(self, delta, stamp_ns: int) -> None:
        p, summary = self.replay.params, self.replay.summary
        task = p.settings.task(delta.task)
        topic = task.token_topic if task is not None else 'language/tokens'
        self.out.write(p.resolve(topic), LANGUAGE_CHUNK, self.tick_ns,
                       messages.language_chunk(self.replay.store, delta, stamp_ns,
                                               p.settings.frame_id))
        summary.token_messages += 1
        summary.tokens += len(delta.token_ids)

    def narration(self, request, stamp_ns: int) -> None:
        if request.task != NARRATION:   # the other tasks' texts are in their LanguageChunks
            return
        self.out.write(self.replay.params.resolve('language/narration'), STRING, self.tick_ns,
                       messages.narration(self.replay.store, request))
        self.replay.summary.narrations += 1

    def subtask(self, subtask, stamp_ns: int) -> None:
        """Record the subtask that drives the actions ('': the instruction) on its topic."""
        self.out.write(self.replay.params.resolve(SUBTASK_TOPIC), STRING, self.tick_ns,
                       messages.text(self.replay.store, subtask.text if subtask else ''))
        self.replay.summary.subtasks += 1


class StopOnRequest:
    """A replay that a signal handler can stop: request_stop(), checked before every tick."""

    stop_requested = False               # set by request_stop() (e.g. a SIGINT handler)

    def request_stop(self) -> None:
        """Stop before the next tick, as Ctrl-C does (safe to call from a signal handler)."""
        self.stop_requested = True

    def _check_stop(self) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt('replay stopped on request')


def check_new_output(out: str | Path, overwrite: bool) -> None:
    """Refuse an existing output path unless `overwrite` (said before any model loads)."""
    if Path(out).exists() and not overwrite:
        raise BagError(f'output {out} exists; expected a new path (or --overwrite)')


class Replay(StopOnRequest):
    """One replay of `bag` into `out`; run() returns (and `summary` holds) a ReplaySummary.

    system: an engine with step(obs) -> FrameResult (default: built from the parameters).
    rate: 'max' (as fast as possible), 'recorded' (real time) or a speed factor.
    copy: input topics written to the output: the ones read ('inputs'), 'all' or 'none'.
    on_frame(obs, result): called after every engine call (tests, live views); obs is None
    on a tick without an observation that only advanced live language requests.
    The output bag is closed properly however the replay ends (error, Ctrl-C); its metadata
    (custom_data) records the status. rtc_trace: keep the chunks sent (`rtc.trace`, for
    bag.rtc_compare); real-time chunking itself follows the parameters' rtc_*.
    """

    def __init__(self, bag: str | Path, out: str | Path, params: ReplayParams, *,
                 system=None, rate: str | float | None = 'max', storage: str = 'mcap',
                 overwrite: bool = False, copy: str = 'inputs', progress: bool = False,
                 on_frame: Callable[[Observation, FrameResult], None] | None = None,
                 node_name: str = 'oxygen_node', max_ticks: int = DEFAULT_MAX_TICKS,
                 rtc_trace: bool = False):
        if copy not in COPY_MODES:
            raise BagError(f'copy {copy!r}; expected one of {COPY_MODES}')
        self.bag_path = Path(bag)
        self.out_path = Path(out)
        bag_abs, out_abs = self.bag_path.resolve(), self.out_path.resolve()
        if out_abs == bag_abs or out_abs in bag_abs.parents or bag_abs in out_abs.parents:
            raise BagError(f'output {out} is, holds or is inside the input bag {bag}; expected '
                           'a path apart from it')
        check_new_output(out, overwrite)
        self.params = params
        self.system = system
        self.speed = parse_rate(rate)
        self.storage = storage
        self.overwrite = overwrite
        self.copy = copy
        self.progress = progress
        self.on_frame = on_frame
        self.node_name = node_name
        self.max_ticks = max_ticks
        self.store = make_typestore()
        self.summary = ReplaySummary(str(bag), str(out))
        self.description: dict = {}          # what the node reports about its engine
        # Real-time chunking on the replay's clock: the chunks sent and their stamps.
        self.rtc = planner_for(params.settings, trace=rtc_trace)

    def topic_specs(self) -> list[TopicSpec]:
        """Return the input topics with the types they must have."""
        p = self.params
        specs = [TopicSpec(topic, CAMERA_TYPES, f'camera {name!r}')
                 for name, topic, _ in p.cameras()]
        specs.append(TopicSpec(p.resolve(p.joint_states_topic), (JOINT_STATE,), 'joint states'))
        specs.append(TopicSpec(p.resolve(p.instruction_topic), (STRING,), 'instruction',
                               required=not p.instruction_override))
        return specs

    def run(self) -> ReplaySummary:
        summary, p = self.summary, self.params
        with InputBag(self.bag_path, self.store) as bag:
            input_conns = [c for spec in self.topic_specs() for c in bag.connections(spec)]
            read = input_conns if self.copy != 'all' else list(bag.reader.connections)
            if self.system is None:
                self.system, self.description, settings = build_engine(p.settings)
                # control_rate_hz 0 (auto): the tick grid of the rate this machine holds
                self.params = p = dataclasses.replace(p, settings=settings)
            elif not p.settings.control_rate_hz:
                raise BagError('control_rate_hz 0 (auto) needs the engine built here (it '
                               'times the machine); give a rate with a prebuilt system')
            summary.deterministic = p.settings.decode_budget is not None
            start_ns = bag.start_ns
            n_ticks = int((bag.end_ns - start_ns) // p.period_ns) + 1
            builder = ObservationBuilder(p, bag.deserialize, start_ns)
            out = OutputBag(self.out_path, self.store, self.storage, self.overwrite)
            progress = _progress_bar(n_ticks, self.progress)
            try:
                with recorded_run(out, summary, str(self.bag_path), p.settings):
                    try:
                        self._loop(bag, out, builder, input_conns, read, start_ns, n_ticks,
                                   progress, time.perf_counter())
                    finally:
                        out.set_custom_data('oxygen_ros.replay.frames', summary.frames)
            finally:
                progress.close()
        return summary

    def _loop(self, bag: InputBag, out: OutputBag, builder: ObservationBuilder,
              input_conns: list, read: list, start_ns: int, n_ticks: int, progress,
              wall_start: float) -> None:
        p, summary = self.params, self.summary
        inputs_ids = {c.id for c in input_conns}
        definitions: dict[int, tuple[str, str]] = {}
        diag = _Diagnostics(p, self.node_name, self.description)
        sink = _BagOutputs(self, out)
        loop = FrameLoop.one(self.system, builder.inputs, sink, p.settings.period_s,
                             stats=diag.stats, rtc=self.rtc)
        tick = 0
        last_input_ns = start_ns
        stale_ns = round(p.settings.stale_frame_timeout_s * 1e9)

        def run_ticks_before(limit_ns: float) -> None:
            nonlocal tick
            while tick < n_ticks:
                tick_ns = start_ns + round(tick * p.period_ns)
                if tick_ns >= limit_ns:
                    return
                if tick_ns > last_input_ns + stale_ns and not self.system.num_live_requests:
                    # An idle gap (every input stale, no request running): the node would
                    # tick without doing anything until the next message. Jump to it.
                    resume = min(n_ticks, math.ceil((limit_ns - start_ns) / p.period_ns))
                    if resume > tick:
                        summary.idle_ticks += resume - tick
                        progress.update(resume - tick)
                        tick = resume
                        continue
                if summary.ticks >= self.max_ticks:
                    raise BagError(f'replay stopped after {self.max_ticks} ticks (the cap): the '
                                   f'bag spans up to {n_ticks - summary.idle_ticks} ticks at '
                                   f'{p.settings.control_rate_hz:g} Hz; raise max_ticks or '
                                   'replay a shorter bag')
                self._pace(tick_ns - start_ns, wall_start)
                self._check_stop()
                self._tick(tick_ns, builder, loop, sink, out, diag)
                tick += 1
                summary.ticks += 1
                summary.bag_time_s = (tick_ns - start_ns) * 1e-9
                progress.update(1)
                if summary.ticks % 10 == 0:
                    progress.set_postfix(frames=summary.frames, tokens=summary.tokens,
                                         refresh=False)

        for conn, time_ns, raw in bag.messages(read):
            self._check_stop()
            run_ticks_before(time_ns)
            summary.input_messages += 1
            if conn.id in inputs_ids:
                last_input_ns = time_ns
                try:
                    builder.update(conn, time_ns, raw)
                except BagError as err:
                    if p.on_bad_input == 'error':
                        raise
                    summary.bad_messages += 1
                    logger.warning('%s (message skipped)', err)
            if self.copy != 'none':
                if conn.id not in definitions:
                    definitions[conn.id] = bag.definition(conn)
                msgdef, digest = definitions[conn.id]
                qos = getattr(conn.ext, 'offered_qos_profiles', ())
                out.write_raw(conn.topic, conn.msgtype, time_ns, raw, msgdef, digest, qos)
                summary.copied_messages += 1
        run_ticks_before(math.inf)
        # The last frames' language requests run to their end, every task's (nothing lost),
        # on ticks without a frame after the bag's end.
        while self.system.num_live_requests:
            if summary.drain_ticks >= MAX_DRAIN_TICKS:
                raise BagError(f'language requests still running {MAX_DRAIN_TICKS} ticks '
                               'after the bag ended')
            tick_ns = start_ns + round((n_ticks + summary.drain_ticks) * p.period_ns)
            self._tick(tick_ns, builder, loop, sink, out, diag, frames=False)
            summary.drain_ticks += 1

    def _pace(self, bag_offset_ns: int, wall_start: float) -> None:
        """Sleep until the wall clock reaches the tick's bag time (scaled by the speed)."""
        if self.speed is None:
            return
        delay = wall_start + bag_offset_ns * 1e-9 / self.speed - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def _tick(self, tick_ns: int, builder: ObservationBuilder, loop: FrameLoop,
              sink: _BagOutputs, out: OutputBag, diag: _Diagnostics, frames: bool = True
              ) -> None:
        """One control tick: the node's frame loop, outputs written at the tick's time.

        frames=False: no observation, only live language requests advance (the drain).
        """
        p, summary = self.params, self.summary

        def check_inputs(built: inputs.ObservationResult) -> None:
            bad = {s.detail for s in built.inputs if s.state == 'bad'}
            if bad and p.on_bad_input == 'error':
                key, why = next((k, w) for k, w in built.problems.items() if w in bad)
                raise BagError(f'{why} (at bag time {tick_ns * 1e-9:.3f} s)',
                               builder.topics.get(key, ''))

        diag.now_s = tick_ns * 1e-9
        sink.tick_ns = tick_ns
        (outcome,) = loop.tick(tick_ns * 1e-9, serve_all=True, check_inputs=check_inputs,
                               frames=frames).values()
        if outcome.error:   # not the input's fault: the replay stops, as the engine failed
            raise BagError(f'engine error at bag time {tick_ns * 1e-9:.3f} s: {outcome.error}')
        if outcome.rejected and p.on_bad_input == 'error':
            raise BagError(f'observation at bag time {tick_ns * 1e-9:.3f} s rejected by the '
                           f'engine: {outcome.rejected.removeprefix("observation rejected: ")}')
        if outcome.action is None and frames:
            summary.skipped_ticks += 1
            for why in outcome.problems.values():
                why = _reason_kind(why)
                if why not in summary.skipped and len(summary.skipped) >= MAX_SKIP_REASONS:
                    why = 'other reasons'   # distinct texts from a bad sender stay bounded
                summary.skipped[why] = summary.skipped.get(why, 0) + 1
        if outcome.result is not None:
            for finished in outcome.result.finished:
                reason = finished.finish_reason
                summary.finished[reason] = summary.finished.get(reason, 0) + 1
            if self.on_frame is not None:
                obs = outcome.inputs.observation if outcome.action is not None else None
                self.on_frame(obs, outcome.result)
        if diag.due(tick_ns):
            out.write(DIAGNOSTICS_TOPIC, DIAGNOSTIC_ARRAY, tick_ns,
                      messages.diagnostic_array(self.store, tick_ns, diag.statuses(loop),
                                                self.params.settings.device))
            summary.diagnostics += 1


def _reason_kind(why: str) -> str:
    """Strip the changing numbers ('waiting 1.3 s', 'last message 0.7 s ago') off a reason."""
    for marker in (' (waiting ', ', last message '):
        why = why.split(marker)[0]
    return why


@contextlib.contextmanager
def recorded_run(out: OutputBag, summary: ReplaySummary, source: str, settings):
    """Open `out` and record a replay's run in its metadata, however the run ends.

    Yields the open bag. Writes the source and settings first; on leaving, the summary's
    status ('complete', 'interrupted' on Ctrl-C, 'error' with its message) and wall time go
    into the summary and the bag's custom_data, and the bag is closed (nothing written is lost).
    """
    out.open()
    wall_start = time.perf_counter()
    try:
        out.set_custom_data('oxygen_ros.replay.source', source)
        out.set_custom_data('oxygen_ros.replay.settings', repr(settings))
        yield out
        summary.status = 'complete'
    except KeyboardInterrupt:
        summary.status = 'interrupted'
        raise
    except BaseException as err:
        summary.status = 'error'
        summary.error = str(err) or type(err).__name__
        raise
    finally:
        summary.wall_s = time.perf_counter() - wall_start
        out.set_custom_data('oxygen_ros.replay.status', summary.status)
        if summary.error:
            out.set_custom_data('oxygen_ros.replay.error', summary.error)
        out.close()


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit='tick', disable=not enabled, dynamic_ncols=True,
                desc='replay')


def build_engine(settings) -> tuple[object, dict, object]:
    """Build exactly the engine the node builds from these settings.

    Returns (system, description, settings with the control rate resolved: auto is timed).
    """
    from oxygen_ros.runtime.engine_setup import SETUP_ERRORS

    try:
        engine = build_node_engine(settings, warmup=False)
    except SETUP_ERRORS as err:
        raise BagError(f'engine: {err}') from None
    return engine.system, dict(engine.description), engine.settings


def run_replay(bag: str | Path, out: str | Path, params: ReplayParams, **kwargs
               ) -> ReplaySummary:
    """Replay `bag` into `out` (see Replay); return the summary."""
    return Replay(bag, out, params, **kwargs).run()
