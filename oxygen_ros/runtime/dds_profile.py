"""The Fast DDS profile for raw camera frames (config/fastdds_large_frames.xml) and its variable.

Fast DDS reads a default XML profile from an environment variable when a process creates its
first participant: FASTDDS_DEFAULT_PROFILES_FILE since Fast DDS 3 (Kilted, Rolling),
FASTRTPS_DEFAULT_PROFILES_FILE before (Humble, Iron, Jazzy: Fast DDS 2.x; Kilted's rmw still
reads the old name, with a deprecation warning). The profile gives a process a shared-memory
segment large enough for raw frames (docs/cameras.md); the processes this package starts get it
from here, camera drivers started elsewhere from the same variable.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

PROFILE_NAME = 'fastdds_large_frames.xml'
FASTDDS_VARIABLE = 'FASTDDS_DEFAULT_PROFILES_FILE'      # Fast DDS 3.x
FASTRTPS_VARIABLE = 'FASTRTPS_DEFAULT_PROFILES_FILE'    # Fast DDS 2.x
FAST_DDS_2_DISTROS = ('humble', 'iron', 'jazzy')
FIRST_FAST_DDS_3_RCLPY = 9                               # Kilted's rclpy 9.x


def profile_path() -> Path:
    """Return the shipped profile: from the source tree, else from an installed share/."""
    here = Path(__file__).resolve().parents[2] / 'config' / PROFILE_NAME
    if here.is_file():
        return here
    for prefix in filter(None, os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep)):
        installed = Path(prefix) / 'share' / 'oxygen_ros' / 'config' / PROFILE_NAME
        if installed.is_file():
            return installed
    return here   # not found: callers name it, and Fast DDS reports a missing file


def uses_fast_dds_2(environ=os.environ) -> bool:
    """Return whether this ROS 2 has Fast DDS 2.x (ROS_DISTRO, else rclpy's version)."""
    distro = environ.get('ROS_DISTRO', '').lower()
    if distro:
        return distro in FAST_DDS_2_DISTROS
    try:
        major = int(importlib.metadata.version('rclpy').split('.')[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major < FIRST_FAST_DDS_3_RCLPY


def profile_variable(environ=os.environ) -> str:
    """Return the variable this machine's Fast DDS reads its default profile from."""
    return FASTRTPS_VARIABLE if uses_fast_dds_2(environ) else FASTDDS_VARIABLE


def profile_environment(path: Path | str | None = None, environ=os.environ,
                        keep_existing: bool = True) -> dict[str, str]:
    """Return the variables that give a process the profile (this machine's one only).

    keep_existing: empty when the environment already names a profile (a team's own profile
    is kept: merge the segment size into it, docs/cameras.md).
    """
    if keep_existing and (environ.get(FASTDDS_VARIABLE) or environ.get(FASTRTPS_VARIABLE)):
        return {}
    return {profile_variable(environ): str(path or profile_path())}
