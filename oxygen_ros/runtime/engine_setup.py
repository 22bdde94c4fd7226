"""Build the engine (model + frontend + scheduler) from Settings; what the node and the replay run.

Kept free of ROS so the tests and the bag replay build exactly the engine the node runs and
feed it the same observations.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
import time
from typing import Callable, Sequence

import numpy as np
import torch

from oxygen_ros.engine import (AdaptiveBudget, Budget, Engine as EngineView, FixedBudget,
                               FleetRobot, Frontend, identity_norm_stats, LanguagePolicy,
                               LanguageTask, make_fleet, random_observation, random_setup)
from oxygen_ros.engine.fleet import (forced_token_room, num_blocks_for, ONE_ROBOT,
                                     pool_block_bytes, pool_slot_bytes)
from oxygen_ros.engine.hardware import choose_dtype
from oxygen_ros.engine.workload import answer_tokens
from oxygen_ros.engine.prepare import (CompilePlan, prepare_model, runner_options, seal,
                                       sealed, warm_up)
from oxygen_ros.model.checkpoint import (CheckpointError, checkpoint_config, CONFIG_FILE,
                                         load_pi05)
from oxygen_ros.model.config import get_preset
from oxygen_ros.model.pi05 import extend_bucket
from oxygen_ros.model.robot_spec import (check_fits_model, check_norm_stats, get_robot,
                                         RobotSpec, RobotSpecError)
from oxygen_ros.model.tokenizer import PaligemmaTokenizer
from oxygen_ros.runtime.allocator import keep_freed_memory
from oxygen_ros.runtime.capacity import (AUTO_SHARE, Capacity, capacity_from,
                                         question_reserve, resolve_rate, steady_batch,
                                         steady_frame, time_call, time_ticks, TIMED_FRAMES)
from oxygen_ros.runtime.params import FleetSettings, Settings
from oxygen_ros.runtime.procfs import meminfo_kb
from oxygen_ros.runtime.questions import ASK, ASK_TOPIC, MAX_OPEN_QUESTIONS
from oxygen_ros.runtime.rtc import planner_for

logger = logging.getLogger(__name__)

# Robots due in the same tick denoise together: a fleet's denoise runs batches of 1 and of
# several rows (one compiled graph each).
FLEET_ACTION_ROWS = (1, 2)


def action_rows(robots: int) -> tuple[int, ...]:
    """Return the denoise batch sizes to warm up for a fleet of `robots` (one robot: 1 row)."""
    return FLEET_ACTION_ROWS if robots > 1 else (1,)


class EngineSetupError(RuntimeError):
    """The engine could not be built; str(err) says what to fix."""


# Everything build_engine raises for a bad setting or file (its message names the culprit).
SETUP_ERRORS = (EngineSetupError, CheckpointError, FileNotFoundError, ValueError)


@dataclasses.dataclass
class Engine:
    """One engine instance and what the node reports about it."""

    system: object                 # the FleetEngine (build_fleet), or the System view of a
    #                                one-robot fleet (build_engine)
    frontend: Frontend | None      # the robot's (None for a fleet: each robot has its own)
    description: dict              # for diagnostics: source, preset, device, dtype, ...
    warnings: list[str]            # things that work but deserve a look (e.g. tiny tokenizer)
    settings: Settings | FleetSettings | None = None   # what it was built from, with the
    #                                control rates resolved (auto: from `capacity`)
    capacity: Capacity | None = None   # the rate this machine holds (None: not timed)
    auto: tuple[str, ...] = ()     # robots whose rate is auto (control_rate_hz 0): a node
    #                                re-times them on its first ticks (capacity.RateSettler)


def inference_threads(torch_threads: int) -> int:
    """Torch threads for inference: the parameter, or 0 -> every core but one.

    Measured on a 2-core machine with the node driven by a camera process (bench --parts
    node, pi05-cpu): 2 threads gave inference 1.66x the engine alone with 100% deadline misses
    (an OpenMP team loses whole barriers whenever the executor, DDS or the cameras take one of
    its cores); 1 thread gave 1.01x and held the rate. One core stays for everything else.
    """
    if torch_threads:
        return torch_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _dtype(name: str) -> torch.dtype:
    return {'float32': torch.float32, 'bfloat16': torch.bfloat16}[name]


def resolve_dtype(settings: Settings, config) -> tuple[torch.dtype, str]:
    """Return the compute dtype to build `config` in, and why: the parameter, or probed."""
    if settings.dtype != 'auto':
        return _dtype(settings.dtype), 'set by parameter dtype'
    return choose_dtype(config, settings.device)


def _model_config(settings: Settings):
    """Return the Pi05Config the settings load (checkpoint's config.json or the preset)."""
    if settings.checkpoint:
        path = Path(settings.checkpoint).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f'checkpoint folder {path} does not exist')
        try:
            config = checkpoint_config(path)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise EngineSetupError(
                f'checkpoint {path}: cannot read {CONFIG_FILE}: {err}') from None
    else:
        config = get_preset(settings.preset)
    if settings.denoise_steps:
        config = config.replace(num_steps=settings.denoise_steps)
    return config


