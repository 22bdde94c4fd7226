"""Benchmark output: CSV of every run, result.json, the markdown summary (plots: plots.py).

The summary leads with the targets (targets.py), then one section per part that ran.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .fleet_timing import fleet_timing_section
from .overload import overload_section
from .tasks import tasks_section
from .plots import write_plots
from .run import BenchResult, save_result
from .targets import evaluate_targets, fmt, sweep_rows

NOISY_OTHER_LOAD_PCT = 10.0   # CPU share of other processes above which the summary warns


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
    if result.rtc:
        paths['rtc'] = out / 'rtc.csv'
        write_csv(result.rtc, paths['rtc'])
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
    if result.overload:
        paths['overload'] = out / 'overload.csv'
        write_csv(result.overload, paths['overload'])
    for name, rows in (('tasks', result.tasks), ('task_tokens', result.task_tokens)):
        if rows:
            paths[name] = out / f'{name}.csv'
            write_csv(rows, paths[name])
    paths.update(write_plots(result, out))
    paths['summary'].write_text(summary_markdown(result, paths))
    return paths


# ---- markdown -----------------------------------------------------------------------------

def table(header: list[str], rows: list[list]) -> str:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(fmt(v) if not isinstance(v, str) else v for v in row) + ' |'
              for row in rows]
    return '\n'.join(lines)


def floors_section(result: BenchResult) -> list[str]:
    """Lead with the ratio to the floor: each phase of a frame against this machine's limit."""
    if not result.floors:
        return []
    env, opts = result.environment, result.options
    machine = env.get('machine', {})
    rates = ', '.join(f'{name} {flops / 1e9:.0f} GFLOP/s'
                      for name, flops in machine.get('matmul_flops', {}).items())
    compiled = env.get('floor_compile') or next(iter(env.get('compile', {}).values()), {})
    action = next(r for r in result.floors if r['phase'] == 'action')
    return [f'## At the machine\'s limit: the action path runs at {action["x_floor"]:.1f}× its '
            f'floor', '',
            f'{opts.preset}, one {opts.plan.workloads[0]} frame, {opts.dtype} '
            f'({env.get("dtype_reason", "")}), {machine.get("threads")} torch threads (the '
            'node\'s: every core but one unless --floor-threads). '
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
            "'load' = load_pi05 (memory-mapped) then prepare_model, as configure does; load "
            f'alone: {loads}.', '']


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
             'requests; on the CPU each robot\'s prefill, denoise and token steps on its own '
             'thread, the torch threads divided among them, so it may beat the serial ideal '
             'below); separate = R '
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
                    'camera frames arrived/s (slowest)', 'camera frames lost %', 'tok/s',
                    'tok/s min 5 s window', 'k',
                    'CPU outside control active %', 'idle %', 'node CPU active %',
                    'robot CPU %'],
                   [[r['rate_asked_hz'], r['rate_held_hz'], r['rate_held_over_asked'],
                     r['deadline_miss_pct'], r['late_ticks'], r['missing_ticks'],
                     r['node_skipped_ticks'], r['camera_msgs_per_s'],
                     r.get('camera_arrived_hz_min', math.nan),
                     r.get('camera_lost_pct_max', math.nan), r['tokens_per_s'],
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
             'newest, so at most one per tick); arrived = frames the node\'s middleware got '
             'whole over its last 10 s (published by sequence numbers, less those it counted '
             'lost; raw frames need the Fast DDS profile, docs/cameras.md). The engine next to '
             'the robot shows what the '
             'stand-in robot process alone does to act() on this machine. CPU in '
             '% of one core; per thread name, active: '
             f'{r["cpu_threads_active"] or "–"}; idle: {r.get("cpu_threads_idle") or "–"}.',
             '']
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
    weights = ('random weights; the rtc part: its own policy, below'
               if result.rtc and result.rtc[0].get('policy', '').split(':')[0] != 'random weights'
               else 'random weights')
    parts += [f'Preset `{opts.preset}` ({weights}) on {env.get("gpu", env["cpu"])} '
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
              table(['group', 'samples', 'F frontend ms', 'P prefill ms', 'D denoise ms',
                     'f first token ms', 'd(1) ms: steps in a row',
                     'd(B) ms: steps in a row, B = ceil(N/k)'], component_table(result)), '',
              'Ideal speedup of oxygen over isolated: (F + 2P + D + f + d(1) steps 1..N-1) / '
              '(F + P + D + f + d(B) steps 1..k-1 + d(B-1) step k), B = ceil(N/k) live '
              "requests: the new request's first token comes from its prefix (f: the LM head), "
              'so k-1 steps run B rows and the last B-1. A frame\'s first step runs after its '
              'prefill, denoise and f (weights evicted); the next ones refill the caches, so '
              'each is timed in its place in a row (later steps as the last timed). '
              'Frame deadline (deadline misses, oxygen-adaptive): '
              + ', '.join(f'S={s}: {1e3 * p:.0f} ms' for s, p in sorted(result.periods.items()))
              + (f' (= 1 / {opts.control_hz:g} Hz)' if opts.control_hz else
                 ' (= 1.5 × the fastest prefill + denoise)'), '']
    nk = sweep_rows(result, 'nk', system='oxygen')
    if nk:
        iso = {r['n_tokens']: r for r in sweep_rows(result, 'nk', system='isolated')}
        parts += [f'## {plan.workloads[0]}: N × k sweep, S={plan.default_steps}', '',
                  table(['N', 'k', 'oxygen Hz', 'isolated Hz', 'speedup', 'ideal',
                         'measured/ideal', 'speedup p50', 'p50/ideal', 'manager %',
                         'frontend ms', 'tok/s',
                         'act p50 ms', 'tokens identical', 'other load %'],
                        [[r['n_tokens'], r['k'], r['action_hz'],
                          iso[r['n_tokens']]['action_hz'], r['speedup'], r['ideal_speedup'],
                          r['speedup_over_ideal'], r['speedup_p50'],
                          r['speedup_p50_over_ideal'], r['manager_pct'], r['frontend_ms'],
                          r['tokens_per_s'],
                          r['act_ms_p50'], r['tokens_identical'], r.get('other_load_pct')]
                         for r in nk]), '',
                  'speedup = oxygen Hz / isolated Hz with Hz = H / mean frame latency (the '
                  'paper); speedup p50 uses the median frame instead.', '']
    for n in sorted({r['n_tokens'] for r in sweep_rows(result, 'nk')}):
        rows = sweep_rows(result, 'nk', n_tokens=n)
        if n != plan.headline_n and len(plan.ns) > 2:
            continue
        parts += [f'### All systems, {plan.workloads[0]} N={n}, S={plan.default_steps}', '',
                  system_table(rows), '']
    for sweep, key, title in (('steps', 'steps', 'S (denoise steps)'),
                              ('arrivals', 'arrival_rate', 'arrivals (Poisson, requests/frame)'),
                              ('mixed', 'lengths', 'mixed request lengths'),
                              ('workloads', 'workload', 'workloads')):
        rows = sweep_rows(result, sweep)
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
                  '(weights + KV + activations, and what preparing the model as the node does '
                  f'keeps: packed copies, compiled passes; --compile {opts.compile}); for '
                  'parallel, the sum over its two worker processes. MKL fast memory manager '
                  f'{"on" if result.memory[0].get("mkl_fast_mm", True) else "off"} in the '
                  'probes (MKL_DISABLE_FAST_MM; it caches a GEMM buffer per row count).', '']
    parts += build_section(result)
    parts += robots_section(result, paths)
    parts += fleet_timing_section(result.fleet_timing)
    parts += node_section(result, paths)
    parts += rtc_section(result, paths)
    parts += overload_section(result.overload)
    parts += tasks_section(result.tasks, result.task_tokens)
    parts += ['## Files', ''] + [f'- `{p.name}`' for p in paths.values()] + ['']
    return '\n'.join(parts)


