"""Benchmark: the quick run end to end, the component model, the token-identity check.

No timing thresholds here: timings on a shared CI machine are noise. What is checked is that
the benchmark measures what it says (columns, files, formulas, the token check catching a
mismatch) and that every system's tokens agree with isolated.
"""

import collections
import csv
import dataclasses
import json
import math

import pytest

from oxygen_ros.bench import run as bench_run
from oxygen_ros.bench.measure import compare_tokens, RequestRecord, summarize, SystemLog
from oxygen_ros.bench.phases import PhaseCosts
from oxygen_ros.bench.plan import (build_groups, divisors, Group, quick_options, round_order,
                                   SystemSpec, WARMUP_FRAMES)
from oxygen_ros.engine.types import ActionOutput, FinishedRequest, FrameResult, TokenDelta, Timings
from oxygen_ros.kv import FinishReason

EXPECTED_RUN_COLUMNS = {
    'sweep', 'workload', 'system', 'label', 'steps', 'n_tokens', 'k', 'arrival_rate', 'lengths',
    'action_hz', 'frame_ms_p50', 'frame_ms_p99', 'act_ms_p50', 'act_ms_p99', 'tokens_per_s',
    'completion_s_p50', 'deadline_miss_pct', 'overhead_pct', 'kv_peak_mb', 'speedup',
    'ideal_speedup', 'speedup_over_ideal', 'speedup_p50_over_ideal', 'act_p50_over_action_only',
    'tokens_identical', 'requests_compared', 'action_max_diff', 'evicted', 'refused',
    'other_load_pct'}
EXPECTED_MEMORY_COLUMNS = {'system', 'peak_rss_mb', 'above_runtime_mb', 'cuda_peak_mb',
                           'above_runtime_vs_action_only'}
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def costs(prefill=0.1, denoise=0.05, decode=None):
    return PhaseCosts(vision_s=0.01, prefill_s=prefill, denoise_s=denoise,
                      decode_s=decode or {1: 0.01, 6: 0.02}, flops={}, memory_bytes={})


# ---- end to end ---------------------------------------------------------------------------

@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
    from oxygen_ros.cli import main

    out = tmp_path_factory.mktemp('bench')
    # float32 as on a machine without fast bf16 (dtype auto's own choice is tested with a
    # faked probe): the memory part then probes the optional bf16 KV store as well
    assert main(['bench', '--quick', '--out', str(out), '--no-progress',
                 '--dtype', 'float32']) == 0
    return out


def test_quick_bench_writes_csv_markdown_and_plots(quick_run):
    runs = read_csv(quick_run / 'runs.csv')
    assert EXPECTED_RUN_COLUMNS <= set(runs[0])
    assert {r['sweep'] for r in runs} == {'nk', 'steps', 'arrivals', 'mixed', 'workloads'}
    assert {'action-only', 'isolated', 'parallel', 'shared', 'oxygen',
            'oxygen-adaptive'} <= {r['system'] for r in runs}
    memory = read_csv(quick_run / 'memory.csv')
    assert EXPECTED_MEMORY_COLUMNS <= set(memory[0])
    assert all(float(m['peak_rss_mb']) > 0 for m in memory)
    # the bf16 KV store of the float32 model is probed too: its pool is about half oxygen's
    pools = {m['kv_dtype']: float(m['kv_pool_mb']) for m in memory if m['system'] == 'oxygen'}
    assert pools['bfloat16'] < 0.55 * pools['float32'], pools
    assert read_csv(quick_run / 'components.csv')
    summary = (quick_run / 'summary.md').read_text()
    for heading in ('## Targets', '## Component model', 'N × k sweep', '## Peak memory'):
        assert heading in summary
    for name in ('tradeoff', 'speedup_heatmap', 'action_hz_vs_n', 'memory'):
        png = (quick_run / f'{name}.png').read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_quick_bench_floors_run_at_the_nodes_threads_not_the_benchmarks(quick_run):
    # The node's default (every core but one) is what a robot's frame runs on; the benchmark
    # process itself runs 2 threads.
    from oxygen_ros.runtime.engine_setup import inference_threads

    result = json.loads((quick_run / 'result.json').read_text())
    assert result['options']['threads'] == 2
    assert result['environment']['machine']['threads'] == inference_threads(0)
    assert 'passes' in result['environment']['floor_compile']   # its own model's, described
    summary = (quick_run / 'summary.md').read_text()
    assert f"{inference_threads(0)} torch threads (the node's" in summary


