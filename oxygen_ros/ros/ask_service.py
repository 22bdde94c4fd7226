"""The node's `ask` service: a question answered from a robot's newest frame.

The service callback is a coroutine in a callback group of its own: it hands the question to
the robot's QuestionDesk (runtime/questions.py) and awaits a Future that the control thread
completes once the answer's last token is decoded. The default group would hold the wake
timer until then; a guard condition wakes the executor when the answer is ready.
"""

from __future__ import annotations

from typing import Callable

from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from rclpy.task import Future

from oxygen_ros.srv import Ask

from oxygen_ros.ros.robot_io import ns_to_stamp
from oxygen_ros.runtime.questions import Answer, refused


class AskService:
    """`ask` on `node`, over the desks of the loop that `loop()` returns (None: not built)."""

    def __init__(self, node: Node, loop: Callable[[], object], lifecycle: Callable[[], str]):
        self._node, self._loop, self._lifecycle = node, loop, lifecycle
        self._group = ReentrantCallbackGroup()
        self._ready = node.create_guard_condition(lambda: None, callback_group=self._group)
        self._service = node.create_service(Ask, 'ask', self._on_ask,
                                            callback_group=self._group)

    def desks(self) -> list:
        """Return the question desks of the loop's robots (those with questions on)."""
        loop = self._loop()
        if loop is None:
            return []
        return [r.questions for r in loop.robots.values() if r.questions is not None]

    def set_max_chars(self, max_chars: int) -> None:
        for desk in self.desks():
            desk.max_chars = max_chars

    def open(self, max_chars: int) -> None:
        """Take questions (activation), refusing those over max_chars characters."""
        for desk in self.desks():
            desk.max_chars = max_chars
            desk.open()

    def close(self, reason: str) -> None:
        """Answer every open question with `reason` and take no more (deactivation)."""
        for desk in self.desks():
            desk.close(reason)

    async def _on_ask(self, request: Ask.Request, response: Ask.Response) -> Ask.Response:
        """Answer a question from the robot's newest frame; awaits, never blocks the executor."""
        future = Future()
        answer = self._ask(request.question, request.robot, future)
        if answer is None:   # asked: the control thread sets the future once it is answered
            answer = await future
        response.ok, response.reason, response.answer = answer.ok, answer.reason, answer.text
        response.frame_index = answer.frame_index
        response.stamp = ns_to_stamp(answer.stamp_ns)
        response.finish_reason = answer.finish_reason
        response.tokens = answer.tokens
        response.wait_s = answer.wait_s
        if not answer.ok:
            self._node.get_logger().info(f'ask: no answer: {answer.reason}')
        return response

    def _ask(self, question: str, robot: str, future: Future) -> Answer | None:
        """Ask; return the refusal, or None when asked (`future` gets the Answer then)."""
        loop, lifecycle = self._loop(), self._lifecycle()
        if lifecycle != 'active' or loop is None:
            return refused(f'the node is {lifecycle}, not active: questions are answered '
                           'from the frames of an active node')
        names = list(loop.robots)
        if not robot and len(names) == 1:
            robot = names[0]
        if robot not in loop.robots:
            return refused(f'unknown robot {robot!r}; the node serves {names}')
        desk = loop.robots[robot].questions
        if desk is None:
            return refused('questions are off for this robot (ask_tokens 0)')

        def answered(answer: Answer) -> None:   # control thread (or deactivate)
            future.set_result(answer)
            self._ready.trigger()
        return desk.ask(question, answered)
