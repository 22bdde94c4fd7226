"""Latest robot inputs (cameras, joint state, instruction) and the observation built from them.

Subscription callbacks (or a bag reader) only store the newest message with its time of
receipt; the control tick converts what it uses (so a 30 Hz camera under a 10 Hz control loop
costs one conversion per tick) and gets either an Observation or the reasons why there is none.

Staleness is judged on the node clock at receipt, not on header stamps: camera clocks are often
unsynchronised, and with use_sim_time both sides follow /clock, so bag replays stay consistent.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import unicodedata
from typing import Any, Callable, Sequence

import numpy as np

from oxygen_ros.engine.types import Observation
from oxygen_ros.runtime.conversions import InputError


# --- instruction ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Instruction:
    """A task text as the model will see it, plus what was changed to make it safe."""

    text: str                 # cleaned, at most max_chars characters ('' = no task)
    received_chars: int       # length of the raw text as received
    truncated: bool           # cut to max_chars
    invalid_chars: int        # U+FFFD (bytes that were not UTF-8) and lone surrogates removed
    control_chars: int        # control / format characters replaced by spaces

    @property
    def notes(self) -> list[str]:
        """Human-readable list of the changes made to the received text."""
        notes = []
        if self.truncated:
            notes.append(f'truncated from {self.received_chars} to {len(self.text)} characters')
        if self.invalid_chars:
            notes.append(f'{self.invalid_chars} invalid (non-UTF-8) characters removed')
        if self.control_chars:
            notes.append(f'{self.control_chars} control characters replaced by spaces')
        return notes


def sanitize_instruction(raw: str, max_chars: int) -> Instruction:
    """Make an instruction safe for the tokenizer and bounded in length.

    NFC-normalises, drops replacement characters (rclpy decodes bytes that are not UTF-8 as
    U+FFFD) and lone surrogates, turns control characters into spaces, collapses whitespace and
    truncates to `max_chars` (on a word boundary when one is near). Only the first
    4 * max_chars + 16 characters are read: the work per message is bounded whatever its size
    (a 100 MB instruction cost 26 s in the input callback when all of it was cleaned first).
    """
    received = len(raw)
    raw = raw[:4 * max_chars + 16]
    invalid = raw.count('\ufffd') + sum(1 for c in raw if '\ud800' <= c <= '\udfff')
    text = ''.join(c for c in raw if c != '\ufffd' and not '\ud800' <= c <= '\udfff')
    text = unicodedata.normalize('NFC', text)
    control = 0
    chars = []
    for c in text:
        if unicodedata.category(c) in ('Cc', 'Cf', 'Zl', 'Zp') and c not in ' ':
            control += c not in '\t\n\r'   # ordinary whitespace is not worth reporting
            chars.append(' ')
        else:
            chars.append(c)
    text = ' '.join(''.join(chars).split())
    truncated = len(text) > max_chars or received > len(raw)
    if len(text) > max_chars:
        cut = text[:max_chars]
        space = cut.rfind(' ')
        text = (cut[:space] if space >= max_chars * 0.8 else cut).rstrip()
    return Instruction(text, received, truncated, invalid, control)


# --- latest message buffer ----------------------------------------------------------------------
@dataclasses.dataclass
class Received:
    """A message with its time of receipt (node clock, seconds) and its cached conversion."""

    msg: Any
    received_s: float
    converted: Any = None        # conversion result, computed once by the consumer
    error: str | None = None     # conversion failure, computed once by the consumer
    count: int = 0               # messages received on this input so far (this one included)


class LatestBuffer:
    """Thread-safe newest message per input name; older messages are simply replaced."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, Received] = {}

    def put(self, name: str, msg: Any, received_s: float) -> None:
        with self._lock:
            old = self._latest.get(name)
            self._latest[name] = Received(msg, received_s, count=(old.count if old else 0) + 1)

    def get(self, name: str) -> Received | None:
        with self._lock:
            return self._latest.get(name)

    def clear(self) -> None:
        with self._lock:
            self._latest.clear()


def convert_once(entry: Received, convert: Callable[[Any], Any]) -> Any:
    """Return entry's converted value, converting on first use; raise InputError if bad."""
    if entry.converted is None and entry.error is None:
        try:
            entry.converted = convert(entry.msg)
        except InputError as err:
            entry.error = str(err)
    if entry.error is not None:
        raise InputError(entry.error)
    return entry.converted


# --- joint states merged per joint name -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MergedJointState:
    """Newest position of each wanted joint, from any number of JointState publishers.

    Has `name` and `position` like sensor_msgs/JointState, so the same converter reads it;
    `received_s` holds each joint's own time of receipt.
    """

    name: list[str]                 # wanted joints received so far, in wanted order
    position: list[float]
    received_s: list[float]

    def stale_names(self, now_s: float, timeout_s: float) -> list[str]:
        """Joints whose newest position is older than `timeout_s` (or from the future)."""
        return [n for n, t in zip(self.name, self.received_s) if abs(now_s - t) > timeout_s]


