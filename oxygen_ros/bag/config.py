"""Replay settings: the node's own parameters (same file, names, defaults and checks).

The parameter table and its checks live in oxygen_ros.runtime.params, which is pure Python
(no rclpy), so a replay reads config/<robot>.yaml exactly as the node does and rejects what
the node would reject. ReplayParams adds the few things only a replay needs.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping

from oxygen_ros.bag.errors import BagError
from oxygen_ros.runtime import params as node_params

logger = logging.getLogger(__name__)

NODE_NAME = node_params.NODE_NAME
# Node parameters a replay has no use for (accepted silently).
IGNORED_PARAMS = {'use_sim_time', 'autostart'}


@dataclasses.dataclass
class ReplayParams:
    """The node's Settings plus replay-only options."""

    settings: node_params.Settings
    namespace: str = ''                   # node namespace (resolves relative topic names)
    instruction_topic: str = 'instruction'       # the node's subscription names (remaps)
    joint_states_topic: str = 'joint_states'
    instruction_override: str = ''        # replaces every recorded instruction ('' = keep)
    diagnostics_period_s: float = 1.0     # bag seconds between /diagnostics messages
    on_bad_input: str = 'error'           # 'error': stop with BagError; 'skip': as the node

    def __post_init__(self):
        if self.on_bad_input not in ('error', 'skip'):
            raise BagError(f"on_bad_input {self.on_bad_input!r}; expected 'error' or 'skip'")
        if not self.diagnostics_period_s > 0:
            raise BagError(f'diagnostics_period_s {self.diagnostics_period_s}; expected > 0')

    @property
    def robot(self) -> str:
        return self.settings.robot

    @property
    def period_ns(self) -> float:
        return 1e9 / self.settings.control_rate_hz

    def resolve(self, name: str) -> str:
        """Return a topic name as a bag has it: absolute, under the namespace if relative."""
        if name.startswith('/'):
            return name
        ns = self.namespace.strip('/')
        return f'/{ns}/{name}' if ns else f'/{name}'

    def cameras(self, compressed: bool | None = None) -> list[tuple[str, str, bool]]:
        """(camera name, absolute topic, compressed) per configured camera.

        The topic is the camera's image_transport topic: its base topic for raw frames,
        `<base>/compressed` for compressed ones. compressed: True/False for every camera,
        None: as each camera is configured.
        """
        out = []
        for cam in self.settings.cameras:
            jpeg = cam.compressed if compressed is None else compressed
            out.append((cam.name, self.resolve(node_params.transport_topic(cam.topic, jpeg)),
                        jpeg))
        return out


def node_values(config: str | Path | None, overrides: Mapping[str, Any] | None = None,
                node_name: str = NODE_NAME, robot_spec=None) -> dict[str, Any]:
    """Parameter values as the node would have them: robot defaults, file, then overrides.

    robot_spec: the robot's spec when it has no file (inferred from a dataset); its cameras
    and joints are the defaults.
    """
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    file_values: dict[str, Any] = {}
    if config is not None:
        try:
            file_values = node_params.load_node_params(config, node_name)
        except OSError as err:
            raise BagError(f'config {config}: cannot read: {err.strerror or err}') from None
        except Exception as err:   # noqa: BLE001 - YAML errors, missing section
            raise BagError(f'config {config}: {err}') from None
    robot = robot_spec or overrides.get('robot', file_values.get('robot', 'libero'))
    try:
        values = node_params.robot_defaults(robot)
    except (node_params.RobotSpecError, TypeError):
        values = {'robot': robot}   # Settings.check says what is wrong with it
    values.update(file_values)
    values.update(overrides)
    unknown = sorted(k for k in values if node_params.param_spec(k) is None
                     and k not in IGNORED_PARAMS and not k.startswith('qos_overrides.'))
    if unknown:
        logger.warning('%s: unknown parameters ignored: %s', config or 'command line',
                       ', '.join(unknown))
    for name, value in values.items():
        warning = node_params.deprecation_warning(name, value)
        if warning:
            logger.warning('%s: %s', config or 'command line', warning)
    return {k: v for k, v in values.items() if node_params.param_spec(k) is not None}


def load_params(config: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                node_name: str = NODE_NAME, robot_spec=None, **replay_options) -> ReplayParams:
    """Build ReplayParams from a node parameter file (optional) and parameter overrides.

    robot_spec: the robot's RobotSpec when it has no file (inferred from a dataset).
    replay_options: ReplayParams fields (namespace, instruction_override, ...).
    Raises BagError listing every invalid parameter, as the node's configure would.
    """
    values = node_values(config, overrides, node_name, robot_spec)
    try:
        settings = node_params.Settings.from_values(values, robot_spec)
    except (ValueError, TypeError) as err:
        where = f'config {config}' if config else 'parameters'
        raise BagError(f'{where}: {err}') from None
    return ReplayParams(settings, **{k: v for k, v in replay_options.items() if v is not None})
