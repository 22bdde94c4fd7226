"""The node's parameters: one table of specs, per-value checks and the settings they make.

Pure Python (no rclpy): the node turns each ParamSpec into a declared parameter with a
ParameterDescriptor, and calls `check_value` from its on-set callback. Cross-parameter checks
(cameras and joints matching the robot) need all values at once and run in
`Settings.from_values`, at configure time, so related values can be changed one by one.

Cameras are a list of names, `camera_names`, each with its own sub-parameters
`cameras.<name>.topic` (image_transport base topic), `cameras.<name>.compressed` and
`cameras.<name>.check_camera_info` (CAMERA_PARAMS; `camera_param_specs` names them).

Several robots: `robots` (a list of names, empty = one robot, the parameters above) makes
the node serve a fleet. Each robot has its own copy of the ROBOT_PARAMS under its name
(`arm_left.robot`, `arm_left.cameras.image.topic`, `arm_left.decode_budget`, ...;
`robot_param_specs` names them), and the rest (model, device, threads, ...) is shared.
`FleetSettings.from_values` checks them all and names the robot of every problem.

Two kinds of parameters:
  configure-time  shape the model, the KV pool or the subscriptions; changeable only while
                  the node is unconfigured (cleanup, set, configure again).
  runtime         applied while active (control rate, decode budget, request period, stale
                  timeout, instruction length, real-time chunking rtc_*).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
import re
from typing import Any, Callable

import yaml

from oxygen_ros.model.robot_spec import (BUILTIN_ROBOTS, get_robot, is_robot_path,
                                         JOINT_POSITION, RobotSpec, RobotSpecError,
                                         shipped_robots)
from oxygen_ros.model.config import DEFAULT_MAX_GUIDANCE_WEIGHT

NARRATION = 'narration'   # the default language task (engine.workload.NARRATION)
SUBTASK_MAX_AGE_S = 2.0   # a driving task's subtask stays the action prompt this long
ASK = 'ask'               # the task of questions (runtime.questions.ASK), a reserved name
ASK_PROMPT = 'Question: {question}\nAnswer:'   # ask_prompt's default

NODE_NAME = 'oxygen_node'
ROBOTS = BUILTIN_ROBOTS
DTYPES = ('float32', 'bfloat16')
COMPILE_CHOICES = ('auto', 'max', 'on', 'off')
_DEVICE_RE = re.compile(r'^(cpu|cuda(:\d+)?|mps)$')

# Shipped robot -> (camera names, joint names), read from its spec (config/robots/<name>.yaml):
# the parameters camera_names and joint_names default to these (override them in the YAML).
ROBOT_IO = {name: (spec.camera_names, spec.joint_names)
            for name, spec in ((name, get_robot(name)) for name in shipped_robots())}


def default_camera_topic(camera: str) -> str:
    """Relative base topic of a camera (image_transport naming), remappable at launch."""
    return f'camera/{camera}/image_raw'


def transport_topic(base: str, compressed: bool) -> str:
    """Return the topic image_transport sends a base topic's frames on (raw or compressed)."""
    return f'{base.rstrip("/")}/compressed' if compressed else base


