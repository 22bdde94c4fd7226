"""Benchmark output: CSV of every run, a markdown summary with the targets, PNG plots."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib

matplotlib.use('Agg')   # files only, no display; must precede pyplot
from matplotlib.patches import Patch  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .run import BenchResult, save_result  # noqa: E402
from .serve import serve_targets  # noqa: E402

SYSTEM_STYLE = {   # colour, marker per system (oxygen k=... share the oxygen colour)
    'action-only': ('black', 's'), 'isolated': ('tab:red', 'o'), 'parallel': ('tab:purple', 'v'),
    'shared': ('tab:orange', 'D'), 'oxygen': ('tab:blue', 'o'),
    'oxygen-adaptive': ('tab:green', '^'),
}
TARGET_RATIO_OVER_IDEAL = 0.95
TARGET_ACT_OVER_ACTION_ONLY = 1.05
TARGET_OVERHEAD_PCT_K1 = 2.0
TARGET_MEMORY_OVER_ACTION_ONLY = 1.15
GPU_TARGET_HEADLINE, GPU_TARGET_BEST = 2.98, 3.7
NOISY_OTHER_LOAD_PCT = 10.0   # CPU share of other processes above which the summary warns
# The node part (issue 10, item 3): oxygen_node process vs the engine alone, one run.
TARGET_NODE_OVER_ENGINE_P50 = 1.10    # node inference_time p50 / engine act() p50
TARGET_RATE_HELD = 0.97               # ticks delivered / asked
TARGET_NODE_MISS_PCT = 2.0            # deadline misses, % of asked ticks
TARGET_NODE_CPU_ACTIVE_PCT = 5.0      # node CPU outside the control thread, % of one core
TARGET_NODE_CPU_IDLE_PCT = 3.0
# The robots part (issue 14, item 3): R robots from one FleetEngine, at R = TARGET_ROBOTS.
TARGET_ROBOTS = 4
TARGET_FLEET_HZ_OVER_IDEAL = 0.9      # every robot's Hz / component-model fleet Hz
TARGET_FLEET_OVER_SEPARATE = 1.5      # aggregate Hz, fleet / R separate engines side by side
TARGET_FLEET_MEMORY_OVER_ONE = 1.3    # fleet memory / one single-robot engine
GPU_TARGET_ROBOTS, GPU_TARGET_ROBOT_HZ = 8, 10.0   # pi05 bf16: each of 8 robots >= 10 Hz
ROBOT_STYLE = {'fleet': ('tab:blue', 'o'), 'separate': ('tab:red', 'v'),
               'sequential': ('tab:orange', 'D')}
# Floors (issue 21): time / floor of a LIBERO frame's phases, per preset.
TARGET_X_FLOOR = {'pi05-cpu': {'action': 3.0, 'denoise': 3.0, 'decode 1': 3.0},
                  'pi05': {'action': 1.5}}
TARGET_DECODE_BANDWIDTH = 0.8         # pi05 decode step: bytes / time >= 80% of copy bandwidth
TARGET_BUILD_OVER_WEIGHTS = 1.3       # peak RSS of building / loading / weights' size


# ---- files ------------------------------------------------------------------------------------

def write_csv(rows: list[dict], path: Path) -> None:
    """Rows with the union of their keys as columns (first-seen order)."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, 'w', newline='') as out:
        writer = csv.DictWriter(out, columns)
        writer.writeheader()
        writer.writerows(rows)