class JointStateMerger:
    """Merges JointState messages per joint name (arm and gripper may publish separately)."""

    def __init__(self, wanted: Sequence[str]):
        self.wanted = tuple(wanted)
        self._index = {name: i for i, name in enumerate(self.wanted)}
        self._latest: dict[str, tuple[float, float]] = {}   # joint -> (position, received_s)

    def update(self, names: Sequence[str], positions: Sequence[float],
               received_s: float) -> bool:
        """Take one message; return whether it held a wanted joint. Raise InputError if bad."""
        names = list(names)
        positions = list(positions)
        if len(positions) != len(names):
            raise InputError(f'JointState has {len(names)} names but {len(positions)} '
                             'positions')
        seen = set()
        for name, value in zip(names, positions):
            if name in self._index and name not in seen:   # a duplicate: the first one wins
                seen.add(name)
                self._latest[name] = (float(value), received_s)
        return bool(seen)

    def snapshot(self) -> MergedJointState | None:
        """Return the merged state (None before any wanted joint arrived)."""
        have = [n for n in self.wanted if n in self._latest]
        if not have:
            return None
        return MergedJointState(have, [self._latest[n][0] for n in have],
                                [self._latest[n][1] for n in have])

    def clear(self) -> None:
        self._latest.clear()


# --- messages lost in transport ------------------------------------------------------------------
LOSS_WINDOW_S = 10.0        # losses are judged over this window
LOSS_WARN_SHARE = 0.05      # warn when more than this share of the messages sent was lost
LOSS_WARN_MIN = 3           # ... and at least this many (one lost frame is not a pattern)
LATE_PERIODS = 1.5          # estimate: a newest message older than this many periods is late


@dataclasses.dataclass
class _Delivery:
    """One input's delivery records: (time, sent, lost) increments and what they came from."""

    records: collections.deque = dataclasses.field(default_factory=collections.deque)
    last_sequence: dict = dataclasses.field(default_factory=dict)   # publisher -> (seq, sent s)
    last_lost_total: int | None = None
    period_s: float | None = None        # the publisher's period, from sequence numbers
    counted: bool = False                # the middleware counts lost messages


class TransportLoss:
    """Messages of each input lost between its publishers and this subscription, per window.

    The node reads each camera at tick time from a depth-1 subscription, so messages it did not
    need are overwritten, and a gap in sequence numbers between two ticks is mostly those:
    not a loss. What is counted instead, best source first:

    1. lost_total(): the middleware's own count of messages that never arrived whole (the
       subscription's "message lost" event; rmw_fastrtps counts a raw frame whose fragments
       overran the shared-memory segment). Exact, and free: one call per tick.
    2. Without it (a middleware that does not count): an estimate from taken(), comparing
       receipt with publication: the newest message a tick takes is less than one publisher
       period old when every message arrives; older than LATE_PERIODS periods, those after it
       were lost (a lower bound). The period comes from publication sequence numbers and
       source stamps; without sequence numbers there is no estimate.

    sent: messages published in the window, from the publication sequence numbers of the
    messages taken (per publisher). Everything here runs on the tick's thread.
    """

    def __init__(self, window_s: float = LOSS_WINDOW_S):
        self.window_s = window_s
        self._inputs: dict[str, _Delivery] = {}

    def _delivery(self, key: str) -> _Delivery:
        return self._inputs.setdefault(key, _Delivery())

    def taken(self, key: str, now_s: float, age_s: float, sequence: int | None = None,
              publisher: bytes = b'', sent_s: float | None = None) -> None:
        """Record a message taken at `now_s`, received `age_s` before.

        sequence, publisher, sent_s: its publication sequence number, publisher id and
        source time (seconds), when the middleware gives them.
        """
        d = self._delivery(key)
        if sequence is None:
            return
        last = d.last_sequence.get(publisher)
        d.last_sequence[publisher] = (sequence, sent_s)
        sent = 1 if last is None or sequence <= last[0] else sequence - last[0]
        if last is not None and sent_s is not None and last[1] is not None and sent > 0:
            period = (sent_s - last[1]) / sent
            if period > 0:
                d.period_s = period if d.period_s is None else 0.8 * d.period_s + 0.2 * period
        lost = 0
        if not d.counted and d.period_s and age_s >= LATE_PERIODS * d.period_s:
            lost = int(age_s / d.period_s - 0.5)      # the periods it missed, about
        d.records.append((now_s, sent, lost))
        self._trim(d, now_s)

    def lost_total(self, key: str, now_s: float, total: int | None) -> None:
        """Record the middleware's running count of lost messages (None: it counts none)."""
        if total is None:
            return
        d = self._delivery(key)
        if not d.counted:                      # exact counts from now on: drop estimates
            d.counted = True
            d.records = collections.deque((t, sent, 0) for t, sent, _ in d.records)
        if d.last_lost_total is not None and total > d.last_lost_total:
            d.records.append((now_s, 0, total - d.last_lost_total))
        d.last_lost_total = total
        self._trim(d, now_s)

    def _trim(self, d: _Delivery, now_s: float) -> None:
        while d.records and d.records[0][0] < now_s - self.window_s:
            d.records.popleft()

    def window(self, key: str, now_s: float) -> tuple[int | None, int | None]:
        """Return (sent, lost) over the last window_s (None where not measured)."""
        d = self._inputs.get(key)
        if d is None:
            return None, None
        self._trim(d, now_s)
        sent = sum(r[1] for r in d.records) if d.last_sequence else None
        measured = d.counted or d.period_s is not None
        lost = sum(r[2] for r in d.records) if measured else None
        return sent, lost

    def clear(self) -> None:
        self._inputs.clear()


