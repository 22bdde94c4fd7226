"""Scheduler and engine wiring against a fake runner and frontend: no model, milliseconds each.

The fake runner's "model" is a pure function of (frame, position, fed token), so every request
has a known reference stream: a request that reads a wrong slot, a stale prefix or a wrong
length produces different tokens.
"""

import math

import numpy as np
import pytest

from oxygen_ros.engine import (AdaptiveBudget, default_num_slots, Engine, FinishReason,
                               FixedBudget, LanguagePolicy, Observation, ObservationError,
                               Scheduler, System, UnlimitedBudget)
from oxygen_ros.engine.frontend import PreparedObservation
from oxygen_ros.engine.runner import MODEL_CALLS
from oxygen_ros.engine.workload import get_workload, WORKLOADS
from oxygen_ros.kv import KVPool

H, A = 2, 3          # action chunk of the fake model
TEXT_TOKENS = 40     # fake tokens are 2 .. 41 (0 and 1 are never emitted unless asked)


def first_token(frame):
    return 2 + (frame * 7) % TEXT_TOKENS


def next_token(frame, position, fed):
    return 2 + (frame * 31 + position * 7 + fed * 3) % TEXT_TOKENS


def reference(frame, n_tokens, eos_id=None):
    """The fake model's own greedy stream for a request started at `frame`."""
    tokens = [first_token(frame)]
    while len(tokens) < n_tokens and tokens[-1] != eos_id:
        tokens.append(next_token(frame, len(tokens), tokens[-1]))
    return tokens


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeRunner:
    """Prefix = the frame index written into a slot; decode = next_token() of that frame."""

    def __init__(self, num_slots, max_gen_len, clock, step_s=lambda rows: 0.0):
        self.prefix = [None] * num_slots        # frame whose prefix each slot holds
        self.written = {}                       # generated entries written per block
        self.max_gen_len = max_gen_len
        self.clock = clock
        self.step_s = step_s                    # fake seconds of a decode step of B rows
        self.fail_calls = set()                 # decode call numbers that raise
        self.decode_calls = []                  # blocks of every decode call
        self.prefills = 0
        self.seconds = dict.fromkeys(MODEL_CALLS, 0.0)
        self.last_call_s = 0.0
        self.action_shape = (H, A)

    def reset_times(self):
        self.seconds = dict.fromkeys(MODEL_CALLS, 0.0)

    def prefill(self, tensors, slot):
        self.prefills += 1
        self.prefix[slot] = tensors['frame']

    def sample_actions(self, slot, noise, plan=None):
        assert noise.shape == (H, A)
        return np.full((H, A), self.prefix[slot], dtype=np.float32)

    def first_tokens(self, slots):
        self.last_call_s = 0.0
        return [first_token(self.prefix[s]) for s in slots]

    def decode(self, slots, blocks, gen_lens, tokens):
        self.decode_calls.append(list(blocks))
        if len(self.decode_calls) in self.fail_calls:
            raise RuntimeError('injected decode failure')
        assert blocks == sorted(blocks) and len(set(blocks)) == len(blocks)
        out = []
        for slot, block, gen_len, fed in zip(slots, blocks, gen_lens, tokens):
            # K/V entries are appended in order: a request (new in its block at gen_len 0)
            # never skips or rewrites one.
            assert gen_len in (0, self.written.get(block)) and gen_len < self.max_gen_len, (
                block, gen_len)
            self.written[block] = gen_len + 1
            out.append(next_token(self.prefix[slot], gen_len + 1, fed))
        self.last_call_s = self.step_s(len(blocks))
        self.clock.now += self.last_call_s
        self.seconds['decode'] += self.last_call_s
        return out


class FakeFrontend:
    def prepare(self, obs):
        if obs.state is None:
            raise ObservationError('no state')
        return PreparedObservation(None, {'frame': obs.frame_index})

    def robot_actions(self, normalized, prepared, held=None):
        return normalized

    def encode_text(self, text):
        return [100 + len(word) for word in text.split()]

    def decode(self, ids):
        return ''.join(f'<{i}>' for i in ids)

    def next_delta(self, ids, shown, final):
        text = self.decode(ids)
        return text[len(shown):], text


