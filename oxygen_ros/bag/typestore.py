"""Message types for bags: the standard ROS 2 types plus oxygen_ros/msg/*, without ROS installed.

Our definitions are read from the package's msg/*.msg files (source tree or an installed
share/oxygen_ros/msg), so a bag we write carries exactly the text rosidl builds the
generated code from, and its type hashes (RIHS01) equal the ones ROS computes.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from rosbags.typesys import get_types_from_msg, get_typestore, Stores
from rosbags.typesys.store import Typestore

from oxygen_ros.bag.errors import BagError

PACKAGE = 'oxygen_ros'
ACTION_CHUNK = 'oxygen_ros/msg/ActionChunk'
LANGUAGE_CHUNK = 'oxygen_ros/msg/LanguageChunk'
IMAGE = 'sensor_msgs/msg/Image'
COMPRESSED_IMAGE = 'sensor_msgs/msg/CompressedImage'
JOINT_STATE = 'sensor_msgs/msg/JointState'
STRING = 'std_msgs/msg/String'
DIAGNOSTIC_ARRAY = 'diagnostic_msgs/msg/DiagnosticArray'
# Why Jazzy: the definitions of every standard type used here are identical from Humble to
# Kilted, and Jazzy is the distribution robots run most.
BASE_STORE = Stores.ROS2_JAZZY


def msg_dirs() -> list[Path]:
    """Directories that may hold our .msg files, most specific first."""
    dirs = []
    if os.environ.get('OXYGEN_ROS_MSG_DIR'):
        dirs.append(Path(os.environ['OXYGEN_ROS_MSG_DIR']))
    dirs.append(Path(__file__).resolve().parents[2] / 'msg')   # source tree: <repo>/msg
    # Installed (colcon): <prefix>/share/oxygen_ros/msg; read from the environment, since
    # this layer imports nothing from ROS (not even ament_index_python).
    for prefix in os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep):
        if prefix:
            dirs.append(Path(prefix) / 'share' / PACKAGE / 'msg')
    return dirs


def find_msg_dir() -> Path:
    """Return the first directory with ActionChunk.msg (BagError lists where it looked)."""
    dirs = msg_dirs()
    for path in dirs:
        if (path / 'ActionChunk.msg').is_file():
            return path
    raise BagError('oxygen_ros message definitions (ActionChunk.msg) not found; looked in '
                   + ', '.join(str(d) for d in dirs) + ' (set OXYGEN_ROS_MSG_DIR)')


@functools.lru_cache(maxsize=4)
def _parse_msg_dir(msg_dir: Path) -> dict:
    types = {}
    for path in sorted(msg_dir.glob('*.msg')):
        types.update(get_types_from_msg(path.read_text(), f'{PACKAGE}/msg/{path.stem}'))
    return types


def our_message_types(msg_dir: Path | None = None) -> dict:
    """Return field definitions of every oxygen_ros/msg/* type (rosbags' get_types_from_msg)."""
    return dict(_parse_msg_dir(msg_dir or find_msg_dir()))


def make_typestore() -> Typestore:
    """Return a new typestore of the standard ROS 2 types plus ours (callers may extend it)."""
    store = get_typestore(BASE_STORE)
    store.register(our_message_types())
    return store