def _check_device(device: str) -> None:
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise EngineSetupError(f"device {device!r}: CUDA is not available to this torch "
                               f"({torch.__version__}); use device 'cpu'")


def tasks_for(settings: Settings, eos_id: int) -> tuple[LanguageTask, ...]:
    """Build the language tasks the node's parameters describe (language_tasks, tasks.*).

    Questions (ask_tokens > 0) are one more task, on demand (runtime/questions.py).
    """
    tasks = tuple(
        LanguageTask(task.name, LanguagePolicy(
            max_new_tokens=task.tokens, every_n_frames=task.every_n_frames, seed=settings.seed,
            eos_id=eos_id, prompt_template=task.prompt), priority=task.priority,
            topic=task.token_topic, drives_actions=task.drives_actions,
            max_age_s=settings.subtask_max_age_s)
        for task in settings.tasks)
    if settings.ask_tokens:
        tasks += (LanguageTask(ASK, LanguagePolicy(
            max_new_tokens=settings.ask_tokens, every_n_frames=0, eos_id=eos_id,
            prompt_template=settings.ask_prompt, max_queue=MAX_OPEN_QUESTIONS),
            priority=settings.ask_priority, topic=ASK_TOPIC, on_demand=True),)
    return tasks


def robot_spec(settings: Settings) -> RobotSpec:
    """Return the spec of the robot the settings name (resolved by Settings.check)."""
    return settings.spec if settings.spec is not None else get_robot(settings.robot)


def _frontend(config, spec: RobotSpec, tokenizer, norm_stats, device) -> Frontend:
    """Build a robot's frontend; a spec that does not fit the model is a one-line error."""
    try:
        check_fits_model(spec, config.action_dim, config.num_cameras)
        check_norm_stats(spec, norm_stats, config.action_dim)
    except RobotSpecError as err:
        raise EngineSetupError(str(err)) from None
    return Frontend.from_config(config, spec, tokenizer, norm_stats, device)


def _check_fits(settings: Settings, config) -> None:
    """Refuse a robot that does not fit the model before any weight is built or read."""
    try:
        check_fits_model(robot_spec(settings), config.action_dim, config.num_cameras)
    except RobotSpecError as err:
        raise EngineSetupError(str(err)) from None


def _random_weights(settings: Settings, device: str, dtype: torch.dtype, config):
    spec = robot_spec(settings)
    model, frontend = random_setup(config, spec, seed=settings.seed, device=device,
                                   dtype=dtype)
    warnings = []
    tokenizer = frontend.tokenizer
    if settings.tokenizer:
        tokenizer = PaligemmaTokenizer(settings.tokenizer, max_len=config.max_token_len)
    else:
        warnings.append('random weights with the tiny offline tokenizer: narration is noise')

    def make_frontend(spec: RobotSpec) -> Frontend:
        return _frontend(config, spec, tokenizer, identity_norm_stats(spec), device)
    return model, make_frontend, {'source': f'random weights (preset {settings.preset}, '
                                            f'seed {settings.seed})'}, warnings