def make(policy, budget, num_slots=None, sizing_k=None, share_prefix=True,
         step_s=lambda rows: 0.0):
    clock = FakeClock()
    if num_slots is None:
        num_slots = default_num_slots(policy, sizing_k)
    max_gen_len = policy.max_request_len - 1
    runner = FakeRunner(num_slots, max_gen_len, clock, step_s)
    scheduler = Scheduler(policy, budget, KVPool(num_slots, 10), max_gen_len,
                          share_prefix=share_prefix)
    return Engine('fake', scheduler, runner, FakeFrontend(), debug=True, clock=clock)


def obs(frame):
    return Observation(images={}, state=np.zeros(1), instruction='go', frame_index=frame)


def run(engine, frames, drain=True):
    """Step through frames (then drain); return ({origin frame: FinishedRequest}, results)."""
    requests, results = {}, []
    for frame in frames:
        results.append(engine.step(obs(frame)))
    while drain and engine.num_live_requests:
        results.append(engine.advance_language())
    for result in results:
        requests.update((f.origin_frame, f) for f in result.finished)
    return requests, results


def is_run(slots):
    return slots == list(range(slots[0], slots[0] + len(slots)))


@pytest.mark.parametrize('eos', [False, True])
@pytest.mark.parametrize('k', [1, 2, 3, 7])
def test_fixed_k_streams_equal_the_models_own(k, eos):
    eos_id = reference(1, 7)[3] if eos else None
    policy = LanguagePolicy(max_new_tokens=7, eos_id=eos_id)
    engine = make(policy, FixedBudget(k), sizing_k=k)
    requests, results = run(engine, range(12))
    assert sorted(requests) == list(range(12))
    for frame, req in requests.items():
        assert req.token_ids == reference(frame, 7, eos_id), frame
        assert req.finish_reason.completed
        assert req.text == ''.join(f'<{i}>' for i in req.token_ids)
    assert all(r.k == k for r in results)
    if eos:
        assert {r.finish_reason for r in requests.values()} == {FinishReason.EOS,
                                                                FinishReason.LENGTH}
    assert engine.pool.num_in_use == 0


def test_adaptive_k_streams_equal_the_models_own():
    policy = LanguagePolicy(max_new_tokens=9, eos_id=None)
    budget = AdaptiveBudget(0.010, k_max=9, margin=0.0)
    engine = make(policy, budget, sizing_k=1, step_s=lambda rows: 0.001 + 0.0005 * rows)
    requests, results = run(engine, range(10))
    assert len({r.k for r in results}) >= 2                        # k really varied
    for frame, req in requests.items():
        assert req.token_ids == reference(frame, 9) and req.finish_reason == 'length'


def test_unlimited_and_isolated_finish_in_their_frame():
    policy = LanguagePolicy(max_new_tokens=5, eos_id=None)
    for share_prefix, prefills in [(True, 4), (False, 8)]:
        engine = make(policy, UnlimitedBudget(), share_prefix=share_prefix)
        requests, results = run(engine, range(4), drain=False)
        assert engine.pool.num_slots == 2 and engine.num_live_requests == 0
        assert engine.runner.prefills == prefills                  # isolated prefills twice
        assert all(r.k == 5 and r.finished[0].frames == 1 for r in results)
        assert all(req.token_ids == reference(f, 5) for f, req in requests.items())


def test_pool_of_ceil_n_over_k_plus_one_never_evicts():
    """The reference workloads' (N, k) grid: one request per frame, EOS off."""
    assert {get_workload(name).horizon for name in WORKLOADS} == {10}
    for n in (5, 10, 15, 20, 30):
        for k in [k for k in range(1, n + 1) if n % k == 0]:
            policy = LanguagePolicy(max_new_tokens=n, eos_id=None)
            engine = make(policy, FixedBudget(k), sizing_k=k)
            assert engine.pool.num_slots == math.ceil(n / k) + 1
            requests, _ = run(engine, range(2 * math.ceil(n / k) + 3))
            assert all(r.finish_reason == 'length' for r in requests.values()), (n, k)
            # The spare is never needed in steady state.
            assert engine.pool.peak_slots_in_use == math.ceil(n / k)


def test_steady_state_batches_are_runs_of_slots_but_for_one_hole():
    """Lowest-free-first slots keep live requests on a run of slots.

    The newest request takes its first token from its prefix, so it sits out the frame's
    last step: that step has one hole (the runner fills it with a padding row).
    """
    for k in (1, 2, 5):
        policy = LanguagePolicy(max_new_tokens=10, eos_id=None)
        engine = make(policy, FixedBudget(k), sizing_k=k)
        run(engine, range(12), drain=False)   # draining empties the run from its start
        holes = [s[-1] - s[0] + 1 - len(s) for s in engine.runner.decode_calls]
        assert max(holes) <= 1 and holes.count(0) >= holes.count(1) * (k - 1), k


