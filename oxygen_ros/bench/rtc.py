"""Bench part 'rtc': the same frames with real-time chunking off, guided and prefix.

A synthetic episode (cameras panning slowly over smooth pictures, the state on slow sines) is
stepped frame by frame through one engine per mode over the same model; per frame the modes
take turns (the first one rotates), so a slow moment of a shared machine hits each alike.
Time is the episode's own clock, as in a replay: frame j is observed at j·T and its chunk is
out L later, where L is the p95 of the 'off' engine's act() over the warm-up frames (or, with
a delay d given, (d + 1) P, the longest latency with that delay), so every mode continues its
chunks with the same delay d = ceil(L / P) - 1, and T = max(1 / control_hz, L) in whole steps
P (an engine cannot start a frame before the last one is out) unless period_rows is given.
A measured timing that leaves nothing to continue (see episode_timing) is replaced by an
assumed one, and the report says which it was.
Per mode (runtime.rtc.compare_runs): the boundary jumps and gaps, the played path's total
variation, act() p50, and how far the frozen rows lie from the committed ones; plus whether
the language tokens equal the 'off' run's (RTC must not touch the language path).

The policy (rtc_policy): by default a smooth policy (bench/smooth_policy.py: the preset's
action expert fine-tuned with openpi's flow-matching loss on smooth demonstrations, cached), a
checkpoint folder, or random weights. Random weights make rough chunks: two rows of one chunk
lie about as far apart as two rows of different chunks, so the literal jump (last old row ->
first new row) cannot fall below the path's own row step and RTC has nothing to show. A
trained policy's chunks are smooth and differ from one noise to the next: there the jump is
what RTC removes. The gap (first new row -> the old chunk's row for the same time) leaves the
row step out; both are reported, with the row step.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from oxygen_ros.runtime.rtc import delay_rows

TARGET_JUMP_GUIDED = 0.3        # boundary jump guided / off (mean over the boundaries)
TARGET_ACT_GUIDED = 2.0         # act() p50 guided / off
TARGET_ACT_PREFIX = 1.05        # act() p50 prefix / off
SMOOTH, RANDOM = 'smooth', 'random'   # RtcBenchOptions.policy, besides a checkpoint folder


@dataclasses.dataclass(frozen=True)
class RtcBenchOptions:
    """The rtc part's settings (model preset, device, dtype and threads are BenchOptions')."""

    robot: str = 'libero'
    frames: int = 30                # measured frames (chunks) per mode
    warmup: int = 3                 # frames before, not measured (all but the first set L)
    control_hz: float = 10.0        # asked frame rate; T is at least the latency
    delay: int | None = None        # d in rows; None: from the warm-up's act() p95
    period_rows: int | None = None  # rows between frames; None: from control_hz and latency
    modes: tuple[str, ...] = ('off', 'guided', 'prefix')
    column: int = 0                 # action column plotted
    tokens: int = 5                 # N of the language request each frame starts (k = N)
    policy: str = SMOOTH            # 'smooth', 'random' (the bench preset's) or a checkpoint
    policy_preset: str | None = None   # smooth: the preset fine-tuned (None: the bench's)
    policy_steps: int | None = None    # smooth: optimiser steps (None: the trainer's default)
    max_guidance_weight: float | None = None   # β of guided (None: rtc_max_guidance_weight's)


# The episode's timing when the measured latency leaves nothing to continue: the issue's
# 'inference_time ≈ 140 ms, about 3 rows at 20 Hz', one frame per 3 rows.
ASSUMED_DELAY, ASSUMED_PERIOD_ROWS = 2, 3


def episode_timing(options: RtcBenchOptions, measured_s: float, step_s: float,
                   horizon: int) -> tuple[int, float, str]:
    """Return (d, frame period in s, 'measured' | 'given' | 'assumed') of the episode.

    Measured: d from act()'s p95, a frame every max(1 / control_hz, latency). When that
    leaves the new chunk no committed row past d (d + rows per frame >= H: a slow CPU for a
    short horizon), RTC has nothing to do there; the episode then assumes d = 2 and a frame
    every 3 rows, as a robot's GPU would give, and says so.
    """
    if options.delay is not None:
        d, latency, timing = options.delay, (options.delay + 1) * step_s, 'given'
    else:
        d, latency, timing = delay_rows(measured_s, step_s), measured_s, 'measured'
    rows = options.period_rows or math.ceil(
        max(1 / options.control_hz, latency) / step_s - 1e-9)
    if timing == 'measured' and not options.period_rows and d + rows >= horizon:
        d, rows, timing = ASSUMED_DELAY, ASSUMED_PERIOD_ROWS, 'assumed'
    return d, rows * step_s, timing


def rtc_policy(options: RtcBenchOptions, preset: str, device: str, dtype: str, threads: int,
               seed: int, random_weights, progress=lambda line: None):
    """Return the episode's (model, frontend, description) as options.policy says.

    random_weights() -> (model, frontend) of the bench preset with random weights.
    """
    if options.policy == RANDOM:
        model, frontend = random_weights()
        return model, frontend, f'random weights (preset {preset})'
    if options.policy == SMOOTH:
        from .smooth_policy import read_info, smooth_policy, SmoothPolicyOptions

        steps = {'steps': options.policy_steps} if options.policy_steps else {}
        smooth = SmoothPolicyOptions(preset=options.policy_preset or preset,
                                     robot=options.robot, seed=seed, **steps)
        path = smooth_policy(smooth, device, progress=progress)
        made = read_info(path)
        smoothness = made['smoothness']
        what = (f'smooth policy: preset {smooth.preset} with its action expert fine-tuned '
                f'{smooth.steps} steps on smooth demonstrations (loss {made["loss_first"]:.3f} '
                f'-> {made["loss_last"]:.3f}; its chunks: row step '
                f'{smoothness["row_step"]:.3f} vs {smoothness["across_chunks"]:.3f} between '
                f'two chunks), {path}')
    else:
        path, what = options.policy, f'checkpoint {options.policy}'
    model, frontend, _ = load_policy(path, options.robot, device, dtype, threads)
    return model, frontend, what


def load_policy(path, robot: str, device: str, dtype: str, threads: int):
    """Load a checkpoint folder as the node does: (model, frontend of `robot`, description)."""
    from oxygen_ros.runtime.engine_setup import load_model, robot_spec
    from oxygen_ros.runtime.params import robot_defaults, Settings

    settings = Settings.from_values({**robot_defaults(robot), 'checkpoint': str(path),
                                     'device': device, 'dtype': dtype,
                                     'torch_threads': threads})
    model, make_frontend, description, _ = load_model(settings)
    return model, make_frontend(robot_spec(settings)), description['source']


def run_rtc_part(options: RtcBenchOptions, model, frontend, seed: int,
                 progress=lambda line: None, policy: str = '') -> tuple[list[dict], list[dict]]:
    """Run the episode once per mode; return (one row per mode, the plotted paths).

    policy: what the model is, for the report.
    """
    from oxygen_ros.engine import FixedBudget, LanguagePolicy, make_engine, synthetic_frame
    from oxygen_ros.runtime.actions import action_layout
    from oxygen_ros.runtime.params import RtcSettings
    from oxygen_ros.runtime.rtc import compare_runs, RtcPlanner

    layout = action_layout(options.robot)
    P = layout.step_period_s
    image_size = model.config.vision.image_size
    language = LanguagePolicy(max_new_tokens=options.tokens, seed=seed, eos_id=None)
    engines = {mode: make_engine('oxygen', model, frontend, language,
                                 FixedBudget(options.tokens), seed=seed)
               for mode in options.modes}
    act_s: dict[str, list[float]] = {mode: [] for mode in options.modes}
    tokens: dict[str, dict[int, list[int]]] = {mode: {} for mode in options.modes}

    def step(mode, obs, planner=None):
        continuation = planner.continuation(obs) if planner is not None else None
        start = time.perf_counter()
        action = engines[mode].act(obs, continuation)
        action.inference_time_s = time.perf_counter() - start
        for delta in engines[mode].advance_language().deltas:
            tokens[mode].setdefault(delta.origin_frame, []).extend(delta.token_ids)
        return action

    reference = 'off' if 'off' in options.modes else options.modes[0]
    warm = {mode: [] for mode in options.modes}
    for i in range(options.warmup):
        obs = synthetic_frame(options.robot, i, i / options.control_hz, seed, image_size)
        for mode in options.modes:
            warm[mode].append(step(mode, obs).inference_time_s)
    # The first frame of an engine pays one-time costs (allocation, kernels): not a latency.
    measured = float(np.percentile(warm[reference][1:] or warm[reference], 95))
    horizon = model.config.action_horizon
    d, period, timing = episode_timing(options, measured, P, horizon)
    latency = (d + 1) * P if timing != 'measured' else measured
    progress(f'rtc: act() p95 {1e3 * measured:.0f} ms over the warm-up; the episode ({timing}): '
             f'latency {1e3 * latency:.0f} ms, d = {d} rows, a frame every '
             f'{1e3 * period:.0f} ms ({round(period / P)} rows of {1e3 * P:.0f} ms)')
    beta = {'max_guidance_weight': options.max_guidance_weight} if options.max_guidance_weight \
        else {}
    planners = {mode: RtcPlanner(RtcSettings(mode, delay=d, **beta), P, trace=True)
                for mode in options.modes}
    for j in range(options.frames):
        index = options.warmup + j
        obs = synthetic_frame(options.robot, index, j * period, seed, image_size)
        rotation = j % len(options.modes)
        for mode in options.modes[rotation:] + options.modes[:rotation]:
            action = step(mode, obs, planners[mode])
            act_s[mode].append(action.inference_time_s)
            planners[mode].record(action, obs.stamp + latency)
        if (j + 1) % 10 == 0:
            progress(f'rtc: {j + 1}/{options.frames} frames')
    rows, paths = compare_runs({mode: p.trace for mode, p in planners.items()}, P, d)
    name = layout.names[options.column]
    for row in rows:
        same = tokens[row['mode']] == tokens[reference]
        row.update(robot=options.robot, policy=policy, frames=options.frames,
                   max_guidance_weight=planners[row['mode']].settings.max_guidance_weight,
                   period_ms=1e3 * period,
                   timing=timing,
                   latency_ms=1e3 * latency, measured_act_p95_ms=1e3 * measured,
                   tokens_identical_to_off=same,
                   requests_compared=len(tokens[row['mode']]))
    plotted = [{'mode': mode, 'column': name, 'times_s': path.times_s.tolist(),
                'values': path.rows[:, options.column].tolist(),
                'boundary_times_s': path.boundary_times_s.tolist(),
                'jumps': path.jumps.tolist()} for mode, path in paths.items()]
    return rows, plotted


def rtc_targets(rows: list[dict]) -> list[dict]:
    """Return the rtc part's targets (boundary jump, frozen rows, act() cost)."""
    by_mode = {r['mode']: r for r in rows}
    targets = []
    if 'guided' in by_mode and 'off' in by_mode:
        g = by_mode['guided']
        targets.append({
            'target': f'boundary jump guided ≤ {TARGET_JUMP_GUIDED} × off (synthetic episode)',
            'measured': f'{g["jump_mean_vs_off"]:.3f}× (mean {g["jump_mean"]:.4f} vs '
                        f'{by_mode["off"]["jump_mean"]:.4f} over {g["boundaries"]} '
                        f'boundaries, d = {g["delay_rows"]}; the row step within a chunk, '
                        f'its floor: {g["row_step_mean"]:.4f})',
            'met': g['jump_mean_vs_off'] <= TARGET_JUMP_GUIDED})
        targets.append({
            'target': f'boundary gap guided ≤ {TARGET_JUMP_GUIDED} × off (new row vs the old '
                      "chunk's row for the same time)",
            'measured': f'{g["gap_mean_vs_off"]:.3f}× (mean {g["gap_mean"]:.4f} vs '
                        f'{by_mode["off"]["gap_mean"]:.4f})',
            'met': g['gap_mean_vs_off'] <= TARGET_JUMP_GUIDED})
        targets.append({
            'target': f'act() guided ≤ {TARGET_ACT_GUIDED} × off',
            'measured': f'{g["act_ms_p50_vs_off"]:.2f}× ({g["act_ms_p50"]:.1f} vs '
                        f'{by_mode["off"]["act_ms_p50"]:.1f} ms p50)',
            'met': g['act_ms_p50_vs_off'] <= TARGET_ACT_GUIDED})
    if 'prefix' in by_mode and 'off' in by_mode:
        p = by_mode['prefix']
        exact = p['frozen_rows_max_diff'] == 0.0
        targets.append({
            'target': 'prefix: the frozen rows equal the committed ones exactly',
            'measured': (f'max |frozen - committed| = {p["frozen_rows_max_diff"]:g} over '
                         f'{p["chunks"] - 1} chunks, d = {p["delay_rows"]}'
                         if p['delay_rows'] else 'd = 0: no frozen row'),
            'met': exact if p['delay_rows'] else None})
        targets.append({
            'target': f'act() prefix ≤ {TARGET_ACT_PREFIX} × off',
            'measured': f'{p["act_ms_p50_vs_off"]:.3f}× ({p["act_ms_p50"]:.1f} vs '
                        f'{by_mode["off"]["act_ms_p50"]:.1f} ms p50)',
            'met': p['act_ms_p50_vs_off'] <= TARGET_ACT_PREFIX})
    if rows:
        same = all(r['tokens_identical_to_off'] for r in rows)
        targets.append({
            'target': 'language tokens identical with RTC on or off',
            'measured': ', '.join(f'{r["mode"]}: {r["requests_compared"]} requests '
                                  f'{"identical" if r["tokens_identical_to_off"] else "DIFFER"}'
                                  for r in rows if r['mode'] != 'off'),
            'met': same})
    return targets
