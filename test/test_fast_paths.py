"""The fast paths: dtype auto, compiled passes == eager, graph breaks pinned, builds in place.

The one inductor compile here runs on MICRO (one layer, two denoise steps): what is tested is
that compiled and eager agree and that the warm-up covers every shape, not the kernels'
speed (that is the benchmark's). Graph breaks are counted by tracing only (explain).
"""

import logging
import math
import time
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from oxygen_ros.bench.phases import PhaseProbe
from oxygen_ros.bench.systems import make_system
from oxygen_ros.engine import (FixedBudget, LanguagePolicy, LanguageTask, make_engine,
                               random_observation, random_setup, UnlimitedBudget)
from oxygen_ros.engine import hardware, prepare
from oxygen_ros.model import get_preset, Pi05Model
from oxygen_ros.model.compiled import CompiledFunction
from oxygen_ros.model.config import GemmaConfig, SiglipConfig
from oxygen_ros.model.pi05 import INIT_BLOCK
from oxygen_ros.runtime import engine_setup
from oxygen_ros.runtime.params import RtcSettings, Settings
from oxygen_ros.runtime.rtc import RtcPlanner

TINY = get_preset('tiny')
MICRO = TINY.replace(backbone=GemmaConfig(32, 1, 64, 2, 1, 16, TINY.backbone.vocab_size),
                     expert=GemmaConfig(16, 1, 32, 2, 1, 16, TINY.backbone.vocab_size),
                     vision=SiglipConfig(16, 1, 2, 32, 7, 28), num_steps=2, action_horizon=2)
# compiled vs eager actions (float32): inductor reorders float sums, nothing more
COMPILED_ACTION_ATOL = 1e-4


INSTRUCTIONS = ('pick up the red block', 'open the drawer', 'push the plate to the left edge')


def observation(frame: int):
    return random_observation('libero', frame, seed=3, image_size=MICRO.vision.image_size,
                              instruction=INSTRUCTIONS[frame % 3])


def run_frames(system, frames):
    actions, tokens = [], {}
    for frame in frames:
        result = system.step(observation(frame))
        actions.append(result.action.normalized)
        tokens.update(((f.task, f.origin_frame), f.token_ids) for f in result.finished)
    while system.num_live_requests:
        system.advance_language()
        tokens.update(((f.task, f.origin_frame), f.token_ids)
                      for f in system.last_result.finished)
    return actions, tokens