def test_quick_bench_tokens_match_isolated_everywhere(quick_run):
    runs = read_csv(quick_run / 'runs.csv')
    language = [r for r in runs if r['system'] != 'action-only']
    assert all(r['tokens_identical'] == 'True' for r in language), [
        (r['label'], r['sweep'], r['token_mismatches']) for r in language
        if r['tokens_identical'] != 'True']
    oxygen = [r for r in runs if r['system'] == 'oxygen']
    assert all(int(r['requests_compared']) > 0 for r in oxygen)
    # Actions come from the same frames and noise: identical to float32 tolerance.
    assert all(float(r['action_max_diff']) < 1e-4 for r in runs)


def test_replot_from_result_json(quick_run):
    from oxygen_ros.cli import main

    (quick_run / 'tradeoff.png').unlink()
    assert main(['bench', '--replot', str(quick_run)]) == 0
    assert (quick_run / 'tradeoff.png').read_bytes().startswith(PNG_MAGIC)


def test_memory_probe_measures_the_model_prepared_as_the_node_prepares_it(monkeypatch):
    # The product's memory: fused and packed weights, compiled passes warmed up on the
    # system's own runner and sealed (configure's steps), not an eager model.
    from oxygen_ros.bench import memory
    from oxygen_ros.engine import prepare

    calls = []
    real_prepare, real_warm_up, real_seal = prepare.prepare_model, prepare.warm_up, prepare.seal

    def prepare_model(model, device, setting='auto', **kw):
        calls.append(('prepare', setting))
        return real_prepare(model, device, setting, **kw)

    def warm_up(runner, plan, frames, *args, **kw):
        calls.append(('warm up', runner.kv.k.shape[1], len(frames)))
        return real_warm_up(runner, plan, frames, *args, **kw)

    def seal(model, plan, *args):
        calls.append(('seal',))
        return real_seal(model, plan, *args)

    monkeypatch.setattr(prepare, 'prepare_model', prepare_model)
    monkeypatch.setattr(prepare, 'warm_up', warm_up)
    monkeypatch.setattr(prepare, 'seal', seal)
    args = memory.build_parser().parse_args(
        ['--system', 'oxygen', '--preset', 'tiny', '--compile', 'off', '--n', '4', '--k', '2',
         '--frames', '3'])
    result = memory.probe(args)
    slots = calls[1][1]
    assert calls == [('prepare', 'off'), ('warm up', slots, 1), ('seal',)], calls
    assert slots >= 2   # the oxygen engine's own pool (a request per frame, two live)
    assert result['above_runtime_mb'] > 0 and result['kv_pool_mb'] > 0


# ---- token identity -----------------------------------------------------------------------

def test_compare_tokens_detects_changed_and_accepts_evicted_prefix():
    length, evicted = FinishReason.LENGTH, FinishReason.EVICTED
    ref = {0: RequestRecord((5, 6, 7), length, 2), 1: RequestRecord((8, 9, 10), length, 3)}
    same = {0: RequestRecord((5, 6, 7), length, 0), 1: RequestRecord((8, 9), evicted, 1)}
    check = compare_tokens(ref, same)
    assert check.identical and check.compared == 2
    changed = {0: RequestRecord((5, 6, 7), length, 0), 1: RequestRecord((8, 4, 10), length, 3)}
    check = compare_tokens(ref, changed)
    assert check.identical is False and check.mismatched == [1]
    assert compare_tokens(ref, {}).identical is None


class CorruptingSystem:
    """Wraps a system and flips one token of the first request it finishes."""

    def __init__(self, system):
        self.system = system
        self.corrupted = False

    def step(self, obs):
        result = self.system.step(obs)
        for req in result.finished:
            if not self.corrupted and req.token_ids:
                req.token_ids[-1] += 1
                self.corrupted = True
        return result

    def __getattr__(self, name):
        return getattr(self.system, name)