def rtc_section(result: BenchResult, paths: dict[str, Path]) -> list[str]:
    """Return the rtc part's section: one row per mode on the same synthetic episode."""
    if not result.rtc:
        return []
    first = result.rtc[0]
    lines = [f'## Real-time chunking ({first["robot"]}, {first["frames"]} frames per mode, '
             f'd = {first["delay_rows"]} rows, a frame every {first["period_ms"]:.0f} ms, '
             f'timing {first.get("timing", "measured")})', '',
             table(['mode', 'jump mean', 'jump p95', 'jump max', 'jump / off', 'gap mean',
                    'gap / off', 'row step', 'total variation', 'TV / off', 'act p50 ms',
                    'act / off', 'max |frozen - committed|', 'tokens = off'],
                   [[r['mode'], r['jump_mean'], r['jump_p95'], r['jump_max'],
                     r['jump_mean_vs_off'], r['gap_mean'], r['gap_mean_vs_off'],
                     r['row_step_mean'], r['total_variation'], r['total_variation_vs_off'],
                     r['act_ms_p50'], r['act_ms_p50_vs_off'], f'{r["frozen_rows_max_diff"]:g}',
                     r['tokens_identical_to_off']] for r in result.rtc]), '',
             f'Policy: {first.get("policy") or "random weights"}.', '',
             'Every mode is played from the same row of each chunk (the first past the delay '
             'd), so a jump (L2 over the action columns, robot units, between the last row '
             'played of the old chunk and the first of the new one) compares what the chunks '
             'hold. The gap is the first new row against the old chunk\'s row for the same '
             'time; the row step, the mean distance between two consecutive rows of one chunk, '
             'is the floor of any jump. A trained policy\'s chunks are smooth (row step << the '
             'jump without RTC) and differ from one noise to the next, which is what RTC '
             'removes; random weights give rough chunks (row step ≈ jump), where no boundary '
             'can be smoother than the chunk itself. act() is timed with the modes taking '
             'turns frame by frame (a shared machine slows each alike). The episode\'s '
             f'latency: {first["latency_ms"]:.0f} ms (act() p95 over the warm-up: '
             f'{first["measured_act_p95_ms"]:.0f} ms; timing "assumed": that left the new '
             'chunk no committed row past d, so d = 2 and a frame every 3 rows, as on a '
             'robot\'s GPU).', '']
    if 'rtc_boundaries' in paths:
        lines += [f'![one joint across chunk boundaries]({paths["rtc_boundaries"].name})', '']
    return lines


