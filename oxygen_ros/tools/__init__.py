"""Command-line tools above every layer; nothing in the package imports them (cli.py aside).

demo.py              `make demo`: oxygen_node + a simulated robot with a live view
soak.py              `oxygen-ros soak`: the node over DDS under random load and injected faults
record_demo.py       `oxygen-ros record-demo`: a bag of the demo robot's inputs (rclpy + bag/)
check_checkpoint.py  `oxygen-ros check-checkpoint DIR`: load a checkpoint, run one frame
robot_spec.py        `oxygen-ros robot-spec`: a robot's spec as YAML, read or checked
"""
