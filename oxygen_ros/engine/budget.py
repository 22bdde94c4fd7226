"""Decode budget k: how many tokens each live language request may advance in one frame.

One budget unit = one token step of every live request: a batched decode_step, or (for a
request's very first token) the LM head on the prefix's last hidden state. The scheduler asks
`choose()` once per frame, after the action path, and reports every step it runs back through
`observe_decode()` so adaptive budgets learn the cost of a step per batch size.

What a budget gives is what the frame's slack allows; it may be 0. Progress does not depend on
it: the scheduler gives every admitted request at least the steps its pool deadline needs
(scheduler.py), and plans those deadlines with `k_min`, the fewest steps per frame the budget
stands for (the pool is sized ceil(N / k_min) + 1 with it).
"""

from __future__ import annotations

import bisect
import math
import sys
from typing import Protocol


class Budget(Protocol):
    """What the scheduler asks of a decode budget (FixedBudget, AdaptiveBudget, Unlimited)."""

    unlimited: bool        # True: every request decodes to completion in its first frame
    k_min: int             # steps per request per frame that admission plans deadlines with

    def choose(self, elapsed_s: float, batch_size: int, deadline_s: float | None = None) -> int:
        """Return k for this frame (elapsed_s: frame time so far; batch_size: live requests).

        deadline_s: when the frame's language must end, seconds after it began (a fleet's
        next robot tick; None: the budget's own period).
        """

    def allow_more(self, elapsed_s: float, batch_size: int,
                   deadline_s: float | None = None) -> bool:
        """Whether another step at `batch_size` rows still fits in this frame."""

    def time_left(self, elapsed_s: float, deadline_s: float | None = None) -> float:
        """Seconds from elapsed_s to the frame's deadline (math.inf: not bound by time)."""

    def observe_action(self, seconds: float) -> None:
        """Record the action path time of a frame."""

    def observe_tail(self, seconds: float) -> None:
        """Record a tick's time after its last language step (detokenising, publishing)."""

    def observe_decode(self, batch_size: int, seconds: float) -> None:
        """Record the time of one token step over `batch_size` rows."""

    def observe_extend(self, tokens: int, seconds: float) -> None:
        """Record the time of one extend pass over `tokens` padded query tokens."""

    def extend_estimate(self, tokens: int) -> float:
        """Seconds an extend pass over `tokens` padded query tokens is expected to take."""

    def observe_first(self, rows: int, seconds: float) -> None:
        """Record the time of one first-token call (the LM head over `rows` prefixes)."""

    def first_estimate(self, rows: int) -> float:
        """Seconds a first-token call over `rows` prefixes is expected to take (0: unknown)."""

    def step_estimate(self, batch_size: int) -> float:
        """Seconds a token step over `batch_size` rows is expected to take (0: not priced)."""


TAIL_GUARD = 0.02   # share of the period kept beyond a tick's measured tail (AdaptiveBudget)


def sizing_k(budget: Budget) -> int | None:
    """Return the k a pool is sized for under `budget`: its k_min (None: no batching)."""
    return None if budget.unlimited else budget.k_min


class UnlimitedBudget:
    """No cross-frame batching: each request runs to completion in the frame it starts."""

    unlimited = True
    k_max = k_min = sys.maxsize

    def choose(self, elapsed_s: float, batch_size: int, deadline_s: float | None = None) -> int:
        return sys.maxsize

    def allow_more(self, elapsed_s: float, batch_size: int,
                   deadline_s: float | None = None) -> bool:
        return True

    def time_left(self, elapsed_s: float, deadline_s: float | None = None) -> float:
        return math.inf

    def observe_action(self, seconds: float) -> None:
        """Unused: nothing to plan."""

    def observe_tail(self, seconds: float) -> None:
        """Unused: nothing to plan."""

    def observe_decode(self, batch_size: int, seconds: float) -> None:
        """Unused: nothing to plan."""

    def observe_extend(self, tokens: int, seconds: float) -> None:
        """Unused: nothing to plan."""

    def extend_estimate(self, tokens: int) -> float:
        return 0.0

    def observe_first(self, rows: int, seconds: float) -> None:
        """Unused: nothing to plan."""

    def first_estimate(self, rows: int) -> float:
        return 0.0

    def step_estimate(self, batch_size: int) -> float:
        return 0.0

    def __str__(self) -> str:
        return 'UnlimitedBudget()'