def _checkpoint(settings: Settings, device: str, dtype: torch.dtype, config):
    path = Path(settings.checkpoint).expanduser()
    # config.json's own config unless something in it was overridden (denoise steps)
    loaded = load_pi05(path, config=config if settings.denoise_steps else None, device=device,
                       dtype=dtype)
    stats = loaded.norm_stats

    def norm_stats_of(spec: RobotSpec):
        # A LeRobot folder has one set of statistics (its processor files), whatever the key.
        if loaded.layout == 'lerobot':
            return next(iter(stats.items()))
        if spec.asset_id in stats:
            return spec.asset_id, stats[spec.asset_id]
        raise EngineSetupError(
            f'{spec.where}: norm_stats: {spec.asset_id!r} is not in checkpoint {path}; expected '
            f'one of {sorted(stats) or "none"} (assets/<key>/norm_stats.json)')
    warnings = []
    if settings.tokenizer:
        tokenizer_path = Path(settings.tokenizer).expanduser()
    elif loaded.tokenizer_path is not None:
        tokenizer_path = loaded.tokenizer_path
    else:
        raise EngineSetupError(f'checkpoint {path}: {loaded.tokenizer_note}, and parameter '
                               "'tokenizer' is empty: give the PaliGemma SentencePiece model "
                               '(tokenizer.model)')
    tokenizer = PaligemmaTokenizer(tokenizer_path, max_len=loaded.config.max_token_len)

    description = {'source': f'{loaded.layout} checkpoint {path}', 'norm_stats': '',
                   'tokenizer': str(tokenizer_path)}

    def make_frontend(spec: RobotSpec) -> Frontend:
        key, robot_stats = norm_stats_of(spec)
        try:
            check_norm_stats(spec, robot_stats, loaded.config.action_dim,
                             f'assets/{key}' if loaded.layout == 'openpi' else str(path))
        except RobotSpecError as err:
            raise EngineSetupError(str(err)) from None
        used = [k for k in description['norm_stats'].split(', ') if k]
        description['norm_stats'] = ', '.join(dict.fromkeys([*used, key]))
        return _frontend(loaded.config, spec, tokenizer, robot_stats, device)
    return loaded.model, make_frontend, description, warnings


def describe_robot(spec: RobotSpec) -> dict:
    """Return what the diagnostics say about a robot: its spec's name, file and layout."""
    return {'robot': spec.name, 'robot_spec': spec.source or 'inferred',
            'cameras': ', '.join(f'{cam} ({slot})' for cam, slot in spec.cameras),
            'state_dim': spec.state_dim,
            'actions': f'{spec.action_dim} {spec.action_space} at {1 / spec.step_period_s:g} Hz'}


def available_memory_bytes(device: str) -> int | None:
    """Memory a new allocation on `device` can use now (None when unknown)."""
    if device.startswith('cuda'):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    available_kb = meminfo_kb('MemAvailable')
    return None if available_kb is None else available_kb * 1024


def check_pool_fits(settings: Settings, config, tasks: Sequence[LanguageTask],
                    dtype: torch.dtype) -> None:
    """Refuse an explicit kv_capacity whose pool would take more than half the free memory.

    A parameter set over DDS (kv_capacity=1024 of a large model) must fail configure with a
    reason, not take the robot computer out of memory.
    """
    if not settings.kv_capacity:
        return
    blocks = num_blocks_for(tasks, settings.decode_budget or 1, settings.kv_capacity)
    per_slot = pool_slot_bytes(config, dtype) + pool_block_bytes(config, tasks, dtype)
    need = (settings.kv_capacity * pool_slot_bytes(config, dtype)
            + blocks * pool_block_bytes(config, tasks, dtype))
    free = available_memory_bytes(settings.device)
    if free is not None and need > free // 2:
        raise EngineSetupError(
            f'kv_capacity {settings.kv_capacity} needs {need / 2**30:.2f} GiB of KV cache, more '
            f'than half the free memory of {settings.device} ({free / 2**30:.2f} GiB): use '
            f'kv_capacity 0 (sized from N and k) or at most {max(free // 2 // per_slot, 1)}')


