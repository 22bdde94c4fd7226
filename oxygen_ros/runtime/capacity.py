"""What control rate this machine holds, timed on a few warm-up frames at configure.

    capacity = 1 / tick,   tick = act p50 + language + question reserve

  act p50   observation to actions (frontend, prefill, denoise): the median of the timed
            frames' act().
  language  the least language work a tick always does after its action: with the budget
            giving nothing (an adaptive budget under overload), each live request takes its
            minimum of k_min steps (1 for the adaptive budget, k for a fixed one) in batched
            decode steps, plus the new request's first token and the engine's bookkeeping.
            Timed per frame as (frame time - act) at the steady batch B* = the requests live
            at once, ceil(ceil(N / k_min) / n) for one request every n frames (0 without
            language): the frames run until the first request has ended (frame
            ceil(N / k_min)), then STEADY_FRAMES more, and the median of those is taken. A
            slow model that stops timing before then has its language fitted as a + b·B over
            the frames' decode batch B (a robust line: median slope, never negative) and
            taken at B*: an extrapolation, which is why the steady frames are timed whenever
            the timing budget allows (a step of 10 rows costs what cache traffic makes it, not
            what a line through 1-5 rows says).

  extend    one extend pass over the longest prompt a request may feed (a question's
            template, a task's), timed after the frames. It seeds the adaptive budget's cost
            model of such passes (engine/budget.py), so the first question's pass is priced
            before one was ever run.
  question reserve
            with questions on (ask_tokens > 0), the time a tick keeps for one: its extend
            pass and its N - 1 one-row decode steps (both timed after the frames), spread over
            ASK_WINDOWS = 2 ticks. A question asked just after a tick's language window waits
            up to a period for the next one; two windows then answer it, within about 2.2
            frame periods by design, the rest of the third period left for what the timing
            does not see (the node's input build and tail, the action path's jitter; a
            question's steps cost more in the node than in a loop, ~5 vs ~3.5 ms on pi05-cpu,
            and it also takes one token a window in the periodic tasks' own batched step). A
            tick without a question spends the reserve like any slack: the adaptive budget
            gives the periodic tasks more tokens, and those ahead of their deadlines yield
            their steps to the next question (engine/scheduler.py). The reserve costs rate:
            ~20 ms of a ~115 ms tick on pi05-cpu here. Without it the window that narration's
            least work and AUTO_SHARE left was about one batched step a tick, and 10-token
            answers took up to nine periods; with a reserve over three windows, up to five.
            `ask_tokens: 0` gives the reserve back to the rate.

The timed frames run on a throwaway engine with the node's model, robot, language policy and
threads, on random observations of the model's image size (larger camera frames add their
resizing to act()). The first frame is not timed (torch's first calls allocate). With
`control_rate_hz: 0` (auto) the node runs at AUTO_SHARE of the capacity: the adaptive budget
spends the rest on more tokens per tick, and an overrunning tick stays rare.

What configure cannot see, the node's first ticks show: its ticks also build their inputs
(camera frames of the robot's size, resized in act()), publish chunks and tokens, and share the
machine with the robot's own processes. A RateSettler re-times an auto rate once, on the node's
ticks SETTLE_SKIP + 1 .. SETTLE_SKIP + SETTLE_TICKS: act is replaced by the median of (tick
- its language round), build and publishing included; the question reserve is priced again
with the node's own step costs (its budget's estimates: a question's one-row steps cost ~5 ms
there against ~3.5 ms in configure's loop), never below configure's; the language stays as
timed. A re-timed rate within SETTLE_CHANGE of the one in use is not applied. On pi05-cpu
here the node's act ran 80-95 ms against 80 timed at configure, and build and tail took
another ~8 ms: the reserve's window went to the action path.

A fleet (parameter `robots`) is timed the same way with every robot sending a frame each tick
(one prefill row per robot on a CPU): its capacity is the rate at which all robots can tick
together, and an auto robot runs at AUTO_SHARE of it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable

from oxygen_ros.runtime.status import OK, WARN

AUTO_SHARE = 0.9          # auto rate = this share of the capacity
ASK_WINDOWS = 2           # ticks over which a question's work is reserved (question reserve)
TIMED_FRAMES = 5          # timed warm-up frames (after one untimed), at least
STEADY_FRAMES = 3         # timed frames at the steady batch, when the budget allows
MIN_TIMED_FRAMES = 2      # a slow model stops after these once MAX_TIMING_S has passed
MAX_TIMING_S = 5.0        # timing budget of configure (a pi05 on a CPU takes seconds a frame)
MIN_RATE_HZ, MAX_RATE_HZ = 0.1, 1000.0   # control_rate_hz's range
SETTLE_SKIP = 10          # first ticks of a node left out of re-timing its auto rate
SETTLE_TICKS = 30         # ticks whose median re-times it (RateSettler)
SETTLE_CHANGE = 0.03      # a re-timed rate this close to the rate in use is not applied


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The rate this machine holds: the timed act() and the least language work per tick."""

    act_s: float            # act() p50 of the timed frames
    language_s: float       # least language work of a tick at the steady batch (seconds)
    steady_batch: int       # B*: requests live at once in the steady state
    frames: int             # timed frames behind the figures
    label: str              # what was timed, e.g. 'preset pi05-cpu'
    extend: tuple[int, float] | None = None   # (tokens, seconds) of one extend pass over the
    #                         longest prompt a request feeds (None: no task has a template)
    ask_s: float = 0.0      # question reserve: seconds a tick keeps for a question (0: none)

    @property
    def tick_s(self) -> float:
        """Seconds of a tick doing its action, its least language work and its reserve."""
        return self.act_s + self.language_s + self.ask_s

    @property
    def rate_hz(self) -> float:
        return 1.0 / max(self.tick_s, 1e-9)

    def auto_rate_hz(self) -> float:
        """Return the rate `control_rate_hz: 0` means: AUTO_SHARE of the capacity, in range."""
        return min(max(AUTO_SHARE * self.rate_hz, MIN_RATE_HZ), MAX_RATE_HZ)

    def describe(self, asked_hz: float) -> str:
        """Say 'holds about X Hz at preset P, asked Y Hz', with the tick's parts."""
        return (f'holds about {self.rate_hz:.3g} Hz at {self.label}, asked {asked_hz:.3g} Hz '
                f'(a tick: act {1e3 * self.act_s:.0f} ms + language '
                f'{1e3 * self.language_s:.0f} ms at {self.steady_batch} live requests'
                + (f' + {1e3 * self.ask_s:.0f} ms kept for a question' if self.ask_s else '')
                + f', {self.frames} frames timed at configure)')

    def note(self, asked_hz: float) -> tuple[int, str]:
        """Return (status level, message): what this machine holds next to the rate asked.

        A warning when asked_hz overruns it.
        """
        message = f'this machine {self.describe(asked_hz)}'
        if asked_hz <= self.rate_hz:
            return OK, message
        return WARN, (f'{message}: ticks will overrun (language still takes its minimum); set '
                      f'control_rate_hz 0 (auto) or at most {self.auto_rate_hz():.3g}')

    def values(self) -> dict:
        """Return the figures for diagnostics (numbers)."""
        values = {'capacity_hz': self.rate_hz, 'capacity_act_ms': 1e3 * self.act_s,
                  'capacity_language_ms': 1e3 * self.language_s}
        if self.extend is not None:
            values['capacity_extend_ms'] = 1e3 * self.extend[1]
        if self.ask_s:
            values['capacity_ask_ms'] = 1e3 * self.ask_s
        return values


