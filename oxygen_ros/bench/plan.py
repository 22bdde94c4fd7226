"""What the benchmark runs: groups of systems that see the same frames, and the sweeps.

A group is one language setting (workload, S, N, arrivals, request lengths) and the systems
compared under it. The runner steps every system of a group on the same observation, frame by
frame, in turn (round_order), so slow phases of a shared machine hit all systems alike.

Warm-up: a fixed-k oxygen system reaches its steady decode batch after ceil(N/k) frames, so it
starts that many frames (+ WARMUP_FRAMES) before the measured window; the other systems are in
steady state after WARMUP_FRAMES. Systems that need less warm-up skip the group's earliest
frames; the measured frames are the same for all. The isolated baseline runs every frame: it
is the reference every other system's tokens are compared with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from ..engine.workload import LanguagePolicy

# Every system the benchmark knows; 'action-only' is prefill + denoise with no language at all
# (the upper bound on action frequency).
SYSTEM_NAMES = ('action-only', 'isolated', 'parallel', 'shared', 'oxygen', 'oxygen-adaptive')
SWEEPS = ('nk', 'steps', 'arrivals', 'mixed', 'workloads')
PARTS = ('floors',) + SWEEPS + ('memory',)   # the default ('all'): runs anywhere, ROS or not
# 'robots' (R robots from one engine vs R engines, in worker processes, minutes), 'node'
# (oxygen_node, a stand-in robot and a monitor as processes: it needs the ROS install and the
# built messages), 'serve' (`oxygen-ros serve` over the engine, a client on localhost),
# 'overload' (the node with the shipped YAML, then asked 2x what it holds: narration figures),
# 'tasks' (the node with narration, a subtask and questions at once, against narration alone
# and action-only; each task's tokens against the task alone in the engine),
# 'rtc' (real-time chunking off / guided / prefix on the same synthetic episode) and 'build'
# (peak RSS of building / loading a model of --build-preset, pi05 by default: 7 GB of memory
# and a 7 GB checkpoint written to a temporary folder, minutes) run only when asked for.
ALL_PARTS = PARTS + ('robots', 'node', 'serve', 'overload', 'tasks', 'rtc', 'build')
ROBOT_COUNTS = (1, 2, 4, 8)
PAPER_NS = (5, 10, 15, 20, 30)
PAPER_STEPS = (5, 10, 15, 20)
# One request per 0.25 .. 4 frames (Poisson), as requests per frame.
PAPER_ARRIVAL_RATES = (4.0, 2.0, 1.0, 0.5, 0.25)
MIXED_LENGTHS = (5, 10, 20, 30)
WARMUP_FRAMES = 2
HEADLINE_N, HEADLINE_K = 30, 5   # the paper's headline setting (libero N=30, k=5)


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One system of a group: a name from SYSTEM_NAMES and, for oxygen, its k."""

    name: str
    k: int | None = None   # tokens per request per frame (oxygen); k_max (oxygen-adaptive)

    def __post_init__(self):
        if self.name not in SYSTEM_NAMES:
            raise ValueError(f'unknown system {self.name!r}; expected one of {SYSTEM_NAMES}')
        if self.name == 'oxygen' and not (self.k and self.k >= 1):
            raise ValueError('oxygen needs k >= 1')

    @property
    def label(self) -> str:
        return f'oxygen k={self.k}' if self.name == 'oxygen' else self.name

    @property
    def own_processes(self) -> bool:
        """Whether it runs in processes of its own, on copies of the weights (parallel)."""
        return self.name == 'parallel'


def round_order(systems: Sequence[SystemSpec], round_index: int) -> list[SystemSpec]:
    """Return the order the systems step through one frame (round `round_index` of a group).

    The in-process systems share one model's weights: each finds them in the caches where the
    system before it left them. The parallel baseline's processes read weight copies of their
    own, so the system after it finds its weights evicted (libero N=30 k=1: oxygen 89-91% of
    its component model when it came right after parallel in 5 of 6 rounds, 96-99% in runs
    without parallel). So systems in processes of their own go first in every round and the
    in-process ones rotate after them: each is the one after them equally often, and the
    start rotates so slow moments of a shared machine hit every system alike.
    """
    outside = [s for s in systems if s.own_processes]
    inside = [s for s in systems if not s.own_processes]
    if not inside:
        return list(systems)
    turn = round_index % len(inside)
    return outside + inside[turn:] + inside[:turn]


