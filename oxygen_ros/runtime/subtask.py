"""π0.5's hierarchical loop for one robot: a language task's newest subtask drives the actions.

A task with `drives_actions` decodes subtask text from the high-level instruction (its
template's {instruction}, on the frame's one prefill). The newest completed text becomes the
action prompt from the next frame on; the instruction stays that task's prompt. The frame
loop (runtime/frame_loop.py) asks `action_prompt` when it builds an observation and never
waits: until a subtask exists, or once the active one is older than `max_age_s` (measured
from the tick of the frame it was generated from, on the loop's clock), the instruction is
the prompt. An empty text is not adopted (the previous subtask stays).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from oxygen_ros.engine import FinishReason
from oxygen_ros.engine.types import FinishedRequest

# Frames whose tick times are kept to date a subtask by its source frame; a request living
# longer than this many frames is too old to drive anything anyway (treated as stale).
FRAMES_KEPT = 1024
INSTRUCTION, SUBTASK = 'instruction', 'subtask'   # where a tick's action prompt came from
# std_msgs/String of the subtask driving the actions ('': the instruction), latched.
SUBTASK_TOPIC = 'language/subtask'


@dataclasses.dataclass(frozen=True)
class Subtask:
    """A subtask text, and the frame it was generated from."""

    text: str
    frame_index: int      # the frame whose prefix it was decoded from
    frame_s: float        # that frame's tick time (the loop's clock; -inf: unknown, stale)
    stamp_ns: int         # that frame's observation stamp
    request_id: int

    def age_s(self, now_s: float) -> float:
        return now_s - self.frame_s


class SubtaskLoop:
    """The active subtask of one robot (task `task`), stale after `max_age_s`."""

    def __init__(self, task: str, max_age_s: float):
        if not max_age_s > 0:
            raise ValueError(f'subtask max age must be > 0 s, got {max_age_s}')
        self.task = task
        self.max_age_s = max_age_s
        self.current: Subtask | None = None     # newest completed subtask (maybe stale)
        self.driving: Subtask | None = None     # the latest tick's (None: the instruction)
        self.adopted = 0                        # subtasks that became current
        self.empty = 0                          # completed with empty text, not adopted
        self.last_now_s: float | None = None    # time of the latest tick
        self._frames: collections.OrderedDict[int, tuple[float, int]] = (
            collections.OrderedDict())

    def active(self, now_s: float) -> Subtask | None:
        """Return the subtask that drives the actions at now_s (None: the instruction)."""
        current = self.current
        if current is None or current.age_s(now_s) > self.max_age_s:
            return None
        return current

    def update(self, now_s: float) -> bool:
        """Pick what drives a tick at now_s; True when it differs from the last tick's."""
        active = self.active(now_s)
        changed = active is not self.driving
        self.driving, self.last_now_s = active, now_s
        return changed

    def action_prompt(self, instruction: str) -> str:
        """Return the action prompt of the latest tick: its subtask, else the instruction."""
        return self.driving.text if self.driving is not None else instruction

    @property
    def source(self) -> str:
        """Where the latest tick's action prompt came from (SUBTASK or INSTRUCTION)."""
        return SUBTASK if self.driving is not None else INSTRUCTION

    def record_frame(self, frame_index: int, now_s: float, stamp_ns: int) -> None:
        """Remember when frame `frame_index` was served (dates the subtasks decoded from it)."""
        self._frames[frame_index] = (now_s, stamp_ns)
        while len(self._frames) > FRAMES_KEPT:
            self._frames.popitem(last=False)

    def finished(self, requests: Iterable[FinishedRequest]) -> Subtask | None:
        """Adopt the newest completed request of the task (its text; None: nothing new).

        Newest: of the latest source frame (requests of one tick may finish out of order).
        """
        done = [r for r in requests
                if r.task == self.task and FinishReason(r.finish_reason).completed]
        texts = [r for r in done if r.text.strip()]
        self.empty += len(done) - len(texts)
        if not texts:
            return None
        newest = max(texts, key=lambda r: r.origin_frame)
        if self.current is not None and newest.origin_frame < self.current.frame_index:
            return None   # an older frame's subtask never replaces a newer one
        frame_s, stamp_ns = self._frames.get(newest.origin_frame, (float('-inf'), 0))
        self.current = Subtask(newest.text.strip(), newest.origin_frame, frame_s, stamp_ns,
                               newest.request_id)
        self.adopted += 1
        return self.current

    def status(self) -> dict:
        """Diagnostics as of the latest tick: source (and why), text, source frame, age.

        The subtask described is the one driving the actions, else the newest (stale, or
        adopted for the next frame); 'next': a newer subtask adopted for the next frame.
        """
        now_s, current = self.last_now_s, self.current
        status = {'task': self.task, 'source': self.source, 'max_age_s': self.max_age_s,
                  'adopted': self.adopted, 'empty': self.empty}
        subject = self.driving if self.driving is not None else current
        if subject is None:
            status['why'] = 'no subtask yet'
            return status
        status.update(text=subject.text, frame=subject.frame_index,
                      age_s=None if now_s is None else subject.age_s(now_s))
        if current is not subject:
            status['next'] = current.text
        if self.driving is None:
            status['why'] = ('stale' if now_s is not None and current.age_s(now_s) > self.max_age_s
                             else 'from the next frame')
        return status