class FixedBudget:
    """The paper's setting: exactly k token steps per request per frame."""

    unlimited = False

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f'k must be >= 1, got {k}')
        self.k = k

    @property
    def k_max(self) -> int:
        return self.k

    @property
    def k_min(self) -> int:
        return self.k

    def choose(self, elapsed_s: float, batch_size: int, deadline_s: float | None = None) -> int:
        """Return k for this frame: k, whatever the time (k per robot tick)."""
        return self.k

    def allow_more(self, elapsed_s: float, batch_size: int,
                   deadline_s: float | None = None) -> bool:
        """Whether another step fits in this frame (a fixed budget never cuts a frame short)."""
        return True

    def time_left(self, elapsed_s: float, deadline_s: float | None = None) -> float:
        """Return math.inf: a fixed budget is not bound by time (nothing waits for one)."""
        return math.inf

    def observe_action(self, seconds: float) -> None:
        """Record the action path time of a frame (unused by a fixed budget)."""

    def observe_tail(self, seconds: float) -> None:
        """Record a tick's time after its language steps (unused by a fixed budget)."""

    def observe_decode(self, batch_size: int, seconds: float) -> None:
        """Record the time of one token step over `batch_size` rows (unused here)."""

    def observe_extend(self, tokens: int, seconds: float) -> None:
        """Record the time of one extend pass (unused here)."""

    def extend_estimate(self, tokens: int) -> float:
        """Return 0: a fixed budget gives k steps whatever the time."""
        return 0.0

    def observe_first(self, rows: int, seconds: float) -> None:
        """Record the time of one first-token call (unused here)."""

    def first_estimate(self, rows: int) -> float:
        """Return 0: a fixed budget gives k steps whatever the time."""
        return 0.0

    def step_estimate(self, batch_size: int) -> float:
        """Return 0: a fixed budget gives k steps whatever the time."""
        return 0.0

    def __str__(self) -> str:
        return f'FixedBudget(k={self.k})'


class StepCostModel:
    """Online estimate d(B) of one token step's time for batch size B.

    Per batch size: max(EMA of measured steps, latest step). The max makes the estimate jump
    up at once when steps get slower (a deadline at risk) and drift down slowly when they get
    faster (slack is only given back once it is confirmed). For a size never seen:
    between two measured sizes, linear interpolation; below the smallest, the smallest's cost
    (a step never gets cheaper with more rows, so that is an upper bound); above the largest,
    linear extrapolation along the last segment, or, with one measured size b0 only,
    d(b0)·B/b0 (pessimistic: assumes cost grows with rows, as on a compute-bound CPU).
    """

    def __init__(self, ema: float = 0.3, prior_s: float | None = None):
        self.ema = ema                        # weight of the newest sample
        self.prior_s = prior_s                # cost assumed before any measurement (None: none)
        self._ema: dict[int, float] = {}      # batch size -> EMA seconds per step
        self._cost: dict[int, float] = {}     # batch size -> max(EMA, latest) seconds

    def observe(self, batch_size: int, seconds: float) -> None:
        old = self._ema.get(batch_size)
        ema = seconds if old is None else old + self.ema * (seconds - old)
        self._ema[batch_size] = ema
        self._cost[batch_size] = max(ema, seconds)
        # A step never gets cheaper with fewer rows, so a smaller size believed slower than
        # this measurement is stale (one hiccup): lower it, or k could stay 0 for good after a
        # single slow step because that size is rarely measured again.
        for smaller in [b for b in self._cost if b < batch_size and self._cost[b] > seconds]:
            self._cost[smaller] = seconds
            self._ema[smaller] = min(self._ema[smaller], seconds)

    def estimate(self, batch_size: int) -> float | None:
        """Seconds per step at `batch_size`, or None when nothing is known yet."""
        if batch_size in self._cost:
            return self._cost[batch_size]
        if not self._cost:
            return self.prior_s
        sizes = sorted(self._cost)
        if batch_size < sizes[0]:
            return self._cost[sizes[0]]
        if len(sizes) == 1:
            return self._cost[sizes[0]] * batch_size / sizes[0]
        i = bisect.bisect_left(sizes, batch_size)
        lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
        slope = max((self._cost[hi] - self._cost[lo]) / (hi - lo), 0.0)
        return max(self._cost[lo] + slope * (batch_size - lo), self._cost[sizes[0]])

    def known(self) -> dict[int, float]:
        return dict(self._cost)