@pytest.mark.usefixtures('one_torch_thread')
def test_compiled_passes_equal_eager_and_never_compile_in_a_tick():
    """compile 'on' (inductor): after the runner's warm-up, frames of every shape the engine
    uses run compiled (no eager fallback), tokens equal eager's and actions agree closely.

    Three language tasks: decode rows on one prefix slot, each in its own generation block;
    two templates of instructions of three lengths, so extend passes of one and two rows
    and several prompt lengths (buckets) run compiled. Then extend passes themselves,
    compiled against eager: the same logits up to float rounding, the same K/V written.
    """
    model, frontend = random_setup(MICRO, 'libero', seed=1)
    reference, _ = random_setup(MICRO, 'libero', seed=1)   # same weights, eager, unfused
    plan = prepare.prepare_model(model, 'cpu', 'on')
    if not plan.any:
        pytest.fail(f'compile unavailable on this machine: {plan.reason}')
    tasks = (LanguageTask('narration', LanguagePolicy(max_new_tokens=5, eos_id=None)),
             LanguageTask('subtask', LanguagePolicy(max_new_tokens=3, every_n_frames=2,
                                                    eos_id=None, prompt_template='{instruction}:'),
                          priority=1),
             LanguageTask('scene', LanguagePolicy(max_new_tokens=2, eos_id=None,
                                                  prompt_template='Describe {instruction}'),
                          priority=1))   # the subtask's level: their passes share a call

    def engine(model):
        return make_engine('oxygen', model, frontend, tasks, FixedBudget(2))
    system = engine(model)
    system.runner.warm_up_compiled(frames=[frontend.prepare(observation(99)).tensors],
                                   prompt_len=system.scheduler.max_forced_tokens)
    prepare.seal(model, plan, 0.0)
    extend_rows = []
    extend = system.runner.extend
    system.runner.extend = lambda slots, *rest: extend_rows.append(len(slots)) or extend(
        slots, *rest)
    actions, tokens = run_frames(system, range(5))   # prompts of other lengths than frame 99
    ref_actions, ref_tokens = run_frames(engine(reference), range(5))
    assert {task for task, _ in tokens} == {'narration', 'subtask', 'scene'}
    assert set(extend_rows) == {1, 2}
    compiled = model.compiled_functions
    assert [fn.name for fn in compiled] == ['vision tower', 'prefill layers',
                                            'denoise loop of step regions', 'decode step',
                                            'extend pass']
    assert [(fn.fallbacks, fn.failed) for fn in compiled] == [(0, False)] * 5
    assert tokens and tokens == ref_tokens
    for got, want in zip(actions, ref_actions):
        np.testing.assert_allclose(got, want, atol=COMPILED_ACTION_ATOL, rtol=0)
    # An extend pass compiled == eager: logits and the K/V written into the blocks.
    runner, store = system.runner, system.runner.store
    slots, blocks = torch.tensor([0, 1]), torch.tensor([0, 1])
    gen_len, n_tokens = torch.tensor([0, 3]), torch.tensor([7, 4])
    tokens = torch.randint(2, MICRO.backbone.vocab_size, (2, 8))
    outputs = []
    for compiled_fn in (model._extend_fn, None):
        model._extend_fn = compiled_fn
        logits = model.extend_step(runner.kv, slots, store.prefix_valid[:2], store.n_valid[:2],
                                   gen_len, tokens, n_tokens, gen=runner.gen, blocks=blocks,
                                   attend_len=8)
        outputs.append((logits, store.gen_k[:, :2, :7].clone()))
    (logits, written), (eager_logits, eager_written) = outputs
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(written, eager_written, atol=1e-5, rtol=1e-5)
    # The benchmark's component model probes this sealed model: its own shapes compile while
    # it warms up (its decode is another graph than the engine's), so its samples time
    # compiled passes, never an eager fallback; the model is sealed again after.
    model._extend_fn = compiled[-1]
    probe = PhaseProbe(model, batches=(1, 2), frames=[frontend.prepare(observation(7)).tensors])
    probe.sample()
    assert [(fn.fallbacks, fn.sealed) for fn in compiled] == [(0, True)] * 5


def rtc_chunks(model, frontend, mode: str, frames: int = 4):
    """Chunks of `frames` frames, each continuing the last (real-time chunking, delay 1)."""
    engine = make_engine('oxygen', model, frontend, LanguagePolicy(max_new_tokens=3, eos_id=None),
                         UnlimitedBudget(), seed=1)
    planner = RtcPlanner(RtcSettings(mode, delay=1), 0.05)
    chunks = []
    for i in range(frames):
        obs = observation(i)
        obs.stamp = 0.1 * i
        chunks.append(engine.act(obs, planner.continuation(obs)))
        planner.record(chunks[-1], obs.stamp + 0.06)
        engine.advance_language()
    return chunks


