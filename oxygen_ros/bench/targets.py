"""The benchmark's targets: each with its measured value and whether it is met.

The figures come from the rows of a BenchResult; evaluate_targets is what the summary's table
and the command's [met] / [MISSED] lines print. The parts that own their own targets (overload,
rtc, serve) contribute them here.
"""

from __future__ import annotations

import math

from .fleet_timing import fleet_timing_targets
from .overload import overload_targets
from .tasks import tasks_targets
from .rtc import rtc_targets
from .run import BenchResult
from .serve import serve_targets

TARGET_RATIO_OVER_IDEAL = 0.95
TARGET_ACT_OVER_ACTION_ONLY = 1.05
TARGET_OVERHEAD_PCT_K1 = 2.0
TARGET_MEMORY_OVER_ACTION_ONLY = 1.15
GPU_TARGET_HEADLINE, GPU_TARGET_BEST = 2.98, 3.7
# The node part (issue 10, item 3): oxygen_node process vs the engine alone, one run.
TARGET_NODE_OVER_ENGINE_P50 = 1.10    # node inference_time p50 / engine act() p50
TARGET_RATE_HELD = 0.97               # ticks delivered / asked
TARGET_NODE_MISS_PCT = 2.0            # deadline misses, % of asked ticks
TARGET_NODE_CPU_ACTIVE_PCT = 5.0      # node CPU outside the control thread, % of one core
TARGET_NODE_CPU_IDLE_PCT = 3.0
TARGET_CAMERA_ARRIVED = 14 / 15         # frames that arrive whole / the camera rate (issue 20)
# The robots part (issue 14, item 3): R robots from one FleetEngine, at R = TARGET_ROBOTS.
TARGET_ROBOTS = 4
TARGET_FLEET_HZ_OVER_IDEAL = 0.9      # every robot's Hz / component-model fleet Hz
TARGET_FLEET_OVER_SEPARATE = 1.5      # aggregate Hz, fleet / R separate engines (accelerator)
# On a CPU prefill is compute-bound, so 1.5x sits above what the arithmetic allows (issue 23):
# there the fleet's aggregate must reach the component model's bound, and at R = 2 the fleet
# must not lose to two separate engines.
TARGET_FLEET_OVER_BOUND_CPU = 0.95     # aggregate Hz / (R x the component model's fleet Hz)
TARGET_CPU_SEPARATE_R = 2              # R at which fleet aggregate >= separate aggregate
TARGET_FLEET_MEMORY_OVER_ONE = 1.3    # fleet memory / one single-robot engine
GPU_TARGET_ROBOTS, GPU_TARGET_ROBOT_HZ = 8, 10.0   # pi05 bf16: each of 8 robots >= 10 Hz
# Floors (issue 21): time / floor of a LIBERO frame's phases, per preset.
TARGET_X_FLOOR = {'pi05-cpu': {'action': 3.0, 'denoise': 3.0, 'decode 1': 3.0},
                  'pi05': {'action': 1.5}}
TARGET_DECODE_BANDWIDTH = 0.8         # pi05 decode step: bytes / time >= 80% of copy bandwidth
TARGET_BUILD_OVER_WEIGHTS = 1.3       # peak RSS of building / loading / weights' size


def fmt(value, digits: int = 2) -> str:
    """Format a figure as the tables and the measured text print it ('–': none)."""
    if value is None or value == '':
        return '–'
    if isinstance(value, bool):
        return 'yes' if value else '**NO**'
    if isinstance(value, float):
        return '–' if math.isnan(value) else f'{value:.{digits}f}'
    return str(value)


def sweep_rows(result: BenchResult, sweep: str, **match) -> list[dict]:
    """Return the rows of one sweep whose columns equal `match`."""
    return [r for r in result.rows if r['sweep'] == sweep
            and all(r[key] == value for key, value in match.items())]


def headline_rows(result: BenchResult) -> list[dict]:
    plan = result.options.plan
    return sweep_rows(result, 'nk', n_tokens=plan.headline_n)


