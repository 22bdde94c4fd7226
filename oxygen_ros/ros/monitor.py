"""Observer of a running oxygen_node: records every action chunk, token chunk and diagnostic.

    python -m oxygen_ros.ros.monitor --duration 60 --out stats.json

Subscribes `actions`, `language/tokens` and `/diagnostics` (same QoS as the node's publishers)
and writes, when the duration ends or on Ctrl-C / SIGTERM, one JSON file:

    ticks        one record per ActionChunk: receive time `t`, header `stamp` (s), `frame`
                 index, `inference_s` (the chunk's inference_time) and `tokens`, the tokens of
                 the LanguageChunks that carried the same stamp (the same tick)
    tokens       one record per LanguageChunk: `t`, `stamp`, `request`, `n` tokens, `done`,
                 `finish_reason`
    narrations   one record per language/narration message (a completed request): `t`, `chars`
    instructions one record per instruction the node is sent: `t`, `chars`
    diagnostics  one record per /diagnostics message naming the node: `t`, lifecycle `state`
                 (the model status's message) and the values of its `model`, `control loop`,
                 `language` and `inputs` statuses (deadline_misses_total, current_k, camera
                 message counts, ...) where present
    summary      ticks, rate, inference p50/p99, tokens/s over the whole recording

Receive times are `time.monotonic()` seconds (CLOCK_MONOTONIC, shared by every process of the
machine), so another process can cut the records into its own time windows. While running,
stdout gets one JSON line per event:
    {"event": "lifecycle", "state": ..., "level": ..., "t": ...}   the node's lifecycle state
                                   or its model status level (2 = ERROR) changed
    {"event": "first_action", "t": ...}
    {"event": "written", "path": ..., <summary>}                   at the end
Use the same ROS_DOMAIN_ID as the node.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path
import statistics
import sys
import threading
import time

from diagnostic_msgs.msg import DiagnosticArray
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from std_msgs.msg import String

from oxygen_ros.msg import ActionChunk, LanguageChunk
from oxygen_ros.ros import qos
from oxygen_ros.runtime.params import NODE_NAME

try:
    from rclpy.executors import ExternalShutdownException
except ImportError:   # pragma: no cover - older rclpy raise KeyboardInterrupt only
    ExternalShutdownException = KeyboardInterrupt

DIAGNOSTIC_PARTS = ('control loop', 'language', 'inputs')   # statuses whose values are kept


def _stamp_s(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


class OutputMonitor(Node):
    """Records what oxygen_node publishes, with monotonic receive times."""

    def __init__(self, node_name: str = NODE_NAME, events=None, **kwargs):
        super().__init__('oxygen_monitor', **kwargs)
        self.watched = node_name
        self.events = events              # file for the JSON event lines (None: silent)
        self.lock = threading.Lock()
        self.ticks: list[dict] = []
        self.tokens: list[dict] = []
        self.diagnostics: list[dict] = []
        self.narrations: list[dict] = []
        self.instructions: list[dict] = []
        self.state = ('', 0)               # last (lifecycle state, model status level)
        self.started = time.monotonic()
        self.create_subscription(ActionChunk, 'actions', self._on_action, qos.ACTIONS_RECORDER)
        self.create_subscription(LanguageChunk, 'language/tokens', self._on_tokens, qos.TOKENS)
        self.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics,
                                 qos.DIAGNOSTICS)
        self.create_subscription(String, 'language/narration',
                                 lambda msg: self._on_text(self.narrations, msg), qos.NARRATION)
        self.create_subscription(String, 'instruction',
                                 lambda msg: self._on_text(self.instructions, msg),
                                 qos.INSTRUCTION)

    def _event(self, **fields) -> None:
        if self.events is not None:
            self.events.write(json.dumps(fields) + '\n')
            self.events.flush()

    def _on_action(self, msg: ActionChunk) -> None:
        now = time.monotonic()
        with self.lock:
            self.ticks.append({'t': now, 'stamp': _stamp_s(msg.header.stamp),
                               'frame': int(msg.frame_index),
                               'inference_s': float(msg.inference_time)})
            first = len(self.ticks) == 1
        if first:
            self._event(event='first_action', t=now)
        self.get_logger().debug(f'frame {msg.frame_index}: inference '
                                f'{msg.inference_time * 1e3:.1f} ms')

    def _on_tokens(self, msg: LanguageChunk) -> None:
        with self.lock:
            self.tokens.append({'t': time.monotonic(), 'stamp': _stamp_s(msg.header.stamp),
                                'request': int(msg.request_id), 'n': len(msg.token_ids),
                                'done': bool(msg.done), 'finish_reason': msg.finish_reason})

    def _on_text(self, records: list[dict], msg: String) -> None:
        with self.lock:
            records.append({'t': time.monotonic(), 'chars': len(msg.data)})

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        now = time.monotonic()
        prefix = f'{self.watched}:'
        record = {'t': now}
        for status in msg.status:
            if not status.name.startswith(prefix):
                continue
            part = status.name[len(prefix):].strip()
            if part == 'model':
                record['state'] = status.message
                # 2 = ERROR: e.g. a failed configure (the node stays alive, unconfigured).
                record['model_level'] = status.level[0] if status.level else 0
                record['model'] = {kv.key: kv.value for kv in status.values}
            elif part in DIAGNOSTIC_PARTS:
                record[part] = {kv.key: kv.value for kv in status.values}
        if len(record) == 1:
            return   # another node's diagnostics
        with self.lock:
            self.diagnostics.append(record)
        state = (record.get('state'), record.get('model_level'))
        if state[0] and state != self.state:
            self.state = state
            self._event(event='lifecycle', state=state[0], level=state[1], t=now)

    def result(self) -> dict:
        """Everything recorded so far, ticks joined with their tokens, plus a summary."""
        with self.lock:
            ticks = [dict(t) for t in self.ticks]
            tokens = list(self.tokens)
            diagnostics = list(self.diagnostics)
            narrations, instructions = list(self.narrations), list(self.instructions)
        join_tokens(ticks, tokens)
        return {'node': self.watched, 'clock': 'time.monotonic() seconds (CLOCK_MONOTONIC)',
                'started': self.started, 'ended': time.monotonic(), 'ticks': ticks,
                'tokens': tokens, 'diagnostics': diagnostics, 'narrations': narrations,
                'instructions': instructions,
                'summary': summarize(ticks, tokens)}


def join_tokens(ticks: list[dict], tokens: list[dict]) -> None:
    """Set each tick's `tokens`: the LanguageChunks of the same tick.

    A tick's chunks carry its ActionChunk's stamp, but two ticks can share a stamp (no new
    camera frame in between), so a chunk goes to the last tick with its stamp received before
    it (the node publishes the action chunk first).
    """
    by_stamp = collections.defaultdict(list)
    for tick in ticks:
        tick['tokens'] = 0
        by_stamp[tick['stamp']].append(tick)
    for chunk in tokens:
        same = by_stamp.get(chunk['stamp'])
        if not same:
            continue   # a tick without a new frame (language only) or its chunk was lost
        before = [tick for tick in same if tick['t'] <= chunk['t']]
        (before[-1] if before else same[0])['tokens'] += chunk['n']


def summarize(ticks: list[dict], tokens: list[dict]) -> dict:
    """Whole-recording figures: ticks, rate, inference p50/p99 (ms), tokens/s."""
    times = [t['t'] for t in ticks]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    inference_ms = sorted(1e3 * t['inference_s'] for t in ticks)
    n_tokens = sum(c['n'] for c in tokens)
    return {
        'ticks': len(ticks),
        'rate_hz': (len(times) - 1) / span if span > 0 else 0.0,
        'inference_p50_ms': statistics.median(inference_ms) if inference_ms else None,
        'inference_p99_ms': (inference_ms[min(len(inference_ms) - 1,
                                              int(0.99 * len(inference_ms)))]
                             if inference_ms else None),
        'tokens': n_tokens,
        'tokens_per_s': n_tokens / span if span > 0 else 0.0,
    }


def write_json(data: dict, path: str | Path) -> None:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Record for --duration seconds (0: until Ctrl-C / SIGTERM), then write --out."""
    parser = argparse.ArgumentParser(prog='python -m oxygen_ros.ros.monitor',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--duration', type=float, default=0.0,
                        help='seconds to record (0 = until Ctrl-C or SIGTERM)')
    parser.add_argument('--out', required=True, help='JSON file to write')
    parser.add_argument('--node-name', default=NODE_NAME,
                        help='node whose /diagnostics statuses are recorded')
    parser.add_argument('--quiet', action='store_true', help='no event lines on stdout')
    args, ros_args = parser.parse_known_args(argv)
    rclpy.init(args=ros_args)
    monitor = OutputMonitor(args.node_name, events=None if args.quiet else sys.stdout)
    executor = SingleThreadedExecutor()
    executor.add_node(monitor)
    end = time.monotonic() + args.duration if args.duration > 0 else float('inf')
    try:
        while rclpy.ok() and time.monotonic() < end:
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass   # Ctrl-C or SIGTERM (rclpy's handler shuts the context down): write what we have
    finally:
        data = monitor.result()
        write_json(data, args.out)
        monitor._event(event='written', path=str(args.out), **data['summary'])
        executor.shutdown()
        monitor.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