def resolve_rate(asked_hz: float, capacity: Capacity | None) -> float:
    """Return the rate to run at: `asked_hz`, or for 0 (auto) the capacity's auto rate.

    Raises ValueError for auto without a capacity (nothing was timed).
    """
    if asked_hz:
        return asked_hz
    if capacity is None:
        raise ValueError('control_rate_hz 0 (auto) needs the configure-time timing, which '
                         'did not run')
    return capacity.auto_rate_hz()


def steady_batch(tokens_per_request: int, k_min: int, every_n_frames: int,
                 max_live: int | None = None) -> int:
    """B*: requests live at once, one every n frames, each ceil(N / k_min) frames long."""
    if every_n_frames <= 0:
        return 0
    live = math.ceil(math.ceil(tokens_per_request / max(k_min, 1)) / every_n_frames)
    return live if max_live is None else min(live, max_live)


def steady_frame(tokens_per_request: int, k_min: int, every_n_frames: int) -> int:
    """Return the first frame at the steady batch: frame 0's request has ended (0: none)."""
    return math.ceil(tokens_per_request / max(k_min, 1)) if every_n_frames > 0 else 0


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit y = a + b·x through (x, y) points: (a, b), median pairwise slope (>= 0), median a.

    Robust to one slow frame among a few (a CPU shared with other work), unlike least squares.
    """
    slopes = [(y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(points)
              for x1, y1 in points[i + 1:] if x1 != x0]
    b = max(statistics.median(slopes), 0.0) if slopes else 0.0
    a = statistics.median(y - b * x for x, y in points)
    return a, b


def time_ticks(tick: Callable[[int], tuple[float, float, int]], *,
               frames: int = TIMED_FRAMES, steady_from: int = 0,
               max_s: float = MAX_TIMING_S,
               clock: Callable[[], float] = time.perf_counter
               ) -> list[tuple[float, float, int]]:
    """Run tick(0) untimed, then tick(1), tick(2), ...; return their (act s, frame s, batch).

    tick(i) runs frame i and returns (act seconds, whole frame seconds, decode batch). Stops
    after `frames` timed frames and STEADY_FRAMES from frame `steady_from` on (the steady
    batch), or after MIN_TIMED_FRAMES once `max_s` has passed.
    """
    start = clock()
    tick(0)
    timed = []
    while len(timed) < max(frames, steady_from - 1 + STEADY_FRAMES):
        timed.append(tick(len(timed) + 1))
        if len(timed) >= MIN_TIMED_FRAMES and clock() - start > max_s:
            break
    return timed


def question_reserve(extend_s: float, step_s: float, ask_tokens: int,
                     windows: int = ASK_WINDOWS) -> float:
    """Return the seconds a tick keeps for a question (the module doc; 0 without questions).

    extend_s: its extend pass (which gives its first token); step_s: a one-row decode step
    (the periodic tasks, ahead of their deadlines, yield theirs: its steps run alone).
    """
    if ask_tokens <= 0:
        return 0.0
    return (extend_s + (ask_tokens - 1) * step_s) / windows


def capacity_from(timed: list[tuple[float, float, int]], batch: int, label: str,
                  extend: tuple[int, float] | None = None, steady_from: int = 0,
                  ask_s: float = 0.0) -> Capacity:
    """Return the Capacity of timed frames (time_ticks) at the steady batch `batch`.

    steady_from: the first frame at the steady batch (time_ticks); the language is the median
    over the timed frames from there on, or fitted and extrapolated when none was timed.
    ask_s: the question reserve (question_reserve).
    """
    act_s = statistics.median(act for act, _, _ in timed)
    if steady_from and len(timed) >= steady_from:   # timed[i] is frame i + 1
        language_s = statistics.median(max(frame - act, 0.0)
                                       for act, frame, _ in timed[steady_from - 1:])
    else:
        a, b = fit_line([(float(n), max(frame - act, 0.0)) for act, frame, n in timed])
        language_s = max(a + b * batch, 0.0)
    return Capacity(act_s, language_s, batch, len(timed), label, extend, ask_s)


def time_call(call: Callable[[], object], repeats: int = 3,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Time call() (one model pass): the median of `repeats` seconds.

    One untimed call first (the first call of a shape allocates).
    """
    call()
    seconds = []
    for _ in range(repeats):
        start = clock()
        call()
        seconds.append(clock() - start)
    return statistics.median(seconds)