@pytest.mark.usefixtures('one_torch_thread')
def test_rtc_chunks_of_a_compiled_model_equal_eager_and_frozen_rows_stay_exact():
    """compile 'on': guided and prefix chunks (their denoise steps run eager, over the compiled
    prefill's K/V) agree with an eager model's; prefix's frozen row is the committed one."""
    micro = MICRO.replace(action_horizon=8)   # rows left to continue after two have played
    model, frontend = random_setup(micro, 'libero', seed=1)
    reference, _ = random_setup(micro, 'libero', seed=1)
    plan = prepare.prepare_model(model, 'cpu', 'on')
    if not plan.any:
        pytest.fail(f'compile unavailable on this machine: {plan.reason}')
    warm = make_engine('oxygen', model, frontend, LanguagePolicy(max_new_tokens=3, eos_id=None),
                       UnlimitedBudget())
    warm.runner.warm_up_compiled(frames=[frontend.prepare(observation(99)).tensors])
    prepare.seal(model, plan, 0.0)
    for mode in ('guided', 'prefix'):
        chunks = rtc_chunks(model, frontend, mode)
        eager = rtc_chunks(reference, frontend, mode)
        assert [c.start_row for c in chunks] == [0] + [1] * 3   # each continued the last
        for got, want in zip(chunks, eager):
            np.testing.assert_allclose(got.normalized, want.normalized,
                                       atol=COMPILED_ACTION_ATOL, rtol=0)
        if mode == 'prefix':   # the frozen row is the committed one, exactly
            for before, after in zip(chunks, chunks[1:]):
                np.testing.assert_array_equal(after.actions[0], before.actions[2])
    assert [(fn.fallbacks, fn.failed) for fn in model.compiled_functions] == [(0, False)] * 5


@pytest.mark.usefixtures('one_torch_thread')
def test_capacity_times_the_warmed_up_compiled_passes(monkeypatch):
    """The configure-time timing (auto rate) compiles first and times sealed passes: no frame
    it times compiles or runs eager; afterwards the node's own warm-up may compile again."""
    from torch._dynamo.utils import counters

    model, frontend = random_setup(MICRO, 'libero', seed=1)
    plan = prepare.prepare_model(model, 'cpu', 'on')
    seen = {}

    def time_ticks(tick, **options):
        seen['sealed'] = [fn.sealed for fn in model.compiled_functions]
        graphs = counters['stats']['unique_graphs']
        timed = real_time_ticks(tick, **options)
        seen['compiled while timed'] = counters['stats']['unique_graphs'] - graphs
        return timed
    real_time_ticks = engine_setup.time_ticks
    monkeypatch.setattr(engine_setup, 'time_ticks', time_ticks)
    settings = Settings.from_values({'preset': 'tiny', 'control_rate_hz': 0.0})
    capacity = engine_setup.time_capacity(model, frontend, settings, plan=plan)
    assert capacity.frames >= 2 and seen == {'sealed': [True] * 5, 'compiled while timed': 0}
    assert [(fn.sealed, fn.fallbacks) for fn in model.compiled_functions] == [(False, 0)] * 5


@pytest.mark.usefixtures('one_torch_thread')
def test_compiled_denoise_loop_serves_every_batch_of_rows_with_one_graph():
    """compile 'on' on the CPU compiles the denoise loop of step regions: after a warm-up of 1
    and 2 rows (a fleet's), 3 rows run compiled too (the batch is dynamic) and equal eager."""
    model, frontend = random_setup(MICRO, 'libero', seed=1)
    reference, _ = random_setup(MICRO, 'libero', seed=1)
    plan = prepare.prepare_model(model, 'cpu', 'on')
    assert not plan.whole_loop and 'denoise loop of step regions' in plan.describe()
    policy = LanguagePolicy(max_new_tokens=2, eos_id=None)
    runners = [make_system('oxygen', m, frontend, policy, k=1).runner for m in (model, reference)]
    frames = [frontend.prepare(observation(i)).tensors for i in range(3)]
    runners[0].warm_up_compiled(action_rows=(1, 2), frames=frames[:1])
    prepare.seal(model, plan, 0.0)
    noise = np.random.default_rng(4).standard_normal((3, *runners[0].action_shape))
    actions = []
    for runner in runners:
        for slot, tensors in enumerate(frames):
            runner.prefill(tensors, slot)
        actions.append(runner.sample_actions_rows([0, 1, 2], noise.astype(np.float32)))
    assert [(fn.fallbacks, fn.failed) for fn in model.compiled_functions] == [(0, False)] * 5
    np.testing.assert_allclose(actions[0], actions[1], atol=COMPILED_ACTION_ATOL, rtol=0)


