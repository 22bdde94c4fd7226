"""ros/parameters.py: validate on set, apply after set (the value is stored when applied).

A bare LifecycleNode with the node's parameters (no engine, no executor): what the on-set
callback refuses changes nothing, and what it accepts reaches `apply` after rclpy stored it.
"""

import pytest

rclpy = pytest.importorskip('rclpy')

from rclpy.lifecycle import LifecycleNode  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from oxygen_ros.ros.parameters import NodeParameters, Served  # noqa: E402
from oxygen_ros.runtime.params import FleetSettings, Settings  # noqa: E402
from oxygen_ros.runtime.status import ProblemLog  # noqa: E402


def make(context, served):
    node = LifecycleNode('oxygen_params_test', context=context)
    applied = []

    def apply(changes):
        # What the node applies must already be what a get_parameter reads.
        applied.append({name: (value, node.get_parameter(name).value)
                        for name, value in changes.items()})
    params = NodeParameters(node, ProblemLog(lambda level, msg: None), served, apply)
    params.declare_all()
    return node, params, applied


def test_changes_are_applied_after_they_are_stored(rclpy_context):
    node, params, applied = make(rclpy_context, lambda: Served('unconfigured'))
    try:
        assert applied == [], 'declaring applies nothing'
        assert node.set_parameters([Parameter('decode_budget', value=3)])[0].successful
        assert applied == [{'decode_budget': (3, 3)}]
        # A configure-time parameter is stored, not applied (configure reads it).
        assert node.set_parameters([Parameter('preset', value='tiny')])[0].successful
        assert len(applied) == 1
        # A refused value is neither stored nor applied.
        result = node.set_parameters([Parameter('decode_budget', value='fast')])[0]
        assert not result.successful and 'expected an integer' in result.reason
        assert node.get_parameter('decode_budget').value == 3 and len(applied) == 1
    finally:
        node.destroy_node()


def test_checks_follow_what_the_node_serves(rclpy_context):
    settings = Settings.from_values({'preset': 'tiny', 'tokens_per_request': 4,
                                     'decode_budget': 2})
    served = Served('active', FleetSettings.one(settings), {'': 3})
    node, params, applied = make(rclpy_context, lambda: served)
    try:
        result = node.set_parameters([Parameter('decode_budget', value=1)])[0]
        assert not result.successful and 'needs 5 KV slots' in result.reason
        result = node.set_parameters([Parameter('preset', value='pi05-cpu')])[0]
        assert not result.successful and 'only change while unconfigured' in result.reason
        result = node.set_parameters([Parameter('stale_frame_timeout_s', value=4.0)])[0]
        assert not result.successful and 'safety limit' in result.reason
        assert applied == []
        assert node.set_parameters([Parameter('stale_frame_timeout_s', value=0.2)])[0].successful
        assert applied == [{'stale_frame_timeout_s': (0.2, 0.2)}]
    finally:
        node.destroy_node()