def evaluate_targets(result: BenchResult) -> list[dict]:
    """Each target of the benchmark issue with its measured value and whether it is met."""
    plan = result.options.plan
    targets = []
    oxygen_nk = sweep_rows(result, 'nk', system='oxygen')
    for key, stat in (('speedup_over_ideal', 'H / mean frame latency, the paper'),
                      ('speedup_p50_over_ideal', 'H / p50 frame latency, robust to noise')):
        if not oxygen_nk:
            break
        worst = min(oxygen_nk, key=lambda r: r[key])
        met = sum(r[key] >= TARGET_RATIO_OVER_IDEAL for r in oxygen_nk)
        targets.append({
            'target': f'oxygen/isolated ≥ {TARGET_RATIO_OVER_IDEAL:.0%} of ideal at every '
                      f'(N, k) ({stat})',
            'measured': f'min {worst[key]:.1%} at N={worst["n_tokens"]} k={worst["k"]}; '
                        f'{met}/{len(oxygen_nk)} (N, k) met',
            'met': met == len(oxygen_nk)})
    head = [r for r in headline_rows(result)
            if r['system'] == 'oxygen' and r['k'] == plan.headline_k]
    if head and not math.isnan(head[0]['act_p50_over_action_only']):
        r = head[0]
        targets.append({
            'target': f'obs-to-action latency N={plan.headline_n} k={plan.headline_k} ≤ '
                      f'{TARGET_ACT_OVER_ACTION_ONLY:.2f} × action-only (p50)',
            'measured': f'p50 {r["act_p50_over_action_only"]:.3f}×, '
                        f'p99 {r["act_p99_over_action_only"]:.3f}×',
            'met': r['act_p50_over_action_only'] <= TARGET_ACT_OVER_ACTION_ONLY})
    k1 = [r for r in oxygen_nk if r['k'] == 1]
    if k1:
        worst = max(k1, key=lambda r: r['manager_pct'])
        targets.append({
            'target': f'manager overhead at k=1 ≤ {TARGET_OVERHEAD_PCT_K1:g}% of frame time',
            'measured': f'max {worst["manager_pct"]:.2f}% (N={worst["n_tokens"]}; the '
                        f'frontend\'s conversions, alike in every system, another '
                        f'{worst["frontend_ms"]:.2f} ms a frame)',
            'met': worst['manager_pct'] <= TARGET_OVERHEAD_PCT_K1})
    model_dtype = result.options.dtype
    mem = {r['system']: r for r in result.memory
           if r.get('kv_dtype', model_dtype) == model_dtype}
    narrow = [r for r in result.memory if r.get('kv_dtype', model_dtype) != model_dtype]
    if 'oxygen' in mem and 'action-only' in mem:
        key = 'cuda_peak_mb' if result.options.device.startswith('cuda') else 'above_runtime_mb'
        ratio = mem['oxygen'][key] / mem['action-only'][key]
        total = mem['oxygen']['peak_rss_mb'] / mem['action-only']['peak_rss_mb']
        targets.append({
            'target': f'peak memory oxygen ≤ {TARGET_MEMORY_OVER_ACTION_ONLY:.2f} × action-only',
            'measured': f'{ratio:.3f}× ({key.replace("_mb", "")}); {total:.3f}× whole-process '
                        f'RSS; KV pool {mem["oxygen"]["kv_pool_mb"]:.1f} vs '
                        f'{mem["action-only"]["kv_pool_mb"]:.1f} MB' + ''.join(
                            f'; {r["kv_dtype"]} KV store: {r[key] / mem["action-only"][key]:.3f}×'
                            f' (pool {r["kv_pool_mb"]:.1f} MB)' for r in narrow),
            'met': ratio <= TARGET_MEMORY_OVER_ACTION_ONLY})
    targets += floor_targets(result)
    targets += node_targets(result)
    targets += serve_targets(result.serve)
    targets += rtc_targets(result.rtc)
    targets += overload_targets(result.overload)
    targets += tasks_targets(result.tasks, result.task_tokens)
    targets += robots_targets(result)
    targets += fleet_timing_targets(result.fleet_timing)
    if not result.rows:
        return targets
    checked = [r for r in result.rows if r['tokens_identical'] != '']
    oxygen_checked = [r for r in checked if r['system'].startswith('oxygen')]
    bad = [r for r in checked if r['tokens_identical'] is not True]
    targets.append({
        'target': 'tokens identical to isolated, every run',
        'measured': f'{len(checked) - len(bad)}/{len(checked)} runs identical '
                    f'({sum(r["requests_compared"] for r in oxygen_checked)} oxygen requests '
                    'compared)' + (f'; mismatch in {", ".join(r["label"] + " " + r["sweep"] for r in bad)}'  # noqa: E501
                                   if bad else ''),
        'met': not bad and bool(oxygen_checked)})
    if result.options.device.startswith('cuda') and head:
        best = max(oxygen_nk, key=lambda r: r['speedup'])
        targets.append({
            'target': f'GPU: speedup ≥ {GPU_TARGET_HEADLINE} at N=30 k=5, ≥ {GPU_TARGET_BEST} '
                      'best',
            'measured': f'{head[0]["speedup"]:.2f}× at N={plan.headline_n} k={plan.headline_k}; '
                        f'best {best["speedup"]:.2f}× (N={best["n_tokens"]} k={best["k"]})',
            'met': head[0]['speedup'] >= GPU_TARGET_HEADLINE
            and best['speedup'] >= GPU_TARGET_BEST})
    return targets