def write_report(result: BenchResult, out_dir: str | Path) -> dict[str, Path]:
    """Write runs.csv, memory.csv, components.csv, result.json, summary.md, plots; return paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {'runs': out / 'runs.csv', 'components': out / 'components.csv',
             'summary': out / 'summary.md', 'result': out / 'result.json'}
    save_result(result, paths['result'])
    for name, rows in (('runs', result.rows), ('components', result.components)):
        if rows:
            write_csv(rows, paths[name])
        else:
            del paths[name]   # e.g. --parts node: no sweep ran
    if result.serve:
        paths['serve'] = out / 'serve.csv'
        write_csv(result.serve, paths['serve'])
    if result.node:
        paths['node'] = out / 'node.csv'
        write_csv(result.node, paths['node'])
        paths['node_ticks'] = out / 'node_ticks.csv'
        write_csv(result.node_ticks, paths['node_ticks'])
    if result.memory:
        paths['memory'] = out / 'memory.csv'
        write_csv(result.memory, paths['memory'])
    for name, rows in (('floors', result.floors), ('builds', result.builds)):
        if rows:
            paths[name] = out / f'{name}.csv'
            write_csv(rows, paths[name])
    if result.robots:
        paths['robots'] = out / 'robots.csv'
        write_csv(result.robots, paths['robots'])
    paths.update(write_plots(result, out))
    paths['summary'].write_text(summary_markdown(result, paths))
    return paths


# ---- markdown -----------------------------------------------------------------------------

def fmt(value, digits: int = 2) -> str:
    if value is None or value == '':
        return '–'
    if isinstance(value, bool):
        return 'yes' if value else '**NO**'
    if isinstance(value, float):
        return '–' if math.isnan(value) else f'{value:.{digits}f}'
    return str(value)


def table(header: list[str], rows: list[list]) -> str:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(fmt(v) if not isinstance(v, str) else v for v in row) + ' |'
              for row in rows]
    return '\n'.join(lines)


def _rows(result: BenchResult, sweep: str, **match) -> list[dict]:
    return [r for r in result.rows if r['sweep'] == sweep
            and all(r[key] == value for key, value in match.items())]


def headline_rows(result: BenchResult) -> list[dict]:
    plan = result.options.plan
    return _rows(result, 'nk', n_tokens=plan.headline_n)


def evaluate_targets(result: BenchResult) -> list[dict]:
    """Each target of the benchmark issue with its measured value and whether it is met."""
    plan = result.options.plan
    targets = []
    oxygen_nk = _rows(result, 'nk', system='oxygen')
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
        worst = max(k1, key=lambda r: r['overhead_pct'])
        targets.append({
            'target': f'manager overhead at k=1 ≤ {TARGET_OVERHEAD_PCT_K1:g}% of frame time',
            'measured': f'max {worst["overhead_pct"]:.2f}% (N={worst["n_tokens"]})',
            'met': worst['overhead_pct'] <= TARGET_OVERHEAD_PCT_K1})
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
    targets += robots_targets(result)
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
        what = 'random weights built' if r['what'] == 'random' else 'checkpoint loaded + fused'
        targets.append({'target': f'{r["preset"]} {what}: peak RSS ≤ '
                                  f'{TARGET_BUILD_OVER_WEIGHTS:g} × weights',
                        'measured': f'{r["peak_over_weights"]:.2f}× ({r["above_runtime_mb"]:.0f}'
                                    f' MB above runtime for {r["weights_mb"]:.0f} MB of weights)',
                        # at pi05's size; a small model's figure is the runtime's noise
                        'met': r['peak_over_weights'] <= TARGET_BUILD_OVER_WEIGHTS
                        if r['preset'] == 'pi05' else None})
    return targets


def floors_section(result: BenchResult) -> list[str]:
    """Lead with the ratio to the floor: each phase of a frame against this machine's limit."""
    if not result.floors:
        return []
    env, opts = result.environment, result.options
    machine = env.get('machine', {})
    rates = ', '.join(f'{name} {flops / 1e9:.0f} GFLOP/s'
                      for name, flops in machine.get('matmul_flops', {}).items())
    compiled = next(iter(env.get('compile', {}).values()), {})
    action = next(r for r in result.floors if r['phase'] == 'action')
    return [f'## At the machine\'s limit: the action path runs at {action["x_floor"]:.1f}× its '
            f'floor', '',
            f'{opts.preset}, one {opts.plan.workloads[0]} frame, {opts.dtype} '
            f'({env.get("dtype_reason", "")}), {env.get("torch_threads")} torch threads. '
            f'Measured in this run: matmul {rates}; copy '
            f'{machine.get("copy_bytes_per_s", 0) / 1e9:.1f} GB/s. Passes '
            f'{compiled.get("passes", "eager")}; warm-up and compile '
            f'{compiled.get("warm_up_s", 0):.0f} s.', '',
            table(['phase', 'ms', 'eager ms', 'GFLOP', 'MB moved', 'floor ms', 'bound',
                   '× floor'],
                  [[r['label'], r['ms'], r['eager_ms'], r['gflop'], r['mb_moved'],
                    r['floor_ms'], r['bound'], r['x_floor']] for r in result.floors]), '',
            'floor = max(GFLOP / matmul peak of the dtype, MB moved / copy bandwidth); work '
            'counts the positions computed (floors.py). eager: the same pass with compilation '
            'off, timed side by side.', '']


def build_section(result: BenchResult) -> list[str]:
    """Peak RSS of building random weights and of loading a checkpoint (part build)."""
    if not result.builds:
        return []
    loads = ', '.join(f'{r.get("load_over_weights", math.nan):.2f}× weights'
                      for r in result.builds if r['what'] == 'load')
    return ['## Building at the model\'s size (fresh process each)', '',
            table(['preset', 'dtype', 'what', 'weights MB', 'peak RSS MB', 'above runtime MB',
                   '/ weights', 's'],
                  [[r['preset'], r['dtype'], r['what'], r['weights_mb'], r['peak_rss_mb'],
                    r['above_runtime_mb'], r['peak_over_weights'], r['seconds']]
                   for r in result.builds]), '',
            "'load' = load_pi05 (memory-mapped) then fuse, as configure does; load alone: "
            f'{loads}.', '']


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
        {'target': f'node CPU outside the control thread ≤ {TARGET_NODE_CPU_ACTIVE_PCT:g}% '
                   f'of a core active, ≤ {TARGET_NODE_CPU_IDLE_PCT:g}% idle',
         'measured': f'{fmt(r["cpu_outside_control_active_pct"], 1)}% active, '
                     f'{fmt(r["cpu_outside_control_idle_pct"], 1)}% idle' + cpu_note,
         'met': cpu_met},
    ]


