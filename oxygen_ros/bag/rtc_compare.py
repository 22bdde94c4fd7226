"""`oxygen-ros replay --rtc-compare`: one recording replayed with real-time chunking off and on.

Each mode replays the same bag (or LeRobot dataset) with a fresh engine into its own output
(OUT/off, OUT/guided, OUT/prefix), on the replay's clock, so every mode sees the same frames,
noise and ticks. The first mode ('off') measures the latency (tick -> chunk out, on the
replay's clock with the engine's real act() time); its delay d (the rtc_delay parameter when
set, else auto from that latency) is then fixed for the other modes, so all of them are
compared at the same d. What is compared is runtime.rtc.compare_runs: boundary jumps, the
path's total variation, act() time and the frozen rows; OUT/rtc.csv holds the rows and
OUT/rtc_boundaries.png one joint across several chunk boundaries.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

from oxygen_ros.bag.config import ReplayParams
from oxygen_ros.bag.replay import check_new_output
from oxygen_ros.runtime.actions import action_layout
from oxygen_ros.runtime.params import AUTO_DELAY, OFF, RTC_MODES
from oxygen_ros.runtime.rtc import compare_runs, plot_paths

CSV_FILE = 'rtc.csv'
PLOT_FILE = 'rtc_boundaries.png'


def compare_rtc(make_replay: Callable, out_dir: str | Path, params: ReplayParams, *,
                modes: tuple[str, ...] = RTC_MODES, overwrite: bool = False,
                column: int = 0, say: Callable[[str], None] = print) -> list[dict]:
    """Replay once per mode; write OUT/<mode>, rtc.csv and the plot; return one row per mode.

    make_replay(out, params, rtc_trace=True) builds a Replay or DatasetReplay.
    """
    if not modes or modes[0] != OFF:
        modes = (OFF,) + tuple(m for m in modes if m != OFF)
    out = Path(out_dir)
    check_new_output(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    settings = params.settings
    delay = settings.rtc_delay
    traces, wall = {}, {}
    for mode in modes:
        changed = dataclasses.replace(settings, rtc_mode=mode, rtc_delay=delay)
        replay = make_replay(out / mode, dataclasses.replace(params, settings=changed),
                             rtc_trace=True)
        say(f'rtc compare: replaying with rtc_mode {mode}'
            + (f', rtc_delay {delay}' if delay != AUTO_DELAY else ''))
        summary = replay.run()
        traces[mode] = replay.rtc.trace
        wall[mode] = summary.wall_s
        if delay == AUTO_DELAY:
            delay = replay.rtc.delay()
    layout = action_layout(settings.robot)
    rows, paths = compare_runs(traces, layout.step_period_s, delay)
    for row in rows:
        row['replay_wall_s'] = wall[row['mode']]
    _write_csv(rows, out / CSV_FILE)
    fig = plot_paths(paths, column, layout.names[column],
                     f'real-time chunking, replay of {params.settings.robot}: d = {delay} rows')
    if fig is not None:
        fig.savefig(out / PLOT_FILE, dpi=120, bbox_inches='tight')
    say(format_rows(rows))
    say(f'wrote {", ".join(str(out / m) for m in modes)}, {out / CSV_FILE}'
        + (f', {out / PLOT_FILE}' if fig is not None else ''))
    return rows


def format_rows(rows: list[dict]) -> str:
    """Return the comparison as a small text table."""
    def num(value, digits=3):
        return '–' if value is None or (isinstance(value, float) and math.isnan(value)) else (
            f'{value:.{digits}f}')
    lines = [f'{"mode":<8} {"jump mean":>10} {"x off":>6} {"gap mean":>9} {"x off":>6} '
             f'{"row step":>9} {"TV":>9} {"act p50 ms":>11} {"x off":>6} {"frozen diff":>12}']
    for r in rows:
        lines.append(f'{r["mode"]:<8} {num(r["jump_mean"]):>10} {num(r["jump_mean_vs_off"], 2):>6}'
                     f' {num(r["gap_mean"]):>9} {num(r["gap_mean_vs_off"], 2):>6}'
                     f' {num(r["row_step_mean"]):>9} {num(r["total_variation"], 2):>9}'
                     f' {num(r["act_ms_p50"], 1):>11} {num(r["act_ms_p50_vs_off"], 2):>6}'
                     f' {r["frozen_rows_max_diff"]:>12.3g}')
    first = rows[0]
    lines.append(f'  {first["chunks"]} chunks, {first["boundaries"]} boundaries, d = '
                 f'{first["delay_rows"]} rows; every mode played from row d of each chunk')
    return '\n'.join(lines)


def _write_csv(rows: list[dict], path: Path) -> None:
    import csv

    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
