"""FleetEngine: R robots through one model and one KV pool.

Fake runner (milliseconds): every robot's streams equal its own reference, decode steps mix
robots, a robot whose frames stop never delays the others, quotas hold under pressure, a bad
observation rejects one robot only. Tiny random model: each robot's tokens and actions equal
those of its own single-robot engine (and the model's generate()).
"""

import threading

import numpy as np
import pytest
import torch

from oxygen_ros.bench.systems import make_system
from oxygen_ros.engine import (FixedBudget, FleetEngine, FleetMember, FleetRobot, Frontend,
                               identity_norm_stats, LanguagePolicy, make_fleet, Observation,
                               random_observation, Scheduler)
from oxygen_ros.kv import KVPool, SlotError
from test_engine import CFG, INSTRUCTIONS, oracle, setup  # noqa: F401 - the model fixture
from test_engine_scheduler import FakeClock, FakeFrontend, FakeRunner, reference

# ---- fakes ------------------------------------------------------------------------------------


class FleetFakeRunner(FakeRunner):
    """FakeRunner with batched rows; a prefill row costs `prefill_s` on the fake clock."""

    def __init__(self, num_slots, max_gen_len, clock, step_s=lambda rows: 0.0, prefill_s=0.0):
        super().__init__(num_slots, max_gen_len, clock, step_s)
        self.prefill_s = prefill_s
        self.prefill_calls = []                 # slots of every prefill_rows call

    def prefill(self, tensors, slot):   # one row: what the engine calls for a lone row
        self.prefill_rows([tensors], [slot])

    def prefill_rows(self, rows, slots):
        self.prefill_calls.append(list(slots))
        for row, slot in zip(rows, slots):
            FakeRunner.prefill(self, row, slot)
        self.clock.now += self.prefill_s * len(slots)

    def sample_actions_rows(self, slots, noise, plans=None):
        return np.stack([self.sample_actions(slot, rows) for slot, rows in zip(slots, noise)])


class TaggedFrontend(FakeFrontend):
    """Robot `tag`'s frame f has the prefix key 10 f + tag: every robot its own streams."""

    def __init__(self, tag):
        self.tag = tag

    def prepare(self, obs):
        prepared = super().prepare(obs)
        prepared.tensors['frame'] = key(obs.frame_index, self.tag)
        return prepared


def key(frame, tag):
    return 10 * frame + tag


def fake_fleet(robots, step_s=lambda rows: 0.0, prefill_s=0.0, frontend=TaggedFrontend,
               max_prefill_rows=None):
    """robots: name -> (tag, policy, budget, quota); frontend(tag) per robot."""
    clock = FakeClock()
    quotas = {name: spec[3] for name, spec in robots.items()}
    max_gen_len = max(spec[1].max_request_len for spec in robots.values()) - 1
    runner = FleetFakeRunner(sum(quotas.values()), max_gen_len, clock, step_s, prefill_s)
    pool = KVPool(sum(quotas.values()), 10)
    blocks = KVPool(sum(quotas.values()), 5)
    shares, block_shares = pool.partition(quotas), blocks.partition(quotas)
    members = [FleetMember(name, Scheduler(policy, budget, shares[name], max_gen_len,
                                           blocks=block_shares[name]),
                           frontend(tag))
               for name, (tag, policy, budget, _) in robots.items()]
    return FleetEngine(members, runner, pool, blocks=blocks, max_prefill_rows=max_prefill_rows,
                       debug=True, clock=clock)


def obs(frame, state=np.zeros(1)):
    return Observation(images={}, state=state, instruction='go', frame_index=frame)


def collect(results):
    """{robot: {origin frame: FinishedRequest}} over a list of FleetResults."""
    out = {}
    for result in results:
        for name, frame_result in result.robots.items():
            out.setdefault(name, {}).update((f.origin_frame, f) for f in frame_result.finished)
    return out


