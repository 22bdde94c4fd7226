"""Asks a running oxygen_node a question every period and records the replies (the bench).

    python -m oxygen_ros.ros.asker --period 2 --out asks.json [--questions Q ...]

Calls the node's `ask` service (oxygen_ros/srv/Ask) every --period seconds with the next of
--questions, whatever the replies pending, and writes, on Ctrl-C / SIGTERM, one JSON file:

    asks    one record per question: `sent` and `replied` (time.monotonic() seconds; replied
            None when no reply came), and the reply's `ok`, `reason`, `frame`, `wait_s`
            (the node's request-to-answer time), `tokens`, `finish_reason`

Use the same ROS_DOMAIN_ID as the node.
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from oxygen_ros.ros.monitor import write_json
from oxygen_ros.srv import Ask

try:
    from rclpy.executors import ExternalShutdownException
except ImportError:   # pragma: no cover - older rclpy raise KeyboardInterrupt only
    ExternalShutdownException = KeyboardInterrupt


class Asker(Node):
    """Asks a question every `period_s` and keeps every reply."""

    def __init__(self, period_s: float, questions: list[str], service: str = 'ask'):
        super().__init__('oxygen_bench_asker')
        self.client = self.create_client(Ask, service)
        self.lock = threading.Lock()
        self.asks: list[dict] = []
        self._questions = itertools.cycle(questions)
        self.timer = self.create_timer(period_s, self._ask)

    def _ask(self) -> None:
        if not self.client.service_is_ready():
            return
        record = {'sent': time.monotonic(), 'replied': None}
        with self.lock:
            self.asks.append(record)
        future = self.client.call_async(Ask.Request(question=next(self._questions)))
        future.add_done_callback(lambda done: self._replied(record, done))

    def _replied(self, record: dict, future) -> None:
        reply = future.result()
        with self.lock:
            record.update(replied=time.monotonic(), ok=bool(reply.ok), reason=reply.reason,
                          frame=int(reply.frame_index), wait_s=float(reply.wait_s),
                          tokens=int(reply.tokens), finish_reason=reply.finish_reason)


def main(argv: list[str] | None = None) -> int:
    """Ask until Ctrl-C / SIGTERM, then write --out."""
    parser = argparse.ArgumentParser(prog='python -m oxygen_ros.ros.asker',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--period', type=float, default=2.0, help='seconds between questions')
    parser.add_argument('--out', required=True, help='JSON file to write')
    parser.add_argument('--questions', nargs='+', default=['what is in the gripper?'],
                        help='asked in turn')
    args, ros_args = parser.parse_known_args(argv)
    rclpy.init(args=ros_args)
    asker = Asker(args.period, args.questions)
    executor = SingleThreadedExecutor()
    executor.add_node(asker)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass   # Ctrl-C or SIGTERM: write what we have
    finally:
        with asker.lock:
            write_json({'asks': list(asker.asks)}, args.out)
        executor.shutdown()
        asker.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