@dataclasses.dataclass(frozen=True)
class Group:
    """Systems compared side by side on the same frames, noise and requests."""

    sweep: str                       # one of SWEEPS
    workload: str                    # libero / droid / aloha
    steps: int                       # S, flow-matching steps
    n_tokens: int                    # N, tokens per request (the largest one when mixed)
    systems: tuple[SystemSpec, ...]
    frames: int                      # measured frames
    arrival_rate: float | None = None   # Poisson requests per frame; None: one every frame
    lengths: tuple[int, ...] = ()    # request lengths drawn per request (mixed sweep)

    def policy(self, seed: int) -> LanguagePolicy:
        """Return the language policy every system of the group runs (EOS off, as in the paper)."""
        return LanguagePolicy(max_new_tokens=self.n_tokens, arrival_rate=self.arrival_rate,
                              length_choices=self.lengths, seed=seed, eos_id=None)

    def warmup(self, spec: SystemSpec) -> int:
        """Frames `spec` runs before the measured window."""
        if self.arrival_rate is not None or self.lengths:
            # Random arrivals and lengths: one long warm-up for all (queue states converge).
            return self.max_warmup
        if spec.name == 'oxygen':
            return math.ceil(self.n_tokens / spec.k) + WARMUP_FRAMES
        if spec.name in ('oxygen-adaptive', 'isolated'):
            # isolated is the token reference: it must see every frame any system starts a
            # request at.
            return self.max_warmup
        return WARMUP_FRAMES

    @property
    def max_warmup(self) -> int:
        """Warm-up of the slowest-to-settle system: the smallest fixed k (adaptive alone: 1)."""
        ks = [s.k for s in self.systems if s.name == 'oxygen']
        if not ks and any(s.name == 'oxygen-adaptive' for s in self.systems):
            ks.append(1)
        return math.ceil(self.n_tokens / min(ks, default=self.n_tokens)) + WARMUP_FRAMES

    @property
    def total_frames(self) -> int:
        """Frames of the group's timeline (warm-up of the slowest system + measured)."""
        return self.max_warmup + self.frames

    def system_frames(self) -> int:
        """Frames all systems of the group run together (for the progress bar)."""
        return sum(self.warmup(s) + self.frames for s in self.systems)

    @property
    def title(self) -> str:
        extra = ''
        if self.arrival_rate is not None:
            extra += f' arrivals {self.arrival_rate:g}/frame'
        if self.lengths:
            extra += f' lengths {"/".join(map(str, self.lengths))}'
        return f'{self.sweep} {self.workload} S={self.steps} N={self.n_tokens}{extra}'


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Knobs of a plan (defaults: the full paper sweep)."""

    workloads: tuple[str, ...] = ('libero', 'droid', 'aloha')
    parts: tuple[str, ...] = PARTS
    ns: tuple[int, ...] = PAPER_NS
    ks: tuple[int, ...] = ()         # restrict k to these (always with k | N); () = all divisors
    steps: tuple[int, ...] = PAPER_STEPS
    default_steps: int = 10          # S of every sweep but 'steps'
    arrival_rates: tuple[float, ...] = PAPER_ARRIVAL_RATES
    lengths: tuple[int, ...] = MIXED_LENGTHS
    frames: int = 20                 # measured frames of an N × k group
    extra_frames: int = 12           # measured frames of the other sweeps' groups
    headline_n: int = HEADLINE_N
    headline_k: int = HEADLINE_K
    parallel: str = 'all'            # which N × k groups run 'parallel': all / headline / none
    systems: tuple[str, ...] = SYSTEM_NAMES   # systems allowed anywhere
    robot_counts: tuple[int, ...] = ROBOT_COUNTS   # part 'robots': R values
    robot_frames: int = 12           # part 'robots': measured ticks per (R, system)
    robot_n: int = 10                # part 'robots': N of every robot's requests
    robot_k: int = 5                 # part 'robots': fixed k of every robot
    robot_prefill_rows: int | None = None   # part 'robots': rows per fleet prefill call
    #                                  (0: all; None: 1 on the CPU, all on an accelerator)


def _filter(systems, allowed) -> tuple[SystemSpec, ...]:
    return tuple(s for s in systems if s.name in allowed)


def build_groups(opts: PlanOptions) -> list[Group]:
    """Return the groups of all requested sweeps, in run order."""
    groups: list[Group] = []
    main = opts.workloads[0]
    S, N, K = opts.default_steps, opts.headline_n, opts.headline_k
    headline = (SystemSpec('action-only'), SystemSpec('isolated'), SystemSpec('shared'),
                SystemSpec('oxygen', K), SystemSpec('oxygen-adaptive', N))
    if 'nk' in opts.parts:
        for n in opts.ns:
            ks = [k for k in divisors(n) if not opts.ks or k in opts.ks]
            with_parallel = opts.parallel == 'all' or (opts.parallel == 'headline' and n == N)
            systems = [SystemSpec('action-only'), SystemSpec('isolated'), SystemSpec('shared')]
            systems += [SystemSpec('parallel')] if with_parallel else []
            systems += [SystemSpec('oxygen', k) for k in ks]
            systems += [SystemSpec('oxygen-adaptive', n)]
            groups.append(Group('nk', main, S, n, _filter(systems, opts.systems), opts.frames))
    if 'steps' in opts.parts:
        for steps in opts.steps:
            systems = headline[:4]
            groups.append(Group('steps', main, steps, N, _filter(systems, opts.systems),
                                opts.extra_frames))
    if 'arrivals' in opts.parts:
        for rate in opts.arrival_rates:
            systems = (headline[1],) + headline[3:]
            groups.append(Group('arrivals', main, S, N, _filter(systems, opts.systems),
                                opts.extra_frames, arrival_rate=rate))
    if 'mixed' in opts.parts:
        lengths = tuple(sorted(opts.lengths))
        groups.append(Group('mixed', main, S, max(lengths), _filter(headline[1:], opts.systems),
                            opts.extra_frames, lengths=lengths))
    if 'workloads' in opts.parts:
        for workload in opts.workloads[1:]:
            groups.append(Group('workloads', workload, S, N, _filter(headline, opts.systems),
                                opts.extra_frames))
    for group in groups:
        if not any(s.name == 'isolated' for s in group.systems):
            raise ValueError(f'group {group.title} has no isolated system to compare against')
    return groups


def full_options(**changes) -> PlanOptions:
    """Return the paper's sweeps on the CPU preset (docs/benchmark.md)."""
    return dataclasses.replace(PlanOptions(), **changes)


def quick_options(**changes) -> PlanOptions:
    """Return a short smoke run over every code path (tiny preset, few frames)."""
    quick = PlanOptions(workloads=('libero', 'aloha'), ns=(5, 10), ks=(1, 5), steps=(2, 4),
                        default_steps=3, arrival_rates=(2.0,), lengths=(2, 5), frames=3,
                        extra_frames=3, headline_n=10, headline_k=5, parallel='headline',
                        robot_counts=(1, 2), robot_frames=3, robot_n=4, robot_k=2)
    return dataclasses.replace(quick, **changes)