def test_a_small_pool_refuses_the_newest_and_never_evicts():
    """A pool too small for N at k: fewer requests are admitted; every admitted one finishes."""
    policy = LanguagePolicy(max_new_tokens=8, eos_id=None)
    engine = make(policy, FixedBudget(1), num_slots=3)      # one frame slot + 2 requests
    requests, results = run(engine, range(30))
    assert all(r.action is not None for r in results[:30])          # an action every frame
    reasons = {f: r.finish_reason for f, r in requests.items()}
    assert set(reasons.values()) == {'length', 'refused'}          # no 'evicted' at all
    admitted = sorted(f for f, reason in reasons.items() if reason == 'length')
    assert admitted[:2] == [0, 1] and len(admitted) >= 6           # FCFS: the oldest go first
    for frame in admitted:
        assert requests[frame].token_ids == reference(frame, 8)
    assert all(requests[f].token_ids == [] and 'KV pool full' in requests[f].error
               for f, reason in reasons.items() if reason == 'refused')


def test_preemption_takes_the_newest_request():
    """A frame that finds the pool full (a slot lost outside the plan) preempts the newest."""
    policy = LanguagePolicy(max_new_tokens=8, eos_id=None)
    engine = make(policy, FixedBudget(1), num_slots=3)
    run(engine, range(2), drain=False)                             # requests of frames 0, 1
    assert engine.pool.allocate('lost frame') is not None          # the last free slot
    scheduler = engine.scheduler
    slot = scheduler.allocate_frame_slot(2)
    assert [r.origin_frame for r in scheduler.active] == [0]       # frame 1's request gave way
    assert engine.pool.holders(slot) == ('frame 2',)
    ended = scheduler.end_language()[1]
    assert [(r.origin_frame, r.finish_reason) for r in ended] == [(1, 'evicted')]


def test_queue_overflow_is_refused_and_every_request_reported():
    policy = LanguagePolicy(max_new_tokens=2, arrival_rate=3.0, max_queue=2, seed=0)
    engine = make(policy, FixedBudget(2), sizing_k=2)
    _, results = run(engine, range(6))
    finished = [f for r in results for f in r.finished]
    refused = [f for f in finished if f.finish_reason == 'refused']
    assert refused and all('queue' in f.error and not f.token_ids for f in refused)
    arrived = sum(policy.arrivals(f) for f in range(6))
    assert len(finished) == arrived - engine.scheduler.num_queued
    assert sorted(f.request_id for f in finished) == list(range(len(finished)))


def test_decode_error_ends_only_the_rows_of_that_step():
    policy = LanguagePolicy(max_new_tokens=6, eos_id=None)
    engine = make(policy, FixedBudget(2), sizing_k=2)
    engine.runner.fail_calls = {4}                 # 1st step of frame 2: frames 0, 1, 2
    requests, _ = run(engine, range(5))
    assert {f for f, r in requests.items() if r.finish_reason == 'error'} == {0, 1, 2}
    for frame, req in requests.items():
        full = reference(frame, 6)
        if req.finish_reason == 'error':
            assert 'injected' in req.error and req.token_ids == full[:len(req.token_ids)]
        else:
            assert req.token_ids == full
    assert engine.pool.num_in_use == 0


def test_random_arrivals_eos_and_language_only_ticks_leak_nothing():
    rng = np.random.default_rng(0)
    for seed in range(4):
        policy = LanguagePolicy(arrival_rate=0.8, length_choices=(1, 3, 6, 10), seed=seed,
                                eos_id=reference(0, 10)[1])
        k = int(rng.integers(1, 4))
        engine = make(policy, FixedBudget(k), sizing_k=k, num_slots=int(rng.integers(2, 6)))
        seen = set()
        for frame in range(30):
            seen.update(f.request_id for f in engine.step(obs(frame)).finished)  # check()s
            if rng.random() < 0.3:
                seen.update(f.request_id for f in engine.advance_language().finished)
        while engine.num_live_requests:
            seen.update(f.request_id for f in engine.advance_language().finished)
        assert engine.pool.num_in_use == 0
        assert seen == set(range(engine.scheduler.num_requests))


