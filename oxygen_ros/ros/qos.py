"""Every QoS profile of the package, chosen in one place (nodes and tools import these)."""

from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy)

# Sensors: only the newest frame matters, a late one is worse than none. Best effort also
# matches reliable publishers (camera drivers, joint_state_broadcaster use either).
SENSOR = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                    reliability=ReliabilityPolicy.BEST_EFFORT,
                    durability=DurabilityPolicy.VOLATILE)

# The task is state: a node started after the instruction was published still gets it.
# Publishers must offer transient local too (`ros2 topic pub --qos-durability transient_local`).
INSTRUCTION = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)

# Outputs: every chunk and token counts (controllers, recorders, the narration stream).
ACTIONS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                     reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.VOLATILE)
TOKENS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=100,
                    reliability=ReliabilityPolicy.RELIABLE,
                    durability=DurabilityPolicy.VOLATILE)
# Late joiners (`ros2 topic echo` started later) see the last few narrations.
NARRATION = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                       reliability=ReliabilityPolicy.RELIABLE,
                       durability=DurabilityPolicy.TRANSIENT_LOCAL)
# As diagnostic_updater publishes /diagnostics.
DIAGNOSTICS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