def component_table(result: BenchResult) -> list[list]:
    """One row per group: its samples, P, D, d(1) and d(B) of its decode batch sizes."""
    rows, seen = [], {}
    for c in result.components:
        seen.setdefault(c['group'], []).append(c)
    for group, batches in seen.items():
        first = batches[0]
        decode = {int(c['batch']): ' / '.join(
            f'{float(ms):.2f}' for ms in [c['decode_step_ms']]
            + str(c.get('decode_next_steps_ms', '')).split('/') if ms) for c in batches}
        rows.append([group, first['samples'], first.get('frontend_ms', math.nan),
                     first['prefill_ms'], first['denoise_ms'],
                     first.get('first_token_ms', math.nan), decode.get(1, '–'),
                     ', '.join(f'{b}: {steps}' for b, steps in sorted(decode.items()) if b > 1)
                     or '–'])
    return rows


def system_table(rows: list[dict]) -> str:
    return table(['system', 'action Hz', 'frame p50/p99 ms', 'act p50/p99 ms', 'tok/s',
                  'req done p50 s', 'deadline miss %', 'manager %', 'speedup', 'ideal',
                  'tokens identical'],
                 [[r['label'], r['action_hz'],
                   f'{r["frame_ms_p50"]:.0f}/{r["frame_ms_p99"]:.0f}',
                   f'{r["act_ms_p50"]:.0f}/{r["act_ms_p99"]:.0f}', r['tokens_per_s'],
                   r['completion_s_p50'], r['deadline_miss_pct'], r['manager_pct'],
                   r['speedup'], r['ideal_speedup'], r['tokens_identical']] for r in rows])