def _robot_rows(result: BenchResult, count: int | None = None) -> dict[str, dict]:
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
    at = _robot_rows(result)
    fleet, separate = at['fleet'], at['separate']
    count = fleet['robots']
    where = f'R={count}' + ('' if count == TARGET_ROBOTS else
                            f' (R={TARGET_ROBOTS} not run)')
    one = _robot_rows(result, 1).get('separate')
    key = 'cuda_peak_mb' if result.options.device.startswith('cuda') else 'above_runtime_mb'
    ceiling = fleet['ideal_fleet_hz'] / fleet['ideal_single_hz']
    targets = [
        {'target': f'robots: every robot ≥ {TARGET_FLEET_HZ_OVER_IDEAL:.1f} × the component '
                   f'model\'s fleet rate, R={TARGET_ROBOTS}',
         'measured': f'{where}: min robot {fleet["action_hz_min"]:.2f} Hz / ideal '
                     f'{fleet["ideal_fleet_hz"]:.2f} Hz = {fleet["hz_min_over_ideal"]:.3f}',
         'met': fleet['hz_min_over_ideal'] >= TARGET_FLEET_HZ_OVER_IDEAL},
        {'target': f'robots: aggregate ≥ {TARGET_FLEET_OVER_SEPARATE:.1f} × {TARGET_ROBOTS} '
                   'separate engines',
         'measured': f'{where}: {fleet["aggregate_hz"]:.1f} vs {separate["aggregate_hz"]:.1f} '
                     f'action rows/s = {fleet["aggregate_hz"] / separate["aggregate_hz"]:.2f}×'
                     f' (sequential {at["sequential"]["aggregate_hz"]:.1f}); the component '
                     f'model allows {ceiling:.2f}× over R engines sharing the device',

         'met': fleet['aggregate_hz'] >= TARGET_FLEET_OVER_SEPARATE * separate['aggregate_hz']},
    ]
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
        gpu = _robot_rows(result, GPU_TARGET_ROBOTS).get('fleet')
        targets.append({
            'target': f'GPU: R={GPU_TARGET_ROBOTS}, each robot ≥ {GPU_TARGET_ROBOT_HZ:g} Hz',
            'measured': 'not run' if gpu is None else f'min robot {gpu["action_hz_min"]:.1f} Hz',
            'met': None if gpu is None else gpu['action_hz_min'] >= GPU_TARGET_ROBOT_HZ})
    return targets


def robots_section(result: BenchResult, paths: dict[str, Path]) -> list[str]:
    """Markdown of the robots part: per R, the three systems side by side."""
    if not result.robots:
        return []
    first = result.robots[0]
    chunk = result.options.plan.robot_prefill_rows
    chunk_text = ('all R rows in one call' if chunk == 0 else f'{chunk} row(s) per call'
                  if chunk else '1 row per call on the CPU, all R on an accelerator')
    lines = [f'## Several robots, one engine (N={first["n_tokens"]}, k={first["k"]}, '
             f'S={first["steps"]}, {first["frames"]} measured ticks)', '',
             'fleet = one process, one model, one FleetEngine (prefills of the R frames: '
             f'{chunk_text}; one denoise over the R frames, decode steps over every robot\'s '
             'requests); separate = R '
             'processes with a single-robot engine each, side by side; sequential = one model, '
             'R single-robot engines served in turn. Robot Hz = H / mean frame time (fleet, '
             'sequential: the tick); latency = observation to actions (sequential: from the '
             'tick\'s start); aggregate = every robot\'s action rows / wall time of the '
             'measured window. Ideal per robot: fleet H / (P_c(R) + D(R) + k·d(R·⌈N/k⌉)) with '
             'P_c(R) the prefills in calls of c rows, separate and sequential '
             'H / (R · (P + D + k·d(⌈N/k⌉))).', '',
             table(['R', 'system', 'robot Hz min / mean', 'ideal Hz', 'min / ideal',
                    'latency p50 / p99 ms', 'aggregate rows/s', 'tok/s', 'peak RSS MB',
                    'above runtime MB', 'CUDA peak MB', 'KV MB', 'tokens identical',
                    'other load %'],
                   [[r['robots'], r['system'],
                     f'{r["action_hz_min"]:.2f} / {r["action_hz_mean"]:.2f}',
                     r['ideal_fleet_hz' if r['system'] == 'fleet' else 'ideal_single_hz'],
                     r['hz_min_over_ideal'],
                     f'{r["latency_ms_p50"]:.0f} / {r["latency_ms_p99_max"]:.0f}',
                     r['aggregate_hz'], r['tokens_per_s'], r['peak_rss_mb'],
                     r['above_runtime_mb'], r['cuda_peak_mb'], r['kv_pool_mb'],
                     r['tokens_identical'],
                     r['other_load_pct']] for r in result.robots]), '',
             'Component model per R (sampled in the benchmark process between the runs):', '',
             table(['R', 'P(R) one call ms', 'rows per call c', 'P_c(R) ms', 'D(R) ms',
                    'd(R·⌈N/k⌉) ms', 'fleet tick ms', 'one robot alone ms'],
                   [[r['robots'], r['comp_prefill_one_call_ms'], r['prefill_rows_per_call'],
                     r['comp_prefill_ms'], r['comp_denoise_ms'], r['comp_decode_ms'],
                     r['comp_fleet_tick_ms'], r['comp_single_frame_ms']]
                    for r in result.robots if r['system'] == 'fleet']), '']
    if 'robots_hz' in paths:
        lines += [f'![robots vs Hz]({paths["robots_hz"].name})', '']
    return lines