def drain(fleet, results):
    while fleet.num_live_requests:
        results.append(fleet.advance_language())


# ---- the shared pool ------------------------------------------------------------------------

def test_partition_gives_each_owner_its_quota_of_one_pool():
    pool = KVPool(5, 8)
    with pytest.raises(ValueError, match='need 6 slots'):
        pool.partition({'a': 3, 'b': 3})
    with pytest.raises(ValueError, match='quota >= 1'):
        pool.partition({'a': 0})
    shares = pool.partition({'a': 2, 'b': 3})
    with pytest.raises(ValueError, match='already partitioned'):
        pool.partition({'c': 1})
    a, b = shares['a'], shares['b']
    assert [a.allocate('frame 0'), b.allocate('frame 0'), a.allocate('frame 1')] == [0, 1, 2]
    assert a.allocate('frame 2') is None and a.num_refusals == 1     # at its quota
    assert pool.num_free == 2 and b.num_free == 2                    # b's slots stay free
    a.retain(0, 'request 0')
    assert a.holders(0) == ('frame 0', 'request 0')
    assert pool.holders(0) == ('a/frame 0', 'a/request 0')
    with pytest.raises(SlotError):
        b.release(0, 'frame 0')                                      # not b's slot
    with pytest.raises(SlotError):
        b.retain(0, 'request 9')
    assert not a.release(0, 'frame 0') and a.release(0, 'request 0')
    assert a.slots_in_use() == [2] and a.usage()['pool_slots_in_use'] == 2
    for share in shares.values():
        share.check()


# ---- scheduling (fake runner) ------------------------------------------------------------------

@pytest.mark.parametrize('max_prefill_rows', [None, 2])
def test_each_robot_streams_equal_its_own_and_decode_mixes_robots(max_prefill_rows):
    robots = {'a': (1, LanguagePolicy(max_new_tokens=7, eos_id=None), FixedBudget(2), 5),
              'b': (2, LanguagePolicy(max_new_tokens=5, eos_id=None), FixedBudget(1), 6),
              'c': (3, LanguagePolicy(max_new_tokens=4, every_n_frames=2, eos_id=None),
                    FixedBudget(4), 2)}
    fleet = fake_fleet(robots, max_prefill_rows=max_prefill_rows)
    results = []
    for frame in range(8):
        # c runs at half the rate of a and b: its ticks coincide with theirs every other tick.
        names = ['a', 'b'] + (['c'] if frame % 2 == 0 else [])
        results.append(fleet.step({name: obs(frame) for name in names}))
        assert set(results[-1].robots) >= set(names)
        assert results[-1].prefill_rows == len(names)
        for name in names:
            action = results[-1].robots[name].action
            assert action.frame_index == frame
            assert np.all(action.normalized == key(frame, robots[name][0]))
    drain(fleet, results)
    requests = collect(results)
    for name, (tag, policy, *_) in robots.items():
        frames = range(8) if name != 'c' else range(0, 8, 2)
        assert sorted(requests[name]) == list(frames), name
        for frame, req in requests[name].items():
            assert req.token_ids == reference(key(frame, tag), policy.max_new_tokens), name
            assert req.finish_reason == 'length'
    # One prefill call per tick with every framed robot's row (or calls of at most
    # max_prefill_rows rows); decode steps mixed robots.
    calls = [len(c) for c in fleet.runner.prefill_calls]
    assert calls == ([3, 2] * 4 if max_prefill_rows is None else [2, 1, 2] * 4)
    assert max(r.decode_batch_size for r in results) >= 6
    assert fleet.pool.num_in_use == 0
    assert all(m.scheduler.pool.num_in_use == 0 for m in fleet.robots.values())