def test_act_twice_and_bad_observations_hold_nothing():
    engine = make(LanguagePolicy(max_new_tokens=3), FixedBudget(1), sizing_k=1)
    engine.act(obs(0))
    engine.act(obs(1))                      # the runtime missed advance_language() of frame 0
    assert engine.pool.num_in_use == 1
    engine.advance_language()
    assert [r.origin_frame for r in engine.scheduler.active] == [1]
    bad = obs(2)
    bad.state = None
    with pytest.raises(ValueError):
        engine.act(bad)
    assert engine.pool.num_in_use == 1     # frame 1's request only
    engine.check()


def test_the_system_protocol_and_its_controls():
    engine = make(LanguagePolicy(max_new_tokens=4), FixedBudget(2), sizing_k=2)
    assert isinstance(engine, System)
    engine.step(obs(0))
    engine.set_budget(FixedBudget(4))
    engine.set_policy(LanguagePolicy(max_new_tokens=4, every_n_frames=0))
    result = engine.step(obs(1))
    assert result.k == 4 and engine.num_live_requests == 0 and str(engine.budget) == \
        'FixedBudget(k=4)'
    engine.set_budget(None)                 # compatibility: None is unlimited
    assert engine.budget.unlimited
    engine.close()


def test_sizing_rule():
    policy = LanguagePolicy(max_new_tokens=30)
    assert default_num_slots(policy, 5) == 7 and default_num_slots(policy, 4) == 9
    assert default_num_slots(policy, None) == 2
    assert default_num_slots(LanguagePolicy(every_n_frames=0), 5) == 1


def test_failed_admission_never_leaks_the_frame_slot():
    # Regression (issue 11): advance_language detached the frame before admission, which had no
    # try/finally; each exception there leaked the frame's slot, and after as many leaks as
    # slots every act() raised.
    policy = LanguagePolicy(max_new_tokens=4, eos_id=None, prompt_template='say {instruction}')
    engine = make(policy, FixedBudget(2), sizing_k=2)
    calls = []

    def broken_encode(text):
        calls.append(text)
        raise UnicodeError('tokenizer failed')
    engine.frontend.encode_text = broken_encode
    for frame in range(3 * engine.pool.num_slots):
        action = engine.act(obs(frame))                 # the action path keeps its slot
        assert action.frame_index == frame
        engine.advance_language()
        assert engine.pool.num_in_use == 0, f'frame {frame} leaked its slot'
    assert len(calls) == 3 * engine.pool.num_slots


def test_scheduler_admission_failure_releases_the_frame_hold():
    class BrokenPolicy(LanguagePolicy):
        def arrivals(self, frame_index):
            raise RuntimeError('policy failed')

    pool = KVPool(3, 10)
    scheduler = Scheduler(BrokenPolicy(max_new_tokens=4, eos_id=None), FixedBudget(2), pool, 3)
    scheduler.allocate_frame_slot(0)
    scheduler.after_actions()
    scheduler.begin_language()
    with pytest.raises(RuntimeError, match='policy failed'):
        scheduler.admit(0, [])
    assert pool.num_in_use == 0


def test_a_pending_extend_pass_is_priced_before_k_and_runs_first():
    """A new request's template is one extend pass, first in the tick whatever the budget,
    and the budget gives the decode steps only the time that pass leaves."""
    def tick(extend_s):
        budget = AdaptiveBudget(0.100, k_max=16, margin=0.0, prior_extend=(8, extend_s))
        budget.observe_decode(1, 0.010)
        budget.observe_decode(2, 0.010)
        policy = LanguagePolicy(max_new_tokens=6, eos_id=None, prompt_template='x')
        scheduler = Scheduler(policy, budget, KVPool(8), max_gen_len=12, max_forced_tokens=4)
        scheduler.allocate_frame_slot(0)
        scheduler.begin_language()
        scheduler.admit(0, [5, 6, 7, 8])
        return scheduler, scheduler.choose_k(elapsed_s=0.020), scheduler.schedule(0.020)

    scheduler, k, plan = tick(0.0)
    assert k == 8 and plan.extend and plan.prompts == [[5, 6, 7, 8]] and plan.gen_lens == [0]
    assert scheduler.active[0].steps_left == 6   # N steps: the pass yields the first token
    scheduler.update(plan, [9], seconds=0.0)
    req = scheduler.active[0]
    assert req.token_ids == [9] and req.gen_len == 4 and req.steps_left == 5
    assert scheduler.schedule(0.020).tokens == [9]   # then decode steps feed what it made
    # A 50 ms pass leaves 30 ms: three 10 ms decode steps, and the pass still runs first.
    _, k, plan = tick(0.050)
    assert k == 3 and plan.extend


