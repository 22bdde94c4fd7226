"""Questions (the ask service's core, runtime/questions.py) answered from the newest frame.

On the tiny random model in the frame loop every adapter runs: a question's greedy answer is
the same with narration and a subtask task decoding beside it as asked alone on the same
frame, and the same as a template task carrying the question; it is admitted with the first
frame after it was asked and dated by that frame. Bad questions get a reason at once
(empty, a megabyte, too many tokens, too many open, closed), an ask_prompt without
{question} is a configuration error, and a question no frame takes is answered with why.
"""

import dataclasses

import pytest

from oxygen_ros.engine import FixedBudget, LanguagePolicy, LanguageTask, make_engine
from oxygen_ros.runtime.frame_loop import FrameLoop
from oxygen_ros.runtime.inputs import ObservationResult
from oxygen_ros.runtime.params import ASK_PROMPT, check_value, Settings
from oxygen_ros.runtime.questions import ASK, MAX_OPEN_QUESTIONS, QuestionDesk
from test_engine import setup  # noqa: F401 - the model fixture
from test_subtask import INSTRUCTION_TEXT, RecordedFrames, Sink

PERIOD_S = 0.1
QUESTION = 'what is in the gripper?'
ASK_TASK = LanguageTask(ASK, LanguagePolicy(max_new_tokens=5, every_n_frames=0, eos_id=None,
                                            prompt_template=ASK_PROMPT, max_queue=4),
                        priority=10, on_demand=True)
OTHERS = (LanguageTask('narration', LanguagePolicy(max_new_tokens=4, eos_id=None)),
          LanguageTask('subtask', LanguagePolicy(max_new_tokens=6, every_n_frames=2,
                                                 eos_id=None,
                                                 prompt_template='Subtask of {instruction}:'),
                       priority=2))


def ask_at(model, frontend, tasks, ask_tick, ticks=8, budget=FixedBudget(4)):
    """Run `ticks` frames and on until answered, asking QUESTION before tick `ask_tick`.

    Returns (answers, sink, loop).
    """
    engine = make_engine('oxygen', model, frontend, tasks, budget, num_slots=10,
                         num_blocks=16, debug=True)
    sink = Sink()
    loop = FrameLoop.one(engine, RecordedFrames(), sink, PERIOD_S)
    desk = loop.only.questions
    answers = []
    tick = 0
    while tick < ticks or not answers:
        assert tick < 100, 'never answered'
        if tick == ask_tick:
            assert desk.ask(QUESTION, answers.append) is None
        sink.tick = tick
        loop.tick(tick * PERIOD_S, serve_all=True)
        tick += 1
    return answers, sink, loop


def test_an_answer_equals_the_question_asked_alone_and_a_template_task(setup):  # noqa: F811
    model, frontend = setup
    together, sink, _ = ask_at(model, frontend, OTHERS + (ASK_TASK,), ask_tick=3)
    alone, _, _ = ask_at(model, frontend, (ASK_TASK,), ask_tick=3)
    (answer,), (own,) = together, alone
    assert answer.ok and own.ok, (answer, own)
    # Admitted with the first frame after it was asked (tick 3's), dated by that frame.
    assert answer.frame_index == own.frame_index == 3
    assert answer.stamp_ns == round(3 * PERIOD_S * 1e9)
    assert answer.tokens == 5 and answer.finish_reason == 'length'
    assert answer.text == own.text
    # The other tasks ran beside it on the same prefixes.
    assert {r.task for _, r in sink.finished} >= {'narration', 'subtask', ASK}
    # A task whose template is the question, started at that frame, decodes the same tokens.
    template = ASK_PROMPT.replace('{question}', QUESTION)
    fixed = LanguageTask('fixed', LanguagePolicy(max_new_tokens=5, eos_id=None,
                                                 prompt_template=template))
    engine = make_engine('oxygen', model, frontend, (fixed,), FixedBudget(4), num_slots=12,
                         num_blocks=16, max_forced_tokens=48)
    loop = FrameLoop.one(engine, RecordedFrames(), sink := Sink(), PERIOD_S)
    for tick in range(14):
        loop.tick(tick * PERIOD_S, serve_all=True)
    (request,) = [r for _, r in sink.finished if r.origin_frame == 3]
    asked = [r for _, r in ask_at(model, frontend, (ASK_TASK,), ask_tick=3)[1].finished
             if r.task == ASK]
    assert asked[0].token_ids == request.token_ids
    assert answer.text == request.text.strip()