def floor_targets(result: BenchResult) -> list[dict]:
    """Time / floor of the phases (part floors) and peak RSS of building (part build)."""
    targets = []
    rows = {r['phase']: r for r in result.floors}
    preset = result.options.preset
    for phase, limit in TARGET_X_FLOOR.get(preset, {}).items():
        if phase in rows:
            r = rows[phase]
            targets.append({'target': f'{preset}: {r["label"]} ≤ {limit:g} × floor',
                            'measured': f'{r["x_floor"]:.2f}× ({r["ms"]:.1f} ms vs floor '
                                        f'{r["floor_ms"]:.1f} ms, {r["bound"]})',
                            'met': r['x_floor'] <= limit})
    if preset == 'pi05' and 'decode 1' in rows and 'machine' in result.environment:
        r = rows['decode 1']
        share = r['mb_moved'] * 1e6 / (r['ms'] / 1e3) / \
            result.environment['machine']['copy_bytes_per_s']
        targets.append({'target': f'pi05: decode step ≥ {TARGET_DECODE_BANDWIDTH:.0%} of the '
                                  'copy bandwidth',
                        'measured': f'{share:.0%}', 'met': share >= TARGET_DECODE_BANDWIDTH})
    for r in result.builds:
        what = 'random weights built' if r['what'] == 'random' else 'checkpoint loaded + prepared'
        targets.append({'target': f'{r["preset"]} {what}: peak RSS ≤ '
                                  f'{TARGET_BUILD_OVER_WEIGHTS:g} × weights',
                        'measured': f'{r["peak_over_weights"]:.2f}× ({r["above_runtime_mb"]:.0f}'
                                    f' MB above runtime for {r["weights_mb"]:.0f} MB of weights)',
                        # at pi05's size; a small model's figure is the runtime's noise
                        'met': r['peak_over_weights'] <= TARGET_BUILD_OVER_WEIGHTS
                        if r['preset'] == 'pi05' else None})
    return targets