def test_a_lower_priority_ahead_of_its_spread_yields_its_step_to_a_question():
    """Narration that earlier slack put ahead of its deadline takes no step while a question
    is live, and its k comes after the question's steps: the tick's time is the question's."""
    from oxygen_ros.engine import LanguageTask
    budget = AdaptiveBudget(0.100, k_max=16, margin=0.0)
    for rows in (1, 2):
        budget.observe_decode(rows, 0.010)
    tasks = (LanguageTask('narration', LanguagePolicy(max_new_tokens=6, every_n_frames=4,
                                                      eos_id=None)),
             LanguageTask('ask', LanguagePolicy(max_new_tokens=5, every_n_frames=0, eos_id=None,
                                                prompt_template='Q: {question}', max_queue=2),
                          priority=10, on_demand=True))
    scheduler = Scheduler(tasks, budget, KVPool(8), max_gen_len=12, max_forced_tokens=4,
                          blocks=KVPool(8))
    rows_per_step = []

    def tick(frame, elapsed_s):   # every step (pass or decode) takes 10 ms
        scheduler.allocate_frame_slot(frame)
        scheduler.begin_language()
        scheduler.admit(frame)
        scheduler.choose_k(elapsed_s)
        while (plan := scheduler.schedule(elapsed_s)) is not None:
            tasks_of = {r.request_id: r.task for r in scheduler.active}
            rows_per_step.append((frame, plan.extend, [tasks_of[i] for i in plan.request_ids]))
            scheduler.update(plan, [2] * plan.size, seconds=0.0)
            elapsed_s += 0.010
        scheduler.end_language()

    tick(0, elapsed_s=0.080)   # 20 ms of slack: narration's first two tokens
    (narration,) = scheduler.active
    assert narration.steps_left == 4 and narration.deadline == 5
    assert scheduler.ask('ask', [7, 8, 9], ticket=1) == ''
    tick(1, elapsed_s=0.070)   # 30 ms: the question's pass and two steps, nothing else
    assert [(e, t) for f, e, t in rows_per_step if f == 1] == [
        (True, ['ask']), (False, ['ask']), (False, ['ask'])]
    assert narration.steps_left == 4   # still on time: 4 steps, 4 frames to its deadline
    tick(2, elapsed_s=0.090)   # narration on schedule again: its step, beside the question's
    assert [t for f, _, t in rows_per_step if f == 2][0] == ['narration', 'ask']
    assert all(r.task == 'narration' for r in scheduler.active)


def test_a_question_steps_before_a_lower_priority_starts():
    """The highest priority's steps come first in a tick: a live question's pass and decode
    step run before the first token of the frame's new narration request."""
    from oxygen_ros.engine import LanguageTask
    tasks = (LanguageTask('narration', LanguagePolicy(max_new_tokens=6, eos_id=None)),
             LanguageTask('ask', LanguagePolicy(max_new_tokens=5, every_n_frames=0, eos_id=None,
                                                prompt_template='Q: {question}', max_queue=2),
                          priority=10, on_demand=True))
    scheduler = Scheduler(tasks, FixedBudget(2), KVPool(8), max_gen_len=12, max_forced_tokens=4,
                          blocks=KVPool(8))
    plans = []
    for frame in range(2):
        if frame == 1:
            assert scheduler.ask('ask', [7, 8, 9], ticket=1) == ''
        scheduler.allocate_frame_slot(frame)
        scheduler.begin_language()
        scheduler.admit(frame)
        scheduler.choose_k(0.0)
        while (plan := scheduler.schedule(0.0)) is not None:
            of = {r.request_id: (r.task, r.origin_frame) for r in scheduler.active}
            kind = 'first' if plan.first_token else 'extend' if plan.extend else 'decode'
            plans.append((frame, kind, sorted(of[i] for i in plan.request_ids)))
            scheduler.update(plan, [2] * plan.size, seconds=0.0)
        scheduler.end_language()
    assert [p[1:] for p in plans if p[0] == 1][:3] == [
        ('extend', [('ask', 1)]), ('decode', [('ask', 1), ('narration', 0)]),
        ('first', [('narration', 1)])]
