"""Several language tasks per frame: one prefix slot, a generation block per request.

On the tiny random model: every task's greedy tokens equal that task run alone on the same
frames (and the model's own generate() for a task continuing the prefix), with one prefill
per frame; the two-part decode equals the one-slot layout. On the fake runner: priorities
under overload (the lower yields, admitted requests finish) and the KV accounting.
"""

import dataclasses

import numpy as np
import pytest
import torch

from oxygen_ros.engine import (AdaptiveBudget, Engine, FinishReason, FixedBudget,
                               LanguagePolicy, LanguageTask, make_engine, Scheduler)
from oxygen_ros.kv import KVPool
from oxygen_ros.model.pi05 import KVTensors
from test_engine import CFG, obs, oracle, setup  # noqa: F401 - the model fixture
from test_engine_scheduler import FakeClock, FakeFrontend, FakeRunner, reference
from test_engine_scheduler import obs as fake_obs

NARRATE = LanguagePolicy(max_new_tokens=6, eos_id=None)
SUBTASK = LanguagePolicy(max_new_tokens=8, every_n_frames=3, eos_id=None,
                         prompt_template='Subtask of {instruction}:')
ASK = LanguagePolicy(max_new_tokens=4, every_n_frames=2, eos_id=None,
                     prompt_template='Is the gripper open?')
TASKS = (LanguageTask('narration', NARRATE), LanguageTask('subtask', SUBTASK, priority=1),
         LanguageTask('ask', ASK, priority=-1))


def by_task(requests_by_frame):
    """{(task, origin frame): FinishedRequest} of every finished request of a run."""
    return {(f.task, f.origin_frame): f for f in requests_by_frame}


def run_all(system, frames):
    """Like test_engine.run, keeping every task's requests: {(task, frame): FinishedRequest}."""
    finished = []
    prefills = 0
    for frame in frames:
        result = system.step(obs(frame))
        finished += result.finished
        prefills += 1
    while system.num_live_requests:
        finished += system.advance_language().finished
    return by_task(finished), prefills


@pytest.mark.parametrize('budget', [FixedBudget(2), FixedBudget(1)])
def test_each_task_streams_equal_the_task_alone_on_one_prefill(setup, budget):  # noqa: F811
    model, frontend = setup
    frames = range(7)
    # Forced template tokens lengthen a request beyond the N that sizes the pool by default
    # (refusals then, tested below): room for every request here.
    together = make_engine('oxygen', model, frontend, TASKS, budget, num_slots=12,
                           num_blocks=24, debug=True)
    calls = {'prefill': 0}
    prefill = together.runner.prefill

    def counting_prefill(tensors, slot):
        calls['prefill'] += 1
        prefill(tensors, slot)

    together.runner.prefill = counting_prefill
    requests, _ = run_all(together, frames)
    # One prefill per frame, whatever the number of tasks: every request read it in place.
    assert calls['prefill'] == len(frames)
    expected = {(t.name, f) for t in TASKS for f in frames if t.policy.arrivals(f)}
    assert set(requests) == expected
    assert all(r.finish_reason == FinishReason.LENGTH for r in requests.values())
    for task in TASKS:
        alone = make_engine('oxygen', model, frontend, (task,), budget, num_slots=12,
                            debug=True)
        own, _ = run_all(alone, frames)
        assert own, task.name
        for key, req in own.items():
            assert requests[key].token_ids == req.token_ids, key
            assert requests[key].text == req.text
    # The task continuing the prefix equals the model's own generate() on a private prefill.
    for frame in frames:
        reference_tokens = oracle(model, frontend, obs(frame), 6, None)
        assert requests[('narration', frame)].token_ids == reference_tokens
    assert together.pool.num_in_use == 0 and together.blocks.num_in_use == 0


def test_requests_of_a_frame_hold_its_one_slot_and_blocks_of_their_own(setup):  # noqa: F811
    model, frontend = setup
    engine = make_engine('oxygen', model, frontend, TASKS, FixedBudget(1), debug=True)
    engine.step(obs(0))        # frame 0 starts all three tasks
    live = engine.scheduler.active
    assert sorted(r.task for r in live) == ['ask', 'narration', 'subtask']
    assert len({r.slot for r in live}) == 1                          # one prefix slot
    assert len({r.block for r in live}) == 3                         # three blocks
    usage = engine.last_result.kv_usage
    slot = live[0].slot
    assert sorted(usage['holders'][slot]) == sorted(f'request {r.request_id}' for r in live)
    assert usage['slots_in_use'] == 1 and usage['blocks_in_use'] == 3
    assert usage['block_bytes_in_use'] == 3 * engine.runner.store.bytes_per_block
    print(engine.pool)
    print(engine.blocks)