def loss_warning(label: str, sent: int | None, lost: int | None, window_s: float,
                 remedy: str) -> str:
    """Return the warning for `lost` of `sent` messages lost in `window_s` ('' when fine)."""
    if not lost or lost < LOSS_WARN_MIN or (sent and lost <= LOSS_WARN_SHARE * sent):
        return ''
    share = f'{lost} of {sent} ({lost / sent:.0%})' if sent else f'{lost}'
    return f'{label}: {share} messages lost in transport over {window_s:g} s: {remedy}'


# --- observation ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InputSource:
    """One input the observation needs: where it comes from and how to convert it."""

    key: str                        # buffer name: 'camera:<name>' or 'joint_states'
    label: str                      # for messages, e.g. "camera 'image' (/camera/image)"
    convert: Callable[[Any], Any]   # message -> numpy value (raises InputError)


@dataclasses.dataclass
class InputStatus:
    """State of one input at a tick, for diagnostics."""

    label: str
    state: str              # 'ok', 'never received', 'stale', 'bad'
    age_s: float | None     # seconds since the newest message (None: never received)
    count: int              # messages received
    detail: str = ''        # the reason when not ok
    sent: int | None = None     # messages published over the loss window (None: unknown)
    lost: int | None = None     # of those, lost in transport (None: not measured)
    warning: str = ''       # a problem that does not stop actions (e.g. messages lost)


@dataclasses.dataclass
class ObservationResult:
    """What a tick gets from its inputs: an Observation, or the reasons there is none."""

    observation: Observation | None
    problems: dict[str, str]            # key -> reason (empty when observation is not None)
    inputs: list[InputStatus]           # every camera and the joint state, in order
    stamp_ns: int | None = None         # the observation's stamp in integer ns, exact (the
    #                                     first camera's header stamp, or its receipt time when
    #                                     the camera left it at zero); None without observation


