"""Language request policy and the paper's reference workloads (libero / droid / aloha)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from oxygen_ros.model.robot_spec import get_robot, RobotSpec


def frame_rng(seed: int, frame_index: int, stream: int = 0) -> np.random.Generator:
    """Return a generator that depends only on (seed, frame_index, stream), not call order.

    Every system (oxygen, baselines, processes) derives per-frame randomness this way, so they
    see the same noise and the same request arrivals whatever else they do.
    """
    return np.random.default_rng(np.random.SeedSequence([seed, frame_index, stream]))


@dataclasses.dataclass(frozen=True)
class LanguagePolicy:
    """When language requests start and how long they may run.

    Arrivals are a pure function of (seed, frame_index), so a rerun or another system sees
    the same requests. A frame starts at most one request (the request adopts that frame's
    KV slot); with Poisson arrivals, requests that arrive in the same frame queue for the next
    frames (up to `max_queue`; further ones are refused and reported).
    """

    max_new_tokens: int = 10            # N, generated tokens per request (EOS may stop earlier)
    every_n_frames: int = 1             # start one request every n frames; 0 = never
    arrival_rate: float | None = None   # Poisson: mean requests per frame (overrides every_n)
    length_choices: tuple[int, ...] = ()  # if set, each request draws N from these (seeded)
    seed: int = 0                       # seeds arrivals and drawn lengths
    eos_id: int | None = 1              # stop token; None disables EOS (the paper's setting)
    prompt_template: str = ''           # '' = continue the action prefix exactly (the paper);
    # otherwise fed as forced tokens after the prefix; '{instruction}' is replaced by the task
    max_queue: int = 4                  # Poisson arrivals waiting for a frame, beyond = refused

    def __post_init__(self):
        lengths = self.length_choices or (self.max_new_tokens,)
        if min(lengths) < 1:
            raise ValueError(f'request lengths must be >= 1, got {lengths}')
        if self.every_n_frames < 0:
            raise ValueError(f'every_n_frames must be >= 0, got {self.every_n_frames}')
        if self.arrival_rate is not None and not self.arrival_rate >= 0:
            raise ValueError(f'arrival_rate must be >= 0, got {self.arrival_rate}')

    @property
    def max_request_len(self) -> int:
        """Largest N any request can have (sizes the KV slots)."""
        return max(self.length_choices or (self.max_new_tokens,))

    def arrivals(self, frame_index: int) -> int:
        """Return the number of requests arriving at this frame."""
        if self.arrival_rate is not None:
            return int(frame_rng(self.seed, frame_index, 1).poisson(self.arrival_rate))
        if self.every_n_frames == 0:
            return 0
        return int(frame_index % self.every_n_frames == 0)

    def request_len(self, frame_index: int) -> int:
        """Return N of a request started at this frame."""
        if not self.length_choices:
            return self.max_new_tokens
        pick = frame_rng(self.seed, frame_index, 2).integers(len(self.length_choices))
        return int(self.length_choices[pick])

    def prompt_text(self, instruction: str) -> str:
        """Return the text fed as forced tokens after the prefix ('' for none)."""
        if not self.prompt_template:
            return ''
        return self.prompt_template.replace('{instruction}', instruction)

    def requests_per_frame(self) -> float:
        """Return the mean arrivals per frame (for pool sizing)."""
        if self.arrival_rate is not None:
            return min(self.arrival_rate, 1.0)
        return 0.0 if self.every_n_frames == 0 else 1.0 / self.every_n_frames


def default_num_slots(policy: LanguagePolicy, k: int | None) -> int:
    """Pool capacity: the one sizing rule, ceil(N/k) + 1 (k None: no cross-frame batching).

    A request of N tokens at k tokens per frame (its first token counts) lives ceil(N/k)
    frames: started in frame t, it finishes in the advance_language() of frame
    t + ceil(N/k) - 1. At most one request starts per frame, so when act() of frame t needs a
    slot, the requests of frames t - ceil(N/k) + 1 .. t - 1 are live: ceil(N/k) slots with
    the frame's own, which its request then adopts (no second slot). The + 1 is the spare
    slack admission keeps (a request ending early by EOS leaves room for one more); an
    adaptive budget sizes with its k_min = 1 (the steps per frame its requests are planned
    with). Forced prompt-template tokens are not counted: under a long template fewer
    requests are admitted (engine/scheduler.py), never is the action path kept waiting.
    Without requests the pool is the frame slot alone.
    """
    if policy.requests_per_frame() == 0:
        return 1
    if k is None:
        return 2
    return math.ceil(policy.max_request_len / max(k, 1)) + 1


NARRATION = 'narration'   # the default language task: today's one stream


@dataclasses.dataclass(frozen=True)
class LanguageTask:
    """One language stream of a robot: its requests, their priority and where they go.

    Every task's request of a frame reads that frame's one prefix (no extra prefill) and
    decodes in the same batched steps as the others. Priority orders admission (higher first)
    and who yields first when the tick's budget runs out (lower first, down to each
    request's minimum: admitted requests always finish).
    """

    name: str = NARRATION
    policy: LanguagePolicy = LanguagePolicy()
    priority: int = 0                   # higher: admitted first, yields last
    topic: str = ''                     # LanguageChunk topic ('': the task's default)
    drives_actions: bool = False        # its newest finished text becomes the action prompt
    max_age_s: float = 2.0              # drives_actions: older, the instruction is the prompt
    on_demand: bool = False             # requests come from Scheduler.ask (questions), each
    #                                     with its own forced tokens; policy.max_queue of them
    #                                     may wait or run at once


def as_tasks(tasks: LanguagePolicy | Sequence[LanguageTask]) -> tuple[LanguageTask, ...]:
    """Return `tasks` as a tuple; a bare policy is the one narration task (today's configs)."""
    if isinstance(tasks, LanguagePolicy):
        return (LanguageTask(NARRATION, tasks),)
    tasks = tuple(tasks)
    if not tasks:
        raise ValueError('a robot needs at least one language task (narration with '
                         'every_n_frames 0 for none)')
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f'language task names must be unique, got {names}')
    return tasks