def test_memory_is_the_blocks_of_the_added_tasks(setup):  # noqa: F811 - the fixture
    """A second task adds generation blocks only: no prefix slot, no copy of a prefix."""
    model, frontend = setup
    narration = make_engine('oxygen', model, frontend, NARRATE, FixedBudget(1))
    same_len = LanguagePolicy(max_new_tokens=6, every_n_frames=2, eos_id=None)
    two = make_engine('oxygen', model, frontend,
                      (LanguageTask('narration', NARRATE), LanguageTask('other', same_len)),
                      FixedBudget(1))
    a, b = narration.runner.store, two.runner.store
    assert (a.num_slots, a.bytes_per_slot, a.bytes_per_block) == (
        b.num_slots, b.bytes_per_slot, b.bytes_per_block)
    # narration: 6 ticks a request, one every frame: 7 blocks; 'other' every 2nd frame: 3 + 1
    assert (a.num_blocks, b.num_blocks) == (7, 7 + 4)
    assert b.total_bytes - a.total_bytes == 4 * a.bytes_per_block
    print(f'narration alone {a.total_bytes} B, with a second task {b.total_bytes} B '
          f'({b.total_bytes / a.total_bytes:.2f}x; prefix slot {a.bytes_per_slot} B, block '
          f'{a.bytes_per_block} B)')


@torch.no_grad()
def test_decode_from_a_shared_slot_and_blocks_equals_one_slot_each(setup):  # noqa: F811
    """Two rows on one prefix slot with a block each == each row with the prefix in its slot."""
    model, _ = setup
    from test_model import make_inputs
    P = CFG.prefix_len
    prefix = model.prefill(*make_inputs(CFG, B=1, seed=3), extra_len=8)     # slot 0: P + 8
    L, _, _, G, D = prefix.kv.k.shape
    shared = KVTensors(prefix.kv.k[:, :, :P].clone(), prefix.kv.v[:, :, :P].clone())
    blocks = KVTensors(torch.zeros(L, 3, 9, G, D), torch.zeros(L, 3, 9, G, D))
    one = KVTensors(prefix.kv.k.repeat(1, 2, 1, 1, 1), prefix.kv.v.repeat(1, 2, 1, 1, 1))
    valid, n_valid = prefix.valid.repeat(2, 1), prefix.n_valid.repeat(2)
    fed = [[5, 9, 7, 3], [11, 4, 4]]      # two requests of one frame, different tokens
    for step in range(4):
        rows = [b for b in range(2) if step < len(fed[b])]
        gen_len = torch.tensor([step] * len(rows))
        tokens = torch.tensor([fed[b][step] for b in rows])
        ref = model.decode_step(one, torch.tensor(rows), valid[rows], n_valid[rows], gen_len,
                                tokens)
        out = model.decode_step(shared, torch.tensor([0] * len(rows)), valid[rows],
                                n_valid[rows], gen_len, tokens, gen=blocks,
                                blocks=torch.tensor([2 * b for b in rows]))   # blocks 0, 2
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The shared prefix was only read; each row wrote its own block, nothing else.
    torch.testing.assert_close(shared.k, prefix.kv.k[:, :, :P])
    assert not blocks.k[:, 1].any()


# ---- the fake runner: priorities and accounting --------------------------------------------

def fake_engine(tasks, budget, num_slots, num_blocks, max_gen_len=8, step_s=lambda rows: 0.0):
    clock = FakeClock()
    runner = FakeRunner(num_slots, max_gen_len, clock, step_s)
    scheduler = Scheduler(tasks, budget, KVPool(num_slots, 100), max_gen_len,
                          blocks=KVPool(num_blocks, 10))
    return Engine('fake', scheduler, runner, FakeFrontend(), debug=True, clock=clock)


def fake_run(engine, frames):
    finished, results = [], []
    for frame in frames:
        results.append(engine.step(fake_obs(frame)))
    while engine.num_live_requests:
        results.append(engine.advance_language())
    for result in results:
        finished += result.finished
    return finished, results


def test_low_priority_is_refused_first_and_admitted_requests_finish():
    """A pool too small for both tasks every frame: the high one is admitted, the low yields."""
    high = LanguageTask('high', LanguagePolicy(max_new_tokens=4, eos_id=None), priority=2)
    low = LanguageTask('low', LanguagePolicy(max_new_tokens=4, eos_id=None), priority=0)
    # k = 1: a request lives 4 frames; 5 blocks hold the high task's 4 live requests and one
    # more, which the low task may take when the high one does not need it.
    engine = fake_engine((low, high), FixedBudget(1), num_slots=6, num_blocks=5)
    finished, _ = fake_run(engine, range(12))
    refused = [f for f in finished if f.finish_reason == FinishReason.REFUSED]
    done = [f for f in finished if f.finish_reason.completed]
    assert {f.task for f in refused} == {'low'}
    assert sorted(f.origin_frame for f in done if f.task == 'high') == list(range(12))
    assert any(f.task == 'low' for f in done)            # it ran where a block was free
    for f in done:                                        # every admitted request finished
        assert f.token_ids == reference(f.origin_frame, 4), (f.task, f.origin_frame)
        assert f.frames <= 4                              # by its deadline
    assert all('generation block' in f.error for f in refused)
    assert not [f for f in finished if f.finish_reason == FinishReason.EVICTED]
    assert engine.pool.num_in_use == 0 and engine.blocks.num_in_use == 0


