"""Every QoS profile of the package, chosen in one place (nodes and tools import these)."""

from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy)

# Sensors: only the newest frame matters, a late one is worse than none. Best effort also
# matches reliable publishers (camera drivers, joint_state_broadcaster use either).
SENSOR = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                    reliability=ReliabilityPolicy.BEST_EFFORT,
                    durability=DurabilityPolicy.VOLATILE)

# Joint states: every message since the last tick is merged per joint name (arm and gripper
# may publish separately at 50-1000 Hz), so the history holds more than one.
JOINT_STATES = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=20,
                          reliability=ReliabilityPolicy.BEST_EFFORT,
                          durability=DurabilityPolicy.VOLATILE)

# The task is state: a node started after the instruction was published still gets it from a
# transient-local publisher. The node subscribes twice (newest wins): INSTRUCTION matches
# latched publishers, INSTRUCTION_VOLATILE plain ones (`ros2 topic pub`'s default is reliable
# + volatile, which a transient-local subscription refuses as incompatible).
INSTRUCTION = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
INSTRUCTION_VOLATILE = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                                  reliability=ReliabilityPolicy.RELIABLE,
                                  durability=DurabilityPolicy.VOLATILE)

# Actions: only the newest chunk is worth executing; a slow controller must not be handed
# queued stale ones. Reliable, so the newest one is not lost on a busy link.
ACTIONS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                     reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.VOLATILE)
# joint_trajectory_controller's joint_trajectory subscription and forward_command_controller's
# commands: reliable (rclcpp's system default they use), newest only.
TRAJECTORY = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                        reliability=ReliabilityPolicy.RELIABLE,
                        durability=DurabilityPolicy.VOLATILE)
COMMANDS = TRAJECTORY
# Tools that record every chunk (monitor, tests) subscribe deeper on their side: compatible
# with ACTIONS, and their own history keeps what arrives while they are busy.
ACTIONS_RECORDER = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                              reliability=ReliabilityPolicy.RELIABLE,
                              durability=DurabilityPolicy.VOLATILE)

# Other outputs: every token counts (recorders, the narration stream).
TOKENS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                    reliability=ReliabilityPolicy.RELIABLE,
                    durability=DurabilityPolicy.VOLATILE)
# Late joiners (`ros2 topic echo` started later) see the last few narrations.
NARRATION = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                       reliability=ReliabilityPolicy.RELIABLE,
                       durability=DurabilityPolicy.TRANSIENT_LOCAL)
# The subtask driving the actions is state, as the instruction is: a late joiner gets the
# active one (language/subtask).
SUBTASK = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                     reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)
# As diagnostic_updater publishes /diagnostics.
DIAGNOSTICS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