class AdaptiveBudget:
    """Choose k each frame so the frame ends by its deadline.

    Per frame, after the action path:  k = floor((deadline - elapsed) / d(B)),  clamped to
    [0, k_max], where deadline = frame_period_s - reserve and d(B) comes from the online
    cost model at the current number of live requests B (an upper bound on every step's batch
    this frame). In a fleet the frame's deadline is the next robot's tick when that comes
    first (min(period, deadline_s) - reserve), and B counts every robot's rows of a step.

    reserve: what the tick needs after its last language step. Until a tick's tail is
    measured, `margin` of the period (5%); then the measured tail (detokenising, publishing:
    max(EMA, latest), as a step's cost) plus TAIL_GUARD of the period for a step that runs
    past its estimate, never more than the margin (measured on pi05-cpu: a tail of ~1-1.5 ms
    at 10 Hz, so ~3 ms of a 100 ms tick's 5 go back to the language steps). Guarantees:
      * slack ≥ one step  ->  k ≥ 1 (follows from the floor);
      * no slack          ->  k = 0: the budget adds nothing, and the scheduler's per-request
        minimum (each request's pool deadline, planned at k_min steps per frame) is all the
        language work of the frame, so admitted requests still finish under any overload;
      * nothing measured  ->  k = 1 (a probe that teaches the cost model).
    `allow_more()` re-checks the clock before each further step, so a frame whose steps run
    slower than estimated stops early instead of overrunning by k steps (the scheduler never
    stops below a request's minimum).

    Extend passes (a new request's template in one pass) have a cost model of their own, by
    padded query tokens: one costs several decode steps (pi05-cpu, eager: a 40-token pass
    ~2.5x a one-row step). The scheduler adds the estimate of the tick's pending pass to the
    elapsed time before choosing k. prior_extend: (tokens, seconds) of a pass timed at
    configure, what the model assumes until it has measured one. First-token calls (the LM
    head on new requests' prefixes, ~1.5 ms on pi05-cpu) have a third model, by rows.
    """

    unlimited = False

    def __init__(self, frame_period_s: float, k_max: int = 16, margin: float = 0.05,
                 ema: float = 0.3, prior_step_s: float | None = None, k_min: int = 1,
                 prior_extend: tuple[int, float] | None = None):
        if frame_period_s <= 0 or not 1 <= k_min <= k_max or not 0 <= margin < 1:
            raise ValueError(f'bad AdaptiveBudget({frame_period_s}, k_min={k_min}, '
                             f'k_max={k_max}, margin={margin})')
        self.frame_period_s = frame_period_s
        self.k_max = k_max
        self.k_min = k_min
        self.margin = margin
        self.cost = StepCostModel(ema, prior_step_s)
        self.extend_cost = StepCostModel(ema)   # padded query tokens -> seconds of a pass
        self.first_cost = StepCostModel(ema)    # rows -> seconds of a first-token call
        if prior_extend is not None:
            self.extend_cost.observe(*prior_extend)
        self.tail = StepCostModel(ema)          # (key 1) -> seconds after the last step
        self.action_s: float | None = None   # EMA of the action path (reporting, planning)
        self._ema = ema
        self.last_k = 0

    @property
    def deadline_s(self) -> float:
        return self._deadline(None)

    def _deadline(self, deadline_s: float | None) -> float:
        """Return the frame's deadline: its period's or an earlier one given, less the reserve."""
        end = self.frame_period_s
        if deadline_s is not None:
            end = min(end, deadline_s)
        reserve = self.margin * end
        tail = self.tail.estimate(1)
        if tail is not None:
            reserve = min(reserve, tail + TAIL_GUARD * end)
        return end - reserve

    def choose(self, elapsed_s: float, batch_size: int, deadline_s: float | None = None) -> int:
        """Return k for this frame; elapsed_s = frame time so far (action path included)."""
        step = self.cost.estimate(max(batch_size, 1))
        if step is None:
            k = 1
        else:
            slack = self._deadline(deadline_s) - elapsed_s
            # 1 ns of tolerance: a slack of exactly n steps must give n despite rounding.
            k = 0 if slack <= 0 else min(self.k_max, int((slack + 1e-9) // max(step, 1e-9)))
        self.last_k = k
        return k

    def allow_more(self, elapsed_s: float, batch_size: int,
                   deadline_s: float | None = None) -> bool:
        """Whether one more step at `batch_size` still ends before the deadline."""
        step = self.cost.estimate(max(batch_size, 1)) or 0.0
        return elapsed_s + step <= self._deadline(deadline_s)

    def time_left(self, elapsed_s: float, deadline_s: float | None = None) -> float:
        """Seconds from elapsed_s to the frame's deadline (negative: past it)."""
        return self._deadline(deadline_s) - elapsed_s

    def observe_tail(self, seconds: float) -> None:
        self.tail.observe(1, seconds)

    def observe_action(self, seconds: float) -> None:
        old = self.action_s
        self.action_s = seconds if old is None else old + self._ema * (seconds - old)

    def observe_decode(self, batch_size: int, seconds: float) -> None:
        self.cost.observe(batch_size, seconds)

    def observe_extend(self, tokens: int, seconds: float) -> None:
        self.extend_cost.observe(tokens, seconds)

    def observe_first(self, rows: int, seconds: float) -> None:
        self.first_cost.observe(rows, seconds)

    def first_estimate(self, rows: int) -> float:
        """Seconds of a first-token call over `rows` prefixes (0 while none was timed)."""
        if not rows:
            return 0.0
        return self.first_cost.estimate(rows) or 0.0

    def step_estimate(self, batch_size: int) -> float:
        """Seconds of a token step over `batch_size` rows (0 while nothing is known)."""
        return self.cost.estimate(max(batch_size, 1)) or 0.0

    def extend_estimate(self, tokens: int) -> float:
        """Seconds of an extend pass over `tokens` (nothing known: a one-row decode step)."""
        estimate = self.extend_cost.estimate(tokens)
        if estimate is None:
            estimate = self.cost.estimate(1)
        return estimate or 0.0

    def __str__(self) -> str:
        known = ', '.join(f'{b}:{s * 1e3:.2f}ms' for b, s in sorted(self.cost.known().items()))
        return (f'AdaptiveBudget(period={self.frame_period_s * 1e3:.1f}ms, k_max={self.k_max}, '
                f'last_k={self.last_k}, d(B)={{{known}}})')
