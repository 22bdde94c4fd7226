"""π0.5's subtask loop: a task's newest subtask is the action prompt from the next frame on.

On the tiny random model in a replay-like loop (the FrameLoop every adapter runs, one tick per
recorded frame): the prompt the model's frontend got, frame by frame, is the instruction until
a subtask completes, then that subtask from the next frame on, and the instruction again once
it is older than max_age_s; the subtask task's own template keeps the instruction. SubtaskLoop
alone: empty, older and unfinished texts are not adopted. The parameter is checked.
"""

import pytest

from oxygen_ros.engine import (FinishReason, FixedBudget, LanguagePolicy, LanguageTask,
                               make_engine, random_observation)
from oxygen_ros.engine.types import FinishedRequest
from oxygen_ros.runtime.frame_loop import FrameLoop, subtask_loop
from oxygen_ros.runtime.inputs import ObservationResult
from oxygen_ros.runtime.params import check_value, SUBTASK_MAX_AGE_S
from oxygen_ros.runtime.status import build_statuses, WARN
from oxygen_ros.runtime.subtask import INSTRUCTION, SUBTASK, SubtaskLoop
from test_engine import CFG, setup  # noqa: F401 - the model fixture

PERIOD_S = 0.1
INSTRUCTION_TEXT = 'pick up the black bowl'
TEMPLATE = 'Subtask of {instruction}:'


class RecordedFrames:
    """Inputs of a replay: tick i builds recorded frame i (stamp: its tick time)."""

    instruction = None

    def __init__(self):
        self.frame = 0

    def build(self, now_s):
        obs = random_observation('libero', self.frame, seed=1,
                                 image_size=CFG.vision.image_size,
                                 instruction=INSTRUCTION_TEXT)
        obs.stamp = now_s
        self.frame += 1
        return ObservationResult(obs, {}, [], round(now_s * 1e9))


class Sink:
    def __init__(self):
        self.actions, self.finished, self.subtasks = [], [], []
        self.tick = -1

    def action(self, action, stamp_ns):
        self.actions.append(action.frame_index)

    def tokens(self, delta, stamp_ns):
        pass

    def narration(self, request, stamp_ns):
        self.finished.append((self.tick, request))

    def subtask(self, subtask, stamp_ns):
        self.subtasks.append((self.tick, subtask.text if subtask else None))


def replay(model, frontend, max_age_s, every_n_frames, frames):
    """Run `frames` ticks; return (prompt per tick, template texts, sink, loop)."""
    tasks = (LanguageTask('narration', LanguagePolicy(max_new_tokens=3, eos_id=None)),
             LanguageTask('subtask', LanguagePolicy(
                 max_new_tokens=4, every_n_frames=every_n_frames, eos_id=None,
                 prompt_template=TEMPLATE), priority=1, drives_actions=True,
                 max_age_s=max_age_s))
    engine = make_engine('oxygen', model, frontend, tasks, FixedBudget(3), num_slots=8,
                         num_blocks=12)
    robot_frontend = engine.fleet.robots[''].frontend
    prompts, templates = [], []
    prepare, encode = robot_frontend.adapter.prepare, robot_frontend.encode_text

    def recording_prepare(images, state, prompt):
        prompts.append(prompt)
        return prepare(images, state, prompt)

    def recording_encode(text):
        templates.append(text)
        return encode(text)

    robot_frontend.adapter.prepare = recording_prepare
    robot_frontend.encode_text = recording_encode
    sink = Sink()
    loop = FrameLoop.one(engine, RecordedFrames(), sink, PERIOD_S)
    for tick in range(frames):
        sink.tick = tick
        (outcome,) = loop.tick(tick * PERIOD_S, serve_all=True).values()
        assert outcome.action is not None and outcome.action_prompt == prompts[-1]
    return prompts, templates, sink, loop


def expected_prompts(sink, frames, max_age_s):
    """The rule, from what finished when: the newest subtask finished before tick t, if fresh."""
    expected, newest = [], None
    for tick in range(frames):
        for done_tick, request in sink.finished:
            if request.task == 'subtask' and done_tick == tick - 1 and request.text.strip():
                if newest is None or request.origin_frame >= newest.origin_frame:
                    newest = request
        fresh = (newest is not None
                 and (tick - newest.origin_frame) * PERIOD_S <= max_age_s + 1e-9)
        expected.append(newest.text.strip() if fresh else INSTRUCTION_TEXT)
    return expected


def test_the_action_prompt_switches_at_the_frame_after_the_subtask_finishes(setup):  # noqa: F811
    model, frontend = setup
    frames = 9
    prompts, templates, sink, loop = replay(model, frontend, 10.0, 3, frames)
    subtasks = [(tick, r) for tick, r in sink.finished if r.task == 'subtask']
    assert len(subtasks) >= 2 and all(r.text.strip() for _, r in subtasks)
    assert prompts == expected_prompts(sink, frames, 10.0)
    first_done = subtasks[0][0]
    assert prompts[:first_done + 1] == [INSTRUCTION_TEXT] * (first_done + 1)   # not before
    assert prompts[first_done + 1] == subtasks[0][1].text.strip()              # the next frame
    # The subtask task's prompt stays the instruction (its template), never a subtask.
    assert templates and set(templates) == {TEMPLATE.format(instruction=INSTRUCTION_TEXT)}
    # language/subtask: each change at the tick it took effect.
    changes = [(t, p) for t, p in enumerate(prompts) if t and p != prompts[t - 1]]
    assert sink.subtasks == changes
    assert sink.actions == list(range(frames))   # every frame acted: nothing waited
    # /diagnostics: the subtask driving the last frame, its source frame and age
    summary = loop.engine_summary('')['subtask']
    driving = next(r for t, r in reversed(subtasks) if t < frames - 1)
    assert summary['source'] == SUBTASK and summary['text'] == prompts[-1] == driving.text
    assert summary['frame'] == driving.origin_frame
    assert summary['age_s'] == pytest.approx((frames - 1 - summary['frame']) * PERIOD_S)


