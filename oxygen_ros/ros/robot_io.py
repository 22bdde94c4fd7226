"""One robot's topics on oxygen_node: polled cameras and joint states, instruction, outputs.

The single-robot node has one RobotIO in its own namespace; a node serving a fleet has one per
robot, in the robot's namespace (`arm_left/camera/image/image_raw`, `arm_left/actions`, ...,
relative to the node's namespace). Each RobotIO owns its subscriptions, its InputSet (what the
frame loop builds observations from) and its RosOutputs (the frame loop's sink), so the
wiring is written once for both.
"""

from __future__ import annotations

import copy
import threading
from typing import Callable

import rclpy
from rclpy.lifecycle import LifecycleNode
from rclpy.qos_overriding_options import QoSOverridingOptions

from builtin_interfaces.msg import Time
from sensor_msgs.msg import CameraInfo, CompressedImage, Image, JointState
from std_msgs.msg import String

from oxygen_ros.msg import ActionChunk, LanguageChunk
from oxygen_ros.ros import qos
from oxygen_ros.ros.conversions import (action_chunk_msg, joint_trajectory_msg,
                                        language_chunk_msg)
from oxygen_ros.ros.polling import LostMessages, never_called, PolledGroup, take_all
from oxygen_ros.runtime.actions import action_layout, ActionLayout
from oxygen_ros.runtime.conversions import (check_frame_size, compressed_to_rgb, image_to_rgb,
                                            InputError, joint_state_to_vector)
from oxygen_ros.runtime.dds_profile import profile_path, profile_variable
from oxygen_ros.runtime.inputs import InputSet, InputSource, sanitize_instruction
from oxygen_ros.runtime.params import NARRATION, Settings
from oxygen_ros.runtime.questions import ASK, ASK_TOPIC
from oxygen_ros.runtime.status import OK, ProblemLog, WARN
from oxygen_ros.runtime.subtask import SUBTASK_TOPIC

try:   # Jazzy+ names the event classes event_handler; Humble only has qos_event.
    from rclpy.event_handler import SubscriptionEventCallbacks
except ImportError:   # pragma: no cover - Humble
    from rclpy.qos_event import SubscriptionEventCallbacks

JOINT_STATES_KEY = 'joint_states'


def loss_remedy() -> str:
    """Return what a camera message loss warning advises, for the middleware in use."""
    if 'fastrtps' not in rclpy.get_rmw_implementation_identifier():
        return 'check the publisher and the link to it'
    return (f'start the camera driver with {profile_variable()}={profile_path()} (raw '
            "frames overrun Fast DDS's default 512 KB shared-memory segment; docs/cameras.md)")


def ns_to_stamp(stamp_ns: int) -> Time:
    """Integer nanoseconds -> builtin_interfaces/Time, exact."""
    stamp_ns = max(int(stamp_ns), 0)
    return Time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000)


def in_namespace(namespace: str, topic: str) -> str:
    """Return a robot's topic: relative names go under its namespace, absolute ones stay."""
    if not namespace or topic.startswith(('/', '~')):
        return topic
    return f'{namespace}/{topic}'


def _overridable(profile):
    """Copy a shared QoS profile: QoS overriding options write into the profile given."""
    return copy.copy(profile)