def test_a_robot_whose_frames_stop_never_delays_the_others():
    policy = LanguagePolicy(max_new_tokens=6, eos_id=None)
    robots = {'a': (1, policy, FixedBudget(2), 4),
              'b': (2, policy, FixedBudget(2), 4)}
    fleet = fake_fleet(robots, prefill_s=0.1)
    results = []
    for frame in range(10):
        # b's cameras stop after frame 2: its ticks carry no observation from then on.
        names = ['a', 'b'] if frame <= 2 else ['a']
        act = fleet.act({name: obs(frame) for name in names})
        # a's actions never wait for b: only the rows that are there run (0.1 s per row).
        assert act.act_s == pytest.approx(0.1 * len(names))
        assert list(act.actions) == names and act.prefill_rows == len(names)
        results.append(fleet.advance_language())
    # b's live requests kept advancing without frames and finished; none was cut short.
    requests = collect(results)
    assert sorted(requests['b']) == [0, 1, 2]
    assert all(r.token_ids == reference(key(f, 2), 6) for f, r in requests['b'].items())
    assert fleet.live_requests('b') == 0 and fleet.scheduler('b').pool.num_in_use == 0
    drain(fleet, results)
    requests = collect(results)
    assert sorted(requests['a']) == list(range(10))
    assert all(r.token_ids == reference(key(f, 1), 6) for f, r in requests['a'].items())


def test_quotas_hold_under_pressure():
    """A chatty robot (N=12 at k=1 needs 13 slots, quota 3) never touches the quiet one's."""
    chatty = LanguagePolicy(max_new_tokens=12, eos_id=None)
    quiet = LanguagePolicy(max_new_tokens=4, eos_id=None)
    robots = {'chatty': (1, chatty, FixedBudget(1), 3),
              'quiet': (2, quiet, FixedBudget(2), 3)}
    fleet = fake_fleet(robots)
    results = []
    for frame in range(12):
        results.append(fleet.step({'chatty': obs(frame), 'quiet': obs(frame)}))
        result = results[-1]
        # Every robot got its action every tick; no share ever went past its quota.
        assert all(result.robots[name].action is not None for name in robots)
        for name in robots:
            usage = result.robots[name].kv_usage
            assert usage['peak_slots_in_use'] <= usage['slots_total'] == 3
    drain(fleet, results)
    requests = collect(results)
    reasons = [r.finish_reason for r in requests['chatty'].values()]
    # Its own newest requests are refused; the ones it admitted all finish.
    assert set(reasons) == {'refused', 'length'} and reasons.count('refused') >= 6
    for frame, req in requests['chatty'].items():
        assert req.token_ids == (reference(key(frame, 1), 12) if req.finish_reason == 'length'
                                 else [])
    assert sorted(requests['quiet']) == list(range(12))
    for frame, req in requests['quiet'].items():
        assert req.finish_reason == 'length' and req.token_ids == reference(key(frame, 2), 4)


def test_bad_observation_rejects_only_that_robot():
    policy = LanguagePolicy(max_new_tokens=3, eos_id=None)
    fleet = fake_fleet({'a': (1, policy, FixedBudget(3), 2),
                        'b': (2, policy, FixedBudget(3), 2)})
    act = fleet.act({'a': obs(0), 'b': obs(0, state=None)})
    assert list(act.actions) == ['a'] and 'no state' in str(act.rejected['b'])
    assert fleet.scheduler('b').pool.num_in_use == 0
    result = fleet.advance_language()
    assert set(result.robots) == {'a'} and result.rejected == act.rejected
    with pytest.raises(ValueError, match="unknown robot 'c'"):
        fleet.act({'c': obs(1)})
    assert fleet.pool.num_in_use == 0


def test_make_fleet_refuses_bad_setups(setup):  # noqa: F811 - the fixture
    model, frontend = setup
    policy = LanguagePolicy(max_new_tokens=3)
    robot = FleetRobot('a', frontend, policy, FixedBudget(1))
    with pytest.raises(ValueError, match='at least one robot'):
        make_fleet(model, [])
    with pytest.raises(ValueError, match='unique'):
        make_fleet(model, [robot, robot])
    with pytest.raises(ValueError, match='max_prefill_rows'):
        make_fleet(model, [robot], max_prefill_rows=0)