def node_section(result: BenchResult, paths: dict[str, Path]) -> list[str]:
    """Markdown of the node part: node vs engine, rate, misses, tokens, CPU."""
    if not result.node:
        return []
    r = result.node[0]
    lines = [f'## The node: oxygen_node process vs the engine alone ({r["robot"]}, '
             f'N={r["n_tokens"]}, k={r["k"]}, cameras {r["cameras"]})', '',
             f'Engine first ({r["engine_frames"]} frames in the benchmark process, nothing '
             f'else running; then {r.get("engine_loaded_frames", 0)} frames while the '
             'stand-in robot publishes, no node), then the node at the asked rate '
             f'({r["rate_source"]}) with a stand-in robot and a monitor process, measured '
             f'over {r["window_s"]:.0f} s after {r["warmup_s"]:g} s of warm-up.', '',
             table(['', 'engine alone', 'engine next to the robot', 'node',
                    'node / engine alone'], [
                 ['inference p50 ms (act() / inference_time)', r['engine_act_ms_p50'],
                  r.get('engine_loaded_act_ms_p50', math.nan), r['node_inference_ms_p50'],
                  r['node_over_engine_p50']],
                 ['inference p99 ms', r['engine_act_ms_p99'],
                  r.get('engine_loaded_act_ms_p99', math.nan), r['node_inference_ms_p99'],
                  r['node_over_engine_p99']],
                 ['% of act() past the asked period', '–',
                  r.get('engine_loaded_late_pct', math.nan),
                  100 * r['late_ticks'] / max(r['ticks_delivered'], 1), '–'],
                 ['frame p50 ms (act + language)', r['engine_frame_ms_p50'], '–', '–', '–'],
             ]), '',
             table(['rate asked Hz', 'rate held Hz', 'held / asked', 'deadline miss %',
                    'late', 'missing', 'skipped (inputs stale)', 'camera frames taken/s',
                    'tok/s', 'tok/s min 5 s window', 'k',
                    'CPU outside control active %', 'idle %', 'node CPU active %',
                    'robot CPU %'],
                   [[r['rate_asked_hz'], r['rate_held_hz'], r['rate_held_over_asked'],
                     r['deadline_miss_pct'], r['late_ticks'], r['missing_ticks'],
                     r['node_skipped_ticks'], r['camera_msgs_per_s'], r['tokens_per_s'],
                     r['tokens_per_s_min_window'],
                     f'{fmt(r["k_min"], 0)}–{fmt(r["k_max"], 0)}',
                     r['cpu_outside_control_active_pct'], r['cpu_outside_control_idle_pct'],
                     r['cpu_node_active_pct'], r['robot_cpu_pct']]]), '',
             'node / engine = the node\'s `inference_time` (observation to actions, as '
             'published) over the engine\'s act() on the same preset, threads and camera '
             'resolution: what running inside the node costs (executor, callbacks, DDS, the '
             'robot process next to it). Late = inference_time past the period; missing = '
             'asked ticks that sent no action chunk; skipped = ticks the node ran without a '
             'fresh camera frame or joint state (the inputs, not the node, were late); camera '
             'frames taken = frames the node took from DDS at its ticks (it takes only the '
             'newest, so at most one per tick). The engine next to the robot shows what the '
             'stand-in robot process alone does to act() on this machine. CPU in '
             '% of one core; per thread name: '
             f'{r["cpu_threads_active"] or "–"}.', '']
    busiest = max(r['other_load_engine_pct'], r['other_load_node_pct'])
    if busiest > NOISY_OTHER_LOAD_PCT:
        lines += [f'**Warning: other processes used {r["other_load_engine_pct"]:.0f}% of the '
                  f'CPUs while the engine was timed and {r["other_load_node_pct"]:.0f}% during '
                  'the node window**: the two sides did not see the same machine, so their '
                  'ratio carries that noise. Rerun on a quiet machine.', '']
    if 'node_latency' in paths:
        lines += [f'![per-tick latency]({paths["node_latency"].name})', '']
    return lines