def test_under_overload_the_low_priority_gets_only_its_minimum():
    """Slow steps against the period: the high task takes the spare steps, the low yields."""
    high = LanguageTask('high', LanguagePolicy(max_new_tokens=6, eos_id=None), priority=1)
    low = LanguageTask('low', LanguagePolicy(max_new_tokens=6, eos_id=None), priority=0)
    # A 10 ms tick: a step over 2 rows costs 4 ms, over 4 rows 8 ms. Frames every 3rd tick.
    budget = AdaptiveBudget(0.010, k_max=6, margin=0.0)
    engine = fake_engine((low, high), budget, num_slots=8, num_blocks=14,
                         step_s=lambda rows: 0.002 * rows)
    finished = []
    for tick in range(40):
        engine.runner.clock.now = tick * 0.010
        if tick % 3 == 0 and tick < 24:
            engine.act(fake_obs(tick))
        finished += engine.advance_language(deadline_s=0.010).finished
    done = {f.task: [] for f in finished}
    for f in finished:
        assert f.finish_reason.completed, f
        assert f.token_ids == reference(f.origin_frame, 6)
        done[f.task].append(f.frames)
    assert len(done['high']) == len(done['low']) == 8          # every request finished
    # The high task's requests finish sooner: the budget's spare steps went to it first.
    assert np.mean(done['high']) < np.mean(done['low'])
    assert engine.pool.num_in_use == 0 and engine.blocks.num_in_use == 0


# ---- the parameter YAML ----------------------------------------------------------------------

def test_default_is_narration_alone_with_the_legacy_parameters():
    from oxygen_ros.runtime.engine_setup import tasks_for
    from oxygen_ros.runtime.params import Settings

    settings = Settings.from_values({'tokens_per_request': 7, 'request_every_n_frames': 2,
                                     'language_prompt': 'Describe:'})
    (task,) = settings.tasks
    assert (task.name, task.tokens, task.every_n_frames, task.prompt) == (
        'narration', 7, 2, 'Describe:')                 # no placeholder needed: legacy meaning
    assert task.token_topic == 'language/tokens'
    # questions are one more task, on demand (runtime/questions.py); ask_tokens 0: none
    built, ask = tasks_for(settings, eos_id=1)
    assert built.policy == LanguagePolicy(max_new_tokens=7, every_n_frames=2, eos_id=1,
                                          prompt_template='Describe:')
    assert (ask.name, ask.on_demand, ask.policy.max_new_tokens) == ('ask', True, 10)
    assert ask.policy.requests_per_frame() == 0
    (built,) = tasks_for(dataclasses.replace(settings, ask_tokens=0), eos_id=1)
    assert built.name == 'narration'


def test_tasks_from_a_parameter_yaml(tmp_path):
    from oxygen_ros.runtime.engine_setup import tasks_for
    from oxygen_ros.runtime.params import load_node_params, Settings

    path = tmp_path / 'tasks.yaml'
    path.write_text('''
oxygen_node:
  ros__parameters:
    language_tasks: [narration, subtask, scene]
    tasks:
      subtask: {prompt: 'Subtask of {instruction}:', tokens: 16, every_n_frames: 5,
                priority: 2}
      scene: {prompt: '{instruction}? Describe the scene:', topic: /scene_text,
              priority: -1}
''')
    settings = Settings.from_values(load_node_params(path))
    assert [t.name for t in settings.tasks] == ['narration', 'subtask', 'scene']
    assert [t.token_topic for t in settings.tasks] == [
        'language/tokens', 'language/subtask/tokens', '/scene_text']
    tasks = tasks_for(settings, eos_id=1)
    assert [(t.priority, t.policy.max_new_tokens, t.policy.every_n_frames) for t in tasks] == [
        (0, 10, 1), (2, 16, 5), (-1, 10, 1), (10, 10, 0)]   # the last: questions, on demand
    assert [t.on_demand for t in tasks] == [False, False, False, True]


@pytest.mark.parametrize('values, reason', [
    ({'language_tasks': ['narration', 'subtask'], 'tasks.subtask.tokenz': 3},
     "tasks.subtask.tokenz: unknown key 'tokenz'"),
    ({'tasks.subtask.tokens': 3}, "tasks.subtask.tokens: unknown task 'subtask'"),
    ({'language_tasks': ['narration', 'subtask'], 'tasks.subtask.prompt': 'What next?'},
     'has no {instruction} placeholder'),
    ({'language_tasks': ['narration', 'narration']}, "['narration'] repeated"),
    ({'language_tasks': ['narration', 'a b']}, 'task names must be identifiers'),
    ({'language_tasks': []}, 'at least one task'),
    ({'language_tasks': ['narration', 'x'], 'tasks.x.topic': 'language/tokens'},
     'two tasks publish on one topic'),
    ({'language_tasks': ['narration', 'x'], 'tasks.x.priority': 1000}, 'must be in [-100, 100]'),
    ({'tasks.narration': 3}, 'not a task parameter'),
])
def test_bad_task_parameters_get_a_reason(values, reason):
    from oxygen_ros.runtime.params import Settings

    settings, problems = Settings.check(values)
    assert settings is None
    assert any(reason in p for p in problems), problems