def test_token_column_detects_an_injected_mismatch(monkeypatch):
    opts = bench_run.BenchOptions.quick_defaults(progress=False)
    make = bench_run.make_bench_system

    def make_corrupt_oxygen(spec, *args, **kwargs):
        system = make(spec, *args, **kwargs)
        return CorruptingSystem(system) if spec.name == 'oxygen' else system

    monkeypatch.setattr(bench_run, 'make_bench_system', make_corrupt_oxygen)
    group = Group('nk', 'libero', 2, 4, (SystemSpec('isolated'), SystemSpec('shared'),
                                         SystemSpec('oxygen', 2)), frames=3)
    models = bench_run.ModelCache(opts)
    with bench_run.tqdm(disable=True) as bar:
        rows, components = bench_run.run_group(group, models, 0.1, opts, bar)
    assert {c['batch'] for c in components} == {1, 2}   # d(1) and d(N/k) = d(4/2)
    by_label = {r['label']: r for r in rows}
    assert by_label['shared']['tokens_identical'] is True
    assert by_label['oxygen k=2']['tokens_identical'] is False
    assert by_label['oxygen k=2']['token_mismatches']


# ---- component model and metrics -------------------------------------------------------

def test_ideal_speedup_formula_on_known_numbers():
    c = dataclasses.replace(costs(prefill=0.1, denoise=0.05, decode={1: 0.01, 6: 0.02}),
                            first_token_s=0.004, frontend_s=0.002)
    F, P, D, f = 0.002, 0.1, 0.05, 0.004
    # N=30: isolated F + 2P + D + f + 29 d(1); the new request's first token is the LM head.
    isolated = F + 2 * P + D + f + 29 * 0.01
    assert c.frame_s(1, 30, prefills=2) == pytest.approx(isolated)
    # k=5: B = 6 live requests; 4 steps of 6 rows, the last of 5 (the new one is done),
    # d(5) interpolated between the measured 1 and 6.
    oxygen = F + P + D + f + 4 * 0.02 + 0.018
    assert c.ideal_speedup(30, 5) == pytest.approx(isolated / oxygen)
    # k = N is the shared baseline: one prefill, N - 1 steps of one row.
    assert c.ideal_speedup(30, 30) == pytest.approx(isolated / (isolated - P))
    # k = 1: B = N; one step of the N - 1 older requests.
    assert c.language_s(6, 1) == pytest.approx(f + 0.018)
    assert c.language_s(6, 0) == 0.0
    group = Group('nk', 'libero', 10, 30, (SystemSpec('isolated'),), frames=1)
    assert bench_run.ideal_speedup(c, group, SystemSpec('oxygen', 5)) == pytest.approx(
        isolated / oxygen)
    assert bench_run.ideal_speedup(c, group, SystemSpec('action-only')) == pytest.approx(
        isolated / (F + P + D))
    assert math.isnan(bench_run.ideal_speedup(
        c, dataclasses.replace(group, arrival_rate=1.0), SystemSpec('oxygen', 5)))
    # The steps after a frame's first measured in a row (2nd, 3rd; later as the 3rd):
    # isolated d(1) + 0.007 + 27 · 0.005; oxygen k=5: d(6), 0.015, 0.01, 0.01, then the 5th
    # step at 5 rows, interpolated between 0.005 (1) and 0.01 (6).
    warm = dataclasses.replace(c, decode_next_s={1: (0.007, 0.005), 6: (0.015, 0.01)})
    assert warm.language_s(1, 30) == pytest.approx(f + 0.01 + 0.007 + 27 * 0.005)
    assert warm.language_s(6, 5) == pytest.approx(f + 0.02 + 0.015 + 0.01 + 0.01 + 0.009)
    assert warm.step_s(6, 1) == 0.015 and warm.step_s(3, 9) == pytest.approx(0.007)
    assert warm.ideal_speedup(30, 5) == pytest.approx(
        (F + 2 * P + D + f + 0.152) / (F + P + D + f + 0.064))
    # A frame's first prefill follows the last frame's steps: after steps of 6 rows (k=5)
    # it costs 0.13, after one row's 0.11 (isolated's second prefill follows its denoise).
    after = dataclasses.replace(warm, prefill_after_s={1: 0.11, 6: 0.13})
    assert after.frame_s(6, 5) == pytest.approx(F + 0.13 + D + f + 0.064)
    assert after.frame_s(1, 30, prefills=2) == pytest.approx(F + 0.11 + P + D + f + 0.152)
    assert after.frame_s(1, 0) == pytest.approx(F + P + D)   # action-only: no steps


