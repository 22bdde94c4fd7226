"""The systems the benchmark compares, behind the one System protocol (engine/system.py).

    action-only  prefill + denoise, no language at all (the latency and memory reference)
    isolated   action task (prefill + denoise), then language task with its OWN second prefill
               and a full N-token decode, sequentially in the same frame (the paper's baseline)
    shared     one prefill shared by both tasks, but no cross-frame batching: each request
               decodes to completion in its frame
    parallel   two model instances in two processes, each with its own prefill, one thread each
               (the naive parallel baseline: it doubles weights and prefill work)
    oxygen     shared prefill + cross-frame continuous batching, fixed k
    oxygen-adaptive  the same with a deadline-adaptive k
All of them produce the same greedy tokens and the same actions for the same frames. Only the
benchmark (and the tests) builds them: the node, the replay and the server run oxygen engines
(runtime/engine_setup.py). isolated and shared are Engines without a prefix shared across
frames or without a decode budget; parallel is ParallelSystem below.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import Callable, Sequence

import torch
import torch.multiprocessing as mp

from oxygen_ros.engine.budget import AdaptiveBudget, Budget, FixedBudget, UnlimitedBudget
from oxygen_ros.engine.engine import Engine, make_engine
from oxygen_ros.engine.frontend import Frontend
from oxygen_ros.engine.prepare import prepare_model, seal
from oxygen_ros.engine.types import ActionOutput, FrameResult, Observation, Timings
from oxygen_ros.engine.workload import LanguagePolicy
from oxygen_ros.model.config import Pi05Config
from oxygen_ros.engine.system import System
from oxygen_ros.model.pi05 import Pi05Model

from .plan import SystemSpec

logger = logging.getLogger(__name__)

SYSTEMS = ('isolated', 'parallel', 'shared', 'oxygen', 'oxygen-adaptive')


def action_only_policy(policy: LanguagePolicy) -> LanguagePolicy:
    """Return the same policy with no language requests at all."""
    return dataclasses.replace(policy, every_n_frames=0, arrival_rate=None)


# ---- parallel: two processes ---------------------------------------------------------------

def _worker_main(role: str, config: dict, state_dict: dict, dtype: torch.dtype, device: str,
                 compile_setting: str, warm_frames: Sequence[dict], frontend: Frontend,
                 policy: LanguagePolicy, seed: int, threads: int, inbox, outbox) -> None:
    """Process body: build a model from config + weights, then serve one frame per message.

    The model is prepared as the parent's was (`prepare_model` with the parent's compile
    setting: fused, packed, the same passes compiled, from the compile cache the parent
    filled, warmed up on `warm_frames` and sealed), so the worker multiplies and rounds as
    the other systems do and its tokens match theirs.
    """
    torch.set_num_threads(threads)
    try:
        model = Pi05Model(Pi05Config.from_dict(config)).to_precision(dtype)
        model.load_state_dict(state_dict)
        model.to(device).eval()
        del state_dict
        plan = prepare_model(model, device, compile_setting)
        if role == 'action':
            system = make_engine('action-only', model, frontend, action_only_policy(policy),
                                 UnlimitedBudget(), seed=seed)
        else:
            system = make_engine('isolated', model, frontend, policy, UnlimitedBudget(),
                                 share_prefix=False, seed=seed)
        if plan.any and warm_frames:   # else the first frames compile (from the cache)
            system.runner.warm_up_compiled(frames=warm_frames)
            seal(model, plan)
    except Exception as err:   # reported to the parent, which raises
        outbox.put(('error', repr(err)))
        return
    outbox.put(('ready', plan.describe()))
    while True:
        obs = inbox.get()
        if obs is None:
            return
        try:
            if role == 'action':
                system.act(obs)
                system.advance_language()    # releases the frame slot; no request starts
            else:
                system.language_task(obs)
            outbox.put(('ok', system.last_result))
        except Exception as err:   # reported to the parent, which raises
            outbox.put(('error', repr(err)))


class ParallelSystem:
    """Naive parallel baseline: action and language in two processes, one model each.

    Each process has its own copy of the weights and its own prefill of every observation,
    and runs one thread.
    The parent converts nothing but frame numbers; each worker validates and prepares the
    observation itself (the work a real second process would repeat).
    """

    system = 'parallel'

    def __init__(self, model: Pi05Model, frontend: Frontend, policy: LanguagePolicy, *,
                 seed: int = 0, threads: int = 1, timeout_s: float = 600.0,
                 compile_setting: str = 'off', warm_frames: Sequence[dict] = ()):
        self.frontend = frontend
        self.policy = policy
        self.budget: Budget = UnlimitedBudget()   # every request completes in its frame
        self.timeout_s = timeout_s
        self.clock = time.perf_counter
        ctx = mp.get_context('spawn')
        # Copies: a tensor handed to a spawned process moves its storage into shared memory,
        # in place, and the model's own weights would leave the addresses their packed copies
        # (model/packed.py) are found by: every other system here would run unpacked.
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        device = str(next(model.parameters()).device)
        self._inbox, self._outbox, self._procs = {}, {}, {}
        for role in ('action', 'language'):
            self._inbox[role], self._outbox[role] = ctx.Queue(), ctx.Queue()
            self._procs[role] = ctx.Process(
                target=_worker_main, name=f'oxygen-{role}', daemon=True,
                args=(role, model.config.to_dict(), weights, model.compute_dtype, device,
                      compile_setting, list(warm_frames), frontend, policy, seed, threads,
                      self._inbox[role], self._outbox[role]))
            self._procs[role].start()
        # how each worker prepared its model (its CompilePlan.describe(): passes, packing)
        self.worker_prepared = {role: self._receive(role, expect='ready')
                                for role in self._procs}
        self._next_frame_index = 0
        self._pending: tuple[int, float, float] | None = None   # frame, act start, act_s
        self._action_result: FrameResult | None = None
        self.last_result: FrameResult | None = None

    def _receive(self, role: str, expect: str = 'ok'):
        try:
            kind, payload = self._outbox[role].get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f'parallel {role} process did not answer in '
                               f'{self.timeout_s:.0f} s') from None
        if kind != expect:
            raise RuntimeError(f'parallel {role} process failed: {payload}')
        return payload

    def act(self, obs: Observation) -> ActionOutput:
        """Send the frame to both processes; wait for the actions only."""
        start = self.clock()
        if self._pending is not None:
            self.advance_language()     # collect the previous frame's language reply first
        index = self._next_frame_index if obs.frame_index is None else int(obs.frame_index)
        self._next_frame_index = index + 1
        obs = dataclasses.replace(obs, frame_index=index)
        for role in ('action', 'language'):
            self._inbox[role].put(obs)
        try:
            self._action_result = self._receive('action')
        except RuntimeError:
            # Keep the language reply stream aligned with frames before reporting the failure.
            self._outbox['language'].get(timeout=self.timeout_s)
            raise
        act_s = self.clock() - start
        self._pending = (index, start, act_s)
        action = self._action_result.action
        return dataclasses.replace(action, inference_time_s=act_s)

    @property
    def num_live_requests(self) -> int:
        """Live requests of the language process after the last frame."""
        return self.last_result.active_requests if self.last_result is not None else 0

    def set_budget(self, budget) -> None:
        raise NotImplementedError('the parallel baseline decodes every request to completion')

    def set_policy(self, policy: LanguagePolicy) -> None:
        raise NotImplementedError('the parallel baseline fixes its policy at start')

    def advance_language(self) -> FrameResult:
        """Wait for the language process's reply for the frame sent by act().

        Without a pending frame nothing runs (no request outlives its frame here): the result
        is an empty language-only frame.
        """
        if self._pending is None:
            self.last_result = FrameResult(
                frame_index=-1, action=None, deltas=[], finished=[],
                k=self.policy.max_request_len, decode_steps=0, batch_sizes=[],
                active_requests=0, timings=Timings(), kv_usage={})
            return self.last_result
        start = self.clock()
        index, _, act_s = self._pending
        self._pending = None
        lang = self._receive('language')
        act = self._action_result
        total_s = act_s + self.clock() - start
        a, g = act.timings, lang.timings
        timings = Timings(prefill_s=a.prefill_s + g.prefill_s, action_s=a.action_s,
                          decode_s=g.decode_s, total_s=total_s, act_s=act_s,
                          frontend_s=max(a.frontend_s, g.frontend_s))
        # The processes overlap, so the frame's model time is the longer of the two.
        timings.overhead_s = max(total_s - max(a.model_s, g.model_s), 0.0)
        usage = {key: act.kv_usage[key] + lang.kv_usage[key]
                 for key in act.kv_usage if 'holders' not in key}
        self.last_result = FrameResult(
            frame_index=index, action=dataclasses.replace(act.action, inference_time_s=act_s),
            deltas=lang.deltas, finished=lang.finished, k=lang.k,
            decode_steps=lang.decode_steps, batch_sizes=lang.batch_sizes,
            active_requests=lang.active_requests, timings=timings, kv_usage=usage)
        return self.last_result

    def step(self, obs: Observation) -> FrameResult:
        self.act(obs)
        return self.advance_language()

    def close(self) -> None:
        """Stop both processes (idempotent)."""
        for role, proc in self._procs.items():
            if proc.is_alive():
                self._inbox[role].put(None)
        for proc in self._procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> ParallelSystem:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        procs = getattr(self, '_procs', {})
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()


# ---- factory --------------------------------------------------------------------------------

def make_system(name: str, model: Pi05Model, frontend: Frontend, policy: LanguagePolicy, *,
                k: int = 5, frame_period_s: float | None = None, num_slots: int | None = None,
                seed: int = 0, debug: bool = False, runner_options: dict | None = None,
                clock: Callable[[], float] = time.perf_counter, parallel: dict | None = None,
                **adaptive_kw) -> Engine | ParallelSystem:
    """Build system `name` (one of SYSTEMS) over one model and frontend.

    k: tokens per request per frame for 'oxygen' (and k_max for 'oxygen-adaptive' unless
    given in adaptive_kw); frame_period_s: the deadline of 'oxygen-adaptive' (required).
    runner_options: ModelRunner options (bucket_sizes, kv_dtype, max_holes_per_row).
    clock: the engine's clock (not the parallel baseline's).
    parallel: ParallelSystem options: compile_setting (the one `model` was prepared with)
    and warm_frames (prepared frames its workers warm their compiled passes on).
    """
    if name == 'parallel':
        return ParallelSystem(model, frontend, policy, seed=seed, **(parallel or {}))
    if name == 'oxygen':
        budget = FixedBudget(k)
    elif name == 'oxygen-adaptive':
        if frame_period_s is None:
            raise ValueError('oxygen-adaptive needs frame_period_s (the frame deadline)')
        adaptive_kw.setdefault('k_max', max(k, policy.max_request_len))
        budget = AdaptiveBudget(frame_period_s, **adaptive_kw)
    elif name in ('shared', 'isolated'):
        budget = UnlimitedBudget()
    else:
        raise ValueError(f'unknown system {name!r}; expected one of {SYSTEMS}')
    return make_engine(name, model, frontend, policy, budget, share_prefix=name != 'isolated',
                       num_slots=num_slots, seed=seed, debug=debug, clock=clock,
                       **(runner_options or {}))


def make_bench_system(spec: SystemSpec, model: Pi05Model, frontend: Frontend,
                      policy: LanguagePolicy, period_s: float, seed: int,
                      runner_options: dict | None = None,
                      parallel: dict | None = None) -> System:
    """Build one system of a group ('action-only' is an Engine with no requests).

    parallel: how `model` was prepared, for the parallel baseline's workers (make_system).
    """
    if spec.name == 'action-only':
        return make_engine('action-only', model, frontend, action_only_policy(policy),
                           UnlimitedBudget(), seed=seed)
    kwargs = {'seed': seed}
    if spec.name == 'oxygen':
        kwargs['k'] = spec.k
    if spec.name == 'oxygen-adaptive':
        kwargs.update(frame_period_s=period_s, k=spec.k or policy.max_request_len)
    return make_system(spec.name, model, frontend, policy, runner_options=runner_options,
                       parallel=parallel, **kwargs)