def build_observation(buffer: LatestBuffer, cameras: list[tuple[str, InputSource]],
                      joints: InputSource, instruction: Instruction | None, now_s: float,
                      stale_timeout_s: float, started_s: float,
                      instruction_topic: str = 'instruction') -> ObservationResult:
    """Assemble the observation of this tick from the newest inputs.

    cameras: (observation camera name, source) pairs. started_s: when the node began waiting
    (how long a never-seen input has been missing). The observation stamp is the header stamp
    of the first camera, or its receipt time when the camera leaves the stamp at zero.
    """
    problems: dict[str, str] = {}
    statuses: list[InputStatus] = []
    values: dict[str, Any] = {}
    stamp_ns = None
    for name, source in cameras + [(None, joints)]:
        entry = buffer.get(source.key)
        if entry is None:
            waited = max(now_s - started_s, 0.0)
            why = f'{source.label}: never received (waiting {waited:.1f} s)'
            problems[source.key] = why
            statuses.append(InputStatus(source.label, 'never received', None, 0, why))
            continue
        age = now_s - entry.received_s
        status = InputStatus(source.label, 'ok', age, entry.count)
        statuses.append(status)
        if age < -stale_timeout_s:
            # The clock jumped back (a looping bag under --clock, use_sim_time switched): a
            # message "from the future" is as unusable as an old one.
            status.state = 'stale'
            status.detail = (f'{source.label}: stale, received {-age:.2f} s after the current '
                             'time (the clock jumped back)')
            problems[source.key] = status.detail
            continue
        if age > stale_timeout_s:
            status.state = 'stale'
            status.detail = (f'{source.label}: stale, last message {age:.2f} s ago '
                             f'(stale_frame_timeout_s {stale_timeout_s:g})')
            if isinstance(entry.msg, MergedJointState):
                status.detail = (f'{source.label}: stale joints '
                                 f'{entry.msg.stale_names(now_s, stale_timeout_s)}, oldest '
                                 f'received {age:.2f} s ago (stale_frame_timeout_s '
                                 f'{stale_timeout_s:g})')
            problems[source.key] = status.detail
            continue
        try:
            values[source.key] = convert_once(entry, source.convert)
        except InputError as err:
            status.state = 'bad'
            status.detail = f'{source.label}: {err}'
            problems[source.key] = status.detail
            continue
        if name is not None and stamp_ns is None:
            header = getattr(entry.msg, 'header', None)
            stamp_ns = (header.stamp.sec * 1_000_000_000 + header.stamp.nanosec) if header else 0
            if stamp_ns <= 0:
                stamp_ns = round(entry.received_s * 1e9)
    if instruction is None:
        problems['instruction'] = (f'instruction: none received yet on {instruction_topic} '
                                   '(std_msgs/String, reliable; transient local or volatile)')
    elif not instruction.text:
        problems['instruction'] = 'instruction: empty, so there is no task (no actions)'
    if problems:
        return ObservationResult(None, problems, statuses)
    images = {name: values[source.key] for name, source in cameras}
    state = np.asarray(values[joints.key], dtype=np.float64)   # [state_dim] robot units
    obs = Observation(images=images, state=state, instruction=instruction.text,
                      stamp=stamp_ns * 1e-9)
    return ObservationResult(obs, {}, statuses, stamp_ns)


class InputSet:
    """The inputs one robot's observations are built from: newest messages and the instruction.

    Writers (subscription callbacks, a bag reader) call `put` / `set_instruction`; the frame
    loop calls `build(now_s)`. cameras: (observation camera name, source) pairs. pull(now_s),
    when set, is called by `build` first: a source read on demand (the node takes its polled
    subscriptions there, on the control thread) puts its newest messages then.

    joint_names: when given, JointState messages (anything with `name` and `position`) put on
    the joints key are merged per joint name, each joint with its own time of receipt: the
    buffer then holds a MergedJointState whose receipt time is its oldest joint's, so one
    joint that stops makes the state stale while partial publishers (arm, gripper) combine.
    """

    def __init__(self, cameras: list[tuple[str, InputSource]], joints: InputSource,
                 stale_timeout_s: float, instruction_topic: str = 'instruction',
                 joint_names: Sequence[str] | None = None):
        self.buffer = LatestBuffer()
        self.merger = JointStateMerger(joint_names) if joint_names is not None else None
        self.cameras = cameras
        self.joints = joints
        self.stale_timeout_s = stale_timeout_s
        self.instruction_topic = instruction_topic
        self.instruction: Instruction | None = None
        self.started_s = 0.0          # when waiting began (how long a missing input is missing)
        self.pull: Callable[[float], None] | None = None
        self.loss = TransportLoss()   # fed by whoever takes the messages (the node's poller)
        self.loss_remedy = 'check the link and the publisher'   # what a loss warning advises

    def put(self, key: str, msg: Any, received_s: float) -> None:
        if key == self.joints.key and self.merger is not None:
            try:
                changed = self.merger.update(msg.name, msg.position, received_s)
            except InputError:
                self.buffer.put(key, msg, received_s)   # the converter reports why
                return
            merged = self.merger.snapshot()
            if changed or self.buffer.get(key) is None:
                # Without a wanted joint yet, the message shows what is missing.
                self.buffer.put(key, merged or msg,
                                min(merged.received_s) if merged else received_s)
            return
        self.buffer.put(key, msg, received_s)

    def set_instruction(self, instruction: Instruction) -> None:
        self.instruction = instruction

    def build(self, now_s: float) -> ObservationResult:
        """Build the observation of a tick at `now_s`, or the reasons there is none."""
        if self.pull is not None:
            self.pull(now_s)
        result = build_observation(self.buffer, self.cameras, self.joints, self.instruction,
                                   now_s, self.stale_timeout_s, self.started_s,
                                   self.instruction_topic)
        for (_, source), status in zip(self.cameras, result.inputs):
            status.sent, status.lost = self.loss.window(source.key, now_s)
            status.warning = loss_warning(status.label, status.sent, status.lost,
                                          self.loss.window_s, self.loss_remedy)
        return result

    def clear(self) -> None:
        """Forget every message and the instruction (cleanup)."""
        self.buffer.clear()
        if self.merger is not None:
            self.merger.clear()
        self.loss.clear()
        self.instruction = None