def tasks_num_slots(tasks: Sequence[LanguageTask], k: int | None) -> int:
    """Prefix slots for several tasks: the longest-lived task's default_num_slots.

    A frame's prefix slot lives as long as its longest request, and at most one frame starts
    per tick, so the task whose requests live longest sizes the pool as it would alone.
    """
    return max(default_num_slots(t.policy, k) for t in tasks)


def tasks_num_blocks(tasks: Sequence[LanguageTask], k: int | None) -> int:
    """Return the generation blocks for several tasks: each one's live requests, plus a spare.

    A task's request lives ceil(N / k) ticks; one starting every n frames has
    ceil(ceil(N / k) / n) live at once when the next is admitted (Poisson arrivals: as if
    n = 1). With one task and n = 1 that is default_num_slots: one block per prefix slot.
    An on-demand task (questions) has its max_queue.
    """
    total = 0
    for task in tasks:
        policy = task.policy
        if task.on_demand:   # at most max_queue asked at once, each in a block of its own
            total += policy.max_queue
            continue
        if policy.requests_per_frame() == 0:
            continue
        life = 1 if k is None else math.ceil(policy.max_request_len / max(k, 1))
        every = 1 if policy.arrival_rate is not None else policy.every_n_frames
        total += math.ceil(life / every) + 1
    return max(total, 1)


def answer_tokens(tasks: Sequence[LanguageTask]) -> int:
    """Return the longest answer (N) of the on-demand tasks among `tasks` (0: no questions)."""
    return max((t.policy.max_request_len for t in tasks if t.on_demand), default=0)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A reference robot setup from the OxyGen paper; its facts come from the RobotSpec."""

    name: str
    robot: str                  # shipped robot name (config/robots/<robot>.yaml)
    horizon: int = 10           # H, action rows per chunk in the paper's workloads

    @property
    def spec(self) -> RobotSpec:
        return get_robot(self.robot)

    @property
    def num_cameras(self) -> int:
        """Cameras the model is fed (all 224² in the real model)."""
        return len(self.spec.cameras)

    @property
    def state_dim(self) -> int:
        return self.spec.state_dim

    @property
    def action_dim(self) -> int:
        return self.spec.action_dim


WORKLOADS: dict[str, Workload] = {name: Workload(name, name) for name in ('libero', 'droid',
                                                                          'aloha')}


def get_workload(name: str) -> Workload:
    """Return the reference workload called `name`."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f'unknown workload {name!r}; '
                         f'expected one of {sorted(WORKLOADS)}') from None


NOISE_BLOCK_FRAMES = 32   # frames whose start noise one draw makes (frame_noise)


def frame_noise(seed: int, frame_index: int, horizon: int, action_dim: int) -> np.ndarray:
    """Flow-matching start noise float32 [H, A] for a frame; identical in every system.

    Drawn for NOISE_BLOCK_FRAMES frames at once (still a function of the seed and the frame
    alone): one draw per frame cost ~0.25 ms of the frame, numpy's generator being cold after
    the model's passes (~25 us warm); a frame now copies its row.
    """
    block = _noise_block(seed, frame_index // NOISE_BLOCK_FRAMES, horizon, action_dim)
    return block[frame_index % NOISE_BLOCK_FRAMES].copy()


@functools.lru_cache(maxsize=32)   # a block per robot seed and shape; pi05's is 205 KB
def _noise_block(seed: int, block: int, horizon: int, action_dim: int) -> np.ndarray:
    noise = frame_rng(seed, block, 3).standard_normal(
        (NOISE_BLOCK_FRAMES, horizon, action_dim), dtype=np.float32)
    noise.flags.writeable = False
    return noise