def test_a_question_template_goes_in_one_extend_pass_at_its_admission(setup):  # noqa: F811
    """The whole prompt (template + question) is one extend pass in the admitting tick, so the
    answer takes N token steps: with k = 4 and N = 5, done one tick after admission."""
    model, frontend = setup
    engine = make_engine('oxygen', model, frontend, OTHERS + (ASK_TASK,), FixedBudget(4),
                         num_slots=10, num_blocks=16, debug=True)
    passes, now = [], [0]   # (tick, prompts) of every extend pass; the tick running
    extend = engine.runner.extend
    engine.runner.extend = lambda slots, blocks, gen_lens, prompts: (
        passes.append((now[0], [list(p) for p in prompts])) or
        extend(slots, blocks, gen_lens, prompts))
    loop = FrameLoop.one(engine, RecordedFrames(), Sink(), PERIOD_S)
    answers = []
    forced = frontend.encode_text(ASK_PROMPT.replace('{question}', QUESTION))
    assert len(forced) > 8
    for tick in range(6):
        if tick == 3:
            assert loop.only.questions.ask(QUESTION, answers.append) is None
        now[0] = tick
        loop.tick(tick * PERIOD_S, serve_all=True)
        if tick == 4:
            assert answers and answers[0].ok and answers[0].tokens == 5, answers
    assert [tick for tick, prompts in passes if forced in prompts] == [3]
    # The subtask's template too: one pass per request (every 2 frames); nothing else
    # (narration has no template).
    subtask = frontend.encode_text(f'Subtask of {INSTRUCTION_TEXT}:')
    assert [tick for tick, prompts in passes if subtask in prompts] == [0, 2, 4]
    assert all(prompt in (forced, subtask) for _, prompts in passes for prompt in prompts)


class Counting:
    """An encode() that counts its calls (a refused megabyte must not be tokenized)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text):
        self.calls += 1
        return list(range(len(text.split()) + 3))


def test_bad_questions_get_a_reason_at_once():
    encode = Counting()
    desk = QuestionDesk(ASK_PROMPT, encode, max_tokens=12, max_chars=500)
    never = []
    assert 'empty' in desk.ask('', never.append).reason
    assert 'empty' in desk.ask(' \n\t\x00 ', never.append).reason
    megabyte = desk.ask('x' * 2**20, never.append)
    assert not megabyte.ok and '1048576 characters' in megabyte.reason
    assert 'at most 500' in megabyte.reason
    assert encode.calls == 0   # refused by its length, never tokenized
    too_long = desk.ask(' '.join(['word'] * 20), never.append)
    assert 'tokens' in too_long.reason and 'at most 12' in too_long.reason
    assert not desk.ask(None, never.append).ok
    for _ in range(MAX_OPEN_QUESTIONS):
        assert desk.ask('where is the bowl?', never.append) is None
    busy = desk.ask('and the plate?', never.append)
    assert f'at most {MAX_OPEN_QUESTIONS}' in busy.reason
    # Closing answers every open question with the reason, and refuses new ones.
    desk.close('node is not active')
    assert len(never) == MAX_OPEN_QUESTIONS
    assert all(not a.ok and a.reason == 'node is not active' for a in never)
    assert desk.ask('where is the bowl?', never.append).reason == 'node is not active'
    desk.open()
    assert desk.ask('where is the bowl?', never.append) is None


def test_a_question_no_frame_takes_is_answered_with_why(setup):  # noqa: F811
    model, frontend = setup
    engine = make_engine('oxygen', model, frontend, (ASK_TASK,), FixedBudget(2), num_slots=4,
                         num_blocks=8)

    class NoFrames:
        instruction = None

        def build(self, now_s):
            return ObservationResult(None, {'camera': 'no frame yet'}, [])

    now = [0.0]
    loop = FrameLoop.one(engine, NoFrames(), Sink(), PERIOD_S)
    desk = loop.only.questions
    desk.clock = lambda: now[0]
    answers = []
    assert desk.ask(QUESTION, answers.append) is None
    tick = 0
    while not answers:
        assert tick < 100, 'never answered'
        now[0] = tick * PERIOD_S
        loop.tick(now[0], serve_all=True)
        tick += 1
    (answer,) = answers
    assert not answer.ok and 'no frame to answer from' in answer.reason
    assert answer.wait_s > desk.admit_timeout_s
    assert not engine.scheduler.num_queued   # withdrawn from the scheduler


def test_a_refused_request_answers_with_the_scheduler_reason(setup):  # noqa: F811
    model, frontend = setup
    # One block, taken by the narration of every frame (questions of a lower priority here):
    # the question is refused, with why.
    low = dataclasses.replace(ASK_TASK, priority=-1)
    engine = make_engine('oxygen', model, frontend, (OTHERS[0], low), FixedBudget(1),
                         num_slots=6, num_blocks=1)
    loop = FrameLoop.one(engine, RecordedFrames(), Sink(), PERIOD_S)
    loop.tick(0.0, serve_all=True)
    answers = []
    assert loop.only.questions.ask(QUESTION, answers.append) is None
    loop.tick(PERIOD_S, serve_all=True)
    (answer,) = answers
    assert not answer.ok and answer.finish_reason == 'refused'
    assert 'generation block' in answer.reason


def test_ask_parameters_are_checked():
    assert 'no {question} placeholder' in check_value('ask_prompt', 'Answer:')
    assert 'only {question}' in check_value('ask_prompt', '{question} {instruction}')
    assert check_value('ask_prompt', ASK_PROMPT) is None
    assert check_value('ask_tokens', 0) is None and check_value('ask_tokens', 513)
    with pytest.raises(ValueError, match='ask_prompt: template .* no {question}'):
        Settings.from_values({'ask_prompt': 'Answer:'})
    with pytest.raises(ValueError, match="'ask' is the task of questions"):
        Settings.from_values({'language_tasks': ['narration', 'ask']})
    settings = Settings.from_values({'ask_tokens': 7, 'ask_priority': -3})
    assert (settings.ask_tokens, settings.ask_priority) == (7, -3)
    with pytest.raises(ValueError, match='no {question}'):
        QuestionDesk('Answer:', lambda text: [], 8, 10)
