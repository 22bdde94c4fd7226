"""The engine's Python log records, forwarded to the node's throttled problem log.

The engine and runtime log with Python's logging (they know nothing of ROS); inside the node
their warnings and errors become problem-log events (throttled, keyed by the message's format
so the same warning with other numbers is one problem) and their INFO lines go to the ROS
logger.
"""

from __future__ import annotations

import logging
import threading

from oxygen_ros.runtime.status import ERROR, OK, ProblemLog, WARN


class EngineLogBridge(logging.Handler):
    """Forwards the engine's Python log records to the node's throttled problem log."""

    LEVELS = {logging.WARNING: WARN, logging.ERROR: ERROR, logging.CRITICAL: ERROR}

    def __init__(self, problems: ProblemLog, info: callable):
        super().__init__(logging.INFO)
        self.problems = problems
        self.info = info

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f'{record.name}: {record.getMessage()}'
            if record.levelno < logging.WARNING:
                self.info(text)
            else:
                # Key on the format string: the same warning with other numbers is one problem.
                self.problems.event(f'{record.name}:{record.msg}',
                                    self.LEVELS.get(record.levelno, ERROR), text)
        except Exception:   # noqa: BLE001 - logging must never break the caller
            self.handleError(record)


class BridgeAttachment:
    """Attach bridges to the 'oxygen_ros' logger; stop propagation while any is attached."""

    lock = threading.Lock()
    attached: list = []
    propagate = True

    @classmethod
    def attach(cls, bridge: logging.Handler) -> None:
        logger = logging.getLogger('oxygen_ros')
        with cls.lock:
            if not cls.attached:
                # The bridges print records through the ROS logger; without this they would
                # print twice (Python's last-resort handler writes warnings to stderr too).
                cls.propagate = logger.propagate
                logger.propagate = False
                if logger.level == logging.NOTSET or logger.level > logging.INFO:
                    logger.setLevel(logging.INFO)
            cls.attached.append(bridge)
            logger.addHandler(bridge)

    @classmethod
    def detach(cls, bridge: logging.Handler) -> None:
        logger = logging.getLogger('oxygen_ros')
        with cls.lock:
            if bridge in cls.attached:
                cls.attached.remove(bridge)
                logger.removeHandler(bridge)
                if not cls.attached:
                    logger.propagate = cls.propagate


def log_at(logger, level: int, message: str) -> None:
    """Write `message` to an rclpy logger at a ProblemLog level (OK, WARN, ERROR)."""
    # One call site per severity: rclpy refuses a call site whose severity changes.
    if level == OK:
        logger.info(message)
    elif level == WARN:
        logger.warning(message)
    else:
        logger.error(message)