def _timing_label(settings: Settings) -> str:
    if settings.checkpoint:
        return f'checkpoint {Path(settings.checkpoint).expanduser().name}'
    return f'preset {settings.preset}'


def _k_min(settings: Settings) -> int:
    """Return the fewest steps per request per frame its budget stands for (budget_for)."""
    return settings.decode_budget or 1


def _steady_batch(settings: Settings) -> int:
    return steady_batch(settings.tokens_per_request, _k_min(settings),
                        settings.request_every_n_frames,
                        settings.kv_capacity - 1 if settings.kv_capacity else None)


def time_capacity(model, frontend: Frontend, settings: Settings,
                  clock: Callable[[], float] = time.perf_counter,
                  plan: CompilePlan | None = None) -> Capacity:
    """Time one robot's frames on a throwaway engine: what rate this machine holds.

    Also the warm-up: the first torch calls allocate and pick kernels (CUDA: initialise the
    context) here, not in the control loop, and the node's scheduler is untouched, so frame
    and request numbering start at 0. See runtime/capacity.py for what is timed.
    plan: the model's compiled passes (prepare_model), compiled here before any frame is
    timed and sealed while the frames are timed, so they run what the node will run.
    """
    return time_fleet_capacity(model, {settings.robot: frontend}, FleetSettings.one(settings),
                               clock=clock, plan=plan)


def row_threads(device: str, robots: int, threads: int) -> int:
    """Return the row threads of a fleet (FleetEngine row_threads, the torch threads divided).

    On a CPU with at least two torch threads, the robots' rows side by side, one per thread
    at most (what R processes would get from their cores); one batched call elsewhere. On a
    2-core robot computer (one inference thread) that is 1.
    """
    return min(robots, threads) if device == 'cpu' and robots > 1 else 1


def longest_prompt(robots: Sequence[FleetRobot], system) -> int:
    """Return the longest prompt a request of `robots` feeds in one extend pass (0: none)."""
    return min(forced_token_room([t for r in robots for t in r.tasks]),
               system.runner.store.max_gen_len)


def prompt_rows(robots: Sequence[FleetRobot]) -> tuple[int, ...]:
    """Return the rows an extend pass of `robots` may have: (1,), or (1, 2) for several.

    A tick runs each priority level's new requests' first steps in turn (scheduler.py), so a
    pass has one row unless two templated tasks share a level or several robots start theirs
    together; the graph of several rows costs ~5 s of every configure (dynamo traces it).
    """
    if len(robots) > 1:
        return (1, 2)
    levels = [t.priority for t in robots[0].tasks if t.policy.prompt_template or t.on_demand]
    return (1, 2) if len(set(levels)) < len(levels) else (1,)