# ---- the tiny model: each robot == its own single-robot engine ---------------------------------

def robot_obs(robot, frame):
    return random_observation(robot, frame, seed=1, image_size=CFG.vision.image_size,
                              instruction=INSTRUCTIONS[frame % len(INSTRUCTIONS)])


@pytest.mark.parametrize('max_prefill_rows', [None, 2])
def test_each_robot_equals_its_single_robot_engine(setup, max_prefill_rows):  # noqa: F811
    model, libero = setup
    frontends = {robot: Frontend.from_config(CFG, robot, libero.tokenizer,
                                             identity_norm_stats(robot))
                 for robot in ('libero', 'droid', 'aloha')}
    eos_id = oracle(model, libero, robot_obs('libero', 1), 10, None)[3]
    robots = [FleetRobot('left', frontends['libero'], LanguagePolicy(max_new_tokens=7,
                                                                     eos_id=eos_id),
                         FixedBudget(2), seed=0),
              # Two robots with templates: their new requests share one extend pass.
              FleetRobot('right', frontends['libero'],
                         LanguagePolicy(max_new_tokens=5, eos_id=None,
                                        prompt_template='Describe: '),
                         FixedBudget(1), seed=1),
              FleetRobot('droid', frontends['droid'],
                         LanguagePolicy(max_new_tokens=6, eos_id=None,
                                        prompt_template='Say what the robot sees: '),
                         FixedBudget(3), seed=2),
              FleetRobot('aloha', frontends['aloha'], LanguagePolicy(max_new_tokens=4,
                                                                     eos_id=None),
                         FixedBudget(4), seed=3)]
    fleet = make_fleet(model, robots, max_prefill_rows=max_prefill_rows, debug=True)
    extend_rows = []   # rows of every extend pass of the fleet
    extend = fleet.runner.extend
    fleet.runner.extend = lambda slots, *rest: extend_rows.append(len(slots)) or extend(
        slots, *rest)
    singles = {r.name: make_system('oxygen', model, r.frontend, r.policy, k=r.budget.k,
                                   seed=r.seed, debug=True) for r in robots}
    fleet_requests, single_requests, fleet_results = {}, {}, []
    for frame in range(6):
        # aloha ticks at half the rate; the others every tick.
        framed = [r for r in robots if r.name != 'aloha' or frame % 2 == 0]
        observations = {r.name: robot_obs(r.frontend.robot, frame) for r in framed}
        result = fleet.step(observations)
        fleet_results.append(result)
        for r in framed:
            alone = singles[r.name].step(observations[r.name])
            single_requests.setdefault(r.name, {}).update(
                (f.origin_frame, f.token_ids) for f in alone.finished)
            fleet_action = result.robots[r.name].action
            np.testing.assert_allclose(fleet_action.actions, alone.action.actions, atol=1e-5,
                                       rtol=0)
            np.testing.assert_allclose(fleet_action.normalized, alone.action.normalized,
                                       atol=1e-5, rtol=0)
        for name, frame_result in result.robots.items():
            fleet_requests.setdefault(name, {}).update(
                (f.origin_frame, f.token_ids) for f in frame_result.finished)
    for name, system in singles.items():
        while system.num_live_requests:
            single_requests[name].update((f.origin_frame, f.token_ids)
                                         for f in system.advance_language().finished)
    while fleet.num_live_requests:
        for name, frame_result in fleet.advance_language().robots.items():
            fleet_requests[name].update((f.origin_frame, f.token_ids)
                                        for f in frame_result.finished)
    assert fleet_requests == single_requests
    assert sum(len(v) for v in fleet_requests.values()) == 6 * 3 + 3
    left = fleet_requests['left']
    assert left[1] == oracle(model, libero, robot_obs('libero', 1), 7, eos_id)
    assert any(len(tokens) < 7 for tokens in left.values())     # EOS stopped some
    # Batching really happened across robots: 3-4 prefill rows, decode steps over robots.
    assert {r.prefill_rows for r in fleet_results} == {3, 4}
    assert extend_rows == [2] * 6   # each frame's two templated requests, in one pass
    assert max(r.decode_batch_size for r in fleet_results) > max(
        max(fr.batch_sizes, default=0) for r in fleet_results for fr in r.robots.values())
    assert fleet.pool.num_in_use == 0


