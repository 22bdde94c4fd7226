"""Questions answered from a robot's newest frame: the `ask` service and serve's 'question'.

A question is a language request of its own task (ASK, `LanguageTask.on_demand`): the
`ask_prompt` template with the question, fed after the prefix of the newest frame when the
robot's language round takes it, with its own N (`ask_tokens`), decoded in the same batched
steps as every other task's request. Nothing waits on the control thread:

    any thread      ask(question, done)      checks the question, queues it; a refusal is
                                             returned at once (done is never called then)
    control thread  hand_over(scheduler)     before the tick's language round and between
                                             its steps: queued questions go to the scheduler
                                             (started on this tick's frame, at once or at
                                             the first step their pass fits)
                    record_frame(index, ns)  the stamp of each frame served
                    finished(requests)       done(Answer) for each question whose request
                                             ended (or was refused), at the step it ended

A question no frame took within `admit_timeout_s` is answered with the reason: no observation
(stale cameras, no instruction), or, frames served, no time beside the language of a higher
priority (admission by time, engine/scheduler.py: an `ask_priority` below another task's);
once admitted, a request always finishes by its pool deadline. close(reason) answers every
open question with `reason` (the node deactivates) and refuses new ones until open().
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable, Iterable

from oxygen_ros.engine import FinishReason
from oxygen_ros.engine.types import FinishedRequest

ASK = 'ask'                        # the language task of questions (a reserved task name)
ASK_TOPIC = 'language/ask/tokens'  # LanguageChunks of the answers' tokens
MAX_OPEN_QUESTIONS = 4             # waiting or being answered at once, per robot
ADMIT_TIMEOUT_S = 5.0              # a question no frame took by then is answered with why
FRAMES_KEPT = 1024                 # frame stamps kept to date an answer by its frame


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a question got: the answer, or why there is none."""

    ok: bool                        # False: no answer, `reason` says why
    text: str = ''                  # the answer
    reason: str = ''                # why not ('' when ok)
    frame_index: int = -1           # the frame whose prefix it was decoded from (-1: none)
    stamp_ns: int = 0               # that frame's observation stamp
    finish_reason: str = ''         # eos or length (refused, evicted, error when not ok)
    tokens: int = 0                 # generated tokens
    wait_s: float = 0.0             # asked -> answered, seconds


def refused(reason: str) -> Answer:
    """Return the answer of a question that is not asked (empty, too long, node not active)."""
    return Answer(False, reason=reason)


@dataclasses.dataclass
class _Question:
    ticket: int
    text: str
    forced: list[int]
    asked_s: float
    done: Callable[[Answer], None]
    handed: bool = False            # given to the scheduler (maybe still waiting for a frame)