def time_fleet_capacity(model, frontends: dict[str, Frontend], fleet: FleetSettings,
                        max_prefill_rows: int | None = 1, *, rows: int = 1,
                        clock: Callable[[], float] = time.perf_counter,
                        plan: CompilePlan | None = None) -> Capacity:
    """Time ticks of a throwaway fleet in which every robot sends a frame (time_capacity).

    frontends: robot type -> its frontend; rows: its row threads (as the node's fleet); plan:
    the model's compiled passes, compiled before and sealed while the frames are timed.
    """
    node = fleet.node
    robots = [FleetRobot(name, frontends[s.robot], tasks_for(s, frontends[s.robot].eos_id),
                         FixedBudget(_k_min(s)), seed=s.seed,
                         kv_quota=max(TIMED_FRAMES, _steady_batch(s)) + 3)
              for name, s in fleet.robots.items()]
    options = runner_options(plan, node.device) if plan else {}
    system = make_fleet(model, robots, kv_dtype=_kv_dtype(node, model),
                        max_prefill_rows=max_prefill_rows, row_threads=rows, clock=clock,
                        **options)
    image_size = model.config.vision.image_size
    tokens = longest_prompt(robots, system)
    if plan:
        warm_up(system.runner, plan, [warm_up_frame(frontends[s.robot], s, image_size)
                                      for s in fleet.robots.values()],
                action_rows(len(fleet.robots)), tokens, prompt_rows(robots))

    planners = {name: planner_for(s) for name, s in fleet.robots.items()}
    chunks: dict[str, np.ndarray] = {}   # robot -> its last chunk [H, A]

    def tick(index: int) -> tuple[float, float, int]:
        # With rtc_mode on, every frame continues the robot's last chunk (guided steps cost
        # about twice a plain denoise), so an auto rate holds with the mode the node runs.
        continuations = {name: cont for name, rows in chunks.items()
                         if (cont := planners[name].continue_rows(rows[1:], delay=1))}
        act = system.act({name: random_observation(frontends[s.robot].adapter.spec, index,
                                                   s.seed, image_size=image_size)
                          for name, s in fleet.robots.items()}, continuations)
        chunks.update((name, out.actions) for name, out in act.actions.items())
        result = system.advance_language()
        return act.act_s, result.timings.total_s, result.decode_batch_size
    batch = sum(_steady_batch(s) for s in fleet.robots.values())
    steady_from = max(steady_frame(s.tokens_per_request, _k_min(s), s.request_every_n_frames)
                      for s in fleet.robots.values())
    label = _timing_label(node)
    if len(robots) > 1:
        label += f' with {len(robots)} robots ticking together'
    try:
        with sealed(model):   # the timed frames run the compiled passes, never a compile
            timed = time_ticks(tick, steady_from=steady_from, clock=clock)
            # Into block 0 of this throwaway engine, on slot 0's prefix of a timed frame.
            runner = system.runner
            extend = None
            if tokens >= 2:   # priced at the tokens the runner pads the prompt to
                extend = (extend_bucket(tokens), time_call(
                    lambda: runner.extend([0], [0], [0], [[2] * tokens]), clock=clock))
            ask_s = 0.0
            # One question at a time (its steps: one row), the robots' longest answer.
            if answer := answer_tokens([t for r in robots for t in r.tasks]):
                gen_len = min(tokens, runner.store.max_gen_len - 1)
                ask_s = question_reserve(extend[1] if extend else 0.0, time_call(
                    lambda: runner.decode([0], [0], [gen_len], [2]), clock=clock), answer)
        return capacity_from(timed, batch, label, extend, steady_from, ask_s)
    finally:
        system.close()


def with_rate(settings: Settings, capacity: Capacity | None) -> Settings:
    """Return `settings` with control_rate_hz resolved (0, auto: the capacity's auto rate)."""
    rate = resolve_rate(settings.control_rate_hz, capacity)
    return settings if rate == settings.control_rate_hz else dataclasses.replace(
        settings, control_rate_hz=rate)


def _rate_description(settings: Settings, asked_hz: float, capacity: Capacity | None) -> dict:
    about = {'control_rate_hz': settings.control_rate_hz,
             'control_rate': ('auto: {:g}% of capacity'.format(100 * AUTO_SHARE)
                              if not asked_hz else 'given')}
    if capacity is not None:
        about.update(capacity.values())
        about['capacity'] = capacity.describe(settings.control_rate_hz)
    return about