def test_batched_rows_equal_rows_alone(setup):  # noqa: F811 - the fixture
    """The runner's batched prefill + denoise against one row at a time, on one store."""
    model, libero = setup
    robots = [FleetRobot(f'r{i}', libero, LanguagePolicy(max_new_tokens=2), FixedBudget(1))
              for i in range(3)]
    runner = make_fleet(model, robots).runner
    rows = [libero.prepare(robot_obs('libero', f)).tensors for f in range(3)]
    noise = np.random.default_rng(0).standard_normal((3,) + runner.action_shape, np.float32)
    runner.prefill_rows(rows, [4, 0, 2])
    batched = runner.sample_actions_rows([4, 0, 2], noise)
    k_batched = runner.store.k[:, [4, 0, 2]].clone()
    for row, slot, rows_noise, expected in zip(rows, [1, 3, 5], noise, batched):
        runner.prefill(row, slot)
        np.testing.assert_allclose(runner.sample_actions(slot, rows_noise), expected,
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(runner.store.k[:, [1, 3, 5]], k_batched, atol=1e-5, rtol=0)
    assert runner.store.n_valid[[4, 0, 2]].tolist() == runner.store.n_valid[[1, 3, 5]].tolist()


def test_rows_side_by_side_equal_rows_in_turn(setup):  # noqa: F811 - the fixture
    """row_threads: each robot's prefill, denoise and token steps on its own thread, same
    outputs as the rows in turn and one batched decode step over every robot's rows."""
    model, libero = setup
    policy = LanguagePolicy(max_new_tokens=3, eos_id=None)

    def robots():
        return [FleetRobot(f'r{i}', libero, policy, FixedBudget(1), seed=i) for i in range(3)]
    threaded = make_fleet(model, robots(), max_prefill_rows=1, row_threads=2, debug=True)
    in_turn = make_fleet(model, robots(), max_prefill_rows=1, debug=True)
    decoding_threads, batched_rows = set(), []
    threaded_decode, in_turn_decode = threaded.runner.decode, in_turn.runner.decode

    def on_row_thread(slots, *args):
        decoding_threads.add(threading.current_thread().name)
        return threaded_decode(slots, *args)

    def batched(slots, *args):
        batched_rows.append(len(slots))
        return in_turn_decode(slots, *args)
    threaded.runner.decode, in_turn.runner.decode = on_row_thread, batched
    try:
        for frame in range(3):
            observations = {f'r{i}': robot_obs('libero', 3 * frame + i) for i in range(3)}
            a, b = threaded.step(observations), in_turn.step(observations)
            for name in observations:
                np.testing.assert_allclose(a.robots[name].action.actions,
                                           b.robots[name].action.actions, atol=1e-5, rtol=0)
                assert ([d.token_ids for d in a.robots[name].deltas]
                        == [d.token_ids for d in b.robots[name].deltas])
        # The rows ran on the engine's row threads, the decode steps too (each robot's own
        # rows); without row threads one step held several robots' rows.
        assert any(t.name.startswith('oxy_rows') for t in threading.enumerate())
        assert decoding_threads and all(n.startswith('oxy_rows') for n in decoding_threads)
        assert max(batched_rows) > 1
    finally:
        threaded.close()
    with pytest.raises(ValueError, match='row_threads'):
        make_fleet(model, robots(), row_threads=0)