class QuestionDesk:
    """One robot's open questions (see the module doc).

    template: the ask_prompt, with {question}; encode(text) -> token ids; max_tokens: the
    prompt tokens a generation block holds; max_chars: the longest question read.
    """

    def __init__(self, template: str, encode: Callable[[str], list[int]], max_tokens: int,
                 max_chars: int, *, max_open: int = MAX_OPEN_QUESTIONS,
                 admit_timeout_s: float = ADMIT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        if '{question}' not in template:
            raise ValueError(f'ask_prompt {template!r} has no {{question}} placeholder')
        self.template = template
        self.encode = encode
        self.max_tokens = max_tokens
        self.max_chars = max_chars
        self.max_open = max_open
        self.admit_timeout_s = admit_timeout_s
        self.clock = clock
        self.closed = ''                    # why questions are refused ('' = open)
        self.answered = 0                   # questions answered (ok)
        self.failed = 0                     # questions that got a reason instead
        self._lock = threading.Lock()
        self._open: dict[int, _Question] = {}      # ticket -> question, until answered
        self._withdraw: list[int] = []      # tickets the scheduler may hold, closed since
        self._tickets = itertools.count()
        self._frames: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._last_frame_s: float | None = None   # when the newest frame was served

    # ---- any thread ---------------------------------------------------------------------------

    def ask(self, question: str, done: Callable[[Answer], None]) -> Answer | None:
        """Queue `question`; None (done(Answer) follows once) or the refusal, at once."""
        if not isinstance(question, str):
            return refused(f'question: expected a string, got {type(question).__name__}')
        if len(question) > self.max_chars:
            # before tokenizing: a megabyte of text is refused without reading it
            return refused(f'question has {len(question)} characters; at most '
                           f'{self.max_chars} (max_instruction_chars)')
        text = ' '.join(''.join(c if c.isprintable() else ' ' for c in question).split())
        if not text:
            return refused('question is empty')
        forced = self.encode(self.template.replace('{question}', text))
        if len(forced) > self.max_tokens:
            return refused(f'question too long: {len(forced)} tokens with the ask_prompt '
                           f'template; at most {self.max_tokens} fit')
        with self._lock:
            if self.closed:
                return refused(self.closed)
            if len(self._open) >= self.max_open:
                return refused(f'{len(self._open)} questions are open; at most '
                               f'{self.max_open} at once, ask again once one is answered')
            ticket = next(self._tickets)
            self._open[ticket] = _Question(ticket, text, forced, self.clock(), done)
        return None

    def open(self) -> None:
        """Take questions (activation)."""
        with self._lock:
            self.closed = ''

    def close(self, reason: str) -> None:
        """Answer every open question with `reason` and refuse new ones until open()."""
        with self._lock:
            self.closed = reason
            questions, self._open = list(self._open.values()), {}
            self._withdraw += [q.ticket for q in questions if q.handed]
        for question in questions:
            self._answer(question, refused(reason))

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._open)

    # ---- the control thread -------------------------------------------------------------------

    def hand_over(self, scheduler) -> None:
        """Give new questions to the scheduler; answer refused and never admitted ones."""
        now = self.clock()
        answers = []
        with self._lock:
            for ticket in self._withdraw:
                scheduler.withdraw(ticket)
            self._withdraw = []
            for question in list(self._open.values()):
                if not question.handed:
                    why = scheduler.ask(ASK, question.forced, question.ticket)
                    question.handed = not why
                    if why:
                        answers.append((self._open.pop(question.ticket), refused(why)))
                elif (now - question.asked_s > self.admit_timeout_s
                      and scheduler.withdraw(question.ticket)):
                    answers.append((self._open.pop(question.ticket),
                                    refused(self._not_started(question))))
        for question, answer in answers:
            self._answer(question, answer)

    def _not_started(self, question: _Question) -> str:
        """Why `question` waited admit_timeout_s without starting."""
        if self._last_frame_s is not None and self._last_frame_s > question.asked_s:
            # Frames came: its first step never fitted beside higher-priority language.
            return (f'not started in {self.admit_timeout_s:g} s: the ticks had no time for it '
                    'beside the language tasks of a higher priority (raise ask_priority, or '
                    'lower the control rate)')
        return (f'no frame to answer from in {self.admit_timeout_s:g} s (the robot has no '
                'observation: see its input diagnostics)')

    def record_frame(self, frame_index: int, stamp_ns: int) -> None:
        """Remember frame `frame_index`'s stamp (dates the answers decoded from it)."""
        self._last_frame_s = self.clock()
        self._frames[frame_index] = stamp_ns
        while len(self._frames) > FRAMES_KEPT:
            self._frames.popitem(last=False)

    def finished(self, requests: Iterable[FinishedRequest]) -> None:
        """Answer the questions whose requests ended (any way) in this tick."""
        ended = [r for r in requests if r.task == ASK and r.ticket is not None]
        if not ended:
            return
        with self._lock:
            found = [(self._open.pop(r.ticket), r) for r in ended if r.ticket in self._open]
        for question, request in found:
            reason = FinishReason(request.finish_reason)
            why = '' if reason.completed else (
                f'the answer was {reason}' + (f': {request.error}' if request.error else ''))
            self._answer(question, Answer(
                reason.completed, request.text.strip(), why, request.origin_frame,
                self._frames.get(request.origin_frame, 0), str(reason), len(request.token_ids)))

    def _answer(self, question: _Question, answer: Answer) -> None:
        answer = dataclasses.replace(answer, wait_s=self.clock() - question.asked_s)
        if answer.ok:
            self.answered += 1
        else:
            self.failed += 1
        question.done(answer)


def desk_for(engine, robot: str, max_chars: int = 500) -> QuestionDesk | None:
    """Return the QuestionDesk of `robot` of a FleetEngine (None: it has no ASK task)."""
    scheduler = engine.scheduler(robot)
    task = next((t for t in scheduler.tasks if t.name == ASK and t.on_demand), None)
    if task is None:
        return None
    return QuestionDesk(task.policy.prompt_template, engine.robots[robot].frontend.encode_text,
                        scheduler.max_forced_tokens, max_chars,
                        max_open=task.policy.max_queue)