class RateSettler:
    """Re-times an auto rate once, on the node's own first ticks (module doc)."""

    def __init__(self, capacity: Capacity, rate_hz: float):
        self.capacity = capacity          # what configure timed
        self.rate_hz = rate_hz            # the rate in use
        self.retimed: Capacity | None = None   # the node's ticks' capacity, once timed
        self.new_rate_hz: float | None = None  # the re-timed rate, when it is applied
        self._seen = 0
        self._fixed: list[float] = []     # seconds of each tick outside its language round
        self._reserve: list[float] = []   # the question reserve at the node's step costs

    @property
    def done(self) -> bool:
        return self.retimed is not None

    def observe(self, tick_s: float, language_s: float, ask_s: float = 0.0) -> float | None:
        """Count one tick with an action; return the re-timed auto rate once (else None).

        tick_s: the tick's wall time; language_s: its language round's; ask_s: the question
        reserve priced with the node's own step costs so far (its budget's; the median over
        the ticks is taken, never below configure's). None also when the re-timed rate is
        within SETTLE_CHANGE of the rate in use.
        """
        if self.done:
            return None
        self._seen += 1
        if self._seen <= SETTLE_SKIP:
            return None
        self._fixed.append(max(tick_s - language_s, 0.0))
        self._reserve.append(ask_s)
        if len(self._fixed) < SETTLE_TICKS:
            return None
        self.retimed = dataclasses.replace(
            self.capacity, act_s=statistics.median(self._fixed), frames=len(self._fixed),
            ask_s=max(self.capacity.ask_s, statistics.median(self._reserve)),
            label=f"{self.capacity.label}, the node's first ticks")
        rate = self.retimed.auto_rate_hz()
        if abs(rate - self.rate_hz) <= SETTLE_CHANGE * self.rate_hz:
            return None
        self.new_rate_hz = rate
        return rate

    def describe(self) -> str:
        """Say what the re-timing found (after it ran)."""
        retimed = self.retimed
        if retimed is None:
            return ''
        return (f'auto rate re-timed on the node\'s first ticks: {retimed.auto_rate_hz():.3g} Hz '
                f'(configure: {self.capacity.auto_rate_hz():.3g} Hz); a tick builds, acts and '
                f'publishes in {1e3 * retimed.act_s:.0f} ms (act() alone at configure: '
                f'{1e3 * self.capacity.act_s:.0f} ms)'
                + (f', {1e3 * retimed.ask_s:.0f} ms kept for a question at its steps there '
                   f'(configure: {1e3 * self.capacity.ask_s:.0f} ms)'
                   if retimed.ask_s > self.capacity.ask_s else '')
                + ('' if self.new_rate_hz else ': within 3%, the rate is kept'))