@pytest.mark.usefixtures('one_torch_thread')
def test_a_fleet_of_two_runs_its_ticks_compiled_after_the_warm_up():
    """Two robots ticking together (noise and prefix state of both rows in one call) run the
    graphs warmed up for a fleet: no input falls back to eager (broadcast inputs are dense)."""
    from oxygen_ros.engine import FixedBudget, FleetRobot, make_fleet

    model, frontend = random_setup(MICRO, 'libero', seed=1)
    plan = prepare.prepare_model(model, 'cpu', 'on')
    policy = LanguagePolicy(max_new_tokens=3, eos_id=None)
    fleet = make_fleet(model, [FleetRobot(name, frontend, policy, FixedBudget(1), seed=seed)
                               for seed, name in enumerate(('a', 'b'))],
                       max_prefill_rows=1, row_threads=2,
                       **prepare.runner_options(plan, 'cpu'))
    prepare.warm_up(fleet.runner, plan, [frontend.prepare(observation(0)).tensors],
                    engine_setup.action_rows(2))
    prepare.seal(model, plan, 0.0)
    for frame in range(4):
        acted = fleet.act({'a': observation(frame), 'b': observation(frame + 1)})
        assert set(acted.actions) == {'a', 'b'} and not acted.failed
        fleet.advance_language()
    assert [(fn.fallbacks, fn.failed) for fn in model.compiled_functions] == [(0, False)] * 5
    # The row threads' sealed calls overlapped; dynamo's process-wide stance is back.
    assert torch._dynamo.eval_frame._stance.stance == 'default'


def test_sealed_function_runs_eager_for_an_unseen_shape(caplog):
    compiles = []

    def counting_backend(graph, example_inputs):
        compiles.append([tuple(t.shape) for t in example_inputs])
        return graph.forward

    fn = CompiledFunction(lambda x: x * 2, 'double', backend=counting_backend, dynamic=False)
    fn(torch.ones(3))
    fn.seal()
    with caplog.at_level(logging.WARNING):
        torch.testing.assert_close(fn(torch.ones(5)), torch.full((5,), 2.0))
    assert fn.fallbacks == 1 and 'not warmed up' in caplog.text
    assert compiles == [[(3,)]]               # eager: nothing compiled for the new shape
    torch.testing.assert_close(fn(torch.ones(3)), torch.full((3,), 2.0))
    assert fn.fallbacks == 1 and compiles == [[(3,)]]   # the warmed-up graph still serves


def test_a_decode_warmed_up_at_two_rows_serves_every_batch_size_compiled():
    """The runner warms decode at 1 and 2 rows: the graph for B > 1 must take any B. A choice
    on the batch size inside the step (the bf16 GELU kernel's threshold once counted decode
    rows) would tie it to a range, and larger batches (a fleet, N=30 at k=1) ran eager."""
    from oxygen_ros.engine.runner import ModelRunner
    from oxygen_ros.model.gemma import GELU_KERNEL_MIN_ROW_VALUES

    model, frontend = random_setup(MICRO, 'libero', seed=1, dtype=torch.bfloat16)
    plan = prepare.prepare_model(model, 'cpu', 'on')
    if not plan.decode:
        pytest.fail(f'compile unavailable on this machine: {plan.reason}')
    rows = GELU_KERNEL_MIN_ROW_VALUES // MICRO.backbone.mlp_dim + 2   # past the old threshold
    runner = ModelRunner(model, 2, 8, num_blocks=rows)
    runner.warm_up_compiled(frames=[frontend.prepare(observation(0)).tensors])
    prepare.seal(model, plan, 0.0)
    for batch in (3, rows):
        runner.decode([0] * batch, list(range(batch)), [0] * batch, [5] * batch)
    assert (model._decode_fn.fallbacks, model._decode_fn.failed) == (0, False)


