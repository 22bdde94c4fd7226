"""The benchmark's plots: one PNG per picture, drawn from whatever rows the run produced."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use('Agg')   # files only, no display; must precede pyplot
from matplotlib.patches import Patch  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .run import BenchResult  # noqa: E402
from .targets import (sweep_rows, TARGET_NODE_OVER_ENGINE_P50,  # noqa: E402
                      TARGET_RATIO_OVER_IDEAL)

SYSTEM_STYLE = {   # colour, marker per system (oxygen k=... share the oxygen colour)
    'action-only': ('black', 's'), 'isolated': ('tab:red', 'o'), 'parallel': ('tab:purple', 'v'),
    'shared': ('tab:orange', 'D'), 'oxygen': ('tab:blue', 'o'),
    'oxygen-adaptive': ('tab:green', '^'),
}
ROBOT_STYLE = {'fleet': ('tab:blue', 'o'), 'separate': ('tab:red', 'v'),
               'sequential': ('tab:orange', 'D')}


def write_plots(result: BenchResult, out: Path) -> dict[str, Path]:
    """Draw the four plots of the issue from whatever rows the run produced."""
    paths = {}
    for name, draw in (('tradeoff', plot_tradeoff), ('speedup_heatmap', plot_heatmap),
                       ('action_hz_vs_n', plot_hz_vs_n), ('memory', plot_memory),
                       ('robots_hz', plot_robots),
                       ('node_latency', plot_node_latency), ('rtc_boundaries', plot_rtc)):
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
    rows = sweep_rows(result, 'nk')
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
    rows = sweep_rows(result, 'nk', system='oxygen')
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
    rows = sweep_rows(result, 'nk')
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
        axes[1].set_title('above runtime: the prepared model (weights, packed copies, compiled '
                          'passes) + KV cache + activations', fontsize=9)
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


def plot_rtc(result: BenchResult):
    """One action column across several chunk boundaries, RTC off and on (the rtc part)."""
    if not result.rtc_paths:
        return None
    from ..runtime.rtc import plot_paths, PlayedPath

    paths = {p['mode']: PlayedPath(np.array(p['times_s']), np.array(p['values'])[:, None],
                                   np.zeros(len(p['times_s']), int), np.array(p['jumps']),
                                   np.array(p['boundary_times_s']))
             for p in result.rtc_paths}
    first = result.rtc[0]
    policy = first.get('policy', 'random weights').split(':')[0].split(' (')[0]
    return plot_paths(paths, 0, result.rtc_paths[0]['column'],
                      f'real-time chunking, {first["robot"]} synthetic episode, {policy}: d = '
                      f'{first["delay_rows"]} rows; {_subtitle(result, hz=False)}')
