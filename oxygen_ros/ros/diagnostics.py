"""Render the runtime's status model (oxygen_ros.runtime.status) as diagnostic_msgs."""

from __future__ import annotations

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from oxygen_ros.runtime.status import Status


def to_diagnostic_array(statuses: list[Status], stamp, hardware_id: str):
    """Statuses -> diagnostic_msgs/DiagnosticArray."""
    array = DiagnosticArray()
    array.header.stamp = stamp
    for status in statuses:
        msg = DiagnosticStatus()
        msg.level = bytes([status.level])
        msg.name = status.name
        msg.message = status.message[:1000]
        msg.hardware_id = hardware_id
        msg.values = [KeyValue(key=k, value=v) for k, v in status.values]
        array.status.append(msg)
    return array