def test_a_broadcast_input_runs_the_warmed_up_graph():
    """An expanded input (stride 0: one prefix's n_valid or noise over a batch's rows, as the
    benchmark's phase probe passes) runs the graph warmed up on dense inputs, not eager."""
    fn = CompiledFunction(lambda x, n: x * n[:, None], 'scale', backend='eager', dynamic=False)
    fn(torch.ones(3, 4), torch.ones(3))
    fn.seal()
    one = torch.tensor(2.0)
    torch.testing.assert_close(fn(torch.ones(1, 4).expand(3, 4), one.expand(3)),
                               torch.full((3, 4), 2.0))
    torch.testing.assert_close(fn(torch.ones(3, 4)[:1].expand(3, 4), one.expand(1).expand(3)),
                               torch.full((3, 4), 2.0))
    assert fn.fallbacks == 0


@torch.no_grad()
def test_a_compiled_pass_checks_its_arguments_not_its_models_modules_and_keeps_its_graphs():
    """Dynamo's guards on the model's module tree are dropped (after a frame they are cold:
    ~0.3 ms of pi05-cpu's first decode step), so each pass keeps its graphs to itself: a model
    a layer deeper, called with arguments of the same shapes, runs a graph of its own and
    equals its eager step.
    """
    logits, guards = [], []
    for depth in (2, 3):
        towers = (GemmaConfig(32, depth, 64, 2, 1, 16, MICRO.backbone.vocab_size),
                  GemmaConfig(16, depth, 32, 2, 1, 16, MICRO.backbone.vocab_size))
        model, frontend = random_setup(MICRO.replace(backbone=towers[0], expert=towers[1]),
                                       'libero', seed=5)
        prefix = model.prefill(**frontend.prepare(observation(0)).tensors, extra_len=4)
        step = (prefix.kv, prefix.slots, prefix.valid, prefix.n_valid, torch.tensor([0]),
                torch.tensor([7]))
        eager = model.decode_step(*step, attend_len=2)   # writes the entry the others rewrite
        model.compile_decode(mode=None, backend='eager', dynamic=True)
        logits.append((model.decode_step(*step, attend_len=2), eager))
        guards.append(dict(model._decode_fn.guards))
        model._decode_fn.seal()
        model.decode_step(*step[:-2], torch.tensor([1]), torch.tensor([7]), attend_len=3)
        assert model._decode_fn.fallbacks == 0             # J = 3: the same (dynamic) graph
    for got, want in logits:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[0][0], logits[1][0])   # the two models differ
    for counts in guards:
        assert counts['dropped'] > counts['kept'] > 0, counts


def test_a_mode_becomes_inductor_options_beside_the_guard_filter():
    """torch.compile takes a mode or options, not both: 'reduce-overhead' (CUDA graphs) is
    written as its inductor options, so the guard filter goes with it; another backend keeps
    its mode and every guard."""
    from oxygen_ros.model.compiled import _isolated

    counts = {'kept': 0, 'dropped': 0}
    options = _isolated({'mode': 'reduce-overhead', 'dynamic': True}, counts)
    assert 'mode' not in options and options['isolate_recompiles'] and options['dynamic']
    assert options['options']['triton.cudagraphs'] and 'guard_filter_fn' in options['options']
    assert _isolated({'mode': 'reduce-overhead', 'backend': 'eager'}, counts) == {
        'mode': 'reduce-overhead', 'backend': 'eager', 'options': None}