def test_a_stale_subtask_falls_back_to_the_instruction(setup):  # noqa: F811
    model, frontend = setup
    frames, max_age_s = 10, 0.75
    # frame 0's subtask (the template's forced tokens, then N) completes a few frames later;
    # the next starts at frame 9: it drives until 0.75 s after frame 0, then goes stale.
    prompts, _, sink, loop = replay(model, frontend, max_age_s, 9, frames)
    assert prompts == expected_prompts(sink, frames, max_age_s)
    driven = [t for t, p in enumerate(prompts) if p != INSTRUCTION_TEXT]
    assert driven and driven == list(range(driven[0], driven[-1] + 1))
    stale_tick = driven[-1] + 1
    assert stale_tick < frames and prompts[stale_tick] == INSTRUCTION_TEXT
    assert stale_tick * PERIOD_S > max_age_s >= driven[-1] * PERIOD_S   # age from frame 0
    assert sink.subtasks == [(driven[0], prompts[driven[0]]), (stale_tick, None)]
    assert SUBTASK_MAX_AGE_S != max_age_s   # the task's own age, not the default
    # diagnostics while stale: WARN, the age and the frame it came from
    status = loop.engine_summary('')['subtask']
    assert status['source'] == INSTRUCTION and status['why'] == 'stale'
    assert status['frame'] == 0 and status['age_s'] > max_age_s
    (row,) = [s for s in build_statuses('oxygen_node', 'active', {}, loop.robots[''].stats
                                        .snapshot(), 10.0, loop.engine_summary(''), [], {},
                                        None) if s.name.endswith('subtask')]
    assert row.level == WARN and 'frame 0' in row.message and 'subtask_max_age_s' in row.message


def finished(request_id, frame, text, reason=FinishReason.LENGTH, task='subtask'):
    return FinishedRequest(request_id, frame, [1], text, reason, 1, task=task)


def test_subtask_loop_adopts_only_the_newest_completed_text():
    loop = SubtaskLoop('subtask', 1.0)
    for frame in range(4):
        loop.record_frame(frame, 0.1 * frame, frame)
    assert loop.finished([finished(0, 0, '  ')]) is None and loop.empty == 1
    assert loop.finished([finished(1, 1, 'grasp', FinishReason.EVICTED),
                          finished(2, 1, 'open', task='narration')]) is None
    adopted = loop.finished([finished(3, 1, 'reach '), finished(4, 2, 'grasp')])
    assert (adopted.text, adopted.frame_index, adopted.frame_s) == ('grasp', 2, 0.2)
    assert loop.finished([finished(5, 1, 'late')]) is None   # older than the current one
    assert loop.update(0.25) and loop.driving is adopted and not loop.update(0.3)
    assert loop.action_prompt('task') == 'grasp' and loop.source == SUBTASK
    assert loop.update(1.3) and loop.action_prompt('task') == 'task'   # 1.1 s old: stale
    gone = loop.finished([finished(6, 99, 'unknown frame')])   # its frame's tick unknown
    assert gone.age_s(1.3) == float('inf') and loop.active(1.3) is None
    with pytest.raises(ValueError, match='max age'):
        SubtaskLoop('subtask', 0.0)


def test_only_a_task_that_drives_the_actions_makes_a_subtask_loop_with_the_parameter_age():
    from oxygen_ros.runtime.engine_setup import tasks_for
    from oxygen_ros.runtime.params import Settings

    plain = LanguageTask('narration', LanguagePolicy())
    assert subtask_loop((plain,)) is None
    settings = Settings.from_values({
        'language_tasks': ['narration', 'subtask'], 'tasks.subtask.prompt': TEMPLATE,
        'tasks.subtask.drives_actions': True, 'subtask_max_age_s': 0.7})
    loop = subtask_loop(tasks_for(settings, eos_id=1))
    assert (loop.task, loop.max_age_s) == ('subtask', 0.7)
    assert Settings.from_values({}).subtask_max_age_s == SUBTASK_MAX_AGE_S
    assert check_value('subtask_max_age_s', 2.0) is None
    assert check_value('subtask_max_age_s', 0.0)    # out of range: a reason
    settings, problems = Settings.check({
        'language_tasks': ['narration', 'subtask'], 'tasks.subtask.drives_actions': True})
    assert settings is None   # no prompt: it would decode subtasks from the last subtask
    assert any('tasks.subtask.drives_actions' in p and '{instruction}' in p for p in problems)