def camera_info_topic(base: str) -> str:
    """image_transport's camera_info topic of a base topic: a sibling named camera_info."""
    head, _, _ = base.rstrip('/').rpartition('/')
    return f'{head}/camera_info' if head else 'camera_info'


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: default, description, optional range and a per-value check."""

    name: str
    default: Any
    description: str
    configure_time: bool = True          # False: may change while active
    int_range: tuple[int, int] | None = None
    float_range: tuple[float, float] | None = None
    check: Callable[[Any], str | None] | None = None   # returns the reason a value is bad
    read_only: bool = False
    # An older form of the value that is still accepted, with a deprecation warning: returns
    # (reason it is bad or None, the warning). The node declares such a parameter with
    # dynamic typing.
    legacy: Callable[[Any], tuple[str | None, str]] | None = None


# ---- real-time chunking (oxygen_ros.runtime.rtc uses these; docs/rtc.md) ----
OFF, GUIDED, PREFIX = 'off', 'guided', 'prefix'
RTC_MODES = (OFF, GUIDED, PREFIX)
RTC_SCHEDULES = ('linear', 'exp')
AUTO_DELAY = -1                  # rtc_delay: take d from the measured latency p95


@dataclasses.dataclass(frozen=True)
class RtcSettings:
    """How a robot's chunks continue each other (the node's rtc_* parameters)."""

    mode: str = OFF                  # off | guided | prefix (checkpoints trained with delays)
    schedule: str = 'exp'            # weight decay over the overlap: linear | exp
    delay: int = AUTO_DELAY          # d in rows; AUTO_DELAY: from the latency p95
    execution_horizon: int = 0       # rows >= this are free (0: every committed row guided)
    max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT   # β, the guidance cap

    @property
    def enabled(self) -> bool:
        return self.mode != OFF

    def problems(self) -> list[str]:
        """Return why these settings are not usable ([] when they are): the rtc_* checks."""
        return [f'rtc_{name}: {why}' for name, value in dataclasses.asdict(self).items()
                if (why := check_value(f'rtc_{name}', value))]


def _check_choice(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(value):
        if value not in choices:
            return f'must be one of {", ".join(choices)}'
        return None
    return check


def _check_preset(value) -> str | None:
    from oxygen_ros.model.config import PRESETS   # torch import only when checked
    if value not in PRESETS:
        return f'unknown preset; expected one of {", ".join(sorted(PRESETS))}'
    return None


def _check_device(value) -> str | None:
    if value == 'mps':
        # model/pi05.py's flow-time embedding is computed in float64 on the model's device,
        # a dtype MPS does not have: the first act() would fail, not configure.
        return ("'mps' is not supported: the model computes in float64 on its device, which "
                "MPS lacks; use 'cpu'")
    if not _DEVICE_RE.match(value):
        return "expected 'cpu', 'cuda' or 'cuda:N'"
    return None


MAX_PATH_CHARS = 4096


def _usable_path(value: str, is_usable: Callable[[Path], bool]) -> bool:
    """Whether `value` names a path that passes `is_usable`; never raises."""
    if not isinstance(value, str) or len(value) > MAX_PATH_CHARS or '\x00' in value:
        return False
    try:
        return is_usable(Path(value).expanduser())
    except (OSError, RuntimeError, ValueError):   # ~unknownuser, name too long, bad bytes
        return False


def _check_checkpoint(value) -> str | None:
    # One answer for missing, unreadable and wrong paths: a parameter service must not tell a
    # DDS peer which files exist outside a checkpoint's layout.
    def is_checkpoint(path: Path) -> bool:
        weights = path / 'model.safetensors'
        return path.is_dir() and weights.is_file() and os.access(weights, os.R_OK)
    if value and not _usable_path(value, is_checkpoint):
        return ('is not a readable checkpoint folder (expected a directory with '
                'model.safetensors and config.json)')
    return None


def _check_robot(value) -> str | None:
    # The file is read (and its schema checked) at configure, in Settings.check.
    def is_yaml_file(path: Path) -> bool:
        return path.is_file() and os.access(path, os.R_OK)
    if not isinstance(value, str) or not value:
        return 'expected a robot name or the path of a robot YAML file'
    if is_robot_path(value):
        if not _usable_path(value, is_yaml_file):
            return 'is not a readable robot YAML file (docs/robots.md)'
        return None
    if value not in shipped_robots():
        return (f'unknown robot; expected one of {", ".join(sorted(shipped_robots()))} '
                '(config/robots/) or the path of a robot YAML file')
    return None


def _check_tokenizer(value) -> str | None:
    def is_model_file(path: Path) -> bool:
        return path.suffix == '.model' and path.is_file() and os.access(path, os.R_OK)
    if value and not _usable_path(value, is_model_file):
        return 'is not a readable SentencePiece model file (expected a *.model file)'
    return None


def parse_decode_budget(value: int | str) -> int | None:
    """Read the decode budget k: 0 -> None (adaptive), k >= 1 -> k.

    Also reads the deprecated string form ('adaptive', or k as text, e.g. "'4'"). Anything
    else raises ValueError.
    """
    if isinstance(value, bool):
        raise ValueError(f'expected an integer k >= 0 (0 = adaptive), got {value!r}')
    if isinstance(value, int):
        k = value
    else:
        text = str(value).strip().lower()
        if text == 'adaptive':
            return None
        try:
            k = int(text)
        except ValueError:
            raise ValueError(f'expected an integer k >= 0 (0 = adaptive), got {value!r}'
                             ) from None
    if k < 0:
        raise ValueError(f'k must be >= 0 (0 = adaptive), got {k}')
    return k or None


def _legacy_decode_budget(value) -> tuple[str | None, str]:
    try:
        k = parse_decode_budget(value)
    except ValueError as err:
        return str(err), ''
    return None, (f'decode_budget as a string ({value!r}) is deprecated: use the integer '
                  f'{k or 0} (0 = adaptive), e.g. `-p decode_budget:={k or 0}`')


def parse_rtc_mode(value: str | bool) -> str:
    """Read rtc_mode: a mode name, or false (what YAML makes of a bare `off`) for 'off'."""
    return OFF if value is False else value


def _legacy_rtc_mode(value) -> tuple[str | None, str]:
    if value is False:   # `-p rtc_mode:=off` and `ros2 param set ... rtc_mode off` send false
        return None, ("rtc_mode false is read as 'off' (YAML reads a bare off as false; "
                      "quote it, rtc_mode:=\"'off'\", to say so)")
    return f'expected one of {", ".join(RTC_MODES)}, got {value!r}', ''


def _check_rate(value) -> str | None:
    if 0 < value < 0.1:
        return f'must be 0 (auto) or in [0.1, 1000], got {value:g}'
    return None


def _check_names(value) -> str | None:
    names = list(value)
    if any(not n.strip() for n in names):
        return 'names must not be empty'
    if len(set(names)) != len(names):
        return f'duplicate names in {names}'
    return None


def _check_template(value) -> str | None:
    # Only {instruction} is substituted; other braces are kept as text, but a stray
    # placeholder is almost always a typo.
    for field in re.findall(r'{([^{}]*)}', value):
        if field != 'instruction':
            return f'unknown placeholder {{{field}}}; only {{instruction}} is substituted'
    return None


_ROBOT_NAME_RE = re.compile(r'^[A-Za-z][A-Za-z0-9_]*$')


def _check_ask_template(value) -> str | None:
    if '{question}' not in value:
        return f'template {value!r} has no {{question}} placeholder (the question goes there)'
    for field in re.findall(r'{([^{}]*)}', value):
        if field != 'question':
            return f'unknown placeholder {{{field}}}; only {{question}} is substituted'
    return None


def _check_task_names(value) -> str | None:
    bad = [name for name in value if not _ROBOT_NAME_RE.match(name)]
    if bad:
        return f'task names must be identifiers (letters, digits, _), got {bad}'
    if ASK in value:
        return (f'{ASK!r} is the task of questions (the ask service): configure it with '
                'ask_tokens, ask_prompt and ask_priority')
    repeated = sorted({name for name in value if list(value).count(name) > 1})
    if repeated:
        return f'task names must be unique, {repeated} repeated'
    if not value:
        return f"at least one task ([{NARRATION}] with request_every_n_frames 0 for none)"
    return None


def _check_robot_names(value) -> str | None:
    names = list(value)
    if any(not isinstance(n, str) for n in names):
        return 'expected a list of robot names (strings)'
    bad = [n for n in names if not _ROBOT_NAME_RE.match(n)]
    if bad:
        return (f'robot names {bad} are not ROS name tokens (a letter, then letters, digits '
                'or _): each becomes a namespace')
    taken = [n for n in names if n in PARAMS_BY_NAME or n in ('cameras', 'qos_overrides')]
    if taken:
        return f'robot names {taken} are parameter names of the node; choose others'
    return _check_names(names)


PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec('autostart', True, 'Configure and activate on startup (false: wait for '
              'lifecycle transitions).', read_only=True),
    ParamSpec('allow_unsafe_changes', False, 'Allow loosening safety limits while active '
              '(raising stale_frame_timeout_s); set at startup only.', read_only=True),
    ParamSpec('checkpoint', '', "openpi checkpoint directory (model.safetensors, config.json, "
              "assets/); '' = random weights of `preset`.", check=_check_checkpoint),
    ParamSpec('preset', 'pi05-cpu', 'Model preset used with random weights (checkpoint empty).',
              check=_check_preset),
    ParamSpec('device', 'cpu', "Torch device: 'cpu', 'cuda', 'cuda:N'.", check=_check_device),
    ParamSpec('dtype', 'auto', "Compute dtype of the model and the KV cache; 'auto' = "
              'bfloat16 where the device multiplies it fast (CUDA, AMX / AVX512-BF16: a '
              'timing probe at configure decides), else float32.',
              check=_check_choice(('auto',) + DTYPES)),
    ParamSpec('compile', 'auto', "torch.compile prefill, denoise and decode at configure "
              "(CUDA graphs on a GPU): 'auto' = where it pays (not test-sized models); 'max' = "
              "also the whole denoise loop as one graph (pi05-cpu denoise ~19 -> ~15 ms, "
              "minutes at the first configure); 'on'; 'off'.",
              check=_check_choice(COMPILE_CHOICES)),
    ParamSpec('torch_threads', 0, "Torch intra-op threads of the control thread's inference; "
              '0 = every core but one (the executor, DDS and camera drivers keep one).',
              int_range=(0, 256)),
    ParamSpec('kv_dtype', 'auto', "KV cache dtype: 'auto' = dtype; 'bfloat16' under a float32 "
              'model halves the pool (K/V rounded when written).',
              check=_check_choice(('auto',) + DTYPES)),
    ParamSpec('control_priority', 0, 'SCHED_FIFO priority of the control thread (1-99; 0 = '
              'normal scheduling, control_nice applies): takes its core from every normal '
              'thread; needs CAP_SYS_NICE or an rtprio limit (else a warning).',
              int_range=(0, 99)),
    ParamSpec('control_nice', -10, 'Nice value of the control thread (and its torch workers): '
              'lower runs first; below 0 needs CAP_SYS_NICE (else a warning); 0 = unchanged.',
              int_range=(-20, 19)),
    ParamSpec('robots', [], "Names of the robots one node serves ([] = one robot, configured "
              "by the parameters here); each robot has the per-robot parameters under its "
              "name (<robot>.robot, <robot>.cameras.<camera>.topic, ...) and its topics in the "
              "namespace <robot>.", check=_check_robot_names),
    ParamSpec('robot', 'libero', 'Robot spec: a shipped robot (config/robots/<name>.yaml: '
              'libero, droid, aloha, so101) or the path of a robot YAML file (cameras, state, '
              'actions; docs/robots.md).', check=_check_robot),
    ParamSpec('camera_names', list(ROBOT_IO['libero'][0]),
              "Robot camera names, in the adapter's terms; each has the sub-parameters "
              'cameras.<name>.topic, .compressed and .check_camera_info.', check=_check_names),
    ParamSpec('joint_names', list(ROBOT_IO['libero'][1]),
              'JointState names forming the robot state vector, in order.', check=_check_names),
    ParamSpec('frame_id', 'base_link', 'frame_id written into ActionChunk headers.'),
    ParamSpec('publish_trajectory', False, 'Also publish each chunk as trajectory_msgs/'
              'JointTrajectory on joint_trajectory (joint-position robots only), for '
              "ros2_control's joint_trajectory_controller."),
    ParamSpec('control_rate_hz', 10.0, 'Control ticks per second (one action chunk each); 0 '
              '= auto: 90% of the rate this machine holds, timed at configure on a few frames '
              '(act p50 plus the least language work of a tick: one decode step per live '
              'request at the steady batch, k steps with a fixed decode_budget).',
              configure_time=False, float_range=(0.0, 1000.0), check=_check_rate),
    ParamSpec('denoise_steps', 0, 'Flow-matching steps; 0 = the model config default.',
              int_range=(0, 100)),
    ParamSpec('language_prompt', '', "Template fed after the observation prefix for narration "
              "('' = continue the prefix); {instruction} is replaced by the task.",
              check=_check_template),
    ParamSpec('tokens_per_request', 10, 'N: tokens each language request generates at most.',
              int_range=(1, 512)),
    ParamSpec('decode_budget', 0, 'k tokens per request per tick; 0 = adaptive (as many as '
              'fit before the tick deadline).', configure_time=False, int_range=(0, 512),
              legacy=_legacy_decode_budget),
    ParamSpec('request_every_n_frames', 1, 'Start a language request every n frames (0 = no '
              'language).', configure_time=False, int_range=(0, 1_000_000)),
    ParamSpec('language_tasks', [NARRATION], 'Language tasks, in order (docs/language_tasks.md):'
              ' each has tasks.<name>.prompt, .tokens, .every_n_frames, .priority, .topic and '
              ".drives_actions; narration's default to language_prompt, tokens_per_request and "
              'request_every_n_frames. Every task reads the frame\'s one prefill.',
              check=_check_task_names),
    ParamSpec('ask_tokens', 10, "N of an answer to a question (the ask service, serve's "
              "'question' field; docs/language_tasks.md); 0 = no questions.",
              int_range=(0, 512)),
    ParamSpec('ask_prompt', ASK_PROMPT, "Template of a question, fed after the newest frame's "
              'prefix; {question} is replaced by the question.', check=_check_ask_template),
    ParamSpec('ask_priority', 10, 'Priority of questions among the language tasks (higher: '
              'admitted first, the last to yield decode steps).', int_range=(-100, 100)),
    ParamSpec('subtask_max_age_s', SUBTASK_MAX_AGE_S, "The subtask of the task that drives the "
              "actions (tasks.<name>.drives_actions, π0.5's subtask loop) is the action "
              'prompt until it is older than this (from the frame it was decoded from); '
              'then the instruction is (docs/language_tasks.md).', float_range=(0.01, 3600.0)),
    ParamSpec('kv_capacity', 0, 'KV pool slots; 0 = sized from N, k and the request rate '
              '(configure refuses a pool larger than half the free memory).',
              int_range=(0, 1024)),
    # A robot must not act on old inputs: at most 5 s, and only tightened while active.
    ParamSpec('stale_frame_timeout_s', 0.5, 'A camera or joint state older than this (node '
              'clock, time of receipt) stops the action path; while active it can only be '
              'lowered (unless allow_unsafe_changes).', configure_time=False,
              float_range=(0.01, 5.0)),
    ParamSpec('max_instruction_chars', 500, 'Longer instructions are truncated (and reported).',
              configure_time=False, int_range=(1, 100_000)),
    ParamSpec('diagnostics_period_s', 1.0, 'Seconds between /diagnostics messages (steady '
              'clock, in every lifecycle state).', configure_time=False,
              float_range=(0.05, 60.0)),
    ParamSpec('seed', 0, 'Seed of random weights, flow-matching noise and request arrivals.',
              int_range=(0, 2**31 - 1)),
    # Real-time chunking (docs/rtc.md): each chunk continues the one the robot executes.
    ParamSpec('rtc_mode', OFF, "Real-time chunking: 'off'; 'guided' (each chunk is guided "
              "toward the committed one; act() pays a backward pass per denoise step); "
              "'prefix' (the delay's rows held to the committed ones, for checkpoints trained "
              'with delays).', configure_time=False, check=_check_choice(RTC_MODES),
              legacy=_legacy_rtc_mode),
    ParamSpec('rtc_schedule', 'exp', "Decay of the guidance weights over the overlap: 'exp' "
              "(the paper's) or 'linear'.", configure_time=False,
              check=_check_choice(RTC_SCHEDULES)),
    ParamSpec('rtc_delay', AUTO_DELAY, 'd: rows of a chunk that play before it is out (frozen '
              f'to the committed chunk, and ActionChunk.start_row); {AUTO_DELAY} = auto, from '
              'the p95 of observation-to-chunk latency and the step period.',
              configure_time=False, int_range=(AUTO_DELAY, 1000)),
    ParamSpec('rtc_execution_horizon', 0, 'Rows of a chunk guided toward the committed one '
              "(the overlap's end, the paper's H - s); 0 = every row the committed chunk still "
              'covers.', configure_time=False, int_range=(0, 1000)),
    ParamSpec('rtc_max_guidance_weight', DEFAULT_MAX_GUIDANCE_WEIGHT,
              'β: cap of the guidance weight (guided mode; caps the t = 1 step at 10 steps).',
              configure_time=False, float_range=(0.01, 100.0)),
    ParamSpec('tokenizer', '', "SentencePiece model; '' = the checkpoint's tokenizer.model, or "
              'a tiny tokenizer trained offline (random weights).',
              check=_check_tokenizer),
)
PARAMS_BY_NAME = {spec.name: spec for spec in PARAMS}
# What each robot of a fleet sets for itself (as <robot>.<name>, cameras too); the others are
# the node's and shared by every robot (one model, one device, one control thread).
ROBOT_PARAMS = ('robot', 'camera_names', 'joint_names', 'frame_id', 'publish_trajectory',
                'control_rate_hz', 'language_prompt', 'tokens_per_request', 'decode_budget',
                'request_every_n_frames', 'language_tasks', 'subtask_max_age_s', 'ask_tokens',
                'ask_prompt', 'ask_priority', 'kv_capacity',
                'stale_frame_timeout_s', 'seed',
                'rtc_mode', 'rtc_schedule', 'rtc_delay', 'rtc_execution_horizon',
                'rtc_max_guidance_weight')

# Per-camera sub-parameters: cameras.<name>.<field>.
CAMERA_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec('topic', '', "image_transport base topic ('' = camera/<name>/image_raw): raw "
              'sensor_msgs/Image on it, CompressedImage on <topic>/compressed.'),
    ParamSpec('compressed', False, 'Subscribe sensor_msgs/CompressedImage (jpeg/png) on '
              '<topic>/compressed instead of Image on <topic>.'),
    ParamSpec('check_camera_info', False, 'Also subscribe sensor_msgs/CameraInfo (the '
              'camera_info sibling of <topic>) and reject frames whose size differs from it.'),
)
_CAMERA_PARAMS_BY_FIELD = {spec.name: spec for spec in CAMERA_PARAMS}
_CAMERA_PARAM_RE = re.compile(r'^cameras\.([^.]+)\.([^.]+)$')


# Per-task sub-parameters: tasks.<name>.<field> (narration's default to the legacy parameters).
TASK_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec('prompt', '', "Template fed after the frame's prefix ('' = continue the prefix); "
              'it must contain {instruction}, replaced by the instruction.',
              check=_check_template),
    ParamSpec('tokens', 10, 'N: tokens a request of this task generates at most.',
              int_range=(1, 512)),
    ParamSpec('every_n_frames', 1, 'Start a request every n frames (0 = never).',
              int_range=(0, 1_000_000)),
    ParamSpec('priority', 0, 'Higher: admitted first and the last to yield decode steps when '
              'the tick is short (admitted requests of every priority finish).',
              int_range=(-100, 100)),
    ParamSpec('topic', '', "LanguageChunk topic of its tokens ('' = language/<name>/tokens; "
              'narration: language/tokens).'),
    ParamSpec('drives_actions', False, "Its newest finished text becomes the action prompt "
              "(π0.5's subtask)."),
)
_TASK_PARAMS_BY_FIELD = {spec.name: spec for spec in TASK_PARAMS}
_TASK_PARAM_RE = re.compile(r'^tasks\.([^.]+)\.([^.]+)$')
# narration's fields default to the parameters that configured it before tasks existed
NARRATION_LEGACY = {'prompt': 'language_prompt', 'tokens': 'tokens_per_request',
                    'every_n_frames': 'request_every_n_frames'}


def task_param_name(task: str, field: str) -> str:
    """Full name of a task sub-parameter, e.g. tasks.subtask.prompt."""
    return f'tasks.{task}.{field}'


def task_param_specs(task: str, values: dict[str, Any] | None = None) -> list[ParamSpec]:
    """Return the sub-parameter specs of one task, named, with its defaults.

    values: the node's values, where narration's defaults come from (language_prompt, ...).
    """
    defaults = {}
    if task == NARRATION:
        defaults = {field: (values or {}).get(legacy, PARAMS_BY_NAME[legacy].default)
                    for field, legacy in NARRATION_LEGACY.items()}
    return [dataclasses.replace(spec, name=task_param_name(task, spec.name),
                                default=defaults.get(spec.name, spec.default))
            for spec in TASK_PARAMS]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """One language task as configured (tasks.<name>.*)."""

    name: str
    prompt: str            # '' = continue the prefix; else a template of {instruction}
    tokens: int            # N
    every_n_frames: int    # 0 = never
    priority: int          # higher: admitted first, yields last
    topic: str             # LanguageChunk topic ('' = the default, token_topic)
    drives_actions: bool   # its newest finished text becomes the action prompt

    @property
    def token_topic(self) -> str:
        """The topic its LanguageChunks go to (narration's unchanged: language/tokens)."""
        if self.topic:
            return self.topic
        return 'language/tokens' if self.name == NARRATION else f'language/{self.name}/tokens'


def _check_tasks(merged: dict[str, Any], values: dict[str, Any], prefix: str
                 ) -> tuple[tuple[TaskConfig, ...], list[str]]:
    """Build the tasks of `language_tasks` from tasks.<name>.*; (tasks, problems)."""
    names = list(merged['language_tasks'])
    problems = []
    for name in sorted(values):
        match = _TASK_PARAM_RE.match(name)
        if name.startswith('tasks.') and not match:
            problems.append(f'{prefix}{name}: not a task parameter; expected tasks.<task>.'
                            f'<field> with a field of {sorted(_TASK_PARAMS_BY_FIELD)}')
        elif match and match.group(1) not in names:
            problems.append(f'{prefix}{name}: unknown task {match.group(1)!r}; language_tasks '
                            f'is {names}')
        elif match and match.group(2) not in _TASK_PARAMS_BY_FIELD:
            problems.append(f'{prefix}{name}: unknown key {match.group(2)!r}; a task has '
                            f'{", ".join(_TASK_PARAMS_BY_FIELD)}')
    tasks = []
    for name in names:
        fields = {}
        for spec in task_param_specs(name, merged):
            value = merged.get(spec.name, spec.default)
            why = check_value(spec.name, value)
            if why:
                problems.append(f'{prefix}{spec.name}: {why}')
            fields[spec.name.rsplit('.', 1)[1]] = value
        # narration's legacy language_prompt keeps its old meaning (any text); a task's own
        # prompt is a template of the instruction.
        own_prompt = task_param_name(name, 'prompt') in merged or name != NARRATION
        if fields['prompt'] and own_prompt and '{instruction}' not in fields['prompt']:
            problems.append(f'{prefix}{task_param_name(name, "prompt")}: template '
                            f'{fields["prompt"]!r} has no {{instruction}} placeholder')
        tasks.append(TaskConfig(name, fields['prompt'], int(fields['tokens']),
                                int(fields['every_n_frames']), int(fields['priority']),
                                fields['topic'], bool(fields['drives_actions'])))
    topics = [t.token_topic for t in tasks]
    if len(set(topics)) != len(topics):
        problems.append(f'{prefix}tasks: two tasks publish on one topic: {topics}')
    driving = [t.name for t in tasks if t.drives_actions]
    if len(driving) > 1:
        problems.append(f'{prefix}tasks: at most one task drives the actions, got {driving}')
    for task in tasks:
        # The prefix's prompt is the active subtask: without the instruction in its own
        # prompt the task would decode the next subtask from the last one.
        if task.drives_actions and '{instruction}' not in task.prompt:
            problems.append(f'{prefix}{task_param_name(task.name, "drives_actions")}: a task '
                            'that drives the actions needs a prompt with {instruction} (its '
                            f'prompt is {task.prompt!r}): the frame\'s prefix holds the '
                            'subtask, the instruction reaches the task through its template')
    return tuple(tasks), problems


def camera_param_name(camera: str, field: str) -> str:
    """Full name of a camera sub-parameter, e.g. cameras.image.topic."""
    return f'cameras.{camera}.{field}'


def camera_param_specs(camera: str) -> list[ParamSpec]:
    """Return the sub-parameter specs of one camera, named and with its defaults."""
    defaults = {'topic': default_camera_topic(camera)}
    return [dataclasses.replace(spec, name=camera_param_name(camera, spec.name),
                                default=defaults.get(spec.name, spec.default))
            for spec in CAMERA_PARAMS]


def robot_param_name(robot: str, name: str) -> str:
    """Full name of a robot's parameter, e.g. arm_left.decode_budget."""
    return f'{robot}.{name}'


def robot_param_specs(robot: str, defaults: dict[str, Any] | None = None) -> list[ParamSpec]:
    """Return the specs of one robot's parameters (cameras not included), named.

    defaults: base name -> default value, where the table's default is not wanted.
    """
    defaults = defaults or {}
    return [dataclasses.replace(PARAMS_BY_NAME[name], name=robot_param_name(robot, name),
                                default=defaults.get(name, PARAMS_BY_NAME[name].default))
            for name in ROBOT_PARAMS]


def split_param_name(name: str) -> tuple[str, str]:
    """Split a robot's parameter name: 'arm_left.cameras.image.topic' -> ('arm_left', ...).

    A node-level name (or one that is not a robot's parameter) gives ('', name).
    """
    robot, _, rest = name.partition('.')
    if rest and _ROBOT_NAME_RE.match(robot) and robot not in ('cameras', 'qos_overrides') and (
            rest in ROBOT_PARAMS or _CAMERA_PARAM_RE.match(rest) or _TASK_PARAM_RE.match(rest)):
        return robot, rest
    return '', name


def param_spec(name: str) -> ParamSpec | None:
    """Return the spec of parameter `name`, camera and robot ones included (None: not ours)."""
    robot, base = split_param_name(name)
    spec = PARAMS_BY_NAME.get(base)
    if spec is None and (match := _CAMERA_PARAM_RE.match(base)):
        field = _CAMERA_PARAMS_BY_FIELD.get(match.group(2))
        if field is not None:
            spec = field
    if spec is None and (match := _TASK_PARAM_RE.match(base)):
        spec = _TASK_PARAMS_BY_FIELD.get(match.group(2))
    if spec is None:
        return None
    return spec if spec.name == name else dataclasses.replace(spec, name=name)


def deprecation_warning(name: str, value: Any) -> str:
    """Return the warning for a value of `name` in a deprecated form ('' if none)."""
    spec = param_spec(name)
    if spec is None or spec.legacy is None or _type_problem(spec.default, value) is None:
        return ''
    why, warning = spec.legacy(value)
    return '' if why else warning


RUNTIME_PARAMS = frozenset(s.name for s in PARAMS if not s.configure_time)
# Runtime parameters that must not be loosened while the robot is being driven: name -> the
# direction that loosens them.
SAFETY_LIMITS = {'stale_frame_timeout_s': 'up'}


def _type_problem(default: Any, value: Any) -> str | None:
    """Why `value` has not the parameter's type (the type of its default), or None.

    ROS parameters arrive typed, but a YAML file read by the replay can hold anything.
    """
    def kind(v) -> str:
        if isinstance(v, bool):
            return 'a bool'
        if isinstance(v, int):
            return 'an integer'
        if isinstance(v, float):
            return 'a number'
        if isinstance(v, str):
            return 'a string'
        if isinstance(v, (list, tuple)):
            return 'a list of ' + (kind(v[0]).split(' ', 1)[1] + 's' if v else 'values')
        return f'a {type(v).__name__}'
    expected = kind(default)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return None   # 10 for 10.0
    if isinstance(default, list):
        ok = isinstance(value, (list, tuple)) and all(
            type(v) is type(default[0]) for v in value) if default else True
    else:
        ok = type(value) is type(default)
    return None if ok else f'expected {expected}, got {kind(value)}'


def check_value(name: str, value: Any) -> str | None:
    """Return why `value` is not acceptable for parameter `name`, or None when it is."""
    spec = param_spec(name)
    if spec is None:
        return None
    why = _type_problem(spec.default, value)
    if why and spec.legacy is not None and isinstance(value, (str, bool)):
        return spec.legacy(value)[0]
    if why:
        return why
    if spec.int_range is not None:
        lo, hi = spec.int_range
        if not lo <= value <= hi:
            return f'must be in [{lo}, {hi}], got {value}'
    if spec.float_range is not None:
        lo, hi = spec.float_range
        if not (math.isfinite(value) and lo <= value <= hi):
            return f'must be in [{lo:g}, {hi:g}], got {value}'
    if spec.check is not None:
        return spec.check(value)
    return None


@dataclasses.dataclass(frozen=True)
class CameraConfig:
    """One subscribed camera."""

    name: str          # robot adapter's camera name (observation key)
    topic: str         # image_transport base topic (relative or absolute)
    compressed: bool   # sensor_msgs/CompressedImage on <topic>/compressed instead of Image
    check_camera_info: bool = False   # compare frame sizes with <topic>'s camera_info

    @property
    def image_topic(self) -> str:
        """The topic frames arrive on (base or <base>/compressed)."""
        return transport_topic(self.topic, self.compressed)

    @property
    def info_topic(self) -> str:
        """The camera_info topic next to the base topic."""
        return camera_info_topic(self.topic)


@dataclasses.dataclass(frozen=True)
class Settings:
    """All parameter values, checked together; what the node configures itself from."""

    checkpoint: str
    preset: str
    device: str
    dtype: str                         # 'auto' is resolved when the model loads
    kv_dtype: str
    torch_threads: int
    control_nice: int
    control_priority: int
    robot: str
    cameras: tuple[CameraConfig, ...]
    joint_names: tuple[str, ...]
    frame_id: str
    publish_trajectory: bool
    control_rate_hz: float
    denoise_steps: int
    language_prompt: str
    tokens_per_request: int
    decode_budget: int | None          # None = adaptive
    request_every_n_frames: int
    kv_capacity: int
    stale_frame_timeout_s: float
    max_instruction_chars: int
    diagnostics_period_s: float
    seed: int
    tokenizer: str
    rtc_mode: str = OFF
    rtc_schedule: str = 'exp'
    rtc_delay: int = AUTO_DELAY
    rtc_execution_horizon: int = 0
    rtc_max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT
    compile: str = 'auto'              # torch.compile: auto, max, on, off
    spec: RobotSpec | None = None      # the robot's spec, resolved from `robot` at check
    tasks: tuple[TaskConfig, ...] = ()   # language_tasks with their tasks.<name>.* values
    subtask_max_age_s: float = SUBTASK_MAX_AGE_S   # a driving task's subtask, then stale
    ask_tokens: int = 10               # N of an answer (0: no questions)
    ask_prompt: str = ASK_PROMPT       # a question's template, with {question}
    ask_priority: int = 10             # questions' priority among the language tasks

    def task(self, name: str) -> TaskConfig | None:
        """Return the configured task called `name` (None: there is none)."""
        return next((t for t in self.tasks if t.name == name), None)

    @property
    def period_s(self) -> float:
        if not self.control_rate_hz:
            raise ValueError('control_rate_hz 0 (auto) has no period until the rate is '
                             'resolved (engine_setup.build_engine times it)')
        return 1.0 / self.control_rate_hz

    @property
    def rtc(self) -> RtcSettings:
        """The real-time chunking settings of the rtc_* parameters."""
        return RtcSettings(self.rtc_mode, self.rtc_schedule, self.rtc_delay,
                           self.rtc_execution_horizon, self.rtc_max_guidance_weight)

    @classmethod
    def from_values(cls, values: dict[str, Any], robot_spec: RobotSpec | None = None
                    ) -> Settings:
        """Check every value and their combinations; raise ValueError naming what is wrong."""
        settings, problems = cls.check(values, robot_spec=robot_spec)
        if problems:
            raise ValueError('invalid parameters:\n  ' + '\n  '.join(problems))
        return settings

    @classmethod
    def check(cls, values: dict[str, Any], prefix: str = '', robot_spec: RobotSpec | None = None
              ) -> tuple[Settings | None, list[str]]:
        """Check every value and their combinations: (settings, []) or (None, problems).

        prefix is put before every parameter name in the problems (a robot's 'arm_left.').
        robot_spec: the robot's spec when it has no file (read from a dataset); `robot` is
        then its name.
        """
        merged = {spec.name: spec.default for spec in PARAMS}
        merged.update(values)
        if robot_spec is not None:
            merged['robot'] = robot_spec.name
        problems = [f'{prefix}{name}: {why}' for name in PARAMS_BY_NAME
                    if (why := check_value(name, merged[name]))
                    and not (name == 'robot' and robot_spec is not None)]
        unknown = sorted(f'{prefix}{n}' for n in values if param_spec(n) is None
                         and n.startswith('cameras.'))
        if unknown:
            problems.append(f'unknown camera parameters {unknown}; each camera has '
                            f'{", ".join(s.name for s in CAMERA_PARAMS)}')
        robot = merged['robot']
        names = list(merged['camera_names'])
        cameras = []
        for name in names:
            fields = {}
            for spec in camera_param_specs(name):
                value = merged.get(spec.name, spec.default)
                why = check_value(spec.name, value)
                if why:
                    problems.append(f'{prefix}{spec.name}: {why}')
                fields[spec.name.rsplit('.', 1)[1]] = value
            cameras.append(CameraConfig(name, fields['topic'] or default_camera_topic(name),
                                        bool(fields['compressed']),
                                        bool(fields['check_camera_info'])))
        tasks, found = _check_tasks(merged, values, prefix)
        problems += found
        topics = [c.image_topic for c in cameras]
        if len(set(topics)) != len(topics):
            problems.append(f'{prefix}cameras: two cameras subscribe the same topic: {topics}')
        spec = robot_spec
        if spec is None and not any(p.startswith(f'{prefix}robot:') for p in problems):
            try:
                spec = get_robot(robot)   # the schema's errors name the file and the field
            except RobotSpecError as err:
                problems.append(f'{prefix}robot: {err}')
        if spec is not None:
            required = spec.camera_names
            missing = [c for c in required if c not in names]
            unknown = [c for c in names if c not in required]
            if missing:
                problems.append(f'{prefix}camera_names lacks {missing}: robot {robot!r} needs '
                                f'{list(required)}')
            if unknown:
                problems.append(f'{prefix}camera_names has {unknown}, which robot {robot!r} '
                                f'does not use (its cameras: {list(required)})')
            state_dim = spec.state_dim
            if len(merged['joint_names']) != state_dim:
                problems.append(f'{prefix}joint_names has {len(merged["joint_names"])} names '
                                f'but robot {robot!r} has a {state_dim}-value state')
            if merged['publish_trajectory']:
                space = spec.action_space
                if space != JOINT_POSITION:
                    problems.append(f'{prefix}publish_trajectory: robot {robot!r} acts in '
                                    f'{space}, not joint positions; a JointTrajectory of its '
                                    'rows would be wrong (use the actions topic or '
                                    'chunk_player)')
        if problems:
            return None, problems
        return cls(
            checkpoint=merged['checkpoint'], preset=merged['preset'], device=merged['device'],
            dtype=merged['dtype'], torch_threads=int(merged['torch_threads']),
            control_nice=int(merged['control_nice']),
            control_priority=int(merged['control_priority']), kv_dtype=merged['kv_dtype'],
            robot=robot,
            cameras=tuple(cameras),
            joint_names=tuple(merged['joint_names']), frame_id=merged['frame_id'],
            publish_trajectory=bool(merged['publish_trajectory']),
            control_rate_hz=float(merged['control_rate_hz']),
            denoise_steps=int(merged['denoise_steps']),
            language_prompt=merged['language_prompt'],
            tokens_per_request=int(merged['tokens_per_request']),
            decode_budget=parse_decode_budget(merged['decode_budget']),
            request_every_n_frames=int(merged['request_every_n_frames']),
            kv_capacity=int(merged['kv_capacity']),
            stale_frame_timeout_s=float(merged['stale_frame_timeout_s']),
            max_instruction_chars=int(merged['max_instruction_chars']),
            diagnostics_period_s=float(merged['diagnostics_period_s']),
            seed=int(merged['seed']), tokenizer=merged['tokenizer'],
            rtc_mode=parse_rtc_mode(merged['rtc_mode']), rtc_schedule=merged['rtc_schedule'],
            rtc_delay=int(merged['rtc_delay']),
            rtc_execution_horizon=int(merged['rtc_execution_horizon']),
            rtc_max_guidance_weight=float(merged['rtc_max_guidance_weight']), spec=spec,
            tasks=tasks, subtask_max_age_s=float(merged['subtask_max_age_s']),
            ask_tokens=int(merged['ask_tokens']), ask_prompt=merged['ask_prompt'],
            ask_priority=int(merged['ask_priority']),
            compile=merged['compile']), []


@dataclasses.dataclass(frozen=True)
class FleetSettings:
    """The settings of a node serving several robots: the node's own, and each robot's.

    Every robot's Settings holds the node's shared values (model, device, ...) and its own
    ROBOT_PARAMS and cameras; `node` is what the model is loaded with.
    """

    node: Settings
    robots: dict[str, Settings]        # robot name -> its settings, in `robots` order

    @classmethod
    def one(cls, settings: Settings) -> FleetSettings:
        """Return the settings of a node serving one robot: a fleet of one, the robot ''."""
        return cls(settings, {'': settings})

    @property
    def is_one(self) -> bool:
        """Whether these are one robot's settings (FleetSettings.one): no robots parameter."""
        return list(self.robots) == ['']

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> FleetSettings:
        """Check the node's values and every robot's (as <robot>.<name>).

        Raises ValueError listing each problem under its full parameter name.
        """
        names = list(values.get('robots') or [])
        why = check_value('robots', names)
        if why:
            raise ValueError(f'invalid parameters:\n  robots: {why}')
        if not names:
            raise ValueError('invalid parameters:\n  robots: empty; a fleet needs at least '
                             'one robot name')
        node_values = {n: v for n, v in values.items() if not split_param_name(n)[0]}
        node, problems = Settings.check(node_values)
        robots = {}
        for robot in names:
            own = {base: value for name, value in values.items()
                   for owner, base in [split_param_name(name)] if owner == robot}
            settings, found = Settings.check(
                {**robot_param_defaults(node_values, own.get('robot')), **own}, robot + '.')
            problems += found
            robots[robot] = settings
        if problems:
            raise ValueError('invalid parameters:\n  ' + '\n  '.join(problems))
        return cls(node, robots)


def robot_param_defaults(node_values: dict[str, Any], robot: str | None) -> dict[str, Any]:
    """Return a fleet robot's defaults: the node's values, cameras' excepted.

    Where its robot type differs from the node's, its camera and joint names are its type's.
    """
    defaults = {n: v for n, v in node_values.items() if not n.startswith('cameras.')}
    node_robot = defaults.get('robot', PARAMS_BY_NAME['robot'].default)
    if robot is not None and robot != node_robot and check_value('robot', robot) is None:
        try:
            defaults.update(robot_defaults(robot))
        except RobotSpecError:
            pass   # configure reports the spec's problem under <robot>.robot
    return defaults


def robot_defaults(robot: str | RobotSpec) -> dict[str, Any]:
    """Camera and joint parameter values matching `robot` (defaults follow the robot).

    robot: a shipped robot's name, a robot YAML's path, or a spec (then no 'robot' value).
    Raises RobotSpecError when the spec cannot be read.
    """
    spec = get_robot(robot)
    values = {} if isinstance(robot, RobotSpec) else {'robot': robot}
    return {**values, 'camera_names': list(spec.camera_names),
            'joint_names': list(spec.joint_names)}


def flatten_params(params: dict[str, Any], prefix: str = '') -> dict[str, Any]:
    """Nested YAML mappings -> dotted parameter names, as rcl reads a parameter file."""
    flat = {}
    for key, value in params.items():
        name = f'{prefix}{key}'
        if isinstance(value, dict):
            flat.update(flatten_params(value, name + '.'))
        else:
            flat[name] = value
    return flat


def load_node_params(path: str | Path, node_name: str = NODE_NAME) -> dict[str, Any]:
    """Read the `ros__parameters` of `node_name` from a ROS 2 parameter YAML file.

    Accepts the keys rcl accepts for a node: `oxygen_node`, `/oxygen_node`, `/**/oxygen_node`
    and `/**` (merged in that order, most specific last). Raises ValueError when none is there.
    """
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f'{path}: expected a mapping of node names, got {type(data).__name__}')
    params: dict[str, Any] = {}
    found = False
    for key in ('/**', f'/**/{node_name}', f'/{node_name}', node_name):
        section = data.get(key)
        if isinstance(section, dict) and isinstance(section.get('ros__parameters'), dict):
            params.update(flatten_params(section['ros__parameters']))
            found = True
    if not found:
        raise ValueError(f'{path}: no "{node_name}: ros__parameters:" section '
                         f'(found keys {sorted(data)})')
    return params