def summary_markdown(result: BenchResult, paths: dict[str, Path]) -> str:
    opts, env = result.options, result.environment
    command = env.get('command', '')
    plan = opts.plan
    parts = [f'# oxygen_ros benchmark ({"quick" if opts.quick else "full"})', '']
    if command:
        parts += ['```', command, '```', '']
    parts += [f'Preset `{opts.preset}` (random weights) on {env.get("gpu", env["cpu"])} '
              f'({env["cores"]} cores), {opts.device} {opts.dtype}, torch {env["torch"]}, '
              f'{opts.threads} torch threads (parallel baseline: 1 per process; memory probes: '
              f'1). Load average {env["loadavg_start"]:.2f} at start, '
              f'{env.get("loadavg_end", math.nan):.2f} at end.'
              + (' Systems of one table ran side by side on the same frames, noise and '
                 'requests, frame by frame in turn; warm-up frames excluded; EOS disabled '
                 '(every request is N tokens, as in the paper). Action frequency = H / mean '
                 'frame latency (frame = act + language).' if result.rows else ''), '',
              'Time per part: ' + ', '.join(f'{name} {sec:.0f} s'
                                            for name, sec in result.part_seconds.items()), '']
    busiest = max((r.get('other_load_pct', 0.0) for r in result.rows), default=0.0)
    if busiest > NOISY_OTHER_LOAD_PCT:
        parts += [f'**Warning: other processes used up to {busiest:.0f}% of the CPUs while '
                  'systems were measured (column other_load_pct).** Means and p99s carry that '
                  'noise; the p50-based columns are the robust ones. Rerun on a quiet machine '
                  'for the paper-definition numbers.', '']
    parts += floors_section(result)
    parts += ['## Targets', '',
              table(['target', 'measured', 'met'],
                    [[t['target'], t['measured'], t['met']] for t in evaluate_targets(result)]),
              '']
    parts += [] if not result.components else [
              '## Component model per group (phases.py passes, sampled between the rounds of '
              "the group's frames; median)", '',
              table(['group', 'samples', 'P prefill ms', 'D denoise ms', 'd(1) ms',
                     'd(B) ms for B = ceil(N/k)'], component_table(result)), '',
              'Ideal speedup of oxygen over isolated: (2P + D + N·d(1)) / (P + D + k·d(N/k)). '
              'Frame deadline (deadline misses, oxygen-adaptive): '
              + ', '.join(f'S={s}: {1e3 * p:.0f} ms' for s, p in sorted(result.periods.items()))
              + (f' (= 1 / {opts.control_hz:g} Hz)' if opts.control_hz else
                 ' (= 1.5 × the fastest prefill + denoise)'), '']
    nk = _rows(result, 'nk', system='oxygen')
    if nk:
        iso = {r['n_tokens']: r for r in _rows(result, 'nk', system='isolated')}
        parts += [f'## {plan.workloads[0]}: N × k sweep, S={plan.default_steps}', '',
                  table(['N', 'k', 'oxygen Hz', 'isolated Hz', 'speedup', 'ideal',
                         'measured/ideal', 'speedup p50', 'p50/ideal', 'overhead %', 'tok/s',
                         'act p50 ms', 'tokens identical', 'other load %'],
                        [[r['n_tokens'], r['k'], r['action_hz'],
                          iso[r['n_tokens']]['action_hz'], r['speedup'], r['ideal_speedup'],
                          r['speedup_over_ideal'], r['speedup_p50'],
                          r['speedup_p50_over_ideal'], r['overhead_pct'], r['tokens_per_s'],
                          r['act_ms_p50'], r['tokens_identical'], r.get('other_load_pct')]
                         for r in nk]), '',
                  'speedup = oxygen Hz / isolated Hz with Hz = H / mean frame latency (the '
                  'paper); speedup p50 uses the median frame instead.', '']
    for n in sorted({r['n_tokens'] for r in _rows(result, 'nk')}):
        rows = _rows(result, 'nk', n_tokens=n)
        if n != plan.headline_n and len(plan.ns) > 2:
            continue
        parts += [f'### All systems, {plan.workloads[0]} N={n}, S={plan.default_steps}', '',
                  system_table(rows), '']
    for sweep, key, title in (('steps', 'steps', 'S (denoise steps)'),
                              ('arrivals', 'arrival_rate', 'arrivals (Poisson, requests/frame)'),
                              ('mixed', 'lengths', 'mixed request lengths'),
                              ('workloads', 'workload', 'workloads')):
        rows = _rows(result, sweep)
        if not rows:
            continue
        parts += [f'## Sweep: {title}', '']
        for value in sorted({r[key] for r in rows}, key=str):
            sub = [r for r in rows if r[key] == value]
            parts += [f'### {key} = {value} (N={sub[0]["n_tokens"]})', '', system_table(sub), '']
    if result.memory:
        key = 'cuda_peak' if opts.device.startswith('cuda') else 'above_runtime'
        parts += [f'## Peak memory ({plan.workloads[0]} N={plan.headline_n}, fresh process per '
                  'system)', '',
                  table(['system', 'processes', 'peak RSS MB', 'above runtime MB', 'CUDA peak MB',
                         'KV pool MB', f'{key} / action-only', 'peak RSS / action-only'],
                        [[m['label'], m['processes'], m['peak_rss_mb'], m['above_runtime_mb'],
                          m['cuda_peak_mb'], m['kv_pool_mb'], m[f'{key}_vs_action_only'],
                          m['peak_rss_vs_action_only']]
                         for m in result.memory]), '',
                  'Above runtime = peak RSS while serving minus the RSS of the imported runtime '
                  '(weights + KV + activations); for parallel, the sum over its two worker '
                  'processes. MKL fast memory manager '
                  f'{"on" if result.memory[0].get("mkl_fast_mm", True) else "off"} in the '
                  'probes (MKL_DISABLE_FAST_MM; it caches a GEMM buffer per row count).', '']
    parts += build_section(result)
    parts += robots_section(result, paths)
    parts += node_section(result, paths)
    parts += ['## Files', ''] + [f'- `{p.name}`' for p in paths.values()] + ['']
    return '\n'.join(parts)


def component_table(result: BenchResult) -> list[list]:
    """One row per group: its samples, P, D, d(1) and d(B) of its decode batch sizes."""
    rows, seen = [], {}
    for c in result.components:
        seen.setdefault(c['group'], []).append(c)
    for group, batches in seen.items():
        first = batches[0]
        decode = {c['batch']: c['decode_step_ms'] for c in batches}
        rows.append([group, first['samples'], first['prefill_ms'], first['denoise_ms'],
                     decode.get(1, math.nan),
                     ', '.join(f'{b}: {ms:.1f}' for b, ms in sorted(decode.items()) if b > 1)
                     or '–'])
    return rows