def test_compile_failure_falls_back_to_eager_logged(caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError('no C++ compiler today')

    fn = CompiledFunction(lambda x: x + 1, 'plus one', backend=broken_backend)
    with caplog.at_level(logging.WARNING):
        torch.testing.assert_close(fn(torch.zeros(2)), torch.ones(2))
    assert fn.failed and 'torch.compile failed, running eager' in caplog.text
    torch.testing.assert_close(fn(torch.zeros(4)), torch.ones(4))


def _meta_model(preset: str) -> Pi05Model:
    with torch.device('meta'):
        return Pi05Model(get_preset(preset))


def test_compile_auto_compiles_where_it_pays(monkeypatch):
    plan = prepare.compile_plan(_meta_model('pi05-cpu'), 'cpu', 'auto')
    assert (plan.vision, plan.prefill, plan.denoise, plan.decode) == (True, True, True, True)
    assert plan.whole_loop and 'denoise loop,' in plan.describe()
    most = prepare.compile_plan(_meta_model('pi05-cpu'), 'cpu', 'max')
    assert (most.vision, most.prefill, most.denoise, most.decode) == (True, True, True, True)
    assert most.whole_loop
    # 'on': the loop of step regions (one step traced), but unrolled for a fleet's row
    # threads (its graph runs from Python, holding the GIL they share, between kernels)
    on = prepare.compile_plan(_meta_model('pi05-cpu'), 'cpu', 'on')
    assert not on.whole_loop and 'denoise loop of step regions' in on.describe()
    assert prepare.compile_plan(_meta_model('pi05-cpu'), 'cpu', 'on', row_threads=2).whole_loop
    # inductor's default mode on the CPU in every dtype (autotuning: minutes, no faster), the
    # graph as one C++ call that releases the GIL; no frozen weights (they defeat the cache)
    assert prepare.compile_settings('cpu') == ('default', {'cpp_wrapper': True})
    assert prepare.compile_settings('cuda') == ('reduce-overhead', {})
    tiny = prepare.compile_plan(_meta_model('tiny'), 'cpu', 'auto')
    assert not tiny.any and 'denoise 0.' in tiny.reason       # test-sized: not worth it
    pi05 = prepare.compile_plan(_meta_model('pi05'), 'cpu', 'auto')
    assert not pi05.any                                         # weight reads dominate
    assert prepare.compile_plan(_meta_model('tiny'), 'cpu', 'on').any
    assert not prepare.compile_plan(_meta_model('pi05-cpu'), 'cpu', 'off').any
    monkeypatch.setattr(prepare, 'unavailable_reason', lambda device: 'no g++ on PATH')
    missing = prepare.compile_plan(_meta_model('pi05-cpu'), 'cpu', 'on')
    assert not missing.any and 'no g++ on PATH' in missing.describe()
    with pytest.raises(ValueError, match='compile'):
        prepare.compile_plan(_meta_model('tiny'), 'cpu', 'sometimes')


@pytest.mark.parametrize('speedup, expected', [(6.5, torch.bfloat16), (1.0, torch.float32),
                                               (0.3, torch.float32)])
def test_dtype_probe_picks_bf16_only_where_it_is_fast(speedup, expected):
    def probe(config, device):
        return speedup, 2e11, speedup * 2e11

    dtype, why = hardware.choose_dtype(get_preset('pi05-cpu'), 'cpu', probe=probe)
    assert dtype == expected
    assert f'{speedup:.1f}x float32' in why and 'GFLOP/s' in why


def test_dtype_probe_times_both_dtypes_in_alternation(monkeypatch):
    """A stall while one dtype is timed must not decide: each is timed in turn, best of each."""
    calls, stalled = [], {'left': 3}
    real_mm = torch.mm

    def mm(a, b):
        calls.append(a.dtype)
        if a.dtype == torch.float32 and len(calls) > 2 and stalled['left']:
            stalled['left'] -= 1       # the first three timed float32 runs hit a stall
            time.sleep(0.01)
        return real_mm(a, b)
    monkeypatch.setattr(torch, 'mm', mm)
    speedup, fp32, bf16 = hardware.bf16_speedup(get_preset('tiny'), 'cpu', rounds=5)
    assert speedup == pytest.approx(bf16 / fp32)
    timed = calls[2:]
    assert timed[:4] == [torch.float32, torch.bfloat16] * 2   # alternating, not one then other
    assert timed.count(torch.float32) >= 5 and timed.count(torch.bfloat16) >= 5
    M, K, N = hardware.probe_shape(get_preset('tiny'))
    assert 2 * M * K * N / fp32 < 0.005, 'the stalled runs are not the best float32 run'


@pytest.mark.parametrize('fast', [True, False])
def test_dtype_auto_at_configure_follows_the_probe(monkeypatch, caplog, fast):
    """The node's configure resolves dtype 'auto' with the probe, and logs which and why."""
    from oxygen_ros.runtime.engine_setup import build_engine
    from oxygen_ros.runtime.params import Settings

    monkeypatch.setattr(hardware, 'bf16_speedup',
                        lambda config, device: (5.0 if fast else 0.5, 1e11, 5e10))
    settings = Settings.from_values({'preset': 'tiny', 'tokens_per_request': 2})
    assert settings.dtype == 'auto' and settings.compile == 'auto'
    with caplog.at_level(logging.INFO, logger='oxygen_ros'):
        engine = build_engine(settings, warmup=False)
    want = 'bfloat16' if fast else 'float32'
    assert engine.system.runner.model.compute_dtype == getattr(torch, want)
    assert engine.description['dtype'] == want and engine.description['kv_dtype'] == want
    assert f'dtype {want}: a ' in caplog.text and 'x float32' in caplog.text


class LiveBytes(TorchDispatchMode):
    """Bytes of CPU tensor storage alive (created under the mode), and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != 'cpu':
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in self._seen:
                self._seen.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, nbytes)
        return out


def test_building_small_in_bf16_never_holds_a_float32_copy():
    cfg = get_preset('small')
    with LiveBytes() as bf16_build:
        model = Pi05Model.build(cfg, torch.bfloat16).init_random(seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    fp32_weights = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert largest * 4 < INIT_BLOCK * 4          # each parameter's noise is one block here
    # the bf16 weights plus one parameter's float32 noise (and its scaled copy) at a time
    assert bf16_build.peak <= weights + 2 * 4 * largest + (1 << 16), (bf16_build.peak, weights)
    assert bf16_build.peak < fp32_weights         # a float32 model never existed
    with LiveBytes() as old_way:   # what random_setup did before: float32, then cast
        Pi05Model(cfg).init_random(seed=0).to_precision(torch.bfloat16)
    assert old_way.peak >= fp32_weights
    # the same weights as the float32 build cast to bf16, bit for bit
    reference = Pi05Model(cfg).init_random(seed=0).to_precision(torch.bfloat16)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name


def test_fused_projections_are_views_and_match_unfused():
    model = Pi05Model(TINY).init_random(seed=5).eval()
    cfg = TINY
    g = torch.Generator().manual_seed(0)
    S = cfg.vision.image_size
    images = torch.rand(1, cfg.num_cameras, 3, S, S, generator=g) * 2 - 1
    masks = torch.tensor([[True, True, False]])
    tokens = torch.randint(3, 500, (1, cfg.max_token_len), generator=g)
    token_masks = torch.arange(cfg.max_token_len)[None] < 9
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)
    with torch.no_grad():
        prefix = model.prefill(images, masks, tokens, token_masks, extra_len=4)
        before = model.sample_actions(prefix, noise), model.lm_logits(prefix.last_hidden)
        params = sum(p.numel() for p in model.parameters())
        model.fuse()
        attn = model.backbone.layers[0].self_attn
        assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()   # a view
        assert sum(p.numel() for p in model.parameters()) == params
        assert set(model.state_dict()) == set(Pi05Model(cfg).state_dict())  # names unchanged
        prefix = model.prefill(images, masks, tokens, token_masks, extra_len=4)
        after = model.sample_actions(prefix, noise), model.lm_logits(prefix.last_hidden)
    for got, want in zip(after, before):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    model.to_precision(torch.bfloat16)      # a cast re-fuses from the cast weights
    assert model.fused and attn.qkv_weight.dtype == torch.bfloat16
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()


def test_floor_is_the_binding_limit_and_work_counts_computed_positions():
    from oxygen_ros.bench.floors import phase_work
    from oxygen_ros.bench.phases import floor_rows, format_phases, PhaseCosts

    model = _meta_model('pi05-cpu')
    libero = phase_work(model, 2, 2 * 256 + 43, (1, 4), 17)
    every = phase_work(model, 3, 968, (1, 4), 17)
    assert libero['prefill'].flops < 0.65 * every['prefill'].flops   # 555 of 968 positions
    assert libero['denoise'] == every['denoise']                     # all P keys by default
    steps = model.config.num_steps   # all work is the steps': the modulations are kept
    assert libero['denoise'].bytes % steps == 0
    packed = phase_work(model, 2, 2 * 256 + 43, (1,), 17, denoise_keys=555)['denoise']
    assert packed.flops < libero['denoise'].flops and packed.bytes < libero['denoise'].bytes
    assert libero['decode 4'].flops == pytest.approx(4 * libero['decode 1'].flops)
    assert libero['decode 4'].bytes < 1.2 * libero['decode 1'].bytes  # weights read once
    machine = hardware.MachinePeaks('cpu', 1, {'float32': 1e11}, 1e10)
    costs = PhaseCosts(0.01, 0.2, 0.05, {1: 0.004, 4: 0.005},
                       {k: w.flops for k, w in libero.items()},
                       {k: w.bytes for k, w in libero.items()}, machine=machine)
    floor, bound = costs.floor('prefill')
    assert bound == 'compute' and floor == pytest.approx(libero['prefill'].flops / 1e11)
    floor, bound = costs.floor('decode 1')
    assert bound == 'memory' and floor == pytest.approx(libero['decode 1'].bytes / 1e10)
    assert costs.floor('action')[0] == pytest.approx(costs.floor('prefill')[0]
                                                     + costs.floor('denoise')[0])
    rows = {r['phase']: r for r in floor_rows(costs, {'denoise': 0.2})}
    assert rows['action']['x_floor'] == pytest.approx(0.25 / costs.floor('action')[0])
    assert rows['denoise']['eager_ms'] == pytest.approx(200) and math.isnan(
        rows['prefill']['eager_ms'])
    table = format_phases(costs, {'denoise': 0.2})
    assert '| x floor |' in table and 'action path' in table


def test_extend_graphs_warmed_for_the_rows_a_pass_can_have():
    """One robot whose templated tasks have levels of their own passes one row at a time (a
    tick starts each level's requests in turn): no graph of several rows is traced at
    configure; two templated tasks on one level, or a fleet, warm that graph too."""
    from oxygen_ros.engine import FleetRobot
    from oxygen_ros.runtime.engine_setup import prompt_rows, tasks_for

    settings = Settings.from_values({
        'language_tasks': ['narration', 'subtask'], 'tasks.subtask.priority': 2,
        'tasks.subtask.prompt': 'Subtask of {instruction}:'})
    tasks = tasks_for(settings, eos_id=1)            # narration, subtask, questions
    assert prompt_rows([FleetRobot('', None, tasks, FixedBudget(1))]) == (1,)
    same_level = tasks[:1] + (LanguageTask('scene', LanguagePolicy(
        prompt_template='Describe {instruction}'), priority=2),) + tasks[1:]
    assert prompt_rows([FleetRobot('', None, same_level, FixedBudget(1))]) == (1, 2)
    fleet = [FleetRobot(name, None, tasks, FixedBudget(1)) for name in ('a', 'b')]
    assert prompt_rows(fleet) == (1, 2)
