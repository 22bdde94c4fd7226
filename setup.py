"""pip install of the pure-Python parts; the ROS 2 build uses CMakeLists.txt (colcon)."""

import glob

from setuptools import setup

# Everything is declared in setup.cfg. The ament files let ament_index find the package when a
# pip install lands in a ROS prefix; the message modules (oxygen_ros.msg) are built only by
# CMake, so a pip install has no oxygen_ros.msg.
setup(
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/oxygen_ros']),
        ('share/oxygen_ros', ['package.xml']),
        # The shipped robot specs (model/robot_spec.py finds them under share/ of the prefix).
        ('share/oxygen_ros/config/robots', sorted(glob.glob('config/robots/*.yaml'))),
    ],
)