def node_targets(result: BenchResult) -> list[dict]:
    """Return the node part's targets (met None: not measurable with this node)."""
    if not result.node:
        return []
    r = result.node[0]
    cpu_note = ('' if r['control_thread_found'] else
                f' (no `oxy_control` thread in this node: whole node '
                f'{r["cpu_node_active_pct"]:.1f}% active, {r["cpu_node_idle_pct"]:.1f}% idle)')
    cpu_met = None
    if r['control_thread_found']:
        cpu_met = (r['cpu_outside_control_active_pct'] <= TARGET_NODE_CPU_ACTIVE_PCT
                   and r['cpu_outside_control_idle_pct'] <= TARGET_NODE_CPU_IDLE_PCT)
        if not cpu_met:   # which threads: the busiest three of each window
            cpu_note = '; by thread, % of a core: ' + '; '.join(
                f'{window} ' + ' '.join(r[key].split()[:3])
                for window, key in (('active', 'cpu_threads_active'),
                                    ('idle', 'cpu_threads_idle')) if r.get(key))
    return [
        {'target': f'node inference_time p50 ≤ {TARGET_NODE_OVER_ENGINE_P50:.2f} × engine '
                   'act() p50',
         'measured': f'{r["node_over_engine_p50"]:.3f}× ({r["node_inference_ms_p50"]:.1f} vs '
                     f'{r["engine_act_ms_p50"]:.1f} ms; p99 {r["node_over_engine_p99"]:.2f}×)',
         'met': r['node_over_engine_p50'] <= TARGET_NODE_OVER_ENGINE_P50},
        {'target': f'node rate held ≥ {TARGET_RATE_HELD:.2f} × asked',
         'measured': f'{r["rate_held_over_asked"]:.3f}× ({r["rate_held_hz"]:.2f} of '
                     f'{r["rate_asked_hz"]:.2f} Hz over {r["window_s"]:.0f} s)',
         'met': r['rate_held_over_asked'] >= TARGET_RATE_HELD},
        {'target': f'node deadline misses ≤ {TARGET_NODE_MISS_PCT:g}% at the asked rate',
         'measured': f'{r["deadline_miss_pct"]:.2f}% ({r["late_ticks"]} late, '
                     f'{r["missing_ticks"]} missing of {r["ticks_asked"]:.0f}; the engine '
                     f'alone next to the robot process: '
                     f'{fmt(r.get("engine_loaded_late_pct", math.nan), 1)}% of act() past '
                     'the period)',
         'met': r['deadline_miss_pct'] <= TARGET_NODE_MISS_PCT},
        {'target': f'every camera received at ≥ {TARGET_CAMERA_ARRIVED:.3g} × its rate',
         'measured': f'{fmt(r.get("camera_arrived_hz_min", math.nan), 1)} Hz the slowest of '
                     f'{r["cameras"]} ({fmt(r.get("camera_lost_pct_max", math.nan), 1)}% '
                     'lost in transport)',
         'met': (None if math.isnan(r.get('camera_arrived_hz_min', math.nan)) else
                 r['camera_arrived_hz_min'] >= TARGET_CAMERA_ARRIVED * r['camera_rate_hz'])},
        {'target': f'node CPU outside the control thread ≤ {TARGET_NODE_CPU_ACTIVE_PCT:g}% '
                   f'of a core active, ≤ {TARGET_NODE_CPU_IDLE_PCT:g}% idle',
         'measured': f'{fmt(r["cpu_outside_control_active_pct"], 1)}% active, '
                     f'{fmt(r["cpu_outside_control_idle_pct"], 1)}% idle' + cpu_note,
         'met': cpu_met},
    ]


def robot_rows(result: BenchResult, count: int | None = None) -> dict[str, dict]:
    """Rows of the robots part at R = count (default: the target's R, else the largest)."""
    counts = sorted({r['robots'] for r in result.robots})
    if count is None:
        below = [c for c in counts if c <= TARGET_ROBOTS]
        count = TARGET_ROBOTS if TARGET_ROBOTS in counts else max(below or counts)
    return {r['system']: r for r in result.robots if r['robots'] == count}