def system_table(rows: list[dict]) -> str:
    return table(['system', 'action Hz', 'frame p50/p99 ms', 'act p50/p99 ms', 'tok/s',
                  'req done p50 s', 'deadline miss %', 'overhead %', 'speedup', 'ideal',
                  'tokens identical'],
                 [[r['label'], r['action_hz'],
                   f'{r["frame_ms_p50"]:.0f}/{r["frame_ms_p99"]:.0f}',
                   f'{r["act_ms_p50"]:.0f}/{r["act_ms_p99"]:.0f}', r['tokens_per_s'],
                   r['completion_s_p50'], r['deadline_miss_pct'], r['overhead_pct'],
                   r['speedup'], r['ideal_speedup'], r['tokens_identical']] for r in rows])


# ---- plots --------------------------------------------------------------------------------

def write_plots(result: BenchResult, out: Path) -> dict[str, Path]:
    """Draw the four plots of the issue from whatever rows the run produced."""
    paths = {}
    for name, draw in (('tradeoff', plot_tradeoff), ('speedup_heatmap', plot_heatmap),
                       ('action_hz_vs_n', plot_hz_vs_n), ('memory', plot_memory),
                       ('robots_hz', plot_robots),
                       ('node_latency', plot_node_latency)):
        fig = draw(result)
        if fig is None:
            continue
        paths[name] = out / f'{name}.png'
        fig.savefig(paths[name], dpi=120, bbox_inches='tight')
        plt.close(fig)
    return paths


def _subtitle(result: BenchResult, hz: bool = True) -> str:
    o = result.options
    stat = 'mean' if o.plot_statistic == 'mean' else 'median (p50)'
    line = f'preset {o.preset}, {o.device} {o.dtype}, {o.threads} threads'
    return line + (f'; Hz = H / {stat} frame latency' if hz else '')


def _keys(result: BenchResult) -> tuple[str, str, str]:
    """Row keys of action Hz, tokens/s and speedup for the plots' statistic."""
    if result.options.plot_statistic == 'p50':
        return 'action_hz_p50', 'tokens_per_s_p50', 'speedup_p50'
    return 'action_hz', 'tokens_per_s', 'speedup'


def plot_tradeoff(result: BenchResult):
    """Plot action Hz vs tokens/s: baselines as lines over N, oxygen as a line over k per N."""
    rows = _rows(result, 'nk')
    if not rows:
        return None
    hz, tps, _ = _keys(result)
    plan = result.options.plan
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    ns = sorted({r['n_tokens'] for r in rows})
    oxygen_colours = plt.get_cmap('Blues')(np.linspace(0.45, 1.0, len(ns)))
    for i, n in enumerate(ns):
        sub = sorted((r for r in rows if r['system'] == 'oxygen' and r['n_tokens'] == n),
                     key=lambda r: r['k'])
        if not sub:
            continue
        ax.plot([r[tps] for r in sub], [r[hz] for r in sub], marker='o',
                color=oxygen_colours[i], label=f'oxygen N={n} (labels: k)', zorder=3)
        for r in sub:
            ax.annotate(str(r['k']), (r[tps], r[hz]), textcoords='offset points',
                        xytext=(4, 4), fontsize=7, color=oxygen_colours[i])
    for system, (colour, marker) in SYSTEM_STYLE.items():
        sub = sorted((r for r in rows if r['system'] == system), key=lambda r: r['n_tokens'])
        if not sub or system in ('oxygen', 'action-only'):
            continue
        ax.plot([r[tps] for r in sub], [r[hz] for r in sub], marker=marker, color=colour,
                linestyle='--', label=f'{system} (N = {ns[0]}..{ns[-1]})')
    action_only = [r[hz] for r in rows if r['system'] == 'action-only']
    if action_only:
        ax.axhline(float(np.mean(action_only)), color='black', linestyle=':', linewidth=1.2,
                   label='action-only (upper bound)')
    ax.set_xlabel('language tokens / s')
    ax.set_ylabel('action frequency (Hz)')
    ax.set_title(f'Action rate vs language throughput, {plan.workloads[0]}, '
                 f'S={plan.default_steps}, one request per frame\n{_subtitle(result)}',
                 fontsize=10)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_heatmap(result: BenchResult):
    """Measured speedup over N × k (with the ideal), and measured / ideal next to it."""
    rows = _rows(result, 'nk', system='oxygen')
    if not rows:
        return None
    _, _, speedup = _keys(result)
    plan = result.options.plan
    ns = sorted({r['n_tokens'] for r in rows})
    ks = sorted({r['k'] for r in rows})
    measured = np.full((len(ns), len(ks)), np.nan)
    ideal = np.full_like(measured, np.nan)
    for r in rows:
        i, j = ns.index(r['n_tokens']), ks.index(r['k'])
        measured[i, j], ideal[i, j] = r[speedup], r['ideal_speedup']
    ratio = measured / ideal
    fig, axes = plt.subplots(1, 2, figsize=(2 * (0.75 * len(ks) + 2.2), 0.7 * len(ns) + 2.2))
    panels = (
        (axes[0], measured, 'YlGnBu', (min(1.0, np.nanmin(measured)), np.nanmax(measured)),
         'measured speedup (ideal)', lambda i, j: f'{measured[i, j]:.2f}×\n({ideal[i, j]:.2f})'),
        (axes[1], ratio, 'RdYlGn', (0.8, 1.2), 'measured / ideal',
         lambda i, j: f'{ratio[i, j]:.0%}'),
    )
    for ax, grid, cmap, (vmin, vmax), label, text in panels:
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect='auto', origin='lower',
                          vmin=vmin, vmax=vmax)
        for i in range(len(ns)):
            for j in range(len(ks)):
                if np.isnan(grid[i, j]):
                    continue
                shade = (grid[i, j] - vmin) / max(vmax - vmin, 1e-9)
                dark = shade > 0.65 if cmap == 'YlGnBu' else not 0.15 < shade < 0.85
                ax.text(j, i, text(i, j), ha='center', va='center', fontsize=7,
                        color='white' if dark else 'black')
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_yticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel('k (tokens per request per frame)')
        ax.set_ylabel('N (tokens per request)')
        fig.colorbar(image, ax=ax, label=label, shrink=0.9)
    axes[0].set_title('oxygen / isolated action frequency', fontsize=9)
    axes[1].set_title(f'measured / ideal (target ≥ {TARGET_RATIO_OVER_IDEAL:.0%})', fontsize=9)
    fig.suptitle(f'Speedup over isolated, {plan.workloads[0]} S={plan.default_steps}; ideal = '
                 f'(2P + D + N·d(1)) / (P + D + k·d(N/k))\n{_subtitle(result)}', fontsize=10)
    fig.tight_layout()
    return fig