def warm_up_frame(frontend: Frontend, settings: Settings, image_size: int) -> dict:
    """Prepare a synthetic frame of the robot (its cameras, a prompt): tensors."""
    obs = random_observation(frontend.adapter.spec, 0, settings.seed, image_size=image_size)
    return frontend.prepare(obs).tensors


def load_model(settings: Settings):
    """Load weights (checkpoint or random preset) once.

    Returns (model, make_frontend(robot), description, warnings); make_frontend builds a robot
    type's frontend over that model.

    Raises EngineSetupError (or CheckpointError / FileNotFoundError) naming the culprit.
    """
    _check_device(settings.device)
    logger.info('%s', keep_freed_memory())   # before the first frame's activations
    # Process-wide: threads that start torch work later (the control thread) use it too.
    torch.set_num_threads(inference_threads(settings.torch_threads))
    try:
        config = _model_config(settings)
        _check_fits(settings, config)
        dtype, why = resolve_dtype(settings, config)
        logger.info('dtype %s: %s', str(dtype).removeprefix('torch.'), why)
        if settings.checkpoint:
            loaded = _checkpoint(settings, settings.device, dtype, config)
        else:
            loaded = _random_weights(settings, settings.device, dtype, config)
        loaded[2]['dtype_reason'] = why
        return loaded
    except (CheckpointError, FileNotFoundError, EngineSetupError):
        raise
    except (ValueError, OSError, RuntimeError) as err:
        # Loader errors (bad safetensors header, tokenizer/vocab mismatch, ...) carry their own
        # reason; say which step failed.
        raise EngineSetupError(f'loading the model failed: {err}') from err


def _kv_dtype(settings: Settings, model) -> torch.dtype:
    return model.compute_dtype if settings.kv_dtype == 'auto' else _dtype(settings.kv_dtype)


def _describe(description: dict, settings: Settings, model, kv_slots: int,
              first: dict, last: dict, plan: CompilePlan, started: float) -> dict:
    config = model.config
    description.update(first)
    description.update({
        'device': settings.device, 'dtype': str(model.compute_dtype).removeprefix('torch.'),
        'kv_dtype': str(_kv_dtype(settings, model)).removeprefix('torch.'),
        'torch_threads': torch.get_num_threads(), 'compile': plan.describe(),
        'compile_s': round(plan.seconds, 2),
        'configure_s': round(time.perf_counter() - started, 2),
        'prefix_len': config.prefix_len, 'horizon': config.action_horizon,
        'denoise_steps': config.num_steps, **last, 'kv_slots': kv_slots,
    })
    logger.info('engine ready in %.1f s (%s, %s; %s)', description['configure_s'],
                description['dtype'], settings.device, description['compile'])
    return description


def build_engine(settings: Settings, warmup: bool = True) -> Engine:
    """Load weights and build one robot's engine: a fleet of one, as its System view.

    Raises EngineSetupError (or CheckpointError / FileNotFoundError / ValueError from the
    loaders) with a message that names the file or parameter at fault.
    """
    engine = build_fleet(FleetSettings.one(settings), warmup)
    return dataclasses.replace(engine, system=EngineView.view(engine.system, ONE_ROBOT),
                               settings=engine.settings.robots[ONE_ROBOT])


def budget_for(settings: Settings, capacity: Capacity | None = None) -> Budget:
    """Return the decode budget a robot's settings ask for: fixed k, or adaptive to its period.

    capacity: what configure timed; its extend pass is the adaptive budget's first estimate of
    one (a question's template in one pass).
    """
    k = settings.decode_budget
    if k is not None:
        return FixedBudget(k)
    return AdaptiveBudget(settings.period_s, k_max=settings.tokens_per_request,
                          prior_extend=capacity.extend if capacity is not None else None)