class RosOutputs:
    """The frame loop's OutputSink over one robot's publishers, behind an open/closed switch.

    close() returns only after a publish in flight has finished, and nothing is published
    after it: that is what makes "no ActionChunk after deactivate returned" hold even for a
    tick that is still running.
    """

    def __init__(self, node: LifecycleNode, frame_id: str, layout: ActionLayout,
                 trajectory: bool = False, namespace: str = '',
                 task_topics: dict[str, str] | None = None, subtask: bool = False):
        self.frame_id = frame_id
        self.layout = layout
        self._lock = threading.Lock()
        self._open = False
        self._node = node
        self.actions_published = 0   # ActionChunks published so far (after the switch)
        self._actions = node.create_publisher(ActionChunk, in_namespace(namespace, 'actions'),
                                              qos.ACTIONS)
        # One LanguageChunk publisher per language task (narration: language/tokens).
        task_topics = task_topics or {NARRATION: 'language/tokens'}
        self._task_tokens = {task: node.create_publisher(
            LanguageChunk, in_namespace(namespace, topic), qos.TOKENS)
            for task, topic in task_topics.items()}
        self._narration = node.create_publisher(
            String, in_namespace(namespace, 'language/narration'), qos.NARRATION)
        # π0.5's subtask loop: the subtask driving the actions ('' = the instruction).
        self._subtask = node.create_publisher(
            String, in_namespace(namespace, SUBTASK_TOPIC), qos.SUBTASK) if subtask else None
        self._trajectory = None
        if trajectory:
            from trajectory_msgs.msg import JointTrajectory

            self._trajectory = node.create_publisher(
                JointTrajectory, in_namespace(namespace, 'joint_trajectory'), qos.TRAJECTORY)

    def open(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        with self._lock:
            self._open = False

    def destroy(self) -> None:
        self.close()
        for pub in (self._actions, *self._task_tokens.values(), self._narration,
                    self._subtask, self._trajectory):
            if pub is not None:
                self._node.destroy_publisher(pub)

    def _publish(self, publisher, msg) -> bool:
        with self._lock:
            if self._open:
                publisher.publish(msg)
            return self._open

    def action(self, action, stamp_ns: int) -> None:
        if self._publish(self._actions, action_chunk_msg(action, ns_to_stamp(stamp_ns),
                                                         self.frame_id, self.layout)):
            self.actions_published += 1
        if self._trajectory is not None:
            self._publish(self._trajectory,
                          joint_trajectory_msg(action, self.frame_id, self.layout))

    def tokens(self, delta, stamp_ns: int) -> None:
        publisher = self._task_tokens.get(delta.task)
        if publisher is not None:
            self._publish(publisher, language_chunk_msg(delta, ns_to_stamp(stamp_ns),
                                                        self.frame_id))

    def narration(self, request, stamp_ns: int) -> None:
        if request.task == NARRATION:   # the other tasks' texts are in their LanguageChunks
            self._publish(self._narration, String(data=request.text))

    def subtask(self, subtask, stamp_ns: int) -> None:
        if self._subtask is not None:
            self._publish(self._subtask, String(data=subtask.text if subtask else ''))


class RobotIO:
    """One robot's subscriptions, inputs and outputs on `node`, topics under `namespace`.

    Cameras and joint states are polled: the control thread takes their messages at the start
    of a tick (ros/polling.py says why); only the instruction is a callback. Each
    subscription's QoS can be overridden with parameters (qos_overrides.<topic>.
    subscription[_<id>].<policy>, read-only, given at startup), as rclcpp nodes allow.

    problems: where this robot's instruction notes and QoS mismatches go;
    max_instruction_chars: read at each instruction (a runtime parameter of the node).
    """

    def __init__(self, node: LifecycleNode, settings: Settings, problems: ProblemLog,
                 max_instruction_chars: Callable[[], int], namespace: str = ''):
        self.node = node
        self.settings = settings
        self.problems = problems
        self.namespace = namespace
        self._max_instruction_chars = max_instruction_chars
        self.subscriptions: list = []
        self.lost_counters: list[tuple[str, LostMessages]] = []   # (camera key, its count)
        self.outputs = RosOutputs(node, settings.frame_id,
                                  action_layout(settings.spec or settings.robot),
                                  settings.publish_trajectory, namespace,
                                  {**{task.name: task.token_topic for task in settings.tasks},
                                   **({ASK: ASK_TOPIC} if settings.ask_tokens else {})},
                                  any(task.drives_actions for task in settings.tasks))
        try:
            self.inputs = self._subscribe(settings)
        except BaseException:
            self.destroy()
            raise

    @property
    def resolved_namespace(self) -> str:
        """Where this robot's relative topics live, e.g. /cell/arm_left."""
        base = self.node.get_namespace().rstrip('/')
        return f'{base}/{self.namespace}' if self.namespace else base or '/'

    def destroy(self) -> None:
        """Drop the subscriptions and publishers."""
        for _, lost in self.lost_counters:            # events before their subscriptions
            lost.destroy()
        self.lost_counters = []
        for sub in self.subscriptions:
            self.node.destroy_subscription(sub)
        self.subscriptions = []
        self.outputs.destroy()

    def _subscribe(self, settings: Settings) -> InputSet:
        node, ns = self.node, self.namespace
        polled_group = PolledGroup()
        polled = []   # (buffer key, subscription)
        cameras = []
        infos = {}    # camera name -> buffer key of its camera_info
        for cam in settings.cameras:
            key = f'camera:{cam.name}'
            sub = node.create_subscription(
                CompressedImage if cam.compressed else Image, in_namespace(ns, cam.image_topic),
                never_called, _overridable(qos.SENSOR), callback_group=polled_group,
                qos_overriding_options=QoSOverridingOptions.with_default_policies())
            polled.append((key, sub))
            self.subscriptions.append(sub)
            self.lost_counters.append((key, LostMessages(sub)))
            if cam.check_camera_info:
                infos[cam.name] = f'camera_info:{cam.name}'
                info_sub = node.create_subscription(
                    CameraInfo, in_namespace(ns, cam.info_topic), never_called, qos.SENSOR,
                    callback_group=polled_group)
                polled.append((infos[cam.name], info_sub))
                self.subscriptions.append(info_sub)
            cameras.append((cam.name, InputSource(
                key, f'camera {cam.name!r} ({sub.topic_name})',
                self._image_converter(cam.compressed, infos.get(cam.name)))))
        joints = settings.joint_names
        # Deeper than the cameras': every JointState since the last tick is merged per joint
        # name (arm and gripper often publish separately), so none may be overwritten.
        sub = node.create_subscription(
            JointState, in_namespace(ns, 'joint_states'), never_called,
            _overridable(qos.JOINT_STATES), callback_group=polled_group,
            qos_overriding_options=QoSOverridingOptions.with_default_policies())
        polled.append((JOINT_STATES_KEY, sub))
        self.subscriptions.append(sub)
        joint_source = InputSource(JOINT_STATES_KEY, f'joint_states ({sub.topic_name})',
                                   lambda m: joint_state_to_vector(m.name, m.position, joints))
        inputs = InputSet(cameras, joint_source, settings.stale_frame_timeout_s,
                          joint_names=joints)
        self.inputs = inputs
        # The instruction, twice: a latched publisher (transient local, the task as state) and
        # a plain one (`ros2 topic pub`: reliable + volatile) each match one of these; the
        # newest message of either wins. A transient-local publisher reaches both, so the same
        # text may arrive twice: it changes nothing the second time.
        # A volatile publisher is incompatible with the latched subscription by design: that
        # event is ignored (rclpy would log it); the volatile one reports real mismatches.
        ignore = SubscriptionEventCallbacks(incompatible_qos=lambda event: None)
        events = SubscriptionEventCallbacks(incompatible_qos=self._on_instruction_qos)
        for entity_id, profile, event_callbacks in (
                ('latched', qos.INSTRUCTION, ignore),
                ('volatile', qos.INSTRUCTION_VOLATILE, events)):
            # Bound to `inputs`: a latched message can arrive before configure returns.
            sub = node.create_subscription(
                String, in_namespace(ns, 'instruction'),
                lambda msg: self._on_instruction(msg, inputs), _overridable(profile),
                event_callbacks=event_callbacks,
                qos_overriding_options=QoSOverridingOptions.with_default_policies(
                    entity_id=entity_id))
            self.subscriptions.append(sub)
            inputs.instruction_topic = sub.topic_name   # as remapped

        camera_keys = {key for key, _ in self.lost_counters}
        loss = inputs.loss
        inputs.loss_remedy = loss_remedy()

        def take_polled(now_s: float) -> None:
            for key, polled_sub in polled:
                for taken in take_all(polled_sub):
                    inputs.put(key, taken.msg, now_s - taken.age_s)
                    if key in camera_keys:
                        loss.taken(key, now_s, taken.age_s, taken.sequence, taken.publisher,
                                   taken.sent_s)
            for key, lost in self.lost_counters:
                loss.lost_total(key, now_s, lost.total())

        inputs.pull = take_polled
        return inputs

    def _image_converter(self, compressed: bool, info_key: str | None):
        """Message -> RGB for one camera; with info_key, also check the size from camera_info."""
        def convert(msg):
            if compressed:
                rgb = compressed_to_rgb(msg.format, msg.data)
            else:
                rgb = image_to_rgb(msg.encoding, msg.height, msg.width, msg.step, msg.data,
                                   msg.is_bigendian)
            if info_key is not None:
                inputs = getattr(self, 'inputs', None)
                entry = inputs.buffer.get(info_key) if inputs is not None else None
                if entry is None:
                    raise InputError('no camera_info received yet (check_camera_info is on)')
                check_frame_size(rgb, entry.msg.width, entry.msg.height)
            return rgb
        return convert

    def _on_instruction(self, msg: String, inputs: InputSet) -> None:
        instruction = sanitize_instruction(msg.data, self._max_instruction_chars())
        if inputs.instruction == instruction:
            return   # the same task again (both subscriptions get a latched publisher's)
        inputs.set_instruction(instruction)
        if not instruction.text:
            self.problems.note(WARN, 'instruction is empty: no task, so no actions until a '
                                     'non-empty instruction arrives (running language '
                                     'requests continue)')
        else:
            shown = instruction.text if len(instruction.text) <= 120 else (
                instruction.text[:117] + '...')
            self.problems.note(OK, f'instruction: "{shown}"')
        if instruction.notes:
            self.problems.note(WARN, 'instruction ' + ', '.join(instruction.notes))

    def _on_instruction_qos(self, event) -> None:
        self.problems.event('instruction_qos', WARN, (
            'an instruction publisher has incompatible QoS: the node takes reliable '
            'publishers, volatile or transient local; publish reliable (the `ros2 topic pub` '
            'default)'))