def plot_hz_vs_n(result: BenchResult):
    """Plot action Hz vs N per system (oxygen at the headline k, and at its best k per N)."""
    rows = _rows(result, 'nk')
    if not rows:
        return None
    hz, _, _ = _keys(result)
    plan = result.options.plan
    fig, ax = plt.subplots(figsize=(7.5, 5))
    k = plan.headline_k
    for system, (colour, marker) in SYSTEM_STYLE.items():
        sub = [r for r in rows if r['system'] == system and (system != 'oxygen' or r['k'] == k)]
        if not sub:
            continue
        sub.sort(key=lambda r: r['n_tokens'])
        label = f'oxygen k={k}' if system == 'oxygen' else system
        ax.plot([r['n_tokens'] for r in sub], [r[hz] for r in sub], marker=marker,
                color=colour, label=label, linestyle='--' if system == 'action-only' else '-')
    best = {}
    for r in rows:
        if r['system'] == 'oxygen' and r[hz] > best.get(r['n_tokens'], (0,))[0]:
            best[r['n_tokens']] = (r[hz], r['k'])
    if best:
        ns = sorted(best)
        ax.plot(ns, [best[n][0] for n in ns], color='tab:blue', linestyle=':', marker='.',
                label='oxygen, best k')
    ax.set_xlabel('N (tokens per request)')
    ax.set_ylabel('action frequency (Hz)')
    ax.set_ylim(bottom=0)
    ax.set_xticks(sorted({r['n_tokens'] for r in rows}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f'Action frequency vs request length, {plan.workloads[0]} '
                 f'S={plan.default_steps}\n{_subtitle(result)}', fontsize=10)
    return fig


def plot_memory(result: BenchResult):
    """Peak memory per system: whole process(es) on the left, above the runtime on the right."""
    if not result.memory:
        return None
    cuda = result.options.device.startswith('cuda')
    mem = result.memory
    x = np.arange(len(mem))
    labels = [m['label'] for m in mem]
    colours = [SYSTEM_STYLE[m['system']][0] for m in mem]
    plan = result.options.plan
    if cuda:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _bars_with_ratio(ax, x, [m['cuda_peak_mb'] for m in mem], colours,
                         [m['cuda_peak_vs_action_only'] for m in mem])
        ax.set_ylabel('peak CUDA memory allocated (MB)')
        ax.set_xticks(x, labels, rotation=20)
        axes = [ax]
    else:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        runtime = [m['peak_rss_mb'] - m['above_runtime_mb'] for m in mem]
        axes[0].bar(x, runtime, color='0.85', label='runtime (torch + libraries)')
        _bars_with_ratio(axes[0], x, [m['above_runtime_mb'] for m in mem], colours,
                         [m['peak_rss_vs_action_only'] for m in mem], bottom=runtime)
        axes[0].set_ylabel('peak resident memory, all processes (MB)')
        axes[0].set_title('whole process (grey: runtime per process)', fontsize=9)
        _bars_with_ratio(axes[1], x, [m['above_runtime_mb'] for m in mem], colours,
                         [m['above_runtime_vs_action_only'] for m in mem])
        pools = [0.0 if math.isnan(m['kv_pool_mb']) else m['kv_pool_mb'] for m in mem]
        axes[1].bar(x, pools, bottom=[m['above_runtime_mb'] - p for m, p in zip(mem, pools)],
                    fill=False, hatch='///', edgecolor='white', linewidth=0)
        axes[1].legend(handles=[Patch(facecolor='0.45', edgecolor='white', hatch='///',
                                      label='hatched: the KV pool')],
                       fontsize=8, loc='upper right')
        axes[1].set_ylabel('peak RSS above runtime (MB)')
        axes[1].set_title('above runtime: weights + KV cache + activations', fontsize=9)
        for ax in axes:
            ax.set_xticks(x, labels, rotation=20)
    fig.suptitle(f'Peak memory, {plan.workloads[0]} N={plan.headline_n}, a fresh process per '
                 f'system (labels: MB, ratio to action-only)\n{_subtitle(result, hz=False)}',
                 fontsize=10)
    fig.tight_layout()
    return fig


def _bars_with_ratio(ax, x, values, colours, ratios, bottom=None):
    base = bottom or [0.0] * len(values)
    bars = ax.bar(x, values, bottom=base, color=colours)
    for bar, value, low, ratio in zip(bars, values, base, ratios):
        ax.text(bar.get_x() + bar.get_width() / 2, low + value, f'{low + value:.0f}\n'
                f'({ratio:.2f}×)', ha='center', va='bottom', fontsize=8)
    ax.set_ylim(top=max(lo + v for lo, v in zip(base, values)) * 1.2)


def plot_robots(result: BenchResult):
    """Robots vs per-robot Hz (with the component model), aggregate rows/s and memory."""
    if not result.robots:
        return None
    cuda = result.options.device.startswith('cuda')
    memory = 'cuda_peak_mb' if cuda else 'above_runtime_mb'
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for system, (colour, marker) in ROBOT_STYLE.items():
        sub = sorted((r for r in result.robots if r['system'] == system),
                     key=lambda r: r['robots'])
        counts = [r['robots'] for r in sub]
        axes[0].plot(counts, [r['action_hz_min'] for r in sub], marker=marker, color=colour,
                     label=f'{system} (slowest robot)')
        ideal = 'ideal_fleet_hz' if system == 'fleet' else 'ideal_single_hz'
        if system != 'sequential':   # sequential and separate share one ideal
            axes[0].plot(counts, [r[ideal] for r in sub], linestyle=':', color=colour,
                         label=f'{"fleet" if system == "fleet" else "R engines"}: component '
                         'model')
        axes[1].plot(counts, [r['aggregate_hz'] for r in sub], marker=marker, color=colour,
                     label=system)
        axes[2].plot(counts, [r[memory] for r in sub], marker=marker, color=colour,
                     label=system)
    titles = ('action rate per robot (Hz)', 'all robots: action rows / s',
              'peak CUDA memory (MB)' if cuda else 'peak RSS above the runtime (MB)')
    for ax, title in zip(axes, titles):
        ax.set_xlabel('robots R')
        ax.set_ylabel(title)
        ax.set_xticks(sorted({r['robots'] for r in result.robots}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    last = max(result.robots, key=lambda r: r['robots'])
    fig.suptitle(f'R robots: one FleetEngine vs R separate engines vs one engine in turn, '
                 f'N={last["n_tokens"]} k={last["k"]}, robots {last["workloads"]}\n'
                 f'{_subtitle(result, hz=False)}', fontsize=10)
    fig.tight_layout()
    return fig


def plot_node_latency(result: BenchResult):
    """Per-tick latency of the node over time, with the engine's act() p50 and the period."""
    if not result.node or not result.node_ticks:
        return None
    r, ticks = result.node[0], result.node_ticks
    t = np.array([x['t_s'] for x in ticks])
    inference = np.array([x['inference_ms'] for x in ticks])
    interval = np.array([x['interval_ms'] for x in ticks], dtype=float)
    measured = np.array([bool(x['measured']) for x in ticks])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                      gridspec_kw={'height_ratios': [2, 1]})
    for ax in (top, bottom):
        if t.size and t.min() < 0:
            ax.axvspan(t.min(), 0, color='0.92', label='warm-up (not measured)')
        if t.size and t.max() > r['window_s']:
            ax.axvspan(r['window_s'], t.max(), color='0.92')   # stopping: not measured
        ax.axhline(r['period_ms'], color='tab:red', linewidth=1,
                   label=f'period {r["period_ms"]:.0f} ms ({r["rate_asked_hz"]:.2f} Hz asked)')
        ax.grid(alpha=0.3)
    top.plot(t[measured], inference[measured], '.', markersize=3, color='tab:blue',
             label='node inference_time, measured ticks')
    top.plot(t[~measured], inference[~measured], '.', markersize=3, color='0.6')
    top.axhline(r['engine_act_ms_p50'], color='black', linestyle='--', linewidth=1,
                label=f'engine act() p50 {r["engine_act_ms_p50"]:.1f} ms')
    top.axhline(TARGET_NODE_OVER_ENGINE_P50 * r['engine_act_ms_p50'], color='black',
                linestyle=':', linewidth=1,
                label=f'{TARGET_NODE_OVER_ENGINE_P50:.2f} × engine act() p50')
    top.set_ylabel('observation to actions (ms)')
    top.set_ylim(bottom=0)
    top.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    bottom.plot(t, interval, '.', markersize=3, color='tab:green',
                label='interval between action chunks received')
    bottom.set_ylabel('tick interval (ms)')
    bottom.set_xlabel('seconds from the start of the measured window')
    bottom.set_ylim(bottom=0)
    bottom.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f'oxygen_node per tick: node/engine p50 {r["node_over_engine_p50"]:.2f}×, '
                 f'held {r["rate_held_hz"]:.2f} of {r["rate_asked_hz"]:.2f} Hz, '
                 f'{r["deadline_miss_pct"]:.1f}% deadline misses, '
                 f'{r["tokens_per_s"]:.0f} tok/s\n{_subtitle(result, hz=False)}, '
                 f'{r["robot"]} N={r["n_tokens"]} k={r["k"]}, cameras {r["cameras"]}',
                 fontsize=10)
    fig.tight_layout()
    return fig
