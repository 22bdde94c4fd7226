"""LeRobot datasets (ROS-free): reading episodes and scoring actions against the recorded ones."""

from oxygen_ros.dataset.lerobot import DatasetError, Frame, is_dataset, LeRobotDataset
from oxygen_ros.dataset.metrics import ActionErrors, chunk_error

__all__ = ['ActionErrors', 'chunk_error', 'DatasetError', 'Frame', 'is_dataset',
           'LeRobotDataset']