def build_fleet(fleet: FleetSettings, warmup: bool = True) -> Engine:
    """Load the model once and build the FleetEngine serving every robot of `fleet`.

    One robot (FleetSettings.one) or several: each robot gets its own frontend (its robot
    type), language policy, decode budget, noise seed and KV quota (its kv_capacity; 0 = sized
    from its N, k and request rate). Prefill runs one row per call on the CPU (a
    compute-bound CPU gains nothing from rows of one prefill, and each row costs
    activations), all rows in one call on an accelerator. warmup: time the machine (the
    capacity; always when a rate is auto). Raises as build_engine does; a fleet robot's
    problem names the robot.
    """
    node = fleet.node
    one = fleet.is_one
    started = time.perf_counter()
    model, make_frontend, description, warnings = load_model(node)
    frontends, policies = {}, {}
    kv_dtype = _kv_dtype(node, model)
    for name, settings in fleet.robots.items():
        who = '' if one else f'robot {name}: '
        try:
            if settings.robot not in frontends:
                frontends[settings.robot] = make_frontend(robot_spec(settings))
        except EngineSetupError as err:
            if one:
                raise
            raise EngineSetupError(f'{who}{err}') from err
        except ValueError as err:
            raise EngineSetupError(f'{who or "loading the model failed: "}{err}') from err
        policies[name] = tasks_for(settings, frontends[settings.robot].eos_id)
        try:
            check_pool_fits(settings, model.config, policies[name], kv_dtype)
        except EngineSetupError as err:
            if one:
                raise
            raise EngineSetupError(f'{name}.{err}') from None
    max_prefill_rows = 1 if node.device == 'cpu' else None
    rows = row_threads(node.device, len(fleet.robots), torch.get_num_threads())
    torch.set_num_threads(max(1, torch.get_num_threads() // rows))   # divided among the rows
    plan = prepare_model(model, node.device, node.compile, row_threads=rows)
    frames = [warm_up_frame(frontends[s.robot], s, model.config.vision.image_size)
              for s in fleet.robots.values()]
    auto = [name for name, s in fleet.robots.items() if not s.control_rate_hz]
    capacity = (time_fleet_capacity(model, frontends, fleet, max_prefill_rows, rows=rows,
                                    plan=plan)
                if warmup or auto else None)
    asked = {name: s.control_rate_hz for name, s in fleet.robots.items()}
    fleet = dataclasses.replace(
        fleet, node=with_rate(node, capacity),
        robots={name: with_rate(s, capacity) for name, s in fleet.robots.items()})
    robots = [FleetRobot(name, frontends[s.robot], policies[name], budget_for(s, capacity),
                         kv_quota=s.kv_capacity or None, seed=s.seed)
              for name, s in fleet.robots.items()]
    system = make_fleet(model, robots, kv_dtype=kv_dtype, max_prefill_rows=max_prefill_rows,
                        row_threads=rows, **runner_options(plan, node.device))
    if warmup:
        warm_up(system.runner, plan, frames, action_rows(len(fleet.robots)),
                longest_prompt(robots, system), prompt_rows(robots))
        seal(model, plan)
    if one:
        settings = fleet.robots[ONE_ROBOT]
        about = {'tokens_per_request': settings.tokens_per_request,
                 **_rate_description(settings, asked[ONE_ROBOT], capacity)}
        first = describe_robot(frontends[settings.robot].adapter.spec)
    else:
        about = {'robot_rates_hz': ', '.join(f'{name} {s.control_rate_hz:.3g}'
                                             + (' (auto)' if name in auto else '')
                                             for name, s in fleet.robots.items())}
        if capacity is not None:
            about.update(capacity.values(), capacity=capacity.describe(
                max(s.control_rate_hz for s in fleet.robots.values())))
        first = {'robots': ', '.join(f'{name} ({s.robot})' for name, s in fleet.robots.items()),
                 'row_threads': rows}
    _describe(description, fleet.node, model, system.pool.num_slots, first, about, plan,
              started)
    frontend = frontends[fleet.robots[ONE_ROBOT].robot] if one else None
    return Engine(system, frontend, description, warnings, fleet, capacity, tuple(auto))