def robots_targets(result: BenchResult) -> list[dict]:
    """Return the robots part's targets at R = 4 (or the largest R run below it)."""
    if not result.robots:
        return []
    at = robot_rows(result)
    fleet, separate = at['fleet'], at['separate']
    count = fleet['robots']
    where = f'R={count}' + ('' if count == TARGET_ROBOTS else
                            f' (R={TARGET_ROBOTS} not run)')
    one = robot_rows(result, 1).get('separate')
    key = 'cuda_peak_mb' if result.options.device.startswith('cuda') else 'above_runtime_mb'
    ceiling = fleet['ideal_fleet_hz'] / fleet['ideal_single_hz']
    targets = [
        {'target': f'robots: every robot ≥ {TARGET_FLEET_HZ_OVER_IDEAL:.1f} × the component '
                   f'model\'s fleet rate, R={TARGET_ROBOTS}',
         'measured': f'{where}: min robot {fleet["action_hz_min"]:.2f} Hz / ideal '
                     f'{fleet["ideal_fleet_hz"]:.2f} Hz = {fleet["hz_min_over_ideal"]:.3f}',
         'met': fleet['hz_min_over_ideal'] >= TARGET_FLEET_HZ_OVER_IDEAL},
    ]
    if result.options.device == 'cpu':
        bound = count * fleet['ideal_fleet_hz']
        targets.append({
            'target': f'robots (CPU): aggregate ≥ {TARGET_FLEET_OVER_BOUND_CPU:.2f} × the '
                      'component model\'s bound, same run',
            'measured': f'{where}: {fleet["aggregate_hz"]:.1f} vs {bound:.1f} action rows/s '
                        f'= {fleet["aggregate_hz"] / bound:.2f}×',
            'met': fleet['aggregate_hz'] >= TARGET_FLEET_OVER_BOUND_CPU * bound})
        pair = robot_rows(result, TARGET_CPU_SEPARATE_R)
        if 'fleet' in pair and 'separate' in pair:
            f, s = pair['fleet']['aggregate_hz'], pair['separate']['aggregate_hz']
            targets.append({
                'target': f'robots (CPU): at R={TARGET_CPU_SEPARATE_R} the fleet does not lose '
                          f'to {TARGET_CPU_SEPARATE_R} separate engines',
                'measured': f'{f:.1f} vs {s:.1f} action rows/s = {f / s:.2f}×',
                'met': f >= s})
    else:
        targets.append({
            'target': f'robots: aggregate ≥ {TARGET_FLEET_OVER_SEPARATE:.1f} × {TARGET_ROBOTS} '
                      'separate engines',
            'measured': f'{where}: {fleet["aggregate_hz"]:.1f} vs '
                        f'{separate["aggregate_hz"]:.1f} action rows/s = '
                        f'{fleet["aggregate_hz"] / separate["aggregate_hz"]:.2f}× (sequential '
                        f'{at["sequential"]["aggregate_hz"]:.1f}); the component model '
                        f'allows {ceiling:.2f}× over R engines sharing the device',
            'met': fleet['aggregate_hz'] >= TARGET_FLEET_OVER_SEPARATE * separate['aggregate_hz']})
    if one is not None:
        ratio = fleet[key] / one[key]
        targets.append({
            'target': f'robots: memory ≤ {TARGET_FLEET_MEMORY_OVER_ONE:.1f} × one engine, '
                      f'R={TARGET_ROBOTS}',
            'measured': f'{where}: {ratio:.3f}× {key.replace("_mb", "").replace("_", " ")} '
                        f'({fleet[key]:.0f} vs {one[key]:.0f} MB); whole process RSS '
                        f'{fleet["peak_rss_mb"] / one["peak_rss_mb"]:.3f}×; {count} separate '
                        f'engines {separate[key] / one[key]:.2f}×',

            'met': ratio <= TARGET_FLEET_MEMORY_OVER_ONE})
    checked = [r for r in result.robots if r['tokens_identical'] != '']
    bad = [r for r in checked if r['tokens_identical'] is not True]
    targets.append({
        'target': 'robots: every robot\'s tokens identical to its single-robot engine',
        'measured': f'{len(checked) - len(bad)}/{len(checked)} runs identical '
                    f'({sum(r["requests_compared"] for r in checked)} requests); max action '
                    f'diff {max((r["action_max_diff"] for r in checked), default=math.nan):.1e}',
        'met': bool(checked) and not bad})
    if result.options.device.startswith('cuda'):
        gpu = robot_rows(result, GPU_TARGET_ROBOTS).get('fleet')
        targets.append({
            'target': f'GPU: R={GPU_TARGET_ROBOTS}, each robot ≥ {GPU_TARGET_ROBOT_HZ:g} Hz',
            'measured': 'not run' if gpu is None else f'min robot {gpu["action_hz_min"]:.1f} Hz',
            'met': None if gpu is None else gpu['action_hz_min'] >= GPU_TARGET_ROBOT_HZ})
    return targets