def test_phase_probe_samples_every_pass_and_reduces_them():
    from oxygen_ros.bench.phases import NEXT_STEPS, PhaseProbe

    model = bench_run.ModelCache(bench_run.BenchOptions.quick_defaults()).model(2)
    calls = []
    probe = PhaseProbe(model, batches=(1, 3), warmup=1, frontend=lambda: calls.append(1))
    order, passes = [], probe._passes()
    # Wrapped passes show the order they run in.
    probe._passes = lambda: {name: (lambda name=name, fn=fn: order.append(name) or fn())
                             for name, fn in passes.items()}
    probe.sample()
    probe.sample()
    assert all(len(v) == 2 for v in probe.samples.values())
    costs_ = probe.costs(min)
    assert set(costs_.decode_s) == {1, 3}
    assert costs_.prefill_s == min(probe.samples['prefill'])
    assert costs_.first_token_s > 0 and costs_.frontend_s > 0 and len(calls) >= 2
    # Each batch's first step runs right after a frame's passes (as in a tick), the next
    # ones in a row, then the next frame's prefill ('prefill after B').
    first = order[:len(order) // 2]
    at = first.index('decode 1')
    ones = [f'decode 1 #{i}' for i in range(2, 2 + NEXT_STEPS)]
    assert first[at - 3:at + 6 + NEXT_STEPS] == [
        'prefill', 'denoise', 'first token', 'decode 1', *ones, 'prefill after 1', 'denoise',
        'first token', 'decode 3', 'decode 3 #2']
    at += 2 * NEXT_STEPS + 5   # past decode 3's steps
    assert first[at] == 'prefill after 3' and set(costs_.prefill_after_s) == {1, 3}


def test_phase_probe_prefills_the_frames_it_is_given():
    """Prefill costs what a frame holds (packed valid positions): the probe must time the
    benchmark's own frames, a masked camera skipped, P(R) cycling through the workloads."""
    from oxygen_ros.bench.phases import PhaseProbe
    from oxygen_ros.engine import random_observation

    opts = bench_run.BenchOptions.quick_defaults()
    models = bench_run.ModelCache(opts)
    model = models.model(2)
    size = model.config.vision.image_size
    frames = [models.frontend(2, robot).prepare(random_observation(robot, 0, image_size=size))
              .tensors for robot in ('libero', 'aloha')]   # 2 cameras shown, then 3
    probe = PhaseProbe(model, batches=(1,), warmup=0, rows=(2,), frames=frames)
    shown = []
    hook = model.vision.vision_model.register_forward_hook(
        lambda module, args, out: shown.append(args[0].shape[0]) and None)
    try:
        passes = probe._passes()
        for name in ('vision', 'prefill', 'prefill x2'):
            shown.clear()
            passes[name]()
            assert shown == {'vision': [2], 'prefill': [2, 3], 'prefill x2': [5]}[name], name
    finally:
        hook.remove()
    probe.sample()
    assert len(probe.samples['prefill']) == 1 and probe.samples['prefill'][0] > 0


def frame_result(index, total_s, act_s, overhead_s, tokens, finished=(), frontend_s=0.0):
    timings = Timings(prefill_s=0.01, action_s=0.01, decode_s=0.0, overhead_s=overhead_s,
                      total_s=total_s, act_s=act_s, frontend_s=frontend_s)
    action = ActionOutput(index, None, [[0.0]], act_s)
    deltas = [TokenDelta(0, index, list(range(tokens)), '', tokens, False)]
    return FrameResult(frame_index=index, action=action, deltas=deltas, finished=list(finished),
                       k=tokens, decode_steps=tokens, batch_sizes=[1] * tokens,
                       active_requests=1, timings=timings, kv_usage={})


def test_summarize_uses_the_paper_definitions():
    log = SystemLog()
    log.record(0, frame_result(0, 1.0, 0.5, 0.0, 0), math.nan, measured=False)
    done = FinishedRequest(0, 0, [1, 2], '', 'length', 2)
    log.record(1, frame_result(1, 0.1, 0.05, 0.001, 2), math.nan, measured=True)
    log.record(2, frame_result(2, 0.3, 0.05, 0.003, 2, [done], frontend_s=0.002), math.nan,
               measured=True)
    m = summarize(log, horizon=10, deadline_s=0.2)
    assert m['action_hz'] == pytest.approx(10 / 0.2)           # H / mean frame latency
    assert m['tokens_per_s'] == pytest.approx(4 / 0.4)
    assert m['overhead_pct'] == pytest.approx(100 * 0.004 / 0.4)
    # manager overhead: outside model calls less the frontend's conversions
    assert m['manager_pct'] == pytest.approx(100 * 0.002 / 0.4)
    assert m['frontend_ms'] == pytest.approx(1.0)                 # mean of 0 and 2 ms
    assert m['deadline_miss_pct'] == pytest.approx(50.0)
    assert m['completion_s_p50'] == pytest.approx(1.4)         # frames 0..2 back to back


def test_plan_warmup_and_groups():
    assert divisors(30) == [1, 2, 3, 5, 6, 10, 15, 30]
    group = Group('nk', 'libero', 10, 30, (SystemSpec('isolated'), SystemSpec('oxygen', 5)),
                  frames=4)
    assert group.warmup(SystemSpec('oxygen', 5)) == 6 + WARMUP_FRAMES
    assert group.warmup(SystemSpec('shared')) == WARMUP_FRAMES
    assert group.warmup(SystemSpec('isolated')) == group.max_warmup   # the token reference
    assert group.total_frames == 6 + WARMUP_FRAMES + 4
    for g in build_groups(quick_options()):
        assert any(s.name == 'isolated' for s in g.systems)
        assert all(s.k is None or g.n_tokens % s.k == 0 for s in g.systems
                   if s.name == 'oxygen')


def test_round_order_puts_the_parallel_processes_first_and_rotates_the_rest():
    # The system after the parallel baseline finds its weights evicted by the other processes;
    # every in-process system must be that one equally often (it once was oxygen 5 rounds in 6).
    names = ['action-only', 'isolated', 'shared', 'parallel', 'oxygen', 'oxygen-adaptive']
    systems = [SystemSpec(n, 1 if n == 'oxygen' else None) for n in names]
    after_parallel = collections.Counter()
    for r in range(10):
        order = round_order(systems, r)
        assert sorted(s.label for s in order) == sorted(s.label for s in systems)
        assert order[0].name == 'parallel'
        after_parallel[order[1].name] += 1
    assert after_parallel == {n: 2 for n in names if n != 'parallel'}
    # without it: the first system rotates through all
    inside = [s for s in systems if s.name != 'parallel']
    assert [round_order(inside, r)[0].name for r in range(5)] == [s.name for s in inside]


def test_serve_part_reports_the_servers_overhead(tmp_path):
    from oxygen_ros.cli import main

    out = tmp_path / 'serve'
    assert main(['bench', '--quick', '--parts', 'serve', '--out', str(out),
                 '--no-progress']) == 0
    (row,) = read_csv(out / 'serve.csv')
    act, rtt, overhead = (float(row[k]) for k in ('act_ms_p50', 'rtt_ms_p50',
                                                  'overhead_ms_p50'))
    assert 0 < act < rtt and 0 < overhead < rtt
    assert float(row['overhead_fraction_p50']) == pytest.approx(overhead / act)
    assert 'server per-request overhead' in (out / 'summary.md').read_text()


def test_phases_command_times_prefill_on_a_robots_frame(capsys):
    """`oxygen-ros phases --robot libero`: prefill on a frame with a masked camera and padding."""
    from oxygen_ros.cli import main
    from oxygen_ros.model import get_preset

    assert main(['phases', '--preset', 'tiny', '--robot', 'libero', '--repeats', '1',
                 '--batches', '1']) == 0
    out = capsys.readouterr().out
    cfg = get_preset('tiny')
    head = out.splitlines()[0]
    valid = int(head.split('one libero frame: ')[1].split(' of ')[0])
    # LIBERO shows 2 of 3 cameras: at most two images' tokens plus the prompt are valid.
    assert 2 * cfg.tokens_per_image < valid <= 2 * cfg.tokens_per_image + cfg.max_token_len
    assert f'of {cfg.prefix_len} prefix positions valid' in head
    assert '| prefill (vision + backbone) |' in out


def test_build_part_measures_a_random_build_and_a_prepared_checkpoint_load():
    """`bench --parts build`, on the tiny preset: both fresh-process probes run and report
    the peak over the weights (this part ran nowhere else and had broken on an import)."""
    from oxygen_ros.bench.build import run_build_part

    rows = run_build_part('tiny', 'bfloat16', progress=False)
    assert [row['what'] for row in rows] == ['random', 'load']
    for row in rows:
        assert row['weights_mb'] > 0 and row['peak_rss_mb'] >= row['runtime_mb']
        assert math.isfinite(row['peak_over_weights'])
    assert rows[1]['checkpoint_mb'] > 0 and math.isfinite(rows[1]['load_over_weights'])
